"""Formats, chat templates and tokenization against golden strings / token ids of the bundled tokenizer.

The golden arrays were computed once from unsloth_jax/assets/tiny-llama and written here literally: they fail
when the tokenizer, the alpaca prompt or a chat template changes.
"""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from unsloth_jax.data import (  # noqa: E402
    ALPACA_PROMPT,
    CHAT_TEMPLATE_NAMES,
    alpaca_prompt,
    chat_template_string,
    format_alpaca,
    get_chat_template,
    prepare_texts,
    standardize_sharegpt,
    tokenize_texts,
)
from tests.helpers import TINY_MODEL as TINY  # noqa: E402
from unsloth_jax.errors import DatasetFormatError  # noqa: E402


def load_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY)


@pytest.fixture(scope="module")
def tok():
    return load_tok()


ALPACA_INPUT = {"instruction": "Sort the numbers.", "input": "3, 1, 2", "output": "1, 2, 3"}
ALPACA_NO_INPUT = {"instruction": "What is the capital of Peru?", "output": "The capital of Peru is Lima."}
SHAREGPT = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hello!"},
                              {"from": "gpt", "value": "Hi! How can I help?"}]}
CHATML = {"messages": [{"role": "user", "content": "Is 7 even or odd?"}, {"role": "assistant", "content": "7 is odd."}]}
TEXT = {"text": "Tom has 3 apples. Café!"}

GOLDEN = {
    "alpaca_input": (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n### Instruction:\nSort the numbers.\n\n"
        "### Input:\n3, 1, 2\n\n### Response:\n1, 2, 3</s>",
        [1, 359, 276, 289, 348, 292, 361, 269, 347, 22, 508, 418, 289, 501, 292, 505, 506, 507, 24, 356, 269, 354,
         292, 364, 362, 275, 363, 24, 209, 209, 293, 351, 36, 209, 627, 275, 650, 24, 209, 209, 293, 503, 36, 209,
         29, 22, 383, 22, 480, 209, 209, 293, 355, 36, 209, 27, 22, 480, 22, 430, 2]),
    "alpaca_no_input": (
        "Below is an instruction that describes a task. Write a response that appropriately completes the "
        "request.\n\n### Instruction:\nWhat is the capital of Peru?\n\n### Response:\nThe capital of Peru is "
        "Lima.</s>",
        [1, 359, 276, 289, 348, 292, 361, 269, 347, 24, 356, 269, 354, 292, 364, 362, 275, 363, 24, 209, 209, 293,
         351, 36, 209, 325, 276, 275, 379, 294, 1287, 41, 209, 209, 293, 355, 36, 209, 311, 379, 294, 1287, 276,
         1495, 24, 2]),
    "sharegpt": (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
        "Hi! How can I help?<|im_end|>\n",
        [1, 4, 93, 813, 280, 87, 209, 44, 79, 366, 278, 978, 24, 5, 209, 4, 95, 282, 92, 209, 724, 11, 5, 209, 4,
         287, 665, 209, 794, 11, 598, 736, 312, 544, 41, 5, 209]),
    "chatml": (
        "<|im_start|>user\nIs 7 even or odd?<|im_end|>\n<|im_start|>assistant\n7 is odd.<|im_end|>\n",
        [1, 4, 95, 282, 92, 209, 725, 573, 429, 394, 635, 41, 5, 209, 4, 287, 665, 209, 33, 276, 635, 24, 5, 209]),
    "text": ("Tom has 3 apples. Café!", [1, 1356, 365, 430, 834, 24, 514, 1044, 138, 113, 11]),
}


@pytest.mark.parametrize("name,record", [("alpaca_input", ALPACA_INPUT), ("alpaca_no_input", ALPACA_NO_INPUT),
                                         ("sharegpt", SHAREGPT), ("chatml", CHATML), ("text", TEXT)])
def test_golden_tokens_per_format(tok, name, record):
    text, ids = GOLDEN[name]
    assert prepare_texts([record], tok) == [text]
    ex = tokenize_texts([text], tok, max_seq_length=512)[0]
    assert ex["input_ids"] == ids
    assert ex["labels"] == ids
    assert tok.decode(ids[1:]) == text  # byte-level BPE round-trips exactly


def test_alpaca_prompts(rng):
    instr, inp, out = (f"w{rng.integers(1_000_000)}" for _ in range(3))
    assert alpaca_prompt(instr, inp, out) == ALPACA_PROMPT.format(instr, inp, out)
    assert alpaca_prompt(instr).endswith(f"### Instruction:\n{instr}\n\n### Response:\n")
    assert "### Input" not in alpaca_prompt(instr, "   ")
    assert format_alpaca({"instruction": instr, "output": out}, "</s>").endswith(f"### Response:\n{out}</s>")
    with pytest.raises(DatasetFormatError, match="missing field 'output'"):
        format_alpaca({"instruction": instr})


def test_prepare_texts_precedence(tok, rng):
    n = int(rng.integers(1000))
    rec = {"text": f"plain {n}", "instruction": "ignored", "output": "ignored", "body": f"body {n}"}
    assert prepare_texts([rec], tok) == [f"plain {n}"]
    assert prepare_texts([rec], tok, dataset_text_field="body") == [f"body {n}"]
    assert prepare_texts([rec], tok, formatting_func=lambda r: [r["body"], r["text"]]) == [f"body {n}", f"plain {n}"]
    with pytest.raises(DatasetFormatError, match=r"record 1: cannot detect"):
        prepare_texts([rec, {"foo": 1}], tok)
    with pytest.raises(DatasetFormatError, match="formatting_func must return"):
        prepare_texts([rec], tok, formatting_func=lambda r: 3)
    bare = load_tok()
    bare.chat_template = None
    with pytest.raises(DatasetFormatError, match="no chat template"):
        prepare_texts([CHATML], bare)


def test_standardize_sharegpt():
    recs = [{"id": 7, "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"},
                                        {"from": "gpt", "value": "a"}]}]
    out = standardize_sharegpt(recs)
    assert out == [{"id": 7, "conversations": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                                               {"role": "assistant", "content": "a"}]}]
    assert recs[0]["conversations"][1] == {"from": "human", "value": "q"}  # input untouched
    with pytest.raises(DatasetFormatError, match="unknown or missing role 'robot'"):
        standardize_sharegpt([{"conversations": [{"from": "robot", "value": "x"}]}])


CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": " Hi! How can I help? "}, {"role": "user", "content": "Is 7 odd?"}]
EXPECTED = {
    "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
              " Hi! How can I help? <|im_end|>\n<|im_start|>user\nIs 7 odd?<|im_end|>\n<|im_start|>assistant\n",
    "qwen-2.5": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n"
                "<|im_start|>assistant\n Hi! How can I help? <|im_end|>\n<|im_start|>user\nIs 7 odd?<|im_end|>\n"
                "<|im_start|>assistant\n",
    "llama-3.1": "<s><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
                 "Today Date: 26 Jul 2024\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
                 "Hello!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHi! How can I help?<|eot_id|>"
                 "<|start_header_id|>user<|end_header_id|>\n\nIs 7 odd?<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "gemma": "<s><start_of_turn>user\nBe brief.\n\nHello!<end_of_turn>\n<start_of_turn>model\nHi! How can I help?"
             "<end_of_turn>\n<start_of_turn>user\nIs 7 odd?<end_of_turn>\n<start_of_turn>model\n",
}
EXPECTED_NO_SYSTEM = {
    "chatml": "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n Hi! How can I help? <|im_end|>\n",
    "qwen-2.5": "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
                "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n Hi! How can I help? <|im_end|>\n",
    "llama-3.1": "<s><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
                 "Today Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\nHi! How can I help?<|eot_id|>",
    "gemma": "<s><start_of_turn>user\nHello!<end_of_turn>\n<start_of_turn>model\nHi! How can I help?<end_of_turn>\n",
}
STOP = {"chatml": "<|im_end|>", "qwen-2.5": "<|im_end|>", "llama-3.1": "<|eot_id|>", "gemma": "<end_of_turn>"}


@pytest.mark.parametrize("name", CHAT_TEMPLATE_NAMES)
def test_get_chat_template_strings(name):
    t = load_tok()
    n = len(t)
    assert get_chat_template(t, name) is t
    assert len(t) == n  # the bundled tokenizer already holds every template's special tokens
    assert t.eos_token == STOP[name]
    assert t.apply_chat_template(CONV, tokenize=False, add_generation_prompt=True) == EXPECTED[name]
    assert t.apply_chat_template(CONV[1:3], tokenize=False) == EXPECTED_NO_SYSTEM[name]
    # Raw sharegpt turns render the same without standardize_sharegpt.
    sharegpt = [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
                for m in CONV]
    assert t.apply_chat_template(sharegpt, tokenize=False, add_generation_prompt=True) == EXPECTED[name]
    # Every special token of the template is one token; a BOS written by the template is not doubled.
    ids = tokenize_texts([EXPECTED[name]], t, 512)[0]["input_ids"]
    assert ids.count(t.bos_token_id) == 1 and ids[0] == t.bos_token_id
    assert t.convert_tokens_to_ids(STOP[name]) in ids


def test_chat_template_mapping_and_map_eos(rng):
    t = load_tok()
    mapping = {"role": "speaker", "content": "text", "user": "me", "assistant": "bot"}
    get_chat_template(t, "chatml", mapping=mapping, map_eos_token=False)
    assert t.eos_token == "</s>"
    word = f"w{rng.integers(10_000)}"
    conv = [{"speaker": "me", "text": word}, {"speaker": "bot", "text": "ok"}]
    assert t.apply_chat_template(conv, tokenize=False) == (
        f"<|im_start|>user\n{word}<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n")
    assert chat_template_string("Llama3.1") == chat_template_string("llama-3.1")
    with pytest.raises(ValueError, match="unknown chat template"):
        get_chat_template(t, "vicuna")
    with pytest.raises(ValueError, match="mapping keys"):
        chat_template_string("chatml", {"speaker": "x"})


def test_get_chat_template_adds_missing_tokens(caplog):
    """A tokenizer without the template's special tokens gets them added (and a warning to resize)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(["hello world"] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    t = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>")
    n = len(t)
    get_chat_template(t, "llama-3.1")
    assert len(t) == n + 3 and "resize" in caplog.text
    for s in ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"):
        assert len(t(s, add_special_tokens=False)["input_ids"]) == 1
    assert t.eos_token == "<|eot_id|>"


def test_tokenize_texts_truncation_and_eos(tok, rng):
    words = ["apple", "river", "seven", "garden", "blue", "Tom"]
    texts = [" ".join(rng.choice(words, size=int(rng.integers(1, 40)))) for _ in range(12)]
    full = tokenize_texts(texts, tok, 10_000)
    m = int(rng.integers(5, 20))
    cut = tokenize_texts(texts, tok, m)
    for f, c in zip(full, cut):
        assert f["input_ids"][0] == tok.bos_token_id
        assert c["input_ids"] == f["input_ids"][:m] and c["labels"] == c["input_ids"]
    with_eos = tokenize_texts(texts, tok, 10_000, add_eos=True)
    for f, e in zip(full, with_eos):
        assert e["input_ids"] == f["input_ids"] + [tok.eos_token_id]
    # No second EOS when the text already ends with it (alpaca rendering appends it).
    alp = prepare_texts([ALPACA_NO_INPUT], tok)
    assert tokenize_texts(alp, tok, 512, add_eos=True)[0]["input_ids"] == GOLDEN["alpaca_no_input"][1]
    with pytest.raises(ValueError):
        tokenize_texts(texts, tok, 0)
