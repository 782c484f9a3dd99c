"""The decoder of every supported family as pure functions over the stacked param dict.

    forward(params, cfg, input_ids, ...) -> logits [B, S, V]  (or the final hidden states [B, S, D])

Layers run under `lax.scan` over groups of `cfg.layer_period` layers (1 for most families, 2 for Gemma 2,
whose sliding and global layers alternate), so compile time does not grow with depth and each layer inside a
group keeps a static attention window. Per-family switches come from `ModelConfig`; every op goes through
`unsloth_jax.ops`, which picks Pallas kernels, cuDNN or XLA.

Shapes: B batch, S sequence, D hidden, Hq/Hkv heads, hd head_dim, V vocab. Activations are in the params'
compute dtype; norms, softmax and RoPE math run in float32.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
import numpy as np

from unsloth_jax import ops
from unsloth_jax.config import ModelConfig

REMAT_MODES = ("none", "full", "offload")


class Batch(NamedTuple):
    """Per-token side inputs shared by all layers. Arrays are [B, S]."""

    positions: jax.Array
    kv_valid: jax.Array | None  # attention_mask (1 = real token); None when there is no padding
    segment_ids: jax.Array | None  # packing: attend only within equal ids
    kv_lengths: jax.Array | None = None  # [B] real lengths when the padding is known to be on the right


# ---------------------------------------------------------------------------------------------- rope
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


# ---------------------------------------------------------------------------------------------- layer
def _norm(cfg: ModelConfig, x: jax.Array, w: jax.Array) -> jax.Array:
    return ops.rms_norm(x, w, cfg.rms_norm_eps, cfg.norm_offset)


def attention_block(cfg: ModelConfig, p: dict, x: jax.Array, cos, sin, batch: Batch, window: int | None,
                    lora_scale: float | None, cache=None):
    """Self-attention of one layer. x [B, S, D] (already normed) -> ([B, S, D], new cache or None).

    cache, when given, is (k [B, T, Hkv, hd], v [B, T, Hkv, hd], valid [B, T], index) for decoding: the new
    keys/values are written at `index` and attention runs over the whole cache.
    """
    b, s, _ = x.shape
    hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = ops.linear(x, p["q_proj"], lora_scale).reshape(b, s, hq, hd)
    k = ops.linear(x, p["k_proj"], lora_scale).reshape(b, s, hkv, hd)
    v = ops.linear(x, p["v_proj"], lora_scale).reshape(b, s, hkv, hd)
    if cfg.qk_norm:
        q = _norm(cfg, q, p["q_norm"])
        k = _norm(cfg, k, p["k_norm"])
    q, k = ops.rope(q, k, cos, sin)
    new_cache = None
    if cache is None:
        out = ops.attention(q, k, v, scale=cfg.scale, causal=True, window=window, softcap=cfg.attn_softcap,
                            kv_valid=batch.kv_valid, segment_ids=batch.segment_ids, kv_lengths=batch.kv_lengths)
    else:
        ck, cv, valid, index = cache
        ck = jax.lax.dynamic_update_slice_in_dim(ck, k.astype(ck.dtype), index, axis=1)
        cv = jax.lax.dynamic_update_slice_in_dim(cv, v.astype(cv.dtype), index, axis=1)
        out = ops.attention(q, ck, cv, scale=cfg.scale, causal=True, window=window, softcap=cfg.attn_softcap,
                            kv_valid=valid, q_offset=index)
        new_cache = (ck, cv)
    out = out.reshape(b, s, hq * hd)
    return ops.linear(out, p["o_proj"], lora_scale), new_cache


def mlp_block(cfg: ModelConfig, p: dict, x: jax.Array, lora_scale: float | None) -> jax.Array:
    gate = ops.linear(x, p["gate_proj"], lora_scale)
    up = ops.linear(x, p["up_proj"], lora_scale)
    return ops.linear(ops.glu(gate, up, cfg.activation), p["down_proj"], lora_scale)


def decoder_layer(cfg: ModelConfig, p: dict, x: jax.Array, cos, sin, batch: Batch, window: int | None,
                  lora_scale: float | None, cache=None):
    """One pre-norm decoder layer (Gemma 2: with sandwich norms). x [B, S, D] -> ([B, S, D], cache)."""
    h = _norm(cfg, x, p["input_layernorm"])
    h, new_cache = attention_block(cfg, p, h, cos, sin, batch, window, lora_scale, cache)
    if cfg.sandwich_norms:
        h = _norm(cfg, h, p["post_attention_layernorm"])
        x = x + h
        h = _norm(cfg, x, p["pre_feedforward_layernorm"])
        h = mlp_block(cfg, p, h, lora_scale)
        h = _norm(cfg, h, p["post_feedforward_layernorm"])
    else:
        x = x + h
        h = _norm(cfg, x, p["post_attention_layernorm"])
        h = mlp_block(cfg, p, h, lora_scale)
    return x + h, new_cache


def _remat(fn, mode: str):
    if mode == "none":
        return fn
    if mode == "full":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)
    if mode == "offload":
        policy = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=["layer_input"],
            offload_src="device", offload_dst="pinned_host")
        return jax.checkpoint(fn, policy=policy)
    raise ValueError(f"unknown remat mode {mode!r}; use one of {REMAT_MODES}")


# -------------------------------------------------------------------------------------------- forward
def embed(cfg: ModelConfig, params: dict, input_ids: jax.Array, dtype) -> jax.Array:
    x = jnp.take(params["embed_tokens"], input_ids, axis=0).astype(dtype)
    if cfg.embed_scale:  # Gemma: the normalizer is rounded to the activation dtype first, as HF does
        x = x * jnp.asarray(cfg.hidden_size ** 0.5, dtype)
    return x


def lm_head_weight(params: dict) -> jax.Array:
    """The [V, D] output projection (the embedding when tied)."""
    return params["lm_head"] if "lm_head" in params else params["embed_tokens"]


def make_batch(input_ids, attention_mask=None, positions=None, segment_ids=None, right_padded: bool = False) -> Batch:
    """Side inputs of a forward pass. right_padded=True promises that every row's padding is at its end
    (training batches), which lets attention use cuDNN's sequence-length masking."""
    lengths = None
    if right_padded and attention_mask is not None:
        lengths = jnp.sum(attention_mask.astype(jnp.int32), axis=-1)
    if positions is None:
        if attention_mask is not None:
            positions = positions_from_mask(attention_mask)
        else:
            positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1]), input_ids.shape)
    return Batch(positions=positions, kv_valid=attention_mask, segment_ids=segment_ids, kv_lengths=lengths)


def layer_groups(cfg: ModelConfig, tree):
    """Stacked layer arrays [L, ...] regrouped [L / period, period, ...] for a scan over groups of `period`
    layers (each layer of a group has a static attention window), and those windows (length period)."""
    period = cfg.layer_period
    windows = (cfg.layer_windows or (None,) * cfg.num_hidden_layers)[:period]
    groups = cfg.num_hidden_layers // period
    return jax.tree.map(lambda a: a.reshape((groups, period) + a.shape[1:]), tree), windows


def final_norm(cfg: ModelConfig, params: dict, x: jax.Array) -> jax.Array:
    """The model's last RMSNorm over [..., D]."""
    return _norm(cfg, x, params["norm"])


def hidden_states(params: dict, cfg: ModelConfig, input_ids: jax.Array, batch: Batch, *,
                  lora_scale: float | None = None, remat: str = "none", dtype=None) -> jax.Array:
    """Final-normed hidden states [B, S, D] for input_ids [B, S]."""
    dtype = dtype or params["embed_tokens"].dtype
    x = embed(cfg, params, input_ids, dtype)
    cos, sin = rope_tables(cfg, batch.positions)
    grouped, windows = layer_groups(cfg, params["layers"])

    def group_body(x, p_group):
        x = checkpoint_name(x, "layer_input")
        for j in range(len(windows)):
            p = jax.tree.map(lambda a: a[j], p_group)
            x, _ = decoder_layer(cfg, p, x, cos, sin, batch, windows[j], lora_scale)
        return x

    body = _remat(group_body, remat)
    x, _ = jax.lax.scan(lambda c, p: (body(c, p), None), x, grouped)
    return final_norm(cfg, params, x)


def logits_from_hidden(cfg: ModelConfig, params: dict, h: jax.Array) -> jax.Array:
    """[..., D] -> [..., V] logits in float32 (Gemma 2: final softcapping applied)."""
    w = lm_head_weight(params)
    logits = jnp.einsum("...d,vd->...v", h, w.astype(h.dtype), preferred_element_type=jnp.float32)
    if cfg.final_softcap is not None:
        logits = cfg.final_softcap * jnp.tanh(logits / cfg.final_softcap)
    return logits


@functools.partial(jax.jit, static_argnames=("cfg", "lora_scale", "remat"))
def forward(params: dict, cfg: ModelConfig, input_ids: jax.Array, attention_mask: jax.Array | None = None,
            positions: jax.Array | None = None, segment_ids: jax.Array | None = None, *,
            lora_scale: float | None = None, remat: str = "none") -> jax.Array:
    """Logits [B, S, V] (float32) for input_ids [B, S] int32."""
    batch = make_batch(input_ids, attention_mask, positions, segment_ids)
    h = hidden_states(params, cfg, input_ids, batch, lora_scale=lora_scale, remat=remat)
    return logits_from_hidden(cfg, params, h)
