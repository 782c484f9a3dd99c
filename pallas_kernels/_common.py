"""Shared helpers for the Pallas kernels: interpret-mode choice, Triton compiler params, block sizes.

Every kernel module in this package uses these, so the conventions live in one place:
- `interpret=None` means "interpret when the default backend is not a GPU" (CPU CI runs the same kernels).
- Triton lowering is selected by passing `triton.CompilerParams`; jax 0.11 warns that this path is
  deprecated, and we silence exactly that warning here.
- Loads and stores must have power-of-two sizes; `next_pow2` and `pad_to` help kernels mask ragged edges.
"""
from __future__ import annotations

import warnings

import jax
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


__all__ = ["resolve_interpret", "compiler_params", "next_pow2", "cdiv", "on_gpu", "pl", "plgpu"]
