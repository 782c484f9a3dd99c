"""Qwen3-VL (config.json model_type "qwen3_vl"; transformers' Qwen3VLForConditionalGeneration): the Qwen3 text
decoder rotating by interleaved M-RoPE positions [3, B, S] with DeepStack, plus the windowless vision tower and
its mergers (models.vision_qwen3). Inputs, batch fields and generation are Qwen2.5-VL's (families.qwen2_5_vl);
what differs is the config, the tower's tensors and its layout fields (vision_* batch fields)."""
from __future__ import annotations

import dataclasses

from unsloth_jax.config import Qwen3VLConfig
from unsloth_jax.families.base import AdapterLayout, TowerTensor
from unsloth_jax.families.qwen import QWEN3
from unsloth_jax.families.qwen2_5_vl import QwenVisionFamily
from unsloth_jax.models.vision_qwen3 import Qwen3VLForConditionalGeneration


def qwen3_vision_module(proj: str) -> str:
    """The parent module of a vision-block projection: attn (qkv, proj) or mlp (linear_fc1, linear_fc2)."""
    return "attn" if proj in ("qkv", "proj") else "mlp"


def _merger_rows(hf: str, path: tuple[str, ...], norm_dim: int, wide: int, out: int) -> list[TowerTensor]:
    """A Qwen3 patch merger's rows: norm (LayerNorm over norm_dim), linear_fc1 [wide, wide], linear_fc2 [out, wide]."""
    return [(f"{hf}.norm.weight", path + ("norm", "weight"), None, "norm", (norm_dim,)),
            (f"{hf}.norm.bias", path + ("norm", "bias"), None, "bias", (norm_dim,)),
            (f"{hf}.linear_fc1.weight", path + ("linear_fc1", "kernel"), None, "kernel", (wide, wide)),
            (f"{hf}.linear_fc1.bias", path + ("linear_fc1", "bias"), None, "bias", (wide,)),
            (f"{hf}.linear_fc2.weight", path + ("linear_fc2", "kernel"), None, "kernel", (out, wide)),
            (f"{hf}.linear_fc2.bias", path + ("linear_fc2", "bias"), None, "bias", (out,))]


@dataclasses.dataclass(frozen=True)
class Qwen3VisionFamily(QwenVisionFamily):
    def parse_config(self, raw: dict, source: str = "config.json") -> Qwen3VLConfig:
        return Qwen3VLConfig.from_dict(raw, source, text=QWEN3)

    def tower_tensors(self, cfg: Qwen3VLConfig) -> list[TowerTensor]:
        v = cfg.vision
        dv, fv, wide = v.hidden_size, v.intermediate_size, v.hidden_size * v.merge_unit
        shapes = {"qkv": (3 * dv, dv), "proj": (dv, dv), "linear_fc1": (fv, dv), "linear_fc2": (dv, fv)}
        rows = [("model.visual.patch_embed.proj.weight", ("visual", "patch_embed", "proj", "kernel"), None, "patch",
                 (dv, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)),
                ("model.visual.patch_embed.proj.bias", ("visual", "patch_embed", "proj", "bias"), None, "bias", (dv,)),
                ("model.visual.pos_embed.weight", ("visual", "pos_embed", "weight"), None, "embed",
                 (v.num_position_embeddings, dv))]
        for i in range(v.depth):
            for norm in ("norm1", "norm2"):
                for w, kind in (("weight", "norm"), ("bias", "bias")):
                    rows.append((f"model.visual.blocks.{i}.{norm}.{w}", ("visual", "blocks", norm, w), i, kind, (dv,)))
            for parent, projs in (("attn", ("qkv", "proj")), ("mlp", ("linear_fc1", "linear_fc2"))):
                for p in projs:
                    base = ("visual", "blocks", parent, p)
                    rows.append((f"model.visual.blocks.{i}.{parent}.{p}.weight", base + ("kernel",), i, "kernel",
                                 shapes[p]))
                    rows.append((f"model.visual.blocks.{i}.{parent}.{p}.bias", base + ("bias",), i, "bias",
                                 (shapes[p][0],)))
        rows += _merger_rows("model.visual.merger", ("visual", "merger"), dv, wide, v.out_hidden_size)
        for j in range(len(v.deepstack_visual_indexes)):
            rows += _merger_rows(f"model.visual.deepstack_merger_list.{j}", ("visual", f"deepstack_merger_{j}"), wide,
                                 wide, v.out_hidden_size)
        return rows

    def text_name(self, name: str) -> str:
        """model.* text names sit under model.language_model.* (transformers' module names, the Hub's files)."""
        return "model.language_model." + name[len("model."):] if name.startswith("model.") else name

    def describe(self, model) -> str:
        c, v = model.config, model.vl_config.vision
        return (f"qwen3_vl, text layers={c.num_hidden_layers}, hidden={c.hidden_size}, vision blocks={v.depth}, "
                f"patch {v.patch_size}, deepstack {list(v.deepstack_visual_indexes)}")


# Tensor names are transformers' module names (model.language_model.*, model.visual.*, lm_head.*: the Hub's
# files and save_pretrained), which are canonical; the Qwen2.5-VL checkpoint spelling (model.layers.*, visual.*) is
# read too. PEFT's layer paths: the same two spellings, the first written by the export.
QWEN3_VL = Qwen3VisionFamily(
    "Qwen3-VL", ("qwen3_vl",), Qwen3VLForConditionalGeneration,
    renames=(("visual.", "model.visual."), ("model.layers.", "model.language_model.layers."),
             ("model.embed_tokens.", "model.language_model.embed_tokens."),
             ("model.norm.", "model.language_model.norm.")),
    also_read_as="model.layers.*, visual.*",
    tower_roots=("visual",),
    adapter=AdapterLayout(language_paths=("model.language_model.layers", "model.layers"),
                          vision_paths=("model.visual.blocks", "visual.blocks"), vision_module=qwen3_vision_module,
                          target_patterns={"language": (r"language_model\.layers", "self_attn|mlp"),
                                           "vision": (r"visual\.blocks", "attn|mlp")}),
    vision_attention=("qkv", "proj"), vision_mlp=("linear_fc1", "linear_fc2"),
    image_fields=("pixel_values", "mrope_positions"), row_fields=("mrope_positions",))
