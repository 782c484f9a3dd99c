"""unsloth_jax: fast LoRA/QLoRA fine-tuning of Llama, Mistral, Qwen and Gemma models in JAX.

Start with `FastLanguageModel.from_pretrained(dir)`; see README.md and docs/ARCHITECTURE.md.
"""
from unsloth_jax.api import FastLanguageModel, Model, is_bfloat16_supported
from unsloth_jax.config import ModelConfig

__version__ = "0.1.0"
__all__ = ["FastLanguageModel", "Model", "ModelConfig", "is_bfloat16_supported", "__version__"]

from unsloth_jax.train import SFTTrainer, TrainingArguments  # noqa: E402

__all__ += ["SFTTrainer", "TrainingArguments"]
