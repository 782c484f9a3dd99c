"""With every op forced onto its Pallas kernel (interpret mode on CPU), the models still match transformers
and the LoRA train step gives the same loss and gradients as the XLA path."""
from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

torch = pytest.importorskip("torch")

from tests.helpers import padded_batch, rel_err  # noqa: E402
from tests.hf_models import save_hf_model  # noqa: E402
from unsloth_jax import FastLanguageModel, lora, ops  # noqa: E402
from unsloth_jax.train import make_train_step  # noqa: E402


@pytest.fixture
def all_pallas():
    for op in ops.KERNEL_OPS:
        ops.set_impl(op, "pallas")
    yield
    for op in ops.OPS:
        ops.set_impl(op, "auto")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3"])
def test_logits_with_kernels_match_transformers(family, tmp_path, rng, all_pallas):
    hf = save_hf_model(family, tmp_path, seed=11)
    model, _ = FastLanguageModel.from_pretrained(tmp_path, dtype="float32", load_tokenizer=False, progress=False)
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    ids = rng.integers(0, 256, size=(2, 20))
    mask = np.ones_like(ids)
    mask[1, 15:] = 0
    with torch.no_grad():
        ref = hf(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    out = np.asarray(model(ids, attention_mask=mask))
    real = mask.astype(bool)
    assert rel_err(out[real], ref[real]) < 1e-4
    used = ops.chosen_impls()
    assert all("pallas" in used.get(op, "") for op in ("rms_norm", "rope", "glu", "linear", "attention")), used


@pytest.mark.slow
def test_train_step_with_kernels_matches_xla(tmp_path, rng):
    save_hf_model("qwen2", tmp_path, seed=12)
    model, _ = FastLanguageModel.from_pretrained(tmp_path, dtype="float32", load_tokenizer=False, progress=False)
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=True)
    projs = model.projections()
    for name in ("q_proj", "v_proj", "down_proj"):
        b = projs[name].lora_b
        b[...] = b[...] + 0.05 * rng.standard_normal(b[...].shape)
    g, t, f = lora.split(model)
    batch = padded_batch(rng, 256, (1, 2, 16), pad_from=12)
    opt = optax.sgd(1.0)

    def run():
        step = make_train_step(g, opt, remat="full", donate=False)
        new_t, _, m = step(t, f, opt.init(t), batch)
        return float(m["loss"]), jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), t, new_t)

    loss_xla, grads_xla = run()
    for op in ops.KERNEL_OPS:
        ops.set_impl(op, "pallas")
    try:
        loss_k, grads_k = run()
    finally:
        for op in ops.OPS:
            ops.set_impl(op, "auto")
    assert abs(loss_k - loss_xla) / abs(loss_xla) < 1e-5
    for a, b in zip(jax.tree.leaves(grads_k), jax.tree.leaves(grads_xla)):
        assert rel_err(a, b) < 1e-4
