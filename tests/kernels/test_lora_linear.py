"""lora_linear kernel vs the jnp reference: forward, dX, dA, dB; w never gets a gradient.

CPU runs use interpret mode with small blocks so that every dimension is ragged and spans several tiles.
`pytest -m gpu` runs the real model shapes on the GPU (compiled Triton, no interpret mode).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.reference as reference
from pallas_kernels.lora_linear import LoraConfig, lora_linear
from tests.helpers import TOL, fast_jit, lower_for_cuda, rel_err



SMALL = dict(bm=32, bn=32, bk=16, group_m=2, dx_bm=32, dx_bk=32, dx_bn=16, sk_bm=16, sk_bk=32,
             red_bc=32, red_bm=16, red_splits=3)


def _inputs(rng, m, k, n, r, dtype):
    x = rng.standard_normal((m, k))
    w = rng.standard_normal((k, n)) / np.sqrt(k)
    a = rng.standard_normal((k, r)) / np.sqrt(k)
    b = rng.standard_normal((r, n))
    dy = rng.standard_normal((m, n))
    return [jnp.asarray(v, dtype) for v in (x, w, a, b, dy)]


def _check(x, w, a, b, dy, scale, dtype, config=None, interpret=None, tol=None):
    f32 = lambda v: v.astype(jnp.float32)  # noqa: E731
    @fast_jit   # one compile for the whole fwd+bwd (interpret mode compiles slowly, runs fast)
    def fwd_bwd(x_, a_, b_, dy_):
        y_, vjp = jax.vjp(lambda x2, a2, b2: lora_linear(x2, w, a2, b2, scale, interpret=interpret,
                                                         config=config), x_, a_, b_)
        return y_, vjp(dy_)

    y, grads = fwd_bwd(x, a, b, dy)
    def ref_fwd_bwd(x_, w_, a_, b_, dy_):
        y_, vjp = jax.vjp(lambda x2, a2, b2: reference.lora_linear(x2, w_, a2, b2, scale), x_, a_, b_)
        return y_, vjp(dy_)

    with jax.default_matmul_precision("float32"):
        y_ref, grads_ref = fast_jit(ref_fwd_bwd)(f32(x), f32(w), f32(a), f32(b), f32(dy))
    tol = tol or TOL[jnp.dtype(dtype).name]
    assert y.dtype == x.dtype and y.shape == y_ref.shape
    errs = {"y": rel_err(f32(y), y_ref)}
    for name, g, g_ref, inp in zip(("dx", "da", "db"), grads, grads_ref, (x, a, b)):
        assert g.dtype == inp.dtype and g.shape == inp.shape
        errs[name] = rel_err(f32(g), g_ref)
    print(errs)
    for name, e in errs.items():
        assert e < tol, f"{name}: rel err {e} >= {tol}"


@pytest.mark.parametrize(
    "dtype,r,fuse",
    [("float32", 8, True), ("float32", 16, False), ("float32", 64, True),
     ("bfloat16", 8, False), ("bfloat16", 16, True), ("bfloat16", 64, False)],
)
def test_matches_reference_ragged(rng, dtype, r, fuse):
    m, k, n = (int(v) for v in rng.integers(40, 90, size=3))   # ragged vs every block size above
    scale = float(rng.uniform(0.5, 4.0))
    cfg = LoraConfig(**SMALL, fuse_xa=fuse, fuse_g=fuse)
    _check(*_inputs(rng, m, k, n, r, jnp.dtype(dtype)), scale, dtype, config=cfg)


def test_default_table_mixed_dtypes_and_leading_dims(rng):
    """Default block table (clipped to the tiny shape); bf16 x/w with f32 master a/b (grads come back f32);
    x with batch dims [B, S, K]."""
    x, w, a, b, dy = _inputs(rng, 2 * 37, 56, 48, 16, jnp.bfloat16)
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    y = jax.eval_shape(lambda x3: lora_linear(x3, w, a, b, 2.0), x.reshape(2, 37, 56))
    assert y.shape == (2, 37, 48) and y.dtype == jnp.bfloat16
    _check(x, w, a, b, dy, 2.0, "bfloat16")


def test_w_is_never_differentiated(rng):
    """jax.grad w.r.t. w is exactly zero, and no op in the gradient program produces a [K, N] product."""
    m, k, n, r = 33, 40, 24, 8
    x, w, a, b, _ = _inputs(rng, m, k, n, r, jnp.float32)
    cfg = LoraConfig(**SMALL)

    def loss(x_, w_, a_, b_):
        return jnp.sum(lora_linear(x_, w_, a_, b_, 1.5, config=cfg) ** 2)

    gw = fast_jit(jax.grad(loss, argnums=1))(x, w, a, b)
    assert gw.shape == (k, n) and float(jnp.max(jnp.abs(gw))) == 0.0

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 2, 3)))(x, w, a, b)
    for eqn in jaxpr.jaxpr.eqns:
        if eqn.primitive.name in ("dot_general", "pallas_call"):
            for v in eqn.outvars:
                assert tuple(v.aval.shape) != (k, n), f"{eqn.primitive.name} produced a [K, N] array"


def test_lowers_to_triton_at_model_shapes():
    """Cross-lower (no GPU needed) the fwd+bwd kernels to Triton IR at Qwen2-1.5B / Llama-3-8B shapes."""
    S = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    for m, k, n, r in ((8192, 1536, 8960, 16), (8192, 1536, 256, 8), (4096, 14336, 4096, 64)):
        args = S((m, k), bf), S((k, n), bf), S((k, r), bf), S((r, n), bf)

        def f(x, w, a, b):
            return jax.grad(lambda x_, a_, b_: jnp.sum(lora_linear(x_, w, a_, b_, 2.0, interpret=False)
                                                       .astype(jnp.float32)), argnums=(0, 1, 2))(x, a, b)
        assert "triton" in lower_for_cuda(f, *args)


# ---------------------------------------------------------------------------------------------- GPU
QWEN = [(8192, 1536, 1536), (8192, 1536, 256), (8192, 1536, 8960), (8192, 8960, 1536)]
LLAMA = [(4096, 4096, 4096), (4096, 4096, 1024), (4096, 4096, 14336), (4096, 14336, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", QWEN + LLAMA)
def test_gpu_model_shapes_bf16(rng, m, k, n):
    _check(*_inputs(rng, m, k, n, 16, jnp.bfloat16), 1.0, "bfloat16", interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("r", [8, 64])
def test_gpu_ranks_bf16(rng, r):
    _check(*_inputs(rng, 8192, 1536, 8960, r, jnp.bfloat16), 2.0, "bfloat16", interpret=False)


@pytest.mark.gpu
def test_gpu_ragged_bf16(rng):
    _check(*_inputs(rng, 1000, 1537, 999, 16, jnp.bfloat16), 2.0, "bfloat16", interpret=False)


@pytest.mark.gpu
def test_gpu_fp32(rng):
    # On the H200 this failed the strict 1e-5 fp32 bound (2026-11-29 GPU run): the Triton f32 dot runs on
    # tensor cores in tf32, so the tf32 bound of DESIGN.md applies. (fp32 is never dispatched; bf16 is.)
    _check(*_inputs(rng, 1000, 1536, 1100, 16, jnp.float32), 2.0, "float32", interpret=False,
           tol=TOL["float32_tf32"])
