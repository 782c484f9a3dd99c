"""Load a Hugging Face safetensors checkpoint into the NNX decoder, streaming tensor by tensor.

    model = load_model(model_dir, cfg, jnp.bfloat16)      # a CausalLM (or a subclass) holding the checkpoint

Each tensor is read from the memory-mapped file, transformed (projection weights transposed to [in, out]),
cast to the compute dtype and written into its slot on the default device, in a nested dict keyed by module
path (`load_params`). Stacked variables are preallocated on the device and filled one layer at a time by a
donating update, so host memory stays near one tensor. `load_model` then fills an abstract model (built with
nnx.eval_shape, no memory) with those arrays.
"""
from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from unsloth_jax.config import ModelConfig
from unsloth_jax.errors import ConfigError, MissingTensorError, ShapeMismatchError, UnexpectedTensorError
from unsloth_jax.families import source_layout
from unsloth_jax.hf.mapping import (TensorSpec, detect_expert_layout, fused_parts, ignored_tensor, mtp_layer_tensor,
                                     stack_shape, tensor_specs)
from unsloth_jax.hf.safetensors_io import SafetensorsFile, checkpoint_files
from unsloth_jax.models.decoder import CausalLM
from unsloth_jax.models.state import fill

log = logging.getLogger("unsloth_jax")

Params = dict


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(buffer: jax.Array, value: jax.Array, layer) -> jax.Array:
    """buffer[layer] = value, in place on devices that support donation (layer is traced: one compile per shape).
    A float buffer is updated as unsigned integers of its width (the same bits): XLA's CPU backend converts a
    float8 or bfloat16 update to float32 and back over the whole stack, which made loading a model in FP8 slow
    (each layer's update rewrote its projection's whole stack)."""
    value = value.astype(buffer.dtype)
    if not jnp.issubdtype(buffer.dtype, jnp.floating):
        return jax.lax.dynamic_update_index_in_dim(buffer, value, layer, 0)
    bits = jnp.dtype(f"uint{8 * buffer.dtype.itemsize}")
    updated = jax.lax.dynamic_update_index_in_dim(jax.lax.bitcast_convert_type(buffer, bits),
                                                  jax.lax.bitcast_convert_type(value, bits), layer, 0)
    return jax.lax.bitcast_convert_type(updated, buffer.dtype)


def _describe(tree, leading: int = 0) -> str:
    """A short description of one layer's value (skipping `leading` stacking axes), for error messages."""
    from pallas_kernels.nf4_format import NF4Weight

    if isinstance(tree, NF4Weight):
        double = "on" if tree.nested_absmax is not None else "off"
        return f"an NF4 weight (shape {list(tree.shape)}, blocksize {tree.blocksize}, double quantization {double})"
    return " + ".join(f"{x.dtype}{list(x.shape[leading:])}" for x in jax.tree.leaves(tree))


def _into_stack(params: dict, spec: TensorSpec, value, num_layers: int, where: str):
    """The layer-stacked param at spec.path with row spec.slot (layer spec.layer) set to `value` (an array or a
    pytree of arrays, e.g. an NF4 weight); the stack of `num_layers` rows is allocated (zeros) at the first layer
    seen and updated in place after.

    Raises ShapeMismatchError naming `where` (the tensor and file) when `value` does not have the structure,
    shapes and dtypes of the layers already stored (e.g. a 4-bit checkpoint whose layers differ in blocksize or
    double quantization)."""
    try:
        stack = get_path(params, spec.path)
    except KeyError:  # the first layer seen: the stack takes its structure, shapes and dtypes
        stack = jax.tree.map(lambda x: jnp.zeros((num_layers, *x.shape), x.dtype), value)
    else:
        stack_leaves, stack_def = jax.tree.flatten(stack)
        leaves, treedef = jax.tree.flatten(value)
        if treedef != stack_def or any(b.shape[1:] != x.shape or b.dtype != x.dtype
                                       for b, x in zip(stack_leaves, leaves)):
            raise ShapeMismatchError(
                f"{where}: layer {spec.layer} loads as {_describe(value)}, but the layers before it as "
                f"{_describe(stack, leading=1)}; every layer of one projection must share shape, dtype and "
                "quantization settings")
    rows = jax.tree.leaves(stack)[0].shape[0]
    if not 0 <= spec.slot < rows:  # dynamic_update_index_in_dim would clamp it onto another layer's row
        raise ShapeMismatchError(f"{where}: layer {spec.layer} is row {spec.slot} of a {rows}-row stack")
    return jax.tree.map(lambda buf, x: _set_layer(buf, x, spec.slot), stack, value)


def set_path(tree: dict, path: tuple[str, ...], value) -> None:
    """tree[path[0]][path[1]]... = value, creating dicts on the way."""
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def get_path(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _to_param_layout(array: np.ndarray, spec: TensorSpec) -> np.ndarray:
    if spec.kind in ("kernel", "router", "expert", "matrix"):
        return array.T
    if spec.kind == "experts":  # a fused [E, out, in] expert stack -> [E, in, out]
        return np.swapaxes(array, 1, 2)
    return array


@functools.partial(jax.jit, donate_argnums=0)
def _set_expert_part(buffer: jax.Array, value: jax.Array, layer, expert, column) -> jax.Array:
    """buffer[layer, expert, :, column:column + out] = value [in, out], in place where donation is supported."""
    start = (layer, expert, jnp.zeros((), jnp.int32), column)
    return jax.lax.dynamic_update_slice(buffer, value.astype(buffer.dtype)[None, None], start)


def _into_expert_stack(params: dict, spec: TensorSpec, value: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The [L, E, in, out] expert stack at spec.path with one expert's projection (kind "expert") written at
    (spec.slot, spec.expert, spec.column); allocated (zeros) when the first part is seen."""
    try:
        stack = get_path(params, spec.path)
    except KeyError:
        stack = jnp.zeros(stack_shape(cfg, spec), value.dtype)
    if not 0 <= spec.slot < stack.shape[0]:  # dynamic_update_slice would clamp it onto another layer's row
        raise ShapeMismatchError(f"{spec.hf_name}: layer {spec.layer} is row {spec.slot} of a "
                                 f"{stack.shape[0]}-row expert stack")
    return _set_expert_part(stack, value, spec.slot, spec.expert, spec.column)


# A weight transform hook: (spec, host array in param layout, dtype) -> the device value to store. The 4-bit
# loader passes one that quantizes projection kernels; the default casts and puts on the device.
Placer = Callable[[TensorSpec, np.ndarray, jnp.dtype], object]


def default_placer(spec: TensorSpec, array: np.ndarray, dtype) -> jax.Array:
    return jnp.asarray(array, dtype=dtype)


BNB_SUFFIXES = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map", ".quant_state.bitsandbytes__nf4")


def _bnb_weight(name: str, spec: TensorSpec, handles: dict, where: dict):
    """An NF4Weight from a pre-quantized bitsandbytes tensor group (`name` + its quant-state tensors)."""
    from pallas_kernels.nf4_format import nf4_from_bnb_tensors

    group = {}
    for key in (name,) + tuple(name + s for s in BNB_SUFFIXES):
        if key in where:
            group[key] = np.array(handles[where[key]].get(key))
    if len(group) == 1:
        raise MissingTensorError(f"{where[name]}: '{name}' is a 4-bit weight but its quant state "
                                 f"(absmax, quant_map, quant_state...) is missing")
    try:
        q = nf4_from_bnb_tensors(group)
    except (KeyError, ValueError) as e:
        raise ShapeMismatchError(f"{where[name]}: cannot read the bitsandbytes 4-bit weight '{name}': {e}") from None
    if tuple(q.shape) != spec.hf_shape:
        raise ShapeMismatchError(f"{where[name]}: 4-bit tensor '{name}' has shape {list(q.shape)}, but config.json "
                                 f"implies {list(spec.hf_shape)}")
    return q


def place(params: Params, spec: TensorSpec, array: np.ndarray, dtype, placer: Placer, cfg: ModelConfig,
          where: str) -> None:
    """Write one tensor in HF layout (`array`, numpy, spec.hf_shape) into `params`: through `placer` (a kernel
    transposed to [in, out] first), a layer into its slot of the stack. A fused tensor (Phi-3 qkv_proj /
    gate_up_proj) is split by rows into its projections' kernels; one expert's projection (MoE kind "expert")
    goes into its slot of the [L, E, in, out] expert stack. `where` names the tensor and file in errors."""
    if spec.kind == "fused":
        for part, start, end in fused_parts(spec):
            place(params, part, array[start:end], dtype, placer, cfg, where)
        return
    value = placer(spec, _to_param_layout(array, spec), jnp.float32 if spec.keep_fp32 else dtype)
    if spec.layer is None:
        set_path(params, spec.path, value)
    elif spec.kind == "expert":
        set_path(params, spec.path, _into_expert_stack(params, spec, value, cfg))
    else:
        set_path(params, spec.path, _into_stack(params, spec, value, stack_shape(cfg, spec)[0], where))


def load_params(
    model_dir: str | os.PathLike,
    cfg: ModelConfig,
    dtype=jnp.bfloat16,
    *,
    placer: Placer | None = None,
    progress: bool = True,
    bnb_4bit: bool = False,
) -> Params:
    """Read every tensor of the checkpoint in `model_dir` into the param dict of `cfg` in `dtype`.

    Raises MissingTensorError / UnexpectedTensorError / ShapeMismatchError naming the tensor and file.
    A `placer` may return a pytree of arrays (e.g. an NF4 weight) for kernels; like plain arrays, each layer is
    written into its slot of a preallocated stack, so loading never holds a layer-stacked param twice.
    `bnb_4bit=True` reads a checkpoint pre-quantized by bitsandbytes (NF4, as transformers saves it): projection
    weights come with their quant-state tensors and load as NF4 weights without re-quantizing.
    """
    placer = placer or default_placer
    files = checkpoint_files(model_dir)
    params: Params = {}
    seen: set[str] = set()
    tied_head_in_file = False
    unexpected: list[str] = []
    handles = {path: SafetensorsFile(path) for path in files}
    where = {name: path for path, f in handles.items() for name in f.keys()}
    layout = source_layout(cfg)  # a multimodal checkpoint: its text names respelled, its towers left on disk
    specs = tensor_specs(cfg, detect_expert_layout(cfg, where) if cfg.is_moe else None)
    fused = [name for name, spec in specs.items() if spec.kind == "fused"]
    if bnb_4bit and fused:
        for f in handles.values():
            f.close()
        raise ConfigError(f"{model_dir}: a {cfg.model_type} checkpoint pre-quantized by bitsandbytes holds fused "
                          f"projections ({fused[0]}, ...); splitting a 4-bit tensor is not supported: load the "
                          "16-bit checkpoint with load_in_4bit=True instead")
    bar = tqdm(total=len(where), desc=f"Loading {Path(model_dir).name}", unit="tensor", disable=not progress, leave=False)
    try:
        for path, f in handles.items():
            for stored in f.keys():
                bar.update(1)
                name = layout.text_name(stored) if layout is not None else stored
                if name is None:
                    continue  # a tower tensor: not part of the text decoder (the merged export copies it)
                spec = specs.get(name)
                if bnb_4bit and spec is None and name.endswith(BNB_SUFFIXES):
                    continue  # read together with its weight
                if spec is None:
                    if name == "lm_head.weight" and cfg.tie_word_embeddings:
                        tied_head_in_file = True  # some writers keep the tied copy; it equals the embedding
                        continue
                    if name.endswith("rotary_emb.inv_freq"):
                        continue  # older checkpoints store the RoPE table; it is derived from the config
                    if mtp_layer_tensor(cfg, name):
                        continue  # GLM-4.5's multi-token-prediction layers: not part of the causal LM
                    if ignored_tensor(cfg, name):
                        continue  # Qwen3.5's mtp.* / model.visual.*, which transformers' causal LM skips too
                    unexpected.append(f"{stored} (in {path.name})")
                    continue
                if name in seen:
                    raise UnexpectedTensorError(f"{path}: tensor '{name}' appears in more than one file")
                seen.add(name)
                if bnb_4bit and spec.kind == "kernel":
                    value = _bnb_weight(stored, spec, handles, where)
                    set_path(params, spec.path, _into_stack(params, spec, value, stack_shape(cfg, spec)[0],
                                                            f"{path}: tensor '{stored}'"))
                    continue
                if tuple(f.shape(stored)) != spec.hf_shape:
                    raise ShapeMismatchError(
                        f"{path}: tensor '{stored}' has shape {list(f.shape(stored))}, but config.json implies "
                        f"{list(spec.hf_shape)}"
                    )
                place(params, spec, f.get(stored), dtype, placer, cfg, f"{path}: tensor '{stored}'")
    finally:
        bar.close()
        for f in handles.values():
            f.close()
    if unexpected:
        shown = ", ".join(unexpected[:8]) + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else "")
        raise UnexpectedTensorError(
            f"{model_dir}: checkpoint has tensors that a {cfg.model_type} model with this config.json does not use: {shown}"
        )
    missing = [n if layout is None else layout.stored_name(n) for n in specs if n not in seen]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise MissingTensorError(f"{model_dir}: checkpoint is missing {len(missing)} tensor(s): {shown}")
    if tied_head_in_file:
        log.debug("ignored lm_head.weight: embeddings are tied in config.json")
    return params


def load_model(model_dir: str | os.PathLike, cfg: ModelConfig, dtype=jnp.bfloat16, *, model_class=CausalLM,
               placer: Placer | None = None, progress: bool = True, bnb_4bit: bool = False):
    """A `model_class` (CausalLM or a subclass) computing in `dtype`, holding the checkpoint in `model_dir`.

    Arguments as `load_params`; the model's `model_dir` is set to the directory."""
    values = load_params(model_dir, cfg, dtype, placer=placer, progress=progress, bnb_4bit=bnb_4bit)
    return model_from_params(values, cfg, dtype, model_class, model_dir)


def model_from_params(values: Params, cfg: ModelConfig, dtype, model_class, source) -> CausalLM:
    """A `model_class` built abstractly (no memory) and filled with `values`; its model_dir is `source`."""
    model = nnx.eval_shape(lambda: model_class(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    fill(model, values)
    model.model_dir = str(source)
    return model
