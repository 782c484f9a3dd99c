"""Hugging Face-style `generate` on the generation engine (unsloth_jax.inference).

    out = generate(model, input_ids, attention_mask, max_new_tokens=64)        # greedy, as HF's generate
    out = generate(model, ids, mask, do_sample=True, temperature=0.7, top_p=0.9, seed=1)

Batches are LEFT padded (attention_mask 0 on the left, as HF's generate expects); each row is generated as its
own sequence (its real tokens only, positions from 0), so a padded row generates exactly what it would alone.
A row stops at its first end-of-sequence token; later slots hold pad_token_id; the result is as wide as the
longest row's output. The engine (paged KV cache, on-device decode loop) serves every family; LongRoPE models
whose sequences would cross original_max_position_embeddings go to the contiguous-cache path
(unsloth_jax.inference.contiguous), which rebuilds its cache at the switch as transformers' Phi-3 does, with a
one-line notice.
"""
from __future__ import annotations

import logging
import weakref

import numpy as np

from unsloth_jax.config import QwenVLConfig
from unsloth_jax.inference.contiguous import generate_contiguous
from unsloth_jax.inference.engine import Engine
from unsloth_jax.inference.eos import default_eos_ids, id_tuple
from unsloth_jax.inference.image_inputs import batch_image_prompts
from unsloth_jax.inference.sampling import SamplingParams

log = logging.getLogger("unsloth_jax")

_engines: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_tokenizers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> its loader's tokenizer
_STREAM_CHUNK = 4  # decode steps per host round trip when streaming


def engine_for(model, *, streaming: bool = False, tokenizer=None) -> Engine:
    """The engine `generate` and `fast_generate` use for `model` (one per model and streaming mode, with the
    model's inference settings: `gpu_memory_utilization` from from_pretrained, if any). tokenizer: for text
    prompts (default: the one in the model's directory, loaded when first needed)."""
    per_model = _engines.setdefault(model, {})
    if streaming not in per_model:
        options = dict(gpu_memory_utilization=getattr(model, "gpu_memory_utilization", None))
        if streaming:
            options["chunk"] = _STREAM_CHUNK
        per_model[streaming] = Engine(model, **options)
    engine = per_model[streaming]
    if tokenizer is not None:
        engine.tokenizer = tokenizer
    return engine


def fast_generate(model, prompts, sampling_params: SamplingParams | None = None, *, tokenizer=None,
                  use_tqdm: bool = False, lora_request=None):
    """vLLM's `LLM.generate` (Unsloth's `model.fast_generate`): prompts (text, token ids, or lists of them)
    -> a list of RequestOutput (`.outputs[i].text / .token_ids / .logprobs / .finish_reason`). The model's
    current weights, LoRA included, are used (lora_request, vLLM's way of naming an adapter, is accepted and
    must be None or the model's own: there is one adapter, the one in the model)."""
    if lora_request is not None and not getattr(lora_request, "_unsloth_jax_own", False):
        raise ValueError("fast_generate: lora_request names another adapter; unsloth_jax generates with the "
                         "adapter in the model (load another with FastLanguageModel.from_pretrained(adapter_dir))")
    engine = engine_for(model, tokenizer=tokenizer)
    if engine.tokenizer is None and _has_text(prompts):
        engine.tokenizer = _model_tokenizer(model)
    return engine.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _has_text(prompts) -> bool:
    items = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
    return any(isinstance(p, str) or (isinstance(p, dict) and "prompt" in p) for p in items)


def set_default_tokenizer(model, tokenizer) -> None:
    """The tokenizer text prompts of `model` use when none is passed: the loader that built both calls this (a GGUF
    file's tokenizer comes from its metadata, so the model's directory holds none to find)."""
    _tokenizers[model] = tokenizer


def _model_tokenizer(model):
    """The tokenizer its loader gave the model (`set_default_tokenizer`), else the one saved beside its weights,
    else an error saying to pass one."""
    if model in _tokenizers:
        return _tokenizers[model]
    model_dir = getattr(model, "model_dir", None)
    if model_dir:
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(model_dir))
        except (OSError, ValueError):
            pass
    raise ValueError("fast_generate: text prompts need a tokenizer and none was found beside the model; pass "
                     "tokenizer=... or token ids")


def _numpy(x) -> np.ndarray:
    """x (numpy, torch tensor or nested lists) as a numpy array."""
    return np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x)


def _as_ids(x, name: str) -> np.ndarray:
    arr = _numpy(x)
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2:
        raise ValueError(f"generate: {name} must be [batch, length], got shape {arr.shape}")
    return arr


def _crosses_longrope_switch(cfg, prompt_width: int, max_new_tokens: int) -> bool:
    return cfg.rope_type == "longrope" and prompt_width + max_new_tokens > cfg.rope_original_max_position


def _prompt_arrays(input_ids, attention_mask) -> tuple[np.ndarray, np.ndarray]:
    """generate's input_ids / attention_mask (numpy, torch or lists) -> (ids [B, P] int32, mask [B, P] int32),
    checked: not empty, equal shapes, LEFT padding only."""
    if input_ids is None:
        raise ValueError("generate: input_ids is required")
    ids = _as_ids(input_ids, "input_ids").astype(np.int32)
    if ids.shape[1] == 0:
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
    return ids, mask


def _eos_and_pad(model, eos_token_id, pad_token_id) -> tuple[tuple[int, ...], int]:
    """The end-of-sequence ids (given, else the model's) and the pad id (given, else config's, else eos[0], else 0)."""
    cfg = model.config
    eos = default_eos_ids(model) if eos_token_id is None else id_tuple(eos_token_id)
    if pad_token_id is None:
        pad_token_id = cfg.pad_token_id if cfg.pad_token_id is not None else (eos[0] if eos else 0)
    return eos, int(pad_token_id)


def _sampling(model, rows: int, max_new_tokens: int, do_sample: bool, temperature: float, top_p: float, top_k: int,
              min_p: float, repetition_penalty: float, seed: int, eos_token_id, pad_token_id
              ) -> tuple[list[SamplingParams], tuple[int, ...], int]:
    """generate's sampling arguments as (one SamplingParams per row, eos ids, pad id), for the engine and the
    contiguous paths alike: temperature 0 unless do_sample; row i's seed is seed's i-th stream. ValueError names
    a bad value."""
    if temperature <= 0 and do_sample:
        raise ValueError("generate: temperature must be positive when do_sample=True (use do_sample=False for greedy)")
    eos, pad_token_id = _eos_and_pad(model, eos_token_id, pad_token_id)
    params = [SamplingParams(temperature=float(temperature) if do_sample else 0.0, top_p=float(top_p),
                             top_k=int(top_k), min_p=float(min_p), repetition_penalty=float(repetition_penalty),
                             max_tokens=int(max_new_tokens), stop_token_ids=list(eos), ignore_eos=True,
                             seed=int(seed) * 1_000_003 + i) for i in range(rows)]
    return params, eos, pad_token_id


def generate(model, input_ids, attention_mask=None, max_new_tokens: int = 32, temperature: float = 1.0,
             top_p: float = 1.0, do_sample: bool = False, eos_token_id=None, seed: int = 0, streamer=None,
             pad_token_id: int | None = None, top_k: int = 0, min_p: float = 0.0,
             repetition_penalty: float = 1.0) -> np.ndarray:
    """Continue each row of input_ids [B, P] by up to max_new_tokens tokens; returns [B, P + new] (numpy int64).

    attention_mask [B, P]: 1 on real tokens, 0 on LEFT padding (None: all real). Greedy (argmax) unless
    do_sample, which samples at `temperature` within top_k / top_p / min_p (SamplingParams' definitions);
    repetition_penalty as transformers'. `seed`: row i's random stream is seed's i-th. eos_token_id: an int or
    a list (None: the model's generation_config / config). streamer: an object with put(ids)/end() such as
    transformers.TextStreamer (put first receives the prompt [B, P], then each step's new tokens [B]), or a
    callable that receives each step's new tokens [B].
    """
    ids, mask = _prompt_arrays(input_ids, attention_mask)
    b, p = ids.shape
    if max_new_tokens <= 0:
        return ids.astype(np.int64)
    cfg = model.config
    params, eos, pad_token_id = _sampling(model, b, max_new_tokens, do_sample, temperature, top_p, top_k, min_p,
                                          repetition_penalty, seed, eos_token_id, pad_token_id)
    if _crosses_longrope_switch(cfg, p, max_new_tokens):
        log.warning("unsloth_jax: LongRoPE sequence past original_max_position_embeddings=%d: generating on the "
                    "contiguous-cache path (not the engine)", cfg.rope_original_max_position)
        return generate_contiguous(model, ids, mask, max_new_tokens, params, eos, streamer, pad_token_id)

    prompts = [row[m > 0].tolist() for row, m in zip(ids, mask)]
    on_tokens = None
    if streamer is not None:
        if hasattr(streamer, "put"):
            streamer.put(ids.astype(np.int64))
        on_tokens = _step_streamer(streamer, b, pad_token_id)
    outs = engine_for(model, streaming=streamer is not None).generate(prompts, params, on_tokens=on_tokens)
    if streamer is not None and hasattr(streamer, "end"):
        streamer.end()
    rows = [o.outputs[0].token_ids for o in outs]
    width = max(len(r) for r in rows)
    new = np.full((b, width), pad_token_id, np.int64)
    for i, r in enumerate(rows):
        new[i, :len(r)] = r
    return np.concatenate([ids.astype(np.int64), new], axis=1)


def generate_vision(model, input_ids, attention_mask=None, pixel_values=None, token_type_ids=None,
                    image_grid_thw=None, max_new_tokens: int = 32, temperature: float = 1.0, top_p: float = 1.0,
                    do_sample: bool = False, eos_token_id=None, seed: int = 0, streamer=None,
                    pad_token_id: int | None = None, top_k: int = 0, min_p: float = 0.0,
                    repetition_penalty: float = 1.0, **kwargs) -> np.ndarray:
    """`generate` for a vision-language model with images: input_ids [B, P] (LEFT padded, attention_mask
    [B, P]) whose image tokens take the images of pixel_values, in order (None: text only).

    Gemma 3 (models.vision.Gemma3ForConditionalGeneration): pixel_values [N, C, H, W], mm_tokens_per_image
    image tokens each; token_type_ids [B, P] (1 = image token: each image's tokens attend to each other both
    ways in the prefill; None: causal, as transformers).
    Qwen2.5-VL (models.vision_qwen2_5.Qwen2_5_VLForConditionalGeneration): pixel_values [patches, C*T*p*p]
    with image_grid_thw [I, 3] (each image's t, h, w patch grid, t*h*w / merge^2 image tokens), as transformers'
    Qwen2-VL image processor gives them (its mm_token_type_ids are accepted and not needed); M-RoPE positions.

    The other arguments as `generate` (temperature, top_p, top_k, min_p, repetition_penalty: the engine's
    sampler). Each row is one engine request with its own images (image_inputs.batch_image_prompts), so the rows
    are prefilled together and decode with continuous batching on the paged cache. Returns [B, P + new] numpy
    int64."""
    unknown = [k for k in kwargs if k not in _VISION_IGNORED]
    if unknown:
        raise TypeError(f"generate (vision): unsupported argument(s) {', '.join(unknown)}")
    ids, mask = _prompt_arrays(input_ids, attention_mask)
    grid = types = None
    if isinstance(model.vl_config, QwenVLConfig):
        if token_type_ids is not None:
            raise ValueError("generate: token_type_ids are Gemma 3's; Qwen2.5-VL takes image_grid_thw")
        pixels, grid = _qwen_images(model, ids, mask, pixel_values, image_grid_thw)
    else:
        if image_grid_thw is not None:
            raise ValueError("generate: image_grid_thw is Qwen2.5-VL's; Gemma 3 takes pixel_values [N, C, H, W]")
        pixels, types = _gemma_images(model.vl_config, ids, pixel_values, token_type_ids)
    if max_new_tokens <= 0:
        return ids.astype(np.int64)
    params, eos, pad_token_id = _sampling(model, ids.shape[0], max_new_tokens, do_sample, temperature, top_p, top_k,
                                          min_p, repetition_penalty, seed, eos_token_id, pad_token_id)
    prompts = batch_image_prompts(model.vl_config, ids, mask, pixels, grid, types)
    on_tokens = None
    if streamer is not None:
        if hasattr(streamer, "put"):
            streamer.put(ids.astype(np.int64))
        on_tokens = _step_streamer(streamer, ids.shape[0], pad_token_id)
    outs = engine_for(model, streaming=streamer is not None).generate(prompts, params, on_tokens=on_tokens)
    if streamer is not None and hasattr(streamer, "end"):
        streamer.end()
    rows = [o.outputs[0].token_ids for o in outs]
    new = np.full((ids.shape[0], max(len(r) for r in rows)), pad_token_id, np.int64)
    for i, r in enumerate(rows):
        new[i, :len(r)] = r
    return np.concatenate([ids.astype(np.int64), new], axis=1)


def _pixels(pixel_values, shape: str, ndim: int) -> np.ndarray:
    """pixel_values (numpy or torch) as float32 numpy with `ndim` dimensions (ValueError naming `shape`)."""
    pixels = _numpy(pixel_values).astype(np.float32)
    if pixels.ndim != ndim:
        raise ValueError(f"generate: pixel_values must be {shape}, got shape {pixels.shape}")
    return pixels


def _check_no_image_tokens(n_image_tokens: int) -> None:
    """pixel_values is None: ValueError if input_ids hold image tokens."""
    if n_image_tokens:
        raise ValueError(f"generate: input_ids hold {n_image_tokens} image tokens but pixel_values is None")


def _gemma_images(cfg, ids: np.ndarray, pixel_values, token_type_ids
                  ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Gemma 3's checked (pixel_values [N, C, H, W] float32 or None, token_type_ids [B, P] int32 or None): N *
    mm_tokens_per_image image tokens in ids [B, P]."""
    n_image_tokens = int(np.sum(ids == cfg.image_token_index))
    pixels = None
    if pixel_values is None:
        _check_no_image_tokens(n_image_tokens)
    else:
        pixels = _pixels(pixel_values, "[N, C, H, W]", 4)
        if n_image_tokens != pixels.shape[0] * cfg.mm_tokens_per_image:
            raise ValueError(f"generate: input_ids hold {n_image_tokens} image tokens, but pixel_values' "
                             f"{pixels.shape[0]} images need {pixels.shape[0] * cfg.mm_tokens_per_image} "
                             f"({cfg.mm_tokens_per_image} each)")
    types = None
    if token_type_ids is not None:
        types = _as_ids(token_type_ids, "token_type_ids").astype(np.int32)
        if types.shape != ids.shape:
            raise ValueError(f"generate: token_type_ids shape {types.shape} differs from input_ids shape {ids.shape}")
    return pixels, types


def _qwen_images(model, ids: np.ndarray, mask: np.ndarray, pixel_values, image_grid_thw
                 ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Qwen2.5-VL's checked (pixel_values [patches, C*T*p*p] float32, image_grid_thw [I, 3] int64), or (None,
    None): the t*h*w / merge^2 tokens of each image fill ids' [B, P] runs of image_token_id in order."""
    cfg = model.vl_config
    if np.any(ids == cfg.video_token_id):
        raise ValueError("generate: input_ids hold video tokens; Qwen2.5-VL generation takes images only")
    n_image_tokens = int(np.sum(ids == cfg.image_token_id))
    if pixel_values is None:
        if image_grid_thw is not None:
            raise ValueError("generate: image_grid_thw is given but pixel_values is None")
        _check_no_image_tokens(n_image_tokens)
        return None, None
    if image_grid_thw is None:
        raise ValueError("generate: pixel_values needs image_grid_thw [images, 3] (each image's t, h, w patches, "
                         "as the image processor gives it)")
    grid = _numpy(image_grid_thw).astype(np.int64)
    if grid.ndim != 2 or grid.shape[1] != 3:
        raise ValueError(f"generate: image_grid_thw must be [images, 3], got shape {grid.shape}")
    vision = cfg.vision
    pixels = _pixels(pixel_values, f"[patches, {vision.patch_dim}]", 2)
    patches = int(grid.prod(-1).sum())
    if pixels.shape != (patches, vision.patch_dim):
        raise ValueError(f"generate: pixel_values shape {pixels.shape}, but image_grid_thw {grid.tolist()} needs "
                         f"[{patches}, {vision.patch_dim}] (C*T*p*p values per patch)")
    needed = int((grid.prod(-1) // vision.merge_unit).sum())
    if n_image_tokens != needed:
        raise ValueError(f"generate: input_ids hold {n_image_tokens} image tokens, but image_grid_thw's "
                         f"{len(grid)} images need {needed} (t*h*w / {vision.merge_unit} each)")
    model.rope_positions(ids, mask, grid)  # ValueError when a run of image tokens does not match its grid
    return pixels, grid


# transformers' generate arguments generate_vision accepts and ignores
_VISION_IGNORED = ("use_cache", "mm_token_type_ids")


def _step_streamer(streamer, rows: int, pad: int):
    """An engine on_tokens callback that hands `streamer` each step's tokens [rows] (pad for rows that have
    finished)."""
    emit = streamer.put if hasattr(streamer, "put") else streamer

    def on_tokens(news: dict) -> None:
        steps = max(len(t) for t in news.values())
        for k in range(steps):
            step = np.full((rows,), pad, np.int64)
            for (r, _), toks in news.items():
                if k < len(toks):
                    step[r] = toks[k]
            emit(step)

    return on_tokens


__all__ = ["generate", "generate_vision", "fast_generate", "engine_for", "set_default_tokenizer", "default_eos_ids",
           "SamplingParams"]
