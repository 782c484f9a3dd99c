"""FP8 frozen-base matmul: the quantization bit for bit against ml_dtypes' float8 rounding in numpy, the forward
and the input gradient against numpy's float64 math on the same quantized operands, and the error against the
unquantized matmul."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.fp8 import (E4M3_MAX, E5M2_MAX, dequantize_fp8_weight, fp8_matmul, quantize_fp8_weight,
                                quantize_rows)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _np_quant_rows(x: np.ndarray, top: float, dtype):
    """Per-row scale max|x| / top and the float8 values, in numpy with ml_dtypes (the independent truth)."""
    x = x.astype(np.float32)
    scale = np.maximum(np.max(np.abs(x), axis=-1) * np.float32(1.0 / top), np.float32(1e-12)).astype(np.float32)
    inv = (np.float32(1.0) / scale).astype(np.float32)
    return (x * inv[:, None]).astype(dtype), scale


@pytest.mark.parametrize("shape", [(64, 96), (3, 40, 24)])
def test_weight_quantization_matches_ml_dtypes(rng, shape):
    kernel = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 3.0, size=shape[-1])
    w = quantize_fp8_weight(jnp.asarray(kernel))
    hf = np.swapaxes(kernel, -1, -2)
    flat = hf.reshape(-1, hf.shape[-1])
    values, scale = _np_quant_rows(flat, E4M3_MAX, ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(w.scale).reshape(-1), scale)
    np.testing.assert_array_equal(np.asarray(w.values).reshape(flat.shape).view(np.uint8), values.view(np.uint8))
    assert w.shape == hf.shape[-2:] and w.stack_shape == tuple(shape[:-2])
    # e4m3 with per-channel scales: a few percent (relative Frobenius) away from the weight
    assert 0.005 < _rel(dequantize_fp8_weight(w, jnp.float32), hf) < 0.04


def test_zero_rows_quantize_to_zero():
    x = jnp.zeros((4, 32), jnp.bfloat16).at[1].set(1.0)
    q, s = quantize_rows(x)
    assert np.all(np.isfinite(np.asarray(s))) and np.all(np.asarray(q.astype(jnp.float32))[[0, 2, 3]] == 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_matmul_forward_and_input_gradient(rng, dtype):
    m, k, n = 48, 80, 56
    x = rng.standard_normal((2, m // 2, k)).astype(np.float32)
    kernel = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    g = rng.standard_normal((2, m // 2, n)).astype(np.float32)
    w = quantize_fp8_weight(jnp.asarray(kernel))
    xj = jnp.asarray(x, dtype)
    y, vjp = jax.vjp(lambda a: fp8_matmul(a, w), xj)
    (dx,) = vjp(jnp.asarray(g, dtype))
    assert y.dtype == dtype and dx.dtype == dtype and y.shape == (2, m // 2, n)

    values = np.asarray(w.values).astype(np.float64)  # [n, k]
    wscale = np.asarray(w.scale, np.float64)
    x2 = np.asarray(xj, np.float32).reshape(m, k)
    xq, sx = _np_quant_rows(x2, E4M3_MAX, ml_dtypes.float8_e4m3fn)
    want_y = (xq.astype(np.float64) @ values.T) * sx[:, None] * wscale[None, :]
    g2 = np.asarray(jnp.asarray(g, dtype), np.float32).reshape(m, n)
    gq, sg = _np_quant_rows((g2 * np.asarray(w.scale)[None, :]).astype(np.float32), E5M2_MAX, ml_dtypes.float8_e5m2)
    want_dx = (gq.astype(np.float64) @ values) * sg[:, None]
    # float32 accumulation on the CPU; Hopper's FP8 MMA accumulates with fewer mantissa bits (9.4e-5 measured on
    # the H200, BENCHMARKS.md); bf16 outputs add their own rounding
    tol = (5e-4 if jax.default_backend() == "gpu" else 1e-5) if dtype == jnp.float32 else 1e-2
    assert _rel(np.asarray(y, np.float32).reshape(m, n), want_y) < tol
    assert _rel(np.asarray(dx, np.float32).reshape(m, k), want_dx) < tol
    # and against the unquantized math: e4m3 forward within a few percent, e5m2 gradient within ~10%
    assert _rel(np.asarray(y, np.float32).reshape(m, n), x2 @ kernel) < 0.06
    assert _rel(np.asarray(dx, np.float32).reshape(m, k), g2 @ kernel.T) < 0.12


def test_fp8_matmul_gives_the_weight_no_gradient(rng):
    w = quantize_fp8_weight(jnp.asarray(rng.standard_normal((16, 8)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
    grads = jax.grad(lambda a, ww: jnp.sum(fp8_matmul(a, ww)), argnums=(0, 1))(x, w)
    assert all(not np.any(np.asarray(leaf, np.float32)) for leaf in jax.tree.leaves(grads[1]))
    with pytest.raises(ValueError, match="in-features"):
        fp8_matmul(jnp.ones((2, 9)), w)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bf16_gemm_out_is_the_f32_path_within_bf16_rounding(rng, dtype):
    """gemm_out="bfloat16": the GEMMs write their unscaled products in bf16 (the StableHLO dots say so) and
    y, dx stay within two bf16 roundings of the float32-output path, forward and backward."""
    m, k, n = 64, 96, 80
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    g = jnp.asarray(rng.standard_normal((m, n)), dtype)
    w = quantize_fp8_weight(jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32))

    def run(gemm_out):
        y, vjp = jax.vjp(lambda a: fp8_matmul(a, w, gemm_out=gemm_out), x)
        return np.asarray(y, np.float32), np.asarray(vjp(g)[0], np.float32)

    y32, dx32 = run("float32")
    y16, dx16 = run("bfloat16")
    assert _rel(y16, y32) < 2 * 2.0**-8 and _rel(dx16, dx32) < 2 * 2.0**-8
    if dtype == jnp.float32:  # float32 outputs show the bf16 rounding the GEMM added
        assert _rel(y16, y32) > 0
    hlo = jax.jit(lambda a, gg: jax.vjp(lambda b: fp8_matmul(b, w, gemm_out="bfloat16"), a)[1](gg)).lower(
        x, g).as_text()
    assert "xf8E5M2>, tensor<" in hlo and "-> tensor<64x96xbf16>" in hlo  # the dx GEMM writes bf16
    with pytest.raises(ValueError, match="gemm_out must be one of float32, bfloat16"):
        fp8_matmul(x, w, gemm_out="float16")


@pytest.mark.gpu
@pytest.mark.parametrize("gemm_out", ["float32", "bfloat16"])
def test_gpu_fp8_gemms_are_cublaslt_fp8_with_the_asked_output(rng, gemm_out):
    """On the GPU both GEMMs of a projection at the 8B step's sizes (2048 tokens, K=4096, N=6144) compile to
    cuBLASLt FP8 custom calls writing `gemm_out` (not an upcast dot). The weight is an argument, as in the
    step: a closed-over weight is constant-folded, and at small sizes XLA picks a split-K Triton GEMM instead
    (seen at 256x512x384 on jax 0.11.2: f8 operands, float32 partial sums)."""
    x = jnp.asarray(rng.standard_normal((2048, 4096)), jnp.bfloat16)
    w = quantize_fp8_weight(jnp.asarray(rng.standard_normal((4096, 6144)) / 64, jnp.float32))

    def fwd_bwd(a, weight):
        y, vjp = jax.vjp(lambda b: fp8_matmul(b, weight, gemm_out=gemm_out), a)
        return y, vjp(y)[0]

    text = jax.jit(fwd_bwd).lower(x, w).compile().as_text()
    calls = [line for line in text.splitlines() if "__cublas$lt$matmul$f8" in line and "custom-call(" in line]
    short = {"float32": "f32", "bfloat16": "bf16"}[gemm_out]
    assert len(calls) == 2, calls
    assert any(f"{short}[2048,6144]" in c for c in calls) and any(f"{short}[2048,4096]" in c for c in calls), calls
