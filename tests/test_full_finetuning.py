"""Full fine-tuning: AdamW over every weight equals torch.optim.AdamW on the transformers model update by update;
the saved checkpoint loads in transformers with the same logits; quantized bases are refused."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.helpers import rel_err  # noqa: E402
from tests.hf_models import save_hf_model  # noqa: E402
from unsloth_jax import FastLanguageModel, SFTTrainer, TrainingArguments, lora  # noqa: E402
from unsloth_jax.errors import ConfigError  # noqa: E402
from unsloth_jax.hf import export  # noqa: E402
from unsloth_jax.hf.safetensors_io import SafetensorsFile  # noqa: E402
from unsloth_jax.train import make_optimizer, make_schedule, make_train_step  # noqa: E402
from unsloth_jax.train.optim import decay_mask  # noqa: E402


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    out = {}
    for i, fam in enumerate(("llama", "qwen2")):  # untied head; tied embeddings with qkv biases
        out[fam] = tmp_path_factory.mktemp(fam)
        save_hf_model(fam, out[fam], seed=21 + i)
    return out


def _full(path, dtype="float32", **kw):
    model, _ = FastLanguageModel.from_pretrained(path, dtype=dtype, full_finetuning=True, load_tokenizer=False,
                                                 progress=False, **kw)
    return model


def _hf(path, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="eager")


def _hf_weights(model) -> dict[str, np.ndarray]:
    """Every weight of our model in HF's names and layout (float32), through the export's own tensor plan."""
    return {e.name: e.make() for e in export.merged_entries(model, np.dtype(np.float32))}


def _batch(rng, b=2, s=16, vocab=256):
    ids = rng.integers(0, vocab, size=(1, b, s)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[:, -1, -5:] = 0  # right padding in the last row
    labels = np.where(mask == 1, ids, -100).astype(np.int32)
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_adamw_updates_equal_torch_tensor_by_tensor(family, hf_dirs, rng):
    """Three AdamW steps (weight decay, clipping at 1.0, linear decay) over every weight, float32, remat on:
    each step's loss, grad norm and the update of every tensor (W_after - W_before) match torch.optim.AdamW
    on the transformers model (tied embeddings: one table fed by both of its uses, as in transformers).
    llama: weight decay on every tensor (make_optimizer's default, one torch param group); qwen2 (q/k/v biases):
    the trainers' grouping (decay_mask) against transformers' Trainer's two groups (get_decay_parameter_names:
    no decay on biases and norms)."""
    # eps = 1e-5 (not 1e-8): an element whose gradient is ~1e-7 from cancellation gets an Adam step of either sign
    # depending on float32 rounding order (seen: embedding rows); a larger eps makes such elements step in
    # proportion to their gradient, so the comparison is well conditioned, while the bulk (|g| >> eps) still
    # takes Adam's normalised steps.
    steps, lr, eps = 3, 1e-3, 1e-5
    model = _full(hf_dirs[family], use_gradient_checkpointing=True)
    assert model.gradient_checkpointing == "full"
    graphdef, trainable, frozen = lora.split(model)
    assert not jax.tree.leaves(frozen)  # everything trains
    assert lora.count(trainable) == lora.count(model)
    grouped = family == "qwen2"
    opt = make_optimizer("adamw_torch", make_schedule("linear", lr, steps, 0), weight_decay=0.1, max_grad_norm=1.0,
                         adam_epsilon=eps, weight_decay_mask=decay_mask() if grouped else None)
    opt_state = opt.init(trainable)
    step = make_train_step(graphdef, opt, remat=model.gradient_checkpointing, donate=False)

    hf = _hf(hf_dirs[family])
    hf.train()
    groups = [{"params": list(hf.parameters()), "weight_decay": 0.1}]
    if grouped:
        decayed = set(transformers.Trainer.get_decay_parameter_names(None, hf))
        assert any("bias" in n for n, _ in hf.named_parameters()) and len(decayed) < len(list(hf.parameters()))
        groups = [{"params": [p for n, p in hf.named_parameters() if n in decayed], "weight_decay": 0.1},
                  {"params": [p for n, p in hf.named_parameters() if n not in decayed], "weight_decay": 0.0}]
    torch_opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=eps)
    sched = transformers.get_scheduler("linear", torch_opt, num_warmup_steps=0, num_training_steps=steps)
    names = [n for n, _ in hf.named_parameters()]  # tied: lm_head.weight is the embedding, listed once
    assert set(names) == set(_hf_weights(model))
    worst = 0.0
    for k in range(steps):
        batch = _batch(rng)
        ours_before = _hf_weights(model)
        torch_before = {n: p.detach().numpy().copy() for n, p in hf.named_parameters()}
        trainable, opt_state, metrics = step(trainable, frozen, opt_state, batch)
        nnx.update(model, trainable)
        out = hf(input_ids=torch.from_numpy(batch["input_ids"][0]).long(),
                 attention_mask=torch.from_numpy(batch["attention_mask"][0]).long(),
                 labels=torch.from_numpy(batch["labels"][0]).long())
        out.loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        torch_opt.step()
        sched.step()
        torch_opt.zero_grad()
        np.testing.assert_allclose(float(metrics["loss"]), out.loss.item(), rtol=1e-5)
        np.testing.assert_allclose(float(metrics["grad_norm"]), norm.item(), rtol=1e-4)
        ours_after = _hf_weights(model)
        for n, p in hf.named_parameters():
            theirs = p.detach().numpy() - torch_before[n]
            assert np.linalg.norm(theirs) > 0, n
            err = rel_err(ours_after[n] - ours_before[n], theirs)
            worst = max(worst, err)
            assert err < 1e-3, f"step {k}: update of {n} differs from torch's by {err:.2e}"
    print(f"largest relative difference of a tensor's update: {worst:.2e}")
    for n, p in hf.named_parameters():
        assert rel_err(_hf_weights(model)[n], p.detach().numpy()) < 1e-5, n


def test_trained_checkpoint_loads_in_transformers(hf_dirs, tmp_path, rng):
    """SFTTrainer trains every weight of a full fine-tuning model on pre-tokenized records; save_pretrained
    writes a transformers checkpoint (float32 stays float32) whose logits equal ours; weights really moved."""
    path = hf_dirs["llama"]
    model = _full(path)
    before = _hf_weights(model)
    records = [{"input_ids": rng.integers(0, 256, 24).tolist()} for _ in range(8)]
    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, max_steps=3,
                             learning_rate=1e-3, save_steps=0, logging_steps=1)
    out = SFTTrainer(model=model, train_dataset=records, args=args, max_seq_length=32).train()
    assert np.isfinite(out.training_loss)
    after = _hf_weights(model)
    assert all(not np.array_equal(before[n], after[n]) for n in before)  # kernels too: no stop_gradient
    model.save_pretrained(tmp_path / "full")
    with SafetensorsFile(tmp_path / "full" / "model.safetensors") as f:
        assert {f.get(k).dtype for k in f.keys()} == {np.dtype(np.float32)}
    assert json.loads((tmp_path / "full" / "config.json").read_text())["dtype"] == "float32"
    hf = _hf(tmp_path / "full")
    ids = rng.integers(0, 256, (2, 20))
    ours = np.asarray(model(ids))
    with torch.no_grad():
        theirs = hf(torch.from_numpy(ids).long()).logits.numpy()
    assert rel_err(ours, theirs) < 1e-5


def test_bf16_weights_float32_moments_and_8bit(hf_dirs, tmp_path, rng):
    """bf16 full fine-tuning keeps the weights bf16 and AdamW's moments float32 (adamw_8bit: 8-bit codes, no
    full-size float32 moment); the bf16 checkpoint loads in transformers and agrees to bf16 accuracy."""
    path = hf_dirs["qwen2"]
    model = _full(path, dtype="bfloat16", use_gradient_checkpointing=False)
    graphdef, trainable, frozen = lora.split(model)
    assert {x.dtype for x in jax.tree.leaves(trainable)} == {jnp.dtype(jnp.bfloat16)}
    sched = make_schedule("constant", 1e-3, 2, 0)
    opt32 = make_optimizer("adamw_torch", sched)
    moments = [x for x in jax.tree.leaves(opt32.init(trainable)) if x.ndim]
    assert moments and {x.dtype for x in moments} == {jnp.dtype(jnp.float32)}
    opt8 = make_optimizer("adamw_8bit", sched)
    state8 = opt8.init(trainable)
    big = max(x.size for x in jax.tree.leaves(trainable))
    assert not any(x.dtype == jnp.float32 and x.size >= big for x in jax.tree.leaves(state8))
    step = make_train_step(graphdef, opt8, remat="none", donate=False)
    new, _, m = step(trainable, frozen, state8, _batch(rng))
    assert np.isfinite(float(m["loss"])) and not int(m["skipped"])
    assert {x.dtype for x in jax.tree.leaves(new)} == {jnp.dtype(jnp.bfloat16)}
    nnx.update(model, new)
    model.save_pretrained(tmp_path / "bf16")
    with SafetensorsFile(tmp_path / "bf16" / "model.safetensors") as f:
        assert {str(f.get(k).dtype) for k in f.keys()} == {"bfloat16"}
        assert "lm_head.weight" not in f.keys()  # still tied
    hf = _hf(tmp_path / "bf16", dtype=torch.float32)
    ids = rng.integers(0, 256, (2, 16))
    with torch.no_grad():
        theirs = hf(torch.from_numpy(ids).long()).logits.numpy()
    assert rel_err(np.asarray(model(ids)), theirs) < 3e-2


def test_quantized_bases_and_lora_are_refused(hf_dirs, tmp_path, capsys):
    path = hf_dirs["llama"]
    with pytest.raises(ConfigError, match="load_in_4bit"):
        FastLanguageModel.from_pretrained(path, full_finetuning=True, load_in_4bit=True, load_tokenizer=False)
    with pytest.raises(ConfigError, match="load_in_fp8"):
        FastLanguageModel.from_pretrained(path, full_finetuning=True, load_in_fp8=True, load_tokenizer=False)
    with pytest.raises(TypeError, match="full_finetuning"):
        FastLanguageModel.from_pretrained(path, full_finetuning="yes", load_tokenizer=False)
    four_bit, _ = FastLanguageModel.from_pretrained(path, dtype="float32", load_in_4bit=True, load_tokenizer=False,
                                                    progress=False)
    with pytest.raises(ValueError, match="NF4Param"):
        lora.enable_full_finetuning(four_bit)
    fp8, _ = FastLanguageModel.from_pretrained(path, dtype="float32", load_in_fp8=True, load_tokenizer=False,
                                               progress=False)
    with pytest.raises(ValueError, match="FP8Param"):
        lora.enable_full_finetuning(fp8)
    model = _full(path)
    assert FastLanguageModel.get_peft_model(model, r=4) is model and model.lora is None
    assert "no effect" in capsys.readouterr().out
    with pytest.raises(ValueError, match="full fine-tuning"):
        lora.add_lora(model, lora.LoraSettings(r=4, lora_alpha=4, target_modules=("q_proj",)),
                      jax.random.PRNGKey(0))
    peft_model = FastLanguageModel.get_peft_model(FastLanguageModel.from_pretrained(
        path, dtype="float32", load_tokenizer=False, progress=False)[0], r=4)
    with pytest.raises(ValueError, match="LoRA adapters"):
        lora.enable_full_finetuning(peft_model)
