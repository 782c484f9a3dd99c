"""Quantized frozen base weights: 4-bit NF4 (QLoRA, bitsandbytes-compatible) and FP8 (e4m3, Hopper GEMMs).

`nf4_placer` / `fp8_placer` are the weight hooks `FastLanguageModel.from_pretrained(load_in_4bit=True)` /
`(load_in_fp8=True)` pass to the loader: each projection kernel is quantized on the device as it is read (NF4:
double quantization, blocksize 64; FP8: per-output-channel scales; both in HF's [out, in] layout), so the full
16-bit model never sits in device memory. Embeddings, norms, biases and the lm_head stay in the compute dtype,
as bitsandbytes and Unsloth do.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.fp8 import FP8Weight, dequantize_fp8_weight, quantize_fp8_weight
from pallas_kernels.nf4 import dequantize_nf4
from pallas_kernels.nf4_format import NF4Weight, quantize_nf4, stack_nf4
from unsloth_jax.models.layers import FP8Param, NF4Param


def nf4_placer(spec, array: np.ndarray, dtype):
    """Quantize projection kernels (given in param layout [in, out]) to NF4 in HF layout; others as usual.
    `spec` is the tensor's `unsloth_jax.hf.mapping.TensorSpec`."""
    if spec.kind != "kernel":
        return jnp.asarray(array, dtype=dtype)
    return quantize_nf4(jnp.asarray(array.T, dtype=dtype), blocksize=64, double_quant=True)


def fp8_placer(spec, array: np.ndarray, dtype):
    """Quantize projection kernels (given in param layout [in, out]) to FP8 (e4m3, per-output-channel scales)."""
    if spec.kind != "kernel":
        return jnp.asarray(array, dtype=dtype)
    return quantize_fp8_weight(jnp.asarray(array, dtype=dtype))


def is_nf4(x) -> bool:
    return isinstance(x, NF4Weight)


def is_quantized(x) -> bool:
    """True for a 4-bit (NF4) or FP8 weight."""
    return isinstance(x, (NF4Weight, FP8Weight))


def dense_kernel(kernel, dtype=None):
    """A projection kernel as a dense [..., in, out] array: dequantizes an NF4 weight (HF [out, in]; in its
    original dtype by default, exactly as bitsandbytes does) or an FP8 weight, and transposes it; returns dense
    arrays unchanged. The one place (besides ops) that turns a quantized weight into a dense one: export uses it."""
    if is_nf4(kernel):
        return jnp.swapaxes(dequantize_nf4(kernel, dtype), -1, -2)
    if isinstance(kernel, FP8Weight):
        return jnp.swapaxes(dequantize_fp8_weight(kernel, dtype), -1, -2)
    return kernel if dtype is None else kernel.astype(dtype)


def quantize_projections(model, kind: str = "nf4", blocksize: int = 64, double_quant: bool = True):
    """Quantize every dense projection kernel of `model` (a CausalLM) in place, as `load_in_4bit` (kind="nf4",
    layer by layer) or `load_in_fp8` (kind="fp8") do while loading. Returns the model."""
    if kind not in ("nf4", "fp8"):
        raise ValueError(f"kind must be 'nf4' or 'fp8', got {kind!r}")
    for lin in model.projection_stacks().values():
        kernel = lin.kernel.get_value()
        if is_quantized(kernel):
            continue
        if kind == "fp8":
            lin.kernel = FP8Param(quantize_fp8_weight(kernel))
            continue
        layers = [quantize_nf4(jnp.swapaxes(kernel[i], 0, 1), blocksize=blocksize, double_quant=double_quant)
                  for i in range(kernel.shape[0])]
        lin.kernel = NF4Param(stack_nf4(layers))
    return model
