"""Fused RMSNorm (forward + backward) as Pallas kernels with the Triton lowering.

Wins: alone, at every shape measured: backward 1.58-2.10x XLA, forward a tie (0.92-1.09x); in the Qwen2-1.5B train
step a tie (188.52 vs 188.49 ms) (BENCHMARKS.md, "Kernels vs XLA, each alone, and what the train step says", row
RMSNorm). Default (ops.PALLAS_WINS["rms_norm"]): bf16 rows of D = 1536 or 4096, the hidden sizes of the train rows
measured (Qwen2-1.5B, Llama-3-8B); XLA elsewhere.

    y = x * rsqrt(mean(x^2, -1) + eps) * (offset + weight)

Statistics and all arithmetic are float32; y is stored in x.dtype. `offset=1.0` gives Gemma's (1 + w).

Layout: x is flattened to [R, D]. D is padded to BD = next_pow2(D) with masks, and each program owns a
[BR, BD] tile (BR rows, a power of two), so small D (the per-head q/k norm of Qwen3, D = 128) still moves
large contiguous blocks per program.

Forward: one pass, x read once, y written once, plus the per-row rstd (float32 [R]) saved for backward.

Backward: a persistent-style kernel. Program p owns a contiguous run of row tiles; for each tile it
computes dx in registers and accumulates dy * x_hat over its rows into a float32 [BD] accumulator, then
writes that partial sum to row p of a small [G, D] float32 buffer. A second tiny kernel sums the G partial
rows into dweight (float32 accumulation, stored in weight.dtype). No atomics.

Block sizes: `_FWD_TABLE` / `_BWD_TABLE`, keyed by (shape class, dtype name, BD); anything not in the
tables falls back to `_fwd_heuristic` / `_bwd_heuristic`. `bench/kernels_elementwise.py --sweep` prints the
best entries for the GPU it runs on.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import (broadcast_mask, cdiv, compiler_params, load, mask_2d, next_pow2, pl, plgpu,
                                    range_mask, resolve_interpret)


class FwdConfig(NamedTuple):
    block_rows: int  # rows per program (power of two)
    num_warps: int
    num_stages: int = 1


class BwdConfig(NamedTuple):
    block_rows: int  # rows per loop step (power of two)
    max_programs: int  # programs (= rows of the float32 partial-dweight buffer)
    num_warps: int
    num_stages: int = 2


# Entries for an H200: about 16 elements per thread in the forward and 8 in the backward, which keeps both
# kernels free of register spills; the bf16 backward at BD=2048 is the sweep's (`bench/kernels_elementwise.py
# --sweep`, which prints the best entries), the others are initial guesses.
# Key: (shape class, dtype name, BD = next_pow2(D)); shape class is "large" (>= 2048 rows) or "small".
_FWD_TABLE: dict[tuple[str, str, int], FwdConfig] = {
    ("large", "bfloat16", 128): FwdConfig(32, 8),
    ("large", "bfloat16", 2048): FwdConfig(2, 8),
    ("large", "bfloat16", 4096): FwdConfig(1, 8),
    ("large", "bfloat16", 8192): FwdConfig(1, 16),
    ("large", "float32", 128): FwdConfig(32, 8),
    ("large", "float32", 2048): FwdConfig(2, 8),
    ("large", "float32", 4096): FwdConfig(1, 8),
}
_BWD_TABLE: dict[tuple[str, str, int], BwdConfig] = {
    ("large", "bfloat16", 128): BwdConfig(32, 528, 16),
    ("large", "bfloat16", 2048): BwdConfig(1, 528, 16),  # one row per step: faster than two in the sweep
    ("large", "bfloat16", 4096): BwdConfig(1, 528, 16),
    ("large", "bfloat16", 8192): BwdConfig(1, 528, 16),
    ("large", "float32", 128): BwdConfig(32, 528, 16),
    ("large", "float32", 2048): BwdConfig(2, 528, 16),
    ("large", "float32", 4096): BwdConfig(1, 528, 16),
}

_MIN_PROGRAMS = 264  # keep at least ~2 programs per SM (132 SMs on an H200) when shrinking BR


def _shape_class(rows: int) -> str:
    return "large" if rows >= 2048 else "small"


def _rows_for(rows: int, bd: int) -> int:
    br = max(1, min(64, 4096 // bd))  # ~4096 elements per tile
    while br > 1 and cdiv(rows, br) < _MIN_PROGRAMS:
        br //= 2
    return br


def _fwd_heuristic(rows: int, bd: int) -> FwdConfig:
    br = _rows_for(rows, bd)
    return FwdConfig(br, max(4, min(16, br * bd // 512)), 1)  # ~16 elements per thread


def _bwd_heuristic(rows: int, bd: int) -> BwdConfig:
    br = _rows_for(rows, bd)
    return BwdConfig(br, 528, max(4, min(16, br * bd // 256)), 2)  # ~8 elements per thread


def _clamp_rows(block_rows: int, rows: int) -> int:
    return max(1, min(block_rows, next_pow2(rows)))


def fwd_config(rows: int, d: int, dtype) -> FwdConfig:
    """Forward block config for `rows` rows of width d in `dtype` (table, else heuristic), clamped to the rows."""
    bd = next_pow2(d)
    cfg = _FWD_TABLE.get((_shape_class(rows), jnp.dtype(dtype).name, bd)) or _fwd_heuristic(rows, bd)
    return cfg._replace(block_rows=_clamp_rows(cfg.block_rows, rows))


def bwd_config(rows: int, d: int, dtype) -> BwdConfig:
    """Backward block config for `rows` rows of width d in `dtype` (table, else heuristic), clamped to the rows."""
    bd = next_pow2(d)
    cfg = _BWD_TABLE.get((_shape_class(rows), jnp.dtype(dtype).name, bd)) or _bwd_heuristic(rows, bd)
    return cfg._replace(block_rows=_clamp_rows(cfg.block_rows, rows))


# --------------------------------------------------------------------------------------------- kernels
def _tile_mask(r0, br: int, rows: int, bd: int, d: int):
    """(row mask [BR] or None, col mask [BD] or None, 2-D mask or None); None where nothing is ragged."""
    rmask = range_mask(r0, br, rows, rows % br != 0)
    cmask = jnp.arange(bd) < d if bd != d else None
    return rmask, cmask, broadcast_mask(mask_2d(rmask, cmask), (br, bd))


def _fwd_kernel(x_ref, w_ref, y_ref, rstd_ref, *, eps: float, offset: float, br: int, bd: int):
    rows, d = x_ref.shape
    r0 = pl.program_id(0) * br
    rmask, cmask, mask = _tile_mask(r0, br, rows, bd, d)
    tile = (pl.ds(r0, br), pl.ds(0, bd))
    x = load(x_ref.at[tile], mask, 0.0).astype(jnp.float32)
    w = load(w_ref.at[pl.ds(0, bd)], cmask, 0.0).astype(jnp.float32)
    ms = jnp.sum(x * x, axis=1) * (1.0 / d)
    rstd = lax.rsqrt(ms + eps)
    y = x * rstd[:, None] * (w + offset)[None, :]
    plgpu.store(y_ref.at[tile], y.astype(y_ref.dtype), mask=mask)
    plgpu.store(rstd_ref.at[pl.ds(r0, br)], rstd, mask=rmask)


def _forward(x2, w, eps, offset, interpret, cfg: FwdConfig):
    rows, d = x2.shape
    bd = next_pow2(d)
    br = cfg.block_rows
    kernel = functools.partial(_fwd_kernel, eps=eps, offset=offset, br=br, bd=bd)
    return pl.pallas_call(
        kernel,
        grid=(cdiv(rows, br),),
        out_shape=(
            jax.ShapeDtypeStruct((rows, d), x2.dtype),
            jax.ShapeDtypeStruct((rows,), jnp.float32),
        ),
        compiler_params=compiler_params(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="rms_norm_fwd",
    )(x2, w)


def _bwd_kernel(x_ref, w_ref, rstd_ref, dy_ref, dx_ref, dwp_ref, *, offset: float, br: int, bd: int,
                tiles_per_program: int):
    rows, d = x_ref.shape
    pid = pl.program_id(0)
    cmask = jnp.arange(bd) < d if bd != d else None
    w = load(w_ref.at[pl.ds(0, bd)], cmask, 0.0).astype(jnp.float32)
    w = (w + offset)[None, :]
    # Rows may run past `rows` in the last programs (whole tiles past the end are fully masked), so the
    # row mask is needed unless the programs tile the rows exactly.
    exact = rows % (br * tiles_per_program) == 0

    def body(i, acc):
        r0 = (pid * tiles_per_program + i) * br
        rmask = range_mask(r0, br, rows, not exact)
        mask = broadcast_mask(mask_2d(rmask, cmask), (br, bd))
        tile = (pl.ds(r0, br), pl.ds(0, bd))
        x = load(x_ref.at[tile], mask, 0.0).astype(jnp.float32)
        dy = load(dy_ref.at[tile], mask, 0.0).astype(jnp.float32)
        rstd = load(rstd_ref.at[pl.ds(r0, br)], rmask, 0.0)
        xhat = x * rstd[:, None]
        wdy = dy * w
        c = jnp.sum(xhat * wdy, axis=1) * (1.0 / d)
        dx = (wdy - xhat * c[:, None]) * rstd[:, None]
        plgpu.store(dx_ref.at[tile], dx.astype(dx_ref.dtype), mask=mask)
        return acc + jnp.sum(dy * xhat, axis=0)

    acc = lax.fori_loop(0, tiles_per_program, body, jnp.zeros((bd,), jnp.float32))
    plgpu.store(dwp_ref.at[pid, pl.ds(0, bd)], acc, mask=cmask)


def _dw_reduce_kernel(p_ref, dw_ref, *, bg: int, bc: int):
    g, d = p_ref.shape
    c0 = pl.program_id(0) * bc
    cmask = range_mask(c0, bc, d, d % bc != 0)

    def body(i, acc):
        g0 = i * bg
        gmask = range_mask(g0, bg, g, g % bg != 0)
        mask = broadcast_mask(mask_2d(gmask, cmask), (bg, bc))
        p = load(p_ref.at[pl.ds(g0, bg), pl.ds(c0, bc)], mask, 0.0)
        return acc + jnp.sum(p, axis=0)

    acc = lax.fori_loop(0, cdiv(g, bg), body, jnp.zeros((bc,), jnp.float32))
    plgpu.store(dw_ref.at[pl.ds(c0, bc)], acc.astype(dw_ref.dtype), mask=cmask)


def _backward_impl(x2, w, rstd, dy2, offset, interpret, cfg: BwdConfig):
    rows, d = x2.shape
    bd = next_pow2(d)
    br = cfg.block_rows
    ntiles = cdiv(rows, br)
    tiles_per_program = cdiv(ntiles, min(ntiles, cfg.max_programs))
    g = cdiv(ntiles, tiles_per_program)
    kernel = functools.partial(_bwd_kernel, offset=offset, br=br, bd=bd,
                               tiles_per_program=tiles_per_program)
    dx, dw_partial = pl.pallas_call(
        kernel,
        grid=(g,),
        out_shape=(
            jax.ShapeDtypeStruct((rows, d), x2.dtype),
            jax.ShapeDtypeStruct((g, d), jnp.float32),
        ),
        compiler_params=compiler_params(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="rms_norm_bwd",
    )(x2, w, rstd, dy2)
    # Column strips of 32-256 floats (>= ~64 programs at D >= 2048), ~2048 floats per loop step.
    bc = max(32, min(256, bd // 64)) if bd >= 32 else bd
    bg = min(next_pow2(g), max(1, 2048 // bc))
    dw = pl.pallas_call(
        functools.partial(_dw_reduce_kernel, bg=bg, bc=bc),
        grid=(cdiv(d, bc),),
        out_shape=jax.ShapeDtypeStruct((d,), w.dtype),
        compiler_params=compiler_params(num_warps=4, num_stages=2),
        interpret=interpret,
        name="rms_norm_dw_reduce",
    )(dw_partial)
    return dx, dw


# ------------------------------------------------------------------------------------------ custom_vjp
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _rms_norm(x2, w, eps, offset, interpret, fcfg, bcfg):
    y, _ = _forward(x2, w, eps, offset, interpret, fcfg)
    return y


def _rms_norm_fwd(x2, w, eps, offset, interpret, fcfg, bcfg):
    y, rstd = _forward(x2, w, eps, offset, interpret, fcfg)
    return y, (x2, w, rstd)


def _rms_norm_bwd(eps, offset, interpret, fcfg, bcfg, res, dy):
    x2, w, rstd = res
    return _backward_impl(x2, w, rstd, dy, offset, interpret, bcfg)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def rms_norm_with_config(x, weight, eps=1e-6, offset=0.0, *, interpret=None,
                         fwd: FwdConfig | None = None, bwd: BwdConfig | None = None):
    """`rms_norm` with explicit block configs (used by the benchmark sweep and tests)."""
    if x.shape[-1] != weight.shape[-1] or weight.ndim != 1:
        raise ValueError(f"rms_norm: weight must be [D] matching x[..., D]; got {x.shape} and {weight.shape}")
    d = x.shape[-1]
    if d > 8192:
        raise ValueError(f"rms_norm kernel supports D <= 8192, got {d}")
    x2 = x.reshape(-1, d)
    rows = x2.shape[0]
    if rows == 0:
        return x
    fcfg = fwd if fwd is not None else fwd_config(rows, d, x.dtype)
    bcfg = bwd if bwd is not None else bwd_config(rows, d, x.dtype)
    fcfg = fcfg._replace(block_rows=_clamp_rows(fcfg.block_rows, rows))
    bcfg = bcfg._replace(block_rows=_clamp_rows(bcfg.block_rows, rows))
    y = _rms_norm(x2, weight, float(eps), float(offset), resolve_interpret(interpret), fcfg, bcfg)
    return y.reshape(x.shape)


def rms_norm(x, weight, eps=1e-6, offset=0.0, *, interpret=None):
    """RMSNorm over the last axis: x * rsqrt(mean(x^2) + eps) * (offset + weight).

    x: [..., D] (D <= 8192), weight: [D]. float32 statistics, output in x.dtype. Differentiable in x and
    weight (dweight is accumulated in float32 and returned in weight.dtype). offset=1.0 is Gemma's (1 + w).
    """
    return rms_norm_with_config(x, weight, eps, offset, interpret=interpret)


__all__ = ["rms_norm", "rms_norm_with_config", "FwdConfig", "BwdConfig", "fwd_config", "bwd_config"]
