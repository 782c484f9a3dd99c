"""Prompts with images on the generation engine (tiny random models, float32): a batch of image prompts of
different lengths and image counts (and a text prompt among them), greedy, gives each prompt transformers'
generate tokens for that prompt alone and the engine's tokens for that prompt run alone. Qwen2.5-VL (M-RoPE,
decoding at rope_deltas) with more sequences than rows and a short decode chunk, so a prompt with images is
admitted while the others decode (continuous batching), and prompts alone compile the vision tower and embedding
once per (length, patch) bucket, and generate streams a text row beside an image row step by step; Gemma 3 with
token_type_ids' bidirectional image blocks."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests import vl_models  # noqa: E402
from tests import vl_qwen_models as qm  # noqa: E402
from tests.test_vision_generate import checkpoint as gemma_checkpoint  # noqa: E402,F401
from tests.test_vision_qwen_generate import _image, _left_padded  # noqa: E402

pytestmark = pytest.mark.torch


def _hf_greedy(hf, ids: list[int], new: int, **images) -> list[int]:
    kw = {k: torch.tensor(np.asarray(v)) for k, v in images.items()}
    row = torch.tensor([ids])
    with torch.no_grad():
        out = hf.generate(input_ids=row, attention_mask=torch.ones_like(row), **kw, max_new_tokens=new,
                          min_new_tokens=new, do_sample=False)
    return out[0, len(ids):].tolist()


def test_qwen_image_prompts_batch_as_alone_and_as_transformers(tmp_path):
    from unsloth_jax import FastVisionModel
    from unsloth_jax.data.vision_loader import patch_bucket
    from unsloth_jax.inference import runner
    from unsloth_jax.inference.engine import Engine, ImageInputs, SamplingParams, bucket

    hf = qm.hf_qwen_vl()
    hf.save_pretrained(tmp_path)
    model, _ = FastVisionModel.from_pretrained(tmp_path, dtype="float32", load_processor=False)
    rng = np.random.default_rng(0)
    text = lambda n: rng.integers(3, 240, n).tolist()  # noqa: E731
    grids = [[], [[1, 4, 4]], [[1, 4, 8], [1, 6, 4]], [[1, 4, 4], [1, 4, 8], [1, 4, 4]], [[1, 8, 4]]]
    max_tokens = [6, 12, 4, 9, 7]
    prompts = []
    for k, prompt_grids in enumerate(grids):
        ids = text(2 + k)
        for g in prompt_grids:
            ids += _image(qm.image_tokens(g)) + text(1 + k % 3)
        if not prompt_grids:
            prompts.append(ids)
            continue
        grid = np.asarray(prompt_grids)
        pixels = rng.standard_normal((int(grid.prod(-1).sum()), qm.PATCH_DIM)).astype(np.float32)
        prompts.append({"prompt_token_ids": ids, "images": ImageInputs(pixels, image_grid_thw=grid)})
    params = [SamplingParams(n=2, temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]

    # 10 sequences on 8 rows, 2 decode steps per chunk: prompt 4 waits for prompt 2's rows, then is prefilled
    # while prompts 0, 1 and 3 are still decoding
    engine = Engine(model, chunk=2, max_rows=8)
    calls = []
    outs = engine.generate(prompts, params, on_tokens=lambda news: calls.append({r for r, _ in news}))
    assert any(4 in c and c - {4} for c in calls), calls

    # alone (one prompt per prefill), the image prompts' embeddings compile at most once per (length, patch) bucket:
    # the 4 image prompts (4 sets of grids, 16 to 64 patches, 11 to 30 tokens) fall in 2
    seen = set()
    for k, (prompt, out, m) in enumerate(zip(prompts, outs, max_tokens)):
        ids = prompt if isinstance(prompt, list) else prompt["prompt_token_ids"]
        images = {} if isinstance(prompt, list) else dict(  # transformers' M-RoPE reads the image tokens' types
            pixel_values=prompt["images"].pixel_values, image_grid_thw=prompt["images"].image_grid_thw,
            mm_token_type_ids=[[int(t == qm.IMAGE) for t in ids]])
        theirs = _hf_greedy(hf, ids, m, **images)
        compiles = runner.image_embeddings.jitted._cache_size()
        alone = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True))
        if isinstance(prompt, dict):
            key = (bucket(len(ids), 16), patch_bucket(len(prompt["images"].pixel_values), 4))
            assert key not in seen or runner.image_embeddings.jitted._cache_size() == compiles, key
            seen.add(key)
        print(k, "engine", out.outputs[0].token_ids, "transformers", theirs)
        assert [o.token_ids for o in out.outputs] == [theirs, theirs], k
        assert alone[0].outputs[0].token_ids == theirs, k
    assert len({tuple(o.outputs[0].token_ids[:4]) for o in outs}) == len(outs)  # the prompts' tokens differ
    assert len(seen) == 2, seen

    # generate with a text row beside an image row: both are prefilled in one admission (two batches), and the
    # streamer sees one step per token, the first tokens of both rows together
    ids, mask = _left_padded([prompts[1]["prompt_token_ids"], prompts[0]])
    steps = []
    both = model.generate(ids, mask, pixel_values=prompts[1]["images"].pixel_values,
                          image_grid_thw=prompts[1]["images"].image_grid_thw, max_new_tokens=6, eos_token_id=[],
                          streamer=steps.append)
    np.testing.assert_array_equal(np.stack(steps, axis=1), both[:, ids.shape[1]:])
    assert both[0, ids.shape[1]:].tolist() == outs[1].outputs[0].token_ids[:6]
    assert both[1, ids.shape[1]:].tolist() == outs[0].outputs[0].token_ids[:6]


def test_gemma_image_prompts_batch_as_alone_and_as_transformers(gemma_checkpoint):  # noqa: F811
    from unsloth_jax import FastVisionModel
    from unsloth_jax.inference.engine import ImageInputs, SamplingParams
    from unsloth_jax.generation import engine_for

    path, hf = gemma_checkpoint
    model, processor = FastVisionModel.from_pretrained(path, dtype="float32")
    records = vl_models.shapes_dataset(4)
    images = [[records[0]["images"][0]], [records[1]["images"][0], records[2]["images"][0]],
              [records[3]["images"][0]]]
    asks = ["What colour is the square?", "Which of the two squares is brighter, and why?", "Colour?"]
    prompts, hf_inputs = [], []
    for ask, imgs in zip(asks, images):
        content = [{"type": "image"}] * len(imgs) + [{"type": "text", "text": ask}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        out = dict(processor(text=[text], images=[imgs], return_tensors="np"))
        ids = out["input_ids"][0].tolist()
        assert sum(t == vl_models.IMAGE for t in ids) == vl_models.MM_TOKENS * len(imgs)
        prompts.append({"prompt_token_ids": ids, "images": ImageInputs(out["pixel_values"],
                                                                        token_type_ids=out["token_type_ids"][0])})
        hf_inputs.append(dict(pixel_values=out["pixel_values"], token_type_ids=out["token_type_ids"]))
    assert len({len(p["prompt_token_ids"]) for p in prompts}) == 3
    new = 8
    engine = engine_for(model)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    outs = engine.generate(prompts, params)
    for k, (prompt, out) in enumerate(zip(prompts, outs)):
        theirs = _hf_greedy(hf, prompt["prompt_token_ids"], new, **hf_inputs[k])
        alone = engine.generate([prompt], params)[0].outputs[0].token_ids
        print(k, "engine", out.outputs[0].token_ids, "transformers", theirs)
        assert out.outputs[0].token_ids == theirs and alone == theirs, k


def test_image_requests_are_checked(gemma_checkpoint):  # noqa: F811
    from unsloth_jax import FastVisionModel
    from unsloth_jax.inference.engine import ImageInputs
    from unsloth_jax.generation import engine_for

    model, _ = FastVisionModel.from_pretrained(gemma_checkpoint[0], dtype="float32", load_processor=False)
    engine = engine_for(model)
    ids = [1, 5, vl_models.BOI] + [vl_models.IMAGE] * vl_models.MM_TOKENS + [vl_models.EOI, 7]
    pixels = np.zeros((1, 3, 32, 32), np.float32)
    cases = [
        ({"prompt_token_ids": ids, "images": pixels}, TypeError, r"prompts\[0\]\['images'\] must be an ImageInputs"),
        ({"prompt": "hi", "images": ImageInputs(pixels)}, ValueError, "needs 'prompt_token_ids'"),
        ({"prompt_token_ids": ids, "images": ImageInputs(np.zeros((2, 3, 32, 32), np.float32))}, ValueError,
         r"prompts\[0\]: the prompt holds 4 image tokens, but its 2 images need 8"),
        ({"prompt_token_ids": ids, "images": ImageInputs(pixels, token_type_ids=np.zeros(3))}, ValueError,
         "token_type_ids has shape"),
        ({"prompt_token_ids": ids, "images": ImageInputs(pixels, image_grid_thw=np.ones((1, 3)))}, ValueError,
         "image_grid_thw is Qwen2.5-VL's"),
    ]
    for prompt, error, message in cases:
        with pytest.raises(error, match=message):
            engine.generate([prompt])
