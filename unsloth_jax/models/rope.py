"""Rotary position embeddings: inverse frequencies (linear / llama3 / LongRoPE / YaRN scaling, Gemma 4's
proportional RoPE, Gemma 3's local base, partial rotary dims) and the cos/sin tables."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from unsloth_jax.config import ModelConfig


def inv_frequencies(cfg: ModelConfig, *, local: bool = False, long: bool = False) -> np.ndarray:
    """RoPE inverse frequencies [rope_dim/2] (float32 numpy, computed in float32 as transformers does), with
    linear or llama3 scaling applied. local=True: Gemma 3's sliding layers (plain RoPE, base rope_local_theta).
    LongRoPE: divided by the short factors, or by the long ones with long=True. The global frequencies are over
    cfg.global_rope_dim (Gemma 4's full-attention layers of their own head dim)."""
    hd = cfg.rope_dim if local else cfg.global_rope_dim
    f32 = np.float32
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv = f32(1.0) / (f32(theta) ** (np.arange(0, hd, 2).astype(f32) / f32(hd)))
    if local:
        return inv.astype(f32)
    if cfg.rope_type == "longrope":
        factors = np.asarray(cfg.rope_long_factor if long else cfg.rope_short_factor, f32)
        inv = f32(1.0) / (factors * (f32(theta) ** (np.arange(0, hd, 2).astype(f32) / f32(hd))))
    elif cfg.rope_type == "linear":
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
    elif cfg.rope_type == "yarn":
        inv = yarn_inv_frequencies(cfg)
    elif cfg.rope_type == "proportional":  # Gemma 4's full-attention layers: the rest of the frequencies are 0
        rotated = int(cfg.rope_proportion * hd // 2)
        inv = f32(1.0) / (f32(theta) ** (np.arange(0, 2 * rotated, 2).astype(f32) / f32(hd)))
        inv = np.concatenate([inv, np.zeros(hd // 2 - rotated, f32)]) / f32(cfg.rope_factor)
    return inv.astype(f32)


def rope_tables(cfg: ModelConfig, positions: jax.Array, *, local: bool = False,
                long: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, S, rope_dim] in float32 for integer positions [B, S] (HF layout: frequencies repeated twice).
    local=True: the tables of Gemma 3's sliding-window layers. LongRoPE picks the long factors for the whole
    call when its largest position + 1 exceeds the original context, as transformers does per forward call
    from position_ids (positions_from_mask counts real tokens only, so padding never tips the choice; cached
    keys keep the factors they were computed with: generation rewrites them at the switch), or per row by
    `long` [B] bool when given (the engine's rows, each its own sequence). LongRoPE and YaRN scale cos and
    sin by rope_attention_factor (never on the local tables)."""
    inv = jnp.asarray(inv_frequencies(cfg, local=local), jnp.float32)
    if cfg.rope_type == "longrope" and not local:
        use_long = jnp.max(positions) + 1 > cfg.rope_original_max_position if long is None else long
        use_long = jnp.reshape(use_long, jnp.shape(use_long) + (1,) * (positions.ndim + 1 - jnp.ndim(use_long)))
        inv = jnp.where(use_long, jnp.asarray(inv_frequencies(cfg, long=True), jnp.float32), inv)
    freqs = positions.astype(jnp.float32)[..., None] * inv
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    if cfg.rope_attention_factor != 1.0 and not local:  # LongRoPE / YaRN (transformers' attention_scaling)
        scale = jnp.float32(cfg.rope_attention_factor)
        return jnp.cos(emb) * scale, jnp.sin(emb) * scale
    return jnp.cos(emb), jnp.sin(emb)


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """Positions [B, S] counting real tokens only (left padding starts real tokens at 0), as HF generate does."""
    return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


def yarn_inv_frequencies(cfg: ModelConfig) -> np.ndarray:
    """YaRN inverse frequencies [rope_dim/2] (float32), as transformers' _compute_yarn_parameters: interpolated
    (divided by the factor) below the correction range, extrapolated (unchanged) above it, a linear ramp between."""
    hd, base, f32 = cfg.rope_dim, cfg.rope_theta, np.float32
    original = cfg.rope_original_max_position

    def correction_dim(rotations: float) -> float:
        return (hd * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(cfg.rope_beta_fast), correction_dim(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, hd - 1)
    if low == high:
        high += 0.001
    pos = f32(base) ** (np.arange(0, hd, 2).astype(f32) / f32(hd))
    extrapolation = f32(1.0) / pos
    interpolation = f32(1.0) / (f32(cfg.rope_factor) * pos)
    ramp = np.clip((np.arange(hd // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1).astype(f32)
    keep = f32(1.0) - ramp
    return (interpolation * (f32(1.0) - keep) + extrapolation * keep).astype(f32)


def mrope_axes(section, interleaved: bool = False) -> np.ndarray:
    """The M-RoPE axis (0 temporal, 1 height, 2 width) each of the sum(section) frequencies reads: consecutive
    runs of section[0], section[1], section[2] (Qwen2.5-VL), or interleaved t h w t h w ... with frequency
    3k + a on axis a for k < section[a] and the rest temporal (Qwen3-VL)."""
    section = [int(s) for s in section]
    if not interleaved:
        return np.repeat(np.arange(3), section)
    axis = np.zeros(sum(section), int)
    for a in (1, 2):
        axis[a:3 * section[a]:3] = a
    return axis


def mrope_tables(cfg: ModelConfig, positions: jax.Array, section, interleaved: bool = False
                 ) -> tuple[jax.Array, jax.Array]:
    """Multimodal RoPE (Qwen2.5-VL, Qwen3-VL): cos, sin [B, S, rope_dim] float32 for positions [3, B, S]
    (temporal, height, width ids). Each of the rope_dim/2 frequencies rotates by the positions of the axis
    mrope_axes(section, interleaved) gives it; the frequencies are then repeated twice as in rope_tables. Equal
    positions on the three axes give rope_tables' result."""
    inv = jnp.asarray(inv_frequencies(cfg), jnp.float32)
    axis = mrope_axes(section, interleaved)  # [rope_dim/2]: the axis each frequency reads
    if axis.shape[0] != inv.shape[0]:
        raise ValueError(f"mrope_section {list(section)} sums to {axis.shape[0]}, expected rope_dim/2 = "
                         f"{inv.shape[0]}")
    pos = jnp.moveaxis(positions.astype(jnp.float32)[axis], 0, -1)  # [B, S, rope_dim/2]
    freqs = pos * inv
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)
