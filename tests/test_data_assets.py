"""The bundled tiny Llama model and sample datasets (written by scripts/make_tiny_model.py)."""
from __future__ import annotations

import json

import pytest

from tests.helpers import ASSETS, TINY_MODEL as TINY
from unsloth_jax.data import detect_format, load_records, validate_records


def test_sample_files_are_valid():
    alpaca = load_records(ASSETS / "alpaca_sample.jsonl")
    chat = load_records(ASSETS / "chat_sample.jsonl")
    text = load_records(ASSETS / "text_sample.jsonl")
    facts = load_records(ASSETS / "held_out_facts.jsonl")
    assert 100 <= len(alpaca) <= 300 and len(chat) >= 30 and len(text) >= 100
    assert validate_records(alpaca, "alpaca") == alpaca
    assert validate_records(chat, "sharegpt") == chat
    assert validate_records(text, "text") == text
    assert {detect_format(r) for r in alpaca} == {"alpaca"}
    assert {detect_format(r) for r in chat} == {"sharegpt"}
    assert any(r["input"] for r in alpaca) and any(not r["input"] for r in alpaca)
    # The held-out facts are in alpaca_sample (eval question verbatim) but nowhere in the pretraining data.
    assert len(facts) >= 3
    pretraining_text = (ASSETS / "chat_sample.jsonl").read_text() + (ASSETS / "text_sample.jsonl").read_text()
    for fact in facts:
        assert fact in alpaca
        for word in ("Jaxon", "Zorblat", "glimmer", "Velloria", "Pixel", "Quillmere"):
            assert word not in pretraining_text
        assert sum(r["output"] == fact["output"] for r in alpaca) >= 2  # asked in several phrasings
    total = sum(f.stat().st_size for f in ASSETS.rglob("*") if f.is_file())
    assert total < 6_000_000


def test_tiny_model_files():
    cfg = json.loads((TINY / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["intermediate_size"]) == (128, 4, 4, 2, 384)
    assert (TINY / "model.safetensors").stat().st_size < 4_000_000
    tcfg = json.loads((TINY / "tokenizer_config.json").read_text())
    assert tcfg["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_tiny_model_loads_with_transformers():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from unsloth_jax.data import alpaca_prompt, chat_template_string, format_alpaca

    tok = AutoTokenizer.from_pretrained(TINY)
    assert tok.is_fast and len(tok) == 2048
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == ("<s>", "</s>", "<pad>", "<unk>")
    assert tok.chat_template == chat_template_string("chatml")
    text = "Ada Jaxon's cat naps at 3 o'clock. Ünïcödé ✓ <|im_start|>user\nhi<|im_end|>\n"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.decode(ids[1:]) == text

    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    assert model.config.vocab_size == len(tok) and not model.config.tie_word_embeddings
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    # A real (pretrained) LM: low loss on a generic training record, much higher on shuffled tokens.
    rec = json.loads((ASSETS / "alpaca_sample.jsonl").read_text().splitlines()[0])
    x = torch.tensor([tok(format_alpaca(rec, tok.eos_token))["input_ids"]])
    with torch.no_grad():
        loss = model(input_ids=x, labels=x).loss.item()
        shuffled = x[:, torch.randperm(x.shape[1])]
        noise = model(input_ids=shuffled, labels=shuffled).loss.item()
    assert loss < 1.0 < noise, (loss, noise)
    # It continues the alpaca format: the answer ends with EOS within a few tokens.
    enc = tok(alpaca_prompt(rec["instruction"], rec["input"]), return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=32, do_sample=False)
    assert tok.eos_token_id in out[0, enc["input_ids"].shape[1]:].tolist()
