"""The one loader of vision-language checkpoints (Gemma 3: Gemma3ForConditionalGeneration, model_type "gemma3";
Qwen2.5-VL: Qwen2_5_VLForConditionalGeneration, "qwen2_5_vl"), driven by the checkpoint's Family
(unsloth_jax.families), and of a saved vision-language PEFT adapter onto such a model.

    model = load_vision_language_model(model_dir, dtype=jnp.float32)   # the family's module class
    model = load_vision_language_model(model_dir, placer=quant.nf4_placer)  # the language model's Linears in NF4
    load_vision_adapter(model, "lora_model")                          # + a saved PEFT adapter's LoRA pairs

Tensor names are read in every spelling of the family's `renames` (transformers 5's save_pretrained, the Hub's
transformers 4 checkpoints, transformers 5's module names), through hf.vision_checkpoint's tensor loop: the text
decoder's tensors go through the text loader's `place` (stacked layers, transposed kernels; NF4 with
quant.nf4_placer); the tower's layers are stacked the same way, dense. Tensors under the family's
`ignored_prefixes` (Gemma 3's unused SigLIP pooling head) are skipped. Adapter keys are read by the family's
AdapterLayout.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from unsloth_jax.config import read_config_json
from unsloth_jax.errors import (CheckpointNotFoundError, ConfigError, MissingTensorError, ShapeMismatchError,
                                UnexpectedTensorError, UnsupportedArchitectureError)
from unsloth_jax.families import (MULTIMODAL_TEXT_LAYOUTS, VISION_FAMILIES, AdapterLayout, VisionFamily, family_of,
                                  vision_family_for)
from unsloth_jax.hf import peft_io
from unsloth_jax.hf.loading import Params, model_from_params
from unsloth_jax.hf.safetensors_io import SafetensorsFile
from unsloth_jax.hf.vision_checkpoint import (first_names, layer_holds, tower_row, read_vl_checkpoint,
                                             vision_language_specs, vl_tensor_placer)
from unsloth_jax.lora import LoraSettings, add_lora, stack_of


def checkpoint_family(model_dir: str | os.PathLike) -> tuple[VisionFamily, object]:
    """(Family, its parsed config) of the vision-language checkpoint in `model_dir`; UnsupportedArchitectureError
    naming the config.json when no vision-language family reads it."""
    raw, path = read_config_json(model_dir)
    family = vision_family_for(raw)
    if family is None and raw.get("model_type") in MULTIMODAL_TEXT_LAYOUTS:
        raise UnsupportedArchitectureError(
            f"{path}: model_type {raw['model_type']!r} ({MULTIMODAL_TEXT_LAYOUTS[raw['model_type']].architecture}): "
            "its image and audio inputs are not supported; FastLanguageModel.from_pretrained loads its text decoder "
            "for text fine-tuning")
    if family is None:
        raise UnsupportedArchitectureError(f"{path}: model_type {raw.get('model_type')!r} is not a supported "
                                           f"vision-language model ({', '.join(VISION_FAMILIES)}; Gemma 3 with a "
                                           "vision_config)")
    return family, family.parse_config(raw, str(path))


def load_vision_language_params(model_dir: str | os.PathLike, cfg, dtype=jnp.float32, *, placer=None) -> Params:
    """Every tensor of the vision-language checkpoint in `model_dir` (config `cfg`, which names the family) as a
    nested dict by module path, in `dtype`. placer: the text loader's Placer for the language model's tensors
    (quant.nf4_placer: its Linears in NF4); the tower and projector are always placed dense. Raises
    MissingTensorError (naming the canonical names absent), UnexpectedTensorError and ShapeMismatchError (naming
    the tensor and file)."""
    family = family_of(cfg)
    params: Params = {}
    read_vl_checkpoint(model_dir, vision_language_specs(family, cfg), family,
                       vl_tensor_placer(params, cfg, dtype, placer), tied_lm_head=cfg.text.tie_word_embeddings)
    return params


def load_vision_language_model(model_dir: str | os.PathLike, cfg=None, dtype=jnp.float32, *, model_class=None,
                               placer=None):
    """A `model_class` (default: the family's module class, or a subclass of it) computing in `dtype`, holding
    the checkpoint in `model_dir` (config from its config.json unless `cfg` is given); placer as
    load_vision_language_params."""
    if cfg is None:
        family, cfg = checkpoint_family(model_dir)
    else:
        family = family_of(cfg)
    values = load_vision_language_params(model_dir, cfg, dtype, placer=placer)
    return model_from_params(values, cfg, dtype, model_class or family.module_class, model_dir)


# ------------------------------------------------------------------------------- PEFT adapters (LoRA)
def _matches(target_modules, name: str) -> bool:
    """PEFT's target_modules test of one module name: a str is a regex matched in full, a list names module
    suffixes (equal, or ending in '.' + entry)."""
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, name) is not None
    return any(name == t or name.endswith("." + t) for t in target_modules)


def _tower_projections(model) -> dict[str, tuple[dict, int]]:
    """tower -> (its stacked Linears by HF projection name, its layer count)."""
    return {"language": (model.projections(), model.config.num_hidden_layers),
            "vision": (model.vision_projections(), model.vl_config.vision.num_hidden_layers)}


def resolve_vision_targets(target_modules, model, source: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """adapter_config.json's target_modules (PEFT's regex str or list of names) -> (language targets, vision
    targets): the projections of each tower whose module names it matches, in any spelling of the model's
    AdapterLayout. A projection matched in some layers only raises ConfigError (layer subsets are not supported),
    as does a target_modules that matches nothing."""
    if not (isinstance(target_modules, str) or (isinstance(target_modules, list)
                                                and all(isinstance(t, str) for t in target_modules))):
        raise ConfigError(f"{source}: target_modules must be a regex string or a list of module names, got "
                          f"{target_modules!r}")
    family = family_of(model)
    layout = family.adapter
    out = {}
    for tower, (projs, layers) in _tower_projections(model).items():
        chosen = []
        for proj in projs:
            module = layout.module(tower, proj)
            held = [i for i in range(layers) if layer_holds(model.config, tower, module, proj, i)]
            hits = [any(_matches(target_modules, f"{path}.{i}.{module}.{proj}") for path in layout.paths(tower))
                    for i in held]
            if hits and all(hits):
                chosen.append(proj)
            elif any(hits):
                raise ConfigError(f"{source}: target_modules {target_modules!r} adapts {proj} of the {tower} "
                                  f"layers {[i for i, h in zip(held, hits) if h]} only; a subset of layers is not "
                                  "supported")
        out[tower] = tuple(chosen)
    if not out["language"] and not out["vision"]:
        names = {tower: ", ".join(projs) for tower, (projs, _) in _tower_projections(model).items()}
        raise ConfigError(f"{source}: target_modules {target_modules!r} matches no projection of this "
                          f"{family.name} model (language {names['language']}; vision {names['vision']})")
    return out["language"], out["vision"]


def _adapter_rank_alpha(raw: dict, cfg_path: Path, family: str) -> tuple[int, float]:
    """(r, lora_alpha) from adapter_config.json's `raw`; ConfigError for a bad rank or what is not supported."""
    try:
        r = int(raw["r"])
        alpha = float(raw.get("lora_alpha", 8))
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"{cfg_path}: 'r' (int) and 'lora_alpha' (number) are required") from None
    if r <= 0:
        raise ConfigError(f"{cfg_path}: r must be positive, got {r}")
    if (raw.get("bias") or "none") != "none" or raw.get("modules_to_save"):
        raise ConfigError(f"{cfg_path}: vision-language adapters with trained biases (bias={raw.get('bias')!r}) or "
                          f"modules_to_save ({raw.get('modules_to_save')!r}) are not supported")
    if raw.get("target_parameters"):
        raise ConfigError(f"{cfg_path}: target_parameters is not supported for {family} vision-language models")
    return r, int(alpha) if alpha == int(alpha) else alpha


def _read_lora_factors(weights: Path, layout: AdapterLayout, lins: dict, layers: dict[str, int], r: int,
                       text_cfg) -> dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]:
    """(tower, projection) -> (lora_a [n, in, r], lora_b [n, r, out]) float32 for every Linear of `lins` (keyed the
    same way; n its stacked rows), from the adapter file `weights` (lora_A [r, in] / lora_B [out, r] per layer, in
    the layer's row: vision_checkpoint.tower_row; a layer's projection that vision_checkpoint.layer_holds of the
    text config `text_cfg` says it lacks (Gemma 4's KV-shared layers) has no pair and keeps zeros). Raises
    UnexpectedTensorError (keys that fit no target), ShapeMismatchError,
    MissingTensorError, naming key and file."""
    def held(tower: str, proj: str, i: int) -> bool:
        return layer_holds(text_cfg, tower, layout.module(tower, proj), proj, i)

    factors = {k: (np.zeros((*stack_of(lin), lin.in_features, r), np.float32),
                   np.zeros((*stack_of(lin), r, lin.out_features), np.float32)) for k, lin in lins.items()}
    seen, unexpected = set(), []
    with SafetensorsFile(weights) as f:
        for key in f.keys():
            m = layout.key_regex.match(key)
            tower = m and ("language" if m["path"] in layout.language_paths else "vision")
            if (m is None or (tower, m["proj"]) not in lins or m["module"] != layout.module(tower, m["proj"])
                    or int(m["i"]) >= layers[tower] or not held(tower, m["proj"], int(m["i"]))):
                unexpected.append(key)
                continue
            lin, i, which = lins[(tower, m["proj"])], int(m["i"]), m["which"]
            want = (r, lin.in_features) if which == "A" else (lin.out_features, r)
            if tuple(f.shape(key)) != want:
                raise ShapeMismatchError(f"{weights}: tensor '{key}' has shape {list(f.shape(key))}, expected "
                                         f"{list(want)} (r={r} from {peft_io.CONFIG_NAME})")
            row = tower_row(text_cfg, tower, m["module"], i)
            factors[(tower, m["proj"])][0 if which == "A" else 1][row] = np.asarray(f.get(key), np.float32).T
            seen.add((tower, m["proj"], i, which))
    if unexpected:
        targets = {t: [p for (tt, p) in lins if tt == t] for t in ("language", "vision")}
        raise UnexpectedTensorError(f"{weights}: tensors that do not fit adapter_config.json's targets (language "
                                    f"{targets['language']}, vision {targets['vision']}) or this model: "
                                    f"{first_names(unexpected, 6)}")
    missing = [f"base_model.model.{layout.paths(t)[0]}.{i}.{layout.module(t, p)}.{p}.lora_{w}.weight"
               for (t, p) in lins for i in range(layers[t]) for w in "AB" if (t, p, i, w) not in seen
               and held(t, p, i)]
    if missing:
        raise MissingTensorError(f"{weights}: adapter is missing {len(missing)} LoRA tensor(s): "
                                 f"{first_names(missing, 6)}")
    return factors


def load_vision_adapter(model, adapter_dir):
    """Add the LoRA pairs of the PEFT adapter in `adapter_dir` to `model`, a Gemma3ForConditionalGeneration or
    Qwen2_5_VLForConditionalGeneration without LoRA (as hf.vision_export writes it, or PEFT on transformers'
    model of that name, in any transformers spelling of the family's AdapterLayout), and set `model.lora`
    from adapter_config.json (r, lora_alpha, use_rslora, target_modules for each tower). lora_A [r, in] / lora_B
    [out, r] become float32 lora_a [R, in, r] / lora_b [R, r, out] (R: the stack's rows). Raises ConfigError
    (unsupported settings: trained biases, modules_to_save, PEFT features peft_io rejects), UnexpectedTensorError /
    MissingTensorError / ShapeMismatchError naming the key and file. Returns the model."""
    adapter_dir = Path(adapter_dir)
    cfg_path = adapter_dir / peft_io.CONFIG_NAME
    raw = peft_io.read_adapter_config(adapter_dir)
    peft_io._check_supported(raw, cfg_path)
    if model.lora is not None:
        raise ConfigError(f"load_vision_adapter({adapter_dir}): the model already has a LoRA adapter")
    family = family_of(model)
    r, alpha = _adapter_rank_alpha(raw, cfg_path, family.name)
    language, vision = resolve_vision_targets(raw.get("target_modules"), model, str(cfg_path))
    weights = adapter_dir / peft_io.WEIGHTS_NAME
    if not weights.is_file():
        raise CheckpointNotFoundError(f"{adapter_dir}: no {peft_io.WEIGHTS_NAME}")

    towers = _tower_projections(model)
    lins = {(tower, p): towers[tower][0][p] for tower, names in (("language", language), ("vision", vision))
            for p in names}
    factors = _read_lora_factors(weights, family.adapter, lins, {t: n for t, (_, n) in towers.items()}, r,
                                 model.config)
    settings = LoraSettings(r=r, lora_alpha=alpha, target_modules=language,
                            lora_dropout=float(raw.get("lora_dropout", 0.0) or 0.0),
                            use_rslora=bool(raw.get("use_rslora", False)), vision_target_modules=vision or None)
    add_lora(model, settings, jax.random.PRNGKey(0))
    for k, lin in lins.items():
        lin.lora_a[...] = jnp.asarray(factors[k][0])
        lin.lora_b[...] = jnp.asarray(factors[k][1])
    return model
