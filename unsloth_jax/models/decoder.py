"""The decoder of every supported family as Flax NNX modules, switched by `ModelConfig` (never by family name).

    model = CausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))      # random init (checkpoints: unsloth_jax.hf)
    logits = model(input_ids, attention_mask)                        # [B, S, V] float32

Module tree (attribute names follow Hugging Face, so a path reads like the HF tensor name):

    model.embed_tokens.weight [V, D]           model.norm.weight [D]          lm_head.weight [V, D] (untied only)
    model.layers.input_layernorm.weight [L, D]  (+ pre/post_feedforward_layernorm: Gemma 2, Gemma 3)
    model.layers.self_attn.{q,k,v,o}_proj.kernel [L, in, out] (+ .bias, .lora_a, .lora_b)
    model.layers.self_attn.{q,k}_norm.weight [L, hd]               (Qwen3, Gemma 3)
    model.layers.mlp.{gate,up,down}_proj.kernel [L, in, out]
    model.layers.mlp.{gate|router,experts.*}                       (MoE families: see unsloth_jax.models.moe)
    model.layers.self_attn.sinks [L, Hq]                           (gpt-oss)

The L decoder layers are one `DecoderLayer` whose variables carry a leading layer axis; `DecoderModel.run_layers`
splits it (`nnx.split`) and runs `lax.scan` over groups of `cfg.layer_period` layers (1 for most families, 2 for
Gemma 2, whose sliding and global layers alternate, 6 for Gemma 3; a Qwen3-MoE with dense layers repeats its
pattern of expert and dense MLPs), so compile time does not grow with depth and each layer of a group keeps a
static attention window, RoPE table (Gemma 3's sliding layers have their own RoPE base) and MLP kind. When the period does not divide L (Gemma 3: 26 = 4 x 6 + 2), the last L mod period layers are a
second, one-step scan. Each group may run under `jax.checkpoint` (remat modes below). Under
`UNSLOTH_JAX_IMPL=layer_loop=unrolled` the scans are unrolled (`unroll=True`: straight-line code, no while loop,
each layer's weights a static slice of the stack) at the cost of a compile that grows with depth.

Two-level remat ("full_every_K", "offload_every_K", for long sequences): the scan groups are themselves grouped
K layers at a time (K rounded up to a multiple of the period), an outer scan runs over those checkpointed
groups, whose inputs alone are kept across the stack (on the device, or in pinned host memory), and each runs
an inner scan of per-layer "full" remat: the backward pass recomputes one checkpointed group (one extra forward
of it), keeping its K layer inputs while its layers' backward runs. Kept layer inputs: L/K + K instead of L.

Shapes: B batch, S sequence, D hidden, V vocab. Activations are in the compute dtype; norms, softmax and RoPE
math run in float32; logits are float32.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import Offloadable, Recompute, checkpoint_name

from unsloth_jax import ops
from unsloth_jax.config import ModelConfig
from unsloth_jax.models.attention import Attention, Batch, KVCache
from unsloth_jax.models.layers import Embedding, RMSNorm, gathered
from unsloth_jax.models.mlp import MLP
from unsloth_jax.models.moe import SparseMLP
from unsloth_jax.models.offload import OFFLOAD_CHUNK_BYTES, offloaded_layer_scan
from unsloth_jax.models.rope import positions_from_mask, rope_tables

REMAT_MODES = ("none", "full", "offload", "offload_attention", "save_attention")
HOST_OFFLOAD_MODES = ("offload", "offload_attention")  # the modes that keep residuals in pinned host memory
GROUPED_REMAT_BASES = ("full", "offload")  # the per-layer modes a two-level mode "<base>_every_<K>" builds on
ATTENTION_NAMES = ("attn_q", "attn_k", "attn_v", "attn_out")  # the values "save_attention" keeps
# The residuals of attention's forward pass that its backward reads besides q, k, v ("offload_attention" keeps
# them): the outputs of cuDNN's fused forward (jax.nn.dot_product_attention, implementation="cudnn": the
# attention output and the softmax statistics), by primitive name, and the flash kernel's, by checkpoint name.
CUDNN_ATTENTION_FORWARD = ("dot_product_attention_fwd_wrapper", "dot_product_attention_fwd")
FLASH_RESIDUAL_NAMES = ("flash_out", "flash_lse")  # pallas_kernels.flash_attention names them
# The projections of a decoder layer by HF name, and the module holding each (layer.<parent>.<name>).
ATTN_PROJS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJS = ("gate_proj", "up_proj", "down_proj")
PROJ_PARENT = {p: "self_attn" for p in ATTN_PROJS} | {p: "mlp" for p in MLP_PROJS}


class DecoderLayer(nnx.Module):
    """One pre-norm decoder layer (Gemma 2, Gemma 3: with sandwich norms around attention and the MLP)."""

    def __init__(self, cfg: ModelConfig, *, stack: tuple[int, ...] = (), dtype=jnp.float32, rngs: nnx.Rngs):
        norm = dict(eps=cfg.rms_norm_eps, offset=cfg.norm_offset, stack=stack, dtype=dtype)
        self.sandwich_norms = cfg.sandwich_norms
        self.input_layernorm = RMSNorm(cfg.hidden_size, **norm)
        self.self_attn = Attention(cfg, stack=stack, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, **norm)
        self.moe = cfg.is_moe
        self.mlp = (SparseMLP if cfg.is_moe else MLP)(cfg, stack=stack, dtype=dtype, rngs=rngs)
        self.pre_feedforward_layernorm = nnx.data(RMSNorm(cfg.hidden_size, **norm) if cfg.sandwich_norms else None)
        self.post_feedforward_layernorm = nnx.data(RMSNorm(cfg.hidden_size, **norm) if cfg.sandwich_norms else None)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, batch: Batch, window: int | None,
                 cache: KVCache | None = None, sparse: bool = False):
        """x [B, S, D] -> ([B, S, D], new (k, v) cache arrays or None, RouterStats or None).

        sparse (static): this layer's MLP is the routed experts block (MoE families); its router statistics
        are returned."""
        h, new_cache = self.self_attn(self.input_layernorm(x), cos, sin, batch, window, cache)
        stats = None
        if self.sandwich_norms:
            x = x + self.post_attention_layernorm(h)
            h = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        else:
            x = x + h
            if self.moe:
                h, stats = self.mlp(self.post_attention_layernorm(x), sparse=sparse, valid=batch.kv_valid)
            else:
                h = self.mlp(self.post_attention_layernorm(x))
        return x + h, new_cache, stats


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


def remat(fn, mode: str, *, offloaded: str = "layer_input"):
    """`fn` under the rematerialisation policy `mode`: "none"; "full" (recompute everything in the backward
    pass); "offload" (as full, but the values named `offloaded` go to pinned host memory instead);
    "offload_attention" (as offload, and attention's forward residuals go to pinned host memory too: its
    output and softmax statistics, Hq (hd + 2) 16-bit values per token and layer, so the backward pass reruns
    the projections but not attention's forward; for long sequences, where attention dominates);
    "save_attention" (as full, but each layer's q, k, v after RoPE and the attention output are kept: about
    (2 Hq + 2 Hkv) hd 16-bit values per token and layer, for no recomputation of the q/k/v projections).
    The two-level modes ("full_every_K", "offload_every_K") are built by `DecoderModel.run_layers` from these."""
    if mode == "none":
        return fn
    if mode == "full":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)
    if mode == "offload":
        policy = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=[offloaded],
            offload_src="device", offload_dst="pinned_host")
        return jax.checkpoint(fn, policy=policy)
    if mode == "offload_attention":
        return jax.checkpoint(fn, policy=OffloadWithAttention(offloaded))
    if mode == "save_attention":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.save_only_these_names(*ATTENTION_NAMES))
    raise ValueError(f"unknown remat mode {mode!r}; use one of {REMAT_MODES} or a two-level mode "
                     f"(\"full_every_K\", \"offload_every_K\")")


def two_level_mode(base: str, layers_per_checkpoint: int) -> str:
    """The remat mode that keeps every `layers_per_checkpoint`-th layer input (the input of each group of that
    many layers) on the device (base "full") or in pinned host memory (base "offload"): "full_every_4"."""
    if base not in GROUPED_REMAT_BASES:
        raise ValueError(f"layers_per_checkpoint needs gradient checkpointing on the device or with host "
                         f"offload (remat mode one of {GROUPED_REMAT_BASES}), got remat mode {base!r}")
    if isinstance(layers_per_checkpoint, bool) or not isinstance(layers_per_checkpoint, int) \
            or layers_per_checkpoint < 1:
        raise ValueError(f"layers_per_checkpoint must be an integer >= 1, got {layers_per_checkpoint!r}")
    return base if layers_per_checkpoint == 1 else f"{base}_every_{layers_per_checkpoint}"


def parse_remat(mode: str) -> tuple[str, int]:
    """(per-layer mode, layers per checkpoint) of a remat mode: ("full", 4) for "full_every_4", (mode, 1) for
    the modes of REMAT_MODES. Raises ValueError for anything else."""
    if mode in REMAT_MODES:
        return mode, 1
    base, sep, k = mode.partition("_every_") if isinstance(mode, str) else ("", "", "")
    if sep and base in GROUPED_REMAT_BASES and k.isdigit() and int(k) >= 1 and k == str(int(k)):
        return base, int(k)
    raise ValueError(f"unknown remat mode {mode!r}; use one of {REMAT_MODES} or a two-level mode "
                     f"(\"full_every_K\", \"offload_every_K\", K >= 1)")


def make_batch(input_ids, attention_mask=None, positions=None, segment_ids=None, right_padded: bool = False) -> Batch:
    """Side inputs of a forward pass. right_padded=True promises that every row's padding is at its end
    (training batches), which lets attention use cuDNN's sequence-length masking."""
    lengths = None
    if right_padded and attention_mask is not None:
        lengths = jnp.sum(attention_mask.astype(jnp.int32), axis=-1)
    if positions is None:
        if attention_mask is not None:
            positions = positions_from_mask(attention_mask)
        else:
            positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1]), input_ids.shape)
    return Batch(positions=positions, kv_valid=attention_mask, segment_ids=segment_ids, kv_lengths=lengths)


class DecoderModel(nnx.Module):
    """Embeddings, the stacked decoder layers and the final norm (HF's `model.model`)."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = DecoderLayer(cfg, stack=(cfg.num_hidden_layers,), dtype=dtype, rngs=rngs)
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, offset=cfg.norm_offset, dtype=dtype)

    def embed(self, input_ids: jax.Array, dtype) -> jax.Array:
        """input_ids [B, S] -> [B, S, D] in `dtype` (Gemma: times sqrt(D), rounded to `dtype` first as HF does)."""
        x = self.embed_tokens(input_ids).astype(dtype)
        if self.config.embed_scale:
            x = x * jnp.asarray(self.config.hidden_size ** 0.5, dtype)
        return x

    def layer_windows(self) -> tuple[int | None, ...]:
        """The attention window of each layer of one scan group (length cfg.layer_period)."""
        cfg = self.config
        return (cfg.layer_windows or (None,) * cfg.num_hidden_layers)[:cfg.layer_period]

    def layer_sparse(self) -> tuple[bool, ...]:
        """Whether each layer of one scan group routes to experts (length cfg.layer_period)."""
        cfg = self.config
        return (cfg.layer_sparse or (False,) * cfg.num_hidden_layers)[:cfg.layer_period]

    def rope(self, positions: jax.Array):
        """RoPE tables for positions [B, S]: ((cos, sin), local), cos/sin [B, S, rope_dim] float32 for the global
        RoPE, and `local` the (cos, sin) of the sliding-window layers when they have their own base (Gemma 3),
        else None."""
        cfg = self.config
        local = rope_tables(cfg, positions, local=True) if cfg.rope_local_theta else None
        return rope_tables(cfg, positions), local

    def run_layers(self, x: jax.Array, cos, sin, batch: Batch, *, remat_mode: str = "none",
                   cache: KVCache | None = None, local_rope=None, router_stats: bool = False):
        """Every decoder layer over x [B, S, D], as a scan over groups of cfg.layer_period layers (and a one-step
        scan over the remaining L mod period layers, if any). Layer i has the window and MLP kind of layer
        i % period, so the tail's layers are those of the first `tail` layers of a group.
        remat_mode: one of REMAT_MODES, or a two-level mode "<full|offload>_every_<K>" (module docstring):
        the scan groups then run in checkpointed groups of ceil(K / period) scan groups (the last one shorter
        when they do not divide L // period); the L mod period tail layers keep per-layer "full" remat.

        cos/sin: the RoPE tables of every layer; local_rope: (cos, sin) for the sliding-window layers instead
        (Gemma 3, from `rope`), or None.
        cache, for decoding: KVCache with k/v [L, B, T, Hkv, hd] (all layers), valid [B, T] and the write index.
        Returns (x, None) or, with a cache, (x, (k, v)) holding the updated [L, B, T, Hkv, hd] caches; with
        router_stats=True (MoE families) a third item, the RouterStats of the MoE layers stacked in layer order.
        """
        cfg = self.config
        period = cfg.layer_period
        groups, tail = divmod(cfg.num_hidden_layers, period)
        windows = self.layer_windows()
        sparse = self.layer_sparse()
        ropes = tuple(local_rope if (local_rope is not None and w is not None) else (cos, sin) for w in windows)
        graphdef, state = nnx.split(self.layers)

        def run_group(h, xs_group, ropes, batch):
            h = checkpoint_name(h, "layer_input")
            layer_states = xs_group if cache is None else xs_group[0]
            size = jax.tree.leaves(layer_states)[0].shape[0]  # period, or the tail's length
            new_k, new_v, stats = [], [], []
            for j in range(size):
                layer = nnx.merge(graphdef, gathered(jax.tree.map(lambda a: a[j], layer_states)))
                layer_cache = None
                if cache is not None:
                    layer_cache = KVCache(xs_group[1][j], xs_group[2][j], cache.valid, cache.index)
                h, kv, layer_stats = layer(h, *ropes[j], batch, windows[j], layer_cache, sparse=sparse[j])
                if kv is not None:
                    new_k.append(kv[0])
                    new_v.append(kv[1])
                if layer_stats is not None:
                    stats.append(layer_stats)
            kv_out = (jnp.stack(new_k), jnp.stack(new_v)) if cache is not None else None
            stats_out = jax.tree.map(lambda *a: jnp.stack(a), *stats) if router_stats and stats else None
            return h, (kv_out, stats_out)

        def group_body(h, xs_group):
            return run_group(h, xs_group, ropes, batch)

        unroll = ops.layer_loop() == "unrolled"  # True: no while loop, every layer's weights a static slice
        base, per_checkpoint = parse_remat(remat_mode)
        inner = -(-per_checkpoint // period)  # scan groups per checkpointed group (two-level modes)
        two_level = inner > 1
        body = remat(group_body, "full" if two_level else base)
        # "offload" in training: the hand-written VJP that prefetches the offloaded inputs (models.offload);
        # "offload_attention" too (unless the policy says offload_attention=policy), keeping attention's forward
        # residuals with each layer's input
        scanned = base == "offload" or (base == "offload_attention" and ops.offload_attention_path() == "scan")
        prefetched = scanned and not two_level and cache is None and not router_stats
        keep = attention_residuals_saveable if base == "offload_attention" else None

        def outer_body(h, xs_outer):
            """`inner` scan groups, each recomputed in the backward pass from its own input (kept while this
            group's backward runs); only this group's input h is kept across the stack."""
            h = checkpoint_name(h, "group_input")
            return jax.lax.scan(body, h, xs_outer, unroll=unroll)

        outer = remat(outer_body, base, offloaded="group_input") if two_level else None

        def scan(h, start, count, size, per_outer=None):
            """Scan `body` over `count` groups of `size` layers starting at layer `start`; with per_outer, scan
            `outer` over `count` groups of `per_outer` such groups. Returns (h, (kv, stats)) with kv and stats
            flattened to one leading layer axis (or None)."""
            shape = (count, size) if per_outer is None else (count, per_outer, size)
            n = math.prod(shape)

            def grouped(a):
                if start or n != a.shape[0]:
                    a = a[start:start + n]
                return a.reshape(shape + a.shape[1:])

            xs = jax.tree.map(grouped, state)
            if prefetched:  # never two-level, so per_outer is None here
                h = offloaded_layer_scan(lambda h, xs_group, side: run_group(h, xs_group, *side)[0], h, xs,
                                         (ropes, batch), keep=keep, unroll=unroll,
                                         chunk_bytes=OFFLOAD_CHUNK_BYTES if ops.offload_copies() == "blocks" else None,
                                         prefetch_weights=ops.offload_weights(keep is not None) == "prefetch")
                return h, (None, None)
            if cache is not None:
                xs = (xs, grouped(cache.k), grouped(cache.v))
            h, ys = jax.lax.scan(body if per_outer is None else outer, h, xs, unroll=unroll)
            return h, jax.tree.map(lambda y: y.reshape((-1,) + y.shape[len(shape):]), ys)

        # (first layer, groups, layers per scan group, scan groups per checkpointed group or None), in layer order
        if two_level:
            n_outer, rest = divmod(groups, inner)
            segments = [(0, n_outer, period, inner)] if n_outer else []
            if rest:  # fewer than `inner` scan groups left: one checkpointed group of `rest`
                segments.append((n_outer * inner * period, 1, period, rest))
        else:
            segments = [(0, groups, period, None)] if groups else []
        if tail:  # the last L mod period layers, under the per-layer policy
            segments.append((groups * period, 1, tail, None))
        kvs, stats_parts = [], []
        for start, count, size, per_outer in segments:
            x, (kv, stats) = scan(x, start, count, size, per_outer)
            kvs.append(kv)
            if stats is not None:
                stats_parts.append(stats)
        kv = None
        if cache is not None:  # the segments' layers are consecutive: concatenate in that order
            kv = tuple(jnp.concatenate(parts) if len(parts) > 1 else parts[0] for parts in zip(*kvs))
            kv = (kv[0].reshape(cache.k.shape), kv[1].reshape(cache.v.shape))
        stats = None
        if stats_parts:
            stats = stats_parts[0] if len(stats_parts) == 1 else jax.tree.map(
                lambda *a: jnp.concatenate(a), *stats_parts)
        return (x, kv, stats) if router_stats else (x, kv)

    def __call__(self, input_ids: jax.Array, batch: Batch, *, remat_mode: str = "none", dtype=None,
                 router_stats: bool = False):
        """Final-normed hidden states [B, S, D] for input_ids [B, S]; with router_stats=True (MoE families)
        (hidden states, RouterStats of the MoE layers)."""
        x = self.embed(input_ids, dtype or self.embed_tokens.weight[...].dtype)
        (cos, sin), local = self.rope(batch.positions)
        if router_stats:
            x, _, stats = self.run_layers(x, cos, sin, batch, remat_mode=remat_mode, local_rope=local,
                                          router_stats=True)
            return self.norm(x), stats
        x, _ = self.run_layers(x, cos, sin, batch, remat_mode=remat_mode, local_rope=local)
        return self.norm(x)


class CausalLM(nnx.Module):
    """A decoder language model (HF's `*ForCausalLM`): `model` (DecoderModel) and, when the embeddings are
    untied, `lm_head`. Static attributes: `config`, `dtype` (compute dtype), `lora` (the LoRA settings after
    `unsloth_jax.lora.add_lora`, else None), `full_finetuning` (True after
    `unsloth_jax.lora.enable_full_finetuning`: every weight trains), `model_dir` (the checkpoint directory it
    was loaded from, or None).
    """

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=None, rngs: nnx.Rngs):
        param_dtype = param_dtype or dtype
        self.config = cfg
        self.dtype = jnp.dtype(dtype)
        self.lora = None
        self.full_finetuning = False
        self.model_dir: str | None = None
        self.model = DecoderModel(cfg, dtype=param_dtype, rngs=rngs)
        self.lm_head = nnx.data(None if cfg.tie_word_embeddings else
                                Embedding(cfg.vocab_size, cfg.hidden_size, dtype=param_dtype, rngs=rngs))

    def projections(self) -> dict:
        """The stacked projections (`Linear`s) of the decoder layers by HF name, q_proj ... down_proj (the
        dense MLP ones only where the model has dense MLP layers)."""
        layers = self.model.layers
        found = {name: getattr(getattr(layers, parent), name, None) for name, parent in PROJ_PARENT.items()}
        return {name: lin for name, lin in found.items() if lin is not None}

    def expert_projections(self) -> dict:
        """The stacked expert projections (`GroupedLinear`s) of a MoE model by PEFT parameter name
        ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"); {} for dense models."""
        from unsloth_jax.models.moe import EXPERT_PARAMETERS

        if not self.config.is_moe:
            return {}
        experts = self.model.layers.mlp.experts
        return {name: getattr(experts, proj) for name, proj in EXPERT_PARAMETERS.items()}

    def head_weight(self) -> jax.Array:
        """The [V, D] output projection (the embedding table when tied)."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return head.weight[...]

    def logits_from_hidden(self, h: jax.Array) -> jax.Array:
        """[..., D] -> [..., V] logits in float32 (Gemma 2: final softcapping applied)."""
        w = self.head_weight()
        logits = jnp.einsum("...d,vd->...v", h, w.astype(h.dtype), preferred_element_type=jnp.float32)
        cap = self.config.final_softcap
        if cap is not None:
            logits = cap * jnp.tanh(logits / cap)
        return logits

    def hidden_states(self, input_ids: jax.Array, batch: Batch, *, remat_mode: str = "none",
                      router_stats: bool = False):
        """Final-normed hidden states [B, S, D] in the compute dtype; with router_stats=True (MoE families)
        (hidden states, RouterStats [MoE layers, E] for unsloth_jax.models.moe.load_balancing_loss)."""
        return self.model(input_ids, batch, remat_mode=remat_mode, dtype=self.dtype, router_stats=router_stats)

    def __call__(self, input_ids, attention_mask=None, positions=None, segment_ids=None) -> jax.Array:
        """Logits [B, S, V] (float32) for input_ids [B, S] (or [S]) of ints; attention_mask [B, S] 1 = real."""
        input_ids = jnp.asarray(input_ids, jnp.int32)
        if input_ids.ndim == 1:
            input_ids = input_ids[None]
        if attention_mask is not None:
            attention_mask = jnp.asarray(attention_mask, jnp.int32).reshape(input_ids.shape)
        batch = make_batch(input_ids, attention_mask, positions, segment_ids)
        return self.logits_from_hidden(self.hidden_states(input_ids, batch))
