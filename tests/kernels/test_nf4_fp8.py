"""NF4 bases as FP8 GEMMs (pallas_kernels.nf4_fp8): the e4m3 weight bit for bit against numpy + ml_dtypes, its
scales against fp8's own quantization of the dequantized weight, and the matmul, forward and dX, against
fp8_matmul of that weight and against the dense NF4 matmul. Interpret mode on the CPU; `-m gpu` on the H200."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pallas_kernels.nf4_format as fmt
from pallas_kernels import fp8, reference
from pallas_kernels.nf4_fp8 import nf4_fp8_matmul, nf4_to_fp8_weight, rows_are_blocks
from tests.helpers import lower_for_cuda


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _quantized(rng, out_f, in_f, double=True):
    w = (rng.standard_normal((out_f, in_f)) * rng.uniform(0.02, 0.2, size=(out_f, 1))).astype(np.float32)
    return w, fmt.quantize_nf4(jnp.asarray(w), double_quant=double)


def _numpy_fp8(q: fmt.NF4Weight):
    """The module docstring's formulas in numpy (float32 steps, ml_dtypes' e4m3 rounding)."""
    out_f, in_f = q.shape
    absmax = np.asarray(fmt.decoded_absmax(q), np.float32).reshape(out_f, -1)
    scale = np.maximum(absmax.max(-1) * np.float32(1 / 448), np.float32(1e-12)).astype(np.float32)
    mult = (absmax * (np.float32(1) / scale)[:, None]).astype(np.float32)
    b = np.asarray(q.codes).astype(np.int32)
    codes = np.stack([(b >> 4) & 15, b & 15], -1).reshape(out_f, in_f)
    vals = fmt.NF4_CODE[codes].astype(np.float32) * np.repeat(mult, q.blocksize, axis=1)
    return vals.astype(ml_dtypes.float8_e4m3fn), scale


@pytest.mark.parametrize("double", [True, False])
@pytest.mark.parametrize("use_kernel", [True, False])
def test_fp8_weight_bit_exact_and_scales_as_fp8_quantization(rng, double, use_kernel):
    w, q = _quantized(rng, 96, 320, double)
    assert rows_are_blocks(q)
    w8 = nf4_to_fp8_weight(q, use_kernel=use_kernel)
    want_vals, want_scale = _numpy_fp8(q)
    assert w8.values.dtype == jnp.float8_e4m3fn and w8.shape == (96, 320) and w8.dtype == "float32"
    np.testing.assert_array_equal(np.asarray(w8.values).view(np.uint8), want_vals.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(w8.scale), want_scale)
    # fp8's own quantization of the dequantized weight: the same scales (each block holds a +-1 code), values
    # apart only where two float32 roundings straddle an e4m3 boundary, then by one e4m3 step
    dense = reference.dequantize_nf4(q, jnp.float32)
    direct = fp8.quantize_fp8_weight(dense.T)
    np.testing.assert_array_equal(np.asarray(direct.scale), want_scale)
    a = np.asarray(direct.values.astype(jnp.float32))
    b = np.asarray(w8.values.astype(jnp.float32))
    differ = a != b
    assert differ.mean() < 1e-3
    assert np.all(np.abs(a - b)[differ] <= np.abs(a[differ]) * 2.0**-3 + 2.0**-9)
    # and e4m3 adds a few percent to NF4's error only
    deq8 = np.asarray(fp8.dequantize_fp8_weight(w8, jnp.float32))
    assert _rel(deq8, np.asarray(dense)) < 0.03 and _rel(deq8, w) < 0.12


def test_rows_across_blocks_take_the_general_route(rng):
    w = rng.standard_normal((6, 40)).astype(np.float32)  # 40 % 64 != 0: blocks span rows
    q = fmt.quantize_nf4(jnp.asarray(w))
    assert not rows_are_blocks(q)
    dense = reference.dequantize_nf4(q, jnp.float32)
    want = fp8.quantize_fp8_weight(dense.T)
    for use_kernel in (True, False):
        got = nf4_to_fp8_weight(q, use_kernel=use_kernel)
        np.testing.assert_array_equal(np.asarray(got.values).view(np.uint8), np.asarray(want.values).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(want.scale))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("gemm_out", ["float32", "bfloat16"])
def test_matmul_is_fp8_matmul_of_the_fp8_weight(rng, dtype, gemm_out):
    w, q = _quantized(rng, 80, 192)
    x = jnp.asarray(rng.standard_normal((3, 10, 192)), dtype)
    g = jnp.asarray(rng.standard_normal((3, 10, 80)), dtype)
    w8 = nf4_to_fp8_weight(q, use_kernel=False)

    def fwd_bwd(fn):
        y, vjp = jax.vjp(fn, x)
        return np.asarray(y, np.float32), np.asarray(vjp(g)[0], np.float32)

    y, dx = fwd_bwd(lambda a: nf4_fp8_matmul(a, q, gemm_out=gemm_out))
    y_ref, dx_ref = fwd_bwd(lambda a: fp8.fp8_matmul(a, w8, gemm_out=gemm_out))
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(dx, dx_ref)
    dense = np.asarray(reference.dequantize_nf4(q, jnp.float32))
    x32, g32 = np.asarray(x, np.float32), np.asarray(g, np.float32)
    assert _rel(y, x32 @ dense.T) < 0.06 and _rel(dx, g32 @ dense) < 0.12
    # the NF4 weight gets no gradient
    gq = jax.grad(lambda qq: jnp.sum(nf4_fp8_matmul(x, qq).astype(jnp.float32)), allow_int=True)(q)
    floats = [leaf for leaf in jax.tree.leaves(gq) if leaf.dtype != jax.dtypes.float0]  # the integer codes: float0
    assert floats and all(not np.any(np.asarray(leaf, np.float32)) for leaf in floats)


def test_bad_arguments_raise(rng):
    _, q = _quantized(rng, 16, 64)
    with pytest.raises(ValueError, match="in-features"):
        nf4_fp8_matmul(jnp.ones((2, 32)), q)
    stacked = fmt.stack_nf4([q, q])
    with pytest.raises(ValueError, match="one layer"):
        nf4_to_fp8_weight(stacked)


def test_lowers_for_cuda_at_8b_shape():
    """The Triton lowering accepts the e4m3-writing dequantize kernel at Llama-3-8B's gate_proj shape."""
    numel = 14336 * 4096
    nb = numel // 64
    q = fmt.NF4Weight(jax.ShapeDtypeStruct((numel // 2,), jnp.uint8), jax.ShapeDtypeStruct((nb,), jnp.uint8),
                      jax.ShapeDtypeStruct((-(-nb // 256),), jnp.float32), jax.ShapeDtypeStruct((), jnp.float32),
                      shape=(14336, 4096), dtype="bfloat16")
    text = lower_for_cuda(lambda qq: nf4_to_fp8_weight(qq, use_kernel=True, interpret=False).values, q)
    assert "nf4_dequantize" in text


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(14336, 4096), (4096, 14336), (1536, 8960)])
def test_gpu_fp8_weight_equals_the_jnp_twin(rng, shape):
    _, q = _quantized(rng, *shape)
    got = jax.jit(lambda qq: nf4_to_fp8_weight(qq, use_kernel=True))(q)
    want = jax.jit(lambda qq: nf4_to_fp8_weight(qq, use_kernel=False))(q)
    np.testing.assert_array_equal(np.asarray(got.values).view(np.uint8), np.asarray(want.values).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(want.scale))
