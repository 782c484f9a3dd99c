"""Generation with images for Qwen2.5-VL (tiny random model, float32): greedy tokens equal transformers'
Qwen2_5_VLForConditionalGeneration.generate on a left-padded batch of two rows of different lengths, one with two
images of different grids, the other with a third grid (M-RoPE in the prefill, rope_deltas in the decode), and
on text-only prompts; greedy with repetition_penalty equals transformers' too, top_k / min_p reach the sampler;
sampling is reproducible by seed, streams its steps and stops at eos; bad inputs are named."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests import vl_qwen_models as qm  # noqa: E402

pytestmark = pytest.mark.torch
NEW = 10
GRIDS = np.array([[1, 4, 8], [1, 6, 4], [1, 4, 4]])  # row 0: 8 + 6 image tokens, row 1: 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_5_vl_generate")
    hf = qm.hf_qwen_vl()
    hf.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module")
def model(checkpoint):
    from unsloth_jax import FastVisionModel

    model, _ = FastVisionModel.from_pretrained(checkpoint[0], dtype="float32", load_processor=False)
    return model


def _image(n: int) -> list[int]:
    return [qm.VSTART] + [qm.IMAGE] * n + [qm.VEND]


def _left_padded(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """rows of token ids -> (input_ids, attention_mask) [B, P] int64, left padded with 0."""
    width = max(len(r) for r in rows)
    ids, mask = np.zeros((len(rows), width), np.int64), np.zeros((len(rows), width), np.int64)
    for i, row in enumerate(rows):
        ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
    return ids, mask


def _batch(seed: int = 0) -> dict:
    """Row 0: text, an image of GRIDS[0], text, one of GRIDS[1], text (27 tokens); row 1: text, one of GRIDS[2],
    text (11 tokens, left padded). pixel_values [72, C*T*p*p] random, image_grid_thw GRIDS, and transformers'
    mm_token_type_ids (1 = image token), as the processor gives them."""
    rng = np.random.default_rng(seed)
    text = lambda n: rng.integers(3, 240, n).tolist()  # noqa: E731
    ids, mask = _left_padded([text(3) + _image(8) + text(2) + _image(6) + text(4), text(2) + _image(4) + text(3)])
    pixels = rng.standard_normal((int(GRIDS.prod(-1).sum()), qm.PATCH_DIM)).astype(np.float32)
    return dict(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=GRIDS.copy(),
                mm_token_type_ids=(ids == qm.IMAGE).astype(np.int64))


def _hf_generate(hf, inputs: dict) -> np.ndarray:
    kw = {k: torch.tensor(v) for k, v in inputs.items()}
    with torch.no_grad():
        return hf.generate(**kw, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False).numpy()


def test_mrope_with_equal_axes_is_plain_rope(model):
    """The decode step rotates by the text model's RoPE: M-RoPE's tables when the three axes are equal."""
    import jax.numpy as jnp

    from unsloth_jax.models.rope import mrope_tables

    positions = jnp.asarray([[0, 5, 17, 300], [2, 3, 4, 1000]], jnp.int32)
    plain, _ = model.model.rope(positions)
    equal = mrope_tables(model.config, jnp.broadcast_to(positions, (3, 2, 4)), model.vl_config.mrope_section)
    for a, b in zip(plain, equal):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_greedy_with_images_equals_transformers(checkpoint, model):
    inputs = _batch()
    assert inputs["attention_mask"][1, 0] == 0  # row 1 is left padded
    ours = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    theirs = _hf_generate(checkpoint[1], inputs)
    print("ours", ours[:, -NEW:].tolist(), "transformers", theirs[:, -NEW:].tolist())
    assert ours.dtype == np.int64 and ours.shape == theirs.shape and (ours == theirs).all()
    assert len(set(ours[:, -NEW:].ravel().tolist())) > 4  # not one repeated token


def test_text_only_equals_transformers(checkpoint, model):
    rng = np.random.default_rng(1)
    ids, mask = _left_padded([rng.integers(3, 240, 9).tolist(), rng.integers(3, 240, 5).tolist()])
    ours = model.generate(ids, mask, max_new_tokens=NEW)
    theirs = _hf_generate(checkpoint[1], dict(input_ids=ids, attention_mask=mask))
    print("ours", ours[:, -NEW:].tolist(), "transformers", theirs[:, -NEW:].tolist())
    assert (ours == theirs).all()


def test_sampling_is_reproducible_streams_and_stops_at_eos(model):
    inputs = _batch()
    p = inputs["input_ids"].shape[1]
    steps = []
    kw = dict(max_new_tokens=NEW, do_sample=True, temperature=1.5, top_p=0.95, eos_token_id=[])
    first = model.generate(**inputs, seed=3, streamer=steps.append, **kw)
    assert (model.generate(**inputs, seed=3, **kw) == first).all()
    assert not (model.generate(**inputs, seed=4, **kw) == first).all()
    np.testing.assert_array_equal(np.stack(steps, axis=1), first[:, p:])
    eos = int(first[0, p + 2])
    stopped = model.generate(**inputs, seed=3, **{**kw, "eos_token_id": eos}, pad_token_id=0)
    print("sampled", first[:, p:].tolist(), "eos", eos, "stopped", stopped[:, p:].tolist())
    for row, full in zip(stopped[:, p:], first[:, p:]):
        hits = np.nonzero(full == eos)[0]
        end = hits[0] + 1 if hits.size else NEW
        np.testing.assert_array_equal(row[:end], full[:end])  # the same stream up to its first eos
        assert (row[end:] == 0).all()


def test_bad_inputs_are_named(model):
    inputs = _batch()
    ids, mask, pixels = inputs["input_ids"], inputs["attention_mask"], inputs["pixel_values"]
    cases = [
        (dict(pixel_values=pixels), "needs image_grid_thw"),
        (dict(image_grid_thw=GRIDS), "image_grid_thw is given but pixel_values is None"),
        (dict(), "image tokens but pixel_values is None"),
        (dict(pixel_values=pixels[None], image_grid_thw=GRIDS), r"pixel_values must be \[patches"),
        (dict(pixel_values=pixels, image_grid_thw=GRIDS.reshape(-1)), r"image_grid_thw must be \[images, 3\]"),
        (dict(pixel_values=pixels[:-4], image_grid_thw=GRIDS), "pixel_values shape"),
        (dict(pixel_values=pixels[:56], image_grid_thw=GRIDS[:2]), "hold 18 image tokens, but image_grid_thw's 2"),
        (dict(pixel_values=pixels, image_grid_thw=GRIDS[[1, 0, 2]]), "image_grid_thw entry"),  # runs vs grids
        (dict(pixel_values=pixels, image_grid_thw=GRIDS, token_type_ids=inputs["mm_token_type_ids"]),
         "token_type_ids"),
    ]
    for extra, message in cases:
        with pytest.raises(ValueError, match=message):
            model.generate(ids, mask, max_new_tokens=2, **extra)
    video = np.where(ids == qm.IMAGE, qm.VIDEO, ids)
    with pytest.raises(ValueError, match="video tokens"):
        model.generate(video, mask, max_new_tokens=2)
    with pytest.raises(ValueError, match="top_p"):
        model.generate(**inputs, do_sample=True, top_p=0.0)
    with pytest.raises(TypeError, match="num_beams"):
        model.generate(**inputs, num_beams=2)


def test_sampler_options_with_images(checkpoint, model):
    """The engine's sampler on the image path: greedy with repetition_penalty equals transformers' generate with
    it; top_k=1 and min_p=1 keep only the most likely token, so sampling with either is the greedy result."""
    inputs = _batch(seed=2)
    kw = {k: torch.tensor(v) for k, v in inputs.items()}
    with torch.no_grad():
        theirs = checkpoint[1].generate(**kw, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                        repetition_penalty=1.8).numpy()
    ours = model.generate(**inputs, max_new_tokens=NEW, do_sample=False, repetition_penalty=1.8)
    np.testing.assert_array_equal(ours, theirs)
    greedy = model.generate(**inputs, max_new_tokens=NEW, do_sample=False, eos_token_id=[])
    assert not (greedy == ours).all()  # the penalty changed the tokens: the comparison above means something
    for option in (dict(top_k=1), dict(min_p=1.0)):
        sampled = model.generate(**inputs, max_new_tokens=NEW, do_sample=True, temperature=2.0, seed=5,
                                 eos_token_id=[], **option)
        np.testing.assert_array_equal(sampled, greedy, err_msg=str(option))
