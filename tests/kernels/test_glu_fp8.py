"""The GLU fused with the e4m3 row quantization (pallas_kernels.glu_fp8) against the plain-jnp composition it
replaces: reference.swiglu / geglu, then pallas_kernels.fp8's row quantization (itself checked bit for bit
against ml_dtypes in test_fp8.py), and fp8_matmul for the down projection and its gradients."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fp8
from pallas_kernels.glu_fp8 import GluFp8Config, glu_fp8_matmul, glu_quantize, glu_quantize_reference
from tests.helpers import lower_for_cuda, rel_err

DTYPES = [jnp.bfloat16, jnp.float32]
# (rows, F, config): the whole row in one chunk, and several chunks (two passes), with ragged rows and columns
CASES = [
    (37, 200, None),
    (5, 1001, GluFp8Config(2, 128, 4)),
    (16, 96, GluFp8Config(4, 32, 4)),
    (3, 48, GluFp8Config(8, 16, 4)),
]


def _inputs(rng, shape, dtype, scale=2.0):
    g = jnp.asarray(rng.standard_normal(shape) * scale, dtype)
    u = jnp.asarray(rng.standard_normal(shape), dtype)
    return g, u


def _bits(a):
    return np.asarray(a).view(np.uint8)


def _assert_e4m3_equal_up_to_subnormal_rounding(actual, desired):
    """e4m3 arrays equal bit for bit, except that an element whose two codes are both subnormal (magnitude at
    most 2^-6 of the row's 448 scale point, codes 0-8 with either sign) may be one code apart, in at most 1e-5
    of the elements: on the GPU, Triton's float32 -> e4m3 conversion and XLA's round some subnormal ties
    differently (seen: codes 3 vs 4 and 131 vs 132 in about 1e-6 of the elements at the 8B shape)."""
    a, d = _bits(actual).astype(np.int16), _bits(desired).astype(np.int16)
    differ = a != d
    subnormal = ((a & 0x7F) <= 8) & ((d & 0x7F) <= 8) & ((a & 0x80) == (d & 0x80)) & (np.abs(a - d) == 1)
    assert not np.any(differ & ~subnormal), np.argwhere(differ & ~subnormal)[:5]
    assert differ.mean() <= 1e-5, differ.mean()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("rows,f,cfg", CASES)
def test_silu_forward_bit_exact(rng, dtype, rows, f, cfg):
    """silu is written as the reference writes it (g * sigmoid(g)), so in interpret mode h, its scales and its
    e4m3 values are the reference composition's bit for bit; zero rows keep the 1e-12 scale floor."""
    g, u = _inputs(rng, (rows, f), dtype)
    g = g.at[rows // 2].set(0)  # an all-zero row of h
    hq, sx, h = glu_quantize(g, u, "silu", with_h=True, interpret=True, cfg=cfg)
    rq, rs, rh = glu_quantize_reference(g, u, "silu")
    assert hq.dtype == fp8.E4M3 and sx.dtype == jnp.float32 and h.dtype == dtype
    np.testing.assert_array_equal(_bits(hq), _bits(rq))
    np.testing.assert_array_equal(np.asarray(sx), np.asarray(rs))
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(rh, np.float32))
    hq2, sx2, none = glu_quantize(g, u, "silu", with_h=False, interpret=True, cfg=cfg)
    assert none is None
    np.testing.assert_array_equal(_bits(hq2), _bits(hq))
    np.testing.assert_array_equal(np.asarray(sx2), np.asarray(sx))


@pytest.mark.parametrize("kind", ["gelu", "gelu_tanh"])
@pytest.mark.parametrize("rows,f,cfg", CASES[:2])
def test_gelu_forward_close(rng, kind, rows, f, cfg):
    """The erf GELU uses the GLU kernel's erfc fit (the Triton lowering has no erf), a few float32 ulps from the
    reference's erf; the tanh GELU is jax.nn.gelu's formula, which XLA may still evaluate differently inside the
    kernel's fusion. Either way h differs by at most one bf16 ulp where the rounding falls differently, or
    (the tanh form at large negative gate, where 1 + tanh cancels) by far less than one e4m3 step of the row;
    so the row scales agree to a bf16 ulp and hq to one e4m3 step."""
    g, u = _inputs(rng, (rows, f), jnp.bfloat16)
    hq, sx, h = glu_quantize(g, u, kind, with_h=True, interpret=True, cfg=cfg)
    rq, rs, rh = glu_quantize_reference(g, u, kind)
    h32, rh32 = np.asarray(h, np.float32), np.asarray(rh, np.float32)
    row_max = np.abs(rh32).max(axis=1, keepdims=True)
    assert np.all(np.abs(h32 - rh32) <= 2.0**-7 * np.abs(rh32) + 2.0**-16 * row_max)
    np.testing.assert_allclose(np.asarray(sx), np.asarray(rs), rtol=2.0**-7)
    deq = np.asarray(hq, np.float32) * np.asarray(sx)[:, None]
    rdeq = np.asarray(rq, np.float32) * np.asarray(rs)[:, None]
    assert np.all(np.abs(deq - rdeq) <= 2.0**-3 * np.abs(rdeq) + 2.0**-9 * 448 * np.asarray(rs)[:, None])


def test_bad_arguments_raise():
    g = jnp.zeros((4, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="same shape"):
        glu_quantize(g, jnp.zeros((4, 9), jnp.bfloat16))
    with pytest.raises(ValueError, match="unknown activation"):
        glu_quantize(g, g, "relu")
    w = fp8.quantize_fp8_weight(jnp.zeros((9, 3)))
    with pytest.raises(ValueError, match="in-features"):
        glu_fp8_matmul(g, g, w)


def _strict_jit(fn):
    """jax.jit compiled with xla_allow_excess_precision off: XLA keeps every bf16 rounding the program asks for
    (by default it may feed the unrounded float32 h of the unfused GLU straight into the quantization)."""
    jitted = jax.jit(fn)
    return lambda *args: jitted.lower(*args).compile(
        compiler_options={"xla_allow_excess_precision": False})(*args)


def _unfused(gate, up, w, lora_b):
    """The model's composition: h = swiglu(gate, up); fp8_matmul(h, w) + h @ lora_b."""
    from pallas_kernels import reference

    h = reference.swiglu(gate, up)
    return fp8.fp8_matmul(h, w) + (h @ lora_b.astype(h.dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("glu_backward", ["xla", "pallas"])
@pytest.mark.parametrize("shape,cfg", [((2, 9, 200), None), ((3, 5, 72), GluFp8Config(2, 32, 4))])
def test_gradients_through_fp8_down_proj_equal_unfused(rng, dtype, glu_backward, shape, cfg):
    """d gate, d up of a loss through the FP8 down projection and a LoRA-like use of h equal the unfused
    path's: bit for bit with the reference GLU backward, to float32 rounding with the Pallas GLU backward
    (its sigmoid is written differently)."""
    f, out = shape[-1], 24
    g, u = _inputs(rng, shape, dtype)
    w = fp8.quantize_fp8_weight(jnp.asarray(rng.standard_normal((f, out)) / np.sqrt(f), jnp.float32))
    lora_b = jnp.asarray(rng.standard_normal((f, out)) * 0.1, jnp.float32)
    ct = jnp.asarray(rng.standard_normal((*shape[:-1], out)), jnp.float32)

    def fused(gate, up):
        y, h = glu_fp8_matmul(gate, up, w, "silu", with_h=True, glu_backward=glu_backward, interpret=True,
                              cfg=cfg)
        return y + (h @ lora_b.astype(h.dtype))

    def loss(fn):
        return lambda gate, up: jnp.sum(fn(gate, up).astype(jnp.float32) * ct)

    unfused = lambda a, b: _unfused(a, b, w, lora_b)  # noqa: E731
    yk, yr = _strict_jit(fused)(g, u), _strict_jit(unfused)(g, u)
    np.testing.assert_array_equal(np.asarray(yk, np.float32), np.asarray(yr, np.float32))
    dk = _strict_jit(jax.grad(loss(fused), argnums=(0, 1)))(g, u)
    dr = _strict_jit(jax.grad(loss(unfused), argnums=(0, 1)))(g, u)
    for a, b in zip(dk, dr):
        assert a.dtype == dtype
        if glu_backward == "xla":
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        else:  # one rounding of the output dtype apart at most
            tol = 2.0**-7 if dtype == jnp.bfloat16 else 1e-5
            a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
            assert np.all(np.abs(a32 - b32) <= tol * np.abs(b32) + tol * np.abs(b32).max() * 1e-2)
            assert rel_err(a32, b32) < tol


def test_without_h_gradients_equal_fp8_matmul(rng):
    """with_h=False (down_proj without LoRA): y and its gradients are fp8_matmul(swiglu(gate, up))'s."""
    from pallas_kernels import reference

    g, u = _inputs(rng, (6, 40), jnp.bfloat16)
    w = fp8.quantize_fp8_weight(jnp.asarray(rng.standard_normal((40, 16)), jnp.float32))
    ct = jnp.asarray(rng.standard_normal((6, 16)), jnp.float32)
    fused = lambda a, b: glu_fp8_matmul(a, b, w, interpret=True)  # noqa: E731
    plain = lambda a, b: fp8.fp8_matmul(reference.swiglu(a, b), w)  # noqa: E731
    for fn in (fused, plain):
        assert fn(g, u).shape == (6, 16)
    grads = [jax.grad(lambda a, b, fn=fn: jnp.sum(fn(a, b).astype(jnp.float32) * ct), argnums=(0, 1))(g, u)
             for fn in (fused, plain)]
    for a, b in zip(*grads):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("cfg", [None, GluFp8Config(1, 4096, 8)])
def test_lowers_for_cuda_at_8b_shape(cfg):
    """The Triton lowering accepts the kernel at Llama-3-8B's MLP shape (one pass and two passes), including the
    e4m3 store and the div.rn inline PTX; the GPU test below runs it."""
    spec = jax.ShapeDtypeStruct((4096, 14336), jnp.bfloat16)
    text = lower_for_cuda(lambda a, b: glu_quantize(a, b, with_h=True, interpret=False, cfg=cfg), spec, spec)
    assert "silu_glu_e4m3_fwd" in text


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [None, GluFp8Config(1, 4096, 8), GluFp8Config(2, 8192, 16)])
@pytest.mark.parametrize("rows,f", [(4096, 14336), (1000, 8960)])
def test_gpu_glu_quantize_8b_shape(rng, cfg, rows, f):
    """Triton on the GPU. The quantization of the kernel's own h is fp8.quantize_rows' bit for bit (the div.rn
    reciprocal, the e4m3 rounding), but for one-code differences in rare subnormal ties. h against the reference
    GLU: Triton's exp differs from XLA's by float32 ulps, so h may differ by one bf16 ulp in rare elements. The
    reference is jitted in two programs, so that its h is rounded to bf16 before it is quantized (inside one
    program XLA's excess precision may quantize the unrounded float32 h)."""
    g, u = _inputs(rng, (rows, f), jnp.bfloat16)
    hq, sx, h = jax.jit(lambda a, b: glu_quantize(a, b, with_h=True, interpret=False, cfg=cfg))(g, u)
    own_q, own_s = jax.jit(fp8.quantize_rows)(h)
    np.testing.assert_array_equal(np.asarray(sx), np.asarray(own_s))
    _assert_e4m3_equal_up_to_subnormal_rounding(hq, own_q)
    from pallas_kernels import reference

    rh = jax.jit(reference.swiglu)(g, u)
    h32, rh32 = np.asarray(h, np.float32), np.asarray(rh, np.float32)
    assert np.all(np.abs(h32 - rh32) <= 2.0**-7 * np.abs(rh32) + 1e-30)
    assert np.mean(h32 == rh32) > 0.999
    rq, rs = jax.jit(fp8.quantize_rows)(rh)
    np.testing.assert_allclose(np.asarray(sx), np.asarray(rs), rtol=2.0**-7)
    assert np.mean(_bits(hq) == _bits(rq)) > 0.99
