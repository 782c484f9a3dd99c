"""Generation with images for Gemma 3 vision-language models (models.vision.Gemma3ForConditionalGeneration), on
one contiguous KV cache (the structure of inference/contiguous.py, whose decode step it reuses).

    out = generate_with_images(model, ids, mask, pixel_values, token_type_ids, max_new_tokens=32)   # [B, P + new]

The prefill embeds the prompt with the image features written at the image tokens (`embed_with_images`) and runs
every layer once over it, writing each layer's keys and values into the cache; the attention of that call is
the training one over the prompt alone (the cache is empty before it), with token_type_ids' image blocks
attending to each other both ways and Gemma 3's sliding windows, as transformers' prefill. Every later step
feeds one text token through `contiguous._decode_step` (causal, windows measured in cache slots, as
transformers' cache positions). Batches are LEFT padded; positions count real tokens only (`positions_from_mask`),
as transformers' generate. The prompt is left padded further to a bucket length (one compile per bucket); the
batch is not bucketed (its images belong to its rows).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from unsloth_jax import ops
from unsloth_jax.inference.contiguous import _choose, _decode_step_jit, bucket
from unsloth_jax.inference.weights import commit_in_place
from unsloth_jax.models.attention import Batch
from unsloth_jax.models.rope import positions_from_mask
from unsloth_jax.models.vision import image_block_ids


class ImagePrefillCache(NamedTuple):
    """One layer's contiguous cache while a prompt with images is prefilled (run_layers hands each layer its own
    k / v through `_replace`): keys and values [B, T, Hkv, hd], the prompt's attention_mask [B, P] (`valid`),
    `index` 0, and the image blocks block_ids [B, P] (models.vision.image_block_ids)."""

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    index: jax.Array
    block_ids: jax.Array

    def attend(self, q, k, v, *, scale, window, softcap, sinks):
        """q [B, P, Hq, hd], k/v [B, P, Hkv, hd]: attention over the prompt itself (image blocks both ways), k/v
        written at slots 0 .. P-1 -> (out [B, P, Hq, hd], (k cache, v cache))."""
        out = ops.attention(q, k, v, scale=scale, causal=True, window=window, softcap=softcap, kv_valid=self.valid,
                            sinks=sinks, block_ids=self.block_ids)
        ck = jax.lax.dynamic_update_slice_in_dim(self.k, k.astype(self.k.dtype), 0, axis=1)
        cv = jax.lax.dynamic_update_slice_in_dim(self.v, v.astype(self.v.dtype), 0, axis=1)
        return out, (ck, cv)


def _prefill(state, input_ids, attention_mask, token_type_ids, pixel_values, key, temperature, top_p, eos_ids,
             pad_id, *, graphdef, cache_len: int, do_sample: bool):
    """Prompt input_ids [B, P] (left padded, attention_mask [B, P], token_type_ids [B, P] 1 = image token or None),
    pixel_values [N, C, H, W] or None -> (first new tokens [B] int32, done [B] bool, (k, v, valid) cache with
    k/v [L, B, cache_len, Hkv, hd] and valid [B, cache_len] int32)."""
    model = nnx.merge(graphdef, state)
    cfg = model.config
    b, p = input_ids.shape
    shape = (cfg.num_hidden_layers, b, cache_len, cfg.num_key_value_heads, cfg.head_dim)
    ck = jnp.zeros(shape, model.dtype)
    cv = jnp.zeros(shape, model.dtype)
    valid = jnp.zeros((b, cache_len), jnp.int32).at[:, :p].set(attention_mask)
    positions = positions_from_mask(attention_mask)
    blocks = (jnp.full((b, p), -1, jnp.int32) if token_type_ids is None else image_block_ids(token_type_ids))
    x = model.embed_with_images(input_ids, pixel_values)
    (cos, sin), local = model.model.rope(positions)
    batch = Batch(positions=positions, kv_valid=attention_mask, segment_ids=None)
    cache = ImagePrefillCache(ck, cv, attention_mask, jnp.int32(0), blocks)
    x, (ck, cv) = model.model.run_layers(x, cos, sin, batch, cache=cache, local_rope=local)
    logits = model.logits_from_hidden(model.model.norm(x[:, -1]))
    tok, done = _choose(logits, jax.random.fold_in(key, 0), temperature, top_p, jnp.zeros((b,), bool), eos_ids,
                        pad_id, do_sample)
    return tok, done, (ck, cv, valid)


_prefill_jit = ops.policy_jit(_prefill, static_argnames=("graphdef", "cache_len", "do_sample"))


def generate_with_images(model, ids: np.ndarray, mask: np.ndarray, pixel_values: np.ndarray | None,
                         token_type_ids: np.ndarray | None, max_new_tokens: int, temperature: float, top_p: float,
                         do_sample: bool, eos: tuple[int, ...], seed: int, streamer, pad_token_id: int) -> np.ndarray:
    """Continue each row of ids [B, P] int32 (left padded: mask [B, P] int32 0 on the padding) whose image tokens
    take the images of pixel_values [N, C, H, W] float (row-major order; None: no images) by up to max_new_tokens
    tokens -> [B, P + new] int64. token_type_ids [B, P] (1 = image token) make each image block attend both ways
    in the prefill (None: causal everywhere, as transformers). Greedy unless do_sample (softmax(logits /
    temperature) within the top_p nucleus, random stream `seed`); a row stops at its first token of `eos`, later
    slots hold pad_token_id; it ends when every row has. streamer: put(prompt) then put(each step's tokens [B]),
    or a callable of each step's tokens."""
    b, p = ids.shape
    eos_arr = jnp.asarray(eos or (-1,), jnp.int32)
    pb = bucket(p)
    t = bucket(pb + max_new_tokens, 64)
    pids = np.zeros((b, pb), np.int32)
    pmask = np.zeros((b, pb), np.int32)
    pids[:, pb - p:] = ids
    pmask[:, pb - p:] = mask
    types = None
    if token_type_ids is not None:
        types = np.zeros((b, pb), np.int32)
        types[:, pb - p:] = token_type_ids
        types = jnp.asarray(types)
    pixels = None if pixel_values is None else jnp.asarray(pixel_values, jnp.float32)
    n_real = pmask.sum(axis=1).astype(np.int32)

    key = jax.random.PRNGKey(seed)
    temp, top, pad = jnp.float32(temperature), jnp.float32(top_p), jnp.int32(pad_token_id)
    commit_in_place(model)
    graphdef, state = nnx.split(model)
    common = dict(graphdef=graphdef, do_sample=bool(do_sample))
    if streamer is not None and hasattr(streamer, "put"):
        streamer.put(ids.astype(np.int64))
    tok, done, cache = _prefill_jit(state, jnp.asarray(pids), jnp.asarray(pmask), types, pixels, key, temp, top,
                                    eos_arr, pad, cache_len=t, **common)
    out = []
    for step in range(max_new_tokens):
        nxt = None
        if step + 1 < max_new_tokens:  # dispatch the next step before reading this one back
            nxt = _decode_step_jit(state, cache, tok, jnp.asarray(n_real + step), jnp.int32(pb + step), done, key,
                                   temp, top, eos_arr, pad, **common)
        host_tok, host_done = np.asarray(tok), np.asarray(done)
        out.append(host_tok)
        if streamer is not None:
            (streamer.put if hasattr(streamer, "put") else streamer)(host_tok.astype(np.int64))
        if host_done.all() or nxt is None:
            break
        tok, done, cache = nxt
    if streamer is not None and hasattr(streamer, "end"):
        streamer.end()
    new = np.stack(out, axis=1) if out else np.zeros((b, 0), np.int32)
    return np.concatenate([ids, new], axis=1).astype(np.int64)


__all__ = ["generate_with_images", "ImagePrefillCache"]
