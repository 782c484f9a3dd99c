"""Fused gated activations SwiGLU and GEGLU (forward + backward) as Pallas kernels (Triton lowering).

Wins nowhere in the train step: alone 0.99-1.58x XLA forward and 1.99-2.60x backward, but the Qwen2-1.5B step is 5%
slower with it (187.6 vs 178.8 ms: XLA fuses the activation into the neighbouring matmuls) (BENCHMARKS.md, "Kernels
vs XLA, each alone, and what the train step says", row GLU). Default: off (ops.PALLAS_WINS["glu"] is False); tested,
and run when asked (glu=pallas; also the GLU backward of pallas_kernels.glu_fp8 with glu_backward="pallas").

    swiglu(gate, up) = silu(gate) * up
    geglu(gate, up)  = gelu(gate) * up      (erf form; tanh form when approximate=True, as torch's
                                             gelu(approximate="tanh"))

All math in float32 registers; outputs in the input dtype. The backward recomputes the activation from the
saved gate/up (nothing else is saved) and writes d_gate, d_up in one pass.

Layout: the op is purely elementwise, so gate/up are viewed as flat 1-D arrays (a free reshape of any
[..., F]) and each program moves one contiguous BLOCK of elements: every load/store is a large, aligned,
unmasked vector access except in the last program, which takes a separate masked path. Bytes per element:
forward reads 2 and writes 1, backward reads 3 and writes 2.

The Triton lowering has no erf, so the erf-form GELU uses a Chebyshev-fitted erfc (fractional error about
1.2e-7, Numerical Recipes' `erfcc` form), evaluated so that 1 + erf(x) keeps full relative precision for
negative x.

Block sizes: `_TABLE` keyed by (activation, dtype name, pass) with a heuristic fallback;
`bench/kernels_elementwise.py --sweep` prints the best entries for the GPU it runs on.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels._common import cdiv, compiler_params, load, next_pow2, pl, plgpu, range_mask, resolve_interpret


class GluConfig(NamedTuple):
    block: int  # elements per program (power of two)
    num_warps: int
    num_stages: int = 1


# Initial guesses for an H200, not swept yet (`bench/kernels_elementwise.py --sweep --only glu` prints the best
# entries): blocks small enough that no kernel spills registers. Key: (activation kind, dtype name,
# "fwd" | "bwd"); the activation is the "shape class" here since the flat layout makes the trailing dim
# irrelevant.
_TABLE: dict[tuple[str, str, str], GluConfig] = {
    (kind, dt, which): GluConfig(4096, 8) if which == "fwd" else GluConfig(2048, 8)
    for kind in ("silu", "gelu", "gelu_tanh") for dt in ("bfloat16", "float16") for which in ("fwd", "bwd")
} | {
    (kind, "float32", which): GluConfig(2048, 8) if which == "fwd" else GluConfig(1024, 8)
    for kind in ("silu", "gelu", "gelu_tanh") for which in ("fwd", "bwd")
}

# program_id * BLOCK is computed in int32 inside the kernel; larger arrays are processed in chunks.
_MAX_ELEMS_PER_CALL = 2**31 - 2**20


def config(n: int, dtype, which: str, kind: str = "silu") -> GluConfig:
    """Block config for n elements of `dtype`, pass `which` ("fwd" | "bwd") and activation `kind` (table, else a
    default), the block clamped to the problem size."""
    cfg = _TABLE.get((kind, jnp.dtype(dtype).name, which))
    if cfg is None:
        cfg = GluConfig(2048 if which == "fwd" else 1024, 4)
    return cfg._replace(block=max(16, min(cfg.block, next_pow2(n))))


# ----------------------------------------------------------------------------------------- activations
_SQRT_HALF = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715
# erfc(z) ~= t * exp(-z^2 + P(t)), t = 1 / (1 + z/2), z >= 0 (Chebyshev fit, fractional error < 1.2e-7).
_ERFC_COEFFS = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398,
                1.48851587, -0.82215223, 0.17087277)


def _one_plus_erf(x):
    """1 + erf(x) in float32, accurate in relative terms also where erf(x) is close to -1."""
    z = jnp.abs(x)
    t = 1.0 / (1.0 + 0.5 * z)
    p = jnp.full_like(z, _ERFC_COEFFS[-1])
    for c in _ERFC_COEFFS[-2::-1]:
        p = p * t + c
    erfc = t * jnp.exp(p - z * z)
    return jnp.where(x >= 0, 2.0 - erfc, erfc)


def _act(g, kind: str):
    if kind == "silu":
        return g / (1.0 + jnp.exp(-g))
    if kind == "gelu":
        return 0.5 * g * _one_plus_erf(g * _SQRT_HALF)
    if kind == "gelu_tanh":
        t = jnp.tanh(_SQRT_2_OVER_PI * (g + _GELU_C * g * g * g))
        return 0.5 * g * (1.0 + t)
    raise ValueError(kind)


def _act_and_grad(g, kind: str):
    if kind == "silu":
        s = 1.0 / (1.0 + jnp.exp(-g))
        return g * s, s * (1.0 + g * (1.0 - s))
    if kind == "gelu":
        cdf2 = _one_plus_erf(g * _SQRT_HALF)  # 2 * Phi(g)
        pdf = _INV_SQRT_2PI * jnp.exp(-0.5 * g * g)
        return 0.5 * g * cdf2, 0.5 * cdf2 + g * pdf
    if kind == "gelu_tanh":
        g2 = g * g
        t = jnp.tanh(_SQRT_2_OVER_PI * (g + _GELU_C * g2 * g))
        da = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_C * g2)
        return 0.5 * g * (1.0 + t), da
    raise ValueError(kind)


# --------------------------------------------------------------------------------------------- kernels
def _blockwise(n: int, block: int, body):
    """Run body(start, mask) on this program's block: unmasked everywhere except a ragged last block."""
    pid = pl.program_id(0)
    start = pid * block
    if n % block == 0:
        body(start, None)
        return
    last = n // block

    @pl.when(pid < last)
    def _():
        body(start, None)

    @pl.when(pid == last)
    def _():
        body(start, range_mask(start, block, n, True))


def _load_f32(ref, start, block, mask):
    """ref[start:start + block] (masked where `mask` is False) as float32."""
    return load(ref.at[pl.ds(start, block)], mask, 0.0).astype(jnp.float32)


def _fwd_kernel(g_ref, u_ref, o_ref, *, kind: str, block: int):
    def body(start, mask):
        g = _load_f32(g_ref, start, block, mask)
        u = _load_f32(u_ref, start, block, mask)
        plgpu.store(o_ref.at[pl.ds(start, block)], (_act(g, kind) * u).astype(o_ref.dtype), mask=mask)

    _blockwise(o_ref.shape[0], block, body)


def _bwd_kernel(g_ref, u_ref, dh_ref, dg_ref, du_ref, *, kind: str, block: int):
    def body(start, mask):
        g = _load_f32(g_ref, start, block, mask)
        u = _load_f32(u_ref, start, block, mask)
        dh = _load_f32(dh_ref, start, block, mask)
        a, da = _act_and_grad(g, kind)
        plgpu.store(dg_ref.at[pl.ds(start, block)], (dh * u * da).astype(dg_ref.dtype), mask=mask)
        plgpu.store(du_ref.at[pl.ds(start, block)], (dh * a).astype(du_ref.dtype), mask=mask)

    _blockwise(dg_ref.shape[0], block, body)


def _chunked(fn, n: int, *flat):
    """Apply fn to [0, n) of the flat operands in pieces of < 2**31 elements (int32 in-kernel offsets)."""
    if n <= _MAX_ELEMS_PER_CALL:
        return fn(*flat)
    outs = []
    for s in range(0, n, _MAX_ELEMS_PER_CALL):
        e = min(n, s + _MAX_ELEMS_PER_CALL)
        outs.append(fn(*(a[s:e] for a in flat)))
    if isinstance(outs[0], tuple):
        return tuple(jnp.concatenate(parts) for parts in zip(*outs))
    return jnp.concatenate(outs)


def _forward(g1, u1, kind, interpret, cfg: GluConfig):
    def call(g, u):
        n = g.shape[0]
        block = max(16, min(cfg.block, next_pow2(n)))
        return pl.pallas_call(
            functools.partial(_fwd_kernel, kind=kind, block=block),
            grid=(cdiv(n, block),),
            out_shape=jax.ShapeDtypeStruct((n,), g.dtype),
            compiler_params=compiler_params(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
            interpret=interpret,
            name=f"{kind}_glu_fwd",
        )(g, u)

    return _chunked(call, g1.shape[0], g1, u1)


def _backward(g1, u1, dh1, kind, interpret, cfg: GluConfig):
    def call(g, u, dh):
        n = g.shape[0]
        block = max(16, min(cfg.block, next_pow2(n)))
        return pl.pallas_call(
            functools.partial(_bwd_kernel, kind=kind, block=block),
            grid=(cdiv(n, block),),
            out_shape=(jax.ShapeDtypeStruct((n,), g.dtype), jax.ShapeDtypeStruct((n,), u.dtype)),
            compiler_params=compiler_params(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
            interpret=interpret,
            name=f"{kind}_glu_bwd",
        )(g, u, dh)

    return _chunked(call, g1.shape[0], g1, u1, dh1)


# ------------------------------------------------------------------------------------------ custom_vjp
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _glu(g1, u1, kind, interpret, fcfg, bcfg):
    return _forward(g1, u1, kind, interpret, fcfg)


def _glu_fwd(g1, u1, kind, interpret, fcfg, bcfg):
    return _forward(g1, u1, kind, interpret, fcfg), (g1, u1)


def _glu_bwd(kind, interpret, fcfg, bcfg, res, dh):
    g1, u1 = res
    return _backward(g1, u1, dh, kind, interpret, bcfg)


_glu.defvjp(_glu_fwd, _glu_bwd)


def glu_with_config(gate, up, kind: str, *, interpret=None, fwd: GluConfig | None = None,
                    bwd: GluConfig | None = None):
    """act(gate) * up for kind in {"silu", "gelu", "gelu_tanh"} with explicit block configs."""
    if gate.shape != up.shape:
        raise ValueError(f"glu: gate {gate.shape} and up {up.shape} must have the same shape")
    if kind not in ("silu", "gelu", "gelu_tanh"):
        raise ValueError(f"glu: unknown activation {kind!r}")
    n = math.prod(gate.shape)
    if n == 0:
        return jnp.zeros(gate.shape, gate.dtype)
    fcfg = fwd if fwd is not None else config(n, gate.dtype, "fwd", kind)
    bcfg = bwd if bwd is not None else config(n, gate.dtype, "bwd", kind)
    out = _glu(gate.reshape(n), up.reshape(n), kind, resolve_interpret(interpret), fcfg, bcfg)
    return out.reshape(gate.shape)


def swiglu(gate, up, *, interpret=None):
    """silu(gate) * up: gate, up [..., F] (same shape and float dtype) -> [..., F] in gate.dtype.

    float32 math; differentiable in gate and up."""
    return glu_with_config(gate, up, "silu", interpret=interpret)


def geglu(gate, up, approximate=False, *, interpret=None):
    """gelu(gate) * up: gate, up [..., F] (same shape and float dtype) -> [..., F] in gate.dtype.

    erf-form GELU, or the tanh form when approximate=True; float32 math; differentiable in gate and up."""
    return glu_with_config(gate, up, "gelu_tanh" if approximate else "gelu", interpret=interpret)


__all__ = ["swiglu", "geglu", "glu_with_config", "GluConfig", "config"]
