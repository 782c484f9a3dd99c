"""Shared helpers for the Pallas kernels: interpret-mode choice, Triton compiler params, block sizes, masks,
masked loads and launch helpers.

Every kernel module in this package uses these, so the conventions live in one place:
- `interpret=None` means "interpret when the default backend is not a GPU" (CPU CI runs the same kernels).
- Triton lowering is selected by passing `triton.CompilerParams`; jax 0.11 warns that this path is
  deprecated, and we silence exactly that warning here.
- Loads and stores must have power-of-two sizes; ragged edges are masked. A mask of None means "nothing to
  mask": the helpers then emit a plain access, so aligned shapes get unmasked, full-width loads.
"""
from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# jax 0.11 prints a deprecation warning whenever the Pallas Triton lowering is chosen. That is the
# lowering we want on NVIDIA GPUs, so silence that one warning and nothing else.
warnings.filterwarnings(
    "ignore", message=r"The Pallas Triton backend is deprecated", category=DeprecationWarning
)


def resolve_interpret(interpret: bool | None) -> bool:
    """None -> True unless the default backend is a GPU. An explicit bool is returned unchanged."""
    if interpret is None:
        return not on_gpu()
    return bool(interpret)


def compiler_params(num_warps: int = 4, num_stages: int = 2) -> plgpu.CompilerParams:
    """Triton compiler parameters (selects the Triton lowering on GPU; ignored in interpret mode)."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """Ceiling division for Python ints."""
    return -(-a // b)


def on_gpu() -> bool:
    """True when the default JAX backend is a GPU."""
    return jax.default_backend() == "gpu"


# --------------------------------------------------------------------------------------------- in-kernel masks
def and_masks(*masks):
    """AND of the boolean masks that are not None (broadcasting); None when all are None."""
    masks = [m for m in masks if m is not None]
    return functools.reduce(jnp.logical_and, masks) if masks else None


def range_mask(start, size: int, limit: int, ragged: bool):
    """bool [size]: start + arange(size) < limit; None when not `ragged` (the block is known to be in range)."""
    if not ragged:
        return None
    return (start + jnp.arange(size)) < limit


def mask_2d(rows, cols):
    """rows [R] and cols [C] masks (each optional) -> their AND as a broadcastable [R, 1] / [1, C] / [R, C]
    mask, or None."""
    r = None if rows is None else rows[:, None]
    c = None if cols is None else cols[None, :]
    return and_masks(r, c)


def broadcast_mask(mask, shape):
    """`mask` broadcast to `shape` (None stays None)."""
    return None if mask is None else jnp.broadcast_to(mask, shape)


def load(ref, mask=None, other=0, shape=None):
    """plgpu.load of `ref`: masked (reading `other` where the mask is False; the mask first broadcast to
    `shape` when given) when `mask` is given, else a plain load."""
    if mask is None:
        return plgpu.load(ref)
    return plgpu.load(ref, mask=broadcast_mask(mask, shape) if shape is not None else mask, other=other)


def load_tile(ref, r0, nr: int, c0, nc: int, rmask=None, cmask=None, other=0):
    """The [nr, nc] tile of a 2-D ref at (r0, c0), reading `other` where the row mask [nr] or the column mask
    [nc] (either may be None: nothing to mask on that axis) is False."""
    return load(ref.at[pl.ds(r0, nr), pl.ds(c0, nc)], mask_2d(rmask, cmask), other)


def store_tile(ref, r0, nr: int, c0, nc: int, value, rmask=None, cmask=None):
    """Store `value` [nr, nc] as the tile of a 2-D ref at (r0, c0), skipping the rows / columns whose mask (each
    optional) is False."""
    plgpu.store(ref.at[pl.ds(r0, nr), pl.ds(c0, nc)], value, mask=mask_2d(rmask, cmask))


# -------------------------------------------------------------------------------------------- launch helpers
def grouped_pid(pid, n_rows: int, n_cols: int, group: int):
    """Map a 1-D program id to (row tile, col tile) in groups of `group` row tiles (L2 reuse of columns)."""
    width = group * n_cols
    group_id = lax.div(pid, width)
    first = group_id * group
    size = jnp.minimum(n_rows - first, group)
    within = lax.rem(pid, width)
    return first + lax.rem(within, size), lax.div(within, size)


def full_spec(shape):
    """BlockSpec giving every program the whole array (the kernel indexes it with pl.ds itself)."""
    nd = len(shape)
    return pl.BlockSpec(tuple(shape), lambda *_: (0,) * nd)


def split_k_output(m: int, n: int, splits: int, dtype):
    """(out_shape, out_spec) for a [m, n] result computed over `splits` K ranges (grid axis 2): one split writes
    it in `dtype`; several write float32 partials [splits, m, n], one slab per split, that the caller sums."""
    if splits == 1:
        return jax.ShapeDtypeStruct((m, n), dtype), full_spec((m, n))
    return (jax.ShapeDtypeStruct((splits, m, n), jnp.float32),
            pl.BlockSpec((None, m, n), lambda i, j, s: (s, 0, 0)))


__all__ = ["resolve_interpret", "compiler_params", "next_pow2", "cdiv", "on_gpu", "pl", "plgpu", "and_masks",
           "range_mask", "mask_2d", "broadcast_mask", "load", "load_tile", "store_tile",
           "grouped_pid", "full_spec", "split_k_output"]
