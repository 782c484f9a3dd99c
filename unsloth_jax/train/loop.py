"""What the preference and RL trainers (DPO, ORPO, GRPO) share beyond the trainer base
(unsloth_jax.train.base, which runs their loop, logging, checkpoints and evaluation): the LoRA checks, the
optimizer from the arguments, the split state with the reference weights, and padding. Their jitted steps come
from the one step factory, unsloth_jax.train.step.make_step.
"""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from unsloth_jax import lora
from unsloth_jax.errors import TrainingError
from unsloth_jax.train.base import TrainerBase
from unsloth_jax.train.base import as_records as records_of  # noqa: F401  (re-exported)
from unsloth_jax.train.logprobs import trains_beyond_lora
from unsloth_jax.backend import commit_to_devices

log = logging.getLogger("unsloth_jax")


def pad_token_id(tokenizer, model) -> int:
    """The padding id: the tokenizer's pad, else its eos, else config.json's pad, else 0."""
    for cand in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None),
                 model.config.pad_token_id):
        if cand is not None:
            return int(cand)
    return 0


SEQUENCE_MULTIPLE = 64  # batch lengths are rounded up to this, so a jitted step compiles for few shapes


def round_up(n: int, multiple: int = SEQUENCE_MULTIPLE) -> int:
    """n rounded up to a multiple of `multiple` (at least one multiple)."""
    return max(multiple, -(-int(n) // multiple) * multiple)


class RLTrainerBase(TrainerBase):
    """What DPOTrainer, ORPOTrainer and GRPOTrainer add to the trainer base: the LoRA and tokenizer checks, their
    optimizer from the arguments, and the split state with the reference weights."""

    nonfinite_hint = "Lower the learning rate or check the data and reward functions"

    def __init__(self, model, args, tokenizer, processing_class, callbacks=None):
        if getattr(model, "lora", None) is None:
            raise TrainingError(f"{type(self).__name__} trains LoRA adapters: call "
                                "FastLanguageModel.get_peft_model(model, ...) first")
        self.tokenizer = processing_class if processing_class is not None else tokenizer
        if self.tokenizer is None:
            raise TrainingError(f"{type(self).__name__} needs processing_class=tokenizer to tokenize the dataset")
        super().__init__(model, args, callbacks)

    def make_optimizer(self, total_steps: int):
        """(schedule, optax optimizer) from the arguments, as SFTTrainer builds them."""
        optimizer, schedule = self.build_optimizer(total_steps, self._warmup_steps(total_steps))
        return schedule, optimizer

    def split_state(self, need_reference: bool):
        """(graphdef, trainable (a copy: the step donates it), frozen, ref_trainable) of the model, committed to
        their devices. ref_trainable is None (the reference is the base: frozen + adapters dropped) unless the
        model trains weights besides LoRA, whose starting values the reference then needs."""
        graphdef, trainable, frozen = lora.split(self.model)
        trainable = jax.tree.map(jnp.copy, trainable)
        ref_trainable = None
        if need_reference and trains_beyond_lora(self.model):
            ref_trainable = jax.tree.map(jnp.copy, trainable)
        trainable, frozen, ref_trainable = commit_to_devices((trainable, frozen, ref_trainable))
        return graphdef, trainable, frozen, ref_trainable


__all__ = ["RLTrainerBase", "SEQUENCE_MULTIPLE", "records_of", "pad_token_id", "round_up"]
