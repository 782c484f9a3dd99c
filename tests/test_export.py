"""PEFT adapter export/import and merged 16-bit export, checked against peft and transformers on torch."""
from __future__ import annotations

import json
import os
import shutil
import struct

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from tests.conftest import fresh_seed  # noqa: E402
from tests.helpers import rel_err, wrong_modes  # noqa: E402
from tests.hf_models import save_hf_model  # noqa: E402
from unsloth_jax import FastLanguageModel, lora  # noqa: E402
from unsloth_jax.errors import CheckpointNotFoundError, ConfigError, UnexpectedTensorError  # noqa: E402
from unsloth_jax.hf import export, peft_io  # noqa: E402
from unsloth_jax.hf.file_modes import umask as read_umask  # noqa: E402
from unsloth_jax.hf.safetensors_io import SafetensorsFile, save_file  # noqa: E402
from unsloth_jax.models import NF4Param  # noqa: E402
from unsloth_jax.train import make_train_step  # noqa: E402

FAMILIES = ("llama", "qwen2", "gemma", "gemma3")  # Phi-3's fused modules: tests/test_phi3.py
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    out = {}
    for i, fam in enumerate(FAMILIES):
        path = tmp_path_factory.mktemp(fam)
        save_hf_model(fam, path, seed=11 + i)
        out[fam] = path
    return out


@pytest.fixture(scope="module")
def trained(hf_dirs):
    """One LoRA model per family trained for a few steps (fresh seed per run), shared by the tests: each test
    gets its own shallow copy via _copy so it may replace params freely."""
    seed = fresh_seed("trained-model")
    rng = np.random.default_rng(seed)
    return {fam: _trained(hf_dirs[fam], rng) for fam in FAMILIES}


def _copy(model):
    """A model sharing the arrays of `model` but not its variables (nnx.clone)."""
    return nnx.clone(model)


def _load(path, dtype="float32"):
    model, _ = FastLanguageModel.from_pretrained(path, dtype=dtype, load_tokenizer=False, progress=False)
    return model


def _trained(path, rng, r=4, alpha=8, steps=3, **kw):
    """A LoRA model after a few SGD steps on random tokens (so every lora_b is nonzero)."""
    model = FastLanguageModel.get_peft_model(_load(path), r=r, lora_alpha=alpha, use_gradient_checkpointing=False,
                                             random_state=int(rng.integers(1 << 30)), **kw)
    ids = rng.integers(0, model.config.vocab_size, size=(1, 2, 12)).astype(np.int32)
    batch = {"input_ids": ids, "labels": ids, "attention_mask": np.ones_like(ids)}
    opt = optax.sgd(1.0)
    g, t, f = lora.split(model)
    step = make_train_step(g, opt, remat="none", donate=False)
    state = opt.init(t)
    for _ in range(steps):
        t, state, _ = step(t, f, state, batch)
    nnx.update(model, t)
    for name in model.lora.target_modules:
        assert float(jnp.abs(model.projections()[name].lora_b[...]).max()) > 0
    return model


def _lora_factors(model) -> dict:
    """{projection: {"lora_a", "lora_b"}} of a LoRA model (arrays stacked over layers)."""
    return {name: {"lora_a": lin.lora_a[...], "lora_b": lin.lora_b[...]}
            for name, lin in model.projections().items() if lin.lora_a is not None}


def _hf(path, **kw):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                             attn_implementation="eager", **kw)


def _torch_logits(m, ids):
    with torch.no_grad():
        return m(torch.tensor(np.asarray(ids), dtype=torch.long)).logits.float().numpy()


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_loads_in_peft_with_same_logits(family, hf_dirs, trained, tmp_path, rng):
    model = _copy(trained[family])
    ids = rng.integers(0, model.config.vocab_size, size=(2, 10))
    ours = np.asarray(model(ids))
    model.save_pretrained(tmp_path / "adapter")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM" and cfg["r"] == 4
    assert cfg["lora_alpha"] == 8 and set(cfg["target_modules"]) == set(TARGETS)
    assert cfg["base_model_name_or_path"] == str(hf_dirs[family])
    with SafetensorsFile(tmp_path / "adapter" / "adapter_model.safetensors") as f:
        keys = f.keys()
        assert all(f.dtype(k) == np.float32 for k in keys)
        a0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
        b1 = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
        chex.assert_shape([f.get(a0), f.get(b1)], [(4, model.config.hidden_size), (model.config.hidden_size, 4)])
        chex.assert_trees_all_equal(f.get(a0), np.asarray(model.projections()["q_proj"].lora_a[...][0]).T)
    assert len(keys) == 2 * len(TARGETS) * model.config.num_hidden_layers
    # our own loader reads it back exactly (float32 factors both ways)
    back, _ = FastLanguageModel.from_pretrained(tmp_path / "adapter", dtype="float32", load_tokenizer=False,
                                                progress=False)
    chex.assert_trees_all_equal(_lora_factors(back), _lora_factors(model))
    pm = peft.PeftModel.from_pretrained(_hf(hf_dirs[family]), str(tmp_path / "adapter"))
    theirs = _torch_logits(pm, ids)
    assert rel_err(ours, theirs) < 1e-5


def test_adapter_of_a_relative_path_names_the_absolute_base(hf_dirs, tmp_path, rng, monkeypatch):
    """A model loaded from a relative path: adapter_config.json names its base by the absolute path, so PEFT's
    AutoPeftModelForCausalLM opens the adapter from another directory."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(hf_dirs["llama"].parent)
    model = _trained(hf_dirs["llama"].name, rng)  # loaded as "llama0", relative to the current directory
    model.save_pretrained(tmp_path / "adapter")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(hf_dirs["llama"].resolve())
    monkeypatch.chdir(tmp_path)
    pm = peft.AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter"), dtype=torch.float32)
    ids = rng.integers(0, model.config.vocab_size, size=(1, 8))
    assert rel_err(np.asarray(model(ids)), _torch_logits(pm, ids)) < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_merged_export_loads_in_transformers_and_shards(family, hf_dirs, trained, tmp_path, rng):
    model = _copy(trained[family])
    ids = rng.integers(0, model.config.vocab_size, size=(2, 10))
    ours = np.asarray(model(ids))
    out = tmp_path / "merged"
    model.save_pretrained_merged(out, None, max_shard_size="40KB", dtype="float32")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all(f"-of-{len(files):05d}.safetensors" in f for f in files)
    seen, total = {}, 0
    for fname in files:
        with SafetensorsFile(out / fname) as f:
            size = 0
            for k in f.keys():
                seen[k] = fname
                nbytes = int(np.prod(f.shape(k))) * f.dtype(k).itemsize
                size += nbytes
                total += nbytes
            assert size <= 40_000 or len(f.keys()) == 1
    assert seen == index["weight_map"]
    assert index["metadata"]["total_size"] == total
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32" and "quantization_config" not in config
    hf = _hf(out)
    assert rel_err(ours, _torch_logits(hf, ids)) < 1e-5
    # PEFT's own merge of the same adapter gives the same weights
    model.save_pretrained(tmp_path / "adapter")
    pm = peft.PeftModel.from_pretrained(_hf(hf_dirs[family]), str(tmp_path / "adapter")).merge_and_unload()
    ref = {k: v.numpy() for k, v in pm.state_dict().items()}
    mine = {k: v.numpy() for k, v in hf.state_dict().items()}
    for k in ref:
        assert rel_err(mine[k], ref[k]) < 1e-6, k


def test_merged_export_bf16_and_dtype_override(hf_dirs, trained, tmp_path):
    model = _copy(trained["llama"])
    model.save_pretrained_merged(tmp_path / "bf16", None, dtype="bfloat16")
    with SafetensorsFile(tmp_path / "bf16" / "model.safetensors") as f:
        assert {f.dtype(k).name for k in f.keys()} == {"bfloat16"}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"))
    assert hf.dtype == torch.bfloat16
    # a bf16 model exports bf16 by default; weights are the float32 merge rounded once
    m16 = _load(hf_dirs["llama"], dtype="bfloat16")
    FastLanguageModel.get_peft_model(m16, r=model.lora.r, lora_alpha=model.lora.lora_alpha,
                                     use_gradient_checkpointing=False)
    nnx.update(m16, nnx.state(model, nnx.LoRAParam))
    m16.save_pretrained_merged(tmp_path / "bf16b", None)
    with SafetensorsFile(tmp_path / "bf16b" / "model.safetensors") as f:
        w = np.asarray(f.get("model.layers.1.self_attn.v_proj.weight"), np.float32)
    k = np.asarray(m16.projections()["v_proj"].kernel[...][1], np.float32)
    a = np.asarray(model.projections()["v_proj"].lora_a[...][1])
    b = np.asarray(model.projections()["v_proj"].lora_b[...][1])
    want = (k + model.lora.scale * (a @ b)).T.astype(jnp.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(w, want)


def _header_dtypes(path) -> set[str]:
    """The tensor dtypes a safetensors header lists, read from the raw header (not through our reader)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


def test_merged_16bit_of_a_float32_model_is_16bit(hf_dirs, tmp_path):
    """merged_16bit writes bfloat16 from a float32-loaded model (the CPU default), float16 when the checkpoint's
    config.json says float16, and what the caller's dtype= says otherwise."""
    model = _load(hf_dirs["llama"])
    assert model.dtype == jnp.float32
    assert json.loads((hf_dirs["llama"] / "config.json").read_text())["dtype"] == "float32"
    model.save_pretrained_merged(tmp_path / "bf16", None, save_method="merged_16bit")
    assert _header_dtypes(tmp_path / "bf16" / "model.safetensors") == {"BF16"}
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config.get("torch_dtype", "bfloat16") == "bfloat16"

    src16 = tmp_path / "src16"  # the same checkpoint, marked float16 (under both config keys)
    shutil.copytree(hf_dirs["llama"], src16)
    raw = json.loads((src16 / "config.json").read_text())
    (src16 / "config.json").write_text(json.dumps({**raw, "dtype": "float16", "torch_dtype": "float16"}))
    m16 = _load(src16)
    assert m16.dtype == jnp.float32
    m16.save_pretrained_merged(tmp_path / "fp16", None)
    assert _header_dtypes(tmp_path / "fp16" / "model.safetensors") == {"F16"}
    config = json.loads((tmp_path / "fp16" / "config.json").read_text())
    assert config["dtype"] == "float16" and config["torch_dtype"] == "float16"

    m16.save_pretrained_merged(tmp_path / "f32", None, dtype="float32")
    assert _header_dtypes(tmp_path / "f32" / "model.safetensors") == {"F32"}
    assert json.loads((tmp_path / "f32" / "config.json").read_text())["dtype"] == "float32"


@pytest.mark.parametrize("family,kw", [("llama", dict(use_rslora=True, modules_to_save=["lm_head"])),
                                       ("qwen2", dict(bias="all")),
                                       ("gemma", dict())])
def test_peft_written_adapter_imports(family, kw, hf_dirs, tmp_path, rng, monkeypatch):
    """An adapter made by PEFT itself (random A, B, saved by save_pretrained) loads through
    FastLanguageModel.from_pretrained(adapter_dir) and gives PEFT's logits."""
    targets = ["q_proj", "v_proj", "down_proj"] if family != "gemma" else "all-linear"
    hf = _hf(hf_dirs[family])
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=6, lora_alpha=12, target_modules=targets, lora_dropout=0.0,
                                                 task_type="CAUSAL_LM", **kw))
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if p.requires_grad:
                p.copy_(p + 0.05 * torch.randn(p.shape, generator=gen))
    pm.eval()
    adapter = tmp_path / "peft_adapter"
    pm.save_pretrained(str(adapter))
    # base_model_name_or_path relative to the adapter directory
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = os.path.relpath(hf_dirs[family], adapter)
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    monkeypatch.chdir(tmp_path)
    assert peft_io.is_adapter_dir(adapter)
    assert os.path.samefile(peft_io.base_model_path(adapter), hf_dirs[family])
    model, _ = FastLanguageModel.from_pretrained(adapter, dtype="float32", load_tokenizer=False, progress=False)
    assert model.lora.r == 6 and model.lora.use_rslora == kw.get("use_rslora", False)
    ids = rng.integers(0, model.config.vocab_size, size=(2, 9))
    assert rel_err(np.asarray(model(ids)), _torch_logits(pm, ids)) < 1e-5
    # and it exports back to an adapter PEFT reads with the same logits
    model.save_pretrained(tmp_path / "again", base_model_name_or_path=str(hf_dirs[family]))
    pm2 = peft.PeftModel.from_pretrained(_hf(hf_dirs[family]), str(tmp_path / "again"))
    assert rel_err(_torch_logits(pm2, ids), _torch_logits(pm, ids)) < 1e-5


def test_adapter_import_errors(hf_dirs, trained, tmp_path):
    model = _copy(trained["llama"])
    good = tmp_path / "good"
    model.save_pretrained(good)
    raw = json.loads((good / "adapter_config.json").read_text())

    def variant(name, **changes):
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors").read_bytes())
        (d / "adapter_config.json").write_text(json.dumps({**raw, **changes}))
        return d

    with pytest.raises(ConfigError, match="use_dora"):
        peft_io.load_adapter(_load(hf_dirs["llama"]), variant("dora", use_dora=True))
    with pytest.raises(ConfigError, match="rank_pattern"):
        peft_io.load_adapter(_load(hf_dirs["llama"]), variant("rp", rank_pattern={"q_proj": 8}))
    with pytest.raises(ConfigError, match="layers_to_transform"):
        peft_io.load_adapter(_load(hf_dirs["llama"]), variant("ltt", layers_to_transform=[0]))
    with pytest.raises(ConfigError, match="embed_tokens"):
        peft_io.load_adapter(_load(hf_dirs["llama"]), variant("tm", target_modules=["q_proj", "embed_tokens"]))
    with pytest.raises(UnexpectedTensorError, match="k_proj.lora_A"):  # the file holds more targets than the config
        peft_io.load_adapter(_load(hf_dirs["llama"]), variant("fewer", target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ConfigError, match="base_model_name_or_path"):
        peft_io.base_model_path(variant("nobase", base_model_name_or_path=None))
    with pytest.raises(CheckpointNotFoundError, match="no-such-model"):
        peft_io.base_model_path(variant("missing", base_model_name_or_path="no-such-model"))
    with pytest.raises(ConfigError, match="merged_4bit"):
        model.save_pretrained_merged(tmp_path / "m4", None, save_method="merged_4bit")
    # short and regex target names resolve
    assert peft_io.resolve_targets(["self_attn.q_proj", "mlp.up_proj"], 2) == ("q_proj", "up_proj")
    assert peft_io.resolve_targets(r".*\.(k_proj|o_proj)", 2) == ("k_proj", "o_proj")
    with pytest.raises(ConfigError, match="only some layers"):
        peft_io.resolve_targets(["model.layers.0.self_attn.q_proj"], 2)


def test_interrupted_export_leaves_nothing(trained, tmp_path, monkeypatch):
    model = _copy(trained["llama"])
    real = export.write_safetensors_stream
    calls = {"n": 0}

    def failing(path, entries, metadata=None):
        calls["n"] += 1
        if calls["n"] == 3:
            with open(path, "wb") as fh:  # a half-written shard, then the crash
                fh.write(b"\0" * 100)
            raise KeyboardInterrupt("simulated crash")
        return real(path, entries, metadata)

    monkeypatch.setattr(export, "write_safetensors_stream", failing)
    out = tmp_path / "merged"
    with pytest.raises(KeyboardInterrupt):
        model.save_pretrained_merged(out, None, max_shard_size="40KB")
    assert not out.exists()
    assert os.listdir(tmp_path) == []  # no partial directory left behind
    # an existing complete export is left untouched by a failed re-export
    monkeypatch.setattr(export, "write_safetensors_stream", real)
    model.save_pretrained_merged(out, None)
    before = {p: (out / p).read_bytes() for p in os.listdir(out)}
    calls["n"] = 0
    monkeypatch.setattr(export, "write_safetensors_stream", failing)
    with pytest.raises(KeyboardInterrupt):
        model.save_pretrained_merged(out, None, max_shard_size="40KB")
    assert {p: (out / p).read_bytes() for p in os.listdir(out)} == before
    assert sorted(os.listdir(tmp_path)) == ["merged"]
    calls["n"] = 2
    with pytest.raises(KeyboardInterrupt):
        model.save_pretrained(tmp_path / "adapter")  # the adapter writer goes through the same stream
    assert not (tmp_path / "adapter").exists()


def test_reexport_replaces_weights_keeps_unrelated_files(trained, tmp_path):
    model = _copy(trained["qwen2"])
    out = tmp_path / "merged"
    model.save_pretrained_merged(out, None, max_shard_size="40KB")
    assert (out / "model.safetensors.index.json").is_file()
    (out / "README.md").write_text("notes")
    model.save_pretrained_merged(out, None)  # now a single file: the old shards and index must go
    names = sorted(os.listdir(out))
    assert names == ["README.md", "config.json", "generation_config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["merged"]
    # save_method="lora" writes just the adapter (+ tokenizer when given)
    model.save_pretrained_merged(tmp_path / "lora", None, save_method="lora")
    assert sorted(os.listdir(tmp_path / "lora")) == ["adapter_config.json", "adapter_model.safetensors"]


def test_exports_get_the_modes_of_new_files(trained, tmp_path, umask):
    """Adapter, merged (sharded and not) and lora exports, and safetensors_io.save_file, give their files and
    folders the modes open() / mkdir() give (0o666 / 0o777 minus the umask), not tempfile's 0600 / 0700."""
    assert read_umask() == umask and read_umask() == umask  # reading it leaves it unchanged
    model = _copy(trained["llama"])
    model.save_pretrained(tmp_path / "adapter")
    model.save_pretrained_merged(tmp_path / "merged", None)
    model.save_pretrained_merged(tmp_path / "sharded", None, max_shard_size="40KB")
    model.save_pretrained_merged(tmp_path / "sharded", None, max_shard_size="40KB")  # replacing an export
    model.save_pretrained_merged(tmp_path / "lora", None, save_method="lora")
    save_file({"x": np.zeros(3, np.float32)}, tmp_path / "file" / "x.safetensors")
    for name in ("adapter", "merged", "sharded", "lora", "file"):
        assert wrong_modes(tmp_path / name, umask) == {}, name
    assert len(os.listdir(tmp_path / "sharded")) > 3


def test_parse_size():
    assert export.parse_size("5GB") == 5 * 10**9
    assert export.parse_size("500MB") == 500 * 10**6
    assert export.parse_size("2GiB") == 2 * 2**30
    assert export.parse_size("100KiB") == 100 * 1024
    assert export.parse_size("8Gb") == 10**9
    assert export.parse_size(1234) == 1234
    for bad in ("5 parsecs", -1, 0, "", None):
        with pytest.raises(ValueError):
            export.parse_size(bad)


def test_four_bit_base_is_dequantized_before_merging(trained, tmp_path):
    """A kernel stored as an NF4Weight is dequantized exactly (bitsandbytes' values) and the LoRA pair is folded
    in float32; nothing is re-quantized."""
    nf4 = pytest.importorskip("pallas_kernels.nf4")
    nf4_format = pytest.importorskip("pallas_kernels.nf4_format")
    model = _copy(trained["llama"])
    gate = model.projections()["gate_proj"]
    k = np.asarray(gate.kernel[...])  # [L, in, out]
    q = nf4_format.stack_nf4([nf4_format.quantize_nf4(jnp.asarray(k[i].T)) for i in range(k.shape[0])])
    gate.kernel = NF4Param(q)
    model.save_pretrained_merged(tmp_path / "m", None, dtype="float32")
    with SafetensorsFile(tmp_path / "m" / "model.safetensors") as f:
        got = np.asarray(f.get("model.layers.1.mlp.gate_proj.weight"))
    deq = np.asarray(nf4.dequantize_nf4(jax.tree.map(lambda a: a[1], q)), np.float32)  # HF [out, in]
    a = np.asarray(gate.lora_a[...][1])
    b = np.asarray(gate.lora_b[...][1])
    chex.assert_shape(got, deq.shape)
    chex.assert_trees_all_close(got, deq + model.lora.scale * (a @ b).T, rtol=1e-6, atol=1e-7)
    assert rel_err(deq, k[1].T) < 0.2  # it is the 4-bit approximation, not the original weight
