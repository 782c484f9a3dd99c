"""4-bit (NF4, bitsandbytes-compatible) base weights for QLoRA.

`nf4_placer` is the weight hook `FastLanguageModel.from_pretrained(load_in_4bit=True)` passes to the loader:
each projection kernel is quantized on the device as it is read (double quantization, blocksize 64, in HF's
[out, in] layout), so the full 16-bit model never sits in device memory. Embeddings, norms, biases and the
lm_head stay in the compute dtype, as bitsandbytes and Unsloth do.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.nf4 import NF4Weight, dequantize_nf4, quantize_nf4, stack_nf4
from unsloth_jax.models.layers import NF4Param


def nf4_placer(spec, array: np.ndarray, dtype):
    """Quantize projection kernels (given in param layout [in, out]) to NF4 in HF layout; others as usual.
    `spec` is the tensor's `unsloth_jax.hf.mapping.TensorSpec`."""
    if spec.kind != "kernel":
        return jnp.asarray(array, dtype=dtype)
    return quantize_nf4(jnp.asarray(array.T, dtype=dtype), blocksize=64, double_quant=True)


def is_nf4(x) -> bool:
    return isinstance(x, NF4Weight)


def dense_kernel(kernel, dtype=None):
    """A projection kernel as a dense [..., in, out] array: dequantizes an NF4 weight (HF [out, in]; in its
    original dtype by default, exactly as bitsandbytes does) and transposes it; returns dense arrays unchanged.
    The one place (besides ops) that turns a 4-bit weight into a dense one: export uses it."""
    if is_nf4(kernel):
        w = dequantize_nf4(kernel, dtype)
        return jnp.swapaxes(w, -1, -2)
    return kernel if dtype is None else kernel.astype(dtype)


def quantize_projections(model, blocksize: int = 64, double_quant: bool = True):
    """Quantize every dense projection kernel of `model` (a CausalLM) to NF4 in place, layer by layer, as
    `load_in_4bit` does while loading. Returns the model."""
    for lin in model.projections().values():
        kernel = lin.kernel.get_value()
        if is_nf4(kernel):
            continue
        layers = [quantize_nf4(jnp.swapaxes(kernel[i], 0, 1), blocksize=blocksize, double_quant=double_quant)
                  for i in range(kernel.shape[0])]
        lin.kernel = NF4Param(stack_nf4(layers))
    return model
