"""Self-attention of one decoder layer: q/k/v/o projections, optional q/k norms (Qwen3, Gemma 3), RoPE (on the
first rotary_dim dims of each head: Phi-3's partial rotary), GQA attention, optional attention sinks (gpt-oss)."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from unsloth_jax import ops
from unsloth_jax.config import ModelConfig
from unsloth_jax.models.layers import Linear, RMSNorm


class Batch(NamedTuple):
    """Per-token side inputs shared by all layers. Arrays are [B, S] unless noted."""

    positions: jax.Array
    kv_valid: jax.Array | None  # attention_mask (1 = real token); None when there is no padding
    segment_ids: jax.Array | None  # packing: attend only within equal ids
    kv_lengths: jax.Array | None = None  # [B] real lengths when the padding is known to be on the right


class KVCache(NamedTuple):
    """One layer's decoding cache: keys and values [B, T, Hkv, hd], slot validity [B, T], write index."""

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    index: jax.Array


class Attention(nnx.Module):
    """Self-attention with the family switches of `cfg` (biases, q/k norm, softcap, query scale)."""

    def __init__(self, cfg: ModelConfig, *, stack: tuple[int, ...] = (), dtype=jnp.float32, rngs: nnx.Rngs):
        d, hd = cfg.hidden_size, cfg.head_dim
        hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, hd
        self.rotary_dim = cfg.rope_dim
        self.scale = cfg.scale
        self.softcap = cfg.attn_softcap
        common = dict(stack=stack, dtype=dtype, rngs=rngs)
        self.q_proj = Linear(d, hq * hd, use_bias=cfg.qkv_bias, **common)
        self.k_proj = Linear(d, hkv * hd, use_bias=cfg.qkv_bias, **common)
        self.v_proj = Linear(d, hkv * hd, use_bias=cfg.qkv_bias, **common)
        self.o_proj = Linear(hq * hd, d, use_bias=cfg.o_bias, **common)
        norm = dict(eps=cfg.rms_norm_eps, offset=cfg.norm_offset, stack=stack, dtype=dtype)
        self.q_norm = nnx.data(RMSNorm(hd, **norm) if cfg.qk_norm else None)
        self.k_norm = nnx.data(RMSNorm(hd, **norm) if cfg.qk_norm else None)
        # gpt-oss: one learned softmax-denominator logit per query head [*stack, Hq] (frozen)
        self.sinks = nnx.data(nnx.Param(jnp.zeros((*stack, hq), dtype)) if cfg.attn_sinks else None)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, batch: Batch, window: int | None,
                 cache: KVCache | None = None) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """x [B, S, D] (already normed) -> ([B, S, D], new (k, v) cache arrays or None).

        With `cache`, the new keys/values are written at `cache.index` and attention runs over the whole cache.
        """
        b, s, _ = x.shape
        q = self.q_proj(x).reshape(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = self.rotate(q, k, cos, sin)
        new_cache = None
        sinks = None if self.sinks is None else jax.lax.stop_gradient(self.sinks[...])
        if cache is None:
            # names for the "save_attention" remat policy (unsloth_jax.models.decoder.remat)
            q, k, v = (checkpoint_name(t, n) for t, n in ((q, "attn_q"), (k, "attn_k"), (v, "attn_v")))
            out = ops.attention(q, k, v, scale=self.scale, causal=True, window=window, softcap=self.softcap,
                                kv_valid=batch.kv_valid, segment_ids=batch.segment_ids, kv_lengths=batch.kv_lengths,
                                sinks=sinks)
            out = checkpoint_name(out, "attn_out")
        else:
            ck = jax.lax.dynamic_update_slice_in_dim(cache.k, k.astype(cache.k.dtype), cache.index, axis=1)
            cv = jax.lax.dynamic_update_slice_in_dim(cache.v, v.astype(cache.v.dtype), cache.index, axis=1)
            out = ops.attention(q, ck, cv, scale=self.scale, causal=True, window=window, softcap=self.softcap,
                                kv_valid=cache.valid, q_offset=cache.index, sinks=sinks)
            new_cache = (ck, cv)
        return self.o_proj(out.reshape(b, s, self.num_heads * self.head_dim)), new_cache

    def rotate(self, q: jax.Array, k: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """RoPE on q [B, S, Hq, hd] and k [B, S, Hkv, hd] with cos/sin [B, S, rotary_dim]; the dims past
        rotary_dim pass through unrotated (partial rotary)."""
        r = self.rotary_dim
        if r == self.head_dim:
            return ops.rope(q, k, cos, sin)
        q_rot, k_rot = ops.rope(q[..., :r], k[..., :r], cos, sin)
        return (jnp.concatenate([q_rot, q[..., r:]], axis=-1), jnp.concatenate([k_rot, k[..., r:]], axis=-1))
