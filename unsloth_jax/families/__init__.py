"""One Family object per architecture, keyed by config.json's model_type (docs/ARCHITECTURE.md, "Adding a family").

    family = family_for(raw)        # config.json's dict -> its Family (UnsupportedArchitectureError if none)
    family = family_of(model)       # a loaded module (or its config) -> its Family
    cfg = text_config(raw)          # config.json's dict of a text checkpoint -> ModelConfig (or of a multimodal
                                    # one whose text decoder loads alone, Gemma 4: cfg.source_layout names it)
    inputs = family.prepare_inputs(batch)

A text family is a `TextFamily`, one module each (llama, qwen, gemma, gemma3_text, phi3, smollm3, qwen3_5_text,
gemma4_text, moe, glm4_moe), registered by one entry in TEXT_FAMILIES; a vision-language family is a
`VisionFamily` (gemma3_vl, qwen2_5_vl, qwen3_vl, qwen3_5), registered in VISION_FAMILIES.
"""
from __future__ import annotations

import dataclasses
import os

from unsloth_jax.config import ModelConfig, read_config_json
from unsloth_jax.errors import ConfigError, UnsupportedArchitectureError
from unsloth_jax.families.base import (AdapterLayout, Family, ModelInputs, MultimodalTextLayout, TextFamily,
                                      VisionFamily)
from unsloth_jax.families.gemma import GEMMA, GEMMA2
from unsloth_jax.families.gemma3_text import GEMMA3_TEXT
from unsloth_jax.families.gemma3_vl import GEMMA3_VL
from unsloth_jax.families.gemma4_text import GEMMA4_MULTIMODAL, GEMMA4_TEXT
from unsloth_jax.families.glm4_moe import GLM4_MOE
from unsloth_jax.families.llama import LLAMA, MISTRAL
from unsloth_jax.families.moe import GPT_OSS, MIXTRAL, QWEN3_MOE
from unsloth_jax.families.phi3 import PHI3
from unsloth_jax.families.qwen import QWEN2, QWEN3
from unsloth_jax.families.qwen2_5_vl import QWEN2_5_VL
from unsloth_jax.families.qwen3_5 import QWEN3_5
from unsloth_jax.families.qwen3_5_text import QWEN3_5_TEXT
from unsloth_jax.families.qwen3_vl import QWEN3_VL
from unsloth_jax.families.smollm3 import SMOLLM3

# The text families; adding one is its module plus its entry here (the order is the supported-types message's)
TEXT_FAMILIES: tuple[TextFamily, ...] = (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA, GEMMA2, GEMMA3_TEXT, PHI3, SMOLLM3,
                                         QWEN3_5_TEXT, GEMMA4_TEXT, QWEN3_MOE, MIXTRAL, GPT_OSS, GLM4_MOE)
# no model_type of its own: the batch layout and inputs every text family shares (the trainers' default family)
TEXT = TextFamily("text decoder", ())
VISION_FAMILIES: dict[str, VisionFamily] = {t: f for f in (GEMMA3_VL, QWEN2_5_VL, QWEN3_VL, QWEN3_5)
                                         for t in f.model_types}
# model_type of a multimodal checkpoint whose text decoder FastLanguageModel loads alone -> its layout
MULTIMODAL_TEXT_LAYOUTS: dict[str, MultimodalTextLayout] = {GEMMA4_MULTIMODAL.model_type: GEMMA4_MULTIMODAL}


def text_families() -> dict[str, TextFamily]:
    """model_type -> its TextFamily, for every registered text family (ValueError if two claim one type)."""
    out: dict[str, TextFamily] = {}
    for family in TEXT_FAMILIES:
        for t in family.model_types:
            if t in out:
                raise ValueError(f"model_type {t!r} is claimed by both {out[t].name} and {family.name}")
            out[t] = family
    return out


TEXT_BY_TYPE = text_families()
TEXT_MODEL_TYPES = tuple(TEXT_BY_TYPE)


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
    if raw.get("model_type") in TEXT_BY_TYPE:
        return TEXT_BY_TYPE[raw["model_type"]]
    supported = ", ".join(TEXT_MODEL_TYPES + tuple(VISION_FAMILIES))
    raise UnsupportedArchitectureError(f"{source}: model_type {raw.get('model_type')!r} is not supported; supported "
                                       f"model types: {supported}")


def text_family(model_type: str) -> TextFamily:
    """The TextFamily of a text ModelConfig's model_type (UnsupportedArchitectureError if none)."""
    family = TEXT_BY_TYPE.get(model_type)
    if family is None:
        raise UnsupportedArchitectureError(f"model_type {model_type!r} is not a supported text model; supported "
                                           f"model types: {', '.join(TEXT_MODEL_TYPES)}")
    return family


def text_config(raw: dict, source: str = "config.json") -> ModelConfig:
    """config.json's dict `raw` of a text decoder -> its family's ModelConfig. UnsupportedArchitectureError naming
    `source` for a vision-language or unknown model_type, ConfigError naming the key for a bad field."""
    model_type = raw.get("model_type")
    if model_type in VISION_FAMILIES:
        raise UnsupportedArchitectureError(
            f"{source}: model_type {model_type!r} is a vision-language model; load it with "
            "FastVisionModel.from_pretrained (unsloth_jax.config.VisionLanguageConfig / QwenVLConfig)")
    if model_type in MULTIMODAL_TEXT_LAYOUTS:
        return _multimodal_text_config(MULTIMODAL_TEXT_LAYOUTS[model_type], raw, source)
    if model_type not in TEXT_BY_TYPE:
        raise UnsupportedArchitectureError(
            f"{source}: model_type {model_type!r} is not supported; supported model types: "
            f"{', '.join(TEXT_MODEL_TYPES)}"
        )
    return TEXT_BY_TYPE[model_type].parse_config(raw, source)


def _multimodal_text_config(layout: MultimodalTextLayout, raw: dict, source: str) -> ModelConfig:
    """The text decoder's ModelConfig of a multimodal checkpoint (its text_config, parsed by the text family; the
    head tied as the whole model's tie_word_embeddings says, transformers' default True), recording the layout."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: model_type {layout.model_type!r} ({layout.architecture}) needs a text_config "
                          "mapping")
    text_type = text.get("model_type")
    family = TEXT_BY_TYPE.get(text_type)
    if family is None:
        raise UnsupportedArchitectureError(f"{source}: text_config.model_type {text_type!r} is not a supported "
                                           f"text model (model_type {layout.model_type!r})")
    cfg = family.parse_config(text, f"{source} text_config")
    return dataclasses.replace(cfg, source_layout=layout.model_type,
                               tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)))


def source_layout(cfg: ModelConfig) -> MultimodalTextLayout | None:
    """The multimodal checkpoint layout a text decoder's config was read from (None: a text checkpoint)."""
    return MULTIMODAL_TEXT_LAYOUTS[cfg.source_layout] if cfg.source_layout else None


def read_text_config(model_dir: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a Hugging Face model directory's config.json (errors name its path)."""
    raw, path = read_config_json(model_dir)
    return text_config(raw, str(path))


def family_of(model_or_config) -> Family:
    """The Family of a loaded module (a vision-language one carries `vl_config`; a text one its ModelConfig as
    `config`) or of a config object."""
    cfg = getattr(model_or_config, "vl_config", None)
    if cfg is None and hasattr(model_or_config, "text"):  # a vision-language config itself
        cfg = model_or_config
    if cfg is not None:
        return VISION_FAMILIES[cfg.model_type]
    return text_family(getattr(model_or_config, "config", model_or_config).model_type)


__all__ = ["AdapterLayout", "Family", "GEMMA", "GEMMA2", "GEMMA3_TEXT", "GEMMA3_VL", "GEMMA4_TEXT", "GLM4_MOE",
           "GPT_OSS", "LLAMA", "MISTRAL", "MIXTRAL", "MULTIMODAL_TEXT_LAYOUTS", "ModelInputs", "MultimodalTextLayout",
           "PHI3", "QWEN2", "QWEN2_5_VL", "QWEN3", "QWEN3_5", "QWEN3_5_TEXT", "QWEN3_MOE", "QWEN3_VL", "SMOLLM3",
           "TEXT", "TEXT_BY_TYPE", "TEXT_FAMILIES", "TEXT_MODEL_TYPES", "TextFamily", "VISION_FAMILIES", "VisionFamily",
           "family_for", "family_of", "read_text_config", "source_layout", "text_config", "text_family",
           "vision_family_for"]
