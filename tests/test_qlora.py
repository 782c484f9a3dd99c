"""4-bit loading: kernels become NF4 on load; logits equal a dense model built from the dequantized weights;
a QLoRA train step updates only LoRA leaves."""
from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

torch = pytest.importorskip("torch")

from pallas_kernels.nf4 import dequantize_nf4  # noqa: E402
from unsloth_jax.models import NF4Param  # noqa: E402
from tests.helpers import rel_err  # noqa: E402
from tests.hf_models import save_hf_model  # noqa: E402
from unsloth_jax import FastLanguageModel, lora  # noqa: E402
from unsloth_jax.train import make_train_step  # noqa: E402


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_4bit_load_matches_dequantized_dense(family, tmp_path, rng):
    """The 4-bit model computes what transformers computes with the dequantized weights put in its linears, and
    each dequantized weight is NF4's usual ~9% (relative Frobenius) away from the checkpoint's."""
    hf = save_hf_model(family, tmp_path, seed=21)
    q_model, _ = FastLanguageModel.from_pretrained(tmp_path, dtype="float32", load_in_4bit=True,
                                                   load_tokenizer=False, progress=False)
    q_projs = q_model.projections()
    kernel = q_projs["q_proj"].kernel
    assert isinstance(kernel, NF4Param) and kernel.get_value().codes.dtype == jnp.uint8
    assert q_model.model.embed_tokens.weight[...].dtype == jnp.float32  # embeddings stay dense
    d_model, _ = FastLanguageModel.from_pretrained(tmp_path, dtype="float32", load_tokenizer=False, progress=False)
    d_projs = d_model.projections()
    n_quantized = 0
    for name, lin in q_projs.items():
        if not isinstance(lin.kernel, NF4Param):
            continue
        deq = np.asarray(dequantize_nf4(lin.kernel.get_value(), jnp.float32))  # [layers, out, in], HF layout
        chex.assert_shape(deq, (len(hf.model.layers), *lin.kernel.get_value().shape))
        d_projs[name].kernel[...] = jnp.swapaxes(jnp.asarray(deq), -1, -2)
        for i, layer in enumerate(hf.model.layers):
            linear = getattr(layer.self_attn, name, None) or getattr(layer.mlp, name)
            assert 0.05 < rel_err(deq[i], linear.weight.detach().numpy()) < 0.12, (name, i)
            with torch.no_grad():
                linear.weight.copy_(torch.from_numpy(deq[i]))
            n_quantized += 1
    assert n_quantized == 7 * len(hf.model.layers)
    ids = rng.integers(0, 256, size=(2, 16))
    out_q = np.asarray(q_model(ids))
    assert rel_err(out_q, np.asarray(d_model(ids))) < 1e-5
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    assert rel_err(out_q, ref) < 1e-4


def test_qlora_train_step(tmp_path, rng):
    save_hf_model("llama", tmp_path, seed=22)
    model, _ = FastLanguageModel.from_pretrained(tmp_path, dtype="float32", load_in_4bit=True,
                                                 load_tokenizer=False, progress=False)
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=True)
    g, t, f = lora.split(model)
    assert all(p[-1] in ("lora_a", "lora_b") for p, _ in nnx.to_flat_state(t))
    ids = rng.integers(0, 256, size=(1, 2, 16)).astype(np.int32)
    batch = {"input_ids": ids, "labels": ids, "attention_mask": np.ones_like(ids)}
    opt = optax.adam(1e-2)
    step = make_train_step(g, opt, remat="full", donate=False)
    state = opt.init(t)
    losses = []
    for _ in range(4):
        t, state, m = step(t, f, state, batch)
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0]
    assert int(m["skipped"]) == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qlora_step_with_fp8_gemms_tracks_the_dequantized_step(tmp_path, rng, monkeypatch, dtype):
    """UNSLOTH_JAX_IMPL=nf4_gemm=fp8 (NF4 storage, e4m3 weights and FP8 GEMMs): the loss within FP8's error of
    the default step on the same NF4 weights, LoRA gradients pointing the same way, only LoRA leaves trained,
    and the run summary's choices say fp8."""
    import jax

    from unsloth_jax import ops

    save_hf_model("llama", tmp_path, seed=int(rng.integers(1 << 30)))
    model, _ = FastLanguageModel.from_pretrained(tmp_path, dtype=dtype, load_in_4bit=True, load_tokenizer=False,
                                                 progress=False)
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=True)
    for lin in model.projections().values():  # non-zero B: every LoRA factor gets a gradient
        lin.lora_b[...] = lin.lora_b[...] + 0.05 * rng.standard_normal(lin.lora_b[...].shape)
    g, t, f = lora.split(model)
    ids = rng.integers(0, 256, size=(1, 2, 16)).astype(np.int32)
    batch = {"input_ids": ids, "labels": ids, "attention_mask": np.ones_like(ids)}
    opt = optax.sgd(1.0)

    def run(impl):
        monkeypatch.setenv(ops.ENV_VAR, f"nf4_gemm={impl}")
        new_t, _, m = make_train_step(g, opt, remat="full", donate=False)(t, f, opt.init(t), batch)
        assert ops.chosen_impls().get("nf4_gemm") == impl
        return float(m["loss"]), [np.asarray(a, np.float32) - np.asarray(b, np.float32)
                                  for a, b in zip(jax.tree.leaves(t), jax.tree.leaves(new_t))]

    loss_deq, upd_deq = run("dequantized")
    loss_fp8, upd_fp8 = run("fp8")
    assert loss_fp8 != loss_deq and rel_err(loss_fp8, loss_deq) < 0.01
    flat_deq, flat_fp8 = np.concatenate([u.ravel() for u in upd_deq]), np.concatenate([u.ravel() for u in upd_fp8])
    cos = flat_deq @ flat_fp8 / (np.linalg.norm(flat_deq) * np.linalg.norm(flat_fp8))
    assert cos > 0.98 and rel_err(flat_fp8, flat_deq) < 0.2, (cos, rel_err(flat_fp8, flat_deq))


def _save_bnb_checkpoint(dense_dir, out_dir, double_quant: bool = True):
    """The float checkpoint in dense_dir quantized to NF4 by transformers + bitsandbytes (CPU) and saved to
    out_dir; returns the 4-bit transformers model."""
    import transformers

    cfg = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                          bnb_4bit_use_double_quant=double_quant,
                                          bnb_4bit_compute_dtype=torch.float32)
    hf4 = transformers.AutoModelForCausalLM.from_pretrained(str(dense_dir), quantization_config=cfg,
                                                            device_map="cpu", dtype=torch.float32)
    hf4.save_pretrained(str(out_dir))
    return hf4


def _float32_logits(hf4, ids):
    """transformers' float32 logits [batch, seq, vocab] of the 4-bit model `hf4` for int ids [batch, seq].

    On CPUs with AVX512-BF16, bitsandbytes' Linear4bit.forward (eval, no grad) repacks each weight with bf16
    absmax and multiplies in bfloat16 whatever bnb_4bit_compute_dtype says: on this test's model (that path
    emulated in torch) its logits are 0.0077-0.0088 relative from the float32 ones, far past a 1e-4 bound.
    Turning the path off per module gives bitsandbytes' float32 dequantize + matmul on every CPU; the check
    after the forward fails loudly if a bitsandbytes version renames the switch."""
    import bitsandbytes as bnb

    linears = [m for m in hf4.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert linears, "no bitsandbytes Linear4bit in the model"
    for m in linears:
        m.support_avx512bf16_for_cpu = False
    with torch.no_grad():
        logits = hf4(torch.tensor(ids)).logits.float().numpy()
    repacked = [m for m in linears if getattr(m.weight.quant_state, "packing_format_for_cpu", False)]
    assert not repacked, f"bitsandbytes repacked {len(repacked)} weights for its bf16 CPU kernel"
    return logits


def test_prequantized_bnb_checkpoint_matches_transformers(tmp_path, rng):
    """A bnb-4bit checkpoint written by transformers (bitsandbytes on the CPU) loads without re-quantizing
    and gives transformers' logits for it."""
    pytest.importorskip("bitsandbytes")
    save_hf_model("llama", tmp_path / "dense", seed=23)
    hf4 = _save_bnb_checkpoint(tmp_path / "dense", tmp_path / "bnb")
    model, _ = FastLanguageModel.from_pretrained(tmp_path / "bnb", dtype="float32", load_tokenizer=False,
                                                 progress=False)
    assert isinstance(model.projections()["down_proj"].kernel, NF4Param)
    ids = rng.integers(0, 256, size=(2, 16))
    assert rel_err(np.asarray(model(ids)), _float32_logits(hf4, ids)) < 1e-4


def test_bnb_reference_is_float32_on_avx512bf16_cpus(tmp_path, rng, monkeypatch):
    """Where bitsandbytes finds AVX512-BF16 (simulated: the per-module flag it sets from has_avx512bf16, and
    its bf16 kernel entry replaced by a stub that fails), the reference logits still come from the float32
    path and equal the ones computed with the flag off."""
    bnb = pytest.importorskip("bitsandbytes")
    save_hf_model("llama", tmp_path / "dense", seed=23)
    hf4 = _save_bnb_checkpoint(tmp_path / "dense", tmp_path / "bnb")
    ids = rng.integers(0, 256, size=(2, 16))
    expected = _float32_logits(hf4, ids)

    def bf16_kernel(*args, **kwargs):
        raise AssertionError("bitsandbytes' bf16 CPU kernel (gemv_4bit) was used for the reference")

    monkeypatch.setattr(bnb.functional, "gemv_4bit", bf16_kernel)
    for m in hf4.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = True
    np.testing.assert_array_equal(_float32_logits(hf4, ids), expected)


def test_bnb_checkpoint_mixing_quant_settings_names_the_tensor(tmp_path):
    """A bnb-4bit checkpoint whose layers differ in quantization settings (layer 1's q_proj without double
    quantization) fails with an error naming that tensor and its file, not a pytree mismatch."""
    pytest.importorskip("bitsandbytes")
    from safetensors.torch import load_file, save_file

    from unsloth_jax.errors import ShapeMismatchError

    save_hf_model("llama", tmp_path / "dense", seed=24)
    for double_quant in (True, False):
        _save_bnb_checkpoint(tmp_path / "dense", tmp_path / f"bnb_{double_quant}", double_quant)
    mixed = load_file(str(tmp_path / "bnb_True" / "model.safetensors"))
    single = load_file(str(tmp_path / "bnb_False" / "model.safetensors"))
    prefix = "model.layers.1.self_attn.q_proj.weight"
    for key in [k for k in mixed if k.startswith(prefix)]:
        del mixed[key]
    mixed.update({k: v for k, v in single.items() if k.startswith(prefix)})
    save_file(mixed, str(tmp_path / "bnb_True" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ShapeMismatchError, match=r"model\.safetensors: tensor 'model\.layers\.1\.self_attn\.q_proj"
                                                 r"\.weight': layer 1 loads as"):
        FastLanguageModel.from_pretrained(tmp_path / "bnb_True", dtype="float32", load_tokenizer=False,
                                          progress=False)
