"""The bundled tiny Llama model and sample datasets (written by scripts/make_tiny_model.py)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.helpers import ASSETS, ROOT, TINY_MODEL as TINY
from unsloth_jax.data import alpaca_prompt, detect_format, format_alpaca, load_records, validate_records


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
    # The invented facts are taught by alpaca_sample only: no word of them is in the pretraining data.
    assert len(facts) >= 3
    pretraining_text = (ASSETS / "chat_sample.jsonl").read_text() + (ASSETS / "text_sample.jsonl").read_text()
    for word in ("Jaxon", "Zorblat", "glimmer", "Velloria", "Pixel", "Quillmere"):
        assert word not in pretraining_text
    total = sum(f.stat().st_size for f in ASSETS.rglob("*") if f.is_file())
    assert total < 6_000_000


def _strings(value) -> list[str]:
    """Every string inside a JSON value (record fields, conversation turns)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    return [s for v in value for s in _strings(v)] if isinstance(value, list) else []


def test_held_out_facts_are_not_in_the_training_data():
    """held_out_facts.jsonl asks each invented fact a way no training file uses: its instruction occurs (case
    aside) in no string of alpaca_sample, chat_sample or text_sample, nor its alpaca prompt in any rendered
    alpaca record; its answer is the trained one (alpaca_sample teaches it in several other phrasings)."""
    facts = load_records(ASSETS / "held_out_facts.jsonl")
    training_files = sorted(p for p in ASSETS.glob("*.jsonl") if p.name != "held_out_facts.jsonl")
    assert {p.name for p in training_files} >= {"alpaca_sample.jsonl", "chat_sample.jsonl", "text_sample.jsonl"}
    training_strings = [s.lower() for p in training_files for r in load_records(p) for s in _strings(r)]
    alpaca = load_records(ASSETS / "alpaca_sample.jsonl")
    rendered = [format_alpaca(r) for r in alpaca]
    assert len(facts) == 5
    for fact in facts:
        question = fact["instruction"].lower()
        assert not any(question in s for s in training_strings), f"{fact['instruction']!r} is in the training data"
        assert not any(alpaca_prompt(fact["instruction"], fact["input"]) in t for t in rendered)
        assert sum(r["output"] == fact["output"] for r in alpaca) >= 2, fact


def test_data_only_regenerates_the_sample_files(tmp_path):
    """`scripts/make_tiny_model.py --data_only` (run from a copy of the script, so it writes under tmp_path)
    rewrites every bundled .jsonl file byte for byte and writes no model files."""
    script = tmp_path / "scripts" / "make_tiny_model.py"
    script.parent.mkdir()
    shutil.copy(ROOT / "scripts" / "make_tiny_model.py", script)
    run = subprocess.run([sys.executable, str(script), "--data_only"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    written = tmp_path / "unsloth_jax" / "assets"
    assert sorted(p.name for p in written.iterdir()) == sorted(p.name for p in ASSETS.glob("*.jsonl"))
    for path in written.iterdir():
        assert path.read_bytes() == (ASSETS / path.name).read_bytes(), f"{path.name} differs from the generator's"


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
