"""Grouped matmul (the MoE expert GEMM): out[rows of group e] = x[rows of group e] @ w[e].

Wins: at Qwen3-30B-A3B's expert shapes 0.99 ms (415 TFLOP/s) forward where jax.lax.ragged_dot takes 73.8 ms, and one
layer's expert block 8.59 ms where ragged_dot takes 254.2 ms and does not fit in the step (BENCHMARKS.md, "MoE:
Qwen3-30B-A3B shape, first 4 of 48 layers, 4 x 2048, LoRA on attention and experts, 2026-12-01", rows grouped GEMM
and expert block). Default (ops.PALLAS_WINS["grouped_matmul"]): 16-bit rows; ragged_dot elsewhere.

`grouped_matmul(x, w, group_sizes)` has the semantics of `jax.lax.ragged_dot(x, w, group_sizes)`: x [N, K] with
rows sorted by group, w [E, K, M] (or [E, M, K] with ``transpose_rhs=True``), group_sizes [E] int32; rows
past sum(group_sizes) are zero in the output. XLA's GPU lowering of ragged_dot rewrites it as a dense product
against every expert (E times the work and an E-times padded copy); these kernels do only the grouped work.

Forward kernel (megablox-style schedule; Triton has no scalar prefetch, so the schedule is an input array):
- The wrapper builds, with plain jnp, a work list of (row tile, group, row range) items: a tile of block_m
  rows that straddles several groups appears once per group it touches, so there are at most
  ceil(N / block_m) + E items (the rows past sum(group_sizes) form one extra "tail" item range that stores
  zeros; unused slots are sentinels with an empty row range).
- Grid: items x column tiles (one 1-D grid in grouped order, so neighbouring programs share tiles in L2). A
  program reads its item with scalar loads, runs the K loop of x[tile rows] @ w[group] in float32 and stores
  only the rows of its range (masked store). Programs of one tile write disjoint rows, so no atomics.
  The x rows outside the range are loaded unmasked: an output row depends only on its own x row, and those
  rows are never stored.

dW kernel (``dW[e] = x[rows of e]^T @ dy[rows of e]``): grid experts x output tiles; each program loops over
its group's row blocks (row-masked loads, dynamic trip count). It runs only when w's gradient is asked for
(see grouped_matmul's docstring).

All loads/stores are power-of-two blocks; ragged N/K/M edges are masked.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import (cdiv, compiler_params, full_spec, grouped_pid, load, load_tile, mask_2d, next_pow2,
                                    pl, plgpu, range_mask, resolve_interpret)

__all__ = ["grouped_matmul", "GmmConfig", "default_config", "make_schedule"]


@dataclasses.dataclass(frozen=True)
class GmmConfig:
    """Block sizes (powers of two) and Triton launch parameters.

    Forward and dX kernels: output tiles [block_m, block_n], contraction step block_k, group_m work items per
    program group (L2 reuse). dW kernel: output tiles [dw_block_p, dw_block_q], row step dw_block_m.
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8
    dw_block_m: int = 64
    dw_block_p: int = 128
    dw_block_q: int = 128
    dw_num_warps: int = 8
    dw_num_stages: int = 3

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name.startswith(("block", "dw_block")) and (v < 16 or v & (v - 1)):
                raise ValueError(f"GmmConfig.{f.name}={v}: block sizes must be powers of two >= 16")
            if v < 1:
                raise ValueError(f"GmmConfig.{f.name}={v} must be >= 1")


def default_config(dtype) -> GmmConfig:
    """The block table measured fastest on the H200 at the Qwen3-30B-A3B expert shapes (bench/grouped_matmul_bench.py
    --sweep): [128, 256] output tiles for 2-byte inputs; 4-byte inputs keep block_n=128 (a 128x256 tile's three
    pipeline stages would not fit shared memory)."""
    return GmmConfig(block_n=256 if jnp.dtype(dtype).itemsize <= 2 else 128)


def _clip(block: int, size: int) -> int:
    """Block never larger than the (power-of-two padded) dimension, and at least 16 (the MMA minimum)."""
    return min(block, max(16, next_pow2(size)))


# ----------------------------------------------------------------------------------------------------------
# schedule (plain jnp, inside the jitted wrapper)
# ----------------------------------------------------------------------------------------------------------

def make_schedule(group_sizes, n_rows: int, block_m: int):
    """Work list of the forward kernel: int32 [4, W] rows (tile, group, row_lo, row_hi), W = cdiv(N, bm) + E.

    Group e covers rows [starts[e], ends[e]) (ends = cumsum(group_sizes) clipped to N); group E is the tail
    [sum, N), whose items store zeros. Item i writes rows [row_lo, row_hi) of row tile `tile` with group
    `group`. Unused slots have row_lo = row_hi = 0 (they write nothing).
    """
    e = group_sizes.shape[0]
    n_tiles = cdiv(n_rows, block_m)
    slots = n_tiles + e
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), n_rows)
    ends = jnp.concatenate([ends, jnp.full((1,), n_rows, jnp.int32)])           # [E + 1], tail last
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    nonempty = ends > starts
    first = starts // block_m
    count = jnp.where(nonempty, (ends - 1) // block_m - first + 1, 0)           # row tiles each group touches
    item_end = jnp.cumsum(count)
    item = jnp.arange(slots, dtype=jnp.int32)
    group = jnp.searchsorted(item_end, item, side="right").astype(jnp.int32)    # E + 1 -> unused slot
    used = group <= e
    g = jnp.minimum(group, e)
    tile = first[g] + item - (item_end[g] - count[g])
    row_lo = jnp.where(used, jnp.maximum(starts[g], tile * block_m), 0)
    row_hi = jnp.where(used, jnp.minimum(ends[g], (tile + 1) * block_m), 0)
    return jnp.stack([jnp.where(used, tile, 0), g, row_lo, row_hi]).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------------------

def _gmm_kernel(sched_ref, x_ref, w_ref, o_ref, *, N, K, M, E, W, bm, bn, bk, group_m, transpose_rhs):
    n_n = cdiv(M, bn)
    item, pid_n = grouped_pid(pl.program_id(0), W, n_n, group_m)
    tile = plgpu.load(sched_ref.at[jnp.int32(0), item])
    group = plgpu.load(sched_ref.at[jnp.int32(1), item])
    row_lo = plgpu.load(sched_ref.at[jnp.int32(2), item])
    row_hi = plgpu.load(sched_ref.at[jnp.int32(3), item])
    m0, n0 = tile * bm, pid_n * bn
    rows = m0 + jnp.arange(bm)
    store_mask = mask_2d((rows >= row_lo) & (rows < row_hi), range_mask(n0, bn, M, M % bn != 0))
    in_rows = range_mask(m0, bm, N, N % bm != 0)     # only rows past N are masked on load (see module doc)
    cmask = range_mask(n0, bn, M, M % bn != 0)
    k_ragged = K % bk != 0

    @pl.when((group < E) & (row_lo < row_hi))
    def _():
        def body(i, acc):
            k0 = i * bk
            kmask = range_mask(k0, bk, K, k_ragged)
            xb = load_tile(x_ref, m0, bm, k0, bk, in_rows, kmask)
            if transpose_rhs:
                wb = load(w_ref.at[group, pl.ds(n0, bn), pl.ds(k0, bk)], mask_2d(cmask, kmask))
                return acc + plgpu.dot(xb, wb, trans_b=True)
            wb = load(w_ref.at[group, pl.ds(k0, bk), pl.ds(n0, bn)], mask_2d(kmask, cmask))
            return acc + plgpu.dot(xb, wb)

        acc = lax.fori_loop(0, cdiv(K, bk), body, jnp.zeros((bm, bn), jnp.float32))
        plgpu.store(o_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)], acc.astype(o_ref.dtype), mask=store_mask)

    @pl.when(group == E)    # the tail rows past sum(group_sizes): zeros
    def _():
        plgpu.store(o_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)], jnp.zeros((bm, bn), o_ref.dtype), mask=store_mask)


def _dw_kernel(bounds_ref, a_ref, b_ref, o_ref, *, P, Q, bm, bp, bq, group_m):
    """o[e] = a[rows of e]^T @ b[rows of e]: a [N, P], b [N, Q] -> o [E, P, Q] (float32 accumulation)."""
    n_p, n_q = cdiv(P, bp), cdiv(Q, bq)
    pid_p, pid_q = grouped_pid(pl.program_id(0), n_p, n_q, group_m)
    e = pl.program_id(1)
    start = plgpu.load(bounds_ref.at[jnp.int32(0), e])
    end = plgpu.load(bounds_ref.at[jnp.int32(1), e])
    p0, q0 = pid_p * bp, pid_q * bq
    pmask = range_mask(p0, bp, P, P % bp != 0)
    qmask = range_mask(q0, bq, Q, Q % bq != 0)
    first = lax.div(start, jnp.int32(bm))
    steps = jnp.where(end > start, lax.div(end + jnp.int32(bm - 1), jnp.int32(bm)) - first, 0)

    def body(i, acc):
        r0 = (first + i) * bm
        rows = r0 + jnp.arange(bm)
        rmask = (rows >= start) & (rows < end)
        ab = load_tile(a_ref, r0, bm, p0, bp, rmask, pmask)
        bb = load_tile(b_ref, r0, bm, q0, bq, rmask, qmask)
        return acc + plgpu.dot(ab, bb, trans_a=True)

    acc = lax.fori_loop(0, steps, body, jnp.zeros((bp, bq), jnp.float32))
    plgpu.store(o_ref.at[e, pl.ds(p0, bp), pl.ds(q0, bq)], acc.astype(o_ref.dtype), mask=mask_2d(pmask, qmask))


# ----------------------------------------------------------------------------------------------------------
# pallas_call wrappers
# ----------------------------------------------------------------------------------------------------------

def _gmm(x, w, group_sizes, transpose_rhs, out_dtype, cfg: GmmConfig, interpret: bool):
    N, K = x.shape
    E = w.shape[0]
    M = w.shape[1] if transpose_rhs else w.shape[2]
    bm, bn, bk = _clip(cfg.block_m, N), _clip(cfg.block_n, M), _clip(cfg.block_k, K)
    sched = make_schedule(group_sizes, N, bm)
    W = sched.shape[1]
    kernel = functools.partial(_gmm_kernel, N=N, K=K, M=M, E=E, W=W, bm=bm, bn=bn, bk=bk, group_m=cfg.group_m,
                               transpose_rhs=transpose_rhs)
    return pl.pallas_call(
        kernel,
        grid=(W * cdiv(M, bn),),
        in_specs=[full_spec(sched.shape), full_spec(x.shape), full_spec(w.shape)],
        out_specs=full_spec((N, M)),
        out_shape=jax.ShapeDtypeStruct((N, M), out_dtype),
        compiler_params=compiler_params(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="grouped_matmul_t" if transpose_rhs else "grouped_matmul",
    )(sched, x, w)


def _dw(a, b, group_sizes, out_dtype, cfg: GmmConfig, interpret: bool):
    """[E, P, Q]: a[rows of e]^T @ b[rows of e] for a [N, P], b [N, Q] (rows past sum(group_sizes) unused)."""
    N, P = a.shape
    Q = b.shape[1]
    E = group_sizes.shape[0]
    bm, bp, bq = _clip(cfg.dw_block_m, N), _clip(cfg.dw_block_p, P), _clip(cfg.dw_block_q, Q)
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), N)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    bounds = jnp.stack([starts, ends]).astype(jnp.int32)
    kernel = functools.partial(_dw_kernel, P=P, Q=Q, bm=bm, bp=bp, bq=bq, group_m=cfg.group_m)
    return pl.pallas_call(
        kernel,
        grid=(cdiv(P, bp) * cdiv(Q, bq), E),
        in_specs=[full_spec(bounds.shape), full_spec(a.shape), full_spec(b.shape)],
        out_specs=full_spec((E, P, Q)),
        out_shape=jax.ShapeDtypeStruct((E, P, Q), out_dtype),
        compiler_params=compiler_params(num_warps=cfg.dw_num_warps, num_stages=cfg.dw_num_stages),
        interpret=interpret,
        name="grouped_matmul_dw",
    )(bounds, a, b)


# ----------------------------------------------------------------------------------------------------------
# custom_vjp
# ----------------------------------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _grouped(x, w, group_sizes, transpose_rhs, out_dtype, cfg, interpret):
    return _gmm(x, w, group_sizes, transpose_rhs, out_dtype, cfg, interpret)


def _grouped_fwd(x, w, group_sizes, transpose_rhs, out_dtype, cfg, interpret):
    # symbolic_zeros=True: the primals arrive as CustomVJPPrimal(value, perturbed). The residuals keep only what
    # the wanted cotangents need (x for dW only when w is perturbed), which tells the backward what to compute.
    xv, wv, gs = x.value, w.value, group_sizes.value
    y = _gmm(xv, wv, gs, transpose_rhs, out_dtype, cfg, interpret)
    return y, (xv if w.perturbed else None, wv if x.perturbed else None, gs)


def _grouped_bwd(transpose_rhs, out_dtype, cfg, interpret, res, dy):
    x, w, gs = res     # here x and w have one dtype (the public wrapper casts w)
    if isinstance(dy, jax.custom_derivatives.SymbolicZero):
        return None, None, None
    dx = dw = None
    if w is not None:
        dx = _gmm(dy.astype(w.dtype), w, gs, not transpose_rhs, w.dtype, cfg, interpret)
    if x is not None:
        dy = dy.astype(x.dtype)
        # y = x @ w[e] -> dW[e] = x_e^T dy_e [K, M];  y = x @ w[e]^T -> dW[e] = dy_e^T x_e [M, K]
        a, b = (dy, x) if transpose_rhs else (x, dy)
        dw = _dw(a, b, gs, x.dtype, cfg, interpret)
    return dx, dw, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd, symbolic_zeros=True)


def grouped_matmul(x, w, group_sizes, *, transpose_rhs: bool = False, block_m: int | None = None,
                   block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                   num_stages: int | None = None, config: GmmConfig | None = None, interpret: bool | None = None,
                   out_dtype=None):
    """Grouped matmul with jax.lax.ragged_dot's semantics: out[rows of e] = x[rows of e] @ w[e].

    x [N, K] (rows sorted by group), w [E, K, M], or [E, M, K] with ``transpose_rhs=True`` (then
    out = x @ w[e]^T, e.g. dX = dy @ w[e]^T without a transposed copy of w); group_sizes [E] int (the rows of
    group e are contiguous and in group order; sum(group_sizes) <= N, larger sums are clipped to N).
    Returns [N, out_dtype or x.dtype]; rows past sum(group_sizes) are zero. float32 accumulation; w is cast to
    x.dtype (the MMA takes one input dtype; a no-op when they match). float32 inputs run the dot in TF32 on
    NVIDIA tensor cores (full float32 in interpret mode).

    Differentiable w.r.t. x and w. dX is the same kernel with the other w layout; dW (float32 accumulation,
    rounded to x.dtype, then cast to w's dtype) is a separate grouped kernel that runs only when w's gradient is needed: a frozen
    w (jax.lax.stop_gradient, or simply not an argument being differentiated) costs nothing.

    Blocks: `config` (GmmConfig; default: default_config(x.dtype)) or the block_m/block_n/block_k/num_warps/num_stages overrides (powers of two
    >= 16, clipped to the problem size); interpret=None interprets unless the default backend is a GPU.
    """
    interpret = resolve_interpret(interpret)
    if x.ndim != 2 or w.ndim != 3:
        raise ValueError(f"grouped_matmul: x must be [N, K] and w [E, K, M] (or [E, M, K] with transpose_rhs); "
                         f"got x{x.shape} w{w.shape}")
    k_axis = 2 if transpose_rhs else 1
    if w.shape[k_axis] != x.shape[1]:
        raise ValueError(f"grouped_matmul: x{x.shape} and w{w.shape} disagree on K (w axis {k_axis}, "
                         f"transpose_rhs={transpose_rhs})")
    if group_sizes.shape != (w.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"grouped_matmul: group_sizes must be an integer [E]=[{w.shape[0]}] array; "
                         f"got {group_sizes.dtype}{tuple(group_sizes.shape)}")
    overrides = dict(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps,
                     num_stages=num_stages)
    cfg = dataclasses.replace(config or default_config(x.dtype), **{k: v for k, v in overrides.items() if v is not None})
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    return _grouped(x, w.astype(x.dtype), group_sizes.astype(jnp.int32), bool(transpose_rhs), out_dtype, cfg,
                    interpret)
