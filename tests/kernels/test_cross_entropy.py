"""Fused linear cross-entropy kernel (and its chunked XLA twin) vs the naive full-logits reference.

Checks the loss, d_hidden and d_lm_head; ragged T and V (V=1000 and a 151936-like vocabulary), bf16 and fp32,
softcap, ignore_index (partial and all-ignored), the multi-chunk backward, and that d_lm_head is skipped when
lm_head is not differentiated. `pytest -m gpu` runs the model shapes on the GPU.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.reference as reference
from pallas_kernels.cross_entropy import CEConfig, cross_entropy
from tests.helpers import TOL, fast_jit, lower_for_cuda, rel_err

IGNORE = -100




def _small_cfg(t, v, **kw):
    base = dict(bt=16, bv=128, bd=32, target_programs=8, bwd_bt=16, bwd_bv=128, bwd_bd=32, bwd_group=2)
    base.update(kw)
    return CEConfig(**base)


def _inputs(rng, t, d, v, dtype, logit_scale=1.0, ignore_frac=0.2):
    h = rng.standard_normal((t, d))
    w = rng.standard_normal((v, d)) * (logit_scale / np.sqrt(d))
    y = rng.integers(0, v, size=t).astype(np.int32)
    y[rng.random(t) < ignore_frac] = IGNORE
    return jnp.asarray(h, dtype), jnp.asarray(w, dtype), jnp.asarray(y)


def _ref_value_and_grads(h, w, y, softcap, fn=reference.cross_entropy_naive, **kw):
    f32 = lambda v: v.astype(jnp.float32)  # noqa: E731
    with jax.default_matmul_precision("float32"):
        return fast_jit(jax.value_and_grad(lambda h_, w_, y_: fn(h_, w_, y_, softcap=softcap, **kw),
                                           argnums=(0, 1)))(f32(h), f32(w), y)


def _check(h, w, y, softcap, dtype, config=None, interpret=None):
    f32 = lambda v: v.astype(jnp.float32)  # noqa: E731
    run = fast_jit(jax.value_and_grad(
        lambda h_, w_, y_: cross_entropy(h_, w_, y_, softcap=softcap, interpret=interpret, config=config),
        argnums=(0, 1)))
    loss, (gh, gw) = run(h, w, y)
    loss_ref, (gh_ref, gw_ref) = _ref_value_and_grads(h, w, y, softcap)
    assert loss.dtype == jnp.float32 and loss.shape == ()
    assert gh.dtype == h.dtype and gw.dtype == w.dtype
    errs = {"loss": rel_err(loss, loss_ref), "dh": rel_err(f32(gh), gh_ref), "dw": rel_err(f32(gw), gw_ref)}
    print(errs, float(loss), float(loss_ref))
    tol = TOL[jnp.dtype(dtype).name]
    for name, e in errs.items():
        assert e < tol, f"{name}: rel err {e} >= {tol}"


@pytest.mark.parametrize("dtype,softcap", [("float32", None), ("float32", 30.0), ("bfloat16", None),
                                           ("bfloat16", 30.0)])
def test_matches_naive_ragged(rng, dtype, softcap):
    t = int(rng.integers(40, 90))          # ragged vs bt=16
    d = int(rng.integers(40, 70))          # ragged vs bd=32
    v = 1000                               # ragged vs bv=128
    # logit_scale large enough that the softcap (30) actually bends the logits
    h, w, y = _inputs(rng, t, d, v, jnp.dtype(dtype), logit_scale=40.0 if softcap else 2.0)
    _check(h, w, y, softcap, dtype, config=_small_cfg(t, v))


def test_large_vocab_151936_like(rng):
    """A Qwen2-sized vocabulary (ragged vs the block) with a tiny D, fp32."""
    t, d, v = 24, 16, 151935
    h, w, y = _inputs(rng, t, d, v, jnp.float32, logit_scale=3.0)
    cfg = _small_cfg(t, v, bv=4096, bd=16, bwd_bv=8192, bwd_bd=16)
    _check(h, w, y, None, "float32", config=cfg)


def test_multi_chunk_backward(rng):
    """Backward split into several token chunks (tiny chunk_bytes), T not a multiple of the chunk."""
    t, d, v = 83, 32, 300
    h, w, y = _inputs(rng, t, d, v, jnp.bfloat16)
    cfg = _small_cfg(t, v, chunk_bytes=32 * v * 2)   # 32-token chunks -> 3 chunks, last one padded
    _check(h, w, y, 15.0, "bfloat16", config=cfg)


def test_all_ignored_gives_zero_loss_and_grads(rng):
    t, d, v = 37, 32, 200
    h, w, _ = _inputs(rng, t, d, v, jnp.float32)
    y = jnp.full((t,), IGNORE, jnp.int32)
    run = fast_jit(jax.value_and_grad(lambda h_, w_, y_: cross_entropy(h_, w_, y_, config=_small_cfg(t, v)),
                                      argnums=(0, 1)))
    loss, (gh, gw) = run(h, w, y)
    assert float(loss) == 0.0 and float(jnp.abs(gh).max()) == 0.0 and float(jnp.abs(gw).max()) == 0.0
    for fn in (reference.cross_entropy, reference.cross_entropy_naive):
        loss_r, (gh_r, gw_r) = _ref_value_and_grads(h, w, y, None, fn=fn)
        assert float(loss_r) == 0.0 and float(jnp.abs(gh_r).max()) == 0.0 and float(jnp.abs(gw_r).max()) == 0.0


def test_lm_head_grad_skipped_when_frozen(rng):
    """Differentiating only hidden: no [V, D] array is produced; lm_head_grad=False returns zeros."""
    t, d, v = 40, 32, 250
    h, w, y = _inputs(rng, t, d, v, jnp.float32)
    cfg = _small_cfg(t, v)
    jaxpr = jax.make_jaxpr(jax.grad(lambda h_: cross_entropy(h_, w, y, config=cfg)))(h)

    def shapes(jx):
        """Output shapes of every op, recursing into sub-programs (not into the Pallas kernel bodies)."""
        for eqn in jx.eqns:
            for var in eqn.outvars:
                yield tuple(getattr(var.aval, "shape", ()))
            if eqn.primitive.name == "pallas_call":
                continue
            for param in eqn.params.values():
                for p in (param if isinstance(param, (tuple, list)) else (param,)):
                    sub = getattr(p, "jaxpr", p)
                    if hasattr(sub, "eqns"):
                        yield from shapes(sub)
    assert (v, d) not in set(shapes(jaxpr.jaxpr))

    run = fast_jit(jax.grad(lambda h_, w_, y_: cross_entropy(h_, w_, y_, config=cfg, lm_head_grad=False),
                            argnums=(0, 1)))
    gh, gw = run(h, w, y)
    assert float(jnp.abs(gw).max()) == 0.0
    _, (gh_ref, _) = _ref_value_and_grads(h, w, y, None)
    assert rel_err(gh, gh_ref) < TOL["float32"]


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_reference_twin_chunked_matches_naive(rng, softcap):
    """The XLA twin (chunked over T with jax.checkpoint) equals the full-logits version, T ragged vs chunk."""
    t, d, v = 70, 24, 333
    h, w, y = _inputs(rng, t, d, v, jnp.float32, logit_scale=40.0 if softcap else 2.0)
    got, (gh, gw) = _ref_value_and_grads(h, w, y, softcap, fn=reference.cross_entropy, chunk_size=32)
    want, (gh_r, gw_r) = _ref_value_and_grads(h, w, y, softcap)
    for a, b in ((got, want), (gh, gh_r), (gw, gw_r)):
        assert rel_err(a, b) < TOL["float32"]


def test_leading_dims_and_api_shape(rng):
    h, w, y = _inputs(rng, 2 * 12, 32, 100, jnp.bfloat16)
    out = jax.eval_shape(lambda h3, y2: cross_entropy(h3, w, y2), h.reshape(2, 12, 32), y.reshape(2, 12))
    assert out.shape == () and out.dtype == jnp.float32


def test_lowers_to_triton_at_model_shapes():
    """Cross-lower (no GPU needed) fwd+bwd to Triton IR at the Qwen2 / Gemma-2 shapes."""
    S = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    for t, d, v, cap in ((8192, 1536, 151936, None), (4096, 2304, 256000, 30.0)):
        args = S((t, d), bf), S((v, d), bf), S((t,), jnp.int32)

        def f(h, w, y):
            return jax.value_and_grad(lambda h_, w_: cross_entropy(h_, w_, y, softcap=cap, interpret=False),
                                      argnums=(0, 1))(h, w)
        assert "triton" in lower_for_cuda(f, *args)


# ---------------------------------------------------------------------------------------------- GPU
MODEL_SHAPES = [(8192, 1536, 151936, None), (4096, 4096, 128256, None), (4096, 2304, 256000, 30.0)]


@pytest.mark.gpu
@pytest.mark.parametrize("t,d,v,softcap", MODEL_SHAPES)
def test_gpu_model_shapes_bf16(rng, t, d, v, softcap):
    h, w, y = _inputs(rng, t, d, v, jnp.bfloat16, logit_scale=40.0 if softcap else 2.0)
    _check(h, w, y, softcap, "bfloat16", interpret=False)


@pytest.mark.gpu
def test_gpu_ragged_bf16(rng):
    h, w, y = _inputs(rng, 1001, 1536, 151935, jnp.bfloat16)
    _check(h, w, y, None, "bfloat16", interpret=False)


@pytest.mark.gpu
def test_gpu_fp32(rng):
    h, w, y = _inputs(rng, 1000, 1536, 32001, jnp.float32)
    _check(h, w, y, 30.0, "float32", interpret=False)


@pytest.mark.gpu
def test_gpu_frozen_head_only_hidden_grad(rng):
    h, w, y = _inputs(rng, 8192, 1536, 151936, jnp.bfloat16)
    run = jax.jit(jax.value_and_grad(lambda h_: cross_entropy(h_, w, y, interpret=False)))
    loss, gh = run(h)
    loss_ref, (gh_ref, _) = _ref_value_and_grads(h, w, y, None)
    assert rel_err(loss, loss_ref) < TOL["bfloat16"]
    assert rel_err(gh.astype(jnp.float32), gh_ref) < TOL["bfloat16"]
