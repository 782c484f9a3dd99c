"""GRPO with images (TRL's vision-language GRPO datasets) and fast_generate of vision-language models, on the tiny
random Gemma 3 (tests/vl_models.py) and Qwen2.5-VL (tests/vl_qwen_models.py), float32, CPU:

- the scorer's policy and reference per-token log-probabilities of completions after prompts with images equal
  transformers + PEFT's log-softmax of the logits with the same images (adapter on / off), both families;
- rows without their images, with the wrong number, or not conversational are refused by row;
- fast_generate (chats with images, engine requests) greedy equals generate;
- examples/grpo_vision.py (bundled tiny Gemma 3, shapes pictures) raises its reward (tests/test_grpo.py's way).
"""
from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from tests import vl_models  # noqa: E402
from tests import vl_qwen_models as qm  # noqa: E402
from tests.helpers import rel_err  # noqa: E402
from tests.test_vision_sft import _randomise_lora  # noqa: E402

pytestmark = pytest.mark.torch
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", params=["gemma3", "qwen2_5_vl"])
def family(request, tmp_path_factory):
    """(name, transformers model, our model with LoRA on both towers, processor)."""
    from unsloth_jax import FastVisionModel

    path = tmp_path_factory.mktemp(request.param)
    if request.param == "gemma3":
        hf, processor = vl_models.hf_gemma3(), vl_models.processor()
        with torch.no_grad():  # varied greedy tokens (test_vision_generate's checkpoint)
            hf.model.language_model.embed_tokens.weight.mul_(0.2)
    else:
        hf, processor = qm.hf_qwen_vl(processor_vocab=True), qm.processor()
    hf.save_pretrained(path)
    model, _ = FastVisionModel.from_pretrained(path, dtype="float32", load_processor=False)
    model = FastVisionModel.get_peft_model(model, r=4, lora_alpha=8, finetune_vision_layers=True,
                                           use_gradient_checkpointing=False)
    return request.param, hf, model, processor


def _rows(n: int, seed: int = 0) -> list[dict]:
    """TRL's vision GRPO rows: a conversational prompt with an image part, the picture in "images", a column."""
    return [{"prompt": [r["messages"][0]], "images": r["images"], "level": i}
            for i, r in enumerate(vl_models.shapes_dataset(n, seed))]


class _InOrder:
    """An rng whose permutation keeps the order (build_batch's shuffle, undone for the comparison)."""

    def permutation(self, n):
        return np.arange(n)


def _hf_logps(hf, ids, images, name, temperature):
    """transformers' log_softmax(logits / temperature) of ids[1:] for one unpadded row with its images."""
    kw = dict(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    if images is not None:
        kw["pixel_values"] = torch.tensor(np.asarray(images.pixel_values))
        if name == "gemma3":
            kw["token_type_ids"] = torch.tensor(np.asarray(images.token_type_ids)[None]).long()
        else:
            kw["image_grid_thw"] = torch.tensor(np.asarray(images.image_grid_thw))
            kw["mm_token_type_ids"] = torch.tensor([[int(t == qm.P_IMAGE) for t in ids]])
    with torch.no_grad():
        logits = hf(**kw).logits.float()[0, :-1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].double().numpy()


def test_logps_with_images_equal_transformers_peft(family, tmp_path, rng):
    """Two prompts with one image each (one of them given as an "image" column, TRL's other spelling), two random
    completions each, LoRA random on both towers: the scorer's old (policy) and reference log-probabilities
    of the completion tokens equal transformers + PEFT's with the adapter enabled and disabled, to 1e-4; the
    images matter (zero pixels move them)."""
    import jax

    from unsloth_jax import GRPOConfig, GRPOTrainer
    from unsloth_jax.train import grpo as G

    name, hf, model, processor = family
    _randomise_lora(model, seed=3)
    rows = _rows(2)
    rows[1] = {"prompt": rows[1]["prompt"], "image": rows[1]["images"][0], "level": 1}
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=8, temperature=0.9, beta=0.04, num_iterations=2)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda prompts, completions, **kw: [0.0] * len(prompts),
                          args=args, train_dataset=rows, processing_class=processor)
    requests = [trainer._request(i) for i in range(2)]
    prompts = [r["prompt_token_ids"] for r in requests for _ in range(2)]
    images = [r["images"] for r in requests for _ in range(2)]
    completions = [rng.integers(4, 2000, int(rng.integers(2, 9))).tolist() for _ in range(4)]
    host = trainer.build_batch(prompts, completions, [False] * 4, np.zeros(4, np.float32), _InOrder(), images)
    graphdef, trainable, frozen, ref_trainable = trainer.split_state(need_reference=True)
    scorer = G.make_grpo_scorer(graphdef, args, want_old=True, want_ref=True)
    scores = jax.tree.map(np.asarray, scorer(trainable, frozen, ref_trainable, jax.device_put(host)))

    model.save_pretrained(tmp_path / "adapter")
    twin = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "adapter").eval()
    mask = host["completion_mask"].reshape(4, -1)[:, 1:] > 0
    for i in range(4):
        ids = prompts[i] + completions[i]
        policy = _hf_logps(twin, ids, images[i], name, 0.9)
        with twin.disable_adapter():
            base = _hf_logps(twin, ids, images[i], name, 0.9)
        m = mask[i, :len(ids) - 1]
        ours_old = scores["old_logps"].reshape(4, -1)[i, :len(ids) - 1][m]
        ours_ref = scores["ref_logps"].reshape(4, -1)[i, :len(ids) - 1][m]
        assert m.sum() == len(completions[i])
        assert rel_err(ours_old, policy[m]) < 1e-4, (i, ours_old, policy[m])
        assert rel_err(ours_ref, base[m]) < 1e-4, (i, ours_ref, base[m])
        assert rel_err(policy[m], base[m]) > 1e-3  # the adapter matters
    blank = dict(host, pixel_values=np.zeros_like(host["pixel_values"]))
    moved = np.asarray(scorer(trainable, frozen, ref_trainable, jax.device_put(blank))["old_logps"])
    assert np.abs((moved - scores["old_logps"]).reshape(4, -1)[mask]).max() > 1e-3  # the images matter


def test_rows_without_their_images_are_named(family, tmp_path):
    from unsloth_jax import FastLanguageModel, GRPOConfig, GRPOTrainer
    from unsloth_jax.errors import DatasetFormatError, TrainingError

    _, _, model, processor = family
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2)

    def make(rows, proc=processor, m=model):
        return GRPOTrainer(model=m, reward_funcs=lambda prompts, completions, **kw: [0.0] * len(prompts),
                           args=args, train_dataset=rows, processing_class=proc)

    rows = _rows(3)
    with pytest.raises(DatasetFormatError, match=r"train_dataset\[1\]: 1 image placeholder.*but 0 image"):
        make([rows[0], {**rows[1], "images": None}, rows[2]])
    with pytest.raises(DatasetFormatError, match=r"train_dataset\[2\]: 1 image placeholder.*but 2 image"):
        make([rows[0], rows[1], {**rows[2], "images": rows[2]["images"] * 2}])
    with pytest.raises(DatasetFormatError, match=r"train_dataset\[0\]: multimodal training needs a conversational"):
        make([{"prompt": "Describe it.", "image": rows[0]["images"][0]}])
    with pytest.raises(DatasetFormatError, match=r"train_dataset\[0\].*image must be a PIL image"):
        make([{**rows[0], "images": ["not/an/image.png"]}])._request(0)
    with pytest.raises(TypeError, match="processor as processing_class"):
        make(rows, proc=processor.tokenizer)
    text_model, tok = FastLanguageModel.from_pretrained(ROOT / "unsloth_jax" / "assets" / "tiny-llama",
                                                        dtype="float32", progress=False)
    text_model = FastLanguageModel.get_peft_model(text_model, r=2, use_gradient_checkpointing=False)
    with pytest.raises(TrainingError, match="not a vision-language model"):
        make(rows, proc=tok, m=text_model)
    # a plain-text user turn and an image column: the placeholder goes before the text, as TRL's
    trainer = make([{"prompt": [{"role": "user", "content": "What is it?"}], "images": rows[0]["images"]}])
    assert trainer.prompt_messages[0][0]["content"][0] == {"type": "image", "image": rows[0]["images"][0]}


def test_fast_generate_greedy_equals_generate(family):
    """Chats with their images (TRL's {"messages", "images"} and images inside the parts) and the engine requests
    they make: fast_generate's greedy tokens equal generate's on the processor's batch."""
    from unsloth_jax.inference import SamplingParams

    name, _, model, processor = family
    rows = vl_models.shapes_dataset(2)
    chats = [{"messages": [rows[0]["messages"][0]], "images": rows[0]["images"]},
             [{"role": "user", "content": [{"type": "image", "image": rows[1]["images"][0]},
                                           {"type": "text", "text": "What colour is the square?"}]}]]
    outs = model.fast_generate(chats, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                               processor=processor)
    processor.tokenizer.padding_side = "left"
    texts = [processor.apply_chat_template([r["messages"][0]], add_generation_prompt=True) for r in rows]
    inputs = dict(processor(text=texts, images=[r["images"] for r in rows], return_tensors="np", padding=True,
                            add_special_tokens=False))
    expect = model.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=[])
    got = np.asarray([o.outputs[0].token_ids for o in outs])
    print(name, got.tolist(), expect[:, -6:].tolist())
    assert (got == expect[:, -6:]).all()
    for out, row, mask in zip(outs, inputs["input_ids"], inputs["attention_mask"]):
        assert out.prompt_token_ids == row[mask > 0].tolist()
    from unsloth_jax.inference.image_inputs import chat_request
    from unsloth_jax.data.vision import multimodal_messages

    request = chat_request(model.vl_config, processor, multimodal_messages(chats[1], [], "x"), "x")
    again = model.fast_generate([request], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert list(again[0].outputs[0].token_ids) == got[1].tolist()
    with pytest.raises(Exception, match=r"prompts\[0\]: 1 image placeholder"):
        model.fast_generate([[rows[0]["messages"][0]]], processor=processor)


def test_example_raises_the_reward(tmp_path):
    """examples/grpo_vision.py, shortened (4 red and 4 blue pictures, 6 steps): the mean reward of completions
    sampled for the training prompts (fixed sampling seed) rises for both colours (0.40 -> 0.99 and 0.33 -> 0.98
    in its 12-step default run)."""
    spec = importlib.util.spec_from_file_location("grpo_vision", ROOT / "examples" / "grpo_vision.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = example.main(["--max_steps", "6", "--per_colour", "4", "--output_dir", str(tmp_path / "run")])
    for colour in ("red", "blue"):
        assert out["after"][colour] > out["before"][colour] + 0.2, out
