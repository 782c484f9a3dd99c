"""Flash attention kernel vs the plain-jnp reference: forward and dQ/dK/dV.

CPU runs use Pallas interpret mode at small ragged lengths (80, 200) with small blocks, so every loop range
(window edge, unmasked interior, causal diagonal / ragged end) and every feature is exercised; Gemma 3's image
blocks (block_ids) against unsloth_jax.ops.attention_mask(..., block_ids=...) + reference.attention. GPU tests
(`pytest -m gpu`) run the compiled Triton kernels at S=2048 with the table's block sizes.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.reference as reference
from pallas_kernels.flash_attention import (
    FlashConfig,
    KernelBlocks,
    flash_attention,
    flash_attention_with_config,
    get_config,
)
from tests.helpers import TOL, fast_jit, lower_for_cuda, rel_err

# Small blocks: several blocks per sequence, asymmetric tiles in both orientations. dK/dV programs: A sums a
# whole query-head group in one program, B lets the grid size decide (tiny grids: one head per program), C
# splits each group in two.
SMALL_A = FlashConfig(KernelBlocks(32, 16, 4, 2), KernelBlocks(16, 32, 4, 2), KernelBlocks(32, 16, 4, 2),
                      dkdv_split=1)
SMALL_B = FlashConfig(KernelBlocks(16, 32, 4, 2), KernelBlocks(32, 16, 4, 2), KernelBlocks(16, 32, 4, 2))
SMALL_C = FlashConfig(SMALL_A.fwd, SMALL_A.dkdv, SMALL_A.dq, dkdv_split=2)


def _inputs(rng, b, s, hq, hkv, d, dtype):
    def arr(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)

    return arr(b, s, hq, d), arr(b, s, hkv, d), arr(b, s, hkv, d), arr(b, s, hq, d)


def _segments(rng, b, s, n):
    """Sorted packing ids with n segments per row plus a trailing pad run with its own id; n < 0: ids drawn
    at random from -n values (unsorted, so block skipping by id ranges must stay conservative)."""
    if n < 0:
        return jnp.asarray(rng.integers(0, -n, size=(b, s)), jnp.int32)
    cuts = np.sort(rng.integers(1, s, size=(b, n - 1)), axis=1)
    ids = np.zeros((b, s), np.int32)
    for i in range(b):
        for c in cuts[i]:
            ids[i, c:] += 1
        ids[i, s - rng.integers(1, max(2, s // 8)):] = 99  # right padding
    return jnp.asarray(ids)


def _value_and_grads(fn, q, k, v, do):
    """(fn(q, k, v), its vjp at do)."""

    def run(q_, k_, v_, do_):
        out, vjp = jax.vjp(fn, q_, k_, v_)
        return out, vjp(do_)

    return fast_jit(run)(q, k, v, do)  # on the CPU: cheap backend passes (these tests are compile-bound)


def _check(rng, *, b, s, hq, hkv, d, dtype, config, kwargs, seg=None):
    q, k, v, do = _inputs(rng, b, s, hq, hkv, d, dtype)
    kw = dict(kwargs)
    if seg is not None:
        kw["segment_ids"] = seg
    def kernel(q_, k_, v_):
        return flash_attention_with_config(q_, k_, v_, config, **kw)

    def ref(q_, k_, v_):
        return reference.flash_attention(q_, k_, v_, **kw)

    out, grads = _value_and_grads(kernel, q, k, v, do)
    out_r, grads_r = _reference(ref, q, k, v, do)
    assert out.dtype == q.dtype and out.shape == q.shape
    tol = TOL[jnp.dtype(dtype).name]
    errs = {"out": rel_err(out, out_r)}
    for name, g, gr, x in zip(("dq", "dk", "dv"), grads, grads_r, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
        errs[name] = rel_err(g, gr)
    print(errs)
    for name, e in errs.items():
        assert e < tol, f"{name}: rel err {e:.3g} >= {tol} ({errs})"


def _reference(ref, q, k, v, do):
    """The reference on float32 copies of the inputs, with full-precision float32 matmuls."""
    with jax.default_matmul_precision("highest"):
        return _value_and_grads(ref, *[x.astype(jnp.float32) for x in (q, k, v, do)])


# (id, b, s, hq, hkv, d, dtype, config, kwargs, segments)
CASES = [
    ("causal-f32-d64-g1", 2, 80, 2, 2, 64, "float32", SMALL_A, dict(causal=True), 0),
    ("causal-bf16-d128-g2", 1, 200, 4, 2, 128, "bfloat16", SMALL_B, dict(causal=True), 0),
    ("full-f32-d64-g4", 1, 80, 4, 1, 64, "float32", SMALL_C, dict(causal=False), 0),
    ("full-bf16-d256-g1-even", 1, 96, 2, 2, 256, "bfloat16", SMALL_A, dict(causal=False), 0),
    ("window-f32-d64-g2", 1, 200, 4, 2, 64, "float32", SMALL_A, dict(causal=True, sliding_window=37), 0),
    ("window-small-bf16-d64-g1", 1, 80, 2, 2, 64, "bfloat16", SMALL_B,
     dict(causal=True, sliding_window=5), 0),
    ("softcap-bf16-d64-g4", 1, 80, 4, 1, 64, "bfloat16", SMALL_A, dict(causal=True, softcap=2.0), 0),
    ("gemma2-bf16-d256-g2", 1, 80, 4, 2, 256, "bfloat16", SMALL_A,
     dict(causal=True, softcap=3.0, sliding_window=30, sm_scale=0.3), 0),
    ("gemma2-f32-d128-g4", 1, 200, 4, 1, 128, "float32", SMALL_B,
     dict(causal=True, softcap=4.0, sliding_window=64), 0),
    ("segments-full-f32-d64-g2", 2, 80, 4, 2, 64, "float32", SMALL_A, dict(causal=False), 3),
    ("segments-causal-bf16-d64-g4", 2, 200, 4, 1, 64, "bfloat16", SMALL_B, dict(causal=True), 4),
    ("segments-all-f32-d128-g2", 1, 200, 4, 2, 128, "float32", SMALL_A,
     dict(causal=True, softcap=5.0, sliding_window=50), 3),
    ("segments-random-bf16-d128-g1", 1, 80, 2, 2, 128, "bfloat16", SMALL_B,
     dict(causal=True, sliding_window=30), -3),
    ("window-noncausal-f32-d64-g1", 1, 80, 2, 2, 64, "float32", SMALL_B,
     dict(causal=False, sliding_window=20), 0),
    ("table-bf16-d128-g4", 1, 200, 8, 2, 128, "bfloat16", None, dict(causal=True), 0),
    ("table-f32-d256-g2", 1, 80, 2, 1, 256, "float32", None, dict(causal=True, sliding_window=40), 2),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_flash_attention_matches_reference(rng, case):
    _, b, s, hq, hkv, d, dtype, config, kwargs, nseg = case
    seg = _segments(rng, b, s, nseg) if nseg else None
    _check(rng, b=b, s=s, hq=hq, hkv=hkv, d=d, dtype=jnp.dtype(dtype), config=config, kwargs=kwargs,
           seg=seg)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fully_masked_rows_give_zeros(rng, dtype):
    """Queries whose segment id no key has: zero output, zero dQ, no NaN anywhere, and no effect on dK/dV."""
    b, s, hq, hkv, d = 1, 80, 4, 2, 64
    q_ids = np.zeros((b, s), np.int32)
    kv_ids = np.zeros((b, s), np.int32)
    dead = rng.choice(s, size=17, replace=False)
    q_ids[0, dead] = -1  # no key has id -1
    seg = (jnp.asarray(q_ids), jnp.asarray(kv_ids))
    dt = jnp.dtype(dtype)
    q, k, v, do = _inputs(rng, b, s, hq, hkv, d, dt)

    def fn(q_, k_, v_):
        return flash_attention_with_config(q_, k_, v_, SMALL_A, causal=True, segment_ids=seg)

    out, (dq, dk, dv) = _value_and_grads(fn, q, k, v, do)
    for x in (out, dq, dk, dv):
        assert np.all(np.isfinite(np.asarray(x, np.float32)))
    assert np.all(np.asarray(out, np.float32)[0, dead] == 0.0)
    assert np.all(np.asarray(dq, np.float32)[0, dead] == 0.0)

    def ref(q_, k_, v_):
        return reference.flash_attention(q_, k_, v_, causal=True, segment_ids=seg)

    out_r, grads_r = _reference(ref, q, k, v, do)
    tol = TOL[dt.name]
    assert rel_err(out, out_r) < tol
    for g, gr in zip((dq, dk, dv), grads_r):
        assert rel_err(g, gr) < tol


def test_window_covering_sequence_is_noop_and_validation(rng):
    b, s, hq, hkv, d = 1, 80, 2, 2, 64
    q, k, v, _ = _inputs(rng, b, s, hq, hkv, d, jnp.float32)
    both = lambda q_, k_, v_: (  # noqa: E731
        flash_attention_with_config(q_, k_, v_, SMALL_A, causal=True),
        flash_attention_with_config(q_, k_, v_, SMALL_A, causal=True, sliding_window=s + 5))
    plain, windowed = fast_jit(both)(q, k, v)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(windowed))
    with pytest.raises(ValueError):
        flash_attention(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2))  # 2 % 3 != 0
    with pytest.raises(ValueError):
        flash_attention(q[..., :48], k[..., :48], v[..., :48])  # head_dim 48
    with pytest.raises(ValueError):
        flash_attention(q, k, v, sliding_window=0)


def test_config_table_and_triton_lowering():
    """The table covers the tuned head dims, and all three kernels lower to Triton IR (no GPU needed)."""
    for d in (64, 128, 256):
        for dt in (jnp.bfloat16, jnp.float32):
            for s in (512, 4096):
                cfg = get_config(s, dt, d)
                for kb in (cfg.fwd, cfg.dkdv, cfg.dq):
                    for x in (kb.block_q, kb.block_k):
                        assert x & (x - 1) == 0
    b, s, hq, hkv, d = 1, 200, 4, 2, 128
    sds = jax.ShapeDtypeStruct
    q, kv = sds((b, s, hq, d), jnp.bfloat16), sds((b, s, hkv, d), jnp.bfloat16)
    seg = sds((b, s), jnp.int32)
    fast = get_config(4096, jnp.bfloat16, d)
    fast = FlashConfig(fast.fwd, fast.dkdv, fast.dq, fast_tanh=True, fast_exp2=True)  # the inline-asm paths

    def fwd_bwd(q_, k_, v_, seg_, do_, config):
        fn = lambda a, b_, c: flash_attention_with_config(  # noqa: E731
            a, b_, c, config, causal=True, segment_ids=seg_, sliding_window=50, softcap=30.0,
            interpret=False)
        out, vjp = jax.vjp(fn, q_, k_, v_)
        return out, vjp(do_)

    for config in (None, fast):
        text = lower_for_cuda(functools.partial(fwd_bwd, config=config), q, kv, kv, seg, q)
        assert text.count("xla.gpu.triton") == 3


# ------------------------------------------------------------------------------------------ image blocks
def _image_rows(rng, s, rows, pad):
    """Block ids [B, S] (as unsloth_jax.models.vision.image_block_ids numbers them: each image run 0, 1, ... per
    row, -1 elsewhere; numbered here as the runs are placed, so the kernel tests need no flax) and the segment ids
    (1 real, 0 right padding; None without `pad`). rows: per batch row (run lengths, at_end): image runs of those
    lengths at random places, separated by at least one text token; at_end: the last run ends with the row's last
    real token (the very end of the sequence without padding)."""
    blk = np.full((len(rows), s), -1, np.int32)
    valid = np.ones((len(rows), s), np.int32)
    for i, (lengths, at_end) in enumerate(rows):
        n_real = s - (int(rng.integers(1, max(2, s // 8))) if pad else 0)
        valid[i, n_real:] = 0
        gaps = len(lengths) + (0 if at_end else 1)
        spare = n_real - sum(lengths) - max(len(lengths) - 1, 0)
        assert spare >= 0
        cuts = np.sort(rng.integers(0, spare + 1, size=max(gaps, 1) - 1))
        extra = np.diff(np.concatenate([[0], cuts, [spare]]))
        pos = 0
        for j, n in enumerate(lengths):
            pos += int(extra[j]) + (1 if j else 0)
            blk[i, pos:pos + n] = j
            pos += n
        if at_end and lengths:
            assert pos == n_real
    return jnp.asarray(blk), (jnp.asarray(valid) if pad else None)


def _check_images(rng, *, b, s, hq, hkv, d, dtype, config, rows, pad=False, window=None, softcap=None,
                  sm_scale=None):
    """Kernel with block_ids vs the reference under unsloth_jax.ops.attention_mask(..., block_ids=...)."""
    from unsloth_jax.ops import attention_mask

    blk, seg = _image_rows(rng, s, rows, pad)
    q, k, v, do = _inputs(rng, b, s, hq, hkv, d, dtype)
    mask = attention_mask(s, s, causal=True, window=window, segment_ids=seg, block_ids=blk)
    assert bool(jnp.any(mask & ~jnp.tril(jnp.ones((s, s), bool)))) == any(any(n > 1 for n in r[0]) for r in rows)
    scale = d ** -0.5 if sm_scale is None else sm_scale

    def kernel(q_, k_, v_):
        return flash_attention_with_config(q_, k_, v_, config, causal=True, segment_ids=seg, block_ids=blk,
                                           sliding_window=window, softcap=softcap, sm_scale=sm_scale)

    def ref(q_, k_, v_):
        return reference.attention(q_, k_, v_, mask, scale=scale, softcap=softcap)

    out, grads = _value_and_grads(kernel, q, k, v, do)
    out_r, grads_r = _reference(ref, q, k, v, do)
    tol = TOL[jnp.dtype(dtype).name]
    errs = {"out": rel_err(out, out_r)}
    for name, g, gr, x in zip(("dq", "dk", "dv"), grads, grads_r, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
        errs[name] = rel_err(g, gr)
    print(errs)
    for name, e in errs.items():
        assert e < tol, f"{name}: rel err {e:.3g} >= {tol} ({errs})"


# (id, b, s, hq, hkv, d, dtype, config, rows [(run lengths, at_end)], extra kwargs). Runs longer than the
# blocks (16/32) cross block boundaries; rows with no run; one-token runs (the causal mask alone).
IMAGE_CASES = [
    ("images-f32-d64-g2", 2, 80, 4, 2, 64, "float32", SMALL_A, [([3, 40, 5], True), ([], False)], {}),
    ("images-bf16-d64-g2", 2, 80, 4, 2, 64, "bfloat16", SMALL_A, [([], False), ([1, 37, 20], False)], {}),
    ("images-window-bf16-d64-g2", 1, 200, 4, 2, 64, "bfloat16", SMALL_B, [([1, 50, 20, 9, 33], True)],
     dict(window=37)),
    ("images-padding-bf16-d32-g2-split", 2, 120, 4, 2, 32, "bfloat16", SMALL_C,
     [([30, 7], True), ([12], False)], dict(pad=True)),
    ("images-padding-window-softcap-f32-d64-g2", 2, 96, 4, 2, 64, "float32", SMALL_B,
     [([45], True), ([3, 17, 33], False)], dict(pad=True, window=20, softcap=5.0, sm_scale=0.2)),
    # the table's tiles (128 x 64 at D=64): the 130-token run covers rows 127 and 128 wherever it lands
    ("images-table-bf16-d64-g2", 1, 200, 4, 2, 64, "bfloat16", None, [([2, 130, 30], True)], dict(window=90)),
]


@pytest.mark.parametrize("case", IMAGE_CASES, ids=[c[0] for c in IMAGE_CASES])
def test_flash_attention_image_blocks(rng, case):
    _, b, s, hq, hkv, d, dtype, config, rows, kwargs = case
    _check_images(rng, b=b, s=s, hq=hq, hkv=hkv, d=d, dtype=jnp.dtype(dtype), config=config, rows=rows,
                  **kwargs)


def test_image_blocks_absent_equal_causal(rng):
    """block_ids all -1 (and any block_ids with causal=False) give exactly the plain kernels' results."""
    b, s, hq, hkv, d = 2, 80, 4, 2, 32
    q, k, v, do = _inputs(rng, b, s, hq, hkv, d, jnp.float32)
    none = jnp.full((b, s), -1, jnp.int32)
    some, _ = _image_rows(rng, s, [([40], True), ([9, 9], False)], False)

    def pair(block_ids, causal):
        def fn(q_, k_, v_):
            return flash_attention_with_config(q_, k_, v_, SMALL_A, causal=causal, sliding_window=30,
                                               block_ids=block_ids)

        return _value_and_grads(fn, q, k, v, do)

    for block_ids, causal in ((none, True), (some, False)):
        got, want = pair(block_ids, causal), pair(None, causal)
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ValueError):
        flash_attention(q, k, v, block_ids=none[:, :-1])


def test_image_blocks_triton_lowering():
    """With block_ids, all three kernels still lower to Triton IR (no GPU needed)."""
    b, s, hq, hkv, d = 1, 200, 4, 2, 64
    sds = jax.ShapeDtypeStruct
    q, kv = sds((b, s, hq, d), jnp.bfloat16), sds((b, s, hkv, d), jnp.bfloat16)
    ids = sds((b, s), jnp.int32)

    def fwd_bwd(q_, k_, v_, seg_, blk_, do_):
        fn = lambda a, b_, c: flash_attention(  # noqa: E731
            a, b_, c, causal=True, segment_ids=seg_, block_ids=blk_, sliding_window=50, interpret=False)
        out, vjp = jax.vjp(fn, q_, k_, v_)
        return out, vjp(do_)

    text = lower_for_cuda(fwd_bwd, q, kv, kv, ids, ids, q)
    assert text.count("xla.gpu.triton") == 3


# ------------------------------------------------------------------------------------------ GPU only
def _gpu_case(rng, *, b, s, hq, hkv, d, dtype, config=None, **kwargs):
    nseg = kwargs.pop("nseg", 0)
    seg = _segments(rng, b, s, nseg) if nseg else None
    _check(rng, b=b, s=s, hq=hq, hkv=hkv, d=d, dtype=jnp.dtype(dtype), config=config, kwargs=kwargs, seg=seg)


@pytest.mark.gpu
def test_gpu_d128_gqa4_causal(rng):
    _gpu_case(rng, b=2, s=2048, hq=16, hkv=4, d=128, dtype="bfloat16", causal=True)


@pytest.mark.gpu
def test_gpu_d256_gqa4_softcap_window(rng):
    _gpu_case(rng, b=1, s=2048, hq=8, hkv=2, d=256, dtype="bfloat16", causal=True, softcap=50.0,
              sliding_window=1024)


@pytest.mark.gpu
def test_gpu_d128_gqa4_softcap_window_fast_math(rng):
    base = get_config(2048, jnp.bfloat16, 128)
    # fast_tanh and fast_exp2 (16-bit table defaults, stated here in case the table changes) and dkdv_split=1:
    # one dK/dV program loops over all 4 query heads of its group (the auto choice splits here).
    cfg = FlashConfig(base.fwd, base.dkdv, base.dq, fast_tanh=True, fast_exp2=True, dkdv_split=1)
    _gpu_case(rng, b=1, s=2048, hq=16, hkv=4, d=128, dtype="bfloat16", config=cfg, causal=True,
              softcap=50.0, sliding_window=700)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [0, 1])
def test_gpu_d64_ragged_segments(rng, split):
    base = get_config(1999, jnp.bfloat16, 64)
    cfg = FlashConfig(base.fwd, base.dkdv, base.dq, dkdv_split=split)
    _gpu_case(rng, b=2, s=1999, hq=8, hkv=4, d=64, dtype="bfloat16", config=cfg, causal=True, nseg=3)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 256])
def test_gpu_table_config_ragged_segments_qwen2_heads(rng, d):
    # The swept 16-bit table tiles (up to 128x128) on a ragged length with packing, Qwen2-1.5B's 12:2 heads
    # (the automatic dK/dV split divides each group of 6 query heads).
    _gpu_case(rng, b=2, s=1000, hq=12, hkv=2, d=d, dtype="bfloat16", causal=True, nseg=2)


@pytest.mark.gpu
def test_gpu_fp32_d128_window(rng):
    # fp32 dots run as tf32 on the GPU (the lowering's default precision), hence the tf32 tolerance.
    q, k, v, do = _inputs(rng, 1, 2048, 8, 2, 128, jnp.float32)

    def fn(a, b_, c):
        return flash_attention(a, b_, c, causal=True, sliding_window=777)

    def ref(a, b_, c):
        return reference.flash_attention(a, b_, c, causal=True, sliding_window=777)

    out, grads = _value_and_grads(fn, q, k, v, do)
    out_r, grads_r = _reference(ref, q, k, v, do)
    assert rel_err(out, out_r) < TOL["float32_tf32"]
    for g, gr in zip(grads, grads_r):
        assert rel_err(g, gr) < TOL["float32_tf32"]


@pytest.mark.gpu
def test_gpu_noncausal_fully_masked_rows(rng):
    b, s, hq, hkv, d = 2, 1536, 8, 8, 128
    q_ids = np.array(_segments(rng, b, s, 3))  # a writable copy
    kv_ids = q_ids.copy()
    dead = rng.choice(s, size=100, replace=False)
    q_ids[:, dead] = -7  # no key has this id: these rows are fully masked
    seg = (jnp.asarray(q_ids), jnp.asarray(kv_ids))
    q, k, v, do = _inputs(rng, b, s, hq, hkv, d, jnp.bfloat16)

    def fn(a, b_, c):
        return flash_attention(a, b_, c, causal=False, segment_ids=seg)

    def ref(a, b_, c):
        return reference.flash_attention(a, b_, c, causal=False, segment_ids=seg)

    out, grads = _value_and_grads(fn, q, k, v, do)
    out_r, grads_r = _reference(ref, q, k, v, do)
    assert np.all(np.asarray(out, np.float32)[:, dead] == 0.0)
    assert np.all(np.asarray(grads[0], np.float32)[:, dead] == 0.0)
    assert rel_err(out, out_r) < TOL["bfloat16"]
    for g, gr in zip(grads, grads_r):
        assert rel_err(g, gr) < TOL["bfloat16"]


@pytest.mark.gpu
def test_gpu_gemma3_image_blocks(rng):
    # Gemma 3's shape of the problem: 256-token images, a 512-token window on a ragged, right-padded batch.
    _check_images(rng, b=2, s=1999, hq=8, hkv=4, d=256, dtype=jnp.bfloat16, config=None,
                  rows=[([256, 256], False), ([256], True)], pad=True, window=512)
