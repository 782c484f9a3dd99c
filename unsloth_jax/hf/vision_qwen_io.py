"""Load a Qwen2.5-VL checkpoint (Qwen2_5_VLForConditionalGeneration, config.json model_type "qwen2_5_vl").

    model = load_qwen_vl_model(model_dir, dtype=jnp.float32)  # models.vision_qwen2_5's model class
    model = load_qwen_vl_model(model_dir, placer=quant.nf4_placer)  # the language model's Linears in NF4 (QLoRA)
    load_vision_adapter(model, "lora_model")  # hf.vision_io, with hf.vision_adapters.QWEN_VL_ADAPTER's key spellings

Tensor names are read in both spellings: the checkpoint one (model.*, visual.*, lm_head.*: the Hub's files and
transformers 5's save_pretrained, which maps its modules back to it), the canonical names here, and transformers 5's
module names (model.language_model.*, model.visual.*). The tensor loop is hf.vision_checkpoint's (shared with Gemma
3): the text decoder's tensors go through the text loader's `place` (dense or NF4); the vision blocks are stacked the
same way, dense.
"""
from __future__ import annotations

import os

import jax.numpy as jnp

from unsloth_jax.config import QwenVLConfig
from unsloth_jax.hf.loading import Params, model_from_params
from unsloth_jax.hf.mapping import TensorSpec, tensor_specs
from unsloth_jax.hf.vision_checkpoint import read_vl_checkpoint, vl_tensor_placer
from unsloth_jax.models.vision_qwen2_5 import Qwen2_5_VLForConditionalGeneration

# (prefix as saved, canonical prefix); the first match wins
QWEN_VL_RENAMES = (("model.language_model.", "model."), ("model.visual.", "visual."))
_BLOCK_TENSORS = (  # (HF suffix after visual.blocks.{i}., module path under visual.blocks)
    ("norm1.weight", ("norm1", "weight")), ("norm2.weight", ("norm2", "weight")),
    *[(f"attn.{p}.{w}", ("attn", p, "kernel" if w == "weight" else w)) for p in ("qkv", "proj")
      for w in ("weight", "bias")],
    *[(f"mlp.{p}.{w}", ("mlp", p, "kernel" if w == "weight" else w)) for p in ("gate_proj", "up_proj", "down_proj")
      for w in ("weight", "bias")],
)


def qwen_vl_canonical_name(name: str) -> str:
    """A Qwen2.5-VL checkpoint tensor name in the canonical (transformers 4) spelling."""
    for old, new in QWEN_VL_RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def qwen_vl_specs(cfg: QwenVLConfig) -> dict[str, TensorSpec]:
    """Every tensor of a Qwen2.5-VL checkpoint, keyed by canonical name: the text decoder's specs, and the vision
    kinds "patch" (Conv3d weight [Dv, C, T, p, p] -> kernel [C*T*p*p, Dv]), "kernel" (transposed), "norm", "bias"."""
    specs = dict(tensor_specs(cfg.text))
    v = cfg.vision
    dv, fv, wide = v.hidden_size, v.intermediate_size, v.hidden_size * v.merge_unit
    shapes = {"qkv": (3 * dv, dv), "proj": (dv, dv), "gate_proj": (fv, dv), "up_proj": (fv, dv), "down_proj": (dv, fv)}

    def add(name, path, layer, kind, shape):
        specs[name] = TensorSpec(name, path, layer, kind, tuple(shape))

    add("visual.patch_embed.proj.weight", ("visual", "patch_embed", "proj", "kernel"), None, "patch",
        (dv, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size))
    for i in range(v.depth):
        for suffix, sub in _BLOCK_TENSORS:
            if sub[-1] == "kernel":
                kind, shape = "kernel", shapes[sub[-2]]
            elif sub[-1] == "bias":
                kind, shape = "bias", (shapes[sub[-2]][0],)
            else:
                kind, shape = "norm", (dv,)
            add(f"visual.blocks.{i}.{suffix}", ("visual", "blocks") + sub, i, kind, shape)
    add("visual.merger.ln_q.weight", ("visual", "merger", "ln_q", "weight"), None, "norm", (dv,))
    for j, out in ((0, wide), (2, v.out_hidden_size)):
        add(f"visual.merger.mlp.{j}.weight", ("visual", "merger", f"mlp_{j}", "kernel"), None, "kernel", (out, wide))
        add(f"visual.merger.mlp.{j}.bias", ("visual", "merger", f"mlp_{j}", "bias"), None, "bias", (out,))
    return specs


def load_qwen_vl_params(model_dir: str | os.PathLike, cfg: QwenVLConfig, dtype=jnp.float32, *,
                        placer=None) -> Params:
    """Every tensor of the Qwen2.5-VL checkpoint in `model_dir` as a nested dict by module path, in `dtype`.
    placer: the text loader's Placer for the language model's tensors (quant.nf4_placer: its Linears in NF4); the
    vision tower and merger are always placed dense. Raises MissingTensorError (naming the canonical names absent),
    UnexpectedTensorError and ShapeMismatchError (naming the tensor and file)."""
    params: Params = {}
    read_vl_checkpoint(model_dir, qwen_vl_specs(cfg), qwen_vl_canonical_name,
                       vl_tensor_placer(params, cfg, dtype, placer), tied_lm_head=cfg.text.tie_word_embeddings,
                       family="Qwen2.5-VL", also_read_as="model.language_model.*, model.visual.*")
    return params


def load_qwen_vl_model(model_dir: str | os.PathLike, cfg: QwenVLConfig | None = None, dtype=jnp.float32, *,
                       model_class=Qwen2_5_VLForConditionalGeneration, placer=None):
    """A `model_class` (Qwen2_5_VLForConditionalGeneration or a subclass) computing in `dtype`, holding the
    checkpoint in `model_dir` (config from its config.json unless `cfg` is given); placer as load_qwen_vl_params."""
    cfg = cfg or QwenVLConfig.from_pretrained(model_dir)
    values = load_qwen_vl_params(model_dir, cfg, dtype, placer=placer)
    return model_from_params(values, cfg, dtype, model_class, model_dir)
