"""LoRA partition, the compiled step (frozen weights get no gradient), PEFT loss parity, resume."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import jax.extend
import optax
import pytest
from flax import nnx

torch = pytest.importorskip("torch")

from tests.helpers import interrupted_run  # noqa: E402
from tests.hf_models import save_hf_model  # noqa: E402
from unsloth_jax import FastLanguageModel, SFTTrainer, TrainingArguments, lora  # noqa: E402
from unsloth_jax.train import make_optimizer, make_schedule, make_train_step  # noqa: E402
from unsloth_jax.errors import TrainingError  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_hf_model("llama", path, seed=5)
    return path


def _peft_model(path, r=8, alpha=16, **kw):
    model, _ = FastLanguageModel.from_pretrained(path, dtype="float32", load_tokenizer=False, progress=False)
    kw.setdefault("use_gradient_checkpointing", True)
    return FastLanguageModel.get_peft_model(model, r=r, lora_alpha=alpha, target_modules=list(TARGETS), **kw)


def _batch(rng, a=1, b=2, s=16, vocab=256):
    ids = rng.integers(0, vocab, size=(a, b, s)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[:, -1, -4:] = 0
    labels = np.where(mask == 1, ids, -100).astype(np.int32)
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def test_param_counts_match_peft(llama_dir, capsys):
    import peft
    import transformers

    model = _peft_model(llama_dir)
    printed = capsys.readouterr().out
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(llama_dir))
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=8, lora_alpha=16, target_modules=list(TARGETS)))
    trainable, total = pm.get_nb_trainable_parameters()
    assert f"trainable params: {trainable:,d} || all params: {total:,d}" in printed
    _, t, _ = lora.split(model)
    assert lora.count(t) == trainable


def _paths(state):
    return [tuple(p) for p, _ in nnx.to_flat_state(state)]


def test_split_merge_roundtrip(llama_dir):
    model = _peft_model(llama_dir)
    g, t, f = lora.split(model)
    assert all(p[-1] in ("lora_a", "lora_b") for p in _paths(t))
    assert not any(p[-1] in ("lora_a", "lora_b") for p in _paths(f))
    assert all(isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(t))
    merged = nnx.merge(g, t, f)
    assert jax.tree.structure(nnx.state(merged)) == jax.tree.structure(nnx.state(model))
    ids = np.arange(12)[None] % 200
    np.testing.assert_array_equal(np.asarray(merged(ids)), np.asarray(model(ids)))


def test_compiled_step_has_no_frozen_gradient(llama_dir, rng):
    """Optimizer state holds only LoRA leaves, and no value in the compiled step's jaxpr has the shape of a
    frozen projection kernel's gradient except the frozen inputs themselves."""
    model = _peft_model(llama_dir, r=4)
    g, t, f = lora.split(model)
    opt = make_optimizer("adamw_torch", make_schedule("constant", 1e-3, 10, 0))
    state = opt.init(t)
    state_shapes = {tuple(x.shape) for x in jax.tree.leaves(state) if x.ndim}
    lora_shapes = {tuple(x.shape) for x in jax.tree.leaves(t)}
    assert state_shapes <= lora_shapes, state_shapes - lora_shapes
    batch = _batch(rng)
    step = make_train_step(g, opt, remat="full", donate=False)
    jaxpr = jax.make_jaxpr(step)(t, f, state, batch)
    frozen_kernel_shapes = {tuple(v.shape) for p, v in nnx.to_flat_state(f) if p[-1] == "kernel"}
    # per-layer slices [in, out] of stacked kernels as well as the stacked [L, in, out]
    frozen_kernel_shapes |= {s[1:] for s in frozen_kernel_shapes}
    frozen_kernel_shapes -= {tuple(x.shape) for x in jax.tree.leaves(t)}  # ignore coincidences with LoRA shapes

    offenders = []
    visited = []

    def visit(jp):
        for eqn in jp.eqns:
            if eqn.primitive.name == "dot_general":
                for v in eqn.outvars:
                    if tuple(v.aval.shape) in frozen_kernel_shapes:
                        offenders.append((eqn.primitive.name, v.aval.shape))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                visited.append(eqn.primitive.name)
                visit(sub)

    visit(jaxpr.jaxpr)
    assert "scan" in visited  # the traversal reached the layer loop (and the remat inside it)
    assert not offenders, f"dot_general producing frozen-weight-shaped values: {offenders}"
    # frozen params bit-identical after steps
    before = jax.tree.map(np.asarray, f)
    for _ in range(2):
        t, state, m = step(t, f, state, batch)
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, f))
    assert np.isfinite(float(m["loss"]))


def test_loss_parity_with_peft(llama_dir, rng):
    """Same init, same batches, AdamW, 20 steps in float32: every loss within 1e-4 relative of PEFT's."""
    import peft
    import transformers

    model = _peft_model(llama_dir, r=8, alpha=16)
    # give B a nonzero start so the adapter matters from step 0 (PEFT gets the same values)
    projs = model.projections()
    for name in TARGETS:
        b = projs[name].lora_b
        b[...] = jnp.asarray(0.01 * rng.standard_normal(b[...].shape), jnp.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32, attn_implementation="eager")
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=8, lora_alpha=16, target_modules=list(TARGETS), lora_dropout=0.0))
    with torch.no_grad():
        for i in range(model.config.num_hidden_layers):
            for name in TARGETS:
                mod = "self_attn" if name in TARGETS[:4] else "mlp"
                target = getattr(getattr(pm.base_model.model.model.layers[i], mod), name)
                target.lora_A["default"].weight.copy_(torch.tensor(np.asarray(projs[name].lora_a[...][i]).T))
                target.lora_B["default"].weight.copy_(torch.tensor(np.asarray(projs[name].lora_b[...][i]).T))
    lr, steps = 1e-3, 20
    opt_t = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=lr, weight_decay=0.01)
    opt = make_optimizer("adamw_torch", make_schedule("constant", lr, steps, 0), weight_decay=0.01, max_grad_norm=0)
    g, t, f = lora.split(model)
    state = opt.init(t)
    step = make_train_step(g, opt, remat="none", donate=False)
    ours, theirs = [], []
    batches = [_batch(rng) for _ in range(2)]  # cycled, so the loss must fall as the adapter fits them
    for i in range(steps):
        batch = batches[i % 2]
        t, state, m = step(t, f, state, batch)
        ours.append(float(m["loss"]))
        out = pm(input_ids=torch.tensor(batch["input_ids"][0], dtype=torch.long),
                 attention_mask=torch.tensor(batch["attention_mask"][0]),
                 labels=torch.tensor(batch["labels"][0], dtype=torch.long))
        theirs.append(out.loss.item())
        opt_t.zero_grad()
        out.loss.backward()
        opt_t.step()
    rel = np.abs(np.array(ours) - np.array(theirs)) / np.abs(np.array(theirs))
    assert rel.max() < 1e-4, list(zip(ours, theirs))
    assert ours[-2] + ours[-1] < ours[0] + ours[1]


def test_gradient_accumulation_equals_big_batch(llama_dir, rng):
    model = _peft_model(llama_dir, r=4)
    g, t, f = lora.split(model)
    opt = optax.sgd(0.1)
    big = _batch(rng, a=1, b=4)
    split_batch = {k: v.reshape(2, 2, *v.shape[2:]) for k, v in big.items()}
    step = make_train_step(g, opt, remat="none", donate=False)
    t1, _, m1 = step(t, f, opt.init(t), big)
    t2, _, m2 = step(t, f, opt.init(t), split_batch)
    np.testing.assert_allclose(float(m1["loss"]), float(m2["loss"]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(t1), jax.tree.leaves(t2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_nonfinite_step_is_skipped(llama_dir, rng):
    model = _peft_model(llama_dir, r=4)
    g, t, f = lora.split(model)
    opt = optax.adam(1e-3)
    bad = jax.tree.map(lambda x: x, f)
    bad["model"]["norm"]["weight"] = bad["model"]["norm"]["weight"].replace(bad["model"]["norm"]["weight"][...] * jnp.nan)
    step = make_train_step(g, opt, remat="none", donate=False)
    state = opt.init(t)
    t2, state2, m = step(t, bad, state, _batch(rng))
    assert int(m["skipped"]) == 1
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, t), jax.tree.map(np.asarray, t2))


def _dataset(rng, n=24):
    return [{"input_ids": list(rng.integers(1, 256, size=int(rng.integers(8, 30))))} for _ in range(n)]


def test_trainer_resume_matches_uninterrupted(llama_dir, tmp_path, rng):
    data = _dataset(rng)

    def trainer_for(out):
        model = _peft_model(llama_dir, r=4)
        args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                 max_steps=20, learning_rate=5e-3, save_steps=10, logging_steps=5,
                                 lr_scheduler_type="cosine", warmup_steps=3, seed=1)
        trainer = SFTTrainer(model=model, train_dataset=data, args=args, max_seq_length=32)
        trainer._pad_id = lambda: 0
        return trainer, model

    full_trainer, model_full = trainer_for(tmp_path / "full")
    full = full_trainer.train()

    interrupted_run(trainer_for(tmp_path / "part")[0], at_step=10)
    assert (tmp_path / "part" / "checkpoint-10" / "trainer_state.json").is_file()

    resumed_trainer, model_resumed = trainer_for(tmp_path / "part")
    resumed = resumed_trainer.train(resume_from_checkpoint=True)
    assert full.global_step == resumed.global_step == 20
    full_losses, resumed_losses = full_trainer.state.loss_history, resumed_trainer.state.loss_history
    assert len(resumed_losses) == 20
    np.testing.assert_allclose(resumed_losses[10:], full_losses[10:], rtol=1e-6)
    # the resumed log history continues the checkpoint's; train_loss covers this call's 10 steps, as in HF
    logged = lambda t: [e["step"] for e in t.state.log_history if "loss" in e]  # noqa: E731
    assert logged(resumed_trainer) == logged(full_trainer) == [1, 5, 10, 15, 20]
    assert resumed.training_loss == pytest.approx(np.mean(resumed_losses[10:]), rel=1e-12)
    assert resumed.metrics["train_steps_per_second"] == pytest.approx(10 / resumed.metrics["train_runtime"],
                                                                      rel=1e-3, abs=2e-3)
    lines = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert {"step", "loss", "learning_rate", "grad_norm", "tokens_per_second"} <= set(lines[-1])
    a = jax.tree.leaves(lora.split(model_full)[1])
    b = jax.tree.leaves(lora.split(model_resumed)[1])
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)


def test_resume_with_another_optimizer_state_is_a_clear_error(llama_dir, tmp_path, rng):
    """A checkpoint whose optimizer state has another layout (saved with optim="sgd", resumed with AdamW; the same
    holds for checkpoints of the optax-chain AdamW state older code wrote) is refused naming the checkpoint."""
    data = _dataset(rng, n=8)

    def trainer_for(optim_name):
        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2,
                                 save_steps=2, logging_steps=1, optim=optim_name, seed=1)
        trainer = SFTTrainer(model=_peft_model(llama_dir, r=4), train_dataset=data, args=args, max_seq_length=32)
        trainer._pad_id = lambda: 0
        return trainer

    trainer_for("sgd").train()
    with pytest.raises(TrainingError, match=r"checkpoint-2: the saved training state does not match"):
        trainer_for("adamw_torch").train(resume_from_checkpoint=True)


def test_offload_step_compiles_once(llama_dir, tmp_path, rng, monkeypatch):
    """With host offload ("unsloth" checkpointing) the step returns committed arrays; the trainer commits its
    inputs up front so step 2 does not compile the step again (it did: 2.7-3.9 s at 8B on the H200).
    On the CPU the offload policy is forced by pretending the backend supports it (it compiles there)."""
    import unsloth_jax.train.step as step_mod
    import unsloth_jax.train.trainer as trainer_mod

    monkeypatch.setattr(step_mod, "host_offload_supported", lambda: True)
    steps = []
    real_make = trainer_mod.make_train_step

    def capture(*a, **kw):
        fn = real_make(*a, **kw)
        steps.append(fn)
        return fn

    monkeypatch.setattr(trainer_mod, "make_train_step", capture)
    model = _peft_model(llama_dir, r=4, alpha=8, use_gradient_checkpointing="unsloth")
    assert model.gradient_checkpointing == "offload"
    args = TrainingArguments(output_dir=str(tmp_path / "o"), per_device_train_batch_size=2, max_steps=4,
                             learning_rate=1e-3, save_steps=0, logging_steps=1)
    trainer = SFTTrainer(model=model, train_dataset=_dataset(rng), args=args, max_seq_length=32)
    trainer._pad_id = lambda: 0
    trainer.train()
    (fn,) = steps
    if not hasattr(fn.jitted, "_cache_size"):
        pytest.skip("this jax has no jit cache introspection")
    assert fn.jitted._cache_size() == 1


def test_tokens_per_second_when_each_step_blocks(llama_dir, tmp_path, rng, monkeypatch):
    """Metrics are read one step late; when every step call blocks until done (a timing wrapper, a synchronous
    backend) the last logged window used to be ~0 s long and report a huge tokens/s. Every window must now span
    at least one step's wall time."""
    import time as time_mod

    import unsloth_jax.train.trainer as trainer_mod

    step_s = 0.2
    real_make = trainer_mod.make_train_step

    def slow(*a, **kw):
        fn = real_make(*a, **kw)

        def blocking(*xs):
            out = jax.block_until_ready(fn(*xs))
            time_mod.sleep(step_s)
            return out

        blocking.lower = fn.lower
        return blocking

    monkeypatch.setattr(trainer_mod, "make_train_step", slow)
    model = _peft_model(llama_dir, r=4)
    args = TrainingArguments(output_dir=str(tmp_path / "t"), per_device_train_batch_size=2, max_steps=4,
                             learning_rate=1e-3, save_steps=0, logging_steps=1)
    trainer = SFTTrainer(model=model, train_dataset=_dataset(rng), args=args, max_seq_length=32)
    trainer._pad_id = lambda: 0
    trainer.train()
    lines = [json.loads(x) for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    max_tokens_per_step = 2 * 32
    assert "warmup_seconds" in lines[0] and all("tokens_per_second" in r for r in lines[1:])  # step 1: warm-up
    for r in lines[1:]:
        assert 0 < r["tokens_per_second"] <= max_tokens_per_step / step_s, r
