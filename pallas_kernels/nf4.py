"""Pallas kernels for NF4 weights (`pallas_kernels.nf4_format.NF4Weight`): dequantization and 4-bit matmul.

Wins (the dequantize kernel): 1.6-3.5x XLA's dequantization of Qwen2 / Llama gate_up, down and o, and the QLoRA step
is 2% (Qwen2-1.5B) / 5% (Llama-3-8B) faster than with its XLA twin (BENCHMARKS.md, "Kernels vs XLA, each alone, and
what the train step says", row NF4 dequantize). Default (ops.PALLAS_WINS["nf4_matmul"]): bf16 activations, this
kernel dequantizing and XLA multiplying. The fused dequantize-in-tile matmul wins nowhere (same section, row
nf4_matmul: it lost at every M from 1 to 8192): `_FUSED_MAX_M` is 0, so it runs only with impl="fused"; tested.

Kernels
-------
* `dequantize_nf4(q, dtype)`: a Pallas kernel over the flat byte array (any shape, odd numel, partial last
  block); the double-quantized scales are decoded inside the kernel.
* `nf4_matmul(x, q)` = ``x @ dequantize(q).T`` (``x [..., in] -> [..., out]``): for ``M = prod(x.shape[:-1])``
  up to a threshold (`_FUSED_MAX_M`, per dtype) a fused kernel dequantizes weight tiles on the fly
  inside the matmul (split over K for parallelism); above it the weight is dequantized by the Pallas kernel
  and multiplied by XLA. The backward gives dX only (``dy @ dequantize(q)``), again fused for small M and
  dequantize-then-matmul otherwise; no dequantized copy is kept between forward and backward. The weight is
  treated as a constant (its cotangent is zero).
* `qlora_linear(x, q, a, b, scale)` = ``nf4_matmul(x, q) + scale * (x @ a) @ b`` with gradients for x, a, b.
The fused matmul needs ``in % blocksize == 0`` (true for every real model shape); other shapes use the
dequantize path.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._common import (and_masks, broadcast_mask, cdiv, compiler_params, load, mask_2d, next_pow2, pl,
                                    plgpu, range_mask, resolve_interpret)
from pallas_kernels.nf4_format import DYNAMIC_MAP, NESTED_BLOCKSIZE, NF4_CODE, NF4Weight, nf4_dtype_name, no_fma

# ------------------------------------------------------------------------------------------------------
# Block-size tables (filled from the GPU sweep: `python bench/nf4.py --sweep`)
# ------------------------------------------------------------------------------------------------------

#: dequantize: key (shape class, output dtype name) -> config. block_bytes packed bytes per program
#: (2x as many elements); lut: "select" (4-level select tree) or "gather" (table load).
_DEQUANT_CONFIGS: dict[tuple[str, str], dict[str, Any]] = {
    # The table load ("gather") with 4096 bytes / 8 warps per program: the fastest in the H200 dequantization
    # sweep (`bench/nf4.py --sweep=dequant`; figures in BENCHMARKS.md, NF4).
    ("large", "bfloat16"): dict(block_bytes=4096, num_warps=8, num_stages=1, lut="gather"),
    ("large", "float16"): dict(block_bytes=4096, num_warps=8, num_stages=1, lut="gather"),
    ("large", "float32"): dict(block_bytes=2048, num_warps=8, num_stages=1, lut="gather"),
    # Below 4M elements a call's fixed cost dominates its time (BENCHMARKS.md, NF4); these entries are unswept.
    ("small", "bfloat16"): dict(block_bytes=2048, num_warps=4, num_stages=1, lut="gather"),
    ("small", "float16"): dict(block_bytes=2048, num_warps=4, num_stages=1, lut="gather"),
    ("small", "float32"): dict(block_bytes=1024, num_warps=4, num_stages=1, lut="gather"),
}

#: fused matmul: key (M class, compute dtype name, "fwd" | "bwd") -> config. For "fwd" (x @ W^T) block_n
#: tiles out-features and block_k is the reduction tile; for "bwd" (dy @ W) block_k tiles in-features and
#: block_n is the reduction tile. split: target number of programs (the reduction is split to reach it).
_MATMUL_CONFIGS: dict[tuple[str, str, str], dict[str, Any]] = {
    ("m16", "bfloat16", "fwd"): dict(block_m=16, block_n=64, block_k=256, target_programs=264,
                                     num_warps=4, num_stages=3, lut="select"),
    ("m64", "bfloat16", "fwd"): dict(block_m=64, block_n=64, block_k=128, target_programs=264,
                                     num_warps=4, num_stages=3, lut="select"),
    ("m16", "bfloat16", "bwd"): dict(block_m=16, block_n=128, block_k=64, target_programs=264,
                                     num_warps=4, num_stages=3, lut="select"),
    ("m64", "bfloat16", "bwd"): dict(block_m=64, block_n=128, block_k=64, target_programs=264,
                                     num_warps=4, num_stages=3, lut="select"),
}
_MATMUL_DEFAULT = dict(block_m=16, block_n=64, block_k=128, target_programs=264, num_warps=4, num_stages=2,
                       lut="select")

#: Largest M = prod(x.shape[:-1]) for which nf4_matmul uses the fused kernel (per compute dtype); above it
#: the weight is dequantized by the Pallas kernel and multiplied by XLA. 0: dequantize + matmul was the faster
#: of the two at every M measured on the H200 (BENCHMARKS.md, NF4), so the fused kernel runs only when
#: impl="fused" asks for it.
_FUSED_MAX_M: dict[str, int] = {"bfloat16": 0, "float16": 0, "float32": 0}


def _dequant_config(numel: int, dtype_name: str) -> dict[str, Any]:
    cls = "large" if numel >= (1 << 22) else "small"
    return dict(_DEQUANT_CONFIGS.get((cls, dtype_name), _DEQUANT_CONFIGS[(cls, "bfloat16")]))


def _matmul_config(m: int, dtype_name: str, direction: str) -> dict[str, Any]:
    cls = "m16" if m <= 16 else "m64"
    cfg = _MATMUL_CONFIGS.get((cls, dtype_name, direction))
    if cfg is None:
        cfg = _MATMUL_CONFIGS.get((cls, "bfloat16", direction), _MATMUL_DEFAULT)
    cfg = dict(cfg)
    cfg["block_m"] = max(16, min(cfg["block_m"], next_pow2(m)))
    return cfg


# ------------------------------------------------------------------------------------------------------
# In-kernel helpers
# ------------------------------------------------------------------------------------------------------


def _nf4_lookup(code: jax.Array, lut: str, table_ref=None) -> jax.Array:
    """float32 NF4 values of int32 codes (0..15) inside a kernel."""
    if lut == "gather":
        return plgpu.load(table_ref.at[code])
    vals = [np.float32(v) for v in NF4_CODE]
    bits = [(code & (1 << i)) != 0 for i in range(4)]
    level = [jnp.where(bits[0], vals[2 * i + 1], vals[2 * i]) for i in range(8)]
    for b in bits[1:]:
        level = [jnp.where(b, level[2 * i + 1], level[2 * i]) for i in range(len(level) // 2)]
    return level[0]


def _unpack_nibbles(packed: jax.Array) -> jax.Array:
    """uint8 [..., B] -> int32 codes [..., 2B] in element order (high nibble first)."""
    b = packed.astype(jnp.int32)
    both = jnp.stack([(b >> 4) & 15, b & 15], axis=-1)
    return both.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _scales_from_codes(qa, flat_block_idx, nested_ref, off_ref, dyn_ref, nblocks2):
    """float32 block scales from int32 8-bit codes `qa` and the flat block indices (same shape)."""
    d = plgpu.load(dyn_ref.at[qa])
    nidx = jnp.minimum(flat_block_idx // NESTED_BLOCKSIZE, nblocks2 - 1)
    s = plgpu.load(nested_ref.at[nidx])
    p = no_fma(d * s)  # rounded on its own, then the offset added: two roundings like bitsandbytes
    off = plgpu.load(off_ref.at[pl.ds(0, 1)])
    return p + off.reshape((1,) * p.ndim)


# ------------------------------------------------------------------------------------------------------
# Dequantization kernel (flat; any shape)
# ------------------------------------------------------------------------------------------------------


def _dequant_kernel(*refs, numel, nbytes, nblocks, nblocks2, blocksize, block_bytes, double, lut, masked):
    refs = list(refs)
    o_ref = refs.pop()
    table_ref = refs.pop() if lut == "gather" else None
    if double:
        codes_ref, absq_ref, nested_ref, off_ref, dyn_ref = refs
    else:
        codes_ref, abs_ref = refs
    pid = pl.program_id(0)
    byte0 = pid * block_bytes
    bmask = range_mask(byte0, block_bytes, nbytes, masked)
    packed = load(codes_ref.at[pl.ds(byte0, block_bytes)], bmask, 0, (block_bytes,))
    vals = _nf4_lookup(_unpack_nibbles(packed), lut, table_ref)  # [2 * block_bytes] float32

    nblk = 2 * block_bytes // blocksize
    blk = pid * nblk + jnp.arange(nblk)
    kmask = blk < nblocks if masked else None
    if double:
        qa = load(absq_ref.at[pl.ds(pid * nblk, nblk)], kmask, 0, (nblk,)).astype(jnp.int32)
        scale = _scales_from_codes(qa, blk, nested_ref, off_ref, dyn_ref, nblocks2)
    else:
        scale = load(abs_ref.at[pl.ds(pid * nblk, nblk)], kmask, 0.0, (nblk,))
    out = (vals.reshape(nblk, blocksize) * scale[:, None]).reshape(2 * block_bytes).astype(o_ref.dtype)
    elem0 = 2 * byte0
    # Unmasked when the tiles cover the tensor exactly (every real model shape): full-width stores.
    omask = range_mask(elem0, 2 * block_bytes, numel, masked)
    plgpu.store(o_ref.at[pl.ds(elem0, 2 * block_bytes)], out, mask=omask)


def _dequant_inputs(q: NF4Weight, lut: str) -> list:
    args = [q.codes]
    if q.double_quant:
        args += [q.absmax, q.nested_absmax.astype(jnp.float32),
                 jnp.reshape(q.offset, (1,)).astype(jnp.float32), jnp.asarray(DYNAMIC_MAP)]
    else:
        args += [q.absmax.astype(jnp.float32)]
    if lut == "gather":
        args.append(jnp.asarray(NF4_CODE))
    return args


def _dequant_flat_call(q: NF4Weight, dtype_name: str, cfg: dict[str, Any], interpret: bool) -> jax.Array:
    """Single-layer dequantization to a flat [numel] array with an explicit config."""
    bs = q.blocksize
    block_bytes = max(int(cfg["block_bytes"]), bs // 2)
    if block_bytes & (block_bytes - 1):
        raise ValueError("block_bytes must be a power of two")
    nbytes = q.nbytes_packed
    kernel = functools.partial(
        _dequant_kernel, numel=q.numel, nbytes=nbytes, nblocks=q.nblocks, nblocks2=q.nblocks2,
        blocksize=bs, block_bytes=block_bytes, double=q.double_quant, lut=cfg["lut"],
        masked=q.numel % (2 * block_bytes) != 0)
    return pl.pallas_call(
        kernel,
        grid=(cdiv(nbytes, block_bytes),),
        out_shape=jax.ShapeDtypeStruct((q.numel,), jnp.dtype(dtype_name)),
        compiler_params=compiler_params(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
        interpret=interpret,
        name="nf4_dequantize",
    )(*_dequant_inputs(q, cfg["lut"]))


def dequantize_nf4(q: NF4Weight, dtype=None, *, interpret: bool | None = None) -> jax.Array:
    """Dequantize `q` to ``[*stack, *q.shape]`` (the original shape, any stacking axes in front) in `dtype`:
    bfloat16, float16 or float32 (default: the original dtype).

    Pallas kernel; exact (bit-identical to bitsandbytes' ``dequantize_4bit`` when `dtype` is the original
    dtype)."""
    interpret = resolve_interpret(interpret)
    name = nf4_dtype_name(dtype if dtype is not None else q.dtype)

    def one(layer: NF4Weight) -> jax.Array:
        return dequantize_nf4_to(layer, name, interpret=interpret)

    lead = q.stack_shape
    if not lead:
        return one(q)
    flat = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[len(lead):]), q)
    out = jax.lax.map(one, flat)
    return out.reshape(lead + q.shape)


def dequantize_nf4_to(q: NF4Weight, dtype_name: str, *, interpret: bool) -> jax.Array:
    """One layer's dequantization [*q.shape] in any float dtype the kernel can store, float8_e4m3fn included
    (pallas_kernels.nf4_fp8 writes FP8 weights this way: the block scales then fold in the row scale), with
    the block config of that dtype (bfloat16's for dtypes the table has no entry for)."""
    if q.stack_shape:
        raise ValueError(f"dequantize_nf4_to needs one layer's weight, got {q}")
    cfg = _dequant_config(q.numel, dtype_name)
    return _dequant_flat_call(q, dtype_name, cfg, interpret).reshape(q.shape)


# ------------------------------------------------------------------------------------------------------
# Fused dequantize + matmul kernels (small M)
# ------------------------------------------------------------------------------------------------------


def _w_tile(refs, n0, k0, *, N, K, blocksize, block_n, block_k, nblocks2, double, lut, w_dtype, mask_n, mask_k):
    """Dequantized weight tile W[n0:n0+block_n, k0:k0+block_k] ([block_n, block_k], zero outside W).
    mask_n / mask_k: whether rows / columns of this tile can fall outside W (static)."""
    codes_ref, absq_ref, nested_ref, off_ref, dyn_ref, table_ref = refs
    kb = K // blocksize  # scale blocks per row (K % blocksize == 0)
    rows = n0 + jnp.arange(block_n)
    rmask = (rows < N)[:, None] if mask_n else None
    bcols = k0 // 2 + jnp.arange(block_k // 2)
    cmask = (bcols < K // 2)[None, :] if mask_k else None
    packed = load(codes_ref.at[pl.ds(n0, block_n), pl.ds(k0 // 2, block_k // 2)], and_masks(rmask, cmask), 0,
                   (block_n, block_k // 2))
    vals = _nf4_lookup(_unpack_nibbles(packed), lut, table_ref)  # [block_n, block_k]
    nkb = max(block_k // blocksize, 1)
    scols = k0 // blocksize + jnp.arange(nkb)
    smask = and_masks(rmask, (scols < kb)[None, :] if mask_k else None)
    sview = absq_ref.at[pl.ds(n0, block_n), pl.ds(k0 // blocksize, nkb)]
    if double:
        qa = load(sview, smask, 0, (block_n, nkb)).astype(jnp.int32)
        flat_blk = rows[:, None] * kb + scols[None, :]
        scale = _scales_from_codes(qa, flat_blk, nested_ref, off_ref, dyn_ref, nblocks2)
    else:
        scale = load(sview, smask, 0.0, (block_n, nkb))
    if smask is not None:
        scale = jnp.where(smask, scale, jnp.float32(0.0))
    if block_k >= blocksize:
        w = (vals.reshape(block_n, nkb, blocksize) * scale[:, :, None]).reshape(block_n, block_k)
    else:  # tile narrower than a scale block: one scale per row of the tile
        w = vals * scale
    return w.astype(w_dtype)


def _split_refs(refs, double, lut):
    refs = list(refs)
    o_ref = refs.pop()
    table_ref = refs.pop() if lut == "gather" else None
    a_ref = refs.pop(0)
    if double:
        codes_ref, absq_ref, nested_ref, off_ref, dyn_ref = refs
    else:
        (codes_ref, absq_ref), nested_ref, off_ref, dyn_ref = refs, None, None, None
    return a_ref, (codes_ref, absq_ref, nested_ref, off_ref, dyn_ref, table_ref), o_ref


def _fwd_kernel(*refs, M, N, K, blocksize, block_m, block_n, block_k, trips, nblocks2, double, lut,
                mask_m, mask_n, mask_k):
    """partial[s, m, n] = sum over this program's K range of x[m, k] * W[n, k]."""
    x_ref, wrefs, o_ref = _split_refs(refs, double, lut)
    j, i, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    n0, m0 = j * block_n, i * block_m
    mrow = mask_2d(range_mask(m0, block_m, M, mask_m), None)  # [block_m, 1] or None

    def body(t, acc):
        k0 = (s * trips + t) * block_k
        kmask = mask_2d(None, range_mask(k0, block_k, K, mask_k))
        xt = load(x_ref.at[pl.ds(m0, block_m), pl.ds(k0, block_k)], and_masks(mrow, kmask), 0, (block_m, block_k))
        w = _w_tile(wrefs, n0, k0, N=N, K=K, blocksize=blocksize, block_n=block_n, block_k=block_k,
                    nblocks2=nblocks2, double=double, lut=lut, w_dtype=xt.dtype, mask_n=mask_n, mask_k=mask_k)
        return acc + plgpu.dot(xt, w, trans_b=True)

    acc = jax.lax.fori_loop(0, trips, body, jnp.zeros((block_m, block_n), jnp.float32))
    omask = broadcast_mask(and_masks(mrow, mask_2d(None, range_mask(n0, block_n, N, mask_n))), acc.shape)
    plgpu.store(o_ref.at[s, pl.ds(m0, block_m), pl.ds(n0, block_n)], acc, mask=omask)


def _bwd_kernel(*refs, M, N, K, blocksize, block_m, block_n, block_k, trips, nblocks2, double, lut,
                mask_m, mask_n, mask_k):
    """partial[s, m, k] = sum over this program's N range of dy[m, n] * W[n, k]."""
    g_ref, wrefs, o_ref = _split_refs(refs, double, lut)
    j, i, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    k0, m0 = j * block_k, i * block_m
    mrow = mask_2d(range_mask(m0, block_m, M, mask_m), None)  # [block_m, 1] or None

    def body(t, acc):
        n0 = (s * trips + t) * block_n
        nmask = mask_2d(None, range_mask(n0, block_n, N, mask_n))
        gt = load(g_ref.at[pl.ds(m0, block_m), pl.ds(n0, block_n)], and_masks(mrow, nmask), 0, (block_m, block_n))
        w = _w_tile(wrefs, n0, k0, N=N, K=K, blocksize=blocksize, block_n=block_n, block_k=block_k,
                    nblocks2=nblocks2, double=double, lut=lut, w_dtype=gt.dtype, mask_n=mask_n, mask_k=mask_k)
        return acc + plgpu.dot(gt, w)

    acc = jax.lax.fori_loop(0, trips, body, jnp.zeros((block_m, block_k), jnp.float32))
    omask = broadcast_mask(and_masks(mrow, mask_2d(None, range_mask(k0, block_k, K, mask_k))), acc.shape)
    plgpu.store(o_ref.at[s, pl.ds(m0, block_m), pl.ds(k0, block_k)], acc, mask=omask)


def _fused_supported(q: NF4Weight) -> bool:
    return len(q.shape) == 2 and q.shape[1] % q.blocksize == 0 and not q.stack_shape


def _fused_weight_inputs(q: NF4Weight, lut: str) -> list:
    N, K = q.shape
    args = [q.codes.reshape(N, K // 2)]
    if q.double_quant:
        args += [q.absmax.reshape(N, K // q.blocksize), q.nested_absmax.astype(jnp.float32),
                 jnp.reshape(q.offset, (1,)).astype(jnp.float32), jnp.asarray(DYNAMIC_MAP)]
    else:
        args += [q.absmax.astype(jnp.float32).reshape(N, K // q.blocksize)]
    if lut == "gather":
        args.append(jnp.asarray(NF4_CODE))
    return args


def _fused_call(a2d: jax.Array, q: NF4Weight, direction: str, cfg: dict[str, Any], interpret: bool):
    """fwd: a2d [M, K] -> a2d @ W^T [M, N];  bwd: a2d [M, N] -> a2d @ W [M, K]  (float32 result)."""
    N, K = q.shape
    M = a2d.shape[0]
    bm, bn, bk = int(cfg["block_m"]), int(cfg["block_n"]), int(cfg["block_k"])
    for b in (bm, bn, bk):
        if b < 16 or b & (b - 1):
            raise ValueError("block sizes must be powers of two >= 16")
    if direction == "fwd":
        tiles, reduce_len, reduce_block, kern = cdiv(N, bn), K, bk, _fwd_kernel
        out_cols = N
    else:
        tiles, reduce_len, reduce_block, kern = cdiv(K, bk), N, bn, _bwd_kernel
        out_cols = K
    mtiles = cdiv(M, bm)
    nchunks = cdiv(reduce_len, reduce_block)
    split = max(1, min(nchunks, cdiv(int(cfg["target_programs"]), tiles * mtiles)))
    trips = cdiv(nchunks, split)
    split = cdiv(nchunks, trips)
    ragged_reduce = reduce_len % reduce_block != 0 or split * trips != nchunks
    if direction == "fwd":
        mask_n, mask_k = N % bn != 0, ragged_reduce
    else:
        mask_n, mask_k = ragged_reduce, K % bk != 0
    kernel = functools.partial(
        kern, M=M, N=N, K=K, blocksize=q.blocksize, block_m=bm, block_n=bn, block_k=bk, trips=trips,
        nblocks2=q.nblocks2, double=q.double_quant, lut=cfg["lut"], mask_m=M % bm != 0, mask_n=mask_n,
        mask_k=mask_k)
    partial = pl.pallas_call(
        kernel,
        grid=(tiles, mtiles, split),
        out_shape=jax.ShapeDtypeStruct((split, M, out_cols), jnp.float32),
        compiler_params=compiler_params(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
        interpret=interpret,
        name=f"nf4_matmul_{direction}",
    )(a2d, *_fused_weight_inputs(q, cfg["lut"]))
    return partial[0] if split == 1 else jnp.sum(partial, axis=0)


# ------------------------------------------------------------------------------------------------------
# nf4_matmul / qlora_linear
# ------------------------------------------------------------------------------------------------------


def _choose_impl(m: int, q: NF4Weight, dtype_name: str, impl: str | None) -> str:
    if impl is not None:
        if impl not in ("fused", "dequant"):
            raise ValueError("impl must be None, 'fused' or 'dequant'")
        if impl == "fused" and not _fused_supported(q):
            raise ValueError(f"the fused kernel needs a 2-D weight with in % blocksize == 0, got {q}")
        return impl
    if _fused_supported(q) and m <= _FUSED_MAX_M.get(dtype_name, 64):
        return "fused"
    return "dequant"


def _matmul_2d(a2d, q: NF4Weight, direction: str, impl: str | None, interpret: bool):
    m = a2d.shape[0]
    name = nf4_dtype_name(a2d.dtype)
    which = _choose_impl(m, q, name, impl)
    if which == "fused":
        return _fused_call(a2d, q, direction, _matmul_config(m, name, direction), interpret).astype(a2d.dtype)
    N, K = q.shape[0], q.numel // q.shape[0]
    w = _dequant_flat_call(q, name, _dequant_config(q.numel, name), interpret).reshape(N, K)
    contract = ((1,), (1,)) if direction == "fwd" else ((1,), (0,))
    # Output directly in the input dtype (float32 accumulation inside the GEMM): no float32 [M, N] temporary.
    return jax.lax.dot_general(a2d, w, (contract, ((), ())))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _nf4_matmul(x, q, impl, interpret):
    lead = x.shape[:-1]
    out = _matmul_2d(x.reshape(-1, x.shape[-1]), q, "fwd", impl, interpret)
    return out.reshape(*lead, q.shape[0])


def _nf4_matmul_fwd(x, q, impl, interpret):
    return _nf4_matmul(x, q, impl, interpret), q


def _nf4_matmul_bwd(impl, interpret, q, g):
    lead = g.shape[:-1]
    dx = _matmul_2d(g.reshape(-1, g.shape[-1]), q, "bwd", impl, interpret)
    return dx.reshape(*lead, dx.shape[-1]), None  # the NF4 weight is frozen: zero cotangent


_nf4_matmul.defvjp(_nf4_matmul_fwd, _nf4_matmul_bwd)


def nf4_matmul(x, q: NF4Weight, *, impl: str | None = None, interpret: bool | None = None) -> jax.Array:
    """``x @ dequantize_nf4(q, x.dtype).T`` for a 2-D NF4 weight ``[out, in]``: ``x [..., in] -> [..., out]``.

    x is bfloat16, float16 or float32; float32 accumulation (the fused kernel's tiles, or XLA's GEMM), result in
    x.dtype.
    `impl`: None (by M, see `_FUSED_MAX_M`), "fused" or "dequant".
    Differentiable in x only (the weight gets a zero cotangent); no dequantized weight is kept for the
    backward pass."""
    if len(q.shape) != 2 or q.stack_shape:
        raise ValueError(f"nf4_matmul needs a single 2-D NF4 weight, got {q}")
    if x.shape[-1] != q.shape[1]:
        raise ValueError(f"x last dim {x.shape[-1]} != weight in-features {q.shape[1]}")
    return _nf4_matmul(x, q, impl, resolve_interpret(interpret))


def qlora_linear(x, q: NF4Weight, a, b, scale, *, impl: str | None = None,
                 interpret: bool | None = None) -> jax.Array:
    """``nf4_matmul(x, q) + scale * (x @ a) @ b``: ``x [..., in]`` (bfloat16, float16 or float32), NF4 weight
    ``[out, in]``, ``a [in, r]``, ``b [r, out]`` (cast to x.dtype) -> ``[..., out]`` in x.dtype.

    Gradients for x, a, b (the LoRA part is plain XLA here); the NF4 weight is frozen."""
    base = nf4_matmul(x, q, impl=impl, interpret=interpret)
    lora = jnp.dot(jnp.dot(x, a.astype(x.dtype)), b.astype(x.dtype))
    return base + (scale * lora).astype(x.dtype)


# Names that moved to pallas_kernels.nf4_format (the bitsandbytes format) when the kernels and the format were
# split: asking this module for one says where it went.
_MOVED_TO_FORMAT = ("quantize_nf4", "stack_nf4", "nf4_from_bnb_tensors", "nf4_to_bnb_tensors", "decoded_absmax")


def __getattr__(name: str):
    if name in _MOVED_TO_FORMAT:
        raise AttributeError(f"pallas_kernels.nf4.{name} moved to pallas_kernels.nf4_format.{name} (the NF4 format "
                             f"lives there, the kernels here): `from pallas_kernels.nf4_format import {name}`"
                             + (" or `from pallas_kernels import quantize_nf4`" if name == "quantize_nf4" else ""))
    raise AttributeError(f"module 'pallas_kernels.nf4' has no attribute '{name}'")

__all__ = ["dequantize_nf4", "nf4_matmul", "qlora_linear"]
