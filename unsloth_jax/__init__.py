"""unsloth_jax: fast LoRA/QLoRA fine-tuning of Llama, Mistral, Qwen and Gemma models in JAX.

Start with `FastLanguageModel.from_pretrained(dir)`; see README.md and docs/ARCHITECTURE.md.

The public names below are imported on first use (PEP 562), so `import unsloth_jax.cli` (the `unsloth-jax`
command's `--help` and `doctor`) starts without importing jax.
"""
from __future__ import annotations

import importlib
import logging

__version__ = "0.1.0"


class _NoTorchNotice(logging.Filter):
    """Drops transformers' "PyTorch was not found" notice (and only it): unsloth_jax uses transformers for
    tokenizers and configs, which need no torch."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("PyTorch was not found")


_transformers_log = logging.getLogger("transformers")  # transformers logs the notice when it is first imported
if not any(isinstance(f, _NoTorchNotice) for f in _transformers_log.filters):
    _transformers_log.addFilter(_NoTorchNotice())

# public name -> module that defines it
_EXPORTS = {
    "FastLanguageModel": "unsloth_jax.api",
    "Model": "unsloth_jax.api",
    "FastVisionModel": "unsloth_jax.api",
    "FastModel": "unsloth_jax.api",
    "VisionModel": "unsloth_jax.api",
    "QwenVisionModel": "unsloth_jax.api",
    "VisionLanguageModel": "unsloth_jax.api",
    "is_bfloat16_supported": "unsloth_jax.api",
    "ModelConfig": "unsloth_jax.config",
    "UnslothVisionDataCollator": "unsloth_jax.data.vision",
    "SFTTrainer": "unsloth_jax.train",
    "SFTConfig": "unsloth_jax.train",
    "TrainingArguments": "unsloth_jax.train",
    "DPOTrainer": "unsloth_jax.train.preference",
    "DPOConfig": "unsloth_jax.train.preference",
    "ORPOTrainer": "unsloth_jax.train.preference",
    "ORPOConfig": "unsloth_jax.train.preference",
    "GRPOTrainer": "unsloth_jax.train.grpo",
    "GRPOConfig": "unsloth_jax.train.grpo",
    "UnslothTrainer": "unsloth_jax.train",
    "UnslothTrainingArguments": "unsloth_jax.train",
    "add_new_tokens": "unsloth_jax.vocab",
    "SamplingParams": "unsloth_jax.inference",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'unsloth_jax' has no attribute '{name}'")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
