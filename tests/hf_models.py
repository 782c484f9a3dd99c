"""Tiny random-init transformers checkpoints of every supported family, for parity tests (needs torch)."""
from __future__ import annotations

import copy

import torch

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)

FAMILIES = {
    "llama": dict(tie_word_embeddings=False),
    "llama3_scaled": dict(tie_word_embeddings=True, rope_theta=500000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama_linear": dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "mistral": dict(sliding_window=8),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(head_dim=32, tie_word_embeddings=False),
    "gemma": dict(head_dim=32, hidden_activation="gelu_pytorch_tanh"),
    "gemma2": dict(head_dim=32, num_hidden_layers=4, sliding_window=8, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0, query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh"),
    # 8 layers with every 3rd global: scan groups of 3 plus a tail of 2; global RoPE linear-scaled, local base
    "gemma3": dict(head_dim=32, num_hidden_layers=8, sliding_window=8, sliding_window_pattern=3,
                   query_pre_attn_scalar=24, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                   rope_scaling={"rope_type": "linear", "factor": 8.0}, hidden_activation="gelu_pytorch_tanh"),
    # transformers' Gemma 3 ignores attn_logit_softcapping (never passes it to attention); the final one applies
    "gemma3_softcap": dict(head_dim=32, num_hidden_layers=4, sliding_window=8, sliding_window_pattern=2,
                           attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=32,
                           tie_word_embeddings=False, hidden_activation="gelu_pytorch_tanh"),
    "phi3": dict(sliding_window=8, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    # LongRoPE (long factors past 16 positions) on 12 of 16 head dims
    "phi3_longrope": dict(max_position_embeddings=64, original_max_position_embeddings=16, partial_rotary_factor=0.75,
                          bos_token_id=1, eos_token_id=2, pad_token_id=0,
                          rope_scaling={"type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                        "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]}),
}
MODEL_TYPES = {"gemma3": "gemma3_text"}  # family prefix -> model_type, where they differ

# ---- SmolLM3 (tests/test_smollm3.py) ----
# "smollm3": SmolLM3Config's default NoPE pattern (every 4th layer: layer 3 of 4), tied embeddings (its default);
# "smollm3_sliding": every 3rd layer NoPE and, by SmolLM3Config's layer_types rule, sliding (window 8): a scan
# group of 3 layers and a tail of 1; untied
FAMILIES.update({
    "smollm3": dict(num_hidden_layers=4, bos_token_id=1, eos_token_id=2, pad_token_id=0, rope_theta=50000.0),
    "smollm3_sliding": dict(num_hidden_layers=4, no_rope_layer_interval=3, use_sliding_window=True, sliding_window=8,
                            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0),
})

# ---- Qwen3.5 (tests/test_qwen3_5.py) ----
# "qwen35": qwen3_5_text with its default pattern (every 4th layer full attention, the others linear), GQA in
# both mixers (4 value heads on 2 key heads), partial rotary 0.25 of a 16-dim head; 5 layers
# (one layer segment: a group of 5)
FAMILIES.update({
    "qwen35": dict(num_hidden_layers=5, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=8, linear_value_head_dim=8, bos_token_id=1, eos_token_id=2, pad_token_id=0),
})
MODEL_TYPES["qwen35"] = "qwen3_5_text"
# ---- Gemma 4 text (tests/test_gemma4.py) ----
# 8 layers, 5 sliding : 1 full (the last forced full): s s s s s g | s g, the last 2 KV-shared (layer 6 reads
# layer 4's keys/values, layer 7 layer 5's); window 8; per-layer inputs of width 16; proportional RoPE on the full
# layers (a quarter of the frequencies); final softcap
MODEL_TYPES["gemma4"] = "gemma4_text"
FAMILIES.update({
    "gemma4": dict(head_dim=32, global_head_dim=32, num_hidden_layers=8, sliding_window=8,
                   hidden_size_per_layer_input=16, vocab_size_per_layer_input=256, num_kv_shared_layers=2,
                   final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh", bos_token_id=2,
                   eos_token_id=1, pad_token_id=0),
})


def model_type_of(family: str) -> str:
    prefix = family.split("_")[0].replace("llama3", "llama")
    return MODEL_TYPES.get(prefix, prefix)


def tiny_config(model_type: str, fields: dict):
    """A transformers config of `model_type` from a deep copy of `fields` (transformers writes into the nested
    dicts it is given, e.g. rope_theta into rope_scaling, which would leak into later tests), eager attention."""
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **copy.deepcopy(fields))
    config._attn_implementation = "eager"
    return config


def make_hf_model(family: str, seed: int = 0, dtype=torch.float32, **overrides):
    """A transformers causal LM of `family` (config fields `overrides` changed) with every parameter randomised
    (norms around 1, biases nonzero)."""
    import transformers

    model_type = model_type_of(family)
    config = tiny_config(model_type, dict(TINY) | FAMILIES[family] | overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale (a checkpoint buffer)
                b.copy_(1.0 + 0.3 * torch.randn(b.shape, generator=gen))
        for name, p in model.named_parameters():
            if "norm" in name:
                base = 0.0 if model_type in ("gemma", "gemma2", "gemma3_text") else 1.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
    model.eval()
    return model


def save_hf_model(family: str, path, seed: int = 0, dtype=torch.float32, **overrides):
    model = make_hf_model(family, seed, dtype, **overrides)
    model.save_pretrained(str(path))
    return model


def train_spm_tokenizer(out_dir, seed: int, chat_template: str | None = None):
    """A SentencePiece BPE model with byte fallback (320 pieces; <unk> <s> </s> = 0 1 2) trained on fresh random
    text in `out_dir`, and beside it in out_dir/"hf" the files of its transformers LlamaTokenizer. Returns that
    directory."""
    import json
    from pathlib import Path

    import numpy as np
    import sentencepiece as spm

    d = Path(out_dir)
    rng = np.random.default_rng(seed)
    words = ["".join(rng.choice(list("abcdefghijklmnopqrst"), size=rng.integers(2, 8))) for _ in range(300)]
    (d / "corpus.txt").write_text("\n".join(" ".join(rng.choice(words, size=12)) for _ in range(600)))
    spm.SentencePieceTrainer.train(input=str(d / "corpus.txt"), model_prefix=str(d / "tok"), vocab_size=320,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0, unk_id=0,
                                   bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    (d / "hf").mkdir()
    (d / "hf" / "tokenizer.model").write_bytes((d / "tok.model").read_bytes())
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
              "add_bos_token": True, "legacy": False}
    if chat_template:
        config["chat_template"] = chat_template
    (d / "hf" / "tokenizer_config.json").write_text(json.dumps(config))
    return d / "hf"
