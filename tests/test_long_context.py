"""Long context: the sequence-tiled MLP and the remat/offload policies compute the same loss and gradients as
the plain step, and the trainer plans the step's memory before step 1, refusing a length that does not fit."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tests.helpers import inner_jaxprs, rel_err
from unsloth_jax import FastLanguageModel, SFTTrainer, TrainingArguments, lora
from unsloth_jax.families import text_config
from unsloth_jax.errors import TrainingError
from unsloth_jax.models import CausalLM
from unsloth_jax.train import make_train_step
from unsloth_jax.train.step import loss_and_count

CFG = {"model_type": "llama", "vocab_size": 80, "hidden_size": 32, "intermediate_size": 96, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5}


def _lora_model(seed: int, cfg: dict = CFG, dtype=jnp.float32) -> CausalLM:
    model = CausalLM(text_config(cfg), dtype=dtype, rngs=nnx.Rngs(seed))
    lora.add_lora(model, lora.LoraSettings(r=4, lora_alpha=8, target_modules=lora.ALL_TARGETS),
                  jax.random.PRNGKey(seed))
    for lin in model.projections().values():
        lin.lora_b[...] = 0.05 * jax.random.normal(jax.random.PRNGKey(seed + 1), lin.lora_b[...].shape)
    return model


def _loss_of_trainable(model, micro, remat):
    """(loss(trainable) of `model` on one micro-batch under `remat`, the trainable state, graphdef, frozen)."""
    graphdef, t, f = lora.split(model)
    return (lambda t_: loss_and_count(nnx.merge(graphdef, t_, f), micro, remat=remat)[0]), t, graphdef, f


def _grads(model, batch, remat, check_step=False):
    """(loss, LoRA gradients) of the jitted loss under `remat`; with check_step, the train step's loss as a
    cross-check (each check compiles a second program, so it is asked for on a few configurations only)."""
    micro = {k: jnp.asarray(v[0]) for k, v in batch.items()}
    loss, t, graphdef, f = _loss_of_trainable(model, micro, remat)
    value, grads = jax.jit(jax.value_and_grad(loss))(t)
    if check_step:
        step = make_train_step(graphdef, optax.sgd(1.0), remat=remat, donate=False)
        _, _, m = step(t, f, optax.sgd(1.0).init(t), batch)
        assert abs(float(m["loss"]) - float(value)) < 1e-6 * abs(float(value))
    return float(value), [np.asarray(g) for g in jax.tree.leaves(grads)]


def test_tiled_mlp_and_remat_policies_match_the_plain_step(rng, monkeypatch):
    import unsloth_jax.train.step as step_mod

    monkeypatch.setattr(step_mod, "host_offload_supported", lambda: True)  # the offload policy compiles on CPU
    seed = int(rng.integers(1 << 30))
    ids = rng.integers(0, CFG["vocab_size"], size=(1, 2, 37)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[0, 1, 30:] = 0
    batch = {"input_ids": ids, "labels": np.where(mask == 1, ids, -100).astype(np.int32), "attention_mask": mask}
    plain = _lora_model(seed)
    plain.model.layers.mlp.chunk_tokens = None
    want_loss, want = _grads(plain, batch, "none", check_step=True)
    for chunk, remat in ((16, "none"), (16, "full"), (None, "full"), (16, "offload"), (7, "offload"),
                         (None, "save_attention")):
        model = _lora_model(seed)
        model.model.layers.mlp.chunk_tokens = chunk  # 74 tokens: tiles of 16 (5, padded) or 7 (11)
        loss, got = _grads(model, batch, remat, check_step=(chunk, remat) == (7, "offload"))
        assert abs(loss - want_loss) / abs(want_loss) < 1e-6, (chunk, remat)
        for a, b in zip(got, want):
            assert rel_err(a, b) < 1e-5, (chunk, remat)


def _live_kernel_calls(jaxpr, kernel: str) -> int:
    """How many pallas_calls of `kernel` in `jaxpr` (and the jaxprs nested in it) have an output that is read.
    jax never drops a pallas_call from a jaxpr (its DCE rule keeps every one); XLA drops the dead ones."""
    used = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call" and kernel in str(eqn.params.get("name")):
            count += any(id(v) in used for v in eqn.outvars)
        count += sum(_live_kernel_calls(inner, kernel) for inner in inner_jaxprs(eqn))
    return count


def test_offload_attention_keeps_attention_residuals_and_skips_its_forward_in_the_backward(rng, monkeypatch):
    """remat "offload_attention" with the Pallas flash kernel (interpret mode): the plain step's loss and LoRA
    gradients, and each layer's attention forward runs once per step (the backward reads its offloaded output
    and log-sum-exp), where "offload" runs it twice (once more when the backward recomputes the layer)."""
    from unsloth_jax import ops

    monkeypatch.setattr(ops, "_set_impls", {"attention": "pallas"})
    cfg = dict(CFG, hidden_size=64)  # head_dim 16: the flash kernel's smallest
    seed = int(rng.integers(1 << 30))
    ids = rng.integers(0, 80, size=(1, 2, 40)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[0, 1, 33:] = 0
    batch = {"input_ids": ids, "labels": np.where(mask == 1, ids, -100).astype(np.int32), "attention_mask": mask}
    micro = {k: jnp.asarray(v[0]) for k, v in batch.items()}
    want_loss, want = _grads(_lora_model(seed, cfg), batch, "none")
    live = {}
    for remat in ("offload", "offload_attention"):
        model = _lora_model(seed, cfg)
        loss, got = _grads(model, batch, remat, check_step=remat == "offload_attention")
        assert abs(loss - want_loss) / abs(want_loss) < 1e-6, remat
        for a, b in zip(got, want):
            assert rel_err(a, b) < 1e-5, remat
        loss_fn, t, _, _ = _loss_of_trainable(model, micro, remat)
        jaxpr = jax.make_jaxpr(jax.grad(loss_fn))(t).jaxpr
        live[remat] = _live_kernel_calls(jaxpr, "flash_attention_fwd")
        assert _live_kernel_calls(jaxpr, "flash_attention_dq") == 1  # one scan body: one call of each kernel
    assert live == {"offload": 2, "offload_attention": 1}


@pytest.mark.gpu
def test_gpu_offload_attention_runs_cudnn_forward_once_per_layer():
    """On the GPU (cuDNN attention, bf16): the compiled value-and-grad under "offload_attention" holds one cuDNN
    attention forward (the layer scan's forward body) where "offload" holds two (the backward body recomputes
    it), and both give the loss and LoRA gradients of the step without remat."""
    from unsloth_jax import ops

    cfg = dict(CFG, hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1)
    ids = np.random.default_rng(0).integers(0, 80, size=(2, 256)).astype(np.int32)
    micro = {"input_ids": jnp.asarray(ids), "labels": jnp.asarray(ids), "attention_mask": jnp.ones_like(ids)}
    results, forward_calls = {}, {}
    for remat in ("none", "offload", "offload_attention"):
        loss_fn, t, _, _ = _loss_of_trainable(_lora_model(0, cfg, jnp.bfloat16), micro, remat)
        with ops.recording_choices() as seen:
            fn = jax.jit(jax.value_and_grad(loss_fn))
            hlo = fn.lower(t).compile().as_text()
        assert seen["attention"] == ["cudnn"], seen
        forward_calls[remat] = hlo.count('custom_call_target="__cudnn$fmhaSoftmax"')
        value, grads = fn(t)
        results[remat] = (float(value), [np.asarray(g, np.float32) for g in jax.tree.leaves(grads)])
    assert forward_calls == {"none": 1, "offload": 2, "offload_attention": 1}, forward_calls
    for remat in ("offload", "offload_attention"):
        assert abs(results[remat][0] - results["none"][0]) < 1e-2 * abs(results["none"][0]), remat
        for a, b in zip(results[remat][1], results["none"][1]):
            assert rel_err(a, b) < 5e-2, remat


def _trainer(tmp_path, max_seq_length, rng):
    model, _ = FastLanguageModel.from_pretrained("unsloth_jax/assets/tiny-llama", dtype="float32",
                                                 load_tokenizer=False, progress=False)
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=True)
    data = [{"input_ids": rng.integers(1, 2000, size=max_seq_length).tolist()} for _ in range(4)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, save_steps=0,
                             logging_steps=1)
    trainer = SFTTrainer(model=model, train_dataset=data, args=args, max_seq_length=max_seq_length)
    trainer._pad_id = lambda: 0
    return trainer


def test_trainer_plans_memory_and_refuses_a_length_that_does_not_fit(tmp_path, rng, monkeypatch, capsys):
    from unsloth_jax import backend
    from unsloth_jax.train import trainer as trainer_mod

    trainer = _trainer(tmp_path / "a", 256, rng)
    trainer.train()
    out = capsys.readouterr().out
    assert "step memory (XLA's analysis, S=256)" in out and "kernels: " in out
    # the same run on a device with less memory than the step needs: refused before step 1, with a length that fits
    plans = []
    real_plan = trainer_mod.plan_step_memory
    monkeypatch.setattr(trainer_mod, "plan_step_memory", lambda *a: plans.append(real_plan(*a)) or plans[-1])
    trainer = _trainer(tmp_path / "b", 256, rng)
    trainer.train()
    need = plans[-1].device_bytes
    monkeypatch.setattr(backend, "device_memory_limit", lambda: int(need * 0.9))
    trainer = _trainer(tmp_path / "c", 256, rng)
    with pytest.raises(TrainingError, match=r"max_seq_length=256\) needs .* the largest max_seq_length that fits is "
                                            r"about ([\d,]+)") as e:
        trainer.train()
    fits = int(str(e.value).split("fits is about ")[1].split(" ")[0].replace(",", ""))
    assert 0 < fits < 256
    assert not (tmp_path / "c" / "metrics.jsonl").exists()  # nothing ran
    monkeypatch.setattr(backend, "device_memory_limit", lambda: int(need * 0.9))
    trainer = _trainer(tmp_path / "d", fits, rng)
    trainer.train()  # the suggested length does fit
    assert plans[-1].device_bytes < need * 0.9


def test_plan_refuses_a_step_whose_offloaded_activations_exceed_host_memory(monkeypatch):
    """XLA's memory analysis says how much pinned host memory the offloaded activations take (the CPU backend
    reports none, so the analysis is given here): more than 90% of the machine's memory is refused before step
    1, naming the sizes and the remat choices that offload less; within it, the plan line reports it."""
    from types import SimpleNamespace

    from unsloth_jax import backend
    from unsloth_jax.train.trainer import plan_step_memory

    gib = 2 ** 30
    analysis = SimpleNamespace(argument_size_in_bytes=6 * gib, output_size_in_bytes=gib, alias_size_in_bytes=gib,
                               temp_size_in_bytes=9 * gib, host_temp_size_in_bytes=128 * gib,
                               host_argument_size_in_bytes=0)

    class Step:
        def lower(self, *args):
            return SimpleNamespace(compile=lambda: SimpleNamespace(memory_analysis=lambda: analysis))

    batch = {"input_ids": np.zeros((1, 8), np.int32)}
    monkeypatch.setattr(backend, "device_memory_limit", lambda: 140 * gib)
    monkeypatch.setattr(backend, "host_memory_limit", lambda: 128 * gib)
    with pytest.raises(TrainingError, match=r"offloads 128\.0 GiB .* this machine has 128\.0 GiB; use "
                                            r"use_gradient_checkpointing='unsloth'"):
        plan_step_memory(Step(), (), batch, 262144, 262144)
    analysis.host_temp_size_in_bytes = 64 * gib
    line = plan_step_memory(Step(), (), batch, 262144, 262144)
    assert line.host_bytes == 64 * gib and "15.00 GiB on the device + 64.00 GiB pinned host" in line


def _gemma2_cfg(layers: int) -> dict:
    from tests.hf_models import FAMILIES, TINY, tiny_config

    return tiny_config("gemma2", dict(TINY) | FAMILIES["gemma2"] | {"num_hidden_layers": layers}).to_dict()


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_two_level_remat_matches_the_plain_step(family, rng, monkeypatch):
    """The two-level modes ("<full|offload>_every_K") give the plain step's loss and LoRA gradients (float32),
    as the per-layer modes do (test above), when K does not divide L (a shorter last checkpointed group) and, for
    Gemma 2 (scan groups of its period 2, sliding and global layers; 7 layers = 3 x 2 + a tail of 1), with
    groups of whole periods."""
    import unsloth_jax.train.step as step_mod

    monkeypatch.setattr(step_mod, "host_offload_supported", lambda: True)  # the offload policy compiles on CPU
    cfg = dict(CFG, num_hidden_layers=7) if family == "llama" else _gemma2_cfg(7)
    assert text_config(cfg).layer_period == (1 if family == "llama" else 2)
    # llama, 7 layers: groups of 3 + 3 + 1 and 2 + 2 + 2 + 1 layers; gemma2: 2 + 1 scan groups of 2, then the tail
    # (and "offload": the prefetched scan over 3 groups of 2, then over the tail)
    modes = ["full_every_3", "offload_every_2"] if family == "llama" else ["offload_every_4", "offload"]
    seed = int(rng.integers(1 << 30))
    ids = rng.integers(0, 80, size=(1, 2, 29)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[0, 1, 23:] = 0
    batch = {"input_ids": ids, "labels": np.where(mask == 1, ids, -100).astype(np.int32), "attention_mask": mask}
    want_loss, want = _grads(_lora_model(seed, cfg), batch, "none")
    for remat in modes:
        loss, got = _grads(_lora_model(seed, cfg), batch, remat, check_step=remat == modes[-1])
        assert abs(loss - want_loss) / abs(want_loss) < 1e-6, remat
        for a, b in zip(got, want):
            assert rel_err(a, b) < 1e-5, remat


def test_two_level_remat_mode_names(monkeypatch):
    import unsloth_jax.train.step as step_mod
    from unsloth_jax.models.layer_stack import LayerStackPolicy

    assert step_mod.resolve_remat(True, 4) == "full_every_4"
    monkeypatch.setattr(step_mod, "host_offload_supported", lambda: True)
    assert step_mod.resolve_remat("unsloth", 4) == "offload_every_4" and step_mod.resolve_remat(True, 1) == "full"
    with pytest.raises(ValueError, match="layers_per_checkpoint"):
        step_mod.resolve_remat(False, 4)

    parse = LayerStackPolicy.parse
    assert (parse("offload").mode, parse("offload").layers_per_checkpoint) == ("offload", 1)
    assert (parse("full_every_4").mode, parse("full_every_4").layers_per_checkpoint) == ("full", 4)
    assert parse("offload", 4) == "offload_every_4" and parse("full", 1) == "full"
    for bad in ("offload_every_0", "save_attention_every_2", "full_every_", "full_every_04", "fast"):
        with pytest.raises(ValueError, match="unknown remat mode"):
            parse(bad)
    with pytest.raises(ValueError, match="layers_per_checkpoint"):
        parse("save_attention", 4)
    with pytest.raises(ValueError, match="layers_per_checkpoint must be an integer"):
        parse("full", 0)


def test_two_level_remat_keeps_fewer_layer_inputs():
    """XLA's memory analysis of the compiled train step: between two sequence lengths, the step's temp bytes
    under "full_every_4" grow by at least 90% of (L - L/4 - 4) layer inputs [B, dS, D] less than under
    per-layer "full" (which keeps L layer inputs, where the two-level mode keeps L/4 group inputs plus the 4
    layer inputs of the group whose backward runs). Reading the growth with the length cancels what does not
    scale with it (the layer weights' copies), so the bound holds only if the residuals really shrink."""
    from bench.remat_memory import lora_state_specs, small_config, step_memory

    layers, hidden, batch, k = 16, 128, 8, 4
    specs = lora_state_specs(small_config(layers, hidden, 128, heads=1, kv_heads=1), jnp.float32)
    seqs = (128, 256)
    temp = {mode: [step_memory(*specs, mode, batch, s)["temp_bytes"] for s in seqs]
            for mode in ("full", "full_every_4")}
    growth = {mode: t[1] - t[0] for mode, t in temp.items()}
    layer_input = batch * (seqs[1] - seqs[0]) * hidden * 4
    kept_less = layers - layers // k - k
    assert growth["full"] - growth["full_every_4"] >= 0.9 * kept_less * layer_input, (temp, layer_input)
