"""Continued pretraining: Unsloth's `UnslothTrainer` and `UnslothTrainingArguments(embedding_learning_rate=...)`.

    model = FastLanguageModel.get_peft_model(model, r=128, modules_to_save=["embed_tokens", "lm_head"], ...)
    trainer = UnslothTrainer(model=model, tokenizer=tok, train_dataset=texts, dataset_text_field="text",
                             packing=True, args=UnslothTrainingArguments(learning_rate=5e-5,
                                                                         embedding_learning_rate=5e-6, ...))

As Unsloth's trainer does with two torch param groups: the trained embedding table and output head step with
embedding_learning_rate, every other trained weight with learning_rate; the same lr_scheduler_type, warmup and
weight decay apply to both (HF's LambdaLR scales each group's initial rate by the same factor), and gradient
clipping is over all of them together. Unsloth picks the group by name (`*.modules_to_save.default.weight`, i.e.
LoRA's modules_to_save copies); here it is every trained leaf under embed_tokens or lm_head, which is the same
set under LoRA and, in full fine-tuning, the embedding and head themselves (Unsloth's name rule matches nothing
there, so its embedding_learning_rate has no effect in full fine-tuning).
"""
from __future__ import annotations

import dataclasses
import logging

import jax

from unsloth_jax import lora
from unsloth_jax.backend import key_names
from unsloth_jax.train import optim
from unsloth_jax.train.trainer import SFTTrainer, TrainingArguments
from unsloth_jax.validation import require_real

log = logging.getLogger("unsloth_jax")


@dataclasses.dataclass
class UnslothTrainingArguments(TrainingArguments):
    """TrainingArguments plus `embedding_learning_rate` (None: the embeddings use learning_rate)."""

    embedding_learning_rate: float | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.embedding_learning_rate is not None:
            self.embedding_learning_rate = require_real("embedding_learning_rate", self.embedding_learning_rate,
                                                        minimum=0, min_exclusive=True)


def trained_embedding_paths(model) -> list[str]:
    """Module paths of the trained leaves that embedding_learning_rate applies to."""
    _, trainable, _ = lora.split(model)
    labels = optim.embedding_labels(trainable)
    paths = jax.tree_util.tree_flatten_with_path(labels)[0]
    return [".".join(key_names(path[:-1]))
            for path, label in paths if label == "embedding"]


class UnslothTrainer(SFTTrainer):
    """SFTTrainer with Unsloth's embedding_learning_rate (see module docstring); the same otherwise."""

    def make_optimizer(self, total: int, warmup: int, embedding_learning_rate: float | None = None):
        embedding_lr = getattr(self.args, "embedding_learning_rate", None)
        if embedding_learning_rate is not None or embedding_lr is None:
            return super().make_optimizer(total, warmup, embedding_learning_rate)
        paths = trained_embedding_paths(self.model)
        if not paths:
            log.warning("unsloth_jax: embedding_learning_rate=%g has no effect: neither embed_tokens nor lm_head "
                        "trains (add them to get_peft_model's modules_to_save)", embedding_lr)
        for path in paths:
            print(f"unsloth_jax: setting lr = {embedding_lr:.2e} instead of {self.args.learning_rate:.2e} for {path}")
        return super().make_optimizer(total, warmup, embedding_lr)


__all__ = ["UnslothTrainer", "UnslothTrainingArguments", "trained_embedding_paths"]
