"""Export a Qwen2.5-VL model's LoRA adapter (api.QwenVisionModel) for transformers + PEFT.

    save_qwen_vl_adapter(model, "lora_model", processor)   # PEFT adapter for Qwen2_5_VLForConditionalGeneration
    save_qwen_vl_merged(model, "merged", processor)         # W + scale * A @ B in 16 bits, a transformers checkpoint

The adapter's keys are PEFT's for transformers 5's module names
(`base_model.model.model.language_model.layers.{i}.self_attn.q_proj.lora_A.weight`,
`base_model.model.model.visual.blocks.{i}.attn.qkv.lora_B.weight`), and adapter_config.json's target_modules is a
regex naming exactly the adapted modules of each tower (a plain list would also catch the vision blocks'
gate/up/down_proj when the language MLP is targeted); both come from hf.vision_export, by the family's AdapterLayout. The merged checkpoint uses the names transformers'
save_pretrained writes (model.*, visual.*, lm_head.*): the text tensors from export.merged_entries, the vision ones
from vision_qwen_io.qwen_vl_specs, in the layouts the loader reads back; config.json and the processor files as
hf.vision_export writes them for Gemma 3.
"""
from __future__ import annotations

import logging

import numpy as np

from unsloth_jax.hf import export
from unsloth_jax.hf.vision_export import (adapter_entries, check_exportable, save_merged_or_adapter,
                                          target_modules_regex, write_adapter_dir)
from unsloth_jax.hf.vision_qwen_io import qwen_vl_specs
from unsloth_jax.lora import merged_kernel
from unsloth_jax.models.state import variable_at

log = logging.getLogger("unsloth_jax")


def save_qwen_vl_adapter(model, out_dir, processor=None, *, base_model_name_or_path=None) -> str:
    """Write a PEFT adapter directory that `peft.PeftModel.from_pretrained(Qwen2_5_VLForConditionalGeneration,
    out_dir)` loads: adapter_config.json and adapter_model.safetensors, plus the processor when given."""
    check_exportable(model, "Qwen2.5-VL")
    config = export._adapter_config(model, base_model_name_or_path or export._base_model_name(model))
    config["target_modules"] = target_modules_regex(model)
    write_adapter_dir(out_dir, config, adapter_entries(model), processor)
    export.announce("unsloth_jax: saved the Qwen2.5-VL LoRA adapter to %s", out_dir)
    return str(out_dir)


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
                        max_shard_size="5GB", dtype=None) -> str:
    """Write the merged model as a transformers Qwen2_5_VLForConditionalGeneration checkpoint (save_method
    "merged_16bit": W + scale * A @ B in float32, cast to `dtype`, default as export.save_merged), with config.json
    from the source and the processor (given, else the source's files); save_method "lora": the adapter only."""
    return save_merged_or_adapter(model, out_dir, processor, save_method, max_shard_size, dtype,
                                  entries_of=merged_entries, save_adapter=save_qwen_vl_adapter, label="Qwen2.5-VL")
