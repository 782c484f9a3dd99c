"""NF4 weights stored byte-for-byte like bitsandbytes, with Pallas dequantization and 4-bit matmul.

Storage (`NF4Weight`)
---------------------
An `NF4Weight` holds exactly what a bitsandbytes / transformers 4-bit checkpoint holds for one weight
(`quant_type="nf4"`, default `blocksize=64`, `compress_statistics=True`), in bitsandbytes' own layout:

* ``codes``          uint8 ``[ceil(numel/2)]`` - the flattened (row-major, HF ``[out, in]``) weight, two 4-bit
  codes per byte, the FIRST element of each pair in the HIGH nibble (``byte = c[2i] << 4 | c[2i+1]``; this is
  what bitsandbytes' ``quantize_4bit`` writes and what its ``dequantize_4bit`` reads). With an odd numel the
  low nibble of the last byte is padding (code 7, i.e. 0.0, as bitsandbytes writes it).
* ``absmax``         one scale per block of ``blocksize`` consecutive elements of the flattened tensor
  (``ceil(numel/blocksize)`` blocks; the last one may be partial). With double quantization these are uint8
  codes of the 256-entry "dynamic" map (`DYNAMIC_MAP`), otherwise float32.
* ``nested_absmax``  float32 ``[ceil(nblocks/256)]`` scales of the 8-bit absmax codes (double quant only).
* ``offset``         float32 scalar: the mean that was subtracted from the absmax before the 8-bit
  quantization (double quant only).

  A block's scale is ``DYNAMIC_MAP[absmax[b]] * nested_absmax[b // 256] + offset`` (two separately rounded
  float32 operations, never a fused multiply-add, as bitsandbytes computes it), and an element's value is
  ``NF4_CODE[code] * scale`` rounded once to the output dtype.

Static metadata (pytree aux data): ``shape`` (original shape, HF/bitsandbytes ``[out, in]``), ``dtype``
(name of the original dtype) and ``blocksize``. The arrays are the pytree children (``nested_absmax`` /
``offset`` are ``None`` without double quantization).

Stacked layers: every child array may carry leading axes, e.g. ``codes [L, nbytes]``, ``absmax [L, nblocks]``,
``nested_absmax [L, nblocks2]``, ``offset [L]``, while the metadata still describes ONE layer. Then
``jax.tree.map(lambda a: a[i], stacked)`` (or ``lax.scan`` over the leading axis) yields a valid single-layer
`NF4Weight`; `stack_nf4` builds such a stack from per-layer weights.

Matching bitsandbytes (facts checked against bitsandbytes 0.50 `functional.py`, `backends/default/ops.py`
and `csrc/cpu_ops.cpp`; tests/kernels/test_nf4_bnb.py compares with the real library on the CPU)
----------------------------------------------------------------------------------------------------------
* 4-bit codes: ``absmax = max|x|`` per block of the flattened tensor; full blocks are scaled by
  ``x * (1/absmax)``, the trailing partial block by ``x / absmax`` (bitsandbytes' default/CPU kernel does
  exactly that); the scaled value is clamped to [-1, 1] and gets the index of the first NF4 decision bound
  (midpoints ``(c[i]+c[i+1])/2`` in float32) that is ``>= x`` (``torch.bucketize``; an exact tie goes to the
  lower code). An all-zero trailing block stores absmax 1e-38 (bitsandbytes clamps it); an all-zero full
  block stores 0. bitsandbytes' CUDA kernel compares with the same float32 midpoints (a decision tree, ties
  also to the lower code) but multiplies the trailing block by the reciprocal as well, so it can differ from
  the CPU result only there, on values within an ulp of a midpoint.
* Double quantization: ``offset = mean(absmax)`` in float32, then ``absmax - offset`` is quantized blockwise
  (256 values per block, float32 block scales) to the 8-bit dynamic map. bitsandbytes' CPU kernel picks each
  8-bit code through a 65536-entry lookup table (the normalized value is rounded to a uniform grid of step
  2/65535 and the table holds the nearest code for each grid point); its CUDA kernel instead binary-searches
  the nearest code directly. The two disagree on about 0.15-0.2% of the codes (measured against a nearest
  search: near code midpoints, and the dynamic map's densely spaced codes near zero, which the LUT can never
  return: only 249 of the 256 codes are reachable on the CPU). We reproduce the
  CPU rule exactly: `_DYN_THRESHOLDS` holds, for every code c, the smallest float32 value that the CPU rule
  maps to a code >= c (derived once from the LUT construction), so the code is a count of exact float32
  comparisons, independent of FMA contraction or backend. Relative to the CUDA rule our absmax codes are
  therefore at most one 8-bit step away, and checkpoints written by either are DEcoded exactly (decoding is
  the same table lookup everywhere).
* The offset: bitsandbytes takes ``torch.mean`` of the float32 absmax, i.e. a float32 sum (torch's cascade
  summation, whose last bit depends on the SIMD width and thread count of the machine) divided by n in
  float32. We compute the float32 sum correctly rounded (double-float32 accumulation) and divide by n
  in float32, so our offset equals bitsandbytes' whenever torch's sum is correctly rounded and otherwise
  differs by an ulp or two (then the absmax codes and nested scales may differ accordingly; given the same
  offset they are identical, which the bitsandbytes test checks). Measured on a 2-core AVX2 machine: equal
  for every weight below 32768 blocks (torch sums those serially); 1 in ~12 of the 4096x4096 weights off
  by one ulp.
* Compilers must not change the float32 arithmetic: XLA rewrites ``x / c`` (constant or broadcast scalar)
  into ``x * (1/c)`` and XLA, LLVM and Triton contract ``a * b + c`` into an FMA. `_exact_div` and
  `_no_fma` keep the IEEE operations bitsandbytes performs (checked bit-exact against bitsandbytes on the
  CPU, and GPU against CPU by the `gpu` tests).
* bitsandbytes' CPU ``dequantize_4bit`` has a bug on AVX-512 machines when the last dimension is a multiple
  of 16 but not of 64; such shapes are kept out of the comparison tests (our own dequantization is exact for
  every shape).

Kernels
-------
* `dequantize_nf4(q, dtype)`: a Pallas kernel over the flat byte array (any shape, odd numel, partial last
  block); the double-quantized scales are decoded inside the kernel.
* `nf4_matmul(x, q)` = ``x @ dequantize(q).T`` (``x [..., in] -> [..., out]``): for ``M = prod(x.shape[:-1])``
  up to a threshold (`_FUSED_MAX_M`, measured on the GPU) a fused kernel dequantizes weight tiles on the fly
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
import json
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._common import cdiv, compiler_params, next_pow2, pl, plgpu, resolve_interpret

# ------------------------------------------------------------------------------------------------------
# Constant tables
# ------------------------------------------------------------------------------------------------------

#: The 16 NF4 values (bitsandbytes `get_4bit_type("nf4")`, float32), indexed by the 4-bit code.
NF4_CODE = np.array(
    [
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
        -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
        0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
        0.7229568362236023, 1.0,
    ],
    dtype=np.float32,
)

#: NF4 decision bounds: code = number of bounds strictly below the scaled value (float32 midpoints).
NF4_BOUNDS = ((NF4_CODE[:-1] + NF4_CODE[1:]) / np.float32(2)).astype(np.float32)

#: bitsandbytes' 256-entry signed "dynamic" map used for the 8-bit absmax codes, exactly as its
#: `create_dynamic_map()` returns it (float32 bits; hard-coded rather than rebuilt, since rebuilding it with
#: other arithmetic can differ in the last bit). test_nf4_bnb.py checks it against the library.
DYNAMIC_MAP = np.array(
    [
        -0.99296874, -0.9789063, -0.96484375, -0.9507812, -0.93671876, -0.92265624, -0.9085938, -0.89453125,
        -0.8804687, -0.86640626, -0.85234374, -0.8382813, -0.82421875, -0.8101562, -0.79609376, -0.78203124,
        -0.7679688, -0.75390625, -0.7398437, -0.72578126, -0.7117188, -0.6976563, -0.68359375, -0.6695312,
        -0.65546876, -0.6414063, -0.6273438, -0.61328125, -0.5992187, -0.58515626, -0.5710938, -0.5570313,
        -0.54296875, -0.5289062, -0.5148437, -0.50078124, -0.4867187, -0.47265625, -0.45859373, -0.44453126,
        -0.43046874, -0.41640624, -0.40234375, -0.38828123, -0.37421876, -0.36015624, -0.34609374, -0.33203125,
        -0.31796873, -0.30390626, -0.28984374, -0.27578127, -0.26171875, -0.24765624, -0.23359375, -0.21953125,
        -0.20546874, -0.19140625, -0.17734376, -0.16328125, -0.14921875, -0.13515624, -0.12109375, -0.107031256,
        -0.09859375, -0.09578126, -0.092968754, -0.09015625, -0.08734375, -0.08453125, -0.08171876, -0.07890625,
        -0.07609375, -0.07328125, -0.070468746, -0.067656256, -0.06484375, -0.06203125, -0.059218753,
        -0.05640625, -0.05359375, -0.05078125, -0.04796875, -0.04515625, -0.042343747, -0.03953125, -0.036718752,
        -0.03390625, -0.03109375, -0.028281251, -0.02546875, -0.02265625, -0.019843752, -0.01703125, -0.01421875,
        -0.01140625, -0.00971875, -0.009156249, -0.00859375, -0.00803125, -0.00746875, -0.00690625, -0.00634375,
        -0.00578125, -0.0052187503, -0.0046562497, -0.00409375, -0.0035312497, -0.00296875, -0.00240625,
        -0.00184375, -0.0012812499, -0.0009437501, -0.00083125, -0.00071875006, -0.0006062501, -0.00049375003,
        -0.00038125002, -0.00026875004, -0.00015625001, -8.875e-05, -6.625e-05, -4.375e-05, -2.1249998e-05,
        -7.75e-06, -3.2500002e-06, -5.5000004e-07, 0, 5.5000004e-07, 3.2500002e-06, 7.75e-06, 2.1249998e-05,
        4.375e-05, 6.625e-05, 8.875e-05, 0.00015625001, 0.00026875004, 0.00038125002, 0.00049375003,
        0.0006062501, 0.00071875006, 0.00083125, 0.0009437501, 0.0012812499, 0.00184375, 0.00240625, 0.00296875,
        0.0035312497, 0.00409375, 0.0046562497, 0.0052187503, 0.00578125, 0.00634375, 0.00690625, 0.00746875,
        0.00803125, 0.00859375, 0.009156249, 0.00971875, 0.01140625, 0.01421875, 0.01703125, 0.019843752,
        0.02265625, 0.02546875, 0.028281251, 0.03109375, 0.03390625, 0.036718752, 0.03953125, 0.042343747,
        0.04515625, 0.04796875, 0.05078125, 0.05359375, 0.05640625, 0.059218753, 0.06203125, 0.06484375,
        0.067656256, 0.070468746, 0.07328125, 0.07609375, 0.07890625, 0.08171876, 0.08453125, 0.08734375,
        0.09015625, 0.092968754, 0.09578126, 0.09859375, 0.107031256, 0.12109375, 0.13515624, 0.14921875,
        0.16328125, 0.17734376, 0.19140625, 0.20546874, 0.21953125, 0.23359375, 0.24765624, 0.26171875,
        0.27578127, 0.28984374, 0.30390626, 0.31796873, 0.33203125, 0.34609374, 0.36015624, 0.37421876,
        0.38828123, 0.40234375, 0.41640624, 0.43046874, 0.44453126, 0.45859373, 0.47265625, 0.4867187,
        0.50078124, 0.5148437, 0.5289062, 0.54296875, 0.5570313, 0.5710938, 0.58515626, 0.5992187, 0.61328125,
        0.6273438, 0.6414063, 0.65546876, 0.6695312, 0.68359375, 0.6976563, 0.7117188, 0.72578126, 0.7398437,
        0.75390625, 0.7679688, 0.78203124, 0.79609376, 0.8101562, 0.82421875, 0.8382813, 0.85234374, 0.86640626,
        0.8804687, 0.89453125, 0.9085938, 0.92265624, 0.93671876, 0.9507812, 0.96484375, 0.9789063, 0.99296874,
        1,
    ],
    dtype=np.float32,
)
assert DYNAMIC_MAP.shape == (256,) and np.all(np.diff(DYNAMIC_MAP) > 0)

NESTED_BLOCKSIZE = 256
_LUT_SIZE = 65536


@functools.lru_cache(maxsize=1)
def _cpu_lut() -> np.ndarray:
    """The 65536-entry table of bitsandbytes' CPU 8-bit quantizer: for each point of a uniform grid over
    [-1, 1] (step 2/65535, float32), the number of codebook midpoints strictly below it."""
    f32 = np.float32
    mid = (f32(0.5) * (DYNAMIC_MAP[:-1] + DYNAMIC_MAP[1:])).astype(f32)
    grid = (f32(-1.0) + (f32(2.0) * np.arange(_LUT_SIZE, dtype=f32)) / f32(_LUT_SIZE - 1)).astype(f32)
    return np.searchsorted(mid, grid, side="left")


def _cpu_lut_code8(v: np.ndarray) -> np.ndarray:
    """bitsandbytes' CPU rule for the 8-bit code of normalized float32 values (numpy emulation, float32 ops):
    clamp to [-1, 1], grid index ``int((v + 1) * 0.5 * 65535 + 0.5)``, table lookup."""
    f32 = np.float32
    lut = _cpu_lut()
    v = np.clip(np.asarray(v, dtype=f32), f32(-1), f32(1))
    t = ((v + f32(1)).astype(f32) * f32(0.5)).astype(f32)
    idx = ((t * f32(_LUT_SIZE - 1)).astype(f32) + f32(0.5)).astype(f32).astype(np.int64)
    return lut[idx]


def _f32_order_key(x: np.ndarray) -> np.ndarray:
    bits = np.asarray(x, np.float32).view(np.int32).astype(np.int64)
    return np.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def _f32_from_order_key(k: np.ndarray) -> np.ndarray:
    k = np.asarray(k, np.int64)
    return np.where(k < 0, (-k) | 0x80000000, k).astype(np.uint32).view(np.float32)


def _build_dyn_thresholds() -> np.ndarray:
    """For c = 1..255 the smallest float32 v in [-1, 1] whose CPU-rule 8-bit code is >= c (bisection over
    the ordered float32 values; the rule is monotone in v)."""
    target = np.arange(1, 256)
    lo = np.full(255, _f32_order_key(np.float32(-1.0)), np.int64)  # maps to code 0
    hi = np.full(255, _f32_order_key(np.float32(1.0)), np.int64)  # maps to code 255
    while np.any(hi - lo > 1):
        mid = (lo + hi) // 2
        ok = _cpu_lut_code8(_f32_from_order_key(mid)) >= target
        hi = np.where(ok, mid, hi)
        lo = np.where(ok, lo, mid)
    return _f32_from_order_key(hi).astype(np.float32)


#: code8(v) = number of thresholds <= v reproduces bitsandbytes' CPU 8-bit quantization of v exactly.
_DYN_THRESHOLDS = _build_dyn_thresholds()

_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


def _dtype_name(dtype) -> str:
    name = jnp.dtype(dtype).name
    if name not in _DTYPES:
        raise ValueError(f"NF4 supports bfloat16/float16/float32 weights, got {name}")
    return name


# ------------------------------------------------------------------------------------------------------
# The pytree
# ------------------------------------------------------------------------------------------------------


@jax.tree_util.register_pytree_node_class
class NF4Weight:
    """NF4-quantized weight in bitsandbytes' storage layout (see the module docstring).

    Children (arrays, may carry leading stacking axes): ``codes``, ``absmax``, ``nested_absmax``, ``offset``.
    Aux data (static): ``shape`` (one layer's original shape), ``dtype`` (its dtype name), ``blocksize``.
    """

    __slots__ = ("codes", "absmax", "nested_absmax", "offset", "shape", "dtype", "blocksize")

    def __init__(self, codes, absmax, nested_absmax, offset, *, shape, dtype, blocksize=64):
        self.codes = codes
        self.absmax = absmax
        self.nested_absmax = nested_absmax
        self.offset = offset
        self.shape = tuple(int(s) for s in shape)
        self.dtype = _dtype_name(dtype)
        self.blocksize = int(blocksize)

    # -- pytree protocol -------------------------------------------------------------------------------
    def tree_flatten(self):
        return (self.codes, self.absmax, self.nested_absmax, self.offset), (self.shape, self.dtype, self.blocksize)

    @classmethod
    def tree_unflatten(cls, aux, children):
        shape, dtype, blocksize = aux
        obj = object.__new__(cls)
        obj.codes, obj.absmax, obj.nested_absmax, obj.offset = children
        obj.shape, obj.dtype, obj.blocksize = shape, dtype, blocksize
        return obj

    # -- derived metadata ------------------------------------------------------------------------------
    @property
    def double_quant(self) -> bool:
        return self.nested_absmax is not None

    @property
    def numel(self) -> int:
        return int(math.prod(self.shape))

    @property
    def nbytes_packed(self) -> int:
        return (self.numel + 1) // 2

    @property
    def nblocks(self) -> int:
        return cdiv(self.numel, self.blocksize)

    @property
    def nblocks2(self) -> int:
        return cdiv(self.nblocks, NESTED_BLOCKSIZE)

    @property
    def stack_shape(self) -> tuple[int, ...]:
        """Leading (stacking) axes of the child arrays; () for a single weight."""
        return tuple(np.shape(self.codes)[:-1])

    def __repr__(self) -> str:
        lead = f"stack={self.stack_shape}, " if self.stack_shape else ""
        return (f"NF4Weight({lead}shape={self.shape}, dtype={self.dtype}, blocksize={self.blocksize}, "
                f"double_quant={self.double_quant})")


def stack_nf4(weights) -> NF4Weight:
    """Stack single-layer NF4Weights with identical metadata along a new leading axis (for lax.scan)."""
    weights = list(weights)
    aux = {jax.tree_util.tree_structure(w) for w in weights}
    if len(aux) != 1:
        raise ValueError("stack_nf4 needs weights with identical shape/dtype/blocksize/double_quant")
    return jax.tree.map(lambda *xs: jnp.stack(xs), *weights)


# ------------------------------------------------------------------------------------------------------
# Quantization (jnp; jit-able, runs on any backend)
# ------------------------------------------------------------------------------------------------------


def _f32_of_sum(values: np.ndarray) -> np.float32:
    """float32(math.fsum(values)) for a float64 vector, without the slow exact sum in the common case.

    numpy's float64 sum is within (n + 2) * 2**-52 * sum|values| of the exact sum (and of fsum's result); when
    both ends of that interval round to the same float32, that float32 is the answer. Otherwise (a sum within
    ~1e-10 relative of a float32 rounding boundary: rare) the exact sum decides."""
    total = float(np.sum(values))
    bound = (values.size + 2) * 2.0**-52 * float(np.sum(np.abs(values)))
    low, high = np.float32(total - bound), np.float32(total + bound)
    if low == high:
        return low
    return np.float32(math.fsum(values.tolist()))


def _mean_offset_host(absmax: jax.Array) -> np.ndarray:
    """float32 mean of the block absmax, computed on the host: the float32-rounded exact sum (as
    float32(math.fsum)), then one IEEE float32 division, like torch.mean up to its summation order. On the host so
    the result is the same bits whatever device quantizes: XLA on the H200 gave a mean 1 ulp away from XLA on the
    CPU for the same inputs (2026-11-29), which moved every nested scale by 1 ulp."""
    a = np.asarray(jax.device_get(absmax), np.float64).reshape(-1)
    return np.asarray(_f32_of_sum(a) / np.float32(a.size), np.float32)


def _exact_div(a: jax.Array, b) -> jax.Array:
    """IEEE float32 ``a / b`` (b a scalar). XLA turns a division by a constant or by a broadcast scalar into a
    multiplication by the rounded reciprocal; ``b + 0 * a`` (== b for finite a) is an ordinary array to it,
    so the true division is kept."""
    den = jnp.asarray(b, jnp.float32) + jnp.float32(0.0) * a
    return a / den


def _no_fma(p: jax.Array) -> jax.Array:
    """Identity for non-NaN `p` that stops a compiler from fusing the product `p` with a following add
    into a fused multiply-add (XLA CPU/GPU, LLVM and Triton all contract ``a * b + c`` otherwise), so
    ``_no_fma(a * b) + c`` is rounded twice, like bitsandbytes computes the double-quantized scales."""
    return jnp.where(p == p, p, jnp.float32(0.0))


def _quant_codes_8bit(vals: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Blockwise (256) 8-bit quantization of float32 `vals` exactly as bitsandbytes' CPU kernel.

    Returns (uint8 codes [n], float32 block absmax [ceil(n/256)])."""
    n = vals.shape[0]
    nb = cdiv(n, NESTED_BLOCKSIZE)
    blocks = jnp.pad(vals, (0, nb * NESTED_BLOCKSIZE - n)).reshape(nb, NESTED_BLOCKSIZE)
    amax = jnp.max(jnp.abs(blocks), axis=1)
    inv = jnp.float32(1.0) / jnp.where(amax > 0, amax, jnp.float32(1.0))
    v = blocks * inv[:, None]
    code = jnp.searchsorted(jnp.asarray(_DYN_THRESHOLDS), v.reshape(-1), side="right")
    code = jnp.where(jnp.repeat(amax > 0, NESTED_BLOCKSIZE), code, 0)  # all-zero block -> code 0
    return code[:n].astype(jnp.uint8), amax


def _double_quant(absmax: jax.Array, offset: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(uint8 absmax codes, float32 nested scales) of ``absmax - offset`` (bitsandbytes' CPU rule)."""
    return _quant_codes_8bit(absmax.astype(jnp.float32) - offset.astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("blocksize",))
def _quantize_blocks(w, blocksize: int):
    """(packed codes uint8 [ceil(n/2)], float32 absmax [nblocks]) of `w`."""
    n = w.size
    nblocks = cdiv(n, blocksize)
    rem = n % blocksize
    flat = jnp.pad(w.reshape(-1).astype(jnp.float32), (0, nblocks * blocksize - n))
    blocks = flat.reshape(nblocks, blocksize)
    absmax = jnp.max(jnp.abs(blocks), axis=1)
    # full blocks: x * (1/absmax)   (absmax == 0 -> all zeros -> 0.0 -> code 7, as bitsandbytes' clamp gives)
    inv = jnp.float32(1.0) / jnp.where(absmax > 0, absmax, jnp.float32(1.0))
    inv = jnp.where(absmax > 0, inv, jnp.float32(0.0))
    scaled = blocks * inv[:, None]
    if rem:
        # trailing partial block: x / max(absmax, 1e-38)
        am_last = absmax[-1]
        safe = jnp.where(am_last > 0, am_last, jnp.float32(1.0))
        last = jnp.where(am_last > 0, _exact_div(blocks[-1], safe), jnp.float32(0.0))
        scaled = scaled.at[-1].set(last)
        absmax = absmax.at[-1].set(jnp.where(am_last > 0, am_last, jnp.float32(1e-38)))
    scaled = jnp.clip(scaled, -1.0, 1.0).reshape(-1)
    code = jnp.zeros(scaled.shape, jnp.uint8)
    for bound in NF4_BOUNDS:  # count of bounds strictly below the value (torch.bucketize, right=False)
        code = code + (scaled > bound).astype(jnp.uint8)
    npairs = (n + 1) // 2
    code = code[: 2 * npairs].reshape(npairs, 2)
    packed = (code[:, 0] << 4) | code[:, 1]
    return packed, absmax


_double_quant_jit = jax.jit(_double_quant)


def quantize_nf4(w, blocksize: int = 64, double_quant: bool = True) -> NF4Weight:
    """Quantize `w` (HF ``[out, in]`` layout, any shape) to NF4 exactly as bitsandbytes' CPU
    ``quantize_4bit(w, quant_type="nf4", blocksize, compress_statistics=double_quant)``.

    Runs as jnp on the array's device (jit-compiled per shape). See the module docstring for how the 8-bit
    absmax codes and the offset relate to bitsandbytes' CPU and CUDA results."""
    if blocksize not in (32, 64, 128, 256, 512, 1024, 2048, 4096):
        raise ValueError(f"invalid blocksize {blocksize}")
    w = jnp.asarray(w)
    dtype = _dtype_name(w.dtype)
    codes, absmax = _quantize_blocks(w, blocksize)
    nested = offset = None
    if double_quant:
        offset = jnp.asarray(_mean_offset_host(absmax))
        absmax, nested = _double_quant_jit(absmax, offset)
    return NF4Weight(codes, absmax, nested, offset, shape=w.shape, dtype=dtype, blocksize=blocksize)


def _decoded_absmax_jnp(q: NF4Weight) -> jax.Array:
    """float32 per-block scales [..., nblocks] (plain jnp; multiply and add kept as two roundings)."""
    if not q.double_quant:
        return q.absmax.astype(jnp.float32)
    dyn = jnp.asarray(DYNAMIC_MAP)[q.absmax.astype(jnp.int32)]
    nidx = jnp.arange(q.absmax.shape[-1]) // NESTED_BLOCKSIZE
    prod = _no_fma(dyn * jnp.take(q.nested_absmax, nidx, axis=-1))
    return prod + jnp.expand_dims(q.offset, -1)


# ------------------------------------------------------------------------------------------------------
# Block-size tables (filled from the GPU sweep: `python bench/nf4.py --sweep`)
# ------------------------------------------------------------------------------------------------------

#: dequantize: key (shape class, output dtype name) -> config. block_bytes packed bytes per program
#: (2x as many elements); lut: "select" (4-level select tree) or "gather" (table load).
_DEQUANT_CONFIGS: dict[tuple[str, str], dict[str, Any]] = {
    # H200 sweep 2026-11-29 (bench/nf4.py --sweep=dequant, llama3-8b gate_up [14336, 4096]): the table load
    # ("gather") beat the select tree at every block size (1.6-2.2 vs 1.1-1.4 TB/s); 4096 bytes / 8 warps best.
    ("large", "bfloat16"): dict(block_bytes=4096, num_warps=8, num_stages=1, lut="gather"),
    ("large", "float16"): dict(block_bytes=4096, num_warps=8, num_stages=1, lut="gather"),
    ("large", "float32"): dict(block_bytes=2048, num_warps=8, num_stages=1, lut="gather"),
    # Below 4M elements a call is dominated by its fixed cost; 2048 bytes / 4 warps was as good as any.
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
#: the weight is dequantized by the Pallas kernel and multiplied by XLA. H200, 2026-11-29 (bench/nf4.py
#: --m=1,16,64): once dequantization used the table load, dequantize+matmul beat the fused kernel at every
#: M tried (1, 16, 64; Qwen2-1.5B and Llama-3-8B gate_up), e.g. M=16 on 4096->14336: 0.131 vs 0.171 ms.
#: So the fused kernel is never chosen automatically; impl="fused" still selects it.
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
    p = _no_fma(d * s)  # rounded on its own, then the offset added: two roundings like bitsandbytes
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
    bmask = byte0 + jnp.arange(block_bytes) < nbytes if masked else None
    packed = _load(codes_ref.at[pl.ds(byte0, block_bytes)], bmask, 0, (block_bytes,))
    vals = _nf4_lookup(_unpack_nibbles(packed), lut, table_ref)  # [2 * block_bytes] float32

    nblk = 2 * block_bytes // blocksize
    blk = pid * nblk + jnp.arange(nblk)
    kmask = blk < nblocks if masked else None
    if double:
        qa = _load(absq_ref.at[pl.ds(pid * nblk, nblk)], kmask, 0, (nblk,)).astype(jnp.int32)
        scale = _scales_from_codes(qa, blk, nested_ref, off_ref, dyn_ref, nblocks2)
    else:
        scale = _load(abs_ref.at[pl.ds(pid * nblk, nblk)], kmask, 0.0, (nblk,))
    out = (vals.reshape(nblk, blocksize) * scale[:, None]).reshape(2 * block_bytes).astype(o_ref.dtype)
    elem0 = 2 * byte0
    view = o_ref.at[pl.ds(elem0, 2 * block_bytes)]
    if masked:
        plgpu.store(view, out, mask=elem0 + jnp.arange(2 * block_bytes) < numel)
    else:  # the tiles cover the tensor exactly (every real model shape): no masks, full-width stores
        plgpu.store(view, out)


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
        out_shape=jax.ShapeDtypeStruct((q.numel,), _DTYPES[dtype_name]),
        compiler_params=compiler_params(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
        interpret=interpret,
        name="nf4_dequantize",
    )(*_dequant_inputs(q, cfg["lut"]))


def dequantize_nf4(q: NF4Weight, dtype=None, *, interpret: bool | None = None) -> jax.Array:
    """Dequantize to an array of the original shape (``q.shape``, with any stacking axes in front) in
    `dtype` (default: the original dtype). Pallas kernel; exact (bit-identical to bitsandbytes'
    ``dequantize_4bit`` when `dtype` is the original dtype)."""
    interpret = resolve_interpret(interpret)
    name = _dtype_name(dtype if dtype is not None else q.dtype)
    cfg = _dequant_config(q.numel, name)

    def one(layer: NF4Weight) -> jax.Array:
        return _dequant_flat_call(layer, name, cfg, interpret).reshape(layer.shape)

    lead = q.stack_shape
    if not lead:
        return one(q)
    flat = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[len(lead):]), q)
    out = jax.lax.map(one, flat)
    return out.reshape(lead + q.shape)


# ------------------------------------------------------------------------------------------------------
# Fused dequantize + matmul kernels (small M)
# ------------------------------------------------------------------------------------------------------


def _all(*masks):
    """AND of the masks that are not None (None when all are None: an unmasked access)."""
    masks = [m for m in masks if m is not None]
    return functools.reduce(jnp.logical_and, masks) if masks else None


def _load(view, mask, other, shape):
    if mask is None:
        return plgpu.load(view)
    return plgpu.load(view, mask=jnp.broadcast_to(mask, shape), other=other)


def _store(view, value, mask):
    if mask is None:
        plgpu.store(view, value)
    else:
        plgpu.store(view, value, mask=jnp.broadcast_to(mask, value.shape))


def _w_tile(refs, n0, k0, *, N, K, blocksize, block_n, block_k, nblocks2, double, lut, w_dtype, mask_n, mask_k):
    """Dequantized weight tile W[n0:n0+block_n, k0:k0+block_k] ([block_n, block_k], zero outside W).
    mask_n / mask_k: whether rows / columns of this tile can fall outside W (static)."""
    codes_ref, absq_ref, nested_ref, off_ref, dyn_ref, table_ref = refs
    kb = K // blocksize  # scale blocks per row (K % blocksize == 0)
    rows = n0 + jnp.arange(block_n)
    rmask = (rows < N)[:, None] if mask_n else None
    bcols = k0 // 2 + jnp.arange(block_k // 2)
    cmask = (bcols < K // 2)[None, :] if mask_k else None
    packed = _load(codes_ref.at[pl.ds(n0, block_n), pl.ds(k0 // 2, block_k // 2)], _all(rmask, cmask), 0,
                   (block_n, block_k // 2))
    vals = _nf4_lookup(_unpack_nibbles(packed), lut, table_ref)  # [block_n, block_k]
    nkb = max(block_k // blocksize, 1)
    scols = k0 // blocksize + jnp.arange(nkb)
    smask = _all(rmask, (scols < kb)[None, :] if mask_k else None)
    sview = absq_ref.at[pl.ds(n0, block_n), pl.ds(k0 // blocksize, nkb)]
    if double:
        qa = _load(sview, smask, 0, (block_n, nkb)).astype(jnp.int32)
        flat_blk = rows[:, None] * kb + scols[None, :]
        scale = _scales_from_codes(qa, flat_blk, nested_ref, off_ref, dyn_ref, nblocks2)
    else:
        scale = _load(sview, smask, 0.0, (block_n, nkb))
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
    mrow = (m0 + jnp.arange(block_m) < M)[:, None] if mask_m else None

    def body(t, acc):
        k0 = (s * trips + t) * block_k
        kmask = (k0 + jnp.arange(block_k) < K)[None, :] if mask_k else None
        xt = _load(x_ref.at[pl.ds(m0, block_m), pl.ds(k0, block_k)], _all(mrow, kmask), 0, (block_m, block_k))
        w = _w_tile(wrefs, n0, k0, N=N, K=K, blocksize=blocksize, block_n=block_n, block_k=block_k,
                    nblocks2=nblocks2, double=double, lut=lut, w_dtype=xt.dtype, mask_n=mask_n, mask_k=mask_k)
        return acc + plgpu.dot(xt, w, trans_b=True)

    acc = jax.lax.fori_loop(0, trips, body, jnp.zeros((block_m, block_n), jnp.float32))
    ncol = (n0 + jnp.arange(block_n) < N)[None, :] if mask_n else None
    _store(o_ref.at[s, pl.ds(m0, block_m), pl.ds(n0, block_n)], acc, _all(mrow, ncol))


def _bwd_kernel(*refs, M, N, K, blocksize, block_m, block_n, block_k, trips, nblocks2, double, lut,
                mask_m, mask_n, mask_k):
    """partial[s, m, k] = sum over this program's N range of dy[m, n] * W[n, k]."""
    g_ref, wrefs, o_ref = _split_refs(refs, double, lut)
    j, i, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    k0, m0 = j * block_k, i * block_m
    mrow = (m0 + jnp.arange(block_m) < M)[:, None] if mask_m else None

    def body(t, acc):
        n0 = (s * trips + t) * block_n
        nmask = (n0 + jnp.arange(block_n) < N)[None, :] if mask_n else None
        gt = _load(g_ref.at[pl.ds(m0, block_m), pl.ds(n0, block_n)], _all(mrow, nmask), 0, (block_m, block_n))
        w = _w_tile(wrefs, n0, k0, N=N, K=K, blocksize=blocksize, block_n=block_n, block_k=block_k,
                    nblocks2=nblocks2, double=double, lut=lut, w_dtype=gt.dtype, mask_n=mask_n, mask_k=mask_k)
        return acc + plgpu.dot(gt, w)

    acc = jax.lax.fori_loop(0, trips, body, jnp.zeros((block_m, block_k), jnp.float32))
    kcol = (k0 + jnp.arange(block_k) < K)[None, :] if mask_k else None
    _store(o_ref.at[s, pl.ds(m0, block_m), pl.ds(k0, block_k)], acc, _all(mrow, kcol))


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
    name = _dtype_name(a2d.dtype)
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

    float32 accumulation (the fused kernel's tiles, or XLA's GEMM), result in x.dtype.
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
    """``nf4_matmul(x, q) + scale * (x @ a) @ b`` with ``a [in, r]``, ``b [r, out]``; gradients for x, a, b
    (the LoRA part is plain XLA here)."""
    base = nf4_matmul(x, q, impl=impl, interpret=interpret)
    lora = jnp.dot(jnp.dot(x, a.astype(x.dtype)), b.astype(x.dtype))
    return base + (scale * lora).astype(x.dtype)


# ------------------------------------------------------------------------------------------------------
# bitsandbytes / transformers checkpoint tensors
# ------------------------------------------------------------------------------------------------------

_QS_SUFFIX = "quant_state.bitsandbytes__nf4"


def _np(a) -> np.ndarray:
    if hasattr(a, "detach"):  # a torch tensor slipped in
        a = a.detach().cpu().numpy()
    return np.asarray(a)


def nf4_from_bnb_tensors(tensors: dict[str, Any]) -> NF4Weight:
    """Build an NF4Weight from one weight's bitsandbytes 4-bit checkpoint tensors.

    Keys (optionally all carrying the same module prefix, e.g. ``model.layers.0.mlp.down_proj.``):
    ``weight`` (packed uint8 ``[ceil(numel/2), 1]``, or another storage dtype viewed as bytes),
    ``weight.absmax`` (uint8 with double quant, else float32), ``weight.quant_map`` (float32[16]),
    ``weight.nested_absmax``, ``weight.nested_quant_map`` (float32[256]) and
    ``weight.quant_state.bitsandbytes__nf4`` (uint8 bytes of a JSON dict with shape, dtype, blocksize,
    nested_offset, ...). The arrays are copied into jax arrays on the default device."""
    qs_keys = [k for k in tensors if k.endswith(_QS_SUFFIX)]
    if len(qs_keys) != 1:
        if any(k.endswith("quant_state.bitsandbytes__fp4") for k in tensors):
            raise NotImplementedError("FP4 checkpoints are not supported (NF4 only)")
        raise ValueError(f"expected exactly one '*{_QS_SUFFIX}' entry, found {qs_keys}")
    prefix = qs_keys[0][: -len(_QS_SUFFIX)]  # ends with "weight."
    meta = json.loads(bytes(_np(tensors[qs_keys[0]]).astype(np.uint8).reshape(-1)).decode("utf-8"))
    if meta.get("quant_type", "nf4") != "nf4":
        raise NotImplementedError(f"quant_type {meta.get('quant_type')} is not supported")
    shape = tuple(int(s) for s in meta["shape"])
    blocksize = int(meta["blocksize"])
    dtype = meta["dtype"]
    numel = int(math.prod(shape))

    packed = np.ascontiguousarray(_np(tensors[prefix[:-1]]))
    packed = packed.reshape(-1).view(np.uint8)[: (numel + 1) // 2]
    quant_map = _np(tensors.get(prefix + "quant_map", NF4_CODE)).astype(np.float32)
    if not np.array_equal(quant_map, NF4_CODE):
        raise ValueError("quant_map differs from the NF4 table")
    absmax = _np(tensors[prefix + "absmax"]).reshape(-1)
    nblocks = cdiv(numel, blocksize)
    if absmax.shape[0] != nblocks:
        raise ValueError(f"absmax has {absmax.shape[0]} entries, expected {nblocks}")
    if prefix + "nested_absmax" in tensors:
        if int(meta.get("nested_blocksize", NESTED_BLOCKSIZE)) != NESTED_BLOCKSIZE:
            raise NotImplementedError("only nested_blocksize 256 is supported")
        nested_map = _np(tensors[prefix + "nested_quant_map"]).astype(np.float32).reshape(-1)
        if not np.array_equal(nested_map, DYNAMIC_MAP):
            raise ValueError("nested_quant_map differs from bitsandbytes' dynamic map")
        nested = _np(tensors[prefix + "nested_absmax"]).astype(np.float32).reshape(-1)
        offset = np.float32(meta["nested_offset"])
        return NF4Weight(jnp.asarray(packed), jnp.asarray(absmax.astype(np.uint8)), jnp.asarray(nested),
                         jnp.asarray(offset), shape=shape, dtype=dtype, blocksize=blocksize)
    return NF4Weight(jnp.asarray(packed), jnp.asarray(absmax.astype(np.float32)), None, None,
                     shape=shape, dtype=dtype, blocksize=blocksize)


def nf4_to_bnb_tensors(q: NF4Weight) -> dict[str, np.ndarray]:
    """The bitsandbytes/transformers checkpoint tensors of a single NF4Weight (keys as in
    `nf4_from_bnb_tensors`, without a module prefix), byte-identical to what bitsandbytes'
    ``QuantState.as_dict(packed=True)`` plus the packed weight would be saved as."""
    if q.stack_shape:
        raise ValueError("nf4_to_bnb_tensors takes one layer; slice the stack first")
    meta: dict[str, Any] = {"quant_type": "nf4", "blocksize": q.blocksize, "dtype": q.dtype, "shape": list(q.shape)}
    out = {"weight": np.asarray(q.codes, np.uint8).reshape(-1, 1)}
    if q.double_quant:
        out["weight.absmax"] = np.asarray(q.absmax, np.uint8).reshape(-1)
    else:
        out["weight.absmax"] = np.asarray(q.absmax, np.float32).reshape(-1)
    out["weight.quant_map"] = NF4_CODE.copy()
    if q.double_quant:
        out["weight.nested_absmax"] = np.asarray(q.nested_absmax, np.float32).reshape(-1)
        out["weight.nested_quant_map"] = DYNAMIC_MAP.copy()
        meta.update({"nested_blocksize": NESTED_BLOCKSIZE, "nested_dtype": "float32",
                     "nested_offset": float(np.asarray(q.offset, np.float32))})
    out["weight." + _QS_SUFFIX] = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8).copy()
    return out


__all__ = [
    "NF4Weight", "NF4_CODE", "NF4_BOUNDS", "DYNAMIC_MAP", "NESTED_BLOCKSIZE", "quantize_nf4", "dequantize_nf4",
    "nf4_matmul", "qlora_linear", "stack_nf4", "nf4_from_bnb_tensors", "nf4_to_bnb_tensors",
]
