"""GLM-4.5 MoE (glm4_moe) against transformers' Glm4MoeForCausalLM in float32 on a tiny random checkpoint
(tests/hf_moe_models.GLM4_MOE: a dense first layer, grouped sigmoid routing with n_group > 1 and a
score-correction bias, a shared expert, partial rotary, q/k norms and biases): config, logits, LoRA training,
the PEFT adapter and the merged export read back by PEFT / transformers, greedy generation (GGUF export:
tests/test_gguf_families.py)."""
from __future__ import annotations

import json

import numpy as np
import optax
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from tests.family_checks import load_f32, hf_f32, torch_logits  # noqa: E402
from tests.helpers import rel_err  # noqa: E402
from tests.hf_moe_models import GLM4_MOE, make_hf_glm4_moe  # noqa: E402
from unsloth_jax import FastLanguageModel, lora  # noqa: E402
from unsloth_jax.families import read_text_config, text_config  # noqa: E402
from unsloth_jax.errors import ConfigError  # noqa: E402
from unsloth_jax.models.moe import EXPERT_PARAMETERS  # noqa: E402
from unsloth_jax.train import make_train_step  # noqa: E402

EXPERTS = list(EXPERT_PARAMETERS)


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """(checkpoint directory as transformers' save_pretrained writes it, the torch model)."""
    path = tmp_path_factory.mktemp("glm4_moe")
    hf = make_hf_glm4_moe(seed=11)
    hf.save_pretrained(str(path))
    return path, hf






def _right_padded(rng, b=3, s=24):
    ids = rng.integers(0, 256, size=(b, s)).astype(np.int64)
    lengths = np.array([s, s - 5, 11])[:b]
    return ids, (np.arange(s)[None] < lengths[:, None]).astype(np.int64)




def test_config_and_logits_match_transformers(glm, rng):
    path, hf = glm
    cfg = read_text_config(path)
    assert cfg.layer_sparse == (False, True, True) and cfg.layer_period == 3
    assert (cfg.router, cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor) == ("sigmoid_group", 4, 2, 2.5)
    assert cfg.shared_expert_size == 24 and cfg.rotary_dim == 8 and cfg.qk_norm and cfg.qkv_bias and not cfg.o_bias
    model = load_f32(path)
    ids, mask = _right_padded(rng)
    real = mask.astype(bool)
    ours = np.asarray(model(ids, attention_mask=mask))
    ref = torch_logits(hf, ids, mask)
    assert rel_err(ours[real], ref[real]) < 1e-5
    # the routing switches matter at this config: without the correction bias / the groups, other logits
    for change in ({"n_group": 1, "topk_group": 1}, "bias"):
        other = make_hf_glm4_moe(**(change if isinstance(change, dict) else {}))
        other.load_state_dict(hf.state_dict())
        if change == "bias":
            with torch.no_grad():
                for layer in other.model.layers[1:]:
                    layer.mlp.gate.e_score_correction_bias.zero_()
        assert rel_err(torch_logits(other, ids, mask)[real], ref[real]) > 1e-3, change


def test_config_errors_name_the_key():
    base = dict(GLM4_MOE, model_type="glm4_moe")
    for change, key in (({"n_group": 3}, "n_group"), ({"topk_group": 5}, "topk_group"),
                        ({"first_k_dense_replace": 3}, "first_k_dense_replace"),
                        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
                        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope_type")):
        with pytest.raises(ConfigError, match=key):
            text_config(base | change)
    # transformers 4's spelling (top-level rope_theta, no partial_rotary_factor: GLM's default 0.5)
    cfg = text_config({k: v for k, v in base.items() if k != "partial_rotary_factor"} | {"rope_theta": 1e6})
    assert cfg.rotary_dim == 8 and cfg.rope_theta == 1e6


def test_lora_training_peft_adapter_and_merged_export(glm, tmp_path, rng):
    """LoRA on attention and the routed experts: train steps lower the loss with gradients on the LoRA factors
    only; the adapter loads in PEFT onto transformers' model with our logits, the merged checkpoint in
    transformers, and our own import of the adapter too."""
    path, _ = glm
    model = load_f32(path)
    FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                     target_parameters=EXPERTS, use_gradient_checkpointing=False,
                                     random_state=int(rng.integers(1 << 30)))
    graphdef, trainable, frozen = lora.split(model)
    names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(trainable)}
    assert names and all(n.endswith(("lora_a", "lora_b")) for n in names), names
    assert "model.layers.mlp.experts.gate_up_proj.lora_a" in names
    ids = rng.integers(0, 256, size=(1, 2, 16)).astype(np.int32)
    batch = {"input_ids": ids, "labels": ids, "attention_mask": np.ones_like(ids)}
    opt = optax.adamw(1e-2)
    step = make_train_step(graphdef, opt, remat="none", donate=False)
    state = opt.init(trainable)
    losses = []
    for _ in range(3):
        trainable, state, m = step(trainable, frozen, state, batch)
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0], losses
    nnx.update(model, trainable)
    assert float(np.abs(np.asarray(model.expert_projections()["mlp.experts.down_proj"].lora_b[...])).max()) > 0

    ids, mask = _right_padded(rng)
    real = mask.astype(bool)
    ours = np.asarray(model(ids, attention_mask=mask))
    model.save_pretrained(tmp_path / "adapter", base_model_name_or_path=str(path))
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(cfg["target_parameters"]) == sorted(EXPERTS)
    pm = peft.PeftModel.from_pretrained(hf_f32(path), str(tmp_path / "adapter"))
    assert type(pm.base_model.model.model.layers[1].mlp.experts).__name__ == "ParamWrapper"
    assert rel_err(ours[real], torch_logits(pm, ids, mask)[real]) < 1e-5
    model.save_pretrained_merged(tmp_path / "merged", None, dtype="float32")
    assert rel_err(ours[real], torch_logits(hf_f32(tmp_path / "merged"), ids, mask)[real]) < 1e-5
    back = load_f32(tmp_path / "adapter")
    assert rel_err(np.asarray(back(ids, attention_mask=mask)), ours) < 1e-6
    # 16-bit merged: experts etc. in bfloat16, the router weight and score bias float32 as transformers writes
    # them; transformers and we read that checkpoint to equal logits
    model.save_pretrained_merged(tmp_path / "merged16", None, dtype="bfloat16")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "merged16" / "model.safetensors"), "np") as f:
        dtypes = {k: str(f.get_slice(k).get_dtype()) for k in f.keys()}
    assert dtypes["model.layers.1.mlp.gate.weight"] == dtypes["model.layers.1.mlp.gate.e_score_correction_bias"] \
        == "F32" and dtypes["model.layers.1.mlp.experts.0.gate_proj.weight"] == "BF16"
    merged16 = torch_logits(hf_f32(tmp_path / "merged16"), ids, mask)[real]
    assert rel_err(np.asarray(load_f32(tmp_path / "merged16")(ids, attention_mask=mask))[real], merged16) < 1e-5
    # bf16 weights against our float32 model: rounding, and now and then a token whose expert choice flips
    # (max 3.8e-2 over 11 random models, most below 1.2e-2)
    assert rel_err(merged16, ours[real]) < 1.5e-1
    bf16, _ = FastLanguageModel.from_pretrained(tmp_path / "merged16", dtype="bfloat16", load_tokenizer=False,
                                                progress=False)
    assert bf16.model.layers.mlp.gate.kernel[...].dtype == np.float32  # the router stays float32


def test_greedy_generation_matches_transformers(glm, rng):
    path, hf = glm
    model = load_f32(path)
    ids = rng.integers(1, 256, size=(1, 10))
    with torch.no_grad():
        want = hf.generate(torch.tensor(ids), attention_mask=torch.ones_like(torch.tensor(ids)), max_new_tokens=5,
                           do_sample=False, pad_token_id=0).numpy()
    got = np.asarray(model.generate(ids, max_new_tokens=5))
    np.testing.assert_array_equal(got[:, :want.shape[1]], want)
    # the paged engine (fast_generate, vLLM's API): the same greedy tokens
    from unsloth_jax import SamplingParams

    out = model.fast_generate([ids[0].tolist()], SamplingParams(temperature=0.0, max_tokens=5))
    assert list(out[0].outputs[0].token_ids) == want[0, ids.shape[1]:].tolist()


def test_refusals_and_mtp_layers(glm, tmp_path):
    """PEFT cannot load LoRA on the dense/shared MLP projections of glm4_moe (it
    maps gate/up/down_proj onto the experts), so save_pretrained refuses; the checkpoint's multi-token-
    prediction layers past num_hidden_layers (GLM-4.5's model.layers.46.*) are skipped as transformers does."""
    path, _ = glm
    model = load_f32(path)
    FastLanguageModel.get_peft_model(model, r=2, lora_alpha=4, target_modules=["q_proj", "gate_proj"],
                                     use_gradient_checkpointing=False)
    with pytest.raises(ConfigError, match="dense MLP projections"):
        model.save_pretrained(tmp_path / "refused")
    from safetensors.numpy import load_file, save_file

    mtp = tmp_path / "mtp"
    mtp.mkdir()
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.3.eh_proj.weight"] = np.zeros((64, 128), np.float32)
    save_file(tensors, str(mtp / "model.safetensors"), metadata={"format": "pt"})
    (mtp / "config.json").write_text((path / "config.json").read_text())
    assert read_text_config(mtp).num_mtp_layers == 1
    load_f32(mtp)
    with pytest.raises(ConfigError, match="output_router_logits"):
        load_f32(path, output_router_logits=True)
