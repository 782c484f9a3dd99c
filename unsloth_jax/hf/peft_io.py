"""Import PEFT LoRA adapters (adapter_config.json + adapter_model.safetensors) into a loaded `Model`.

    model = peft_io.load_adapter(model, "my-adapter")      # adds nnx.LoRAParam lora_a / lora_b, sets model.lora

PEFT stores, per targeted projection of layer N,

    base_model.model.model.layers.N.<self_attn|mlp>.<proj>.lora_A.weight  [r, in]   = lora_a[N].T
    base_model.model.model.layers.N.<self_attn|mlp>.<proj>.lora_B.weight  [out, r]  = lora_b[N].T

plus, when configured, `modules_to_save` copies (`base_model.model.lm_head.weight`,
`base_model.model.model.embed_tokens.weight`, `base_model.model.model.norm.weight`) and trained biases
(`...<proj>.base_layer.bias` for targeted projections, `...<proj>.bias` otherwise). LoRA factors are kept in
float32 whatever the file's dtype. Features this package cannot reproduce (DoRA, per-layer rank/alpha patterns,
layer subsets, ...) raise `ConfigError` naming the field; tensors it does not understand raise
`UnexpectedTensorError` naming the key and file. MoE families: LoRA on the experts (`target_parameters`) in
PEFT's ParamWrapper form, read by `unsloth_jax.hf.moe_io.read_expert_adapter`.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from unsloth_jax.errors import (CheckpointNotFoundError, ConfigError, MissingTensorError, ShapeMismatchError,
                                UnexpectedTensorError)
from unsloth_jax.hf.mapping import ATTN_PROJS, MLP_PROJS, PROJ_MODULE
from unsloth_jax.hf.safetensors_io import SafetensorsFile
from unsloth_jax.lora import LoraSettings, add_lora
from unsloth_jax.models.state import variable_at

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
ALL_TARGETS = ATTN_PROJS + MLP_PROJS

# modules_to_save entries this package can train, with the PEFT key each is saved under and the module path
# of the weight in this package's model.
SAVED_MODULE_KEYS = {
    "lm_head": "base_model.model.lm_head.weight",
    "embed_tokens": "base_model.model.model.embed_tokens.weight",
    "norm": "base_model.model.model.norm.weight",
}
SAVED_MODULE_PATHS = {"lm_head": ("lm_head", "weight"), "embed_tokens": ("model", "embed_tokens", "weight"),
                      "norm": ("model", "norm", "weight")}

_LAYER_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+?)\."
    r"(lora_A(?:\.[\w-]+)?\.weight|lora_B(?:\.[\w-]+)?\.weight|base_layer\.bias|bias)$")

# PEFT LoraConfig fields whose non-default value changes the math or the trained set in a way unsloth_jax
# does not reproduce: field -> (predicate "value is unsupported", what to tell the user).
_UNSUPPORTED = {
    "use_dora": (bool, "DoRA (use_dora=true)"),
    "fan_in_fan_out": (bool, "fan_in_fan_out=true (Conv1D-style weights)"),
    "rank_pattern": (bool, "per-module ranks (rank_pattern)"),
    "alpha_pattern": (bool, "per-module alphas (alpha_pattern)"),
    "layers_to_transform": (lambda v: v is not None, "a subset of layers (layers_to_transform)"),
    "layers_pattern": (lambda v: v is not None and v != [], "layers_pattern"),
    "layer_replication": (lambda v: v is not None, "layer_replication"),
    "lora_bias": (bool, "a trainable bias on lora_B (lora_bias=true)"),
    "use_qalora": (bool, "QA-LoRA (use_qalora=true)"),
    "trainable_token_indices": (bool, "trainable_token_indices"),
    "exclude_modules": (bool, "exclude_modules"),
    "megatron_config": (lambda v: v is not None, "megatron_config"),
    "alora_invocation_tokens": (bool, "activated LoRA (alora_invocation_tokens)"),
    "use_bdlora": (bool, "use_bdlora"),
    "arrow_config": (lambda v: v is not None, "arrow_config"),
    "kasa_config": (lambda v: v is not None, "kasa_config"),
    "velora_config": (lambda v: v is not None, "velora_config"),
    "monteclora_config": (lambda v: v is not None, "monteclora_config"),
}


def is_adapter_dir(path) -> bool:
    """True when `path` is a directory holding a PEFT adapter_config.json."""
    return (Path(path) / CONFIG_NAME).is_file()


def read_adapter_config(adapter_dir) -> dict:
    path = Path(adapter_dir) / CONFIG_NAME
    if not path.is_file():
        raise CheckpointNotFoundError(f"{adapter_dir}: no {CONFIG_NAME} (is this a PEFT adapter directory?)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return raw


def base_model_path(adapter_dir) -> str:
    """The base model directory named by `base_model_name_or_path` in adapter_config.json. A relative path is
    looked up against the adapter directory first, then the current directory."""
    adapter_dir = Path(adapter_dir)
    raw = read_adapter_config(adapter_dir)
    name = raw.get("base_model_name_or_path")
    cfg_path = adapter_dir / CONFIG_NAME
    if not name:
        raise ConfigError(
            f"{cfg_path}: 'base_model_name_or_path' is missing or empty, so the base model is unknown; set it to "
            "the base model's local directory, or load the base with FastLanguageModel.from_pretrained(base_dir) "
            "and call unsloth_jax.hf.peft_io.load_adapter(model, adapter_dir)")
    p = Path(os.path.expanduser(str(name)))
    candidates = [p] if p.is_absolute() else [adapter_dir / p, Path.cwd() / p]
    for c in candidates:
        if c.is_dir():
            return str(c)
    looked = ", ".join(str(c) for c in candidates)
    raise CheckpointNotFoundError(
        f"{cfg_path}: base model '{name}' not found (looked in: {looked}). unsloth_jax loads local Hugging Face "
        "directories: download the base model first (e.g. `huggingface-cli download "
        f"{name} --local-dir <dir>`) and point base_model_name_or_path at it")


def _check_supported(raw: dict, path: Path) -> None:
    if raw.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"{path}: peft_type {raw.get('peft_type')!r} is not supported; only LORA adapters load")
    bad = []
    for field, (is_bad, what) in _UNSUPPORTED.items():
        if field in raw and is_bad(raw[field]):
            bad.append(f"{what} [{field}={json.dumps(raw[field])}]")
    if bad:
        raise ConfigError(f"{path}: adapter uses PEFT feature(s) unsloth_jax does not support: {'; '.join(bad)}")
    task = raw.get("task_type")
    if task not in (None, "CAUSAL_LM"):
        raise ConfigError(f"{path}: task_type {task!r} is not supported (only CAUSAL_LM decoders)")


def _module_names(num_layers: int) -> list[str]:
    """Every LoRA-able module name of the HF model, as PEFT matches them."""
    return [f"model.layers.{i}.{PROJ_MODULE[p]}.{p}" for i in range(num_layers) for p in ALL_TARGETS]


def resolve_targets(target_modules, num_layers: int, source: str = CONFIG_NAME, present=None) -> tuple[str, ...]:
    """PEFT's target_modules -> projection short names. Accepts a list of names (matched as PEFT does: equal to,
    or a '.'-separated suffix of, the module name), a regex string (full match), or "all-linear". `present`:
    the projections the model has (a MoE model may lack the dense MLP ones); default all."""
    if target_modules is None:
        raise ConfigError(f"{source}: target_modules is missing")
    names = _module_names(num_layers)
    if present is not None:
        names = [n for n in names if n.rsplit(".", 1)[1] in present]
    if isinstance(target_modules, str):
        if target_modules == "all-linear":
            return ALL_TARGETS
        try:
            pattern = re.compile(target_modules)
        except re.error as e:
            raise ConfigError(f"{source}: target_modules regex {target_modules!r} is invalid ({e})") from None
        hit = [n for n in names if pattern.fullmatch(n)]
    else:
        targets = [str(t) for t in target_modules]
        unknown = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
        if unknown:
            raise ConfigError(f"{source}: target_modules {unknown} name modules unsloth_jax cannot adapt with LoRA "
                              f"(supported: {', '.join(ALL_TARGETS)})")
        hit = [n for n in names if any(n == t or n.endswith("." + t) for t in targets)]
    if not hit:
        raise ConfigError(f"{source}: target_modules {target_modules!r} match no projection of this model")
    projs = {n.rsplit(".", 1)[1] for n in hit}
    for p in projs:
        layers = {int(n.split(".")[2]) for n in hit if n.endswith("." + p)}
        if len(layers) != num_layers:
            missing = sorted(set(range(num_layers)) - layers)
            raise ConfigError(f"{source}: target_modules {target_modules!r} adapt {p} in only some layers "
                              f"(not in {missing}); unsloth_jax applies LoRA to every layer of a projection")
    return tuple(p for p in ALL_TARGETS if p in projs)


def load_adapter(model, adapter_dir):
    """Add the LoRA factors (and any modules_to_save / trained biases) of the PEFT adapter in `adapter_dir` to
    `model` and set `model.lora` from its adapter_config.json. Returns the model."""
    adapter_dir = Path(adapter_dir)
    cfg_path = adapter_dir / CONFIG_NAME
    raw = read_adapter_config(adapter_dir)
    _check_supported(raw, cfg_path)
    cfg = model.config
    n_layers = cfg.num_hidden_layers
    try:
        r = int(raw["r"])
        alpha = float(raw.get("lora_alpha", 8))
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"{cfg_path}: 'r' (int) and 'lora_alpha' (number) are required") from None
    if r <= 0:
        raise ConfigError(f"{cfg_path}: r must be positive, got {r}")
    if alpha == int(alpha):
        alpha = int(alpha)
    from unsloth_jax.hf import moe_io

    expert_targets = moe_io.resolve_target_parameters(raw.get("target_parameters"), str(cfg_path))
    if expert_targets and not cfg.is_moe:
        raise ConfigError(f"{cfg_path}: adapter uses PEFT feature(s) unsloth_jax does not support: LoRA on raw "
                          f"parameters (target_parameters) of a {cfg.model_type} model")
    targets = (resolve_targets(raw.get("target_modules"), n_layers, str(cfg_path), present=model.projections())
               if raw.get("target_modules") or not expert_targets else ())
    bias = raw.get("bias", "none") or "none"
    if bias not in ("none", "all", "lora_only"):
        raise ConfigError(f"{cfg_path}: bias {bias!r} is not supported (none, all, lora_only)")
    saved = raw.get("modules_to_save") or None
    if saved is not None:
        saved = [saved] if isinstance(saved, str) else list(saved)
        unknown = [m for m in saved if m not in SAVED_MODULE_KEYS]
        if unknown:
            raise ConfigError(f"{cfg_path}: modules_to_save {unknown} are not supported "
                              f"(supported: {', '.join(SAVED_MODULE_KEYS)})")
        saved = tuple(saved)

    weights = adapter_dir / WEIGHTS_NAME
    if not weights.is_file():
        alt = [p.name for p in adapter_dir.glob("adapter_model.*")]
        hint = f" (found {', '.join(alt)}; convert .bin adapters with PEFT's save_pretrained)" if alt else ""
        raise CheckpointNotFoundError(f"{adapter_dir}: no {WEIGHTS_NAME}{hint}")

    projs = model.projections()
    for p in targets:
        if p not in projs:
            raise ConfigError(f"{cfg_path}: target {p} does not exist in this {cfg.model_type} model")
    dims = {p: (projs[p].in_features, projs[p].out_features) for p in targets}
    lora_a = {p: np.zeros((n_layers, dims[p][0], r), np.float32) for p in targets}
    lora_b = {p: np.zeros((n_layers, r, dims[p][1]), np.float32) for p in targets}
    seen: set[tuple[str, int, str]] = set()
    biases: dict[tuple[str, int], np.ndarray] = {}
    top: dict[str, np.ndarray] = {}
    unexpected: list[str] = []
    key_of_saved = {v: k for k, v in SAVED_MODULE_KEYS.items()}
    with SafetensorsFile(weights) as f:
        expert_factors = moe_io.read_expert_adapter(model, f, expert_targets, r, weights) if expert_targets else {}
        for key in f.keys():
            if expert_targets and moe_io.is_expert_key(key):
                continue  # read above
            m = _LAYER_KEY.match(key)
            if m is None:
                mod = key_of_saved.get(key)
                if mod is not None and saved and mod in saved:
                    top[mod] = np.array(f.get(key))
                else:
                    unexpected.append(key)
                continue
            i, module, proj, kind = int(m.group(1)), m.group(2), m.group(3), m.group(4)
            if proj not in PROJ_MODULE or PROJ_MODULE[proj] != module or i >= n_layers:
                unexpected.append(key)
                continue
            arr = f.get(key)
            if kind.endswith("bias"):
                if bias == "none" or projs[proj].bias is None:
                    unexpected.append(key)
                    continue
                biases[(proj, i)] = np.array(arr)
                continue
            if proj not in targets:
                unexpected.append(key)
                continue
            which = kind[5]
            d_in, d_out = dims[proj]
            want = (r, d_in) if which == "A" else (d_out, r)
            if tuple(arr.shape) != want:
                raise ShapeMismatchError(
                    f"{weights}: tensor '{key}' has shape {list(arr.shape)}, expected {list(want)} "
                    f"(r={r} from {CONFIG_NAME}, and this model's {proj} is [{d_out}, {d_in}])")
            target = lora_a if which == "A" else lora_b
            target[proj][i] = np.asarray(arr, np.float32).T
            seen.add((proj, i, which))
    if unexpected:
        shown = ", ".join(unexpected[:6]) + (f" and {len(unexpected) - 6} more" if len(unexpected) > 6 else "")
        raise UnexpectedTensorError(f"{weights}: tensors that do not fit adapter_config.json (targets "
                                    f"{list(targets)}, bias={bias!r}, modules_to_save={list(saved or [])}) or this "
                                    f"{cfg.model_type} model: {shown}")
    missing = [f"layers.{i}.{PROJ_MODULE[p]}.{p}.lora_{w}" for p in targets for i in range(n_layers) for w in "AB"
               if (p, i, w) not in seen]
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise MissingTensorError(f"{weights}: adapter is missing {len(missing)} LoRA tensor(s): {shown}")

    new_biases = {}
    for proj in {p for p, _ in biases}:
        current = projs[proj].bias[...]
        b = np.array(current, dtype=np.float32)
        for (p, i), value in biases.items():
            if p != proj:
                continue
            if value.shape != b.shape[1:]:
                raise ShapeMismatchError(f"{weights}: bias of layer {i} {proj} has shape {list(value.shape)}, "
                                         f"expected {list(b.shape[1:])}")
            b[i] = value
        new_biases[proj] = jnp.asarray(b, current.dtype)
    saved_values = {}
    for mod, value in top.items():
        if mod == "lm_head" and model.lm_head is None:
            raise ConfigError(f"{cfg_path}: modules_to_save holds {mod} but this model has no separate {mod} "
                              "(tied embeddings); untying the head is not supported")
        ref = variable_at(model, SAVED_MODULE_PATHS[mod])
        if tuple(value.shape) != tuple(ref[...].shape):
            raise ShapeMismatchError(f"{weights}: '{SAVED_MODULE_KEYS[mod]}' has shape {list(value.shape)}, "
                                     f"expected {list(ref[...].shape)}")
        saved_values[mod] = jnp.asarray(value, ref[...].dtype)
    # Everything is checked: now change the model.
    settings = LoraSettings(r=r, lora_alpha=alpha, target_modules=targets,
                            lora_dropout=float(raw.get("lora_dropout", 0.0) or 0.0), bias=bias,
                            use_rslora=bool(raw.get("use_rslora", False)), modules_to_save=saved,
                            target_parameters=expert_targets or None)
    add_lora(model, settings, jax.random.PRNGKey(0))
    for p in targets:
        projs[p].lora_a[...] = jnp.asarray(lora_a[p])
        projs[p].lora_b[...] = jnp.asarray(lora_b[p])
    experts = model.expert_projections()
    for name, (a, b) in expert_factors.items():
        experts[name].lora_a[...] = jnp.asarray(a)
        experts[name].lora_b[...] = jnp.asarray(b)
    for proj, value in new_biases.items():
        projs[proj].bias[...] = value
    for mod, value in saved_values.items():
        variable_at(model, SAVED_MODULE_PATHS[mod])[...] = value
    return model
