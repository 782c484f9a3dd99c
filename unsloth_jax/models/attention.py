"""Self-attention of one decoder layer: q/k/v/o projections, optional q/k norms (Qwen3, Gemma 3) and value norm
(Gemma 4), RoPE (on the first rotary_dim dims of each head: Phi-3's partial rotary; none in SmolLM3's NoPE
layers, given cos = None), GQA attention, optional attention sinks (gpt-oss), optional output gate (Qwen3.5: q_proj
gives each head's query then its gate, and the attention output is multiplied by sigmoid(gate) before o_proj), and
Gemma 4's KV-shared layers (attending over an earlier layer's keys/values)."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from unsloth_jax import ops
from unsloth_jax.config import ModelConfig, attention_dims
from unsloth_jax.models.layers import Linear, RMSNorm


class Batch(NamedTuple):
    """Per-token side inputs shared by all layers. Arrays are [B, S] unless noted."""

    positions: jax.Array
    kv_valid: jax.Array | None  # attention_mask (1 = real token); None when there is no padding
    segment_ids: jax.Array | None  # packing: attend only within equal ids
    kv_lengths: jax.Array | None = None  # [B] real lengths when the padding is known to be on the right
    block_ids: jax.Array | None = None  # bidirectional blocks (Gemma 3 images): equal ids >= 0, -1 elsewhere


class KVCache(NamedTuple):
    """One layer's contiguous decoding cache: keys and values [B, T, Hkv, hd], slot validity [B, T], write index
    (every row writes its S new tokens at slots index .. index + S - 1)."""

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    index: jax.Array

    def attend(self, q, k, v, *, scale, window, softcap, sinks):
        """Write k/v [B, S, Hkv, hd] at `index`, attend q [B, S, Hq, hd] over the whole cache -> (out, (k, v))."""
        ck = jax.lax.dynamic_update_slice_in_dim(self.k, k.astype(self.k.dtype), self.index, axis=1)
        cv = jax.lax.dynamic_update_slice_in_dim(self.v, v.astype(self.v.dtype), self.index, axis=1)
        out = ops.attention(q, ck, cv, scale=scale, causal=True, window=window, softcap=softcap,
                            kv_valid=self.valid, q_offset=self.index, sinks=sinks)
        return out, (ck, cv)

    def read(self, q, fresh, arrays, *, scale, window, softcap, sinks):
        """Attend q over another layer's updated cache `arrays` (k, v) without writing (a KV-shared layer)."""
        return ops.attention(q, arrays[0], arrays[1], scale=scale, causal=True, window=window, softcap=softcap,
                             kv_valid=self.valid, q_offset=self.index, sinks=sinks)


class PagedPrefill(NamedTuple):
    """One layer's page pool while a batch of prompts is prefilled: the prompts attend to themselves only.

    k_pages / v_pages [P, BS, Hkv, hd] (P pages of BS token slots); slots [B, S] int32: the flat slot
    (page * BS + offset) each prompt token's key and value go to (padding tokens: a slot of the scratch page);
    lengths [B] int32: real tokens per row (rows are right padded); block_ids [B, S] int32 or None: blocks of
    tokens that attend to each other both ways (Gemma 3's images; ops.attention's block_ids)."""

    k_pages: jax.Array
    v_pages: jax.Array
    slots: jax.Array
    lengths: jax.Array
    block_ids: jax.Array | None = None

    def attend(self, q, k, v, *, scale, window, softcap, sinks):
        valid = (jnp.arange(q.shape[1])[None, :] < self.lengths[:, None]).astype(jnp.int32)
        out = ops.attention(q, k, v, scale=scale, causal=True, window=window, softcap=softcap, kv_valid=valid,
                            kv_lengths=self.lengths, sinks=sinks, block_ids=self.block_ids)
        return out, write_pages(self.k_pages, self.v_pages, self.slots, k, v)

    def read(self, q, fresh, arrays, *, scale, window, softcap, sinks):
        """Attend q over another layer's keys/values of these prompts, `fresh` (k, v), without writing."""
        valid = (jnp.arange(q.shape[1])[None, :] < self.lengths[:, None]).astype(jnp.int32)
        return ops.attention(q, fresh[0], fresh[1], scale=scale, causal=True, window=window, softcap=softcap,
                             kv_valid=valid, kv_lengths=self.lengths, sinks=sinks, block_ids=self.block_ids)


class PagedDecode(NamedTuple):
    """One layer's page pool during decoding: one new token per row.

    slots [B] int32: where the new token's key/value go; block_tables [B, MAXB] int32: each row's pages in
    order; lengths [B] int32: the row's tokens including the new one (0: an idle row)."""

    k_pages: jax.Array
    v_pages: jax.Array
    slots: jax.Array
    block_tables: jax.Array
    lengths: jax.Array

    def attend(self, q, k, v, *, scale, window, softcap, sinks):
        kp, vp = write_pages(self.k_pages, self.v_pages, self.slots[:, None], k, v)
        out = ops.paged_attention(q[:, 0], kp, vp, self.block_tables, self.lengths, scale=scale, window=window,
                                  softcap=softcap, sinks=sinks)
        return out[:, None], (kp, vp)

    def read(self, q, fresh, arrays, *, scale, window, softcap, sinks):
        """Attend q over another layer's updated page pools `arrays` (k, v), this layer's own left unwritten."""
        out = ops.paged_attention(q[:, 0], arrays[0], arrays[1], self.block_tables, self.lengths, scale=scale,
                                  window=window, softcap=softcap, sinks=sinks)
        return out[:, None]


def _own_arrays(cache):
    """A cache's arrays as its `attend` returns them updated: the page pools of a paged cache, else (k, v)."""
    return (cache.k_pages, cache.v_pages) if hasattr(cache, "k_pages") else (cache.k, cache.v)


def _weightless_rms_norm(x: jax.Array, eps: float) -> jax.Array:
    """x * (mean(x^2) + eps) ** -0.5 over the last axis, in float32, back in x's dtype (Gemma 4's value norm)."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def write_pages(k_pages, v_pages, slots, k, v):
    """k/v [B, S, Hkv, hd] written into the page pools [P, BS, Hkv, hd] at the flat slots [B, S] -> new pools."""
    p, bs = k_pages.shape[:2]
    flat = slots.reshape(-1)

    def put(pages, new):
        rows = pages.reshape(p * bs, *pages.shape[2:])
        rows = rows.at[flat].set(new.reshape(-1, *new.shape[2:]).astype(pages.dtype), mode="drop",
                                 unique_indices=False)
        return rows.reshape(pages.shape)

    return put(k_pages, k), put(v_pages, v)


class Attention(nnx.Module):
    """Self-attention with the family switches of `cfg` (biases, q/k norm, softcap, query scale).

    kind: which of the layer's attention submodules this is (config.KIND_MODULES; Gemma 4): "self_attn" (the
    model's head_dim / num_key_value_heads), "global_attn" (the full-attention layers' global_head_dim /
    global_kv_heads, RoPE over the whole head, and with attention_k_eq_v no v_proj: the values are k_proj's
    output, v-normed), "shared_attn" / "shared_global_attn" (KV-shared layers: no k_proj, v_proj or k_norm)."""

    def __init__(self, cfg: ModelConfig, *, stack: tuple[int, ...] = (), dtype=jnp.float32, rngs: nnx.Rngs,
                 kind: str = "self_attn"):
        d = cfg.hidden_size
        hd, hkv = attention_dims(cfg, kind)
        hq = cfg.num_attention_heads
        glob = kind in ("global_attn", "shared_global_attn")
        own_kv = not kind.startswith("shared_")
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, hd
        self.rotary_dim = hd if glob else cfg.rope_dim
        self.scale = cfg.scale
        self.softcap = cfg.attn_softcap
        common = dict(stack=stack, dtype=dtype, rngs=rngs)
        self.output_gate = cfg.attn_output_gate
        self.q_proj = Linear(d, hq * hd * (2 if cfg.attn_output_gate else 1), use_bias=cfg.qkv_bias, **common)
        self.k_proj = nnx.data(Linear(d, hkv * hd, use_bias=cfg.qkv_bias, **common) if own_kv else None)
        self.v_proj = nnx.data(Linear(d, hkv * hd, use_bias=cfg.qkv_bias, **common)
                               if own_kv and not (glob and cfg.attention_k_eq_v) else None)
        self.o_proj = Linear(hq * hd, d, use_bias=cfg.o_bias, **common)
        norm = dict(eps=cfg.rms_norm_eps, offset=cfg.norm_offset, stack=stack, dtype=dtype)
        self.q_norm = nnx.data(RMSNorm(hd, **norm) if cfg.qk_norm else None)
        self.k_norm = nnx.data(RMSNorm(hd, **norm) if cfg.qk_norm and own_kv else None)
        self.v_norm_eps = float(cfg.rms_norm_eps) if cfg.v_norm else None  # Gemma 4: weightless norm of values
        # gpt-oss: one learned softmax-denominator logit per query head [*stack, Hq] (frozen)
        self.sinks = nnx.data(nnx.Param(jnp.zeros((*stack, hq), dtype)) if cfg.attn_sinks else None)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, batch: Batch, window: int | None,
                 cache: KVCache | None = None, shared: tuple | None = None):
        """x [B, S, D] (already normed) -> ([B, S, D], new (k, v) cache arrays or None, (k, v)). cos/sin None:
        this layer applies no RoPE (a NoPE layer, ModelConfig.layer_rope).

        With `cache` (KVCache, PagedPrefill or PagedDecode), the cache writes the new keys/values and runs the
        attention (`cache.attend`); the second item is then the cache's new arrays. The third is this layer's
        keys/values [B, S, Hkv, hd] after their norms and RoPE (what a KV-shared layer reads).
        shared: ((k, v), cache arrays or None) of the earlier layer a KV-shared layer (Gemma 4) attends over; this
        layer (a shared_attn kind) has no k/v projections, its cache (if any) unwritten and returned as it is, and the
        third item is None.
        """
        b, s, _ = x.shape
        gate = None
        if self.output_gate:  # Qwen3.5: per head [query (hd), gate (hd)]
            q, gate = jnp.split(self.q_proj(x).reshape(b, s, self.num_heads, 2 * self.head_dim), 2, axis=-1)
        else:
            q = self.q_proj(x).reshape(b, s, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if shared is None:
            k = self.k_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim)
            # attention_k_eq_v (Gemma 4's full layers): the values are the key projection, before its norm and RoPE
            v = k if self.v_proj is None else self.v_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim)
            if self.k_norm is not None:
                k = self.k_norm(k)
            if self.v_norm_eps is not None:
                v = _weightless_rms_norm(v, self.v_norm_eps)
        if cos is not None:  # None: a NoPE layer (SmolLM3), no rotary embedding at all
            if shared is None:
                q, k = self.rotate(q, k, cos, sin)
            else:
                q, _ = self.rotate(q, q[:, :, :1], cos, sin)  # ops.rope rotates a pair: a dropped one-head k
        new_cache = None
        sinks = None if self.sinks is None else jax.lax.stop_gradient(self.sinks[...])
        common = dict(scale=self.scale, window=window, softcap=self.softcap, sinks=sinks)
        if shared is not None:
            (k, v), arrays = shared
            if cache is None:
                out = ops.attention(q, k, v, causal=True, kv_valid=batch.kv_valid, segment_ids=batch.segment_ids,
                                    kv_lengths=batch.kv_lengths, block_ids=batch.block_ids, **common)
            else:  # attend over the other layer's cache; this layer's own stays as it is
                out = cache.read(q, (k, v), arrays, **common)
                new_cache = _own_arrays(cache)
            kv = None
        elif cache is None:
            # names for the "save_attention" remat policy (unsloth_jax.models.layer_stack)
            q, k, v = (checkpoint_name(t, n) for t, n in ((q, "attn_q"), (k, "attn_k"), (v, "attn_v")))
            out = ops.attention(q, k, v, causal=True, kv_valid=batch.kv_valid, segment_ids=batch.segment_ids,
                                kv_lengths=batch.kv_lengths, block_ids=batch.block_ids, **common)
            out = checkpoint_name(out, "attn_out")
            kv = (k, v)
        else:  # KVCache, PagedPrefill or PagedDecode: the cache writes this call's keys/values and attends
            out, new_cache = cache.attend(q, k, v, **common)
            kv = (k, v)
        out = out.reshape(b, s, self.num_heads * self.head_dim)
        if gate is not None:
            out = out * jax.nn.sigmoid(gate.reshape(out.shape)).astype(out.dtype)
        return self.o_proj(out), new_cache, kv

    def rotate(self, q: jax.Array, k: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """RoPE on q [B, S, Hq, hd] and k [B, S, Hkv, hd] with cos/sin [B, S, rotary_dim]; the dims past
        rotary_dim pass through unrotated (partial rotary)."""
        r = self.rotary_dim
        if r == self.head_dim:
            return ops.rope(q, k, cos, sin)
        q_rot, k_rot = ops.rope(q[..., :r], k[..., :r], cos, sin)
        return (jnp.concatenate([q_rot, q[..., r:]], axis=-1), jnp.concatenate([k_rot, k[..., r:]], axis=-1))
