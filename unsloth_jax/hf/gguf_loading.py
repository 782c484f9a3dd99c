"""A llama.cpp GGUF file as a model source: the config, the weights and the tokenizer, all from the one file.

    path = find_gguf("model.gguf")                  # or a directory holding exactly one .gguf (and no config.json)
    raw = hf_config(path)                           # the Hugging Face config.json dict the metadata describes
    model = load_gguf_model(path, jnp.bfloat16)     # a CausalLM (or subclass) holding the dequantized weights
    tokenizer = gguf_tokenizer(path)                # transformers fast tokenizer, chat template included

Facts from transformers' GGUF loader (integrations/ggml.py, modeling_gguf_pytorch_utils.py,
integrations/gguf/gguf_tokenizer_mapping.py) and llama.cpp (convert_hf_to_gguf.py, llama-vocab.cpp):

* architectures: llama, qwen2, qwen3, gemma, gemma2, phi3, smollm3, and qwen35 / glm4moe (Qwen3.5 text, GLM-4.5
  MoE: gguf_families.py inverts the export's transforms; their multi-token-prediction blocks are skipped); any
  other mixture-of-experts file (an `<arch>.expert_count`, qwen3moe, gpt-oss) raises
  UnsupportedArchitectureError. Metadata `<arch>.*` keys become config.json fields
  (embedding_length -> hidden_size, block_count -> num_hidden_layers, ...); the embeddings are tied when the
  file has no `output.weight`. Where the file is silent, llama.cpp's rule is used: Gemma 2's attention scale is
  head_dim ** -0.5, or (hidden / heads) ** -0.5 for the 46-layer 27B (transformers would take the config
  default 256). Phi-3's LongRoPE comes from the rope_factors_long / rope_factors_short tensors, Llama 3's
  rope_scaling from the rope_freqs tensor (transformers' GGUF loader drops both).
* tensors: every type the `gguf` package dequantizes (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the
  K-quants among them) is read with gguf.dequantize into float32, in numpy order (ggml's dims reversed). llama
  q/k rows are permuted back from llama.cpp's interleaved RoPE pairs to HF's rotate-half halves; Gemma norms
  are stored as 1 + w. Then each tensor takes the same path as a safetensors one (hf/loading.py's `place`).
* tokenizer: `tokenizer.ggml.model` "gpt2" is byte-level BPE with the file's merges and a split regex chosen
  by `tokenizer.ggml.pre` ("smollm" isolates every digit first, as llama.cpp does); "llama" is SentencePiece
  BPE with byte fallback whose merges are rebuilt from the token scores (Gemma: from token order; Phi-3: prefix
  space from a normalizer). CONTROL tokens become special added tokens, USER_DEFINED plain added ones.

Errors name the file and the metadata key or tensor: ConfigError (unreadable file, missing key, a type the
gguf package cannot dequantize), UnsupportedArchitectureError, Missing/UnexpectedTensorError, ShapeMismatchError.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from unsloth_jax.config import ModelConfig
from unsloth_jax.errors import (CheckpointNotFoundError, ConfigError, MissingTensorError, ShapeMismatchError,
                                UnexpectedTensorError, UnsupportedArchitectureError)
from unsloth_jax.families import TEXT_FAMILIES, text_config
from unsloth_jax.hf import gguf_families
from unsloth_jax.hf.gguf_common import llama3_rope_factors
from unsloth_jax.hf.loading import Placer, default_placer, model_from_params, place
from unsloth_jax.hf.mapping import tensor_specs
from unsloth_jax.models.decoder import CausalLM

log = logging.getLogger("unsloth_jax")

# GGUF architecture -> (config.json model_type, transformers class), from the families' gguf_read
ARCHS = {f.gguf_read[0]: (f.model_types[0], f.gguf_read[1]) for f in TEXT_FAMILIES if f.gguf_read}
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4  # llama.cpp token types
# tokenizer.ggml.pre -> the split regex its merges were learned with (llama.cpp's names; others: GPT-2's)
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
               "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
_PRE_SPLITS.update({"qwen35": _QWEN35_SPLIT, "glm4": _LLAMA3_SPLIT, "chatglm-bpe": _LLAMA3_SPLIT})  # llama-vocab.cpp
# llama.cpp's names of the MoE families unsloth_jax loads from safetensors only (Mixtral's GGUF files are
# "llama" with an expert_count; any file with an expert_count is refused the same way)
MOE_ARCHS = ("qwen3moe", "gpt-oss")


def _gguf():
    try:
        import gguf
    except ImportError as e:  # pragma: no cover
        raise ImportError("loading a GGUF file needs the `gguf` package: pip install gguf") from e
    return gguf


# ------------------------------------------------------------------------------------------------ the file
def find_gguf(path: str | os.PathLike) -> Path | None:
    """The GGUF file `path` names: a .gguf file, or a directory without config.json holding exactly one .gguf.
    None when `path` is something else (a Hugging Face directory). A directory with several .gguf files raises
    CheckpointNotFoundError listing them."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if len(files) > 1:
        raise CheckpointNotFoundError(f"{path}: holds {len(files)} GGUF files ({', '.join(p.name for p in files)}); "
                                      "pass the path of the one to load")
    return files[0] if files else None


class GGUFFile:
    """The metadata (`fields`: key -> value) and tensors (`tensors`: name -> gguf ReaderTensor) of one file."""

    def __init__(self, path: str | os.PathLike):
        gguf = _gguf()
        self.path = Path(path)
        try:
            reader = gguf.GGUFReader(str(self.path))
        except (ValueError, KeyError, IndexError, OSError, NotImplementedError) as e:
            raise ConfigError(f"{self.path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
        self.fields: dict = {}
        for key, field in reader.fields.items():
            try:
                self.fields[key] = field.contents()
            except (ValueError, UnicodeDecodeError, IndexError) as e:
                raise ConfigError(f"{self.path}: GGUF metadata key '{key}' cannot be read ({e})") from None
        self.tensors = {t.name: t for t in reader.tensors}
        self.arch = self.need("general.architecture")

    def need(self, key: str):
        """The value of metadata `key`; ConfigError naming the file and key when it is absent."""
        if key not in self.fields or self.fields[key] is None:
            raise ConfigError(f"{self.path}: GGUF metadata key '{key}' is missing")
        return self.fields[key]

    def get(self, key: str, default=None):
        value = self.fields.get(key)
        return default if value is None else value


# ---------------------------------------------------------------------------------------------- the config
def hf_config(path_or_file) -> dict:
    """The Hugging Face config.json dict of a GGUF file (what ModelConfig parses and a merged export writes)."""
    f = path_or_file if isinstance(path_or_file, GGUFFile) else GGUFFile(path_or_file)
    arch = f.arch
    experts = f.get(arch + ".expert_count", 0)
    if arch in MOE_ARCHS or (experts and arch not in gguf_families.READ_ARCHS):
        raise UnsupportedArchitectureError(
            f"{f.path}: a mixture-of-experts GGUF file (architecture {arch!r}"
            f"{f', {arch}.expert_count={experts}' if experts else ''}) is not supported as a model source; load the "
            "Hugging Face safetensors checkpoint instead (qwen3_moe, mixtral and gpt_oss load from there)")
    if arch not in ARCHS:
        raise UnsupportedArchitectureError(f"{f.path}: GGUF architecture {arch!r} is not supported (supported: "
                                           f"{', '.join(ARCHS)})")
    model_type, cls = ARCHS[arch]
    a = arch + "."
    heads = int(f.need(a + "attention.head_count"))
    kv_heads = f.get(a + "attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # llama.cpp may store one count per layer
        if len(set(kv_heads)) != 1:
            raise ConfigError(f"{f.path}: GGUF metadata key '{a}attention.head_count_kv' varies per layer "
                              f"({sorted(set(kv_heads))}); unsloth_jax needs one count")
        kv_heads = kv_heads[0]
    hidden = int(f.need(a + "embedding_length"))
    head_dim = int(f.get(a + "attention.key_length", hidden // heads))
    tokens = f.fields.get("tokenizer.ggml.tokens")
    vocab = f.get(a + "vocab_size", len(tokens) if tokens is not None else None)
    if vocab is None:
        raise ConfigError(f"{f.path}: GGUF metadata keys '{a}vocab_size' and 'tokenizer.ggml.tokens' are both "
                          "missing, so the vocabulary size is unknown")
    names = set(f.tensors)
    raw = {
        "model_type": model_type, "architectures": [cls],
        "vocab_size": int(vocab), "hidden_size": hidden,
        "intermediate_size": int(f.need(a + "feed_forward_length")),
        "num_hidden_layers": int(f.need(a + "block_count")),
        "num_attention_heads": heads, "num_key_value_heads": int(kv_heads), "head_dim": head_dim,
        "rms_norm_eps": float(f.need(a + "attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(f.get(a + "context_length", 4096)),
        "rope_theta": float(f.get(a + "rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": f.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": f.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": f.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    if model_type == "smollm3":  # llama.cpp hard-codes n_no_rope_layer_step = 4 and full attention
        raw["no_rope_layer_interval"] = 4
        raw["use_sliding_window"] = False
    if model_type in ("llama", "smollm3"):
        raw["attention_bias"] = "blk.0.attn_q.bias" in names
        raw["mlp_bias"] = "blk.0.ffn_gate.bias" in names
    rope_dims = f.get(a + "rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim and model_type not in ("phi3", "qwen3_5_text",
                                                                                 "glm4_moe"):
        raise ConfigError(f"{f.path}: GGUF metadata '{a}rope.dimension_count' = {rope_dims} rotates part of the "
                          f"{head_dim}-dim heads; partial RoPE is supported for phi3, qwen35 and glm4moe only")
    scaling = f.get(a + "rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ConfigError(f"{f.path}: GGUF metadata '{a}rope.scaling.type' = {scaling!r} is not supported "
                              "(only linear)")
        raw["rope_scaling"] = {"rope_type": "linear", "factor": float(f.need(a + "rope.scaling.factor"))}
    if "rope_freqs.weight" in names:
        raw["rope_scaling"] = _llama3_scaling(f, raw["rope_theta"], head_dim)
    if model_type == "gemma2":
        raw["hidden_activation"] = "gelu_pytorch_tanh"
        raw["attn_logit_softcapping"] = f.get(a + "attn_logit_softcapping")
        raw["final_logit_softcapping"] = f.get(a + "final_logit_softcapping")
        raw["sliding_window"] = int(f.need(a + "attention.sliding_window"))
        # llama.cpp: the 27B (46 layers) scales queries by (hidden / heads) ** -0.5, the others by head_dim ** -0.5
        raw["query_pre_attn_scalar"] = hidden // heads if raw["num_hidden_layers"] == 46 else head_dim
    if model_type == "gemma":
        raw["hidden_activation"] = "gelu_pytorch_tanh"
    if model_type == "phi3":
        raw.update(_phi3_config(f, head_dim))
    if arch in gguf_families.READ_ARCHS:
        raw.update(gguf_families.config_fields(f, raw, names))
    return raw


def _llama3_scaling(f: GGUFFile, theta: float, head_dim: int) -> dict:
    """Llama 3 rope_scaling from llama.cpp's rope_freqs tensor (the divisor of each inverse frequency).

    The factors are 1 below wavelength O/H, the scale F above O/L, and 1 / ((1 - s) / F + s) between, with
    s = (O / wavelength - L) / (H - L): linear in 1 / wavelength. F is the largest factor; two or more smooth
    factors fit s, and (O, L, H) are fixed up to a common scale that changes no factor, so L = 1. The recovered
    parameters must reproduce every factor (float32), else ConfigError."""
    factors = _dequantized(f, "rope_freqs.weight").reshape(-1).astype(np.float64)
    where = f"{f.path}: tensor 'rope_freqs.weight'"
    if factors.shape != (head_dim // 2,) or np.any(factors < 1 - 1e-6):
        raise ConfigError(f"{where} should hold {head_dim // 2} RoPE factors >= 1 (got {factors.shape[0]} values, "
                          f"min {factors.min():g})")
    scale = float(factors.max())
    inv = 1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim)))
    wavelen = 2 * np.pi / inv.astype(np.float64)
    smooth = (factors > 1 + 1e-5) & (factors < scale * (1 - 1e-5))
    if int(smooth.sum()) < 2:
        raise ConfigError(f"{where}: only {int(smooth.sum())} factor(s) lie between 1 and {scale:g}, too few to "
                          "recover the Llama 3 rope_scaling parameters; load the Hugging Face checkpoint instead")
    s = (1 / factors[smooth] - 1 / scale) / (1 - 1 / scale)
    slope, offset = np.polyfit(1 / wavelen[smooth], s, 1)  # s = O / (H - L) / wavelength - L / (H - L)
    low = 1.0
    high = low - low / offset
    original = int(round(slope * (high - low)))
    out = {"rope_type": "llama3", "factor": scale, "low_freq_factor": low, "high_freq_factor": round(high, 6),
           "original_max_position_embeddings": original}
    check = ModelConfig(model_type="llama", vocab_size=1, hidden_size=head_dim, intermediate_size=1, num_hidden_layers=1,
                        num_attention_heads=1, num_key_value_heads=1, head_dim=head_dim, rope_theta=theta,
                        rope_type="llama3", rope_factor=scale, rope_low_freq_factor=low,
                        rope_high_freq_factor=out["high_freq_factor"], rope_original_max_position=original)
    if not np.allclose(llama3_rope_factors(check), factors, rtol=1e-5, atol=0):
        raise ConfigError(f"{where}: the factors do not follow Llama 3's rope scaling (best fit {out}); load the "
                          "Hugging Face checkpoint instead")
    return out


def _phi3_config(f: GGUFFile, head_dim: int) -> dict:
    a = "phi3."
    out: dict = {"original_max_position_embeddings": int(f.get(a + "rope.scaling.original_context_length",
                                                                 f.get(a + "context_length", 4096)))}
    rope_dims = int(f.get(a + "rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        out["partial_rotary_factor"] = rope_dims / head_dim
    window = int(f.get(a + "attention.sliding_window", 0) or 0)
    out["sliding_window"] = window or None
    if "rope_factors_long.weight" in f.tensors:
        if "rope_factors_short.weight" not in f.tensors:
            raise MissingTensorError(f"{f.path}: has 'rope_factors_long.weight' but not 'rope_factors_short.weight'")
        long = _dequantized(f, "rope_factors_long.weight").reshape(-1)
        short = _dequantized(f, "rope_factors_short.weight").reshape(-1)
        out["rope_scaling"] = {"rope_type": "longrope", "long_factor": [float(x) for x in long],
                               "short_factor": [float(x) for x in short],
                               "attention_factor": float(f.need(a + "rope.scaling.attn_factor"))}
    return out


# ------------------------------------------------------------------------------------------------ tensors
def _dequantized(f: GGUFFile, name: str) -> np.ndarray:
    """Tensor `name` as float32 numpy in HF order (ggml's dims reversed)."""
    gguf = _gguf()
    t = f.tensors[name]
    try:
        data = gguf.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise ConfigError(f"{f.path}: tensor '{name}' has type {t.tensor_type.name}, which the gguf package cannot "
                          "dequantize") from None
    return np.asarray(data, np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (interleaved RoPE pairs per head) back to HF's rotate-half halves."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_names(cfg: ModelConfig, arch: str) -> dict:
    """GGUF tensor name -> the TensorSpec (hf/mapping.py) it fills, through gguf's own name tables."""
    gguf = _gguf()
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(arch_enum, cfg.num_hidden_layers)
    if arch in gguf_families.READ_ARCHS:
        return gguf_families.gguf_names(cfg, name_map)
    out = {}
    for hf_name, spec in tensor_specs(cfg).items():
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise UnsupportedArchitectureError(f"gguf has no {arch} tensor name for '{hf_name}'")
        out[name] = spec
    return out


_DERIVED = ("rope_factors_long.weight", "rope_factors_short.weight", "rope_freqs.weight")  # read into the config


def load_gguf_params(f: GGUFFile, cfg: ModelConfig, dtype, *, placer: Placer | None = None,
                     progress: bool = True) -> dict:
    """Every tensor of the GGUF file, dequantized, in the nested param dict of `cfg` (as hf.loading.load_params)."""
    placer = placer or default_placer
    by_name = gguf_names(cfg, f.arch)
    family = f.arch in gguf_families.READ_ARCHS
    unknown = [n for n in f.tensors if n not in by_name and n not in _DERIVED
               and not (family and gguf_families.is_mtp_tensor(cfg, n))]
    if unknown:
        shown = ", ".join(unknown[:8]) + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
        raise UnexpectedTensorError(f"{f.path}: tensors a {f.arch} model with this metadata does not use: {shown}")
    missing = [n for n in by_name if n not in f.tensors]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise MissingTensorError(f"{f.path}: GGUF file is missing {len(missing)} tensor(s): {shown}")
    permute = f.arch in ("llama", "smollm3")
    gemma_norms = f.arch in ("gemma", "gemma2")
    params: dict = {}
    held: dict = {}  # gguf_families.restore: the first half of a GLM-4.5 gate/up expert pair
    names = [n for n in f.tensors if n in by_name]
    for name in tqdm(names, desc=f"Loading {f.path.name}", unit="tensor", disable=not progress, leave=False):
        spec = by_name[name]
        w = _dequantized(f, name)
        if family:
            w = gguf_families.restore(cfg, name, w, held)
            if w is None:
                continue
        if w.shape != spec.hf_shape:
            raise ShapeMismatchError(f"{f.path}: tensor '{name}' has shape {list(w.shape)} (HF order), but the "
                                     f"metadata implies {list(spec.hf_shape)} for '{spec.hf_name}'")
        if permute and (".attn_q." in name or ".attn_k." in name):
            w = _unpermute(w, cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads)
        if gemma_norms and name.endswith("norm.weight"):
            w = w - np.float32(1)
        place(params, spec, w, dtype, placer, cfg, f"{f.path}: tensor '{name}'")
    return params


def load_gguf_model(path: str | os.PathLike, dtype, *, model_class=CausalLM, placer: Placer | None = None,
                    progress: bool = True):
    """A `model_class` computing in `dtype` holding the GGUF file's weights; its model_dir is the file's path
    (exports rebuild config.json and the tokenizer from it)."""
    f = GGUFFile(path)
    cfg = text_config(hf_config(f), source=f"{f.path} (GGUF metadata)")
    values = load_gguf_params(f, cfg, dtype, placer=placer, progress=progress)
    return model_from_params(values, cfg, dtype, model_class, f.path)


# ---------------------------------------------------------------------------------------------- tokenizer
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet byte-level BPE vocabularies are spelled in)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges that reproduce SentencePiece's highest-score-first merging: every split of every token into two
    vocabulary pieces, ranked by the token's score, then by the lengths of the pieces (longer first); ties keep
    token order, and a token's own splits are ordered by the pieces' ids."""
    merges = []
    for token, score in scores.items():
        local = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges += [(score, left, right) for left, right in local]
    merges.sort(key=lambda m: (-m[0], -len(m[1]), -len(m[2])))
    return [(left, right) for _, left, right in merges]


def _backend(f: GGUFFile):
    """The `tokenizers.Tokenizer` the file describes, with its added tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    kind = f.need("tokenizer.ggml.model")
    tokens = list(f.need("tokenizer.ggml.tokens"))
    types = list(f.get("tokenizer.ggml.token_type", []))
    if kind == "gpt2":
        alphabet = _byte_alphabet()
        letters = set(alphabet.values())
        vocab = {(t if set(t) <= letters else "".join(alphabet[b] for b in t.encode())): i for i, t in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in f.need("tokenizer.ggml.merges")]
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                   end_of_word_suffix="", fuse_unk=False))
        pre = f.get("tokenizer.ggml.pre", "default")
        if pre in _PRE_SPLITS:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        elif pre == "smollm":  # llama.cpp: every digit on its own, then GPT-2's split
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False)])
        else:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        control_ok = letters
    elif kind == "llama":
        scores = f.need("tokenizer.ggml.scores")
        if f.arch in ("gemma", "gemma2"):  # runs of spaces are stored as spaces; merges follow token order
            tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
            scores = [-float(i) for i in range(len(tokens))]
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = _merges_from_scores(vocab, dict(zip(tokens, scores)))
        decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if f.arch in ("gemma", "gemma2"):
            unk = f.get("tokenizer.ggml.unknown_token_id")
            tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None,
                                       unk_token=tokens[unk] if unk is not None else None))
            tok.normalizer = normalizers.Replace(" ", "\u2581")
            tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
        else:
            tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
            prefix = bool(f.get("tokenizer.ggml.add_space_prefix", True))
            if f.arch == "phi3":  # Phi-3's own tokenizer.json: the prefix space comes from a normalizer
                tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                       normalizers.Replace(" ", "\u2581")])
            else:
                tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581",
                                                             prepend_scheme="first" if prefix else "never",
                                                             split=False)
            if prefix:
                decode.append(decoders.Strip(content=" ", left=1))
        tok.decoder = decoders.Sequence(decode)
        control_ok = None
    else:
        raise ConfigError(f"{f.path}: GGUF metadata 'tokenizer.ggml.model' = {kind!r} is not supported (gpt2 for "
                          "byte-level BPE, llama for SentencePiece)")
    control = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types)
               if k == TOKEN_CONTROL and (control_ok is None or set(t) <= control_ok)]
    tok.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types)
            if k == TOKEN_USER_DEFINED and t in vocab]
    tok.add_tokens(user)
    return tok, tokens


def gguf_tokenizer(path_or_file):
    """A transformers PreTrainedTokenizerFast built from the file's tokenizer metadata: vocabulary, merges,
    BOS/EOS/UNK/PAD, add_bos/add_eos (SentencePiece vocabularies add BOS unless the file says otherwise, as
    llama.cpp does) and the chat template."""
    from transformers import PreTrainedTokenizerFast

    f = path_or_file if isinstance(path_or_file, GGUFFile) else GGUFFile(path_or_file)
    tok, tokens = _backend(f)
    special = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                      ("pad_token", "padding_token_id")):
        tid = f.get(f"tokenizer.ggml.{key}")
        if tid is not None:
            if not 0 <= int(tid) < len(tokens):
                raise ConfigError(f"{f.path}: GGUF metadata 'tokenizer.ggml.{key}' = {tid} is outside the "
                                  f"{len(tokens)}-token vocabulary")
            special[name] = tokens[int(tid)]
    kind = f.need("tokenizer.ggml.model")
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, clean_up_tokenization_spaces=False, chat_template=f.get("tokenizer.chat_template"),
        add_bos_token=bool(f.get("tokenizer.ggml.add_bos_token", kind == "llama")),
        add_eos_token=bool(f.get("tokenizer.ggml.add_eos_token", False)), **special)
    out.name_or_path = str(f.path)
    return out
