"""A tiny random Qwen2.5-VL (transformers' Qwen2_5_VLForConditionalGeneration, eager attention, float32) and
matching inputs built directly (no image processor): pixel_values [patches, C*T*p*p] random, image_grid_thw."""
from __future__ import annotations

import numpy as np

IMAGE, VIDEO, VSTART, VEND = 250, 251, 252, 253
TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3]))  # head_dim 16
# patch 4, merge 2, window 16 px = 2 x 2 merged tokens: the grids below have 2 windows each; block 1 attends fully
VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, window_size=16, fullatt_block_indexes=[1], in_channels=3)
GRIDS = np.array([[1, 4, 8], [1, 6, 4]])  # 32 + 24 patches -> 8 + 6 language tokens
PATCH_DIM = 3 * 2 * 4 * 4


def hf_qwen_vl(seed: int = 0):
    """transformers' Qwen2_5_VLForConditionalGeneration with random weights everywhere (norms around 1)."""
    import torch
    import transformers

    cfg = transformers.Qwen2_5_VLConfig(text_config=dict(TEXT), vision_config=dict(VISION), image_token_id=IMAGE,
                                        video_token_id=VIDEO, vision_start_token_id=VSTART,
                                        vision_end_token_id=VEND)
    for c in (cfg, cfg.text_config, cfg.vision_config):
        c._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
    return model.eval()


def image_tokens(grid) -> int:
    t, h, w = grid
    return int(t * h * w // 4)


def inputs(rng, *, s: int = 32):
    """Two rows of s tokens: row 0 holds both images of GRIDS (each between vision start/end tokens), row 1 is
    text only with 6 tokens of right padding. Returns (input_ids, attention_mask, pixel_values, image_grid_thw)."""
    ids = rng.integers(3, 240, size=(2, s))
    at = 2
    for grid in GRIDS:
        n = image_tokens(grid)
        ids[0, at], ids[0, at + 1:at + 1 + n], ids[0, at + 1 + n] = VSTART, IMAGE, VEND
        at += n + 4
    assert at <= s
    mask = np.ones_like(ids)
    mask[1, s - 6:] = 0
    ids[1, s - 6:] = 0
    pixels = rng.standard_normal((int(GRIDS.prod(-1).sum()), PATCH_DIM)).astype(np.float32)
    return ids, mask, pixels, GRIDS.copy()
