"""The compiled pieces of the generation engine: prefill, first tokens, the decode loop, row updates.

    pools, logits = prefill(weights, pools, ids, lengths, slots, plan=plan)   # prompts [P, S] right padded
    embeds, deep = image_embeddings(weights, ids, pixel_values, image_kwargs, plan=plan)   # prompts with images:
    pools, logits = prefill(weights, pools, ids, lengths, slots, PrefillImages(embeds, block_ids, mrope, deep),
                            plan=plan)
    rows, first, lp = start_rows(rows, logits, ..., flags=flags)             # first tokens of admitted rows
    pools, rows, tokens, logprobs, taken = decode_chunk(weights, pools, rows, tables, steps, plan=plan,
                                                        flags=flags, cap=cap)

A linear-attention layer (Qwen3.5) keeps each row's recurrent state (conv window and delta-rule state,
`models.linear_attention.RecurrentState`) where an attention layer keeps its page pools: a prefill computes the
prompts' final states and writes them into the admitted rows (a row's state restarts there), decode steps
advance the live rows' states.

Every layer runs unrolled in Python (no scan: no per-step copy of the cache through a scan, and each layer's
page pool is its own array, updated in place as a donated loop carry). The decode loop is one `lax.while_loop`
of up to `steps` tokens that stops early once every row is done; the host reads its [R, cap] output once.

Row state (`Rows`, arrays [R, ...]): the token to feed next, the tokens already cached (`lengths`, also the next
token's position), whether the row is active, tokens still allowed (`budget`), tokens generated, the row's PRNG
key, its sampling parameters, its stop token ids [R, S] (-1 padded), with a repetition penalty the tokens seen
[R, V], in a run with M-RoPE prompts (Qwen2.5-VL with images) each row's position offset (a token's rotary
position is its cache slot + the offset: transformers' rope_deltas), and with LongRoPE (Phi-3) the index of the
first output token each row feeds with the long factors (`long_from`; the engine rewrites the row's cached keys
with them at that step when its request says so, as transformers' Phi-3 rebuilds its cache).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from unsloth_jax import ops
from unsloth_jax.inference.pages import attention_pool
from unsloth_jax.inference.sampling import RowParams, SamplerFlags, sample, seen_tokens, token_keys
from unsloth_jax.inference.weights import DecodeWeights, LayerPlan, layer_module
from unsloth_jax.models.attention import Batch, PagedDecode, PagedPrefill
from unsloth_jax.models.linear_attention import RecurrentDecode, RecurrentPrefill
from unsloth_jax.models.rope import mrope_tables


class Rows(NamedTuple):
    tokens: jax.Array  # [R] int32, fed at the next step
    lengths: jax.Array  # [R] int32, tokens in the cache
    active: jax.Array  # [R] bool
    budget: jax.Array  # [R] int32, tokens the row may still generate
    generated: jax.Array  # [R] int32
    keys: jax.Array  # [R, 2] uint32
    params: RowParams
    stop_ids: jax.Array  # [R, S] int32, -1 padded
    seen: jax.Array | None  # [R, V] bool, with a repetition penalty
    offsets: jax.Array | None = None  # [R] int32, rotary position - cache slot (runs with M-RoPE prompts)
    long_from: jax.Array | None = None  # [R] int32, LongRoPE: output tokens from this index on are fed long


class PrefillImages(NamedTuple):
    """The image side of a prefill of prompts [P, S]: embeds [P, S, D] (the model's embed_with_images: token
    embeddings with the image features at the image tokens; `image_embeddings`), block_ids [P, S] int32 (Gemma 3's
    image blocks, attending to each other both ways; -1 elsewhere) or None (causal), rope_positions [3, P, S]
    int32 (Qwen2.5-VL's M-RoPE positions) or None (positions 0 .. S-1), deepstack [K, P, S, D] (Qwen3-VL's
    DeepStack residuals, added to the output of layer k) or None."""

    embeds: jax.Array
    block_ids: jax.Array | None
    rope_positions: jax.Array | None
    deepstack: jax.Array | None = None


def _layers(plan: LayerPlan, weights: DecodeWeights, model, x, positions, caches, lengths, *, decode: bool,
            rope=None, long=None, ple=None, deepstack=None):
    """Every layer over x [B, S, D], layer i with the cache `caches(i)` (a PagedPrefill or PagedDecode over its
    page pools; a linear-attention layer's RecurrentPrefill or RecurrentDecode over its rows' recurrent states)
    -> (x, new pools tuple). decode: one token per row (projection kernels read in place). rope:
    ((cos, sin), local) tables to rotate by instead of the text model's at `positions`. long: LongRoPE's
    factors per row ([B] bool), or None. ple: Gemma 4's per-layer inputs [L, B, S, P], or None. A KV-shared
    layer (Gemma 4) attends over its source layer's keys/values (prefill) or pages (decode), its own pages
    left unwritten. deepstack: [K, B, S, D] added to the output of layers 0 .. K-1 (Qwen3-VL), or None."""
    cfg = model.config
    (cos, sin), local = model.model.rope(positions, long) if rope is None else rope
    windows, sparse = model.model.layer_windows(), model.model.layer_sparse()
    linear = model.model.layer_linear()  # Qwen3.5: caches(i) of a linear layer is its RecurrentPrefill / Decode
    batch = Batch(positions=positions, kv_valid=None, segment_ids=None, kv_lengths=lengths)
    pools, shared = [], {}
    ropes = model.model.layer_ropes(cos, sin, local)  # per layer; (None, None) on NoPE layers
    for i in range(cfg.num_hidden_layers):
        layer = layer_module(plan, weights, i, in_place=decode)
        extra = {} if ple is None else {"per_layer_input": ple[i]}
        if cfg.kv_source(i) != i:
            extra["shared"] = shared[cfg.kv_source(i)]
        x, kv, _, fresh = layer(x, *ropes[i], batch, windows[i], caches(i), sparse=sparse[i], linear=linear[i],
                                return_kv=True, **extra)
        if deepstack is not None and i < deepstack.shape[0]:
            x = x + deepstack[i].astype(x.dtype)
        if i in cfg.kv_shared_sources:
            shared[i] = (fresh, kv)
        pools.append(kv)
    return x, tuple(pools)


def _prefill(weights: DecodeWeights, pools, ids, lengths, slots, images: PrefillImages | None = None,
             long=None, state_rows=None, *, plan: LayerPlan):
    """Prompts ids [P, S] (right padded, lengths [P]) through the model, their keys/values written to the pools
    at slots [P, S] -> (pools, logits of each prompt's last token [P, V] float32). images (PrefillImages, prompts
    with images): the layers start from its embeddings (ids unused), with its image blocks and M-RoPE positions.
    long: LongRoPE's factors per prompt ([P] bool; a row's cache rewritten with the long factors is a prefill of
    its whole sequence so far with long True), or None. state_rows (linear-attention layers, Qwen3.5): (prompt_of
    [N], targets [N]): row targets[n] starts from the final recurrent state of prompt prompt_of[n] (targets out
    of range are dropped); the other rows keep theirs."""
    model = nnx.merge(plan.graphdef, weights.state)
    p, s = ids.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (p, s))
    rope, block_ids, deepstack = None, None, None
    ple = None
    if images is None:
        x = model.model.embed(ids, model.dtype)
        ple = model.model.per_layer_inputs(ids, x)
    else:
        x, block_ids, deepstack = images.embeds, images.block_ids, images.deepstack
        if images.rope_positions is not None:
            rope = (mrope_tables(model.config, images.rope_positions, model.vl_config.mrope_section,
                                 model.vl_config.mrope_interleaved), None)

    def caches(i):
        if model.config.layer_linear and model.config.layer_linear[i]:
            return RecurrentPrefill(pools[i].conv, pools[i].state, lengths, *state_rows)
        return PagedPrefill(pools[i][0], pools[i][1], slots, lengths, block_ids)

    x, pools = _layers(plan, weights, model, x, positions, caches, lengths, decode=False, rope=rope, long=long,
                       ple=ple, deepstack=deepstack)
    last = jnp.take_along_axis(x, (jnp.maximum(lengths, 1) - 1)[:, None, None], axis=1)[:, 0]
    return pools, model.logits_from_hidden(model.model.norm(last))


def _image_embeddings(weights: DecodeWeights, ids, pixel_values, image_kwargs, *, plan: LayerPlan):
    """(the prefill embeddings [P, S, D], the DeepStack residuals [K, P, S, D] or None) of prompts ids [P, S] with
    images: the model's embed_with_images(ids, pixel_values, **image_kwargs) (the vision tower, LoRA included, and
    the image features at the image tokens; image_inputs.image_batch builds the arguments), or its
    embed_with_deepstack where it has one (Qwen3-VL)."""
    model = nnx.merge(plan.graphdef, weights.state)
    if hasattr(model, "embed_with_deepstack"):
        return model.embed_with_deepstack(ids, pixel_values, **image_kwargs)
    return model.embed_with_images(ids, pixel_values, **image_kwargs), None


def _stopped(tokens, stop_ids):
    return jnp.any(tokens[:, None] == stop_ids, axis=-1)


def _start_rows(rows: Rows, logits, prompt_of, targets, prompt_lengths, budgets, keys, params: RowParams, stop_ids,
                prompt_tokens, offsets=None, long_from=None, *, flags: SamplerFlags):
    """Admit new rows: their first token sampled from their prompt's last logits.

    logits [P, V]; prompt_of [N] (which prompt each new row continues); targets [N] the row slots; prompt_lengths
    [N]; budgets [N] (max_tokens); keys [N, 2]; params (RowParams of [N]); stop_ids [N, S]; prompt_tokens [N, T]
    (NO_TOKEN padded; for the repetition penalty's seen tokens); offsets [N] (the rows' position offsets; exactly
    when `rows` has them); long_from [N] (LongRoPE; exactly when `rows` has it). Returns (rows, first tokens [N], their log-probs [N])."""
    n = targets.shape[0]
    seen = seen_tokens(prompt_tokens, logits.shape[-1]) if flags.penalty else None
    tokens, logprobs = sample(logits[prompt_of], params, token_keys(keys, jnp.zeros((n,), jnp.int32)), flags, seen)
    active = ~_stopped(tokens, stop_ids) & (budgets > 1)
    new = Rows(tokens, prompt_lengths, active, budgets - 1, jnp.ones((n,), jnp.int32), keys, params, stop_ids,
               None if seen is None else seen.at[jnp.arange(n), tokens].set(True), offsets, long_from)
    rows = jax.tree.map(lambda old, fresh: old.at[targets].set(fresh.astype(old.dtype)), rows, new)
    return rows, tokens, logprobs


def _decode_chunk(weights: DecodeWeights, pools, rows: Rows, tables, steps, *, plan: LayerPlan, flags: SamplerFlags,
                  cap: int):
    """Up to `steps` (<= cap) decode steps of every active row -> (pools, rows, tokens [R, cap] (-1 where a row
    produced nothing), log-probs [R, cap], steps taken)."""
    model = nnx.merge(plan.graphdef, weights.state)
    r = rows.tokens.shape[0]
    k_pages = attention_pool(pools)[0]
    page_size = k_pages.shape[1]
    num_slots = k_pages.shape[0] * page_size

    def body(carry):
        step, pools, rows, out_tok, out_lp = carry
        live = rows.active
        page = jnp.take_along_axis(tables, (rows.lengths // page_size)[:, None], axis=1)[:, 0]
        slots = jnp.where(live, page * page_size + rows.lengths % page_size, num_slots)  # idle rows: dropped
        attend_len = jnp.where(live, rows.lengths + 1, 0)
        x = model.model.embed(rows.tokens[:, None], model.dtype)
        ple = model.model.per_layer_inputs(rows.tokens[:, None], x)

        def caches(i):
            if model.config.layer_linear and model.config.layer_linear[i]:
                return RecurrentDecode(pools[i].conv, pools[i].state, live)
            return PagedDecode(pools[i][0], pools[i][1], slots, tables, attend_len)

        positions = rows.lengths if rows.offsets is None else rows.lengths + rows.offsets
        long = None if rows.long_from is None else rows.generated - 1 >= rows.long_from  # the fed token's index
        x, pools = _layers(plan, weights, model, x, positions[:, None], caches, None, decode=True, long=long,
                           ple=ple)
        logits = model.logits_from_hidden(model.model.norm(x[:, 0]))
        tok, lp = sample(logits, rows.params, token_keys(rows.keys, rows.generated), flags, rows.seen)
        out_tok = out_tok.at[:, step].set(jnp.where(live, tok, -1))
        out_lp = out_lp.at[:, step].set(jnp.where(live, lp, 0.0))
        budget = rows.budget - live
        done = _stopped(tok, rows.stop_ids) | (budget <= 0)
        seen = rows.seen
        if seen is not None:
            seen = seen.at[jnp.arange(r), tok].set(seen[jnp.arange(r), tok] | live)
        rows = rows._replace(tokens=jnp.where(live, tok, rows.tokens), lengths=rows.lengths + live,
                             active=live & ~done, budget=budget, generated=rows.generated + live, seen=seen)
        return step + 1, pools, rows, out_tok, out_lp

    def cond(carry):
        step, _, rows, _, _ = carry
        return (step < steps) & jnp.any(rows.active)

    init = (jnp.int32(0), pools, rows, jnp.full((r, cap), -1, jnp.int32), jnp.zeros((r, cap), jnp.float32))
    taken, pools, rows, out_tok, out_lp = jax.lax.while_loop(cond, body, init)
    return pools, rows, out_tok, out_lp, taken


def _deactivate(rows: Rows, targets):
    """Rows `targets` [N] stop (finished on the host: a stop string)."""
    return rows._replace(active=rows.active.at[targets].set(False))


prefill = ops.policy_jit(_prefill, static_argnames=("plan",), donate_argnums=(1,))
image_embeddings = ops.policy_jit(_image_embeddings, static_argnames=("plan",))
start_rows = ops.policy_jit(_start_rows, static_argnames=("flags",), donate_argnums=(0,))
decode_chunk = ops.policy_jit(_decode_chunk, static_argnames=("plan", "flags", "cap"), donate_argnums=(1, 2),
                              compiler_options=ops.decode_compiler_options)
deactivate = jax.jit(_deactivate, donate_argnums=(0,))


def empty_rows(r: int, stop_width: int, vocab: int, flags: SamplerFlags, offsets: bool = False,
               long_from: bool = False) -> Rows:
    """Row state of r idle rows (every field its own buffer: the state is donated); offsets: with position
    offsets (a run with M-RoPE prompts); long_from: with LongRoPE switch indices."""
    def ints():
        return jnp.zeros((r,), jnp.int32)

    params = RowParams(jnp.zeros((r,), jnp.float32), ints(), jnp.ones((r,), jnp.float32),
                       jnp.zeros((r,), jnp.float32), jnp.ones((r,), jnp.float32))
    return Rows(ints(), ints(), jnp.zeros((r,), bool), ints(), ints(), jnp.zeros((r, 2), jnp.uint32), params,
                jnp.full((r, stop_width), -1, jnp.int32),
                jnp.zeros((r, vocab), bool) if flags.penalty else None, ints() if offsets else None,
                ints() if long_from else None)


__all__ = ["Rows", "PrefillImages", "prefill", "image_embeddings", "start_rows", "decode_chunk", "deactivate",
           "empty_rows"]
