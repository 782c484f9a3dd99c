"""The layer stack: how the L decoder layers run in training and decoding, and what they keep for the backward pass.

    policy = LayerStackPolicy.parse("offload")                  # or use_gradient_checkpointing=..., remat=...
    x, kv = run_layers(model.model.layers, cfg, x, cos, sin, batch, policy=policy)

`LayerStackPolicy` is the one value that says how the stack saves, recomputes and offloads (frozen, hashable,
compared by value; traced code holds it as a static Python value: a train step closes over its own, and it is part of
the model's graphdef, so another policy is another compiled program, never a stale one). Its fields are enums
(Checkpoint, Offload, LayerLoop, OffloadAttention, OffloadWeights, OffloadCopies; StrEnums, so a member also
equals its string). `LayerStackPolicy.parse` is the one function that reads what users type; it runs where the
user gives the value (get_peft_model / from_pretrained's use_gradient_checkpointing and layers_per_checkpoint,
the CLI's --use_gradient_checkpointing, the step factory's remat: unsloth_jax.train.step.make_step), the policy
is stored on the model as `model.gradient_checkpointing`, and everything below (the steps' losses, the decoder,
`run_layers`) takes the typed value. Its fields:

    checkpoint             what each layer keeps for its backward pass: "none" (everything: no recomputation),
                           "full" (its input only; the layer is recomputed), "save_attention" (its input, and q, k,
                           v after RoPE and the attention output: no recomputation of the q/k/v projections)
    offload                what goes to pinned host memory instead of staying on the device: "none", "inputs"
                           (the layer inputs), "inputs_and_attention" (and attention's forward residuals: its
                           output and softmax statistics, so the backward pass does not rerun attention's forward)
    layers_per_checkpoint  K > 1: two-level checkpointing (below), only every K-th layer input kept
    layer_loop             "scan" (one lax.scan over the stacked weights) or "unrolled" (unroll=True: straight-line
                           code, each layer's weights a static slice; longer compiles)
    offload_attention      how "inputs_and_attention" runs: "scan" (models.offload's prefetched custom-VJP scan)
                           or "policy" (jax's offload policy under jax.checkpoint)
    offload_weights        that scan slices each layer's weights one iteration ahead ("prefetch") or at the
                           iteration's start ("in_step"); "auto": prefetch where attention's residuals are kept
    offload_copies         its host copies in row blocks of at most 32 MiB ("blocks") or whole ("whole")

Its name (str(policy)) is the remat mode users know, and `parse` reads it back: "none", "full", "offload"
(Unsloth's use_gradient_checkpointing="unsloth"), "offload_attention", "save_attention", the two-level
"full_every_K" / "offload_every_K", each followed by any non-default setting: "offload,layer_loop=unrolled".
`parse` also takes Unsloth's False / True / "unsloth". A policy compares equal to its name.

`run_layers` runs the stack segment by segment (`ModelConfig.layer_segments`): a segment is a run of consecutive
layers that repeats one group of layer kinds (window, MLP kind, RoPE choice, token mixer), and each segment is one
`lax.scan` over its groups, merging one layer's slice of the stacked state into a module per step (`nnx.merge`), so
compile time grows with the number of distinct segments and their group sizes, not with depth, and each layer of a
group keeps a static attention window, RoPE table, MLP kind and token mixer. Most families are one segment with
groups of 1 layer; Gemma 2's groups are 2 (sliding, global), Gemma 3's 6 with a tail segment (26 = 4 x 6 + 2);
Qwen3.5's 3 linear-attention : 1 full-attention layers are groups of 4; GLM-4.5's [dense, dense, MoE x 58] is two
segments of 1-layer groups, not 60 unrolled layers. Each group runs under `jax.checkpoint` (`checkpointed`), except
that the host-offload modes in training go through `models.offload.offloaded_layer_scan` (the prefetched custom-VJP
scan) instead, one per segment (except for Gemma 4's per-layer inputs and KV-shared layers, whose values cross
segments: jax's offload policy runs those).

Two-level checkpointing (layers_per_checkpoint = K > 1, for long sequences): the scan groups are themselves
grouped K layers at a time (K rounded up to a multiple of the segment's group size), an outer scan runs over those
checkpointed groups, whose inputs alone are kept across the stack (on the device, or in pinned host memory), and
each runs an inner scan of per-layer "full" remat: the backward pass recomputes one checkpointed group (one extra
forward of it), keeping its K layer inputs while its layers' backward runs. Kept layer inputs: L/K + K instead of L.

Adding a remat mode: a row of MODES (its name -> (checkpoint, offload)), and, for a new checkpoint or offload
value, a member of Checkpoint / Offload and its jax.checkpoint policy in `_jax_policy` (or its own path in
`run_layers`); parsing, naming, the API, the CLI and the steps follow. A new setting: an enum (default member
first), a row of SETTINGS and a field of that name, read in `run_layers`.
"""
from __future__ import annotations

import dataclasses
import enum
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import Offloadable, Recompute, checkpoint_name

from unsloth_jax.config import ModelConfig, stack_holders
from unsloth_jax.models.attention import Batch, KVCache
from unsloth_jax.models.layers import gathered
from unsloth_jax.models.offload import OFFLOAD_CHUNK_BYTES, offloaded_layer_scan


class Checkpoint(enum.StrEnum):
    """What each layer keeps for its backward pass (module docstring)."""
    NONE = "none"
    FULL = "full"
    SAVE_ATTENTION = "save_attention"


class Offload(enum.StrEnum):
    """What goes to pinned host memory instead of staying on the device."""
    NONE = "none"
    INPUTS = "inputs"
    INPUTS_AND_ATTENTION = "inputs_and_attention"


class LayerLoop(enum.StrEnum):
    """How the stack loops over its layers: one lax.scan, or unrolled straight-line code."""
    SCAN = "scan"
    UNROLLED = "unrolled"


class OffloadAttention(enum.StrEnum):
    """How "inputs_and_attention" runs: the prefetched custom-VJP scan, or jax's offload policy."""
    SCAN = "scan"
    POLICY = "policy"


class OffloadWeights(enum.StrEnum):
    """When the prefetched scan slices each layer's weights."""
    AUTO = "auto"
    PREFETCH = "prefetch"
    IN_STEP = "in_step"


class OffloadCopies(enum.StrEnum):
    """The prefetched scan's host copies: in row blocks, or whole."""
    BLOCKS = "blocks"
    WHOLE = "whole"


# The per-layer remat modes by name: (what each layer keeps, what goes to pinned host memory).
MODES = {
    "none": (Checkpoint.NONE, Offload.NONE),
    "full": (Checkpoint.FULL, Offload.NONE),
    "offload": (Checkpoint.FULL, Offload.INPUTS),
    "offload_attention": (Checkpoint.FULL, Offload.INPUTS_AND_ATTENTION),
    "save_attention": (Checkpoint.SAVE_ATTENTION, Offload.NONE),
}
REMAT_MODES = tuple(MODES)
TWO_LEVEL_BASES = ("full", "offload")  # the per-layer modes a two-level mode "<base>_every_<K>" builds on
# Unsloth's use_gradient_checkpointing values (parse takes them besides the names) and the mode each means
UNSLOTH_VALUES = {False: "none", None: "none", True: "full", "unsloth": "offload"}
# The settings that are not the mode itself: field name -> its enum (the first member is the default).
SETTINGS = {
    "layer_loop": LayerLoop,
    "offload_attention": OffloadAttention,
    "offload_weights": OffloadWeights,
    "offload_copies": OffloadCopies,
}
FIELDS = {"checkpoint": Checkpoint, "offload": Offload, **SETTINGS}  # every enum field and its type
OFFLOAD_SETTINGS = ("offload_attention", "offload_weights", "offload_copies")  # read under host offload only

ATTENTION_NAMES = ("attn_q", "attn_k", "attn_v", "attn_out")  # the values "save_attention" keeps
# The residuals of attention's forward pass that its backward reads besides q, k, v ("offload_attention" keeps
# them): the outputs of cuDNN's fused forward (jax.nn.dot_product_attention, implementation="cudnn": the
# attention output and the softmax statistics), by primitive name, and the flash kernel's, by checkpoint name.
CUDNN_ATTENTION_FORWARD = ("dot_product_attention_fwd_wrapper", "dot_product_attention_fwd")
FLASH_RESIDUAL_NAMES = ("flash_out", "flash_lse")  # pallas_kernels.flash_attention names them


def _member(name: str, value, kind: type[enum.StrEnum]) -> enum.StrEnum:
    """`value` (a member of `kind` or its string) as the member; ValueError naming the field otherwise."""
    if isinstance(value, str) and value in kind._value2member_map_:
        return kind(value)
    raise ValueError(f"LayerStackPolicy: {name} must be one of {', '.join(repr(m.value) for m in kind)}, "
                     f"got {value!r}")


@dataclasses.dataclass(frozen=True, eq=False)
class LayerStackPolicy:
    """How the layer stack saves, recomputes and offloads (module docstring). Frozen and hashable; equal to
    another policy with the same fields, and to its name (`str(policy)`, which `parse` reads back)."""

    checkpoint: Checkpoint = Checkpoint.NONE
    offload: Offload = Offload.NONE
    layers_per_checkpoint: int = 1
    layer_loop: LayerLoop = LayerLoop.SCAN
    offload_attention: OffloadAttention = OffloadAttention.SCAN
    offload_weights: OffloadWeights = OffloadWeights.AUTO
    offload_copies: OffloadCopies = OffloadCopies.BLOCKS

    def __post_init__(self):
        for name, kind in FIELDS.items():  # strings of the members are taken as the members
            object.__setattr__(self, name, _member(name, getattr(self, name), kind))
        if (self.checkpoint, self.offload) not in MODES.values():
            raise ValueError(f"LayerStackPolicy: checkpoint={self.checkpoint.value!r} with "
                             f"offload={self.offload.value!r} is "
                             f"not a remat mode; the modes: "
                             + ", ".join(f"{m} = ({c}, {o})" for m, (c, o) in MODES.items()))
        k = self.layers_per_checkpoint
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"layers_per_checkpoint must be an integer >= 1, got {k!r}")
        if k > 1 and self.mode not in TWO_LEVEL_BASES:
            raise ValueError(f"layers_per_checkpoint needs gradient checkpointing on the device or with host "
                             f"offload (remat mode one of {TWO_LEVEL_BASES}), got remat mode {self.mode!r}")

    # ---- names
    @property
    def mode(self) -> str:
        """The per-layer remat mode: a key of MODES."""
        return next(m for m, pair in MODES.items() if pair == (self.checkpoint, self.offload))

    @property
    def name(self) -> str:
        """"offload", "full_every_4", "offload,layer_loop=unrolled": the mode, then the non-default settings."""
        k = self.layers_per_checkpoint
        head = self.mode if k == 1 else f"{self.mode}_every_{k}"
        return ",".join([head] + [f"{s}={getattr(self, s)}" for s, kind in SETTINGS.items()
                                  if getattr(self, s) is not next(iter(kind))])

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"LayerStackPolicy({self.name!r})"

    def __eq__(self, other):
        if isinstance(other, LayerStackPolicy):
            return dataclasses.astuple(self) == dataclasses.astuple(other)
        if isinstance(other, str):
            return self.name == other
        return NotImplemented

    def __hash__(self):
        return hash(self.name)  # equal policies have equal names, and a policy equals its name

    @classmethod
    def parse(cls, value, layers_per_checkpoint: int = 1, *, argument: str = "remat") -> "LayerStackPolicy":
        """The policy of a user's value: a LayerStackPolicy (as it is), a name (class docstring: "offload",
        "full_every_4", "offload_attention,offload_weights=in_step"), or Unsloth's False / True / "unsloth".
        layers_per_checkpoint > 1 makes a per-layer mode two-level. ValueError naming `argument` otherwise."""
        if isinstance(value, cls):
            policy = value
        else:
            if isinstance(value, bool) or value is None:
                value = UNSLOTH_VALUES[value]
            if not isinstance(value, str):
                raise ValueError(f"{argument}: unknown remat mode {value!r}; {_SYNTAX}")
            head, *items = (s.strip() for s in value.split(","))
            head = UNSLOTH_VALUES.get(head, head)
            base, sep, k = head.partition("_every_")
            if head in MODES:
                base, k = head, 1
            elif sep and base in TWO_LEVEL_BASES and k.isdigit() and int(k) >= 1 and k == str(int(k)):
                k = int(k)
            else:
                raise ValueError(f"{argument}: unknown remat mode {head!r} in {value!r}; {_SYNTAX}")
            settings = {}
            for item in items:
                key, eq, choice = (s.strip() for s in item.partition("="))
                if not eq or key not in SETTINGS or choice not in SETTINGS[key]._value2member_map_:
                    raise ValueError(f"{argument}: {item!r} in {value!r} is not a layer-stack setting; "
                                     + "; ".join(f"{s}: {'|'.join(m.value for m in c)}" for s, c in SETTINGS.items()))
                settings[key] = choice
            checkpoint, offload = MODES[base]
            policy = cls(checkpoint, offload, k, **settings)
        return policy.with_layers_per_checkpoint(layers_per_checkpoint, f"{argument}={value!r}")

    def with_layers_per_checkpoint(self, k: int, given: str | None = None) -> "LayerStackPolicy":
        """The policy made two-level with every k-th layer input kept (k = 1: as it is); a ValueError if it
        already keeps another K (`given`: how the user wrote the policy, for the message)."""
        if k == 1:
            return self
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"layers_per_checkpoint must be an integer >= 1, got {k!r}")
        if self.layers_per_checkpoint not in (1, k):
            raise ValueError(f"{given or repr(self)} already keeps every {self.layers_per_checkpoint}-th "
                             f"layer input; layers_per_checkpoint={k} contradicts it")
        return dataclasses.replace(self, layers_per_checkpoint=k)

    def without_host_offload(self) -> "LayerStackPolicy":
        """The same policy with its host offload dropped (plain remat on the device; the offload-only settings
        back to their defaults): the fallback where the backend has no pinned host memory."""
        if self.offload is Offload.NONE:
            return self
        return dataclasses.replace(self, offload=Offload.NONE,
                                   **{k: next(iter(SETTINGS[k])) for k in OFFLOAD_SETTINGS})

    # ---- what the layer stack reads
    @property
    def offload_scan(self) -> bool:
        """Whether the host offload runs as models.offload's prefetched custom-VJP scan (for one checkpointed
        layer group at a time; run_layers uses it in training without router statistics)."""
        return self.offload is Offload.INPUTS or (self.offload is Offload.INPUTS_AND_ATTENTION
                                                  and self.offload_attention is OffloadAttention.SCAN)

    @property
    def prefetch_weights(self) -> bool:
        """Whether that scan slices each layer's weights one iteration ahead (auto: with attention's residuals
        kept, where it measured faster)."""
        if self.offload_weights is OffloadWeights.AUTO:
            return self.offload is Offload.INPUTS_AND_ATTENTION
        return self.offload_weights is OffloadWeights.PREFETCH

    @property
    def copy_chunk_bytes(self) -> int | None:
        """The largest piece of that scan's host copies (None: whole arrays)."""
        return OFFLOAD_CHUNK_BYTES if self.offload_copies is OffloadCopies.BLOCKS else None


def require_policy(value, argument: str) -> LayerStackPolicy:
    """`value` if it is a LayerStackPolicy; a TypeError naming `argument` otherwise (code below the API takes the
    parsed value: LayerStackPolicy.parse runs where the user gives it)."""
    if not isinstance(value, LayerStackPolicy):
        raise TypeError(f"{argument} must be a LayerStackPolicy (LayerStackPolicy.parse reads what users type), "
                        f"got {value!r}")
    return value


_SYNTAX = (f"use one of {', '.join(REMAT_MODES)}, a two-level mode (\"full_every_K\", \"offload_every_K\", K >= 1), "
           "Unsloth's False / True / \"unsloth\", or a LayerStackPolicy; layer-stack settings follow the mode after "
           "commas (\"offload,layer_loop=unrolled\")")
NO_REMAT = LayerStackPolicy()
FULL = LayerStackPolicy("full")


@dataclasses.dataclass(frozen=True)
class OffloadWithAttention:
    """Remat policy of "offload_attention": the value named `offloaded` and attention's forward residuals
    (CUDNN_ATTENTION_FORWARD outputs, FLASH_RESIDUAL_NAMES) go to pinned host memory; everything else is
    recomputed (the policy outcomes jax.ad_checkpoint.Offloadable / Recompute)."""

    offloaded: str

    def __call__(self, prim, *_, **params):
        named = params.get("name") if prim.name == "name" else None
        if named == self.offloaded or attention_residuals_saveable(prim, **params):
            return Offloadable(src="device", dst="pinned_host")
        return Recompute


def attention_residuals_saveable(prim, *_, **params) -> bool:
    """Remat policy keeping attention's forward residuals (CUDNN_ATTENTION_FORWARD outputs, FLASH_RESIDUAL_NAMES)
    and recomputing the rest: the prefetched "offload_attention" scan sends what it keeps to pinned host memory."""
    return prim.name in CUDNN_ATTENTION_FORWARD or (prim.name == "name"
                                                     and params.get("name") in FLASH_RESIDUAL_NAMES)


def _jax_policy(policy: LayerStackPolicy, offloaded: str):
    """The jax.checkpoint policy of one checkpointed unit under `policy`'s checkpoint and offload; the value
    named `offloaded` (the unit's input) is what "inputs" sends to pinned host memory."""
    if policy.checkpoint is Checkpoint.SAVE_ATTENTION:
        return jax.checkpoint_policies.save_only_these_names(*ATTENTION_NAMES)
    if policy.offload is Offload.INPUTS:
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=[offloaded],
            offload_src="device", offload_dst="pinned_host")
    if policy.offload is Offload.INPUTS_AND_ATTENTION:
        return OffloadWithAttention(offloaded)
    return jax.checkpoint_policies.nothing_saveable


def checkpointed(fn, policy: LayerStackPolicy, *, offloaded: str = "layer_input"):
    """`fn` under `policy`'s per-layer rematerialisation (its layers_per_checkpoint is not read): as it is for
    checkpoint "none", else under jax.checkpoint with `_jax_policy`."""
    if policy.checkpoint is Checkpoint.NONE:
        return fn
    return jax.checkpoint(fn, policy=_jax_policy(policy, offloaded))


def remat(fn, mode, *, offloaded: str = "layer_input"):
    """`fn` under the per-layer remat mode `mode` (a name of REMAT_MODES, or a LayerStackPolicy): "none";
    "full" (recompute everything in the backward pass); "offload" (as full, but the values named `offloaded` go
    to pinned host memory instead); "offload_attention" (as offload, and attention's forward residuals go to
    pinned host memory too: its output and softmax statistics, Hq (hd + 2) 16-bit values per token and layer,
    so the backward pass reruns the projections but not attention's forward; for long sequences, where
    attention dominates); "save_attention" (as full, but each layer's q, k, v after RoPE and the attention output
    are kept: about (2 Hq + 2 Hkv) hd 16-bit values per token and layer). The two-level modes are built by
    `run_layers`."""
    policy = LayerStackPolicy.parse(mode, argument="mode")
    if policy.layers_per_checkpoint != 1:
        raise ValueError(f"remat() takes a per-layer mode ({', '.join(REMAT_MODES)}); {mode!r} is two-level "
                         "(run_layers builds those)")
    return checkpointed(fn, policy, offloaded=offloaded)


def layer_windows(cfg: ModelConfig) -> tuple[int | None, ...]:
    """The attention window of every layer (length L; None: full attention)."""
    return cfg.layer_windows or (None,) * cfg.num_hidden_layers


def layer_sparse(cfg: ModelConfig) -> tuple[bool, ...]:
    """Whether every layer routes to experts (length L)."""
    return cfg.layer_sparse or (False,) * cfg.num_hidden_layers


def layer_linear(cfg: ModelConfig) -> tuple[bool, ...]:
    """Whether every layer mixes tokens by gated DeltaNet linear attention (Qwen3.5; length L)."""
    return cfg.layer_linear or (False,) * cfg.num_hidden_layers


def layer_ropes(cfg: ModelConfig, cos, sin, local_rope=None) -> tuple:
    """The (cos, sin) every layer rotates by (length L): `local_rope` for the sliding-window layers when given
    (Gemma 3), (None, None) for the NoPE layers (SmolLM3: Attention then rotates nothing), else (cos, sin)."""
    rotates = cfg.layer_rope or (True,) * cfg.num_hidden_layers
    return tuple((None, None) if not r else local_rope if (local_rope is not None and w is not None) else (cos, sin)
                 for w, r in zip(layer_windows(cfg), rotates))


def missing_subs(cfg: ModelConfig, subs, layer: int) -> frozenset[str]:
    """Those of the stacked submodules `subs` (names under the stacked DecoderLayer) that layer `layer` does not
    hold (config.stack_holders: Qwen3.5's other token mixer)."""
    return frozenset(sub for sub in subs if layer not in stack_holders(cfg, sub))


def layer_graphdef(layers: nnx.Module, missing: frozenset[str]) -> nnx.GraphDef:
    """The graphdef of one layer of the stacked `layers` that lacks the submodules `missing` (missing_subs): the
    stacked module's with those set to None, so a layer's slice (layer_rows) merges into it."""
    if not missing:
        return nnx.graphdef(layers)
    clone = nnx.merge(*nnx.split(layers))  # new module objects over the same arrays
    for sub in missing:
        setattr(clone, sub, None)
    return nnx.graphdef(clone)


def layer_graphdefs(layers: nnx.Module, cfg: ModelConfig) -> tuple[tuple[nnx.GraphDef, ...], tuple[int, ...]]:
    """(one graphdef per distinct set of submodules the layers of `layers` lack (layer_graphdef), and for each of
    the L layers the index of its graphdef): Qwen3.5's two mixers give two, a uniform stack one."""
    subs = tuple(nnx.state(layers).keys())
    missing = [missing_subs(cfg, subs, i) for i in range(cfg.num_hidden_layers)]
    distinct = list(dict.fromkeys(missing))
    return tuple(layer_graphdef(layers, m) for m in distinct), tuple(distinct.index(m) for m in missing)


def layer_row(cfg: ModelConfig, sub: str, layer: int, first: int = 0) -> int:
    """The row of layer `layer` in submodule `sub`'s stack counted from layer `first` (the holders in between)."""
    return sum(first <= h < layer for h in stack_holders(cfg, sub))


def layer_rows(state: nnx.State, cfg: ModelConfig, layer: int, first: int = 0) -> nnx.State:
    """Layer `layer`'s part of a stacked layer state whose rows start at layer `first`: its row (layer_row) of
    every leaf of the submodules it holds, the others left out."""
    return nnx.State({sub: jax.tree.map(lambda a, r=layer_row(cfg, sub, layer, first): a[r], tree)
                      for sub, tree in state.items() if layer in stack_holders(cfg, sub)})


def stack_rows(state: nnx.State, cfg: ModelConfig, start: int, shape: tuple[int, ...]) -> nnx.State:
    """The rows of layers start .. start + prod(shape) - 1 of a stacked layer state, grouped: shape[-1] is the
    layers in a group (a segment's period) and each leaf becomes [*shape[:-1], c, ...] with c the group's layers
    holding its submodule (config.stack_holders; the same in every group of a segment); a submodule no layer of
    the group holds is left out."""
    period, n = shape[-1], math.prod(shape)
    out = {}
    for sub, tree in state.items():
        holders = stack_holders(cfg, sub)
        c = sum(start <= h < start + period for h in holders)
        if c:
            r0, rows = sum(h < start for h in holders), n // period * c
            out[sub] = jax.tree.map(lambda a: a[r0:r0 + rows].reshape(shape[:-1] + (c,) + a.shape[1:]), tree)
    return nnx.State(out)


def run_layers(layers: nnx.Module, cfg: ModelConfig, x: jax.Array, cos, sin, batch: Batch, *,
               policy: LayerStackPolicy = NO_REMAT, cache: KVCache | None = None, local_rope=None,
               router_stats: bool = False, per_layer_inputs: jax.Array | None = None):
    """Every decoder layer of the stacked `layers` (a DecoderLayer whose variables carry a leading layer axis: one
    row per layer holding the submodule, config.stack_holders) over
    x [B, S, D], segment by segment (cfg.layer_segments: consecutive runs of a repeating group of layer kinds),
    each segment a scan over its groups, whose body runs the group's layers with their static windows, MLP kinds
    and RoPE tables.
    policy: the LayerStackPolicy (module docstring); under two-level checkpointing a segment's groups run in
    checkpointed groups of ceil(K / period) scan groups (the last one shorter when they do not divide the
    segment's groups).

    cos/sin: the RoPE tables of every layer; local_rope: (cos, sin) for the sliding-window layers instead
    (Gemma 3, from `DecoderModel.rope`), or None; NoPE layers (cfg.layer_rope False) get neither.
    cache, for decoding: KVCache with k/v [L, B, T, Hkv, hd] (all layers), valid [B, T] and the write index (or
    a NamedTuple with k and v fields and an `attend` as KVCache's); ValueError for layers of two attention shapes
    (Gemma 4's global_head_dim), which one array cannot hold.
    per_layer_inputs: [L, B, S, P] (Gemma 4's per-layer inputs, DecoderModel.per_layer_inputs), layer i's slice
    fed to layer i; None for other families.
    KV-shared layers (Gemma 4, cfg.kv_source) attend over the keys/values of their source layer, which runs in an
    earlier segment (its kind is unique, so its segment is one group) and hands them on; a KV-shared layer's own
    cache slot is left as it is.
    Returns (x, None) or, with a cache, (x, (k, v)) holding the updated [L, B, T, Hkv, hd] caches; with
    router_stats=True (MoE families) a third item, the RouterStats of the MoE layers stacked in layer order.
    """
    if cache is not None and cfg.global_head_dim:
        raise ValueError(f"{cfg.model_type}: run_layers' one [L, B, T, Hkv, hd] cache cannot hold layers of two "
                         "attention shapes (Gemma 4's global_head_dim); decode with the generation engine "
                         "(unsloth_jax.inference), whose page pools are per layer")
    windows, sparse, linear = layer_windows(cfg), layer_sparse(cfg), layer_linear(cfg)
    sources = cfg.kv_shared_sources
    shared: dict = {}  # source layer -> ((k, v), its updated cache arrays or None), filled segment by segment
    ropes = layer_ropes(cfg, cos, sin, local_rope)
    state = nnx.state(layers)
    graphdefs, kind = layer_graphdefs(layers, cfg)

    unroll = policy.layer_loop is LayerLoop.UNROLLED  # True: no while loop, every layer's weights a static slice
    keep = attention_residuals_saveable if policy.offload is Offload.INPUTS_AND_ATTENTION else None

    def run_group(first, h, xs_group, group_ropes, batch):
        """One group of layers, the first with the kinds of layer `first` (static). xs_group: {"layers": the
        group's stacked state (stack_rows), and "ple" (per-layer inputs), "k", "v" (cache slots) where given}."""
        h = checkpoint_name(h, "layer_input")
        layer_states = xs_group["layers"]
        new_k, new_v, stats, handed = [], [], [], {}
        for j in range(len(group_ropes)):
            i = first + j
            one = layer_rows(layer_states, cfg, i, first)
            layer = nnx.merge(graphdefs[kind[i]], gathered(one))
            layer_cache = None
            if cache is not None:
                layer_cache = cache._replace(k=xs_group["k"][j], v=xs_group["v"][j])  # KVCache or a variant
            extra = {}
            if "ple" in xs_group:
                extra["per_layer_input"] = xs_group["ple"][j]
            if cfg.kv_source(i) != i:
                src = cfg.kv_source(i)
                extra["shared"] = handed[src] if src in handed else shared[src]  # this group's, or an earlier one's
            h, kv, layer_stats, fresh = layer(h, *group_ropes[j], batch, windows[i], layer_cache, sparse=sparse[i],
                                              linear=linear[i], return_kv=True, **extra)
            if i in sources:
                handed[i] = (fresh, kv)
            if kv is not None:
                new_k.append(kv[0])
                new_v.append(kv[1])
            if layer_stats is not None:
                stats.append(layer_stats)
        kv_out = (jnp.stack(new_k), jnp.stack(new_v)) if cache is not None else None
        stats_out = jax.tree.map(lambda *a: jnp.stack(a), *stats) if router_stats and stats else None
        return h, (kv_out, stats_out, handed)

    def scan_segment(h, first, period, groups):
        """The segment of `groups` groups of `period` layers from layer `first` -> (h, (kv, stats)), kv and stats
        with one leading layer axis (or None); the keys/values of source layers go to `shared`."""
        group_ropes = ropes[first:first + period]
        inner = -(-policy.layers_per_checkpoint // period)  # scan groups per checkpointed group (two-level)
        two_level = inner > 1
        body = checkpointed(lambda h, xs: run_group(first, h, xs, group_ropes, batch),
                            FULL if two_level else policy)
        if (policy.offload_scan and not two_level and cache is None and not router_stats
                and per_layer_inputs is None and not sources):
            # the host-offload modes in training: the hand-written VJP that prefetches the offloaded inputs
            # (models.offload), with attention's forward residuals kept under "inputs_and_attention"
            xs = {"layers": stack_rows(state, cfg, first, (groups, period))}
            h = offloaded_layer_scan(lambda h, xs_group, side: run_group(first, h, xs_group, *side)[0], h, xs,
                                     (group_ropes, batch), keep=keep, unroll=unroll,
                                     chunk_bytes=policy.copy_chunk_bytes, prefetch_weights=policy.prefetch_weights)
            return h, (None, None)

        def outer_body(h, xs_outer):
            """`inner` scan groups, recomputed in the backward pass from their input h, the one value kept
            across the stack."""
            h = checkpoint_name(h, "group_input")
            return jax.lax.scan(body, h, xs_outer, unroll=unroll)

        outer = checkpointed(outer_body, policy, offloaded="group_input")
        # (first layer, count, per_outer or None): two-level runs `count` checkpointed groups of per_outer groups
        parts = [(first, groups, None)]
        if two_level:
            n_outer, rest = divmod(groups, inner)
            parts = [(first, n_outer, inner)] if n_outer else []
            if rest:  # fewer than `inner` scan groups left: one checkpointed group of `rest`
                parts.append((first + n_outer * inner * period, 1, rest))
        ys_parts = []
        for start, count, per_outer in parts:
            shape = (count, period) if per_outer is None else (count, per_outer, period)
            n = math.prod(shape)

            def grouped(a):
                return a[start:start + n].reshape(shape + a.shape[1:])

            xs = {"layers": stack_rows(state, cfg, start, shape)}
            if per_layer_inputs is not None:
                xs["ple"] = grouped(per_layer_inputs)
            if cache is not None:
                xs.update(k=grouped(cache.k), v=grouped(cache.v))
            h, (kv, stats, handed) = jax.lax.scan(body if per_outer is None else outer, h, xs, unroll=unroll)
            for i, value in handed.items():  # a source layer's segment is one group: its one output
                assert math.prod(shape[:-1]) == 1, (i, shape)
                shared[i] = jax.tree.map(lambda y: y.reshape(y.shape[len(shape) - 1:]), value)
            ys_parts.append(jax.tree.map(lambda y: y.reshape((-1,) + y.shape[len(shape):]), (kv, stats)))
        return h, _concat(ys_parts)

    parts = []
    for first, period, groups in cfg.layer_segments:
        x, ys = scan_segment(x, first, period, groups)
        parts.append(ys)
    kv, stats = _concat(parts)
    if kv is not None:
        kv = (kv[0].reshape(cache.k.shape), kv[1].reshape(cache.v.shape))
    return (x, kv, stats) if router_stats else (x, kv)


def _concat(parts):
    """[(kv, stats)] of consecutive layer runs -> (kv, stats), each joined along its layer axis over the runs
    that have it (None where none has: no cache, or no MoE layer)."""
    def join(items):
        items = [t for t in items if t is not None]
        if len(items) <= 1:
            return items[0] if items else None
        return jax.tree.map(lambda *a: jnp.concatenate(a), *items)

    return join([kv for kv, _ in parts]), join([stats for _, stats in parts])


__all__ = ["LayerStackPolicy", "Checkpoint", "Offload", "LayerLoop", "OffloadAttention", "OffloadWeights",
           "OffloadCopies", "NO_REMAT", "require_policy", "MODES", "REMAT_MODES", "SETTINGS", "UNSLOTH_VALUES",
           "checkpointed", "remat", "run_layers", "layer_windows", "layer_sparse", "layer_linear", "layer_ropes",
           "missing_subs", "layer_graphdef", "layer_row", "layer_rows", "stack_rows"]
