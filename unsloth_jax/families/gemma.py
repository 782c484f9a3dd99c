"""Gemma (GemmaForCausalLM) and Gemma 2 (Gemma2ForCausalLM): (1 + w) RMSNorms, embeddings times sqrt(hidden),
tied embeddings by default, the `hidden_activation` MLP (default gelu_pytorch_tanh); Gemma 2 adds the sandwich
norms (pre/post feed-forward), logit soft-capping, query_pre_attn_scalar, and sliding windows on the even layers
(without layer_types)."""
from __future__ import annotations

from unsloth_jax.config import layer_windows, rope_fields
from unsloth_jax.families.base import TextFamily
from unsloth_jax.families.tensors import LLAMA_TENSORS, SANDWICH


def _gemma_fields(raw: dict, source: str) -> dict:
    return rope_fields(raw, source) | dict(norm_offset=1.0, embed_scale=True,
                                           tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)))


def _gemma2_fields(raw: dict, source: str) -> dict:
    scalar = raw.get("query_pre_attn_scalar")
    return _gemma_fields(raw, source) | dict(sandwich_norms=True,
                                             query_scale=float(scalar) ** -0.5 if scalar else 0.0)


def _gemma2_windows(raw: dict, n_layers: int, source: str) -> tuple[int | None, ...]:
    """layer_types, else even layers slide and odd layers are global."""
    return layer_windows(raw, n_layers, source,
                         untyped=lambda window, n: tuple(window if i % 2 == 0 else None for i in range(n)))


GEMMA = TextFamily("Gemma", ("gemma",), config_fields=_gemma_fields, activation_key="hidden_activation",
                   gguf_arch="GEMMA", gguf_read=("gemma", "GemmaForCausalLM"))
GEMMA2 = TextFamily("Gemma 2", ("gemma2",), config_fields=_gemma2_fields, layer_windows=_gemma2_windows,
                    activation_key="hidden_activation", layer_tensors=LLAMA_TENSORS + SANDWICH, gguf_arch="GEMMA2",
                    gguf_read=("gemma2", "Gemma2ForCausalLM"))

__all__ = ["GEMMA", "GEMMA2"]
