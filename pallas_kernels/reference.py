"""Plain-jnp twins of every Pallas kernel: the ground truth in tests and the XLA path in `unsloth_jax.ops`.

Each function here computes exactly what its kernel computes (same signature minus `interpret`), written in
the most direct jnp form so XLA fuses it as it likes. Keep one section per kernel module.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

# ---- rms_norm / rope / glu (owned by pallas_kernels/rms_norm.py, rope.py, glu.py) ----


def rms_norm(x, weight, eps=1e-6, offset=0.0):
    """x * rsqrt(mean(x^2, -1) + eps) * (offset + weight); float32 math, output in x.dtype."""
    xf = x.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * rstd * (offset + weight.astype(jnp.float32))).astype(x.dtype)


def rope(q, k, cos, sin):
    """HF rotate-half RoPE: x * cos + rotate_half(x) * sin, rotate_half(x) = concat(-x2, x1).

    q [B, S, Hq, D], k [B, S, Hkv, D], cos/sin [B, S, D]; float32 math, outputs in q/k dtype. cos/sin are
    treated as constants (no gradient flows into them), exactly as in the kernel.
    """
    cos = jax.lax.stop_gradient(cos).astype(jnp.float32)[:, :, None, :]
    sin = jax.lax.stop_gradient(sin).astype(jnp.float32)[:, :, None, :]

    def rot(x):
        xf = x.astype(jnp.float32)
        half = x.shape[-1] // 2
        rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
        return (xf * cos + rotated * sin).astype(x.dtype)

    return rot(q), rot(k)


def swiglu(gate, up):
    """silu(gate) * up; float32 math, output in gate.dtype."""
    g = gate.astype(jnp.float32)
    return (g * jax.nn.sigmoid(g) * up.astype(jnp.float32)).astype(gate.dtype)


def geglu(gate, up, approximate=False):
    """gelu(gate) * up (erf form, or the tanh form when approximate=True); float32 math, output in gate.dtype."""
    g = gate.astype(jnp.float32)
    return (jax.nn.gelu(g, approximate=approximate) * up.astype(jnp.float32)).astype(gate.dtype)


# ---- lora_linear / cross_entropy (owned by pallas_kernels/lora_linear.py, cross_entropy.py) ----


def lora_linear(x, w, a, b, scale):
    """x @ w + scale * (x @ a) @ b with f32 accumulation, output in x.dtype.

    x [..., K], w [K, N] (frozen), a [K, r], b [r, N] (a, b may be f32 master weights: they are used in
    x.dtype). `x @ a` is accumulated in f32 and cast to x.dtype before the second (rank-r) product, exactly
    as the kernel does. Gradients flow to x, a and b as usual; in the train step w sits in the frozen tree,
    so jax never forms its [K, N] gradient.
    """
    f32 = jnp.float32
    dt = x.dtype
    y = jnp.dot(x, w.astype(dt), preferred_element_type=f32)
    xa = jnp.dot(x, a.astype(dt), preferred_element_type=f32)
    y = y + scale * jnp.dot(xa.astype(dt), b.astype(dt), preferred_element_type=f32)
    return y.astype(x.dtype)


def _ce_logits(hidden, lm_head, softcap):
    """f32 logits [T, V] = hidden [T, D] . lm_head [V, D] contracted on D (no transpose is materialised)."""
    z = jax.lax.dot_general(hidden, lm_head, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if softcap is not None:
        z = softcap * jnp.tanh(z / softcap)
    return z


def _ce_token_losses_sum(hidden, lm_head, labels, softcap, ignore_index):
    """Sum over valid tokens of logsumexp(z) - z[label] (f32)."""
    z = _ce_logits(hidden, lm_head, softcap)
    lse = jax.nn.logsumexp(z, axis=-1)
    # Target logit by an iota compare (fuses into the reduction; no gather/scatter in the backward).
    hit = jax.lax.broadcasted_iota(jnp.int32, z.shape, 1) == labels[:, None]
    tgt = jnp.sum(jnp.where(hit, z, 0.0), axis=-1)
    valid = labels != ignore_index
    return jnp.sum(jnp.where(valid, lse - tgt, 0.0))


def cross_entropy_naive(hidden, lm_head, labels, softcap=None, ignore_index=-100):
    """Unchunked reference: materialises the full [T, V] f32 logits. For tests and as the memory baseline."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1).astype(jnp.int32)
    total = _ce_token_losses_sum(hidden, lm_head, labels, softcap, ignore_index)
    n = jnp.sum(labels != ignore_index).astype(jnp.float32)
    return total / jnp.maximum(n, 1.0)


def cross_entropy(hidden, lm_head, labels, softcap=None, ignore_index=-100, chunk_size=1024):
    """Mean token cross-entropy of softmax(hidden @ lm_head.T) against labels, never holding [T, V].

    hidden [T, D] (leading dims are flattened); lm_head [V, D] in the embedding layout (a tied
    [vocab, hidden] embedding is used as is: the product contracts D with dot_general, no transpose);
    labels [T] int (already shifted). softcap c
    applies c * tanh(z / c) to the logits (Gemma 2). Tokens whose label == ignore_index do not count; the
    mean is over the counted tokens (0.0, with zero gradients, when none count).

    Chunked over T (`chunk_size` tokens per chunk, lax.map) with jax.checkpoint per chunk, so the forward
    and the backward each hold one [chunk, V] f32 logits block at a time.
    """
    labels = labels.reshape(-1).astype(jnp.int32)
    n = jnp.sum(labels != ignore_index).astype(jnp.float32)

    @jax.checkpoint
    def chunk_sum(h_c, y_c):
        return _ce_token_losses_sum(h_c, lm_head, y_c, softcap, ignore_index)

    total = jnp.sum(_map_token_chunks(chunk_sum, hidden, labels, chunk_size, ignore_index))
    return total / jnp.maximum(n, 1.0)


def _map_token_chunks(fn, hidden, labels, chunk_size, ignore_index):
    """fn(h_c [c, D], y_c [c]) over chunks of at most chunk_size tokens of hidden [T, D] (leading dims
    flattened) and labels [T]; the last chunk is padded with ignore_index labels. Returns fn's results stacked
    on a leading [n_chunks] axis (lax.map, so one chunk is live at a time)."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1).astype(jnp.int32)
    T, D = hidden.shape
    chunk = int(max(1, min(chunk_size, T)))
    n_chunks = -(-T // chunk)
    pad = n_chunks * chunk - T
    if pad:
        hidden = jnp.pad(hidden, ((0, pad), (0, 0)))
        labels = jnp.pad(labels, (0, pad), constant_values=ignore_index)
    if n_chunks == 1:
        return fn(hidden, labels)[None]
    return jax.lax.map(lambda hy: fn(*hy), (hidden.reshape(n_chunks, chunk, D), labels.reshape(n_chunks, chunk)))


def token_logprobs(hidden, lm_head, labels, softcap=None, temperature=1.0, ignore_index=-100, chunk_size=1024):
    """Per-token log-probabilities log softmax(z / temperature)[label] [T] f32, never holding [T, V].

    The per-token variant of `cross_entropy` (same layout: hidden [T, D], lm_head [V, D], labels [T] already
    shifted; softcap as there, applied before the temperature): preference and RL losses need each token's
    value, not the mean. Tokens whose label == ignore_index get 0.0. Chunked over T like `cross_entropy`
    (lax.map of jax.checkpoint'ed chunks), so the forward and the backward hold one [chunk, V] f32 block.
    No Pallas kernel computes this; it is the XLA path of `unsloth_jax.ops.token_logprobs`.
    """
    T = labels.size

    @jax.checkpoint
    def chunk_logprobs(h_c, y_c):
        z = _ce_logits(h_c, lm_head, softcap)
        if temperature != 1.0:
            z = z / temperature
        lse = jax.nn.logsumexp(z, axis=-1)
        hit = jax.lax.broadcasted_iota(jnp.int32, z.shape, 1) == y_c[:, None]
        tgt = jnp.sum(jnp.where(hit, z, 0.0), axis=-1)
        return jnp.where(y_c != ignore_index, tgt - lse, 0.0)

    return _map_token_chunks(chunk_logprobs, hidden, labels, chunk_size, ignore_index).reshape(-1)[:T]


def token_mean_logits(hidden, lm_head, softcap=None, chunk_size=1024):
    """Mean over the vocabulary of each token's logits [T] f32 (TRL's logits/chosen and logits/rejected are
    means of these), never holding [T, V]: without softcap the mean is linear, hidden @ mean(lm_head); with
    softcap, chunks of [chunk, V] logits as `cross_entropy`. hidden [T, D], lm_head [V, D]. Not differentiated
    (a logged metric)."""
    hidden, lm_head = jax.lax.stop_gradient(hidden), jax.lax.stop_gradient(lm_head)
    if softcap is None:
        return hidden.astype(jnp.float32) @ jnp.mean(lm_head.astype(jnp.float32), axis=0)
    T = hidden.shape[0]
    dummy = jnp.zeros((T,), jnp.int32)
    return _map_token_chunks(lambda h_c, _: jnp.mean(_ce_logits(h_c, lm_head, softcap), axis=-1), hidden, dummy,
                             chunk_size, -100).reshape(-1)[:T]


# ---- attention: flash_attention's twin (pallas_kernels/flash_attention.py) and ops' XLA attention ----
def _attention_keep_mask(seq_len, causal, sliding_window, segment_ids):
    """Boolean keep-mask [B or 1, S, S], or None when nothing is masked."""
    qi = jnp.arange(seq_len)[:, None]
    kj = jnp.arange(seq_len)[None, :]
    keep = None
    if causal:
        keep = kj <= qi
    if sliding_window is not None:
        w = (qi - kj) < int(sliding_window)
        keep = w if keep is None else keep & w
    if keep is not None:
        keep = keep[None]
    if segment_ids is not None:
        if isinstance(segment_ids, (tuple, list)):
            q_ids, kv_ids = segment_ids
        else:
            q_ids = kv_ids = segment_ids
        seg = jnp.asarray(q_ids)[:, :, None] == jnp.asarray(kv_ids)[:, None, :]
        keep = seg if keep is None else keep & seg
    return keep


def attention(q, k, v, keep=None, *, scale, softcap=None, sinks=None):
    """Plain-jnp attention with GQA (float32 scores and softmax): `flash_attention`'s twin below, and the XLA
    path of unsloth_jax.ops.attention / paged_attention.

    q [B, Sq, Hq, D], k/v [B, Skv, Hkv, D]; query head h reads KV head h // (Hq // Hkv). Scores are
    q.k * scale, then softcap * tanh(scores / softcap), then masked by `keep` (bool, [B or 1, Sq, Skv], True:
    attend; None: nothing masked). sinks [Hq] (gpt-oss): one more logit per head in every softmax denominator,
    attending to nothing. Rows with nothing to attend (and no sink) give zeros.
    """
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    qg = q.reshape(b, sq, hkv, g, d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    if keep is not None:
        scores = jnp.where(jnp.asarray(keep)[:, None, None], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(1, hkv, g, 1, 1)
        m = jnp.maximum(m, sink)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.exp(scores - m)
    denom = jnp.sum(p, axis=-1)  # [b, hkv, g, q]
    if sinks is not None:
        denom = denom + jnp.exp(sink - m)[..., 0]
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    inv = 1.0 / jnp.where(denom > 0, denom, 1.0)
    out = out * jnp.transpose(inv, (0, 3, 1, 2))[..., None]
    return out.reshape(b, sq, hq, d).astype(q.dtype)


def flash_attention(q, k, v, *, causal=True, segment_ids=None, sliding_window=None, softcap=None,
                    sm_scale=None):
    """Plain-jnp twin of `pallas_kernels.flash_attention.flash_attention` (`attention` above).

    q [B, S, Hq, D], k/v [B, S, Hkv, D]; query head h reads KV head h // (Hq // Hkv). Scores are
    q.k * sm_scale, then softcap * tanh(scores / softcap), then masked (causal j <= i, window i - j < w,
    equal segment ids; segment_ids may be a (q_ids, kv_ids) pair). Fully masked rows give zeros.
    """
    scale = (1.0 / float(q.shape[-1]) ** 0.5) if sm_scale is None else float(sm_scale)
    keep = _attention_keep_mask(q.shape[1], causal, sliding_window, segment_ids)
    return attention(q, k, v, keep, scale=scale, softcap=softcap)


# ---- nf4 (owned by pallas_kernels/nf4.py; the format in pallas_kernels/nf4_format.py) ----


def dequantize_nf4(q, dtype=None):
    """Twin of `pallas_kernels.nf4.dequantize_nf4` (stacking axes allowed): NF4 value * block scale, rounded
    once to `dtype` (default: the original dtype)."""
    from pallas_kernels.nf4_format import NF4_CODE, decoded_absmax

    out_dtype = jnp.dtype(dtype if dtype is not None else q.dtype)
    lead = q.codes.shape[:-1]
    b = q.codes.astype(jnp.int32)
    codes = jnp.stack([(b >> 4) & 15, b & 15], axis=-1).reshape(*lead, -1)
    vals = jnp.asarray(NF4_CODE)[codes]
    nb, bs = q.nblocks, q.blocksize
    vals = jnp.pad(vals, [(0, 0)] * len(lead) + [(0, nb * bs - vals.shape[-1])]).reshape(*lead, nb, bs)
    scale = decoded_absmax(q)
    out = (vals * scale[..., None]).reshape(*lead, nb * bs)[..., : q.numel]
    return out.astype(out_dtype).reshape(*lead, *q.shape)


def nf4_matmul(x, q):
    """Twin of `pallas_kernels.nf4.nf4_matmul`: x @ dequantize(q, x.dtype).T (XLA GEMM, result in x.dtype)."""
    w = dequantize_nf4(q, x.dtype)
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))


def qlora_linear(x, q, a, b, scale):
    """Twin of `pallas_kernels.nf4.qlora_linear`: nf4_matmul(x, q) + scale * (x @ a) @ b."""
    base = nf4_matmul(x, q)
    lora = jnp.dot(jnp.dot(x, a.astype(x.dtype)), b.astype(x.dtype))
    return base + (scale * lora).astype(x.dtype)


# ---- grouped_matmul (owned by pallas_kernels/grouped_matmul.py) ----


def grouped_matmul(x, w, group_sizes, transpose_rhs=False, out_dtype=None):
    """jax.lax.ragged_dot(x [N, K], w [E, K, M] (or [E, M, K] with transpose_rhs), group_sizes [E]) -> [N, M]
    in out_dtype or x.dtype, float32 accumulation; rows past sum(group_sizes) are zero. (XLA's GPU lowering of
    ragged_dot is a dense product against every group: the kernel's speed baseline, not a fast path.)"""
    w = jnp.swapaxes(w, 1, 2) if transpose_rhs else w
    y = jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32)
    return y.astype(out_dtype or x.dtype)


# ---- stacked_linear (owned by pallas_kernels/decode_linear.py) ----


def stacked_linear(x, w, layer, *, bias=None, lora_a=None, lora_b=None, lora_scale=1.0):
    """Twin of `pallas_kernels.decode_linear.stacked_linear`: x @ w[layer] (+ bias) (+ lora_scale * (x @ lora_a)
    @ lora_b), every product in float32 at full precision (inputs upcast), output in x.dtype."""
    f32 = jnp.float32
    hi = jax.lax.Precision.HIGHEST
    xf = x.astype(f32)
    y = jnp.dot(xf, w[layer].astype(f32), precision=hi)
    if bias is not None:
        y = y + bias.astype(f32)
    if lora_a is not None:
        xa = jnp.dot(xf, lora_a.astype(f32), precision=hi)
        y = y + lora_scale * jnp.dot(xa, lora_b.astype(f32), precision=hi)
    return y.astype(x.dtype)


def paged_decode_attention(q, k_pages, v_pages, block_tables, lengths, *, scale, softcap=None, window=None,
                           sinks=None):
    """Decode attention of q [B, Hq, D] over each row's pages of k_pages / v_pages [P, BS, Hkv, D]
    (block_tables [B, MAXB], lengths [B]; see pallas_kernels.decode_attention): every page of the table
    gathered, keys at index >= length (or outside the window) masked, then `attention` above (float32 softmax,
    softcap, sinks). Rows of length 0 give 0. -> [B, Hq, D] in q.dtype."""
    b, maxb = block_tables.shape
    bs = k_pages.shape[1]
    k = k_pages[block_tables].reshape(b, maxb * bs, *k_pages.shape[2:])
    v = v_pages[block_tables].reshape(b, maxb * bs, *v_pages.shape[2:])
    j = jnp.arange(maxb * bs)[None, :]
    keep = j < lengths[:, None]
    if window is not None:
        keep = keep & ((lengths[:, None] - 1) - j < window)
    out = attention(q[:, None], k, v, keep[:, None, :], scale=scale, softcap=softcap, sinks=sinks)[:, 0]
    return jnp.where((lengths > 0)[:, None, None], out, jnp.zeros_like(out))


# ---- gated delta rule (Qwen3.5's linear attention; Pallas path gated_delta_state.py, chunked XLA form gated_delta_chunked.py) ----


def gated_delta_rule(q, k, v, g, beta, initial_state=None, *, scale):
    """The gated delta rule one token at a time (transformers' torch_recurrent_gated_delta_rule, whose query /
    key L2 normalization the caller does): for each head, S_t = exp(g_t) S_{t-1};
    S_t += k_t (beta_t (v_t - k_t^T S_t))^T; o_t = scale q_t^T S_t.

    q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv] with Hv a multiple of Hk (value head h reads query / key head
    h // (Hv // Hk)); g (log decay, <= 0) and beta [B, T, Hv]; initial_state [B, Hv, Dk, Dv] or None (zeros).
    Math in float32. -> (o [B, T, Hv, Dv] in v.dtype, final state [B, Hv, Dk, Dv] float32).
    A segment start (packing) is a g of -1e4 there: exp(g) is 0, so the state restarts."""
    hi = jax.lax.Precision.HIGHEST
    b, t, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    f32 = jnp.float32
    rep = hv // hk
    qf = jnp.repeat(q.astype(f32), rep, axis=2) * scale
    kf = jnp.repeat(k.astype(f32), rep, axis=2)
    state0 = jnp.zeros((b, hv, dk, dv), f32) if initial_state is None else initial_state.astype(f32)

    def step(state, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [B, Hv, Dk], [B, Hv, Dk], [B, Hv, Dv], [B, Hv], [B, Hv]
        state = state * jnp.exp(g_t)[..., None, None]
        predicted = jnp.einsum("bhk,bhkv->bhv", k_t, state, precision=hi)
        delta = (v_t - predicted) * b_t[..., None]
        state = state + k_t[..., :, None] * delta[..., None, :]
        return state, jnp.einsum("bhk,bhkv->bhv", q_t, state, precision=hi)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (qf, kf, v.astype(f32), g.astype(f32), beta.astype(f32)))
    final, out = jax.lax.scan(step, state0, xs)
    return jnp.moveaxis(out, 0, 1).astype(v.dtype), final
