"""The gated delta rule (Qwen3.5's linear attention) with the chunk-local work in XLA and the sequential
inter-chunk state pass, forward and backward, as Pallas kernels for the Triton lowering.

Wins: with bf16 inputs at head dim 128 (Qwen3.5's), forward + backward, against the chunked XLA form
(pallas_kernels.gated_delta_chunked) and in the Qwen3.5-9B LoRA step (BENCHMARKS.md, "Qwen3.5's per-kind layer
stacks and the gated delta kernel, 2026-12-06 (one H100 80GB)"). Default: there only (ops.PALLAS_WINS["gated_delta"]: bf16 v with
Dv = 128); float16, float32 and other head dims run the chunked XLA form unless asked (`ops.set_impl("gated_delta",
"pallas")` or UNSLOTH_JAX_IMPL=gated_delta=pallas).

`gated_delta_rule(q, k, v, g, beta, initial_state, *, scale, chunk, block_v, interpret)`: the interface and result
of pallas_kernels.reference.gated_delta_rule (q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv];
initial_state [B, Hv, Dk, Dv] or None -> (o in v.dtype, final state float32)), with the math of
pallas_kernels.gated_delta_chunked (its docstring has the chunk equations and the segment-start rule, RESET_BELOW).

The split: gated_delta_chunked.chunk_terms computes every chunk's local terms at once in batched XLA products
(the decays, the UT/WY transform's W and U~, eq = scale e Q, p = scale lower(Gamma Q K^T), kr = r K, e_last), and jax
differentiates it. Only the recurrence over chunks runs here, under a custom_vjp:
- forward, grid (Dv blocks, B, Hv): one program owns a [Dk, BV] slice of one head's state in registers (a value
  column's recurrence never reads another column) and walks the chunks: U = U~ - W S; O = eq S + p U;
  S <- e_last S + kr^T U. O goes straight to [B, T, Hv, Dv]; the training forward also stores each chunk's start
  state (float32 [B, Hv, N * Dk, Dv]) for the backward.
- backward, same grid: walks the chunks backwards carrying dS (the gradient of the chunk's end state), recomputes U
  from the stored start state and writes dU~ = kr dS + p^T dO, dW = -dU~ S^T, d eq = dO S^T, dp = dO U^T,
  dkr = U dS^T, d e_last = sum(S * dS) (the last four partial over the Dv blocks: XLA sums them), then
  dS <- e_last dS + eq^T dO - W^T dU~, and at the end d initial_state.
Every tile product is one `dot` of [C, Dk] x [Dk, BV], [C, C] x [C, BV] or their transposes, float32 operands
(TF32 on the GPU for 16-bit inputs, full float32 for float32 inputs), no atomics. The kernels see no ragged edge:
T is padded to whole chunks (g = 0, beta = 0 leave the state unchanged), Dk and Dv to powers of two >= 16 (zero
columns stay zero), the chunk count to a power of two in the e_last vector.

Tiles (default_tiles): chunk 64 and the widest Dv block whose shared-memory bound (smem_bytes) fits an H100's
227 KiB per block: (64, 64) at Qwen3.5's Dk = Dv = 128 ((64, 128) is at the edge of the limit). float32 inputs
run IEEE float32 dots (FMA, not tensor cores: correct, not fast), whose operands live in registers: their chunk is
at most 32, (32, 64) there, as chunk 64 spills heavily. chunk, block_v and num_warps are arguments, for
bench/gated_delta_bench.py's --sweep.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import compiler_params, load_tile, next_pow2, pl, plgpu, resolve_interpret, store_tile
from pallas_kernels.gated_delta_chunked import check_inputs, chunk_terms

SMEM_LIMIT = 227 * 1024  # shared memory per block on an H100


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static about one call (hashable: the custom_vjp's nondiff argument)."""

    n_chunks: int
    chunk: int
    block_v: int
    out_dtype: str  # o's dtype (v's)
    interpret: bool
    ieee: bool  # float32 inputs: full-precision float32 dots (else TF32 on the GPU)
    num_warps: int = 4
    num_stages: int = 1


def smem_bytes(chunk: int, dk: int, block_v: int) -> int:
    """An upper bound on the shared memory of the backward kernel (the larger of the two) for padded Dk and a Dv
    block: every float32 tile that is an operand of a product in one chunk step, each counted once, as if all were
    staged at the same time (S, dS [Dk, BV]; W, eq, kr [C, Dk]; p [C, C]; dO, U, dU~ [C, BV]). Triton reuses
    buffers, so it allocates less (checked by compiling the kernels' Triton IR for sm_90a at Dk = 128)."""
    return 4 * (2 * dk * block_v + 3 * chunk * dk + chunk * chunk + 3 * chunk * block_v)


def default_tiles(t: int, dk: int, dv: int, ieee: bool = False) -> tuple[int, int]:
    """(chunk, block_v) for padded head dims dk, dv: the first of chunk 64, 32, 16 (at most 32 for IEEE float32
    dots, `ieee`; at most the power of two >= T) with a block_v dividing dv whose smem_bytes fit SMEM_LIMIT, the
    widest such block_v."""
    cap = min(32 if ieee else 64, max(16, next_pow2(t)))
    for chunk in sorted({min(c, cap) for c in (64, 32, 16)}, reverse=True):
        block_v = dv
        while block_v > 16 and smem_bytes(chunk, dk, block_v) > SMEM_LIMIT:
            block_v //= 2
        if smem_bytes(chunk, dk, block_v) <= SMEM_LIMIT:
            return chunk, block_v
    return 16, 16


def _dot(a, b, st: _Static, trans_a=False, trans_b=False):
    """float32 tile product: TF32 on the GPU, or full float32 (IEEE) for float32 inputs."""
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=lax.Precision.HIGHEST if st.ieee else None)


def _pick(vec, i, n: int):
    """vec[i] of a [n] vector at a traced index (a masked reduction: no scalar loads)."""
    return jnp.sum(jnp.where(jnp.arange(n, dtype=jnp.int32) == i, vec, 0.0))


def _chunk_tile(ref, ci, st: _Static, cols: int):
    """Chunk ci's rows [C, cols] of a chunk-major [N * C, cols] ref, as float32. Each tile is loaded just before
    its first product, so fewer tiles are live at once (register pressure)."""
    return load_tile(ref, ci * st.chunk, st.chunk, 0, cols).astype(jnp.float32)


# ------------------------------------------------------------------------------------------ forward kernel
def _fwd_kernel(w_ref, ut_ref, eq_ref, p_ref, kr_ref, el_ref, s0_ref, o_ref, sT_ref, states_ref, *, st: _Static,
                dk: int, bv: int):
    c, n = st.chunk, st.n_chunks
    el_vec = plgpu.load(el_ref)
    np_ = el_vec.shape[0]

    def body(ci, state):
        if states_ref is not None:
            store_tile(states_ref, ci * dk, dk, 0, bv, state)
        u = _chunk_tile(ut_ref, ci, st, bv) - _dot(_chunk_tile(w_ref, ci, st, dk), state, st)
        o = _dot(_chunk_tile(eq_ref, ci, st, dk), state, st) + _dot(_chunk_tile(p_ref, ci, st, c), u, st)
        store_tile(o_ref, ci * c, c, 0, bv, o.astype(o_ref.dtype))
        return _pick(el_vec, ci, np_) * state + _dot(_chunk_tile(kr_ref, ci, st, dk), u, st, trans_a=True)

    state = lax.fori_loop(0, n, body, plgpu.load(s0_ref))
    plgpu.store(sT_ref, state)


# Grid (Dv blocks j, batch b, value head h). Chunk-major operands are [B, Hv, N * C, D] (one program reads its
# head's rows, contiguous); o and dO are [B, N * C, Hv, Dv] (the layout the caller wants).
def _rows_spec(rows: int, cols: int, split_v: bool = False):
    """[B, Hv, rows, cols] -> this program's [rows, cols] (split_v: its Dv block of `cols` columns)."""
    if split_v:
        return pl.BlockSpec((None, None, rows, cols), lambda j, b, h: (b, h, 0, j))
    return pl.BlockSpec((None, None, rows, cols), lambda j, b, h: (b, h, 0, 0))


def _out_spec(tp: int, bv: int):
    return pl.BlockSpec((None, tp, None, bv), lambda j, b, h: (b, 0, h, j))


def _vec_spec(np_: int):
    return pl.BlockSpec((None, None, np_), lambda j, b, h: (b, h, 0))


def _in_specs(tp: int, c: int, dk: int, bv: int, np_: int):
    """Specs of (w, ut, eq, p, kr, el)."""
    return [_rows_spec(tp, dk), _rows_spec(tp, bv, True), _rows_spec(tp, dk), _rows_spec(tp, c), _rows_spec(tp, dk),
            _vec_spec(np_)]


def _fwd_call(w, ut, eq, p, kr, el, s0, st: _Static, save_states: bool):
    b, hv, tp, dk = w.shape
    dv = ut.shape[-1]
    bv, c, n = st.block_v, st.chunk, st.n_chunks
    np_ = el.shape[-1]
    out_shape = [jax.ShapeDtypeStruct((b, tp, hv, dv), jnp.dtype(st.out_dtype)),
                 jax.ShapeDtypeStruct((b, hv, dk, dv), jnp.float32)]
    out_specs = [_out_spec(tp, bv), _rows_spec(dk, bv, True)]
    if save_states:
        out_shape.append(jax.ShapeDtypeStruct((b, hv, n * dk, dv), jnp.float32))
        out_specs.append(_rows_spec(n * dk, bv, True))

    def kernel(*refs):
        if not save_states:
            refs = refs + (None,)
        _fwd_kernel(*refs, st=st, dk=dk, bv=bv)

    outs = pl.pallas_call(
        kernel,
        grid=(dv // bv, b, hv),
        in_specs=_in_specs(tp, c, dk, bv, np_) + [_rows_spec(dk, bv, True)],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(num_warps=st.num_warps, num_stages=st.num_stages),
        interpret=st.interpret,
        name="gated_delta_state_fwd",
    )(w, ut, eq, p, kr, el, s0)
    return tuple(outs) if save_states else (outs[0], outs[1], None)


# ------------------------------------------------------------------------------------------ backward kernel
def _bwd_kernel(w_ref, ut_ref, eq_ref, p_ref, kr_ref, el_ref, states_ref, do_ref, dsT_ref,
                dw_ref, dut_ref, deq_ref, dp_ref, dkr_ref, del_ref, ds0_ref, *, st: _Static, dk: int, bv: int):
    c, n = st.chunk, st.n_chunks
    el_vec = plgpu.load(el_ref)
    np_ = el_vec.shape[0]
    idx = jnp.arange(np_, dtype=jnp.int32)

    def body(i, carry):
        ds, d_el = carry
        ci = n - 1 - i
        s = load_tile(states_ref, ci * dk, dk, 0, bv)
        do = _chunk_tile(do_ref, ci, st, bv)
        d_u = _dot(_chunk_tile(kr_ref, ci, st, dk), ds, st) + _dot(_chunk_tile(p_ref, ci, st, c), do, st, trans_a=True)
        store_tile(dut_ref, ci * c, c, 0, bv, d_u)
        store_tile(dw_ref, ci * c, c, 0, dk, -_dot(d_u, s, st, trans_b=True))
        store_tile(deq_ref, ci * c, c, 0, dk, _dot(do, s, st, trans_b=True))
        w = _chunk_tile(w_ref, ci, st, dk)
        u = _chunk_tile(ut_ref, ci, st, bv) - _dot(w, s, st)
        store_tile(dp_ref, ci * c, c, 0, c, _dot(do, u, st, trans_b=True))
        store_tile(dkr_ref, ci * c, c, 0, dk, _dot(u, ds, st, trans_b=True))
        d_el = d_el + jnp.where(idx == ci, jnp.sum(s * ds), 0.0)
        ds = (_pick(el_vec, ci, np_) * ds - _dot(w, d_u, st, trans_a=True)
              + _dot(_chunk_tile(eq_ref, ci, st, dk), do, st, trans_a=True))
        return ds, d_el

    ds, d_el = lax.fori_loop(0, n, body, (plgpu.load(dsT_ref), jnp.zeros((np_,), jnp.float32)))
    plgpu.store(ds0_ref, ds)
    plgpu.store(del_ref, d_el)


def _bwd_call(w, ut, eq, p, kr, el, states, do, dsT, st: _Static):
    b, hv, tp, dk = w.shape
    dv = ut.shape[-1]
    bv, c, n = st.block_v, st.chunk, st.n_chunks
    nv = dv // bv
    np_ = el.shape[-1]

    def partial_spec(cols: int):  # [nv, B, Hv, rows, cols]: one slab per Dv block, summed by the caller
        return pl.BlockSpec((None, None, None, tp, cols), lambda j, b, h: (j, b, h, 0, 0))

    f32 = jnp.float32
    per_block = lambda cols: jax.ShapeDtypeStruct((nv, b, hv, tp, cols), f32)  # noqa: E731
    return pl.pallas_call(
        functools.partial(_bwd_kernel, st=st, dk=dk, bv=bv),
        grid=(nv, b, hv),
        in_specs=_in_specs(tp, c, dk, bv, np_) + [_rows_spec(n * dk, bv, True), _out_spec(tp, bv),
                                                  _rows_spec(dk, bv, True)],
        out_specs=[partial_spec(dk), _rows_spec(tp, bv, True), partial_spec(dk), partial_spec(c), partial_spec(dk),
                   pl.BlockSpec((None, None, None, np_), lambda j, b, h: (j, b, h, 0)), _rows_spec(dk, bv, True)],
        out_shape=[per_block(dk), jax.ShapeDtypeStruct(ut.shape, f32), per_block(dk), per_block(c), per_block(dk),
                   jax.ShapeDtypeStruct((nv, b, hv, np_), f32), jax.ShapeDtypeStruct((b, hv, dk, dv), f32)],
        compiler_params=compiler_params(num_warps=st.num_warps, num_stages=st.num_stages),
        interpret=st.interpret,
        name="gated_delta_state_bwd",
    )(w, ut, eq, p, kr, el, states, do, dsT)


# ------------------------------------------------------------------------------------------ custom_vjp
# Operands: w, eq, kr float32 [B, Hv, N * C, DK], ut [B, Hv, N * C, DV], p [B, Hv, N * C, C], el [B, Hv, NP]
# (NP = next_pow2(N), zero-padded), s0 [B, Hv, DK, DV] -> (o [B, N * C, Hv, DV] in out_dtype, final state).
@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _state_pass(w, ut, eq, p, kr, el, s0, st: _Static):
    o, final, _ = _fwd_call(w, ut, eq, p, kr, el, s0, st, save_states=False)
    return o, final


def _state_pass_fwd(w, ut, eq, p, kr, el, s0, st: _Static):
    o, final, states = _fwd_call(w, ut, eq, p, kr, el, s0, st, save_states=True)
    return (o, final), (w, ut, eq, p, kr, el, states)


def _state_pass_bwd(st: _Static, res, cts):
    w, ut, eq, p, kr, el, states = res
    do, dfinal = cts
    dw, dut, deq, dp, dkr, d_el, ds0 = _bwd_call(w, ut, eq, p, kr, el, states, do, dfinal, st)
    return dw.sum(0), dut, deq.sum(0), dp.sum(0), dkr.sum(0), d_el.sum(0), ds0


_state_pass.defvjp(_state_pass_fwd, _state_pass_bwd)


def _pad_last(x, size: int):
    return x if x.shape[-1] == size else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def gated_delta_rule(q, k, v, g, beta, initial_state=None, *, scale: float, chunk: int | None = None,
                     block_v: int | None = None, num_warps: int | None = None, interpret: bool | None = None):
    """The gated delta rule, its state pass as Pallas kernels (the math of pallas_kernels.reference.gated_delta_rule).

    q, k [B, T, Hk, Dk] (L2-normalized by the caller); v [B, T, Hv, Dv] with Hv a multiple of Hk; g (log decay,
    <= 0; -1e4 at a segment start) and beta [B, T, Hv]; initial_state [B, Hv, Dk, Dv] or None (zeros).
    -> (o [B, T, Hv, Dv] in v.dtype, final state [B, Hv, Dk, Dv] float32); differentiable in q, k, v, g, beta and
    initial_state. chunk: tokens per chunk (a power of two >= 16; at most the power of two >= T); block_v: state
    columns per program (a power of two >= 16 dividing the padded Dv); their defaults: default_tiles;
    num_warps: Triton warps per program (default 8 from a [Dk, BV] state slice of 64 x 64 up, else 4);
    interpret: None = on the CPU."""
    check_inputs(q, k, v, g, beta, initial_state)
    if chunk is not None and (chunk < 16 or chunk & (chunk - 1)):
        raise ValueError(f"gated_delta_rule: chunk must be a power of two >= 16; got {chunk}")
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    pdk, pdv = max(16, next_pow2(dk)), max(16, next_pow2(dv))
    ieee = jnp.dtype(v.dtype) == jnp.float32
    auto_chunk, auto_bv = default_tiles(t, pdk, pdv, ieee)
    chunk = auto_chunk if chunk is None else min(int(chunk), max(16, next_pow2(t)))
    block_v = auto_bv if block_v is None else int(block_v)
    if block_v < 16 or block_v & (block_v - 1) or pdv % block_v:
        raise ValueError(f"gated_delta_rule: block_v must be a power of two >= 16 dividing {pdv} (Dv={dv} padded); "
                         f"got {block_v}")
    terms = chunk_terms(_pad_last(q, pdk), _pad_last(k, pdk), _pad_last(v, pdv), g, beta, scale=scale, chunk=chunk,
                        precision=lax.Precision.HIGHEST if ieee else None)
    if initial_state is None:
        s0 = jnp.zeros((b, hv, pdk, pdv), jnp.float32)
    else:
        s0 = jnp.pad(initial_state.astype(jnp.float32), ((0, 0), (0, 0), (0, pdk - dk), (0, pdv - dv)))
    o, final = state_pass(*terms, s0, out_dtype=v.dtype, block_v=block_v, num_warps=num_warps, interpret=interpret)
    return o[:, :t, :, :dv], final[:, :, :dk, :dv]


def state_pass(w, u_tilde, eq, p, kr, e_last, s0, *, out_dtype, block_v: int, num_warps: int | None = None,
               interpret: bool | None = None):
    """The recurrence over chunks of gated_delta_chunked.chunk_terms' outputs, as the two kernels (differentiable
    in every input): w, eq, kr float32 [B, Hv, N, C, DK], u_tilde [B, Hv, N, C, DV], p [B, Hv, N, C, C], e_last
    [B, Hv, N], s0 float32 [B, Hv, DK, DV] (C, DK, DV powers of two >= 16; block_v dividing DV) ->
    (o [B, N * C, Hv, DV] in out_dtype, final state float32 [B, Hv, DK, DV]). float32 out_dtype: IEEE dots."""
    b, hv, n, c, dk = w.shape
    ieee = jnp.dtype(out_dtype) == jnp.float32
    st = _Static(n_chunks=n, chunk=c, block_v=block_v, out_dtype=jnp.dtype(out_dtype).name,
                 interpret=resolve_interpret(interpret), ieee=bool(ieee),
                 num_warps=int(num_warps) if num_warps else 8 if dk * block_v >= 64 * 64 else 4)
    flat = lambda x: x.reshape(b, hv, n * c, x.shape[-1])  # noqa: E731
    e_last = jnp.pad(e_last, ((0, 0), (0, 0), (0, next_pow2(n) - n)))
    return _state_pass(flat(w), flat(u_tilde), flat(eq), flat(p), flat(kr), e_last, s0, st)
