"""The generation engine: continuous batching over a paged KV cache, with vLLM's names outward.

    engine = Engine(model, tokenizer)
    outs = engine.generate(["Hello"], SamplingParams(n=4, temperature=0.8, max_tokens=64))
    outs[0].outputs[2].text, .token_ids, .logprobs, .finish_reason
    engine.generate([{"prompt_token_ids": ids, "images": ImageInputs(pixel_values, ...)}], params)  # with images

One `generate` call: the prompts (text, or token id lists) become sequences (n per prompt). R decode rows
(a power of two, up to max_rows) run together; the host admits waiting sequences into free rows, prefilling
their prompts in one batched call (the n sequences of a prompt share its full pages and each gets a copy of its
last, partly filled page), then runs a compiled loop of up to `chunk` decode steps on the device, reads the
tokens back once, retires finished sequences (stop token, max_tokens, stop string) and frees their pages and
rows for the next admissions. The KV pool is allocated for the call and released at its end, under a memory cap
(`gpu_memory_utilization` of the free device memory, or `kv_cache_gib`); a sequence is admitted only when pages
for its whole length are free, and one that could never fit is refused with the numbers.

A linear-attention model (Qwen3.5) keeps each row's recurrent state beside the pages of its attention layers;
admission overwrites the row's state with its prompt's final one from the prefill.

Prompts with images (a vision-language model; image_inputs.ImageInputs) are prefilled in their own batch of an
admission: the vision tower's features written into their embeddings (`runner.image_embeddings`), Gemma 3's image
blocks attending both ways, Qwen2.5-VL's M-RoPE positions, whose rows then decode at their cache slot plus a
per-row offset (transformers' rope_deltas). Text prompts keep their own prefill and, in a run without M-RoPE
prompts, their decode program.

The weights are the model's own, read at each call (`weights.prepare`: "shared", "copy" or "merged"), so a
trainer that updates the model in place generates with its current weights.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import sys
import time
import weakref
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from unsloth_jax import ops
from unsloth_jax.inference import pages as paging
from unsloth_jax.inference import runner
from unsloth_jax.inference.eos import default_eos_ids
from unsloth_jax.inference.image_inputs import ImageInputs, ImageRequest, image_batch, image_request
from unsloth_jax.inference.sampling import NO_TOKEN, RowParams, SamplerFlags, SamplingParams, completion_key
from unsloth_jax.inference.weights import WEIGHT_MODES, FP8Copies, MergeBuffers, choose_layout, prepare

log = logging.getLogger("unsloth_jax")

MIN_ROWS = 8  # the smallest row bucket
MAX_ROWS = 256  # the default largest row bucket (vLLM's max_num_seqs)
MAX_ROWS_SMALL = 512  # ... for a model under SMALL_MODEL_PARAMS parameters, whose decode step stays cheap
SMALL_MODEL_PARAMS = 1_000_000_000


@dataclasses.dataclass
class Logprob:
    """vLLM's Logprob: the log-probability of one token (raw model distribution)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a request (vLLM's CompletionOutput)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None  # "stop" or "length"
    stop_reason: int | str | None = None  # the stop token id or string, None for an end-of-sequence token

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """The completions of one prompt (vLLM's RequestOutput)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


@dataclasses.dataclass
class _Sequence:
    request: int
    index: int
    params: SamplingParams
    key: np.ndarray  # [2] uint32
    stop_ids: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    row: int | None = None
    long_from: int = 0  # LongRoPE: the first output token fed with the long factors (negative: the prompt too)
    rewrite: bool = False  # LongRoPE: at that token, rewrite the cached keys with the long factors first
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str | None = None


def bucket(n: int, minimum: int = 1) -> int:
    """The next power of two >= max(n, minimum)."""
    n = max(int(n), int(minimum))
    return 1 << (n - 1).bit_length()


def _enable_compile_cache() -> None:
    """Compiled programs cached on disk (~/.cache/unsloth_jax/xla) on a GPU, unless the user chose a cache
    directory or set UNSLOTH_JAX_COMPILE_CACHE=0."""
    if os.environ.get("UNSLOTH_JAX_COMPILE_CACHE", "1") == "0" or jax.default_backend() != "gpu":
        return
    try:
        if jax.config.jax_compilation_cache_dir:
            return
        path = os.environ.get("UNSLOTH_JAX_COMPILE_CACHE_DIR", os.path.expanduser("~/.cache/unsloth_jax/xla"))
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    except (AttributeError, ValueError) as e:  # a jax without these settings: compile every run
        log.info("unsloth_jax: no on-disk compile cache (%s)", e)


def default_stop_ids(model, tokenizer) -> list[int]:
    """The model's end-of-sequence ids (generation_config.json, config.json) and the tokenizer's."""
    ids = set(default_eos_ids(model))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


class Engine:
    """Generation for one model (a CausalLM). Settings:

    max_rows: decode rows at once (vLLM's max_num_seqs; default 256, 512 for a model under a billion parameters;
    fewer when the KV cache cap cannot hold that many sequences at their full length); page_size: tokens per KV page; chunk: decode steps per
    host round trip; gpu_memory_utilization: fraction of the free device memory the KV pool may take (default
    0.9); kv_cache_gib: a fixed cap instead; weights: "shared" (the model's stacked weights, no copy),
    "copy", "merged", "merged_buffer" (LoRA merged once per call into a buffer the engine keeps), "fp8" (an e4m3
    copy of the base, made once and kept, LoRA unmerged: FP8 rollouts) or "auto"
    ("merged_buffer" when its copy fits in weights.MERGE_FRACTION of the free memory, else "shared"; chosen at
    the first call, with a one-line notice) (see unsloth_jax.inference.weights); max_model_len: the longest prompt + completion
    (default: config.max_position_embeddings); seed: for requests without their own."""

    def __init__(self, model, tokenizer=None, *, max_rows: int | None = None, page_size: int = 16, chunk: int = 64,
                 gpu_memory_utilization: float | None = None, kv_cache_gib: float | None = None,
                 weights: str = "shared", max_model_len: int | None = None, seed: int = 0):
        if weights not in WEIGHT_MODES:
            raise ValueError(f"Engine: weights={weights!r}; use one of {WEIGHT_MODES}")
        if max_rows is None:
            max_rows = MAX_ROWS_SMALL if _parameter_count(model) < SMALL_MODEL_PARAMS else MAX_ROWS
        for name, value in (("max_rows", max_rows), ("page_size", page_size), ("chunk", chunk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Engine: {name} must be an integer >= 1, got {value!r}")
        if page_size & (page_size - 1) or page_size < 16:
            raise ValueError(f"Engine: page_size must be a power of two >= 16, got {page_size}")
        if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"Engine: gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        if kv_cache_gib is not None and not kv_cache_gib > 0:
            raise ValueError(f"Engine: kv_cache_gib must be > 0, got {kv_cache_gib!r}")
        self._model = weakref.ref(model)  # generation.engine_for keys engines by model, weakly
        self.tokenizer = tokenizer
        self.max_rows, self.page_size, self.chunk = max_rows, page_size, chunk
        self.gpu_memory_utilization, self.kv_cache_gib = gpu_memory_utilization, kv_cache_gib
        self.weights = weights
        # "merged_buffer": the merged kernels, rewritten call after call; "fp8": the base's e4m3 copies, kept
        self._merge_buffers = FP8Copies() if weights == "fp8" else MergeBuffers()
        self.max_model_len = int(max_model_len or model.config.max_position_embeddings)
        self.seed = int(seed)
        self._requests_seen = 0
        # timings of the last generate call (seconds; the decode ones include reading the tokens back)
        self.last_stats: dict[str, float] = {}
        _enable_compile_cache()

    @property
    def model(self):
        model = self._model()
        if model is None:
            raise RuntimeError("Engine: its model no longer exists")
        return model

    # ------------------------------------------------------------------------------------------ inputs
    def _prompt_ids(self, prompts) -> tuple[list[str | None], list[list[int]], list[ImageRequest | None]]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        texts, ids, images = [], [], []
        for i, p in enumerate(prompts):
            image_inputs = None
            if isinstance(p, dict):
                image_inputs = p.get("images")
                if image_inputs is not None and "prompt_token_ids" not in p:
                    raise ValueError(f"prompts[{i}]: a prompt with images needs 'prompt_token_ids' (the processor's "
                                     "ids, image tokens expanded), not text")
                if "prompt_token_ids" in p:
                    p = p["prompt_token_ids"]
                elif "prompt" in p:
                    p = p["prompt"]
                else:
                    raise ValueError(f"prompts[{i}]: a dict prompt needs 'prompt' or 'prompt_token_ids'")
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError(f"prompts[{i}] is text but the engine has no tokenizer; pass token ids")
                texts.append(p)
                ids.append([int(t) for t in self.tokenizer(p)["input_ids"]])  # special tokens added, as vLLM
            else:
                arr = np.asarray(p)
                if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
                    raise ValueError(f"prompts[{i}] must be a string or a list of token ids, got {type(p).__name__}")
                texts.append(None)
                ids.append([int(t) for t in arr])
            if not ids[-1]:
                raise ValueError(f"prompts[{i}] is empty; give at least one token")
            vocab = self.model.config.vocab_size
            bad = [t for t in ids[-1] if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompts[{i}] has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
            images.append(None if image_inputs is None else
                          image_request(self.model, ids[-1], image_inputs, f"prompts[{i}]"))
        return texts, ids, images

    def _longrope_plan(self, ids, longrope) -> list[tuple[int, bool]]:
        """Per prompt (long_from, rewrite): `longrope` checked, or each prompt's own switch as transformers'
        Phi-3 makes it for that prompt alone: the long factors from the token whose position reaches
        original_max_position_embeddings, the cache rebuilt with them there (when the prompt is no longer)."""
        cfg = self.model.config
        if longrope is None:
            if cfg.rope_type != "longrope":
                return [(0, False)] * len(ids)
            return [(cfg.rope_original_max_position - len(p), len(p) <= cfg.rope_original_max_position) for p in ids]
        if cfg.rope_type != "longrope":
            raise ValueError(f"longrope: the model's rope_type is {cfg.rope_type!r}, not 'longrope'")
        plan = list(longrope)
        if len(plan) != len(ids) or not all(isinstance(x, tuple) and len(x) == 2 for x in plan):
            raise ValueError(f"longrope: give one (long_from, rewrite) tuple per prompt ({len(ids)}), got {longrope!r}")
        return [(int(a), bool(b)) for a, b in plan]

    def _sequences(self, ids, params_list, longrope=None) -> list[_Sequence]:
        eos = default_stop_ids(self.model, self.tokenizer)
        plan = self._longrope_plan(ids, longrope)
        seqs = []
        for r, (prompt, params) in enumerate(zip(ids, params_list)):
            total = len(prompt) + params.max_tokens
            if total > self.max_model_len:
                raise ValueError(f"prompts[{r}]: {len(prompt)} prompt tokens + max_tokens={params.max_tokens} = "
                                 f"{total} exceed max_model_len={self.max_model_len}")
            seed = params.seed if params.seed is not None else self.seed * 1_000_003 + self._requests_seen + r
            stops = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos)))
            for j in range(params.n):
                # a rewrite only where the row feeds that token (its last fed token is max_tokens - 2)
                seqs.append(_Sequence(r, j, params, completion_key(seed, j), stops, long_from=plan[r][0],
                                      rewrite=plan[r][1] and 0 <= plan[r][0] <= params.max_tokens - 2))
        self._requests_seen += len(ids)
        return seqs

    def layout(self) -> str:
        """The weight layout of the next call: `weights`, with "auto" resolved (once, by the free device memory;
        the choice printed in one line on stderr) to "merged_buffer" or "shared"."""
        if self.weights == "auto":
            stats = _memory_stats()
            free = None if stats is None else stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
            self.weights, why = choose_layout(self.model, free)
            print(f"unsloth_jax generate: weights {self.weights} ({why})", file=sys.stderr)
        return self.weights

    # -------------------------------------------------------------------------------------------- sizes
    def _page_cap(self, max_pages: int) -> int | None:
        """The pages the KV cache cap holds (kv_cache_gib, else gpu_memory_utilization of the free device
        memory; None where the backend reports no memory), checked to hold one sequence of max_pages."""
        size = self.page_size
        per_page = paging.page_bytes(self.model.config, size, self.model.dtype)
        if self.kv_cache_gib is not None:
            cap = int(self.kv_cache_gib * 2**30 // per_page)
        else:
            stats = _memory_stats()
            if stats is None:
                return None
            free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
            cap = int((self.gpu_memory_utilization or 0.9) * free // per_page)
        if cap < max_pages:
            raise ValueError(f"the KV cache cap holds {cap} pages of {size} tokens ({per_page / 2**20:.1f} MiB "
                             f"each) but one sequence needs {max_pages}; raise gpu_memory_utilization or "
                             f"kv_cache_gib, or lower max_tokens")
        return cap

    def _sizes(self, sequences: int, max_pages: int) -> tuple[int, int]:
        """(rows, pool pages) of a call with `sequences` sequences of up to max_pages pages: rows the power of
        two that holds them all (at least MIN_ROWS), at most max_rows and at most what the cap holds at full
        length (rounded down to a power of two); the pool every page those rows can use, up to the cap."""
        cap = self._page_cap(max_pages)
        rows = min(bucket(sequences, MIN_ROWS), bucket(self.max_rows, MIN_ROWS))
        # a linear-attention model's rows also hold recurrent states (counted in pages of the same cap)
        cfg = self.model.config
        per_page = paging.page_bytes(cfg, self.page_size, self.model.dtype)
        row_pages = -(-paging.state_bytes(cfg, self.model.dtype) // per_page)
        if cap is not None:
            fit = max(cap // (max_pages + row_pages), 1)
            fit = 1 << (fit.bit_length() - 1)  # the largest power of two <= cap // (max_pages + row_pages)
            rows = min(rows, max(fit, MIN_ROWS))
        need = rows * max_pages
        return rows, need if cap is None else max(min(need, cap - rows * row_pages), max_pages)

    # --------------------------------------------------------------------------------------- generation
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = False, on_tokens=None, longrope=None) -> list[RequestOutput]:
        """Complete every prompt (a string, token ids, a {"prompt_token_ids": ...} dict, or a list of those; a
        dict may carry the prompt's images: {"prompt_token_ids": ids, "images": image_inputs.ImageInputs(...)}, ids
        with the image tokens expanded as the processor gives them). sampling_params: one for all prompts or one
        per prompt (default SamplingParams()). on_tokens: called after each decode chunk with {(request, index):
        new token ids} (streaming). longrope (a LongRoPE model: Phi-3): per prompt (long_from, rewrite), the index of
        the first output token fed with the long factors (negative: the prompt's too) and whether the row's cached
        keys are rewritten with them there (a prefill of its sequence so far); default: each prompt's own switch
        (`_longrope_plan`); `generation.generate` gives a batch's, as transformers' Phi-3 takes it for the batch.
        Returns one RequestOutput per prompt, in order."""
        texts, ids, images = self._prompt_ids(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = ([sampling_params] * len(ids) if isinstance(sampling_params, SamplingParams)
                       else list(sampling_params))
        if len(params_list) != len(ids):
            raise ValueError(f"{len(params_list)} sampling_params for {len(ids)} prompts")
        for p in params_list:
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params must be SamplingParams, got {type(p).__name__}")
        seqs = self._sequences(ids, params_list, longrope)
        _Run(self, ids, images, seqs, use_tqdm, on_tokens).run()
        outs = []
        for r, (text, prompt) in enumerate(zip(texts, ids)):
            mine = sorted((s for s in seqs if s.request == r), key=lambda s: s.index)
            outs.append(RequestOutput(str(r), text, list(prompt), [self._completion(s) for s in mine]))
        return outs

    def _completion(self, s: _Sequence) -> CompletionOutput:
        text = s.text
        if text is None:
            text = "" if self.tokenizer is None else self.tokenizer.decode(
                s.tokens, skip_special_tokens=s.params.skip_special_tokens)
        lps = None
        if s.params.logprobs is not None:
            lps = [{t: Logprob(lp)} for t, lp in zip(s.tokens, s.logprobs)]
        return CompletionOutput(s.index, text, list(s.tokens), float(np.sum(s.logprobs)), lps, s.finish_reason,
                                s.stop_reason)

    def summary(self, rows: int, pool_pages: int, flags: SamplerFlags, sequences: int) -> None:
        """One line on stderr (stdout carries what the user generates) the first time the model generates; later
        calls log it at INFO (a chat's answers are not interleaved with it)."""
        per_page = paging.page_bytes(self.model.config, self.page_size, self.model.dtype)
        probe = jax.ShapeDtypeStruct((1, 1, self.model.config.head_dim), self.model.dtype)
        kernels = [op for op in ("paged_attention", "decode_linear") if ops.use_pallas(op, probe)]
        line = (f"unsloth_jax generate: {sequences} sequences on {rows} rows, KV pool {pool_pages} pages x "
                f"{self.page_size} tokens ({pool_pages * per_page / 2**30:.2f} GiB), weights {self.weights}, decode "
                f"kernels {'+'.join(kernels) or 'none (XLA)'}, dtype {jnp.dtype(self.model.dtype).name}")
        if self.model in _SUMMARIZED:
            log.info("%s", line)
            return
        _SUMMARIZED.add(self.model)
        print(line, file=sys.stderr)


_SUMMARIZED: "weakref.WeakSet" = weakref.WeakSet()  # models whose first generate call printed its summary line


def _parameter_count(model) -> int:
    """The model's parameters (array elements of its state; a quantized kernel counts its stored elements)."""
    return sum(int(a.size) for a in jax.tree.leaves(nnx.state(model)) if hasattr(a, "size"))


def _memory_stats() -> dict | None:
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        return None
    return stats if stats and "bytes_limit" in stats else None


class _Run:
    """The host loop of one `Engine.generate` call."""

    def __init__(self, engine: Engine, prompts: list[list[int]], images: list[ImageRequest | None],
                 seqs: list[_Sequence], use_tqdm, on_tokens):
        self.e, self.prompts, self.images, self.seqs, self.on_tokens = engine, prompts, images, seqs, on_tokens
        # rows carry position offsets only in runs with M-RoPE prompts: text runs keep their decode program
        self.offsets = any(r is not None and r.rope_positions is not None for r in images)
        self.longrope = engine.model.config.rope_type == "longrope"
        params = [s.params for s in seqs]
        self.flags = SamplerFlags.of(params)
        longest = max(len(prompts[s.request]) + s.params.max_tokens for s in seqs)
        self.max_pages = paging.pages_for(longest, engine.page_size)
        self.stop_width = max(1, max(len(s.stop_ids) for s in seqs))
        self.waiting = collections.deque(_by_request(seqs))
        self.running: dict[int, _Sequence] = {}
        self.bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=len(seqs), desc="generate", unit="seq")

    def run(self) -> None:
        e, cfg = self.e, self.e.model.config
        t0 = time.perf_counter()
        self.plan, self.weights = prepare(e.model, e.layout(), e._merge_buffers)
        # sized after the weights: a first merged buffer is in use when the free memory is read
        self.rows, self.num_pages = e._sizes(len(self.seqs), self.max_pages)
        self.alloc = paging.PageAllocator(self.num_pages)
        self.free_rows = list(range(self.rows - 1, -1, -1))
        self.tables = np.zeros((self.rows, self.max_pages), np.int32)
        e.summary(self.rows, self.num_pages, self.flags, len(self.seqs))
        stats = e.last_stats = {"prepare_s": 0.0, "prefill_s": 0.0, "decode_s": 0.0, "steps": 0, "chunks": 0,
                                "rows": self.rows, "pool_pages": self.num_pages}
        self.pools = paging.make_pools(cfg, self.num_pages, e.page_size, e.model.dtype, self.rows)
        self.state = runner.empty_rows(self.rows, self.stop_width, cfg.vocab_size, self.flags, self.offsets,
                                       self.longrope)
        jax.block_until_ready((self.weights, self.pools))
        stats["prepare_s"] = time.perf_counter() - t0
        try:
            while self.waiting or self.running:
                t0 = time.perf_counter()
                self._admit()
                stats["prefill_s"] += time.perf_counter() - t0
                if not self.running:
                    continue
                t0 = time.perf_counter()
                steps = self._longrope_switch() if self.longrope else e.chunk
                out = runner.decode_chunk(self.weights, self.pools, self.state, jnp.asarray(self.tables),
                                          jnp.int32(steps), plan=self.plan, flags=self.flags, cap=e.chunk)
                self.pools, self.state, tokens, logprobs, taken = out
                tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
                stats["decode_s"] += time.perf_counter() - t0
                stats["steps"] += int(taken)
                stats["chunks"] += 1
                self._collect(tokens, logprobs)
        finally:
            self.pools = self.state = self.weights = None  # the KV pool and copied weights go with the call
            if self.bar is not None:
                self.bar.close()

    def _longrope_switch(self) -> int:
        """LongRoPE: rewrite the cached keys of the rows about to feed their `long_from` token with the long
        factors (one prefill of each row's sequence so far, into its own pages; the n completions of a prompt,
        in step, write the same values to the pages they share), then the steps the next chunk may take: up to
        the next row's rewrite."""
        size, num_slots = self.e.page_size, self.num_pages * self.e.page_size
        now, steps = [], self.e.chunk
        for s in self.running.values():
            fed = len(s.tokens) - 1  # the index of the token the row feeds next
            if s.rewrite and fed == s.long_from:
                now.append(s)
                s.rewrite = False
            elif s.rewrite:
                steps = min(steps, s.long_from - fed)
        if now:
            seqs = [self.prompts[s.request] + s.tokens[:-1] for s in now]
            p_b, s_b = bucket(len(seqs)), bucket(max(len(q) for q in seqs), 16)
            ids = np.zeros((p_b, s_b), np.int32)
            slots = np.full((p_b, s_b), num_slots, np.int32)
            lens = np.zeros((p_b,), np.int32)
            for i, (s, q) in enumerate(zip(now, seqs)):
                t = np.arange(len(q))
                ids[i, :len(q)], lens[i] = q, len(q)
                slots[i, :len(q)] = np.asarray(s.pages)[t // size] * size + t % size
            self.pools, _ = runner.prefill(self.weights, self.pools, jnp.asarray(ids), jnp.asarray(lens),
                                           jnp.asarray(slots), None, jnp.ones((p_b,), bool), plan=self.plan)
        return steps

    # ------------------------------------------------------------------------------------------ admission
    def _admit(self) -> None:
        size = self.e.page_size
        admitted: list[tuple[int, list[_Sequence]]] = []  # (prompt, its admitted sequences)
        while self.waiting and self.free_rows:
            group = self.waiting[0]
            prompt = self.prompts[group[0].request]
            full = len(prompt) // size
            own = [paging.pages_for(len(prompt) + s.params.max_tokens, size) - full for s in group]
            take = 0
            while take < len(group) and take < len(self.free_rows) \
                    and full + sum(own[:take + 1]) <= self.alloc.free:
                take += 1
            if take == 0:
                if not self.running and not admitted:
                    raise MemoryError(f"the KV pool ({self.num_pages} pages) cannot hold request "
                                      f"{group[0].request}; raise gpu_memory_utilization or kv_cache_gib")
                break
            shared = self.alloc.take(full)
            self.alloc.share(shared, take - 1)
            for s, n_own in zip(group[:take], own[:take]):
                s.pages = shared + self.alloc.take(n_own)
                s.row = self.free_rows.pop()
                self.tables[s.row] = 0
                self.tables[s.row, :len(s.pages)] = s.pages
                self.running[s.row] = s
            admitted.append((group[0].request, group[:take]))
            if take == len(group):
                self.waiting.popleft()
            else:
                self.waiting[0] = group[take:]
        if admitted:
            self._prefill(admitted)

    def _prefill(self, admitted) -> None:
        """Prefill the admitted prompts (those without images in one batch, those with images in another) and
        report their first tokens together."""
        news = {}
        for with_images in (False, True):
            group = [(r, seqs) for r, seqs in admitted if (self.images[r] is not None) == with_images]
            if group:
                news.update(self._prefill_group(group, with_images))
        self._emit(news)
        self._retire_finished()

    def _prefill_group(self, admitted, with_images: bool) -> dict:
        """Prefill one batch of admitted prompts and start their rows -> {(request, index): [first token]}."""
        size = self.e.page_size
        num_slots = self.num_pages * size
        n_prompts = len(admitted)
        lengths = [len(self.prompts[r]) for r, _ in admitted]
        p_b, s_b = bucket(n_prompts), bucket(max(lengths), 16)
        ids = np.zeros((p_b, s_b), np.int32)
        slots = np.full((p_b, s_b), num_slots, np.int32)
        lens = np.zeros((p_b,), np.int32)
        src, dst = [], []
        for i, (r, group) in enumerate(admitted):
            prompt = self.prompts[r]
            first = group[0]
            ids[i, :len(prompt)] = prompt
            lens[i] = len(prompt)
            t = np.arange(len(prompt))
            slots[i, :len(prompt)] = np.asarray(first.pages)[t // size] * size + t % size
            if len(prompt) % size:  # the others copy the prompt's partly filled page
                part = len(prompt) // size
                for s in group[1:]:
                    src.append(first.pages[part])
                    dst.append(s.pages[part])
        images = None
        if with_images:
            batch = image_batch(self.e.model, [self.images[r] for r, _ in admitted], p_b, s_b)
            embeds, deep = runner.image_embeddings(self.weights, jnp.asarray(ids), batch.pixel_values,
                                                   batch.image_kwargs, plan=self.plan)
            images = runner.PrefillImages(embeds, batch.block_ids, batch.rope_positions, deep)
        long = None
        if self.longrope:  # prompts past the original context take the long factors from the start
            long = np.zeros((p_b,), bool)
            long[:n_prompts] = [group[0].long_from < 0 for _, group in admitted]
            long = jnp.asarray(long)
        new = [(i, s) for i, (_, group) in enumerate(admitted) for s in group]
        n_b = bucket(len(new))
        prompt_of = np.zeros((n_b,), np.int32)
        targets = np.full((n_b,), self.rows, np.int32)  # padding entries: out of range, dropped
        for k, (i, s) in enumerate(new):
            prompt_of[k], targets[k] = i, s.row
        # linear-attention layers (Qwen3.5): each admitted row starts from its prompt's final recurrent state
        state_rows = (jnp.asarray(prompt_of), jnp.asarray(targets)) if self.e.model.config.layer_linear else None
        self.pools, logits = runner.prefill(self.weights, self.pools, jnp.asarray(ids), jnp.asarray(lens),
                                            jnp.asarray(slots), images, long, state_rows, plan=self.plan)
        if src:
            self.pools = paging.copy_pages(self.pools, jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32))
        plen = np.zeros((n_b,), np.int32)
        budgets = np.ones((n_b,), np.int32)
        keys = np.zeros((n_b, 2), np.uint32)
        stop_ids = np.full((n_b, self.stop_width), -1, np.int32)
        width = bucket(max(lengths), 16) if self.flags.penalty else 1
        prompt_tokens = np.full((n_b, width), NO_TOKEN, np.int32)
        params = [SamplingParams()] * n_b
        offsets = np.zeros((n_b,), np.int32)
        long_from = np.zeros((n_b,), np.int32)
        for k, (i, s) in enumerate(new):
            prompt = self.prompts[s.request]
            prompt_of[k], targets[k], plen[k], budgets[k] = i, s.row, len(prompt), s.params.max_tokens
            if self.images[s.request] is not None:
                offsets[k] = self.images[s.request].position_offset
            keys[k], long_from[k] = s.key, s.long_from
            stop_ids[k, :len(s.stop_ids)] = s.stop_ids
            if self.flags.penalty:
                prompt_tokens[k, :len(prompt)] = prompt
            params[k] = s.params
        rp = RowParams(*(jnp.asarray(a) for a in RowParams.of(params)))
        self.state, first, lps = runner.start_rows(self.state, logits, jnp.asarray(prompt_of), jnp.asarray(targets),
                                                   jnp.asarray(plen), jnp.asarray(budgets), jnp.asarray(keys), rp,
                                                   jnp.asarray(stop_ids), jnp.asarray(prompt_tokens),
                                                   jnp.asarray(offsets) if self.offsets else None,
                                                   jnp.asarray(long_from) if self.longrope else None, flags=self.flags)
        first, lps = np.asarray(first), np.asarray(lps)
        news = {}
        for k, (_, s) in enumerate(new):
            self._append(s, [int(first[k])], [float(lps[k])])
            news[(s.request, s.index)] = [int(first[k])]
        return news

    # ------------------------------------------------------------------------------------------ progress
    def _collect(self, tokens: np.ndarray, logprobs: np.ndarray) -> None:
        news = {}
        for row, s in list(self.running.items()):
            got = tokens[row]
            n = int(np.sum(got >= 0))
            if n:
                self._append(s, got[:n].tolist(), logprobs[row, :n].tolist())
                news[(s.request, s.index)] = got[:n].tolist()
        self._emit(news)
        self._retire_finished()

    def _append(self, s: _Sequence, toks: list[int], lps: list[float]) -> None:
        s.tokens += toks
        s.logprobs += lps
        if s.tokens and s.tokens[-1] in s.stop_ids:
            s.finish_reason = "stop"
            s.stop_reason = s.tokens[-1] if s.tokens[-1] in s.params.stop_token_ids else None
        elif len(s.tokens) >= s.params.max_tokens:
            s.finish_reason = "length"
        if s.params.stop and self.e.tokenizer is not None:
            self._check_stop_strings(s)

    def _check_stop_strings(self, s: _Sequence) -> None:
        text = self.e.tokenizer.decode(s.tokens, skip_special_tokens=s.params.skip_special_tokens)
        hits = [(text.find(stop), stop) for stop in s.params.stop if stop in text]
        if not hits:
            return
        at, stop = min(hits)
        s.text = text[:at + len(stop)] if s.params.include_stop_str_in_output else text[:at]
        # keep the tokens up to the one that completed the stop string
        for n in range(1, len(s.tokens) + 1):
            if stop in self.e.tokenizer.decode(s.tokens[:n], skip_special_tokens=s.params.skip_special_tokens):
                s.tokens, s.logprobs = s.tokens[:n], s.logprobs[:n]
                break
        s.finish_reason, s.stop_reason = "stop", stop

    def _emit(self, news: dict) -> None:
        if self.on_tokens is not None and news:
            self.on_tokens(news)

    def _retire_finished(self) -> None:
        done = [row for row, s in self.running.items() if s.finish_reason is not None]
        if not done:
            return
        stopped_on_host = [row for row in done if isinstance(self.running[row].stop_reason, str)]
        if stopped_on_host:
            self.state = runner.deactivate(self.state, jnp.asarray(stopped_on_host, jnp.int32))
        for row in done:
            s = self.running.pop(row)
            self.alloc.release(s.pages)
            s.pages, s.row = [], None
            self.free_rows.append(row)
            if self.bar is not None:
                self.bar.update(1)


def _by_request(seqs: list[_Sequence]) -> list[list[_Sequence]]:
    groups: dict[int, list[_Sequence]] = {}
    for s in seqs:
        groups.setdefault(s.request, []).append(s)
    return list(groups.values())


__all__ = ["Engine", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "default_stop_ids",
           "ImageInputs"]
