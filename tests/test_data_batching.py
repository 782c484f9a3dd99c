"""DataLoader (buckets, packing, determinism, shuffling), first-fit packing, suggest_max_seq_length, the
response-only label mask (token-id matching and text matching, normalizing tokenizers) and the completion-only
mask of prompt-completion records."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from unsloth_jax.data import (
    DataLoader,
    bucket_lengths,
    first_fit_decreasing,
    pick_bucket,
    response_only_labels,
    suggest_max_seq_length,
    train_on_responses_only,
)
from tests.helpers import TINY_MODEL as TINY
from unsloth_jax.errors import DatasetFormatError

PAD = 3


def make_examples(rng, n, lo=1, hi=300, with_masked=True):
    out = []
    for _ in range(n):
        L = int(rng.integers(lo, hi + 1))
        ids = rng.integers(4, 2048, size=L).tolist()
        labels = list(ids)
        if with_masked and L > 2:  # a prompt part already masked, as after train_on_responses_only
            k = int(rng.integers(0, L // 2))
            labels[:k] = [-100] * k
        out.append({"input_ids": ids, "labels": labels})
    return out


def row_segments(batch, b):
    """The (ids, labels, positions) of each segment of row b."""
    seg = batch["segment_ids"][b]
    out = []
    for s in range(1, int(seg.max(initial=0)) + 1):
        where = np.flatnonzero(seg == s)
        assert np.all(np.diff(where) == 1), "segments are contiguous"
        out.append((batch["input_ids"][b, where], batch["labels"][b, where], batch["positions"][b, where], where))
    return out


def test_bucket_lengths():
    assert bucket_lengths(1000) == (64, 128, 256, 512, 1000)
    assert bucket_lengths(2048) == (64, 128, 256, 512, 1024, 2048)
    assert bucket_lengths(48) == (48,)
    assert bucket_lengths(64) == (64,)
    assert bucket_lengths(300, min_bucket=128) == (128, 256, 300)
    assert [pick_bucket(n, (64, 128, 300)) for n in (1, 64, 65, 129, 300, 999)] == [64, 64, 128, 300, 300, 300]


def test_first_fit_decreasing_matches_naive(rng):
    cap = int(rng.integers(50, 400))
    lengths = rng.integers(1, cap + 1, size=int(rng.integers(50, 400)))
    rows = first_fit_decreasing(lengths, cap)
    # Naive first-fit over the same (longest-first, stable) order.
    free, naive = [], []
    for i in np.argsort(-lengths, kind="stable"):
        for r, f in enumerate(free):
            if f >= lengths[i]:
                free[r] -= lengths[i]
                naive[r].append(int(i))
                break
        else:
            free.append(cap - lengths[i])
            naive.append([int(i)])
    assert rows == naive
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[r]) <= cap for r in rows)


@pytest.mark.parametrize("max_len", [200, 333])
def test_unpacked_batches(rng, max_len):
    examples = make_examples(rng, int(rng.integers(30, 60)), hi=max_len + 40)  # some get truncated
    B = int(rng.integers(3, 8))
    loader = DataLoader(examples, B, max_len, PAD, shuffle=True, seed=int(rng.integers(1 << 30)))
    assert len(loader) == -(-len(examples) // B)
    assert loader.bucket_lengths == bucket_lengths(max_len)
    seen = []
    for i in range(len(loader)):
        batch = loader.batch(0, i)
        rows = loader.batch_rows(0, i)
        S = batch["input_ids"].shape[1]
        assert set(batch) == {"input_ids", "labels", "attention_mask", "segment_ids", "positions"}
        assert all(v.dtype == np.int32 and v.shape == (B, S) for v in batch.values())
        longest = max(min(len(examples[r[0]]["input_ids"]), max_len) for r in rows if r)
        assert S == pick_bucket(longest, loader.bucket_lengths) and S in loader.bucket_lengths
        for b, row in enumerate(rows):
            if not row:  # padding row of the last batch
                assert np.all(batch["labels"][b] == -100) and np.all(batch["attention_mask"][b] == 0)
                assert np.all(batch["input_ids"][b] == PAD)
                continue
            ex = examples[row[0]]
            n = min(len(ex["input_ids"]), max_len)
            np.testing.assert_array_equal(batch["input_ids"][b, :n], ex["input_ids"][:n])
            np.testing.assert_array_equal(batch["labels"][b, :n], ex["labels"][:n])  # first label kept
            np.testing.assert_array_equal(batch["positions"][b, :n], np.arange(n))
            assert np.all(batch["attention_mask"][b, :n] == 1) and np.all(batch["segment_ids"][b, :n] == 1)
            assert np.all(batch["input_ids"][b, n:] == PAD) and np.all(batch["labels"][b, n:] == -100)
            assert np.all(batch["attention_mask"][b, n:] == 0) and np.all(batch["segment_ids"][b, n:] == 0)
            assert np.all(batch["positions"][b, n:] == 0)
            seen.append(row[0])
    assert sorted(seen) == list(range(len(examples)))  # every example exactly once per epoch


def test_packed_batches(rng):
    max_len = int(rng.integers(150, 400))
    examples = make_examples(rng, int(rng.integers(40, 90)), hi=max_len)
    B = int(rng.integers(2, 6))
    loader = DataLoader(examples, B, max_len, PAD, packing=True, seed=int(rng.integers(1 << 30)))
    assert loader.bucket_lengths == (max_len,)
    assert len(loader) == -(-loader.num_rows // B)
    assert loader.num_rows < len(examples) and 0 < loader.fill_ratio <= 1
    seen = []
    for i in range(len(loader)):
        batch = loader.batch(1, i)
        assert all(v.shape == (B, max_len) for v in batch.values())
        for b, row in enumerate(loader.batch_rows(1, i)):
            segs = row_segments(batch, b)
            assert len(segs) == len(row)
            used = 0
            for (ids, labels, pos, where), ex_idx in zip(segs, row):
                ex = examples[ex_idx]
                assert where[0] == used  # examples are laid out back to back from the row start
                np.testing.assert_array_equal(ids, ex["input_ids"])
                assert labels[0] == -100  # no prediction across the example boundary
                np.testing.assert_array_equal(labels[1:], ex["labels"][1:])
                np.testing.assert_array_equal(pos, np.arange(len(ids)))
                used += len(ids)
                seen.append(ex_idx)
            assert np.all(batch["attention_mask"][b, :used] == 1) and np.all(batch["attention_mask"][b, used:] == 0)
            assert np.all(batch["labels"][b, used:] == -100) and np.all(batch["input_ids"][b, used:] == PAD)
            assert np.all(batch["segment_ids"][b, used:] == 0) and np.all(batch["positions"][b, used:] == 0)
    assert sorted(seen) == list(range(len(examples)))


def test_determinism_and_shuffle(rng):
    examples = make_examples(rng, 64, hi=120)
    seed = int(rng.integers(1 << 30))
    for packing in (False, True):
        a = DataLoader(examples, 4, 128, PAD, packing=packing, seed=seed)
        b = DataLoader(examples, 4, 128, PAD, packing=packing, seed=seed)
        idx = [int(i) for i in rng.permutation(len(a))]
        for i in idx:  # any call order gives the same batches (pure function of (epoch, index))
            x, y = a.batch(3, i), b.batch(3, i)
            assert all(np.array_equal(x[k], y[k]) for k in x)
        assert all(np.array_equal(a.batch(3, idx[0])[k], a.batch(3, idx[0])[k]) for k in x)
        order0, order1 = a.order(0), a.order(1)
        assert not np.array_equal(order0, order1)  # a new shuffle every epoch
        assert not np.array_equal(order0, DataLoader(examples, 4, 128, PAD, packing=packing, seed=seed + 1).order(0))
        np.testing.assert_array_equal(
            DataLoader(examples, 4, 128, PAD, packing=packing, shuffle=False).order(5), np.arange(a.num_rows))
        # Resuming mid-epoch yields the remaining batches.
        resumed = list(a.epoch_batches(2, start=3))
        assert len(resumed) == len(a) - 3
        assert all(np.array_equal(resumed[0][k], a.batch(2, 3)[k]) for k in resumed[0])
        a.set_epoch(2)
        first = next(iter(a))
        assert all(np.array_equal(first[k], a.batch(2, 0)[k]) for k in first)


def test_drop_last_and_errors(rng):
    examples = make_examples(rng, 10, hi=50)
    assert len(DataLoader(examples, 4, 64, PAD, drop_last=True)) == 2
    loader = DataLoader(examples, 4, 64, PAD, drop_last=False, shuffle=False)
    assert len(loader) == 3
    last = loader.batch(0, 2)
    assert np.all(last["attention_mask"][2:] == 0) and np.all(last["labels"][2:] == -100)
    with pytest.raises(IndexError):
        loader.batch(0, 3)
    with pytest.raises(ValueError, match="pad_token_id"):
        DataLoader(examples, 4, 64, None)
    with pytest.raises(ValueError, match="labels length"):
        DataLoader([{"input_ids": [1, 2, 3], "labels": [1, 2]}], 1, 8, PAD)
    # Labels default to input_ids; empty examples are dropped.
    one = DataLoader([{"input_ids": [5, 6, 7]}, {"input_ids": []}], 1, 8, PAD)
    assert one.num_examples == 1 and one.batch(0, 0)["labels"][0, :3].tolist() == [5, 6, 7]


def test_suggest_max_seq_length(rng):
    examples = make_examples(rng, 200, hi=900)
    lengths = np.array([len(e["input_ids"]) for e in examples])
    q = np.quantile(lengths, 0.9, method="higher")
    expected = int(np.ceil(q / 64) * 64)
    assert suggest_max_seq_length(examples, quantile=0.9) == expected
    assert suggest_max_seq_length([e["input_ids"] for e in examples], quantile=0.9) == expected
    assert suggest_max_seq_length(examples, quantile=1.0, multiple_of=100) == int(np.ceil(lengths.max() / 100) * 100)
    assert suggest_max_seq_length(examples, cap=256) == 256
    assert suggest_max_seq_length([{"input_ids": [1, 2]}]) == 64
    with pytest.raises(ValueError, match="tokenizer"):
        suggest_max_seq_length(["a text"])


def test_suggest_max_seq_length_texts():
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY)
    texts = ["word " * 10, "word " * 100, "word " * 70]
    n = len(tok("word " * 100)["input_ids"])
    assert suggest_max_seq_length(texts, tok, quantile=1.0, multiple_of=8) == -(-n // 8) * 8


# ----------------------------------------------------------------------------------------- response only
def _random_content(rng, forbidden, n):
    pool = np.setdiff1d(np.arange(10, 500), np.asarray(list(forbidden)))
    return rng.choice(pool, size=n).tolist()


def test_response_only_labels_ids(rng):
    instr, resp = [7, 8], [7, 9, 9]
    ids, expected = [1], [-100]
    for _ in range(int(rng.integers(1, 4))):  # system-ish prefix, then user/assistant turns
        u = _random_content(rng, {7}, int(rng.integers(1, 10)))
        a = _random_content(rng, {7}, int(rng.integers(1, 10)))
        ids += instr + u + resp + a
        expected += [-100] * (len(instr) + len(u) + len(resp)) + a
    assert response_only_labels(ids, instr, resp) == expected
    arr = np.asarray(ids, dtype=np.int32)
    out = response_only_labels(arr, instr, resp)
    assert isinstance(out, np.ndarray) and out.dtype == np.int32 and out.tolist() == expected
    # Existing -100 labels stay; alternatives are accepted; no instruction marker = train to the end.
    labels = list(ids)
    labels[-1] = -100
    assert response_only_labels(ids, instr, resp, labels=labels)[-1] == -100
    assert response_only_labels(ids, [[5, 5, 5], instr], [resp]) == expected
    single = [1, 2] + instr + [11, 12] + resp + [13, 7, 8, 14]  # no instruction marker: train to the end
    assert response_only_labels(single, None, resp) == [-100] * 9 + [13, 7, 8, 14]
    assert response_only_labels(ids, instr, [600, 601]) == [-100] * len(ids)  # marker absent


def _trainer(tok, examples, eval_examples=None):
    return SimpleNamespace(tokenizer=tok, train_examples=examples, eval_examples=eval_examples)


def test_train_on_responses_only_chatml():
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from unsloth_jax.data import prepare_texts, tokenize_texts

    tok = AutoTokenizer.from_pretrained(TINY)
    conv = {"messages": [{"role": "user", "content": "Is 7 even or odd?"},
                         {"role": "assistant", "content": "7 is odd."},
                         {"role": "user", "content": "And 8?"}, {"role": "assistant", "content": "8 is even."}]}
    train = tokenize_texts(prepare_texts([conv], tok), tok, 512)
    evals = tokenize_texts(prepare_texts([conv], tok), tok, 512)
    trainer = _trainer(tok, train, evals)
    assert train_on_responses_only(trainer) is trainer
    golden_ids = [1, 4, 95, 282, 92, 209, 725, 573, 429, 394, 635, 41, 5, 209, 4, 287, 665, 209, 33, 276, 635, 24, 5,
                  209, 4, 95, 282, 92, 209, 1631, 78, 580, 41, 5, 209, 4, 287, 665, 209, 34, 276, 429, 24, 5, 209]
    golden_labels = [-100] * 18 + [33, 276, 635, 24, 5, 209] + [-100] * 15 + [34, 276, 429, 24, 5, 209]
    for ex in (train[0], evals[0]):
        assert ex["input_ids"] == golden_ids and ex["labels"] == golden_labels


def test_train_on_responses_only_context_dependent_marker(caplog):
    """'Answer: ' tokenizes differently alone than before 'Paris': id matching misses it, text matching not."""
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from unsloth_jax.data import tokenize_texts

    tok = AutoTokenizer.from_pretrained(TINY)
    ex = tokenize_texts(["Question: What is the capital of France? Answer: Paris."], tok, 64)
    ids = ex[0]["input_ids"]
    marker_ids = tok("Answer: ", add_special_tokens=False)["input_ids"]
    assert response_only_labels(ids, tok("Question: ", add_special_tokens=False)["input_ids"], marker_ids) == \
        [-100] * len(ids)
    train_on_responses_only(_trainer(tok, ex), "Question: ", "Answer: ")
    assert ex[0]["labels"] == [-100] * (len(ids) - 2) + [1532, 24]  # " Paris", "."
    assert tok.decode(ex[0]["labels"][-2:]) == " Paris."

    # Truncated examples lose their response: warned; when no example has one, it is an error.
    mixed = tokenize_texts(["Question: a? Answer: b.", "Question: only a question"], tok, 64)
    train_on_responses_only(_trainer(tok, mixed), "Question: ", "Answer: ")
    assert "1 of 2 train_examples have no response tokens" in caplog.text
    with pytest.raises(DatasetFormatError, match="response marker"):
        train_on_responses_only(_trainer(tok, tokenize_texts(["no markers"], tok, 8)), "Q: ", "A: ")


# ----------------------------------------------------------------------------- normalizing tokenizers
_NORM_CORPUS = [
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.",
    "### Instruction:\nName the Capital of Peru.\n\n### Response:\nLima is the Capital.",
    "### Instruction:\nWhat Colour is the Sky?\n\n### Response:\nThe Sky is Blue.",
]


def _lowercasing_tokenizer(kind: str):
    """A real fast tokenizer whose normalizer lowercases, trained here with the `tokenizers` library:
    byte-level BPE (decode lowercases the text) or WordPiece (decode also drops newlines and adds spaces)."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.normalizer = normalizers.Lowercase()
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["</s>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase(),
                                               normalizers.StripAccents()])
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=400, special_tokens=["[UNK]", "</s>"])
    tok.train_from_iterator(_NORM_CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


@pytest.mark.parametrize("kind", ["bpe", "wordpiece"])
def test_train_on_responses_only_lowercasing_tokenizer(kind):
    """The decoded text of a lowercasing tokenizer lacks "### Response:", so the text search finds no marker;
    the markers' token ids still occur, and the trained tokens are exactly the response's own tokens."""
    from unsloth_jax.data import RESPONSE_PARTS, prepare_texts, tokenize_texts

    tok = _lowercasing_tokenizer(kind)
    records = [{"instruction": "Name the Capital of Peru.", "output": "Lima is the Capital."},
               {"instruction": "What Colour is the Sky?", "output": "The Sky is Blue."}]
    examples = tokenize_texts(prepare_texts(records, tok), tok, 256)
    assert "### Response:" not in tok.decode(examples[0]["input_ids"])
    train_on_responses_only(_trainer(tok, examples), *RESPONSE_PARTS["alpaca"])
    for rec, ex in zip(records, examples):
        response = tok(rec["output"] + tok.eos_token, add_special_tokens=False)["input_ids"]
        ids = ex["input_ids"]
        assert ids[len(ids) - len(response):] == response  # the response tokenizes the same in context
        assert ex["labels"] == [-100] * (len(ids) - len(response)) + response


# ------------------------------------------------------------------------------------- prompt-completion
def _tiny_tokenizer():
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY)


def _char_truth(tok, prompt: str, full: str) -> list[int]:
    """Labels by character offsets: a token is trained when it holds any character after the prompt."""
    enc = tok(full, return_offsets_mapping=True)
    return [t if end > len(prompt) else -100 for t, (_, end) in zip(enc["input_ids"], enc["offset_mapping"])]


def test_prompt_completion_standard_loss_on_completion(caplog):
    """Standard records: text = prompt + completion + EOS; the loss covers the completion and EOS, as TRL's
    rule (prompt tokenized alone, its length masked) where the prompt's tokens are a prefix, and from the
    merged token on where a token spans the boundary ("bl" + "ue")."""
    from unsloth_jax.data import build_examples, prepare_texts

    tok = _tiny_tokenizer()
    records = [{"prompt": "The capital of Peru is", "completion": " Lima."},
               {"prompt": "Q: What is 2+2?\nA:", "completion": " 4" + tok.eos_token},  # EOS not doubled
               {"prompt": "The sky is bl", "completion": "ue."}]
    texts = prepare_texts(records, tok)
    assert texts == ["The capital of Peru is Lima.</s>", "Q: What is 2+2?\nA: 4</s>", "The sky is blue.</s>"]
    examples = build_examples(records, tok, 128)
    for rec, text, ex in zip(records, texts, examples):
        full = tok(text)["input_ids"]
        assert ex["input_ids"] == full
        assert ex["labels"] == _char_truth(tok, rec["prompt"], text)
    for rec, text, ex in zip(records[:2], texts, examples):  # TRL's rule, where the prompt is a prefix
        prompt_ids = tok(rec["prompt"])["input_ids"]
        full = tok(text)["input_ids"]
        assert full[:len(prompt_ids)] == prompt_ids
        assert ex["labels"] == [-100] * len(prompt_ids) + full[len(prompt_ids):]
    assert "1 of 3 prompt-completion examples tokenize the prompt differently" in caplog.text
    assert [ex["labels"] for ex in build_examples(records, tok, 128, completion_only_loss=False)] == \
        [ex["input_ids"] for ex in examples]
    truncated = build_examples(records[:1], tok, 3)[0]
    assert truncated["labels"] == [-100] * 3


def test_prompt_completion_conversational_loss_on_completion():
    """Conversational records render with the chat template; the trained tokens are TRL's: the whole
    conversation's ids after those of the prompt rendered with its generation prompt."""
    from unsloth_jax.data import build_examples, prompt_completion_texts

    tok = _tiny_tokenizer()
    records = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sky colour?"}],
                "completion": [{"role": "assistant", "content": "Blue."}]},
               {"prompt": [{"from": "human", "value": "2+2?"}], "completion": [{"from": "gpt", "value": "4"}]}]
    examples = build_examples(records, tok, 256)
    for rec, ex in zip(records, examples):
        msgs = [{"role": {"human": "user", "gpt": "assistant"}.get(t.get("from"), t.get("role")),
                 "content": t.get("content", t.get("value"))} for t in rec["prompt"] + rec["completion"]]
        n_prompt = len(msgs) - len(rec["completion"])
        prompt_ids = tok.apply_chat_template(msgs[:n_prompt], add_generation_prompt=True, tokenize=True)["input_ids"]
        full = tok.apply_chat_template(msgs, tokenize=True)["input_ids"]
        assert full[:len(prompt_ids)] == prompt_ids
        assert ex["input_ids"] == [tok.bos_token_id] + full  # tokenize_texts adds the BOS the template omits
        assert [t for t in ex["labels"] if t != -100] == full[len(prompt_ids):]
        assert ex["labels"][-len(full) + len(prompt_ids):] == full[len(prompt_ids):]
        prompt_text, full_text = prompt_completion_texts(rec, tok)
        assert full_text == tok.apply_chat_template(msgs, tokenize=False) and full_text.startswith(prompt_text)
