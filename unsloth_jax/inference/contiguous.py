"""Generation over one contiguous KV cache, one jitted decode step per token: the engine's fallback for what it
does not serve (LongRoPE sequences that cross original_max_position_embeddings, below), reached through
`unsloth_jax.generation.generate`, which says so in one line.

    out = generate_contiguous(model, input_ids, attention_mask, max_new_tokens=64, eos_token_id=(2,))

Batches are LEFT padded (attention_mask 0 on the left, as HF's generate expects); positions count real tokens
only (`positions_from_mask`), so a padded row generates exactly what it would alone. The prompt is
left-padded further to a bucket length and the batch to a bucket size, so the jitted prefill and decode step
compile once per bucket of (batch, prompt length, cache length) and not for every new prompt length.

Each layer's cache is written through `DecoderModel.run_layers(..., cache=...)`, so the cached path is the same
layer code as training (Gemma 2's attention softcapping and alternating sliding windows included: the window
is measured in cache slots, which differ from HF's cache positions by a constant per row). Rows that emitted
an end-of-sequence token get `pad_token_id` afterwards; generation stops once every row has finished.

LongRoPE (Phi-3) picks short or long factors per forward call from the batch's largest position, so a cache
filled with the short factors would keep stale keys once decoding passes original_max_position_embeddings.
As transformers' Phi3ForCausalLM.prepare_inputs_for_generation does, the step at which the sequence (prompt
width included) reaches original_max_position_embeddings + 1 tokens is a forward over the whole sequence so
far (`_rebuild_step`), which rewrites every cached key and value with the factors of that call.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from unsloth_jax import ops
from unsloth_jax.config import ModelConfig
from unsloth_jax.inference.sampling import (NO_TOKEN, RowParams, SamplerFlags, SamplingParams, completion_key,
                                            sample, seen_tokens, token_keys)
from unsloth_jax.inference.weights import commit_in_place
from unsloth_jax.models.attention import Batch, KVCache
from unsloth_jax.models.rope import positions_from_mask

_MIN_BUCKET = 16


def bucket(n: int, minimum: int = _MIN_BUCKET) -> int:
    """The compile bucket of a length or batch size: the next power of two, at least `minimum`."""
    n = max(int(n), int(minimum))
    return 1 << (n - 1).bit_length()


# ------------------------------------------------------------------------------------------ model pieces
def _layers(model, x, positions, cache_k, cache_v, valid, index):
    """Run every layer of `model` over x [B, S, D] with the cache; writes this chunk's keys/values at `index`.

    cache_k/cache_v: [L, B, T, Hkv, hd]; valid: [B, T] (1 where a slot holds a real token, this chunk included).
    Returns (x, cache_k, cache_v).
    """
    (cos, sin), local = model.model.rope(positions)
    batch = Batch(positions=positions, kv_valid=None, segment_ids=None)
    x, (ck, cv) = model.model.run_layers(x, cos, sin, batch, cache=KVCache(cache_k, cache_v, valid, index),
                                         local_rope=local)
    return x, ck, cv


class RowSampler(NamedTuple):
    """What a contiguous path samples with, per row of its batch: params (RowParams of [B] arrays); keys [B, 2]
    uint32, each row's base key (a token's key folds in its index in the row's output, as the engine's); seen
    [B, V] bool, the row's prompt and output tokens for the repetition penalty (None without one)."""

    params: RowParams
    keys: jax.Array
    seen: jax.Array | None


def row_sampler(params: list[SamplingParams], ids: np.ndarray, mask: np.ndarray, vocab: int
                ) -> tuple[RowSampler, SamplerFlags]:
    """The RowSampler and its static SamplerFlags for a batch ids [R, P] (mask [R, P] 1 on real tokens) whose
    first len(params) rows take `params` (seed: the row's random stream; the engine's keys for the same seed)
    and whose further rows (batch padding) copy the first's."""
    rows = ids.shape[0]
    params = list(params) + [params[0]] * (rows - len(params))
    flags = SamplerFlags.of(params)
    keys = np.stack([completion_key(q.seed or 0, 0) for q in params])
    seen = None
    if flags.penalty:
        seen = seen_tokens(jnp.asarray(np.where(mask > 0, ids, NO_TOKEN), jnp.int32), vocab)
    return RowSampler(RowParams(*(jnp.asarray(a) for a in RowParams.of(params))), jnp.asarray(keys), seen), flags


def _choose(logits, sampler: RowSampler, generated, done, eos_ids, pad_id, flags: SamplerFlags):
    """Next tokens [B] from logits [B, V] (f32) by inference.sampling.sample (greedy rows: argmax after the
    repetition penalty), the generated-th token of each row. Finished rows get pad_id; a row finishes when it
    emits one of eos_ids. -> (tokens [B] int32, done [B], sampler with the tokens seen)."""
    keys = token_keys(sampler.keys, jnp.broadcast_to(jnp.int32(generated), done.shape))
    tok, _ = sample(logits, sampler.params, keys, flags, sampler.seen)
    tok = jnp.where(done, pad_id, tok)
    done = done | jnp.any(tok[:, None] == eos_ids[None, :], axis=-1)
    seen = None if sampler.seen is None else sampler.seen.at[jnp.arange(tok.shape[0]), tok].set(True)
    return tok, done, sampler._replace(seen=seen)


def _next_tokens(model, x, positions, cache, index, done, sampler, generated, eos_ids, pad_id,
                 flags: SamplerFlags, read=-1):
    """Embedded chunk x [B, S, D] through every layer (cache written at slot `index`), then the next token of
    each row from chunk position `read` (default the last) -> (tokens [B], done [B], cache, sampler)."""
    ck, cv, valid = cache
    x, ck, cv = _layers(model, x, positions, ck, cv, valid, index)
    logits = model.logits_from_hidden(model.model.norm(x[:, read]))
    tok, done, sampler = _choose(logits, sampler, generated, done, eos_ids, pad_id, flags)
    return tok, done, (ck, cv, valid), sampler


def _prefill(state, input_ids, attention_mask, sampler, eos_ids, pad_id, *, graphdef, cache_len: int,
             flags: SamplerFlags):
    """Prompt [B, P] (left padded) -> (first new tokens [B], done [B], cache, sampler)."""
    model = nnx.merge(graphdef, state)
    cfg = model.config
    b, p = input_ids.shape
    shape = (cfg.num_hidden_layers, b, cache_len, cfg.num_key_value_heads, cfg.head_dim)
    ck = jnp.zeros(shape, model.dtype)
    cv = jnp.zeros(shape, model.dtype)
    valid = jnp.zeros((b, cache_len), jnp.int32).at[:, :p].set(attention_mask)
    positions = positions_from_mask(attention_mask)
    x = model.model.embed(input_ids, model.dtype)
    return _next_tokens(model, x, positions, (ck, cv, valid), 0, jnp.zeros((b,), bool), sampler, 0, eos_ids,
                        pad_id, flags)


def _decode_step(state, cache, tokens, positions, index, done, sampler, generated, eos_ids, pad_id, *, graphdef,
                 flags: SamplerFlags):
    """One token per row: tokens [B] at cache slot `index` and positions [B], the generated-th new token of each
    row -> (next tokens, done, cache, sampler)."""
    model = nnx.merge(graphdef, state)
    ck, cv, valid = cache
    b = tokens.shape[0]
    valid = jax.lax.dynamic_update_slice_in_dim(valid, jnp.ones((b, 1), valid.dtype), index, axis=1)
    x = model.model.embed(tokens[:, None], model.dtype)
    return _next_tokens(model, x, positions[:, None], (ck, cv, valid), index, done, sampler, generated, eos_ids,
                        pad_id, flags)


def _rebuild_step(state, cache, tokens, index, done, sampler, generated, eos_ids, pad_id, *, graphdef,
                  flags: SamplerFlags):
    """The decode step of the token at cache slot `index`, run as a forward over every slot: tokens [B, T]
    (T = cache length) hold the prompt and every token up to slot `index` (later slots are ignored). Every cached
    key and value is rewritten with the RoPE factors of this call (LongRoPE's switch to the long factors);
    slots after `index` get keys that stay invalid until a decode step writes them. -> (next tokens, done,
    cache, sampler), as `_decode_step`."""
    model = nnx.merge(graphdef, state)
    ck, cv, valid = cache
    b = tokens.shape[0]
    valid = jax.lax.dynamic_update_slice_in_dim(valid, jnp.ones((b, 1), valid.dtype), index, axis=1)
    positions = positions_from_mask(valid)  # slots after `index` repeat the last position: the maximum holds
    x = model.model.embed(tokens, model.dtype)
    return _next_tokens(model, x, positions, (ck, cv, valid), 0, done, sampler, generated, eos_ids, pad_id, flags,
                        read=index)


def _rebuild_step_index(cfg: ModelConfig, prompt_width: int) -> int | None:
    """The decode step (0 = the one fed the first new token) that must rebuild the cache, or None: with LongRoPE
    the step at which the prompt width plus the tokens fed so far reaches original_max_position_embeddings + 1,
    when the prompt is shorter than that (transformers' Phi-3 drops its cache at that length)."""
    if cfg.rope_type != "longrope" or prompt_width > cfg.rope_original_max_position:
        return None
    return cfg.rope_original_max_position - prompt_width


_prefill_jit = ops.policy_jit(_prefill, static_argnames=("graphdef", "cache_len", "flags"))
_decode_step_jit = ops.policy_jit(_decode_step, static_argnames=("graphdef", "flags"), donate_argnums=(1,))
_rebuild_step_jit = ops.policy_jit(_rebuild_step, static_argnames=("graphdef", "flags"), donate_argnums=(1,))


# ----------------------------------------------------------------------------------------------- generate
def generate_contiguous(model, ids: np.ndarray, mask: np.ndarray, max_new_tokens: int,
                        params: list[SamplingParams], eos: tuple[int, ...], streamer, pad_token_id: int) -> np.ndarray:
    """Continue each row of ids [B, P] int32 (left padded: mask [B, P] 0 on the padding, inputs checked by
    `unsloth_jax.generation.generate`) by up to max_new_tokens tokens -> [B, P + new] int64. params: one
    SamplingParams per row (temperature 0: greedy; top_k, top_p, min_p, repetition_penalty and seed as the
    engine's); a row stops at its first token of `eos`, later slots hold pad_token_id; it ends when every row
    has. streamer: as `generate`'s (put(prompt) then put(each step's tokens [B]), or a callable of each step's
    tokens)."""
    b, p = ids.shape
    cfg: ModelConfig = model.config
    eos_arr = jnp.asarray(eos or (-1,), jnp.int32)

    # Buckets: the prompt is left padded to pb, the batch to bb rows (copies of row 0), the cache to t slots.
    pb, bb = bucket(p), bucket(b, 1)
    t = bucket(pb + max_new_tokens, 64)
    pids = np.zeros((bb, pb), np.int32)
    pmask = np.zeros((bb, pb), np.int32)
    pids[:b, pb - p:] = ids
    pmask[:b, pb - p:] = mask
    pids[b:] = pids[0]
    pmask[b:] = pmask[0]
    n_real = pmask.sum(axis=1).astype(np.int32)

    sampler, flags = row_sampler(params, pids, pmask, cfg.vocab_size)
    pad = jnp.int32(pad_token_id)
    commit_in_place(model)  # as the engine's weights: one program before and after training
    graphdef, state = nnx.split(model)
    common = dict(graphdef=graphdef, flags=flags)

    if streamer is not None and hasattr(streamer, "put"):
        streamer.put(ids.astype(np.int64))
    tok, done, cache, sampler = _prefill_jit(state, jnp.asarray(pids), jnp.asarray(pmask), sampler, eos_arr, pad,
                                             cache_len=t, **common)

    def fed_tokens(out, tok):  # the prompt, the tokens fed so far (out: one [b] per step) and this step's
        step = len(out)
        fed = np.zeros((bb, t), np.int32)
        fed[:, :pb] = pids
        fed[:b, pb:pb + step] = np.stack(out, axis=1) if out else np.zeros((b, 0), np.int32)
        fed[b:, pb:pb + step] = fed[0, pb:pb + step]  # the batch's padding rows copy row 0
        fed[:, pb + step] = np.asarray(tok)
        return fed

    new = decode_loop(state, cache, tok, done, sampler, n_real, pb, max_new_tokens, eos_arr, pad, common, streamer,
                      b, rebuild_at=_rebuild_step_index(cfg, p), fed_tokens=fed_tokens)
    return np.concatenate([ids, new], axis=1).astype(np.int64)


def decode_loop(state, cache, tok, done, sampler, first_positions, first_slot: int, max_new_tokens: int, eos_arr, pad,
                common: dict, streamer, rows: int, *, rebuild_at: int | None, fed_tokens) -> np.ndarray:
    """The decode steps after a prefill that gave the first new tokens `tok` [R] (done [R], cache, sampler): step n
    feeds its token at cache slot first_slot + n and position first_positions [R] + n, the next step dispatched
    before this one's tokens are read back; it ends after max_new_tokens tokens or when the first `rows` rows
    (the real ones) are done. At step `rebuild_at` the step is `_rebuild_step` over fed_tokens(the [rows] tokens
    read so far, one per step; this step's tokens) [R, T]. streamer: put / callable of each step's tokens
    [rows], end() at the end. Returns the new tokens [rows, steps] int32."""
    out = []
    for step in range(max_new_tokens):
        nxt = None
        if step + 1 < max_new_tokens:  # dispatch the next step before reading this one back
            slot, generated = jnp.int32(first_slot + step), jnp.int32(step + 1)
            if step == rebuild_at:
                nxt = _rebuild_step_jit(state, cache, jnp.asarray(fed_tokens(out, tok)), slot, done, sampler,
                                        generated, eos_arr, pad, **common)
            else:
                nxt = _decode_step_jit(state, cache, tok, jnp.asarray(first_positions + step), slot, done, sampler,
                                       generated, eos_arr, pad, **common)
        host_tok = np.asarray(tok)[:rows]
        host_done = np.asarray(done)[:rows]
        out.append(host_tok)
        if streamer is not None:
            (streamer.put if hasattr(streamer, "put") else streamer)(host_tok.astype(np.int64))
        if host_done.all() or nxt is None:
            break
        tok, done, cache, sampler = nxt
    if streamer is not None and hasattr(streamer, "end"):
        streamer.end()
    return np.stack(out, axis=1) if out else np.zeros((rows, 0), np.int32)


__all__ = ["generate_contiguous", "bucket"]
