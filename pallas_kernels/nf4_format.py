"""The NF4 weight format, byte-for-byte as bitsandbytes stores it: `NF4Weight`, quantization, checkpoint tensors.

Plain numpy / jnp, no Pallas kernels: the kernels that read this format (dequantization, 4-bit matmul) are in
`pallas_kernels.nf4`.

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
  offset they are identical, which the bitsandbytes test checks). How often the offsets differ on a CPU:
  BENCHMARKS.md, NF4.
* Compilers must not change the float32 arithmetic: XLA rewrites ``x / c`` (constant or broadcast scalar)
  into ``x * (1/c)`` and XLA, LLVM and Triton contract ``a * b + c`` into an FMA. `_exact_div` and
  `no_fma` keep the IEEE operations bitsandbytes performs (checked bit-exact against bitsandbytes on the
  CPU, and GPU against CPU by the `gpu` tests).
* bitsandbytes' CPU ``dequantize_4bit`` has a bug on AVX-512 machines when the last dimension is a multiple
  of 16 but not of 64; such shapes are kept out of the comparison tests (our own dequantization is exact for
  every shape).
"""
from __future__ import annotations

import functools
import json
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._common import cdiv


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


def nf4_dtype_name(dtype) -> str:
    """The name of a supported weight dtype: "bfloat16", "float16" or "float32" (ValueError otherwise)."""
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

    Children (arrays, may carry leading stacking axes): ``codes`` uint8 ``[ceil(numel/2)]``, ``absmax``
    ``[nblocks]`` (uint8 codes with double quantization, else float32), ``nested_absmax`` float32
    ``[ceil(nblocks/256)]`` and ``offset`` float32 ``[]`` (both None without double quantization).
    Aux data (static): ``shape`` (one layer's original shape), ``dtype`` (its dtype name), ``blocksize``.
    """

    __slots__ = ("codes", "absmax", "nested_absmax", "offset", "shape", "dtype", "blocksize")

    def __init__(self, codes, absmax, nested_absmax, offset, *, shape, dtype, blocksize=64):
        self.codes = codes
        self.absmax = absmax
        self.nested_absmax = nested_absmax
        self.offset = offset
        self.shape = tuple(int(s) for s in shape)
        self.dtype = nf4_dtype_name(dtype)
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
    the result is the same bits whatever device quantizes (XLA's float32 mean is not: GPU and CPU can differ by
    an ulp, which moves every nested scale)."""
    a = np.asarray(jax.device_get(absmax), np.float64).reshape(-1)
    return np.asarray(_f32_of_sum(a) / np.float32(a.size), np.float32)


def _exact_div(a: jax.Array, b) -> jax.Array:
    """IEEE float32 ``a / b`` (b a scalar). XLA turns a division by a constant or by a broadcast scalar into a
    multiplication by the rounded reciprocal; ``b + 0 * a`` (== b for finite a) is an ordinary array to it,
    so the true division is kept."""
    den = jnp.asarray(b, jnp.float32) + jnp.float32(0.0) * a
    return a / den


def no_fma(p: jax.Array) -> jax.Array:
    """Identity for non-NaN `p` that stops a compiler from fusing the product `p` with a following add
    into a fused multiply-add (XLA CPU/GPU, LLVM and Triton all contract ``a * b + c`` otherwise), so
    ``no_fma(a * b) + c`` is rounded twice, like bitsandbytes computes the double-quantized scales."""
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
    """Quantize `w` (HF ``[out, in]`` layout, any shape; dtype bfloat16, float16 or float32) to NF4 exactly as
    bitsandbytes' CPU ``quantize_4bit(w, quant_type="nf4", blocksize, compress_statistics=double_quant)``.

    Returns an `NF4Weight`: uint8 codes ``[ceil(numel/2)]``; with double_quant uint8 absmax codes ``[nblocks]``,
    float32 ``nested_absmax [ceil(nblocks/256)]`` and a float32 scalar ``offset``, else float32 absmax.

    Runs as jnp on the array's device (jit-compiled per shape). See the module docstring for how the 8-bit
    absmax codes and the offset relate to bitsandbytes' CPU and CUDA results."""
    if blocksize not in (32, 64, 128, 256, 512, 1024, 2048, 4096):
        raise ValueError(f"invalid blocksize {blocksize}")
    w = jnp.asarray(w)
    dtype = nf4_dtype_name(w.dtype)
    codes, absmax = _quantize_blocks(w, blocksize)
    nested = offset = None
    if double_quant:
        offset = jnp.asarray(_mean_offset_host(absmax))
        absmax, nested = _double_quant_jit(absmax, offset)
    return NF4Weight(codes, absmax, nested, offset, shape=w.shape, dtype=dtype, blocksize=blocksize)


def decoded_absmax(q: NF4Weight) -> jax.Array:
    """float32 per-block scales [..., nblocks] (plain jnp; multiply and add kept as two roundings)."""
    if not q.double_quant:
        return q.absmax.astype(jnp.float32)
    dyn = jnp.asarray(DYNAMIC_MAP)[q.absmax.astype(jnp.int32)]
    nidx = jnp.arange(q.absmax.shape[-1]) // NESTED_BLOCKSIZE
    prod = no_fma(dyn * jnp.take(q.nested_absmax, nidx, axis=-1))
    return prod + jnp.expand_dims(q.offset, -1)



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
    "NF4Weight", "NF4_CODE", "NF4_BOUNDS", "DYNAMIC_MAP", "NESTED_BLOCKSIZE", "quantize_nf4", "stack_nf4",
    "nf4_from_bnb_tensors", "nf4_to_bnb_tensors",
]
