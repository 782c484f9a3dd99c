"""The weights a rollout decodes with, prepared once per `generate` call from the model's live state.

The trainer keeps each projection's layers stacked ([L, in, out]); a decode step that slices layer i out of
the stack inside the compiled program gets a copy of that slice every step (XLA's GEMM fusions do not read a
slice in place), which on the H200 doubled the step at 1.5B (BENCHMARKS.md, generation). Three layouts:

  "shared"  the stacked base weights as they are (no second copy), sliced in the step; the LoRA factors
            cast to the compute dtype and split per layer once per rollout (a few MiB).
  "copy"    every layer's weights as their own arrays: one copy of the base weights per rollout (freed after
            it), LoRA unmerged as in "shared". Same numbers as "shared".
  "merged"  as "copy", with each projection's LoRA pair folded into its kernel (W + scale A B, in the compute
            dtype): the fastest step, a full copy of the weights, and the LoRA delta rounded into W (16-bit
            bases only).
  "merged_buffer"  the stacked layout of "shared" with each LoRA projection's kernel replaced by W + scale A B,
            written by one jitted merge per rollout into a buffer of the base kernel's shape that the caller
            keeps (`MergeBuffers`) and donates to the next merge: the decode step of "merged" without its
            LoRA reads, one extra copy of the projection kernels held across rollouts, not one more per rollout
            (16-bit bases only).
  "fp8"     the stacked layout of "shared" with each dense projection kernel replaced by an e4m3 copy
            (per-output-channel scales: pallas_kernels.fp8.quantize_fp8_weight, the load_in_fp8 format) made
            once per base kernel and kept by the caller (`FP8Copies`; the base is frozen), LoRA unmerged in the
            compute dtype: decoding reads half the bytes of a 16-bit base; the tokens are the FP8 model's, close
            to the 16-bit ones (tests/test_fp8_rollouts.py measures how close).
  "auto"    "merged_buffer" when the model has LoRA on a 16-bit base and the merged copy fits in MERGE_FRACTION
            of the free device memory, else "shared" (`choose_layout`; the engine resolves it once and prints
            its choice in one line).

`DecodeWeights` holds the arrays (a pytree the compiled functions take); `LayerPlan` the static side.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from unsloth_jax import ops
from unsloth_jax.backend import commit_to_devices
from unsloth_jax.config import layer_slot, stack_holders
from unsloth_jax.models.layer_stack import layer_graphdefs, layer_rows
from pallas_kernels.fp8 import FP8Weight, quantize_fp8_weight
from pallas_kernels.nf4_format import NF4Weight

WEIGHT_MODES = ("shared", "copy", "merged", "merged_buffer", "fp8", "auto")
MERGE_FRACTION = 0.25  # "auto" merges when the merged kernels take at most this share of the free device memory


class LayerPlan(NamedTuple):
    """Static side of the decode weights: the model graphdef, the layer graphdefs (one per set of stacked
    submodules a layer lacks: layer_stack.layer_graphdef; Qwen3.5's two mixers give two), which one each layer
    merges into (`kind`, length L), each layer's rows in the stacked submodules it holds (`rows`: (name, row)
    pairs, config.stack_holders) and whether layers are sliced in-step."""

    graphdef: nnx.GraphDef
    layer_graphdefs: tuple
    kind: tuple[int, ...]
    rows: tuple[tuple[tuple[str, int], ...], ...]
    sliced: bool  # True: the stacked part is sliced inside the step ("shared")


def _plan(graphdef, layers, cfg, sliced: bool) -> LayerPlan:
    """The LayerPlan of the stacked layer module `layers` (its graphdef, or a clone's of the same structure)."""
    graphdefs, kind = layer_graphdefs(layers, cfg)
    subs = tuple(nnx.state(layers).keys())
    rows = tuple(tuple((sub, layer_slot(cfg, sub, i)) for sub in subs if i in stack_holders(cfg, sub))
                 for i in range(cfg.num_hidden_layers))
    return LayerPlan(graphdef, graphdefs, kind, rows, sliced)


class DecodeWeights(NamedTuple):
    """state: the whole model's state (embeddings, final norm, head; the layer stack is read only when sliced);
    stacked: the layer state part sliced in the step, or None; per_layer: a tuple over the L layers of tuples of
    states (the LoRA factors in "shared"; the whole layer otherwise) that make up the layer with its slice."""

    state: nnx.State
    stacked: nnx.State | None
    per_layer: tuple


def _cast_lora(tree, dtype):
    return jax.tree.map(lambda a: a.astype(dtype), tree)


def _unstack(tree, cfg) -> tuple:
    """A stacked layer state -> its L layers' parts (layer_stack.layer_rows)."""
    return tuple(layer_rows(tree, cfg, i) for i in range(cfg.num_hidden_layers))


def _split_lora(lora_state, cfg, dtype):
    return tuple((s,) for s in _unstack(_cast_lora(lora_state, dtype), cfg))


def _copy_layers(base_state, lora_state, cfg, dtype):
    return tuple(zip(_unstack(base_state, cfg), _unstack(_cast_lora(lora_state, dtype), cfg)))


_split_lora = jax.jit(_split_lora, static_argnums=(1, 2))
_copy_layers = jax.jit(_copy_layers, static_argnums=(2, 3))


def _projections(layer_module):
    """Every Linear of a (stacked) decoder layer (decoder.layer_projections: Gemma 4's global_attn, wide_mlp, ...)."""
    from unsloth_jax.models.decoder import layer_projections

    return iter(layer_projections(layer_module).values())


class MergeBuffers:
    """The merged kernels of "merged_buffer" between rollouts: one array per LoRA projection, in the order of
    the layer stack's projections, each donated to the next rollout's merge (so it is rewritten in place)."""

    def __init__(self):
        self.kernels: list[jax.Array] = []


class FP8Copies:
    """The e4m3 copies of "fp8", one per projection in the order of the layer stack's projections, each with the
    base kernel it was made from (remade when that kernel is another array)."""

    def __init__(self):
        self.copies: list[tuple[jax.Array, FP8Weight]] = []


def prepare(model, mode: str = "shared", buffers: MergeBuffers | FP8Copies | None = None
            ) -> tuple[LayerPlan, DecodeWeights]:
    """The decode weights of `model` (a CausalLM) in layout `mode` (WEIGHT_MODES other than "auto", which
    `choose_layout` resolves). buffers: the MergeBuffers "merged_buffer" writes into, or the FP8Copies "fp8"
    reuses (a fresh one if None or of the other kind)."""
    if mode not in WEIGHT_MODES or mode == "auto":
        raise ValueError(f"weights={mode!r}: use one of {WEIGHT_MODES[:-1]} (resolve 'auto' by choose_layout)")
    commit_in_place(model)
    graphdef, state = nnx.split(model)
    layers = model.model.layers
    cfg, dtype = model.config, model.dtype
    if mode == "merged":
        return _prepare_merged(graphdef, state, layers, cfg, dtype)
    if mode == "merged_buffer":
        keep = buffers if isinstance(buffers, MergeBuffers) else MergeBuffers()
        return _prepare_merged_buffer(graphdef, state, layers, cfg, dtype, keep)
    if mode == "fp8":
        return _prepare_fp8(graphdef, state, layers, cfg, dtype, buffers if isinstance(buffers, FP8Copies)
                            else FP8Copies())
    _, lora_state, base_state = nnx.split(layers, nnx.LoRAParam, ...)
    if mode == "shared":
        per_layer = _split_lora(lora_state, cfg, jnp.dtype(dtype))
        return _plan(graphdef, layers, cfg, True), DecodeWeights(state, base_state, per_layer)
    per_layer = _copy_layers(base_state, lora_state, cfg, jnp.dtype(dtype))
    return _plan(graphdef, layers, cfg, False), DecodeWeights(state, None, per_layer)


def commit_in_place(model) -> None:
    """Commit `model`'s arrays that are not yet (same buffers and values; backend.commit_to_devices says why): a
    trainer writes back committed arrays where the loader left uncommitted ones, and jax.jit keys its programs
    on that, so without this a generate after training compiled every engine program again. Done once per model:
    later calls find every array committed and change nothing."""
    state = nnx.state(model)
    if any(isinstance(a, jax.Array) and not a.committed for a in jax.tree.leaves(state)):
        nnx.update(model, commit_to_devices(state))


def _merged_kernel(kernel, a, b, scale, dtype):
    w = kernel.astype(jnp.float32) + scale * jnp.einsum("lir,lro->lio", a.astype(jnp.float32), b.astype(jnp.float32))
    return w.astype(dtype)


def _quantized_base(layers) -> bool:
    return any(isinstance(lin.kernel.get_value(), (NF4Weight, FP8Weight)) for lin in _projections(layers))


def merged_bytes(model) -> int:
    """Bytes of the merged kernels "merged_buffer" keeps: every projection with LoRA, in the compute dtype."""
    itemsize = jnp.dtype(model.dtype).itemsize
    return sum(int(lin.kernel.get_value().size) * itemsize for lin in _projections(model.model.layers)
               if lin.lora_a is not None)


def choose_layout(model, free_bytes: int | None) -> tuple[str, str]:
    """Resolve weights="auto" for `model` with free_bytes of free device memory (None: unknown, as on a CPU)
    -> (layout, the reason in a few words)."""
    if hasattr(model, "vl_config"):  # the vision-language engine path reads the LoRA (its towers' too) unmerged
        return "shared", "a vision-language model's LoRA read unmerged"
    layers = model.model.layers
    if not any(lin.lora_a is not None for lin in _projections(layers)):
        return "shared", "no LoRA to merge"
    if _quantized_base(layers):
        return "shared", "LoRA read unmerged on the 4-bit / FP8 base"
    need = merged_bytes(model)
    if free_bytes is not None and need > MERGE_FRACTION * free_bytes:
        return "shared", (f"LoRA read unmerged: a merged copy ({need / 2**30:.2f} GiB) exceeds {MERGE_FRACTION:g} of "
                          f"the free {free_bytes / 2**30:.2f} GiB")
    return "merged_buffer", f"LoRA merged into a reused {need / 2**30:.2f} GiB buffer once per rollout"


def _prepare_merged(graphdef, state, layers, cfg, dtype):
    if _quantized_base(layers):
        raise ValueError("weights='merged' needs a 16-bit base; this model's projections are 4-bit or FP8 "
                         "(use weights='shared')")
    # A module of the same structure with every LoRA pair folded into its kernel and dropped.
    clone = nnx.merge(*nnx.split(layers), copy=True)  # own Variables: the model's kernels stay as they are
    merged = {}
    for lin in _projections(clone):
        if lin.lora_a is not None:
            merged[id(lin)] = (lin, lin.kernel.get_value(), lin.lora_a.get_value(), lin.lora_b.get_value(),
                               float(lin.lora_scale))
    for lin, kernel, a, b, scale in merged.values():
        lin.kernel.set_value(_merged_kernel_jit(kernel, a, b, scale, jnp.dtype(dtype)))
        lin.lora_a = lin.lora_b = None
        lin.lora_scale = None
    per_layer = tuple((s,) for s in _unstack_jit(nnx.state(clone), cfg))
    return _plan(graphdef, clone, cfg, False), DecodeWeights(state, None, per_layer)


_merged_kernel_jit = jax.jit(_merged_kernel, static_argnums=(3, 4))


def _merge_into(buffer, kernel, a, b, scale):
    """W + scale A B in buffer's dtype, written over `buffer` (donated: same shape and dtype as the result)."""
    return _merged_kernel(kernel, a, b, scale, buffer.dtype)


_merge_into_jit = jax.jit(_merge_into, static_argnums=(4,), donate_argnums=(0,))


def _prepare_merged_buffer(graphdef, state, layers, cfg, dtype, buffers: MergeBuffers):
    """"merged_buffer": a stacked layer module whose LoRA kernels are the merged buffers (rewritten in place by
    this rollout's merge; allocated on the first), its LoRA pairs dropped; sliced in the step as "shared"."""
    if _quantized_base(layers):
        raise ValueError("weights='merged_buffer' needs a 16-bit base; this model's projections are 4-bit or FP8 "
                         "(use weights='shared')")
    clone = nnx.merge(*nnx.split(layers), copy=True)  # own Variables (same arrays): the model's stay
    lora = [lin for lin in _projections(clone) if lin.lora_a is not None]
    old = buffers.kernels
    fresh = []
    for k, lin in enumerate(lora):
        kernel, a, b = lin.kernel.get_value(), lin.lora_a.get_value(), lin.lora_b.get_value()
        scale = float(lin.lora_scale)
        if k < len(old) and old[k].shape == kernel.shape and old[k].dtype == jnp.dtype(dtype):
            merged = _merge_into_jit(old[k], kernel, a, b, scale)
        else:
            merged = _merged_kernel_jit(kernel, a, b, scale, jnp.dtype(dtype))
        fresh.append(merged)
        lin.kernel.set_value(merged)
        lin.lora_a = lin.lora_b = None
        lin.lora_scale = None
    buffers.kernels = fresh
    return (_plan(graphdef, clone, cfg, True),
            DecodeWeights(state, nnx.state(clone), tuple(() for _ in range(cfg.num_hidden_layers))))


_unstack_jit = jax.jit(_unstack, static_argnums=(1,))


def _prepare_fp8(graphdef, state, layers, cfg, dtype, copies: FP8Copies):
    """"fp8": a stacked layer module whose dense projection kernels are e4m3 copies (made once per base kernel),
    LoRA unmerged and split per layer as in "shared"."""
    from unsloth_jax.models.layers import FP8Param

    if _quantized_base(layers):
        raise ValueError("weights='fp8' needs a 16-bit base; this model's projections are already 4-bit or FP8 "
                         "(use weights='shared')")
    clone = nnx.merge(*nnx.split(layers), copy=True)  # own Variables: the model keeps its kernels
    old = copies.copies
    fresh = []
    for k, lin in enumerate(_projections(clone)):
        kernel = lin.kernel.get_value()
        fp8 = old[k][1] if k < len(old) and old[k][0] is kernel else quantize_fp8_weight(kernel)
        fresh.append((kernel, fp8))
        lin.kernel = FP8Param(fp8)
    copies.copies = fresh
    _, lora_state, base_state = nnx.split(clone, nnx.LoRAParam, ...)
    per_layer = _split_lora(lora_state, cfg, jnp.dtype(dtype))
    return _plan(graphdef, clone, cfg, True), DecodeWeights(state, base_state, per_layer)


def _is_projection_kernel(path) -> bool:
    from unsloth_jax.models.decoder import PROJ_PARENT

    names = [getattr(k, "key", None) for k in path]
    return len(names) >= 3 and names[-2] == "kernel" and names[-3] in PROJ_PARENT and "experts" not in names


def layer_module(plan: LayerPlan, weights: DecodeWeights, i: int, *, in_place: bool = False):
    """Layer i as a module, inside a traced function: its slice of the stack and its own arrays. in_place
    (decode steps of a "shared" plan): the projection kernels (dense, or NF4) stay `ops.LayerSlice`s of the
    stack, which `ops.linear` reads in place when its decode kernel is chosen (and slices otherwise)."""
    parts = list(weights.per_layer[i])
    if plan.sliced:
        def pick(path, a, r):
            if isinstance(a, NF4Weight):
                if in_place and len(a.stack_shape) == 1 and _is_projection_kernel(path):
                    return ops.LayerSlice(a, r)
                return jax.tree.map(lambda v: v[r], a)
            if in_place and a.ndim == 3 and jnp.issubdtype(a.dtype, jnp.floating) and _is_projection_kernel(path):
                return ops.LayerSlice(a, r)
            return a[r]

        parts.insert(0, nnx.State({
            sub: jax.tree_util.tree_map_with_path(lambda path, a, r=r: pick(path, a, r),
                                                  weights.stacked[sub], is_leaf=lambda a: isinstance(a, NF4Weight))
            for sub, r in plan.rows[i]}))
    return nnx.merge(plan.layer_graphdefs[plan.kind[i]], *parts)


__all__ = ["WEIGHT_MODES", "MERGE_FRACTION", "LayerPlan", "DecodeWeights", "MergeBuffers", "FP8Copies", "prepare",
           "choose_layout",
           "merged_bytes", "layer_module", "commit_in_place"]
