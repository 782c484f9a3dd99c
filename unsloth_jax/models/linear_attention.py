"""Qwen3.5's token mixer of its linear-attention layers: gated DeltaNet (transformers' Qwen3_5GatedDeltaNet).

Module tree under a decoder layer's `linear_attn` (HF names; stacked over the linear-attention layers only,
config.stack_holders, written L below, as the full-attention layers' `self_attn` is over theirs):

    in_proj_qkv.kernel [L, D, C]   C = 2 Hk Dk + Hv Dv: q, k, v before the conv      (Linear, LoRA-able)
    in_proj_z.kernel [L, D, Hv Dv] the output gate; in_proj_b / in_proj_a .kernel [L, D, Hv]: beta and the decay
    conv1d.weight [L, C, 1, K]     depthwise causal conv (HF's Conv1d layout), no bias
    A_log [L, Hv], dt_bias [L, Hv] the decay: g = -exp(A_log) softplus(a + dt_bias)
    norm.weight [L, Dv]            the gated RMSNorm (plain weight, not 1 + w)
    out_proj.kernel [L, Hv Dv, D]

Compute over x [B, S, D]: qkv = silu(causal_conv(in_proj_qkv(x))); q, k L2-normalized (float32); beta =
sigmoid(in_proj_b(x)); o = ops.gated_delta_rule(q, k, v, g, beta, scale=Dk ** -0.5); out_proj(norm(o) *
silu(in_proj_z(x))). Padding (attention_mask 0) is zeroed at the input, as transformers does, and carries the
state unchanged (g = 0, beta = 0); packing restarts the state at each segment start (g = -1e4 there) and keeps
the conv inside a segment.

Generation keeps two arrays per row and linear layer beside the paged KV cache of the attention layers
(`RecurrentState`): the conv window (the last K-1 conv inputs) and the delta-rule state.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from unsloth_jax import ops
from unsloth_jax.config import ModelConfig
from unsloth_jax.models.layers import INIT_STD, Linear

LINEAR_PROJS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
SEGMENT_START_DECAY = -1e4  # log decay at a packed segment's first token: exp(g) = 0 restarts the state


class RecurrentState(NamedTuple):
    """One linear-attention layer's generation state of R rows: conv [R, C, K-1] (the last K-1 conv inputs, in
    the compute dtype) and state [R, Hv, Dk, Dv] float32 (the delta-rule state)."""

    conv: jax.Array
    state: jax.Array


class RecurrentPrefill(NamedTuple):
    """A linear layer's rows while prompts [P, S] (right padded, `lengths` [P]) are prefilled: the prompts run
    from a zero state, and each admitted row `targets[n]` takes the final state of prompt `prompt_of[n]` (targets
    out of range [0, R) are dropped)."""

    conv: jax.Array
    state: jax.Array
    lengths: jax.Array
    prompt_of: jax.Array
    targets: jax.Array


class RecurrentDecode(NamedTuple):
    """A linear layer's rows during decoding (one token per row); rows not `live` [R] keep their state."""

    conv: jax.Array
    state: jax.Array
    live: jax.Array


def make_state(cfg: ModelConfig, rows: int, dtype) -> RecurrentState:
    """Zeroed generation state of `rows` rows for one linear-attention layer."""
    return RecurrentState(
        jnp.zeros((rows, cfg.linear_conv_dim, cfg.linear_conv_kernel - 1), dtype),
        jnp.zeros((rows, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
                  jnp.float32))


def causal_conv(x: jax.Array, weight: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """Depthwise causal conv: x [B, S, C], weight [C, K] -> [B, S, C] with out[t] = sum_j weight[:, K-1-j] x[t-j]
    (zeros before the start; with segment_ids [B, S], only taps of the same segment)."""
    k = weight.shape[-1]
    w = weight.astype(jnp.float32)
    xf = x.astype(jnp.float32)
    out = xf * w[:, k - 1]
    for j in range(1, k):
        shifted = jnp.pad(xf, ((0, 0), (j, 0), (0, 0)))[:, :x.shape[1]]
        if segment_ids is not None:
            same = segment_ids == jnp.pad(segment_ids, ((0, 0), (j, 0)), constant_values=-1)[:, :x.shape[1]]
            shifted = shifted * same[..., None]
        out = out + shifted * w[:, k - 1 - j]
    return out.astype(x.dtype)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x * rsqrt(sum(x^2) + eps) over the last axis, in float32 (transformers' / FLA's l2norm)."""
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)


class DepthwiseConv1d(nnx.Module):
    """The conv1d's weight [*stack, C, 1, K] in HF's Conv1d layout (groups = C, no bias)."""

    def __init__(self, channels: int, kernel: int, *, stack: tuple[int, ...] = (), dtype=jnp.float32,
                 rngs: nnx.Rngs):
        shape = (*stack, channels, 1, kernel)
        self.weight = nnx.Param((INIT_STD * 10 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))


class GatedRMSNorm(nnx.Module):
    """transformers' Qwen3_5RMSNormGated: weight * rmsnorm(x) (cast to x's dtype first) * silu(gate), over the
    last axis; weight [*stack, dim] (initialised to 1)."""

    def __init__(self, dim: int, *, eps: float, stack: tuple[int, ...] = (), dtype=jnp.float32):
        self.eps = float(eps)
        self.weight = nnx.Param(jnp.ones((*stack, int(dim)), dtype))

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        normed = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)).astype(x.dtype)
        y = (self.weight[...] * normed).astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
        return y.astype(x.dtype)


class GatedDeltaNet(nnx.Module):
    """Qwen3.5's linear attention (module docstring), with the sizes of `cfg`'s linear_* fields."""

    def __init__(self, cfg: ModelConfig, *, stack: tuple[int, ...] = (), dtype=jnp.float32, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_kernel = cfg.linear_conv_kernel
        common = dict(stack=stack, dtype=dtype, rngs=rngs)
        self.in_proj_qkv = Linear(d, cfg.linear_conv_dim, **common)
        self.in_proj_z = Linear(d, self.value_dim, **common)
        self.in_proj_b = Linear(d, self.num_v_heads, **common)
        self.in_proj_a = Linear(d, self.num_v_heads, **common)
        self.conv1d = DepthwiseConv1d(cfg.linear_conv_dim, cfg.linear_conv_kernel, **common)
        self.dt_bias = nnx.Param(jnp.ones((*stack, self.num_v_heads), dtype))
        a = jax.random.uniform(rngs.params(), (*stack, self.num_v_heads), jnp.float32, 1.0, 16.0)
        self.A_log = nnx.Param(jnp.log(a).astype(dtype))
        self.norm = GatedRMSNorm(self.head_v_dim, eps=cfg.rms_norm_eps, stack=stack, dtype=dtype)
        self.out_proj = Linear(self.value_dim, d, **common)

    def __call__(self, x: jax.Array, batch, cache=None):
        """x [B, S, D] (already normed) -> ([B, S, D], the cache's new RecurrentState or None). batch: the
        decoder's Batch (kv_valid: padding; segment_ids: packing). cache: None (a whole sequence from a zero
        state), RecurrentPrefill (prompts: their final states go to the admitted rows) or RecurrentDecode."""
        b, s, _ = x.shape
        valid = None if batch is None else batch.kv_valid
        if isinstance(cache, RecurrentPrefill):
            valid = (jnp.arange(s)[None, :] < cache.lengths[:, None]).astype(jnp.int32)
        if valid is not None:  # transformers zeroes the padding tokens' inputs
            x = x * valid[..., None].astype(x.dtype)
        mixed = self.in_proj_qkv(x)  # [B, S, C]
        z = self.in_proj_z(x).reshape(b, s, self.num_v_heads, self.head_v_dim)
        beta = jax.nn.sigmoid(self.in_proj_b(x).astype(jnp.float32))
        a = self.in_proj_a(x).astype(jnp.float32)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a + self.dt_bias[...].astype(jnp.float32))
        weight = self.conv1d.weight[...][:, 0, :]  # [C, K]
        segments = None if batch is None else batch.segment_ids
        initial, new_conv = None, None
        if isinstance(cache, RecurrentDecode):
            window = jnp.concatenate([jnp.swapaxes(cache.conv, 1, 2).astype(mixed.dtype), mixed], axis=1)  # [B, K, C]
            conv = jnp.einsum("bkc,ck->bc", window.astype(jnp.float32), weight.astype(jnp.float32))[:, None]
            conv = conv.astype(mixed.dtype)
            new_conv = jnp.swapaxes(window[:, 1:], 1, 2).astype(cache.conv.dtype)
            initial = cache.state
        else:
            conv = causal_conv(mixed, weight, segments)
            if isinstance(cache, RecurrentPrefill):  # the last K-1 real inputs of each prompt (zeros before it)
                idx = cache.lengths[:, None] - (self.conv_kernel - 1) + jnp.arange(self.conv_kernel - 1)[None]
                last = jnp.take_along_axis(mixed, jnp.maximum(idx, 0)[..., None], axis=1)
                new_conv = jnp.swapaxes(jnp.where((idx >= 0)[..., None], last, 0), 1, 2)
        conv = jax.nn.silu(conv)
        q, k, v = jnp.split(conv, [self.key_dim, 2 * self.key_dim], axis=-1)
        q = l2_normalize(q.reshape(b, s, self.num_k_heads, self.head_k_dim))
        k = l2_normalize(k.reshape(b, s, self.num_k_heads, self.head_k_dim))
        v = v.reshape(b, s, self.num_v_heads, self.head_v_dim)
        if valid is not None:  # padding carries the state through unchanged
            keep = valid[..., None].astype(bool)
            g, beta = jnp.where(keep, g, 0.0), jnp.where(keep, beta, 0.0)
        if segments is not None:
            start = segments != jnp.pad(segments, ((0, 0), (1, 0)), constant_values=-1)[:, :s]
            g = jnp.where(start[..., None], SEGMENT_START_DECAY, g)
        o, final = ops.gated_delta_rule(q, k, v, g, beta, initial, scale=self.head_k_dim ** -0.5)
        o = self.norm(o, z).reshape(b, s, self.value_dim)
        out = self.out_proj(o)
        new_cache = None
        if isinstance(cache, RecurrentDecode):
            live = cache.live[:, None, None]
            new_cache = RecurrentState(jnp.where(live, new_conv, cache.conv),
                                       jnp.where(live[..., None], final, cache.state))
        elif isinstance(cache, RecurrentPrefill):
            new_cache = RecurrentState(
                cache.conv.at[cache.targets].set(new_conv[cache.prompt_of].astype(cache.conv.dtype), mode="drop"),
                cache.state.at[cache.targets].set(final[cache.prompt_of], mode="drop"))
        return out, new_cache


__all__ = ["GatedDeltaNet", "GatedRMSNorm", "DepthwiseConv1d", "RecurrentState", "RecurrentPrefill",
           "RecurrentDecode", "LINEAR_PROJS", "make_state", "causal_conv", "l2_normalize"]
