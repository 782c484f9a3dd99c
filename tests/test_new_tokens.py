"""add_new_tokens against transformers' mean resizing and Unsloth's rule; adapters with new tokens and
modules_to_save load in PEFT (on the transformers model resized the same way) and here, with the same logits."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tests.helpers import TINY_MODEL, rel_err  # noqa: E402
from tests.hf_models import save_hf_model  # noqa: E402
from unsloth_jax import FastLanguageModel, SFTTrainer, TrainingArguments, add_new_tokens  # noqa: E402
from unsloth_jax.errors import ConfigError  # noqa: E402
from unsloth_jax.hf import peft_io  # noqa: E402
from unsloth_jax.hf.safetensors_io import SafetensorsFile  # noqa: E402
from unsloth_jax.vocab import resize_token_embeddings  # noqa: E402

NEW = ["<|reasoning|>", "<|/reasoning|>", "</s>"]  # the last one exists already and is skipped


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A copy of the bundled tiny Llama (tokenizer included), so base_model_name_or_path points at a stable dir."""
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    shutil.copytree(TINY_MODEL, path)
    return path


def _load(path):
    return FastLanguageModel.from_pretrained(path, dtype="float32", progress=False)


def _hf(path, vocab=None):
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    if vocab is not None:
        hf.resize_token_embeddings(vocab)
    return hf.eval()


def test_new_rows_match_transformers_mean_resizing(tmp_path, rng):
    """On a model without untrained rows, our new rows are transformers' mean_resizing rows up to its jitter
    (it draws them from N(mean, 1e-9 * covariance): ours lie within 6 of its standard deviations, element by
    element); old rows are untouched; the grown model computes transformers' logits over new ids."""
    base = tmp_path / "llama"
    save_hf_model("llama", base, seed=17)
    model, _ = FastLanguageModel.from_pretrained(base, dtype="float32", load_tokenizer=False, progress=False)
    old = {"embed": np.asarray(model.model.embed_tokens.weight[...]), "head": np.asarray(model.lm_head.weight[...])}
    resize_token_embeddings(model, 259)
    assert model.config.vocab_size == 259 and model.model.config.vocab_size == 259
    torch.manual_seed(0)
    hf = _hf(base, 259)  # mean_resizing=True is transformers' default
    theirs = {"embed": hf.model.embed_tokens.weight.detach().numpy(), "head": hf.lm_head.weight.detach().numpy()}
    ours = {"embed": np.asarray(model.model.embed_tokens.weight[...]), "head": np.asarray(model.lm_head.weight[...])}
    for k in ours:
        assert (old[k].max(axis=1) > 1e-16).all()  # no untrained rows: Unsloth's mean is the plain mean
        np.testing.assert_array_equal(ours[k][:256], old[k])
        std = np.sqrt(1e-9 * np.var(old[k], axis=0))  # the jitter's per-dimension standard deviation
        assert np.all(np.abs(ours[k][256:] - theirs[k][256:]) <= 6 * std + 1e-7), k
    ids = rng.integers(0, 259, (2, 12))
    ids[:, 3] = 258
    with torch.no_grad():  # with our rows (no jitter) the grown models compute the same logits
        hf.model.embed_tokens.weight[256:] = torch.from_numpy(ours["embed"][256:])
        hf.lm_head.weight[256:] = torch.from_numpy(ours["head"][256:])
        ref = hf(torch.from_numpy(ids).long()).logits.numpy()
    assert rel_err(np.asarray(model(ids)), ref) < 1e-5


def test_add_new_tokens_grows_tokenizer_and_model_by_unsloths_rule(tiny_dir, capsys):
    """The tokenizer gets the tokens (an existing one is skipped), config.vocab_size follows, old rows are
    unchanged, and the new rows are the mean of the trained rows: the bundled model's pad row is zero
    (torch's padding_idx), so Unsloth's rule leaves it out of both means."""
    model, tok = _load(tiny_dir)
    old = {"embed": np.asarray(model.model.embed_tokens.weight[...]), "head": np.asarray(model.lm_head.weight[...])}
    add_new_tokens(model, tok, new_tokens=NEW)
    assert "already in the tokenizer" in capsys.readouterr().out
    assert len(tok) == 2050 and model.config.vocab_size == 2050 and model.model.config.vocab_size == 2050
    ids = tok("<|reasoning|>hi<|/reasoning|>", add_special_tokens=False)["input_ids"]
    assert ids[0] == 2048 and ids[-1] == 2049
    trained = old["embed"].max(axis=1) > 1e-16
    assert not trained[tok.pad_token_id] and trained.sum() == 2047
    ours = {"embed": np.asarray(model.model.embed_tokens.weight[...]), "head": np.asarray(model.lm_head.weight[...])}
    for k in ours:
        np.testing.assert_array_equal(ours[k][:2048], old[k])
        np.testing.assert_allclose(ours[k][2048:], np.broadcast_to(old[k][trained].mean(0), (2, old[k].shape[1])),
                                   rtol=1e-5, atol=1e-7)


def test_untrained_rows_and_padded_vocabulary_follow_unsloth(tiny_dir):
    """Unsloth's rule: rows whose max is <= 1e-16 are left out of the mean (the head's mean leaves out the same
    rows); an embedding already larger than the tokenizer (padded) is not shrunk: only the new tokens' rows
    [len(tokenizer) before, after) change, the padding rows after them stay as they were."""
    model, tok = _load(tiny_dir)
    resize_token_embeddings(model, 2056)  # 8 padding rows beyond the tokenizer's 2048
    embed = np.array(model.model.embed_tokens.weight[...])
    head = np.array(model.lm_head.weight[...])
    embed[[5, 9, 2050]] = -np.abs(embed[[5, 9, 2050]])  # max <= 0: "untrained" in Unsloth's sense
    model.model.embed_tokens.weight[...] = embed
    add_new_tokens(model, tok, new_tokens=["<a>", "<b>"])
    keep = embed.max(axis=1) > 1e-16
    assert not keep[[tok.pad_token_id, 5, 9, 2050]].any() and keep.sum() == 2052
    got_e, got_h = np.asarray(model.model.embed_tokens.weight[...]), np.asarray(model.lm_head.weight[...])
    assert got_e.shape == (2056, embed.shape[1]) and model.config.vocab_size == 2056
    np.testing.assert_allclose(got_e[2048:2050], np.broadcast_to(embed[keep].mean(0), (2, embed.shape[1])), rtol=1e-5,
                               atol=1e-7)
    np.testing.assert_allclose(got_h[2048:2050], np.broadcast_to(head[keep].mean(0), (2, head.shape[1])), rtol=1e-5,
                               atol=1e-7)
    np.testing.assert_array_equal(got_e[2050:], embed[2050:])
    np.testing.assert_array_equal(got_h[2050:], head[2050:])
    with pytest.raises(TypeError, match="list of strings"):
        add_new_tokens(model, tok, new_tokens="<c>")
    with pytest.raises(NotImplementedError, match="interpolation"):
        add_new_tokens(model, tok, new_tokens=["<c>"], method="interpolation")
    with pytest.raises(ValueError, match="shrinking"):
        resize_token_embeddings(model, 100)


def _train_records(rng, vocab, n=8, length=24):
    """Records that use the new tokens (the last two ids), so their rows get gradients."""
    out = []
    for _ in range(n):
        ids = rng.integers(0, vocab, length)
        ids[rng.integers(0, length, 3)] = rng.integers(vocab - 2, vocab, 3)
        out.append({"input_ids": ids.tolist()})
    return out


def _train(model, records, out_dir):
    args = TrainingArguments(output_dir=str(out_dir), per_device_train_batch_size=4, max_steps=2,
                             learning_rate=5e-3, save_steps=0, logging_steps=1)
    SFTTrainer(model=model, train_dataset=records, args=args, max_seq_length=32).train()


def test_adapter_with_new_tokens_loads_in_peft_and_here(tiny_dir, tmp_path, rng, capsys):
    """New tokens + LoRA + trained embed_tokens/lm_head (added to modules_to_save by get_peft_model, as Unsloth
    does): the adapter has PEFT 0.21's key names at the grown size, loads with PeftModel.from_pretrained on the
    transformers model resized to len(tokenizer), and back here through from_pretrained(adapter_dir): the
    same logits each time."""
    model, tok = _load(tiny_dir)
    add_new_tokens(model, tok, new_tokens=NEW[:2])
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    assert "embed_tokens and lm_head train too" in capsys.readouterr().out
    assert model.lora.modules_to_save == ("embed_tokens", "lm_head")
    start = np.asarray(model.model.embed_tokens.weight[...])[2048:].copy()
    _train(model, _train_records(rng, 2050), tmp_path / "run")
    assert not np.allclose(np.asarray(model.model.embed_tokens.weight[...])[2048:], start)  # the new rows trained
    adapter = tmp_path / "adapter"
    model.save_pretrained(adapter)
    tok.save_pretrained(str(adapter))

    loaded_tok = transformers.AutoTokenizer.from_pretrained(str(adapter))
    pm = peft.PeftModel.from_pretrained(_hf(tiny_dir, len(loaded_tok)), str(adapter)).eval()
    ids = loaded_tok("<|reasoning|> the cat <|/reasoning|> sat", add_special_tokens=True)["input_ids"]
    assert 2048 in ids and 2049 in ids
    ours = np.asarray(model(np.asarray([ids])))
    with torch.no_grad():
        theirs = pm(torch.tensor([ids])).logits.numpy()
    assert rel_err(ours, theirs) < 1e-5

    # PEFT writing the same adapter: our keys and shapes, plus the whole embedding layers it adds when the
    # vocabulary was resized (save_embedding_layers="auto"), which our loader reads too
    pm.save_pretrained(str(tmp_path / "peft_written"))
    shapes = {}
    for d in (adapter, tmp_path / "peft_written"):
        with SafetensorsFile(d / "adapter_model.safetensors") as f:
            shapes[d.name] = {k: tuple(f.get(k).shape) for k in f.keys()}
    extra = {f"base_model.model.{m}.{part}.weight": (2050, 128) for m in ("model.embed_tokens", "lm_head")
             for part in ("modules_to_save", "original_module")}
    assert shapes["peft_written"] == shapes["adapter"] | extra
    assert shapes["adapter"]["base_model.model.model.embed_tokens.weight"] == (2050, 128)

    for d in (adapter, tmp_path / "peft_written"):
        again, again_tok = FastLanguageModel.from_pretrained(d, dtype="float32", progress=False)
        assert again.config.vocab_size == 2050 and (d != adapter or len(again_tok) == 2050)
        assert rel_err(np.asarray(again(np.asarray([ids]))), ours) < 1e-6, d.name


def test_tied_embeddings_adapter_keeps_the_head_tied_in_peft(tmp_path, rng):
    """Tied embeddings (Qwen2 shape), vocabulary grown, embed_tokens trained as a module to save: PEFT with the
    adapter's ensure_weight_tying ties its head to the trained copy, as this model computes; our loader reads
    it back (and refuses an adapter whose PEFT head would stay on the base weights)."""
    base = tmp_path / "qwen2"
    save_hf_model("qwen2", base, seed=7)
    model, _ = FastLanguageModel.from_pretrained(base, dtype="float32", load_tokenizer=False, progress=False)
    resize_token_embeddings(model, 260)
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, target_modules=["q_proj"],
                                             modules_to_save=["lm_head"])  # tied: names the embedding table
    assert model.lora.modules_to_save == ("embed_tokens",)
    _train(model, _train_records(rng, 260), tmp_path / "run")
    adapter = tmp_path / "adapter"
    model.save_pretrained(adapter)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["ensure_weight_tying"] is True
    ids = rng.integers(0, 260, (2, 16))
    ours = np.asarray(model(ids))
    pm = peft.PeftModel.from_pretrained(_hf(base, 260), str(adapter)).eval()
    with torch.no_grad():
        theirs = pm(torch.from_numpy(ids).long()).logits.numpy()
    assert rel_err(ours, theirs) < 1e-5
    again, _ = FastLanguageModel.from_pretrained(base, dtype="float32", load_tokenizer=False, progress=False)
    peft_io.load_adapter(again, adapter)
    assert again.config.vocab_size == 260
    assert rel_err(np.asarray(again(ids)), ours) < 1e-6
    cfg["ensure_weight_tying"] = False
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    with SafetensorsFile(adapter / "adapter_model.safetensors") as f:
        tensors = {k: np.array(f.get(k)) for k in f.keys()}
    from safetensors.numpy import save_file

    del tensors["base_model.model.lm_head.weight"]
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    fresh, _ = FastLanguageModel.from_pretrained(base, dtype="float32", load_tokenizer=False, progress=False)
    with pytest.raises(ConfigError, match="ensure_weight_tying"):
        peft_io.load_adapter(fresh, adapter)
