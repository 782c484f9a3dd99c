"""4-bit (NF4, bitsandbytes-compatible) base weights for QLoRA.

`nf4_placer` is the weight hook `FastLanguageModel.from_pretrained(load_in_4bit=True)` passes to the loader:
each projection kernel is quantized on the device as it is read (double quantization, blocksize 64, in HF's
[out, in] layout), so the full 16-bit model never sits in device memory. Embeddings, norms, biases and the
lm_head stay in the compute dtype, as bitsandbytes and Unsloth do.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.nf4 import dequantize_nf4
from pallas_kernels.nf4_format import NF4Weight, quantize_nf4
from unsloth_jax.hf.mapping import TensorSpec


def nf4_placer(spec: TensorSpec, array: np.ndarray, dtype):
    """Quantize projection kernels (given in param layout [in, out]) to NF4 in HF layout; others as usual."""
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
