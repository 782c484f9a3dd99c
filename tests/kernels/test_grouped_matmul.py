"""grouped_matmul kernel vs jax.lax.ragged_dot (CPU, interpret mode) and vs a per-group jnp loop (GPU).

CPU runs use 16-wide blocks so that N, K and M are ragged and span several tiles, and group boundaries fall
inside tiles. `pytest -m gpu` runs the Qwen3-30B-A3B expert shapes compiled for Triton.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import GmmConfig, grouped_matmul, make_schedule
from tests.helpers import TOL, fast_jit, lower_for_cuda, rel_err

SMALL = dict(block_m=16, block_n=16, block_k=16)
GROUP_KINDS = ("random", "one_group", "small_groups", "partial_sum")


def _group_sizes(rng, kind: str, n: int, e: int) -> np.ndarray:
    """int32 [e] group sizes of one kind: 'random' (multinomial, about a third of the groups empty),
    'one_group' (every row in one random group), 'small_groups' (each < 16 rows, sum < n), 'partial_sum'
    (multinomial over fewer than n rows: the tail rows belong to no group)."""
    if kind == "one_group":
        sizes = np.zeros(e, np.int64)
        sizes[rng.integers(e)] = n
        return sizes.astype(np.int32)
    if kind == "small_groups":
        sizes = rng.integers(0, 16, size=e)
        while sizes.sum() >= n:
            sizes //= 2
        return sizes.astype(np.int32)
    p = rng.dirichlet(np.ones(e))
    p[rng.choice(e, size=e // 3, replace=False)] = 0.0
    p /= p.sum()
    rows = n if kind == "random" else int(rng.integers(n // 3, n - 1))
    return rng.multinomial(rows, p).astype(np.int32)


def _inputs(rng, n, k, m, e, dtype, transpose_rhs=False):
    x = jnp.asarray(rng.standard_normal((n, k)), dtype)
    w = rng.standard_normal((e, m, k) if transpose_rhs else (e, k, m)) / np.sqrt(k)
    dy = jnp.asarray(rng.standard_normal((n, m)), dtype)
    return x, jnp.asarray(w, dtype), dy


def _ragged_ref(x, w, gs, transpose_rhs):
    """jax.lax.ragged_dot in float32, full precision (w [E, M, K] is transposed for it)."""
    w = jnp.swapaxes(w, 1, 2) if transpose_rhs else w
    return jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), gs, precision=jax.lax.Precision.HIGHEST)


def _f32(v):
    return v.astype(jnp.float32)


@pytest.mark.parametrize("kind", GROUP_KINDS)
@pytest.mark.parametrize("dtype,transpose_rhs", [("float32", False), ("bfloat16", False), ("float32", True),
                                                 ("bfloat16", True)])
def test_forward_matches_ragged_dot(rng, kind, dtype, transpose_rhs):
    n, k, m = int(rng.integers(40, 90)), int(rng.integers(20, 50)), int(rng.integers(17, 40))
    e = int(rng.integers(3, 7))
    gs = jnp.asarray(_group_sizes(rng, kind, n, e))
    x, w, _ = _inputs(rng, n, k, m, e, jnp.dtype(dtype), transpose_rhs)
    y = fast_jit(lambda x_, w_, g_: grouped_matmul(x_, w_, g_, transpose_rhs=transpose_rhs, **SMALL))(x, w, gs)
    ref = _ragged_ref(x, w, gs, transpose_rhs)
    assert y.shape == (n, m) and y.dtype == x.dtype
    total = int(gs.sum())
    assert not np.any(np.asarray(_f32(y))[total:]), "rows past sum(group_sizes) must be zero"
    err = rel_err(_f32(y), ref)
    print(kind, dtype, transpose_rhs, "group_sizes", gs.tolist(), "rel err", err)
    assert err < TOL[dtype]


@pytest.mark.parametrize("dtype,transpose_rhs", [("float32", False), ("float32", True), ("bfloat16", False)])
def test_gradients_match_ragged_dot(rng, dtype, transpose_rhs):
    """dX and dW of grouped_matmul vs jax.vjp of ragged_dot (float32, full precision)."""
    n, k, m, e = int(rng.integers(40, 90)), int(rng.integers(20, 50)), int(rng.integers(17, 40)), 5
    gs = jnp.asarray(_group_sizes(rng, "partial_sum", n, e))
    x, w, dy = _inputs(rng, n, k, m, e, jnp.dtype(dtype), transpose_rhs)

    @fast_jit
    def ours(x_, w_, g_, dy_):
        return jax.vjp(lambda a, b: grouped_matmul(a, b, g_, transpose_rhs=transpose_rhs, **SMALL), x_, w_)[1](dy_)

    dx, dw = ours(x, w, gs, dy)
    dx_ref, dw_ref = jax.vjp(lambda a, b: _ragged_ref(a, b, gs, transpose_rhs), _f32(x), _f32(w))[1](_f32(dy))
    assert dx.dtype == x.dtype and dw.dtype == w.dtype and dw.shape == w.shape
    errs = {"dx": rel_err(_f32(dx), dx_ref), "dw": rel_err(_f32(dw), dw_ref)}
    print("group_sizes", gs.tolist(), errs)
    for name, err in errs.items():
        assert err < TOL[dtype], f"{name}: rel err {err}"


def test_frozen_w_runs_no_weight_gradient_kernel(rng):
    """With w frozen (stop_gradient, or not differentiated) the backward has only the dX kernel; asked for,
    dW appears. Float32 w with bfloat16 x: dW comes back in w's dtype."""
    n, k, m, e = 48, 32, 24, 4
    gs = jnp.asarray(_group_sizes(rng, "random", n, e))
    x, w, _ = _inputs(rng, n, k, m, e, jnp.bfloat16)
    w = w.astype(jnp.float32)

    def loss(x_, w_):
        return jnp.sum(_f32(grouped_matmul(x_, w_, gs, **SMALL)) ** 2)

    def kernel_names(fn, *args):
        jaxpr = jax.make_jaxpr(fn)(*args)
        return sorted(str(eqn.params.get("name", "")) for eqn in jaxpr.jaxpr.eqns
                      if eqn.primitive.name == "pallas_call")

    frozen = kernel_names(jax.grad(lambda x_, w_: loss(x_, jax.lax.stop_gradient(w_))), x, w)
    x_only = kernel_names(jax.grad(loss), x, w)
    both = kernel_names(jax.grad(loss, argnums=(0, 1)), x, w)
    assert frozen == x_only == ["grouped_matmul", "grouped_matmul_t"], frozen
    assert both == ["grouped_matmul", "grouped_matmul_dw", "grouped_matmul_t"], both
    dw = fast_jit(jax.grad(loss, argnums=1))(x, w)
    assert dw.dtype == jnp.float32 and dw.shape == w.shape


def test_default_config_and_out_dtype(rng):
    """Default blocks (clipped to the tiny problem) and out_dtype=float32 from bfloat16 inputs."""
    n, k, m, e = 75, 40, 33, 6
    gs = jnp.asarray(_group_sizes(rng, "random", n, e))
    x, w, _ = _inputs(rng, n, k, m, e, jnp.bfloat16)
    y = fast_jit(lambda x_, w_, g_: grouped_matmul(x_, w_, g_, out_dtype=jnp.float32))(x, w, gs)
    assert y.dtype == jnp.float32
    assert rel_err(y, _ragged_ref(x, w, gs, False)) < TOL["bfloat16"]


def test_schedule_covers_every_row_once(rng):
    """Every row of [0, N) is written by exactly one work item, with the group that owns it (E for the tail),
    within its tile; at most cdiv(N, bm) + E slots."""
    n, e, bm = int(rng.integers(50, 300)), int(rng.integers(2, 20)), 16
    gs = _group_sizes(rng, "partial_sum", n, e)
    tile, group, lo, hi = np.asarray(make_schedule(jnp.asarray(gs), n, bm))
    assert tile.shape == (-(-n // bm) + e,)
    owner = np.full(n, -1)
    for t, g, a, b in zip(tile, group, lo, hi):
        if a < b:
            assert t * bm <= a and b <= (t + 1) * bm
            assert np.all(owner[a:b] == -1), "a row written twice"
            owner[a:b] = g
    expected = np.concatenate([np.repeat(np.arange(e), gs), np.full(n - gs.sum(), e)])
    np.testing.assert_array_equal(owner, expected)


def test_bad_arguments_raise():
    x = jnp.zeros((8, 4))
    with pytest.raises(ValueError, match="disagree on K"):
        grouped_matmul(x, jnp.zeros((2, 5, 3)), jnp.array([4, 4]))
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul(x, jnp.zeros((2, 4, 3)), jnp.array([4, 2, 2]))
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul(x, jnp.zeros((2, 4, 3)), jnp.array([4.0, 4.0]))
    with pytest.raises(ValueError, match="x must be"):
        grouped_matmul(jnp.zeros((2, 8, 4)), jnp.zeros((2, 4, 3)), jnp.array([4, 4]))
    with pytest.raises(ValueError, match="powers of two"):
        GmmConfig(block_m=48)


def test_lowers_to_triton_at_model_shapes():
    """Cross-lower (no GPU needed) fwd + dX + dW to Triton IR at the Qwen3-30B-A3B expert shapes."""
    S = jax.ShapeDtypeStruct
    for n, k, m in ((65536, 2048, 1536), (65536, 768, 2048)):
        def f(x, w, gs):
            return jax.grad(lambda x_, w_: jnp.sum(_f32(grouped_matmul(x_, w_, gs, interpret=False))),
                            argnums=(0, 1))(x, w)
        assert "triton" in lower_for_cuda(f, S((n, k), jnp.bfloat16), S((128, k, m), jnp.bfloat16),
                                          S((128,), jnp.int32))


# ---------------------------------------------------------------------------------------------- GPU
# Qwen3-30B-A3B experts: 8192 tokens x top-8 = 65536 rows, E = 128; gate_up [2048 -> 1536], down [768 -> 2048]
QWEN3_MOE = [(n, k, m) for n in (8192, 65536) for k, m in ((2048, 1536), (768, 2048))]


def _host_f32(v) -> np.ndarray:
    return np.asarray(jnp.asarray(v).astype(jnp.float32))


def _per_group_ref(a, b, gs: np.ndarray, transpose_rhs=False):
    """out[rows of e] = a[rows of e] @ b[e], a loop over groups in numpy float32 on the host (one pass; an eager
    jnp loop compiles a dot per distinct group size)."""
    offs = np.concatenate([[0], np.cumsum(gs)])
    a32, b32 = _host_f32(a), _host_f32(b)
    m = b.shape[1] if transpose_rhs else b.shape[2]
    out = np.zeros((a.shape[0], m), np.float32)
    for e in range(len(gs)):
        if gs[e]:
            out[offs[e]:offs[e + 1]] = a32[offs[e]:offs[e + 1]] @ (b32[e].T if transpose_rhs else b32[e])
    return jnp.asarray(out)


def _per_group_dw(x, dy, gs: np.ndarray):
    offs = np.concatenate([[0], np.cumsum(gs)])
    x32, dy32 = _host_f32(x), _host_f32(dy)
    return jnp.asarray(np.stack([x32[offs[e]:offs[e + 1]].T @ dy32[offs[e]:offs[e + 1]] for e in range(len(gs))]))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,m", QWEN3_MOE)
def test_gpu_forward_model_shapes_bf16(rng, n, k, m):
    e = 128
    gs = rng.multinomial(n, np.ones(e) / e).astype(np.int32)
    x, w, _ = _inputs(rng, n, k, m, e, jnp.bfloat16)
    y = jax.jit(lambda x_, w_, g_: grouped_matmul(x_, w_, g_, interpret=False))(x, w, jnp.asarray(gs))
    err = rel_err(_f32(y), _per_group_ref(x, w, gs))
    print(n, k, m, "rel err", err)
    assert err < TOL["bfloat16"]


@pytest.mark.gpu
@pytest.mark.parametrize("k,m", [(2048, 1536), (768, 2048)])
def test_gpu_gradients_bf16(rng, k, m):
    """dX and dW at N=8192 with skewed group sizes (some experts empty) and 100 tail rows."""
    n, e = 8192, 128
    p = rng.dirichlet(np.full(e, 0.3))
    gs = rng.multinomial(n - 100, p).astype(np.int32)
    x, w, dy = _inputs(rng, n, k, m, e, jnp.bfloat16)

    @jax.jit
    def grads(x_, w_, g_, dy_):
        return jax.vjp(lambda a, b: grouped_matmul(a, b, g_, interpret=False), x_, w_)[1](dy_)

    dx, dw = grads(x, w, jnp.asarray(gs), dy)
    errs = {"dx": rel_err(_f32(dx), _per_group_ref(dy, w, gs, transpose_rhs=True)),
            "dw": rel_err(_f32(dw), _per_group_dw(x, dy, gs))}
    print(k, m, errs)
    for name, err in errs.items():
        assert err < TOL["bfloat16"], f"{name}: rel err {err}"


@pytest.mark.gpu
def test_gpu_ragged_fp32(rng):
    """Ragged N/K/M, float32 (TF32 tensor cores: the tf32 bound), transpose_rhs."""
    n, k, m, e = 3001, 1000, 777, 16
    gs = _group_sizes(rng, "partial_sum", n, e)
    x, w, _ = _inputs(rng, n, k, m, e, jnp.float32, transpose_rhs=True)
    y = jax.jit(lambda x_, w_, g_: grouped_matmul(x_, w_, g_, transpose_rhs=True, interpret=False))(
        x, w, jnp.asarray(gs))
    assert rel_err(y, _per_group_ref(x, w, gs, transpose_rhs=True)) < TOL["float32_tf32"]
