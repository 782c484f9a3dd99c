"""A tiny random Qwen3-VL (transformers' Qwen3VLForConditionalGeneration, eager attention, float32) for the
inputs of tests/vl_qwen_models.py (same ids, patch 4 / merge 2 geometry, two images of different grids):
3 text layers with q/k norms and interleaved M-RoPE, 3 vision blocks, DeepStack from blocks 0 and 2 into text
layers 0 and 1, a 4 x 4 learned position grid resampled to each image."""
from __future__ import annotations

from tests.vl_qwen_models import IMAGE, P_IMAGE, P_VEND, P_VIDEO, P_VSTART, VEND, VIDEO, VSTART

TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1,
            eos_token_id=2, rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2],
                                                 mrope_interleaved=True))
VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_position_embeddings=16,
              deepstack_visual_indexes=[0, 2])


def hf_qwen3_vl(seed: int = 0, processor_vocab: bool = False):
    """transformers' Qwen3VLForConditionalGeneration with random weights everywhere (norms around 1);
    processor_vocab: 2052 ids with tests.vl_qwen_models.processor()'s vision token ids (else 256 ids)."""
    import torch
    import transformers

    text, ids = dict(TEXT), (IMAGE, VIDEO, VSTART, VEND)
    if processor_vocab:
        text["vocab_size"], ids = 2052, (P_IMAGE, P_VIDEO, P_VSTART, P_VEND)
    cfg = transformers.Qwen3VLConfig(text_config=text, vision_config=dict(VISION), image_token_id=ids[0],
                                     video_token_id=ids[1], vision_start_token_id=ids[2], vision_end_token_id=ids[3])
    for c in (cfg, cfg.text_config, cfg.vision_config):
        c._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Qwen3VLForConditionalGeneration(cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
    return model.eval()


def mm_token_type_ids(ids, image: int = IMAGE):
    """transformers' mm_token_type_ids for ids [B, S] (1 on image tokens): Qwen3-VL's get_rope_index reads them."""
    return (ids == image).astype("int64")
