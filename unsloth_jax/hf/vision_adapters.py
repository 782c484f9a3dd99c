"""How PEFT names the LoRA modules of each vision-language family (Gemma 3, Qwen2.5-VL): the layer paths of both
towers in every transformers spelling read, and each projection's parent module. hf.vision_io reads adapters with
these; hf.vision_export / hf.vision_qwen_export write the transformers 5 spelling."""
from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass

from unsloth_jax.hf.mapping import PROJ_MODULE
from unsloth_jax.models.vision_qwen2_5 import Qwen2_5_VLForConditionalGeneration


@dataclass(frozen=True)
class AdapterLayout:
    """How PEFT names a vision-language family's LoRA modules: `family` for messages; `language_paths` /
    `vision_paths`, the module paths of each tower's layers (under base_model.model., followed by .{i}.) in every
    transformers spelling read; `vision_module`, a vision projection's parent module (the language projections'
    is mapping.PROJ_MODULE's, as in the text decoders); `target_patterns`, per tower (layer-path regex, parent
    modules regex) for the target_modules regex an exported adapter_config.json carries. The first of each
    tower's paths is the one an export writes (transformers 5's module names)."""

    family: str
    language_paths: tuple[str, ...]
    vision_paths: tuple[str, ...]
    vision_module: Callable[[str], str]
    target_patterns: dict

    def target_modules_regex(self, language: tuple[str, ...], vision: tuple[str, ...]) -> str:
        """target_modules for the adapted projections of each tower: one alternative per tower with any."""
        parts = []
        for tower, names in (("language", language), ("vision", vision)):
            if names:
                path, parents = self.target_patterns[tower]
                parts.append(rf".*{path}\.\d+\.(?:{parents})\.(?:{'|'.join(names)})")
        return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"

    def paths(self, tower: str) -> tuple[str, ...]:
        return self.language_paths if tower == "language" else self.vision_paths

    def module(self, tower: str, proj: str) -> str:
        """The HF parent module (e.g. self_attn, mlp) of projection `proj` of `tower`."""
        return PROJ_MODULE[proj] if tower == "language" else self.vision_module(proj)

    @functools.cached_property
    def key_regex(self) -> re.Pattern:
        """One LoRA key of an adapter: groups path (a layer path of either tower), i, module, proj, which (A/B)."""
        paths = sorted(self.language_paths + self.vision_paths, key=len, reverse=True)
        return re.compile(rf"^base_model\.model\.(?P<path>{'|'.join(map(re.escape, paths))})\.(?P<i>\d+)\."
                          r"(?P<module>\w+)\.(?P<proj>\w+?)\.lora_(?P<which>[AB])(?:\.[\w-]+)?\.weight$")


def gemma_vision_module(proj: str) -> str:
    """The parent module of a SigLIP encoder-layer projection: self_attn (q/k/v/out_proj) or mlp (fc1, fc2)."""
    return "self_attn" if proj.endswith("proj") else "mlp"


# transformers 5's module names (hf.vision_export writes these) and transformers 4's (language_model.model.layers,
# vision_tower.vision_model.encoder.layers), with and without the model. level
GEMMA3_ADAPTER = AdapterLayout(
    "Gemma 3", language_paths=("model.language_model.layers", "model.language_model.model.layers",
                               "language_model.layers", "language_model.model.layers"),
    vision_paths=("model.vision_tower.encoder.layers", "model.vision_tower.vision_model.encoder.layers",
                  "vision_tower.encoder.layers", "vision_tower.vision_model.encoder.layers"),
    vision_module=gemma_vision_module,
    target_patterns={"language": (r"language_model(?:\.model)?\.layers", "self_attn|mlp"),
                     "vision": (r"vision_tower(?:\.vision_model)?\.encoder\.layers", "self_attn|mlp")})


def qwen_vision_module(proj: str) -> str:
    """The parent module of a vision-block projection: attn (qkv, proj) or mlp (gate/up/down_proj)."""
    return "attn" if proj in ("qkv", "proj") else "mlp"


# PEFT's module paths of the decoder layers and vision blocks: transformers 5's module names (hf.vision_qwen_export
# writes these) and the checkpoint spelling (model.layers, visual.blocks) PEFT on transformers 4 writes
QWEN_VL_ADAPTER = AdapterLayout("Qwen2.5-VL", language_paths=("model.language_model.layers", "model.layers"),
                                vision_paths=("model.visual.blocks", "visual.blocks"), vision_module=qwen_vision_module,
                                target_patterns={"language": (r"language_model\.layers", "self_attn|mlp"),
                                                 "vision": (r"visual\.blocks", "attn|mlp")})


def adapter_layout(model) -> AdapterLayout:
    """The AdapterLayout of `model`'s family (Gemma 3 or Qwen2.5-VL)."""
    if isinstance(model, Qwen2_5_VLForConditionalGeneration):
        return QWEN_VL_ADAPTER
    return GEMMA3_ADAPTER
