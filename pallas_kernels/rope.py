"""Fused rotary position embedding for q and k in one launch (HF rotate-half layout), forward + backward.

Wins nowhere in the train step: alone its backward is 1.17-1.40x XLA but its forward 0.72-1.05x, and the Qwen2-1.5B
step ties (178.6 vs 178.8 ms) (BENCHMARKS.md, "Kernels vs XLA, each alone, and what the train step says", row RoPE).
Default: off (ops.PALLAS_WINS["rope"] is False); tested, and run when asked (`ops.set_impl("rope", "pallas")` or
UNSLOTH_JAX_IMPL=rope=pallas).

    out = x * cos + rotate_half(x) * sin,   rotate_half(x) = concat(-x2, x1)

with x1/x2 the two halves of the head dim. Per half (c1/c2, s1/s2 the halves of cos/sin):
    out1 = x1 * c1 - x2 * s1,   out2 = x2 * c2 + x1 * s2
The transpose (backward) is
    dx1 = dy1 * c1 + dy2 * s2,  dx2 = dy2 * c2 - dy1 * s1
which for HF's duplicated cos/sin (c1 == c2, s1 == s2) is the rotation by -sin. The kernel uses the exact
transpose, so it is right for any cos/sin. cos/sin are constants: their cotangents are zeros.

Layout: q [B, S, Hq, D] and k [B, S, Hkv, D] are viewed as [T, H, D] (T = B*S), cos/sin as [T, D]. One
program owns BT tokens: it loads the four cos/sin half-tiles [BT, D/2] once into registers, then walks the
q heads and the k heads in blocks of HB heads, each step a [BT, HB, D/2] tile per half (read once, written
once). D/2 is padded to a power of two with masks when needed.

Block sizes: `_TABLE` keyed by (shape class "Hq/Hkv", dtype name, D) with a heuristic fallback;
`bench/kernels_elementwise.py --sweep` prints the best entries for the GPU it runs on.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels._common import (broadcast_mask, cdiv, compiler_params, load, mask_2d, next_pow2, pl, plgpu,
                                    range_mask, resolve_interpret)


class RopeConfig(NamedTuple):
    block_tokens: int  # BT, tokens per program (power of two)
    max_heads: int  # HB upper bound: heads per step (power of two; the largest power of two dividing H is used)
    num_warps: int
    num_stages: int = 1
    unroll_heads: bool = True  # unroll the head-block loop (GPU); False: an scf.for loop


# Initial guesses for an H200 (`bench/kernels_elementwise.py --sweep` prints the best entries): one step moves a
# [BT, HB, D/2] tile of about 2048 elements per half with 8 warps (8 elements per thread); much larger steps
# spill registers.
# Key: (shape class "Hq/Hkv", dtype name, head_dim D).
_TABLE: dict[tuple[str, str, int], RopeConfig] = {
    ("12/2", "bfloat16", 128): RopeConfig(8, 4, 8),
    ("32/8", "bfloat16", 128): RopeConfig(4, 8, 8),
    ("8/4", "bfloat16", 256): RopeConfig(1, 8, 4, 1, False),  # the sweep's: one token, rolled head loop
}

_MIN_PROGRAMS = 264


def _heuristic(tokens: int, hq: int, hkv: int, d: int, dtype) -> RopeConfig:
    hb = min(8, _pow2_divisor(hq))
    bt = max(1, min(32, 2048 // (next_pow2(d // 2) * hb)))
    while bt > 1 and cdiv(tokens, bt) < _MIN_PROGRAMS:
        bt //= 2
    return RopeConfig(bt, 8, 8 if bt * hb * next_pow2(d // 2) >= 2048 else 4, 1)


def config(tokens: int, hq: int, hkv: int, d: int, dtype) -> RopeConfig:
    """Block config for `tokens` tokens, Hq/Hkv heads of size d in `dtype` (table, else heuristic), the token
    block clamped to the problem size."""
    key = (f"{hq}/{hkv}", jnp.dtype(dtype).name, d)
    cfg = _TABLE.get(key) or _heuristic(tokens, hq, hkv, d, dtype)
    return cfg._replace(block_tokens=max(1, min(cfg.block_tokens, next_pow2(tokens))))


def _pow2_divisor(n: int) -> int:
    return n & -n


# --------------------------------------------------------------------------------------------- kernel
def _rope_kernel(q_ref, k_ref, cos_ref, sin_ref, qo_ref, ko_ref, *, bt: int, bh: int, max_heads: int,
                 transpose: bool, unroll: bool):
    tokens, _, half = cos_ref.shape
    t0 = pl.program_id(0) * bt
    tmask = range_mask(t0, bt, tokens, tokens % bt != 0)
    cmask = jnp.arange(bh) < half if bh != half else None
    mask2 = broadcast_mask(mask_2d(tmask, cmask), (bt, bh))

    def load2(ref, which):
        return load(ref.at[pl.ds(t0, bt), jnp.int32(which), pl.ds(0, bh)], mask2, 0.0).astype(jnp.float32)

    c1 = load2(cos_ref, 0)[:, None, :]
    c2 = load2(cos_ref, 1)[:, None, :]
    s1 = load2(sin_ref, 0)[:, None, :]
    s2 = load2(sin_ref, 1)[:, None, :]
    if transpose:
        # dx1 = dy1 * c1 + dy2 * s2 ; dx2 = dy2 * c2 - dy1 * s1
        a11, a12, a21, a22 = c1, s2, -s1, c2
    else:
        # y1 = x1 * c1 - x2 * s1 ; y2 = x2 * c2 + x1 * s2
        a11, a12, a21, a22 = c1, -s1, s2, c2

    def rotate(x_ref, o_ref):
        nheads = x_ref.shape[1]
        hb = min(max_heads, _pow2_divisor(nheads))
        mask3 = None if mask2 is None else jnp.broadcast_to(mask2[:, None, :], (bt, hb, bh))

        def head_block(h0):
            i1 = (pl.ds(t0, bt), pl.ds(h0, hb), jnp.int32(0), pl.ds(0, bh))
            i2 = (pl.ds(t0, bt), pl.ds(h0, hb), jnp.int32(1), pl.ds(0, bh))
            x1 = load(x_ref.at[i1], mask3, 0.0).astype(jnp.float32)
            x2 = load(x_ref.at[i2], mask3, 0.0).astype(jnp.float32)
            y1 = x1 * a11 + x2 * a12
            y2 = x2 * a22 + x1 * a21
            plgpu.store(o_ref.at[i1], y1.astype(o_ref.dtype), mask=mask3)
            plgpu.store(o_ref.at[i2], y2.astype(o_ref.dtype), mask=mask3)

        if unroll:  # static: a few head blocks, all loads visible to the scheduler at once
            for h0 in range(0, nheads, hb):
                head_block(h0)
        else:
            @pl.loop(0, nheads // hb)
            def _(i):
                head_block(i * hb)

    rotate(q_ref, qo_ref)
    rotate(k_ref, ko_ref)


def _apply(q3, k3, cos2, sin2, interpret, cfg: RopeConfig, transpose: bool):
    # The head dim is viewed as [2, D/2] (free reshapes) so each half is addressed by an integer index and
    # a slice starting at 0, padded to a power of two.
    tokens, hq, d = q3.shape
    hkv = k3.shape[1]
    half = d // 2
    bh = next_pow2(half)
    bt = cfg.block_tokens
    # Interpret mode (CPU tests) compiles the rolled loop faster; same body, same math.
    unroll = cfg.unroll_heads and not interpret
    kernel = functools.partial(_rope_kernel, bt=bt, bh=bh, max_heads=cfg.max_heads, transpose=transpose,
                               unroll=unroll)
    qo, ko = pl.pallas_call(
        kernel,
        grid=(cdiv(tokens, bt),),
        out_shape=(
            jax.ShapeDtypeStruct((tokens, hq, 2, half), q3.dtype),
            jax.ShapeDtypeStruct((tokens, hkv, 2, half), k3.dtype),
        ),
        compiler_params=compiler_params(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="rope_bwd" if transpose else "rope_fwd",
    )(q3.reshape(tokens, hq, 2, half), k3.reshape(tokens, hkv, 2, half),
      cos2.reshape(tokens, 2, half), sin2.reshape(tokens, 2, half))
    return qo.reshape(q3.shape), ko.reshape(k3.shape)


# ------------------------------------------------------------------------------------------ custom_vjp
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _rope(q3, k3, cos2, sin2, interpret, cfg):
    return _apply(q3, k3, cos2, sin2, interpret, cfg, transpose=False)


def _rope_fwd(q3, k3, cos2, sin2, interpret, cfg):
    return _apply(q3, k3, cos2, sin2, interpret, cfg, transpose=False), (cos2, sin2)


def _rope_bwd(interpret, cfg, res, cts):
    cos2, sin2 = res
    dq, dk = cts
    dq, dk = _apply(dq, dk, cos2, sin2, interpret, cfg, transpose=True)
    return dq, dk, jnp.zeros_like(cos2), jnp.zeros_like(sin2)


_rope.defvjp(_rope_fwd, _rope_bwd)


def rope_with_config(q, k, cos, sin, *, interpret=None, cfg: RopeConfig | None = None):
    """`rope` with an explicit block config (used by the benchmark sweep and tests)."""
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"rope: q and k must be [B, S, H, D]; got {q.shape} and {k.shape}")
    b, s, hq, d = q.shape
    if k.shape[:2] != (b, s) or k.shape[3] != d:
        raise ValueError(f"rope: k {k.shape} does not match q {q.shape}")
    if d % 2:
        raise ValueError(f"rope: head_dim must be even, got {d}")
    hkv = k.shape[2]
    tokens = b * s
    if tokens == 0:
        return q, k
    cos = jnp.broadcast_to(cos, (b, s, d)).reshape(tokens, d)
    sin = jnp.broadcast_to(sin, (b, s, d)).reshape(tokens, d)
    if cfg is None:
        cfg = config(tokens, hq, hkv, d, q.dtype)
    cfg = cfg._replace(block_tokens=max(1, min(cfg.block_tokens, next_pow2(tokens))))
    qo, ko = _rope(q.reshape(tokens, hq, d), k.reshape(tokens, hkv, d), cos, sin,
                   resolve_interpret(interpret), cfg)
    return qo.reshape(q.shape), ko.reshape(k.shape)


def rope(q, k, cos, sin, *, interpret=None):
    """Rotate q [B, S, Hq, D] and k [B, S, Hkv, D] by cos/sin [B, S, D] (HF rotate-half) in one launch.

    Math in float32; returns (q_rot, k_rot) in q/k dtype. Gradients flow to q and k; cos/sin are treated as
    constants (their cotangents are zeros).
    """
    return rope_with_config(q, k, cos, sin, interpret=interpret)


__all__ = ["rope", "rope_with_config", "RopeConfig", "config"]
