"""FP8 frozen-base matmuls for Hopper: float8_e4m3fn weights with per-output-channel scales, activations
quantized per row on the fly, incoming gradients in float8_e5m2, no weight gradient ever.

    w = quantize_fp8_weight(kernel)            # kernel [in, out] -> FP8Weight (values e4m3 [out, in], scale [out])
    y = fp8_matmul(x, w)                       # x [..., in] bf16 -> [..., out] bf16, differentiable in x

Scaling (what keeps e4m3's 3-bit mantissa accurate enough):
  weight      W[n, :] = values[n, :] * scale[n],      scale[n] = max_k |W[n, k]| * (1/448)
  activation  x[m, :] = xq[m, :] * sx[m],             sx[m]    = max_k |x[m, k]| * (1/448)         (e4m3)
  gradient    (g * scale)[m, :] = gq[m, :] * sg[m],   sg[m]    = max_n |g[m, n] scale[n]| * (1/57344) (e5m2)
with values = round(W[n, :] * (1/scale[n])) and likewise for the rows (all float32; the reciprocals are IEEE
divisions, so every backend rounds the same way).
Forward y = (xq @ values^T) * sx[:, None] * scale[None, :]; backward dx = (gq @ values) * sg[:, None]: the weight
scale sits on the contraction axis of the backward GEMM, so it is folded into g before g is quantized. Both
GEMMs are XLA dots of float8 operands, which XLA lowers to cuBLASLt FP8 GEMMs on Hopper (float32 accumulation);
elsewhere XLA upcasts them, so the same numbers come out of the CPU in tests.

`gemm_out` is the dtype a GEMM writes its unscaled product in before the row/channel scales are applied (in
float32, by the fusion that reads it): float32 (the default) or bfloat16, which halves the bytes the GEMM writes
and its scale fusion reads at the cost of one more bf16 rounding (relative 2^-9, far below e4m3's 2^-4). The
per-row and per-channel scales cannot go into the GEMM itself: Hopper's cuBLASLt FP8 GEMM takes scalar scales.

The HF [out, in] layout puts the forward GEMM's contraction axis innermost for both operands (the layout
cuBLASLt's FP8 GEMM takes); the backward GEMM contracts the weight's outer axis, for which XLA transposes it.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
E4M3_MAX = 448.0
E5M2_MAX = 57344.0
_TINY = 1e-12  # floor of a scale, so an all-zero row quantizes to zeros instead of NaN


@jax.tree_util.register_pytree_node_class
class FP8Weight:
    """A frozen weight in FP8: `values` float8_e4m3fn [..., out, in] and `scale` float32 [..., out] (leading
    stacking axes allowed, as for the decoder's layer stacks). Aux data: `dtype`, the original dtype's name."""

    __slots__ = ("values", "scale", "dtype")

    def __init__(self, values, scale, *, dtype: str = "bfloat16"):
        self.values = values
        self.scale = scale
        self.dtype = str(jnp.dtype(dtype))

    def tree_flatten(self):
        return (self.values, self.scale), self.dtype

    @classmethod
    def tree_unflatten(cls, dtype, children):
        obj = object.__new__(cls)
        obj.values, obj.scale = children
        obj.dtype = dtype
        return obj

    @property
    def shape(self) -> tuple[int, int]:
        """One layer's HF shape (out, in)."""
        return tuple(int(s) for s in np.shape(self.values)[-2:])

    @property
    def stack_shape(self) -> tuple[int, ...]:
        return tuple(np.shape(self.values)[:-2])

    @property
    def numel(self) -> int:
        return int(math.prod(self.shape))

    def __repr__(self) -> str:
        lead = f"stack={self.stack_shape}, " if self.stack_shape else ""
        return f"FP8Weight({lead}shape={self.shape}, e4m3, per-output-channel scale, dtype={self.dtype})"


@jax.jit
def quantize_fp8_weight(kernel: jax.Array) -> FP8Weight:
    """kernel [..., in, out] (the decoder's layout, any float dtype) -> FP8Weight in HF [..., out, in] layout."""
    w = jnp.swapaxes(kernel, -1, -2).astype(jnp.float32)
    values, scale = _quantize_last_axis(w, E4M3)
    return FP8Weight(values, scale, dtype=kernel.dtype)


def scale_of(amax: jax.Array, dtype=E4M3) -> jax.Array:
    """The float32 scale of rows whose largest magnitude is `amax`: amax * (1 / top of `dtype`), floored."""
    top = E4M3_MAX if jnp.dtype(dtype) == jnp.dtype(E4M3) else E5M2_MAX
    return jnp.maximum(amax * jnp.float32(1.0 / top), jnp.float32(_TINY))


def _quantize_last_axis(x: jax.Array, dtype):
    """(x * (1 / scale) in `dtype`, scale) with scale = max |x| * (1 / top) over the last axis (float32 x)."""
    scale = scale_of(jnp.max(jnp.abs(x), axis=-1), dtype)
    inv = jnp.float32(1.0) / scale
    return (x * inv[..., None]).astype(dtype), scale


def dequantize_fp8_weight(w: FP8Weight, dtype=None) -> jax.Array:
    """The dense [..., out, in] weight an FP8Weight stands for, in `dtype` (default: the original dtype)."""
    out = w.values.astype(jnp.float32) * w.scale[..., None]
    return out.astype(dtype or w.dtype)


def quantize_rows(x: jax.Array, dtype=E4M3) -> tuple[jax.Array, jax.Array]:
    """Per-row quantization of x [M, K]: (xq [M, K] in `dtype`, scale [M] float32) with x ~= xq * scale[:, None]."""
    return _quantize_last_axis(x.astype(jnp.float32), dtype)


def _dot_nt(a, b, out_dtype):
    """a [M, K] @ b [N, K]^T with float32 accumulation, result in out_dtype."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=out_dtype)


def _dot_nn(a, b, out_dtype):
    """a [M, N] @ b [N, K] with float32 accumulation, result in out_dtype."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=out_dtype)


GEMM_OUT_DTYPES = ("float32", "bfloat16")


def gemm_out_dtype(gemm_out) -> jnp.dtype:
    """The checked dtype of a `gemm_out` argument (a name or dtype in GEMM_OUT_DTYPES)."""
    name = str(jnp.dtype(gemm_out))
    if name not in GEMM_OUT_DTYPES:
        raise ValueError(f"fp8 gemm_out must be one of {', '.join(GEMM_OUT_DTYPES)}, got {name}")
    return jnp.dtype(name)


def fp8_matmul_quantized(xq: jax.Array, sx: jax.Array, w: FP8Weight, out_dtype, gemm_out=jnp.float32
                         ) -> jax.Array:
    """The forward GEMM of already quantized rows: xq e4m3 [M, in], sx float32 [M] -> [M, out] in out_dtype
    (the GEMM writes gemm_out, module docstring)."""
    y = _dot_nt(xq, w.values, gemm_out_dtype(gemm_out)).astype(jnp.float32)
    return (y * sx[:, None] * w.scale[None, :]).astype(out_dtype)


def fp8_matmul_dx(g: jax.Array, w: FP8Weight, gemm_out=jnp.float32) -> jax.Array:
    """The backward GEMM: g [M, out] (the output's cotangent) -> dx [M, in] in g.dtype, g quantized to e5m2 with
    the weight scale folded in (module docstring)."""
    gq, sg = quantize_rows(g.astype(jnp.float32) * w.scale[None, :], E5M2)
    dx = _dot_nn(gq, w.values, gemm_out_dtype(gemm_out)).astype(jnp.float32) * sg[:, None]
    return dx.astype(g.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fp8_matmul_2d(x2, w, gemm_out):
    xq, sx = quantize_rows(x2, E4M3)
    return fp8_matmul_quantized(xq, sx, w, x2.dtype, gemm_out)


def _fp8_matmul_fwd(x2, w, gemm_out):
    return _fp8_matmul_2d(x2, w, gemm_out), w


def _fp8_matmul_bwd(gemm_out, w, g):
    zero_w = jax.tree.map(jnp.zeros_like, w)  # frozen: never used, so XLA removes it
    return fp8_matmul_dx(g, w, gemm_out), zero_w


_fp8_matmul_2d.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)


def fp8_matmul(x: jax.Array, w: FP8Weight, *, gemm_out="float32") -> jax.Array:
    """x [..., in] @ W^T for an FP8Weight of HF shape [out, in] -> [..., out] in x.dtype (see the module
    docstring for the scaling and `gemm_out`, "float32" or "bfloat16"). Differentiable in x only; the weight
    never gets a gradient."""
    if w.stack_shape:
        raise ValueError(f"fp8_matmul needs one layer's weight, got {w}")
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"x last dim {x.shape[-1]} != weight in-features {w.shape[1]}")
    lead = x.shape[:-1]
    y = _fp8_matmul_2d(x.reshape(-1, x.shape[-1]), w, str(gemm_out_dtype(gemm_out)))
    return y.reshape(*lead, w.shape[0])


def fp8_matmul_reference(x: jax.Array, w: FP8Weight) -> jax.Array:
    """Plain-jnp twin: the quantized operands dequantized to float32, a float32 matmul, rounded to x.dtype."""
    xq, sx = quantize_rows(x.reshape(-1, x.shape[-1]), E4M3)
    xd = xq.astype(jnp.float32) * sx[:, None]
    y = xd @ dequantize_fp8_weight(w, jnp.float32).T
    return y.astype(x.dtype).reshape(*x.shape[:-1], w.shape[0])


__all__ = ["FP8Weight", "GEMM_OUT_DTYPES", "gemm_out_dtype", "scale_of", "quantize_fp8_weight",
           "dequantize_fp8_weight", "quantize_rows", "fp8_matmul", "fp8_matmul_quantized", "fp8_matmul_dx",
           "fp8_matmul_reference", "E4M3", "E5M2"]
