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
    model.layers.linear_attn.*                                     (Qwen3.5: see unsloth_jax.models.linear_attention)
    model.embed_tokens_per_layer.weight [Vp, L*P], model.per_layer_model_projection.kernel [D, L*P],
    model.per_layer_projection_norm.weight [P], model.layers.per_layer_input_gate / per_layer_projection,
    model.layers.post_per_layer_input_norm.weight [L, D], model.layers.layer_scalar [L, 1]   (Gemma 4)
    model.layers.{global_attn,shared_attn,shared_global_attn,wide_mlp}.*    (Gemma 4: config.KIND_MODULES)

The L decoder layers are one `DecoderLayer` whose variables carry a leading layer axis (L, or for a token mixer
only some layers hold the number of its holders: config.stack_holders; Qwen3.5's self_attn [La, ...] over its
full-attention layers, linear_attn [L - La, ...] over the others; Gemma 4's global_attn over its full-attention
layers at their own head dim, shared_attn / shared_global_attn over its KV-shared layers, wide_mlp over those of
a double-wide MLP; row r is layer stack_holders(...)[r]);
`DecoderModel.run_layers`
runs them (unsloth_jax.models.layer_stack: per segment of `cfg.layer_segments`, a `lax.scan` over its groups) under the
`LayerStackPolicy` it is given: what each layer keeps for the backward pass, what goes to pinned host memory,
two-level checkpointing, the loop's settings.

Shapes: B batch, S sequence, D hidden, V vocab. Activations are in the compute dtype; norms, softmax and RoPE
math run in float32; logits are float32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from unsloth_jax import ops
from unsloth_jax.config import KIND_MODULES, ModelConfig, stack_holders
from unsloth_jax.models.attention import Attention, Batch, KVCache
from unsloth_jax.models.layer_stack import (NO_REMAT, LayerStackPolicy, layer_linear, layer_ropes, layer_sparse,
                                            layer_windows, require_policy, run_layers)
from unsloth_jax.models.layers import Buffer, Embedding, Linear, RMSNorm
from unsloth_jax.models.linear_attention import LINEAR_PROJS, GatedDeltaNet
from unsloth_jax.models.mlp import MLP
from unsloth_jax.models.moe import SparseMLP
from unsloth_jax.models.rope import positions_from_mask, rope_tables

# The projections of a decoder layer by HF name, and the module holding each (layer.<parent>.<name>).
ATTN_PROJS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJS = ("gate_proj", "up_proj", "down_proj")
PROJ_PARENT = {p: "self_attn" for p in ATTN_PROJS} | {p: "mlp" for p in MLP_PROJS}
PROJ_PARENT |= {p: "linear_attn" for p in LINEAR_PROJS}  # Qwen3.5's linear-attention layers


def layer_projections(layers) -> dict:
    """Every projection (`Linear`) of a (stacked) decoder layer module: (submodule, HF name) -> Linear, each
    submodule of config.KIND_MODULES standing for the HF parent (PROJ_PARENT) of the name, in PROJ_PARENT order."""
    found = {}
    for name, parent in PROJ_PARENT.items():
        for sub in KIND_MODULES.get(parent, (parent,)):
            lin = getattr(getattr(layers, sub, None), name, None)
            if lin is not None:
                found[(sub, name)] = lin
    return found


class DecoderLayer(nnx.Module):
    """One pre-norm decoder layer (Gemma 2, 3, 4: with sandwich norms around attention and the MLP; Gemma 4: then
    the per-layer input block and the layer's scalar)."""

    def __init__(self, cfg: ModelConfig, *, stack: tuple[int, ...] = (), dtype=jnp.float32, rngs: nnx.Rngs):
        """stack=(L,): every layer's variables stacked, a submodule's over the layers holding it only
        (config.stack_holders: Qwen3.5's self_attn over its full-attention layers, linear_attn over the others;
        Gemma 4's kinds of attention and MLP, config.KIND_MODULES); stack=(): one layer, holding every submodule
        the model has (`held` picks the first of a kind)."""
        norm = dict(eps=cfg.rms_norm_eps, offset=cfg.norm_offset, stack=stack, dtype=dtype)

        def rows(sub):  # a submodule's stack: the layers holding it
            return (len(stack_holders(cfg, sub)),) if stack else ()

        self.sandwich_norms = cfg.sandwich_norms
        self.input_layernorm = RMSNorm(cfg.hidden_size, **norm)
        # None where no layer attends; a layer's own module (layer_stack.layer_graphdef) drops the mixer it lacks
        self.self_attn = nnx.data(Attention(cfg, stack=rows("self_attn"), dtype=dtype, rngs=rngs)
                                  if not stack or rows("self_attn")[0] else None)
        # Gemma 4: the attention of the full-attention layers at their own shape and of the KV-shared layers
        # (config.KIND_MODULES), each stacked over its holders; attributes only where some layer holds them
        for kind in KIND_MODULES["self_attn"][1:]:
            if stack_holders(cfg, kind):
                setattr(self, kind, nnx.data(Attention(cfg, stack=rows(kind), dtype=dtype, rngs=rngs, kind=kind)))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, **norm)
        self.moe = cfg.is_moe
        self.mlp = nnx.data((SparseMLP if cfg.is_moe else MLP)(cfg, stack=rows("mlp"), dtype=dtype, rngs=rngs)
                            if not stack or rows("mlp")[0] else None)
        if stack_holders(cfg, "wide_mlp"):  # Gemma 4's KV-shared layers: a double-wide MLP
            self.wide_mlp = nnx.data(MLP(cfg, stack=rows("wide_mlp"), dtype=dtype, rngs=rngs, wide=True))
        self.pre_feedforward_layernorm = nnx.data(RMSNorm(cfg.hidden_size, **norm) if cfg.sandwich_norms else None)
        self.post_feedforward_layernorm = nnx.data(RMSNorm(cfg.hidden_size, **norm) if cfg.sandwich_norms else None)
        # Gemma 4: the per-layer input block (gate D -> P, times the layer's input, projection P -> D, norm)
        p = cfg.per_layer_input_size
        self.activation = cfg.activation
        self.per_layer_input_gate = nnx.data(Linear(cfg.hidden_size, p, stack=stack, dtype=dtype, rngs=rngs)
                                             if p else None)
        self.per_layer_projection = nnx.data(Linear(p, cfg.hidden_size, stack=stack, dtype=dtype, rngs=rngs)
                                             if p else None)
        self.post_per_layer_input_norm = nnx.data(RMSNorm(cfg.hidden_size, **norm) if p else None)
        # Gemma 4: the layer's output scale [*stack, 1] (a buffer in transformers, which never trains it)
        self.layer_scalar = nnx.data(Buffer(jnp.ones((*stack, 1), dtype)) if cfg.layer_scalar else None)
        if cfg.has_linear_layers:  # Qwen3.5: each layer runs its own mixer (layer_linear)
            self.linear_attn = nnx.data(GatedDeltaNet(cfg, stack=rows("linear_attn"), dtype=dtype, rngs=rngs))

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, batch: Batch, window: int | None,
                 cache: KVCache | None = None, sparse: bool = False, linear: bool = False, *,
                 per_layer_input: jax.Array | None = None, shared: tuple | None = None, return_kv: bool = False):
        """x [B, S, D] -> ([B, S, D], new (k, v) cache arrays or None, RouterStats or None), and with
        return_kv=True a fourth item: this layer's keys/values (Attention's third output) for KV-shared layers.

        sparse (static): this layer's MLP is the routed experts block (MoE families); its router statistics
        are returned. linear (static): this layer mixes tokens by linear attention (`linear_attn`, Qwen3.5); its
        cache is then a RecurrentPrefill / RecurrentDecode, the second item its new RecurrentState and the fourth
        None. per_layer_input [B, S, P]: this layer's slice of the per-layer inputs (Gemma 4).
        shared: what a KV-shared layer attends over (Attention's `shared`)."""
        if linear:
            (h, new_cache), kv = self.linear_attn(self.input_layernorm(x), batch, cache), None
        else:
            attn = self.held(KIND_MODULES["self_attn"])
            h, new_cache, kv = attn(self.input_layernorm(x), cos, sin, batch, window, cache, shared)
        stats = None
        mlp = self.held(KIND_MODULES["mlp"])
        if self.sandwich_norms:
            x = x + self.post_attention_layernorm(h)
            h = self.post_feedforward_layernorm(mlp(self.pre_feedforward_layernorm(x)))
        else:
            x = x + h
            if self.moe:
                h, stats = mlp(self.post_attention_layernorm(x), sparse=sparse, valid=batch.kv_valid)
            else:
                h = mlp(self.post_attention_layernorm(x))
        x = x + h
        if self.per_layer_input_gate is not None:
            g = ops.glu(self.per_layer_input_gate(x), per_layer_input.astype(x.dtype), self.activation)
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        if self.layer_scalar is not None:
            x = x * jax.lax.stop_gradient(self.layer_scalar[...]).astype(x.dtype)
        return (x, new_cache, stats, kv) if return_kv else (x, new_cache, stats)

    def held(self, kinds: tuple[str, ...]):
        """The one of the submodules `kinds` (config.KIND_MODULES) this layer holds: in one layer's module
        (layer_stack.layer_graphdef) the others are None or absent."""
        return next(m for m in (getattr(self, k, None) for k in kinds) if m is not None)


def call_inputs(input_ids, attention_mask=None, positions=None, segment_ids=None) -> tuple[jax.Array, Batch]:
    """A model call's arguments as (input_ids int32 [B, S], Batch): [S] ids become one row, attention_mask
    [B, S] (1 = real) is cast to int32 in the ids' shape."""
    input_ids = jnp.asarray(input_ids, jnp.int32)
    if input_ids.ndim == 1:
        input_ids = input_ids[None]
    if attention_mask is not None:
        attention_mask = jnp.asarray(attention_mask, jnp.int32).reshape(input_ids.shape)
    return input_ids, make_batch(input_ids, attention_mask, positions, segment_ids)


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
        # Gemma 4's per-layer inputs (PLE): a [Vp, L * P] table and a D -> L * P projection of the embeddings
        width = cfg.num_hidden_layers * cfg.per_layer_input_size
        self.embed_tokens_per_layer = nnx.data(
            Embedding(cfg.per_layer_vocab_size, width, dtype=dtype, rngs=rngs) if width else None)
        self.per_layer_model_projection = nnx.data(
            Linear(cfg.hidden_size, width, dtype=dtype, rngs=rngs) if width else None)
        self.per_layer_projection_norm = nnx.data(
            RMSNorm(cfg.per_layer_input_size, eps=cfg.rms_norm_eps, offset=cfg.norm_offset, dtype=dtype)
            if width else None)

    def embed(self, input_ids: jax.Array, dtype) -> jax.Array:
        """input_ids [B, S] -> [B, S, D] in `dtype` (Gemma: times sqrt(D), rounded to `dtype` first as HF does)."""
        x = self.embed_tokens(input_ids).astype(dtype)
        if self.config.embed_scale:
            x = x * jnp.asarray(self.config.hidden_size ** 0.5, dtype)
        return x

    def per_layer_inputs(self, input_ids: jax.Array, x: jax.Array) -> jax.Array | None:
        """Gemma 4's per-layer inputs [L, B, S, P] in x's dtype for input_ids [B, S] and their embeddings x
        [B, S, D] (`embed`'s output): (RMSNorm(x @ projection / sqrt(D)) + table[ids] * sqrt(P)) / sqrt(2), layer
        i's slice feeding layer i; None for families without them."""
        cfg = self.config
        if self.embed_tokens_per_layer is None:
            return None
        if input_ids is None:
            raise ValueError(f"{cfg.model_type}: the per-layer input embeddings need input_ids (inputs_embeds alone "
                             "cannot give them)")
        p, dt = cfg.per_layer_input_size, x.dtype
        table = self.embed_tokens_per_layer(input_ids).astype(dt) * jnp.asarray(p ** 0.5, dt)
        proj = self.per_layer_model_projection(x) * jnp.asarray(cfg.hidden_size ** -0.5, dt)
        proj = self.per_layer_projection_norm(proj.reshape(*x.shape[:-1], cfg.num_hidden_layers, p))
        out = (proj + table.reshape(proj.shape)) * jnp.asarray(2.0 ** -0.5, dt)
        return jnp.moveaxis(out, -2, 0)

    def layer_windows(self) -> tuple[int | None, ...]:
        """The attention window of every layer (length L)."""
        return layer_windows(self.config)

    def layer_sparse(self) -> tuple[bool, ...]:
        """Whether every layer routes to experts (length L)."""
        return layer_sparse(self.config)

    def layer_linear(self) -> tuple[bool, ...]:
        """Whether every layer mixes tokens by linear attention (Qwen3.5; length L)."""
        return layer_linear(self.config)

    def layer_ropes(self, cos, sin, local=None) -> tuple:
        """The (cos, sin) every layer rotates by (length L): `local` on the sliding-window layers when given,
        (None, None) on NoPE layers (cfg.layer_rope), else (cos, sin)."""
        return layer_ropes(self.config, cos, sin, local)

    def rope(self, positions: jax.Array, long: jax.Array | None = None):
        """RoPE tables for positions [B, S]: ((cos, sin), local), cos/sin [B, S, rope_dim] float32 for the global
        RoPE, and `local` the (cos, sin) of the sliding-window layers when they have their own base (Gemma 3),
        else None. long: LongRoPE's factors per row ([B] bool; rope_tables)."""
        cfg = self.config
        local = rope_tables(cfg, positions, local=True) if cfg.rope_local_theta else None
        return rope_tables(cfg, positions, long=long), local

    def run_layers(self, x: jax.Array, cos, sin, batch: Batch, *, remat_mode: LayerStackPolicy = NO_REMAT,
                   cache: KVCache | None = None, local_rope=None, router_stats: bool = False,
                   per_layer_inputs: jax.Array | None = None):
        """Every decoder layer over x [B, S, D] under the layer-stack policy `remat_mode` (a LayerStackPolicy,
        parsed where the user gave it): unsloth_jax.models.layer_stack.run_layers, which says what cos/sin,
        cache, local_rope, router_stats and per_layer_inputs are and what it returns: (x, None), (x, (k, v))
        with a cache, and the RouterStats third with router_stats=True."""
        return run_layers(self.layers, self.config, x, cos, sin, batch,
                          policy=require_policy(remat_mode, "remat_mode"), cache=cache,
                          local_rope=local_rope, router_stats=router_stats, per_layer_inputs=per_layer_inputs)

    def __call__(self, input_ids: jax.Array | None, batch: Batch, *,
                 remat_mode: LayerStackPolicy = NO_REMAT, dtype=None, router_stats: bool = False,
                 inputs_embeds: jax.Array | None = None):
        """Final-normed hidden states [B, S, D] for input_ids [B, S] under the layer-stack policy `remat_mode`
        (run_layers); with router_stats=True (MoE families) (hidden states, RouterStats of the MoE layers).
        inputs_embeds [B, S, D], when given, replaces the embedding of input_ids (already scaled: the caller's
        `embed` output, e.g. with image features written in)."""
        if inputs_embeds is not None:
            x = inputs_embeds.astype(dtype or inputs_embeds.dtype)
        else:
            x = self.embed(input_ids, dtype or self.embed_tokens.weight[...].dtype)
        (cos, sin), local = self.rope(batch.positions)
        ple = self.per_layer_inputs(input_ids, x)
        if router_stats:
            x, _, stats = self.run_layers(x, cos, sin, batch, remat_mode=remat_mode, local_rope=local,
                                          router_stats=True, per_layer_inputs=ple)
            return self.norm(x), stats
        x, _ = self.run_layers(x, cos, sin, batch, remat_mode=remat_mode, local_rope=local, per_layer_inputs=ple)
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
        dense MLP ones only where the model has dense MLP layers; Qwen3.5's in_proj_* / out_proj too): of each
        name the first submodule holding it (config.KIND_MODULES: Gemma 4's self_attn before its global_attn,
        shared_attn, ...; `projection_stacks` has them all)."""
        found = {}
        for (_, name), lin in self.projection_stacks().items():
            found.setdefault(name, lin)
        return found

    def projection_stacks(self) -> dict:
        """Every stacked projection (`Linear`) of the decoder layers: (submodule under model.layers, HF name) ->
        Linear, e.g. ("self_attn", "q_proj"), and for Gemma 4 ("global_attn", "q_proj"), ("wide_mlp",
        "up_proj"): each submodule of config.KIND_MODULES standing for the HF parent (PROJ_PARENT) of the name,
        stacked over the layers holding it (config.stack_holders)."""
        return layer_projections(self.model.layers)

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

    def hidden_states(self, input_ids: jax.Array, batch: Batch, *, remat_mode: LayerStackPolicy = NO_REMAT,
                      router_stats: bool = False):
        """Final-normed hidden states [B, S, D] in the compute dtype, the layers run under the layer-stack policy
        `remat_mode` (a LayerStackPolicy: model.gradient_checkpointing, NO_REMAT); with router_stats=True (MoE families)
        (hidden states, RouterStats [MoE layers, E] for unsloth_jax.models.moe.load_balancing_loss)."""
        return self.model(input_ids, batch, remat_mode=remat_mode, dtype=self.dtype, router_stats=router_stats)

    def __call__(self, input_ids, attention_mask=None, positions=None, segment_ids=None) -> jax.Array:
        """Logits [B, S, V] (float32) for input_ids [B, S] (or [S]) of ints; attention_mask [B, S] 1 = real."""
        input_ids, batch = call_inputs(input_ids, attention_mask, positions, segment_ids)
        return self.logits_from_hidden(self.hidden_states(input_ids, batch))
