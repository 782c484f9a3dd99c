"""KV-cache generation: greedy output equals transformers' greedy generate (left-padded batches, eos handling,
Gemma 2 softcapping + sliding windows, Gemma 3, Phi-3 LongRoPE), LoRA generation equals PEFT's, bucketing avoids
recompiles, sampling."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.conftest import fresh_seed  # noqa: E402
from tests.hf_models import save_hf_model  # noqa: E402
from unsloth_jax import FastLanguageModel  # noqa: E402
from unsloth_jax.generation import generate  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (hf model, our model), built lazily and cached for the module."""
    cache = {}

    def get(family):
        if family not in cache:
            path = tmp_path_factory.mktemp(family)
            hf = save_hf_model(family, path, seed=fresh_seed(f"{family} model"))
            model, _ = FastLanguageModel.from_pretrained(path, dtype="float32", load_tokenizer=False, progress=False)
            cache[family] = (hf, model)
        return cache[family]

    return get


def _left_padded(rng, lengths, vocab=256, pad=0):
    width = max(lengths)
    ids = np.full((len(lengths), width), pad, np.int64)
    mask = np.zeros((len(lengths), width), np.int64)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = rng.integers(3, vocab, size=n)
        mask[i, width - n:] = 1
    return ids, mask


def _hf_generate(hf, ids, mask, max_new, eos, pad=0):
    with torch.no_grad():
        out = hf.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=max_new,
                          do_sample=False, eos_token_id=eos, pad_token_id=pad)
    return out.numpy()


@pytest.mark.torch
@pytest.mark.parametrize("family", ["llama", "llama3_scaled", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3",
                                    "gemma3_softcap", "phi3", "phi3_longrope"])
def test_greedy_matches_transformers_left_padded(tiny, family, rng):
    """A left-padded batch (rows of different lengths), then again with an eos that one row emits early: the
    tokens, the pad fill after eos and the early stop all equal HF's. Gemma 2's and Gemma 3's window (8) is
    exceeded (Gemma 3: local and global RoPE, a scan tail of 2 layers); Phi-3's LongRoPE switches to the long
    factors once positions pass 16, mid-generation, and the cache is rebuilt with them, as transformers does."""
    hf, model = tiny(family)
    lengths = [int(rng.integers(6, 12)), int(rng.integers(2, 6)), int(rng.integers(1, 4))]
    ids, mask = _left_padded(rng, lengths)
    max_new = 14
    first = _hf_generate(hf, ids, mask, max_new, eos=[2])
    ours = generate(model, ids, mask, max_new_tokens=max_new, eos_token_id=[2], pad_token_id=0)
    np.testing.assert_array_equal(ours, first)
    # An eos the first row produces at its 4th new token (not before): it stops there, the others go on.
    row0 = first[0, ids.shape[1]:]
    candidates = [t for j, t in enumerate(row0[3:8], start=3) if t not in row0[:j] and t != 0]
    eos = int(candidates[0]) if candidates else int(row0[3])
    ref = _hf_generate(hf, ids, mask, max_new, eos=[eos])
    ours = generate(model, ids, mask, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.torch
def test_longrope_cache_rebuild_follows_the_prompt_width(tiny, rng):
    """Every row left padded by 2 more columns than it needs: transformers' Phi-3 rebuilds its cache when the
    sequence width reaches 17 (still short factors: no row has 17 tokens yet) and switches to the long factors
    two steps later without a rebuild, so keys of both kinds stay cached. Our tokens equal HF's (rebuilding at
    the switch instead gave other tokens for 4 of 8 seeds tried)."""
    hf, model = tiny("phi3_longrope")
    lengths = [int(rng.integers(6, 12)), int(rng.integers(2, 6)), int(rng.integers(1, 4))]
    ids, mask = _left_padded(rng, lengths)
    ids, mask = np.pad(ids, ((0, 0), (2, 0))), np.pad(mask, ((0, 0), (2, 0)))
    ref = _hf_generate(hf, ids, mask, 14, eos=[2])
    np.testing.assert_array_equal(generate(model, ids, mask, max_new_tokens=14, eos_token_id=[2], pad_token_id=0),
                                  ref)


@pytest.mark.torch
def test_longrope_requests_on_the_engine_switch_as_transformers_alone(tiny, rng):
    """Engine requests of a LongRoPE model (original context 16) in one call, each switching where transformers
    switches generating it alone: prompts of 5 and 13 tokens (long factors and a cache rewrite mid-decode, 13 with
    n=2 greedy completions sharing the prompt's pages), 16 (the rewrite before the first decode step) and 20
    (long from the prefill) give transformers' greedy tokens; without the rewrite the scores differ."""
    from unsloth_jax.inference import Engine, SamplingParams

    hf, model = tiny("phi3_longrope")
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (5, 13, 16, 20)]
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, n=2 if len(p) == 13 else 1)
              for p in prompts]
    outs = Engine(model, chunk=4).generate(prompts, params)
    for p, out in zip(prompts, outs):
        ref = _hf_generate(hf, np.asarray([p]), np.ones((1, len(p)), np.int64), 14, eos=[-1])[0, len(p):]
        for c in out.outputs:
            assert c.token_ids == ref.tolist(), len(p)
    # the rewrite matters: without it the same tokens (where they stay equal) get other log-probabilities
    scored = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=0)
    with_rewrite = Engine(model).generate(prompts[:1], scored)[0].outputs[0]
    no_rewrite = Engine(model).generate(prompts[:1], scored, longrope=[(16 - 5, False)])[0].outputs[0]
    assert with_rewrite.token_ids == outs[0].outputs[0].token_ids
    assert (no_rewrite.token_ids != with_rewrite.token_ids
            or abs(no_rewrite.cumulative_logprob - with_rewrite.cumulative_logprob) > 1e-3)
    with pytest.raises(ValueError, match="longrope"):
        Engine(model).generate(prompts[:1], params[0], longrope=[11])


@pytest.mark.torch
def test_lora_greedy_matches_peft(tiny, rng, tmp_path):
    """A LoRA model (random nonzero B) saved as a PEFT adapter: PEFT's greedy generate equals ours, for a single
    1-D prompt (the CLI's case)."""
    import jax
    import jax.numpy as jnp
    import peft

    hf, base = tiny("llama")
    model, _ = FastLanguageModel.from_pretrained(base.model_dir, dtype="float32", load_tokenizer=False, progress=False)
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, random_state=int(rng.integers(1 << 30)))
    key = jax.random.PRNGKey(int(rng.integers(1 << 30)))
    projs = model.projections()
    for i, name in enumerate(("q_proj", "v_proj", "down_proj")):
        b = projs[name].lora_b
        b[...] = 0.3 * jax.random.normal(jax.random.fold_in(key, i), b[...].shape, jnp.float32)
    model.save_pretrained(str(tmp_path / "adapter"))
    pm = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter"))
    pm.eval()
    ids = rng.integers(3, 256, size=int(rng.integers(4, 12)))
    try:
        ref = _hf_generate(pm, ids[None], np.ones((1, ids.size), np.int64), 10, eos=[2])
    finally:
        pm.unload()  # leave the shared HF model as it was
    ours = generate(model, ids, max_new_tokens=10, eos_token_id=[2], pad_token_id=0)
    np.testing.assert_array_equal(ours, ref)


def test_prompt_lengths_share_a_compiled_bucket(tiny, rng):
    """Prompts of 5 to 13 tokens with 5 to 20 new ones fall in the same buckets (rows, prompt length, pages):
    the engine's prefill and decode loop do not compile again."""
    from unsloth_jax.inference import runner

    _, model = tiny("llama")
    generate(model, rng.integers(3, 256, size=(3, 5)), max_new_tokens=14)
    prefill, step = runner.prefill.jitted._cache_size(), runner.decode_chunk.jitted._cache_size()
    for n, new in ((6, 14), (9, 20), (13, 5)):  # all within 16 prompt tokens and 2 pages of 16 tokens
        generate(model, rng.integers(3, 256, size=(3, n)), max_new_tokens=new)
    assert runner.prefill.jitted._cache_size() == prefill
    assert runner.decode_chunk.jitted._cache_size() == step


def test_sampling_is_seeded_and_top_p_limits(tiny, rng):
    _, model = tiny("llama")
    ids = rng.integers(3, 256, size=(3, 6))
    greedy = generate(model, ids, max_new_tokens=8, eos_token_id=[])
    a = generate(model, ids, max_new_tokens=8, do_sample=True, temperature=1.5, seed=11, eos_token_id=[])
    b = generate(model, ids, max_new_tokens=8, do_sample=True, temperature=1.5, seed=11, eos_token_id=[])
    np.testing.assert_array_equal(a, b)
    others = [generate(model, ids, max_new_tokens=8, do_sample=True, temperature=1.5, seed=s, eos_token_id=[])
              for s in (12, 13)]
    assert any(not np.array_equal(a, o) for o in others)
    # A nucleus smaller than the top token's probability keeps only the top token: greedy.
    tiny_p = generate(model, ids, max_new_tokens=8, do_sample=True, top_p=1e-6, seed=3, eos_token_id=[])
    np.testing.assert_array_equal(tiny_p, greedy)


def test_streamer_receives_prompt_then_each_token(tiny, rng):
    _, model = tiny("llama")
    ids = rng.integers(3, 256, size=(1, 5))

    class Collect:
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, x):
            self.puts.append(np.asarray(x))

        def end(self):
            self.ended = True

    s = Collect()
    out = generate(model, ids, max_new_tokens=7, eos_token_id=[], streamer=s)
    assert s.ended and len(s.puts) == 8
    np.testing.assert_array_equal(s.puts[0], ids)
    np.testing.assert_array_equal(np.concatenate(s.puts[1:]), out[0, 5:])
    got = []
    generate(model, ids, max_new_tokens=7, eos_token_id=[], streamer=lambda t: got.append(int(t[0])))
    assert got == out[0, 5:].tolist()


def test_bad_inputs_raise(tiny):
    _, model = tiny("llama")
    ids = np.array([[5, 6, 7, 0]])
    with pytest.raises(ValueError, match="padding between real tokens"):
        generate(model, ids, np.array([[1, 0, 1, 1]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="no real token"):
        generate(model, ids, np.array([[0, 0, 0, 0]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="shape"):
        generate(model, ids, np.array([[1, 1]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="empty"):
        generate(model, np.zeros((1, 0), np.int64), max_new_tokens=2)
