"""Fused linear cross-entropy: mean_t [logsumexp(z_t) - z_t[label_t]] with z = softcap(hidden @ lm_head.T).

Wins: forward+backward 1.58x XLA's chunked loss at Qwen2 [8192, 1536, 151936] and 1.25x at Llama [4096, 4096,
128256], with 0.20 GB of temporaries against 9.96 unfused (BENCHMARKS.md, "Kernels vs XLA, each alone, and what the
train step says", row fused cross-entropy); in the 8B step at 32,768 tokens XLA's loss is 1.1% slower
(BENCHMARKS.md, "Options measured in the step and left off", row cross_entropy=xla). Default
(ops.PALLAS_WINS["cross_entropy"]): bf16 hidden states; XLA's chunked loss (pallas_kernels.reference) else.

Layout: hidden [T, D], lm_head [V, D] -- the embedding layout, so a tied [vocab, hidden] embedding is passed
as is. Every product contracts D of both operands (in-kernel `dot(..., trans_b=True)`, and dot_general
dimension numbers (((1,), (1,)), ((), ())) in XLA): no transposed copy of the embedding is ever made.

Forward kernel (never materialises logits): grid (T tiles, V splits). Each program runs, for its [bt] rows
and its slice of the vocabulary, a loop over [bv]-wide V blocks; each block's logits [bt, bv] come from an
inner loop over D (an ordinary MMA tile), then get softcapped and folded into an online logsumexp (running
max m and sum l) plus the target logit. The per-split partials [S, T] are combined by XLA (tiny), giving
lse [T] and the loss. Memory: O(T * S) floats beyond the inputs.

Backward: the probabilities are recomputed. For a chunk of Tc tokens a second kernel rebuilds each logits
tile and writes dlogits = coef_t * (softmax - onehot) * softcap' directly in the input dtype ([Tc, V], the
only large temporary: Tc is chosen so it stays under `chunk_bytes`, 256 MiB by default); then two XLA (cuBLAS)
products give d_hidden = dlogits @ lm_head and d_lm_head += dlogits.T @ hidden (f32 accumulator), chunk by
chunk in a lax.scan. Peak extra memory: one dlogits chunk (+ the [V, D] f32 accumulator when d_lm_head is
needed).

Skipping d_lm_head: the custom_vjp uses symbolic zeros, so when JAX does not differentiate w.r.t. lm_head
(frozen embedding: lm_head is in the frozen tree, closed over, or stop_gradient'ed) the d_lm_head product
and its [V, D] accumulator are skipped automatically. `lm_head_grad=False` forces the skip (jax.grad
w.r.t. lm_head then returns zeros). The common LoRA case therefore costs 3 big matmuls, not 4.

Labels must be in [0, V) or equal to ignore_index. The mean is over tokens whose label != ignore_index;
0.0 with zero gradients when all are ignored. Result is float32.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from pallas_kernels._common import (cdiv, compiler_params, full_spec, grouped_pid, load, load_tile, next_pow2, pl,
                                    plgpu, range_mask, resolve_interpret, store_tile)

__all__ = ["cross_entropy", "CEConfig", "CONFIGS", "pick_config"]

_INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class CEConfig:
    """Block sizes (powers of two). fwd: [bt, bv] logits tiles, D step bd, V split over programs so that the
    grid has about `target_programs` programs. bwd: [bwd_bt, bwd_bv] tiles of dlogits, D step bwd_bd,
    programs ordered in groups of `bwd_group` T tiles (each lm_head tile is read once per group)."""

    bt: int = 64
    bv: int = 128
    bd: int = 64
    warps: int = 4
    stages: int = 3
    target_programs: int = 1056
    bwd_bt: int = 128
    bwd_bv: int = 128
    bwd_bd: int = 64
    bwd_warps: int = 8
    bwd_stages: int = 3
    bwd_group: int = 32
    chunk_bytes: int = 256 * 2**20


# Keyed by (shape class, dtype name, D); shape class "large" when T >= 1024 else "small".
# Filled from `python bench/kernels_matmul.py --sweep` on the GPU.
CONFIGS: dict[tuple[str, str, int], CEConfig] = {
    ("large", "bfloat16", 1536): CEConfig(),
    ("large", "bfloat16", 2304): CEConfig(),
    ("large", "bfloat16", 4096): CEConfig(),
    ("small", "bfloat16", 1536): CEConfig(bt=32, target_programs=528),
    ("small", "bfloat16", 2304): CEConfig(bt=32, target_programs=528),
    ("small", "bfloat16", 4096): CEConfig(bt=32, target_programs=528),
    ("large", "float32", 1536): CEConfig(bt=32, bv=64, bd=32, bwd_bt=64, bwd_bv=64, bwd_bd=32, bwd_warps=4),
    ("large", "float32", 2304): CEConfig(bt=32, bv=64, bd=32, bwd_bt=64, bwd_bv=64, bwd_bd=32, bwd_warps=4),
    ("large", "float32", 4096): CEConfig(bt=32, bv=64, bd=32, bwd_bt=64, bwd_bv=64, bwd_bd=32, bwd_warps=4),
}
_DEFAULT = CEConfig()


def pick_config(t: int, d: int, v: int, dtype) -> CEConfig:
    """Table lookup for T tokens, hidden size D, vocabulary V (unused) and `dtype`, with fallbacks to D=4096 and
    the "large" class, then the default."""
    del v
    cls = "large" if t >= 1024 else "small"
    name = jnp.dtype(dtype).name
    for key in ((cls, name, d), ("large", name, d), (cls, name, 4096), ("large", name, 4096)):
        if key in CONFIGS:
            return CONFIGS[key]
    return _DEFAULT


def _softcap(acc, softcap):
    """Returns (z, t) with z = softcap * tanh(acc / softcap) and t the tanh (None without softcap)."""
    if softcap is None:
        return acc, None
    t = jnp.tanh(acc * (1.0 / softcap))
    return softcap * t, t


# ----------------------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------------------

def _logits_tile(h_ref, w_ref, t0, v0, rmask, cmask, *, D, bt, bv, bd):
    """f32 [bt, bv] tile of hidden[t0:t0+bt] . lm_head[v0:v0+bv] (contracting D)."""
    d_ragged = D % bd != 0

    def body(i, acc):
        d0 = i * bd
        dmask = range_mask(d0, bd, D, d_ragged)
        hb = load_tile(h_ref, t0, bt, d0, bd, rmask, dmask)
        wb = load_tile(w_ref, v0, bv, d0, bd, cmask, dmask)
        return acc + plgpu.dot(hb, wb, trans_b=True)

    return lax.fori_loop(0, cdiv(D, bd), body, jnp.zeros((bt, bv), jnp.float32))


def _fwd_kernel(h_ref, w_ref, lab_ref, m_ref, l_ref, zl_ref, *, T, V, D, bt, bv, bd, v_per_split, softcap):
    pid_t, pid_s = pl.program_id(0), pl.program_id(1)
    t0 = pid_t * bt
    rmask = range_mask(t0, bt, T, T % bt != 0)
    labels = load(lab_ref.at[pl.ds(t0, bt)], rmask, other=-1)
    v_start = pid_s * v_per_split
    n_blocks = lax.div(jnp.minimum(v_per_split, V - v_start) + (bv - 1), bv)   # >= 1 (no split is empty)
    v_ragged = V % bv != 0

    def body(j, carry):
        m, l, zl = carry
        v0 = v_start + j * bv
        cols = v0 + jnp.arange(bv)
        cmask = (cols < V) if v_ragged else None
        acc = _logits_tile(h_ref, w_ref, t0, v0, rmask, cmask, D=D, bt=bt, bv=bv, bd=bd)
        z, _ = _softcap(acc, softcap)
        if v_ragged:
            z = jnp.where(cmask[None, :], z, -jnp.inf)
        zl = zl + jnp.sum(jnp.where(cols[None, :] == labels[:, None], z, 0.0), axis=1)
        m_new = jnp.maximum(m, jnp.max(z, axis=1))
        l = l * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - m_new[:, None]), axis=1)
        return m_new, l, zl

    init = (jnp.full((bt,), -jnp.inf, jnp.float32), jnp.zeros((bt,), jnp.float32), jnp.zeros((bt,), jnp.float32))
    m, l, zl = lax.fori_loop(0, n_blocks, body, init)
    plgpu.store(m_ref.at[pl.ds(t0, bt)], m, mask=rmask)
    plgpu.store(l_ref.at[pl.ds(t0, bt)], l, mask=rmask)
    plgpu.store(zl_ref.at[pl.ds(t0, bt)], zl, mask=rmask)


def _dlogits_kernel(h_ref, w_ref, lab_ref, lse_ref, coef_ref, o_ref, *, T, V, D, bt, bv, bd, group, softcap):
    n_t, n_v = cdiv(T, bt), cdiv(V, bv)
    pid_t, pid_v = grouped_pid(pl.program_id(0), n_t, n_v, group)
    t0, v0 = pid_t * bt, pid_v * bv
    rmask = range_mask(t0, bt, T, T % bt != 0)
    cmask = range_mask(v0, bv, V, V % bv != 0)
    labels = load(lab_ref.at[pl.ds(t0, bt)], rmask, other=-1)
    lse = load(lse_ref.at[pl.ds(t0, bt)], rmask, other=0.0)
    coef = load(coef_ref.at[pl.ds(t0, bt)], rmask, other=0.0)
    acc = _logits_tile(h_ref, w_ref, t0, v0, rmask, cmask, D=D, bt=bt, bv=bv, bd=bd)
    z, t = _softcap(acc, softcap)
    cols = v0 + jnp.arange(bv)
    p = jnp.exp(z - lse[:, None])
    d = (p - jnp.where(cols[None, :] == labels[:, None], 1.0, 0.0)) * coef[:, None]
    if softcap is not None:
        d = d * (1.0 - t * t)
    store_tile(o_ref, t0, bt, v0, bv, d.astype(o_ref.dtype), rmask, cmask)


# ----------------------------------------------------------------------------------------------------------
# wrappers
# ----------------------------------------------------------------------------------------------------------

def _clip(b: int, n: int) -> int:
    return min(b, max(16, next_pow2(n)))


def _forward_stats(hidden, lm_head, labels, softcap, cfg: CEConfig, interpret):
    """Returns (lse [T] f32, target logit [T] f32)."""
    T, D = hidden.shape
    V = lm_head.shape[0]
    bt, bv, bd = _clip(cfg.bt, T), _clip(cfg.bv, V), _clip(cfg.bd, D)
    n_t, n_vb = cdiv(T, bt), cdiv(V, bv)
    splits = max(1, min(n_vb, cdiv(cfg.target_programs, n_t)))
    v_per_split = cdiv(n_vb, splits) * bv
    splits = cdiv(V, v_per_split)          # every split holds at least one valid column
    kernel = functools.partial(_fwd_kernel, T=T, V=V, D=D, bt=bt, bv=bv, bd=bd, v_per_split=v_per_split,
                               softcap=softcap)
    part = jax.ShapeDtypeStruct((splits, T), jnp.float32)
    part_spec = pl.BlockSpec((None, T), lambda t, s: (s, 0))
    m, l, zl = pl.pallas_call(
        kernel,
        grid=(n_t, splits),
        in_specs=[full_spec(hidden.shape), full_spec(lm_head.shape), full_spec(labels.shape)],
        out_specs=[part_spec, part_spec, part_spec],
        out_shape=[part, part, part],
        compiler_params=compiler_params(num_warps=cfg.warps, num_stages=cfg.stages),
        interpret=interpret,
        name="ce_fwd",
    )(hidden, lm_head, labels)
    m_all = jnp.max(m, axis=0)
    lse = m_all + jnp.log(jnp.sum(l * jnp.exp(m - m_all[None, :]), axis=0))
    return lse, jnp.sum(zl, axis=0)


def _loss_from_stats(lse, zl, labels, ignore_index):
    valid = labels != ignore_index
    n = jnp.sum(valid).astype(jnp.float32)
    return jnp.sum(jnp.where(valid, lse - zl, 0.0)) / jnp.maximum(n, 1.0), n


def _dlogits(h, lm_head, labels, lse, coef, softcap, cfg: CEConfig, interpret):
    T, D = h.shape
    V = lm_head.shape[0]
    bt, bv, bd = _clip(cfg.bwd_bt, T), _clip(cfg.bwd_bv, V), _clip(cfg.bwd_bd, D)
    n_t, n_v = cdiv(T, bt), cdiv(V, bv)
    kernel = functools.partial(_dlogits_kernel, T=T, V=V, D=D, bt=bt, bv=bv, bd=bd,
                               group=max(1, min(cfg.bwd_group, n_t)), softcap=softcap)
    return pl.pallas_call(
        kernel,
        grid=(n_t * n_v,),
        in_specs=[full_spec(h.shape), full_spec(lm_head.shape), full_spec(labels.shape),
                  full_spec(lse.shape), full_spec(coef.shape)],
        out_specs=full_spec((T, V)),
        out_shape=jax.ShapeDtypeStruct((T, V), h.dtype),
        compiler_params=compiler_params(num_warps=cfg.bwd_warps, num_stages=cfg.bwd_stages),
        interpret=interpret,
        name="ce_dlogits",
    )(h, lm_head, labels, lse, coef)


def _chunk_tokens(T: int, V: int, itemsize: int, cfg: CEConfig) -> int:
    """Tokens per backward chunk: dlogits [tc, V] stays under cfg.chunk_bytes and in int32 offsets; prefer a
    multiple of the row block that divides T (no padding copy) when one lies in [tc_max / 2, tc_max]."""
    bt = _clip(cfg.bwd_bt, T)
    tc_max = max(bt, (cfg.chunk_bytes // (V * itemsize)) // bt * bt)
    tc_max = min(tc_max, max(bt, (_INT32_MAX // V) // bt * bt))
    if tc_max >= T:
        return T
    for tc in range(tc_max, tc_max // 2 - 1, -bt):
        if tc > 0 and T % tc == 0:
            return tc
    return tc_max


def _backward(hidden, lm_head, labels, lse, g, softcap, ignore_index, want_dw, cfg, interpret):
    T, D = hidden.shape
    V = lm_head.shape[0]
    valid = labels != ignore_index
    n = jnp.maximum(jnp.sum(valid).astype(jnp.float32), 1.0)
    coef = jnp.where(valid, g.astype(jnp.float32) / n, 0.0)
    precision = lax.Precision.HIGHEST if hidden.dtype == jnp.float32 else None

    def one_chunk(h_c, y_c, lse_c, coef_c):
        dl = _dlogits(h_c, lm_head, y_c, lse_c, coef_c, softcap, cfg, interpret)      # [Tc, V]
        dh = lax.dot_general(dl, lm_head, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32).astype(hidden.dtype)
        dw = None
        if want_dw:
            dw = lax.dot_general(dl, h_c, (((0,), (0,)), ((), ())), precision=precision,
                                 preferred_element_type=jnp.float32)
        return dh, dw

    tc = _chunk_tokens(T, V, jnp.dtype(hidden.dtype).itemsize, cfg)
    n_chunks = cdiv(T, tc)
    if n_chunks == 1:
        dh, dw = one_chunk(hidden, labels, lse, coef)
    else:
        pad = n_chunks * tc - T
        h_p = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(n_chunks, tc, D)
        y_p = jnp.pad(labels, (0, pad), constant_values=ignore_index).reshape(n_chunks, tc)
        lse_p = jnp.pad(lse, (0, pad)).reshape(n_chunks, tc)
        coef_p = jnp.pad(coef, (0, pad)).reshape(n_chunks, tc)

        def step(acc, xs):
            dh_c, dw_c = one_chunk(*xs)
            return (acc + dw_c if want_dw else acc), dh_c

        acc0 = jnp.zeros((V, D), jnp.float32) if want_dw else jnp.zeros((), jnp.float32)
        dw, dh = lax.scan(step, acc0, (h_p, y_p, lse_p, coef_p))
        dh = dh.reshape(n_chunks * tc, D)[:T]
        if not want_dw:
            dw = None
    return dh, (None if dw is None else dw.astype(lm_head.dtype))


# ----------------------------------------------------------------------------------------------------------
# custom_vjp (symbolic zeros: d_lm_head is only computed when lm_head is being differentiated)
# ----------------------------------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _ce(hidden, lm_head, labels, softcap, ignore_index, lm_head_grad, cfg, interpret):
    lse, zl = _forward_stats(hidden, lm_head, labels, softcap, cfg, interpret)
    return _loss_from_stats(lse, zl, labels, ignore_index)[0]


def _ce_fwd(hidden, lm_head, labels, softcap, ignore_index, lm_head_grad, cfg, interpret):
    want_dw = bool(lm_head_grad) and bool(lm_head.perturbed)
    h, w, y = hidden.value, lm_head.value, labels.value
    lse, zl = _forward_stats(h, w, y, softcap, cfg, interpret)
    loss = _loss_from_stats(lse, zl, y, ignore_index)[0]
    return loss, (h, w, y, lse, () if want_dw else None)


def _ce_bwd(softcap, ignore_index, lm_head_grad, cfg, interpret, res, g):
    h, w, y, lse, marker = res
    want_dw = marker is not None
    if isinstance(g, SymbolicZero):
        return None, None, None
    dh, dw = _backward(h, w, y, lse, g, softcap, ignore_index, want_dw, cfg, interpret)
    return dh, dw, None


_ce.defvjp(_ce_fwd, _ce_bwd, symbolic_zeros=True)


def cross_entropy(hidden, lm_head, labels, softcap=None, ignore_index=-100, *, interpret: bool | None = None,
                  lm_head_grad: bool = True, config: CEConfig | None = None):
    """Mean cross-entropy of softmax(softcap(hidden @ lm_head.T)) against labels, fused and chunked.

    hidden [T, D] (leading dims are flattened), lm_head [V, D] (embedding layout, contracted on D),
    labels [T] int (already shifted; ignore_index marks tokens that do not count). softcap: Gemma 2's
    cap * tanh(z / cap) on the logits, or None. Returns a float32 scalar.
    Gradients: d_hidden always; d_lm_head only when JAX differentiates w.r.t. lm_head and
    lm_head_grad=True (lm_head_grad=False forces zeros and skips the [V, D] product). `config` overrides the
    block-size table (benchmark sweep). lm_head is cast to hidden.dtype for the MMA.
    """
    interpret = resolve_interpret(interpret)
    D = hidden.shape[-1]
    hidden = hidden.reshape(-1, D)
    labels = labels.reshape(-1).astype(jnp.int32)
    if lm_head.ndim != 2 or lm_head.shape[1] != D or labels.shape[0] != hidden.shape[0]:
        raise ValueError(f"cross_entropy: bad shapes hidden{hidden.shape} lm_head{lm_head.shape} labels{labels.shape}")
    lm_head = lm_head.astype(hidden.dtype)
    if config is None:
        config = pick_config(hidden.shape[0], D, lm_head.shape[0], hidden.dtype)
    softcap = None if softcap is None else float(softcap)
    return _ce(hidden, lm_head, labels, softcap, int(ignore_index), bool(lm_head_grad), config, interpret)
