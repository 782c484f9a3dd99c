"""A vision-language family's checkpoint tensors (its Family's data as TensorSpecs) and the checkpoint-tensor loop
the one loader (hf.vision_io) runs for every family.

    specs = vision_language_specs(family, cfg)
    params = {}
    read_vl_checkpoint(model_dir, specs, family, vl_tensor_placer(params, cfg, dtype, placer),
                       tied_lm_head=cfg.text.tie_word_embeddings)

Every tensor of the directory's safetensors files is read under its canonical name, checked against the family's
TensorSpecs (shape, one file giving it once) and handed to a place callback; unexpected and missing tensors are
named. `vl_tensor_placer` is the callback both families use: the text decoder's tensors through the text loader's
`place` (dense, or NF4 with quant.nf4_placer), the vision tower's and projector's dense, layers into their stack.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from unsloth_jax.errors import MissingTensorError, ShapeMismatchError, UnexpectedTensorError
from unsloth_jax.hf.loading import Params, Placer, _into_stack, default_placer, place, set_path
from unsloth_jax.families import VisionFamily
from unsloth_jax.config import layer_has, layer_slot
from unsloth_jax.hf.mapping import TensorSpec, tensor_specs
from unsloth_jax.hf.safetensors_io import SafetensorsFile, checkpoint_files

# place_tensor(spec, array in HF layout (numpy, spec.hf_shape), where: "file: tensor 'name'" for errors)
PlaceTensor = Callable[[TensorSpec, np.ndarray, str], None]
TEXT_ROOTS = ("model", "lm_head")  # module-path roots of the text decoder's tensors in both families


def layer_holds(text_cfg, tower: str, parent: str, proj: str, layer: int) -> bool:
    """Whether layer `layer` of `tower` ("language" / "vision") holds projection `proj` (under HF module `parent`):
    every vision block holds its projections; a language layer those config.layer_has gives it (Qwen3.5: the
    projections of its own token mixer only), by the text decoder's config `text_cfg`."""
    return tower == "vision" or layer_has(text_cfg, layer, f"{parent}.{proj}.")


def tower_row(text_cfg, tower: str, parent: str, layer: int) -> int:
    """The row of layer `layer` of `tower` in the stacked module `parent` (a vision block's its index; a language
    layer's config.layer_slot of the text decoder's config `text_cfg`)."""
    return layer if tower == "vision" else layer_slot(text_cfg, parent, layer)


def first_names(names: list[str], limit: int = 8) -> str:
    """The first `limit` of `names`, comma separated, and how many more there are."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def vision_language_specs(family: VisionFamily, cfg) -> dict[str, TensorSpec]:
    """Every tensor a checkpoint of `family` with config `cfg` must hold, keyed by canonical name: the text
    decoder's specs (module paths under `model` / `lm_head`; "model." names carry family.text_prefix), then the
    tower's rows (family.tower_tensors)."""
    specs = {}
    for name, spec in tensor_specs(cfg.text).items():
        canon = family.text_name(name)
        specs[canon] = dataclasses.replace(spec, hf_name=canon) if canon != name else spec
    for name, path, layer, kind, shape in family.tower_tensors(cfg):
        specs[name] = TensorSpec(name, path, layer, kind, tuple(shape))
    return specs


def read_vl_checkpoint(model_dir: str | os.PathLike, specs: dict[str, TensorSpec], family: VisionFamily,
                       place_tensor: PlaceTensor, *, tied_lm_head: bool) -> None:
    """Hand every tensor of the checkpoint in `model_dir` to `place_tensor`, by its spec in `specs` (keyed by
    canonical name, what family.canonical_name makes of a stored name). Canonical names starting with one of
    family.ignored_prefixes are skipped, as is lm_head.weight when `tied_lm_head`. Raises UnexpectedTensorError (a
    tensor no spec has, or a canonical name given twice), ShapeMismatchError (naming the tensor and file) and
    MissingTensorError (the canonical names absent, and the other spellings read)."""
    canonical_name, ignored_prefixes = family.canonical_name, family.ignored_prefixes
    seen: dict[str, str] = {}
    unexpected: list[str] = []
    handles = {path: SafetensorsFile(path) for path in checkpoint_files(model_dir)}
    try:
        for path, f in handles.items():
            for name in f.keys():
                canon = canonical_name(name)
                spec = specs.get(canon)
                if spec is None:
                    skipped = canon.startswith(ignored_prefixes) or (canon == "lm_head.weight" and tied_lm_head)
                    if not skipped:  # skipped: never run, or a tied copy of the embedding
                        unexpected.append(f"{name} (in {path.name})")
                    continue
                if canon in seen:
                    raise UnexpectedTensorError(f"{path}: tensor '{name}' is '{canon}', which {seen[canon]} "
                                                "already gave")
                seen[canon] = f"'{name}' in {path.name}"
                where = f"{path}: tensor '{name}'"
                if tuple(f.shape(name)) != spec.hf_shape:
                    raise ShapeMismatchError(f"{where} has shape {list(f.shape(name))}, but config.json implies "
                                             f"{list(spec.hf_shape)}")
                place_tensor(spec, np.asarray(f.get(name)), where)
    finally:
        for f in handles.values():
            f.close()
    if unexpected:
        raise UnexpectedTensorError(f"{model_dir}: checkpoint has tensors a {family.name} model with this "
                                    f"config.json does not use: {first_names(unexpected)}")
    missing = [n for n in specs if n not in seen]
    if missing:
        raise MissingTensorError(f"{model_dir}: checkpoint is missing {len(missing)} tensor(s) (canonical names; "
                                 f"also read as {family.also_read_as}): {first_names(missing)}")


def skipped_tensors(model_dir: str | os.PathLike, family: VisionFamily
                    ) -> list[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]]:
    """The tensors of the checkpoint in `model_dir` that read_vl_checkpoint skips by family.ignored_prefixes
    (Gemma 3's SigLIP head), for an export to write through unchanged: (canonical name, shape, a function reading
    the tensor from its file as float32 when called). Nothing is read now."""
    def reader(path, name):
        def read() -> np.ndarray:
            with SafetensorsFile(path) as f:
                return np.array(f.get(name), np.float32)  # a copy: the file's map closes after
        return read

    found = []
    for path in checkpoint_files(model_dir):
        with SafetensorsFile(path) as f:
            for name in f.keys():
                canon = family.canonical_name(name)
                if canon.startswith(family.ignored_prefixes):
                    found.append((canon, tuple(f.shape(name)), reader(path, name)))
    return found


def _place_vision(params: Params, spec: TensorSpec, array: np.ndarray, dtype, vision_layers: int,
                  where: str) -> None:
    """One vision-tower / projector tensor (HF layout) into `params` in `dtype`: a conv "patch" weight
    [Dv, C, (T,) p, p] -> kernel [C*(T*)p*p, Dv] (rows in channel, (time,) row, column order), a "kernel" [out, in]
    -> [in, out], anything else as it is; a layer's tensor into its slot of the [vision_layers, ...] stack."""
    if spec.kind == "patch":
        array = array.reshape(array.shape[0], -1).T
    elif spec.kind == "kernel":
        array = array.T
    value = jnp.asarray(array, dtype=dtype)
    if spec.layer is None:
        set_path(params, spec.path, value)
    else:
        set_path(params, spec.path, _into_stack(params, spec, value, vision_layers, where))


def vl_tensor_placer(params: Params, cfg, dtype, placer: Placer | None = None) -> PlaceTensor:
    """The place callback writing into `params` (a nested dict by module path) for a vision-language config `cfg`
    (its .text ModelConfig and .vision config): the text decoder's tensors (module paths under TEXT_ROOTS)
    through the text loader's `place` with `placer` (default: dense in `dtype`; quant.nf4_placer: the Linears in
    NF4), every other tensor dense in `dtype`."""
    def place_tensor(spec: TensorSpec, array: np.ndarray, where: str) -> None:
        if spec.path[0] in TEXT_ROOTS:
            place(params, spec, array, dtype, placer or default_placer, cfg.text, where)
        else:
            _place_vision(params, spec, array, dtype, cfg.vision.num_hidden_layers, where)

    return place_tensor
