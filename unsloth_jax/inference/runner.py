"""The compiled pieces of the generation engine: prefill, first tokens, the decode loop, row updates.

    pools, logits = prefill(weights, pools, ids, lengths, slots, plan=plan)   # prompts [P, S] right padded
    rows, first, lp = start_rows(rows, logits, ..., flags=flags)             # first tokens of admitted rows
    pools, rows, tokens, logprobs, taken = decode_chunk(weights, pools, rows, tables, steps, plan=plan,
                                                        flags=flags, cap=cap)

Every layer runs unrolled in Python (no scan: no per-step copy of the cache through a scan, and each layer's
page pool is its own array, updated in place as a donated loop carry). The decode loop is one `lax.while_loop`
of up to `steps` tokens that stops early once every row is done; the host reads its [R, cap] output once.

Row state (`Rows`, arrays [R, ...]): the token to feed next, the tokens already cached (`lengths`, also the next
token's position), whether the row is active, tokens still allowed (`budget`), tokens generated, the row's PRNG
key, its sampling parameters, its stop token ids [R, S] (-1 padded) and, with a repetition penalty, the tokens
seen [R, V].
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from unsloth_jax import ops
from unsloth_jax.inference.sampling import RowParams, SamplerFlags, sample, seen_tokens, token_keys
from unsloth_jax.inference.weights import DecodeWeights, LayerPlan, layer_module
from unsloth_jax.models.attention import Batch, PagedDecode, PagedPrefill


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


def _layers(plan: LayerPlan, weights: DecodeWeights, model, x, positions, caches, lengths, *, decode: bool):
    """Every layer over x [B, S, D], layer i with the cache `caches(i)` (a PagedPrefill or PagedDecode over its
    page pools) -> (x, new pools tuple). decode: one token per row (projection kernels read in place)."""
    cfg = model.config
    (cos, sin), local = model.model.rope(positions)
    windows, sparse = model.model.layer_windows(), model.model.layer_sparse()
    batch = Batch(positions=positions, kv_valid=None, segment_ids=None, kv_lengths=lengths)
    pools = []
    for i in range(cfg.num_hidden_layers):
        j = i % cfg.layer_period
        rope = local if (local is not None and windows[j] is not None) else (cos, sin)
        layer = layer_module(plan, weights, i, in_place=decode)
        x, kv, _ = layer(x, *rope, batch, windows[j], caches(i), sparse=sparse[j])
        pools.append(kv)
    return x, tuple(pools)


def _prefill(weights: DecodeWeights, pools, ids, lengths, slots, *, plan: LayerPlan):
    """Prompts ids [P, S] (right padded, lengths [P]) through the model, their keys/values written to the pools
    at slots [P, S] -> (pools, logits of each prompt's last token [P, V] float32)."""
    model = nnx.merge(plan.graphdef, weights.state)
    p, s = ids.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (p, s))
    x = model.model.embed(ids, model.dtype)

    def caches(i):
        return PagedPrefill(pools[i][0], pools[i][1], slots, lengths)

    x, pools = _layers(plan, weights, model, x, positions, caches, lengths, decode=False)
    last = jnp.take_along_axis(x, (jnp.maximum(lengths, 1) - 1)[:, None, None], axis=1)[:, 0]
    return pools, model.logits_from_hidden(model.model.norm(last))


def _stopped(tokens, stop_ids):
    return jnp.any(tokens[:, None] == stop_ids, axis=-1)


def _start_rows(rows: Rows, logits, prompt_of, targets, prompt_lengths, budgets, keys, params: RowParams, stop_ids,
                prompt_tokens, *, flags: SamplerFlags):
    """Admit new rows: their first token sampled from their prompt's last logits.

    logits [P, V]; prompt_of [N] (which prompt each new row continues); targets [N] the row slots; prompt_lengths
    [N]; budgets [N] (max_tokens); keys [N, 2]; params (RowParams of [N]); stop_ids [N, S]; prompt_tokens [N, T]
    (NO_TOKEN padded; for the repetition penalty's seen tokens). Returns (rows, first tokens [N], their log-probs
    [N])."""
    n = targets.shape[0]
    seen = seen_tokens(prompt_tokens, logits.shape[-1]) if flags.penalty else None
    tokens, logprobs = sample(logits[prompt_of], params, token_keys(keys, jnp.zeros((n,), jnp.int32)), flags, seen)
    active = ~_stopped(tokens, stop_ids) & (budgets > 1)
    new = Rows(tokens, prompt_lengths, active, budgets - 1, jnp.ones((n,), jnp.int32), keys, params, stop_ids,
               None if seen is None else seen.at[jnp.arange(n), tokens].set(True))
    rows = jax.tree.map(lambda old, fresh: old.at[targets].set(fresh.astype(old.dtype)), rows, new)
    return rows, tokens, logprobs


def _decode_chunk(weights: DecodeWeights, pools, rows: Rows, tables, steps, *, plan: LayerPlan, flags: SamplerFlags,
                  cap: int):
    """Up to `steps` (<= cap) decode steps of every active row -> (pools, rows, tokens [R, cap] (-1 where a row
    produced nothing), log-probs [R, cap], steps taken)."""
    model = nnx.merge(plan.graphdef, weights.state)
    r = rows.tokens.shape[0]
    page_size = pools[0][0].shape[1]
    num_slots = pools[0][0].shape[0] * page_size

    def body(carry):
        step, pools, rows, out_tok, out_lp = carry
        live = rows.active
        page = jnp.take_along_axis(tables, (rows.lengths // page_size)[:, None], axis=1)[:, 0]
        slots = jnp.where(live, page * page_size + rows.lengths % page_size, num_slots)  # idle rows: dropped
        attend_len = jnp.where(live, rows.lengths + 1, 0)
        x = model.model.embed(rows.tokens[:, None], model.dtype)

        def caches(i):
            return PagedDecode(pools[i][0], pools[i][1], slots, tables, attend_len)

        x, pools = _layers(plan, weights, model, x, rows.lengths[:, None], caches, None, decode=True)
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
start_rows = ops.policy_jit(_start_rows, static_argnames=("flags",), donate_argnums=(0,))
decode_chunk = ops.policy_jit(_decode_chunk, static_argnames=("plan", "flags", "cap"), donate_argnums=(1, 2),
                              compiler_options=ops.decode_compiler_options)
deactivate = jax.jit(_deactivate, donate_argnums=(0,))


def empty_rows(r: int, stop_width: int, vocab: int, flags: SamplerFlags) -> Rows:
    """Row state of r idle rows (every field its own buffer: the state is donated)."""
    def ints():
        return jnp.zeros((r,), jnp.int32)

    params = RowParams(jnp.zeros((r,), jnp.float32), ints(), jnp.ones((r,), jnp.float32),
                       jnp.zeros((r,), jnp.float32), jnp.ones((r,), jnp.float32))
    return Rows(ints(), ints(), jnp.zeros((r,), bool), ints(), ints(), jnp.zeros((r, 2), jnp.uint32), params,
                jnp.full((r, stop_width), -1, jnp.int32),
                jnp.zeros((r, vocab), bool) if flags.penalty else None)


__all__ = ["Rows", "prefill", "start_rows", "decode_chunk", "deactivate", "empty_rows"]
