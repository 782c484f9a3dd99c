"""Export to the Hugging Face world: PEFT adapters and merged 16-bit checkpoints.

    save_adapter(model, "lora_model")                  # adapter_config.json + adapter_model.safetensors
    save_merged(model, "merged", tokenizer)            # W + scale * A @ B, sharded HF safetensors + config.json
    save_full(model, "full")                           # a fully fine-tuned model, in its weights' dtype

Adapters write PEFT 0.21's keys: LoRA factors, and modules_to_save tables under the module's own name
(`base_model.model.model.embed_tokens.weight`; PEFT drops the live parameter's `modules_to_save.default.`), at
the grown size after add_new_tokens. With tied embeddings a trained table is written for the head too and the
config sets ensure_weight_tying, so PEFT's head follows the trained table as ours does. When the vocabulary was
resized PEFT also writes whole-module copies (`...modules_to_save.weight`, `...original_module.weight`, the
untrained base table); those are not written here (this model keeps no untrained copy), and PEFT loads the
adapter without them onto a model resized with `resize_token_embeddings(len(tokenizer))`.

`base_model_name_or_path` is the source directory as an absolute path (a relative one would resolve only from
the directory it was given in). A model loaded from a llama.cpp GGUF file has no base transformers or PEFT can
open, so its adapter directory also holds that base: `base_model/` (the weights as loaded, i.e. dequantized, in
the model's dtype, with config.json and the tokenizer), which `base_model_name_or_path` names, and the tokenizer.

Everything is written into a temporary directory next to `out_dir` that replaces `out_dir` only once complete,
so an interrupted export never leaves a directory that looks finished. When `out_dir` already exists, files
that the new export does not produce and that are not stale export artifacts (weights, index, configs it
rewrites) are carried over, so a tokenizer or a README saved there earlier survives.

The merged export streams: tensors are planned first (names, shapes, dtypes -> shards), then each is computed
(one layer of one projection: dequantize if 4-bit, fold the LoRA pair in float32, cast, transpose to HF's
[out, in]) and written straight into its shard, so host memory holds one tensor at a time.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from unsloth_jax.errors import CheckpointNotFoundError, ConfigError
from unsloth_jax.families import source_layout
from unsloth_jax.hf.file_modes import chmod_like_new
from unsloth_jax.config import layer_has, layer_module, layer_slot, stack_holders
from unsloth_jax.hf.mapping import fused_groups, tensor_specs
from unsloth_jax.models.decoder import PROJ_PARENT as PROJ_MODULE
from unsloth_jax.hf.safetensors_io import DTYPES as _ST_DTYPES, SafetensorsFile, checkpoint_files
from unsloth_jax.lora import merged_kernel
from unsloth_jax.models.layers import value_of
from unsloth_jax.models.state import variable_at
from unsloth_jax.quant import dense_kernel

log = logging.getLogger("unsloth_jax")


def announce(message: str, *args) -> None:
    """Print what a save wrote (the paths), so a Python caller sees it without configuring logging; not when the
    "unsloth_jax" logger's level is set above INFO (the CLI's -q)."""
    if logging.getLogger("unsloth_jax").level <= logging.INFO:
        print(message % args, flush=True)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
PEFT_SCHEMA_VERSION = "0.21.2"  # the PEFT release whose adapter_config.json fields we write
SAVE_METHODS = ("merged_16bit", "lora")
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")  # a multimodal model's processor
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "added_tokens.json")
# Files an export owns: a stale copy in the previous out_dir is dropped rather than carried over.
BASE_MODEL_DIR = "base_model"  # a GGUF-loaded model's adapter: its base as a transformers checkpoint
_ADAPTER_ARTIFACTS = re.compile(r"^(adapter_config\.json|adapter_model\.(safetensors|bin)|base_model)$")
_MERGED_ARTIFACTS = re.compile(r"^(config\.json|generation_config\.json|model\.safetensors(\.index\.json)?|"
                               r"model-\d{5}-of-\d{5}\.safetensors|pytorch_model.*\.bin(\.index\.json)?)$")


# --------------------------------------------------------------------------------------------- helpers
def parse_size(size) -> int:
    """Bytes from an int or a size string as transformers accepts them: "5GB" (10^9), "500MB", "10KB", "2GiB",
    "100MiB", "1KiB", a trailing lower-case "b" meaning bits ("8Gb"), or plain digits."""
    if isinstance(size, bool):
        raise ValueError(f"max_shard_size must be an int or a string like '5GB', got {size!r}")
    if isinstance(size, (int, np.integer)):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return int(size)
    if not isinstance(size, str):
        raise ValueError(f"max_shard_size must be an int or a string like '5GB', got {size!r}")
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?[Bb]|[Bb])?\s*", size)
    if not m:
        raise ValueError(f"max_shard_size {size!r} is not a size; use e.g. 5GB, 500MB, 2GiB or an int of bytes")
    number, unit = float(m.group(1)), m.group(2) or "B"
    scale = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    bscale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    if unit in ("B", "b"):
        value = number / (8 if unit == "b" else 1)
    elif unit[1] == "i":
        value = number * bscale[unit[0].upper()]
    else:
        value = number * scale[unit[0].upper()] / (8 if unit.endswith("b") else 1)
    if value < 1:
        raise ValueError(f"max_shard_size {size!r} is below one byte")
    return int(value)


def _checkpoint_dtype(model) -> str | None:
    """The dtype the source checkpoint's config.json records ("dtype", or the older "torch_dtype"), if any."""
    if model.model_dir is None:
        return None
    try:
        raw = json.loads((Path(model.model_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    name = (raw.get("dtype") or raw.get("torch_dtype")) if isinstance(raw, dict) else None
    return name.removeprefix("torch.") if isinstance(name, str) else None


def _resolve_out_dtype(model, dtype) -> np.dtype:
    """The dtype merged weights are written in: `dtype` if given; else 16-bit whatever the model computes in
    (a float32-loaded model too): float16 when the source checkpoint is float16, bfloat16 otherwise."""
    if dtype is None:
        dt = jnp.dtype(jnp.float16 if _checkpoint_dtype(model) == "float16" else jnp.bfloat16)
    else:
        from unsloth_jax.backend import resolve_dtype

        dt = resolve_dtype(dtype)
    if dt not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        raise ConfigError(f"cannot export in dtype {dt}; use bfloat16, float16 or float32")
    return np.dtype(ml_dtypes.bfloat16) if dt == jnp.dtype(jnp.bfloat16) else np.dtype(dt.name)


def _dtype_name(dt: np.dtype) -> str:
    return {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}[np.dtype(dt).name]


@contextlib.contextmanager
def atomic_directory(out_dir, stale: re.Pattern | None = None) -> Iterator[Path]:
    """Yield a fresh temporary directory next to `out_dir`; on success it becomes `out_dir`. On any exception
    (KeyboardInterrupt included) the temporary directory is removed and `out_dir` is left as it was.

    An existing `out_dir` is swapped out (renamed aside, the new one renamed in), then its entries that the new
    directory lacks and that do not match `stale` are moved over, and the old directory is deleted."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    parent = out_dir.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=parent))
    try:
        chmod_like_new(tmp)  # mkdtemp makes it 0700; out_dir gets a new directory's mode
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    try:
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=parent))
            os.rmdir(old)
            os.rename(out_dir, old)
        os.rename(tmp, out_dir)
    except BaseException:
        if old is not None and old.exists() and not out_dir.exists():
            os.rename(old, out_dir)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        for entry in os.listdir(old):
            if (out_dir / entry).exists() or entry.startswith(".") or (stale is not None and stale.fullmatch(entry)):
                continue
            os.rename(old / entry, out_dir / entry)
        shutil.rmtree(old, ignore_errors=True)


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


# ------------------------------------------------------------------------------------- safetensors stream
class _Entry:
    """One tensor to write: its name, shape, dtype and a function producing it (called once, at write time)."""

    __slots__ = ("name", "shape", "dtype", "make")

    def __init__(self, name: str, shape: tuple[int, ...], dtype: np.dtype, make: Callable[[], np.ndarray]):
        self.name, self.shape, self.dtype, self.make = name, tuple(int(s) for s in shape), np.dtype(dtype), make

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def write_safetensors_stream(path: Path, entries: list[_Entry], metadata: dict | None = None) -> None:
    """Write one safetensors file whose header is known up front, computing and writing one tensor at a time."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for e in entries:
        if e.dtype not in _ST_NAMES:
            raise TypeError(f"tensor '{e.name}': dtype {e.dtype} cannot be stored in safetensors")
        header[e.name] = {"dtype": _ST_NAMES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(blob)))
        out.write(blob)
        for e in entries:
            arr = e.make()
            arr = np.ascontiguousarray(arr).reshape(np.shape(arr))  # ascontiguousarray makes a 0-d array 1-d
            if arr.shape != e.shape or arr.dtype != e.dtype:
                raise AssertionError(f"export bug: '{e.name}' produced {arr.dtype}{list(arr.shape)}, planned "
                                     f"{e.dtype}{list(e.shape)}")
            out.write(memoryview(arr.reshape(-1).view(np.uint8)))
            del arr


def plan_shards(entries: list[_Entry], max_shard_size: int) -> list[list[_Entry]]:
    """Split in order, as huggingface_hub does: a new shard when the next tensor would push the current one over
    the limit; a tensor larger than the limit gets a shard of its own."""
    shards: list[list[_Entry]] = []
    current: list[_Entry] = []
    size = 0
    for e in entries:
        if e.nbytes > max_shard_size:
            shards.append([e])
            continue
        if current and size + e.nbytes > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(e)
        size += e.nbytes
    if current:
        shards.append(current)
    return shards


# ------------------------------------------------------------------------------------------- adapter
def _adapter_config(model, base_model_name_or_path) -> dict:
    lo = model.lora
    alpha = lo.lora_alpha
    if isinstance(alpha, float) and alpha.is_integer():
        alpha = int(alpha)
    targets, rank_pattern, alpha_pattern = _peft_targets(model)
    return {
        "alora_invocation_tokens": None,
        "alpha_pattern": alpha_pattern,
        "arrow_config": None,
        "auto_mapping": None,
        "base_model_name_or_path": base_model_name_or_path,
        "bias": lo.bias,
        "corda_config": None,
        "ensure_weight_tying": _ties_saved_embedding(model),
        "eva_config": None,
        "exclude_modules": None,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "kasa_config": None,
        "layer_replication": None,
        "layers_pattern": None,
        "layers_to_transform": None,
        "loftq_config": {},
        "lora_alpha": alpha,
        "lora_bias": False,
        "lora_dropout": float(lo.lora_dropout),
        "lora_ga_config": None,
        "megatron_config": None,
        "megatron_core": "megatron.core",
        "modules_to_save": list(lo.modules_to_save) if lo.modules_to_save else None,
        "monteclora_config": None,
        "peft_type": "LORA",
        "peft_version": PEFT_SCHEMA_VERSION,
        "qalora_group_size": 16,
        "r": int(lo.r),
        "rank_pattern": rank_pattern,
        "revision": None,
        "target_modules": targets,
        "target_parameters": list(lo.target_parameters) if lo.target_parameters else None,
        "task_type": "CAUSAL_LM",
        "trainable_token_indices": None,
        "use_bdlora": None,
        "use_dora": False,
        "use_qalora": False,
        "use_rslora": bool(lo.use_rslora),
        "velora_config": None,
    }


def _adapter_entries(model) -> list[_Entry]:
    from unsloth_jax.hf.peft_io import SAVED_MODULE_KEYS, SAVED_MODULE_PATHS

    lo = model.lora
    stacks = model.projection_stacks()
    n = model.config.num_hidden_layers
    entries: list[_Entry] = []
    f32 = np.dtype(np.float32)
    if model.config.is_moe:
        from unsloth_jax.hf.moe_io import check_adapter_expressible, expert_adapter_tensors

        check_adapter_expressible(model)
        entries += [_Entry(name, shape, f32, make) for name, shape, make in expert_adapter_tensors(model)]
    fused = {p for _, _, group in fused_groups(model.config) for p in group}
    for proj in lo.target_modules:
        if proj in fused:
            continue  # written below as the checkpoint's fused module
        for (sub, name), lin in stacks.items():
            if name == proj and lin.lora_a is None:
                raise ConfigError(f"model.lora targets {proj} but model.model.layers.{sub}.{proj} has no "
                                  "lora_a/lora_b")
        prefix = f"base_model.model.model.layers.{{i}}.{PROJ_MODULE[proj]}.{proj}"
        for i in range(n):
            if not layer_has(model.config, i, f"{PROJ_MODULE[proj]}.{proj}."):
                continue  # Qwen3.5: a layer has one of its two mixers; Gemma 4's KV-shared layers no k/v projections
            sub = layer_module(model.config, PROJ_MODULE[proj], i)  # Gemma 4: global_attn, wide_mlp, ...
            lin = stacks[(sub, proj)]
            a, b = lin.lora_a[...], lin.lora_b[...]
            p, r = prefix.format(i=i), layer_slot(model.config, sub, i)
            entries.append(_Entry(f"{p}.lora_A.weight", (a.shape[2], a.shape[1]), f32,
                                  lambda a=a, r=r: np.asarray(a[r], np.float32).T))
            entries.append(_Entry(f"{p}.lora_B.weight", (b.shape[2], b.shape[1]), f32,
                                  lambda b=b, r=r: np.asarray(b[r], np.float32).T))
    entries += _fused_adapter_entries(model)
    if lo.bias in ("all", "lora_only"):
        for (sub, proj), lin in stacks.items():
            if lin.bias is None:
                continue
            targeted = proj in lo.target_modules
            if lo.bias == "lora_only" and not targeted:
                continue
            bias = lin.bias[...]
            leaf = "base_layer.bias" if targeted else "bias"
            for r, i in enumerate(stack_holders(model.config, sub)):
                entries.append(_Entry(f"base_model.model.model.layers.{i}.{PROJ_MODULE[proj]}.{proj}.{leaf}",
                                      bias.shape[1:], _np_dtype(bias.dtype), lambda x=bias, r=r: np.asarray(x[r])))
    for mod in lo.modules_to_save or ():
        if mod not in SAVED_MODULE_KEYS:
            raise ConfigError(f"modules_to_save entry {mod!r} cannot be exported (supported: "
                              f"{', '.join(SAVED_MODULE_KEYS)})")
        if mod == "lm_head" and model.lm_head is None:
            log.warning("unsloth_jax: modules_to_save names %s, but embeddings are tied (no separate %s); "
                        "not saved", mod, mod)
            continue
        value = variable_at(model, SAVED_MODULE_PATHS[mod])[...]
        entries.append(_Entry(SAVED_MODULE_KEYS[mod], value.shape, _np_dtype(value.dtype),
                              lambda v=value: np.asarray(v)))
        if mod == "embed_tokens" and _ties_saved_embedding(model):  # the tied head, saved as PEFT saves it
            entries.append(_Entry(SAVED_MODULE_KEYS["lm_head"], value.shape, _np_dtype(value.dtype),
                                  lambda v=value: np.asarray(v)))
    layout = source_layout(model.config)
    if layout is not None:  # PEFT on the multimodal model: its module names (base_model.model.model.language_model.*)
        for e in entries:
            e.name = layout.adapter_key(e.name)
    return entries


def _ties_saved_embedding(model) -> bool:
    """True when the embeddings are tied and the adapter trains the table: the adapter then asks PEFT to keep
    the head tied to the trained copy (ensure_weight_tying), which is what this model computes."""
    return model.lm_head is None and "embed_tokens" in (model.lora.modules_to_save or ())


# ------------------------------------------------------------------- adapters of fused modules (Phi-3)
# Phi-3's checkpoint fuses q/k/v into qkv_proj and gate/up into gate_up_proj, so PEFT adapts those fused modules.
# Our decoder keeps the projections apart, each with its own LoRA pair (A_p [in, r], B_p [r, out_p]). Their
# fused equivalent, exactly, is one rank n*r pair over the n projections of the group: A = [A_1^T; ...; A_n^T]
# [n r, in] and B = blockdiag(B_1^T, ..., B_n^T) [sum out_p, n r]. A projection of the group that is not targeted
# gets zero blocks (so the layout, and the split on import, never depends on which were targeted).
# adapter_config.json says so with rank_pattern {fused: n r} and alpha_pattern {fused: alpha'}, alpha' keeping
# the scale: n * alpha (alpha / r), or sqrt(n) * alpha with rsLoRA (alpha / sqrt(r)).
def _peft_targets(model) -> tuple[list[str], dict, dict]:
    """adapter_config.json's target_modules, rank_pattern and alpha_pattern for the model's LoRA settings."""
    lo = model.lora
    targets = list(lo.target_modules)
    rank_pattern, alpha_pattern = {}, {}
    for name, _, group in fused_groups(model.config):
        if not any(p in targets for p in group):
            continue
        targets = [t for t in targets if t not in group] + [name]
        n = len(group)
        rank_pattern[name] = n * lo.r
        alpha = lo.lora_alpha * (n ** 0.5 if lo.use_rslora else n)
        alpha_pattern[name] = int(alpha) if float(alpha).is_integer() else float(alpha)
    layout = source_layout(model.config)
    if layout is not None:  # a multimodal model: a bare name would also catch the towers' modules of that name
        parents = sorted({PROJ_MODULE[t] for t in targets})
        targets = (rf"{re.escape(layout.text_prefix)}layers\.\d+\.(?:{'|'.join(parents)})\."
                   rf"(?:{'|'.join(targets)})")
    return targets, rank_pattern, alpha_pattern


def _fused_adapter_entries(model) -> list[_Entry]:
    lo = model.lora
    projs = model.projections()
    f32 = np.dtype(np.float32)
    entries: list[_Entry] = []
    for name, parent, group in fused_groups(model.config):
        if not any(p in lo.target_modules for p in group):
            continue
        lins = [projs[p] if p in lo.target_modules else None for p in group]
        d_in = projs[group[0]].in_features
        outs = [projs[p].out_features for p in group]
        rank = len(group) * lo.r

        def fused_a(i, lins=lins, d_in=d_in):
            return np.concatenate([np.zeros((lo.r, d_in), np.float32) if lin is None else
                                   np.asarray(lin.lora_a[...][i], np.float32).T for lin in lins])

        def fused_b(i, lins=lins, outs=outs, rank=rank):
            b = np.zeros((sum(outs), rank), np.float32)
            row = 0
            for k, (lin, out) in enumerate(zip(lins, outs)):
                if lin is not None:
                    b[row:row + out, k * lo.r:(k + 1) * lo.r] = np.asarray(lin.lora_b[...][i], np.float32).T
                row += out
            return b

        for i in range(model.config.num_hidden_layers):
            p = f"base_model.model.model.layers.{i}.{parent}.{name}"
            entries.append(_Entry(f"{p}.lora_A.weight", (rank, d_in), f32, lambda i=i, fa=fused_a: fa(i)))
            entries.append(_Entry(f"{p}.lora_B.weight", (sum(outs), rank), f32, lambda i=i, fb=fused_b: fb(i)))
    return entries


def _np_dtype(dt) -> np.dtype:
    dt = np.dtype(dt)
    return np.dtype(ml_dtypes.bfloat16) if dt == np.dtype(ml_dtypes.bfloat16) else dt


def _gguf_source(model) -> Path | None:
    """The GGUF file the model was loaded from, or None."""
    src = Path(model.model_dir) if model.model_dir is not None else None
    return src if src is not None and src.is_file() and src.suffix.lower() == ".gguf" else None


def _base_model_name(model) -> str | None:
    """The model's source as adapter_config.json names it: an absolute path when it exists locally, else as given
    (a hub id)."""
    if model.model_dir is None:
        return None
    src = str(model.model_dir)
    return os.path.abspath(src) if os.path.exists(src) else src


def _write_adapter(model, directory: Path, base_model_name_or_path, out_dir, tokenizer=None) -> None:
    """The adapter files into `directory` (which becomes `out_dir`), the tokenizer when given; for a GGUF-loaded
    model also its base (BASE_MODEL_DIR) and the GGUF's tokenizer when none is given."""
    if model.lora is None:
        raise ConfigError("the model has no LoRA adapter to save; call FastLanguageModel.get_peft_model first "
                          "(or save the whole model with save_pretrained_merged)")
    gguf = _gguf_source(model) if base_model_name_or_path is None else None
    if gguf is not None:  # transformers and PEFT cannot open a GGUF as a base: write the one the adapter trained on
        base_dir = directory / BASE_MODEL_DIR
        base_dir.mkdir()
        _write_merged(model, base_dir, tokenizer, "5GB", _resolve_out_dtype(model, weights_dtype(model)),
                      fold_lora=False)
        base_model_name_or_path = os.path.abspath(Path(out_dir) / BASE_MODEL_DIR)
        _write_tokenizer(model, directory, tokenizer)
    else:
        if base_model_name_or_path is None:
            base_model_name_or_path = _base_model_name(model)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(directory))
    write_safetensors_stream(directory / ADAPTER_WEIGHTS, _adapter_entries(model), {"format": "pt"})
    _write_json(directory / ADAPTER_CONFIG, _adapter_config(model, base_model_name_or_path))


def save_adapter(model, out_dir, *, base_model_name_or_path=None, tokenizer=None) -> str:
    """Write a PEFT LoRA adapter directory that `peft.PeftModel.from_pretrained(hf_model, out_dir)` loads:
    adapter_config.json and adapter_model.safetensors (LoRA factors in float32 under PEFT's key names, plus
    modules_to_save copies and trained biases where configured), and the tokenizer when given. A GGUF-loaded
    model's adapter also gets its base and tokenizer (see the module docstring), so that
    `peft.AutoPeftModelForCausalLM.from_pretrained(out_dir)` loads it."""
    with atomic_directory(out_dir, _ADAPTER_ARTIFACTS) as tmp:
        _write_adapter(model, tmp, base_model_name_or_path, out_dir, tokenizer)
    announce("unsloth_jax: saved LoRA adapter to %s%s", out_dir,
             f" (with its base, dequantized from the GGUF, in {BASE_MODEL_DIR}/)" if _gguf_source(model)
             and base_model_name_or_path is None else "")
    return str(out_dir)


# -------------------------------------------------------------------------------------------- merged
def _base_kernel(lin, layer: int) -> np.ndarray:
    """Layer `layer` of a projection's frozen kernel as a dense float32 [in, out] array, without its LoRA pair."""
    kernel = value_of(lin.kernel)
    return np.asarray(dense_kernel(jax.tree.map(lambda a: a[layer], kernel)), np.float32)


def merged_entries(model, out_dtype: np.dtype, fold_lora: bool = True) -> list[_Entry]:
    """The merged checkpoint as planned tensors with HF names, in HF order (embeddings, layers, norm, head;
    then the MoE tensors of MoE families). fold_lora=False: the dense projections without their LoRA pairs."""
    kernel_of = merged_kernel if fold_lora else _base_kernel
    from unsloth_jax.hf.moe_io import MergedExperts

    entries: list[_Entry] = []
    experts = MergedExperts(model) if model.config.is_moe else None
    for name, spec in tensor_specs(model.config).items():
        if spec.kind in ("router", "expert", "experts", "experts_t"):
            make = experts.maker(spec, out_dtype)
        elif spec.kind == "fused":  # Phi-3: the merged projections stacked back into one tensor
            lins = [variable_parent(model, part.path) for part in spec.parts]

            def make(lins=lins, i=spec.slot):
                return np.concatenate([kernel_of(lin, i).T for lin in lins]).astype(out_dtype)
        elif spec.kind == "kernel":
            lin = variable_parent(model, spec.path)

            def make(lin=lin, i=spec.slot):
                return np.ascontiguousarray(kernel_of(lin, i).T).astype(out_dtype)
        elif spec.kind == "matrix":  # an unstacked weight kept transposed (Gemma 4's per_layer_model_projection)
            leaf = variable_at(model, spec.path)[...]

            def make(leaf=leaf):
                return np.ascontiguousarray(np.asarray(leaf, np.float32).T).astype(out_dtype)
        else:
            leaf = variable_at(model, spec.path)[...]

            def make(leaf=leaf, i=spec.slot, out_dtype=np.float32 if spec.keep_fp32 else out_dtype):
                x = leaf if i is None else leaf[i]
                return np.asarray(np.asarray(x, np.float32).astype(out_dtype))
        entries.append(_Entry(name, spec.hf_shape, np.float32 if spec.keep_fp32 else out_dtype, make))
    layout = source_layout(model.config)
    if layout is not None:  # a multimodal source: its spelling of the text names, then its towers as they are
        for e in entries:
            e.name = layout.stored_name(e.name)
        entries += _kept_entries(model, layout)
    return entries


def _kept_entries(model, layout) -> list[_Entry]:
    """The source checkpoint's tensors under layout.kept_prefixes (a multimodal model's towers, never loaded), as
    entries copying each one's bytes unchanged (its own dtype). CheckpointNotFoundError when the source
    directory is gone."""
    src = Path(model.model_dir) if model.model_dir is not None else None
    if src is None or not src.is_dir():
        raise CheckpointNotFoundError(
            f"cannot write the merged {layout.architecture} checkpoint: its tower tensors are copied from the source "
            f"directory {model.model_dir!r}, which does not exist")

    opened: dict = {}  # the shard read last, kept open: the entries are written in file order

    def reader(path, name):
        def read() -> np.ndarray:
            if path not in opened:
                for f in opened.values():
                    f.close()
                opened.clear()
                opened[path] = SafetensorsFile(path)
            return np.array(opened[path].get(name))  # a copy; the last shard closes with the entries
        return read

    entries = []
    for path in checkpoint_files(src):
        with SafetensorsFile(path) as f:
            for name in f.keys():
                if name.startswith(layout.kept_prefixes):
                    entries.append(_Entry(name, f.shape(name), f.dtype(name), reader(path, name)))
    return entries


def variable_parent(model, path: tuple[str, ...]):
    """The module holding the variable at `path` (for a projection kernel: its Linear)."""
    node = model
    for key in path[:-1]:
        node = getattr(node, key)
    return node


def source_config(model) -> dict | None:
    """The config.json dict of the checkpoint the model was loaded from (rebuilt from the metadata for a GGUF
    file), or None when there is none."""
    if model.model_dir is None:
        return None
    src = Path(model.model_dir)
    if src.is_file() and src.suffix.lower() == ".gguf":
        from unsloth_jax.hf.gguf_loading import hf_config

        return hf_config(src)
    if (src / "config.json").is_file():
        return json.loads((src / "config.json").read_text())
    return None


def _merged_config(model, out_dtype: np.dtype) -> dict:
    raw = source_config(model)
    if raw is None:
        raise CheckpointNotFoundError(
            f"cannot write config.json for the merged model: the source directory {model.model_dir!r} has no "
            "config.json (save_pretrained_merged copies it from the directory the model was loaded from)")
    raw.pop("quantization_config", None)  # the merged weights are dense
    text = raw["text_config"] if model.config.source_layout else raw  # a multimodal source: its text_config
    text["vocab_size"] = int(model.config.vocab_size)  # add_new_tokens may have grown it
    name = _dtype_name(out_dtype)
    raw["dtype"] = name
    if "torch_dtype" in raw:
        raw["torch_dtype"] = name
    return raw


def write_shards(directory: Path, entries: list[_Entry], limit: int) -> None:
    """entries as model.safetensors, or as shards of at most `limit` bytes with transformers' index, in
    directory."""
    shards = plan_shards(entries, limit)
    meta = {"format": "pt"}
    if len(shards) == 1:
        write_safetensors_stream(directory / "model.safetensors", shards[0], meta)
        return
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors_stream(directory / fname, shard, meta)
        weight_map.update({e.name: fname for e in shard})
    n_params = sum(int(np.prod(e.shape, dtype=np.int64)) for e in entries)
    _write_json(directory / INDEX_NAME, {
        "metadata": {"total_parameters": n_params, "total_size": sum(e.nbytes for e in entries)},
        "weight_map": weight_map})


def copy_generation_config(model, directory: Path) -> None:
    """The model's source generation_config.json into directory, when it has one."""
    src = Path(model.model_dir) if model.model_dir is not None else None
    if src is not None and (src / "generation_config.json").is_file():
        shutil.copyfile(src / "generation_config.json", directory / "generation_config.json")


def _write_merged(model, directory: Path, tokenizer, max_shard_size, out_dtype: np.dtype,
                  copy_tokenizer: bool = True, fold_lora: bool = True) -> None:
    limit = parse_size(max_shard_size)
    config = _merged_config(model, out_dtype)  # fail early, before writing gigabytes
    write_shards(directory, merged_entries(model, out_dtype, fold_lora), limit)
    _write_json(directory / "config.json", config)
    copy_generation_config(model, directory)
    if model.config.source_layout:  # a multimodal checkpoint of the source's type: its processor too
        for fname in PROCESSOR_FILES:
            if (Path(model.model_dir) / fname).is_file():
                shutil.copyfile(Path(model.model_dir) / fname, directory / fname)
    if tokenizer is not None or copy_tokenizer:
        _write_tokenizer(model, directory, tokenizer)


def _write_tokenizer(model, directory: Path, tokenizer) -> None:
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
        return
    src = Path(model.model_dir) if model.model_dir is not None else None
    source_vocab = (source_config(model) or {}).get("vocab_size")
    if source_vocab is not None and source_vocab != model.config.vocab_size:
        log.warning("unsloth_jax: the vocabulary grew from %s to %d tokens (add_new_tokens) but no tokenizer was "
                    "given: the tokenizer copied from %s lacks the new tokens; pass tokenizer=", source_vocab,
                    model.config.vocab_size, src)
    if src is not None and src.is_file() and src.suffix.lower() == ".gguf":  # the tokenizer its metadata holds
        from unsloth_jax.hf.gguf_loading import gguf_tokenizer

        gguf_tokenizer(src).save_pretrained(str(directory))
        log.info("unsloth_jax: no tokenizer given; wrote the one in %s", src)
        return
    copied = []
    if src is not None and src.is_dir():
        for fname in _TOKENIZER_FILES:
            if (src / fname).is_file():
                shutil.copyfile(src / fname, directory / fname)
                copied.append(fname)
    if copied:
        log.info("unsloth_jax: no tokenizer given; copied %s from %s", ", ".join(copied), src)
    else:
        log.warning("unsloth_jax: no tokenizer given and none found in %s; the export has no tokenizer files", src)


def weights_dtype(model) -> str:
    """The dtype name of the model's dense weights (that of its embedding table)."""
    return _dtype_name(_np_dtype(model.model.embed_tokens.weight[...].dtype))


def save_full(model, out_dir, tokenizer=None, *, max_shard_size="5GB") -> str:
    """Write a fully fine-tuned model as a transformers checkpoint in its weights' own dtype (bf16 stays bf16,
    float32 stays float32): sharded safetensors (+ index), config.json with the current vocab_size,
    generation_config.json. Tokenizer files only when `tokenizer` is given, as transformers' save_pretrained
    (files already in out_dir, such as a tokenizer saved there first, are kept)."""
    out_dtype = _resolve_out_dtype(model, weights_dtype(model))
    with atomic_directory(out_dir, _MERGED_ARTIFACTS) as tmp:
        _write_merged(model, tmp, tokenizer, max_shard_size, out_dtype, copy_tokenizer=False)
    announce("unsloth_jax: saved the fully fine-tuned %s model to %s", weights_dtype(model), out_dir)
    return str(out_dir)


def save_merged(model, out_dir, tokenizer=None, *, save_method: str = "merged_16bit", max_shard_size="5GB",
                dtype=None) -> str:
    """Write the merged model as a Hugging Face checkpoint (save_method="merged_16bit"), or only the adapter and
    tokenizer (save_method="lora").

    merged_16bit: every projection becomes W + scale * A @ B, computed in float32 (a 4-bit base is dequantized
    first) and cast to `dtype` (default: float16 when the source checkpoint's config.json says float16, else
    bfloat16, whatever dtype the model was loaded in; dtype="float32" keeps full precision). Shards
    above `max_shard_size` (int bytes or "5GB", "500MB", "2GiB") with model.safetensors.index.json; config.json
    from the source directory with the dtype updated; generation_config.json and tokenizer files."""
    if save_method not in SAVE_METHODS:
        if save_method in ("merged_4bit", "merged_4bit_forced"):
            raise ConfigError(f"save_method={save_method!r}: re-quantizing a merged model to 4-bit loses accuracy "
                              "and is not supported; use save_method='merged_16bit' (or save_pretrained_gguf for "
                              "a quantized llama.cpp file)")
        raise ConfigError(f"save_method={save_method!r} is not supported; use one of {', '.join(SAVE_METHODS)}")
    if save_method == "lora":
        return save_adapter(model, out_dir, tokenizer=tokenizer)
    stale = _MERGED_ARTIFACTS if tokenizer is None else re.compile(
        _MERGED_ARTIFACTS.pattern + "|" + "|".join(re.escape(f) for f in _TOKENIZER_FILES))
    out_dtype = _resolve_out_dtype(model, dtype)
    with atomic_directory(out_dir, stale) as tmp:
        _write_merged(model, tmp, tokenizer, max_shard_size, out_dtype)
    announce("unsloth_jax: saved merged %s model to %s", _dtype_name(out_dtype), out_dir)
    return str(out_dir)
