"""Decode attention over a paged KV cache: one new query token per row, keys and values in page pools.

Wins: the generation engine's decode step on the H200 (BENCHMARKS.md, "Generation engine, 2026-12-04"): with
this kernel and decode_linear, Qwen2-1.5B at 16 rows ran 2.99 ms per step against 4.46 ms with XLA's page gather and slice
copies (the two kernels measured together, not each alone). Default: ops.PALLAS_WINS["paged_attention"] picks it
for 16-bit decoding with head_dim 64, 128 or 256; elsewhere XLA's gather of every page of the table
(pallas_kernels.reference.paged_decode_attention, its ground truth).

    out = paged_decode_attention(q, k_pages, v_pages, block_tables, lengths, scale=hd ** -0.5)

q [B, Hq, D]; k_pages / v_pages [P, BS, Hkv, D] (P pages of BS token slots, one layer's pool); block_tables
[B, MAXB] int32 (row b's token t is in page block_tables[b, t // BS], slot t % BS); lengths [B] int32 (the
row's tokens, the query's own included; 0: an idle row, output 0). Optional: window (a key j is kept when
(length - 1) - j < window, Hugging Face's sliding window), softcap (scores = softcap * tanh(scores / softcap)),
sinks [Hq] (one extra logit per head in the softmax denominator, attending to nothing: gpt-oss).

Design (flash-decoding): grid (row, KV head, split). The G = Hq / Hkv query heads of one KV head are one block
of rows (padded to 16 for the dot, masked), so each key and value is read once for its whole group. A row's
pages in use (ceil(length / BS), minus the pages wholly outside the window) are divided among `splits`
programs; each walks its pages in order (a scalar load of the page id, then the [BS, D] key and value tiles
of its KV head) with an online softmax, and writes its unnormalised output, maximum and sum (float32). A small
XLA reduction combines the splits (and the sinks). Pages past a row's length are never read.

Inference only: no custom_vjp.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import cdiv, compiler_params, full_spec, next_pow2, pl, plgpu, resolve_interpret

__all__ = ["paged_decode_attention", "choose_splits", "TARGET_PROGRAMS"]

#: Programs to aim for (two per SM of an H200) when splitting a row's pages among programs.
TARGET_PROGRAMS = 264
_NEG = -1e30


def choose_splits(rows: int, kv_heads: int, max_pages: int) -> int:
    """Programs per (row, KV head): enough to reach about TARGET_PROGRAMS, at most one per page, a power of 2."""
    want = cdiv(TARGET_PROGRAMS, max(rows * kv_heads, 1))
    return max(1, min(next_pow2(want), next_pow2(max_pages)))


def _scalar(ref, *idx):
    """A scalar int32 read from ref at [..., idx[-1]] (a one-element load, as the Triton lowering wants)."""
    *lead, last = idx
    return plgpu.load(ref.at[(*lead, pl.ds(last, 1))]).reshape(())


def _kernel(len_ref, bt_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, G, GP, D, BS, pages_per_split, scale,
            softcap, window):
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = _scalar(len_ref, b)
    rows = jnp.arange(GP)
    row_ok = rows < G
    q = plgpu.load(q_ref.at[b, pl.ds(h * G, GP), pl.ds(0, D)])  # rows >= G: the next group's or padding
    used = (length + BS - 1) // BS
    first = 0
    if window is not None:
        first = jnp.maximum(length - window, 0) // BS
    start = jnp.maximum(first, s * pages_per_split)
    stop = jnp.minimum(used, (s + 1) * pages_per_split)
    slots = jnp.arange(BS)

    def body(i, carry):
        m, l, acc = carry
        page = _scalar(bt_ref, b, i)
        k = plgpu.load(k_ref.at[page, pl.ds(0, BS), h, pl.ds(0, D)])
        v = plgpu.load(v_ref.at[page, pl.ds(0, BS), h, pl.ds(0, D)])
        scores = plgpu.dot(q, k.T) * scale  # [GP, BS] float32
        if softcap is not None:
            scores = softcap * jnp.tanh(scores / softcap)
        j = i * BS + slots
        keep = j < length
        if window is not None:
            keep = keep & ((length - 1) - j < window)
        scores = jnp.where(keep[None, :], scores, _NEG)
        m_new = jnp.maximum(m, jnp.max(scores, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(scores - m_new[:, None])
        p = jnp.where(keep[None, :], p, 0.0)
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
        return m_new, l, acc

    init = (jnp.full((GP,), _NEG, jnp.float32), jnp.zeros((GP,), jnp.float32), jnp.zeros((GP, D), jnp.float32))
    m, l, acc = lax.fori_loop(start, jnp.maximum(stop, start), body, init)
    plgpu.store(o_ref.at[s, b, pl.ds(h * G, GP), pl.ds(0, D)], acc, mask=row_ok[:, None])
    plgpu.store(m_ref.at[s, b, pl.ds(h * G, GP)], m, mask=row_ok)
    plgpu.store(l_ref.at[s, b, pl.ds(h * G, GP)], l, mask=row_ok)


def paged_decode_attention(q, k_pages, v_pages, block_tables, lengths, *, scale: float, softcap=None, window=None,
                           sinks=None, splits: int | None = None, num_warps: int = 4, interpret=None):
    """Attention of q [B, Hq, D] (bf16, fp16 or fp32) over each row's pages of k_pages / v_pages [P, BS, Hkv, D]
    (the same dtype), block_tables [B, MAXB] int32, lengths [B] int32 (module docstring) -> [B, Hq, D] in
    q's dtype; float32 softmax. splits: programs per (row, KV head) (default `choose_splits`)."""
    interpret = resolve_interpret(interpret)
    B, Hq, D = q.shape
    P, BS, Hkv, Dk = k_pages.shape
    MAXB = block_tables.shape[1]
    if Dk != D or v_pages.shape != k_pages.shape or Hq % Hkv:
        raise ValueError(f"paged_decode_attention: q{q.shape} with pages k{k_pages.shape} v{v_pages.shape}")
    if BS & (BS - 1) or D & (D - 1) or BS < 16 or D < 16:
        raise ValueError(f"paged_decode_attention: page size {BS} and head_dim {D} must be powers of two >= 16")
    G = Hq // Hkv
    GP = max(16, next_pow2(G))
    S = splits or choose_splits(B, Hkv, MAXB)
    pps = cdiv(MAXB, S)
    kernel = functools.partial(_kernel, G=G, GP=GP, D=D, BS=BS, pages_per_split=pps, scale=float(scale),
                               softcap=None if softcap is None else float(softcap),
                               window=None if window is None else int(window))
    # Outputs are padded by GP - G head rows so every program's masked block stays inside the buffer.
    hp = Hq + GP - G
    out_shape = (jax.ShapeDtypeStruct((S, B, hp, D), jnp.float32),
                 jax.ShapeDtypeStruct((S, B, hp), jnp.float32),
                 jax.ShapeDtypeStruct((S, B, hp), jnp.float32))
    qp = jnp.pad(q, ((0, 0), (0, GP - G), (0, 0))) if GP > G else q
    o, m, l = pl.pallas_call(
        kernel, grid=(B, Hkv, S), out_shape=out_shape,
        in_specs=[full_spec((B,)), full_spec(block_tables.shape), full_spec(qp.shape), full_spec(k_pages.shape),
                  full_spec(v_pages.shape)],
        out_specs=[full_spec(s.shape) for s in out_shape],
        compiler_params=compiler_params(num_warps=num_warps, num_stages=1), interpret=interpret,
        name="paged_decode_attention",
    )(lengths.astype(jnp.int32), block_tables.astype(jnp.int32), qp, k_pages, v_pages)
    o, m, l = o[:, :, :Hq], m[:, :, :Hq], l[:, :, :Hq]
    top = jnp.max(m, axis=0)  # [B, Hq]
    if sinks is not None:
        top = jnp.maximum(top, sinks.astype(jnp.float32)[None, :])
    w = jnp.exp(m - top[None])
    denom = jnp.sum(w * l, axis=0)
    if sinks is not None:
        denom = denom + jnp.exp(sinks.astype(jnp.float32)[None, :] - top)
    num = jnp.sum(w[..., None] * o, axis=0)
    out = jnp.where(denom[..., None] > 0, num / jnp.where(denom > 0, denom, 1.0)[..., None], 0.0)
    return jnp.where((lengths > 0)[:, None, None], out, 0.0).astype(q.dtype)
