"""The one exporter of vision-language models (Gemma 3, Qwen2.5-VL; api.VisionLanguageModel) to transformers /
PEFT, driven by the model's Family (unsloth_jax.families).

    save_vision_adapter(model, "lora_model", processor)     # PEFT adapter for transformers' model class
    save_vision_merged(model, "merged", processor)          # W + scale * A @ B in 16 bits, a transformers checkpoint

The adapter's keys are PEFT's for transformers 5's module names, the first path of each tower in the family's
AdapterLayout (`base_model.model.model.language_model.layers.{i}.self_attn.q_proj.lora_A.weight`,
`base_model.model.model.vision_tower.encoder.layers.{i}.mlp.fc1.lora_B.weight`,
`base_model.model.model.visual.blocks.{i}.attn.qkv.lora_B.weight`), and adapter_config.json's target_modules is a
regex naming exactly the adapted modules of each tower (a plain list would also catch the other tower's
projections of the same name). The merged checkpoint uses the tensor names transformers' save_pretrained writes
(the canonical names of hf.vision_checkpoint.vision_language_specs): the text decoder's tensors come from
export.merged_entries (the text export, names in the family's text_name spelling), the tower's and projector's
from the family's tower rows, in the layouts the loader (hf.vision_io) reads back, and the source checkpoint's
tensors under the family's ignored_prefixes (Gemma 3's unused SigLIP pooling head) copied through. Both are
written through export's atomic directory.
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np

from unsloth_jax.errors import ConfigError
from unsloth_jax.hf import export
from unsloth_jax.families import family_of
from unsloth_jax.hf.vision_checkpoint import layer_holds, tower_row, skipped_tensors, vision_language_specs
from unsloth_jax.lora import merged_kernel
from unsloth_jax.models.state import variable_at

log = logging.getLogger("unsloth_jax")


def _lora_modules(model) -> list[tuple[str, object, list[int]]]:
    """(module path with {i}, Linear, (layer, its row in the stack) of the layers holding it) of every projection
    carrying a LoRA pair, under transformers 5's module names (the family's AdapterLayout); the layers by
    vision_checkpoint.layer_holds, the rows by its tower_row."""
    layout, lo = family_of(model).adapter, model.lora
    towers = (("language", lo.target_modules, model.projections(), model.config.num_hidden_layers),
              ("vision", lo.vision_target_modules or (), model.vision_projections(),
               model.vl_config.vision.num_hidden_layers))
    out = []
    for tower, names, lins, layers in towers:
        for name in names:
            module = layout.module(tower, name)
            held = [(i, tower_row(model.config, tower, module, i)) for i in range(layers)
                    if layer_holds(model.config, tower, module, name, i)]
            out.append((f"{layout.paths(tower)[0]}.{{i}}.{module}.{name}", lins[name], held))
    return out


def target_modules_regex(model) -> str:
    """adapter_config.json's target_modules: one alternative per tower, matching its adapted modules only."""
    lo = model.lora
    return family_of(model).adapter.target_modules_regex(tuple(lo.target_modules),
                                                         tuple(lo.vision_target_modules or ()))


def check_exportable(model, what: str) -> None:
    """ConfigError unless the model has a LoRA adapter export can write; `what` names it in the message."""
    lo = model.lora
    if lo is None:
        raise ConfigError("the model has no LoRA adapter to save; call FastVisionModel.get_peft_model first")
    if lo.modules_to_save or lo.bias != "none":
        raise ConfigError(f"saving a {what} adapter with modules_to_save or trained biases is not supported yet; use "
                          "get_peft_model(..., bias='none') without modules_to_save")


def adapter_entries(model) -> list:
    """The adapter's tensors: lora_A [r, in] / lora_B [out, r] float32 per layer under PEFT's names."""
    f32 = np.dtype(np.float32)
    entries = []
    for path, lin, held in _lora_modules(model):
        a, b = lin.lora_a[...], lin.lora_b[...]
        for i, row in held:
            p = "base_model.model." + path.format(i=i)
            entries.append(export._Entry(f"{p}.lora_A.weight", (a.shape[2], a.shape[1]), f32,
                                         lambda a=a, row=row: np.asarray(a[row], np.float32).T))
            entries.append(export._Entry(f"{p}.lora_B.weight", (b.shape[2], b.shape[1]), f32,
                                         lambda b=b, row=row: np.asarray(b[row], np.float32).T))
    return entries


def _save_processor(model, directory: Path, processor) -> None:
    """The processor (or tokenizer) given, else the tokenizer and processor files of the source directory."""
    if processor is not None:
        processor.save_pretrained(str(directory))
        return
    src = Path(model.model_dir) if model.model_dir is not None else None
    if src is None or not src.is_dir():
        return
    for fname in export._TOKENIZER_FILES + export.PROCESSOR_FILES:
        if (src / fname).is_file():
            shutil.copyfile(src / fname, directory / fname)


def save_vision_adapter(model, out_dir, processor=None, *, base_model_name_or_path=None) -> str:
    """Write a PEFT adapter directory that `peft.PeftModel.from_pretrained(<transformers' model class>, out_dir)`
    loads: adapter_config.json (target_modules a regex, module docstring) and adapter_model.safetensors, plus the
    processor when given."""
    name = family_of(model).name
    check_exportable(model, name)
    config = export._adapter_config(model, base_model_name_or_path or export._base_model_name(model))
    config["target_modules"] = target_modules_regex(model)
    write_adapter_dir(out_dir, config, adapter_entries(model), processor)
    export.announce("unsloth_jax: saved the %s LoRA adapter to %s", name, out_dir)
    return str(out_dir)


def write_adapter_dir(out_dir, config: dict, entries: list, processor) -> None:
    """Write a PEFT adapter directory atomically (replacing an earlier adapter save): adapter_config.json from
    `config`, adapter_model.safetensors from `entries` (export._Entry) and the processor's files when given."""
    with export.atomic_directory(out_dir, export._ADAPTER_ARTIFACTS) as tmp:
        if processor is not None:
            processor.save_pretrained(str(tmp))
        export.write_safetensors_stream(tmp / export.ADAPTER_WEIGHTS, entries, {"format": "pt"})
        export._write_json(tmp / export.ADAPTER_CONFIG, config)


def _vision_make(model, spec, out_dtype):
    """A maker of one tower / projector tensor in HF layout, LoRA folded into the adapted stacked Linears."""
    if spec.kind == "kernel" and spec.layer is not None:  # a stacked tower Linear: [in, out] -> HF [out, in]
        lin = export.variable_parent(model, spec.path)
        return lambda: np.ascontiguousarray(merged_kernel(lin, spec.slot).T).astype(out_dtype)
    leaf = variable_at(model, spec.path)[...]
    if spec.kind in ("kernel", "patch"):  # a projector Linear; a patch kernel [C*(T*)p*p, Dv] -> conv weight
        return lambda: np.ascontiguousarray(np.asarray(leaf, np.float32).T).reshape(spec.hf_shape).astype(out_dtype)
    return lambda: np.asarray(leaf if spec.slot is None else leaf[spec.slot], np.float32).astype(out_dtype)


def _source_entries(model, out_dtype: np.dtype) -> list:
    """The source checkpoint's tensors the loader skipped by the family's ignored_prefixes (SigLIP's pooling head,
    which Gemma 3 never runs but transformers' model holds), read from model.model_dir at write time and cast to
    out_dtype, so transformers finds none missing. A source that is gone is warned about."""
    family = family_of(model)
    if not family.ignored_prefixes:
        return []
    source = getattr(model, "model_dir", None)
    if source is None or not Path(source).is_dir():
        log.warning("unsloth_jax: the source checkpoint %s is not there any more: the merged model lacks its "
                    "tensors under %s (unused by %s; transformers will report them missing)", source,
                    ", ".join(family.ignored_prefixes), family.name)
        return []
    return [export._Entry(name, shape, out_dtype, lambda read=read: read().astype(out_dtype))
            for name, shape, read in skipped_tensors(source, family)]


def merged_entries(model, out_dtype: np.dtype) -> list:
    """Every tensor of the merged checkpoint (transformers' save_pretrained names), text then the tower and
    projector, then the source's tensors the model does not hold (Gemma 3's SigLIP head), unchanged."""
    family = family_of(model)
    entries = []
    for e in export.merged_entries(model, out_dtype):
        name = family.text_name(e.name)
        entries.append(export._Entry(name, e.shape, e.dtype, e.make))
    for name, spec in vision_language_specs(family, model.vl_config).items():
        if spec.path[0] in family.tower_roots:
            entries.append(export._Entry(name, spec.hf_shape, out_dtype, _vision_make(model, spec, out_dtype)))
    return entries + _source_entries(model, out_dtype)


def _merged_config(model, out_dtype: np.dtype) -> dict:
    raw = export.source_config(model)
    if raw is None:
        raise ConfigError(f"cannot write config.json for the merged model: {model.model_dir!r} has no config.json")
    raw.pop("quantization_config", None)
    name = export._dtype_name(out_dtype)
    for cfg in (raw, raw.get("text_config") or {}, raw.get("vision_config") or {}):
        if "dtype" in cfg or cfg is raw:
            cfg["dtype"] = name
        if "torch_dtype" in cfg:
            cfg["torch_dtype"] = name
    return raw


def write_merged_checkpoint(model, out_dir, entries: list, config: dict, processor, max_shard_size) -> None:
    """Write a vision-language model's merged checkpoint into out_dir (atomically, replacing an earlier merged
    save): `entries` (export._Entry, the tensors) in shards of at most max_shard_size with the index,
    config.json, the source's generation_config.json and the processor (given, else the source's files)."""
    with export.atomic_directory(out_dir, export._MERGED_ARTIFACTS) as tmp:
        export.write_shards(tmp, entries, export.parse_size(max_shard_size))
        export._write_json(tmp / "config.json", config)
        export.copy_generation_config(model, tmp)
        _save_processor(model, tmp, processor)


def save_vision_merged(model, out_dir, processor=None, *, save_method: str = "merged_16bit",
                       max_shard_size="5GB", dtype=None) -> str:
    """Write the merged model as a transformers checkpoint of the family's model class (save_method
    "merged_16bit": W + scale * A @ B in float32, cast to `dtype`, default as export.save_merged: bfloat16 unless
    the source says float16), with config.json from the source and the processor (given, else the source's
    files); save_method "lora": the adapter only; another save_method is a ConfigError."""
    if save_method == "lora":
        return save_vision_adapter(model, out_dir, processor)
    if save_method not in export.SAVE_METHODS:
        raise ConfigError(f"save_method={save_method!r} is not supported for vision-language models; use one of "
                          f"{', '.join(export.SAVE_METHODS)}")
    out_dtype = export._resolve_out_dtype(model, dtype)
    write_merged_checkpoint(model, out_dir, merged_entries(model, out_dtype), _merged_config(model, out_dtype),
                            processor, max_shard_size)
    export.announce("unsloth_jax: saved the merged %s %s model to %s", export._dtype_name(out_dtype),
                    family_of(model).name, out_dir)
    return str(out_dir)
