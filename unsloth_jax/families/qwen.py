"""Qwen2 / Qwen2.5 (Qwen2ForCausalLM: q/k/v biases, no o_proj bias) and Qwen3 (Qwen3ForCausalLM: per-head q/k
RMSNorm before RoPE). Sliding windows only with use_sliding_window: from layer_types, else on the layers from
max_window_layers on."""
from __future__ import annotations

from unsloth_jax.config import layer_windows, rope_fields
from unsloth_jax.families.base import TextFamily
from unsloth_jax.families.tensors import LLAMA_TENSORS, QK_NORM, QKV_BIAS


def qwen_layer_windows(raw: dict, n_layers: int, source: str) -> tuple[int | None, ...]:
    """Qwen2 / Qwen3's windows: none unless use_sliding_window; then layer_types, or every layer from
    max_window_layers on."""
    if not raw.get("use_sliding_window", False):
        return (None,) * n_layers

    def from_first(window: int, n: int) -> tuple[int | None, ...]:
        first = int(raw.get("max_window_layers", 0))
        return tuple(window if i >= first else None for i in range(n))
    return layer_windows(raw, n_layers, source, untyped=from_first)


def _qwen2_fields(raw: dict, source: str) -> dict:
    return rope_fields(raw, source) | dict(qkv_bias=True, o_bias=False)


def qk_norm_fields(raw: dict, source: str) -> dict:
    """RoPE, and q/k RMSNorm on every layer (Qwen3, Qwen3-MoE)."""
    return rope_fields(raw, source) | dict(qk_norm=True)


QWEN2 = TextFamily("Qwen2", ("qwen2",), config_fields=_qwen2_fields, layer_windows=qwen_layer_windows,
                   layer_tensors=LLAMA_TENSORS + QKV_BIAS, gguf_arch="QWEN2", gguf_read=("qwen2", "Qwen2ForCausalLM"))
QWEN3 = TextFamily("Qwen3", ("qwen3",), config_fields=qk_norm_fields, layer_windows=qwen_layer_windows,
                   layer_tensors=LLAMA_TENSORS + QK_NORM, gguf_arch="QWEN3", gguf_read=("qwen3", "Qwen3ForCausalLM"))

__all__ = ["QWEN2", "QWEN3", "qk_norm_fields", "qwen_layer_windows"]
