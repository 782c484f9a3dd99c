"""Flash attention (forward and backward) as Pallas kernels for the Triton lowering.

Wins against XLA, not against cuDNN: forward+backward 7.2-9.3x XLA at D=128, 3.4-4.1x at D=256 and 3.6-5.1x on Gemma
2's softcap + window case, but 0.60-0.78x cuDNN; Gemma-2-2B's step takes 324.1 ms with it against 417.4 with XLA
attention (BENCHMARKS.md, "Flash attention (Pallas) vs cuDNN and XLA, 2026-11-29"). Default
(ops.PALLAS_WINS["attention"], after cuDNN in ops.attention): 16-bit calls cuDNN cannot serve (softcap, packed
segments, left padding, Gemma 3's image blocks, the vision towers' windows) with head_dim up to 256, other head dims
zero-padded to 64, 128 or 256 (ops.flash_head_dim). head_dim 64 was not timed: XLA's path materialises the same
[S, S] scores at any D, so the kernel's lead, larger at D=128 than at D=256, is taken to hold there. At the vision
towers' padded 72 / 80 the alternative, XLA's dense scores, ran the Qwen2.5-VL-7B step out of memory; with the
kernel it trains at 9,372 tokens/s (BENCHMARKS.md, "Vision-language at real shapes, 2026-12-06").

`flash_attention(q, k, v, *, causal, segment_ids, sliding_window, softcap, sm_scale, interpret, block_ids)`:
q [B, S, Hq, D], k and v [B, S, Hkv, D] with Hq a multiple of Hkv (grouped-query attention: query head h
reads KV head h // (Hq // Hkv), HF's repeat_kv order, without repeating K/V in memory).

block_ids [B, S] (Gemma 3's images): -1 for ordinary tokens, one id >= 0 per contiguous run of image tokens;
with causal masking, a query also sees the later keys of its own run (window and segment ids still apply), as
`unsloth_jax.ops.attention_mask(..., block_ids=...)`, without any [S, S] mask. XLA summarises, per row block,
which column blocks share an id >= 0 (per-block min/max of the ids, like segment ids); the forward and dQ
kernels stretch their last (masked) range to the furthest key block a row block's runs reach, the dK/dV
kernel its first (masked) range back to the earliest query block that reaches its keys. Only masked blocks
read the ids. Without block_ids the operands are None and the kernels are the plain ones.

Kernels (three `pl.pallas_call`s, no atomics):
- forward, grid (q blocks, B, Hq): online softmax in base 2 (log2(e) folded into the score scale); writes the
  output and the float32 log-sum-exp (base 2) that the backward reuses.
- dK/dV, grid (KV blocks, B, Hkv): one program owns one KV block of one KV head and loops over the query heads
  of its group and over the query blocks that can see it, so the group sum needs no atomics. When that grid is
  too small to fill the GPU (few KV heads, short sequences), each group is split over several programs that
  write partial dK/dV, summed by one XLA reduction (`dkdv_head_split`).
- dQ, grid (q blocks, B, Hq): one program owns one query block and loops over the KV blocks it can see.
delta = rowsum(dO * O) is one fused XLA reduction ahead of the two backward kernels.

Every loop over blocks is split in three ranges: blocks on the lower edge of the sliding window (masked),
blocks fully inside (no position mask at all; only the segment mask when segment ids are given), and blocks on
the causal diagonal or the ragged end of the sequence (masked). Blocks outside (causal upper triangle, behind
the window) are never visited, but for the image-block reach above, nor are blocks whose segment-id range
cannot meet the current block's (a per-block min/max summary computed by XLA, so packed sequences skip the
cross-document blocks). Ragged sequence ends are handled with masked loads of power-of-two blocks.

Masked scores are -inf; the running max starts at a finite -1e30, so fully masked rows never produce NaN:
they get output 0, log-sum-exp +inf (so recomputed probabilities are exactly 0) and zero gradients.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels._common import (and_masks, cdiv, compiler_params, load, next_pow2, pl, plgpu, range_mask,
                                    resolve_interpret)

LOG2E = math.log2(math.e)
_M_INIT = -1e30  # initial running max: finite, so exp2(m_old - m_new) never sees (-inf) - (-inf)


# ------------------------------------------------------------------------------------------ block-size table
@dataclasses.dataclass(frozen=True)
class KernelBlocks:
    """Tile sizes and launch parameters of one kernel (block_q x block_k tiles)."""

    block_q: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    """Launch configuration of the three kernels.

    fast_tanh: softcap through tanh.approx (GPU only, 16-bit inputs). fast_exp2: softmax exponentials through
    ex2.approx.ftz (GPU only; results below 2**-126 flush to zero). dkdv_split: query heads of a KV group split
    over this many dK/dV programs (partials summed by XLA); 0 picks it from the grid size.
    """

    fwd: KernelBlocks
    dkdv: KernelBlocks
    dq: KernelBlocks
    fast_tanh: bool = False
    dkdv_split: int = 0
    fast_exp2: bool = False


def _cfg(fwd, dkdv, dq, fast_math=False) -> FlashConfig:
    return FlashConfig(KernelBlocks(*fwd), KernelBlocks(*dkdv), KernelBlocks(*dq), fast_tanh=fast_math,
                       fast_exp2=fast_math)


# Keyed by (shape class, dtype, head_dim). Shape class: "short" (S <= 1024) or "long".
# Entries are (block_q, block_k, num_warps, num_stages) for fwd, dK/dV and dQ.
# D=128 and D=256 16-bit entries: the fastest tiles of the H200 sweeps (`python bench/attention.py --sweep
# --dims 128,256`, and `--extra` for the edge candidates; figures in BENCHMARKS.md, "Flash attention"); one step
# larger runs out of shared memory. fast_math (tanh.approx softcap, ex2.approx exponentials) is on for them:
# faster at D=256 and in the Gemma 2 softcap case, a tie at D=128 (`--sweep --table-only --exp2`).
# D=64 and float32 entries are unswept guesses (tiles that compile for sm_90a).
_TABLE: dict[tuple[str, str, int], FlashConfig] = {}
for _cls in ("short", "long"):
    for _dt in ("bfloat16", "float16"):
        _TABLE[(_cls, _dt, 64)] = _cfg((128, 64, 4, 3), (64, 128, 8, 2), (128, 64, 8, 2))
        _TABLE[(_cls, _dt, 128)] = _cfg((128, 128, 8, 3), (64, 128, 8, 4), (128, 64, 8, 4), fast_math=True)
        _TABLE[(_cls, _dt, 256)] = _cfg((128, 64, 8, 2), (64, 64, 8, 2), (64, 32, 4, 3), fast_math=True)
    _TABLE[(_cls, "float32", 64)] = _cfg((64, 32, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2))
    _TABLE[(_cls, "float32", 128)] = _cfg((64, 32, 8, 2), (32, 32, 8, 2), (64, 32, 8, 2))
    _TABLE[(_cls, "float32", 256)] = _cfg((32, 32, 8, 1), (16, 32, 8, 1), (32, 16, 8, 1))


def shape_class(seq_len: int) -> str:
    """The block table's sequence-length class: "short" (S <= 1024) or "long"."""
    return "short" if seq_len <= 1024 else "long"


def get_config(seq_len: int, dtype, head_dim: int) -> FlashConfig:
    """Table lookup; unknown (dtype, head_dim) pairs fall back to the nearest entry of the same dtype family."""
    name = jnp.dtype(dtype).name
    if name not in ("bfloat16", "float16", "float32"):
        name = "float32"
    d = min((64, 128, 256), key=lambda x: (abs(x - head_dim), x))
    return _TABLE[(shape_class(seq_len), name, d)]


def _clamp_blocks(kb: KernelBlocks, seq_len: int) -> KernelBlocks:
    """Blocks never larger than the (power-of-two padded) sequence."""
    cap = max(16, next_pow2(seq_len))
    return dataclasses.replace(kb, block_q=min(kb.block_q, cap), block_k=min(kb.block_k, cap))


# ------------------------------------------------------------------------------------------ shared pieces
@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static about one call (hashable: it is a nondiff argument of the custom_vjp)."""

    seq_len: int
    groups: int  # Hq // Hkv
    causal: bool
    window: int | None
    softcap: float | None
    scale: float
    interpret: bool
    config: FlashConfig


def _tanh_fn(st: _Static):
    if st.config.fast_tanh and not st.interpret:
        return plgpu.approx_tanh
    return jnp.tanh


def _exp2(x, st: _Static):
    """2**x of float32 scores; fast_exp2 (GPU): one ex2.approx.ftz.f32 instead of the lowering's libdevice exp2f
    (measured faster at D=256, see the table)."""
    if st.config.fast_exp2 and not st.interpret:
        [y] = plgpu.elementwise_inline_asm("ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f", pack=1,
                                           result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])
        return y
    return jnp.exp2(x)


def _scores(s, st: _Static):
    """Raw q.k (f32) -> (scores in log2 units, tanh value or None). Softcap: cap * tanh(s * scale / cap)."""
    if st.softcap is None:
        return s * (st.scale * LOG2E), None
    t = _tanh_fn(st)(s * (st.scale / st.softcap))
    return t * (st.softcap * LOG2E), t


def _mask(qpos, kpos, qseg, kseg, st: _Static, *, positions: bool, check_q: bool, check_k: bool, qblk=None,
          kblk=None):
    """Boolean keep-mask from broadcastable query/key positions; None when nothing is masked.

    qblk/kblk (block ids, only with causal and `positions`): a key past the query stays visible when both
    share a block id >= 0."""
    m = None
    if positions:
        if check_q:
            m = and_masks(m, qpos < st.seq_len)
        if check_k:
            m = and_masks(m, kpos < st.seq_len)
        if st.causal:
            past = qpos >= kpos
            if qblk is not None:
                past = past | ((qblk == kblk) & (qblk >= 0))
            m = and_masks(m, past)
        if st.window is not None:
            m = and_masks(m, (qpos - kpos) < st.window)
    if qseg is not None:
        m = and_masks(m, qseg == kseg)
    return m


def _idiv(a, b: int):
    """Floor division of a non-negative traced int by a positive Python int."""
    return lax.div(a, jnp.int32(b))


def _icdiv(a, b: int):
    return lax.div(a + jnp.int32(b - 1), jnp.int32(b))


def _split_ranges(lo, full_lo, full_hi, hi):
    """[lo, b) masked, [b, c) unmasked, [c, hi) masked, with lo <= b <= c <= hi."""
    b = jnp.minimum(jnp.maximum(full_lo, lo), hi)
    c = jnp.minimum(jnp.maximum(full_hi, b), hi)
    return b, c


def _kv_ranges_for_q_block(q_lo, st: _Static, bq: int, bk: int):
    """KV block ranges seen by query rows [q_lo, q_lo + bq) (forward and dQ kernels)."""
    S = st.seq_len
    q_hi = jnp.minimum(q_lo + bq, S)  # valid rows end
    nk = cdiv(S, bk)
    zero = jnp.int32(0)
    if st.window is not None:
        lo = _idiv(jnp.maximum(q_lo - (st.window - 1), zero), bk)
        full_lo = _icdiv(jnp.maximum(q_hi - st.window, zero), bk)
    else:
        lo = zero
        full_lo = zero
    if st.causal:
        hi = _icdiv(q_hi, bk)
        full_hi = _idiv(q_lo + 1, bk)
    else:
        hi = jnp.int32(nk)
        full_hi = jnp.int32(S // bk)
    b, c = _split_ranges(lo, full_lo, full_hi, hi)
    return lo, b, c, hi


def _q_ranges_for_kv_block(k_lo, st: _Static, bq: int, bk: int):
    """Query block ranges that see keys [k_lo, k_lo + bk) (dK/dV kernel)."""
    S = st.seq_len
    k_hi = jnp.minimum(k_lo + bk, S)
    nq = cdiv(S, bq)
    zero = jnp.int32(0)
    if st.causal:
        lo = _idiv(k_lo, bq)
        full_lo = _icdiv(k_hi - 1, bq)
    else:
        lo = zero
        full_lo = zero
    if st.window is not None:
        hi = _icdiv(jnp.minimum(k_hi - 1 + st.window, S), bq)
        full_hi = jnp.minimum(_idiv(k_lo + st.window, bq), jnp.int32(S // bq))
    else:
        hi = jnp.int32(nq)
        full_hi = jnp.int32(S // bq)
    if S % bk:  # the last KV block is ragged: every query block it meets needs the bounds mask
        full_hi = jnp.where(k_lo + bk > S, zero, full_hi)
    b, c = _split_ranges(lo, full_lo, full_hi, hi)
    return lo, b, c, hi


def _segment_block_ranges(row_ids, col_ids, seq_len: int, b_rows: int, b_cols: int):
    """int32 [B, 2, n_row_blocks]: [first, last + 1) column block that may hold a matching segment id.

    From per-block min/max ids (valid for any ids, exact-ish for sorted packing ids): a column block whose id
    range misses the row block's range cannot match and is skipped. Rows with no match get an empty range.
    """
    def blocks(ids, size):
        n = cdiv(seq_len, size)
        ids = jnp.pad(ids, ((0, 0), (0, n * size - seq_len)), mode="edge").reshape(ids.shape[0], n, size)
        return ids.min(axis=-1), ids.max(axis=-1)

    rmin, rmax = blocks(row_ids, b_rows)
    cmin, cmax = blocks(col_ids, b_cols)
    hit = (rmin[:, :, None] <= cmax[:, None, :]) & (cmin[:, None, :] <= rmax[:, :, None])  # [B, nr, nc]
    n_cols = hit.shape[-1]
    first = jnp.argmax(hit, axis=-1)
    last = n_cols - jnp.argmax(hit[..., ::-1], axis=-1)
    anyhit = hit.any(axis=-1)
    lo = jnp.where(anyhit, first, 0)
    hi = jnp.where(anyhit, last, 0)
    return jnp.stack([lo, hi], axis=1).astype(jnp.int32)


def _image_block_hits(row_ids, col_ids, seq_len: int, b_rows: int, b_cols: int):
    """bool [B, n_row_blocks, n_col_blocks]: the row block and the column block may hold a common block id >= 0.

    From per-block min/max of the ids >= 0 (a block without any has min > max, so it meets nothing):
    conservative for any ids, exact for image_block_ids' runs (consecutive ids increasing along the row).
    """
    big = jnp.int32(jnp.iinfo(jnp.int32).max)

    def blocks(ids, size):
        n = cdiv(seq_len, size)
        ids = jnp.pad(ids, ((0, 0), (0, n * size - seq_len)), constant_values=-1).reshape(ids.shape[0], n, size)
        return jnp.where(ids >= 0, ids, big).min(axis=-1), ids.max(axis=-1)

    rmin, rmax = blocks(row_ids, b_rows)
    cmin, cmax = blocks(col_ids, b_cols)
    return (rmin[:, :, None] <= cmax[:, None, :]) & (cmin[:, None, :] <= rmax[:, :, None])


def _image_reach_forward(blk, seq_len: int, bq: int, bk: int):
    """int32 [B, nq]: per query block, one past the furthest key block its image blocks reach (0: none). The
    forward and dQ kernels extend their causal range [.., hi) to at least this."""
    hit = _image_block_hits(blk, blk, seq_len, bq, bk)
    nk = hit.shape[-1]
    last = nk - jnp.argmax(hit[..., ::-1], axis=-1)
    return jnp.where(hit.any(axis=-1), last, 0).astype(jnp.int32)


def _image_reach_backward(blk, seq_len: int, bk: int, bq: int):
    """int32 [B, nk]: per key block, the earliest query block whose image blocks reach it (nq: none). The dK/dV
    kernel starts its causal range [lo, ..) at most there."""
    hit = _image_block_hits(blk, blk, seq_len, bk, bq)
    nq = hit.shape[-1]
    return jnp.where(hit.any(axis=-1), jnp.argmax(hit, axis=-1), nq).astype(jnp.int32)


def _extend_hi(ranges, ext_ref, block):
    """(lo, b, c, hi) with the last (masked) range stretched to the image-block reach of row block `block`."""
    lo, b, c, hi = ranges
    if ext_ref is None:
        return ranges
    return lo, b, c, jnp.maximum(hi, plgpu.load(ext_ref.at[block]))


def _extend_lo(ranges, ext_ref, block):
    """(lo, b, c, hi) with the first (masked) range stretched back to the image-block reach of key block
    `block` (dK/dV)."""
    lo, b, c, hi = ranges
    if ext_ref is None:
        return ranges
    return jnp.minimum(lo, plgpu.load(ext_ref.at[block])), b, c, hi


def _clamp_to_segments(ranges, rng_ref, block):
    """Intersect (lo, b, c, hi) with the segment range of row block `block` (no-op without segments)."""
    lo, b, c, hi = ranges
    if rng_ref is None:
        return lo, b, c, hi
    lo = jnp.maximum(lo, plgpu.load(rng_ref.at[jnp.int32(0), block]))
    hi = jnp.maximum(jnp.minimum(hi, plgpu.load(rng_ref.at[jnp.int32(1), block])), lo)
    b = jnp.minimum(jnp.maximum(b, lo), hi)
    c = jnp.minimum(jnp.maximum(c, b), hi)
    return lo, b, c, hi


def _load_rows(ref, start, size: int, seq_len: int, masked: bool, *, head=None, other=0):
    """Load rows [start, start+size) of a [S, D] / [S] ref, or of head `head` of a [S, G, D] / [G, S] ref.

    Rows past the end are masked (read as `other`) when `masked`. One indexer per load (Triton lowering).
    """
    rows = pl.ds(start, size)
    ndim = len(ref.shape)
    if head is None:
        idx = (rows,) + (slice(None),) * (ndim - 1)
        vector = ndim == 1
    elif ndim == 3:  # [S, G, D]
        idx = (rows, head, slice(None))
        vector = False
    else:  # [G, S]
        idx = (head, rows)
        vector = True
    ok = range_mask(start, size, seq_len, masked)
    if ok is not None and not vector:
        ok = ok[:, None]
    return load(ref.at[idx], ok, other)


# ------------------------------------------------------------------------------------------ forward kernel
def _loop_ranges(ranges, body, carry):
    """Run body(i, carry, masked) over [lo, b) masked, [b, c) unmasked, [c, hi) masked (see _split_ranges)."""
    lo, b, c, hi = ranges
    carry = lax.fori_loop(lo, b, functools.partial(body, masked=True), carry)
    carry = lax.fori_loop(b, c, functools.partial(body, masked=False), carry)
    return lax.fori_loop(c, hi, functools.partial(body, masked=True), carry)


def _kv_block_scores(q, qpos, qseg, qblk, k_ref, v_ref, kseg_ref, blk_ref, k_lo, bk: int, st: _Static,
                     masked: bool):
    """(k, v, s, t) for query rows `q` against keys [k_lo, k_lo + bk): s the masked base-2 scores [bq, bk]
    (-inf where a key may not be attended), t the softcap tanh (None without softcap). Forward and dQ.
    qblk [bq, 1] / blk_ref: image block ids (None without), read in masked blocks only."""
    S = st.seq_len
    kpos = k_lo + jnp.arange(bk)
    k = _load_rows(k_ref, k_lo, bk, S, masked)
    v = _load_rows(v_ref, k_lo, bk, S, masked)
    s, t = _scores(plgpu.dot(q, k, trans_b=True), st)
    kseg = None
    if kseg_ref is not None:
        kseg = _load_rows(kseg_ref, k_lo, bk, S, masked)[None, :]
    kblk = None
    if masked and blk_ref is not None:
        kblk = _load_rows(blk_ref, k_lo, bk, S, True, other=-1)[None, :]
    keep = _mask(qpos[:, None], kpos[None, :], qseg, kseg, st, positions=masked, check_q=False, check_k=True,
                 qblk=qblk if masked else None, kblk=kblk)
    if keep is not None:
        s = jnp.where(keep, s, -jnp.inf)
    return k, v, s, t


def _fwd_kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, rng_ref, blk_ref, ext_ref, o_ref, lse_ref, *,
                st: _Static, bq: int, bk: int):
    S = st.seq_len
    nq = cdiv(S, bq)
    qi = (nq - 1) - pl.program_id(0)  # heaviest (causal) blocks first
    q_lo = qi * bq
    qpos = q_lo + jnp.arange(bq)
    ragged_q = S % bq != 0
    q = _load_rows(q_ref, q_lo, bq, S, ragged_q)
    qseg = None
    if qseg_ref is not None:
        qseg = _load_rows(qseg_ref, q_lo, bq, S, ragged_q)[:, None]
    qblk = None
    if blk_ref is not None:
        qblk = _load_rows(blk_ref, q_lo, bq, S, ragged_q, other=-1)[:, None]

    def body(kj, carry, masked: bool):
        acc, m_i, l_i = carry
        _, v, s, _ = _kv_block_scores(q, qpos, qseg, qblk, k_ref, v_ref, kseg_ref, blk_ref, kj * bk, bk, st,
                                      masked)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        alpha = _exp2(m_i - m_new, st)
        p = _exp2(s - m_new[:, None], st)
        l_new = l_i * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
        return acc, m_new, l_new

    d = q.shape[-1]
    carry = (
        jnp.zeros((bq, d), jnp.float32),
        jnp.full((bq,), _M_INIT, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
    )
    ranges = _extend_hi(_kv_ranges_for_q_block(q_lo, st, bq, bk), ext_ref, qi)
    ranges = _clamp_to_segments(ranges, rng_ref, qi)
    acc, m_i, l_i = _loop_ranges(ranges, body, carry)
    has = l_i > 0.0
    o = acc / jnp.where(has, l_i, 1.0)[:, None]
    lse = jnp.where(has, m_i + jnp.log2(jnp.where(has, l_i, 1.0)), jnp.inf)
    row_ok = qpos < S
    plgpu.store(o_ref.at[pl.ds(q_lo, bq)], o.astype(o_ref.dtype), mask=row_ok[:, None])
    plgpu.store(lse_ref.at[pl.ds(q_lo, bq)], lse, mask=row_ok)


# Every kernel's grid is (row blocks, B, heads); axis 1 is the batch, axis 2 a (possibly virtual) head.
def _head_spec(S: int, D: int):
    """BlockSpec of one head's [S, D] rows of a [B, S, H, D] array, head = grid axis 2."""
    return pl.BlockSpec((None, S, None, D), lambda r, b, h: (b, 0, h, 0))


def _kv_spec(S: int, D: int, per_kv: int):
    """BlockSpec of K or V [B, S, Hkv, D] when grid axis 2 runs over `per_kv` programs per KV head."""
    def index(r, b, h):
        return (b, 0, lax.div(h, per_kv) if per_kv > 1 else h, 0)

    return pl.BlockSpec((None, S, None, D), index)


def _segment_operands(qseg, kseg, S: int, *, rows_are_queries: bool, b_rows: int, b_cols: int):
    """(BlockSpecs of q ids, kv ids and per-row-block ranges, the ranges array); all None without segments."""
    if qseg is None:
        return [None, None, None], None
    row_ids, col_ids = (qseg, kseg) if rows_are_queries else (kseg, qseg)
    rng = _segment_block_ranges(row_ids, col_ids, S, b_rows, b_cols)
    ids_spec = pl.BlockSpec((None, S), lambda r, b, h: (b, 0))
    return [ids_spec, ids_spec, pl.BlockSpec((None, 2, rng.shape[-1]), lambda r, b, h: (b, 0, 0))], rng


def _block_operands(blk, S: int, *, rows_are_queries: bool, b_rows: int, b_cols: int):
    """(BlockSpecs of the image block ids and of the per-row-block reach, the reach array); all None without
    block ids."""
    if blk is None:
        return [None, None], None
    if rows_are_queries:
        ext = _image_reach_forward(blk, S, b_rows, b_cols)
    else:
        ext = _image_reach_backward(blk, S, b_rows, b_cols)
    return [pl.BlockSpec((None, S), lambda r, b, h: (b, 0)),
            pl.BlockSpec((None, ext.shape[-1]), lambda r, b, h: (b, 0))], ext


def _fwd_call(q, k, v, qseg, kseg, blk, st: _Static):
    B, S, Hq, D = q.shape
    G = st.groups
    kb = _clamp_blocks(st.config.fwd, S)
    bq, bk = kb.block_q, kb.block_k
    grid = (cdiv(S, bq), B, Hq)
    seg_specs, rng = _segment_operands(qseg, kseg, S, rows_are_queries=True, b_rows=bq, b_cols=bk)
    blk_specs, ext = _block_operands(blk, S, rows_are_queries=True, b_rows=bq, b_cols=bk)
    in_specs = [_head_spec(S, D), _kv_spec(S, D, G), _kv_spec(S, D, G), *seg_specs, *blk_specs]
    out_specs = [_head_spec(S, D), pl.BlockSpec((None, None, S), lambda i, b, h: (b, h, 0))]
    out_shape = [
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct((B, Hq, S), jnp.float32),
    ]
    return pl.pallas_call(
        functools.partial(_fwd_kernel, st=st, bq=bq, bk=bk),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(num_warps=kb.num_warps, num_stages=kb.num_stages),
        interpret=st.interpret,
        name="flash_attention_fwd",
    )(q, k, v, qseg, kseg, rng, blk, ext)


# ------------------------------------------------------------------------------------------ dK/dV kernel
def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kseg_ref, rng_ref, blk_ref, ext_ref,
                 dk_ref, dv_ref, *, st: _Static, bq: int, bk: int, groups: int):
    # q_ref/do_ref: [S, G, D] (the `groups` query heads this program sums over); lse_ref/delta_ref: [G, S];
    # k/v: [S, D].
    S = st.seq_len
    G = groups
    kj = pl.program_id(0)
    k_lo = kj * bk
    kpos = k_lo + jnp.arange(bk)
    ragged_k = S % bk != 0
    k = _load_rows(k_ref, k_lo, bk, S, ragged_k)
    v = _load_rows(v_ref, k_lo, bk, S, ragged_k)
    kseg = None
    if kseg_ref is not None:
        kseg = _load_rows(kseg_ref, k_lo, bk, S, ragged_k)[:, None]
    kblk = None
    if blk_ref is not None:
        kblk = _load_rows(blk_ref, k_lo, bk, S, ragged_k, other=-1)[:, None]
    ranges = _extend_lo(_q_ranges_for_kv_block(k_lo, st, bq, bk), ext_ref, kj)
    ranges = _clamp_to_segments(ranges, rng_ref, kj)

    def head_loop(g, carry):
        def body(qi, carry, masked: bool):
            dk, dv = carry
            q_lo = qi * bq
            qpos = q_lo + jnp.arange(bq)
            q = _load_rows(q_ref, q_lo, bq, S, masked, head=g)
            do = _load_rows(do_ref, q_lo, bq, S, masked, head=g)
            lse = _load_rows(lse_ref, q_lo, bq, S, masked, head=g)
            delta = _load_rows(delta_ref, q_lo, bq, S, masked, head=g)
            s_t, t_t = _scores(plgpu.dot(k, q, trans_b=True), st)  # [bk, bq]: keys x queries
            qseg = None
            if qseg_ref is not None:
                qseg = _load_rows(qseg_ref, q_lo, bq, S, masked)[None, :]
            qblk = None
            if masked and blk_ref is not None:
                qblk = _load_rows(blk_ref, q_lo, bq, S, True, other=-1)[None, :]
            keep = _mask(qpos[None, :], kpos[:, None], qseg, kseg, st, positions=masked, check_q=True,
                         check_k=False, qblk=qblk, kblk=kblk if masked else None)
            if keep is not None:
                s_t = jnp.where(keep, s_t, -jnp.inf)
            p_t = _exp2(s_t - lse[None, :], st)
            dv = dv + plgpu.dot(p_t.astype(do.dtype), do)
            dp_t = plgpu.dot(v, do, trans_b=True)
            ds_t = p_t * (dp_t - delta[None, :])
            if t_t is not None:
                ds_t = ds_t * (1.0 - t_t * t_t)
            dk = dk + plgpu.dot(ds_t.astype(q.dtype), q)
            return dk, dv

        return _loop_ranges(ranges, body, carry)

    d = k.shape[-1]
    carry = (jnp.zeros((bk, d), jnp.float32), jnp.zeros((bk, d), jnp.float32))
    if G == 1:
        carry = head_loop(jnp.int32(0), carry)
    else:
        carry = lax.fori_loop(0, G, head_loop, carry)
    dk, dv = carry
    dk = dk * st.scale
    row_ok = (kpos < S)[:, None]
    plgpu.store(dk_ref.at[pl.ds(k_lo, bk)], dk.astype(dk_ref.dtype), mask=row_ok)
    plgpu.store(dv_ref.at[pl.ds(k_lo, bk)], dv.astype(dv_ref.dtype), mask=row_ok)


def _num_sms() -> int:
    try:
        dev = jax.devices()[0]
        if dev.platform == "gpu":
            return int(getattr(dev, "core_count", 0) or 132)
    except Exception:  # noqa: BLE001 - no device info: assume an H100/H200-sized GPU
        pass
    return 132


def dkdv_head_split(groups: int, batch: int, kv_heads: int, kv_blocks: int, requested: int = 0) -> int:
    """How many programs share one KV block's query-head group in the dK/dV kernel.

    With few KV heads (GQA) and short sequences, one program per (KV block, KV head) leaves SMs idle and the
    causal imbalance (the first KV block sees every query block) sets the time; splitting the group over
    n programs (partial dK/dV summed afterwards by XLA) restores parallelism. `requested` > 0 forces n.
    """
    if requested:
        if groups % requested:
            raise ValueError(f"dkdv_split {requested} must divide the group size {groups}")
        return requested
    # The smallest split that gives 8 programs per SM: in the split sweeps (bench/attention.py; BENCHMARKS.md,
    # "Flash attention") the largest split tried was the fastest, or within noise of it, at every shape.
    target = 8 * _num_sms()
    for n in range(1, groups + 1):
        if groups % n == 0 and kv_blocks * batch * kv_heads * n >= target:
            return n
    return groups


def _dkdv_call(q, k, v, do, lse, delta, qseg, kseg, blk, st: _Static):
    B, S, Hq, D = q.shape
    Hkv = k.shape[2]
    kb = _clamp_blocks(st.config.dkdv, S)
    bq, bk = kb.block_q, kb.block_k
    nk = cdiv(S, bk)
    split = dkdv_head_split(st.groups, B, Hkv, nk, st.config.dkdv_split)
    gc = st.groups // split  # query heads per program
    grid = (nk, B, Hkv * split)  # axis 2: "virtual" KV head h = kv_head * split + chunk

    group_spec = pl.BlockSpec((None, S, gc, D), lambda j, b, h: (b, 0, h, 0))
    kv_spec = _kv_spec(S, D, split)
    stat_spec = pl.BlockSpec((None, gc, S), lambda j, b, h: (b, h, 0))
    seg_specs, rng = _segment_operands(qseg, kseg, S, rows_are_queries=False, b_rows=bk, b_cols=bq)
    blk_specs, ext = _block_operands(blk, S, rows_are_queries=False, b_rows=bk, b_cols=bq)
    in_specs = [group_spec, kv_spec, kv_spec, group_spec, stat_spec, stat_spec, *seg_specs, *blk_specs]
    out_shape = jax.ShapeDtypeStruct((B, S, Hkv * split, D), k.dtype)
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, st=st, bq=bq, bk=bk, groups=gc),
        grid=grid,
        in_specs=in_specs,
        out_specs=[_head_spec(S, D), _head_spec(S, D)],
        out_shape=[out_shape, out_shape],
        compiler_params=compiler_params(num_warps=kb.num_warps, num_stages=kb.num_stages),
        interpret=st.interpret,
        name="flash_attention_dkdv",
    )(q, k, v, do, lse, delta, qseg, kseg, rng, blk, ext)
    if split > 1:  # sum the partial gradients of each KV head's query-head chunks
        def fold(x):
            return x.reshape(B, S, Hkv, split, D).sum(axis=3, dtype=jnp.float32).astype(k.dtype)

        dk, dv = fold(dk), fold(dv)
    return dk, dv


# ------------------------------------------------------------------------------------------ dQ kernel
def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kseg_ref, rng_ref, blk_ref, ext_ref,
               dq_ref, *, st: _Static, bq: int, bk: int):
    S = st.seq_len
    nq = cdiv(S, bq)
    qi = (nq - 1) - pl.program_id(0)
    q_lo = qi * bq
    qpos = q_lo + jnp.arange(bq)
    ragged_q = S % bq != 0
    q = _load_rows(q_ref, q_lo, bq, S, ragged_q)
    do = _load_rows(do_ref, q_lo, bq, S, ragged_q)
    lse = _load_rows(lse_ref, q_lo, bq, S, ragged_q)
    delta = _load_rows(delta_ref, q_lo, bq, S, ragged_q)
    qseg = None
    if qseg_ref is not None:
        qseg = _load_rows(qseg_ref, q_lo, bq, S, ragged_q)[:, None]
    qblk = None
    if blk_ref is not None:
        qblk = _load_rows(blk_ref, q_lo, bq, S, ragged_q, other=-1)[:, None]

    def body(kj, dq, masked: bool):
        k, v, s, t = _kv_block_scores(q, qpos, qseg, qblk, k_ref, v_ref, kseg_ref, blk_ref, kj * bk, bk, st,
                                      masked)
        p = _exp2(s - lse[:, None], st)
        dp = plgpu.dot(do, v, trans_b=True)
        ds = p * (dp - delta[:, None])
        if t is not None:
            ds = ds * (1.0 - t * t)
        return dq + plgpu.dot(ds.astype(k.dtype), k)

    d = q.shape[-1]
    dq = jnp.zeros((bq, d), jnp.float32)
    ranges = _extend_hi(_kv_ranges_for_q_block(q_lo, st, bq, bk), ext_ref, qi)
    ranges = _clamp_to_segments(ranges, rng_ref, qi)
    dq = _loop_ranges(ranges, body, dq) * st.scale
    plgpu.store(dq_ref.at[pl.ds(q_lo, bq)], dq.astype(dq_ref.dtype), mask=(qpos < S)[:, None])


def _dq_call(q, k, v, do, lse, delta, qseg, kseg, blk, st: _Static):
    B, S, Hq, D = q.shape
    G = st.groups
    kb = _clamp_blocks(st.config.dq, S)
    bq, bk = kb.block_q, kb.block_k
    grid = (cdiv(S, bq), B, Hq)
    q_spec = _head_spec(S, D)
    kv_spec = _kv_spec(S, D, G)
    stat_spec = pl.BlockSpec((None, None, S), lambda i, b, h: (b, h, 0))
    seg_specs, rng = _segment_operands(qseg, kseg, S, rows_are_queries=True, b_rows=bq, b_cols=bk)
    blk_specs, ext = _block_operands(blk, S, rows_are_queries=True, b_rows=bq, b_cols=bk)
    in_specs = [q_spec, kv_spec, kv_spec, q_spec, stat_spec, stat_spec, *seg_specs, *blk_specs]
    return pl.pallas_call(
        functools.partial(_dq_kernel, st=st, bq=bq, bk=bk),
        grid=grid,
        in_specs=in_specs,
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=compiler_params(num_warps=kb.num_warps, num_stages=kb.num_stages),
        interpret=st.interpret,
        name="flash_attention_dq",
    )(q, k, v, do, lse, delta, qseg, kseg, rng, blk, ext)


# ------------------------------------------------------------------------------------------ custom_vjp
def _delta(o, do):
    """rowsum(dO * O) in float32, laid out [B, Hq, S] like the log-sum-exp (one fused XLA reduction)."""
    d = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    return jnp.transpose(d, (0, 2, 1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(q, k, v, qseg, kseg, blk, st: _Static):
    return _fwd_call(q, k, v, qseg, kseg, blk, st)[0]


def _flash_fwd(q, k, v, qseg, kseg, blk, st: _Static):
    o, lse = _fwd_call(q, k, v, qseg, kseg, blk, st)
    # named so that a remat policy can keep (or offload) them and skip this forward in the backward pass
    o, lse = checkpoint_name(o, "flash_out"), checkpoint_name(lse, "flash_lse")
    return o, (q, k, v, qseg, kseg, blk, o, lse)


def _flash_bwd(st: _Static, res, do):
    q, k, v, qseg, kseg, blk, o, lse = res
    do = do.astype(q.dtype)
    delta = _delta(o, do)
    dk, dv = _dkdv_call(q, k, v, do, lse, delta, qseg, kseg, blk, st)
    dq = _dq_call(q, k, v, do, lse, delta, qseg, kseg, blk, st)
    return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ------------------------------------------------------------------------------------------ public API
def _prepare(q, k, v, *, causal, segment_ids, sliding_window, softcap, sm_scale, interpret, config,
             block_ids=None):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"expected q, k, v of rank 4 [B, S, H, D], got {q.shape}, {k.shape}, {v.shape}")
    B, S, Hq, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[1] != S or k.shape[3] != D:
        raise ValueError(f"k and v must be [B, S, Hkv, D] matching q {q.shape}; got {k.shape}, {v.shape}")
    Hkv = k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    if D not in (16, 32, 64, 128, 256):
        raise ValueError(f"head_dim {D} is not supported (a power of two, 16..256)")
    if not (q.dtype == k.dtype == v.dtype) or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    window = None
    if sliding_window is not None:
        window = int(sliding_window)
        if window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        if window >= S:  # i - j < S always holds: the window masks nothing
            window = None
    qseg = kseg = None
    if segment_ids is not None:
        if isinstance(segment_ids, (tuple, list)):
            qseg, kseg = segment_ids
        else:
            qseg = kseg = segment_ids
        qseg = jnp.asarray(qseg).astype(jnp.int32)
        kseg = jnp.asarray(kseg).astype(jnp.int32)
        if qseg.shape != (B, S) or kseg.shape != (B, S):
            raise ValueError(f"segment_ids must be [B, S] = {(B, S)}, got {qseg.shape}, {kseg.shape}")
    blk = None
    if block_ids is not None:
        blk = jnp.asarray(block_ids)
        if blk.shape != (B, S) or not jnp.issubdtype(blk.dtype, jnp.integer):
            raise ValueError(f"block_ids must be integer [B, S] = {(B, S)}, got {blk.dtype} {blk.shape}")
        # Without causal masking every key is visible already: the blocks add nothing.
        blk = blk.astype(jnp.int32) if causal else None
    scale = float(1.0 / math.sqrt(D)) if sm_scale is None else float(sm_scale)
    cap = None if softcap is None else float(softcap)
    if cap is not None and not cap > 0:
        raise ValueError(f"softcap must be > 0, got {softcap}")
    if config is None:
        config = get_config(S, q.dtype, D)
    if config.fast_tanh and jnp.dtype(q.dtype) == jnp.float32:
        config = dataclasses.replace(config, fast_tanh=False)
    st = _Static(
        seq_len=S, groups=Hq // Hkv, causal=bool(causal), window=window, softcap=cap, scale=scale,
        interpret=resolve_interpret(interpret), config=config,
    )
    return qseg, kseg, blk, st


def flash_attention(q, k, v, *, causal=True, segment_ids=None, sliding_window=None, softcap=None,
                    sm_scale=None, interpret=None, block_ids=None):
    """Fused attention: softmax(mask(softcap(q k^T * sm_scale))) v with GQA, differentiable in q, k, v.

    Args:
      q: [B, S, Hq, D]; k, v: [B, S, Hkv, D], Hq a multiple of Hkv; one floating dtype; D a power of two
        (64, 128, 256 are tuned). Query head h reads KV head h // (Hq // Hkv).
      causal: query i attends key j only if j <= i.
      segment_ids: [B, S] int ids; tokens attend only to keys with an equal id (packing, right padding).
        A pair (q_ids, kv_ids) masks queries and keys with separate ids: a query whose id no key has is
        fully masked and gets a zero output and zero gradients.
      sliding_window: int w >= 1: query i attends key j only if i - j < w (HF Mistral / Gemma 2; with
        causal=False keys after the query stay visible, as in `unsloth_jax.ops.attention_mask`).
      softcap: float c: scores become c * tanh(scores / c) before masking (Gemma 2).
      sm_scale: score scale, default 1/sqrt(D).
      interpret: None -> Pallas interpret mode unless running on a GPU.
      block_ids: [B, S] int, bidirectional blocks on top of the causal mask (Gemma 3's image tokens, ids from
        `unsloth_jax.models.vision.image_block_ids`): -1 for ordinary tokens, an id >= 0 shared by the tokens
        of one block. Query i also attends key j > i when block_ids[i] == block_ids[j] >= 0; the window and
        segment conditions still apply (`unsloth_jax.ops.attention_mask`'s block_ids). Not differentiated.
        Ignored when causal=False (every key is visible already).
    Returns:
      [B, S, Hq, D] in q.dtype.
    """
    return flash_attention_with_config(
        q, k, v, None, causal=causal, segment_ids=segment_ids, sliding_window=sliding_window,
        softcap=softcap, sm_scale=sm_scale, interpret=interpret, block_ids=block_ids)


def flash_attention_with_config(q, k, v, config: FlashConfig | None, *, causal=True, segment_ids=None,
                                sliding_window=None, softcap=None, sm_scale=None, interpret=None,
                                block_ids=None):
    """`flash_attention` with an explicit launch configuration (None: the table's); for tests and sweeps."""
    qseg, kseg, blk, st = _prepare(q, k, v, causal=causal, segment_ids=segment_ids,
                                   sliding_window=sliding_window, softcap=softcap, sm_scale=sm_scale,
                                   interpret=interpret, config=config, block_ids=block_ids)
    return _flash(q, k, v, qseg, kseg, blk, st)


__all__ = ["flash_attention", "flash_attention_with_config", "FlashConfig", "KernelBlocks", "get_config",
           "shape_class", "dkdv_head_split"]
