"""One Family object per architecture, keyed by config.json's model_type (docs/ARCHITECTURE.md, "Adding a family").

    family = family_for(raw)        # config.json's dict -> its Family (UnsupportedArchitectureError if none)
    family = family_of(model)       # a loaded module (or its config) -> its Family
    inputs = family.prepare_inputs(batch)

Text families share `TEXT` (config.py's ModelConfig parsers, hf/mapping.py's tables, models.decoder.CausalLM); a
vision-language family is a `VisionFamily` (one module each: gemma3_vl, qwen2_5_vl, qwen3_vl, qwen3_5).
"""
from __future__ import annotations

from unsloth_jax.config import MOE_MODEL_TYPES, SUPPORTED_MODEL_TYPES
from unsloth_jax.errors import UnsupportedArchitectureError
from unsloth_jax.families.base import AdapterLayout, Family, ModelInputs, TextFamily, VisionFamily
from unsloth_jax.families.gemma3_vl import GEMMA3_VL
from unsloth_jax.families.qwen2_5_vl import QWEN2_5_VL
from unsloth_jax.families.qwen3_vl import QWEN3_VL
from unsloth_jax.families.qwen3_5 import QWEN3_5
from unsloth_jax.models.decoder import CausalLM

TEXT = TextFamily("text decoder", SUPPORTED_MODEL_TYPES + MOE_MODEL_TYPES, CausalLM)
VISION_FAMILIES: dict[str, VisionFamily] = {t: f for f in (GEMMA3_VL, QWEN2_5_VL, QWEN3_VL, QWEN3_5)
                                         for t in f.model_types}


def vision_family_for(raw: dict) -> VisionFamily | None:
    """The vision-language family of config.json's dict `raw`, or None for a text checkpoint (Gemma 3's
    model_type "gemma3" is vision-language only with a vision_config)."""
    family = VISION_FAMILIES.get(raw.get("model_type"))
    if family is GEMMA3_VL and "vision_config" not in raw:
        return None
    return family


def family_for(raw: dict, source: str = "config.json") -> Family:
    """The Family reading config.json's dict `raw`; UnsupportedArchitectureError naming `source` if none does."""
    family = vision_family_for(raw)
    if family is not None:
        return family
    if raw.get("model_type") in TEXT.model_types:
        return TEXT
    supported = ", ".join(TEXT.model_types + tuple(VISION_FAMILIES))
    raise UnsupportedArchitectureError(f"{source}: model_type {raw.get('model_type')!r} is not supported; supported "
                                       f"model types: {supported}")


def family_of(model_or_config) -> Family:
    """The Family of a loaded module (a vision-language one carries `vl_config`) or of a config object."""
    cfg = getattr(model_or_config, "vl_config", None)
    if cfg is None and hasattr(model_or_config, "text"):  # a vision-language config itself
        cfg = model_or_config
    if cfg is not None:
        return VISION_FAMILIES[cfg.model_type]
    return TEXT


__all__ = ["AdapterLayout", "Family", "GEMMA3_VL", "ModelInputs", "QWEN2_5_VL", "QWEN3_5", "QWEN3_VL", "TEXT",
           "TextFamily", "VISION_FAMILIES", "VisionFamily", "family_for", "family_of", "vision_family_for"]
