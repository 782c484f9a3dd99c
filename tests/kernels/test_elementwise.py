"""RMSNorm, RoPE and SwiGLU/GEGLU Pallas kernels vs their plain-jnp twins (forward and every gradient).

CPU: interpret mode, small ragged shapes (odd row counts, D = 2304 and non-power-of-two D, F = 1000, odd
element counts), bf16 and fp32, fresh random inputs every run. GPU (`pytest -m gpu`): the real model shapes,
compiled through the Triton lowering.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.glu as glu_mod
import pallas_kernels.reference as ref
from pallas_kernels.rms_norm import BwdConfig, FwdConfig, rms_norm, rms_norm_with_config
from pallas_kernels.rope import RopeConfig, rope, rope_with_config
from tests.helpers import TOL, lower_for_cuda, rel_err

F32 = jnp.float32
DTYPES = [jnp.float32, jnp.bfloat16]


def _randn(rng, shape, dtype, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype=dtype)


def _check_vjp(kernel_fn, ref_fn, primals, cts, dtype, what=""):
    """Compare forward and every gradient; the reference runs in f32 on the same (possibly bf16) inputs."""
    def fwd_bwd(fn, prims, cotangents):
        out, vjp = jax.vjp(fn, *prims)
        return out, vjp(cotangents)

    # One jit per side: one XLA compile instead of an eager dispatch (and compile) per primitive.
    out, grads = jax.jit(fwd_bwd, static_argnums=0)(kernel_fn, tuple(primals), cts)
    ref_out, ref_grads = jax.jit(fwd_bwd, static_argnums=0)(
        ref_fn, tuple(p.astype(F32) for p in primals), jax.tree_util.tree_map(lambda c: c.astype(F32), cts))
    tol = TOL[jnp.dtype(dtype).name]
    outs = jax.tree_util.tree_leaves(out)
    ref_outs = jax.tree_util.tree_leaves(ref_out)
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        assert o.dtype == dtype, (what, "out", i, o.dtype)
        err = rel_err(o, r)
        assert err < tol, f"{what} forward[{i}] rel err {err:.3e} >= {tol}"
    for i, (g, r, p) in enumerate(zip(grads, ref_grads, primals)):
        assert g.dtype == p.dtype and g.shape == p.shape, (what, "grad", i, g.dtype, g.shape)
        err = rel_err(g, r)
        assert err < tol, f"{what} grad[{i}] rel err {err:.3e} >= {tol}"


def _lower_for_triton(fn, *args):
    """Number of Triton kernels in fn lowered for CUDA from the CPU."""
    return lower_for_cuda(fn, *args).count("triton")


# --------------------------------------------------------------------------------------------- rms_norm
# Each case pairs a dtype with a ragged shape so every shape/dtype feature is covered without the full
# cross product (interpret-mode compiles dominate the CPU run time).
_BF16, _F32 = jnp.bfloat16, jnp.float32


@pytest.mark.parametrize(
    "dtype,shape,offset",
    [(_BF16, (37, 2304), 0.0), (_F32, (37, 2304), 0.0), (_F32, (3, 7, 1000), 1.0), (_BF16, (3, 7, 1000), 1.0),
     (_BF16, (129, 128), 0.0)],
    ids=["bf16-D2304", "f32-D2304", "f32-D1000-gemma", "bf16-D1000-gemma", "bf16-D128-rows129"],
)
def test_rms_norm_matches_reference(rng, dtype, shape, offset):
    d = shape[-1]
    x = _randn(rng, shape, dtype, 2.0)
    w = _randn(rng, (d,), dtype, 0.5) + (0.0 if offset else 1.0)
    dy = _randn(rng, shape, dtype)
    eps = float(rng.uniform(1e-6, 1e-5))
    _check_vjp(lambda a, b: rms_norm(a, b, eps, offset),
               lambda a, b: ref.rms_norm(a, b, eps, offset), (x, w), dy, dtype, f"rms_norm{shape}")


def test_rms_norm_block_configs(rng):
    """Multi-row tiles with ragged rows, several tiles per backward program, and fully masked tail tiles;
    inside jit, with a nonlinear loss."""
    x = _randn(rng, (301, 100), F32)
    w = _randn(rng, (100,), F32)
    fcfg = FwdConfig(8, 4)
    bcfg = BwdConfig(4, 7, 4)  # 76 tiles -> 7 programs x 11 tiles (one tile past the end)
    kern = lambda a, b: rms_norm_with_config(a, b, 1e-6, 0.0, fwd=fcfg, bwd=bcfg)
    loss = lambda f: (lambda a, b: jnp.sum(jnp.sin(f(a, b))))
    val, grads = jax.jit(jax.value_and_grad(loss(kern), argnums=(0, 1)))(x, w)
    ref_val, ref_grads = jax.value_and_grad(loss(lambda a, b: ref.rms_norm(a, b, 1e-6, 0.0)), argnums=(0, 1))(x, w)
    # A sum of 30,100 terms: its rounding error scales with sum |term|, not with |sum| (which can be near 0).
    # Over 3,000 seeds |val - ref_val| / sum|sin(ref)| was at most 3.7e-9 (the old 1e-5 * max(1, |ref_val|)
    # failed 17 of them).
    assert abs(float(val) - float(ref_val)) <= 1e-7 * float(jnp.sum(jnp.abs(jnp.sin(ref.rms_norm(x, w, 1e-6, 0.0)))))
    for a, b in zip(grads, ref_grads):
        assert rel_err(a, b) < TOL["float32"]


def test_rms_norm_lowers_for_triton():
    x = jax.ShapeDtypeStruct((8192, 2304), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((2304,), jnp.bfloat16)
    fn = lambda a, b, c: jax.vjp(lambda p, q: rms_norm(p, q, interpret=False), a, b)[1](c)
    assert _lower_for_triton(fn, x, w, x) >= 3  # fwd, bwd, dweight reduction


# ------------------------------------------------------------------------------------------------- rope
def _cos_sin(rng, b, s, d, duplicated=True, dtype=F32):
    if duplicated:
        ang = rng.uniform(0.0, 2 * np.pi, (b, s, d // 2))
        ang = np.concatenate([ang, ang], axis=-1)
        return jnp.asarray(np.cos(ang), dtype), jnp.asarray(np.sin(ang), dtype)
    return _randn(rng, (b, s, d), dtype), _randn(rng, (b, s, d), dtype)


@pytest.mark.parametrize(
    "dtype,b,s,hq,hkv,d",
    [(_F32, 2, 37, 12, 2, 128), (_BF16, 2, 37, 12, 2, 128), (_BF16, 1, 19, 6, 3, 80), (_F32, 3, 5, 8, 4, 256)],
    ids=["f32-qwen2-heads", "bf16-qwen2-heads", "bf16-D80-odd-heads", "f32-gemma-D256"],
)
def test_rope_matches_reference(rng, dtype, b, s, hq, hkv, d):
    q = _randn(rng, (b, s, hq, d), dtype)
    k = _randn(rng, (b, s, hkv, d), dtype)
    cos, sin = _cos_sin(rng, b, s, d)
    cts = (_randn(rng, q.shape, dtype), _randn(rng, k.shape, dtype))
    _check_vjp(lambda a, c: rope(a, c, cos, sin), lambda a, c: ref.rope(a, c, cos, sin),
               (q, k), cts, dtype, f"rope{(b, s, hq, hkv, d)}")


def test_rope_block_config_general_cos_sin(rng):
    """Ragged token blocks, several head blocks, bf16 cos/sin that are NOT duplicated over the halves."""
    dtype = jnp.float32
    b, s, hq, hkv, d = 3, 7, 8, 2, 64
    q = _randn(rng, (b, s, hq, d), dtype)
    k = _randn(rng, (b, s, hkv, d), dtype)
    cos, sin = _cos_sin(rng, b, s, d, duplicated=False, dtype=jnp.bfloat16)
    cts = (_randn(rng, q.shape, dtype), _randn(rng, k.shape, dtype))
    cfg = RopeConfig(block_tokens=8, max_heads=2, num_warps=4)
    _check_vjp(lambda a, c: rope_with_config(a, c, cos, sin, cfg=cfg),
               lambda a, c: ref.rope(a, c, cos, sin), (q, k), cts, dtype, "rope cfg")


def test_rope_cos_sin_get_zero_gradients(rng):
    b, s, hq, hkv, d = 1, 5, 2, 1, 16
    q = _randn(rng, (b, s, hq, d), F32)
    k = _randn(rng, (b, s, hkv, d), F32)
    cos, sin = _cos_sin(rng, b, s, d)
    loss = lambda c, sn: sum(jnp.sum(o) for o in rope(q, k, c, sn))
    gc, gs = jax.grad(loss, argnums=(0, 1))(cos, sin)
    assert not np.any(np.asarray(gc)) and not np.any(np.asarray(gs))


def test_rope_lowers_for_triton():
    S = jax.ShapeDtypeStruct
    q, k = S((2, 2048, 32, 128), jnp.bfloat16), S((2, 2048, 8, 128), jnp.bfloat16)
    c = S((2, 2048, 128), jnp.float32)
    fn = lambda q, k, c, s: jax.vjp(lambda a, b: rope(a, b, c, s, interpret=False), q, k)[1]((q, k))
    assert _lower_for_triton(fn, q, k, c, c) >= 2


# -------------------------------------------------------------------------------------------------- glu
_GLU_VARIANTS = {
    "swiglu": (glu_mod.swiglu, ref.swiglu),
    "geglu": (glu_mod.geglu, ref.geglu),
    "geglu_tanh": (lambda g, u: glu_mod.geglu(g, u, approximate=True),
                   lambda g, u: ref.geglu(g, u, approximate=True)),
}


@pytest.mark.parametrize("variant", list(_GLU_VARIANTS))
@pytest.mark.parametrize("dtype,shape", [(_BF16, (37, 1000)), (_F32, (7, 151))], ids=["bf16-F1000", "f32-odd-numel"])
def test_glu_matches_reference(rng, dtype, variant, shape):
    kern, reference = _GLU_VARIANTS[variant]
    g = np.asarray(rng.standard_normal(shape) * 2.0)
    if dtype == _F32:  # include saturated activations (|gate| up to 60): results stay finite and exact
        flat = g.reshape(-1)
        flat[: flat.size // 4] = rng.uniform(-60.0, 60.0, flat.size // 4)
    g = jnp.asarray(g, dtype)
    u = _randn(rng, shape, dtype)
    dh = _randn(rng, shape, dtype)
    _check_vjp(kern, reference, (g, u), dh, dtype, f"{variant}{shape}")


def test_glu_block_config_multi_block(rng):
    g = _randn(rng, (17, 300), jnp.bfloat16)
    u = _randn(rng, (17, 300), jnp.bfloat16)
    dh = _randn(rng, (17, 300), jnp.bfloat16)
    cfg = glu_mod.GluConfig(block=512, num_warps=4)  # 5100 elements: 9 full blocks + a ragged tail
    _check_vjp(lambda a, b: glu_mod.glu_with_config(a, b, "gelu", fwd=cfg, bwd=cfg), ref.geglu,
               (g, u), dh, jnp.bfloat16, "geglu cfg")


def test_glu_lowers_for_triton():
    a = jax.ShapeDtypeStruct((8192, 9216), jnp.bfloat16)
    fn = lambda g, u, dh: jax.vjp(lambda x, y: glu_mod.geglu(x, y, True, interpret=False), g, u)[1](dh)
    assert _lower_for_triton(fn, a, a, a) >= 2


# ------------------------------------------------------------------------------------- GPU, real shapes
def _gpu_check(kernel_fn, ref_fn, primals, cts, dtype, what):
    _check_vjp(kernel_fn, ref_fn, primals, cts, dtype, what)  # jitted inside


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize(
    "rows,d,offset",
    [(8192, 1536, 0.0), (4096, 4096, 0.0), (8192, 2304, 1.0), (131072, 128, 0.0), (16384, 4096, 0.0),
     (1000, 8192, 0.0)],
)
def test_gpu_rms_norm_real_shapes(rng, dtype, rows, d, offset):
    x = _randn(rng, (rows, d), dtype, 2.0)
    w = _randn(rng, (d,), dtype, 0.5) + 1.0
    dy = _randn(rng, (rows, d), dtype)
    _gpu_check(lambda a, b: rms_norm(a, b, 1e-6, offset, interpret=False),
               lambda a, b: ref.rms_norm(a, b, 1e-6, offset), (x, w), dy, dtype, f"rms_norm[{rows},{d}]")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize(
    "b,s,hq,hkv,d", [(4, 2048, 12, 2, 128), (2, 2048, 32, 8, 128), (4, 2048, 8, 4, 256), (1, 1000, 6, 3, 80)]
)
def test_gpu_rope_real_shapes(rng, dtype, b, s, hq, hkv, d):
    q = _randn(rng, (b, s, hq, d), dtype)
    k = _randn(rng, (b, s, hkv, d), dtype)
    cos, sin = _cos_sin(rng, b, s, d)
    cts = (_randn(rng, q.shape, dtype), _randn(rng, k.shape, dtype))
    _gpu_check(lambda a, c: rope(a, c, cos, sin, interpret=False),
               lambda a, c: ref.rope(a, c, cos, sin), (q, k), cts, dtype, f"rope{(b, s, hq, hkv, d)}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize(
    "variant,shape",
    [("swiglu", (8192, 8960)), ("swiglu", (4096, 14336)), ("geglu_tanh", (8192, 9216)), ("geglu", (8192, 9216)),
     ("swiglu", (37, 1001))],
)
def test_gpu_glu_real_shapes(rng, dtype, variant, shape):
    kern, reference = _GLU_VARIANTS[variant]
    g = _randn(rng, shape, dtype, 2.0)
    u = _randn(rng, shape, dtype)
    dh = _randn(rng, shape, dtype)
    _gpu_check(lambda a, b: kern(a, b), reference, (g, u), dh, dtype, f"{variant}{shape}")
