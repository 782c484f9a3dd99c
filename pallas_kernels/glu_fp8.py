"""The MLP's gated activation fused with the e4m3 row quantization of its output, feeding an FP8 down_proj.

Wins nowhere in the train step: the Llama-3-8B FP8 step is 1.2% slower with it (264.24 vs 261.18 ms) (BENCHMARKS.md,
"Options measured in the step and left off", row glu_fp8=pallas). Default: off (ops.PALLAS_WINS["glu_fp8"] is
False): XLA's GLU, then fp8_matmul quantizes h; tested, and run when asked (glu_fp8=pallas).

    h      = act(gate) * up                       rounded to gate.dtype, as `reference.swiglu` / `geglu` give it
    sx[m]  = max(max_k |h[m, k]| * (1/448), 1e-12)   float32 [M]
    hq     = (h * (1 / sx[:, None])) in float8_e4m3fn  [M, F]

exactly `pallas_kernels.fp8`'s activation quantization of h (the same float32 operations in the same order,
applied to the same rounded h), so `glu_fp8_matmul(gate, up, w)` computes what `fp8_matmul(glu(gate, up), w)`
computes, without writing h in float32 or reading it back for its absmax. h itself is written (in gate.dtype)
only when asked for (`with_h`: down_proj's LoRA A consumes it).

Layout: gate/up [M, F]; each program owns BR rows and walks the F columns in chunks of BC (powers of two):
- one chunk (BC >= F): h is computed once in registers, its row absmax taken, quantized and stored;
- several chunks: pass 1 computes h chunk by chunk (storing h when asked) and keeps the running row absmax,
  pass 2 recomputes h chunk by chunk (gate/up read again, mostly from L2) and stores hq. The recomputation is
  bit-identical, so both layouts give the same output.
The row scale's reciprocal is an IEEE division (PTX `div.rn.f32` on the GPU; Triton's own float32 division is
the approximate `div.full`), as XLA's is.

Differentiation (`glu_fp8_matmul`): the quantization is straight-through, as in the unfused composition: the
cotangent of h is fp8_matmul's dx (e5m2 gradient GEMM, `fp8.fp8_matmul_dx`) plus the cotangent of the h output
(the LoRA path), and d gate, d up come from the existing GLU backward: the Pallas kernel of `pallas_kernels.glu`
(`glu_backward="pallas"`) or the VJP of the plain-jnp reference (`"xla"`).

Block sizes: `config()` (initial guesses for an H200, not swept; `bench/glu_fp8_bench.py --sweep` times the
candidates).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import fp8, reference
from pallas_kernels._common import (broadcast_mask, cdiv, compiler_params, load, mask_2d, next_pow2, pl, plgpu,
                                    range_mask, resolve_interpret)
from pallas_kernels.glu import _act, _backward
from pallas_kernels.glu import config as glu_config

KINDS = ("silu", "gelu", "gelu_tanh")
_INV_E4M3_MAX = 1.0 / fp8.E4M3_MAX
# In-kernel offsets are int32: calls with more elements are split over rows.
_MAX_ELEMS_PER_CALL = 2**31 - 2**20


class GluFp8Config(NamedTuple):
    block_rows: int  # rows per program (power of two)
    block_cols: int  # columns per chunk (power of two); >= F means one pass with the row in registers
    num_warps: int
    num_stages: int = 1


def config(rows: int, f: int) -> GluFp8Config:
    """Block config for gate/up [rows, f]: the whole row in registers (about 32 elements a thread per operand)
    up to 16384 columns, else 8192-column chunks; clamped to the problem size."""
    bf = next_pow2(f)
    if bf <= 16384:
        br = max(1, min(next_pow2(rows), 8192 // bf)) if bf < 8192 else 1
        return GluFp8Config(br, bf, max(4, min(16, br * bf // 1024)))
    return GluFp8Config(1, 8192, 8)


def _activation(kind: str):
    """act(g) in float32: silu and the tanh GELU as the reference writes them (so interpret mode is bit-exact),
    the erf GELU as the GLU kernel computes it (the Triton lowering has no erf)."""
    if kind == "silu":
        return lambda g: g * jax.nn.sigmoid(g)
    if kind == "gelu_tanh":
        return lambda g: jax.nn.gelu(g, approximate=True)
    return functools.partial(_act, kind=kind)


def _reciprocal(x, interpret: bool):
    """1 / x for float32 x, correctly rounded on every backend."""
    if interpret:
        return 1.0 / x
    [y] = plgpu.elementwise_inline_asm("div.rn.f32 $0, $1, $2;", args=[jnp.ones_like(x), x],
                                       constraints="=f,f,f", pack=1,
                                       result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])
    return y


def _kernel(g_ref, u_ref, *out_refs, kind: str, br: int, bc: int, with_h: bool, interpret: bool):
    hq_ref, sx_ref = out_refs[:2]
    h_ref = out_refs[2] if with_h else None
    rows, f = g_ref.shape
    r0 = pl.program_id(0) * br
    rmask = range_mask(r0, br, rows, rows % br != 0)
    n_chunks = cdiv(f, bc)
    act = _activation(kind)

    def tile_and_mask(c0):
        cmask = range_mask(c0, bc, f, f % bc != 0)
        return (pl.ds(r0, br), pl.ds(c0, bc)), broadcast_mask(mask_2d(rmask, cmask), (br, bc))

    def h_of(tile, mask):
        """float32 h of the tile, rounded through the output dtype (0 where masked)."""
        g = load(g_ref.at[tile], mask, 0.0).astype(jnp.float32)
        u = load(u_ref.at[tile], mask, 0.0).astype(jnp.float32)
        return (act(g) * u).astype(g_ref.dtype)

    def store_hq(tile, mask, h, inv):
        hq = (h.astype(jnp.float32) * inv[:, None]).astype(hq_ref.dtype)
        plgpu.store(hq_ref.at[tile], hq, mask=mask)

    def row_absmax(h):
        return jnp.max(jnp.abs(h.astype(jnp.float32)), axis=1)

    def finish(amax):
        scale = jnp.maximum(amax * jnp.float32(_INV_E4M3_MAX), jnp.float32(fp8._TINY))
        plgpu.store(sx_ref.at[pl.ds(r0, br)], scale, mask=rmask)
        return _reciprocal(scale, interpret)

    if n_chunks == 1:
        tile, mask = tile_and_mask(0)
        h = h_of(tile, mask)
        if with_h:
            plgpu.store(h_ref.at[tile], h, mask=mask)
        store_hq(tile, mask, h, finish(row_absmax(h)))
        return

    def pass1(i, amax):
        tile, mask = tile_and_mask(i * bc)
        h = h_of(tile, mask)
        if with_h:
            plgpu.store(h_ref.at[tile], h, mask=mask)
        return jnp.maximum(amax, row_absmax(h))

    inv = finish(lax.fori_loop(0, n_chunks, pass1, jnp.zeros((br,), jnp.float32)))

    def pass2(i, carry):
        tile, mask = tile_and_mask(i * bc)
        store_hq(tile, mask, h_of(tile, mask), inv)
        return carry

    lax.fori_loop(0, n_chunks, pass2, 0)


def _call(g2, u2, kind, with_h, interpret, cfg: GluFp8Config):
    rows, f = g2.shape
    br = max(1, min(cfg.block_rows, next_pow2(rows)))
    bc = max(16, min(cfg.block_cols, next_pow2(f)))
    out_shape = [jax.ShapeDtypeStruct((rows, f), fp8.E4M3), jax.ShapeDtypeStruct((rows,), jnp.float32)]
    if with_h:
        out_shape.append(jax.ShapeDtypeStruct((rows, f), g2.dtype))
    return pl.pallas_call(
        functools.partial(_kernel, kind=kind, br=br, bc=bc, with_h=with_h, interpret=interpret),
        grid=(cdiv(rows, br),),
        out_shape=tuple(out_shape),
        compiler_params=compiler_params(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"{kind}_glu_e4m3_fwd",
    )(g2, u2)


def _check(gate, up, kind):
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"glu_fp8: gate {gate.shape} {gate.dtype} and up {up.shape} {up.dtype} must have the "
                         "same shape and dtype")
    if kind not in KINDS:
        raise ValueError(f"glu_fp8: unknown activation {kind!r}; use one of {', '.join(KINDS)}")
    if gate.ndim < 1 or gate.shape[-1] == 0:
        raise ValueError(f"glu_fp8: gate {gate.shape} needs a non-empty last axis")


def glu_quantize(gate, up, kind: str = "silu", *, with_h: bool = False, interpret=None,
                 cfg: GluFp8Config | None = None):
    """gate, up [M, F] (same float dtype) -> (hq float8_e4m3fn [M, F], sx float32 [M], h [M, F] in gate.dtype
    or None): h = act(gate) * up and its per-row e4m3 quantization (module docstring). Forward only."""
    _check(gate, up, kind)
    if gate.ndim != 2:
        raise ValueError(f"glu_quantize: gate must be [M, F], got {gate.shape}")
    rows, f = gate.shape
    cfg = cfg or config(rows, f)
    interpret = resolve_interpret(interpret)
    step = max(1, _MAX_ELEMS_PER_CALL // f)
    parts = [_call(gate[s:s + step], up[s:s + step], kind, with_h, interpret, cfg) for s in range(0, rows, step)]
    outs = parts[0] if len(parts) == 1 else tuple(jnp.concatenate(p) for p in zip(*parts))
    return outs[0], outs[1], (outs[2] if with_h else None)


def _reference_glu(kind):
    """The reference GLU of `kind`: h = act(gate) * up in the inputs' dtype."""
    if kind == "silu":
        return reference.swiglu
    return functools.partial(reference.geglu, approximate=kind == "gelu_tanh")


def glu_quantize_reference(gate, up, kind: str = "silu"):
    """Plain-jnp twin of glu_quantize: (hq, sx, h) from reference.swiglu / geglu and fp8.quantize_rows."""
    h = _reference_glu(kind)(gate, up)
    hq, sx = fp8.quantize_rows(h, fp8.E4M3)
    return hq, sx, h


# ------------------------------------------------------------------------------------------ custom_vjp
def _outputs(g2, u2, w, kind, with_h, gemm_out, interpret, cfg):
    hq, sx, h = glu_quantize(g2, u2, kind, with_h=with_h, interpret=interpret, cfg=cfg)
    y = fp8.fp8_matmul_quantized(hq, sx, w, g2.dtype, gemm_out)
    return (y, h) if with_h else (y,)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def _glu_fp8_matmul(g2, u2, w, kind, with_h, glu_backward, gemm_out, interpret, cfg):
    return _outputs(g2, u2, w, kind, with_h, gemm_out, interpret, cfg)


def _glu_fp8_matmul_fwd(g2, u2, w, kind, with_h, glu_backward, gemm_out, interpret, cfg):
    return _outputs(g2, u2, w, kind, with_h, gemm_out, interpret, cfg), (g2, u2, w)


def _glu_fp8_matmul_bwd(kind, with_h, glu_backward, gemm_out, interpret, cfg, res, cts):
    g2, u2, w = res
    dh = fp8.fp8_matmul_dx(cts[0], w, gemm_out)  # in the output dtype, as fp8_matmul's dx
    if with_h:
        dh = dh + cts[1].astype(dh.dtype)  # the LoRA path's cotangent of h, summed as autodiff sums them
    if glu_backward == "pallas":
        n = g2.size
        flat = _backward(g2.reshape(n), u2.reshape(n), dh.reshape(n), kind, interpret,
                         glu_config(n, g2.dtype, "bwd", kind))
        dg, du = (d.reshape(g2.shape) for d in flat)
    else:
        _, vjp = jax.vjp(_reference_glu(kind), g2, u2)
        dg, du = vjp(dh)
    return dg, du, jax.tree.map(jnp.zeros_like, w)  # the frozen weight's zero is never used: XLA removes it


_glu_fp8_matmul.defvjp(_glu_fp8_matmul_fwd, _glu_fp8_matmul_bwd)


def glu_fp8_matmul(gate, up, w: fp8.FP8Weight, kind: str = "silu", *, with_h: bool = False,
                   glu_backward: str = "xla", gemm_out="float32", interpret=None, cfg: GluFp8Config | None = None):
    """fp8_matmul(act(gate) * up, w) with the activation and its e4m3 quantization in one kernel.

    gate, up [..., F] (same float dtype); w: one layer's FP8Weight of HF shape [out, F]. Returns y [..., out] in
    gate.dtype, and with `with_h` also h [..., F] in gate.dtype (for down_proj's LoRA): (y, h), else y.
    Differentiable in gate and up (and through h); the GLU backward is `glu_backward` ("pallas": the
    pallas_kernels.glu kernel; "xla": the reference's VJP). gemm_out: the down GEMMs' output dtype before
    their scales (pallas_kernels.fp8, "float32" or "bfloat16")."""
    _check(gate, up, kind)
    if w.stack_shape or w.shape[1] != gate.shape[-1]:
        raise ValueError(f"glu_fp8_matmul: gate {gate.shape} needs one layer's weight of in-features "
                         f"{gate.shape[-1]}, got {w}")
    if glu_backward not in ("pallas", "xla"):
        raise ValueError(f"glu_fp8_matmul: glu_backward must be 'pallas' or 'xla', got {glu_backward!r}")
    lead, f = gate.shape[:-1], gate.shape[-1]
    cfg = cfg or config(max(1, gate.size // f), f)
    outs = _glu_fp8_matmul(gate.reshape(-1, f), up.reshape(-1, f), w, kind, with_h, glu_backward,
                           str(fp8.gemm_out_dtype(gemm_out)), resolve_interpret(interpret), cfg)
    y = outs[0].reshape(*lead, w.shape[0])
    return (y, outs[1].reshape(gate.shape)) if with_h else y


__all__ = ["glu_quantize", "glu_quantize_reference", "glu_fp8_matmul", "GluFp8Config", "config"]
