"""Qwen3.5 as released (config.json model_type "qwen3_5"; transformers' Qwen3_5ForConditionalGeneration): the
Qwen3.5 hybrid text decoder (qwen3_5_text: gated DeltaNet on three layers of four, gated full attention on the
others) rotating its partial RoPE dims by interleaved M-RoPE, plus Qwen3-VL's vision tower without DeepStack. The
module is Qwen3-VL's (models.vision_qwen3) on a config whose tower has no DeepStack indexes; tensor names,
inputs, batch fields and generation are Qwen3-VL's. What differs: the config, the linear-attention mixer in the
PEFT target pattern, and the multi-token-prediction head (mtp.*) checkpoints carry, which transformers never runs:
skipped on load, copied through on a merged export."""
from __future__ import annotations

import dataclasses

from unsloth_jax.config import Qwen3_5Config
from unsloth_jax.families.qwen3_5_text import QWEN3_5_TEXT
from unsloth_jax.families.qwen3_vl import QWEN3_VL, Qwen3VisionFamily


@dataclasses.dataclass(frozen=True)
class Qwen3_5Family(Qwen3VisionFamily):
    def parse_config(self, raw: dict, source: str = "config.json") -> Qwen3_5Config:
        return Qwen3_5Config.from_dict(raw, source, text=QWEN3_5_TEXT)

    def describe(self, model) -> str:
        c, v = model.config, model.vl_config.vision
        linear = sum(c.layer_linear)
        return (f"qwen3_5, text layers={c.num_hidden_layers} ({linear} linear attention), hidden={c.hidden_size}, "
                f"vision blocks={v.depth}, patch {v.patch_size}")


# Qwen3-VL's data with Qwen3.5's name, model_type, skipped mtp.* head and linear_attn in the language targets
QWEN3_5 = Qwen3_5Family(**{f.name: getattr(QWEN3_VL, f.name) for f in dataclasses.fields(QWEN3_VL)} | dict(
    name="Qwen3.5", model_types=("qwen3_5",), ignored_prefixes=("mtp.",),
    adapter=dataclasses.replace(QWEN3_VL.adapter, target_patterns=QWEN3_VL.adapter.target_patterns | {
        "language": (r"language_model\.layers", "self_attn|linear_attn|mlp")})))
