"""Mixture-of-experts MLP (Qwen3-MoE, Mixtral, gpt-oss): a float32 router, top-k routing, and the experts run as
grouped GEMMs over the tokens sorted by expert.

Module tree under a decoder layer's `mlp` (names follow transformers 5; the router is `gate`, or `router` for
gpt-oss), stacked on the layer axis L like every other decoder variable:

    mlp.gate.kernel [L, D, E]  (+ .bias [L, E]: gpt-oss)                       the router (HF weight [E, D], transposed)
    mlp.experts.gate_up_proj.kernel [L, E, D, 2F]  (+ .bias [L, E, 2F]: gpt-oss)   gate and up, concatenated
                                                     (gpt-oss: interleaved, gate = [..., 0::2], up = [..., 1::2])
    mlp.experts.down_proj.kernel    [L, E, F, D]   (+ .bias [L, E, D])
    mlp.experts.<proj>.lora_a [L, E, in, r], lora_b [L, E, r, out]   nnx.LoRAParam (float32), PEFT's
                                                     target_parameters on the fused expert weights
    mlp.{gate,up,down}_proj   (Linear)   only when some layers are dense (Qwen3-MoE mlp_only_layers /
                                         decoder_sparse_step); those layers hold zeros in the expert stacks and
                                         the MoE layers zeros here, so the stacked layers keep one structure

Compute of one MoE layer over T tokens (N = T * top_k rows, no [T, E, D] buffer and no per-expert loop):

    logits = x @ router (float32)  ->  top-k weights [T, k] (float32) and experts [T, k]
    rows sorted by expert (stable argsort of the T*k assignments), group_sizes [E] = rows per expert
    h = grouped_matmul(x[token of row], gate_up[E, D, 2F], group_sizes)  (+ LoRA: two more, rank r)
    y = grouped_matmul(act(h), down[E, F, D], group_sizes) * weight of row
    out[t] = sum of the k rows of token t (gathered back in token order)

`ops.grouped_matmul` is the grouped GEMM: the Pallas kernel (pallas_kernels.grouped_matmul) for 16-bit rows on
a GPU, jax.lax.ragged_dot elsewhere (XLA's GPU lowering of ragged_dot is a dense product against every expert).
The frozen expert weights get no gradient (stop_gradient), so their grouped GEMMs are differentiated for dX
only. The LoRA factors need weight gradients, dW[e] = x_e^T g_e; `ragged_matmul` computes them as one batched
GEMM over row tiles (`grouped_weight_grad`) rather than a ragged contraction, which XLA's GPU compiler rewrites
into a dense dot over a zero-padded [E, N, K] copy of x.

The router statistics of each layer (`RouterStats`) give transformers' load-balancing loss
(`load_balancing_loss`).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from unsloth_jax import ops
from unsloth_jax.config import ModelConfig
from unsloth_jax.models.layers import INIT_STD, Buffer, Linear

EXPERT_PROJS = ("gate_up_proj", "down_proj")
# PEFT's target_parameters names of the expert weights (the parameter paths under a decoder layer).
EXPERT_PARAMETERS = {f"mlp.experts.{p}": p for p in EXPERT_PROJS}


class RouterStats(NamedTuple):
    """One MoE layer's routing over its tokens (padding excluded), [..., E] float32: the summed softmax
    probabilities, the number of top-k assignments per expert, and the number of tokens (scalar per layer)."""

    prob_sum: jax.Array
    counts: jax.Array
    rows: jax.Array


class GroupedLinear(Linear):
    """E projections of one expert block: rows of expert e get x @ kernel[e] (+ bias[e]) (+ LoRA).

    A `Linear` whose stack ends in the expert axis: kernel nnx.Param [*stack, E, in, out]; bias [*stack, E, out]
    or None; lora_a / lora_b nnx.LoRAParam [*stack, E, in, r] / [*stack, E, r, out] (float32) or None;
    lora_scale a static float. Called on rows grouped by expert instead of on a batch.
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, *, use_bias: bool = False,
                 stack: tuple[int, ...] = (), dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(in_features, out_features, use_bias=use_bias, stack=(*stack, int(num_experts)),
                         dtype=dtype, rngs=rngs)
        self.num_experts = int(num_experts)

    def __call__(self, x: jax.Array, group_sizes: jax.Array, row_expert: jax.Array) -> jax.Array:
        """x [N, in] with rows grouped by expert (group_sizes [E] int32, row_expert [N] the expert of each row)
        -> [N, out] in x.dtype."""
        lora = None if self.lora_a is None else (self.lora_a[...], self.lora_b[...], self.lora_scale)
        bias = None if self.bias is None else self.bias[...]
        return grouped_linear(x, self.kernel[...], group_sizes, bias=bias, row_expert=row_expert, lora=lora)


WGRAD_TILE = 128  # rows per tile of grouped_weight_grad


def grouped_weight_grad(x: jax.Array, g: jax.Array, group_sizes: jax.Array, tile: int = WGRAD_TILE) -> jax.Array:
    """dW[e] = x[rows of e]^T @ g[rows of e] for rows grouped by expert: x [N, K], g [N, M], group_sizes [E]
    -> [E, K, M] float32 (rows past sum(group_sizes) count for no expert).

    The rows are cut at every tile boundary (multiples of `tile`) and every group start, which gives at most
    N/tile + E segments, each inside one tile and one group. Each segment's tile of x and g (rows outside the
    segment zeroed) makes one product of a batched GEMM [W, K, tile] @ [W, tile, M], and the W partial sums
    are added per group. Memory: about (1 + E * tile / N) times x and g, plus W x K x M partials."""
    n, k = x.shape
    e = group_sizes.shape[0]
    tiles = -(-n // tile)
    pad = tiles * tile - n
    xt = jnp.pad(x, ((0, pad), (0, 0))).reshape(tiles, tile, k)
    gt = jnp.pad(g, ((0, pad), (0, 0))).reshape(tiles, tile, g.shape[1])
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    points = jnp.sort(jnp.concatenate([jnp.arange(tiles, dtype=starts.dtype) * tile, starts]))
    stops = jnp.concatenate([points[1:], jnp.full((1,), tiles * tile, points.dtype)])
    seg_tile = jnp.minimum(points // tile, tiles - 1)
    seg_group = jnp.minimum(jnp.searchsorted(ends, points, side="right"), e - 1)  # past the end: masked below
    rows = seg_tile[:, None] * tile + jnp.arange(tile)[None, :]
    inside = (rows >= points[:, None]) & (rows < jnp.minimum(stops, ends[-1])[:, None])
    gs = jnp.where(inside[..., None], jnp.take(gt, seg_tile, axis=0), 0).astype(g.dtype)
    partial = jnp.einsum("wtk,wtm->wkm", jnp.take(xt, seg_tile, axis=0), gs, preferred_element_type=jnp.float32)
    return jax.ops.segment_sum(partial, seg_group, num_segments=e)


@jax.custom_vjp
def ragged_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """ops.grouped_matmul(x [N, K], w [E, K, M], group_sizes) -> [N, M] (the LoRA factors' grouped GEMMs),
    whose gradient for w comes from grouped_weight_grad (tiles) instead of XLA's dense rewrite of the ragged
    contraction; dX is a grouped GEMM too."""
    return ops.grouped_matmul(x, w, group_sizes)


def _ragged_matmul_fwd(x, w, group_sizes):
    return ops.grouped_matmul(x, w, group_sizes), (x, w, group_sizes)


def _ragged_matmul_bwd(res, g):
    x, w, group_sizes = res
    dx = ops.grouped_matmul(g, jnp.swapaxes(w, 1, 2), group_sizes)
    dw = grouped_weight_grad(x, g, group_sizes).astype(w.dtype)
    return dx, dw, None


ragged_matmul.defvjp(_ragged_matmul_fwd, _ragged_matmul_bwd)


def grouped_linear(x: jax.Array, kernel: jax.Array, group_sizes: jax.Array, *, bias=None, row_expert=None,
                   lora=None) -> jax.Array:
    """Grouped GEMM: x [N, in] (rows sorted by expert) @ kernel [E, in, out] per group -> [N, out] in x.dtype.

    The frozen kernel is wrapped in stop_gradient (no gradient is ever formed for it); lora = (a [E, in, r],
    b [E, r, out], scale) adds scale * (x @ a[e]) @ b[e] as two rank-r grouped GEMMs (ragged_matmul, so the
    factors' gradients are tiled batched GEMMs); bias [E, out] is added per row (row_expert [N] names each
    row's expert)."""
    y = ops.grouped_matmul(x, jax.lax.stop_gradient(kernel).astype(x.dtype), group_sizes)
    if lora is not None:
        a, b, scale = lora
        xa = ragged_matmul(x, a.astype(x.dtype), group_sizes)
        y = y + (scale * ragged_matmul(xa, b.astype(x.dtype), group_sizes)).astype(x.dtype)
    if bias is not None:
        y = y + jnp.take(jax.lax.stop_gradient(bias), row_expert, axis=0).astype(x.dtype)
    return y


class Experts(nnx.Module):
    """The E experts of one MoE layer (HF's `mlp.experts`): fused gate_up_proj [E, D, 2F] and down_proj [E, F, D]."""

    def __init__(self, cfg: ModelConfig, *, stack: tuple[int, ...] = (), dtype=jnp.float32, rngs: nnx.Rngs):
        e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        common = dict(use_bias=cfg.expert_bias, stack=stack, dtype=dtype, rngs=rngs)
        self.gate_up_proj = GroupedLinear(e, d, 2 * f, **common)
        self.down_proj = GroupedLinear(e, f, d, **common)


class Router(nnx.Module):
    """logits = x @ kernel (+ bias) in float32; kernel [*stack, D, E] (HF's [E, D] weight transposed), frozen.
    score_bias (GLM-4.5): e_score_correction_bias [*stack, E], which `route` adds to the scores for the choice
    only (not part of the logits)."""

    def __init__(self, hidden: int, num_experts: int, *, use_bias: bool, stack: tuple[int, ...] = (),
                 dtype=jnp.float32, rngs: nnx.Rngs, score_bias: bool = False):
        shape = (*stack, int(hidden), int(num_experts))
        self.kernel = nnx.Param((INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))
        self.bias = nnx.data(nnx.Param(jnp.zeros((*stack, int(num_experts)), dtype)) if use_bias else None)
        self.e_score_correction_bias = nnx.data(  # a buffer in transformers
            Buffer(jnp.zeros((*stack, int(num_experts)), dtype)) if score_bias else None)

    def score_bias(self) -> jax.Array | None:
        """The e_score_correction_bias [E] float32 (frozen), or None."""
        b = self.e_score_correction_bias
        return None if b is None else jax.lax.stop_gradient(b[...]).astype(jnp.float32)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [T, D] -> router logits [T, E] float32."""
        w = jax.lax.stop_gradient(self.kernel[...]).astype(jnp.float32)
        logits = jnp.einsum("td,de->te", x.astype(jnp.float32), w, preferred_element_type=jnp.float32)
        if self.bias is not None:
            logits = logits + jax.lax.stop_gradient(self.bias[...]).astype(jnp.float32)
        return logits


def route(logits: jax.Array, cfg: ModelConfig, score_bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E] float32 -> (top-k weights [T, k] float32, expert ids [T, k] int32).

    "softmax_topk" (Qwen3-MoE, Mixtral): softmax over all experts, the k largest, renormalised to sum 1 when
    norm_topk_prob. "topk_softmax" (gpt-oss): the k largest logits, softmax over those k. "sigmoid_group"
    (GLM-4.5): `route_sigmoid_group` (score_bias: the router's e_score_correction_bias [E])."""
    k = cfg.num_experts_per_tok
    if cfg.router == "sigmoid_group":
        return route_sigmoid_group(logits, cfg, score_bias)
    if cfg.router == "topk_softmax":
        top, experts = jax.lax.top_k(logits, k)
        return jax.nn.softmax(top, axis=-1), experts
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


# ---- GLM-4.5 MoE: sigmoid grouped routing, shared experts ----
def route_sigmoid_group(logits: jax.Array, cfg: ModelConfig,
                        score_bias: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """GLM-4.5's router (DeepSeek-V3's noaux_tc), as transformers' Glm4MoeTopkRouter: scores = sigmoid(logits);
    the choice uses scores + score_bias: the E experts are n_group groups, a group's score is the sum of its 2
    best, experts outside the topk_group best groups are excluded, and the k best remaining are chosen. Their
    weights are the plain scores, divided by their sum (+ 1e-20) when norm_topk_prob, times
    routed_scaling_factor."""
    k, e = cfg.num_experts_per_tok, cfg.num_experts
    scores = jax.nn.sigmoid(logits)
    choice = scores if score_bias is None else scores + score_bias
    if cfg.n_group > 1:
        groups = choice.reshape(choice.shape[0], cfg.n_group, e // cfg.n_group)
        group_scores = jnp.sum(jax.lax.top_k(groups, 2)[0], axis=-1)  # [T, n_group]
        _, best = jax.lax.top_k(group_scores, cfg.topk_group)
        keep = jnp.zeros(group_scores.shape, bool).at[jnp.arange(choice.shape[0])[:, None], best].set(True)
        choice = jnp.where(jnp.repeat(keep, e // cfg.n_group, axis=-1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, experts


class SharedExperts(nnx.Module):
    """GLM-4.5's shared experts (HF's `mlp.shared_experts`): a SwiGLU MLP of cfg.shared_expert_size that every
    token of a MoE layer runs beside the routed experts (its output is added); frozen (no LoRA target)."""

    def __init__(self, cfg: ModelConfig, *, stack: tuple[int, ...] = (), dtype=jnp.float32, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.shared_expert_size
        common = dict(stack=stack, dtype=dtype, rngs=rngs)
        self.gate_proj = Linear(d, f, **common)
        self.up_proj = Linear(d, f, **common)
        self.down_proj = Linear(f, d, **common)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(ops.glu(self.gate_proj(x), self.up_proj(x), "silu"))
# ---- end GLM-4.5 MoE ----


def router_stats(logits: jax.Array, experts: jax.Array, valid: jax.Array | None) -> RouterStats:
    """The load-balancing statistics of one layer: logits [T, E] float32, the chosen experts [T, k] and token
    validity [T] (None: every token counts). Counts have no gradient (as in transformers); prob_sum has."""
    t, e = logits.shape
    k = experts.shape[-1]
    w = jnp.ones((t,), jnp.float32) if valid is None else valid.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    counts = jnp.zeros((e,), jnp.float32).at[experts.reshape(-1)].add(jnp.repeat(w, k))
    return RouterStats(prob_sum=jnp.sum(probs * w[:, None], axis=0), counts=jax.lax.stop_gradient(counts),
                       rows=jnp.sum(w))


def load_balancing_loss(stats: RouterStats, num_experts: int) -> jax.Array:
    """transformers' load_balancing_loss_func (Switch Transformer eqs. 4-6) over the MoE layers of one forward:
    stats stacked over layers [n, E] (rows [n]). num_experts * sum_e (counts_e / rows) * (prob_sum_e / rows),
    with counts, prob_sum and rows summed over the layers. float32 scalar."""
    rows = jnp.maximum(jnp.sum(stats.rows), 1e-9)
    tokens_per_expert = jnp.sum(stats.counts, axis=0) / rows
    prob_per_expert = jnp.sum(stats.prob_sum, axis=0) / rows
    return num_experts * jnp.sum(tokens_per_expert * prob_per_expert)


def expert_activation(h: jax.Array, cfg: ModelConfig) -> jax.Array:
    """gate_up output [N, 2F] -> [N, F] in h.dtype: SwiGLU silu(gate) * up, or gpt-oss's clamped variant
    (gate clamped above at limit, up to [-limit, limit], gate * sigmoid(alpha * gate) * (up + 1))."""
    if cfg.gate_up_interleaved:
        gate, up = h[..., 0::2], h[..., 1::2]
    else:
        gate, up = jnp.split(h, 2, axis=-1)
    if cfg.expert_activation == "silu":
        return ops.glu(gate, up, "silu")
    limit, alpha = cfg.swiglu_limit, cfg.swiglu_alpha
    g = jnp.minimum(gate.astype(jnp.float32), limit)
    u = jnp.clip(up.astype(jnp.float32), -limit, limit)
    return ((u + 1.0) * (g * jax.nn.sigmoid(g * alpha))).astype(h.dtype)


def expert_ffn(x: jax.Array, weights: jax.Array, experts: jax.Array, block: Experts, cfg: ModelConfig) -> jax.Array:
    """The routed experts over x [T, D]: weights [T, k] float32, experts [T, k] int32 -> [T, D] in x.dtype.

    The T*k (token, expert) assignments are sorted by expert (stable), the rows gathered in that order, both
    projections run as grouped GEMMs over the E groups, each row is scaled by its routing weight, and the k
    rows of each token are summed in token order."""
    t, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    row_expert = flat[order]
    group_sizes = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)
    rows = jnp.take(x, order // k, axis=0)
    h = block.gate_up_proj(rows, group_sizes, row_expert)
    y = block.down_proj(expert_activation(h, cfg), group_sizes, row_expert)
    y = y * jnp.take(weights.reshape(-1), order).astype(y.dtype)[:, None]
    back = jnp.zeros_like(order).at[order].set(jnp.arange(t * k, dtype=order.dtype))  # inverse permutation
    return jnp.sum(jnp.take(y, back, axis=0).reshape(t, k, -1), axis=1)


class SparseMLP(nnx.Module):
    """The MLP of a MoE family's decoder layer (HF's `mlp`): router + experts, and the dense gate/up/down
    projections when some layers of the model are dense (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, *, stack: tuple[int, ...] = (), dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        self.router_name = cfg.router_name
        setattr(self, cfg.router_name, Router(cfg.hidden_size, cfg.num_experts, use_bias=cfg.router_bias,
                                              stack=stack, dtype=jnp.float32 if cfg.router_fp32 else dtype,
                                              rngs=rngs,
                                              score_bias=cfg.router_score_bias))
        self.experts = Experts(cfg, stack=stack, dtype=dtype, rngs=rngs)
        dense = cfg.has_dense_mlp
        d, f = cfg.hidden_size, cfg.intermediate_size
        common = dict(stack=stack, dtype=dtype, rngs=rngs)
        self.gate_proj = nnx.data(Linear(d, f, **common) if dense else None)
        self.up_proj = nnx.data(Linear(d, f, **common) if dense else None)
        self.down_proj = nnx.data(Linear(f, d, **common) if dense else None)
        # GLM-4.5: the shared experts' MLP (zeros in the dense layers, like the expert stacks)
        self.shared_experts = nnx.data(SharedExperts(cfg, **common) if cfg.shared_expert_size else None)

    def __call__(self, x: jax.Array, *, sparse: bool, valid: jax.Array | None = None):
        """x [B, S, D] -> ([B, S, D], RouterStats of this layer or None for a dense layer). valid [B, S]: the
        tokens the router statistics count (attention_mask; None counts all)."""
        if not sparse:
            return self.down_proj(ops.glu(self.gate_proj(x), self.up_proj(x), "silu")), None
        b, s, d = x.shape
        tokens = x.reshape(b * s, d)
        router = getattr(self, self.router_name)
        logits = router(tokens)
        weights, experts = route(logits, self.config, router.score_bias())
        out = expert_ffn(tokens, weights, experts, self.experts, self.config)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        stats = router_stats(logits, experts, None if valid is None else valid.reshape(-1))
        return out.reshape(b, s, d), stats


__all__ = ["EXPERT_PARAMETERS", "EXPERT_PROJS", "Experts", "GroupedLinear", "Router", "RouterStats", "SharedExperts",
           "SparseMLP", "expert_activation", "expert_ffn", "grouped_linear", "grouped_weight_grad",
           "load_balancing_loss", "ragged_matmul", "route", "route_sigmoid_group", "router_stats"]
