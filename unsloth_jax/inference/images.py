"""Generation with images for the vision-language models, Gemma 3 (models.vision.Gemma3ForConditionalGeneration)
and Qwen2.5-VL (models.vision_qwen2_5.Qwen2_5_VLForConditionalGeneration), on one contiguous KV cache (the
structure of inference/contiguous.py, whose decode step it reuses).

    prompt = ImagePrompt(pixel_values, token_type_ids=types)                                # Gemma 3
    prompt = ImagePrompt(pixel_values, rope_positions=mrope, image_grid_thw=grid)           # Qwen2.5-VL
    out = generate_with_images(model, ids, mask, prompt, max_new_tokens=32, ...)            # [B, P + new]

The prefill embeds the prompt with the image features written at the image tokens (`embed_with_images`) and runs
every layer once over it, writing each layer's keys and values into the cache; the attention of that call is
the training one over the prompt alone (the cache is empty before it). Every later step feeds one text token
through `contiguous._decode_step` (causal, windows measured in cache slots, as transformers' cache positions).
Batches are LEFT padded. The prompt is left padded further to a bucket length (one compile per bucket); the batch
is not bucketed (its images belong to its rows). The families differ only in what ImagePrompt carries:

- Gemma 3: token_type_ids' image blocks attend to each other both ways in the prefill (with Gemma 3's sliding
  windows), as transformers' prefill; positions count real tokens only (`positions_from_mask`).
- Qwen2.5-VL: causal; the prefill rotates by the M-RoPE positions rope_positions [3, B, P] (`mrope_positions`,
  transformers' get_rope_index). After the prompt transformers continues at cache position + rope_deltas, i.e.
  row r's first new token sits at its largest prompt position + 1, the same on all three axes; M-RoPE with
  equal axes is the text model's RoPE (rope.mrope_tables), so the decode step is the shared one, fed those
  positions. The patches are zero-padded to a bucket (`vision_loader.patch_bucket`) with the tower's padded
  window layout, so the prefill compiles once per patch bucket, not per set of grids.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from unsloth_jax import ops
from unsloth_jax.data.vision_loader import pad_patches, patch_bucket
from unsloth_jax.inference.contiguous import _choose, bucket, decode_loop, row_sampler
from unsloth_jax.inference.sampling import SamplerFlags, SamplingParams
from unsloth_jax.inference.weights import commit_in_place
from unsloth_jax.models.attention import Batch
from unsloth_jax.models.rope import mrope_tables, positions_from_mask
from unsloth_jax.models.vision import image_block_ids


class ImagePrompt(NamedTuple):
    """The images of a prompt batch [B, P] and how its family reads them (generation.generate_vision builds it).

    pixel_values    float32 numpy, Gemma 3 [N, C, H, W], Qwen2.5-VL [patches, C*T*p*p]; None: no image
    token_type_ids  [B, P] int, 1 = image token (Gemma 3: each image's tokens attend both ways); None: causal
    rope_positions  [3, B, P] int M-RoPE positions (Qwen2.5-VL, 0 on padding); None: positions_from_mask
    image_grid_thw  [I, 3] int (Qwen2.5-VL: each image's patch grid, for the tower's layout); None: Gemma 3
    """

    pixel_values: np.ndarray | None = None
    token_type_ids: np.ndarray | None = None
    rope_positions: np.ndarray | None = None
    image_grid_thw: np.ndarray | None = None

    def first_new_positions(self, mask: np.ndarray) -> np.ndarray:
        """[B] int32: the position of each row's first new token (each later one + 1): its largest M-RoPE
        position + 1 (transformers' real-token count + rope_deltas), else its real-token count (mask [B, P])."""
        if self.rope_positions is None:
            return mask.sum(axis=1).astype(np.int32)
        return (np.asarray(self.rope_positions).max(axis=(0, 2)) + 1).astype(np.int32)


class ImagePrefillCache(NamedTuple):
    """One layer's contiguous cache while a prompt with images is prefilled (run_layers hands each layer its own
    k / v through `_replace`): keys and values [B, T, Hkv, hd], the prompt's attention_mask [B, P] (`valid`),
    `index` 0, and the image blocks block_ids [B, P] (models.vision.image_block_ids; all -1: causal)."""

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


def _prompt_rope(model, positions, rope_positions):
    """The prompt's RoPE tables ((cos, sin), local): the text model's at positions [B, P], or M-RoPE's at
    rope_positions [3, B, P] (Qwen2.5-VL, no local tables)."""
    if rope_positions is None:
        return model.model.rope(positions)
    return mrope_tables(model.config, rope_positions, model.vl_config.mrope_section), None


def _prefill(state, input_ids, attention_mask, token_type_ids, rope_positions, pixel_values, image_kwargs, sampler,
             eos_ids, pad_id, *, graphdef, cache_len: int, flags: SamplerFlags):
    """Prompt input_ids [B, P] (left padded, attention_mask [B, P]) with ImagePrompt's token_type_ids [B, P] or
    None and rope_positions [3, B, P] or None, pixel_values (None: no image) and embed_with_images' extra
    arguments image_kwargs (Qwen2.5-VL: the tower's `layout`), sampler (contiguous.RowSampler) -> (first new tokens
    [B] int32, done [B] bool, (k, v, valid) cache with k/v [L, B, cache_len, Hkv, hd] and valid [B, cache_len]
    int32, sampler)."""
    model = nnx.merge(graphdef, state)
    cfg = model.config
    b, p = input_ids.shape
    shape = (cfg.num_hidden_layers, b, cache_len, cfg.num_key_value_heads, cfg.head_dim)
    ck = jnp.zeros(shape, model.dtype)
    cv = jnp.zeros(shape, model.dtype)
    valid = jnp.zeros((b, cache_len), jnp.int32).at[:, :p].set(attention_mask)
    positions = positions_from_mask(attention_mask)
    blocks = (jnp.full((b, p), -1, jnp.int32) if token_type_ids is None else image_block_ids(token_type_ids))
    x = model.embed_with_images(input_ids, pixel_values, **image_kwargs)
    (cos, sin), local = _prompt_rope(model, positions, rope_positions)
    batch = Batch(positions=positions, kv_valid=attention_mask, segment_ids=None)
    cache = ImagePrefillCache(ck, cv, attention_mask, jnp.int32(0), blocks)
    x, (ck, cv) = model.model.run_layers(x, cos, sin, batch, cache=cache, local_rope=local)
    logits = model.logits_from_hidden(model.model.norm(x[:, -1]))
    tok, done, sampler = _choose(logits, sampler, 0, jnp.zeros((b,), bool), eos_ids, pad_id, flags)
    return tok, done, (ck, cv, valid), sampler


_prefill_jit = ops.policy_jit(_prefill, static_argnames=("graphdef", "cache_len", "flags"))


def _left_pad(a: np.ndarray | None, width: int) -> jax.Array | None:
    """Integer a [..., P] zero-padded on the left of its last axis to [..., width] int32 (None stays None)."""
    if a is None:
        return None
    return jnp.asarray(np.pad(np.asarray(a, np.int32), [(0, 0)] * (a.ndim - 1) + [(width - a.shape[-1], 0)]))


def _vision_inputs(model, prompt: ImagePrompt) -> tuple[jax.Array | None, dict]:
    """The prefill's pixel_values (float32) and embed_with_images' extra arguments: Gemma 3's images as given
    ({}); Qwen2.5-VL's patches zero-padded to their bucket with the tower's padded layout ({"layout": ...})."""
    if prompt.pixel_values is None:
        return None, {}
    if prompt.image_grid_thw is None:
        return jnp.asarray(prompt.pixel_values, jnp.float32), {}
    vision = model.vl_config.vision
    padded = pad_patches(dict(pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw), vision,
                         patch_bucket(prompt.pixel_values.shape[0], vision.merge_unit))
    layout = {k.removeprefix("vision_"): jnp.asarray(v) for k, v in padded.items() if k.startswith("vision_")}
    return jnp.asarray(padded["pixel_values"], jnp.float32), {"layout": layout}


def generate_with_images(model, ids: np.ndarray, mask: np.ndarray, prompt: ImagePrompt, max_new_tokens: int,
                         params: list[SamplingParams], eos: tuple[int, ...], streamer, pad_token_id: int
                         ) -> np.ndarray:
    """Continue each row of ids [B, P] int32 (left padded: mask [B, P] int32 0 on the padding) whose image tokens
    take the images of `prompt` (ImagePrompt, checked by generation.generate_vision; row-major order) by up to
    max_new_tokens tokens -> [B, P + new] int64. params: one SamplingParams per row (temperature 0: greedy;
    top_k, top_p, min_p, repetition_penalty and seed as the engine's); a row stops at its first token of `eos`,
    later slots hold pad_token_id; it ends when every row has. streamer: put(prompt) then put(each step's tokens
    [B]), or a callable of each step's tokens."""
    b, p = ids.shape
    eos_arr = jnp.asarray(eos or (-1,), jnp.int32)
    pb = bucket(p)
    t = bucket(pb + max_new_tokens, 64)
    pixels, image_kwargs = _vision_inputs(model, prompt)
    first_positions = prompt.first_new_positions(mask)

    sampler, flags = row_sampler(params, ids, mask, model.config.vocab_size)
    pad = jnp.int32(pad_token_id)
    commit_in_place(model)
    graphdef, state = nnx.split(model)
    common = dict(graphdef=graphdef, flags=flags)
    if streamer is not None and hasattr(streamer, "put"):
        streamer.put(ids.astype(np.int64))
    tok, done, cache, sampler = _prefill_jit(state, _left_pad(ids, pb), _left_pad(mask, pb),
                                             _left_pad(prompt.token_type_ids, pb), _left_pad(prompt.rope_positions, pb),
                                             pixels, image_kwargs, sampler, eos_arr, pad, cache_len=t, **common)
    new = decode_loop(state, cache, tok, done, sampler, first_positions, pb, max_new_tokens, eos_arr, pad, common,
                      streamer, b)
    return np.concatenate([ids, new], axis=1).astype(np.int64)


__all__ = ["generate_with_images", "ImagePrompt", "ImagePrefillCache"]
