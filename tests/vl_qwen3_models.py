"""A tiny random Qwen3-VL (transformers' Qwen3VLForConditionalGeneration, eager attention, float32) for the
inputs of tests/vl_qwen_models.py (same ids, patch 4 / merge 2 geometry, two images of different grids):
3 text layers with q/k norms and interleaved M-RoPE, 3 vision blocks, DeepStack from blocks 0 and 2 into text
layers 0 and 1, a 4 x 4 learned position grid resampled to each image."""
from __future__ import annotations

import numpy as np

from tests.vl_qwen_models import IMAGE, random_qwen_vl

TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1,
            eos_token_id=2, rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2],
                                                 mrope_interleaved=True))
VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_position_embeddings=16,
              deepstack_visual_indexes=[0, 2])


def hf_qwen3_vl(seed: int = 0, processor_vocab: bool = False):
    """transformers' Qwen3VLForConditionalGeneration with random weights (tests.vl_qwen_models.random_qwen_vl)."""
    return random_qwen_vl("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", TEXT, VISION, seed, processor_vocab)


def mm_token_type_ids(ids, image: int = IMAGE):
    """transformers' mm_token_type_ids for ids [B, S] (1 on image tokens): Qwen3-VL's get_rope_index reads them."""
    return (ids == image).astype("int64")


def assert_greedy_with_images_matches(model, hf, rng, hf_kwargs) -> None:
    """Greedy generate of a left-padded batch (row 0: two images of different grids, row 1: a third) equals
    transformers' generate (hf_kwargs(ids, mask, pixels, grids): its input kwargs), each row up to its first eos."""
    import torch

    from tests import vl_qwen_models as qm

    grids = np.array([[1, 4, 8], [1, 6, 4], [1, 4, 4]])
    text = lambda n: rng.integers(3, 240, n).tolist()  # noqa: E731
    image = lambda n: [qm.VSTART] + [qm.IMAGE] * n + [qm.VEND]  # noqa: E731
    rows = [text(3) + image(8) + text(2) + image(6) + text(4), text(2) + image(4) + text(3)]
    width = max(map(len, rows))
    ids, mask = np.zeros((2, width), np.int64), np.zeros((2, width), np.int64)
    for i, row in enumerate(rows):
        ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
    pixels = rng.standard_normal((int(grids.prod(-1).sum()), qm.PATCH_DIM)).astype(np.float32)
    new = 8
    ours = model.generate(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grids,
                          max_new_tokens=new, do_sample=False)
    with torch.no_grad():
        theirs = hf.generate(**hf_kwargs(ids, mask, pixels, grids), max_new_tokens=new, do_sample=False).numpy()
    print("ours", ours[:, -new:].tolist(), "transformers", theirs[:, -new:].tolist())
    np.testing.assert_array_equal(ours[:, :width], ids)
    for mine, hf_row in zip(ours[:, width:], theirs[:, width:]):  # each row up to its first eos (both stop there)
        stop = list(hf_row).index(2) + 1 if 2 in hf_row else new
        assert mine[:stop].tolist() == hf_row[:stop].tolist()
