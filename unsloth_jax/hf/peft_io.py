"""Import PEFT LoRA adapters (adapter_config.json + adapter_model.safetensors) into a loaded `Model`.

    model = peft_io.load_adapter(model, "my-adapter")      # adds nnx.LoRAParam lora_a / lora_b, sets model.lora

PEFT stores, per targeted projection of layer N,

    base_model.model.model.layers.N.<self_attn|mlp>.<proj>.lora_A.weight  [r, in]   = lora_a[N].T
    base_model.model.model.layers.N.<self_attn|mlp>.<proj>.lora_B.weight  [out, r]  = lora_b[N].T

plus, when configured, `modules_to_save` copies (`base_model.model.lm_head.weight`,
`base_model.model.model.embed_tokens.weight`, `base_model.model.model.norm.weight`: PEFT 0.21 drops the
`modules_to_save.default.` its live parameters carry; tables with more rows than the base, from add_new_tokens,
grow the model's vocabulary to match) and trained biases
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
from unsloth_jax.config import layer_has, layer_module, layer_slot, stack_holders
from unsloth_jax.families import source_layout
from unsloth_jax.hf.mapping import fused_groups, kv_shared_tensor
from unsloth_jax.models.decoder import ATTN_PROJS, MLP_PROJS, PROJ_PARENT as PROJ_MODULE
from unsloth_jax.hf.safetensors_io import SafetensorsFile
from unsloth_jax.lora import LoraSettings, add_lora
from unsloth_jax.models.state import variable_at

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
ALL_TARGETS = ATTN_PROJS + MLP_PROJS
LINEAR_TARGETS = tuple(p for p, parent in PROJ_MODULE.items() if parent == "linear_attn")  # Qwen3.5's

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
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp|linear_attn)\.(\w+?)\."
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
    if p.name == "base_model":  # hf.export.BASE_MODEL_DIR: the base saved inside the adapter (GGUF), moved with it
        candidates.append(adapter_dir / p.name)
    for c in candidates:
        if c.is_dir() or (c.is_file() and c.suffix.lower() == ".gguf"):
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


def _module_names(num_layers: int, cfg=None) -> list[str]:
    """Every LoRA-able module name of the HF model, as PEFT matches them (with `cfg`, a Qwen3.5 layer's own
    mixer only; without, the seven projections of every layer)."""
    if cfg is None:
        return [f"model.layers.{i}.{PROJ_MODULE[p]}.{p}" for i in range(num_layers) for p in ALL_TARGETS]
    layout = source_layout(cfg)  # a multimodal checkpoint's text decoder: PEFT sees its module names
    spell = layout.stored_name if layout is not None else str
    return [spell(f"model.layers.{i}.{PROJ_MODULE[p]}.{p}") for i in range(num_layers)
            for p in ALL_TARGETS + LINEAR_TARGETS if layer_has(cfg, i, f"{PROJ_MODULE[p]}.{p}.")]


def _layer_index(module: str) -> int:
    """The layer number of a _module_names entry (model.layers.{i}.*, model.language_model.layers.{i}.*)."""
    return int(re.search(r"(?:^|\.)layers\.(\d+)\.", module).group(1))


def resolve_targets(target_modules, num_layers: int, source: str = CONFIG_NAME, present=None,
                    cfg=None) -> tuple[str, ...]:
    """PEFT's target_modules -> projection short names. Accepts a list of names (matched as PEFT does: equal to,
    or a '.'-separated suffix of, the module name), a regex string (full match), or "all-linear". `present`:
    the projections the model has (a MoE model may lack the dense MLP ones); default all. `cfg`: the model's
    ModelConfig, whose layers may lack some modules (Qwen3.5: each layer has one of two token mixers)."""
    if target_modules is None:
        raise ConfigError(f"{source}: target_modules is missing")
    names = _module_names(num_layers, cfg)
    if present is not None:
        names = [n for n in names if n.rsplit(".", 1)[1] in present]
    if isinstance(target_modules, str):
        if target_modules == "all-linear":
            return ALL_TARGETS + tuple(p for p in LINEAR_TARGETS if present is not None and p in present)
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
        layers = {_layer_index(n) for n in hit if n.endswith("." + p)}
        having = {_layer_index(n) for n in names if n.endswith("." + p)}
        if layers != having:
            missing = sorted(having - layers)
            raise ConfigError(f"{source}: target_modules {target_modules!r} adapt {p} in only some layers "
                              f"(not in {missing}); unsloth_jax applies LoRA to every layer of a projection")
    return tuple(p for p in ALL_TARGETS + LINEAR_TARGETS if p in projs)


def _embedding_layer_key(key: str) -> tuple[str, str | None]:
    """(key without the wrapper part, the part) for the whole-module keys PEFT adds when the vocabulary was
    resized (save_embedding_layers): `X.modules_to_save.weight` (the trained copy again) and
    `X.original_module.weight` (the base table); other keys come back as (key, None)."""
    for part in ("modules_to_save", "original_module"):
        suffix = f".{part}.weight"
        if key.endswith(suffix):
            return key[:-len(suffix)] + ".weight", part
    return key, None


def _saved_modules(value, cfg_path: Path) -> tuple[str, ...] | None:
    """adapter_config.json's modules_to_save as the short names of SAVED_MODULE_KEYS; PEFT's longer spellings
    ("model.embed_tokens", written with ensure_weight_tying) map to the short ones."""
    if not value:
        return None
    names = [value] if isinstance(value, str) else list(value)
    short = [n.removeprefix("model.") if n.removeprefix("model.") in SAVED_MODULE_KEYS else n for n in names]
    unknown = [n for n, s in zip(names, short) if s not in SAVED_MODULE_KEYS]
    if unknown:
        raise ConfigError(f"{cfg_path}: modules_to_save {unknown} are not supported "
                          f"(supported: {', '.join(SAVED_MODULE_KEYS)})")
    return tuple(dict.fromkeys(short))


def _tied_tables(top: dict, ensure_weight_tying: bool, cfg_path: Path) -> dict:
    """The saved tables of an adapter for a model with tied embeddings, as one "embed_tokens" table. PEFT's
    head follows the trained table only with ensure_weight_tying (or when it saved an identical head copy);
    an untied head cannot be represented here and raises ConfigError."""
    head, embed = top.get("lm_head"), top.get("embed_tokens")
    if head is None:
        if embed is not None and not ensure_weight_tying:
            raise ConfigError(f"{cfg_path}: the adapter trains embed_tokens of a model with tied embeddings without "
                              "ensure_weight_tying, so in PEFT its output head keeps the base weights (untied); "
                              "unsloth_jax cannot untie the head")
        return top
    if embed is None or head.shape != embed.shape or not np.array_equal(head, embed):
        raise ConfigError(f"{cfg_path}: the adapter holds an lm_head that differs from embed_tokens, but this model "
                          "ties its embeddings (one table); untying the head is not supported")
    return {k: v for k, v in top.items() if k != "lm_head"}


def _saved_vocab_size(model, top: dict, weights: Path) -> int:
    """The vocabulary size of the adapter's saved tables (they may be larger than the base's after
    add_new_tokens); the model's own when none is saved. Tables that disagree raise ShapeMismatchError."""
    rows = {mod: int(v.shape[0]) for mod, v in top.items() if mod in ("embed_tokens", "lm_head") and v.ndim == 2}
    if len(set(rows.values())) > 1:
        raise ShapeMismatchError(f"{weights}: the saved embed_tokens and lm_head have different row counts {rows}")
    vocab = next(iter(rows.values()), model.config.vocab_size)
    if vocab < model.config.vocab_size:
        raise ShapeMismatchError(f"{weights}: the saved tables have {vocab} rows, fewer than the base model's "
                                 f"{model.config.vocab_size}; shrinking the vocabulary is not supported")
    return vocab


def load_adapter(model, adapter_dir):
    """Add the LoRA factors (and any modules_to_save / trained biases) of the PEFT adapter in `adapter_dir` to
    `model` and set `model.lora` from its adapter_config.json. Returns the model."""
    adapter_dir = Path(adapter_dir)
    cfg_path = adapter_dir / CONFIG_NAME
    raw = read_adapter_config(adapter_dir)
    split = None
    if fused_groups(model.config):
        raw, split = split_fused_adapter(raw, adapter_dir, model)
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
    targets = (resolve_targets(raw.get("target_modules"), n_layers, str(cfg_path), present=model.projections(),
                               cfg=cfg)
               if raw.get("target_modules") or not expert_targets else ())
    bias = raw.get("bias", "none") or "none"
    if bias not in ("none", "all", "lora_only"):
        raise ConfigError(f"{cfg_path}: bias {bias!r} is not supported (none, all, lora_only)")
    saved = _saved_modules(raw.get("modules_to_save"), cfg_path)
    tied = model.lm_head is None

    weights = adapter_dir / WEIGHTS_NAME
    if not weights.is_file():
        alt = [p.name for p in adapter_dir.glob("adapter_model.*")]
        hint = f" (found {', '.join(alt)}; convert .bin adapters with PEFT's save_pretrained)" if alt else ""
        raise CheckpointNotFoundError(f"{adapter_dir}: no {WEIGHTS_NAME}{hint}")

    projs = model.projections()
    all_stacks = model.projection_stacks()  # (our submodule, projection) -> Linear
    for p in targets:
        if p not in projs:
            raise ConfigError(f"{cfg_path}: target {p} does not exist in this {cfg.model_type} model")
    # by (our submodule, projection): Gemma 4's global_attn etc. beside self_attn (config.KIND_MODULES)
    stacks = {key: lin for key, lin in all_stacks.items() if key[1] in targets}
    dims = {key: (lin.in_features, lin.out_features) for key, lin in stacks.items()}
    lora_a = {key: np.zeros((len(stack_holders(cfg, key[0])), dims[key][0], r), np.float32) for key in stacks}
    lora_b = {key: np.zeros((len(stack_holders(cfg, key[0])), r, dims[key][1]), np.float32) for key in stacks}
    seen: set[tuple[str, int, str]] = set()
    biases: dict[tuple[str, int], np.ndarray] = {}
    top: dict[str, np.ndarray] = {}
    unexpected: list[str] = []
    key_of_saved = {v: k for k, v in SAVED_MODULE_KEYS.items()}
    with SafetensorsFile(weights) as f:
        expert_factors = moe_io.read_expert_adapter(model, f, expert_targets, r, weights) if expert_targets else {}
        if split is not None:
            f = _SplitTensors(f, split)
        layout = source_layout(cfg)
        if layout is not None:  # PEFT on a multimodal model: keys under base_model.model.model.language_model.
            f = _TextKeys(f, layout)
        for key in f.keys():
            if expert_targets and moe_io.is_expert_key(key):
                continue  # read above
            m = _LAYER_KEY.match(key)
            if m is None:
                plain, part = _embedding_layer_key(key)
                mod = key_of_saved.get(plain)
                # with tied embeddings PEFT also writes the head's key beside the trained table
                if mod is not None and saved and (mod in saved or (tied and mod == "lm_head"
                                                                   and "embed_tokens" in saved)):
                    if part == "original_module":
                        continue  # the untrained base table: only used with the adapter disabled
                    value = np.array(f.get(key))
                    if mod in top and not np.array_equal(top[mod], value):
                        raise UnexpectedTensorError(f"{weights}: '{key}' differs from the '{plain}' saved beside it")
                    top[mod] = value
                else:
                    unexpected.append(key)
                continue
            i, module, proj, kind = int(m.group(1)), m.group(2), m.group(3), m.group(4)
            if kv_shared_tensor(cfg, key):
                continue  # a Gemma 4 KV-shared layer's k/v projection, which its forward never reads
            if proj not in PROJ_MODULE or PROJ_MODULE[proj] != module or i >= n_layers \
                    or not layer_has(cfg, i, f"{module}.{proj}."):
                unexpected.append(key)
                continue
            arr = f.get(key)
            sub = layer_module(cfg, module, i)
            if kind.endswith("bias"):
                if bias == "none" or projs[proj].bias is None:
                    unexpected.append(key)
                    continue
                biases[(sub, proj, i)] = np.array(arr)
                continue
            if proj not in targets:
                unexpected.append(key)
                continue
            which = kind[5]
            d_in, d_out = dims[(sub, proj)]
            want = (r, d_in) if which == "A" else (d_out, r)
            if tuple(arr.shape) != want:
                raise ShapeMismatchError(
                    f"{weights}: tensor '{key}' has shape {list(arr.shape)}, expected {list(want)} "
                    f"(r={r} from {CONFIG_NAME}, and this model's {proj} is [{d_out}, {d_in}])")
            target = lora_a if which == "A" else lora_b
            target[(sub, proj)][layer_slot(cfg, sub, i)] = np.asarray(arr, np.float32).T
            seen.add((proj, i, which))
    if unexpected:
        shown = ", ".join(unexpected[:6]) + (f" and {len(unexpected) - 6} more" if len(unexpected) > 6 else "")
        raise UnexpectedTensorError(f"{weights}: tensors that do not fit adapter_config.json (targets "
                                    f"{list(targets)}, bias={bias!r}, modules_to_save={list(saved or [])}) or this "
                                    f"{cfg.model_type} model: {shown}")
    missing = [f"layers.{i}.{PROJ_MODULE[p]}.{p}.lora_{w}" for p in targets for i in range(n_layers) for w in "AB"
               if (p, i, w) not in seen and layer_has(cfg, i, f"{PROJ_MODULE[p]}.{p}.")]
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise MissingTensorError(f"{weights}: adapter is missing {len(missing)} LoRA tensor(s): {shown}")

    new_biases = {}
    for sub, proj in {(s, p) for s, p, _ in biases}:
        current = all_stacks[(sub, proj)].bias[...]
        b = np.array(current, dtype=np.float32)
        for (s, p, i), value in biases.items():
            if (s, p) != (sub, proj):
                continue
            if value.shape != b.shape[1:]:
                raise ShapeMismatchError(f"{weights}: bias of layer {i} {proj} has shape {list(value.shape)}, "
                                         f"expected {list(b.shape[1:])}")
            b[layer_slot(cfg, sub, i)] = value
        new_biases[(sub, proj)] = jnp.asarray(b, current.dtype)
    if tied:
        top = _tied_tables(top, bool(raw.get("ensure_weight_tying")), cfg_path)
        saved = tuple("embed_tokens" if m == "lm_head" else m for m in saved) if saved else saved
    vocab = _saved_vocab_size(model, top, weights)
    saved_values = {}
    for mod, value in top.items():
        ref = variable_at(model, SAVED_MODULE_PATHS[mod])
        want = ref[...].shape if mod == "norm" else (vocab, ref[...].shape[1])
        if tuple(value.shape) != tuple(want):
            raise ShapeMismatchError(f"{weights}: '{SAVED_MODULE_KEYS[mod]}' has shape {list(value.shape)}, "
                                     f"expected {list(want)}")
        saved_values[mod] = jnp.asarray(value, ref[...].dtype)
    # Everything is checked: now change the model.
    if vocab != cfg.vocab_size:
        from unsloth_jax.vocab import resize_token_embeddings

        resize_token_embeddings(model, vocab)
    settings = LoraSettings(r=r, lora_alpha=alpha, target_modules=targets,
                            lora_dropout=float(raw.get("lora_dropout", 0.0) or 0.0), bias=bias,
                            use_rslora=bool(raw.get("use_rslora", False)), modules_to_save=saved,
                            target_parameters=expert_targets or None)
    add_lora(model, settings, jax.random.PRNGKey(0))
    for key, lin in stacks.items():
        lin.lora_a[...] = jnp.asarray(lora_a[key])
        lin.lora_b[...] = jnp.asarray(lora_b[key])
    experts = model.expert_projections()
    for name, (a, b) in expert_factors.items():
        experts[name].lora_a[...] = jnp.asarray(a)
        experts[name].lora_b[...] = jnp.asarray(b)
    for key, value in new_biases.items():
        all_stacks[key].bias[...] = value
    for mod, value in saved_values.items():
        variable_at(model, SAVED_MODULE_PATHS[mod])[...] = value
    return model


class _TextKeys:
    """An adapter file of a multimodal model (MultimodalTextLayout) seen with its text decoder's keys in the text
    spelling (base_model.model.model.layers.*); other keys as they are."""

    def __init__(self, f, layout):
        self._f = f
        self._stored = {layout.text_adapter_key(k): k for k in f.keys()}

    def keys(self):
        return list(self._stored)

    def get(self, key):
        return self._f.get(self._stored[key])


# ------------------------------------------------------------------- adapters of fused modules (Phi-3)
class _SplitTensors:
    """An adapter file seen with its fused modules' LoRA tensors replaced by the split per-projection ones."""

    def __init__(self, f: SafetensorsFile, split: tuple[dict[str, np.ndarray], set[str]]):
        self._f = f
        self._split, self._fused = split

    def keys(self):
        return [k for k in self._f.keys() if k not in self._fused] + list(self._split)

    def get(self, key):
        return self._split[key] if key in self._split else self._f.get(key)


def _pattern_value(pattern: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key k with module matching (.*\\.)?(k)$."""
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return key, value
    return None, default


def split_fused_adapter(raw: dict, adapter_dir, model):
    """A PEFT adapter of a model whose checkpoint fuses projections (Phi-3: qkv_proj, gate_up_proj) in the form
    load_adapter reads: (adapter_config with the split projection names as targets, and None when no fused
    module is targeted, else ({PEFT key: array} of the split LoRA tensors, the fused keys they replace)).
    Two layouts split exactly, per fused module of n projections and rank R:

      R = r (PEFT trained the fused module): every projection gets A [r, in] and its rows of B;
      R = n r with alpha giving the same scale (what save_pretrained writes, see hf/export.py): B is block
        diagonal, projection k gets A rows and B columns k r .. (k + 1) r; a projection whose A block is zero
        in every layer was not targeted.

    Other ranks, or a non-block-diagonal B at R = n r, raise ConfigError naming the tensor."""
    adapter_dir = Path(adapter_dir)
    cfg_path, weights = adapter_dir / CONFIG_NAME, adapter_dir / WEIGHTS_NAME
    groups = {name: (parent, projs) for name, parent, projs in fused_groups(model.config)}
    targets = raw.get("target_modules")
    n_layers = model.config.num_hidden_layers
    names = [f"model.layers.{i}.{PROJ_MODULE[p]}.{p}" for i in range(n_layers)
             for p in ALL_TARGETS if not any(p in projs for _, projs in groups.values())]
    names += [f"model.layers.{i}.{parent}.{name}" for i in range(n_layers) for name, (parent, _) in groups.items()]
    if targets == "all-linear" or targets is None or not weights.is_file():
        hit = names if targets == "all-linear" else []
    elif isinstance(targets, str):
        try:
            hit = [n for n in names if re.fullmatch(targets, n)]
        except re.error as e:
            raise ConfigError(f"{cfg_path}: target_modules regex {targets!r} is invalid ({e})") from None
    else:
        hit = [n for n in names if any(n == str(t) or n.endswith("." + str(t)) for t in targets)]
        known = {n.rsplit(".", 1)[1] for n in names}
        unknown = [str(t) for t in targets if not any(n == str(t) or n.endswith("." + str(t)) for n in names)]
        if unknown:
            raise ConfigError(f"{cfg_path}: target_modules {unknown} name no module of this {model.config.model_type} "
                              f"checkpoint (it has {', '.join(sorted(known))})")
    fused_hit = sorted({n.rsplit(".", 1)[1] for n in hit} & set(groups))
    if not fused_hit:
        return raw, None
    try:
        r = int(raw["r"])
        alpha = float(raw.get("lora_alpha", 8))
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"{cfg_path}: 'r' (int) and 'lora_alpha' (number) are required") from None
    rslora = bool(raw.get("use_rslora", False))
    scale = alpha / (r ** 0.5 if rslora else r)
    projs_now = model.projections()
    split: dict[str, np.ndarray] = {}
    consumed: set[str] = set()
    used_patterns: set[str] = set()
    targeted: set[str] = set()
    with SafetensorsFile(weights) as f:
        for name in fused_hit:
            parent, projs = groups[name]
            outs = [projs_now[p].out_features for p in projs]
            d_in = projs_now[projs[0]].in_features
            n = len(projs)
            blocks_used = [False] * n
            per_layer = []
            for i in range(n_layers):
                module = f"model.layers.{i}.{parent}.{name}"
                key_a = f"base_model.model.{module}.lora_A.weight"
                key_b = f"base_model.model.{module}.lora_B.weight"
                if key_a not in f.keys() or key_b not in f.keys():
                    raise MissingTensorError(f"{weights}: adapter targets {name} but '{key_a}' or '{key_b}' is missing")
                a, b = np.asarray(f.get(key_a), np.float32), np.asarray(f.get(key_b), np.float32)
                consumed |= {key_a, key_b}
                rank = a.shape[0]
                if a.shape != (rank, d_in) or b.shape != (sum(outs), rank):
                    raise ShapeMismatchError(f"{weights}: '{key_a}' {list(a.shape)} / '{key_b}' {list(b.shape)} do not "
                                             f"fit {name} [{sum(outs)}, {d_in}]")
                rkey, _ = _pattern_value(raw.get("rank_pattern"), module, r)
                akey, alpha_f = _pattern_value(raw.get("alpha_pattern"), module, alpha)
                used_patterns |= {k for k in (rkey, akey) if k is not None}
                scale_f = float(alpha_f) / (rank ** 0.5 if rslora else rank)
                if rank not in (r, n * r) or abs(scale_f - scale) > 1e-6 * abs(scale):
                    raise ConfigError(
                        f"{weights}: '{key_a}' has rank {rank} and scale {scale_f:g}; unsloth_jax splits a fused {name} "
                        f"adapter only at rank r={r} (shared A) or {n}*r={n * r} (block diagonal) with the scale of "
                        f"r and lora_alpha ({scale:g})")
                per_layer.append((i, a, b, rank))
                if rank == n * r:
                    row = 0
                    for k, out in enumerate(outs):
                        cols = slice(k * r, (k + 1) * r)
                        off = np.delete(b[row:row + out], np.s_[k * r:(k + 1) * r], axis=1)
                        if np.any(off):
                            raise ConfigError(f"{weights}: '{key_b}' is not block diagonal (rows of {projs[k]} use "
                                              f"other projections' ranks), so it cannot be split into per-projection "
                                              "LoRA pairs exactly")
                        blocks_used[k] |= bool(np.any(a[cols]))
                        row += out
                else:
                    blocks_used = [True] * n
            for i, a, b, rank in per_layer:
                row = 0
                for k, (p, out) in enumerate(zip(projs, outs)):
                    if blocks_used[k]:
                        cols = slice(None) if rank == r else slice(k * r, (k + 1) * r)
                        prefix = f"base_model.model.model.layers.{i}.{parent}.{p}"
                        split[f"{prefix}.lora_A.weight"] = a[cols]
                        split[f"{prefix}.lora_B.weight"] = b[row:row + out, cols]
                    row += out
            targeted |= {p for p, used in zip(projs, blocks_used) if used}
    plain = sorted({n.rsplit(".", 1)[1] for n in hit} - set(groups))
    out = dict(raw, target_modules=plain + [p for p in ALL_TARGETS if p in targeted])
    for field in ("rank_pattern", "alpha_pattern"):
        out[field] = {k: v for k, v in (raw.get(field) or {}).items() if k not in used_patterns}
    return out, (split, consumed)
