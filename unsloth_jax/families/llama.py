"""Llama (2, 3, 3.1, 3.2; LlamaForCausalLM) and Mistral (MistralForCausalLM): the plain decoder layer, RoPE with
default / linear / llama3 / YaRN scaling, optional attention / MLP biases (attention_bias, mlp_bias), sliding
windows from layer_types or sliding_window. Mistral's checkpoints are Llama's, and llama.cpp writes both as
"llama"."""
from __future__ import annotations

from unsloth_jax.families.base import TextFamily

LLAMA = TextFamily("Llama", ("llama",), gguf_arch="LLAMA", gguf_read=("llama", "LlamaForCausalLM"))
MISTRAL = TextFamily("Mistral", ("mistral",), gguf_arch="LLAMA")

__all__ = ["LLAMA", "MISTRAL"]
