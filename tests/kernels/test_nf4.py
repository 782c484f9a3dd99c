"""NF4 kernels vs their plain-jnp twins (interpret mode on CPU; `-m gpu` runs the real-shape GPU tests).

No torch / bitsandbytes here: tests/kernels/test_nf4_bnb.py compares with the real library.
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.nf4 as nf4
import pallas_kernels.nf4_format as fmt
import pallas_kernels.reference as ref
from tests.helpers import TOL, rel_err

JAX_DT = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


def _rand_nf4(rng, shape, dtype="bfloat16", double=True, blocksize=64, lead=()) -> fmt.NF4Weight:
    """A random NF4Weight (random codes and statistics; no quantization compile needed)."""
    numel = int(np.prod(shape))
    nb = -(-numel // blocksize)
    nb2 = -(-nb // 256)
    codes = jnp.asarray(rng.integers(0, 256, lead + ((numel + 1) // 2,), dtype=np.uint8))
    if double:
        absmax = jnp.asarray(rng.integers(0, 256, lead + (nb,), dtype=np.uint8))
        nested = jnp.asarray(rng.uniform(0.2, 1.5, lead + (nb2,)).astype(np.float32))
        offset = jnp.asarray(rng.uniform(1.0, 3.0, lead).astype(np.float32))
        return fmt.NF4Weight(codes, absmax, nested, offset, shape=shape, dtype=dtype, blocksize=blocksize)
    absmax = jnp.asarray(rng.uniform(0.1, 3.0, lead + (nb,)).astype(np.float32))
    return fmt.NF4Weight(codes, absmax, None, None, shape=shape, dtype=dtype, blocksize=blocksize)


def _normal(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(JAX_DT[dtype])


def _f32(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


def _fwd_bwd(fn):
    """jit(x, q, g) -> (fn(x, q), d/dx <fn(x, q), g>)."""
    def run(x, q, g):
        out, vjp = jax.vjp(lambda x_: fn(x_, q), x)
        return out, vjp(g)[0]
    return jax.jit(run)


# ---------------------------------------------------------------------------------------------------
# tables
# ---------------------------------------------------------------------------------------------------


def test_tables(rng):
    assert fmt.NF4_CODE.dtype == np.float32 and fmt.NF4_CODE[0] == -1 and fmt.NF4_CODE[15] == 1
    assert fmt.NF4_CODE[7] == 0 and np.all(np.diff(fmt.NF4_CODE) > 0)
    assert fmt.DYNAMIC_MAP.shape == (256,) and fmt.DYNAMIC_MAP[-1] == 1 and fmt.DYNAMIC_MAP[127] == 0
    t = fmt._DYN_THRESHOLDS
    assert t.shape == (255,) and np.all(np.diff(t) >= 0)
    # The threshold form equals the (numpy-emulated) 65536-entry LUT rule, also right at the thresholds.
    v = np.concatenate([rng.uniform(-1, 1, 20_000), rng.standard_normal(5_000) * 1e-3]).astype(np.float32)
    v = np.concatenate([v, t, np.nextafter(t, np.float32(-2)), np.nextafter(t, np.float32(2))])
    v = np.clip(v, -1, 1).astype(np.float32)
    assert np.array_equal(np.searchsorted(t, v, side="right"), fmt._cpu_lut_code8(v))


# ---------------------------------------------------------------------------------------------------
# quantization
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape,dtype", [((37, 131), "bfloat16"), ((64, 256), "float32")])
def test_quantize_dequantize_error(rng, shape, dtype):
    w = _normal(rng, shape, dtype) * jnp.asarray(np.exp(rng.uniform(-0.7, 0.7, (shape[0], 1))), JAX_DT[dtype])
    wf = _f32(w).reshape(-1)
    numel = wf.size
    q = fmt.quantize_nf4(w)
    q0 = fmt.quantize_nf4(w, double_quant=False)
    assert q.shape == shape and q.dtype == dtype and q.codes.shape == ((numel + 1) // 2,)
    assert q.codes.dtype == jnp.uint8 and q.absmax.dtype == jnp.uint8 and q.nested_absmax.dtype == jnp.float32
    assert q.absmax.shape == (q.nblocks,) and q.nested_absmax.shape == (q.nblocks2,) and q.offset.shape == ()
    assert np.array_equal(np.asarray(q.codes), np.asarray(q0.codes))

    # Without double quant: absmax is the exact block max and every code is the nearest NF4 value.
    pad = q0.nblocks * 64 - numel
    blocks = np.pad(wf, (0, pad)).reshape(-1, 64)
    am = np.abs(blocks).max(1)
    assert np.array_equal(np.asarray(q0.absmax), am)
    b = np.asarray(q0.codes).astype(np.int64)
    codes = np.stack([b >> 4, b & 15], -1).reshape(-1)[:numel]
    scaled = np.clip(wf / np.repeat(am, 64)[:numel], -1, 1)
    dist = np.abs(scaled[:, None] - fmt.NF4_CODE[None, :])
    assert np.all(dist[np.arange(numel), codes] <= dist.min(1) + 1e-6)

    # With double quant: decoded absmax within one dynamic-map step of the truth; weights within NF4 error.
    am_dec = np.asarray(fmt.decoded_absmax(q))
    nested = np.repeat(np.asarray(q.nested_absmax), 256)[: q.nblocks]
    assert np.all(np.abs(am_dec - am) <= nested * 0.0075 + 1e-6)
    deq = _f32(jax.jit(nf4.dequantize_nf4)(q)).reshape(-1)
    # |w - NF4[c] * am_dec| <= |w - NF4[c] * am| + |am - am_dec|, the first at most half the widest NF4 gap
    # (-1 .. -0.696: 0.1520 * am); plus the rounding of the output to the weight dtype.
    bound = 0.1520 * np.repeat(am, 64)[:numel] + np.abs(np.repeat(am_dec - am, 64)[:numel]) + 1e-2 * np.abs(deq)
    assert np.all(np.abs(deq - wf) <= bound + 1e-6)
    assert rel_err(deq, wf) < 0.15


def test_quantize_is_idempotent_float32(rng):
    w = _normal(rng, (48, 192), "float32")
    q = fmt.quantize_nf4(w, double_quant=False)
    q2 = fmt.quantize_nf4(jax.jit(nf4.dequantize_nf4)(q), double_quant=False)
    assert np.array_equal(np.asarray(q2.codes), np.asarray(q.codes))
    assert np.array_equal(np.asarray(q2.absmax), np.asarray(q.absmax))


def test_host_sum_equals_float32_of_fsum(rng, monkeypatch):
    """The double-quant offset's sum: numpy's float64 sum where it decides the float32 result, math.fsum where
    it does not (sums at a float32 rounding tie); always float32(math.fsum(values))."""
    import math

    calls = []
    real_fsum = math.fsum
    monkeypatch.setattr(fmt.math, "fsum", lambda xs: calls.append(1) or real_fsum(xs))

    def margin_over_bound(values):
        """How far the exact sum is from the nearest float32 rounding midpoint, in units of numpy's error
        bound (n + 2) 2^-52 sum|v|."""
        exact = real_fsum(values.tolist())
        f = np.float32(exact)
        mids = [(float(f) + float(np.nextafter(f, np.float32(d)))) / 2 for d in (-np.inf, np.inf)]
        return min(abs(exact - m) for m in mids) / ((values.size + 2) * 2.0**-52 * float(np.sum(np.abs(values))))

    for n in (1, 7, 1000, 200_000):
        for _ in range(3):
            values = np.abs(rng.standard_normal(n)) * rng.choice([1e-3, 1.0, 1e3], n)
            before = len(calls)
            assert fmt._f32_of_sum(values) == np.float32(real_fsum(values.tolist()))
            if margin_over_bound(values) > 2:  # all but about 1 in 1000 random sums at n = 200,000
                assert len(calls) == before, n  # a sum far from a rounding boundary: no exact sum needed
    del calls[:]
    tie = np.array([1.0, 2.0**-24])  # exactly halfway between two float32s: ties to even (1.0)
    assert fmt._f32_of_sum(tie) == np.float32(1.0) and len(calls) == 1
    above = np.array([1.0, 2.0**-24, 2.0**-60])  # a hair above the tie: float64 decides nothing here either
    assert fmt._f32_of_sum(above) == np.float32(real_fsum(above.tolist())) and len(calls) == 2


# ---------------------------------------------------------------------------------------------------
# dequantization kernel
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape,out_dtype,double,lut",
    [
        ((37, 131), "bfloat16", True, "select"),  # odd numel, partial last block
        ((128, 64), "float32", False, "gather"),  # tiles cover the tensor exactly: unmasked path
        ((3, 1000), "float16", True, "gather"),  # partial last block
        ((300, 70), "bfloat16", True, "select"),  # 329 blocks: two nested blocks, last one partial
    ],
)
def test_dequantize_kernel(rng, shape, out_dtype, double, lut, monkeypatch):
    q = _rand_nf4(rng, shape, dtype="float32", double=double)
    for key in list(nf4._DEQUANT_CONFIGS):
        monkeypatch.setitem(nf4._DEQUANT_CONFIGS, key, dict(nf4._DEQUANT_CONFIGS[key], lut=lut))
    out = jax.jit(lambda q: nf4.dequantize_nf4(q, out_dtype))(q)
    want = jax.jit(lambda q: ref.dequantize_nf4(q, out_dtype))(q)
    assert out.shape == shape and out.dtype == JAX_DT[out_dtype]
    assert rel_err(_f32(out), _f32(want)) == 0.0  # elementwise and exact: identical bits expected
    assert np.array_equal(_f32(out), _f32(want))


def test_dequantize_default_dtype(rng):
    q = _rand_nf4(rng, (20, 66), dtype="float16", double=False)
    out = nf4.dequantize_nf4(q)
    assert out.dtype == jnp.float16 and out.shape == (20, 66)
    assert np.array_equal(_f32(out), _f32(ref.dequantize_nf4(q)))


# ---------------------------------------------------------------------------------------------------
# nf4_matmul (+ dX), fused and dequantize paths
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "M,N,K,dtype,double,impl,lut",
    [
        (5, 70, 320, "bfloat16", True, "fused", "select"),  # ragged N, K not a multiple of block_k
        (16, 128, 256, "bfloat16", True, "fused", "gather"),  # no ragged edge: unmasked loads/stores
        (20, 33, 192, "float32", False, "fused", "gather"),  # M > 16 -> block_m 32
        (3, 50, 130, "float32", True, "dequant", "select"),  # K not a multiple of 64: dequantize path
        (9, 40, 128, "bfloat16", False, "dequant", "gather"),
    ],
)
def test_nf4_matmul(rng, M, N, K, dtype, double, impl, lut, monkeypatch):
    for table in (nf4._MATMUL_CONFIGS, nf4._DEQUANT_CONFIGS):
        for key in list(table):
            monkeypatch.setitem(table, key, dict(table[key], lut=lut))
    q = _rand_nf4(rng, (N, K), dtype="bfloat16", double=double)
    x = _normal(rng, (M, K), dtype)
    g = _normal(rng, (M, N), dtype)
    out, dx = _fwd_bwd(lambda x, q: nf4.nf4_matmul(x, q, impl=impl))(x, q, g)
    out_r, dx_r = _fwd_bwd(ref.nf4_matmul)(x, q, g)
    assert out.shape == (M, N) and out.dtype == x.dtype and dx.shape == x.shape and dx.dtype == x.dtype
    assert rel_err(_f32(out), _f32(out_r)) < TOL[dtype]
    assert rel_err(_f32(dx), _f32(dx_r)) < TOL[dtype]


def test_dispatch_threshold(rng):
    q = _rand_nf4(rng, (64, 128))
    limit = nf4._FUSED_MAX_M["bfloat16"]  # 0 on the measured table: the fused kernel is never auto-chosen
    if limit > 0:
        assert nf4._choose_impl(1, q, "bfloat16", None) == "fused"
    assert nf4._choose_impl(limit + 1, q, "bfloat16", None) == "dequant"
    assert nf4._choose_impl(1, q, "bfloat16", "fused") == "fused"
    q_odd = _rand_nf4(rng, (64, 100))
    assert nf4._choose_impl(1, q_odd, "bfloat16", None) == "dequant"
    with pytest.raises(ValueError):
        nf4._choose_impl(1, q_odd, "bfloat16", "fused")


def test_qlora_linear_grads(rng):
    N, K, r = 48, 128, 8
    q = _rand_nf4(rng, (N, K), double=True)
    x = _normal(rng, (2, 3, K), "bfloat16")
    a = jnp.asarray(rng.standard_normal((K, r)).astype(np.float32) * 0.1)
    b = jnp.asarray(rng.standard_normal((r, N)).astype(np.float32) * 0.1)
    g = _normal(rng, (2, 3, N), "bfloat16")

    def run(fn):
        def f(x, a, b, q, g):
            out, vjp = jax.vjp(lambda x_, a_, b_: fn(x_, q, a_, b_, 0.5), x, a, b)
            return (out,) + vjp(g)
        return jax.jit(f)(x, a, b, q, g)

    got = run(nf4.qlora_linear)
    want = run(ref.qlora_linear)
    for name, o, w in zip(("out", "dx", "da", "db"), got, want):
        assert o.shape == w.shape and o.dtype == w.dtype, name
        assert rel_err(_f32(o), _f32(w)) < TOL["bfloat16"], name
    assert got[2].dtype == jnp.float32 and got[3].dtype == jnp.float32


# ---------------------------------------------------------------------------------------------------
# stacked layers (leading L axis, lax.scan)
# ---------------------------------------------------------------------------------------------------


def test_stacked_layers_scan(rng):
    L, D, M = 3, 64, 4
    layers = [_rand_nf4(rng, (D, D), double=True) for _ in range(L)]
    stacked = fmt.stack_nf4(layers)
    assert stacked.stack_shape == (L,) and stacked.shape == (D, D)
    assert stacked.codes.shape == (L, D * D // 2) and stacked.offset.shape == (L,)
    for i, layer in enumerate(layers):
        sl = jax.tree.map(lambda a: a[i], stacked)
        assert isinstance(sl, fmt.NF4Weight) and sl.stack_shape == () and sl.shape == (D, D)
        for got, want in zip(jax.tree.leaves(sl), jax.tree.leaves(layer)):
            assert np.array_equal(np.asarray(got), np.asarray(want))

    # dequantize of the whole stack == per-layer reference
    deq = jax.jit(nf4.dequantize_nf4)(stacked)
    assert deq.shape == (L, D, D)
    assert np.array_equal(_f32(deq), _f32(jax.jit(ref.dequantize_nf4)(stacked)))

    # lax.scan over layers with the fused kernel, and its gradient
    x = _normal(rng, (M, D), "bfloat16") * 0.5

    def net(fn):
        def f(x, qs):
            def body(h, qi):
                return fn(h, qi).astype(h.dtype) * jnp.bfloat16(0.05), None
            h, _ = jax.lax.scan(body, x, qs)
            return jnp.sum(h.astype(jnp.float32) ** 2)
        return jax.jit(jax.value_and_grad(f))

    v, gx = net(nf4.nf4_matmul)(x, stacked)
    v_r, gx_r = net(ref.nf4_matmul)(x, stacked)
    assert rel_err(float(v), float(v_r)) < TOL["bfloat16"]
    assert rel_err(_f32(gx), _f32(gx_r)) < TOL["bfloat16"]


# ---------------------------------------------------------------------------------------------------
# bitsandbytes checkpoint tensors (format only; the real library is compared in test_nf4_bnb.py)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("double", [True, False])
def test_bnb_tensors_round_trip(rng, double):
    q = _rand_nf4(rng, (30, 77), dtype="bfloat16", double=double)  # odd numel
    t = fmt.nf4_to_bnb_tensors(q)
    assert t["weight"].shape == ((30 * 77 + 1) // 2, 1) and t["weight"].dtype == np.uint8
    assert np.array_equal(t["weight.quant_map"], fmt.NF4_CODE)
    meta = json.loads(bytes(t["weight.quant_state.bitsandbytes__nf4"]).decode())
    assert meta["quant_type"] == "nf4" and meta["blocksize"] == 64 and meta["dtype"] == "bfloat16"
    assert meta["shape"] == [30, 77]
    if double:
        assert t["weight.absmax"].dtype == np.uint8 and np.array_equal(t["weight.nested_quant_map"], fmt.DYNAMIC_MAP)
        assert meta["nested_blocksize"] == 256 and meta["nested_dtype"] == "float32"
        assert np.float32(meta["nested_offset"]) == np.float32(q.offset)
    else:
        assert t["weight.absmax"].dtype == np.float32 and "weight.nested_absmax" not in t
    prefixed = {"model.layers.0.self_attn.q_proj." + k: v for k, v in t.items()}
    for tensors in (t, prefixed):
        q2 = fmt.nf4_from_bnb_tensors(tensors)
        assert (q2.shape, q2.dtype, q2.blocksize, q2.double_quant) == (q.shape, q.dtype, q.blocksize, double)
        for got, want in zip(jax.tree.leaves(q2), jax.tree.leaves(q)):
            assert np.array_equal(np.asarray(got), np.asarray(want))
        back = fmt.nf4_to_bnb_tensors(q2)
        assert all(back[k].tobytes() == t[k].tobytes() for k in t)


# ---------------------------------------------------------------------------------------------------
# GPU: real shapes, no interpret mode
# ---------------------------------------------------------------------------------------------------

GPU_SHAPES = [(8960, 1536), (14336, 4096), (4096, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_quantize_matches_cpu_backend(rng, shape):
    """quantize_nf4 on the GPU gives the same bits as on the CPU backend (which test_nf4_bnb.py checks against
    bitsandbytes): no FMA contraction or reciprocal-division rewrites change the result on the GPU."""
    w = _normal(rng, shape, "bfloat16")
    q_gpu = fmt.quantize_nf4(w)
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        q_cpu = fmt.quantize_nf4(jax.device_put(w, cpu))
    names = ("codes", "absmax", "nested_absmax", "offset")
    for name, got, want in zip(names, jax.tree.leaves(q_gpu), jax.tree.leaves(q_cpu)):
        got, want = np.asarray(got), np.asarray(want)
        bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
        assert bad.size == 0, (f"{name}: {bad.size} of {got.size} differ, first at {bad[:5]}: "
                               f"gpu {got.reshape(-1)[bad[:5]]} cpu {want.reshape(-1)[bad[:5]]}")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
def test_gpu_dequantize(rng, shape, out_dtype):
    q = fmt.quantize_nf4(_normal(rng, shape, "bfloat16"))
    out = jax.jit(lambda q: nf4.dequantize_nf4(q, out_dtype))(q)
    want = jax.jit(lambda q: ref.dequantize_nf4(q, out_dtype))(q)
    assert rel_err(_f32(out), _f32(want)) < 1e-6
    assert np.array_equal(_f32(out), _f32(want))  # bit-exact (no FMA in the scale decode)
    # and equal to a numpy decode of the stored bytes (two roundings for the double-quantized scale)
    dyn = fmt.DYNAMIC_MAP[np.asarray(q.absmax)]
    nested = np.asarray(q.nested_absmax)[np.arange(q.nblocks) // 256]
    scale = (dyn * nested).astype(np.float32) + np.float32(q.offset)
    b = np.asarray(q.codes).astype(np.int64)
    vals = fmt.NF4_CODE[np.stack([b >> 4, b & 15], -1).reshape(-1)]
    want_np = (vals * np.repeat(scale, 64)).astype(np.float32)
    assert np.array_equal(_f32(jnp.asarray(want_np).astype(JAX_DT[out_dtype])).reshape(-1), _f32(out).reshape(-1))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("M,impl", [(1, None), (16, None), (64, "fused"), (16, "dequant"), (4096, None)])
def test_gpu_nf4_matmul(rng, shape, M, impl):
    q = fmt.quantize_nf4(_normal(rng, shape, "bfloat16"))
    N, K = shape
    x = _normal(rng, (M, K), "bfloat16")
    g = _normal(rng, (M, N), "bfloat16")
    out, dx = _fwd_bwd(lambda x, q: nf4.nf4_matmul(x, q, impl=impl))(x, q, g)
    out_r, dx_r = _fwd_bwd(ref.nf4_matmul)(x, q, g)
    assert rel_err(_f32(out), _f32(out_r)) < TOL["bfloat16"]
    assert rel_err(_f32(dx), _f32(dx_r)) < TOL["bfloat16"]


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["fused", "dequant"])
def test_gpu_nf4_matmul_float32(rng, impl):
    q = _rand_nf4(rng, (4096, 4096), double=True)
    x = _normal(rng, (8, 4096), "float32")
    g = _normal(rng, (8, 4096), "float32")
    out, dx = _fwd_bwd(lambda x, q: nf4.nf4_matmul(x, q, impl=impl))(x, q, g)
    with jax.default_matmul_precision("highest"):
        out_r, dx_r = _fwd_bwd(ref.nf4_matmul)(x, q, g)
    assert rel_err(_f32(out), _f32(out_r)) < TOL["float32_tf32"]
    assert rel_err(_f32(dx), _f32(dx_r)) < TOL["float32_tf32"]


@pytest.mark.gpu
def test_gpu_stacked_scan_qlora(rng):
    L, D, r = 4, 1536, 16
    stacked = fmt.stack_nf4([fmt.quantize_nf4(_normal(rng, (D, D), "bfloat16") * 0.02) for _ in range(L)])
    a = jnp.asarray(rng.standard_normal((L, D, r)).astype(np.float32) * 0.01)
    b = jnp.asarray(rng.standard_normal((L, r, D)).astype(np.float32) * 0.01)
    x = _normal(rng, (2, 8, D), "bfloat16")

    def net(fn):
        def f(x, a, b, qs):
            def body(h, layer):
                qi, ai, bi = layer
                return fn(h, qi, ai, bi, 2.0), None
            h, _ = jax.lax.scan(body, x, (qs, a, b))
            return jnp.mean(h.astype(jnp.float32) ** 2)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))

    v, grads = net(nf4.qlora_linear)(x, a, b, stacked)
    v_r, grads_r = net(ref.qlora_linear)(x, a, b, stacked)
    assert rel_err(float(v), float(v_r)) < TOL["bfloat16"]
    for got, want in zip(grads, grads_r):
        assert rel_err(_f32(got), _f32(want)) < TOL["bfloat16"]
