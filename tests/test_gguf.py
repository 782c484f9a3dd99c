"""GGUF export: tensors, types, metadata and tokenizer read back with gguf.GGUFReader and compared with the
transformers model merged independently here, llama.cpp's conventions re-derived in the test (per-head q/k row
interleaving, Gemma 1 + w norms, Llama 3 rope factors from transformers' rope init). Optional checks against
llama.cpp itself: its converter (LLAMA_CPP_DIR=<llama.cpp checkout>) and its runtime (llama_cpp importable)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from tests.conftest import fresh_seed  # noqa: E402
from tests.helpers import rel_err, wrong_modes  # noqa: E402
from tests.hf_models import FAMILIES as HF_FAMILIES, TINY, model_type_of, tiny_config, train_spm_tokenizer  # noqa: E402
from unsloth_jax import FastLanguageModel  # noqa: E402
from unsloth_jax.errors import ConfigError  # noqa: E402
from unsloth_jax.hf import gguf_export  # noqa: E402

ASSET_TOKENIZER = Path(__file__).resolve().parents[1] / "unsloth_jax" / "assets" / "tiny-llama"
Q = gguf.GGMLQuantizationType
T = gguf.TokenType
# family -> (tokenizer kind, llama.cpp arch name)
CASES = {
    "llama": ("bpe", "llama"),
    "qwen2": ("bpe", "qwen2"),
    "gemma": ("spm", "gemma"),
    "llama3_scaled": ("bpe", "llama"),
    "mistral": ("spm", "llama"),
    "qwen3": ("bpe", "qwen3"),
    "gemma2": ("spm", "gemma2"),
    "phi3_longrope": ("spm", "phi3"),
}
HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
}


def _hf_rows(cfg, name: str):
    """Where projection `name` lives in the HF state dict: (module, first row, end row); Phi-3 fuses q/k/v and
    gate/up into one tensor each."""
    mod = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
    if cfg.model_type != "phi3" or name in ("o_proj", "down_proj"):
        return f"{mod}.{name}", None, None
    q, kv, f = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    rows = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv), "gate_proj": (0, f),
            "up_proj": (f, 2 * f)}[name]
    return ("self_attn.qkv_proj" if mod == "self_attn" else "mlp.gate_up_proj"), *rows


# ------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def spm_tokenizer_dir(tmp_path_factory):
    """A SentencePiece BPE model with byte fallback trained on fresh random text, and its HF tokenizer."""
    pytest.importorskip("sentencepiece")
    return train_spm_tokenizer(tmp_path_factory.mktemp("spm"), fresh_seed("spm tokenizer"))


def _tokenizer(kind, spm_dir):
    src = spm_dir if kind == "spm" else ASSET_TOKENIZER
    return transformers.AutoTokenizer.from_pretrained(str(src))


def _make_hf_dir(family, path, vocab, spm_dir, seed):
    model_type = model_type_of(family)
    config = tiny_config(model_type, dict(TINY) | HF_FAMILIES[family] | {"vocab_size": vocab})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if model_type.startswith("gemma") else 1.0) + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_((0.1 if name.endswith("bias") else 0.08) * torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(path))
    if CASES[family][0] == "spm":  # the source directory keeps the SentencePiece model, as hub checkpoints do
        (path / "tokenizer.model").write_bytes((spm_dir / "tokenizer.model").read_bytes())
    return model


@pytest.fixture(scope="module")
def cases(tmp_path_factory, spm_tokenizer_dir):
    """family -> (unsloth_jax model with random nonzero LoRA, tokenizer, transformers model, source dir)."""
    seed = fresh_seed("gguf cases")
    rng = np.random.default_rng(seed)
    out = {}
    for k, family in enumerate(CASES):
        kind = CASES[family][0]
        tok = _tokenizer(kind, spm_tokenizer_dir)
        vocab = 320 if kind == "spm" else 2048
        path = tmp_path_factory.mktemp(family)
        hf = _make_hf_dir(family, path, vocab, spm_tokenizer_dir, seed=(seed + 7 * k) % (1 << 31))
        model, _ = FastLanguageModel.from_pretrained(path, dtype="float32", load_tokenizer=False, progress=False)
        model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
        for lin in model.projections().values():
            if lin.lora_b is not None:
                lin.lora_b[...] = np.asarray(0.05 * rng.standard_normal(lin.lora_b[...].shape), np.float32)
        out[family] = (model, tok, hf, path)
    return out


def _merged_state(model, hf) -> dict[str, np.ndarray]:
    """HF weights with W + scale * B^T A^T folded in (float32, torch), from the LoRA factors directly."""
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    for name, lin in model.projections().items():
        if lin.lora_a is None:
            continue
        mod, start, end = _hf_rows(model.config, name)
        for i in range(model.config.num_hidden_layers):
            a = torch.tensor(np.asarray(lin.lora_a[...][i]).T)  # PEFT lora_A [r, in]
            b = torch.tensor(np.asarray(lin.lora_b[...][i]).T)  # PEFT lora_B [out, r]
            key = f"model.layers.{i}.{mod}.weight"
            w = torch.tensor(sd[key])
            w[start:end] += model.lora.scale * (b @ a)
            sd[key] = w.numpy()
    return sd


def _interleave_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: within each head, row 2j+s holds HF row s*hd/2 + j (rotate-half -> pairs)."""
    hd = w.shape[0] // n_heads
    idx = [h * hd + s * (hd // 2) + j for h in range(n_heads) for j in range(hd // 2) for s in range(2)]
    return w[np.array(idx)]


def _expected_tensors(family, model, hf) -> dict[str, np.ndarray]:
    cfg = model.config
    gemma = cfg.model_type.startswith("gemma")
    permute = cfg.model_type in ("llama", "mistral")
    sd = _merged_state(model, hf)
    out = {}
    for key, w in sd.items():
        if key == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            out["output.weight"] = w
            continue
        if key == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
            continue
        if key == "model.norm.weight":
            out["output_norm.weight"] = w + 1 if gemma else w
            continue
        parts = key.split(".")
        i, mod, leaf = int(parts[2]), ".".join(parts[3:-1]), parts[-1]
        if mod == "post_attention_layernorm":
            name = "post_attention_norm" if cfg.model_type == "gemma2" else "ffn_norm"
        elif mod == "pre_feedforward_layernorm":
            name = "ffn_norm"
        elif mod == "post_feedforward_layernorm":
            name = "post_ffw_norm"
        else:
            name = HF_TO_GGUF[mod]
        if permute and mod == "self_attn.q_proj":
            w = _interleave_rows(w, cfg.num_attention_heads)
        if permute and mod == "self_attn.k_proj":
            w = _interleave_rows(w, cfg.num_key_value_heads)
        if gemma and name.endswith("norm"):
            w = w + 1
        out[f"blk.{i}.{name}.{leaf}"] = w
    return out


def _fields(reader) -> dict:
    out = {}
    for k, f in reader.fields.items():
        try:
            out[k] = f.contents()
        except Exception:  # noqa: BLE001
            out[k] = None
    return out


def _read(path):
    r = gguf.GGUFReader(path)
    return r, {t.name: t for t in r.tensors}, _fields(r)


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("family", list(CASES))
def test_f32_tensors_and_metadata_match_transformers(family, cases, tmp_path):
    model, tok, hf, path = cases[family]
    cfg, raw = model.config, json.loads((path / "config.json").read_text())
    out = model.save_pretrained_gguf(tmp_path, tok, quantization_method="f32")
    assert out == str(tmp_path / "unsloth.F32.gguf") and os.listdir(tmp_path) == ["unsloth.F32.gguf"]
    _, tensors, kv = _read(out)
    want = _expected_tensors(family, model, hf)
    if cfg.rope_type == "llama3":
        want["rope_freqs.weight"] = None
    if cfg.rope_type == "longrope":  # Phi-3: the factors as F32 tensors, straight from config.json
        want["rope_factors_long.weight"] = np.asarray(raw["rope_parameters"]["long_factor"], np.float32)
        want["rope_factors_short.weight"] = np.asarray(raw["rope_parameters"]["short_factor"], np.float32)
    assert set(tensors) == set(want)
    for name, t in tensors.items():
        assert t.tensor_type == Q.F32, name
        if want[name] is None:
            continue
        got = np.asarray(t.data).reshape(want[name].shape)
        np.testing.assert_allclose(got, want[name], rtol=1e-6, atol=1e-7, err_msg=name)
        assert list(t.shape) == list(reversed(want[name].shape))  # ggml order
    arch = CASES[family][1]
    assert kv["general.architecture"] == arch and kv["general.file_type"] == gguf.LlamaFileType.ALL_F32
    assert kv[f"{arch}.context_length"] == raw["max_position_embeddings"]
    assert kv[f"{arch}.embedding_length"] == raw["hidden_size"]
    assert kv[f"{arch}.block_count"] == raw["num_hidden_layers"]
    assert kv[f"{arch}.feed_forward_length"] == raw["intermediate_size"]
    assert kv[f"{arch}.attention.head_count"] == raw["num_attention_heads"]
    assert kv[f"{arch}.attention.head_count_kv"] == raw["num_key_value_heads"]
    assert kv[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(raw["rms_norm_eps"], rel=1e-6)
    if not arch.startswith("gemma"):
        assert kv[f"{arch}.rope.freq_base"] == pytest.approx(cfg.rope_theta)
    if arch == "llama":
        assert kv["llama.vocab_size"] == raw["vocab_size"] and kv["llama.rope.dimension_count"] == cfg.head_dim
    if arch == "phi3":  # Phi3MiniModel.set_gguf_parameters / generate_extra_tensors
        original = raw["original_max_position_embeddings"]
        assert kv["phi3.rope.dimension_count"] == int(raw["partial_rotary_factor"] * raw["hidden_size"]) // raw[
            "num_attention_heads"] == 12
        assert kv["phi3.rope.scaling.original_context_length"] == original
        scale = raw["max_position_embeddings"] / original
        assert kv["phi3.rope.scaling.attn_factor"] == pytest.approx((1 + np.log(scale) / np.log(original)) ** 0.5)
        assert kv["phi3.attention.sliding_window"] == 0 and "phi3.vocab_size" not in kv
    if arch == "gemma2":
        assert kv["gemma2.attn_logit_softcapping"] == raw["attn_logit_softcapping"]
        assert kv["gemma2.final_logit_softcapping"] == raw["final_logit_softcapping"]
        assert kv["gemma2.attention.sliding_window"] == raw["sliding_window"]
    assert kv["tokenizer.ggml.bos_token_id"] == tok.bos_token_id
    assert kv["tokenizer.ggml.eos_token_id"] == tok.eos_token_id


def test_gguf_file_gets_the_mode_of_a_new_file(cases, tmp_path, umask):
    """The GGUF file (written to a mkstemp file, then renamed) and its folder get 0o666 / 0o777 minus the umask."""
    model, tok, _, _ = cases["qwen2"]
    out = Path(model.save_pretrained_gguf(tmp_path / "gguf", tok, quantization_method="q8_0"))
    assert out.parent == tmp_path / "gguf" and os.listdir(out.parent) == [out.name]
    assert wrong_modes(tmp_path / "gguf", umask) == {}


def test_llama3_rope_factors_match_transformers(cases, tmp_path):
    model, tok, hf, _ = cases["llama3_scaled"]
    out = model.save_pretrained_gguf(tmp_path, tok, quantization_method="f16")
    _, tensors, kv = _read(out)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf.config, "cpu")
    cfg = model.config
    base = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
    factors = (base / scaled).numpy()
    got = np.asarray(tensors["rope_freqs.weight"].data)
    assert tensors["rope_freqs.weight"].tensor_type == Q.F32
    np.testing.assert_allclose(got, factors, rtol=1e-5)
    assert got.min() == 1.0 and got.max() == pytest.approx(cfg.rope_factor)
    assert "llama.rope.scaling.type" not in kv  # llama3 scaling travels as rope_freqs only


@pytest.mark.parametrize("method,qtype,tol", [("f16", Q.F16, None), ("bf16", Q.BF16, None), ("q8_0", Q.Q8_0, 127),
                                              ("q4_0", Q.Q4_0, 8), ("q5_1", Q.Q5_1, 31)])
def test_quantized_types_dequantize_within_their_error(method, qtype, tol, cases, tmp_path):
    family = "qwen2"
    model, tok, hf, _ = cases[family]
    out = model.save_pretrained_gguf(tmp_path, tok, quantization_method=method)
    assert out.endswith(f"unsloth.{qtype.name}.gguf")
    _, tensors, kv = _read(out)
    assert kv["general.file_type"] == getattr(gguf.LlamaFileType, f"MOSTLY_{qtype.name}")
    want = _expected_tensors(family, model, hf)
    for name, t in tensors.items():
        w = want[name]
        if w.ndim == 1:
            assert t.tensor_type == Q.F32, name
            continue
        expect_type = Q.Q8_0 if (method in ("q4_0", "q5_1") and name == "token_embd.weight") else qtype
        assert t.tensor_type == expect_type, name
        deq = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(w.shape)
        if qtype == Q.F16:
            np.testing.assert_array_equal(deq, w.astype(np.float16).astype(np.float32))
        elif qtype == Q.BF16:
            import ml_dtypes

            np.testing.assert_array_equal(deq, w.astype(ml_dtypes.bfloat16).astype(np.float32))
        else:
            levels = 127 if t.tensor_type == Q.Q8_0 else tol
            blocks = w.reshape(w.shape[0], -1, 32)
            step = np.abs(blocks).max(-1, keepdims=True) / levels  # one quantization step per block
            err = np.abs(deq.reshape(blocks.shape) - blocks)
            assert np.all(err <= 0.6 * step + 1e-7 if levels == 127 else err <= 1.1 * step + 1e-7), name
            assert rel_err(deq, w) < (0.01 if levels == 127 else 0.2), name


def test_byte_level_bpe_vocab(cases, tmp_path):
    model, tok, _, _ = cases["llama"]
    _, _, kv = _read(model.save_pretrained_gguf(tmp_path, tok, quantization_method="q8_0"))
    assert kv["tokenizer.ggml.model"] == "gpt2" and kv["tokenizer.ggml.pre"] == "gpt-2"
    vocab = tok.get_vocab()
    tokens = kv["tokenizer.ggml.tokens"]
    assert len(tokens) == model.config.vocab_size
    assert all(tokens[i] == t for t, i in vocab.items())
    types = kv["tokenizer.ggml.token_type"]
    specials = {tok.convert_tokens_to_ids(t) for t in tok.all_special_tokens}
    assert all(types[i] == T.CONTROL for i in specials)
    assert all(types[i] == T.NORMAL for i in range(len(types)) if i not in specials and i not in
               {v for k, v in tok.get_added_vocab().items()})
    tj = json.loads((ASSET_TOKENIZER / "tokenizer.json").read_text())
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    assert kv["tokenizer.ggml.merges"] == merges
    assert kv["tokenizer.ggml.unknown_token_id"] == tok.unk_token_id
    assert kv["tokenizer.ggml.padding_token_id"] == tok.pad_token_id
    assert kv["tokenizer.ggml.add_bos_token"] is True
    assert kv["tokenizer.chat_template"] == tok.chat_template


def _spm_encode(text: str, tokens: list[str], scores: list[float]) -> list[int]:
    """llama.cpp's SPM tokenizer in miniature: start from characters, repeatedly merge the adjacent pair whose
    concatenation is a token with the highest score (leftmost on ties); unknown characters -> byte tokens."""
    index = {t: i for i, t in enumerate(tokens)}
    syms = list("\u2581" + text.replace(" ", "\u2581"))
    while True:
        best = None
        for k in range(len(syms) - 1):
            i = index.get(syms[k] + syms[k + 1])
            if i is not None and (best is None or scores[i] > best[0]):
                best = (scores[i], k)
        if best is None:
            break
        k = best[1]
        syms[k:k + 2] = [syms[k] + syms[k + 1]]
    out = []
    for s in syms:
        if s in index:
            out.append(index[s])
        else:
            out.extend(index[f"<0x{b:02X}>"] for b in s.encode())
    return out


def test_sentencepiece_vocab_from_model_file_and_from_tokenizer_json(cases, spm_tokenizer_dir, tmp_path, rng):
    spm = pytest.importorskip("sentencepiece")
    model, tok, _, path = cases["gemma"]
    sp = spm.SentencePieceProcessor(model_file=str(spm_tokenizer_dir / "tokenizer.model"))
    _, _, kv = _read(model.save_pretrained_gguf(tmp_path / "a", tok))
    assert kv["tokenizer.ggml.model"] == "llama" and kv["tokenizer.ggml.add_space_prefix"] is False
    tokens, scores, types = kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.scores"], kv["tokenizer.ggml.token_type"]
    for i in range(sp.vocab_size()):
        assert tokens[i] == sp.IdToPiece(i)
        assert scores[i] == pytest.approx(sp.GetScore(i)) or i in (0, 1, 2)
        if sp.IsByte(i):
            assert types[i] == T.BYTE
    assert types[1] == types[2] == T.CONTROL  # <s>, </s>: special added tokens
    assert "tokenizer.ggml.merges" not in kv
    # without tokenizer.model (what transformers 5 saves): same pieces and types, merge-rank scores that make the
    # SPM algorithm reproduce the HF tokenizer
    (path / "tokenizer.model").rename(path / "tokenizer.model.off")
    try:
        fresh = transformers.AutoTokenizer.from_pretrained(str(spm_tokenizer_dir))
        fresh.save_pretrained(str(tmp_path / "tok5"))
        tok5 = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok5"))
        assert not (tmp_path / "tok5" / "tokenizer.model").exists()
        _, _, kv2 = _read(model.save_pretrained_gguf(tmp_path / "b", tok5))
    finally:
        (path / "tokenizer.model.off").rename(path / "tokenizer.model")
    assert kv2["tokenizer.ggml.tokens"] == tokens
    t2 = kv2["tokenizer.ggml.token_type"]
    assert [t2[i] for i in range(3, 259)] == [T.BYTE] * 256 and t2[1] == t2[2] == T.CONTROL
    letters = list("abcdefghijklmnopqrstuvwxyz")
    for _ in range(50):
        text = " ".join("".join(rng.choice(letters, size=rng.integers(1, 9))) for _ in range(rng.integers(1, 6)))
        assert _spm_encode(text, tokens, kv2["tokenizer.ggml.scores"]) == tok5.encode(text, add_special_tokens=False)


def test_errors_and_interrupted_write(cases, tmp_path, monkeypatch):
    model, tok, _, _ = cases["llama"]
    with pytest.raises(ConfigError, match="llama-quantize"):
        model.save_pretrained_gguf(tmp_path, tok, quantization_method="q4_k_m")
    calls = {"n": 0}
    real = gguf_export._quantize

    def failing(data, qtype):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt("simulated crash")
        return real(data, qtype)

    monkeypatch.setattr(gguf_export, "_quantize", failing)
    with pytest.raises(KeyboardInterrupt):
        model.save_pretrained_gguf(tmp_path, tok, quantization_method="q8_0")
    assert os.listdir(tmp_path) == []


def _convert_with_llama_cpp(llama_dir: Path, model_dir: Path, outfile: Path, outtype: str, pre: str):
    """Run llama.cpp's convert_hf_to_gguf.py (unknown BPE pre-tokenizer hashes fall back to `pre`: the tiny test
    tokenizer is not one of its registered models)."""
    code = (
        "import sys, runpy\n"
        f"sys.path.insert(0, {str(llama_dir)!r}); sys.path.insert(1, {str(llama_dir / 'gguf-py')!r})\n"
        "import conversion.base as b\n"
        "orig = b.TextModel.get_vocab_base_pre\n"
        "def pre(self, tok):\n"
        "    try: return orig(self, tok)\n"
        f"    except NotImplementedError: return {pre!r}\n"
        "b.TextModel.get_vocab_base_pre = pre\n"
        f"sys.argv = ['convert_hf_to_gguf.py', {str(model_dir)!r}, '--outtype', {outtype!r}, '--outfile', {str(outfile)!r}]\n"
        f"runpy.run_path({str(llama_dir / 'convert_hf_to_gguf.py')!r}, run_name='__main__')\n")
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.skipif(not os.environ.get("LLAMA_CPP_DIR"), reason="set LLAMA_CPP_DIR to a llama.cpp checkout to "
                    "compare with its convert_hf_to_gguf.py")
@pytest.mark.parametrize("family,outtype", [("llama", "q8_0"), ("qwen2", "f16"), ("gemma", "bf16"),
                                            ("llama3_scaled", "f16"), ("mistral", "f16"), ("qwen3", "q8_0"),
                                            ("gemma2", "f16"), ("phi3_longrope", "f16")])
def test_identical_to_llama_cpp_converter(family, outtype, cases, tmp_path):
    """Our file equals what llama.cpp's converter writes for our merged 16-bit export: every key (except
    general.name, which it derives from the directory name) and every tensor byte."""
    llama_dir = Path(os.environ["LLAMA_CPP_DIR"])
    model, tok, _, src = cases[family]
    merged = tmp_path / "merged"
    model.save_pretrained_merged(merged, tok, dtype="float32")  # the precision the GGUF export converts from
    if (src / "tokenizer.model").exists():
        (merged / "tokenizer.model").write_bytes((src / "tokenizer.model").read_bytes())
    ours = model.save_pretrained_gguf(tmp_path / "ours", tok, quantization_method=outtype)
    ref = tmp_path / "ref.gguf"
    _convert_with_llama_cpp(llama_dir, merged, ref, outtype, "gpt-2")
    _, ta, ka = _read(ours)
    _, tb, kb = _read(ref)
    ka.pop("general.name")
    kb.pop("general.name")
    assert ka == kb
    assert list(ta) == list(tb) or set(ta) == set(tb)
    for name in ta:
        assert ta[name].tensor_type == tb[name].tensor_type, name
        assert list(ta[name].shape) == list(tb[name].shape), name
        np.testing.assert_array_equal(np.asarray(ta[name].data), np.asarray(tb[name].data), err_msg=name)


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="opt-in: `pip install llama-cpp-python` (a C++ build from source, about 10 minutes, so "
                           "not in the default test install)")
def test_llama_cpp_runtime_logits(cases, tmp_path, rng):
    """llama.cpp (llama-cpp-python) runs the exported f32 GGUF and its logits match transformers' on the merged
    model. Opt-in: the default install has no llama-cpp-python (it builds from source)."""
    import llama_cpp
    model, tok, hf, _ = cases["llama"]
    path = model.save_pretrained_gguf(tmp_path, tok, quantization_method="f32")
    ids = [int(x) for x in rng.integers(3, model.config.vocab_size, size=12)]
    llm = llama_cpp.Llama(model_path=path, n_ctx=64, logits_all=True, verbose=False, n_threads=2)
    llm.eval(ids)
    theirs = np.array(llm.scores[: len(ids)], np.float32)
    sd = _merged_state(model, hf)
    ref = hf.__class__(hf.config)
    ref.load_state_dict({k: torch.tensor(v) for k, v in sd.items()}, strict=False)
    ref.eval()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].numpy()
    assert rel_err(theirs, want) < 1e-3
