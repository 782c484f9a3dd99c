"""GGUF export of Qwen3.5 text (llama.cpp "qwen35") and GLM-4.5 MoE ("glm4moe"), read back with gguf.GGUFReader.

Truth: the transformers model's own state dict with the random LoRA pairs folded in here, transformed by the
rules re-derived below from llama.cpp's converter (conversion/qwen.py, conversion/glm.py). The name table
(`_QWEN35_NAMES`, `_GLM_NAMES`) and the keys were checked once against the converter's output at these configs
(test_identical_to_llama_cpp_converter, LLAMA_CPP_DIR=<llama.cpp checkout>: tensor by tensor and key by key).
Reading (hf/gguf_loading.py): our file, and with LLAMA_CPP_DIR a converter-made one with an MTP block, loads
back with the logits of transformers on the merged weights (transformers has no qwen35 / glm4moe GGUF loader)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from tests.conftest import fresh_seed  # noqa: E402
from tests.family_checks import torch_logits  # noqa: E402
from tests.helpers import rel_err  # noqa: E402
from tests.hf_models import make_hf_model  # noqa: E402
from tests.hf_moe_models import make_hf_glm4_moe  # noqa: E402
from tests.test_gguf import ASSET_TOKENIZER, _convert_with_llama_cpp, _read  # noqa: E402
from unsloth_jax import FastLanguageModel  # noqa: E402
from unsloth_jax.config import ModelConfig  # noqa: E402
from unsloth_jax.families import text_config  # noqa: E402
from unsloth_jax.errors import ConfigError  # noqa: E402
from unsloth_jax.hf import gguf_families, gguf_loading  # noqa: E402

Q = gguf.GGMLQuantizationType
GLM_SPECIALS = ["[gMASK]", "<|user|>", "<|endoftext|>", "<|observation|>"]
QWEN35_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
                  "in_proj_z", "out_proj"]
# HF suffix after model.layers.{i}. -> GGUF name after blk.{i}. (checked against llama.cpp's converter)
_COMMON = {"input_layernorm.weight": "attn_norm.weight",
           "post_attention_layernorm.weight": "post_attention_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
           "self_attn.k_proj.weight": "attn_k.weight",
           "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
           "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
           "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
           "mlp.down_proj.weight": "ffn_down.weight"}
_QWEN35_NAMES = _COMMON | {
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight", "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.A_log": "ssm_a", "linear_attn.dt_bias": "ssm_dt.bias", "linear_attn.conv1d.weight":
    "ssm_conv1d.weight", "linear_attn.norm.weight": "ssm_norm.weight", "linear_attn.out_proj.weight": "ssm_out.weight"}
_GLM_NAMES = _COMMON | {
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias", "mlp.shared_experts.gate_proj.weight":
    "ffn_gate_shexp.weight", "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight"}
ARCH = {"qwen35": "qwen35", "glm4_moe": "glm4moe"}
EXPERT_STACKS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # GLM-4.5's LoRA target_parameters


def _expert_stack(model, name: str):
    """The GroupedLinear of expert stack `name` (kernel [L, E, in, out], lora_a [L, E, in, r], lora_b [L, E, r,
    out])."""
    node = model.model.layers
    for part in name.split("."):
        node = getattr(node, part)
    return node


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """family -> (our model with random nonzero LoRA, tokenizer, transformers model, source dir). Qwen3.5: 4 value
    heads on 2 key heads (the V-head reordering), LoRA on the linear attention's projections too. GLM-4.5: a
    dense first layer, 8 experts in 4 groups, a shared expert, q/k norms and biases, LoRA on the experts too; no
    MTP layer (the converter would announce one without its tensors); the GLM special tokens its tokenizer has."""
    seed = fresh_seed("gguf families")
    rng = np.random.default_rng(seed)
    out = {}
    for family in ("qwen35", "glm4_moe"):
        tok = transformers.AutoTokenizer.from_pretrained(str(ASSET_TOKENIZER))
        if family == "qwen35":
            hf = make_hf_model("qwen35", seed=seed % 10_000, vocab_size=2048)
            targets = QWEN35_TARGETS
        else:
            tok.add_tokens(GLM_SPECIALS, special_tokens=True)
            hf = make_hf_glm4_moe(seed=seed % 10_000 + 1, vocab_size=2112, num_nextn_predict_layers=0)
            targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        experts = {"target_parameters": list(EXPERT_STACKS)} if family == "glm4_moe" else {}
        path = tmp_path_factory.mktemp(family)
        hf.save_pretrained(str(path))
        model, _ = FastLanguageModel.from_pretrained(path, dtype="float32", load_tokenizer=False, progress=False)
        model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, target_modules=targets,
                                                 use_gradient_checkpointing=False, **experts)
        lins = list(model.projections().values()) + [_expert_stack(model, p) for p in experts.get(
            "target_parameters", ())]
        for lin in lins:
            if lin.lora_b is not None:
                lin.lora_b[...] = np.asarray(0.05 * rng.standard_normal(lin.lora_b[...].shape), np.float32)
        out[family] = (model, tok, hf, path)
    return out


_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp", "in_proj_qkv": "linear_attn",
           "in_proj_z": "linear_attn", "out_proj": "linear_attn"}


def _merged_state(model, hf) -> dict[str, np.ndarray]:
    """HF weights (float32) with W + scale * B^T A^T folded in where the layer has the projection."""
    sd = {k: v.detach().float().numpy().copy() for k, v in hf.state_dict().items()}
    for name, lin in model.projections().items():
        if lin.lora_a is None:
            continue
        for i in range(model.config.num_hidden_layers):
            key = f"model.layers.{i}.{_PARENT[name]}.{name}.weight"
            if key in sd:
                a, b = np.asarray(lin.lora_a[...][i]), np.asarray(lin.lora_b[...][i])  # [in, r], [r, out]
                sd[key] = sd[key] + model.lora.scale * (a @ b).T
    for name in EXPERT_STACKS if model.config.is_moe else ():  # transformers' stacks are [E, out, in]
        stack = _expert_stack(model, name)
        if stack.lora_a is None:
            continue
        for i in range(model.config.num_hidden_layers):
            key = f"model.layers.{i}.{name}"
            if key in sd:
                a, b = np.asarray(stack.lora_a[...][i]), np.asarray(stack.lora_b[...][i])
                sd[key] = sd[key] + model.lora.scale * np.stack([(a[e] @ b[e]).T for e in range(a.shape[0])])
    return sd


def _tiled(nk: int, nv: int, head_dim: int) -> np.ndarray:
    """Row order of llama.cpp's value heads: tiled position p * nk + k holds HF's head k * (nv / nk) + p."""
    r = nv // nk
    return np.array([(k * r + p) * head_dim + d for p in range(r) for k in range(nk) for d in range(head_dim)])


def _expected(family, model, hf) -> dict[str, np.ndarray]:
    """GGUF name -> expected float32 data (numpy order), from the merged transformers state dict."""
    cfg = model.config
    sd = _merged_state(model, hf)
    qwen = family == "qwen35"
    table = _QWEN35_NAMES if qwen else _GLM_NAMES
    out = {"token_embd.weight": sd.pop("model.embed_tokens.weight"),
           "output_norm.weight": sd.pop("model.norm.weight") + (1 if qwen else 0)}
    if "lm_head.weight" in sd:
        out["output.weight"] = sd.pop("lm_head.weight")
    for key, w in sd.items():
        _, _, i, suffix = key.split(".", 3)
        if suffix == "mlp.experts.gate_up_proj":  # transformers 5's fused [E, 2F, D]: gate rows, then up rows
            f = w.shape[1] // 2
            out[f"blk.{i}.ffn_gate_exps.weight"], out[f"blk.{i}.ffn_up_exps.weight"] = w[:, :f], w[:, f:]
            continue
        if suffix == "mlp.experts.down_proj":  # [E, D, F]
            out[f"blk.{i}.ffn_down_exps.weight"] = w
            continue
        name = table[suffix]
        if qwen:
            nk, nv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                              cfg.linear_value_head_dim)
            if suffix.endswith("norm.weight") and suffix != "linear_attn.norm.weight":
                w = w + 1
            elif suffix == "linear_attn.conv1d.weight":
                w = w[:, 0, :]
            if suffix in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
                w = np.concatenate([w[:2 * nk * dk], w[2 * nk * dk:][_tiled(nk, nv, dv)]])
            elif suffix == "linear_attn.in_proj_z.weight":
                w = w[_tiled(nk, nv, dv)]
            elif suffix in ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight", "linear_attn.dt_bias"):
                w = w[_tiled(nk, nv, 1)]
            elif suffix == "linear_attn.A_log":
                w = -np.exp(w[_tiled(nk, nv, 1)].astype(np.float64))
            elif suffix == "linear_attn.out_proj.weight":
                w = w[:, _tiled(nk, nv, dv)]
        out[f"blk.{i}.{name}"] = w
    return out


@pytest.mark.parametrize("family", ["qwen35", "glm4_moe"])
def test_f32_tensors_and_metadata_match_transformers(family, cases, tmp_path):
    model, tok, hf, path = cases[family]
    raw = hf.config
    _, tensors, kv = _read(model.save_pretrained_gguf(tmp_path, tok, quantization_method="f32"))
    want = _expected(family, model, hf)
    assert sorted(tensors) == sorted(want)
    for name, t in tensors.items():
        assert t.tensor_type == Q.F32, name
        assert list(t.shape) == list(reversed(want[name].shape)), name  # ggml order
        got = np.asarray(t.data).reshape(want[name].shape)
        np.testing.assert_allclose(got, want[name], rtol=1e-6, atol=1e-7, err_msg=name)
    a = ARCH[family] + "."
    assert kv["general.architecture"] == ARCH[family]
    assert kv[a + "block_count"] == raw.num_hidden_layers and kv[a + "embedding_length"] == raw.hidden_size
    assert kv[a + "feed_forward_length"] == raw.intermediate_size
    assert kv[a + "attention.head_count"] == raw.num_attention_heads
    assert kv[a + "attention.head_count_kv"] == raw.num_key_value_heads
    assert kv[a + "attention.key_length"] == kv[a + "attention.value_length"] == raw.head_dim
    partial = raw.rope_parameters["partial_rotary_factor"]
    assert kv[a + "rope.dimension_count"] == int(raw.head_dim * partial) < raw.head_dim
    if family == "qwen35":
        assert kv[a + "ssm.conv_kernel"] == raw.linear_conv_kernel_dim
        assert kv[a + "ssm.state_size"] == raw.linear_key_head_dim
        assert kv[a + "ssm.group_count"] == raw.linear_num_key_heads
        assert kv[a + "ssm.time_step_rank"] == raw.linear_num_value_heads
        assert kv[a + "ssm.inner_size"] == raw.linear_value_head_dim * raw.linear_num_value_heads
        assert kv[a + "full_attention_interval"] == 4 and raw.layer_types[3] == "full_attention"
        assert kv[a + "rope.dimension_sections"] == [11, 11, 10, 0]
    else:
        assert kv[a + "expert_count"] == raw.n_routed_experts and kv[a + "expert_used_count"] == raw.num_experts_per_tok
        assert kv[a + "expert_feed_forward_length"] == raw.moe_intermediate_size
        assert kv[a + "expert_shared_count"] == raw.n_shared_experts
        assert kv[a + "leading_dense_block_count"] == raw.first_k_dense_replace
        assert kv[a + "expert_group_count"] == raw.n_group and kv[a + "expert_group_used_count"] == raw.topk_group
        assert kv[a + "expert_gating_func"] == gguf.ExpertGatingFuncType.SIGMOID
        assert kv[a + "expert_weights_scale"] == pytest.approx(raw.routed_scaling_factor)
        assert kv[a + "expert_weights_norm"] is True and kv[a + "nextn_predict_layers"] == 0
        added = tok.get_added_vocab()  # the converter's _set_vocab_glm special tokens
        assert kv["tokenizer.ggml.eot_token_id"] == added["<|user|>"]
        assert kv["tokenizer.ggml.eom_token_id"] == added["<|observation|>"]
    assert kv["tokenizer.ggml.model"] == "gpt2" and len(kv["tokenizer.ggml.tokens"]) == raw.vocab_size


@pytest.mark.parametrize("family", ["qwen35", "glm4_moe"])
def test_q8_0_types(family, cases, tmp_path):
    """Routers and conv kernels stay F32 as 1-D tensors and norms do, rows of 24 (the experts' down
    and shared-expert down projections) fall back to F16, the rest is Q8_0 within a quantization step."""
    model, tok, hf, _ = cases[family]
    _, tensors, kv = _read(model.save_pretrained_gguf(tmp_path, tok, quantization_method="q8_0"))
    assert kv["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    want = _expected(family, model, hf)
    for name, t in tensors.items():
        w = want[name]
        if w.ndim == 1 or name.endswith(("_norm.weight", "ffn_gate_inp.weight", "ssm_conv1d.weight")):
            assert t.tensor_type == Q.F32, name
        elif w.shape[-1] % 32:
            assert t.tensor_type == Q.F16 and ".ffn_down_" in name, name
        else:
            assert t.tensor_type == Q.Q8_0, name
            deq = gguf.quants.dequantize(np.asarray(t.data), Q.Q8_0).reshape(w.shape)
            step = np.abs(w.reshape(*w.shape[:-1], -1, 32)).max(-1, keepdims=True) / 127
            assert np.all(np.abs(deq - w).reshape(step.shape[:-1] + (32,)) <= 0.6 * step + 1e-7), name


@pytest.mark.parametrize("family", ["qwen35", "glm4_moe"])
def test_f32_file_loads_back_with_the_merged_models_logits(family, cases, tmp_path, rng):
    """Our GGUF reader (from_pretrained on the .gguf) inverts the export: its config is the source's where the
    file describes it, and its logits equal transformers' on the merged weights (transformers has no qwen35 /
    glm4moe GGUF loader to compare with directly)."""
    model, tok, hf, _ = cases[family]
    path = model.save_pretrained_gguf(tmp_path, tok, quantization_method="f32")
    back, back_tok = FastLanguageModel.from_pretrained(path, dtype="float32", progress=False)
    cfg, src = back.config, model.config
    for field in ("num_hidden_layers", "layer_linear", "linear_num_value_heads", "rotary_dim", "layer_sparse",
                  "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob", "shared_expert_size",
                  "qkv_bias", "qk_norm", "num_experts"):
        assert getattr(cfg, field) == getattr(src, field), field
    ref = hf.__class__(hf.config).eval()
    ref.load_state_dict({k: torch.tensor(v) for k, v in _merged_state(model, hf).items()}, strict=False)
    ids = rng.integers(3, hf.config.vocab_size, size=(2, 12))
    # Qwen3.5: 5e-5, transformers' chunked delta rule rounds differently in float32 (tests/test_qwen3_5.py)
    assert rel_err(np.asarray(back(ids)), torch_logits(ref, ids)) < (5e-5 if family == "qwen35" else 1e-5)
    assert back_tok.encode("hello world") == tok.encode("hello world")


def test_qwen35_split_regex_names_its_pre_tokenizer_both_ways(cases, tmp_path):
    """A byte-level BPE tokenizer splitting text by Qwen3.5's regex (digits one by one, combining marks kept with
    their letters) is written with tokenizer.ggml.pre "qwen35" (its hash unknown: the regex decides), and our
    reader's tokenizer splits as llama.cpp's qwen35 pre-tokenizer does: the same ids as the source tokenizer."""
    from tokenizers import Regex, pre_tokenizers

    model, tok, _, _ = cases["qwen35"]
    tok = transformers.AutoTokenizer.from_pretrained(str(ASSET_TOKENIZER))
    split = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+"
             "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                           use_regex=False)])
    path = model.save_pretrained_gguf(tmp_path, tok, quantization_method="q8_0")
    _, _, kv = _read(path)
    assert kv["tokenizer.ggml.pre"] == "qwen35"
    back = gguf_loading.gguf_tokenizer(path)
    text = "It's 12345 he\u0301llo  wo\u0308rld!!\n\n  x -- y"
    assert back.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)


def _config(model_type: str, **fields) -> ModelConfig:
    raw = dict(model_type=model_type, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
               rms_norm_eps=1e-6)
    if model_type == "qwen3_5_text":
        raw.update(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
    else:
        raw.update(moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2)
    return text_config(raw | fields)


def test_settings_llama_cpp_cannot_represent_are_refused():
    qwen = _config("qwen3_5_text", layer_types=["linear_attention", "full_attention", "linear_attention",
                                                "linear_attention"])
    with pytest.raises(ConfigError, match="layer_types"):
        gguf_families.check(qwen, {})
    with pytest.raises(ConfigError, match="linear_value_head_dim"):
        gguf_families.check(_config("qwen3_5_text", linear_value_head_dim=16), {})
    assert gguf_families.full_attention_interval(_config("qwen3_5_text", full_attention_interval=2)) == 2
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 16}
    with pytest.raises(ConfigError, match="rope_type 'llama3'"):
        gguf_families.check(_config("glm4_moe", rope_parameters=llama3), {})


@pytest.mark.skipif(not os.environ.get("LLAMA_CPP_DIR"), reason="set LLAMA_CPP_DIR to a llama.cpp checkout to "
                    "compare with its convert_hf_to_gguf.py")
@pytest.mark.parametrize("family,outtype", [("qwen35", "f32"), ("qwen35", "q8_0"), ("qwen35", "bf16"),
                                            ("glm4_moe", "f16"), ("glm4_moe", "q8_0"), ("glm4_moe", "f32")])
def test_identical_to_llama_cpp_converter(family, outtype, cases, tmp_path):
    """Our file equals what llama.cpp's converter writes for our merged float32 export: every key but
    general.name and every tensor's name, type, shape and bytes, except Qwen3.5's ssm_a = -exp(A_log): ours is
    exp correctly rounded to float32, torch's float32 exp (the converter's) can be 1 ulp off it."""
    model, tok, _, _ = cases[family]
    merged = tmp_path / "merged"
    model.save_pretrained_merged(merged, tok, dtype="float32")
    ours = model.save_pretrained_gguf(tmp_path / "ours", tok, quantization_method=outtype)
    ref = tmp_path / "ref.gguf"
    _convert_with_llama_cpp(Path(os.environ["LLAMA_CPP_DIR"]), merged, ref, outtype, "gpt-2")
    _, ta, ka = _read(ours)
    _, tb, kb = _read(ref)
    ka.pop("general.name")
    kb.pop("general.name")
    assert ka == kb
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert ta[name].tensor_type == tb[name].tensor_type, name
        assert list(ta[name].shape) == list(tb[name].shape), name
        if name.endswith(".ssm_a"):
            np.testing.assert_array_max_ulp(np.asarray(ta[name].data), np.asarray(tb[name].data), maxulp=1)
            continue
        np.testing.assert_array_equal(np.asarray(ta[name].data), np.asarray(tb[name].data), err_msg=name)


@pytest.mark.skipif(not os.environ.get("LLAMA_CPP_DIR"), reason="set LLAMA_CPP_DIR to a llama.cpp checkout to "
                    "read a file its convert_hf_to_gguf.py wrote")
@pytest.mark.parametrize("family", ["qwen35", "glm4_moe"])
def test_reads_converter_file_with_mtp_block(family, cases, tmp_path, rng):
    """llama.cpp's converter writes the multi-token-prediction block (Qwen3.5's mtp.* with mtp_num_hidden_layers,
    GLM-4.5's model.layers.{L}.* with num_nextn_predict_layers) as an extra block past the decoder
    (nextn_predict_layers); our reader skips it and gives the merged model's logits."""
    from safetensors.numpy import load_file, save_file

    model, tok, hf, _ = cases[family]
    merged = tmp_path / "merged"
    model.save_pretrained_merged(merged, tok, dtype="float32")
    (shard,) = merged.glob("*.safetensors")
    tensors = load_file(str(shard))
    d, n = hf.config.hidden_size, hf.config.num_hidden_layers
    qwen = family == "qwen35"
    prefix = "mtp." if qwen else f"model.layers.{n}."
    names = (("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm") if qwen else
             ("eh_proj", "enorm", "hnorm", "shared_head.norm"))
    extra = {f"{prefix}{k}.weight": rng.standard_normal(shape).astype(np.float32) * 0.05
             for k, shape in zip(names, ((d, 2 * d), (d,), (d,), (d,)))}
    copied = hf.config.layer_types.index("full_attention") if qwen else n - 1  # the block's decoder layer
    for k, v in tensors.items():
        if k.startswith(f"model.layers.{copied}."):
            extra[("mtp.layers.0." if qwen else f"model.layers.{n}.") + k.split(".", 3)[3]] = v
    save_file(tensors | extra, str(shard), metadata={"format": "pt"})
    raw = json.loads((merged / "config.json").read_text())
    key = "mtp_num_hidden_layers" if qwen else "num_nextn_predict_layers"
    (merged / "config.json").write_text(json.dumps(raw | {key: 1}))
    ref = tmp_path / "ref.gguf"
    _convert_with_llama_cpp(Path(os.environ["LLAMA_CPP_DIR"]), merged, ref, "f32", "gpt-2")
    _, tensors_ref, kv = _read(ref)
    assert kv[ARCH[family] + ".nextn_predict_layers"] == 1 and kv[ARCH[family] + ".block_count"] == n + 1
    assert f"blk.{n}.nextn.eh_proj.weight" in tensors_ref
    back, _ = FastLanguageModel.from_pretrained(ref, dtype="float32", progress=False)
    assert back.config.num_hidden_layers == n
    ids = rng.integers(3, hf.config.vocab_size, size=(2, 12))
    assert rel_err(np.asarray(back(ids)), np.asarray(model(ids))) < 1e-5
