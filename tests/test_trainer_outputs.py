"""SFTTrainer's results as transformers shapes them (TrainOutput, trainer.state.log_history), report_to
(TensorBoard event files read back), and argument checks at construction. Runs the bundled tiny model."""
from __future__ import annotations

import json
import math
import socket

import numpy as np
import pytest

from tests.helpers import TINY_MODEL, read_tensorboard_scalars
from unsloth_jax import FastLanguageModel, SFTTrainer, TrainingArguments
from unsloth_jax.train import TrainerState, TrainOutput
from unsloth_jax.train.reporting import resolve_report_to


def _model():
    model, _ = FastLanguageModel.from_pretrained(TINY_MODEL, dtype="float32", load_tokenizer=False, progress=False)
    return FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)


def _dataset(rng, n=12):
    return [{"input_ids": [int(x) for x in rng.integers(4, 200, size=int(rng.integers(8, 30)))]} for _ in range(n)]


def _trainer(tmp_path, rng, eval_dataset=None, **kw):
    kw = {"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 2, "max_steps": 6,
          "learning_rate": 1e-3, "save_steps": 0, "logging_steps": 2, **kw}
    return SFTTrainer(model=_model(), train_dataset=_dataset(rng), eval_dataset=eval_dataset, max_seq_length=32,
                      args=TrainingArguments(**kw))


def test_train_returns_train_output_with_hf_metrics(tmp_path, rng):
    """train() returns TrainOutput(global_step, training_loss, metrics); metrics follow transformers'
    speed_metrics (samples = max_steps x batch x accumulation) and train_loss is the mean step loss."""
    trainer = _trainer(tmp_path, rng, gradient_accumulation_steps=2)
    out = trainer.train()
    assert isinstance(out, TrainOutput) and out.global_step == 6
    m = out.metrics
    assert set(m) == {"train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss", "epoch"}
    runtime = m["train_runtime"]
    assert runtime > 0
    # recomputed from the rounded runtime, so allow the rounding of both
    assert m["train_steps_per_second"] == pytest.approx(6 / runtime, rel=1e-3, abs=2e-3)
    assert m["train_samples_per_second"] == pytest.approx(6 * 2 * 2 / runtime, rel=1e-3, abs=2e-3)
    state = trainer.state
    assert isinstance(state, TrainerState)
    assert state.global_step == 6 and state.max_steps == 6 and len(state.loss_history) == 6
    assert out.training_loss == m["train_loss"] == pytest.approx(np.mean(state.loss_history), rel=1e-12)
    batches_per_epoch = math.ceil(12 / 2)
    assert m["epoch"] == state.epoch == pytest.approx(6 * 2 / batches_per_epoch)


def test_ctrl_c_names_the_newest_checkpoint_and_how_to_resume(tmp_path, rng, capsys):
    """Issue 48: Ctrl-C during train() prints the newest checkpoint and the trainer.train(resume_from_checkpoint=...)
    call that continues from it; that call runs the remaining steps. Its train_loss averages the steps of that call
    only, as transformers 5's Trainer does (`_total_loss_scalar` restarts at 0 in every train() call)."""
    class CtrlC:
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 3:
                raise KeyboardInterrupt

    trainer = _trainer(tmp_path, rng, save_steps=2)
    trainer.callback_handler.callbacks.append(CtrlC())
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    err = capsys.readouterr().err
    newest = (tmp_path / "out" / "checkpoint-2").resolve()
    assert "interrupted at step 3" in err and f"the newest checkpoint is {newest}" in err, err
    assert f"trainer.train(resume_from_checkpoint={str(newest)!r})" in err, err
    trainer.callback_handler.callbacks.pop()
    out = trainer.train(resume_from_checkpoint=str(newest))
    assert out.global_step == 6 and len(trainer.state.loss_history) == 6
    assert out.metrics["train_loss"] == pytest.approx(np.mean(trainer.state.loss_history[2:]), rel=1e-9)

    fresh = _trainer(tmp_path / "b", rng)
    fresh.callback_handler.callbacks.append(CtrlC())
    with pytest.raises(KeyboardInterrupt):
        fresh.train()
    assert "no checkpoint was saved" in capsys.readouterr().err


def test_log_history_entries(tmp_path, rng):
    """Logged steps (1, then every logging_steps) average the loss since the previous entry; an eval entry
    and the final summary follow, as in transformers."""
    trainer = _trainer(tmp_path, rng, eval_dataset=_dataset(rng, n=4))
    out = trainer.train()
    hist, losses = trainer.state.log_history, trainer.state.loss_history
    steps = [e for e in hist if "loss" in e]
    assert [e["step"] for e in steps] == [1, 2, 4, 6]
    for e in steps:
        assert set(e) == {"loss", "grad_norm", "learning_rate", "epoch", "step"}
    windows = [(0, 1), (1, 2), (2, 4), (4, 6)]
    for e, (a, b) in zip(steps, windows):
        assert e["loss"] == pytest.approx(np.mean(losses[a:b]), rel=1e-12)
    evals = [e for e in hist if "eval_loss" in e]
    assert len(evals) == 1 and set(evals[0]) == {"eval_loss", "eval_runtime", "eval_samples_per_second",
                                                   "eval_steps_per_second", "epoch", "step"} and evals[0]["step"] == 6
    assert np.isfinite(evals[0]["eval_loss"])
    assert hist[-1] == {**out.metrics, "step": 6}
    again = trainer.evaluate()  # transformers' dict, the same loss as the logged entry (the model is unchanged)
    assert again["eval_loss"] == pytest.approx(evals[0]["eval_loss"], rel=1e-6) and again["epoch"] == out.metrics["epoch"]
    assert again["eval_runtime"] > 0 and again["eval_samples_per_second"] > 0
    jsonl = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in jsonl] == [(e["step"], e["loss"]) for e in steps]


def test_tensorboard_events_match_metrics_jsonl(tmp_path, rng):
    logdir = tmp_path / "tb"
    trainer = _trainer(tmp_path, rng, report_to="tensorboard", logging_dir=str(logdir))
    out = trainer.train()
    scalars = read_tensorboard_scalars(logdir)
    jsonl = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    # event files store float32
    np.testing.assert_allclose([v for _, v in scalars["train/loss"]], [r["loss"] for r in jsonl], rtol=1e-6)
    assert [s for s, _ in scalars["train/loss"]] == [r["step"] for r in jsonl]
    np.testing.assert_allclose([v for _, v in scalars["train/learning_rate"]], [r["learning_rate"] for r in jsonl],
                               rtol=1e-6)
    assert scalars["train/train_runtime"][0][1] == pytest.approx(out.metrics["train_runtime"], rel=1e-6)


def test_tensorboard_default_logging_dir(tmp_path, rng):
    """Without logging_dir, events go to OUTPUT_DIR/runs/<datetime>_<hostname> (transformers' default)."""
    trainer = _trainer(tmp_path, rng, max_steps=2, report_to=["tensorboard"])
    trainer.train()
    runs = list((tmp_path / "out" / "runs").iterdir())
    assert len(runs) == 1 and runs[0].name.endswith("_" + socket.gethostname())
    assert read_tensorboard_scalars(runs[0])["train/loss"]


def test_report_to_none_writes_no_events(tmp_path, rng):
    trainer = _trainer(tmp_path, rng, max_steps=2, report_to="none")
    trainer.train()
    assert not (tmp_path / "out" / "runs").exists()


@pytest.mark.parametrize("value, expected", [(None, []), ("none", []), ([], []), (["none"], []),
                                             ("tensorboard", ["tensorboard"]), ("all", ["tensorboard"]),
                                             (["tensorboard", "tensorboard"], ["tensorboard"])])
def test_report_to_values(value, expected):
    assert resolve_report_to(value) == expected
    assert TrainingArguments(report_to=value).report_to == expected


def test_report_to_unknown_names_the_value():
    with pytest.raises(ValueError, match="'wandb'"):
        TrainingArguments(report_to="wandb")
    with pytest.raises(ValueError, match="'mlflow'"):
        TrainingArguments(report_to=["tensorboard", "mlflow"])
    with pytest.raises(TypeError, match="report_to"):
        TrainingArguments(report_to=3)


@pytest.mark.parametrize("kwargs, error, words", [
    ({"learning_rate": "2e-4"}, TypeError, ("learning_rate", "'2e-4'")),
    ({"learning_rate": -1e-4}, ValueError, ("learning_rate", "-0.0001")),
    ({"learning_rate": float("nan")}, ValueError, ("learning_rate", "nan")),
    ({"per_device_train_batch_size": 0}, ValueError, ("per_device_train_batch_size", "0")),
    ({"per_device_train_batch_size": 2.0}, TypeError, ("per_device_train_batch_size", "2.0")),
    ({"gradient_accumulation_steps": -2}, ValueError, ("gradient_accumulation_steps", "-2")),
    ({"max_steps": 0}, ValueError, ("max_steps", "0")),
    ({"max_steps": "60"}, TypeError, ("max_steps", "'60'")),
    ({"logging_steps": 0}, ValueError, ("logging_steps", "0")),
    ({"save_steps": -5}, ValueError, ("save_steps", "-5")),
    ({"warmup_ratio": 1.5}, ValueError, ("warmup_ratio", "1.5")),
    ({"warmup_steps": -1}, ValueError, ("warmup_steps", "-1")),
    ({"optim": "adamw_9bit"}, ValueError, ("optim", "adamw_9bit")),
    ({"lr_scheduler_type": "polynomial"}, ValueError, ("lr_scheduler_type", "polynomial")),
    ({"weight_decay": -0.1}, ValueError, ("weight_decay", "-0.1")),
    ({"adam_beta2": 1.0}, ValueError, ("adam_beta2", "1")),
    ({"bf16": "yes"}, TypeError, ("bf16", "'yes'")),
    ({"overwrite_output_dir": "yes"}, TypeError, ("overwrite_output_dir", "'yes'")),
    ({"resume_from_checkpoint": 3}, TypeError, ("resume_from_checkpoint", "3")),
    ({"eval_strategy": "sometimes"}, ValueError, ("eval_strategy", "'sometimes'", "steps")),
    ({"eval_steps": 0}, ValueError, ("eval_steps", "0")),
])
def test_training_arguments_checked_at_construction(kwargs, error, words):
    with pytest.raises(error) as e:
        TrainingArguments(**kwargs)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_training_arguments_accepts_hf_style_values():
    assert TrainingArguments(learning_rate=0, max_steps=-1, num_train_epochs=2).learning_rate == 0
    assert TrainingArguments(warmup_steps=0.1).warmup_steps == 0.1  # a ratio, as transformers 5 reads it
    assert TrainingArguments(per_device_train_batch_size=np.int64(4)).per_device_train_batch_size == 4


def test_output_dir_of_an_earlier_run_needs_overwrite_or_resume(tmp_path, rng):
    """A fresh train() into an output_dir holding an earlier run's files is refused naming overwrite_output_dir
    (transformers' name); with overwrite_output_dir=True only the new run's files remain; a resume asked for with
    TrainingArguments(resume_from_checkpoint=...) (transformers' argument) continues that run. An output_dir that
    is a file is refused before the step compiles."""
    from unsloth_jax.errors import TrainingError

    data = _dataset(rng)
    out = tmp_path / "out"

    def trainer(**kw):
        kw = {"output_dir": str(out), "per_device_train_batch_size": 2, "max_steps": 6, "learning_rate": 1e-3,
              "save_steps": 3, "logging_steps": 1, "seed": 1, **kw}
        return SFTTrainer(model=_model(), train_dataset=data, max_seq_length=32, args=TrainingArguments(**kw))

    trainer().train()
    with pytest.raises(TrainingError, match=r"holds an earlier run's files \(checkpoint-3, checkpoint-6, "
                                            r"metrics.jsonl\); pass overwrite_output_dir=True"):
        trainer().train()
    second = trainer(max_steps=4, save_steps=2, overwrite_output_dir=True)
    second.train()
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-4", "metrics.jsonl"]
    steps = lambda: [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert steps() == [1, 2, 3, 4]
    resumed = trainer(max_steps=4, save_steps=2, resume_from_checkpoint=str(out / "checkpoint-2"))
    resumed.train()
    np.testing.assert_allclose(resumed.state.loss_history, second.state.loss_history, rtol=1e-6)
    assert steps() == [1, 2, 3, 4]  # the resumed steps replace the lines logged after checkpoint-2
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    with pytest.raises(TrainingError, match="output_dir .* is not a directory"):
        trainer(output_dir=str(a_file)).train()


def test_tokens_per_second_is_each_windows_tokens_over_its_steps_run_time(tmp_path, rng, monkeypatch):
    """metrics.jsonl's tokens_per_second is the logged window's target tokens over the time its steps ran, without
    compile time (reported as compile_seconds): each value is checked against the same compiled step re-run on
    that step's own inputs after training (best of 3). The batches have three lengths, so steps compile mid-run;
    counting their compilation made such steps 10-100x slow, and steps read as returned (before running) up to
    10x fast."""
    import time

    import jax

    import unsloth_jax.train.trainer as trainer_mod

    calls = []  # per step call: (copies of the donated trainable and opt_state, frozen, batch, metrics)
    steps = []
    real_make = trainer_mod.make_train_step

    def capture(*a, **kw):
        fn = real_make(*a, **kw)
        steps.append(fn)

        class Step:
            lower = staticmethod(fn.lower)

            def __call__(self, trainable, frozen, opt_state, batch):
                kept = jax.device_put((trainable, opt_state), may_alias=False)  # a copy that compiles nothing
                out = fn(trainable, frozen, opt_state, batch)
                calls.append((kept, frozen, batch, out[2]))
                return out

        return Step()

    monkeypatch.setattr(trainer_mod, "make_train_step", capture)
    lengths = [int(rng.integers(lo, hi)) for lo, hi in ((20, 60), (70, 120), (140, 250)) for _ in range(8)]
    data = [{"input_ids": [int(x) for x in rng.integers(4, 200, size=n)]} for n in lengths]
    trainer = SFTTrainer(model=_model(), train_dataset=data, max_seq_length=256,
                         args=TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
                                                max_steps=8, save_steps=0, logging_steps=1, seed=int(rng.integers(99))))
    trainer.train()
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9)) and len(calls) == 8

    def run_seconds(k):
        (trainable, opt_state), frozen, batch, _ = calls[k]
        best = float("inf")
        for _ in range(3):
            args = jax.block_until_ready(jax.device_put((trainable, opt_state), may_alias=False))
            t0 = time.perf_counter()
            jax.block_until_ready(steps[0](args[0], frozen, args[1], batch))
            best = min(best, time.perf_counter() - t0)
        return best

    shapes = [tuple(batch["input_ids"].shape) for _, _, batch, _ in calls]
    assert len(set(shapes)) >= 2, shapes  # some steps compiled during the run
    # a shape's first run (just compiled) also starts up XLA's kernels: a warm-up, reported as warmup_seconds
    first = [shapes[k] not in shapes[:k] for k in range(len(shapes))]
    assert [("warmup_seconds" in r) for r in records] == first, (records, shapes)
    assert all(("tokens_per_second" in r) != new for r, new in zip(records, first))
    ratios = [r["tokens_per_second"] / (int(calls[k][3]["tokens"]) / run_seconds(k))
              for k, r in enumerate(records) if not first[k]]
    print("logged / re-timed tokens_per_second:", [round(x, 2) for x in ratios], shapes)
    assert all(0.25 < x < 4 for x in ratios), (ratios, shapes)
    for k, record in enumerate(records):
        if "compile_seconds" in record:
            assert shapes[k] not in shapes[:k], (k, shapes)  # compiled: a shape not seen before
    assert sum(r.get("compile_seconds", 0) for r in records) > 0


def test_first_logged_tokens_per_second_leaves_out_the_warm_up(tmp_path, rng, monkeypatch):
    """Issue 48: the first step (XLA's first run of the program, several times slower than the next) is left out
    of the first window's tokens_per_second: with every step made to take 0.1 s more and the first 1 s more,
    the first window's rate is the steady one; logged alone (logging_first_step), it is warmup_seconds."""
    import time

    real = SFTTrainer.run_step
    calls = []

    def timed(self, state, batch):
        out = real(self, state, batch)
        jax.block_until_ready(out[1]["loss"])
        time.sleep(1.0 if not calls else 0.1)
        calls.append(int(out[1]["tokens"]))
        return out

    import jax

    monkeypatch.setattr(SFTTrainer, "run_step", timed)
    data = [{"input_ids": [int(x) for x in rng.integers(4, 200, size=20)]} for _ in range(12)]  # one shape
    for first_step, out in ((False, "a"), (True, "b")):
        calls.clear()
        trainer = SFTTrainer(model=_model(), train_dataset=data, max_seq_length=32,
                             args=TrainingArguments(output_dir=str(tmp_path / out), per_device_train_batch_size=2,
                                                    max_steps=6, logging_steps=3, logging_first_step=first_step,
                                                    report_to="none"))
        trainer.train()
        records = [json.loads(x) for x in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]
        steady = [r["tokens_per_second"] for r in records if "tokens_per_second" in r]
        assert [r["step"] for r in records] == ([1, 3, 6] if first_step else [3, 6])
        # each counted step took >= 0.1 s and < 0.2 s: tokens / s within those bounds, not 1 s-dragged
        for r in steady:
            assert sum(calls[1:3]) / 2 / 0.2 < r < sum(calls[1:3]) / 2 / 0.1, (r, calls, records)
        if first_step:
            assert "tokens_per_second" not in records[0] and records[0]["warmup_seconds"] >= 1.0, records


def test_sft_config_carries_trls_sft_arguments(tmp_path, rng):
    """SFTConfig (TRL's name, exported at the top level) gives SFTTrainer dataset_text_field, max_length (or its
    older name max_seq_length), packing and completion_only_loss; SFTTrainer's own keyword arguments still win."""
    from transformers import AutoTokenizer

    from unsloth_jax import SFTConfig

    tok = AutoTokenizer.from_pretrained(str(TINY_MODEL))
    model = _model()
    docs = [{"body": f"a document about {w} and why it matters so much to everyone"} for w in ("jax", "flax", "nnx")]
    out = str(tmp_path / "out")
    trainer = SFTTrainer(model=model, processing_class=tok, train_dataset=docs,
                         args=SFTConfig(output_dir=out, dataset_text_field="body", max_length=8, packing=True))
    assert trainer.max_seq_length == 8 and trainer.packing
    assert [e["input_ids"] for e in trainer.train_examples] == [tok(d["body"]).input_ids[:8] for d in docs]
    trainer = SFTTrainer(model=model, processing_class=tok, train_dataset=docs, max_seq_length=32, packing=False,
                         args=SFTConfig(output_dir=out, dataset_text_field="body", max_seq_length=8, packing=True))
    assert trainer.max_seq_length == 32 and not trainer.packing
    assert SFTConfig(max_seq_length=12).max_length == 12 and SFTConfig(max_length=12).max_seq_length == 12
    with pytest.raises(ValueError, match="max_length=8 and max_seq_length=12"):
        SFTConfig(max_length=8, max_seq_length=12)
    with pytest.raises(ValueError, match="assistant_only_loss=True"):
        SFTConfig(assistant_only_loss=True)
    pairs = [{"prompt": "2 + 2 =", "completion": " 4"}, {"prompt": "3 + 3 =", "completion": " 6"}]
    labels = {flag: [e["labels"] for e in SFTTrainer(model=model, processing_class=tok, train_dataset=pairs,
                                                     args=SFTConfig(output_dir=out, completion_only_loss=flag))
                     .train_examples] for flag in (None, False)}
    prompt_len = len(tok("2 + 2 =").input_ids)
    assert all(x == -100 for x in labels[None][0][:prompt_len])  # TRL's default: the completion only
    assert -100 not in labels[False][0]


def test_eval_strategy_steps_epoch_and_no(tmp_path, rng):
    """eval_strategy (transformers' name): "steps" evaluates every eval_steps steps and after training, "epoch"
    after each epoch and after training, "no" never, None (the default) after training; an evaluation during
    training is of the weights at that step (a run stopped there gives the same eval_loss)."""
    data, evals = _dataset(rng, n=8), _dataset(rng, n=4)
    runs = []

    def run(**kw):
        kw = {"output_dir": str(tmp_path / f"run{len(runs)}"), "per_device_train_batch_size": 2, "max_steps": 6,
              "learning_rate": 1e-2, "lr_scheduler_type": "constant", "save_steps": 0, "seed": 1, **kw}
        trainer = SFTTrainer(model=_model(), train_dataset=data, eval_dataset=evals, max_seq_length=32,
                             args=TrainingArguments(**kw))
        trainer.train()
        runs.append(trainer)
        return {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}

    by_steps = run(eval_strategy="steps", eval_steps=2)
    assert list(by_steps) == [2, 4, 6]
    assert list(run(eval_strategy="epoch")) == [4, 6]  # 8 rows in batches of 2: 4 steps an epoch
    assert list(run(eval_strategy="no")) == []
    assert list(run()) == [6]
    stopped = run(max_steps=2)
    assert by_steps[2] == pytest.approx(stopped[2], rel=1e-6) and by_steps[2] != pytest.approx(by_steps[6])


def test_float_warmup_steps_is_a_ratio(tmp_path, rng):
    trainer = _trainer(tmp_path, rng, max_steps=10, warmup_steps=0.25)
    assert trainer._warmup_steps(10) == 3  # ceil(0.25 x 10)


def test_sft_trainer_max_seq_length_zero_is_an_error(rng):
    model = _model()
    with pytest.raises(ValueError, match="max_seq_length must be >= 1, got 0"):
        SFTTrainer(model=model, train_dataset=_dataset(rng), max_seq_length=0)
    with pytest.raises(TypeError, match="max_seq_length"):
        SFTTrainer(model=model, train_dataset=_dataset(rng), max_seq_length="128")
    trainer = SFTTrainer(model=model, train_dataset=_dataset(rng), max_seq_length=None)  # None: the model's
    assert trainer.max_seq_length == model.max_seq_length


def test_evaluate_without_eval_dataset_is_a_training_error(tmp_path, rng):
    from unsloth_jax.errors import TrainingError

    with pytest.raises(TrainingError, match="eval_dataset"):
        _trainer(tmp_path, rng).evaluate()


@pytest.mark.torch
def test_save_model_writes_the_adapter_and_tokenizer_peft_loads(tmp_path, rng):
    """transformers' trainer.save_model(): the adapter and tokenizer into args.output_dir (the run's metrics and
    checkpoints stay), or into the folder given; PEFT loads it onto transformers' model and gives our logits.
    After full fine-tuning it writes the whole model, which transformers loads."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    import transformers

    model, tokenizer = FastLanguageModel.from_pretrained(TINY_MODEL, dtype="float32", progress=False)
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    out = tmp_path / "out"
    trainer = SFTTrainer(model=model, tokenizer=tokenizer, train_dataset=_dataset(rng), max_seq_length=32,
                         args=TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, max_steps=3,
                                                learning_rate=1e-2, save_steps=0, report_to="none"))
    trainer.train()
    assert trainer.save_model() == str(out)
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json", "metrics.jsonl"} <= {
        p.name for p in out.iterdir()}
    assert trainer.save_model(tmp_path / "elsewhere") == str(tmp_path / "elsewhere")
    assert (tmp_path / "elsewhere" / "adapter_model.safetensors").is_file()

    ids = np.array([[1, 20, 30, 40, 50, 60]])
    ours = np.asarray(model(ids))
    base = transformers.AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    with torch.no_grad():
        before = base(torch.tensor(ids)).logits.numpy()
        theirs = peft.PeftModel.from_pretrained(base, out).eval()(torch.tensor(ids)).logits.numpy()
    assert np.abs(ours - theirs).max() < 1e-4 and np.abs(ours - before).max() > 1e-3
    assert transformers.AutoTokenizer.from_pretrained(out).get_vocab() == tokenizer.get_vocab()

    full, tokenizer = FastLanguageModel.from_pretrained(TINY_MODEL, dtype="float32", full_finetuning=True,
                                                        progress=False)
    trainer = SFTTrainer(model=full, tokenizer=tokenizer, train_dataset=_dataset(rng), max_seq_length=32,
                         args=TrainingArguments(output_dir=str(tmp_path / "full"), per_device_train_batch_size=2,
                                                max_steps=2, learning_rate=1e-3, save_steps=0, report_to="none"))
    trainer.train()
    trainer.save_model()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "full", dtype=torch.float32)
    with torch.no_grad():
        assert np.abs(np.asarray(full(ids)) - hf(torch.tensor(ids)).logits.numpy()).max() < 1e-4
