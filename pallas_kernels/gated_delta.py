"""The gated delta rule (Qwen3.5's linear attention) in chunks, forward and backward, as Pallas kernels for the
Triton lowering.

Wins: not measured on a GPU yet (bench/gated_delta_bench.py, the `gateddelta` stage of bench/gpu_session.sh, times it
against the chunked XLA path and the token scan). Default: off (ops.PALLAS_WINS["gated_delta"] is False: XLA's
chunked form, pallas_kernels.gated_delta_chunked); tested in interpret mode, and run when asked
(`ops.set_impl("gated_delta", "pallas")` or UNSLOTH_JAX_IMPL=gated_delta=pallas).

`gated_delta_rule(q, k, v, g, beta, initial_state, *, scale, chunk, block_v, interpret)`: the interface and result
of pallas_kernels.reference.gated_delta_rule (q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv];
initial_state [B, Hv, Dk, Dv] or None -> (o in v.dtype, final state float32)), with the math of
pallas_kernels.gated_delta_chunked (its docstring has the chunk equations and the segment-start rule, RESET_BELOW).

Kernels (grid (Dv blocks, B, Hv); a value column's recurrence never reads another column, so each program owns a
[Dk, BV] slice of one head's state; value head h reads query / key head h // (Hv // Hk); no atomics):
- forward: one program loops over the chunks, the state slice in registers: per chunk the decays, the strictly lower
  A, T = (I + A)^-1 by forward substitution over the chunk's rows (each step one masked row reduction and one
  row-times-matrix product), W = T beta e K, U = T beta V - W S, the outputs and the next state. The training
  forward also stores each chunk's start state (float32 [B, Hv, N * Dk, Dv]) for the backward.
- backward: one program walks the chunks backwards carrying dS (the gradient of the chunk's end state), recomputes
  the chunk's T, W, U from the stored start state, and writes dq, dk, dg, dbeta (partials over the Dv blocks, and
  per value head: XLA sums them, then over each GQA group), dv and, at the end, d initial_state.
Ragged T: masked loads read zeros past the end (g = 0, beta = 0 leave the state unchanged) and masked stores skip
those rows. Dk and Dv are zero-padded to powers of two (at least 16) by the wrapper: exact, padded columns stay 0.
All math is float32; on the GPU the tile products are TF32 for 16-bit inputs and full float32 for float32 inputs.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import (cdiv, compiler_params, load, load_tile, next_pow2, pl, plgpu, range_mask,
                                    resolve_interpret, store_tile)
from pallas_kernels.gated_delta_chunked import DEFAULT_CHUNK, RESET_BELOW, check_inputs

FLOAT32_CHUNK = 32  # the defaults for float32 inputs (shared memory; see gated_delta_rule)
FLOAT32_BLOCK_V = 64


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static about one call (hashable: the custom_vjp's nondiff argument)."""

    seq_len: int
    chunk: int
    block_v: int
    groups: int  # Hv // Hk
    scale: float
    has_init: bool
    interpret: bool
    ieee: bool  # float32 inputs: full-precision float32 dots (else TF32 on the GPU)
    num_warps: int = 4
    num_stages: int = 1

    @property
    def n_chunks(self) -> int:
        return cdiv(self.seq_len, self.chunk)

    @property
    def ragged(self) -> bool:
        return self.seq_len % self.chunk != 0


# ------------------------------------------------------------------------------------------ in-kernel pieces
def _iota2(c: int):
    """(row index [C, 1], column index [1, C]) int32."""
    idx = jnp.arange(c, dtype=jnp.int32)
    return idx[:, None], idx[None, :]


def _decays(g, c: int):
    """A chunk's log decays g [C] -> (gamma [C, C], e [C], r [C], e_last scalar, reset [C] bool): as
    gated_delta_chunked.chunk_decays, the cumulative sums as masked row reductions."""
    row, col = _iota2(c)
    lower = row >= col
    reset = g < RESET_BELOW
    big_g = jnp.sum(jnp.where(lower, jnp.where(reset, 0.0, g)[None, :], 0.0), axis=1)
    seg = jnp.sum(jnp.where(lower, reset.astype(jnp.int32)[None, :], 0), axis=1)
    same = lower & (seg[:, None] == seg[None, :])
    gamma = jnp.where(same, jnp.exp(jnp.where(same, big_g[:, None] - big_g[None, :], 0.0)), 0.0)
    last = jnp.arange(c, dtype=jnp.int32) == c - 1
    g_last = jnp.sum(jnp.where(last, big_g, 0.0))
    seg_last = jnp.sum(jnp.where(last, seg, 0))
    first = seg == 0
    e = jnp.where(first, jnp.exp(jnp.where(first, big_g, 0.0)), 0.0)
    in_last = seg == seg_last
    r = jnp.where(in_last, jnp.exp(jnp.where(in_last, g_last - big_g, 0.0)), 0.0)
    e_last = jnp.sum(jnp.where(last, e, 0.0))
    return gamma, e, r, e_last, reset


def _unit_lower_inverse(a, c: int):
    """(I + a)^-1 of a strictly lower [C, C] float32 tile: forward substitution, row i = e_i - a_i (I + a)^-1
    (rows >= i still hold the identity, which a_i, zero from column i on, never reads)."""
    row, col = _iota2(c)
    eye = jnp.where(row == col, 1.0, 0.0).astype(jnp.float32)

    def step(i, t):
        a_i = jnp.sum(jnp.where(row == i, a, 0.0), axis=0)  # [C]: row i of a, indexed by column j
        t_i = jnp.where(jnp.arange(c, dtype=jnp.int32) == i, 1.0, 0.0) - jnp.sum(a_i[:, None] * t, axis=0)
        return jnp.where(row == i, t_i[None, :], t)

    return lax.fori_loop(1, c, step, eye)


def _dot(a, b, st: _Static, trans_a=False, trans_b=False):
    """float32 tile product: TF32 on the GPU, or full float32 (IEEE) for float32 inputs."""
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=lax.Precision.HIGHEST if st.ieee else None)


class _Chunk:
    """One chunk's loaded inputs and recomputed intra-chunk quantities (shared by the two kernels)."""

    def __init__(self, q_ref, k_ref, v_ref, g_ref, b_ref, ci, st: _Static, dk: int, bv: int):
        c = st.chunk
        self.st = st
        self.lo = lo = ci * c
        self.rows = range_mask(lo, c, st.seq_len, st.ragged)
        f32 = jnp.float32
        self.q = load_tile(q_ref, lo, c, 0, dk, self.rows).astype(f32) * st.scale
        self.k = load_tile(k_ref, lo, c, 0, dk, self.rows).astype(f32)
        self.v = load_tile(v_ref, lo, c, 0, bv, self.rows).astype(f32)
        self.g = load(g_ref.at[pl.ds(lo, c)], self.rows)
        self.beta = load(b_ref.at[pl.ds(lo, c)], self.rows)
        self.gamma, self.e, self.r, self.e_last, self.reset = _decays(self.g, c)
        row, col = _iota2(c)
        self.strict = row > col
        self.kk = _dot(self.k, self.k, st, trans_b=True)
        a = jnp.where(self.strict, self.gamma * self.beta[:, None] * self.kk, 0.0)
        self.t = _unit_lower_inverse(a, c)
        self.w = _dot(self.t, (self.beta * self.e)[:, None] * self.k, st)  # [C, Dk]
        self.ut = _dot(self.t, self.beta[:, None] * self.v, st)  # [C, BV]
        self.qk = _dot(self.q, self.k, st, trans_b=True)
        self.p = self.gamma * self.qk  # lower triangle

    def updates(self, state):
        """U = U~ - W S [C, BV]."""
        return self.ut - _dot(self.w, state, self.st)


# ------------------------------------------------------------------------------------------ forward kernel
def _fwd_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, s0_ref, o_ref, sT_ref, states_ref, *, st: _Static, dk: int,
                bv: int):
    if st.has_init:
        state = plgpu.load(s0_ref)
    else:
        state = jnp.zeros((dk, bv), jnp.float32)

    def body(ci, state):
        ch = _Chunk(q_ref, k_ref, v_ref, g_ref, b_ref, ci, st, dk, bv)
        if states_ref is not None:
            store_tile(states_ref, ci * dk, dk, 0, bv, state)
        u = ch.updates(state)
        o = ch.e[:, None] * _dot(ch.q, state, st) + _dot(ch.p, u, st)
        store_tile(o_ref, ch.lo, st.chunk, 0, bv, o.astype(o_ref.dtype), ch.rows)
        return ch.e_last * state + _dot(ch.r[:, None] * ch.k, u, st, trans_a=True)

    state = lax.fori_loop(0, st.n_chunks, body, state)
    plgpu.store(sT_ref, state)


# Grid (Dv blocks j, batch b, value head h).
def _qk_spec(t: int, dk: int, groups: int):
    return pl.BlockSpec((None, t, None, dk), lambda j, b, h: (b, 0, lax.div(h, groups) if groups > 1 else h, 0))


def _v_spec(t: int, bv: int):
    return pl.BlockSpec((None, t, None, bv), lambda j, b, h: (b, 0, h, j))


def _row_spec(t: int):
    """[B, Hv, T] per-token scalars (g, beta)."""
    return pl.BlockSpec((None, None, t), lambda j, b, h: (b, h, 0))


def _state_spec(rows: int, bv: int):
    """[B, Hv, rows, Dv] states (rows = Dk, or N * Dk for the per-chunk start states)."""
    return pl.BlockSpec((None, None, rows, bv), lambda j, b, h: (b, h, 0, j))


def _fwd_call(q, k, v, g, beta, s0, st: _Static, save_states: bool):
    b, t, hv, dv = v.shape
    dk = q.shape[-1]
    bv = st.block_v
    n = st.n_chunks
    out_shape = [jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct((b, hv, dk, dv), jnp.float32)]
    out_specs = [_v_spec(t, bv), _state_spec(dk, bv)]
    if save_states:
        out_shape.append(jax.ShapeDtypeStruct((b, hv, n * dk, dv), jnp.float32))
        out_specs.append(_state_spec(n * dk, bv))
    in_specs = [_qk_spec(t, dk, st.groups), _qk_spec(t, dk, st.groups), _v_spec(t, bv), _row_spec(t), _row_spec(t),
                _state_spec(dk, bv) if st.has_init else None]

    def kernel(*refs):
        if not save_states:
            refs = refs + (None,)
        _fwd_kernel(*refs, st=st, dk=dk, bv=bv)

    outs = pl.pallas_call(
        kernel,
        grid=(dv // bv, b, hv),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(num_warps=st.num_warps, num_stages=st.num_stages),
        interpret=st.interpret,
        name="gated_delta_fwd",
    )(q, k, v, g, beta, s0)
    return tuple(outs) if save_states else (outs[0], outs[1], None)


# ------------------------------------------------------------------------------------------ backward kernel
def _bwd_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, states_ref, do_ref, dsT_ref,
                dq_ref, dk_ref, dv_ref, dg_ref, db_ref, ds0_ref, *, st: _Static, dk: int, bv: int):
    c = st.chunk
    row, col = _iota2(c)
    n = st.n_chunks

    def body(i, ds):
        ci = n - 1 - i
        ch = _Chunk(q_ref, k_ref, v_ref, g_ref, b_ref, ci, st, dk, bv)
        s0 = load_tile(states_ref, ci * dk, dk, 0, bv)
        do = load_tile(do_ref, ch.lo, c, 0, bv, ch.rows).astype(jnp.float32)
        u = ch.updates(s0)
        # S1 = e_last S0 + (r K)^T U
        kr = ch.r[:, None] * ch.k
        d_u = _dot(kr, ds, st) + _dot(ch.p, do, st, trans_a=True)
        d_kr = _dot(u, ds, st, trans_b=True)
        d_glast = ch.e_last * jnp.sum(s0 * ds)
        dr = jnp.sum(d_kr * ch.k, axis=1)
        d_k = ch.r[:, None] * d_kr
        d_big_g = -ch.r * dr
        d_glast += jnp.sum(ch.r * dr)
        # O = e Q S0 + P U, P = gamma * (Q K^T)
        d_p = ch.gamma * _dot(do, u, st, trans_b=True)
        d_big_g += ch.e * jnp.sum(do * _dot(ch.q, s0, st), axis=1)
        d_q = ch.e[:, None] * _dot(do, s0, st, trans_b=True) + _dot(d_p, ch.k, st)
        z = d_p * ch.qk
        d_big_g += jnp.sum(z, axis=1) - jnp.sum(z, axis=0)
        d_k += _dot(d_p, ch.q, st, trans_a=True)
        # U = U~ - W S0; [W | U~] = T [beta e K | beta V]
        d_w = -_dot(d_u, s0, st, trans_b=True)
        ds_prev = ch.e_last * ds + _dot(ch.e[:, None] * ch.q, do, st, trans_a=True) - _dot(ch.w, d_u, st, trans_a=True)
        d_kb = _dot(ch.t, d_w, st, trans_a=True)
        d_vb = _dot(ch.t, d_u, st, trans_a=True)
        d_a = -jnp.where(ch.strict, _dot(d_kb, ch.w, st, trans_b=True) + _dot(d_vb, ch.ut, st, trans_b=True), 0.0)
        d_v = ch.beta[:, None] * d_vb
        d_beta = jnp.sum(d_vb * ch.v, axis=1)
        d_be = jnp.sum(d_kb * ch.k, axis=1)
        d_k += (ch.beta * ch.e)[:, None] * d_kb
        d_beta += ch.e * d_be
        d_big_g += ch.beta * ch.e * d_be
        # A = strict(gamma * beta_i K K^T)
        d_ag = d_a * ch.gamma
        d_ak = d_ag * ch.kk
        d_beta += jnp.sum(d_ak, axis=1)
        y = d_ak * ch.beta[:, None]
        d_big_g += jnp.sum(y, axis=1) - jnp.sum(y, axis=0)
        d_kk = d_ag * ch.beta[:, None]
        d_k += _dot(d_kk, ch.k, st) + _dot(d_kk, ch.k, st, trans_a=True)
        # G = cumsum(g) within the chunk (a segment start's own g counts as 0)
        d_big_g += jnp.where(jnp.arange(c, dtype=jnp.int32) == c - 1, d_glast, 0.0)
        d_g = jnp.sum(jnp.where(row >= col, d_big_g[:, None], 0.0), axis=0)
        d_g = jnp.where(ch.reset, 0.0, d_g)
        store_tile(dq_ref, ch.lo, c, 0, dk, d_q * st.scale, ch.rows)
        store_tile(dk_ref, ch.lo, c, 0, dk, d_k, ch.rows)
        store_tile(dv_ref, ch.lo, c, 0, bv, d_v.astype(dv_ref.dtype), ch.rows)
        plgpu.store(dg_ref.at[pl.ds(ch.lo, c)], d_g, mask=ch.rows)
        plgpu.store(db_ref.at[pl.ds(ch.lo, c)], d_beta, mask=ch.rows)
        return ds_prev

    ds = lax.fori_loop(0, n, body, plgpu.load(dsT_ref))
    plgpu.store(ds0_ref, ds)


def _bwd_call(q, k, v, g, beta, states, do, dsT, st: _Static):
    b, t, hv, dv = v.shape
    dk = q.shape[-1]
    bv = st.block_v
    nv = dv // bv
    n = st.n_chunks
    per_head = pl.BlockSpec((None, None, t, None, dk), lambda j, b, h: (j, b, 0, h, 0))
    scalars = pl.BlockSpec((None, None, None, t), lambda j, b, h: (j, b, h, 0))
    f32 = jnp.float32
    return pl.pallas_call(
        functools.partial(_bwd_kernel, st=st, dk=dk, bv=bv),
        grid=(nv, b, hv),
        in_specs=[_qk_spec(t, dk, st.groups), _qk_spec(t, dk, st.groups), _v_spec(t, bv), _row_spec(t),
                  _row_spec(t), _state_spec(n * dk, bv), _v_spec(t, bv), _state_spec(dk, bv)],
        out_specs=[per_head, per_head, _v_spec(t, bv), scalars, scalars, _state_spec(dk, bv)],
        out_shape=[jax.ShapeDtypeStruct((nv, b, t, hv, dk), f32), jax.ShapeDtypeStruct((nv, b, t, hv, dk), f32),
                   jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct((nv, b, hv, t), f32),
                   jax.ShapeDtypeStruct((nv, b, hv, t), f32), jax.ShapeDtypeStruct((b, hv, dk, dv), f32)],
        compiler_params=compiler_params(num_warps=st.num_warps, num_stages=st.num_stages),
        interpret=st.interpret,
        name="gated_delta_bwd",
    )(q, k, v, g, beta, states, do, dsT)


# ------------------------------------------------------------------------------------------ custom_vjp
# Operands here are the kernels' layout: q, k [B, T, Hk, DK] and v [B, T, Hv, DV] (DK, DV padded to powers of
# two), g and beta float32 [B, Hv, T], s0 float32 [B, Hv, DK, DV] (zeros when there is none: its gradient is
# then dropped by the wrapper).
@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _gdn(q, k, v, g, beta, s0, st: _Static):
    o, final, _ = _fwd_call(q, k, v, g, beta, s0 if st.has_init else None, st, save_states=False)
    return o, final


def _gdn_fwd(q, k, v, g, beta, s0, st: _Static):
    o, final, states = _fwd_call(q, k, v, g, beta, s0 if st.has_init else None, st, save_states=True)
    return (o, final), (q, k, v, g, beta, states)


def _gdn_bwd(st: _Static, res, cts):
    q, k, v, g, beta, states = res
    do, dfinal = cts
    dq, dk, dv, dg, dbeta, ds0 = _bwd_call(q, k, v, g, beta, states, do, dfinal, st)
    b, t, hk, d = q.shape

    def per_key_head(x):  # [nv, B, T, Hv, DK] -> [B, T, Hk, DK]: sum the Dv blocks and each GQA group
        return x.sum(0).reshape(b, t, hk, st.groups, d).sum(3).astype(q.dtype)

    return per_key_head(dq), per_key_head(dk), dv, dg.sum(0), dbeta.sum(0), ds0


_gdn.defvjp(_gdn_fwd, _gdn_bwd)


def _pad_last(x, size: int):
    return x if x.shape[-1] == size else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def gated_delta_rule(q, k, v, g, beta, initial_state=None, *, scale: float, chunk: int | None = None,
                     block_v: int | None = None, interpret: bool | None = None):
    """The gated delta rule as Pallas kernels (the math of pallas_kernels.reference.gated_delta_rule).

    q, k [B, T, Hk, Dk] (L2-normalized by the caller); v [B, T, Hv, Dv] with Hv a multiple of Hk; g (log decay,
    <= 0; -1e4 at a segment start) and beta [B, T, Hv]; initial_state [B, Hv, Dk, Dv] or None (zeros).
    -> (o [B, T, Hv, Dv] in v.dtype, final state [B, Hv, Dk, Dv] float32); differentiable in q, k, v, g, beta and
    initial_state. chunk: tokens per chunk (a power of two >= 16; default 64, 32 for float32 inputs; at most the power
    of two >= T); block_v: state columns per program (a power of two >= 16 dividing the padded Dv; default all of
    them, at most 64 for float32 inputs); interpret: None = on the CPU."""
    check_inputs(q, k, v, g, beta, initial_state)
    # float32 tiles take twice the shared memory: at Dk = Dv = 128 the 16-bit defaults (64, 128) ask an H100 for
    # 368 KiB against its 227; (32, 64) fits
    wide = jnp.dtype(v.dtype).itemsize > 2
    chunk = (FLOAT32_CHUNK if wide else DEFAULT_CHUNK) if chunk is None else int(chunk)
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"gated_delta_rule: chunk must be a power of two >= 16; got {chunk}")
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    chunk = min(chunk, max(16, next_pow2(t)))
    pdk, pdv = max(16, next_pow2(dk)), max(16, next_pow2(dv))
    block_v = (min(pdv, FLOAT32_BLOCK_V) if wide else pdv) if block_v is None else int(block_v)
    if block_v < 16 or block_v & (block_v - 1) or pdv % block_v:
        raise ValueError(f"gated_delta_rule: block_v must be a power of two >= 16 dividing {pdv} (Dv={dv} padded); "
                         f"got {block_v}")
    st = _Static(seq_len=t, chunk=chunk, block_v=block_v, groups=hv // hk, scale=float(scale),
                 has_init=initial_state is not None, interpret=resolve_interpret(interpret),
                 ieee=jnp.dtype(v.dtype) == jnp.float32, num_warps=4 if pdk * block_v <= 64 * 64 else 8)
    f32 = jnp.float32
    if initial_state is None:
        s0 = jnp.zeros((b, hv, pdk, pdv), f32)
    else:
        s0 = jnp.pad(initial_state.astype(f32), ((0, 0), (0, 0), (0, pdk - dk), (0, pdv - dv)))
    rows = [jnp.swapaxes(x.astype(f32), 1, 2) for x in (g, beta)]  # [B, Hv, T]
    o, final = _gdn(_pad_last(q, pdk), _pad_last(k, pdk), _pad_last(v, pdv), *rows, s0, st)
    return o[..., :dv], final[:, :, :dk, :dv]
