"""The leaf modules of the decoder: `Linear` (a projection with an optional LoRA pair), `RMSNorm`, `Embedding`.

Variable types say what trains (flax.nnx filters select on them):
  nnx.Param      dense weights: frozen under LoRA (the train step differentiates only the LoRA state), trained
                 in full fine-tuning (unsloth_jax.lora.enable_full_finetuning);
  nnx.LoRAParam  the LoRA factors `lora_a` [in, r] and `lora_b` [r, out] (Flax's own type);
  NF4Param       a 4-bit NF4 base weight (an `NF4Weight` pytree in HF's [out, in] layout); never trained;
  FP8Param       an FP8 base weight (an `FP8Weight`: e4m3 values [out, in], per-output-channel scales); never
                 trained;
  Buffer         a tensor transformers keeps as a buffer (nn.Buffer: in the checkpoint, not a parameter): loaded
                 and exported like a weight, never trained, not counted among the parameters.

Every module may be built with leading `stack` axes (the decoder stacks its layers on axis 0 and scans over
them); `__call__` then runs on one slice of the stack, which the scan hands it. Names follow Hugging Face:
`weight` where the layout is HF's (norms, embeddings, the untied head [V, D]), `kernel` where it is transposed
(projections: [in, out], so x @ kernel needs no transpose).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from unsloth_jax import ops

INIT_STD = 0.02  # transformers' default initializer_range, for randomly initialised models


class NF4Param(nnx.Variable):
    """A frozen 4-bit base weight: an `NF4Weight` (bitsandbytes' NF4 format, HF [out, in] layout per layer)."""


class FP8Param(nnx.Variable):
    """A frozen FP8 base weight: an `FP8Weight` (float8_e4m3fn [out, in] per layer, float32 scale [out])."""


class Buffer(nnx.Variable):
    """A checkpoint tensor that transformers holds as a buffer, not a parameter (Gemma 4's layer_scalar, GLM-4.5's
    e_score_correction_bias): never trained (not an nnx.Param, so full fine-tuning leaves it frozen), and left out
    of the parameter counts, as in transformers and PEFT."""


def gathered(tree):
    """`tree`'s arrays constrained to be whole on every device when a mesh is set (`jax.set_mesh`), else
    `tree` itself. The decoder applies it to one layer's slice of the stacked weights inside the layer scan,
    and `Embedding` to its table: weights sharded over an FSDP mesh axis are then all-gathered where they are
    used, one layer at a time (also in the backward pass's recomputation), and the batch-sharded activations
    never are."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return tree
    whole = jax.sharding.PartitionSpec()
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, whole), tree)


def value_of(variable):
    """The value a Variable holds (an array, or a pytree such as an NF4Weight); None stays None."""
    return None if variable is None else variable.get_value()


class Linear(nnx.Module):
    """y = x @ kernel (+ bias) (+ lora_scale * (x @ lora_a) @ lora_b).

    kernel: nnx.Param [*stack, in, out] in the weight dtype, NF4Param (NF4Weight, [*stack] of [out, in]) or
    FP8Param (FP8Weight, [*stack] of [out, in]);
    bias: nnx.Param [*stack, out] or None; lora_a / lora_b: nnx.LoRAParam [*stack, in, r] / [*stack, r, out]
    (float32 master weights, cast to x.dtype in the matmul) or None; lora_scale: a static float;
    train_kernel: a static bool, True in full fine-tuning (the kernel's gradient is then not stopped, see
    ops.linear).
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = False, stack: tuple[int, ...] = (),
                 dtype=jnp.float32, rngs: nnx.Rngs):
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        shape = (*stack, self.in_features, self.out_features)
        self.kernel = nnx.Param((INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))
        self.bias = nnx.data(nnx.Param(jnp.zeros((*stack, self.out_features), dtype)) if use_bias else None)
        self.lora_a = nnx.data(None)
        self.lora_b = nnx.data(None)
        self.lora_scale: float | None = None
        self.train_kernel = False

    def lora_factors(self):
        """(lora_a [*stack, in, r], lora_b [*stack, r, out], scale), as ops.linear takes it, or None."""
        if self.lora_a is None:
            return None
        return (self.lora_a[...], self.lora_b[...], self.lora_scale)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., in] -> [..., out] in x.dtype."""
        return ops.linear(x, value_of(self.kernel), value_of(self.bias), self.lora_factors(),
                          kernel_grad=self.train_kernel)


class RMSNorm(nnx.Module):
    """x * rsqrt(mean(x^2) + eps) * (offset + weight) over the last axis; weight [*stack, dim].

    offset is 1 for Gemma's (1 + w) norm (weights initialised to 0) and 0 elsewhere (initialised to 1)."""

    def __init__(self, dim: int, *, eps: float, offset: float = 0.0, stack: tuple[int, ...] = (),
                 dtype=jnp.float32):
        self.eps = float(eps)
        self.offset = float(offset)
        init = jnp.zeros if offset else jnp.ones
        self.weight = nnx.Param(init((*stack, int(dim)), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return ops.rms_norm(x, self.weight[...], self.eps, self.offset)


class Embedding(nnx.Module):
    """A [num, dim] table in HF's layout: token embeddings, and the untied output head (logits = h @ weight.T)."""

    def __init__(self, num: int, dim: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.weight = nnx.Param((INIT_STD * jax.random.normal(rngs.params(), (int(num), int(dim)),
                                                              jnp.float32)).astype(dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:
        """ids [...] int -> [..., dim] rows of the table (whole on every device under a mesh, see `gathered`:
        a table split over the devices would make XLA look the ids up in every shard and all-reduce the
        activations of the whole batch)."""
        return jnp.take(gathered(self.weight[...]), ids, axis=0)
