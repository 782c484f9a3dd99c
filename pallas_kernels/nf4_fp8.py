"""NF4 bases multiplied in FP8: a frozen NF4 weight (QLoRA storage) dequantized straight to e4m3 with
per-output-channel scales, for the cuBLASLt FP8 GEMMs of `pallas_kernels.fp8` (FP8 compute).

Wins, with FP8 numerics: the Llama-3-8B QLoRA step takes 275.41 ms this way against 389.87 with NF4 dequantized to
bf16 (BENCHMARKS.md, "Training speed, 2,048-token rows", rows QLoRA). Default: off, asked for only (ops setting
nf4_gemm=fp8), because it changes the numbers (BENCHMARKS.md, "FP8 quality: SmolLM2-135M-Instruct on the CPU"), not
for speed.

    w8 = nf4_to_fp8_weight(q)                  # NF4Weight [out, in] -> FP8Weight (e4m3 [out, in], scale [out])
    y  = nf4_fp8_matmul(x, q)                  # x [..., in] -> [..., out] in x.dtype, differentiable in x

Scaling. Every NF4 block holds one element of magnitude exactly its absmax (NF4's codes include +-1.0), so the
largest |W| of a row is the largest absmax of its blocks, and the row scale needs no pass over the codes:
  scale[n]        = max(max_b absmax[n, b] * (1/448), 1e-12)      (fp8's weight scale, exactly what
                                                                    `fp8.quantize_fp8_weight` of the
                                                                    dequantized weight gives)
  mult[n, b]      = absmax[n, b] * (1 / scale[n])                   float32, one per block
  values[n, k]    = e4m3(NF4_CODE[code[n, k]] * mult[n, k // blocksize])
The values are the NF4 dequantization with `mult` as the block scales, written in e4m3: the Pallas dequantize
kernel (`pallas_kernels.nf4`) or its jnp twin, one pass reading 4 bits and writing 8 per element. They can
differ from quantizing the dequantized float32 weight only where the two float32 roundings land on either
side of an e4m3 rounding boundary (rare; the tests count them). A row that spans several blocks' boundary
(in % blocksize != 0, no real model) takes the general route: dequantize to float32, quantize the rows.

Differentiation: dX = fp8_matmul's e5m2 gradient GEMM against the same e4m3 weight, which the backward pass
rebuilds from the NF4 codes (nothing but the NF4 weight is kept between forward and backward, as in the
16-bit QLoRA path). The weight gets no gradient.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import fp8, nf4, reference
from pallas_kernels._common import resolve_interpret
from pallas_kernels.nf4_format import NF4Weight, decoded_absmax

_E4M3 = "float8_e4m3fn"


def _block_multipliers(q: NF4Weight) -> tuple[jax.Array, jax.Array]:
    """(mult float32 [nblocks], scale float32 [out]) of one layer whose rows are whole blocks (module docstring)."""
    out_f, in_f = q.shape
    per_row = decoded_absmax(q).reshape(out_f, in_f // q.blocksize)
    scale = fp8.scale_of(jnp.max(per_row, axis=-1))  # the row's |W| max is its largest block absmax
    inv = jnp.float32(1.0) / scale
    return (per_row * inv[:, None]).reshape(-1), scale


def rows_are_blocks(q: NF4Weight) -> bool:
    """Whether every row of the [out, in] weight is a whole number of NF4 blocks (true for real models)."""
    return len(q.shape) == 2 and q.shape[1] % q.blocksize == 0


def nf4_to_fp8_weight(q: NF4Weight, *, use_kernel: bool = True, interpret: bool | None = None) -> fp8.FP8Weight:
    """One layer's NF4 weight (HF [out, in]) as an FP8Weight: e4m3 values [out, in], float32 scale [out].

    use_kernel: the Pallas dequantize kernel writes the e4m3 values (else the jnp twin, `reference`)."""
    if q.stack_shape or len(q.shape) != 2:
        raise ValueError(f"nf4_to_fp8_weight needs one layer's [out, in] weight, got {q}")
    if not rows_are_blocks(q):
        dense = (nf4.dequantize_nf4(q, jnp.float32, interpret=interpret) if use_kernel
                 else reference.dequantize_nf4(q, jnp.float32))
        values, scale = fp8.quantize_rows(dense, fp8.E4M3)
        return fp8.FP8Weight(values, scale, dtype=q.dtype)
    mult, scale = _block_multipliers(q)
    scaled = NF4Weight(q.codes, mult, None, None, shape=q.shape, dtype="float32", blocksize=q.blocksize)
    if use_kernel:
        values = nf4.dequantize_nf4_to(scaled, _E4M3, interpret=resolve_interpret(interpret))
    else:
        values = reference.dequantize_nf4(scaled, jnp.float8_e4m3fn)
    return fp8.FP8Weight(values, scale, dtype=q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _matmul_2d(x2, q, use_kernel, gemm_out, interpret):
    w8 = nf4_to_fp8_weight(q, use_kernel=use_kernel, interpret=interpret)
    xq, sx = fp8.quantize_rows(x2, fp8.E4M3)
    return fp8.fp8_matmul_quantized(xq, sx, w8, x2.dtype, gemm_out)


def _matmul_fwd(x2, q, use_kernel, gemm_out, interpret):
    return _matmul_2d(x2, q, use_kernel, gemm_out, interpret), q


def _matmul_bwd(use_kernel, gemm_out, interpret, q, g):
    w8 = nf4_to_fp8_weight(q, use_kernel=use_kernel, interpret=interpret)  # rebuilt, not kept
    zero_q = jax.tree.map(jnp.zeros_like, q)  # frozen: never used, so XLA removes it
    return fp8.fp8_matmul_dx(g, w8, gemm_out), zero_q


_matmul_2d.defvjp(_matmul_fwd, _matmul_bwd)


def nf4_fp8_matmul(x: jax.Array, q: NF4Weight, *, use_kernel: bool = True, gemm_out="float32",
                   interpret: bool | None = None) -> jax.Array:
    """x [..., in] @ W^T for one layer's NF4 weight W [out, in], as FP8 GEMMs (module docstring): x quantized
    per row to e4m3, W to e4m3 per output channel; the backward's dX quantizes the cotangent to e5m2.
    Result in x.dtype; gemm_out as in `pallas_kernels.fp8` ("float32" or "bfloat16")."""
    if q.stack_shape or len(q.shape) != 2:
        raise ValueError(f"nf4_fp8_matmul needs one layer's [out, in] weight, got {q}")
    if x.shape[-1] != q.shape[1]:
        raise ValueError(f"x last dim {x.shape[-1]} != weight in-features {q.shape[1]}")
    y = _matmul_2d(x.reshape(-1, x.shape[-1]), q, bool(use_kernel), str(fp8.gemm_out_dtype(gemm_out)),
                   resolve_interpret(interpret))
    return y.reshape(*x.shape[:-1], q.shape[0])


__all__ = ["nf4_to_fp8_weight", "nf4_fp8_matmul", "rows_are_blocks"]
