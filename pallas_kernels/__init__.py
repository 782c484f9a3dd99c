"""pallas_kernels: fused Pallas kernels (Triton lowering on NVIDIA GPUs, interpret mode on CPU).

    from pallas_kernels import rms_norm, flash_attention, quantize_nf4, nf4_matmul, grouped_matmul

Each kernel is a `jax.custom_vjp` whose forward and backward are `pl.pallas_call`s, with a plain-jnp twin in
`pallas_kernels.reference`; each function's docstring gives its shapes and dtypes.

The names below are imported on first use (PEP 562), so `import pallas_kernels` does not import jax.
Six submodules carry their function's name (rms_norm, rope, lora_linear, cross_entropy, flash_attention,
grouped_matmul);
the package attribute is always the function. Reach such a module's other names with
`from pallas_kernels.rms_norm import rms_norm_with_config` (`import pallas_kernels.rms_norm as m` reads the
package attribute, so it binds the function).
"""
from __future__ import annotations

import importlib
import sys
import types

# public name -> module that defines it
_EXPORTS = {
    "rms_norm": "pallas_kernels.rms_norm",
    "rope": "pallas_kernels.rope",
    "swiglu": "pallas_kernels.glu",
    "geglu": "pallas_kernels.glu",
    "lora_linear": "pallas_kernels.lora_linear",
    "cross_entropy": "pallas_kernels.cross_entropy",
    "flash_attention": "pallas_kernels.flash_attention",
    "NF4Weight": "pallas_kernels.nf4_format",
    "quantize_nf4": "pallas_kernels.nf4_format",
    "dequantize_nf4": "pallas_kernels.nf4",
    "nf4_matmul": "pallas_kernels.nf4",
    "qlora_linear": "pallas_kernels.nf4",
    "FP8Weight": "pallas_kernels.fp8",
    "quantize_fp8_weight": "pallas_kernels.fp8",
    "fp8_matmul": "pallas_kernels.fp8",
    "glu_fp8_matmul": "pallas_kernels.glu_fp8",
    "nf4_fp8_matmul": "pallas_kernels.nf4_fp8",
    "grouped_matmul": "pallas_kernels.grouped_matmul",
    "stacked_linear": "pallas_kernels.decode_linear",
    "nf4_decode_linear": "pallas_kernels.nf4_decode",
    "paged_decode_attention": "pallas_kernels.decode_attention",
    "gated_delta_rule": "pallas_kernels.gated_delta_state",
    "chunked_gated_delta_rule": "pallas_kernels.gated_delta_chunked",
    "resolve_interpret": "pallas_kernels._common",
}
__all__ = list(_EXPORTS)
# names that are both a submodule and the function it defines
_SHARED_NAMES = frozenset(name for name, module in _EXPORTS.items() if module == f"{__name__}.{name}")


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


class _Package(types.ModuleType):
    """The package's module type. Once a submodule has loaded, the import system sets it as an attribute of the
    package, which for the shared names would replace the function; this keeps the function there instead."""

    def __setattr__(self, name: str, value) -> None:
        if name in _SHARED_NAMES and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
