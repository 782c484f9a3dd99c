"""Phi-3's fused checkpoint tensors (qkv_proj, gate_up_proj): split on load, merged back on export (transformers
loads the merged checkpoint as phi3), LoRA adapters written in PEFT's fused layout (PEFT loads them onto
transformers' Phi3ForCausalLM with the same logits) and read back exactly, PEFT-made fused adapters imported."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from tests.conftest import fresh_seed  # noqa: E402
from tests.helpers import rel_err  # noqa: E402
from tests.hf_models import save_hf_model  # noqa: E402
from unsloth_jax import FastLanguageModel  # noqa: E402
from unsloth_jax.errors import ConfigError  # noqa: E402
from unsloth_jax.hf.safetensors_io import SafetensorsFile  # noqa: E402
from unsloth_jax.models import NF4Param  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("phi3")
    save_hf_model("phi3_longrope", path, seed=fresh_seed("phi3 model") % (1 << 31))
    return path


def _load(path, **kw):
    model, _ = FastLanguageModel.from_pretrained(path, dtype="float32", load_tokenizer=False, progress=False, **kw)
    return model


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")


def _torch_logits(m, ids):
    with torch.no_grad():
        return m(torch.tensor(np.asarray(ids), dtype=torch.long)).logits.float().numpy()


def _lora_model(path, rng, targets, **kw):
    """Our model with LoRA on `targets`, every lora_b random (so each pair changes the logits)."""
    model = FastLanguageModel.get_peft_model(_load(path), r=4, lora_alpha=8, target_modules=targets,
                                             use_gradient_checkpointing=False, random_state=int(rng.integers(1 << 30)),
                                             **kw)
    for lin in model.projections().values():
        if lin.lora_b is not None:
            lin.lora_b[...] = np.asarray(0.05 * rng.standard_normal(lin.lora_b[...].shape), np.float32)
    return model


def test_loads_split_and_merges_back(phi3_dir, tmp_path, rng):
    """The q/k/v and gate/up kernels are the rows of the fused tensors, transposed; the merged 16-bit export
    (LoRA folded in) is a phi3 checkpoint with fused tensors that transformers runs with our logits, and whose
    weights equal PEFT's own merge of our adapter."""
    model = _lora_model(phi3_dir, rng, ALL)
    with SafetensorsFile(phi3_dir / "model.safetensors") as f:
        qkv = f.get("model.layers.1.self_attn.qkv_proj.weight")
        gate_up = f.get("model.layers.0.mlp.gate_up_proj.weight")
    projs = model.projections()
    q, kv, ff = 4 * 16, 2 * 16, model.config.intermediate_size
    np.testing.assert_array_equal(np.asarray(projs["k_proj"].kernel[...][1]).T, qkv[q:q + kv])
    np.testing.assert_array_equal(np.asarray(projs["v_proj"].kernel[...][1]).T, qkv[q + kv:])
    np.testing.assert_array_equal(np.asarray(projs["up_proj"].kernel[...][0]).T, gate_up[ff:])
    ids = rng.integers(0, model.config.vocab_size, size=(2, 20))
    ours = np.asarray(model(ids))
    model.save_pretrained_merged(tmp_path / "merged", None, dtype="float32")
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["model_type"] == "phi3" and config["rope_parameters"]["rope_type"] == "longrope"
    hf = _hf(tmp_path / "merged")
    assert type(hf).__name__ == "Phi3ForCausalLM"
    assert rel_err(ours, _torch_logits(hf, ids)) < 1e-5
    model.save_pretrained(tmp_path / "adapter")
    pm = peft.PeftModel.from_pretrained(_hf(phi3_dir), str(tmp_path / "adapter")).merge_and_unload()
    mine = hf.state_dict()
    for k, v in pm.state_dict().items():
        assert rel_err(mine[k].numpy(), v.numpy()) < 1e-6, k


@pytest.mark.parametrize("targets,kw", [(ALL, {}), (["q_proj", "v_proj", "up_proj"], {"use_rslora": True})])
def test_adapter_loads_in_peft_and_back(targets, kw, phi3_dir, tmp_path, rng):
    """save_pretrained writes qkv_proj / gate_up_proj LoRA pairs of rank n*r (block diagonal; an untargeted
    projection's blocks are zero) with rank_pattern / alpha_pattern keeping the scale: PEFT on transformers'
    Phi-3 gives our logits, and from_pretrained(adapter) restores exactly the same projections and factors."""
    model = _lora_model(phi3_dir, rng, targets, **kw)
    ids = rng.integers(0, model.config.vocab_size, size=(2, 20))
    ours = np.asarray(model(ids))
    model.save_pretrained(tmp_path / "adapter")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    fused_targets = {"qkv_proj", "gate_up_proj"} | ({"o_proj", "down_proj"} & set(targets))
    assert set(cfg["target_modules"]) == fused_targets and cfg["r"] == 4
    assert cfg["rank_pattern"] == {"qkv_proj": 12, "gate_up_proj": 8}
    if kw.get("use_rslora"):
        assert cfg["alpha_pattern"] == pytest.approx({"qkv_proj": 8 * 3 ** 0.5, "gate_up_proj": 8 * 2 ** 0.5})
    else:
        assert cfg["alpha_pattern"] == {"qkv_proj": 24, "gate_up_proj": 16}
    d = model.config.hidden_size
    with SafetensorsFile(tmp_path / "adapter" / "adapter_model.safetensors") as f:
        a = f.get("base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight")
        b = f.get("base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight")
        assert a.shape == (12, d) and b.shape == (4 * 16 + 2 * 2 * 16, 12)
        assert not any(k.endswith(("q_proj.lora_A.weight", "gate_proj.lora_A.weight")) for k in f.keys())
    np.testing.assert_array_equal(a[:4], np.asarray(model.projections()["q_proj"].lora_a[...][0]).T)
    if "k_proj" not in targets:
        assert not np.any(a[4:8]) and not np.any(b[:, 4:8])
    pm = peft.PeftModel.from_pretrained(_hf(phi3_dir), str(tmp_path / "adapter"))
    assert rel_err(ours, _torch_logits(pm, ids)) < 1e-5
    back = _load(tmp_path / "adapter")
    assert back.lora.target_modules == model.lora.target_modules and back.lora.r == 4
    assert back.lora.use_rslora == kw.get("use_rslora", False)
    for name, lin in model.projections().items():
        if lin.lora_a is not None:
            np.testing.assert_array_equal(back.projections()[name].lora_a[...], lin.lora_a[...])
            np.testing.assert_array_equal(back.projections()[name].lora_b[...], lin.lora_b[...])
    np.testing.assert_array_equal(np.asarray(back(ids)), ours)


def test_peft_made_fused_adapter_imports(phi3_dir, tmp_path, rng):
    """An adapter PEFT trains on transformers' Phi-3 (one A shared by q, k and v) loads as per-projection pairs
    with that A copied; logits equal PEFT's, and it exports back to an adapter PEFT reads with the same logits."""
    pm = peft.get_peft_model(_hf(phi3_dir), peft.LoraConfig(r=6, lora_alpha=12, target_modules=["qkv_proj", "down_proj"],
                                                            lora_dropout=0.0, task_type="CAUSAL_LM"))
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    with torch.no_grad():
        for _, p in pm.named_parameters():
            if p.requires_grad:
                p.copy_(p + 0.05 * torch.randn(p.shape, generator=gen))
    pm.eval()
    pm.save_pretrained(str(tmp_path / "peft_adapter"))
    cfg_path = tmp_path / "peft_adapter" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps(dict(cfg, base_model_name_or_path=str(phi3_dir))))
    model = _load(tmp_path / "peft_adapter")
    assert model.lora.target_modules == ("q_proj", "k_proj", "v_proj", "down_proj") and model.lora.r == 6
    ids = rng.integers(0, model.config.vocab_size, size=(2, 20))
    want = _torch_logits(pm, ids)
    assert rel_err(np.asarray(model(ids)), want) < 1e-5
    model.save_pretrained(tmp_path / "again")
    pm2 = peft.PeftModel.from_pretrained(_hf(phi3_dir), str(tmp_path / "again"))
    assert rel_err(_torch_logits(pm2, ids), want) < 1e-5


def test_fused_adapter_that_cannot_split_is_refused(phi3_dir, tmp_path, rng):
    model = _lora_model(phi3_dir, rng, ALL)
    good = tmp_path / "good"
    model.save_pretrained(good)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(good / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.mlp.gate_up_proj.lora_B.weight"
    mixed = dict(tensors)
    mixed[key] = tensors[key].copy()
    mixed[key][0, 5] = 0.5  # a gate row using the up projection's rank: no exact split
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    save_file(mixed, str(bad / "adapter_model.safetensors"))
    with pytest.raises(ConfigError, match="block diagonal"):
        _load(bad)
    cfg = json.loads((good / "adapter_config.json").read_text())
    cfg["alpha_pattern"] = {}  # rank 12 with alpha 8: a different scale than r=4
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(ConfigError, match=r"proj\.lora_A\.weight' has rank \d+ and scale"):
        _load(bad)


def test_four_bit_and_prequantized(phi3_dir, tmp_path, rng):
    """load_in_4bit quantizes each split projection; a bitsandbytes-prequantized fused tensor is refused."""
    from unsloth_jax.quant import dense_kernel

    model = _load(phi3_dir, load_in_4bit=True)
    dense = _load(phi3_dir)
    for name, lin in model.projections().items():
        assert isinstance(lin.kernel, NF4Param), name
        deq = np.asarray(dense_kernel(lin.kernel.get_value()), np.float32)
        want = dense.projections()[name].kernel
        assert rel_err(deq, want[...]) < 0.15, name  # NF4's error on these weights, per split projection
        want[...] = deq
    ids = rng.integers(0, model.config.vocab_size, size=(1, 12))
    assert rel_err(np.asarray(model(ids)), np.asarray(dense(ids))) < 1e-5
    fake = tmp_path / "bnb"
    fake.mkdir()
    for f in phi3_dir.iterdir():
        (fake / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((phi3_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    (fake / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="pre-quantized by bitsandbytes holds fused"):
        _load(fake)
