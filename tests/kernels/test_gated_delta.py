"""The gated delta rule (Qwen3.5's linear attention): the chunked XLA form (pallas_kernels.gated_delta_chunked) and
the Pallas state-pass path (pallas_kernels.gated_delta_state, interpret mode on the CPU) against the token-by-token
reference, forward, final state and every gradient (q, k, v, g, beta, initial_state).

CPU: small heads (Dk, Dv 16..32, one case not a power of two), ragged T (37, 100), GQA (Hv = 2 Hk), with and without
an initial state, packed segment starts (g = -1e4), chunks of 16 and 64, float32 and bf16, fresh random inputs.
GPU (`pytest -m gpu`): Qwen3.5's head shape compiled through the Triton lowering.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.reference as ref
from pallas_kernels.gated_delta_chunked import chunked_gated_delta_rule
from pallas_kernels.gated_delta_state import SMEM_LIMIT, default_tiles, smem_bytes
from pallas_kernels.gated_delta_state import gated_delta_rule as kernel
from tests.helpers import TOL, lower_for_cuda, rel_err
from unsloth_jax import ops

F32, BF16 = jnp.float32, jnp.bfloat16
GRADS = ("q", "k", "v", "g", "beta", "initial_state")


def _inputs(rng, *, b=2, t=37, hk=2, hv=4, dk=16, dv=32, dtype=F32, init=True, resets=True):
    """Unit-norm q, k; g = -softplus(normal) (a few -1e4 segment starts), beta in (0, 1); the cotangents."""
    def unit(shape):
        x = rng.standard_normal(shape)
        return jnp.asarray(x / np.linalg.norm(x, axis=-1, keepdims=True), dtype)

    q, k = unit((b, t, hk, dk)), unit((b, t, hk, dk))
    v = jnp.asarray(rng.standard_normal((b, t, hv, dv)), dtype)
    g = -np.logaddexp(0.0, rng.standard_normal((b, t, hv)))
    if resets:
        for row in range(b):  # starts of packed segments, one of them on a chunk's first token
            g[row, rng.choice(np.arange(1, t), size=2, replace=False), :] = -1e4
            g[row, min(16, t - 1), 0] = -1e4
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((b, t, hv))))
    s0 = jnp.asarray(rng.standard_normal((b, hv, dk, dv)), F32) if init else None
    do = jnp.asarray(rng.standard_normal((b, t, hv, dv)), dtype)
    dfinal = jnp.asarray(rng.standard_normal((b, hv, dk, dv)), F32)
    return (q, k, v, jnp.asarray(g, F32), jnp.asarray(beta, F32), s0), (do, dfinal)


def _fwd_bwd(fn, primals, cts):
    n = 6 if primals[5] is not None else 5
    out, vjp = jax.vjp(lambda *a: fn(*a, *primals[n:]), *primals[:n])
    return out, vjp(cts)


def _check(fns: dict, primals, cts, tol):
    """Each fn's outputs and gradients vs the reference's on the same inputs (the reference's math is float32; it
    runs once for all of fns, {what: fn})."""
    scale = primals[0].shape[-1] ** -0.5
    (ro, rs), rgrads = jax.jit(_fwd_bwd, static_argnums=0)(lambda *a: ref.gated_delta_rule(*a, scale=scale),
                                                           primals, cts)
    for what, fn in fns.items():
        (o, s), grads = jax.jit(_fwd_bwd, static_argnums=0)(lambda *a: fn(*a, scale=scale), primals, cts)
        assert o.dtype == primals[2].dtype and o.shape == ro.shape and s.dtype == F32, (what, o.dtype, s.dtype)
        for name, a, r in (("o", o, ro), ("final state", s, rs)):
            err = rel_err(a, r)
            assert err < tol, f"{what}: {name} rel err {err:.3e} >= {tol}"
        for name, gr, r, p in zip(GRADS, grads, rgrads, primals):
            assert gr.dtype == p.dtype and gr.shape == p.shape, (what, name, gr.dtype, gr.shape)
            err = rel_err(gr, r)
            assert err < tol, f"{what}: d{name} rel err {err:.3e} >= {tol}"


# Each case pairs features (interpret-mode compiles dominate the CPU time, so no full cross product).
CASES = {
    "f32-T37-gqa-init-resets-c16": (dict(t=37, dtype=F32), 16),
    "bf16-T100-noinit-c64": (dict(t=100, hk=2, hv=2, dtype=BF16, init=False), 64),
    "f32-T100-gqa-init-noresets-c64": (dict(t=100, dk=32, dv=16, dtype=F32, resets=False), 64),
}


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_matches_reference(rng, case):
    kwargs, chunk = CASES[case]
    primals, cts = _inputs(rng, **kwargs)
    tol = TOL[jnp.dtype(kwargs["dtype"]).name]
    _check({case: lambda *a, **kw: chunked_gated_delta_rule(*a, chunk=chunk, **kw)}, primals, cts, tol)


KERNEL_CASES = {
    # two Dv blocks per head (block_v 16 of Dv 32), GQA, an initial state, segment starts, ragged T
    "f32-T37-gqa-init-resets-c16-bv16": (dict(t=37, dtype=F32), 16, 16),
    # Dk, Dv not powers of two (padded to 32), no initial state, Hv = Hk, the default tiles (chunk 64: two chunks)
    "bf16-T100-noinit-d20-default": (dict(t=100, hk=2, hv=2, dk=20, dv=24, dtype=BF16, init=False), None, None),
}


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernel_matches_reference(rng, case):
    kwargs, chunk, block_v = KERNEL_CASES[case]
    primals, cts = _inputs(rng, **kwargs)
    tol = TOL[jnp.dtype(kwargs["dtype"]).name]
    _check({case: lambda *a, **kw: kernel(*a, chunk=chunk, block_v=block_v, **kw)}, primals, cts, tol)


def test_sequences_shorter_than_a_chunk(rng):
    """T = 5 (the chunk shrinks to the power of two above T: 8, the kernel's 16) and T = 1 (one decode step)."""
    primals, cts = _inputs(rng, b=1, t=5, hk=1, hv=2, dk=16, dv=16, resets=False)
    _check({"chunked T=5": chunked_gated_delta_rule, "kernel T=5": kernel}, primals, cts, TOL["float32"])
    primals, _ = _inputs(rng, b=2, t=1, hk=1, hv=2, dk=16, dv=16, resets=False)
    both = jax.jit(lambda *a: (chunked_gated_delta_rule(*a, scale=0.3), ref.gated_delta_rule(*a, scale=0.3)))
    for got, want in zip(*both(*primals)):
        assert rel_err(got, want) < 1e-5


def test_every_token_a_segment_start_stays_finite(rng):
    """g = -1e4 on every token (each token its own segment): o = scale q.k beta v, gradients finite, and dg = 0. The
    Pallas path (its chunk-local terms, where segment starts are handled, are the chunked form's too)."""
    primals, cts = _inputs(rng, b=1, t=20, hk=1, hv=1, dk=16, dv=16, init=True, resets=False)
    primals = primals[:3] + (jnp.full_like(primals[3], -1e4),) + primals[4:]
    (o, s), grads = jax.jit(_fwd_bwd, static_argnums=0)(lambda *a: kernel(*a, scale=0.5, chunk=16), primals, cts)
    q, k, v, _, beta, _ = primals
    want = 0.5 * jnp.sum(q * k, -1)[..., None] * beta[..., None] * v
    assert rel_err(o, want) < 1e-5
    assert all(bool(jnp.isfinite(x).all()) for x in grads)
    assert float(jnp.abs(grads[3]).max()) == 0.0


def test_ops_dispatch(rng, monkeypatch):
    """ops.gated_delta_rule runs the chunked form by default and the kernel when forced."""
    primals, _ = _inputs(rng, b=1, t=20, hk=1, hv=2, dk=16, dv=16)
    want = ref.gated_delta_rule(*primals, scale=0.25)
    with ops.recording_choices() as seen:  # a fresh jit each time: traced under the policy then in force
        got = jax.jit(lambda *a: ops.gated_delta_rule(*a, scale=0.25))(*primals)
    assert seen == {"gated_delta": ["xla"]}
    assert rel_err(got[0], want[0]) < 1e-5
    monkeypatch.setenv(ops.ENV_VAR, "gated_delta=pallas")
    with ops.recording_choices() as seen:
        got = jax.jit(lambda *a: ops.gated_delta_rule(*a, scale=0.25))(*primals)
    assert seen == {"gated_delta": ["pallas"]}
    assert rel_err(got[0], want[0]) < 1e-5 and rel_err(got[1], want[1]) < 1e-5


@pytest.mark.parametrize("t, dk, dv", [(2048, 128, 128), (2048, 256, 256), (2048, 64, 128), (40, 16, 32)])
@pytest.mark.parametrize("ieee", [False, True])
def test_default_tiles_fit_shared_memory(t, dk, dv, ieee):
    """The default (chunk, block_v): powers of two >= 16, chunk at most the power of two >= T (and 32 for float32
    inputs' IEEE dots), block_v dividing Dv, and the shared-memory bound within an H100's block; Qwen3.5's heads
    get chunk 64 for 16-bit inputs."""
    chunk, block_v = default_tiles(t, dk, dv, ieee)
    for x in (chunk, block_v):
        assert x >= 16 and x & (x - 1) == 0, (chunk, block_v)
    assert chunk <= max(16, 1 << (t - 1).bit_length()) and chunk <= (32 if ieee else 64) and dv % block_v == 0
    assert smem_bytes(chunk, dk, block_v) <= SMEM_LIMIT
    if (dk, dv) == (128, 128):
        assert chunk == (32 if ieee else 64) and block_v >= 32


def test_bad_shapes_name_the_argument(rng):
    (q, k, v, g, beta, s0), _ = _inputs(rng, b=1, t=8, hk=2, hv=4, dk=16, dv=16)
    with pytest.raises(ValueError, match="beta must be"):
        kernel(q, k, v, g, beta[..., :2], s0, scale=1.0)
    with pytest.raises(ValueError, match="v must be"):
        chunked_gated_delta_rule(q, k, v[:, :, :3], g, beta, s0, scale=1.0)
    with pytest.raises(ValueError, match="initial_state must be"):
        chunked_gated_delta_rule(q, k, v, g, beta, s0[:, :2], scale=1.0)
    with pytest.raises(ValueError, match="chunk must be"):
        kernel(q, k, v, g, beta, s0, scale=1.0, chunk=24)
    with pytest.raises(ValueError, match="block_v must be"):
        kernel(q, k, v, g, beta, s0, scale=1.0, block_v=8)
    with pytest.raises(ValueError, match="chunk must be"):
        chunked_gated_delta_rule(q, k, v, g, beta, s0, scale=1.0, chunk=48)


@pytest.mark.parametrize("dtype, block_v", [(BF16, None), (F32, 16)])
def test_kernels_lower_for_triton(rng, dtype, block_v):
    """Forward and backward go through the Triton lowering (checked from the CPU): two kernels; bf16 on the default
    tiles (TF32 dots), float32 with two Dv blocks (IEEE dots, partial gradients)."""
    primals, cts = _inputs(rng, b=1, t=40, hk=1, hv=2, dk=32, dv=32, dtype=dtype)

    def fwd_bwd(*primals_and_cts):
        return _fwd_bwd(lambda *a: kernel(*a, scale=0.2, block_v=block_v, interpret=False), primals_and_cts[:6],
                        primals_and_cts[6:])

    assert lower_for_cuda(fwd_bwd, *primals, *cts).count("xla.gpu.triton") == 2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_qwen35_shape(rng, dtype):
    """Qwen3.5's linear-attention heads (Hk 16, Hv 32, Dk = Dv = 128) at T = 1000, compiled for the GPU: kernel and
    chunked form vs the reference (the products of bf16 inputs' float32 tiles run as TF32, of float32 inputs in full
    float32)."""
    primals, cts = _inputs(rng, b=1, t=1000, hk=16, hv=32, dk=128, dv=128, dtype=jnp.dtype(dtype))
    tol = TOL[dtype]
    _check({f"kernel {dtype}": kernel, f"chunked {dtype}": chunked_gated_delta_rule}, primals, cts, tol)


def test_bench_tiny_prints_a_json_line(capsys):
    """bench/gated_delta_bench.py --tiny --parts for the Pallas path in this process (the CPU check of the script):
    its line, then one line for each of its two parts."""
    import json

    from bench.gated_delta_bench import main

    main(["--tiny", "--impl", "pallas", "--runs", "1", "--parts"])
    line, *parts = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert line["name"] == "gated_delta" and line["impl"] == "pallas" and line["ms"] > 0, line
    assert {"shape", "dtype", "config", "peak_bytes", "jax_version", "device"} <= set(line), line
    assert [(p["name"], p["part"]) for p in parts] == [("gated_delta_part", "chunk_terms"),
                                                       ("gated_delta_part", "state_pass")], parts
    assert all(p["ms"] > 0 for p in parts), parts
