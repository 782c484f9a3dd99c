"""Rotary position embeddings: inverse frequencies (with linear / llama3 scaling) and the cos/sin tables."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from unsloth_jax.config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> np.ndarray:
    """RoPE inverse frequencies [hd/2] (float32 numpy, computed in float32 as transformers does), with linear or
    llama3 scaling applied."""
    hd = cfg.head_dim
    f32 = np.float32
    inv = f32(1.0) / (f32(cfg.rope_theta) ** (np.arange(0, hd, 2).astype(f32) / f32(hd)))
    if cfg.rope_type == "linear":
        inv = inv / cfg.rope_factor
    elif cfg.rope_type == "llama3":
        low_wavelen = cfg.rope_original_max_position / cfg.rope_low_freq_factor
        high_wavelen = cfg.rope_original_max_position / cfg.rope_high_freq_factor
        wavelen = f32(2 * np.pi) / inv
        scaled = np.where(wavelen > low_wavelen, inv / cfg.rope_factor, inv)
        smooth = (cfg.rope_original_max_position / wavelen - cfg.rope_low_freq_factor) / (
            cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
        smoothed = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(f32)


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, S, hd] in float32 for integer positions [B, S] (HF layout: frequencies repeated twice)."""
    inv = jnp.asarray(inv_frequencies(cfg), jnp.float32)
    freqs = positions.astype(jnp.float32)[..., None] * inv
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """Positions [B, S] counting real tokens only (left padding starts real tokens at 0), as HF generate does."""
    return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)
