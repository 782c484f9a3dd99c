"""Phi-3 (Phi3ForCausalLM): Llama's layer whose checkpoint fuses qkv_proj and gate_up_proj (the module keeps the
projections apart: hf/mapping.py splits the fused rows on load and fuses them back on export), partial RoPE and
LongRoPE (_phi3_fields)."""
from __future__ import annotations

import math

from unsloth_jax.config import need, rope_fields
from unsloth_jax.errors import ConfigError
from unsloth_jax.families.base import TextFamily

# (fused HF suffix, parent module, the projections it holds in row order)
FUSED_PROJS = (("self_attn.qkv_proj.weight", "self_attn", ("q_proj", "k_proj", "v_proj")),
               ("mlp.gate_up_proj.weight", "mlp", ("gate_proj", "up_proj")))
_PHI3 = (
    ("input_layernorm.weight", ("input_layernorm", "weight"), "norm"),
    ("post_attention_layernorm.weight", ("post_attention_layernorm", "weight"), "norm"),
    ("self_attn.o_proj.weight", ("self_attn", "o_proj", "kernel"), "kernel"),
    ("mlp.down_proj.weight", ("mlp", "down_proj", "kernel"), "kernel"),
    *[(suffix, (parent, suffix.split(".")[1], "kernel"), "fused") for suffix, parent, _ in FUSED_PROJS],
)


def _phi3_fields(raw: dict, source: str) -> dict:
    """Phi-3 (Phi3ForCausalLM): Llama's layer (the checkpoint fuses qkv_proj and gate_up_proj; hf/mapping.py
    splits them), partial RoPE (`partial_rotary_factor`) and LongRoPE (`rope_scaling` type "longrope", or the
    older "su" / "yarn" that transformers reads as longrope): inverse frequencies divided by `short_factor` while
    the largest position of a call is below `original_max_position_embeddings`, by `long_factor` beyond, and
    cos/sin times `attention_factor` (default sqrt(1 + ln(factor) / ln(original)), factor = max_position /
    original)."""
    params = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    head_dim = int(raw.get("head_dim") or int(need(raw, "hidden_size", source)) // int(
        need(raw, "num_attention_heads", source)))
    partial = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) or 1.0)
    rotary = int(head_dim * partial)
    if rotary <= 0 or rotary > head_dim or rotary % 2:
        raise ConfigError(f"{source}: partial_rotary_factor={partial} gives {rotary} rotary dims of a {head_dim}-dim "
                          "head; it must be even and between 2 and head_dim")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    out: dict = {"rotary_dim": 0 if rotary == head_dim else rotary}
    if rope_type not in ("longrope", "su", "yarn"):
        out.update(rope_fields({"rope_parameters": params}, source))
        return out
    short, long = params.get("short_factor"), params.get("long_factor")
    for key, value in (("short_factor", short), ("long_factor", long)):
        if not isinstance(value, list) or len(value) != rotary // 2 or not all(
                isinstance(x, (int, float)) and x > 0 for x in value):
            raise ConfigError(f"{source}: rope_scaling.{key} must be a list of {rotary // 2} positive numbers "
                              f"(one per rotary frequency) for rope type {rope_type!r}")
    original = raw.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    if not original:
        raise ConfigError(f"{source}: LongRoPE needs original_max_position_embeddings")
    original = int(original)
    factor = params.get("factor") or int(raw.get("max_position_embeddings", original)) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    out.update(rope_theta=float(params["rope_theta"]), rope_type="longrope", rope_factor=float(factor),
               rope_original_max_position=original, rope_short_factor=tuple(float(x) for x in short),
               rope_long_factor=tuple(float(x) for x in long), rope_attention_factor=float(attention))
    return out


PHI3 = TextFamily("Phi-3", ("phi3",), config_fields=_phi3_fields, layer_tensors=_PHI3, fused_projs=FUSED_PROJS,
                  gguf_arch="PHI3", gguf_read=("phi3", "Phi3ForCausalLM"))

__all__ = ["PHI3"]
