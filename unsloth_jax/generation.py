"""Hugging Face-style `generate` on the generation engine (unsloth_jax.inference).

    out = generate(model, input_ids, attention_mask, max_new_tokens=64)        # greedy, as HF's generate
    out = generate(model, ids, mask, do_sample=True, temperature=0.7, top_p=0.9, seed=1)

transformers' arguments mean what they mean there (max_length, num_return_sequences, generation_config and the
model's generation_config.json, use_cache; the "flags set but do_sample is not True" warning); the others are
refused by name. Batches may be padded left or right (attention_mask 0 on the padding) and come back left padded,
as transformers' output for a left-padded batch; each row is generated as its own sequence (its real tokens only,
positions from 0), so a padded row generates exactly what it would alone.
A row stops at its first end-of-sequence token; later slots hold pad_token_id; the result is as wide as the
longest row's output. The engine (paged KV cache, on-device decode loop) serves every family; a LongRoPE batch
(Phi-3) switches to the long factors where transformers' Phi-3 does for the same batch (`_longrope_plan`), the
engine rewriting its rows' cached keys with them where transformers rebuilds its cache.
"""
from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Mapping

import numpy as np

from unsloth_jax.inference.engine import Engine
from unsloth_jax.inference.eos import default_eos_ids, id_tuple
from unsloth_jax.inference.eos import generation_config as generation_config_json
from unsloth_jax.data.vision import multimodal_messages
from unsloth_jax.families import family_of
from unsloth_jax.families.base import as_id_rows
from unsloth_jax.inference.image_inputs import batch_image_prompts, chat_request
from unsloth_jax.inference.sampling import SamplingParams
from unsloth_jax.validation import require_bool, require_int, require_real

log = logging.getLogger("unsloth_jax")

_engines: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_tokenizers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> its loader's tokenizer
_STREAM_CHUNK = 4  # decode steps per host round trip when streaming


def engine_for(model, *, streaming: bool = False, tokenizer=None, weights: str = "shared") -> Engine:
    """The engine `generate` and `fast_generate` use for `model` (one per model, streaming mode and weight layout,
    with the model's inference settings: `gpu_memory_utilization` from from_pretrained, if any). tokenizer: for
    text prompts (default: the one in the model's directory, loaded when first needed). weights: the Engine's
    weight layout (GRPO's rollouts: "auto", LoRA merged into a reused buffer when it fits)."""
    per_model = _engines.setdefault(model, {})
    key = (streaming, weights)
    if key not in per_model:
        options = dict(gpu_memory_utilization=getattr(model, "gpu_memory_utilization", None), weights=weights)
        if streaming:
            options["chunk"] = _STREAM_CHUNK
        per_model[key] = Engine(model, **options)
    engine = per_model[key]
    if tokenizer is not None:
        engine.tokenizer = tokenizer
    return engine


def fast_generate(model, prompts, sampling_params: SamplingParams | None = None, *, tokenizer=None,
                  use_tqdm: bool = False, lora_request=None):
    """vLLM's `LLM.generate` (Unsloth's `model.fast_generate`): prompts (text, token ids, or lists of them)
    -> a list of RequestOutput (`.outputs[i].text / .token_ids / .logprobs / .finish_reason`). The model's
    current weights, LoRA included, are used; lora_request (vLLM's way of naming an adapter: what
    `model.load_lora(path)` returns) generates with that adapter's weights instead, on its `model`, a twin that
    shares the base weights, so the model's own LoRA is untouched."""
    if lora_request is not None:
        twin = getattr(lora_request, "model", None)
        if twin is None:
            raise TypeError(f"fast_generate: lora_request must come from model.load_lora(path), got "
                            f"{type(lora_request).__name__}")
        if tokenizer is None and _has_text(prompts):  # the tokenizer of the model asked, not looked up for the twin
            tokenizer = engine_for(model).tokenizer or _model_tokenizer(model)
        model = twin
    engine = engine_for(model, tokenizer=tokenizer)
    if engine.tokenizer is None and _has_text(prompts):
        engine.tokenizer = _model_tokenizer(model)
    return engine.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _is_chat(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


def fast_generate_vision(model, prompts, sampling_params: SamplingParams | None = None, *, processor=None,
                         use_tqdm: bool = False):
    """`fast_generate` for a vision-language model (VisionLanguageModel.fast_generate): prompts with
    their images -> a list of RequestOutput, one per prompt. A prompt is an engine request ({"prompt_token_ids":
    ids, "images": ImageInputs(...)}, image tokens expanded as the processor gives them), token ids, text, a chat
    (a list of messages whose image parts carry their images: {"type": "image", "image": img}) or
    {"messages": chat, "images": [...]} (or "image": one image) whose images fill the chat's image placeholders
    (TRL's prepare_multimodal_messages rule, data.vision.multimodal_messages). Chats go through `processor`
    (default: the one FastVisionModel.from_pretrained loaded): its chat template with the generation prompt,
    then its image preprocessing (inference.image_inputs.chat_request). Errors name prompts[i]."""
    items = [prompts] if isinstance(prompts, (str, dict)) or _is_chat(prompts) or (
        isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], (int, np.integer))) else list(prompts)
    if processor is None:
        processor = _tokenizers.get(model)
    requests = []
    for i, p in enumerate(items):
        where = f"prompts[{i}]"
        if isinstance(p, dict) and "messages" in p:
            given = p.get("images", [p["image"]] if p.get("image") is not None else [])
            messages = multimodal_messages(p["messages"], [] if given is None else list(given), where)
        elif _is_chat(p):
            messages = multimodal_messages(p, [], where)
        else:
            requests.append(p)
            continue
        if processor is None:
            raise ValueError(f"fast_generate: {where} is a chat; pass processor=... (FastVisionModel.from_pretrained "
                             "returns it)")
        requests.append(chat_request(model.vl_config, processor, messages, where))
    tokenizer = None if processor is None else getattr(processor, "tokenizer", processor)
    return engine_for(model, tokenizer=tokenizer).generate(requests, sampling_params, use_tqdm=use_tqdm)


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


def _longrope_plan(cfg, mask: np.ndarray) -> list[tuple[int, bool]] | None:
    """The engine's LongRoPE plan (Engine.generate's `longrope`) for the left-padded batch of mask [B, P], as
    transformers' Phi-3 generates that batch: a forward call takes the long factors once its largest position + 1
    (the longest row's, L real tokens) passes original_max_position_embeddings O, so every row feeds its output
    token O - L on with them (all of it when L > O); and the cache is rebuilt once the padded width reaches O + 1
    (output token O - P), which rewrites the cached keys with the long factors only when that is the same token
    (L == P); otherwise the rebuild keeps the short factors (the cache as it is) and keys of both kinds stay
    cached. None for other models."""
    if cfg.rope_type != "longrope":
        return None
    longest, width, original = int(mask.sum(axis=1).max()), mask.shape[1], cfg.rope_original_max_position
    return [(original - longest, longest == width and longest <= original)] * mask.shape[0]


def _prompt_arrays(input_ids, attention_mask) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """generate's input_ids / attention_mask (numpy, torch or lists) -> (ids [B, P] int32, mask [B, P] int32,
    order [B, P]), checked: not empty, equal shapes, each row's real tokens one run. Rows padded on the right (or
    both sides) come back LEFT padded, as transformers' generate wants its input: ids = take_along_axis(input,
    order), the padding columns first and in their order, so row i's new tokens start at column P in every row."""
    if input_ids is None:
        raise ValueError("generate: input_ids is required")
    ids = as_id_rows(input_ids, "input_ids").astype(np.int32)
    if ids.shape[1] == 0:
        raise ValueError("generate: input_ids is empty; give at least one prompt token (e.g. the BOS token)")
    if attention_mask is None:
        mask = np.ones_like(ids)
    else:
        mask = as_id_rows(attention_mask, "attention_mask").astype(np.int32)
        if mask.shape != ids.shape:
            raise ValueError(f"generate: attention_mask shape {mask.shape} differs from input_ids shape {ids.shape}")
    real = mask > 0
    empty = np.nonzero(~real.any(axis=1))[0].tolist()
    if empty:
        raise ValueError(f"generate: rows {empty} of attention_mask have no real token")
    runs = np.sum(np.diff(real.astype(np.int8), axis=1) == 1, axis=1) + real[:, 0]  # starts of runs of 1s
    if np.any(runs > 1):
        raise ValueError("generate: attention_mask has padding between real tokens; pad on the left or the right only")
    order = np.argsort(real, axis=1, kind="stable")  # padding columns first, then the real tokens, each in order
    return (np.take_along_axis(ids, order, axis=1), np.take_along_axis(mask, order, axis=1).clip(0, 1), order)


def _eos_and_pad(model, eos_token_id, pad_token_id) -> tuple[tuple[int, ...], int]:
    """The end-of-sequence ids (given, else the model's) and the pad id (given, else config's, else eos[0], else 0)."""
    cfg = model.config
    eos = default_eos_ids(model) if eos_token_id is None else id_tuple(eos_token_id)
    if pad_token_id is None:
        pad_token_id = cfg.pad_token_id if cfg.pad_token_id is not None else (eos[0] if eos else 0)
    return eos, int(pad_token_id)


# transformers' generation settings generate reads, with transformers' global defaults (GenerationConfig's
# _get_default_generation_params): a setting comes from the call, else the `generation_config` argument, else the
# model's generation_config.json, else here. max_new_tokens None and max_length None: 32 new tokens.
_SETTINGS = {"max_new_tokens": None, "max_length": None, "do_sample": False, "temperature": 1.0, "top_p": 1.0,
             "top_k": 50, "min_p": None, "repetition_penalty": 1.0, "num_return_sequences": 1, "eos_token_id": None,
             "pad_token_id": None}
_DEFAULT_NEW_TOKENS = 32
_BEAMS = "beam search is not supported; use greedy decoding or do_sample=True (with num_return_sequences=n)"
_PROCESSORS = ("custom logits processing is not supported; the sampler takes temperature, top_k, top_p, min_p and "
               "repetition_penalty")
# transformers' generate arguments generate does not implement -> (the value that changes nothing, what to do)
_UNSUPPORTED = {
    "num_beams": (1, _BEAMS), "num_beam_groups": (1, _BEAMS), "diversity_penalty": (0.0, _BEAMS),
    "length_penalty": (1.0, _BEAMS), "early_stopping": (False, _BEAMS),
    "return_dict_in_generate": (False, "generate returns the token ids only; for the sampled tokens' "
                                "log-probabilities use model.fast_generate(prompts, SamplingParams(logprobs=0))"),
    "output_scores": (False, "use model.fast_generate(prompts, SamplingParams(logprobs=0)) for log-probabilities"),
    "output_logits": (False, "call the model, model(input_ids, attention_mask=mask), for logits"),
    "output_attentions": (False, "attention weights are not returned"),
    "output_hidden_states": (False, "hidden states are not returned"),
    "stop_strings": (None, "use model.fast_generate(prompts, SamplingParams(stop=[...])), or eos_token_id for "
                     "stop tokens"),
    "min_new_tokens": (None, "a row stops at its first eos token; pass eos_token_id=[] to never stop early"),
    "min_length": (0, "a row stops at its first eos token; pass eos_token_id=[] to never stop early"),
    "typical_p": (1.0, _PROCESSORS), "epsilon_cutoff": (0.0, _PROCESSORS), "eta_cutoff": (0.0, _PROCESSORS),
    "top_h": (None, _PROCESSORS), "no_repeat_ngram_size": (0, _PROCESSORS), "bad_words_ids": (None, _PROCESSORS),
    "suppress_tokens": (None, _PROCESSORS), "begin_suppress_tokens": (None, _PROCESSORS),
    "sequence_bias": (None, _PROCESSORS), "logits_processor": (None, _PROCESSORS),
    "stopping_criteria": (None, _PROCESSORS), "prefix_allowed_tokens_fn": (None, _PROCESSORS),
    "forced_bos_token_id": (None, _PROCESSORS), "forced_eos_token_id": (None, _PROCESSORS),
    "renormalize_logits": (False, _PROCESSORS), "guidance_scale": (None, _PROCESSORS),
    "penalty_alpha": (None, "contrastive search is not supported; " + _BEAMS),
    "encoder_repetition_penalty": (1.0, _PROCESSORS),
    "exponential_decay_length_penalty": (None, _PROCESSORS), "remove_invalid_values": (False, _PROCESSORS),
    "max_time": (None, "limit the length with max_new_tokens"),
    "assistant_model": (None, "assisted (speculative) decoding is not supported; drop assistant_model"),
    "prompt_lookup_num_tokens": (None, "assisted (speculative) decoding is not supported"),
    "cache_implementation": (None, "the engine's paged KV cache is always used; drop cache_implementation"),
    "past_key_values": (None, "the engine keeps its own KV cache; pass the whole sequence as input_ids"),
    "inputs_embeds": (None, "pass input_ids"),
    "position_ids": (None, "positions come from attention_mask; drop position_ids"),
    "token_type_ids": (None, "a text model takes no token_type_ids; drop it (tokenizer(..., "
                       "return_token_type_ids=False))"),
}


def _settings(model, call: dict, generation_config, what: str) -> dict:
    """generate's settings (_SETTINGS' keys): the call's non-None values, else `generation_config`'s (a
    transformers GenerationConfig or a dict), else the model's generation_config.json, else transformers'
    defaults, checked. Warns (UserWarning, once per call) as transformers does when sampling-only flags are set
    but do_sample is not True: for a flag set by the user, or when neither it nor do_sample was (both from the
    model's generation_config.json)."""
    unknown = sorted(set(call) - set(_SETTINGS) - set(_UNSUPPORTED) - {"use_cache"})
    if unknown:
        raise TypeError(f"{what}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}")
    for name, value in call.items():
        if name in _UNSUPPORTED and value is not None and value != _UNSUPPORTED[name][0]:
            raise TypeError(f"{what}(): {name}={value!r} is not supported: {_UNSUPPORTED[name][1]}")
    if "use_cache" in call:  # accepted; the KV cache is always on
        require_bool("use_cache", call["use_cache"])
    if generation_config is None:
        given = {}
    elif isinstance(generation_config, dict):
        given = dict(generation_config)
    elif hasattr(generation_config, "to_dict"):
        given = generation_config.to_dict()
    else:
        raise TypeError(f"{what}(): generation_config must be a transformers GenerationConfig or a dict, got "
                        f"{type(generation_config).__name__}")
    user = {k: v for k, v in {**given, **call}.items() if k in _SETTINGS and v is not None}
    model_file = {k: v for k, v in generation_config_json(model).items() if k in _SETTINGS and v is not None}
    out = {**_SETTINGS, **model_file, **user}
    out["do_sample"] = require_bool("do_sample", out["do_sample"])
    for name, minimum in (("max_new_tokens", 0), ("max_length", 1), ("num_return_sequences", 1)):
        if out[name] is not None:
            out[name] = require_int(name, out[name], minimum=minimum)
    out["top_k"] = require_int("top_k", out["top_k"], minimum=0)
    for name in ("temperature", "top_p", "repetition_penalty", "min_p"):
        if out[name] is not None:
            out[name] = require_real(name, out[name])
    if out["num_return_sequences"] > 1 and not out["do_sample"]:
        raise ValueError(f"{what}(): num_return_sequences={out['num_return_sequences']} needs do_sample=True "
                         "(greedy decoding gives one completion per prompt, as in transformers)")
    if not out["do_sample"]:
        _warn_sampling_flags(out, user)
    return out


def _warn_sampling_flags(out: dict, user: dict) -> None:
    """transformers' "flags set but do_sample is not True" warning, as one UserWarning."""
    changed = {"temperature": out["temperature"] != 1.0, "top_p": out["top_p"] != 1.0,
               "top_k": out["top_k"] != 50, "min_p": out["min_p"] is not None}
    flags = [name for name, is_set in changed.items() if is_set and (name in user or "do_sample" not in user)]
    if flags:
        shown = ", ".join(f"{name}={out[name]}" for name in flags)
        warnings.warn(f"generate: do_sample is not set to True, but {shown} {'is' if len(flags) == 1 else 'are'} "
                      "set: these flags only apply to sampling, so this call decodes greedily. Pass do_sample=True "
                      "to sample, or drop them (some may come from the model's generation_config.json)",
                      UserWarning, stacklevel=4)


def _new_tokens(settings: dict, prompt_width: int) -> int:
    """The new-token budget: max_new_tokens, else max_length (prompt included, as transformers: the padded width
    P counts) - P, else 32."""
    if settings["max_new_tokens"] is not None:
        return settings["max_new_tokens"]
    if settings["max_length"] is not None:
        if settings["max_length"] <= prompt_width:
            raise ValueError(f"generate: max_length={settings['max_length']} counts the prompt, whose width is "
                             f"{prompt_width}; give a larger max_length, or max_new_tokens")
        return settings["max_length"] - prompt_width
    return _DEFAULT_NEW_TOKENS


def _sampling(model, rows: int, max_new_tokens: int, settings: dict, seed: int
              ) -> tuple[list[SamplingParams], tuple[int, ...], int]:
    """generate's settings as (one SamplingParams per row, eos ids, pad id), for the engine: temperature 0 unless do_sample; row i's seed is seed's i-th stream. ValueError names a bad value."""
    do_sample, temperature = settings["do_sample"], settings["temperature"]
    if temperature <= 0 and do_sample:
        raise ValueError("generate: temperature must be positive when do_sample=True (use do_sample=False for greedy)")
    eos, pad_token_id = _eos_and_pad(model, settings["eos_token_id"], settings["pad_token_id"])
    params = [SamplingParams(temperature=float(temperature) if do_sample else 0.0, top_p=float(settings["top_p"]),
                             top_k=int(settings["top_k"]), min_p=float(settings["min_p"] or 0.0),
                             repetition_penalty=float(settings["repetition_penalty"]),
                             max_tokens=int(max_new_tokens), stop_token_ids=list(eos), ignore_eos=True,
                             seed=int(seed) * 1_000_003 + i) for i in range(rows)]
    return params, eos, pad_token_id


def _unpack(input_ids, attention_mask):
    """A mapping passed as input_ids (transformers 5's apply_chat_template(..., return_tensors=...) gives a
    BatchEncoding): its input_ids and attention_mask (an explicit attention_mask wins)."""
    if isinstance(input_ids, Mapping):
        if "input_ids" not in input_ids:
            raise TypeError(f"generate: input_ids is a mapping without 'input_ids' (keys {sorted(input_ids)}); pass "
                            "the token ids, or the tokenizer's output as **inputs")
        if attention_mask is None:
            attention_mask = input_ids.get("attention_mask")
        input_ids = input_ids["input_ids"]
    return input_ids, attention_mask


def _preamble(model, input_ids, attention_mask, generation_config, call: dict
              ) -> tuple[dict, np.ndarray, np.ndarray, np.ndarray]:
    """What generate and generate_vision do first: (settings (`_settings` of the call's non-None arguments),
    ids [B, P] left padded, mask [B, P], order: the columns the rows were reordered by (`_prompt_arrays`))."""
    input_ids, attention_mask = _unpack(input_ids, attention_mask)
    ids, mask, order = _prompt_arrays(input_ids, attention_mask)
    settings = _settings(model, {k: v for k, v in call.items() if v is not None}, generation_config, "generate")
    return settings, ids, mask, order


def generate(model, input_ids=None, attention_mask=None, max_new_tokens: int | None = None,
             temperature: float | None = None, top_p: float | None = None, do_sample: bool | None = None,
             eos_token_id=None, seed: int = 0, streamer=None, pad_token_id: int | None = None,
             top_k: int | None = None, min_p: float | None = None, repetition_penalty: float | None = None, *,
             max_length: int | None = None, num_return_sequences: int | None = None, generation_config=None,
             **kwargs) -> np.ndarray:
    """Continue each row of input_ids [B, P] by up to max_new_tokens tokens; returns [B * n, P + new] (numpy
    int64), as transformers' generate.

    input_ids: ids, or a mapping with input_ids and attention_mask (transformers 5's apply_chat_template(...,
    return_tensors="np")). attention_mask [B, P]: 1 on real tokens, 0 on padding, left or right (None: all
    real); right-padded rows are returned left padded, as transformers returns a left-padded batch. Greedy
    (argmax) unless do_sample, which samples at `temperature` within top_k (default 50, as transformers; 0: off) /
    top_p / min_p (SamplingParams' definitions); repetition_penalty as transformers'. max_length: prompt width +
    new tokens, as transformers (max_new_tokens wins; neither: 32 new tokens). num_return_sequences=n (sampling):
    n completions per prompt, rows p0 x n, p1 x n, ... A setting the call leaves out comes from
    `generation_config` (a transformers GenerationConfig or dict), else the model's generation_config.json (its
    do_sample, temperature, top_p, ...), as transformers does. use_cache is accepted (the KV cache is always on);
    other transformers arguments are refused by name. `seed`: row i's random stream is seed's i-th.
    eos_token_id: an int or a list (None: the model's generation_config / config). streamer: an object with
    put(ids)/end() such as transformers.TextStreamer (put first receives the prompt [B, P], then each step's new
    tokens [B]), or a callable that receives each step's new tokens [B].
    """
    settings, ids, mask, _ = _preamble(
        model, input_ids, attention_mask, generation_config,
        dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, do_sample=do_sample,
             eos_token_id=eos_token_id, pad_token_id=pad_token_id, top_k=top_k, min_p=min_p,
             repetition_penalty=repetition_penalty, max_length=max_length,
             num_return_sequences=num_return_sequences, **kwargs))
    n = settings["num_return_sequences"]
    ids, mask = np.repeat(ids, n, axis=0), np.repeat(mask, n, axis=0)  # rows p0 x n, p1 x n, ... (transformers')
    b, p = ids.shape
    max_new_tokens = _new_tokens(settings, p)
    if max_new_tokens <= 0:
        return ids.astype(np.int64)
    cfg = model.config
    params, eos, pad_token_id = _sampling(model, b, max_new_tokens, settings, seed)
    prompts = [row[m > 0].tolist() for row, m in zip(ids, mask)]
    return _run_engine(model, ids, prompts, params, streamer, pad_token_id, _longrope_plan(cfg, mask))


def _run_engine(model, ids: np.ndarray, prompts: list, params: list, streamer, pad_token_id: int,
                longrope=None) -> np.ndarray:
    """The engine's completions of `prompts` (one request per row of the left-padded prompt ids [B, P]) with
    `params` (and Engine.generate's `longrope` plan), streamed to `streamer`, as generate returns them:
    [B, P + new] int64, finished rows padded."""
    on_tokens = None
    if streamer is not None:
        if hasattr(streamer, "put"):
            streamer.put(ids.astype(np.int64))
        on_tokens = _step_streamer(streamer, ids.shape[0], pad_token_id)
    outs = engine_for(model, streaming=streamer is not None).generate(prompts, params, on_tokens=on_tokens,
                                                                      longrope=longrope)
    if streamer is not None and hasattr(streamer, "end"):
        streamer.end()
    rows = [o.outputs[0].token_ids for o in outs]
    new = np.full((ids.shape[0], max(len(r) for r in rows)), pad_token_id, np.int64)
    for i, r in enumerate(rows):
        new[i, :len(r)] = r
    return np.concatenate([ids.astype(np.int64), new], axis=1)


def generate_vision(model, input_ids, attention_mask=None, pixel_values=None, token_type_ids=None,
                    image_grid_thw=None, *, seed: int = 0, streamer=None, generation_config=None,
                    mm_token_type_ids=None, **settings) -> np.ndarray:
    """`generate` for a vision-language model with images: input_ids [B, P] (padded left or right, attention_mask
    [B, P]) whose image tokens take the images of pixel_values, in order (None: text only), checked by the model's
    family (generation_images).

    Gemma 3 (models.vision.Gemma3ForConditionalGeneration): pixel_values [N, C, H, W], mm_tokens_per_image
    image tokens each; token_type_ids [B, P] (1 = image token: each image's tokens attend to each other both
    ways in the prefill; None: causal, as transformers).
    Qwen2.5-VL (models.vision_qwen2_5.Qwen2_5_VLForConditionalGeneration): pixel_values [patches, C*T*p*p]
    with image_grid_thw [I, 3] (each image's t, h, w patch grid, t*h*w / merge^2 image tokens), as transformers'
    Qwen2-VL image processor gives them (its mm_token_type_ids are accepted and not needed); M-RoPE positions.

    settings: `generate`'s (max_new_tokens, temperature, top_p, do_sample, eos_token_id, pad_token_id, top_k,
    min_p, repetition_penalty, max_length, num_return_sequences, ...), with generation_config and the model's
    generation_config.json as there (the engine's sampler). Each row is one engine request with its own images
    (image_inputs.batch_image_prompts), so the rows are prefilled together and decode with continuous batching on
    the paged cache. Returns [B * n, P + new] numpy int64."""
    settings, ids, mask, order = _preamble(model, input_ids, attention_mask, generation_config, settings)
    pixels, grid, types = family_of(model).generation_images(model, ids, mask, order, pixel_values, token_type_ids,
                                                             image_grid_thw)
    max_new_tokens = _new_tokens(settings, ids.shape[1])
    n = settings["num_return_sequences"]
    if max_new_tokens <= 0:
        return np.repeat(ids, n, axis=0).astype(np.int64)
    if n > 1 and streamer is not None:
        raise ValueError("generate: a streamer takes one completion per prompt; drop it or num_return_sequences")
    prompts = [p for p in batch_image_prompts(model.vl_config, ids, mask, pixels, grid, types) for _ in range(n)]
    ids = np.repeat(ids, n, axis=0)  # rows p0 x n, p1 x n, ... (transformers' order)
    params, eos, pad_token_id = _sampling(model, ids.shape[0], max_new_tokens, settings, seed)
    return _run_engine(model, ids, prompts, params, streamer, pad_token_id)


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


__all__ = ["generate", "generate_vision", "fast_generate", "fast_generate_vision", "engine_for",
           "set_default_tokenizer", "default_eos_ids", "SamplingParams"]
