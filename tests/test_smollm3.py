"""SmolLM3 (model_type smollm3): Llama's layer with NoPE layers (config `no_rope_layers` / `no_rope_layer_interval`)
and SmolLM3Config's sliding-window rule. Logits equal transformers' SmolLM3ForCausalLM in float32 (right-padded
rows), one LoRA step lowers the loss with gradients on the LoRA factors only, the PEFT adapter and the merged
checkpoint load in PEFT / transformers with our logits, greedy generation on the engine equals transformers',
and GGUF export (llama.cpp's smollm3: NoPE every 4th layer, hard-coded) or a clear refusal."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from tests.conftest import fresh_seed  # noqa: E402
from tests.family_checks import assert_greedy_matches_transformers, load_f32, hf_f32, torch_logits, right_padded, trained_with_random_b  # noqa: E402
from tests.helpers import rel_err  # noqa: E402
from tests.hf_models import save_hf_model  # noqa: E402
from unsloth_jax import FastLanguageModel  # noqa: E402
from unsloth_jax.families import text_config  # noqa: E402
from unsloth_jax.errors import ConfigError  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BASE = dict(model_type="smollm3", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (source dir, transformers model, our model), built once per module."""
    cache = {}

    def get(family):
        if family not in cache:
            path = tmp_path_factory.mktemp(family)
            hf = save_hf_model(family, path, seed=fresh_seed(f"{family} model") % (1 << 31))
            cache[family] = (path, hf, load_f32(path))
        return cache[family]

    return get










# ------------------------------------------------------------------------------------------------ config
def test_config_nope_pattern_and_windows():
    """no_rope_layer_interval (default 4) and no_rope_layers give the per-layer RoPE switch; the scan period
    follows it (6 layers, NoPE at 3: period 4 and a tail of 2); a pattern that never repeats is one group of L;
    NoPE layers slide only with use_sliding_window and a sliding_window (SmolLM3Config's layer_types rule); bad
    values raise ConfigError naming the key."""
    cfg = text_config(BASE)
    assert cfg.layer_rope == (True, True, True, False, True, True) and cfg.layer_period == 4
    assert cfg.has_nope_layers and cfg.tie_word_embeddings and cfg.layer_windows == (None,) * 6
    assert text_config(BASE | {"no_rope_layer_interval": 2}).layer_period == 2
    odd = text_config(BASE | {"no_rope_layers": [0, 1, 1, 1, 1, 1]})
    assert odd.layer_rope[0] is False and odd.layer_period == 6
    all_rope = text_config(BASE | {"no_rope_layers": [1] * 6})
    assert all_rope.layer_rope == () and not all_rope.has_nope_layers and all_rope.layer_period == 1
    slide = text_config(BASE | {"use_sliding_window": True, "sliding_window": 8})
    assert slide.layer_windows == (None, None, None, 8, None, None)
    # layer_types is obeyed only with use_sliding_window (transformers' SmolLM3Attention)
    types = ["sliding_attention", "full_attention"] * 3
    assert text_config(BASE | {"layer_types": types, "sliding_window": 8}).layer_windows == (None,) * 6
    assert text_config(BASE | {"layer_types": types, "sliding_window": 8, "use_sliding_window": True}
                                 ).layer_windows == (8, None) * 3
    for bad, key in [({"no_rope_layers": [1, 0]}, "no_rope_layers"), ({"no_rope_layers": [1, 2, 1, 1, 1, 1]},
                                                                        "no_rope_layers"),
                     ({"no_rope_layer_interval": 0}, "no_rope_layer_interval"),
                     ({"layer_types": ["sliding_attention"] * 6, "use_sliding_window": True}, "sliding_window"),
                     ({"layer_types": ["chunked_attention"] * 6}, "layer_types")]:
        with pytest.raises(ConfigError, match=key):
            text_config(BASE | bad)


# ------------------------------------------------------------------------------------------------ logits
@pytest.mark.parametrize("family", ["smollm3", "smollm3_sliding"])
def test_logits_match_transformers_right_padded(family, tiny, rng):
    """Two right-padded rows (20 and 13 tokens, past the window of 8): logits of every real token equal
    transformers' SmolLM3ForCausalLM in float32 (the default NoPE pattern; and every 3rd layer NoPE + sliding,
    a scan group of 3 and a tail of 1)."""
    _, hf, model = tiny(family)
    assert model.config.has_nope_layers
    ids, mask = right_padded(rng, [20, 13])
    ours, theirs = np.asarray(model(ids, mask)), torch_logits(hf, ids, mask)
    real = mask.astype(bool)
    assert rel_err(ours[real], theirs[real]) < 1e-5


# ------------------------------------------------------------------------------------------------ LoRA
def test_lora_step_peft_adapter_and_merged_export(tiny, tmp_path, rng):
    """One SFT step lowers the loss and changes only LoRA factors (the trainable state is LoRA only); with every
    lora_b random, the PEFT adapter loads in PEFT on transformers' model with our logits, and the merged
    checkpoint loads in transformers (SmolLM3ForCausalLM) with our logits."""
    path, _, _ = tiny("smollm3")
    model = FastLanguageModel.get_peft_model(load_f32(path), r=4, lora_alpha=8, target_modules=ALL,
                                             use_gradient_checkpointing=True, random_state=int(rng.integers(1 << 30)))
    model, ids, mask, real, ours = trained_with_random_b(model, rng)
    model.save_pretrained(tmp_path / "adapter")
    pm = peft.PeftModel.from_pretrained(hf_f32(path), str(tmp_path / "adapter"))
    assert rel_err(ours[real], torch_logits(pm, ids, mask)[real]) < 1e-5
    model.save_pretrained_merged(tmp_path / "merged", None, dtype="float32")
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["model_type"] == "smollm3" and config["no_rope_layers"] == [1, 1, 1, 0]
    merged = hf_f32(tmp_path / "merged")
    assert type(merged).__name__ == "SmolLM3ForCausalLM"
    assert rel_err(ours[real], torch_logits(merged, ids, mask)[real]) < 1e-5


# ------------------------------------------------------------------------------------------------ generation
@pytest.mark.parametrize("family", ["smollm3", "smollm3_sliding"])
def test_greedy_generation_matches_transformers(family, tiny, rng):
    """Greedy tokens of a left-padded batch on the engine equal transformers' generate (NoPE layers in the
    prefill and decode steps; the sliding NoPE layers' window of 8 passed)."""
    _, hf, model = tiny(family)
    assert_greedy_matches_transformers(hf, model, rng, [9, 4], new=6, eos=2)


# ------------------------------------------------------------------------------------------------ GGUF
def test_gguf_export_roundtrip_and_refusals(tiny, tmp_path, rng):
    """save_pretrained_gguf writes llama.cpp's smollm3 architecture (llama's tensors, q/k rows in its interleaved
    RoPE layout; the chat template without [:] slicing); read back as a model source (NoPE every 4th layer, as
    llama.cpp hard-codes) it gives our logits. A NoPE pattern llama.cpp would run differently, or sliding
    windows, is refused naming the key."""
    gguf = pytest.importorskip("gguf")
    from tests.hf_models import make_hf_model
    from unsloth_jax.hf.gguf_loading import hf_config

    asset = __import__("pathlib").Path(__file__).resolve().parents[1] / "unsloth_jax" / "assets" / "tiny-llama"
    tok = transformers.AutoTokenizer.from_pretrained(str(asset))
    tok.chat_template = "{% for m in messages[:] %}{{ m['content'] }}{% endfor %}"
    src = tmp_path / "src"
    make_hf_model("smollm3", seed=fresh_seed("smollm3 gguf") % (1 << 31), vocab_size=len(tok)).save_pretrained(str(src))
    model = load_f32(src)
    out = model.save_pretrained_gguf(tmp_path / "gguf", tok, quantization_method="f32")
    reader = gguf.GGUFReader(out)
    field = lambda k: bytes(reader.fields[k].parts[reader.fields[k].data[0]]).decode()  # noqa: E731
    assert field("general.architecture") == "smollm3"
    assert field("tokenizer.chat_template") == "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert {"blk.3.attn_q.weight", "token_embd.weight", "output_norm.weight"} <= {t.name for t in reader.tensors}
    assert hf_config(out)["model_type"] == "smollm3"
    back = load_f32(out)
    assert back.config.layer_rope == model.config.layer_rope
    ids = rng.integers(3, len(tok), size=(2, 12))
    assert rel_err(np.asarray(back(ids)), np.asarray(model(ids))) < 1e-5
    _, _, sliding = tiny("smollm3_sliding")
    with pytest.raises(ConfigError, match="no_rope_layers"):
        sliding.save_pretrained_gguf(tmp_path / "gguf2", tok, quantization_method="f32")
