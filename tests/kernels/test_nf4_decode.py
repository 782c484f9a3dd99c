"""pallas_kernels.nf4_decode.nf4_decode_linear against the NF4 reference: x @ dequantize_nf4(q[layer]).T plus
bias and LoRA, in float32 (interpret mode on the CPU; compiled on the GPU with the `gpu` marker)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.reference as reference
from pallas_kernels.nf4_decode import NF4DecodeConfig, nf4_decode_linear, supported
from pallas_kernels.nf4_format import NF4Weight, quantize_nf4, stack_nf4
from tests.helpers import TOL, fast_jit, lower_for_cuda, rel_err

L = 3


def _inputs(rng, m, k, n, r, dtype, bias, double=True, layers=L, blocksize=64):
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    q = stack_nf4([quantize_nf4(jnp.asarray(rng.standard_normal((n, k)) / np.sqrt(k), jnp.float32),
                                blocksize=blocksize, double_quant=double) for _ in range(layers)])
    b = jnp.asarray(rng.standard_normal(n), dtype) if bias else None
    a = jnp.asarray(rng.standard_normal((k, r)) / np.sqrt(k), dtype) if r else None
    bb = jnp.asarray(rng.standard_normal((r, n)) / np.sqrt(max(r, 1)), dtype) if r else None
    return x, q, b, a, bb


def _ref(x, q, layer, b, a, bb, scale):
    """float32 product with the weights `dequantize_nf4(q[layer], x.dtype)` holds; the LoRA factor x @ a rounded
    to x.dtype as the kernel's input is."""
    f = lambda v: None if v is None else jnp.asarray(v, jnp.float32)  # noqa: E731
    w = f(reference.dequantize_nf4(jax.tree.map(lambda v: v[layer], q), x.dtype))
    y = f(x) @ w.T
    if a is not None:
        xa = jnp.dot(x, a, preferred_element_type=jnp.float32).astype(x.dtype)
        y = y + scale * (f(xa) @ f(bb))
    return y if b is None else y + f(b)


def _check(x, q, b, a, bb, tol, scale=2.0, **kw):
    """Layers 0 and L-1 read at run time by one compiled program; each equals its own layer's reference and is
    far from the other layers' (a kernel reading the wrong layer fails)."""
    n_layers = q.stack_shape[0]

    @fast_jit
    def run(x_, q_, b_, a_, bb_, layers):
        return tuple(nf4_decode_linear(x_, q_, layer, bias=b_, lora_a=a_, lora_b=bb_, lora_scale=scale, **kw)
                     for layer in layers)

    ys = run(x, q, b, a, bb, (jnp.int32(0), jnp.int32(n_layers - 1)))
    refs = [_ref(x, q, layer, b, a, bb, scale) for layer in range(n_layers)]
    for layer, y in zip((0, n_layers - 1), ys):
        assert y.dtype == x.dtype and y.shape == (x.shape[0], q.shape[0])
        err = rel_err(jnp.asarray(y, jnp.float32), refs[layer])
        print(f"layer {layer}: rel err {err:.2e}")
        assert err < tol, f"layer {layer}: rel err {err} >= {tol}"
        for other in range(n_layers):
            if other != layer:
                assert rel_err(jnp.asarray(y, jnp.float32), refs[other]) > 10 * tol


CASES = [  # m, k, n, r, dtype, bias, double, config
    (1, 128, 96, 0, "float32", False, True, NF4DecodeConfig(block_n=32, block_k2=32)),
    (16, 192, 200, 4, "float32", True, True, NF4DecodeConfig(block_n=64, block_k2=64, splits=1, lut="select")),
    (5, 256, 40, 8, "float32", True, False, NF4DecodeConfig(block_n=16, block_k2=32, splits=3)),
    (33, 128, 64, 16, "bfloat16", True, True, NF4DecodeConfig(block_n=32, block_k2=16)),
    (16, 320, 72, 0, "float16", False, True, None),
]


@pytest.mark.parametrize("m,k,n,r,dtype,bias,double,cfg", CASES,
                         ids=[f"m{c[0]}-k{c[1]}-n{c[2]}-r{c[3]}-{c[4]}-{'dq' if c[6] else 'f32abs'}" for c in CASES])
def test_matches_reference(rng, m, k, n, r, dtype, bias, double, cfg):
    """Ragged rows, out-features and K splits, single / double quantized scales, both NF4 lookups, LoRA and
    bias in the epilogue (one split) or after the XLA sum of the partials (several)."""
    x, q, b, a, bb = _inputs(rng, m, k, n, r, jnp.dtype(dtype), bias, double)
    # 16-bit results are rounded once to x.dtype; float32 ones differ from the reference by summation order
    _check(x, q, b, a, bb, 1e-5 if dtype == "float32" else TOL[dtype], config=cfg)


def test_blocksize_128_and_negative_layer(rng):
    x, q, b, a, bb = _inputs(rng, 4, 256, 48, 0, jnp.float32, False, blocksize=128)
    y = nf4_decode_linear(x, q, -1, config=NF4DecodeConfig(block_n=16, block_k2=32))
    assert rel_err(y, _ref(x, q, L - 1, None, None, None, 1.0)) < 1e-5


def test_layer_is_read_in_place():
    """The codes of the stack reach the pallas_call whole: no slice, gather or copy of them in the program."""
    S = jax.ShapeDtypeStruct
    n, k = 96, 128
    q = NF4Weight(S((4, n * k // 2), jnp.uint8), S((4, n * k // 64), jnp.uint8), S((4, 1), jnp.float32),
                  S((4,), jnp.float32), shape=(n, k), dtype="bfloat16")
    for splits in (1, 3):
        jaxpr = jax.make_jaxpr(lambda x_, q_, l_: nf4_decode_linear(
            x_, q_, l_, config=NF4DecodeConfig(block_k2=16, splits=splits), interpret=False))(
            S((16, k), jnp.bfloat16), q, S((), jnp.int32))
        codes = jaxpr.jaxpr.invars[1]
        users = [e.primitive.name for e in jaxpr.jaxpr.eqns if any(v is codes for v in e.invars)]
        assert set(users) <= {"reshape", "pallas_call"}, users
        prims = {e.primitive.name for e in jaxpr.jaxpr.eqns}
        assert not prims & {"dynamic_slice", "gather", "copy", "copy_p"}, prims


def test_bad_arguments(rng):
    x, q, b, a, bb = _inputs(rng, 2, 128, 32, 4, jnp.float32, True)
    with pytest.raises(ValueError, match="x must be"):
        nf4_decode_linear(x[:, :64], q, 0)
    with pytest.raises(ValueError, match="stacked over one axis"):
        nf4_decode_linear(x, jax.tree.map(lambda v: v[0], q), 0)
    with pytest.raises(ValueError, match="both lora_a and lora_b"):
        nf4_decode_linear(x, q, 0, lora_a=a)
    with pytest.raises(ValueError, match="bias"):
        nf4_decode_linear(x, q, 0, bias=b[:5])
    with pytest.raises(TypeError, match="layer"):
        nf4_decode_linear(x, q, 0.5)
    with pytest.raises(ValueError, match="power of two"):
        nf4_decode_linear(x, q, 0, config=NF4DecodeConfig(block_n=48))
    odd = stack_nf4([quantize_nf4(jnp.ones((8, 96), jnp.float32))] * 2)   # in-features not a blocksize multiple
    assert not supported(odd) and supported(q)


QWEN = [(1536, 1536), (1536, 256), (1536, 8960), (8960, 1536)]
LLAMA = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)]


def _abstract_stack(layers, n, k):
    S = jax.ShapeDtypeStruct
    nb = n * k // 64
    return NF4Weight(S((layers, n * k // 2), jnp.uint8), S((layers, nb), jnp.uint8),
                     S((layers, -(-nb // 256)), jnp.float32), S((layers,), jnp.float32), shape=(n, k),
                     dtype="bfloat16")


def test_lowers_to_triton_at_model_shapes():
    """Cross-lower (no GPU needed) to Triton at the Qwen2-1.5B / Llama-3-8B shapes, M in {1, 16, 128}, LoRA and
    bias, both lookups."""
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    for (k, n), m, lut in [(s, 16, "gather") for s in QWEN + LLAMA] + [((4096, 14336), 1, "select"),
                                                                         ((14336, 4096), 128, "gather")]:
        def f(x, q, layer, bias, a, bb):
            return nf4_decode_linear(x, q, layer, bias=bias, lora_a=a, lora_b=bb, lora_scale=2.0,
                                     config=NF4DecodeConfig(lut=lut), interpret=False)

        args = (S((m, k), bf), _abstract_stack(28, n, k), S((), jnp.int32), S((n,), bf), S((k, 16), bf),
                S((16, n), bf))
        assert "triton" in lower_for_cuda(f, *args)


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 128])
@pytest.mark.parametrize("k,n", QWEN + LLAMA)
def test_gpu_model_shapes_bf16(rng, m, k, n):
    x, q, b, a, bb = _inputs(rng, m, k, n, 16, jnp.bfloat16, False, layers=2)
    _check(x, q, b, a, bb, TOL["bfloat16"], interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("lut", ["gather", "select"])
@pytest.mark.parametrize("splits", [1, 4])
def test_gpu_configs_ragged(rng, lut, splits):
    x, q, b, a, bb = _inputs(rng, 5, 1024, 200, 8, jnp.bfloat16, True)
    _check(x, q, b, a, bb, TOL["bfloat16"], config=NF4DecodeConfig(splits=splits, lut=lut), interpret=False)


@pytest.mark.gpu
def test_gpu_float32_single_quant(rng):
    x, q, b, a, bb = _inputs(rng, 16, 512, 256, 4, jnp.float32, True, double=False)
    _check(x, q, b, a, bb, TOL["float32_tf32"], interpret=False)
