"""Load a Gemma 3 vision-language checkpoint (Gemma3ForConditionalGeneration, config.json model_type "gemma3").

    model = load_vision_language_model(model_dir, dtype=jnp.float32)   # a models.vision.Gemma3ForConditionalGeneration
    load_vision_adapter(model, "lora_model")                          # + a saved PEFT adapter's LoRA pairs

Tensor names are read in any of the spellings of `mapping.VL_RENAMES` (transformers 5's save_pretrained, the Hub's
transformers 4 checkpoints, transformers 5's module names). The text decoder's tensors go through the text
loader's `place` (stacked layers, transposed kernels); the vision layers are stacked the same way. SigLIP's
pooling head (`vision_tower.head.*`), which Gemma 3 never runs, is skipped.
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from unsloth_jax.config import VisionLanguageConfig
from unsloth_jax.errors import (CheckpointNotFoundError, ConfigError, MissingTensorError, ShapeMismatchError,
                                UnexpectedTensorError)
from unsloth_jax.hf.loading import Params, _into_stack, default_placer, model_from_params, place, set_path
from unsloth_jax.hf.mapping import (PROJ_MODULE, VL_IGNORED_PREFIXES, TensorSpec, vision_language_specs,
                                    vl_canonical_name)
from unsloth_jax.lora import LoraSettings, add_lora
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


def load_vision_language_params(model_dir: str | os.PathLike, cfg: VisionLanguageConfig, dtype=jnp.float32, *,
                                placer=None) -> Params:
    """Every tensor of the Gemma 3 vision-language checkpoint in `model_dir` as a nested dict by module path,
    in `dtype`. placer: the text loader's Placer for the language model's tensors (quant.nf4_placer: its Linears
    in NF4); the vision tower and projector are always placed dense. Raises MissingTensorError (naming the
    canonical names absent), UnexpectedTensorError and ShapeMismatchError (naming the tensor and file)."""
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
                    place(params, spec, array, dtype, placer or default_placer, cfg.text, where)
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
                               dtype=jnp.float32, *, model_class=Gemma3ForConditionalGeneration, placer=None):
    """A `model_class` (Gemma3ForConditionalGeneration or a subclass) computing in `dtype`, holding the checkpoint
    in `model_dir` (config from its config.json unless `cfg` is given); placer as load_vision_language_params."""
    cfg = cfg or VisionLanguageConfig.from_pretrained(model_dir)
    values = load_vision_language_params(model_dir, cfg, dtype, placer=placer)
    return model_from_params(values, cfg, dtype, model_class, model_dir)


# ------------------------------------------------------------------------------- PEFT adapters (LoRA)
# One key of a vision-language adapter: transformers 5's module names (hf.vision_export writes these) or
# transformers 4's (language_model.model.layers, vision_tower.vision_model.encoder.layers).
_VL_ADAPTER_KEY = re.compile(
    r"^base_model\.model\.(?:model\.)?(?P<tower>language_model(?:\.model)?|vision_tower(?:\.vision_model)?\.encoder)"
    r"\.layers\.(?P<i>\d+)\.(?P<module>self_attn|mlp)\.(?P<proj>\w+?)\.lora_(?P<which>[AB])(?:\.[\w-]+)?\.weight$")
_TOWER_SPELLINGS = {"language": ("model.language_model.layers", "language_model.model.layers"),
                    "vision": ("model.vision_tower.encoder.layers", "vision_tower.vision_model.encoder.layers")}


def _vl_module(tower: str, proj: str) -> str:
    """The HF parent module (self_attn or mlp) of a projection of `tower`."""
    if tower == "language":
        return PROJ_MODULE[proj]
    return "self_attn" if proj.endswith("proj") else "mlp"


def _matches(target_modules, name: str) -> bool:
    """PEFT's target_modules test of one module name: a str is a regex matched in full, a list names module
    suffixes (equal, or ending in '.' + entry)."""
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, name) is not None
    return any(name == t or name.endswith("." + t) for t in target_modules)


def resolve_vision_targets(target_modules, model, source: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """adapter_config.json's target_modules (PEFT's regex str or list of names) -> (language targets, vision
    targets): the projections of each tower whose module names it matches, in either transformers spelling.
    A projection matched in some layers only raises ConfigError (layer subsets are not supported), as does a
    target_modules that matches nothing."""
    if not (isinstance(target_modules, str) or (isinstance(target_modules, list)
                                                and all(isinstance(t, str) for t in target_modules))):
        raise ConfigError(f"{source}: target_modules must be a regex string or a list of module names, got "
                          f"{target_modules!r}")
    towers = {"language": (tuple(model.projections()), model.config.num_hidden_layers),
              "vision": (tuple(model.vision_projections()), model.vl_config.vision.num_hidden_layers)}
    out = {}
    for tower, (projs, layers) in towers.items():
        chosen = []
        for proj in projs:
            hits = [any(_matches(target_modules, f"{prefix}.{i}.{_vl_module(tower, proj)}.{proj}")
                        for prefix in _TOWER_SPELLINGS[tower]) for i in range(layers)]
            if all(hits):
                chosen.append(proj)
            elif any(hits):
                raise ConfigError(f"{source}: target_modules {target_modules!r} adapts {proj} of the {tower} "
                                  f"layers {[i for i, h in enumerate(hits) if h]} only; a subset of layers is not "
                                  "supported")
        out[tower] = tuple(chosen)
    if not out["language"] and not out["vision"]:
        raise ConfigError(f"{source}: target_modules {target_modules!r} matches no projection of this Gemma 3 "
                          "vision-language model (language q/k/v/o_proj, gate/up/down_proj; vision q/k/v/out_proj, "
                          "fc1, fc2)")
    return out["language"], out["vision"]


def load_vision_adapter(model, adapter_dir):
    """Add the LoRA pairs of the PEFT adapter in `adapter_dir` (as hf.vision_export.save_vision_adapter writes it,
    or PEFT on transformers' Gemma3ForConditionalGeneration) to `model`, a Gemma3ForConditionalGeneration without
    LoRA, and set `model.lora` from adapter_config.json (r, lora_alpha, use_rslora, target_modules for each
    tower). lora_A [r, in] / lora_B [out, r] become lora_a [L, in, r] / lora_b [L, r, out] float32. Raises
    ConfigError (unsupported settings: trained biases, modules_to_save, PEFT features peft_io rejects),
    UnexpectedTensorError / MissingTensorError / ShapeMismatchError naming the key and file. Returns the model."""
    from unsloth_jax.hf import peft_io

    adapter_dir = Path(adapter_dir)
    cfg_path = adapter_dir / peft_io.CONFIG_NAME
    raw = peft_io.read_adapter_config(adapter_dir)
    peft_io._check_supported(raw, cfg_path)
    if model.lora is not None:
        raise ConfigError(f"load_vision_adapter({adapter_dir}): the model already has a LoRA adapter")
    try:
        r = int(raw["r"])
        alpha = float(raw.get("lora_alpha", 8))
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"{cfg_path}: 'r' (int) and 'lora_alpha' (number) are required") from None
    if r <= 0:
        raise ConfigError(f"{cfg_path}: r must be positive, got {r}")
    alpha = int(alpha) if alpha == int(alpha) else alpha
    if (raw.get("bias") or "none") != "none" or raw.get("modules_to_save"):
        raise ConfigError(f"{cfg_path}: vision-language adapters with trained biases (bias={raw.get('bias')!r}) or "
                          f"modules_to_save ({raw.get('modules_to_save')!r}) are not supported")
    if raw.get("target_parameters"):
        raise ConfigError(f"{cfg_path}: target_parameters is not supported for Gemma 3 vision-language models")
    language, vision = resolve_vision_targets(raw.get("target_modules"), model, str(cfg_path))
    weights = adapter_dir / peft_io.WEIGHTS_NAME
    if not weights.is_file():
        raise CheckpointNotFoundError(f"{adapter_dir}: no {peft_io.WEIGHTS_NAME}")

    lins = {("language", p): model.projections()[p] for p in language}
    lins.update({("vision", p): model.vision_projections()[p] for p in vision})
    layers = {"language": model.config.num_hidden_layers, "vision": model.vl_config.vision.num_hidden_layers}
    factors = {k: (np.zeros((layers[k[0]], lin.in_features, r), np.float32),
                   np.zeros((layers[k[0]], r, lin.out_features), np.float32)) for k, lin in lins.items()}
    seen, unexpected = set(), []
    with SafetensorsFile(weights) as f:
        for key in f.keys():
            m = _VL_ADAPTER_KEY.match(key)
            tower = None if m is None else ("language" if m["tower"].startswith("language") else "vision")
            if (m is None or (tower, m["proj"]) not in lins or m["module"] != _vl_module(tower, m["proj"])
                    or int(m["i"]) >= layers[tower]):
                unexpected.append(key)
                continue
            lin, i, which = lins[(tower, m["proj"])], int(m["i"]), m["which"]
            want = (r, lin.in_features) if which == "A" else (lin.out_features, r)
            if tuple(f.shape(key)) != want:
                raise ShapeMismatchError(f"{weights}: tensor '{key}' has shape {list(f.shape(key))}, expected "
                                         f"{list(want)} (r={r} from {peft_io.CONFIG_NAME})")
            factors[(tower, m["proj"])][0 if which == "A" else 1][i] = np.asarray(f.get(key), np.float32).T
            seen.add((tower, m["proj"], i, which))
    if unexpected:
        shown = ", ".join(unexpected[:6]) + (f" and {len(unexpected) - 6} more" if len(unexpected) > 6 else "")
        raise UnexpectedTensorError(f"{weights}: tensors that do not fit adapter_config.json's targets (language "
                                    f"{list(language)}, vision {list(vision)}) or this model: {shown}")
    missing = [f"{t} layers.{i}.{p}.lora_{w}" for (t, p) in lins for i in range(layers[t]) for w in "AB"
               if (t, p, i, w) not in seen]
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise MissingTensorError(f"{weights}: adapter is missing {len(missing)} LoRA tensor(s): {shown}")
    settings = LoraSettings(r=r, lora_alpha=alpha, target_modules=language,
                            lora_dropout=float(raw.get("lora_dropout", 0.0) or 0.0),
                            use_rslora=bool(raw.get("use_rslora", False)), vision_target_modules=vision or None)
    add_lora(model, settings, jax.random.PRNGKey(0))
    for k, lin in lins.items():
        lin.lora_a[...] = jnp.asarray(factors[k][0])
        lin.lora_b[...] = jnp.asarray(factors[k][1])
    return model
