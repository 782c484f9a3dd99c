"""Load a Gemma 3 vision-language checkpoint (Gemma3ForConditionalGeneration, config.json model_type "gemma3").

    model = load_vision_language_model(model_dir, dtype=jnp.float32)   # a models.vision.Gemma3ForConditionalGeneration

Tensor names are read in any of the spellings of `mapping.VL_RENAMES` (transformers 5's save_pretrained, the Hub's
transformers 4 checkpoints, transformers 5's module names). The text decoder's tensors go through the text
loader's `place` (stacked layers, transposed kernels); the vision layers are stacked the same way. SigLIP's
pooling head (`vision_tower.head.*`), which Gemma 3 never runs, is skipped.
"""
from __future__ import annotations

import logging
import os

import jax.numpy as jnp
import numpy as np

from unsloth_jax.config import VisionLanguageConfig
from unsloth_jax.errors import MissingTensorError, ShapeMismatchError, UnexpectedTensorError
from unsloth_jax.hf.loading import Params, _into_stack, default_placer, model_from_params, place, set_path
from unsloth_jax.hf.mapping import VL_IGNORED_PREFIXES, TensorSpec, vision_language_specs, vl_canonical_name
from unsloth_jax.hf.safetensors_io import SafetensorsFile, checkpoint_files
from unsloth_jax.models.vision import Gemma3ForConditionalGeneration

log = logging.getLogger("unsloth_jax")


def _place_vision(params: Params, spec: TensorSpec, array: np.ndarray, dtype, cfg: VisionLanguageConfig,
                  where: str) -> None:
    """One vision-tower / projector tensor (HF layout) into `params` in `dtype` (layers into their stack)."""
    if spec.kind == "patch":  # conv [Dv, C, p, p] -> [C*p*p, Dv], rows in (channel, row, column) order
        array = array.reshape(array.shape[0], -1).T
    elif spec.kind == "kernel":
        array = array.T
    value = jnp.asarray(array, dtype=dtype)
    if spec.layer is None:
        set_path(params, spec.path, value)
    else:
        set_path(params, spec.path, _into_stack(params, spec, value, cfg.vision.num_hidden_layers, where))


def load_vision_language_params(model_dir: str | os.PathLike, cfg: VisionLanguageConfig, dtype=jnp.float32) -> Params:
    """Every tensor of the Gemma 3 vision-language checkpoint in `model_dir` as a nested dict by module path,
    in `dtype`. Raises MissingTensorError (naming the canonical names absent), UnexpectedTensorError and
    ShapeMismatchError (naming the tensor and file)."""
    specs = vision_language_specs(cfg)
    text_names = {n for n, s in specs.items() if s.path[0] in ("model", "lm_head")}
    params: Params = {}
    seen: dict[str, str] = {}
    unexpected: list[str] = []
    handles = {path: SafetensorsFile(path) for path in checkpoint_files(model_dir)}
    try:
        for path, f in handles.items():
            for name in f.keys():
                canon = vl_canonical_name(name)
                if canon.startswith(VL_IGNORED_PREFIXES):
                    continue
                spec = specs.get(canon)
                if spec is None:
                    if canon == "lm_head.weight" and cfg.text.tie_word_embeddings:
                        continue  # a tied copy of the embedding
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
                array = np.asarray(f.get(name))
                if canon in text_names:
                    place(params, spec, array, dtype, default_placer, cfg.text, where)
                else:
                    _place_vision(params, spec, array, dtype, cfg, where)
    finally:
        for f in handles.values():
            f.close()
    if unexpected:
        shown = ", ".join(unexpected[:8]) + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else "")
        raise UnexpectedTensorError(f"{model_dir}: checkpoint has tensors a Gemma 3 vision-language model with this "
                                    f"config.json does not use: {shown}")
    missing = [n for n in specs if n not in seen]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise MissingTensorError(f"{model_dir}: checkpoint is missing {len(missing)} tensor(s) (canonical names; "
                                 f"also read as model.language_model.*, vision_tower.vision_model.*): {shown}")
    return params


def load_vision_language_model(model_dir: str | os.PathLike, cfg: VisionLanguageConfig | None = None,
                               dtype=jnp.float32, *, model_class=Gemma3ForConditionalGeneration):
    """A `model_class` (Gemma3ForConditionalGeneration or a subclass) computing in `dtype`, holding the checkpoint
    in `model_dir` (config from its config.json unless `cfg` is given)."""
    cfg = cfg or VisionLanguageConfig.from_pretrained(model_dir)
    values = load_vision_language_params(model_dir, cfg, dtype)
    return model_from_params(values, cfg, dtype, model_class, model_dir)
