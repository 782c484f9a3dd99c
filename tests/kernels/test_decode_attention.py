"""The paged decode-attention kernel against its plain-jnp reference (and a float64 numpy attention): random
page assignments, ragged lengths, GQA groups, softcap, sliding windows, sinks, several splits."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import reference as ref
from pallas_kernels.decode_attention import paged_decode_attention


def _case(rng, b, hq, hkv, d, bs, maxb, dtype, lengths=None):
    pages = b * maxb + 3
    q = rng.normal(size=(b, hq, d)).astype(np.float32)
    k = rng.normal(size=(pages, bs, hkv, d)).astype(np.float32)
    v = rng.normal(size=(pages, bs, hkv, d)).astype(np.float32)
    tables = rng.permutation(pages)[:b * maxb].reshape(b, maxb).astype(np.int32)
    tables[-1, 0] = tables[0, 0]  # a page shared by two rows
    if lengths is None:
        lengths = rng.integers(1, maxb * bs + 1, size=b)
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), jnp.asarray(tables), jnp.asarray(np.asarray(lengths, np.int32))


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


CASES = [  # (b, hq, hkv, d, bs, maxb, softcap, window, sinks, splits)
    (3, 4, 4, 64, 16, 3, None, None, False, 1),
    (4, 12, 2, 128, 16, 4, None, None, False, None),  # Qwen2-1.5B's group of 6
    (2, 8, 2, 64, 16, 5, 50.0, 20, False, 2),  # Gemma 2: softcap and a window
    (3, 8, 1, 32, 16, 3, None, None, True, 4),  # gpt-oss: sinks
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matches_reference(case, dtype, rng):
    b, hq, hkv, d, bs, maxb, softcap, window, with_sinks, splits = case
    lengths = rng.integers(1, maxb * bs + 1, size=b)
    lengths[0] = maxb * bs  # one row fills its table exactly
    if b > 2:
        lengths[1], lengths[2] = 1, 0  # a single token, and an idle row
    q, k, v, tables, lens = _case(rng, b, hq, hkv, d, bs, maxb, dtype, lengths)
    sinks = jnp.asarray(rng.normal(size=hq), jnp.float32) if with_sinks else None
    kw = dict(scale=d ** -0.5, softcap=softcap, window=window, sinks=sinks)
    got = paged_decode_attention(q, k, v, tables, lens, splits=splits, **kw)
    want = ref.paged_decode_attention(q, k, v, tables, lens, **kw)
    assert got.dtype == q.dtype and got.shape == q.shape
    assert not np.any(np.isnan(np.asarray(got, np.float32)))
    err = _rel(got, want)
    assert err < (1e-5 if dtype == jnp.float32 else 2e-2), err
    if b > 2:
        assert np.all(np.asarray(got[2], np.float32) == 0)  # the idle row


def test_reference_equals_float64_attention(rng):
    """The reference against attention written here in float64 on each row's gathered keys (GQA, window)."""
    b, hq, hkv, d, bs, maxb, window = 3, 6, 2, 32, 16, 3, 11
    q, k, v, tables, lens = _case(rng, b, hq, hkv, d, bs, maxb, jnp.float32)
    got = np.asarray(ref.paged_decode_attention(q, k, v, tables, lens, scale=0.3, window=window), np.float64)
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    for r in range(b):
        n = int(lens[r])
        keys = k[np.asarray(tables[r])].reshape(-1, hkv, d)[:n]
        vals = v[np.asarray(tables[r])].reshape(-1, hkv, d)[:n]
        for h in range(hq):
            kv = h // (hq // hkv)
            s = keys[:, kv] @ q[r, h] * 0.3
            s[: max(n - window, 0)] = -np.inf
            p = np.exp(s - s.max())
            np.testing.assert_allclose(got[r, h], (p / p.sum()) @ vals[:, kv], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(16, 12, 2, 128, 20), (128, 12, 2, 128, 20), (16, 32, 8, 128, 128),
                                   (128, 32, 8, 128, 20)])
def test_gpu_model_shapes(shape, rng):
    """Compiled on the GPU at the engine's shapes (Qwen2-1.5B and Llama-3-8B heads; ~320 and ~2,048 tokens)."""
    b, hq, hkv, d, maxb = shape
    q, k, v, tables, lens = _case(rng, b, hq, hkv, d, 16, maxb, jnp.bfloat16)
    got = jax.jit(lambda *a: paged_decode_attention(*a, scale=d ** -0.5))(q, k, v, tables, lens)
    want = ref.paged_decode_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), tables,
                                      lens, scale=d ** -0.5)
    assert _rel(got, want) < 2e-2


@pytest.mark.gpu
def test_gpu_softcap_window_sinks(rng):
    q, k, v, tables, lens = _case(rng, 8, 8, 4, 256, 16, 6, jnp.bfloat16)
    sinks = jnp.asarray(rng.normal(size=8), jnp.float32)
    kw = dict(scale=0.0625, softcap=50.0, window=40, sinks=sinks)
    got = jax.jit(lambda *a: paged_decode_attention(*a, **kw))(q, k, v, tables, lens)
    want = ref.paged_decode_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), tables,
                                      lens, **kw)
    assert _rel(got, want) < 2e-2


def test_lowers_to_triton(rng):
    """Cross-lowered for CUDA from the CPU (Triton IR, no GPU needed) at the engine's shapes, with softcap,
    window and sinks: the block shapes and primitives the Triton lowering needs."""
    from tests.helpers import lower_for_cuda

    for b, hq, hkv, d, maxb in ((16, 12, 2, 128, 20), (128, 32, 8, 128, 20), (4, 8, 4, 256, 6)):
        q, k, v, tables, lens = _case(rng, b, hq, hkv, d, 16, maxb, jnp.bfloat16)
        sinks = jnp.zeros((hq,), jnp.float32)
        for kw in (dict(), dict(softcap=50.0, window=40, sinks=sinks)):
            text = lower_for_cuda(lambda *a: paged_decode_attention(*a, scale=0.1, interpret=False, **kw),
                                  q, k, v, tables, lens)
            assert "triton" in text
