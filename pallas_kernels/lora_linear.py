"""Fused LoRA linear layer: y = x @ w + scale * (x @ a) @ b, with a backward that never forms dW.

Wins nowhere in the train step: alone forward+backward 1.03-1.28x XLA at 8 Qwen2-1.5B / Llama-3-8B projections, but
the step is 22% slower with it (218.8 vs 178.8 ms) (BENCHMARKS.md, "Kernels vs XLA, each alone, and what the train
step says", row LoRA linear). Default: off (ops.PALLAS_WINS["linear"] is False); tested, and run when asked
(linear=pallas).

Forward (one tiled kernel): each program owns one [bm, bn] tile of y, runs the K loop of x @ w in f32 and,
in the epilogue, adds scale * xa_tile @ b_tile, where xa = x @ a [M, r] is either accumulated in the same
K loop (``fuse_xa``: costs r/bn extra MMA work, saves a pass over x) or computed first by a small kernel.
xa (f32) is kept as the residual for dB.

Backward (w is frozen):
  g  = scale * dy @ b.T          [M, r]   (fused into the dX loop when ``fuse_g``, else its own kernel)
  dX = dy @ w.T + g @ a.T        [M, K]   (one tiled kernel, the rank-r term in its epilogue)
  dA = x.T @ g                   [K, r]   (split-M reduction kernel, partial sums added by XLA)
  dB = scale * xa.T @ dy         [r, N]   (same reduction kernel)

Gradient w.r.t. w: NONE is computed. The custom_vjp backward returns a symbolic zero for w, so
``jax.grad`` w.r.t. w yields an all-zeros array (JAX materialises the zeros only if asked; no [K, N]
product is ever formed). Keep w in the frozen tree; never train it through this function.

All loads/stores are power-of-two blocks; ragged M/N/K edges are masked (masks are emitted only where the
size is not a multiple of the block). r is padded to rp = max(16, next_pow2(r)) inside the kernels (MMA
needs >= 16) by masked loads, never in HBM.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import (cdiv, compiler_params, full_spec, grouped_pid, load_tile, next_pow2, pl, plgpu,
                                    range_mask, resolve_interpret, store_tile)

__all__ = ["lora_linear", "LoraConfig", "CONFIGS", "pick_config", "shape_class"]


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Block sizes for the four kernels (see module docstring). All block sizes are powers of two."""

    # forward y tiles [bm, bn], K step bk; grouped program order (group_m rows of tiles share w in L2)
    bm: int = 128
    bn: int = 128
    bk: int = 64
    group_m: int = 8
    warps: int = 8
    stages: int = 3
    fuse_xa: bool = True
    # backward dX tiles [dx_bm, dx_bk], N step dx_bn
    dx_bm: int = 128
    dx_bk: int = 128
    dx_bn: int = 64
    dx_warps: int = 8
    dx_stages: int = 3
    fuse_g: bool = True
    # skinny kernels (xa = x @ a, g = dy @ b.T when not fused): row tile sk_bm, contraction step sk_bk
    sk_bm: int = 64
    sk_bk: int = 128
    sk_warps: int = 4
    sk_stages: int = 3
    # reductions over M (dA, dB): column tile red_bc, row step red_bm, red_splits programs along M
    red_bc: int = 128
    red_bm: int = 64
    red_splits: int = 16
    red_warps: int = 4
    red_stages: int = 3


# Initial guesses, keyed by (shape class, dtype name, r). Shape class: "small" when M < 1024, "narrow" when
# min(K, N) <= 512 (e.g. the [1536, 256] k/v projections: smaller tiles give enough programs), else "large".
# The GPU sweep (`python bench/kernels_matmul.py --sweep`) prints the best entries to paste here.
_F32 = dict(bm=64, bn=64, bk=32, warps=4, stages=2, dx_bm=64, dx_bk=64, dx_bn=32, dx_warps=4, dx_stages=2)
_SMALL = dict(bm=64, bn=64, dx_bm=64, dx_bk=64, warps=4, dx_warps=4, red_splits=4)
_NARROW = dict(bm=64, bn=128, dx_bm=64, dx_bk=128, warps=4, dx_warps=4)
CONFIGS: dict[tuple[str, str, int], LoraConfig] = {}
for _r in (8, 16, 64):
    _fuse = dict(fuse_xa=_r <= 16, fuse_g=_r <= 16)   # fused rank-r product costs r/bn (r/bk) extra MMA work
    CONFIGS[("large", "bfloat16", _r)] = LoraConfig(**_fuse)
    CONFIGS[("narrow", "bfloat16", _r)] = LoraConfig(**_NARROW, **_fuse)
    CONFIGS[("small", "bfloat16", _r)] = LoraConfig(**_SMALL, **_fuse)
    for _cls in ("large", "narrow", "small"):
        CONFIGS[(_cls, "float32", _r)] = LoraConfig(**_F32, **_fuse)
del _r, _cls, _fuse
_DEFAULT = LoraConfig()


def shape_class(m: int, k: int, n: int) -> str:
    """The block table's class of an [M, K] @ [K, N] problem: "small", "narrow" or "large" (see CONFIGS)."""
    if m < 1024:
        return "small"
    return "narrow" if min(k, n) <= 512 else "large"


def pick_config(m: int, k: int, n: int, r: int, dtype) -> LoraConfig:
    """Table lookup with fallbacks (nearest tabulated r, then the bf16 entry, then the default)."""
    cls = shape_class(m, k, n)
    name = jnp.dtype(dtype).name
    r_key = 8 if r <= 8 else (16 if r <= 32 else 64)
    for key in ((cls, name, r_key), (cls, "bfloat16", r_key), ("large", "bfloat16", r_key)):
        if key in CONFIGS:
            return CONFIGS[key]
    return _DEFAULT


# ----------------------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------------------

def _fwd_kernel(*refs, M, K, N, R, RP, bm, bn, bk, group_m, scale, fuse_xa):
    if fuse_xa:
        x_ref, w_ref, a_ref, b_ref, y_ref, xa_out_ref = refs
    else:
        x_ref, w_ref, xa_in_ref, b_ref, y_ref = refs
    n_m, n_n, n_k = cdiv(M, bm), cdiv(N, bn), cdiv(K, bk)
    pid_m, pid_n = grouped_pid(pl.program_id(0), n_m, n_n, group_m)
    m0, n0 = pid_m * bm, pid_n * bn
    rmask = range_mask(m0, bm, M, M % bm != 0)
    cmask = range_mask(n0, bn, N, N % bn != 0)
    rpmask = range_mask(0, RP, R, R != RP)
    k_ragged = K % bk != 0

    def body(i, carry):
        acc, xa = carry
        k0 = i * bk
        kmask = range_mask(k0, bk, K, k_ragged)
        xb = load_tile(x_ref, m0, bm, k0, bk, rmask, kmask)
        wb = load_tile(w_ref, k0, bk, n0, bn, kmask, cmask)
        acc = acc + plgpu.dot(xb, wb)
        if fuse_xa:
            ab = load_tile(a_ref, k0, bk, 0, RP, kmask, rpmask)
            xa = xa + plgpu.dot(xb, ab)
        return acc, xa

    acc0 = jnp.zeros((bm, bn), jnp.float32)
    xa0 = jnp.zeros((bm, RP), jnp.float32)
    acc, xa = lax.fori_loop(0, n_k, body, (acc0, xa0))
    if not fuse_xa:
        xa = load_tile(xa_in_ref, m0, bm, 0, RP, rmask, rpmask)
    bb = load_tile(b_ref, 0, RP, n0, bn, rpmask, cmask)
    acc = acc + scale * plgpu.dot(xa.astype(bb.dtype), bb)
    store_tile(y_ref, m0, bm, n0, bn, acc.astype(y_ref.dtype), rmask, cmask)
    if fuse_xa:
        @pl.when(pid_n == 0)
        def _():
            store_tile(xa_out_ref, m0, bm, 0, RP, xa, rmask, rpmask)


def _dx_kernel(*refs, M, K, N, R, RP, bm, bk, bn, group_m, scale, fuse_g):
    if fuse_g:
        dy_ref, w_ref, b_ref, a_ref, dx_ref, g_out_ref = refs
    else:
        dy_ref, w_ref, g_in_ref, a_ref, dx_ref = refs
    n_m, n_kt, n_n = cdiv(M, bm), cdiv(K, bk), cdiv(N, bn)
    pid_m, pid_k = grouped_pid(pl.program_id(0), n_m, n_kt, group_m)
    m0, k0 = pid_m * bm, pid_k * bk
    rmask = range_mask(m0, bm, M, M % bm != 0)
    kmask = range_mask(k0, bk, K, K % bk != 0)
    rpmask = range_mask(0, RP, R, R != RP)
    n_ragged = N % bn != 0

    def body(i, carry):
        acc, g = carry
        n0 = i * bn
        nmask = range_mask(n0, bn, N, n_ragged)
        dyb = load_tile(dy_ref, m0, bm, n0, bn, rmask, nmask)
        wb = load_tile(w_ref, k0, bk, n0, bn, kmask, nmask)
        acc = acc + plgpu.dot(dyb, wb, trans_b=True)
        if fuse_g:
            bb = load_tile(b_ref, 0, RP, n0, bn, rpmask, nmask)
            g = g + plgpu.dot(dyb, bb, trans_b=True)
        return acc, g

    acc0 = jnp.zeros((bm, bk), jnp.float32)
    g0 = jnp.zeros((bm, RP), jnp.float32)
    acc, g = lax.fori_loop(0, n_n, body, (acc0, g0))
    if fuse_g:
        g = g * scale
    else:
        g = load_tile(g_in_ref, m0, bm, 0, RP, rmask, rpmask)
    ab = load_tile(a_ref, k0, bk, 0, RP, kmask, rpmask)
    acc = acc + plgpu.dot(g.astype(ab.dtype), ab, trans_b=True)
    store_tile(dx_ref, m0, bm, k0, bk, acc.astype(dx_ref.dtype), rmask, kmask)
    if fuse_g:
        @pl.when(pid_k == 0)
        def _():
            store_tile(g_out_ref, m0, bm, 0, RP, g, rmask, rpmask)


def _skinny_kernel(x_ref, s_ref, o_ref, *, M, C, R, RP, bm, bc, scale, s_rows_are_r):
    """o[M, r] = scale * x[M, C] @ S, with S = s [C, r] or, when s_rows_are_r, s [r, C] transposed."""
    m0 = pl.program_id(0) * bm
    rmask = range_mask(m0, bm, M, M % bm != 0)
    rpmask = range_mask(0, RP, R, R != RP)
    c_ragged = C % bc != 0

    def body(i, acc):
        c0 = i * bc
        cmask = range_mask(c0, bc, C, c_ragged)
        xb = load_tile(x_ref, m0, bm, c0, bc, rmask, cmask)
        if s_rows_are_r:
            sb = load_tile(s_ref, 0, RP, c0, bc, rpmask, cmask)
            return acc + plgpu.dot(xb, sb, trans_b=True)
        sb = load_tile(s_ref, c0, bc, 0, RP, cmask, rpmask)
        return acc + plgpu.dot(xb, sb)

    acc = lax.fori_loop(0, cdiv(C, bc), body, jnp.zeros((bm, RP), jnp.float32))
    if scale != 1.0:
        acc = acc * scale
    store_tile(o_ref, m0, bm, 0, RP, acc, rmask, rpmask)


def _reduce_kernel(big_ref, small_ref, o_ref, *, M, C, R, RP, bc, bm, rows_per_split):
    """o[s, C, r] = big[rows of split s, C].T @ small[rows of split s, r]  (small cast to big's dtype)."""
    pid_c, pid_s = pl.program_id(0), pl.program_id(1)
    c0 = pid_c * bc
    cmask = range_mask(c0, bc, C, C % bc != 0)
    rpmask = range_mask(0, RP, R, R != RP)
    row_start = pid_s * rows_per_split
    n_steps = rows_per_split // bm
    # Rows past M are masked; only the last split can be ragged.
    ragged = (M % rows_per_split != 0) or (rows_per_split % bm != 0)

    def body(i, acc):
        m0 = row_start + i * bm
        rmask = range_mask(m0, bm, M, ragged)
        bb = load_tile(big_ref, m0, bm, c0, bc, rmask, cmask)
        sb = load_tile(small_ref, m0, bm, 0, RP, rmask, rpmask)
        return acc + plgpu.dot(bb, sb.astype(bb.dtype), trans_a=True)

    acc = lax.fori_loop(0, n_steps, body, jnp.zeros((bc, RP), jnp.float32))
    store_tile(o_ref, c0, bc, 0, RP, acc, cmask, rpmask)


# ----------------------------------------------------------------------------------------------------------
# pallas_call wrappers
# ----------------------------------------------------------------------------------------------------------

def _rp(r: int) -> int:
    return max(16, next_pow2(r))


def _skinny(x, s, scale, r, cfg, interpret, s_rows_are_r):
    M, C = x.shape
    RP = _rp(r)
    bm = min(cfg.sk_bm, max(16, next_pow2(M)))
    bc = min(cfg.sk_bk, max(16, next_pow2(C)))
    kernel = functools.partial(_skinny_kernel, M=M, C=C, R=r, RP=RP, bm=bm, bc=bc, scale=float(scale),
                               s_rows_are_r=s_rows_are_r)
    return pl.pallas_call(
        kernel,
        grid=(cdiv(M, bm),),
        in_specs=[full_spec(x.shape), full_spec(s.shape)],
        out_specs=full_spec((M, r)),
        out_shape=jax.ShapeDtypeStruct((M, r), jnp.float32),
        compiler_params=compiler_params(num_warps=cfg.sk_warps, num_stages=cfg.sk_stages),
        interpret=interpret,
        name="lora_skinny",
    )(x, s)


def _reduce(big, small, r, cfg, interpret):
    """big [M, C], small [M, r] f32 -> big.T @ small [C, r] in f32 (split over M, partials summed)."""
    M, C = big.shape
    RP = _rp(r)
    bc = min(cfg.red_bc, max(16, next_pow2(C)))
    bm = min(cfg.red_bm, max(16, next_pow2(M)))
    splits = max(1, min(cfg.red_splits, cdiv(M, bm)))
    rows_per_split = cdiv(cdiv(M, splits), bm) * bm
    splits = cdiv(M, rows_per_split)
    kernel = functools.partial(_reduce_kernel, M=M, C=C, R=r, RP=RP, bc=bc, bm=bm,
                               rows_per_split=rows_per_split)
    parts = pl.pallas_call(
        kernel,
        grid=(cdiv(C, bc), splits),
        in_specs=[full_spec(big.shape), full_spec(small.shape)],
        out_specs=pl.BlockSpec((None, C, r), lambda c, s: (s, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((splits, C, r), jnp.float32),
        compiler_params=compiler_params(num_warps=cfg.red_warps, num_stages=cfg.red_stages),
        interpret=interpret,
        name="lora_reduce",
    )(big, small)
    return jnp.sum(parts, axis=0)


def _clip_blocks(cfg: LoraConfig, M, K, N) -> LoraConfig:
    """Shrink blocks for tiny problems (keeps powers of two, >= 16)."""
    def c(v, n):
        return min(v, max(16, next_pow2(n)))
    return dataclasses.replace(cfg, bm=c(cfg.bm, M), bn=c(cfg.bn, N), bk=c(cfg.bk, K),
                               dx_bm=c(cfg.dx_bm, M), dx_bk=c(cfg.dx_bk, K), dx_bn=c(cfg.dx_bn, N))


def _forward(x, w, a, b, scale, cfg, interpret):
    a, b = a.astype(x.dtype), b.astype(x.dtype)   # one MMA input dtype; no-op in the usual bf16 case
    M, K = x.shape
    N = w.shape[1]
    r = a.shape[1]
    RP = _rp(r)
    cfg = _clip_blocks(cfg, M, K, N)
    grid = (cdiv(M, cfg.bm) * cdiv(N, cfg.bn),)
    common = dict(M=M, K=K, N=N, R=r, RP=RP, bm=cfg.bm, bn=cfg.bn, bk=cfg.bk, group_m=cfg.group_m,
                  scale=float(scale), fuse_xa=cfg.fuse_xa)
    params = compiler_params(num_warps=cfg.warps, num_stages=cfg.stages)
    y_shape = jax.ShapeDtypeStruct((M, N), x.dtype)
    xa_shape = jax.ShapeDtypeStruct((M, r), jnp.float32)
    if cfg.fuse_xa:
        y, xa = pl.pallas_call(
            functools.partial(_fwd_kernel, **common),
            grid=grid,
            in_specs=[full_spec(x.shape), full_spec(w.shape), full_spec(a.shape), full_spec(b.shape)],
            out_specs=[full_spec((M, N)), full_spec((M, r))],
            out_shape=[y_shape, xa_shape],
            compiler_params=params,
            interpret=interpret,
            name="lora_fwd",
        )(x, w, a, b)
    else:
        xa = _skinny(x, a, 1.0, r, cfg, interpret, s_rows_are_r=False)
        y = pl.pallas_call(
            functools.partial(_fwd_kernel, **common),
            grid=grid,
            in_specs=[full_spec(x.shape), full_spec(w.shape), full_spec(xa.shape), full_spec(b.shape)],
            out_specs=full_spec((M, N)),
            out_shape=y_shape,
            compiler_params=params,
            interpret=interpret,
            name="lora_fwd",
        )(x, w, xa, b)
    return y, xa


def _backward(x, w, a, b, xa, dy, scale, cfg, interpret):
    a_dtype, b_dtype = a.dtype, b.dtype
    a, b = a.astype(x.dtype), b.astype(x.dtype)
    M, K = x.shape
    N = w.shape[1]
    r = a.shape[1]
    RP = _rp(r)
    cfg = _clip_blocks(cfg, M, K, N)
    dy = dy.astype(x.dtype)
    grid = (cdiv(M, cfg.dx_bm) * cdiv(K, cfg.dx_bk),)
    common = dict(M=M, K=K, N=N, R=r, RP=RP, bm=cfg.dx_bm, bk=cfg.dx_bk, bn=cfg.dx_bn, group_m=cfg.group_m,
                  scale=float(scale), fuse_g=cfg.fuse_g)
    params = compiler_params(num_warps=cfg.dx_warps, num_stages=cfg.dx_stages)
    dx_shape = jax.ShapeDtypeStruct((M, K), x.dtype)
    if cfg.fuse_g:
        dx, g = pl.pallas_call(
            functools.partial(_dx_kernel, **common),
            grid=grid,
            in_specs=[full_spec(dy.shape), full_spec(w.shape), full_spec(b.shape), full_spec(a.shape)],
            out_specs=[full_spec((M, K)), full_spec((M, r))],
            out_shape=[dx_shape, jax.ShapeDtypeStruct((M, r), jnp.float32)],
            compiler_params=params,
            interpret=interpret,
            name="lora_dx",
        )(dy, w, b, a)
    else:
        g = _skinny(dy, b, scale, r, cfg, interpret, s_rows_are_r=True)
        dx = pl.pallas_call(
            functools.partial(_dx_kernel, **common),
            grid=grid,
            in_specs=[full_spec(dy.shape), full_spec(w.shape), full_spec(g.shape), full_spec(a.shape)],
            out_specs=full_spec((M, K)),
            out_shape=dx_shape,
            compiler_params=params,
            interpret=interpret,
            name="lora_dx",
        )(dy, w, g, a)
    da = _reduce(x, g, r, cfg, interpret)                       # [K, r] = x.T @ g
    db = scale * _reduce(dy, xa, r, cfg, interpret).T          # [r, N] = scale * xa.T @ dy
    # dA, dB are f32 sums: cast once to the parameters' own dtype (f32 master weights keep full precision)
    return dx, da.astype(a_dtype), db.astype(b_dtype)


# ----------------------------------------------------------------------------------------------------------
# custom_vjp
# ----------------------------------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _lora(x, w, a, b, scale, cfg, interpret):
    return _forward(x, w, a, b, scale, cfg, interpret)[0]


def _lora_fwd(x, w, a, b, scale, cfg, interpret):
    y, xa = _forward(x, w, a, b, scale, cfg, interpret)
    return y, (x, w, a, b, xa)


def _lora_bwd(scale, cfg, interpret, res, dy):
    x, w, a, b, xa = res
    dx, da, db = _backward(x, w, a, b, xa, dy, scale, cfg, interpret)
    # None = symbolic zero cotangent for the frozen w: no [K, N] gradient is computed.
    return dx, None, da, db


_lora.defvjp(_lora_fwd, _lora_bwd)


def lora_linear(x, w, a, b, scale, *, interpret: bool | None = None, config: LoraConfig | None = None):
    """y = x @ w + scale * (x @ a) @ b, output in x.dtype, f32 accumulation.

    x [M, K] (leading batch dims are flattened), w [K, N] frozen, a [K, r], b [r, N], scale a Python float.
    Differentiable w.r.t. x, a and b. w is nondifferentiable: jax.grad w.r.t. w returns zeros and no
    [K, N] gradient is computed. `config` overrides the block-size table (used by the benchmark sweep).
    a and b may be kept in float32 (master weights): they are cast to x.dtype for the MMAs, and dA, dB are
    accumulated in f32 and returned in a's and b's own dtype.
    """
    interpret = resolve_interpret(interpret)
    K = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if w.ndim != 2 or w.shape[0] != K or a.shape[0] != K or b.shape[0] != a.shape[1] or b.shape[1] != w.shape[1]:
        raise ValueError(f"lora_linear: bad shapes x{x.shape} w{w.shape} a{a.shape} b{b.shape}")
    dt = x.dtype
    w = w.astype(dt)
    if config is None:
        config = pick_config(x2.shape[0], K, w.shape[1], a.shape[1], dt)
    y = _lora(x2, w, a, b, float(scale), config, interpret)
    return y.reshape(*lead, w.shape[1])
