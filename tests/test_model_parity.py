"""Logits of every family equal transformers' (float32, relative error < 1e-5), with padding and windows; the
config parsing of Gemma 3 and Phi-3 (both RoPE spellings, LongRoPE, partial rotary, scan grouping)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.helpers import rel_err  # noqa: E402
from tests.hf_models import FAMILIES, save_hf_model  # noqa: E402
from unsloth_jax import FastLanguageModel  # noqa: E402
from unsloth_jax.families import text_config  # noqa: E402
from unsloth_jax.errors import ConfigError  # noqa: E402


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        out[family] = (path, save_hf_model(family, path, seed=len(family)))
    return out


def _hf_logits(model, ids, mask, positions=None):
    with torch.no_grad():
        kw = {"attention_mask": torch.tensor(mask)}
        if positions is not None:
            kw["position_ids"] = torch.tensor(positions)
        return model(torch.tensor(ids), **kw).logits.float().numpy()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers_right_padding(family, checkpoints, rng):
    path, hf = checkpoints[family]
    model, _ = FastLanguageModel.from_pretrained(path, dtype="float32", load_tokenizer=False, progress=False)
    b, s = 3, 24  # longer than the sliding windows (8) of mistral / gemma2
    ids = rng.integers(0, 256, size=(b, s)).astype(np.int64)
    lengths = np.array([s, s - 5, 11])
    mask = (np.arange(s)[None] < lengths[:, None]).astype(np.int64)
    ref = _hf_logits(hf, ids, mask)
    out = np.asarray(model(ids, attention_mask=mask))
    real = mask.astype(bool)
    err = rel_err(out[real], ref[real])
    assert err < 1e-5, f"{family}: relative error {err:.2e}"


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3", "gemma3", "phi3_longrope"])
def test_logits_match_transformers_left_padding(family, checkpoints, rng):
    path, hf = checkpoints[family]
    model, _ = FastLanguageModel.from_pretrained(path, dtype="float32", load_tokenizer=False, progress=False)
    b, s = 2, 20
    ids = rng.integers(0, 256, size=(b, s)).astype(np.int64)
    mask = np.ones((b, s), np.int64)
    mask[1, :7] = 0  # left padding
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    ref = _hf_logits(hf, ids, mask, positions)
    out = np.asarray(model(ids, attention_mask=mask))
    real = mask.astype(bool)
    err = rel_err(out[real], ref[real])
    assert err < 1e-5, f"{family}: relative error {err:.2e}"


def test_longrope_short_sequences_use_the_short_factors(checkpoints, rng):
    """Below original_max_position_embeddings (16) LongRoPE divides by short_factor; the right-padded test above
    (24 positions) covers long_factor. Both are checked against transformers."""
    path, hf = checkpoints["phi3_longrope"]
    model, _ = FastLanguageModel.from_pretrained(path, dtype="float32", load_tokenizer=False, progress=False)
    cfg = model.config
    assert cfg.rope_type == "longrope" and cfg.rotary_dim == 12 and cfg.rope_original_max_position == 16
    ids = rng.integers(0, 256, size=(2, 16)).astype(np.int64)  # largest position 15: short
    mask = np.ones_like(ids)
    mask[1, 11:] = 0
    ref = _hf_logits(hf, ids, mask)
    out = np.asarray(model(ids, attention_mask=mask))
    real = mask.astype(bool)
    assert rel_err(out[real], ref[real]) < 1e-5


def test_longrope_factor_follows_the_longest_row_not_the_padding(checkpoints, rng):
    """A right-padded batch 20 wide whose rows hold at most 16 tokens (a training batch padded to a bucket):
    the short factors, as transformers uses for the same rows given their positions (0, 1, ... as the data
    loader makes them), and for the same rows padded only to the longest (HF's collators). transformers' bare
    forward on the 20-wide batch counts the padding as positions and would pick the long factors."""
    path, hf = checkpoints["phi3_longrope"]
    model, _ = FastLanguageModel.from_pretrained(path, dtype="float32", load_tokenizer=False, progress=False)
    s, lengths = 20, np.array([16, int(rng.integers(5, 16))])
    ids = rng.integers(0, 256, size=(2, s)).astype(np.int64)
    mask = (np.arange(s)[None] < lengths[:, None]).astype(np.int64)
    real = mask.astype(bool)
    out = np.asarray(model(ids, attention_mask=mask))
    assert rel_err(out[real], _hf_logits(hf, ids, mask, np.where(real, np.arange(s)[None], 0))[real]) < 1e-5
    trimmed = _hf_logits(hf, ids[:, :16], mask[:, :16])
    assert rel_err(out[:, :16][real[:, :16]], trimmed[real[:, :16]]) < 1e-5
    positions = np.where(real, np.arange(s)[None], 0).astype(np.int32)
    with_positions = np.asarray(model(ids, attention_mask=mask, positions=positions))
    assert rel_err(with_positions[real], out[real]) < 1e-6
    assert rel_err(out[real], _hf_logits(hf, ids, mask)[real]) > 1e-3  # the bare 20-wide HF forward differs


GEMMA3_BASE = dict(model_type="gemma3_text", vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, sliding_window=8)


def test_gemma3_config_spellings_agree():
    """transformers 4's config.json (rope_theta, rope_local_base_freq, rope_scaling, sliding_window_pattern) and
    transformers 5's (rope_parameters per layer type, layer_types) give one ModelConfig; 26 layers group 4 x 6 + 2."""
    old = text_config(dict(GEMMA3_BASE, num_hidden_layers=26, rope_theta=1e6, rope_local_base_freq=1e4,
                                     rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window_pattern=6,
                                     query_pre_attn_scalar=256))
    types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(26)]
    new = text_config(dict(GEMMA3_BASE, num_hidden_layers=26, layer_types=types, query_pre_attn_scalar=256,
                                     rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                         "rope_theta": 1e6},
                                                      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}))
    assert old == new
    assert new.layer_period == 6 and new.num_hidden_layers % new.layer_period == 2
    assert new.layer_windows[:6] == (8, 8, 8, 8, 8, None) and new.layer_windows[24:] == (8, 8)
    assert (new.rope_type, new.rope_factor, new.rope_theta, new.rope_local_theta) == ("linear", 8.0, 1e6, 1e4)
    assert new.qk_norm and new.sandwich_norms and new.embed_scale and new.norm_offset == 1.0
    assert new.scale == pytest.approx(256 ** -0.5) and new.tie_word_embeddings
    # defaults of Gemma3TextConfig when the keys are absent: global base 1e6, local 1e4, every 6th layer global
    bare = text_config(dict(GEMMA3_BASE, num_hidden_layers=12))
    assert (bare.rope_theta, bare.rope_local_theta, bare.layer_windows[5], bare.layer_windows[11]) == (
        1e6, 1e4, None, None)
    with pytest.raises(ConfigError, match="use_bidirectional_attention"):
        text_config(dict(GEMMA3_BASE, num_hidden_layers=2, use_bidirectional_attention=True))


PHI3_BASE = dict(model_type="phi3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                 original_max_position_embeddings=32)


def test_phi3_rope_config():
    """"su" (the first Phi-3 128k configs) reads as longrope; factor and attention factor as transformers derives
    them; wrong factor lengths and odd partial rotary dims are refused naming the field."""
    factors = {"short_factor": [1.0] * 6, "long_factor": [2.0] * 6}
    cfg = text_config(dict(PHI3_BASE, partial_rotary_factor=0.75, rope_scaling={"type": "su", **factors}))
    assert cfg.rope_type == "longrope" and cfg.rotary_dim == 12 and cfg.rope_dim == 12
    assert cfg.rope_factor == 4.0 and cfg.rope_attention_factor == pytest.approx((1 + np.log(4) / np.log(32)) ** 0.5)
    assert cfg.rope_long_factor == (2.0,) * 6 and cfg.rope_original_max_position == 32
    plain = text_config(dict(PHI3_BASE, rope_theta=5e5))
    assert (plain.rope_type, plain.rope_theta, plain.rotary_dim, plain.rope_dim) == ("default", 5e5, 0, 16)
    with pytest.raises(ConfigError, match="long_factor"):
        text_config(dict(PHI3_BASE, rope_scaling={"type": "longrope", "short_factor": [1.0] * 8,
                                                            "long_factor": [1.0] * 7}))
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        text_config(dict(PHI3_BASE, partial_rotary_factor=0.5625))  # 9 dims
