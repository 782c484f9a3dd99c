"""A tiny random Qwen3.5 as released (transformers' Qwen3_5ForConditionalGeneration, eager attention, float32) for
the inputs of tests/vl_qwen_models.py (same ids, patch 4 / merge 2 geometry, two images of different grids): 4
text layers (gated DeltaNet x3, then gated full attention), RoPE on a quarter of each 32-dim head by interleaved
M-RoPE (sections 2, 1, 1), Qwen3-VL's tower of 3 blocks without DeepStack, a 4 x 4 learned position grid; the saved
checkpoint also holds a multi-token-prediction head (mtp.*), as released checkpoints do."""
from __future__ import annotations

import numpy as np

from tests.vl_qwen_models import random_qwen_vl

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
    """transformers' Qwen3_5ForConditionalGeneration with random weights (tests.vl_qwen_models.random_qwen_vl)."""
    return random_qwen_vl("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", TEXT, VISION, seed, processor_vocab)


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
