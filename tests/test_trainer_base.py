"""The trainer base every trainer runs on (unsloth_jax.train.base): DPO, ORPO and GRPO checkpoints resume to the
uninterrupted run's losses and weights (by path and by True), GRPO's evaluation on held-out prompts, callbacks,
the output_dir rules for the RL trainers, and flat device memory over 200 GRPO steps. Bundled tiny model."""
from __future__ import annotations

import gc
import json
import shutil

import jax
import numpy as np
import pytest

pytest.importorskip("transformers")

from tests.helpers import TINY_MODEL  # noqa: E402
from unsloth_jax import (DPOConfig, DPOTrainer, FastLanguageModel, GRPOConfig, GRPOTrainer, ORPOConfig,  # noqa: E402
                         ORPOTrainer, SFTTrainer, TrainingArguments, lora)
from unsloth_jax.errors import TrainingError  # noqa: E402


def _tiny(seed=3407, r=4):
    model, tok = FastLanguageModel.from_pretrained(TINY_MODEL, dtype="float32", progress=False)
    return FastLanguageModel.get_peft_model(model, r=r, lora_alpha=2 * r, use_gradient_checkpointing=False,
                                            random_state=seed), tok


def _pairs(n=4):
    return [{"prompt": f"Question {i}: what is {i} plus {i}?", "chosen": f" It is {2 * i}.",
             "rejected": f" Maybe {2 * i + 3}, or something else."} for i in range(n)]


def _prompts(n, offset=0):
    return [{"prompt": f"Say {i + offset}:", "level": i} for i in range(n)]


def _length_reward(prompts, completions, completion_ids, **kwargs):
    return [-len(c) / 8 for c in completion_ids]


def _make(kind, out, seed, **kw):
    """A fresh model and trainer of `kind` writing to `out` (the same data and arguments for a given seed)."""
    model, tok = _tiny()
    common = dict(output_dir=str(out), max_steps=5, save_steps=3, logging_steps=1, learning_rate=1e-2, seed=seed,
                  lr_scheduler_type="cosine", warmup_steps=1)
    common.update(kw)
    if kind == "dpo":
        args = DPOConfig(per_device_train_batch_size=2, gradient_accumulation_steps=2, beta=0.1, **common)
        return DPOTrainer(model=model, args=args, train_dataset=_pairs(6), processing_class=tok)
    if kind == "orpo":
        args = ORPOConfig(per_device_train_batch_size=2, beta=0.2, **common)
        return ORPOTrainer(model=model, args=args, train_dataset=_pairs(6), processing_class=tok)
    if kind == "grpo_spg":
        # steps_per_generation = 5 over 2 accumulation micro-batches: generations at micro-steps 0 and 5, so step
        # 2 (micro 4, 5) takes slices of two generations and checkpoint-3 (micro 6) falls inside the second
        args = GRPOConfig(per_device_train_batch_size=2, gradient_accumulation_steps=2, steps_per_generation=5,
                          num_generations=2, max_completion_length=6, beta=0.04, **common)
        return GRPOTrainer(model=model, reward_funcs=_length_reward, args=args, train_dataset=_prompts(5),
                           processing_class=tok)
    # GRPO with a reference (beta > 0) and num_iterations = 2: checkpoint-3 falls inside a generation batch,
    # which step 4 reuses (old and reference log-probabilities included)
    args = GRPOConfig(per_device_train_batch_size=4, num_generations=2, max_completion_length=6, beta=0.04,
                      num_iterations=2, **common)
    return GRPOTrainer(model=model, reward_funcs=_length_reward, args=args, train_dataset=_prompts(5),
                       processing_class=tok)


def _interrupt(trainer, at_step: int) -> None:
    """trainer.train() interrupted when it asks for the batch of step `at_step` (0-based): a crash after the
    checkpoints saved before that step."""
    real = trainer.next_batch

    def crash(step):
        if step == at_step:
            raise KeyboardInterrupt("simulated interruption")
        return real(step)

    trainer.next_batch = crash
    with pytest.raises(KeyboardInterrupt):
        trainer.train()


def _trained(trainer) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(lora.split(trainer.model)[1])]


def _logged(trainer, keys) -> list[dict]:
    return [{k: e[k] for k in keys if k in e} for e in trainer.state.log_history if "loss" in e]


@pytest.mark.parametrize("kind", ["dpo", "orpo", "grpo", "grpo_spg"])
def test_rl_trainers_resume_to_the_uninterrupted_run(kind, tmp_path, seed):
    """A run interrupted after its step-3 checkpoint and resumed (train(resume_from_checkpoint=True) in a fresh
    trainer and model; and TrainingArguments(resume_from_checkpoint=<path>)) gives the uninterrupted run's step
    losses bit for bit, its trained LoRA weights, its log entries (GRPO: rewards and num_tokens, i.e. the same
    prompts and completions), and metrics.jsonl holds each step once. grpo_spg: steps_per_generation=5 with 2
    accumulation steps, the checkpoint inside a generation buffer."""
    seed = seed % 2**16
    full = _make(kind, tmp_path / "full", seed)
    full.train()
    _interrupt(_make(kind, tmp_path / "part", seed), at_step=4)
    if kind.startswith("grpo"):
        assert (tmp_path / "part" / "checkpoint-3" / "generation_batch.npz").is_file()
    assert [p.name for p in sorted((tmp_path / "part").glob("checkpoint-*"))] == ["checkpoint-3"]
    shutil.copytree(tmp_path / "part", tmp_path / "part2")
    keys = ["loss", "step", "epoch", "learning_rate", "reward", "num_tokens", "rewards/chosen", "nll_loss"]

    by_true = _make(kind, tmp_path / "part", seed)
    out = by_true.train(resume_from_checkpoint=True)
    by_path = _make(kind, tmp_path / "part2", seed, resume_from_checkpoint=str(tmp_path / "part2" / "checkpoint-3"))
    by_path.train()
    for resumed, out_dir in ((by_true, tmp_path / "part"), (by_path, tmp_path / "part2")):
        assert len(resumed.state.loss_history) == 5
        np.testing.assert_array_equal(resumed.state.loss_history, full.state.loss_history)
        for a, b in zip(_trained(resumed), _trained(full)):
            np.testing.assert_array_equal(a, b)
        assert _logged(resumed, keys) == _logged(full, keys)
        steps = [json.loads(x)["step"] for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2, 3, 4, 5]
        assert (out_dir / "checkpoint-5" / "trainer_state.json").is_file()
    assert out.global_step == 5 and out.training_loss == pytest.approx(np.mean(full.state.loss_history[3:]))


def test_rl_trainer_refuses_a_used_output_dir_and_retrains_its_own(tmp_path):
    """As SFTTrainer: a new DPO trainer into an output_dir holding another run's files is refused naming
    overwrite_output_dir, which replaces them; the same trainer training again after a completed run replaces
    that run's files, but not those of its own interrupted run (their checkpoints can be resumed)."""
    first = _make("dpo", tmp_path, 1, max_steps=2, save_steps=1)
    first.train()
    with pytest.raises(TrainingError, match="holds an earlier run's files .*overwrite_output_dir=True"):
        _make("dpo", tmp_path, 1, max_steps=2, save_steps=1).train()
    first.args.max_steps = 1
    first.train()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "metrics.jsonl"]
    first.args.max_steps = 2
    _interrupt(first, at_step=1)
    with pytest.raises(TrainingError, match=r"holds an earlier run's files \(checkpoint-1, metrics.jsonl\)"):
        first.train()
    _make("dpo", tmp_path, 1, max_steps=2, save_steps=0, overwrite_output_dir=True).train()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_grpo_evaluates_held_out_prompts_with_trls_eval_keys(tmp_path):
    """eval_dataset: every eval_steps steps (and after training) num_generations completions of each held-out
    prompt are sampled with the live weights and scored; the entry holds TRL's eval_ keys, equal to the mean /
    std of the rewards the reward functions returned for those completions (computed here with numpy), and a run
    stopped at step 2 (constant learning rate: the same weights there) logs the same evaluation at step 2."""
    seen = []

    def reward(prompts, completions, completion_ids, level, **kwargs):
        values = [-len(c) / 8 for c in completion_ids]
        seen.append({"prompts": prompts, "ids": completion_ids, "values": values, "level": level})
        return values

    def bonus(prompts, completions, completion_ids, **kwargs):
        return [None if len(c) % 3 == 0 else 1.0 for c in completion_ids]

    evals = _prompts(3, offset=100)
    eval_prompts = {r["prompt"] for r in evals}

    def run(max_steps):
        model, tok = _tiny()
        args = GRPOConfig(output_dir=str(tmp_path / f"run{max_steps}"), per_device_train_batch_size=4,
                          num_generations=2, max_completion_length=8, max_steps=max_steps, logging_steps=1,
                          learning_rate=3e-2, lr_scheduler_type="constant", save_steps=0, eval_strategy="steps",
                          eval_steps=2, per_device_eval_batch_size=4, reward_weights=[1.0, 0.5], seed=5)
        trainer = GRPOTrainer(model=model, reward_funcs=[reward, bonus], args=args, train_dataset=_prompts(4),
                              eval_dataset=evals, processing_class=tok)
        seen.clear()
        trainer.train()
        calls = [c for c in seen if set(c["prompts"]) <= eval_prompts]
        return trainer, [e for e in trainer.state.log_history if "eval_reward" in e], calls

    trainer, entries, calls = run(4)
    assert [e["step"] for e in entries] == [2, 4]
    assert len(calls) == 2 * 2  # per evaluation: 3 prompts, 2 per engine call (per_device_eval_batch_size 4 / 2)
    for e, (a, b) in zip(entries, (calls[0:2], calls[2:4])):
        ids = a["ids"] + b["ids"]
        assert [p for c in (a, b) for p in c["prompts"]] == [r["prompt"] for r in evals for _ in range(2)]
        assert a["level"] == [0, 0, 1, 1]  # the eval records' other columns reach the reward functions
        r1 = np.asarray(a["values"] + b["values"])
        r2 = np.asarray([np.nan if len(c) % 3 == 0 else 1.0 for c in ids])
        total = r1 + 0.5 * np.nan_to_num(r2)
        groups = total.reshape(3, 2)
        assert e["eval_reward"] == pytest.approx(total.mean(), abs=1e-9)
        assert e["eval_reward_std"] == pytest.approx(total.std(ddof=1), abs=1e-9)
        assert e["eval_rewards/reward/mean"] == pytest.approx(r1.mean(), abs=1e-9)
        assert e["eval_rewards/bonus/mean"] == pytest.approx(np.nanmean(r2), nan_ok=True)
        assert e["eval_frac_reward_zero_std"] == pytest.approx(np.mean(groups.std(axis=1, ddof=1) == 0))
        assert e["eval_completions/mean_length"] == pytest.approx(np.mean([len(c) for c in ids]))
        assert e["eval_runtime"] > 0 and e["epoch"] > 0
    assert calls[0]["ids"] + calls[1]["ids"] != calls[2]["ids"] + calls[3]["ids"]  # the weights moved in between
    _, stopped, stopped_calls = run(2)
    assert [e["step"] for e in stopped] == [2]
    assert stopped[0]["eval_reward"] == entries[0]["eval_reward"]
    assert stopped_calls[0]["ids"] == calls[0]["ids"]
    again = trainer.evaluate()  # after training: the trained weights, the same sampling seed as the step-4 one
    assert again["eval_reward"] == entries[1]["eval_reward"]


def test_callbacks_see_each_step_and_can_save_evaluate_and_stop(tmp_path, rng):
    """callbacks=[...] (transformers' names and signature): on_train_begin, on_step_end per step, on_log with
    each log entry, on_save with the checkpoint, on_evaluate, on_train_end; control.should_save saves at that
    step, should_evaluate evaluates there and should_training_stop ends training after it (that step logged as
    the last)."""
    events = []

    class Recorder:
        def on_train_begin(self, args, state, control, **kw):
            events.append(("begin", state.global_step))

        def on_step_end(self, args, state, control, **kw):
            events.append(("step", state.global_step))
            control.should_save = state.global_step == 1
            control.should_evaluate = state.global_step == 2
            control.should_training_stop = state.global_step == 3

        def on_log(self, args, state, control, logs=None, **kw):
            events.append(("log", logs["step"], logs is state.log_history[-1]))

        def on_save(self, args, state, control, checkpoint=None, **kw):
            events.append(("save", checkpoint.rsplit("-", 1)[-1]))

        def on_evaluate(self, args, state, control, metrics=None, **kw):
            events.append(("evaluate", metrics["step"], "eval_loss" in metrics))

        def on_train_end(self, args, state, control, **kw):
            events.append(("end", state.global_step))

    model, _ = _tiny()
    data = [{"input_ids": rng.integers(4, 200, int(rng.integers(8, 20))).tolist()} for _ in range(8)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=6, save_steps=0,
                             logging_steps=2, eval_strategy="no")
    trainer = SFTTrainer(model=model, train_dataset=data, eval_dataset=data[:2], max_seq_length=32, args=args,
                         callbacks=[Recorder])
    out = trainer.train()
    assert out.global_step == 3 and len(trainer.state.loss_history) == 3
    # a step's log entry comes when its metrics are read: one step late, or before a save or an evaluation
    assert events == [("begin", 0), ("step", 1), ("log", 1, True), ("save", "1"), ("step", 2), ("log", 2, True),
                      ("log", 2, True), ("evaluate", 2, True), ("step", 3), ("log", 3, True), ("log", 3, True),
                      ("end", 3)]
    assert [e["step"] for e in trainer.state.log_history] == [1, 2, 2, 3, 3]  # step 3, the last, is logged
    assert [p.name for p in tmp_path.glob("checkpoint-*")] == ["checkpoint-1"]
    with pytest.raises(TypeError, match="callbacks"):
        SFTTrainer(model=model, train_dataset=data, max_seq_length=32, args=args, callbacks=[object()])


def test_grpo_device_memory_is_flat_over_80_steps(tmp_path):
    """80 tiny GRPO steps (generation, scoring with a reference, update): the live device arrays after step 80
    (gc run, measured from a callback at the same point of the loop) hold exactly the bytes they held after step
    10. A leak of even one float32 scalar per step would add 280 bytes, so the bound is < 4 bytes a step."""
    live = {}
    first, last = 10, 80

    class Probe:
        def on_step_end(self, args, state, control, **kw):
            if state.global_step in (first, last):
                gc.collect()
                arrays = jax.live_arrays()
                live[state.global_step] = (sum(a.nbytes for a in arrays), len(arrays))

    model, tok = _tiny(r=2)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=4, max_steps=last, logging_steps=20, learning_rate=1e-3, beta=0.04,
                      save_steps=0, seed=3)
    trainer = GRPOTrainer(model=model, reward_funcs=_length_reward, args=args, train_dataset=_prompts(6),
                          processing_class=tok, callbacks=[Probe()])
    trainer.train()
    print(f"live device bytes, arrays after steps {first} and {last}:", live)
    (bytes_first, n_first), (bytes_last, n_last) = live[first], live[last]
    assert bytes_last - bytes_first < (last - first) * 4, live
    assert n_last <= n_first, live


def test_a_checkpoint_of_another_layout_is_refused_by_name(tmp_path):
    """A training state saved with other shapes (e.g. a Qwen3.5 LoRA state from before its per-kind layer
    stacks: rows for all 32 layers where the model now has 8 or 24) is a TrainingError naming the checkpoint, the
    optimizer and both shapes, never a silent restore."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from unsloth_jax.train.checkpoints import STATE_FILE, restore_checkpoint

    path = tmp_path / "checkpoint-3"
    saver = ocp.StandardCheckpointer()
    saver.save(path / "state", {"lora_a": jnp.ones((32, 8, 2))})
    saver.wait_until_finished()
    (path / STATE_FILE).write_text("{}")
    with pytest.raises(TrainingError, match=r"checkpoint-3: the saved training state does not match .*'adamw_torch'"
                                            r".*\(8, 8, 2\).*\(32, 8, 2\).*Qwen3.5"):
        restore_checkpoint(path, {"lora_a": jnp.zeros((8, 8, 2))}, "adamw_torch")
