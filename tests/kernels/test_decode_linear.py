"""stacked_linear (decode GEMM on one layer of a stacked kernel, bias and LoRA fused) vs the jnp reference.

CPU runs use interpret mode with small blocks, so every dimension is ragged and spans several tiles, and split-K
is exercised with a short last split. The reference runs on float32 copies of the inputs at full precision.
`pytest -m gpu` runs the real model shapes on the GPU (compiled Triton, no interpret mode).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.reference as reference
from pallas_kernels.decode_linear import (_SMEM_BUDGET, TARGET_PROGRAMS, TUNED, DecodeConfig, _smem_bytes,
                                          pick_config, resolve_config, rows_bucket, stacked_linear)
from tests.helpers import TOL, fast_jit, lower_for_cuda, rel_err

L = 3


def _f32(v):
    return None if v is None else jnp.asarray(v, jnp.float32)


def _inputs(rng, m, k, n, r, dtype, bias, w_dtype=None, layers=L):
    x = rng.standard_normal((m, k))
    w = rng.standard_normal((layers, k, n)) / np.sqrt(k)
    b = rng.standard_normal(n) if bias else None
    a = rng.standard_normal((k, r)) / np.sqrt(k) if r else None
    bb = rng.standard_normal((r, n)) / np.sqrt(r) if r else None  # the LoRA delta about as large as x @ w
    cast = lambda v, dt=dtype: None if v is None else jnp.asarray(v, dt)  # noqa: E731
    return cast(x), cast(w, w_dtype or dtype), cast(b), cast(a), cast(bb)


def _ref(x, w, layer, b, a, bb, scale):
    return reference.stacked_linear(_f32(x), _f32(w), layer, bias=_f32(b), lora_a=_f32(a), lora_b=_f32(bb),
                                    lora_scale=scale)


def _check_layers(x, w, b, a, bb, scale, tol, runtime_layer=False, **kw):
    """Layers 0 and L-1 (one compiled program) against the reference; each result is far from every other
    layer's reference (a kernel reading the wrong layer would fail). runtime_layer: the layer index is an int32
    argument of the program (the kernel reads it at run time) instead of a Python int."""
    n_layers = w.shape[0]

    @fast_jit
    def run(x_, w_, b_, a_, bb_, layers):
        return tuple(stacked_linear(x_, w_, layer, bias=b_, lora_a=a_, lora_b=bb_, lora_scale=scale, **kw)
                     for layer in (layers if runtime_layer else (0, n_layers - 1)))

    ys = run(x, w, b, a, bb, (jnp.int32(0), jnp.int32(n_layers - 1)))
    refs = [_ref(x, w, layer, b, a, bb, scale) for layer in range(n_layers)]
    for layer, y in zip((0, n_layers - 1), ys):
        assert y.dtype == x.dtype and y.shape == (x.shape[0], w.shape[2])
        err = rel_err(_f32(y), refs[layer])
        print(f"layer {layer}: rel err {err:.2e}")
        assert err < tol, f"layer {layer}: rel err {err} >= {tol}"
        for other in range(n_layers):
            if other != layer:
                assert rel_err(_f32(y), refs[other]) > 0.2, f"layer {layer}'s result matches layer {other}"


# (m, dtype, bias, r, overrides): ragged M (1, 5, 16, 33) and K, N drawn in [40, 90) (not multiples of any block
# below); splits > 1 with a short last split; r padded to 16 or 64 inside the kernel; runtime_layer: the layer
# is an int32 scalar read by the kernel.
CASES = [
    (1, "float32", True, 5, dict(block_n=16, block_k=16)),
    (5, "bfloat16", False, 16, dict(block_n=32, block_k=16, splits=3)),
    (16, "float32", False, 0, dict(block_n=16, block_k=32, splits=2)),
    (33, "bfloat16", True, 40, dict(block_n=16, block_k=16)),
    (5, "float32", True, 0, dict(block_n=32, block_k=16, splits=4)),
    (33, "float32", False, 8, dict(block_n=32, block_k=16, splits=2, num_warps=8, num_stages=2)),
    (16, "bfloat16", True, 16, dict(block_n=16, block_k=16, splits=3)),
    (1, "bfloat16", False, 0, dict(block_n=32, block_k=32)),
    (5, "float32", True, 8, dict(block_n=16, block_k=16, splits=2, runtime_layer=True)),
    (33, "bfloat16", False, 16, dict(block_n=32, block_k=16, runtime_layer=True)),
]


@pytest.mark.parametrize("m,dtype,bias,r,kw", CASES,
                         ids=[f"m{c[0]}-{c[1]}-{'bias' if c[2] else 'nobias'}-r{c[3]}-s{c[4].get('splits', 1)}"
                              + ("-runtime" if c[4].get("runtime_layer") else "") for c in CASES])
def test_matches_reference_ragged(rng, m, dtype, bias, r, kw):
    k, n = (int(v) for v in rng.integers(40, 90, size=2))
    scale = float(rng.uniform(0.5, 4.0))
    x, w, b, a, bb = _inputs(rng, m, k, n, r, jnp.dtype(dtype), bias)
    _check_layers(x, w, b, a, bb, scale, TOL[dtype], **kw)


def test_default_config_fp32_x_with_bf16_stack(rng):
    """No overrides (the pick_config rule, clipped to a small shape, split-K chosen by the rule); fp32 rows
    against a bf16 stack (tiles upcast in the kernel); a negative layer index counts from the end."""
    m, k, n = 7, 300, 72
    x, w, b, a, bb = _inputs(rng, m, k, n, 8, jnp.float32, True, w_dtype=jnp.bfloat16, layers=4)
    cfg = resolve_config(pick_config(m, k, n, jnp.float32, 8), m, k, n, jnp.float32, 8)
    assert cfg.splits > 1  # the rule splits K here (few N tiles)
    y = fast_jit(lambda *v: stacked_linear(v[0], v[1], -1, bias=v[2], lora_a=v[3], lora_b=v[4], lora_scale=0.5))(
        x, w, b, a, bb)
    assert y.dtype == jnp.float32
    err = rel_err(y, _ref(x, w, 3, b, a, bb, 0.5))
    assert err < TOL["float32"], err


def test_runtime_layer_in_scan(rng):
    """A traced layer index from lax.scan over the layers: one kernel for all, each step its own layer."""
    x, w, b, a, bb = _inputs(rng, 3, 50, 40, 4, jnp.float32, True, layers=4)

    def step(carry, layer):
        return carry, stacked_linear(x, w, layer, bias=b, lora_a=a, lora_b=bb, block_n=16, block_k=16)

    ys = fast_jit(lambda: jax.lax.scan(step, 0, jnp.arange(4))[1])()
    for layer in range(4):
        assert rel_err(ys[layer], _ref(x, w, layer, b, a, bb, 1.0)) < TOL["float32"]


@pytest.mark.parametrize("runtime_layer", [False, True])
def test_layer_is_read_in_place(runtime_layer):
    """The stack reaches the pallas_call whole: no slice, gather or copy of w in the program (the layer is the
    weight BlockSpec's index, or a pointer offset read at run time), with or without split-K."""
    S = jax.ShapeDtypeStruct
    x, w = S((16, 96), jnp.bfloat16), S((4, 96, 80), jnp.bfloat16)
    a, b = S((96, 16), jnp.bfloat16), S((16, 80), jnp.bfloat16)
    layer = jnp.int32(2) if runtime_layer else 2
    for splits in (1, 3):
        jaxpr = jax.make_jaxpr(lambda x_, w_, a_, b_: stacked_linear(
            x_, w_, layer, lora_a=a_, lora_b=b_, splits=splits, interpret=False))(x, w, a, b)
        w_var = jaxpr.jaxpr.invars[1]
        users = [e for e in jaxpr.jaxpr.eqns if any(v is w_var for v in e.invars)]
        assert [e.primitive.name for e in users] == ["pallas_call"], users
        prims = {e.primitive.name for e in jaxpr.jaxpr.eqns}
        assert not prims & {"slice", "dynamic_slice", "gather", "copy", "copy_p"}, prims


def test_bad_arguments():
    x = jnp.ones((4, 32), jnp.bfloat16)
    w = jnp.ones((3, 32, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="out of range"):
        stacked_linear(x, w, 3)
    with pytest.raises(TypeError, match="Python int or an integer scalar"):
        stacked_linear(x, w, 1.0)
    with pytest.raises(TypeError, match="integer scalar"):
        stacked_linear(x, w, jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="both lora_a and lora_b"):
        stacked_linear(x, w, 0, lora_a=jnp.ones((32, 8), jnp.bfloat16))
    with pytest.raises(TypeError, match="dtype"):
        stacked_linear(x, w.astype(jnp.float32), 0)
    with pytest.raises(ValueError, match="power of two"):
        stacked_linear(x, w, 0, block_n=24)


QWEN = [(1536, 1536), (1536, 256), (1536, 8960), (8960, 1536)]
LLAMA = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)]


@pytest.mark.parametrize("m", [1, 16, 128])
@pytest.mark.parametrize("r", [0, 16, 64])
def test_config_rule_at_model_shapes(m, r):
    """Powers of two, at least 16 wide, stages fit the shared-memory budget, splits leave no split empty, and
    the grid is near the program target (or as large as the K steps and the partial-sum bound allow)."""
    for k, n in QWEN + LLAMA:
        for dtype in (jnp.bfloat16, jnp.float32):
            cfg = resolve_config(pick_config(m, k, n, dtype, r), m, k, n, dtype, r)
            for v in (cfg.block_m, cfg.block_n, cfg.block_k):
                assert v >= 16 and v & (v - 1) == 0, cfg
            rp = max(16, r) if r else 0
            assert _smem_bytes(cfg.block_m, cfg.block_n, cfg.block_k, rp, jnp.dtype(dtype).itemsize,
                               cfg.num_stages) <= _SMEM_BUDGET, cfg
            k_steps = -(-k // cfg.block_k)
            steps = -(-k_steps // cfg.splits)
            assert (cfg.splits - 1) * steps < k_steps, cfg   # the last split has at least one step
            if jnp.dtype(dtype).itemsize == 2 and (rows_bucket(m), k, n) in TUNED:
                continue   # a measured config: its grid is whatever ran fastest
            tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
            s_max = max(1, k * jnp.dtype(dtype).itemsize // (4 * m))   # partial-sum bytes <= one weight slice
            assert cfg.splits <= s_max or cfg.splits * (steps - 1) < k_steps, cfg
            assert tiles * cfg.splits >= min(TARGET_PROGRAMS // 2, tiles * min(k_steps, s_max) // 2), (k, n, cfg)


def test_tuned_configs_are_used_for_16_bit_rows_only():
    """A TUNED shape gets its measured config for 16-bit rows in its rows bucket; float32 rows and other
    buckets get the rule."""
    assert TUNED, "no tuned shapes"
    for (bucket, k, n), cfg in TUNED.items():
        assert pick_config(bucket, k, n, jnp.bfloat16, 16) == cfg
        assert pick_config(bucket, k, n, jnp.float16, 0) == cfg
        assert pick_config(bucket, k, n, jnp.float32, 16) != cfg
        other = 128 if bucket != 128 else 16
        if (other, k, n) not in TUNED:
            assert pick_config(other, k, n, jnp.bfloat16, 16) != cfg


def test_tuned_table_is_read_only_and_taken_from_the_environment_once(tmp_path):
    """TUNED cannot change while programs trace; a table named by UNSLOTH_JAX_DECODE_LINEAR_CONFIGS replaces the
    measured configs of the shapes it lists when the module is imported, and a bad file is a clear error."""
    import json
    import subprocess
    import sys

    from pallas_kernels.decode_linear import CONFIGS_ENV
    from tests.helpers import subprocess_env

    cfg = DecodeConfig(block_m=16, block_n=64, block_k=64)
    with pytest.raises(TypeError, match="does not support item assignment"):
        TUNED[(16, 64, 64)] = cfg
    table = tmp_path / "configs.json"
    table.write_text(json.dumps({"16,8960,1536": {"block_m": 16, "block_n": 32, "block_k": 64, "splits": 2},
                                 "128,64,96": {"block_m": 128, "block_n": 32, "block_k": 32}}))
    code = ("from pallas_kernels.decode_linear import TUNED; "
            "print(sorted((k, v.block_n, v.block_k, v.splits) for k, v in TUNED.items()))")
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env(**{CONFIGS_ENV: str(table)}),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[((16, 8960, 1536), 32, 64, 2), ((128, 64, 96), 32, 32, None)]"
    table.write_text('{"16,8960,1536": {"block_rows": 16}}')
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env(**{CONFIGS_ENV: str(table)}),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and f"{CONFIGS_ENV}={table}" in out.stderr and "block_rows" in out.stderr


def test_lowers_to_triton_at_model_shapes():
    """Cross-lower (no GPU needed) to Triton IR at the Qwen2-1.5B / Llama-3-8B shapes, M in {1, 16, 128}, with
    bias and LoRA, each with its default config (split-K or not)."""
    S = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    cases = [(m, k, n) for m in (16,) for k, n in QWEN + LLAMA] + [(1, 1536, 256), (128, 1536, 1536),
                                                                    (128, 4096, 14336), (200, 4096, 4096)]
    for m, k, n in cases:
        args = S((m, k), bf), S((28, k, n), bf), S((n,), bf), S((k, 16), bf), S((16, n), bf)

        def f(x, w, b, a, bb):
            return stacked_linear(x, w, 27, bias=b, lora_a=a, lora_b=bb, lora_scale=2.0, interpret=False)

        assert "triton" in lower_for_cuda(f, *args)
    # the layer read at run time
    args = S((16, 4096), bf), S((32, 4096, 14336), bf), S((), jnp.int32)
    assert "triton" in lower_for_cuda(lambda x, w, layer: stacked_linear(x, w, layer, interpret=False), *args)
    # fp32 rows on a bf16 stack, rank 64, no bias
    args = S((16, 4096), jnp.float32), S((4, 4096, 1024), bf), S((4096, 64), jnp.float32), S((64, 1024), jnp.float32)
    assert "triton" in lower_for_cuda(
        lambda x, w, a, bb: stacked_linear(x, w, 1, lora_a=a, lora_b=bb, interpret=False), *args)


# ---------------------------------------------------------------------------------------------- GPU
def _gpu_check(rng, m, k, n, r, dtype, bias, tol, layers=3, runtime_layer=False, **kw):
    x, w, b, a, bb = _inputs(rng, m, k, n, r, jnp.dtype(dtype), bias, layers=layers)
    scale = 2.0
    for layer in (0, layers - 1):
        idx = jnp.int32(layer) if runtime_layer else layer
        y = jax.jit(lambda *v, idx=idx: stacked_linear(v[0], v[1], idx, bias=v[2], lora_a=v[3], lora_b=v[4],
                                                        lora_scale=scale, interpret=False, **kw))(x, w, b, a, bb)
        y_ref = jax.jit(lambda *v, layer=layer: reference.stacked_linear(
            v[0], v[1], layer, bias=v[2], lora_a=v[3], lora_b=v[4], lora_scale=scale))(
            *(_f32(v) for v in (x, w, b, a, bb)))
        err = rel_err(_f32(y), y_ref)
        print(f"m={m} k={k} n={n} r={r} layer={layer}: rel err {err:.2e}")
        assert err < tol, err


@pytest.mark.gpu
@pytest.mark.parametrize("m", [16, 128])
@pytest.mark.parametrize("k,n", QWEN + LLAMA)
def test_gpu_model_shapes_bf16(rng, m, k, n):
    _gpu_check(rng, m, k, n, 16, "bfloat16", bias=(k, n) in QWEN, tol=TOL["bfloat16"])


@pytest.mark.gpu
@pytest.mark.parametrize("m,r", [(1, 0), (1, 64), (5, 8), (33, 64), (200, 16)])
def test_gpu_ragged_rows_bf16(rng, m, r):
    _gpu_check(rng, m, 1537, 999, r, "bfloat16", bias=True, tol=TOL["bfloat16"])


@pytest.mark.gpu
def test_gpu_fp32(rng):
    # fp32 dots run as tf32 on the tensor cores (Triton's default), so the tf32 bound of DESIGN.md applies.
    _gpu_check(rng, 16, 1536, 1100, 16, "float32", bias=True, tol=TOL["float32_tf32"])


@pytest.mark.gpu
@pytest.mark.parametrize("m", [16, 128])
def test_gpu_runtime_layer_bf16(rng, m):
    _gpu_check(rng, m, 1536, 8960, 16, "bfloat16", bias=True, tol=TOL["bfloat16"], layers=28, runtime_layer=True)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 4])
def test_gpu_forced_splits_bf16(rng, splits):
    _gpu_check(rng, 16, 4096, 1024, 16, "bfloat16", bias=True, tol=TOL["bfloat16"], splits=splits)
