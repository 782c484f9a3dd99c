"""Text generation with a KV cache: prefill the prompt once, then one jitted decode step per new token.

    out = generate(model, input_ids, attention_mask, max_new_tokens=64)        # greedy, as HF's generate
    out = generate(model, ids, mask, do_sample=True, temperature=0.7, top_p=0.9, seed=1)

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

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from unsloth_jax import ops
from unsloth_jax.config import ModelConfig
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


def _choose(logits, key, temperature, top_p, done, eos_ids, pad_id, do_sample: bool):
    """Next tokens [B] from logits [B, V] (f32): argmax, or temperature + nucleus sampling. Finished rows get
    pad_id; a row finishes when it emits one of eos_ids."""
    if do_sample:
        z = logits / jnp.maximum(temperature, 1e-6)
        order = jnp.argsort(-z, axis=-1)
        sorted_z = jnp.take_along_axis(z, order, axis=-1)
        probs = jax.nn.softmax(sorted_z, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
        keep_sorted = before < top_p
        keep_sorted = keep_sorted.at[:, 0].set(True)
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(z.shape[0])[:, None], order].set(keep_sorted)
        z = jnp.where(keep, z, -jnp.inf)
        tok = jax.random.categorical(key, z, axis=-1).astype(jnp.int32)
    else:
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    tok = jnp.where(done, pad_id, tok)
    done = done | jnp.any(tok[:, None] == eos_ids[None, :], axis=-1)
    return tok, done


def _next_tokens(model, x, positions, cache, index, done, key, temperature, top_p, eos_ids, pad_id,
                 do_sample: bool, read=-1):
    """Embedded chunk x [B, S, D] through every layer (cache written at slot `index`), then the next token of
    each row from chunk position `read` (default the last) -> (tokens [B], done [B], cache)."""
    ck, cv, valid = cache
    x, ck, cv = _layers(model, x, positions, ck, cv, valid, index)
    logits = model.logits_from_hidden(model.model.norm(x[:, read]))
    tok, done = _choose(logits, key, temperature, top_p, done, eos_ids, pad_id, do_sample)
    return tok, done, (ck, cv, valid)


def _prefill(state, input_ids, attention_mask, key, temperature, top_p, eos_ids, pad_id, *, graphdef,
             cache_len: int, do_sample: bool):
    """Prompt [B, P] (left padded) -> (first new tokens [B], done [B], cache)."""
    model = nnx.merge(graphdef, state)
    cfg = model.config
    b, p = input_ids.shape
    shape = (cfg.num_hidden_layers, b, cache_len, cfg.num_key_value_heads, cfg.head_dim)
    ck = jnp.zeros(shape, model.dtype)
    cv = jnp.zeros(shape, model.dtype)
    valid = jnp.zeros((b, cache_len), jnp.int32).at[:, :p].set(attention_mask)
    positions = positions_from_mask(attention_mask)
    x = model.model.embed(input_ids, model.dtype)
    return _next_tokens(model, x, positions, (ck, cv, valid), 0, jnp.zeros((b,), bool),
                        jax.random.fold_in(key, 0), temperature, top_p, eos_ids, pad_id, do_sample)


def _decode_step(state, cache, tokens, positions, index, done, key, temperature, top_p, eos_ids, pad_id, *,
                 graphdef, do_sample: bool):
    """One token per row: tokens [B] at cache slot `index` and positions [B] -> (next tokens, done, cache)."""
    model = nnx.merge(graphdef, state)
    ck, cv, valid = cache
    b = tokens.shape[0]
    valid = jax.lax.dynamic_update_slice_in_dim(valid, jnp.ones((b, 1), valid.dtype), index, axis=1)
    x = model.model.embed(tokens[:, None], model.dtype)
    return _next_tokens(model, x, positions[:, None], (ck, cv, valid), index, done,
                        jax.random.fold_in(key, index), temperature, top_p, eos_ids, pad_id, do_sample)


def _rebuild_step(state, cache, tokens, index, done, key, temperature, top_p, eos_ids, pad_id, *, graphdef,
                  do_sample: bool):
    """The decode step of the token at cache slot `index`, run as a forward over every slot: tokens [B, T]
    (T = cache length) hold the prompt and every token up to slot `index` (later slots are ignored). Every cached
    key and value is rewritten with the RoPE factors of this call (LongRoPE's switch to the long factors);
    slots after `index` get keys that stay invalid until a decode step writes them. -> (next tokens, done,
    cache), as `_decode_step`."""
    model = nnx.merge(graphdef, state)
    ck, cv, valid = cache
    b = tokens.shape[0]
    valid = jax.lax.dynamic_update_slice_in_dim(valid, jnp.ones((b, 1), valid.dtype), index, axis=1)
    positions = positions_from_mask(valid)  # slots after `index` repeat the last position: the maximum holds
    x = model.model.embed(tokens, model.dtype)
    return _next_tokens(model, x, positions, (ck, cv, valid), 0, done, jax.random.fold_in(key, index),
                        temperature, top_p, eos_ids, pad_id, do_sample, read=index)


def _rebuild_step_index(cfg: ModelConfig, prompt_width: int) -> int | None:
    """The decode step (0 = the one fed the first new token) that must rebuild the cache, or None: with LongRoPE
    the step at which the prompt width plus the tokens fed so far reaches original_max_position_embeddings + 1,
    when the prompt is shorter than that (transformers' Phi-3 drops its cache at that length)."""
    if cfg.rope_type != "longrope" or prompt_width > cfg.rope_original_max_position:
        return None
    return cfg.rope_original_max_position - prompt_width


_prefill_jit = ops.policy_jit(_prefill, static_argnames=("graphdef", "cache_len", "do_sample"))
_decode_step_jit = ops.policy_jit(_decode_step, static_argnames=("graphdef", "do_sample"), donate_argnums=(1,))
_rebuild_step_jit = ops.policy_jit(_rebuild_step, static_argnames=("graphdef", "do_sample"), donate_argnums=(1,))


# ------------------------------------------------------------------------------------------------ helpers
def _generation_config(model) -> dict:
    model_dir = getattr(model, "model_dir", None)
    if model_dir:
        path = Path(model_dir) / "generation_config.json"
        if path.is_file():
            try:
                return json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                return {}
    return {}


def default_eos_ids(model) -> tuple[int, ...]:
    """End-of-sequence ids: generation_config.json's eos_token_id when the model directory has one, else
    config.json's."""
    return _id_tuple(_generation_config(model).get("eos_token_id", model.config.eos_token_id))


def _id_tuple(raw) -> tuple[int, ...]:
    """None, an int or a list of ints -> a tuple of ints."""
    if raw is None:
        return ()
    return tuple(int(t) for t in raw) if isinstance(raw, (list, tuple)) else (int(raw),)


def _as_ids(x, name: str) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2:
        raise ValueError(f"generate: {name} must be [batch, length], got shape {arr.shape}")
    return arr


def _stream(streamer, tokens: np.ndarray) -> None:
    if streamer is None:
        return
    if hasattr(streamer, "put"):
        streamer.put(tokens)
    else:
        streamer(tokens)


# ----------------------------------------------------------------------------------------------- generate
def generate(model, input_ids, attention_mask=None, max_new_tokens: int = 32, temperature: float = 1.0,
             top_p: float = 1.0, do_sample: bool = False, eos_token_id=None, seed: int = 0, streamer=None,
             pad_token_id: int | None = None) -> np.ndarray:
    """Continue each row of input_ids [B, P] by up to max_new_tokens tokens; returns [B, P + new] (numpy).

    attention_mask [B, P]: 1 on real tokens, 0 on LEFT padding (None: all real). Greedy (argmax) unless
    do_sample, which samples from softmax(logits / temperature) restricted to the top_p nucleus (`seed` picks
    the random stream). eos_token_id: an int or a list (None: the model's generation_config / config). A row
    stops at its first eos; later slots hold pad_token_id (default: config.pad_token_id, else the first eos).
    Generation ends when every row has finished, so `new` may be less than max_new_tokens.

    streamer: an object with put(ids)/end() such as transformers.TextStreamer (put first receives the prompt
    [B, P], then each step's new tokens [B]), or a callable that receives each step's new tokens [B].
    """
    ids = _as_ids(input_ids, "input_ids").astype(np.int32)
    b, p = ids.shape
    if p == 0:
        raise ValueError("generate: input_ids is empty; give at least one prompt token (e.g. the BOS token)")
    if attention_mask is None:
        mask = np.ones_like(ids)
    else:
        mask = _as_ids(attention_mask, "attention_mask").astype(np.int32)
        if mask.shape != ids.shape:
            raise ValueError(f"generate: attention_mask shape {mask.shape} differs from input_ids shape {ids.shape}")
    if not np.all(mask[:, -1] == 1):
        rows = np.nonzero(mask[:, -1] != 1)[0].tolist()
        raise ValueError(f"generate: rows {rows} end in padding; batched generation needs LEFT padding "
                         "(tokenizer.padding_side = 'left')")
    if np.any(np.diff(mask, axis=1) < 0):
        raise ValueError("generate: attention_mask has padding between real tokens; only left padding is supported")
    if max_new_tokens <= 0:
        return ids.astype(np.int64)
    if temperature <= 0 and do_sample:
        raise ValueError("generate: temperature must be positive when do_sample=True (use do_sample=False for greedy)")
    cfg: ModelConfig = model.config
    if eos_token_id is None:
        eos = default_eos_ids(model)
    else:
        eos = _id_tuple(eos_token_id)
    if pad_token_id is None:
        pad_token_id = cfg.pad_token_id if cfg.pad_token_id is not None else (eos[0] if eos else 0)
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

    key = jax.random.PRNGKey(seed)
    temp = jnp.float32(temperature)
    top = jnp.float32(top_p)
    pad = jnp.int32(pad_token_id)
    graphdef, state = nnx.split(model)
    common = dict(graphdef=graphdef, do_sample=bool(do_sample))

    if streamer is not None and hasattr(streamer, "put"):
        streamer.put(ids.astype(np.int64))
    tok, done, cache = _prefill_jit(state, jnp.asarray(pids), jnp.asarray(pmask), key, temp, top, eos_arr, pad,
                                cache_len=t, **common)
    out = []
    rebuild_at = _rebuild_step_index(cfg, p)
    for step in range(max_new_tokens):
        nxt = None
        if step + 1 < max_new_tokens and step == rebuild_at:
            fed = np.zeros((bb, t), np.int32)  # the prompt, the tokens fed so far and this step's
            fed[:, :pb] = pids
            fed[:b, pb:pb + step] = np.stack(out, axis=1) if out else np.zeros((b, 0), np.int32)
            fed[b:, pb:pb + step] = fed[0, pb:pb + step]  # the batch's padding rows copy row 0
            fed[:, pb + step] = np.asarray(tok)
            nxt = _rebuild_step_jit(state, cache, jnp.asarray(fed), jnp.int32(pb + step), done, key, temp, top,
                                    eos_arr, pad, **common)
        elif step + 1 < max_new_tokens:  # dispatch the next step before reading this one back
            nxt = _decode_step_jit(state, cache, tok, jnp.asarray(n_real + step), jnp.int32(pb + step), done, key,
                               temp, top, eos_arr, pad, **common)
        host_tok = np.asarray(tok)[:b]
        host_done = np.asarray(done)[:b]
        out.append(host_tok)
        _stream(streamer, host_tok.astype(np.int64))
        if host_done.all() or nxt is None:
            break
        tok, done, cache = nxt
    if streamer is not None and hasattr(streamer, "end"):
        streamer.end()
    new = np.stack(out, axis=1) if out else np.zeros((b, 0), np.int32)
    return np.concatenate([ids, new], axis=1).astype(np.int64)


__all__ = ["generate", "bucket", "default_eos_ids"]
