"""What GGUF export and GGUF loading both need, in a module below both: gguf_export.py imports export.py, which
imports gguf_loading.py (a model read from a GGUF file exports the config and tokenizer the file holds), so
gguf_loading.py cannot import from gguf_export.py without a cycle (tests/test_imports.py)."""
from __future__ import annotations

import math

import numpy as np


def llama3_rope_factors(cfg) -> np.ndarray:
    """rope_freqs for Llama 3 rope scaling, computed in float32 as convert_hf_to_gguf.py does with torch."""
    f32 = np.float32
    dim = cfg.head_dim
    freqs = f32(1.0) / (f32(cfg.rope_theta) ** (np.arange(0, dim, 2, dtype=f32) / f32(dim)))
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_ctx = cfg.rope_original_max_position
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for freq in freqs.astype(f32):
        wavelen = f32(2 * math.pi) / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (f32(old_ctx) / wavelen - f32(low)) / f32(high - low)
            out.append(f32(1) / ((f32(1) - smooth) / f32(factor) + smooth))
    return np.array(out, dtype=f32)


def add_shape(w, cfg) -> None:
    """The size keys every converter writes: context, widths, depth, heads, norm epsilon."""
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
