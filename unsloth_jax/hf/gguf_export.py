"""Export the merged model as a llama.cpp GGUF file through the `gguf` package.

    path = save_gguf(model, "out", tokenizer, quantization_method="q8_0")   # out/unsloth.Q8_0.gguf

The file is what llama.cpp's convert_hf_to_gguf.py writes for the merged 16-bit checkpoint that
`export.save_merged` produces (facts from ggml-org/llama.cpp `convert_hf_to_gguf.py` / `conversion/*.py`):

* architectures: llama (Llama and Mistral), qwen2, qwen3, gemma, gemma2, smollm3 (llama's tensors and hparams;
  llama.cpp hard-codes its NoPE layers as every 4th, so other no_rope_layers patterns and sliding windows are
  refused), phi3 (its fused qkv_proj / gate_up_proj
  written back as attn_qkv / ffn_up; LongRoPE as rope_factors_long / rope_factors_short tensors plus
  rope.scaling.attn_factor, partial rotary as rope.dimension_count, as Phi3MiniModel does), qwen35 (Qwen3.5 text)
  and glm4moe (GLM-4.5 MoE: the first MoE family here), whose tensor transforms and keys are in gguf_families.py;
  Gemma 3 and the other MoE families are refused;
* tensors: llama.cpp names (token_embd, blk.N.attn_q, ..., output_norm, output); a tensor that is not float16 or
  float32 in the HF checkpoint (bf16) is converted to float32 first; Llama/Mistral q_proj/k_proj rows are
  permuted from HF's rotate-half RoPE layout to llama.cpp's interleaved one; Gemma norms are stored as 1 + w;
  Llama 3 rope scaling becomes a `rope_freqs.weight` tensor of per-frequency factors;
* types: 1-D tensors, norms, biases, MoE routers (ffn_gate_inp) and conv kernels (ssm_conv1d) stay F32; other
  weights take the requested type (F32, F16, BF16, Q8_0,
  and the legacy Q4_0 / Q4_1 / Q5_0 / Q5_1 that gguf.quants can produce); a row length that the block size
  does not divide falls back to F16, as the converter does. For the 4/5-bit types the output head (or the
  tied embedding) is kept in Q8_0 (llama-quantize keeps it at higher precision too);
* metadata: general.*, <arch>.context_length / embedding_length / block_count / feed_forward_length /
  attention.head_count / head_count_kv / layer_norm_rms_epsilon / rope.freq_base / ... and the tokenizer
  (tokenizer.ggml.model "gpt2" with merges and a pre-tokenizer name for byte-level BPE, "llama" with scores
  for SentencePiece-style vocabularies; token types NORMAL / UNKNOWN / CONTROL / USER_DEFINED / UNUSED / BYTE;
  BOS/EOS/UNK/PAD ids, add_bos/add_eos and the chat template through gguf.SpecialVocab).

Tokenizer sources, in order: the source directory's `tokenizer.model` when sentencepiece is installed
(exactly the converter's SentencePiece path), else the tokenizer object's tokenizer.json (transformers 5 writes
no tokenizer.model). For a SentencePiece-style BPE read from tokenizer.json the scores are derived from the
merge ranks (score = -rank of the first merge producing the piece), which makes llama.cpp's SPM tokenizer merge
in the same order as the HF tokenizer (the converter's own tokenizer.json fallback writes -1000 for every
token, which it cannot).

The file is written in two passes over the model: tensor infos first (shapes and types are known without
data), then each tensor is computed, quantized and written, so host memory holds one tensor at a time. It is
written to a temporary name and renamed when complete.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import tempfile
from hashlib import sha256
from pathlib import Path

import numpy as np

from unsloth_jax.errors import ConfigError, UnsupportedArchitectureError
from unsloth_jax.families import TEXT_FAMILIES
from unsloth_jax.hf import export, gguf_families
from unsloth_jax.hf.file_modes import chmod_like_new
from unsloth_jax.hf.gguf_common import add_shape, llama3_rope_factors

log = logging.getLogger("unsloth_jax")

# quantization_method -> (per-tensor GGML type name, LlamaFileType name, file name tag)
_METHODS = {
    "f32": ("F32", "ALL_F32"),
    "f16": ("F16", "MOSTLY_F16"),
    "bf16": ("BF16", "MOSTLY_BF16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
    "q4_0": ("Q4_0", "MOSTLY_Q4_0"),
    "q4_1": ("Q4_1", "MOSTLY_Q4_1"),
    "q5_0": ("Q5_0", "MOSTLY_Q5_0"),
    "q5_1": ("Q5_1", "MOSTLY_Q5_1"),
}
_ALIASES = {"not_quantized": "f16", "fast_quantized": "q8_0", "fp16": "f16", "float16": "f16", "bfloat16": "bf16",
            "float32": "f32", "fp32": "f32"}
_LOW_BIT = ("q4_0", "q4_1", "q5_0", "q5_1")
# model_type -> the gguf.MODEL_ARCH member its family writes (TextFamily.gguf_arch)
_ARCH = {t: f.gguf_arch for f in TEXT_FAMILIES if f.gguf_arch for t in f.model_types}
# SmolLM3: convert_hf_to_gguf.py's SmolLM3Model is LlamaModel with its own arch (q/k rows permuted as llama's);
# llama.cpp has no GGUF key for the NoPE layers: it hard-codes NoPE on every 4th layer (n_no_rope_layer_step = 4)
_LLAMA_LAYOUT = ("LLAMA", "SMOLLM3")  # archs whose q/k rows take llama.cpp's interleaved RoPE layout
SMOLLM3_GGUF_NOPE_STEP = 4
# tensors the converter keeps in F32 whatever the file type (name suffixes): routers, conv kernels
_F32_TENSORS = (".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight", ".ssm_conv1d.weight")

# convert_hf_to_gguf.py's pre-tokenizer check text and the hashes of the families this package supports.
_CHKTXT = ('\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ '
           '🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ '
           '------======= нещо на Български \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, '
           '\'RE you sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL')
_PRE_HASHES = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Meta-Llama-3-8B
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen1.5 / Qwen2 / Qwen2.5
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen3
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",  # gpt2
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",  # Mistral Nemo
    "d30d75d9059f1aa2c19359de71047b3ae408c70875e8a3ccf8c5fba56c9d8af4": "qwen35",  # Qwen3.5
    "9ca2dd618e8afaf09731a7cf6e2105b373ba6a1821559f258b272fe83e6eb902": "glm4",  # GLM-4.5-Air
}
# GLM-4.5 (the converter's _set_vocab_glm): special token kinds taken from these added tokens, where the
# tokenizer files do not already name one of the kind
_GLM_SPECIALS = (("bos", "[gMASK]"), ("eot", "<|user|>"), ("unk", "<|endoftext|>"), ("eom", "<|observation|>"))
# tokenizer.json split regexes of those pre-tokenizers (fallback when the hash is unknown, e.g. a resized vocab)
_LLAMA3_PAT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
               "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_QWEN2_PAT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
              "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_QWEN35_PAT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+"
               "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")


def _gguf():
    try:
        import gguf
    except ImportError as e:  # pragma: no cover
        raise ImportError("GGUF export needs the `gguf` package: pip install gguf") from e
    return gguf


def resolve_method(quantization_method: str) -> str:
    m = str(quantization_method).lower()
    m = _ALIASES.get(m, m)
    if m not in _METHODS:
        hint = ""
        if re.fullmatch(r"(i?q\d_k.*|iq.*|q\d_k)", m):
            hint = (" (K-quants and i-quants need llama.cpp's quantizer: export 'f16' and run "
                    f"`llama-quantize model.F16.gguf model.{m.upper()}.gguf {m.upper()}`)")
        raise ConfigError(f"quantization_method {quantization_method!r} is not supported{hint}; supported: "
                          f"{', '.join(_METHODS)} (aliases: {', '.join(_ALIASES)})")
    return m


# ----------------------------------------------------------------------------------------------- tensors
def _permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: HF rotate-half row order -> interleaved pairs, per head."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


class _Tensor:
    __slots__ = ("name", "shape", "qtype", "make")

    def __init__(self, name, shape, qtype, make):
        self.name, self.shape, self.qtype, self.make = name, tuple(shape), qtype, make


def _plan_tensors(model, method: str) -> list[_Tensor]:
    """The GGUF tensors in write order, with llama.cpp names, shapes and types; `make()` computes the data."""
    gguf = _gguf()
    from unsloth_jax.hf import export

    cfg = model.config
    arch = getattr(gguf.MODEL_ARCH, _ARCH[cfg.model_type])
    name_map = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    Q = gguf.GGMLQuantizationType
    # The merged weights at the model's own precision (a float32 model is not rounded to 16 bits first); each
    # tensor is then converted to its GGUF type.
    hf_dtype = export._resolve_out_dtype(model, model.dtype)
    permute = _ARCH[cfg.model_type] in _LLAMA_LAYOUT
    gemma = cfg.model_type in ("gemma", "gemma2")
    plan: list[_Tensor] = []
    if permute and cfg.rope_type == "llama3":
        plan.append(_Tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", (cfg.head_dim // 2,), Q.F32,
                            lambda: llama3_rope_factors(cfg)))
    if cfg.model_type == "phi3":
        plan += _phi3_rope_tensors(model)
    head_names = {"output.weight"} | ({"token_embd.weight"} if cfg.tie_word_embeddings else set())
    if cfg.model_type in gguf_families.ARCHS:
        entries = export.merged_entries(model, hf_dtype)
        return [_Tensor(name, shape, _qtype(name, shape, method, head_names), make)
                for name, shape, make in gguf_families.plan(model, entries, name_map, hf_dtype)]
    for e in export.merged_entries(model, hf_dtype):
        if gemma and e.name == "lm_head.weight":
            continue
        new_name = name_map.get_name(e.name, try_suffixes=(".weight", ".bias"))
        if new_name is None:
            raise UnsupportedArchitectureError(f"no llama.cpp tensor name for '{e.name}' ({cfg.model_type})")

        def make(e=e, name=e.name):
            data = e.make()
            if data.dtype not in (np.float16, np.float32):
                data = data.astype(np.float32)
            if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
                data = _permute(data, cfg.num_attention_heads, cfg.num_attention_heads)
            elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
                data = _permute(data, cfg.num_attention_heads, cfg.num_key_value_heads)
            if gemma and name.endswith("norm.weight"):
                data = data + data.dtype.type(1)
            return data

        plan.append(_Tensor(new_name, e.shape, _qtype(new_name, e.shape, method, head_names), make))
    return plan


def _qtype(new_name: str, shape, method: str, head_names: set):
    """The GGML type of a tensor, by the converter's rules: 1-D tensors, norms, biases, routers and conv kernels
    F32; the output head of a 4/5-bit file Q8_0; rows the block size does not divide F16; else the method's."""
    gguf = _gguf()
    Q = gguf.GGMLQuantizationType
    if len(shape) <= 1 or new_name.endswith(("_norm.weight",) + _F32_TENSORS) or not new_name.endswith(".weight"):
        return Q.F32
    qtype = Q.Q8_0 if (method in _LOW_BIT and new_name in head_names) else getattr(Q, _METHODS[method][0])
    if qtype not in (Q.F32, Q.F16):
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        if shape[-1] % block:
            log.warning("unsloth_jax: %s has rows of %d values, not a multiple of %s's block of %d; "
                        "storing it as F16", new_name, shape[-1], qtype.name, block)
            qtype = Q.F16
    return qtype


def _nbytes(shape, qtype) -> int:
    gguf = _gguf()
    byte_shape = gguf.quant_shape_to_byte_shape(shape, qtype) if qtype not in (
        gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) else None
    if byte_shape is not None:
        return int(np.prod(byte_shape))
    return int(np.prod(shape)) * (4 if qtype == gguf.GGMLQuantizationType.F32 else 2)


def _quantize(data: np.ndarray, qtype) -> np.ndarray:
    gguf = _gguf()
    return gguf.quants.quantize(data, qtype)


# ----------------------------------------------------------------------------------------------- metadata
def _source_config(model) -> dict:
    from unsloth_jax.hf.export import source_config

    return source_config(model) or {}



def _add_hparams(w, model, raw: dict, ftype) -> None:
    cfg = model.config
    gguf = _gguf()
    mt = cfg.model_type
    if mt in ("gemma", "gemma2"):  # GemmaModel / Gemma2Model.set_gguf_parameters
        add_shape(w, cfg)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_file_type(ftype)
        if cfg.rope_theta != 10000.0:  # the converter relies on llama.cpp's default of 10000 for Gemma
            w.add_rope_freq_base(cfg.rope_theta)
        if mt == "gemma2":
            w.add_attn_logit_softcapping(cfg.attn_softcap)
            w.add_final_logit_softcapping(cfg.final_softcap)
            w.add_sliding_window(int(raw.get("sliding_window") or max([x for x in cfg.layer_windows if x] or [0])))
        return
    if mt == "phi3":
        _add_phi3_hparams(w, model, raw, ftype)
        return
    if mt in gguf_families.ARCHS:
        gguf_families.add_hparams(w, model, raw, ftype)
        return
    # TextModel.set_gguf_parameters
    add_shape(w, cfg)
    if cfg.rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope_factor)
    w.add_rope_freq_base(cfg.rope_theta)
    if raw.get("head_dim") is not None or not raw:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_file_type(ftype)
    if _ARCH[mt] in _LLAMA_LAYOUT:  # LlamaModel.set_gguf_parameters
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(cfg.head_dim)


# ---------------------------------------------------------------------------------------------- SmolLM3
def _check_smollm3(cfg) -> None:
    """llama.cpp's smollm3 runs NoPE on layers 3, 7, 11, ... (no metadata key says otherwise) and full attention
    everywhere: a model whose layers differ would run wrongly there, so it is refused, naming the config key."""
    n = cfg.num_hidden_layers
    want = tuple((i + 1) % SMOLLM3_GGUF_NOPE_STEP != 0 for i in range(n))
    have = cfg.layer_rope or (True,) * n
    if have != want:
        raise ConfigError(
            f"GGUF export of smollm3: llama.cpp hard-codes NoPE on every {SMOLLM3_GGUF_NOPE_STEP}th layer "
            f"(no_rope_layers {[int(r) for r in want]}), but this model's no_rope_layers is {[int(r) for r in have]}; "
            "save the merged model with save_pretrained_merged instead")
    if any(cfg.layer_windows):
        raise ConfigError("GGUF export of smollm3: llama.cpp's smollm3 has no sliding-window attention, but this "
                          "model sets use_sliding_window / sliding_window on some layers (layer_types); save the "
                          "merged model with save_pretrained_merged instead")


# ---------------------------------------------------------------------------------------------- Phi-3
def _phi3_original_context(model, raw: dict) -> int:
    cfg = model.config
    if cfg.rope_type == "longrope":
        return cfg.rope_original_max_position
    return int(raw.get("original_max_position_embeddings") or cfg.max_position_embeddings)


def _phi3_rope_dims(model) -> int:
    """The converter's rope_dims: int(partial_rotary_factor * hidden) // heads."""
    cfg = model.config
    return cfg.rope_dim * cfg.hidden_size // (cfg.num_attention_heads * cfg.head_dim)


def _phi3_rope_tensors(model) -> list[_Tensor]:
    """Phi3MiniModel.generate_extra_tensors: LongRoPE's factors, long then short, F32 [rope_dims / 2]."""
    gguf = _gguf()
    cfg = model.config
    if cfg.rope_type != "longrope":
        return []
    if len(cfg.rope_long_factor) * 2 != _phi3_rope_dims(model):
        raise ConfigError(f"LongRoPE factors have {len(cfg.rope_long_factor)} entries but llama.cpp's phi3 wants "
                          f"rope_dims / 2 = {_phi3_rope_dims(model) // 2}")
    Q = gguf.GGMLQuantizationType
    out = []
    for tensor, factors in ((gguf.MODEL_TENSOR.ROPE_FACTORS_LONG, cfg.rope_long_factor),
                            (gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT, cfg.rope_short_factor)):
        out.append(_Tensor(gguf.TENSOR_NAMES[tensor] + ".weight", (len(factors),), Q.F32,
                           lambda f=factors: np.asarray(f, np.float32)))
    return out


def _add_phi3_hparams(w, model, raw: dict, ftype) -> None:
    """Phi3MiniModel.set_gguf_parameters (it does not call TextModel's)."""
    cfg = model.config
    original = _phi3_original_context(model, raw)
    add_shape(w, cfg)
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_rope_dimension_count(_phi3_rope_dims(model))
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_file_type(ftype)
    windows = [x for x in cfg.layer_windows if x]
    w.add_sliding_window(int(raw.get("sliding_window") or (windows[0] if windows else 0)))
    if cfg.rope_type == "longrope":  # the converter derives the factor from the context lengths, not the config
        scale = cfg.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0)


# ---------------------------------------------------------------------------------------------- tokenizer
def _looks_special(text: str) -> bool:
    """convert_hf_to_gguf.py's does_token_look_special."""
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<｜") and text.endswith("｜>")) or (text.startswith("<unused") and text.endswith(">")))


def _pre_tokenizer(tokenizer, tok_json: dict) -> str:
    try:
        chkhsh = sha256(str(tokenizer.encode(_CHKTXT)).encode()).hexdigest()
    except Exception:  # noqa: BLE001 - an exotic tokenizer only loses the hash lookup
        chkhsh = None
    if chkhsh in _PRE_HASHES:
        return _PRE_HASHES[chkhsh]
    pre = tok_json.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    regexes = [p.get("pattern", {}).get("Regex") for p in parts if p.get("type") == "Split"]
    if _LLAMA3_PAT in regexes:
        return "llama-bpe"
    if _QWEN2_PAT in regexes:
        return "qwen2"
    if _QWEN35_PAT in regexes:
        return "qwen35"
    if not regexes and any(p.get("type") == "ByteLevel" and p.get("use_regex", True) for p in parts):
        return "gpt-2"
    log.warning("unsloth_jax: the BPE pre-tokenizer (hash %s) is not one llama.cpp's converter knows for the "
                "supported families; writing tokenizer.ggml.pre='default' (llama.cpp may split text differently)",
                chkhsh)
    return "default"


def _find_spm_model(model, tokenizer) -> Path | None:
    for d in (getattr(tokenizer, "name_or_path", None), model.model_dir):
        if d and (Path(d) / "tokenizer.model").is_file():
            return Path(d) / "tokenizer.model"
    return None


def _spm_vocab_from_model(path: Path, n_vocab: int, tok_config: dict, added_tokens_json: Path | None):
    """convert_hf_to_gguf.py's _create_vocab_sentencepiece."""
    from sentencepiece import SentencePieceProcessor

    gguf = _gguf()
    T = gguf.TokenType
    sp = SentencePieceProcessor()
    sp.LoadFromFile(str(path))
    tokens = [f"[PAD{i}]".encode() for i in range(n_vocab)]
    scores = [-10000.0] * n_vocab
    types = [T.UNUSED] * n_vocab
    for i in range(min(sp.vocab_size(), n_vocab)):
        piece = sp.IdToPiece(i)
        t = T.NORMAL
        if sp.IsUnknown(i):
            t = T.UNKNOWN
        elif sp.IsControl(i):
            t = T.CONTROL
        elif sp.IsUnused(i):
            t = T.UNUSED
        elif sp.IsByte(i):
            t = T.BYTE
        tokens[i], scores[i], types[i] = piece.encode(), sp.GetScore(i), t
    if added_tokens_json is not None and added_tokens_json.is_file():
        for key, tid in json.loads(added_tokens_json.read_text()).items():
            if tid < n_vocab:
                tokens[tid], scores[tid], types[tid] = key.encode(), -1000.0, T.USER_DEFINED
    for tid, data in (tok_config.get("added_tokens_decoder") or {}).items():
        tid = int(tid)
        if tid >= n_vocab:
            continue
        text = data["content"]
        if data.get("special") or _looks_special(text):
            types[tid] = T.CONTROL
        else:
            text = text.replace("\u2581", " ")
            types[tid] = T.USER_DEFINED
        scores[tid], tokens[tid] = -1000.0, text.encode()
    return tokens, scores, types


def _spm_vocab_from_json(tokenizer, tok_json: dict, n_vocab: int):
    """A SentencePiece-style ("llama") vocabulary from a byte-fallback BPE tokenizer.json: pieces, types as the
    converter assigns them, and merge-rank scores."""
    gguf = _gguf()
    T = gguf.TokenType
    model = tok_json["model"]
    merges = model.get("merges") or []
    rank: dict[str, int] = {}
    for k, m in enumerate(merges):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        rank.setdefault(a + b, k)
    tokens = [f"[PAD{i}]".encode() for i in range(n_vocab)]
    scores = [-1000.0] * n_vocab
    types = [T.UNUSED] * n_vocab
    unk = model.get("unk_token")
    dropped = 0
    for piece, tid in model["vocab"].items():
        if tid >= n_vocab:
            dropped += 1
            continue
        tokens[tid] = piece.encode()
        if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
            types[tid], scores[tid] = T.BYTE, 0.0
        elif piece == unk:
            types[tid], scores[tid] = T.UNKNOWN, 0.0
        else:
            types[tid], scores[tid] = T.NORMAL, -float(rank.get(piece, 0))
    special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for added in tok_json.get("added_tokens", []):
        tid, text = int(added["id"]), added["content"]
        if tid >= n_vocab:
            dropped += 1
            continue
        if added.get("special") or tid in special_ids or _looks_special(text):
            types[tid] = T.UNKNOWN if text == unk and not added.get("special") else T.CONTROL
        else:
            text = text.replace("\u2581", " ")
            types[tid] = T.USER_DEFINED
        tokens[tid], scores[tid] = text.encode(), -1000.0
    if dropped:
        log.warning("unsloth_jax: %d tokenizer token(s) have ids >= vocab_size %d and are not in the GGUF", dropped,
                    n_vocab)
    return tokens, scores, types


def _bpe_vocab(tokenizer, n_vocab: int):
    """convert_hf_to_gguf.py's get_vocab_base (byte-level BPE): tokens and types."""
    gguf = _gguf()
    T = gguf.TokenType
    vocab = tokenizer.get_vocab()
    if vocab and max(vocab.values()) >= n_vocab:
        raise ConfigError(f"the tokenizer has token ids up to {max(vocab.values())} but the model's vocab_size is "
                          f"{n_vocab}; resize the embeddings first")
    reverse = {i: t for t, i in vocab.items()}
    added_vocab = tokenizer.get_added_vocab()
    added_decoder = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(T.UNUSED)
            continue
        token = reverse[i]
        if token in added_vocab:
            if not added_decoder[i].normalized:
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            if added_decoder[i].special or _looks_special(token):
                types.append(T.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(T.USER_DEFINED)
        else:
            types.append(T.NORMAL)
        tokens.append(token)
    return tokens, types


def _add_vocab(w, model, tokenizer, raw_config: dict) -> None:
    # gguf.SpecialVocab logs template-parsing notes (e.g. "Unknown separator token") that concern llama.cpp's
    # own converter heuristics, not this export; keep them at debug level.
    vocab_log = logging.getLogger("gguf.vocab")
    level = vocab_log.level
    vocab_log.setLevel(logging.ERROR)
    try:
        _add_vocab_impl(w, model, tokenizer, raw_config)
    finally:
        vocab_log.setLevel(level)


def _add_vocab_impl(w, model, tokenizer, raw_config: dict) -> None:
    gguf = _gguf()
    cfg = model.config
    n_vocab = cfg.vocab_size
    with tempfile.TemporaryDirectory(prefix="unsloth_jax_gguf_tok_") as td:
        td = Path(td)
        tokenizer.save_pretrained(str(td))
        cfg_json = dict(raw_config) or {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
                                        "pad_token_id": cfg.pad_token_id}
        (td / "config.json").write_text(json.dumps(cfg_json))
        tok_config = json.loads((td / "tokenizer_config.json").read_text()) if (
            td / "tokenizer_config.json").is_file() else {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            tok_json = json.loads(backend.to_str())
        elif (td / "tokenizer.json").is_file():
            tok_json = json.loads((td / "tokenizer.json").read_text())
        else:
            tok_json = None
        spm_file = _find_spm_model(model, tokenizer)
        try:
            import sentencepiece  # noqa: F401
        except ImportError:
            spm_file = None
        model_json = (tok_json or {}).get("model", {})
        spm_like = model_json.get("type") == "BPE" and model_json.get("byte_fallback", False)
        if spm_file is not None and (spm_like or tok_json is None or cfg.model_type in ("gemma", "gemma2")):
            kind = "llama"
            added_json = spm_file.parent / "added_tokens.json"
            tokens, scores, types = _spm_vocab_from_model(spm_file, n_vocab, tok_config, added_json)
        elif tok_json is None:
            raise ConfigError("GGUF export needs a fast (tokenizer.json) tokenizer or a tokenizer.model file")
        elif spm_like:
            kind = "llama"
            tokens, scores, types = _spm_vocab_from_json(tokenizer, tok_json, n_vocab)
        elif model_json.get("type") == "BPE":
            kind = "gpt2"
            tokens, types = _bpe_vocab(tokenizer, n_vocab)
        else:
            raise ConfigError(f"tokenizer model type {model_json.get('type')!r} cannot be written to GGUF by "
                              "unsloth_jax (supported: byte-level BPE, and SentencePiece-style BPE or a "
                              "tokenizer.model file)")
        if cfg.model_type in ("gemma", "gemma2") and kind != "llama":
            raise ConfigError("Gemma GGUF export needs a SentencePiece-style tokenizer (tokenizer.model or a "
                              "byte-fallback BPE tokenizer.json), as llama.cpp's converter does")
        if kind == "llama":
            w.add_tokenizer_model("llama")
            w.add_tokenizer_pre("default")
            w.add_token_list(tokens)
            w.add_token_scores(scores)
            w.add_token_types(types)
            special = gguf.SpecialVocab(td, n_vocab=len(tokens))
        else:
            w.add_tokenizer_model("gpt2")
            w.add_tokenizer_pre(_pre_tokenizer(tokenizer, tok_json))
            w.add_token_list(tokens)
            w.add_token_types(types)
            special = gguf.SpecialVocab(td, load_merges=True)
        if cfg.model_type == "glm4_moe":
            added = tokenizer.get_added_vocab()
            for kind, text in _GLM_SPECIALS:
                if text in added:
                    special._set_special_token(kind, added[text])
        if cfg.model_type == "smollm3" and isinstance(special.chat_template, str):
            # SmolLM3Model.set_vocab: llama.cpp's template engine has no [:] slicing, which SmolLM3's uses
            special.chat_template = special.chat_template.replace("[:]", "")
        special.add_to_gguf(w, quiet=True)
        if _ARCH[cfg.model_type] in _LLAMA_LAYOUT and isinstance(tok_config.get("add_prefix_space"), bool):
            w.add_add_space_prefix(tok_config["add_prefix_space"])
        if cfg.model_type == "gemma":
            extra = gguf.SpecialVocab(td, load_merges=False, special_token_types=["eot"], n_vocab=n_vocab)
            extra._set_special_token("eot", 107)
            extra.chat_template = None
            extra.add_to_gguf(w, quiet=True)
        if cfg.model_type in ("gemma", "gemma2"):
            w.add_add_space_prefix(False)


# -------------------------------------------------------------------------------------------------- entry
def save_gguf(model, out_dir, tokenizer, *, quantization_method: str = "f16") -> str:
    """Write `out_dir/unsloth.<TYPE>.gguf` for the merged model (LoRA folded in, a 4-bit base dequantized) and
    return its path. quantization_method: f16 (default), bf16, q8_0, f32, q4_0, q4_1, q5_0, q5_1, or Unsloth's
    aliases "not_quantized" (f16) and "fast_quantized" (q8_0)."""
    cfg = model.config
    if cfg.source_layout:  # llama.cpp writes such a model as a text GGUF plus an mmproj file of its towers
        raise UnsupportedArchitectureError(
            f"GGUF export of the text decoder of a {cfg.source_layout!r} checkpoint (its vision/audio towers kept "
            "aside) is not supported; save the merged checkpoint with save_pretrained_merged and convert it with "
            "llama.cpp's convert_hf_to_gguf.py")
    if cfg.model_type not in _ARCH:
        what = "GGUF export of {} is not supported (mixture-of-experts)" if cfg.is_moe else \
            "GGUF export does not support model_type {!r}"
        raise UnsupportedArchitectureError(
            f"{what.format(cfg.model_type)} (supported: {', '.join(_ARCH)}); save the merged 16-bit model with "
            "save_pretrained_merged and convert it with llama.cpp's convert_hf_to_gguf.py")
    gguf = _gguf()
    method = resolve_method(quantization_method)
    if cfg.model_type == "smollm3":
        _check_smollm3(cfg)
    raw = _source_config(model)
    if cfg.model_type in gguf_families.ARCHS:
        gguf_families.check(cfg, raw)
    if tokenizer is None:
        if model.model_dir is None:
            raise ConfigError("save_gguf needs the tokenizer (pass the one from_pretrained returned)")
        if str(model.model_dir).lower().endswith(".gguf"):
            from unsloth_jax.hf.gguf_loading import gguf_tokenizer

            tokenizer = gguf_tokenizer(model.model_dir)
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model.model_dir))
    ftype = getattr(gguf.LlamaFileType, _METHODS[method][1])
    arch_name = gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, _ARCH[cfg.model_type])]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"unsloth.{_METHODS[method][0]}.gguf"
    plan = _plan_tensors(model, method)

    w = gguf.GGUFWriter(path=None, arch=arch_name)
    w.add_type(gguf.GGUFType.MODEL)
    name = Path(model.model_dir).name if model.model_dir else "unsloth_jax-model"
    w.add_name(name)
    for t in plan:
        nbytes = _nbytes(t.shape, t.qtype)
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), nbytes, raw_dtype=t.qtype)
    total, shared, expert, n_expert = w.get_total_parameter_count()
    if total > 0:
        w.add_size_label(gguf.size_label(total, shared, expert, n_expert))
    _add_hparams(w, model, raw, ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_vocab(w, model, tokenizer, raw)

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=out_dir)
    os.close(fd)
    try:
        chmod_like_new(tmp)  # mkstemp makes it 0600
        w.write_header_to_file(path=Path(tmp))
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in plan:
            data = _quantize(t.make(), t.qtype)
            w.write_tensor_data(data)
            del data
        w.close()
        os.replace(tmp, path)
    except BaseException:
        w.close()
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    export.announce("unsloth_jax: wrote %s (%s, %d tensors)", path, method, len(plan))
    return str(path)
