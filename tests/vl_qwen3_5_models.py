"""A tiny random Qwen3.5 as released (transformers' Qwen3_5ForConditionalGeneration, eager attention, float32) for
the inputs of tests/vl_qwen_models.py (same ids, patch 4 / merge 2 geometry, two images of different grids): 4
text layers (gated DeltaNet x3, then gated full attention), RoPE on a quarter of each 32-dim head by interleaved
M-RoPE (sections 2, 1, 1), Qwen3-VL's tower of 3 blocks without DeepStack, a 4 x 4 learned position grid; the saved
checkpoint also holds a multi-token-prediction head (mtp.*), as released checkpoints do."""
from __future__ import annotations

import numpy as np

from tests.vl_qwen_models import IMAGE, P_IMAGE, P_VEND, P_VIDEO, P_VSTART, VEND, VIDEO, VSTART

TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8, max_position_embeddings=512, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                 mrope_section=[2, 1, 1], mrope_interleaved=True))
VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_position_embeddings=16)
MTP = {"mtp.fc.weight": (64, 128), "mtp.norm.weight": (64,)}  # a stand-in for the released checkpoints' mtp.* head


def hf_qwen3_5(seed: int = 0, processor_vocab: bool = False):
    """transformers' Qwen3_5ForConditionalGeneration with random weights everywhere (norms around 1);
    processor_vocab: 2052 ids with tests.vl_qwen_models.processor()'s vision token ids (else 256 ids)."""
    import torch
    import transformers

    text, ids = dict(TEXT), (IMAGE, VIDEO, VSTART, VEND)
    if processor_vocab:
        text["vocab_size"], ids = 2052, (P_IMAGE, P_VIDEO, P_VSTART, P_VEND)
    cfg = transformers.Qwen3_5Config(text_config=text, vision_config=dict(VISION), image_token_id=ids[0],
                                     video_token_id=ids[1], vision_start_token_id=ids[2], vision_end_token_id=ids[3])
    for c in (cfg, cfg.text_config, cfg.vision_config):
        c._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForConditionalGeneration(cfg)
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


def save_with_mtp(model, path, seed: int = 0) -> dict[str, np.ndarray]:
    """model.save_pretrained(path) (one model.safetensors), plus random mtp.* tensors (MTP) in that file, as the
    released checkpoints carry them. Returns the mtp tensors."""
    from safetensors.numpy import load_file, save_file

    model.save_pretrained(path)
    rng = np.random.default_rng(seed)
    mtp = {k: rng.standard_normal(shape).astype(np.float32) for k, shape in MTP.items()}
    tensors = load_file(str(path / "model.safetensors"))
    save_file(tensors | mtp, str(path / "model.safetensors"), metadata={"format": "pt"})
    return mtp
