"""Gemma 4 as released (config.json model_type "gemma4", transformers' Gemma4ForConditionalGeneration: the gemma4_text
decoder under model.language_model.*, vision and audio towers beside it) through FastLanguageModel: its text decoder
loads alone (the towers stay on disk), and its saves are of the checkpoint's own type. Against transformers / PEFT
in float32 on a tiny random model (global_head_dim != head_dim, KV-shared layers): text logits, a LoRA step, the
PEFT adapter (our keys and PEFT's), the merged checkpoint (towers copied byte for byte), and the refusals."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from tests.conftest import fresh_seed  # noqa: E402
from tests.family_checks import load_f32, lora_steps_lower_the_loss, right_padded, torch_logits  # noqa: E402
from tests.helpers import rel_err  # noqa: E402
from unsloth_jax import FastLanguageModel, FastVisionModel  # noqa: E402
from unsloth_jax.errors import ConfigError, UnsupportedArchitectureError  # noqa: E402
from unsloth_jax.families import text_config  # noqa: E402
from unsloth_jax.hf.safetensors_io import SafetensorsFile, checkpoint_files  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
# 8 layers s s s s s g | s g, the last 2 KV-shared; full layers at head_dim 32, sliding ones at 16; window 8
TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=8, hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=256, num_kv_shared_layers=2, final_logit_softcapping=30.0,
            hidden_activation="gelu_pytorch_tanh", bos_token_id=2, eos_token_id=1, pad_token_id=0)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
              head_dim=16, patch_size=4, pooling_kernel_size=2, position_embedding_size=64)
AUDIO = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, subsampling_conv_channels=[8, 4],
             output_proj_dims=48, conv_kernel_size=3)
# the multimodal tokens inside the tiny vocabulary, above the ids the tests draw (right_padded: below 240)
TOKENS = dict(image_token_id=250, audio_token_id=251, boi_token_id=252, eoi_token_id=253, boa_token_id=254,
              eoa_token_index=255, video_token_id=249)


def _hf_model(seed: int):
    """A Gemma4ForConditionalGeneration with every parameter and layer scalar random (norms around 1)."""
    config = transformers.Gemma4Config(text_config=dict(TEXT), vision_config=dict(VISION),
                                       audio_config=dict(AUDIO), **TOKENS)
    torch.manual_seed(seed)
    model = transformers.Gemma4ForConditionalGeneration(config)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(1.0 + 0.3 * torch.randn(b.shape, generator=gen))
        for name, p in model.named_parameters():
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + (0.2 if "norm" in name else 0.08) * torch.randn(p.shape, generator=gen))
    return model.eval()


def _hf_f32(path):
    return transformers.Gemma4ForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32,
                                                                       attn_implementation="eager").eval()


def _tensors(path, prefixes) -> dict[str, tuple[str, tuple, bytes]]:
    """name -> (dtype, shape, raw bytes) of the checkpoint's tensors under `prefixes`."""
    out = {}
    for file in checkpoint_files(path):
        with SafetensorsFile(file) as f:
            for name in f.keys():
                if name.startswith(prefixes):
                    out[name] = (str(f.dtype(name)), f.shape(name), np.array(f.get(name)).tobytes())
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(source dir, transformers' model of it)."""
    path = tmp_path_factory.mktemp("gemma4mm")
    hf = _hf_model(fresh_seed("gemma4 multimodal model") % (1 << 31))
    hf.save_pretrained(str(path))
    (path / "processor_config.json").write_text(json.dumps({"processor_class": "Gemma4Processor"}))  # copied on export
    return path, hf


def test_config_notice_logits_and_refusals(tiny, rng, capsys):
    """config.json of model_type gemma4 parses to its text_config's gemma4_text ModelConfig plus the recorded
    layout; FastLanguageModel says in one line that the towers stay on disk, and its logits on right-padded rows
    (20 and 13 tokens, past the window) equal transformers' Gemma4ForConditionalGeneration on input_ids alone.
    FastVisionModel and GGUF export refuse it; a gemma4 config without a text_config is refused naming the key."""
    path, hf = tiny
    raw = json.loads((path / "config.json").read_text())
    cfg = text_config(raw)
    assert cfg.source_layout == "gemma4" and cfg.model_type == "gemma4_text"
    assert cfg == dataclasses.replace(text_config(raw["text_config"]), source_layout="gemma4")
    assert (cfg.global_head_dim, cfg.head_dim, cfg.layer_kv_source) == (32, 16, (0, 1, 2, 3, 4, 5, 4, 5))
    with pytest.raises(ConfigError, match="text_config"):
        text_config({"model_type": "gemma4"})
    model = load_f32(path)
    notice = [line for line in capsys.readouterr().out.splitlines() if "Gemma4ForConditionalGeneration" in line]
    assert len(notice) == 1 and "model.vision_tower.*" in notice[0] and "model.audio_tower.*" in notice[0]
    assert not any(k.startswith(("vision", "audio", "embed_vision")) for k in vars(model))
    ids, mask = right_padded(rng, [20, 13], vocab=240)
    real = mask.astype(bool)
    # 2e-4 as tests/test_gemma4.py's logits bound (float32 rounding over 8 layers)
    assert rel_err(np.asarray(model(ids, mask))[real], torch_logits(hf, ids, mask)[real]) < 2e-4
    assert rel_err(np.asarray(model(ids[:1, :20])), torch_logits(hf, ids[:1, :20])) < 2e-4  # input_ids alone
    with pytest.raises(UnsupportedArchitectureError, match="FastLanguageModel.from_pretrained loads its text decoder"):
        FastVisionModel.from_pretrained(path, load_processor=False)
    with pytest.raises(UnsupportedArchitectureError, match="GGUF export of the text decoder of a 'gemma4'"):
        model.save_pretrained_gguf(path.parent / "gguf", None, quantization_method="f32")


def test_lora_step_adapter_and_merged_export(tiny, tmp_path, rng):
    """One SFT step lowers the loss; with every lora_b random, the PEFT adapter (keys under
    base_model.model.model.language_model.layers, adapter_config.json naming the source) loads in PEFT on
    transformers' Gemma4ForConditionalGeneration with our logits and back here; the merged checkpoint is a
    Gemma4ForConditionalGeneration (config.json the source's) that transformers loads with no missing /
    unexpected keys, its tower tensors bit-equal to the source's, with our logits; the processor file copied."""
    path, _ = tiny
    model = FastLanguageModel.get_peft_model(load_f32(path), r=4, lora_alpha=8, target_modules=ALL,
                                             random_state=int(rng.integers(1 << 30)))
    g, t1, f = lora_steps_lower_the_loss(model, rng, vocab=240, lr=1e-4)  # lr as tests/test_gemma4.py's
    model = nnx.merge(g, t1, f)
    for lin in model.projection_stacks().values():
        lin.lora_b[...] = np.asarray(0.05 * rng.standard_normal(lin.lora_b[...].shape), np.float32)
    ids, mask = right_padded(rng, [18, 11], vocab=240)
    real = mask.astype(bool)
    ours = np.asarray(model(ids, mask))

    model.save_pretrained(tmp_path / "adapter")
    with SafetensorsFile(tmp_path / "adapter" / "adapter_model.safetensors") as fh:
        keys = set(fh.keys())
    assert "base_model.model.model.language_model.layers.5.self_attn.k_proj.lora_A.weight" in keys
    assert all(k.startswith("base_model.model.model.language_model.layers.") for k in keys)
    assert not any(".layers.6.self_attn.k_proj" in k or ".layers.7.self_attn.v_proj" in k for k in keys)
    adapter_cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == str(path.resolve())
    pm = peft.PeftModel.from_pretrained(_hf_f32(path), str(tmp_path / "adapter"))
    # 5e-4 as tests/test_gemma4.py's adapter bound (float32 rounding with random LoRA pairs has a heavy tail)
    assert rel_err(ours[real], torch_logits(pm, ids, mask)[real]) < 5e-4
    back = load_f32(tmp_path / "adapter")  # the adapter directory: its base, then the adapter
    assert rel_err(np.asarray(back(ids, mask))[real], ours[real]) < 1e-5

    model.save_pretrained_merged(tmp_path / "merged", None, dtype="float32")
    source_cfg = json.loads((path / "config.json").read_text())
    assert json.loads((tmp_path / "merged" / "config.json").read_text()) == source_cfg | {"dtype": "float32"}
    assert _tensors(tmp_path / "merged", TOWERS) == _tensors(path, TOWERS) != {}
    assert (tmp_path / "merged" / "processor_config.json").read_text() == (path / "processor_config.json").read_text()
    merged, info = transformers.Gemma4ForConditionalGeneration.from_pretrained(
        str(tmp_path / "merged"), dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert rel_err(ours[real], torch_logits(merged.eval(), ids, mask)[real]) < 5e-4  # as PEFT's above


def test_peft_made_adapter_loads(tiny, tmp_path, rng):
    """An adapter PEFT makes on transformers' Gemma4ForConditionalGeneration (random A and B on the language
    model's projections, a target_modules regex as the towers have projections of the same names) loads here
    with PEFT's logits."""
    from unsloth_jax.hf.peft_io import load_adapter

    path, _ = tiny
    torch.manual_seed(int(rng.integers(1 << 30)))
    targets = rf".*language_model\.layers\.\d+\.(?:self_attn|mlp)\.(?:{'|'.join(ALL)})"
    pm = peft.get_peft_model(_hf_f32(path), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                          init_lora_weights=False))
    pm.save_pretrained(str(tmp_path / "adapter"))
    model = load_adapter(load_f32(path), tmp_path / "adapter")
    assert set(model.lora.target_modules) == set(ALL)
    ids, mask = right_padded(rng, [12, 7], vocab=240)
    real = mask.astype(bool)
    # 2e-4 as the logits test
    assert rel_err(np.asarray(model(ids, mask))[real], torch_logits(pm, ids, mask)[real]) < 2e-4
