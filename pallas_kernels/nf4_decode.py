"""Decode-sized matmul on one layer of a stacked NF4 weight: the 4-bit codes dequantized in registers, never in
memory, and the layer read in place from the stack.

Wins: the engine's decode step on an NF4 base (BENCHMARKS.md, "Generation engine, 2026-12-04"): Llama-3-8B NF4 at 16
rows ran 13.21 ms per step against 14.34 ms slicing, dequantizing and multiplying (same call); alone, 1.07x / 1.19x
that path at the 8B gate_up / down shapes (BENCHMARKS.md, "Kernels vs XLA, each alone, and what the train step
says"), but still 2x slower than a bf16 base: it is bound by its dequantizing arithmetic, not by HBM. Default:
ops.PALLAS_WINS["nf4_decode"] picks it for 16-bit decode rows on an NF4 base (not under nf4_gemm=fp8).

    y = x @ dequantize(q[layer]).T (+ bias) (+ lora_scale * (x @ lora_a) @ lora_b)
    x [M, K] decode rows (M = 1..256), q an NF4Weight stacked over L layers (codes [L, N*K/2]), y [M, N]

Why: the engine's decode step reads every weight once per token. Through `nf4_matmul` an NF4 projection is sliced
out of the stack (a copy of its codes), dequantized to a bf16 matrix in HBM and multiplied by XLA: about 5.5 bytes
of traffic per weight against the 0.53 bytes the codes and scales hold. Here each weight tile is read once as
codes, turned into values in registers and multiplied at once.

Design (bitsandbytes' layout, `pallas_kernels.nf4_format`; HF [out, in] = [N, K], K % blocksize == 0):
- the packed codes of a layer, viewed [N, K/2], hold W[n, 2j] in the high and W[n, 2j+1] in the low nibble of
  byte [n, j]. Rather than interleaving the two nibbles back into element order in registers, x is split once
  (outside the kernel, a tiny XLA op) into its even and odd columns x_e, x_o [M, K/2], and
  y = x_e @ hi(W)^T + x_o @ lo(W)^T: two dots on the byte tile, no shuffle.
- grid (M blocks, N tiles, K splits); each program loops over its byte range in steps of `block_k2` bytes
  (2 * block_k2 weights per row); the block scales of the step ([block_n, block_k2 / (blocksize/2)], double
  quantized codes decoded as in `pallas_kernels.nf4`) scale the looked-up NF4 values, rounded once to x's dtype
  (the same values `dequantize_nf4(q, x.dtype)` writes), then a dot with f32 accumulation.
- the layer is an int32 operand (one compiled kernel for every layer; clamped to the stack), the codes are
  indexed [layer, rows, bytes] in place: no slice of the stack exists anywhere.
- split-K writes f32 partials [S, M, N] that XLA sums with the LoRA delta and the bias; with one split both go
  in the kernel's epilogue. LoRA: xa = x @ lora_a is one small XLA GEMM, xa @ lora_b[:, tile] is in the kernel.

Inference only: no custom_vjp, no backward.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels._common import (cdiv, compiler_params, full_spec, load, load_tile, mask_2d, next_pow2, pl,
                                    plgpu, range_mask, resolve_interpret, split_k_output)
from pallas_kernels.nf4 import _nf4_lookup
from pallas_kernels.nf4_format import DYNAMIC_MAP, NESTED_BLOCKSIZE, NF4_CODE, NF4Weight, no_fma

__all__ = ["nf4_decode_linear", "NF4DecodeConfig", "pick_config", "supported"]

#: Programs to aim for when choosing split-K: two per SM of an H200 (132 SMs).
TARGET_PROGRAMS = 264


@dataclasses.dataclass(frozen=True)
class NF4DecodeConfig:
    """block_n rows of W per program, block_k2 packed bytes (2 * block_k2 weights) per row per loop step,
    splits of the K range (None: chosen to reach about TARGET_PROGRAMS programs), lut "select" (a select tree
    of the 16 NF4 values) or "gather" (a table load)."""

    block_n: int = 32
    block_k2: int = 128
    splits: int | None = None
    num_warps: int = 4
    num_stages: int = 2
    lut: str = "select"


def pick_config(m: int, k: int, n: int) -> NF4DecodeConfig:
    """The default config for x [m, k] and W [n, k]: NF4DecodeConfig()'s blocks (the fastest at the 8B
    gate_up and down shapes, M=16, of `bench/nf4_decode_bench.py --sweep` on the H200), splits by `_resolve`."""
    del m, k, n
    return NF4DecodeConfig()


def supported(q: NF4Weight) -> bool:
    """Whether the kernel takes this weight: one leading stack axis, 2-D [N, K] layers, K a multiple of an even
    blocksize of at least 32."""
    return (len(q.stack_shape) == 1 and len(q.shape) == 2 and q.blocksize % 32 == 0
            and q.shape[1] % q.blocksize == 0)


def _resolve(cfg: NF4DecodeConfig, m: int, k: int, n: int, blocksize: int) -> tuple[int, int, int, int]:
    """(block_m, block_n, block_k2, splits) for x [m, k], W [n, k]."""
    for name in ("block_n", "block_k2"):
        v = getattr(cfg, name)
        if v < 16 or v & (v - 1):
            raise ValueError(f"nf4_decode_linear: {name}={v} must be a power of two >= 16")
    if cfg.lut not in ("select", "gather"):
        raise ValueError(f"nf4_decode_linear: lut={cfg.lut!r}: use 'select' or 'gather'")
    half = blocksize // 2  # packed bytes per scale block
    bk2 = max(cfg.block_k2, next_pow2(half))
    bk2 = min(bk2, max(next_pow2(k // 2), next_pow2(half)))
    bn = min(cfg.block_n, max(16, next_pow2(n)))
    bm = min(128, max(16, next_pow2(m)))
    steps = cdiv(k // 2, bk2)
    if cfg.splits is None:
        tiles = cdiv(n, bn) * cdiv(m, bm)
        splits = max(1, min(steps, cdiv(TARGET_PROGRAMS, tiles)))
    else:
        splits = max(1, min(int(cfg.splits), steps))
    return bm, bn, bk2, splits


def _kernel(*refs, M, N, K, blocksize, nblocks2, bm, bn, bk2, steps, splits, double, lut, has_lora, has_bias,
            scale, out_dtype):
    refs = list(refs)
    layer_ref, xe_ref, xo_ref, codes_ref, absq_ref = refs[:5]
    rest = refs[5:]
    nested_ref, off_ref, dyn_ref = (rest.pop(0), rest.pop(0), rest.pop(0)) if double else (None, None, None)
    table_ref = rest.pop(0) if lut == "gather" else None
    xa_ref, b_ref = (rest.pop(0), rest.pop(0)) if has_lora else (None, None)
    bias_ref = rest.pop(0) if has_bias else None
    (o_ref,) = rest

    layer = plgpu.load(layer_ref.at[pl.ds(0, 1)]).reshape(())
    pid_m, pid_n, pid_s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m0, n0 = pid_m * bm, pid_n * bn
    K2, half = K // 2, blocksize // 2
    kb = K // blocksize          # scale blocks per row of W
    nkb = bk2 // half            # scale blocks per loop step
    rows = n0 + jnp.arange(bn)
    mmask = range_mask(m0, bm, M, M % bm != 0)
    nmask = range_mask(n0, bn, N, N % bn != 0)
    ragged = splits * steps * bk2 != K2
    if double:
        off = plgpu.load(off_ref.at[pl.ds(layer, 1)])                       # [1]
    x_dtype = xe_ref.dtype

    def body(i, acc):
        b0 = (pid_s * steps + i) * bk2
        kmask = range_mask(b0, bk2, K2, ragged)
        packed = load(codes_ref.at[layer, pl.ds(n0, bn), pl.ds(b0, bk2)], mask_2d(nmask, kmask), 0,
                      (bn, bk2)).astype(jnp.int32)
        hi = _nf4_lookup((packed >> 4) & 15, lut, table_ref)                # [bn, bk2] float32
        lo = _nf4_lookup(packed & 15, lut, table_ref)
        s0 = b0 // half
        smask = mask_2d(nmask, range_mask(s0, nkb, kb, ragged))
        sview = absq_ref.at[layer, pl.ds(n0, bn), pl.ds(s0, nkb)]
        if double:
            qa = load(sview, smask, 0, (bn, nkb)).astype(jnp.int32)
            blk = rows[:, None] * kb + (s0 + jnp.arange(nkb))[None, :]      # flat block index in the layer
            nidx = layer * nblocks2 + jnp.minimum(blk // NESTED_BLOCKSIZE, nblocks2 - 1)
            d = plgpu.load(dyn_ref.at[qa])
            s = plgpu.load(nested_ref.at[nidx])
            sc = no_fma(d * s) + off.reshape(1, 1)     # two roundings, as bitsandbytes
        else:
            sc = load(sview, smask, 0.0, (bn, nkb))
        if smask is not None:
            sc = jnp.where(jnp.broadcast_to(smask, (bn, nkb)), sc, jnp.float32(0.0))
        w_hi = (hi.reshape(bn, nkb, half) * sc[:, :, None]).reshape(bn, bk2).astype(x_dtype)
        w_lo = (lo.reshape(bn, nkb, half) * sc[:, :, None]).reshape(bn, bk2).astype(x_dtype)
        xe = load_tile(xe_ref, m0, bm, b0, bk2, mmask, kmask)
        xo = load_tile(xo_ref, m0, bm, b0, bk2, mmask, kmask)
        return acc + plgpu.dot(xe, w_hi, trans_b=True) + plgpu.dot(xo, w_lo, trans_b=True)

    acc = lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), jnp.float32))
    if has_lora:
        rp = xa_ref.shape[1]
        xa = load_tile(xa_ref, m0, bm, 0, rp, mmask, None)
        bb = load_tile(b_ref, 0, rp, n0, bn, None, nmask)
        lora = plgpu.dot(xa, bb)
        acc = acc + (lora if scale == 1.0 else scale * lora)
    if has_bias:
        acc = acc + load(bias_ref.at[pl.ds(n0, bn)], nmask).astype(jnp.float32)[None, :]
    if splits == 1:
        plgpu.store(o_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)], acc.astype(out_dtype), mask=mask_2d(mmask, nmask))
    else:
        plgpu.store(o_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)], acc, mask=mask_2d(mmask, nmask))


def _check(x, q, layer, bias, lora_a, lora_b):
    if not isinstance(q, NF4Weight) or not supported(q):
        raise ValueError(f"nf4_decode_linear: need an NF4Weight stacked over one axis with 2-D layers and "
                         f"in-features a multiple of its blocksize (a multiple of 32); got {q!r}")
    N, K = q.shape
    if x.ndim != 2 or x.shape[1] != K:
        raise ValueError(f"nf4_decode_linear: x must be [M, {K}], got {x.shape}")
    if x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise TypeError(f"nf4_decode_linear: x must be bfloat16, float16 or float32, got {x.dtype}")
    if jnp.shape(layer) != () or not jnp.issubdtype(jnp.result_type(layer), jnp.integer) \
            or isinstance(layer, bool):
        raise TypeError(f"nf4_decode_linear: layer must be an integer scalar, got {layer!r}")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"nf4_decode_linear: bias{bias.shape} should be ({N},)")
    if (lora_a is None) != (lora_b is None):
        raise ValueError("nf4_decode_linear: give both lora_a and lora_b, or neither")
    if lora_a is not None and (lora_a.shape[0] != K or lora_b.shape != (lora_a.shape[1], N)):
        raise ValueError(f"nf4_decode_linear: bad LoRA shapes a{lora_a.shape} b{lora_b.shape} for K={K}, N={N}")
    L = q.stack_shape[0]
    layer = jnp.asarray(layer, jnp.int32)
    return jnp.clip(jnp.where(layer < 0, layer + L, layer), 0, L - 1).reshape(1)


def nf4_decode_linear(x, q: NF4Weight, layer, *, bias=None, lora_a=None, lora_b=None, lora_scale=1.0,
                      config: NF4DecodeConfig | None = None, interpret=None) -> jax.Array:
    """y = x @ dequantize_nf4(q[layer], x.dtype).T (+ bias) (+ lora_scale * (x @ lora_a) @ lora_b).

    x [M, K] (bf16, fp16 or fp32); q an NF4Weight stacked over L layers, each HF [N, K] (see `supported`);
    layer a Python int or int32 scalar (traced or not; negative counts from the end; clamped to the stack);
    bias [N]; lora_a [K, r], lora_b [r, N] or both None. f32 accumulation, result [M, N] in x.dtype. The weights
    are the values `dequantize_nf4(q[layer], x.dtype)` holds, so the result equals that matrix's product up to
    the order of the f32 sums. Inference only (not differentiable)."""
    interpret = resolve_interpret(interpret)
    layer = _check(x, q, layer, bias, lora_a, lora_b)
    cfg = config or pick_config(x.shape[0], q.shape[1], q.shape[0])
    M, K = x.shape
    N = q.shape[0]
    L = q.stack_shape[0]
    bm, bn, bk2, S = _resolve(cfg, M, K, N, q.blocksize)
    steps = cdiv(cdiv(K // 2, bk2), S)
    pairs = x.reshape(M, K // 2, 2)
    operands = [layer, pairs[:, :, 0], pairs[:, :, 1], q.codes.reshape(L, N, K // 2)]
    if q.double_quant:
        operands += [q.absmax.reshape(L, N, K // q.blocksize), q.nested_absmax.astype(jnp.float32).reshape(-1),
                     jnp.reshape(q.offset, (L,)).astype(jnp.float32), jnp.asarray(DYNAMIC_MAP, jnp.float32)]
    else:
        operands += [q.absmax.astype(jnp.float32).reshape(L, N, K // q.blocksize)]
    if cfg.lut == "gather":
        operands.append(jnp.asarray(np.asarray(NF4_CODE, np.float32)))
    has_lora = lora_a is not None
    if has_lora:
        r = lora_a.shape[1]
        rp = max(16, next_pow2(r))
        xa = jnp.dot(x, lora_a.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
        b = lora_b.astype(x.dtype)
        if rp != r:  # the rank padded to a power of two with zero columns / rows (tiny arrays)
            xa = jnp.pad(xa, ((0, 0), (0, rp - r)))
            b = jnp.pad(b, ((0, rp - r), (0, 0)))
    in_kernel = S == 1
    if has_lora and in_kernel:
        operands += [xa, b]
    if bias is not None and in_kernel:
        operands.append(bias.astype(x.dtype))
    out_shape, out_spec = split_k_output(M, N, S, x.dtype)
    kernel = functools.partial(
        _kernel, M=M, N=N, K=K, blocksize=q.blocksize, nblocks2=q.nblocks2, bm=bm, bn=bn, bk2=bk2, steps=steps,
        splits=S, double=q.double_quant, lut=cfg.lut, has_lora=has_lora and in_kernel,
        has_bias=bias is not None and in_kernel, scale=float(lora_scale), out_dtype=out_shape.dtype)
    y = pl.pallas_call(
        kernel,
        grid=(cdiv(M, bm), cdiv(N, bn), S),
        in_specs=[full_spec(jnp.shape(a)) for a in operands],
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=compiler_params(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="nf4_decode_linear",
    )(*operands)
    if in_kernel:
        return y
    y = jnp.sum(y, axis=0)
    if has_lora:
        y = y + float(lora_scale) * jnp.dot(xa, b, preferred_element_type=jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)
