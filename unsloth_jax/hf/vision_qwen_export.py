"""Export a Qwen2.5-VL model's LoRA adapter (api.QwenVisionModel) for transformers + PEFT.

    save_qwen_vl_adapter(model, "lora_model", processor)   # PEFT adapter for Qwen2_5_VLForConditionalGeneration
    save_qwen_vl_merged(model, "merged", processor)         # W + scale * A @ B in 16 bits, a transformers checkpoint

The adapter's keys are PEFT's for transformers 5's module names
(`base_model.model.model.language_model.layers.{i}.self_attn.q_proj.lora_A.weight`,
`base_model.model.model.visual.blocks.{i}.attn.qkv.lora_B.weight`), and adapter_config.json's target_modules is a
regex naming exactly the adapted modules of each tower (a plain list would also catch the vision blocks'
gate/up/down_proj when the language MLP is targeted). The merged checkpoint uses the names transformers'
save_pretrained writes (model.*, visual.*, lm_head.*): the text tensors from export.merged_entries, the vision ones
from vision_qwen_io.qwen_vl_specs, in the layouts the loader reads back; config.json and the processor files as
hf.vision_export writes them for Gemma 3.
"""
from __future__ import annotations

import logging

import numpy as np

from unsloth_jax.errors import ConfigError
from unsloth_jax.hf import export
from unsloth_jax.hf.mapping import PROJ_MODULE
from unsloth_jax.hf.vision_export import save_merged_or_adapter, write_adapter_dir
from unsloth_jax.hf.vision_adapters import qwen_vision_module
from unsloth_jax.hf.vision_qwen_io import qwen_vl_specs
from unsloth_jax.lora import merged_kernel
from unsloth_jax.models.state import variable_at

log = logging.getLogger("unsloth_jax")

LANGUAGE_LAYERS = "model.language_model.layers"  # transformers' module path of the decoder layers
VISION_BLOCKS = "model.visual.blocks"  # and of the vision blocks
_TOWER_PATTERNS = {"language": (r"language_model\.layers", "self_attn|mlp"),
                   "vision": (r"visual\.blocks", "attn|mlp")}


def _lora_modules(model) -> list[tuple[str, object, int]]:
    """(module path with {i}, Linear, layers) of every projection carrying a LoRA pair."""
    lo = model.lora
    projs, vision = model.projections(), model.vision_projections()
    out = [(f"{LANGUAGE_LAYERS}.{{i}}.{PROJ_MODULE[n]}.{n}", projs[n], model.config.num_hidden_layers)
           for n in lo.target_modules]
    out += [(f"{VISION_BLOCKS}.{{i}}.{qwen_vision_module(n)}.{n}", vision[n], model.vl_config.vision.depth)
            for n in lo.vision_target_modules or ()]
    return out


def target_modules_regex(model) -> str:
    """adapter_config.json's target_modules: one alternative per tower, matching its adapted modules only."""
    lo = model.lora
    parts = []
    for tower, names in (("language", lo.target_modules), ("vision", lo.vision_target_modules or ())):
        if names:
            path, parents = _TOWER_PATTERNS[tower]
            parts.append(rf".*{path}\.\d+\.(?:{parents})\.(?:{'|'.join(names)})")
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def adapter_entries(model) -> list:
    """The adapter's tensors: lora_A [r, in] / lora_B [out, r] float32 per layer under PEFT's names."""
    f32 = np.dtype(np.float32)
    entries = []
    for path, lin, layers in _lora_modules(model):
        a, b = lin.lora_a[...], lin.lora_b[...]
        for i in range(layers):
            p = "base_model.model." + path.format(i=i)
            entries.append(export._Entry(f"{p}.lora_A.weight", (a.shape[2], a.shape[1]), f32,
                                         lambda a=a, i=i: np.asarray(a[i], np.float32).T))
            entries.append(export._Entry(f"{p}.lora_B.weight", (b.shape[2], b.shape[1]), f32,
                                         lambda b=b, i=i: np.asarray(b[i], np.float32).T))
    return entries


def save_qwen_vl_adapter(model, out_dir, processor=None, *, base_model_name_or_path=None) -> None:
    """Write a PEFT adapter directory that `peft.PeftModel.from_pretrained(Qwen2_5_VLForConditionalGeneration,
    out_dir)` loads: adapter_config.json and adapter_model.safetensors, plus the processor when given."""
    lo = model.lora
    if lo is None:
        raise ConfigError("the model has no LoRA adapter to save; call FastVisionModel.get_peft_model first")
    if lo.modules_to_save or lo.bias != "none":
        raise ConfigError("saving a Qwen2.5-VL adapter with modules_to_save or trained biases is not supported yet; "
                          "use get_peft_model(..., bias='none') without modules_to_save")
    config = export._adapter_config(model, base_model_name_or_path or export._base_model_name(model))
    config["target_modules"] = target_modules_regex(model)
    write_adapter_dir(out_dir, config, adapter_entries(model), processor)
    log.info("unsloth_jax: saved the Qwen2.5-VL LoRA adapter to %s", out_dir)


def _vision_make(model, spec, out_dtype):
    """A maker of one vision tensor in HF layout, LoRA folded into the adapted block Linears."""
    if spec.kind == "kernel" and spec.layer is not None:  # a stacked block Linear: [in, out] -> HF [out, in]
        lin = export.variable_parent(model, spec.path)
        return lambda: np.ascontiguousarray(merged_kernel(lin, spec.layer).T).astype(out_dtype)
    leaf = variable_at(model, spec.path)[...]
    if spec.kind in ("kernel", "patch"):  # the merger's Linears; the patch kernel [C*T*p*p, Dv] -> Conv3d weight
        return lambda: np.ascontiguousarray(np.asarray(leaf, np.float32).T).reshape(spec.hf_shape).astype(out_dtype)
    return lambda: np.asarray(leaf if spec.layer is None else leaf[spec.layer], np.float32).astype(out_dtype)


def merged_entries(model, out_dtype: np.dtype) -> list:
    """Every tensor of the merged checkpoint (transformers' save_pretrained names), text then vision."""
    entries = list(export.merged_entries(model, out_dtype))
    for name, spec in qwen_vl_specs(model.vl_config).items():
        if name.startswith("visual."):
            entries.append(export._Entry(name, spec.hf_shape, out_dtype, _vision_make(model, spec, out_dtype)))
    return entries


def save_qwen_vl_merged(model, out_dir, processor=None, *, save_method: str = "merged_16bit",
                        max_shard_size="5GB", dtype=None) -> None:
    """Write the merged model as a transformers Qwen2_5_VLForConditionalGeneration checkpoint (save_method
    "merged_16bit": W + scale * A @ B in float32, cast to `dtype`, default as export.save_merged), with config.json
    from the source and the processor (given, else the source's files); save_method "lora": the adapter only."""
    save_merged_or_adapter(model, out_dir, processor, save_method, max_shard_size, dtype,
                           entries_of=merged_entries, save_adapter=save_qwen_vl_adapter, label="Qwen2.5-VL")
