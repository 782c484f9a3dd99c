"""Gemma 4 text (config.json model_type "gemma4_text"; transformers' Gemma4ForCausalLM): Gemma 3's tensors, the
layer's scalar, per-layer input embeddings (PLE) and KV-shared layers (config._gemma4_fields)."""
from __future__ import annotations

from unsloth_jax.config import _gemma4_fields, no_layer_windows
from unsloth_jax.families.base import TextFamily
from unsloth_jax.families.tensors import LLAMA_TENSORS, QK_NORM, SANDWICH

# with per-layer inputs (per_layer_input_size), each layer's per-layer input block; KV-shared layers have no
# k_proj / v_proj / k_norm (config.layer_has)
_GEMMA4_PLE = (
    ("per_layer_input_gate.weight", ("per_layer_input_gate", "kernel"), "kernel"),
    ("per_layer_projection.weight", ("per_layer_projection", "kernel"), "kernel"),
    ("post_per_layer_input_norm.weight", ("post_per_layer_input_norm", "weight"), "norm"),
)

_LAYER_SCALAR = (("layer_scalar", ("layer_scalar",), "norm"),)
# its windows come from _gemma4_fields
GEMMA4_TEXT = TextFamily("Gemma 4 text", ("gemma4_text",), config_fields=_gemma4_fields,
                         layer_windows=no_layer_windows,
                         layer_tensors=LLAMA_TENSORS + SANDWICH + QK_NORM + _LAYER_SCALAR,
                         switched_tensors=(("per_layer_input_size", _GEMMA4_PLE),))

__all__ = ["GEMMA4_TEXT"]
