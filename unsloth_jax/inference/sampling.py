"""Sampling: vLLM's `SamplingParams` and the on-device sampler of the generation engine.

    params = SamplingParams(n=8, temperature=1.0, top_p=0.9, max_tokens=256, seed=0)

Per row, in this order (transformers' logits processors, which TRL's in-process generation uses; vLLM's
definitions agree): repetition penalty on the raw logits (a logit of a token already in the prompt or the output
is divided by the penalty when positive, multiplied when negative), temperature, top-k (keep the k largest;
ties with the k-th kept), top-p (keep the smallest set of most likely tokens whose probability reaches top_p,
renormalised over the top-k set), min-p (keep tokens with probability >= min_p x the largest), then a draw.
temperature 0 is greedy (argmax after the penalty). The draw is the Gumbel-max trick with a key made from the
request's seed and the index of the token in its output, so a request's tokens do not depend on which other
requests share its batch.

No sort anywhere: top-k and top-p find their thresholds by a 16-way search over the float32 bit patterns of the
probabilities (which order like the values), eight passes over the vocabulary, exact up to ties. Each feature
costs only when some row of the batch asks for it (`SamplerFlags`, static in the compiled step).

The log-probability returned with each token is the raw model distribution's (log_softmax of the logits before
any processing), as vLLM returns by default.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

NO_TOKEN = int(np.iinfo(np.int32).max)  # pads a row of token ids: out of range of any vocabulary (seen_tokens drops it)
_SEARCH_WAYS = 16  # thresholds tried per pass of the top-k / top-p search
_SEARCH_PASSES = 8  # 16 ** 8 = 2 ** 32 covers every float32 bit pattern


@dataclasses.dataclass
class SamplingParams:
    """vLLM's sampling parameters (the subset the engine implements).

    n: completions per prompt (they share the prompt's cache pages); temperature (0: greedy); top_p in (0, 1];
    top_k (0 or -1: off); min_p in [0, 1]; repetition_penalty > 0 (1: off); seed (None: drawn from the engine's
    seed); max_tokens >= 1; stop: strings that end a completion (not included in its text); stop_token_ids:
    token ids that end it (included in token_ids); ignore_eos: do not stop at the model's end-of-sequence tokens;
    logprobs: None, or an int >= 0 to return the sampled tokens' log-probabilities (the engine returns the
    sampled token's only); skip_special_tokens: for the decoded text; include_stop_str_in_output.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        def bad(name, what):
            raise ValueError(f"SamplingParams: {name} must be {what}, got {getattr(self, name)!r}")

        if isinstance(self.n, bool) or not isinstance(self.n, (int, np.integer)) or self.n < 1:
            bad("n", "an integer >= 1")
        if not _real(self.temperature) or self.temperature < 0:
            bad("temperature", "a number >= 0 (0 means greedy)")
        if not _real(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) or self.top_k < -1:
            bad("top_k", "an integer >= 0 (0 or -1: off)")
        if not _real(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "in [0, 1]")
        if not _real(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", "a number > 0 (1: off)")
        if self.max_tokens is None or isinstance(self.max_tokens, bool) \
                or not isinstance(self.max_tokens, (int, np.integer)) or self.max_tokens < 1:
            bad("max_tokens", "an integer >= 1")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer))):
            bad("seed", "an integer or None")
        if self.logprobs is not None and (not isinstance(self.logprobs, (int, np.integer)) or self.logprobs < 0):
            bad("logprobs", "None or an integer >= 0")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        if not all(isinstance(s, str) for s in self.stop):
            bad("stop", "a string or a list of strings")
        ids = list(self.stop_token_ids or [])
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t >= 0 for t in ids):
            bad("stop_token_ids", "a list of token ids >= 0")
        self.stop_token_ids = [int(t) for t in ids]
        self.top_k = 0 if self.top_k == -1 else int(self.top_k)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and np.isfinite(x)


class SamplerFlags(NamedTuple):
    """Which sampler features some row of a batch uses (static: each combination compiles once)."""

    sample: bool = False  # some row has temperature > 0
    top_k: bool = False
    top_p: bool = False
    min_p: bool = False
    penalty: bool = False

    @staticmethod
    def of(params: Sequence[SamplingParams]) -> "SamplerFlags":
        sampled = [p for p in params if not p.greedy]
        return SamplerFlags(sample=bool(sampled), top_k=any(p.top_k > 0 for p in sampled),
                            top_p=any(p.top_p < 1 for p in sampled), min_p=any(p.min_p > 0 for p in sampled),
                            penalty=any(p.repetition_penalty != 1 for p in params))


class RowParams(NamedTuple):
    """Per-row sampling parameters as device arrays [R]."""

    temperature: jax.Array  # float32; 0 = greedy
    top_k: jax.Array  # int32; 0 = off
    top_p: jax.Array  # float32
    min_p: jax.Array  # float32
    penalty: jax.Array  # float32 repetition penalty

    @staticmethod
    def of(params: Sequence[SamplingParams]) -> "RowParams":
        """Host arrays for a list of per-row params."""
        return RowParams(np.asarray([p.temperature for p in params], np.float32),
                         np.asarray([p.top_k for p in params], np.int32),
                         np.asarray([p.top_p for p in params], np.float32),
                         np.asarray([p.min_p for p in params], np.float32),
                         np.asarray([p.repetition_penalty for p in params], np.float32))


def _bits(p: jax.Array) -> jax.Array:
    """int32 bit patterns of non-negative float32 values (ordered like the values)."""
    return jax.lax.bitcast_convert_type(p.astype(jnp.float32), jnp.int32)


def _once(x: jax.Array) -> jax.Array:
    """x computed once: a cut's threshold is the bits of one token's probability, so the search and the keep mask
    must see the same rounding. XLA on a GPU may recompute a softmax inside each consumer's fusion, and two fusions'
    exponentials can differ in the last bit, which would drop the token at the threshold (a GPU run of
    test_sampled_frequencies_match_the_distribution drew only 4 tokens under top_k=5 in 2 of 120 cases); the barrier
    keeps one computed value."""
    return jax.lax.optimization_barrier(x)


def _search_threshold(bits: jax.Array, measure, goal: jax.Array) -> jax.Array:
    """The largest t in [0, max bits] with measure(bits >= t) >= goal, per row, for `measure` non-increasing in
    t: a 16-way search, _SEARCH_PASSES passes. bits [R, V] int32; measure(mask [R, V, W]) -> [R, W]; goal [R].
    Returns t [R] int32."""
    lo = jnp.zeros(bits.shape[:1], jnp.int32)  # measure(lo) >= goal holds (everything kept)
    hi = jnp.max(bits, axis=-1) + 1  # measure(hi) < goal holds (nothing kept)
    ways = jnp.arange(1, _SEARCH_WAYS, dtype=jnp.int32)
    for _ in range(_SEARCH_PASSES):
        width = hi - lo
        cand = lo[:, None] + (width // _SEARCH_WAYS)[:, None] * ways + ((width % _SEARCH_WAYS)[:, None] * ways) // _SEARCH_WAYS
        ok = measure(bits[:, :, None] >= cand[:, None, :]) >= goal[:, None]  # [R, W-1], true then false
        count = jnp.sum(ok, axis=-1)  # candidates that keep the goal
        new_lo = jnp.where(count > 0, jnp.take_along_axis(cand, jnp.maximum(count - 1, 0)[:, None], -1)[:, 0], lo)
        new_hi = jnp.where(count < _SEARCH_WAYS - 1,
                           jnp.take_along_axis(cand, jnp.minimum(count, _SEARCH_WAYS - 2)[:, None], -1)[:, 0], hi)
        lo, hi = new_lo, new_hi
    return lo


def apply_penalty(logits: jax.Array, seen: jax.Array, penalty: jax.Array) -> jax.Array:
    """transformers' / vLLM's repetition penalty: logits [R, V] of tokens with seen [R, V] set are divided by
    penalty [R] when positive, multiplied when negative."""
    pen = penalty[:, None]
    return jnp.where(seen, jnp.where(logits > 0, logits / pen, logits * pen), logits)


def completion_key(seed: int, index: int) -> np.ndarray:
    """The base key [2] uint32 of completion `index` of a request with `seed` (each of its tokens folds in the
    token's index in the completion: token_keys)."""
    return np.asarray(jax.random.fold_in(jax.random.PRNGKey(seed), index), np.uint32)


def token_keys(keys: jax.Array, generated: jax.Array) -> jax.Array:
    """Per-row keys [R, 2] for the next token: base keys [R, 2] with each row's count of generated tokens [R]."""
    return jax.vmap(jax.random.fold_in)(keys, generated)


def seen_tokens(tokens: jax.Array, vocab: int) -> jax.Array:
    """The repetition penalty's seen mask [N, vocab] bool: True at each row's ids of tokens [N, T] int32, whose
    unused slots hold NO_TOKEN (a negative pad would wrap around to the last token of the vocabulary)."""
    n = tokens.shape[0]
    return jnp.zeros((n, vocab), bool).at[jnp.arange(n)[:, None], tokens].set(True, mode="drop")


def filtered_logits(logits: jax.Array, rows: RowParams, flags: SamplerFlags) -> jax.Array:
    """Temperature, top-k, top-p and min-p applied to logits [R, V] float32 (after the penalty): the tempered
    logits with every dropped token at -inf."""
    z = logits / jnp.maximum(rows.temperature, 1e-6)[:, None]
    neg = jnp.float32(-jnp.inf)
    if not (flags.top_k or flags.top_p or flags.min_p):
        return z
    probs = _once(jax.nn.softmax(z, axis=-1))
    bits = _bits(probs)
    if flags.top_k:
        k = rows.top_k
        t = _search_threshold(bits, lambda m: jnp.sum(m, axis=1, dtype=jnp.int32), jnp.maximum(k, 1))
        keep = (bits >= t[:, None]) | (k <= 0)[:, None]
        z = jnp.where(keep, z, neg)
        probs = _once(jax.nn.softmax(z, axis=-1))
        bits = _bits(probs)
    if flags.top_p:
        top_p = rows.top_p
        t = _search_threshold(bits, lambda m: jnp.sum(jnp.where(m, probs[:, :, None], 0.0), axis=1),
                              jnp.minimum(top_p, jnp.sum(probs, axis=-1)))
        keep = (bits >= t[:, None]) | (top_p >= 1)[:, None]
        z = jnp.where(keep, z, neg)
    if flags.min_p:
        floor = rows.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
        z = jnp.where((probs >= floor) | (rows.min_p <= 0)[:, None], z, neg)
    return z


def sample(logits: jax.Array, rows: RowParams, keys: jax.Array, flags: SamplerFlags, seen: jax.Array | None = None
           ) -> tuple[jax.Array, jax.Array]:
    """Next tokens [R] int32 and their raw log-probabilities [R] float32 from logits [R, V] float32.

    keys [R, 2] uint32: one PRNG key per row for this token; seen [R, V] bool (with flags.penalty): tokens already
    in the row's prompt or output."""
    raw_lse = jax.nn.logsumexp(logits, axis=-1)
    scored = apply_penalty(logits, seen, rows.penalty) if flags.penalty else logits
    greedy = jnp.argmax(scored, axis=-1).astype(jnp.int32)
    if flags.sample:
        z = filtered_logits(scored, rows, flags)
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, logits.shape[-1:], jnp.float32))(keys)
        drawn = jnp.argmax(z + gumbel, axis=-1).astype(jnp.int32)
        tokens = jnp.where(rows.temperature > 0, drawn, greedy)
    else:
        tokens = greedy
    logprobs = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - raw_lse
    return tokens, logprobs


def filtered_probs(logits, params: Sequence[SamplingParams], seen=None) -> np.ndarray:
    """The distribution each row samples from (numpy [R, V]): for tests and diagnostics."""
    rows = RowParams(*(jnp.asarray(a) for a in RowParams.of(params)))
    flags = SamplerFlags.of(params)._replace(sample=True)
    logits = jnp.asarray(logits, jnp.float32)
    if flags.penalty:
        logits = apply_penalty(logits, jnp.asarray(seen), rows.penalty)
    return np.asarray(jax.nn.softmax(filtered_logits(logits, rows, flags), axis=-1))


__all__ = ["SamplingParams", "SamplerFlags", "RowParams", "sample", "apply_penalty", "filtered_logits",
           "filtered_probs", "seen_tokens", "NO_TOKEN", "completion_key", "token_keys"]
