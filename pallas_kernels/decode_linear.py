"""Decode-sized GEMM on one layer of a stacked weight, read in place, with bias and the LoRA delta fused.

Wins: the generation engine's decode step on the H200 (BENCHMARKS.md, "Generation engine, 2026-12-04"): with
this kernel and paged_decode_attention, Qwen2-1.5B at 16 rows ran 2.99 ms per step against 4.46 ms with XLA's
in-step slices of the stacked kernels (the two kernels measured together). Default: ops.PALLAS_WINS["decode_linear"]
picks it for 16-bit decode rows. Its block configs come from TUNED where a shape was measured in the engine,
otherwise from the rule in `pick_config` (an untuned guess: a profile of that step showed these kernels at
1.1-1.7 TB/s, a third of HBM bandwidth, so most shapes still have room).

    y = x @ w[layer] (+ bias) (+ lora_scale * (x @ lora_a) @ lora_b)      x [M, K], w [L, K, N], M = 1..256

Why: the generation engine decodes with the trainer's stacked kernels [L, in, out]. Slicing layer i out of the
stack inside the compiled decode step makes XLA copy the slice before its GEMM (its GEMM fusions do not read a
slice in place), which doubled the decode step on the H200; unmerged LoRA doubled the kernel count per step.
Here the layer is chosen by a pointer offset into the stack (layer * K * N), so no slice of it exists anywhere:
- a static Python int `layer` is the weight BlockSpec's index (block (squeezed, K, N), index map (layer, 0, 0)):
  the offset is a constant of the kernel, which is therefore a different Triton kernel for every layer;
- an int32 scalar array `layer` (traced or not) is an operand of the kernel: each program loads it and
  indexes the stack with it (one scalar load before the first weight load), so one compiled kernel serves
  every layer (fewer Triton compilations for a 28-layer decode program; also usable inside lax.scan/fori over
  layers). It is clamped to [0, L - 1] (no bounds error can be raised from a traced value).

Design (memory bound: the [K, N] slice is read once, x is tiny):
- grid (m blocks, N tiles, K splits). M is padded to a power-of-two block bm (16..128) by masked loads; for
  M <= 128 there is one M block, so every weight tile is read exactly once.
- each program loops over its K range in steps of bk, accumulating x @ w in f32 and, in the same loop, its
  share of xa = x @ lora_a [bm, rp] (rp = r padded to a power of two >= 16 by masked loads; the rank-r dot
  costs rp/bn of the main one). Its epilogue adds scale * xa @ lora_b[:, tile]: each program recomputes its
  rows' xa, no separate kernel, no HBM round trip.
- split-K (to fill the 132 SMs when N is small): split s writes f32 partials [s, M, N] (its partial xa times
  lora_b included; the sum over splits is exact algebra), XLA sums them, adds the bias and casts: one small
  fused reduction, deterministic, no atomics. With one split the bias and the cast are in the kernel epilogue.
- every load and store is a power-of-two block; ragged M, N, K edges and the padded rank are masked (masks only
  where a size is not a multiple of its block). The weight tiles are loaded with evict_first (streamed once;
  x, lora_a, lora_b are re-read by every program and should stay in L2).
- w may be bf16 with fp32 x (tiles are upcast in registers; no converted copy of the stack). fp32 dots run
  as tf32 on the GPU's tensor cores (Triton's default), so fp32 results there are good to ~1e-3.

Inference only: no custom_vjp, no backward.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import types

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import (cdiv, compiler_params, full_spec, load, load_tile, mask_2d, next_pow2, pl,
                                    plgpu, range_mask, resolve_interpret, split_k_output)

__all__ = ["stacked_linear", "DecodeConfig", "TUNED", "CONFIGS_ENV", "pick_config", "resolve_config", "TARGET_PROGRAMS"]

#: Programs to aim for when choosing split-K and shrinking tiles: two per SM of an H200 (132 SMs), enough
#: loads in flight to cover HBM latency for a streaming read.
TARGET_PROGRAMS = 264
#: Shared-memory budget for the software-pipelined tiles (H200: 227 KiB per block; keep headroom).
_SMEM_BUDGET = 160 * 1024


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Block sizes (powers of two) and launch parameters. splits=None: chosen by `resolve_config` (split-K so
    that about TARGET_PROGRAMS programs run, within a bound on partial-sum traffic); an int forces it (1 = no
    split, it is still clipped to the number of K steps)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 256
    splits: int | None = None
    num_warps: int = 4
    num_stages: int = 3


#: Configs measured best on the H200 for 16-bit rows, by (rows bucket, K, N): rows bucket 16 for M <= 16, 64 for
#: M <= 64, 128 above (bench/decode_linear_chain.py: every layer of a stack in turn, as the engine calls it).
#: A shape not listed gets the rule below.
_MEASURED = {
    # Qwen2-1.5B down_proj at <= 16 rows: the engine's 16-row step 3.02 -> 2.81 ms (BENCHMARKS.md, generation,
    # 2026-12-04f); the rule gave block_k 256 with 12 splits.
    (16, 8960, 1536): DecodeConfig(block_m=16, block_n=64, block_k=128, splits=4, num_warps=4, num_stages=4),
}
#: Environment variable naming a JSON file of configs to use in place of _MEASURED for the shapes it lists
#: ({"16,8960,1536": {"block_m": 16, ...}}, as bench/decode_linear_chain.py --write-best writes), read once when
#: this module is imported: benchmarks compare tables across processes, never within one.
CONFIGS_ENV = "UNSLOTH_JAX_DECODE_LINEAR_CONFIGS"


def _configs_from_env() -> dict:
    path = os.environ.get(CONFIGS_ENV)
    if not path:
        return {}
    try:
        with open(path) as f:
            table = json.load(f)
        return {tuple(int(v) for v in key.split(",")): DecodeConfig(**cfg) for key, cfg in table.items()}
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"{CONFIGS_ENV}={path}: not a decode_linear config table "
                         f"({{\"rows,K,N\": {{\"block_m\": ...}}}}): {exc}") from exc


#: The table pick_config reads (read-only: a program traced later must see the same configs as one traced before).
TUNED: types.MappingProxyType = types.MappingProxyType({**_MEASURED, **_configs_from_env()})


def rows_bucket(m: int) -> int:
    """TUNED's rows key: 16 for m <= 16, 64 for m <= 64, 128 above."""
    return 16 if m <= 16 else 64 if m <= 64 else 128


def pick_config(m: int, k: int, n: int, dtype, r: int = 0) -> DecodeConfig:
    """The default config for x [m, k] @ w [k, n] (rank-r LoRA, 0 = none) in `dtype` (x's dtype): the TUNED
    entry for 16-bit rows of a measured shape, otherwise the rule below.

    Rule (initial guesses for the H200, to be replaced by the sweep of bench/decode_linear_bench.py):
      M <= 16  : 16 x 64 tiles, bk 256, 4 warps   (a GEMV: long K steps, many narrow N tiles)
      M <= 64  : bm x 64 tiles, bk 128, 4 warps
      M > 64   : 128 x 64 tiles, bk 64, 4 warps, 4 stages (keeps the [128, bk] x tile + w tile per stage small)
    fp32 halves bk (same bytes per stage). Then `resolve_config` shrinks bk (to 64) and bn (to 32) while the
    whole grid has fewer than TARGET_PROGRAMS tiles, picks split-K, and fits the stages in shared memory.
    """
    del r
    tuned = TUNED.get((rows_bucket(m), k, n)) if jnp.dtype(dtype).itemsize == 2 else None
    if tuned is not None:
        return tuned
    bm = min(128, max(16, next_pow2(m)))
    if bm <= 16:
        cfg = DecodeConfig(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=3)
    elif bm <= 64:
        cfg = DecodeConfig(block_m=bm, block_n=64, block_k=128, num_warps=4, num_stages=3)
    else:
        cfg = DecodeConfig(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=4)
    if jnp.dtype(dtype).itemsize >= 4:
        cfg = dataclasses.replace(cfg, block_k=max(32, cfg.block_k // 2))
    return cfg


def _smem_bytes(bm, bn, bk, rp, itemsize, stages):
    return stages * (bm * bk + bk * bn + bk * rp) * itemsize + rp * bn * itemsize


def resolve_config(cfg: DecodeConfig, m: int, k: int, n: int, dtype, r: int = 0, *,
                   auto_shrink: bool = True) -> DecodeConfig:
    """cfg made concrete for this problem: blocks clipped to the (padded) sizes, tiles shrunk while the grid is
    smaller than TARGET_PROGRAMS (auto_shrink; a sweep passes False to time its blocks as given), stages and
    bk reduced to fit _SMEM_BUDGET, and splits chosen when None:

      splits = clip(round(TARGET_PROGRAMS / (m blocks * N tiles)), 1, min(K steps, s_max)),
      s_max  = K * itemsize(w) / (4 M): the f32 partials [splits, M, N] stay at most one weight slice in bytes
               (they are written and read back, mostly from L2); at M = 128 split-K is mostly off.
    K steps are then spread evenly: steps per split = round(K steps / splits), splits = cdiv(K steps, that)
    (no empty split; only the last may be short).
    """
    for name in ("block_m", "block_n", "block_k"):
        v = getattr(cfg, name)
        if v < 16 or v & (v - 1):
            raise ValueError(f"stacked_linear: {name}={v} must be a power of two >= 16")
    itemsize = jnp.dtype(dtype).itemsize
    rp = max(16, next_pow2(r)) if r else 0

    def clip(v, size):
        return max(16, min(v, next_pow2(size)))

    bm = clip(cfg.block_m, m)
    bn = clip(cfg.block_n, n)
    bk = clip(cfg.block_k, k)
    n_m = cdiv(m, bm)
    if auto_shrink and cfg.splits is None:
        while n_m * cdiv(n, bn) * cdiv(k, bk) < TARGET_PROGRAMS and bk > 64:
            bk //= 2
        while n_m * cdiv(n, bn) * cdiv(k, bk) < TARGET_PROGRAMS and bn > 32:
            bn //= 2
    stages = cfg.num_stages
    while _smem_bytes(bm, bn, bk, rp, itemsize, stages) > _SMEM_BUDGET and stages > 2:
        stages -= 1
    while _smem_bytes(bm, bn, bk, rp, itemsize, stages) > _SMEM_BUDGET and bk > 32:
        bk //= 2
    k_steps = cdiv(k, bk)
    if cfg.splits is None:
        s_max = max(1, (k * itemsize) // (4 * m))
        splits = round(TARGET_PROGRAMS / (n_m * cdiv(n, bn)))
        splits = max(1, min(splits, k_steps, s_max))
    else:
        splits = max(1, min(cfg.splits, k_steps))
    splits = cdiv(k_steps, max(1, round(k_steps / splits)))
    return DecodeConfig(block_m=bm, block_n=bn, block_k=bk, splits=splits, num_warps=cfg.num_warps,
                        num_stages=stages)


# ----------------------------------------------------------------------------------------------------------
# kernel
# ----------------------------------------------------------------------------------------------------------

def _kernel(*refs, M, K, N, R, RP, bm, bn, bk, steps, splits, scale, has_bias, has_lora, out_dtype,
            runtime_layer):
    refs = list(refs)
    if runtime_layer:   # layer_ref [1] int32, w_ref the whole stack [L, K, N]
        layer_ref, x_ref, w_ref = refs[:3]
        rest = refs[3:]
        layer = plgpu.load(layer_ref.at[pl.ds(0, 1)]).reshape(())
        w_at = lambda k0, n0: w_ref.at[layer, pl.ds(k0, bk), pl.ds(n0, bn)]  # noqa: E731
    else:               # w_ref is already layer `layer` of the stack (BlockSpec)
        x_ref, w_ref = refs[:2]
        rest = refs[2:]
        w_at = lambda k0, n0: w_ref.at[pl.ds(k0, bk), pl.ds(n0, bn)]  # noqa: E731
    bias_ref = rest.pop(0) if has_bias else None
    a_ref, b_ref = (rest.pop(0), rest.pop(0)) if has_lora else (None, None)
    (o_ref,) = rest

    pid_m, pid_n, pid_s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m0, n0 = pid_m * bm, pid_n * bn
    k_begin = pid_s * (steps * bk)
    rmask = range_mask(m0, bm, M, M % bm != 0)
    cmask = range_mask(n0, bn, N, N % bn != 0)
    rpmask = range_mask(0, RP, R, R != RP) if has_lora else None
    # K is masked when the splits' steps overrun it (ragged K, or a last split with fewer real steps).
    k_ragged = splits * steps * bk != K
    x_dtype = x_ref.dtype

    def body(i, carry):
        acc, xa = carry
        k0 = k_begin + i * bk
        kmask = range_mask(k0, bk, K, k_ragged)
        xb = load_tile(x_ref, m0, bm, k0, bk, rmask, kmask)
        w_tile = w_at(k0, n0)
        wmask = mask_2d(kmask, cmask)
        if wmask is None:
            wb = plgpu.load(w_tile, eviction_policy="evict_first")
        else:
            wb = plgpu.load(w_tile, mask=jnp.broadcast_to(wmask, (bk, bn)), other=0,
                            eviction_policy="evict_first")
        acc = acc + plgpu.dot(xb, wb.astype(x_dtype))
        if has_lora:
            ab = load_tile(a_ref, k0, bk, 0, RP, kmask, rpmask)
            xa = xa + plgpu.dot(xb, ab)
        return acc, xa

    acc0 = jnp.zeros((bm, bn), jnp.float32)
    xa0 = jnp.zeros((bm, RP), jnp.float32) if has_lora else jnp.zeros((), jnp.float32)
    acc, xa = lax.fori_loop(0, steps, body, (acc0, xa0))
    if has_lora:
        bb = load_tile(b_ref, 0, RP, n0, bn, rpmask, cmask)
        lora = plgpu.dot(xa.astype(bb.dtype), bb)
        acc = acc + (lora if scale == 1.0 else scale * lora)
    if has_bias:
        bias = load(bias_ref.at[pl.ds(n0, bn)], cmask)
        acc = acc + bias.astype(jnp.float32)[None, :]
    out = o_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)]
    plgpu.store(out, acc.astype(out_dtype), mask=mask_2d(rmask, cmask))


def _check(x, w, layer, bias, lora_a, lora_b):
    if x.ndim != 2 or w.ndim != 3 or w.shape[1] != x.shape[1]:
        raise ValueError(f"stacked_linear: need x [M, K] and w [L, K, N]; got x{x.shape} w{w.shape}")
    L, _, N = w.shape
    if isinstance(layer, (jax.Array, jax.core.Tracer)) or hasattr(layer, "dtype"):
        if jnp.shape(layer) != () or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
            raise TypeError(f"stacked_linear: a runtime layer must be an integer scalar, got {jnp.shape(layer)} "
                            f"{jnp.result_type(layer)}")
        layer = jnp.asarray(layer, jnp.int32)
        return jnp.clip(jnp.where(layer < 0, layer + L, layer), 0, L - 1).reshape(1)
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise TypeError(f"stacked_linear: layer must be a Python int or an integer scalar array, got "
                        f"{type(layer).__name__}")
    if not -L <= layer < L:
        raise ValueError(f"stacked_linear: layer {layer} out of range for a stack of {L}")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"stacked_linear: bias{bias.shape} should be ({N},)")
    if (lora_a is None) != (lora_b is None):
        raise ValueError("stacked_linear: give both lora_a and lora_b, or neither")
    if lora_a is not None and (lora_a.ndim != 2 or lora_b.ndim != 2 or lora_a.shape[0] != x.shape[1]
                               or lora_b.shape != (lora_a.shape[1], N)):
        raise ValueError(f"stacked_linear: bad LoRA shapes a{lora_a.shape} b{lora_b.shape} for K={x.shape[1]}, "
                         f"N={N}")
    if w.dtype != x.dtype and not (x.dtype == jnp.float32 and w.dtype in (jnp.bfloat16, jnp.float16)):
        raise TypeError(f"stacked_linear: w {w.dtype} with x {x.dtype} (w must be x's dtype, or 16-bit with fp32 x)")
    return layer % L


def stacked_linear(x, w, layer, *, bias=None, lora_a=None, lora_b=None, lora_scale=1.0, block_n=None,
                   block_k=None, splits=None, num_warps=None, num_stages=None, config: DecodeConfig | None = None,
                   interpret=None):
    """y = x @ w[layer] (+ bias) (+ lora_scale * (x @ lora_a) @ lora_b): f32 accumulation, output in x.dtype.

    x [M, K] decode rows (bf16, fp16 or fp32); w [L, K, N] stacked kernel in x.dtype (or 16-bit with fp32 x),
    of which only layer `layer` is read, in place: a static Python int (negative counts from the end; the
    offset is compiled into the kernel) or an int32 scalar array (read at run time, clamped to the stack; one
    compiled kernel for every layer);
    bias [N] or None; lora_a [K, r] and lora_b [r, N], or both None (cast to x.dtype if they are not).
    block_n, block_k, splits, num_warps, num_stages (or a whole `config`) override the `pick_config` rule
    (the benchmark sweep uses them). Inference only: not differentiable.
    """
    interpret = resolve_interpret(interpret)
    layer = _check(x, w, layer, bias, lora_a, lora_b)
    M, K = x.shape
    N = w.shape[2]
    has_lora = lora_a is not None
    r = lora_a.shape[1] if has_lora else 0
    base = config if config is not None else pick_config(M, K, N, x.dtype, r)
    overrides = {k: v for k, v in dict(block_n=block_n, block_k=block_k, splits=splits, num_warps=num_warps,
                                         num_stages=num_stages).items() if v is not None}
    base = dataclasses.replace(base, **overrides)
    blocks_given = config is not None or any(v is not None for v in (block_n, block_k, splits))
    cfg = resolve_config(base, M, K, N, x.dtype, r, auto_shrink=not blocks_given)
    bm, bn, bk, S = cfg.block_m, cfg.block_n, cfg.block_k, cfg.splits
    steps = cdiv(cdiv(K, bk), S)
    RP = max(16, next_pow2(r)) if has_lora else 0

    runtime_layer = not isinstance(layer, int)
    if runtime_layer:
        operands = [layer, x, w]
        in_specs = [full_spec((1,)), full_spec(x.shape), full_spec(w.shape)]
    else:
        operands = [x, w]
        in_specs = [full_spec(x.shape), pl.BlockSpec((None, K, N), lambda i, j, s: (layer, 0, 0))]
    if bias is not None and S == 1:
        operands.append(bias)
        in_specs.append(full_spec(bias.shape))
    if has_lora:
        operands += [lora_a.astype(x.dtype), lora_b.astype(x.dtype)]
        in_specs += [full_spec(lora_a.shape), full_spec(lora_b.shape)]
    out_shape, out_spec = split_k_output(M, N, S, x.dtype)
    kernel = functools.partial(
        _kernel, M=M, K=K, N=N, R=r, RP=RP, bm=bm, bn=bn, bk=bk, steps=steps, splits=S,
        scale=float(lora_scale), has_bias=bias is not None and S == 1, has_lora=has_lora,
        out_dtype=out_shape.dtype, runtime_layer=runtime_layer)
    y = pl.pallas_call(
        kernel,
        grid=(cdiv(M, bm), cdiv(N, bn), S),
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=compiler_params(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="stacked_linear",
    )(*operands)
    if S == 1:
        return y
    y = jnp.sum(y, axis=0)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)
