"""Gemma 3 text (config.json model_type "gemma3_text"; transformers' Gemma3ForCausalLM, and the text decoder of
Gemma 3 with images, families.gemma3_vl): Gemma 2's layer with q/k norms, sliding layers in a pattern and two RoPE
bases (_gemma3_fields)."""
from __future__ import annotations

import logging
import math

from unsloth_jax.config import layer_windows, need, no_layer_windows, rope_fields
from unsloth_jax.errors import ConfigError
from unsloth_jax.families.base import TextFamily
from unsloth_jax.families.tensors import LLAMA_TENSORS, QK_NORM, SANDWICH

log = logging.getLogger("unsloth_jax")


def _gemma3_fields(raw: dict, source: str) -> dict:
    """Gemma 3 text (Gemma3ForCausalLM): Gemma 2's layer shape (sandwich norms, (1 + w) norms, scaled
    embeddings) plus q/k norms, every `sliding_window_pattern`-th layer global (or `layer_types`), and two RoPEs:
    plain RoPE with base `rope_local_base_freq` on sliding layers, `rope_theta` + `rope_scaling` on global ones.
    `final_logit_softcapping` applies; `attn_logit_softcapping` is ignored, as transformers' Gemma 3 does.
    Reads transformers 4 (`rope_theta`, `rope_local_base_freq`, `rope_scaling`) and 5 (`rope_parameters` keyed
    by layer type) spellings; defaults are Gemma3TextConfig's."""
    if raw.get("use_bidirectional_attention"):
        raise ConfigError(f"{source}: use_bidirectional_attention=true (an embedding model) is not supported")
    n = int(need(raw, "num_hidden_layers", source))
    params = raw.get("rope_parameters") or {}
    nested = isinstance(params.get("full_attention"), dict) or isinstance(params.get("sliding_attention"), dict)
    if nested:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full = dict(params or raw.get("rope_scaling") or {})
        local = {}
    full.setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", raw.get("rope_local_base_freq", 10_000.0))
    if (local.get("rope_type") or local.get("type") or "default") != "default":
        raise ConfigError(f"{source}: sliding_attention rope type {local.get('rope_type') or local.get('type')!r} "
                          "is not supported (only default RoPE on Gemma 3's sliding layers)")
    out = rope_fields({"rope_parameters": full}, source)
    out["rope_local_theta"] = float(local["rope_theta"])
    if not math.isfinite(out["rope_local_theta"]) or out["rope_local_theta"] <= 0:
        raise ConfigError(f"{source}: rope_local_base_freq must be positive")
    if not raw.get("layer_types"):
        pattern = int(raw.get("sliding_window_pattern") or 6)
        raw = dict(raw, sliding_window=raw.get("sliding_window", 4096),
                   layer_types=["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)])
    out["layer_windows"] = layer_windows(raw, n, source)
    if not any(out["layer_windows"]):
        out["rope_local_theta"] = 0.0  # no sliding layer: one RoPE
    if raw.get("attn_logit_softcapping"):
        log.warning("unsloth_jax: %s sets attn_logit_softcapping, which transformers' Gemma 3 never applies; "
                    "ignored here too, so the logits match transformers'", source)
    out.update(qk_norm=True, norm_offset=1.0, embed_scale=True, sandwich_norms=True, attn_softcap=None,
               tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
               query_scale=float(raw.get("query_pre_attn_scalar") or 256) ** -0.5)
    return out


# its windows come from _gemma3_fields
GEMMA3_TEXT = TextFamily("Gemma 3", ("gemma3_text",), config_fields=_gemma3_fields, layer_windows=no_layer_windows,
                         activation_key="hidden_activation", layer_tensors=LLAMA_TENSORS + SANDWICH + QK_NORM)

__all__ = ["GEMMA3_TEXT"]
