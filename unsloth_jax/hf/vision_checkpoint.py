"""The checkpoint-tensor loop both vision-language loaders share (hf.vision_io: Gemma 3, hf.vision_qwen_io:
Qwen2.5-VL).

    params = {}
    read_vl_checkpoint(model_dir, specs, canonical_name, vl_tensor_placer(params, cfg, dtype, placer),
                       tied_lm_head=cfg.text.tie_word_embeddings, family="Qwen2.5-VL", also_read_as="model.visual.*")

Every tensor of the directory's safetensors files is read under its canonical name, checked against the family's
TensorSpecs (shape, one file giving it once) and handed to a place callback; unexpected and missing tensors are
named. `vl_tensor_placer` is the callback both families use: the text decoder's tensors through the text loader's
`place` (dense, or NF4 with quant.nf4_placer), the vision tower's and projector's dense, layers into their stack.
"""
from __future__ import annotations

import os
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from unsloth_jax.errors import MissingTensorError, ShapeMismatchError, UnexpectedTensorError
from unsloth_jax.hf.loading import Params, Placer, _into_stack, default_placer, place, set_path
from unsloth_jax.hf.mapping import TensorSpec
from unsloth_jax.hf.safetensors_io import SafetensorsFile, checkpoint_files

# place_tensor(spec, array in HF layout (numpy, spec.hf_shape), where: "file: tensor 'name'" for errors)
PlaceTensor = Callable[[TensorSpec, np.ndarray, str], None]
TEXT_ROOTS = ("model", "lm_head")  # module-path roots of the text decoder's tensors in both families


def first_names(names: list[str], limit: int = 8) -> str:
    """The first `limit` of `names`, comma separated, and how many more there are."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def read_vl_checkpoint(model_dir: str | os.PathLike, specs: dict[str, TensorSpec],
                       canonical_name: Callable[[str], str], place_tensor: PlaceTensor, *, tied_lm_head: bool,
                       family: str, also_read_as: str, ignored_prefixes: tuple[str, ...] = ()) -> None:
    """Hand every tensor of the checkpoint in `model_dir` to `place_tensor`, by its spec in `specs` (keyed by
    canonical name, what `canonical_name` makes of a stored name). Canonical names starting with one of
    `ignored_prefixes` are skipped, as is lm_head.weight when `tied_lm_head`. Raises UnexpectedTensorError (a tensor
    no spec has, or a canonical name given twice), ShapeMismatchError (naming the tensor and file) and
    MissingTensorError (the canonical names absent); `family` ("Gemma 3 vision-language", "Qwen2.5-VL") and
    `also_read_as` (the other spellings read) word the messages."""
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
        raise UnexpectedTensorError(f"{model_dir}: checkpoint has tensors a {family} model with this config.json "
                                    f"does not use: {first_names(unexpected)}")
    missing = [n for n in specs if n not in seen]
    if missing:
        raise MissingTensorError(f"{model_dir}: checkpoint is missing {len(missing)} tensor(s) (canonical names; "
                                 f"also read as {also_read_as}): {first_names(missing)}")


def skipped_tensors(model_dir: str | os.PathLike, canonical_name: Callable[[str], str],
                    prefixes: tuple[str, ...]) -> list[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]]:
    """The tensors of the checkpoint in `model_dir` that read_vl_checkpoint skips by `ignored_prefixes` (Gemma 3's
    SigLIP head), for an export to write through unchanged: (canonical name, shape, a function reading the tensor
    from its file as float32 when called). Nothing is read now."""
    def reader(path, name):
        def read() -> np.ndarray:
            with SafetensorsFile(path) as f:
                return np.array(f.get(name), np.float32)  # a copy: the file's map closes after
        return read

    found = []
    for path in checkpoint_files(model_dir):
        with SafetensorsFile(path) as f:
            for name in f.keys():
                canon = canonical_name(name)
                if canon.startswith(prefixes):
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
    (its .text ModelConfig and .vision config): the text decoder's tensors (module paths under model / lm_head)
    through the text loader's `place` with `placer` (default: dense in `dtype`; quant.nf4_placer: the Linears in
    NF4), every other tensor dense in `dtype`."""
    def place_tensor(spec: TensorSpec, array: np.ndarray, where: str) -> None:
        if spec.path[0] in TEXT_ROOTS:
            place(params, spec, array, dtype, placer or default_placer, cfg.text, where)
        else:
            _place_vision(params, spec, array, dtype, cfg.vision.num_hidden_layers, where)

    return place_tensor
