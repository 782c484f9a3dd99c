"""Per-token log-probabilities of a model on its own token ids, and the reference model of a LoRA policy.

    lp = token_logps(model, ModelInputs(input_ids, attention_mask))  # [B, S-1] f32: log p(ids[:, t+1] | ids[:, :t+1])
    seq = masked_sum(lp, loss_mask)                               # [B]: summed over the completion tokens
    ref = reference_model(graphdef, trainable, frozen)            # the same weights with the adapters switched off

Rows are right padded (attention_mask 1 on real tokens, then 0), the layout of SFT's batches, so attention may
use cuDNN. The log-probabilities go through `ops.token_logprobs`, chunked over tokens: no [B, S, V] logits.

The reference of a LoRA policy is its base: `reference_model` merges the same `frozen` state (the very arrays
the policy uses, no second copy) with the LoRA factors dropped from every projection, as TRL does for a PEFT
model by disabling its adapters. Weights trained besides LoRA (modules_to_save, biases) come from
`ref_trainable`, a copy of their values before training, when the trainer keeps one.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from unsloth_jax import ops
from unsloth_jax.families import ModelInputs, family_of
from unsloth_jax.models.decoder import CausalLM
from unsloth_jax.models.layer_stack import NO_REMAT, LayerStackPolicy


def token_logps(model: CausalLM, inputs: ModelInputs, *, remat: LayerStackPolicy = NO_REMAT,
                temperature: float = 1.0, chunk: int = 1024, mean_logits: bool = False):
    """[B, S-1] float32: entry t is log p(input_ids[:, t+1]) given the tokens up to t (logits / temperature).

    inputs: the rows (the family's prepare_inputs of a batch): input_ids, attention_mask int32 [B, S], right
    padded, and a vision-language model's image fields, run as the SFT step runs them. Entries whose target is
    padding hold log-probs of the padding token and must be masked by the caller (`masked_sum`).
    mean_logits=True: also each position's logits averaged over the vocabulary, [B, S-1] (no gradient), as a
    second item. remat: the layer-stack policy (typed: the step factory parsed it).
    """
    h = family_of(model).hidden_states(model, inputs, remat=remat)
    b, s, d = h.shape
    input_ids = inputs.input_ids
    targets = input_ids[:, 1:].reshape(-1)
    flat = h[:, :-1].reshape(-1, d)
    softcap = model.config.final_softcap
    lp = ops.token_logprobs(flat, model.head_weight(), targets, softcap=softcap, temperature=temperature,
                            chunk=chunk).reshape(b, s - 1)
    if not mean_logits:
        return lp
    return lp, ops.token_mean_logits(flat, model.head_weight(), softcap=softcap, chunk=chunk).reshape(b, s - 1)


def masked_sum(values: jax.Array, mask: jax.Array) -> jax.Array:
    """Row sums of values [B, T] where mask [B, T] is nonzero -> [B] float32."""
    return jnp.sum(jnp.where(mask > 0, values, 0.0), axis=-1)


def drop_adapters(model: CausalLM) -> CausalLM:
    """Remove the LoRA pair of every projection of `model` (in place; a vision-language model's vision-tower
    projections too) and return it. Used on a module merged inside a jitted function, so the model the user
    holds keeps its adapters."""
    vision = model.vision_projections() if hasattr(model, "vision_projections") else {}
    for lin in [*model.projection_stacks().values(), *vision.values()]:
        lin.lora_a = lin.lora_b = None
        lin.lora_scale = None
    return model


def reference_model(graphdef: nnx.GraphDef, trainable, frozen, ref_trainable=None) -> CausalLM:
    """The policy's base model: graphdef merged with `frozen` (shared, not copied) and `ref_trainable` (the
    pre-training values of non-LoRA trainable weights; None: `trainable`), adapters dropped, no gradient."""
    state = trainable if ref_trainable is None else ref_trainable
    state = jax.lax.stop_gradient(state)
    return drop_adapters(nnx.merge(graphdef, state, frozen))


def trains_beyond_lora(model: CausalLM) -> bool:
    """True when the model's trainable state holds more than the LoRA factors (modules_to_save, biases)."""
    settings = model.lora
    return bool(settings is not None and (settings.modules_to_save or settings.bias != "none"))


__all__ = ["token_logps", "masked_sum", "drop_adapters", "reference_model",
           "trains_beyond_lora"]
