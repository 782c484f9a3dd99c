"""The gated delta rule in chunks, in plain jnp: the XLA path of ops.gated_delta_rule (the Pallas path,
pallas_kernels.gated_delta_state, shares chunk_terms and runs the state pass as kernels; the token-by-token scan
pallas_kernels.reference.gated_delta_rule is the ground truth).

Per head, within a chunk of C tokens with start state S0 [Dk, Dv] (G the cumulative log decay inside the chunk,
e = exp(G), Gamma_ij = exp(G_i - G_j) for j <= i and 0 above the diagonal):
    A = strict_lower(Gamma * beta_i k_i.k_j)             (the delta rule's dependence of token i on tokens j < i)
    [W | U~] = (I + A)^-1 [beta e K | beta V]             (the UT/WY transform; the inverse by blocked substitution)
    U = U~ - W S0                                         (the chunk's state updates, [C, Dv])
    O = scale (e Q S0 + lower(Gamma * Q K^T) U)
    S1 = e_C S0 + (exp(G_C - G) K)^T U
Everything but the last three lines runs for all chunks at once; a lax.scan over chunks carries the state.
Every exponent is a difference G_i - G_j with j <= i inside one segment (or G itself), so for g <= 0 no exp sees a
positive number, in the forward or in the gradient; a segment start (g = -1e4) makes the factors across it exactly 0
and restarts the cumulative sums (RESET_BELOW). jax autodiff gives the gradients (the inverse's by its custom VJP).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

DEFAULT_CHUNK = 64
# A log decay below this is a segment start: its decay is taken as exactly 0 (exp(-60) < 1e-26) and the chunk's
# cumulative sums restart there, so they never hold -1e4 (whose float32 ulp, 1e-3, would spoil every later
# difference G_i - G_j of the chunk).
RESET_BELOW = -60.0


def _chunks(x, t_pad: int, chunk: int):
    """[B, T, H, ...] -> [B, H, N, C, ...] float32, zero-padded along T to t_pad = N * C."""
    x = x.astype(jnp.float32)
    t = x.shape[1]
    if t_pad != t:
        x = jnp.pad(x, [(0, 0), (0, t_pad - t)] + [(0, 0)] * (x.ndim - 2))
    b, _, h = x.shape[:3]
    x = x.reshape(b, t_pad // chunk, chunk, h, *x.shape[3:])
    return jnp.moveaxis(x, 3, 1)


def chunk_decays(g, chunk: int):
    """The decay factors of chunks of log decays g [..., C] (float32, <= 0) -> (G, gamma, e, r, e_last):
    G [..., C] the cumulative log decay since the chunk start or the last segment start (see RESET_BELOW; such
    a token's own g counts as 0), gamma [..., C, C] = exp(G_i - G_j) for j <= i in one segment (else 0),
    e [..., C] = exp(G) before the chunk's first segment start (else 0: the start state is forgotten),
    r [..., C] = exp(G_last - G_j) for j in the chunk's last segment (else 0), e_last [...] = e[..., -1]."""
    reset = g < RESET_BELOW
    big_g = jnp.cumsum(jnp.where(reset, 0.0, g), axis=-1)
    seg = jnp.cumsum(reset.astype(jnp.int32), axis=-1)
    same = (seg[..., :, None] == seg[..., None, :]) & jnp.tril(jnp.ones((chunk, chunk), bool))
    diff = big_g[..., :, None] - big_g[..., None, :]
    gamma = jnp.where(same, jnp.exp(jnp.where(same, diff, 0.0)), 0.0)
    first = seg == 0
    e = jnp.where(first, jnp.exp(jnp.where(first, big_g, 0.0)), 0.0)
    last = seg == seg[..., -1:]
    tail = big_g[..., -1:] - big_g
    r = jnp.where(last, jnp.exp(jnp.where(last, tail, 0.0)), 0.0)
    return big_g, gamma, e, r, e[..., -1]


def unit_lower_inverse(a, precision=None):
    """(I + a)^-1 of strictly lower a [..., C, C] (C a power of two), by blocked forward substitution: the inverses
    of the diagonal blocks of size s give those of size 2s as [[T11, 0], [-T22 A21 T11, T22]] (log2 C rounds of
    batched products, stable as forward substitution is). Differentiable in a: its gradient is
    -strict_lower(T^T dT T^T) (from dT = -T dA T), two batched products instead of the rounds' transposes."""
    return _unit_lower_inverse(a, precision)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _unit_lower_inverse(a, precision):
    c = a.shape[-1]
    lead = a.shape[:-2]
    blocks = jnp.ones(lead + (c, 1, 1), a.dtype)  # the diagonal blocks of size s = 1
    s = 1
    while s < c:
        nb = c // (2 * s)
        pairs = blocks.reshape(lead + (nb, 2, s, s))
        t11, t22 = pairs[..., 0, :, :], pairs[..., 1, :, :]
        # the (row block 2p + 1, column block 2p) tiles of a: A21 of each pair
        tiles = a.reshape(lead + (nb, 2, s, nb, 2, s))[..., :, 1, :, :, 0, :]  # [..., nb, s, nb, s]
        same = (jnp.arange(nb)[:, None] == jnp.arange(nb)[None, :])[:, None, :, None]
        a21 = jnp.sum(jnp.where(same, tiles, 0.0), axis=-2)  # [..., nb, s, s]: the pair's own tile, exactly
        x = -jnp.einsum("...ij,...jk,...kl->...il", t22, a21, t11, precision=precision)
        top = jnp.concatenate([t11, jnp.zeros_like(t11)], axis=-1)
        bottom = jnp.concatenate([x, t22], axis=-1)
        blocks = jnp.concatenate([top, bottom], axis=-2)  # [..., nb, 2s, 2s]
        s *= 2
    return blocks.reshape(lead + (c, c))


def _unit_lower_inverse_fwd(a, precision):
    t = _unit_lower_inverse(a, precision)
    return t, t


def _unit_lower_inverse_bwd(precision, t, dt):
    c = t.shape[-1]
    da = -jnp.einsum("...ji,...jk,...lk->...il", t, dt, t, precision=precision)
    return (jnp.where(jnp.tril(jnp.ones((c, c), bool), -1), da, 0.0),)


_unit_lower_inverse.defvjp(_unit_lower_inverse_fwd, _unit_lower_inverse_bwd)


def chunk_terms(q, k, v, g, beta, *, scale, chunk: int, precision=None):
    """The chunk-local terms of the state recurrence, for all chunks at once (the first lines of the module
    docstring): q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g, beta [B, T, Hv]; T zero-padded to N * chunk ->
    (w [B, Hv, N, C, Dk], u_tilde [B, Hv, N, C, Dv], eq = scale e Q [B, Hv, N, C, Dk],
    p = scale lower(Gamma * Q K^T) [B, Hv, N, C, C], kr = r K [B, Hv, N, C, Dk], e_last [B, Hv, N]), all float32.
    The chunked scan below and pallas_kernels.gated_delta_state's state-pass kernel both consume these."""
    t, hk = q.shape[1], q.shape[2]
    hv = v.shape[2]
    rep = hv // hk
    ein = functools.partial(jnp.einsum, precision=precision)
    tp = -(-t // chunk) * chunk
    qc = _chunks(q, tp, chunk) * scale  # [B, Hk, N, C, Dk]
    kc = _chunks(k, tp, chunk)
    vc = _chunks(v, tp, chunk)  # [B, Hv, N, C, Dv]
    gc = _chunks(g, tp, chunk)  # [B, Hv, N, C]
    bc = _chunks(beta, tp, chunk)

    def per_value_head(x):  # [B, Hk, ...] -> [B, Hv, ...]: value head h reads key head h // rep
        return jnp.repeat(x, rep, axis=1)

    _, gamma, e, kr_scale, e_last = chunk_decays(gc, chunk)
    strict = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    # K K^T and Q K^T once per key head
    kk = per_value_head(ein("...id,...jd->...ij", kc, kc))
    qk = per_value_head(ein("...id,...jd->...ij", qc, kc))
    qc, kc = per_value_head(qc), per_value_head(kc)
    a = jnp.where(strict, gamma * bc[..., :, None] * kk, 0.0)
    t_inv = unit_lower_inverse(a, precision)
    w = ein("...ij,...jd->...id", t_inv, (bc * e)[..., None] * kc)
    u_tilde = ein("...ij,...jd->...id", t_inv, bc[..., None] * vc)
    p = gamma * qk  # lower triangle (gamma is 0 above)
    return w, u_tilde, e[..., None] * qc, p, kr_scale[..., None] * kc, e_last


def check_inputs(q, k, v, g, beta, initial_state):
    """Shape checks shared by the chunked path and the kernel: a ValueError naming the argument."""
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"gated_delta_rule: q and k must both be [B, T, Hk, Dk]; got q {q.shape}, k {k.shape}")
    b, t, hk, dk = q.shape
    if v.ndim != 4 or v.shape[:2] != (b, t) or v.shape[2] % hk:
        raise ValueError(f"gated_delta_rule: v must be [B, T, Hv, Dv] with Hv a multiple of Hk={hk} and "
                         f"B, T = {b}, {t}; got {v.shape}")
    hv, dv = v.shape[2], v.shape[3]
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (b, t, hv):
            raise ValueError(f"gated_delta_rule: {name} must be [B, T, Hv] = {(b, t, hv)}; got {x.shape}")
    if initial_state is not None and initial_state.shape != (b, hv, dk, dv):
        raise ValueError(f"gated_delta_rule: initial_state must be [B, Hv, Dk, Dv] = {(b, hv, dk, dv)}; got "
                         f"{initial_state.shape}")


def chunked_gated_delta_rule(q, k, v, g, beta, initial_state=None, *, scale, chunk: int = DEFAULT_CHUNK):
    """The gated delta rule computed chunk by chunk (same interface and result as
    pallas_kernels.reference.gated_delta_rule).

    q, k [B, T, Hk, Dk] (L2-normalized by the caller); v [B, T, Hv, Dv], Hv a multiple of Hk; g (log decay, <= 0;
    -1e4 at a segment start) and beta [B, T, Hv]; initial_state [B, Hv, Dk, Dv] or None (zeros). Math in float32;
    T need not be a multiple of `chunk` (a power of two; zero padding: g = 0, beta = 0 leave the state unchanged;
    sequences shorter than a chunk use the next power of two above T instead).
    -> (o [B, T, Hv, Dv] in v.dtype, final state [B, Hv, Dk, Dv] float32). Differentiable in every input.
    Products of float32 inputs are full float32, of 16-bit inputs XLA's default (TF32 on the GPU)."""
    check_inputs(q, k, v, g, beta, initial_state)
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunked_gated_delta_rule: chunk must be a power of two; got {chunk}")
    b, t, _, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    chunk = min(chunk, 1 << max(t - 1, 0).bit_length())
    # float32 inputs get full-precision float32 products (the GPU's default would be TF32); 16-bit inputs the default
    prec = lax.Precision.HIGHEST if jnp.dtype(v.dtype) == jnp.float32 else None
    ein = functools.partial(jnp.einsum, precision=prec)
    w, u_tilde, eq, p, kr, e_last = chunk_terms(q, k, v, g, beta, scale=scale, chunk=chunk, precision=prec)
    n = w.shape[2]
    tp = n * chunk

    def step(state, xs):
        w_n, ut_n, eq_n, p_n, kr_n, el_n = xs
        u = ut_n - ein("bhck,bhkv->bhcv", w_n, state)
        out = ein("bhck,bhkv->bhcv", eq_n, state) + ein("bhcj,bhjv->bhcv", p_n, u)
        state = el_n[..., None, None] * state + ein("bhck,bhcv->bhkv", kr_n, u)
        return state, out

    state0 = jnp.zeros((b, hv, dk, dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (w, u_tilde, eq, p, kr, e_last))
    final, out = lax.scan(step, state0, xs)  # out [N, B, Hv, C, Dv]
    out = jnp.moveaxis(out, 0, 2).reshape(b, hv, tp, dv)[:, :, :t]
    return jnp.moveaxis(out, 1, 2).astype(v.dtype), final
