"""TrainerBase: the loop every trainer (SFT, UnslothTrainer, DPO, ORPO, GRPO) runs, and everything around it.

    trainer.train(resume_from_checkpoint=None | True | "out/checkpoint-20") -> TrainOutput

The base owns: the output_dir checks (a reused output_dir is refused unless overwrite_output_dir=True or the run
resumes; a trainer training again after a completed train() replaces that run's files), resume
(`train(resume_from_checkpoint=...)`, else `args.resume_from_checkpoint`: the device state, step, histories and
the trainer's own state come back from the checkpoint, and metrics.jsonl keeps each step once), the step loop
with its progress bar, the training log (unsloth_jax.train.steplog: log_history, metrics.jsonl, stdout,
report_to), callbacks (unsloth_jax.train.callbacks), checkpoints every save_steps steps and at the end
(save_total_limit kept), evaluation by eval_strategy / eval_steps, the non-finite step guard, and the run's
summary lines and TrainOutput (transformers' train_runtime, ...).

A trainer supplies (see the methods marked "supplied by each trainer"):
  prepare_run()         -> RunPlan: the total steps, learning-rate schedule, epoch of a step count, and the
                           starting device state {"trainable", "opt_state"} its steps carry (what is checkpointed);
  next_batch(step)      -> the batch of optimizer step `step` (a pure function of step and the trainer's own
                           checkpointed state);
  run_step(state, batch) -> (state, metrics): one optimizer step; metrics hold "loss", "grad_norm", "skipped"
                           and "tokens" (as every step's apply_gradients gives them) plus the trainer's log keys;
and optionally evaluate() with has_eval_data(), run_summary_lines(start), final_metrics(), and
checkpoint_record() / write_checkpoint_files(directory) / restore_trainer_state(record, directory) for state
beyond the device state (GRPO's generation counter, prompt position and the generation batch in use).

Metrics are read one step late, so the host never waits for the device: a step's end time is taken when its
metrics are read (blocking until it finished). So that a logged window's time is its steps' own, a step is read
before the next is called when it has already finished, and before a call that compiles (a batch shape not
seen yet); compile time spent while no step runs is left out of the window (it would be time the device waits),
compiling while a step runs overlaps it and stays in.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from tqdm.auto import tqdm

from unsloth_jax import distributed, lora
from unsloth_jax.errors import TrainingError
from unsloth_jax.models.vision import layer_norm_paths
from unsloth_jax.train import checkpoints, optim
from unsloth_jax.train.callbacks import CallbackHandler, TrainerControl
from unsloth_jax.train.reporting import Reporters, default_logging_dir
from unsloth_jax.train.state import TrainerState, TrainOutput, train_metrics
from unsloth_jax.backend import commit_to_devices
from unsloth_jax.train.steplog import CompileTime, StepLog, is_ready

log = logging.getLogger("unsloth_jax")


@dataclasses.dataclass
class RunPlan:
    """What a trainer's prepare_run() gives the loop.

    total: optimizer steps of the whole run. schedule: the learning rate of step i (0-based), as the optimizer
    uses it. epoch_at: epochs done after n optimizer steps. planned_samples: rows the whole schedule covers
    (transformers' train_samples_per_second numerator). summary: the head of the run's summary line ("12
    examples, 6 steps"). train_state: the device state the steps carry, {"trainable", "opt_state"} (pytrees of
    arrays), checkpointed as it is.
    """

    total: int
    schedule: Callable
    epoch_at: Callable[[int], float]
    planned_samples: float
    summary: str
    train_state: dict


def as_records(dataset) -> list[dict]:
    """A list of dicts from a list, any iterable of dicts, or an HF datasets.Dataset."""
    if dataset is None:
        return []
    if isinstance(dataset, list):
        return dataset
    if hasattr(dataset, "to_list"):
        return dataset.to_list()
    return list(dataset)


def cast_weights(model, dtype) -> None:
    """Cast the model's floating dense weights (nnx.Param, not the float32 LoRA masters) to `dtype`, in place."""
    for _, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Param) or isinstance(var, nnx.LoRAParam):
            continue
        value = var.get_value()
        if hasattr(value, "dtype") and jnp.issubdtype(value.dtype, jnp.floating):
            var.set_value(value.astype(dtype))


def base_label(model) -> str:
    """" + NF4" / " + FP8" when the frozen projections are quantized."""
    from unsloth_jax.models import FP8Param, NF4Param

    kinds = {type(lin.kernel) for lin in model.projection_stacks().values()}
    return " + NF4" if NF4Param in kinds else " + FP8" if FP8Param in kinds else ""


def trained_what(model, n_train: int, optim_name: str) -> str:
    """The run summary's account of what trains and where the optimizer state lives."""
    what = "full fine-tuning" if model.full_finetuning else f"LoRA r={model.lora.r}"
    return f"{what} ({n_train:,d} trainable, optimizer state {optim.state_dtype(optim_name)})"


def mesh_note(mesh) -> str:
    if mesh is None:
        return ""
    return f" per device on {distributed.describe(mesh)} (global batch x{distributed.batch_shards(mesh)})"


class TrainerBase:
    """The loop and its surroundings (see the module docstring). Subclasses set `args` (a TrainingArguments),
    `model` and call `super().__init__`."""

    name = ""  # the trainer in the summary line and progress bar ("DPO", "GRPO"); "" for SFT
    nonfinite_hint = "Lower the learning rate or check the data"
    mesh = None  # a jax.sharding.Mesh when the trainer runs its steps on several devices (args.mesh)

    def __init__(self, model, args, callbacks=None):
        self.model, self.args = model, args
        self.state = TrainerState()
        self.callback_handler = CallbackHandler(callbacks)
        self.control = TrainerControl()
        self.train_state: dict | None = None  # {"trainable", "opt_state"} while train() runs, else None
        self._reporters = None
        self._trained_into: Path | None = None  # output_dir of this object's last completed train() call
        self._apply_precision_flags()

    # ------------------------------------------------------------------- supplied by each trainer
    def prepare_run(self) -> RunPlan:
        """Build the run (data order, total steps, optimizer, step function, starting state)."""
        raise NotImplementedError

    def next_batch(self, step: int):
        """The batch of optimizer step `step` (0-based)."""
        raise NotImplementedError

    def run_step(self, state: dict, batch) -> tuple[dict, dict]:
        """One optimizer step from `state` -> (new state, metrics)."""
        raise NotImplementedError

    def has_eval_data(self) -> bool:
        return False

    def evaluate(self) -> dict:
        """The eval_* metrics of the model's current weights."""
        raise TrainingError(f"evaluate() needs an eval_dataset ({type(self).__name__}(..., eval_dataset=...))")

    def run_summary_lines(self, start: int) -> list[str]:
        """Lines printed after the summary line (before step `start` runs); SFT: kernels and step memory."""
        return []

    def final_metrics(self) -> dict:
        """Entries added to TrainOutput.metrics (GRPO: its time split)."""
        return {}

    def checkpoint_record(self) -> dict:
        """JSON-able trainer state saved in trainer_state.json under "trainer" (beyond the device state)."""
        return {}

    def write_checkpoint_files(self, directory: Path) -> None:
        """Write the trainer's own files into a checkpoint directory being saved."""

    def restore_trainer_state(self, record: dict, directory: Path) -> None:
        """Take back what checkpoint_record() / write_checkpoint_files() saved."""

    # -------------------------------------------------------------------------------------------- saving
    def save_model(self, output_dir: str | os.PathLike | None = None) -> str:
        """transformers' Trainer.save_model: the model's save_pretrained (a PEFT adapter; the whole model after
        full fine-tuning) with the trainer's tokenizer or processor, into `output_dir` (None: args.output_dir).
        Called during train() (from a callback), it saves the current weights. Returns the directory's path."""
        out = output_dir if output_dir is not None else self.args.output_dir
        if not out:
            raise ValueError("save_model: no output_dir given, and args.output_dir is empty")
        save = getattr(self.model, "save_pretrained", None)
        if save is None:
            raise TypeError(f"save_model: the model ({type(self.model).__name__}) has no save_pretrained; load it with "
                            "FastLanguageModel.from_pretrained or FastVisionModel.from_pretrained")
        if self.train_state is not None:  # mid-run: the model object holds the weights of the last update
            self.write_back(self.train_state["trainable"])
        save(str(out), tokenizer=getattr(self, "tokenizer", None))
        return str(out)

    # ----------------------------------------------------------------------------------- shared pieces
    def _apply_precision_flags(self) -> None:
        want = jnp.bfloat16 if self.args.bf16 else jnp.float16 if self.args.fp16 else None
        if want is not None and jnp.dtype(want) != self.model.dtype:
            log.warning("unsloth_jax: %s=True: casting the model from %s to %s", "bf16" if self.args.bf16 else "fp16",
                        self.model.dtype.name, jnp.dtype(want).name)
            cast_weights(self.model, want)
            self.model.dtype = jnp.dtype(want)

    def _warmup_steps(self, total: int) -> int:
        """Warmup steps of a `total`-step run; a float warmup_steps in [0, 1) is a ratio (transformers 5)."""
        w = self.args.warmup_steps
        if isinstance(w, float) and 0 < w < 1:
            return int(math.ceil(w * total))
        return optim.warmup_steps_for(total, int(w), self.args.warmup_ratio)

    def build_optimizer(self, total: int, warmup: int, embedding_learning_rate: float | None = None):
        """(optax optimizer, learning-rate schedule) of a `total`-step run with `warmup` warmup steps, from the
        arguments; with embedding_learning_rate, the embedding and head leaves follow the same schedule from that
        rate."""
        args = self.args
        schedule = optim.make_schedule(args.lr_scheduler_type, args.learning_rate, total, warmup)
        embedding_schedule = None if embedding_learning_rate is None else optim.make_schedule(
            args.lr_scheduler_type, embedding_learning_rate, total, warmup)
        optimizer = optim.make_optimizer(args.optim, schedule, weight_decay=args.weight_decay,
                                         max_grad_norm=args.max_grad_norm, adam_beta1=args.adam_beta1,
                                         adam_beta2=args.adam_beta2, adam_epsilon=args.adam_epsilon,
                                         embedding_schedule=embedding_schedule,
                                         weight_decay_mask=optim.decay_mask(layer_norm_paths(self.model)))
        return optimizer, schedule

    def _open_reporters(self) -> None:
        """Start the report_to integrations of this train() call (closed by train() whatever happens); none on
        the processes other than 0 of a multi-host run."""
        args = self.args
        logging_dir = args.logging_dir or default_logging_dir(args.output_dir)
        names = args.report_to if distributed.is_main_process() else []
        self._reporters = Reporters(names, logging_dir, dataclasses.asdict(args))
        if self._reporters.logging_dir:
            print(f"unsloth_jax: TensorBoard logs -> {self._reporters.logging_dir}")

    def _close_reporters(self) -> None:
        if self._reporters is not None:
            self._reporters.close()
        self._reporters = None

    def _on_log(self, entry: dict) -> None:
        if self._reporters is not None:
            self._reporters.log(entry, entry["step"])
        self._fire("on_log", logs=entry)

    def _fire(self, event: str, **kwargs) -> None:
        self.callback_handler.fire(event, self.args, self.state, self.control, **kwargs)

    def _summary_line(self, run: RunPlan) -> str:
        a, model = self.args, self.model
        n_train = lora.count(run.train_state["trainable"])
        label = f"unsloth_jax {self.name}:" if self.name else "unsloth_jax:"
        return (f"{label} {run.summary}, batch {a.per_device_train_batch_size} x {a.gradient_accumulation_steps} "
                f"accumulation{mesh_note(self.mesh)}, {model.dtype.name}{base_label(model)}, "
                f"{trained_what(model, n_train, a.optim)}, remat={model.gradient_checkpointing}")

    def write_back(self, trainable) -> None:
        """The trained weights written into the model object (during and after train())."""
        nnx.update(self.model, trainable)

    def state_on_mesh(self, mesh, trainable, frozen, opt_state):
        """The state placed on the mesh by unsloth_jax.distributed's rules; the model's frozen weights are
        replaced by their sharded copies, so no device keeps the whole unsharded model as well."""
        trainable, frozen, opt_state = distributed.shard_state(mesh, (trainable, frozen, opt_state))
        nnx.update(self.model, frozen)
        return trainable, frozen, opt_state

    # --------------------------------------------------------------------------------- checkpoints
    def _state_record(self, step: int) -> dict:
        """trainer_state.json of a checkpoint at `step`: what a resumed run needs to continue the history."""
        st = self.state
        return {"global_step": step, "seed": self.args.seed, "epoch": st.epoch, "max_steps": st.max_steps,
                "loss_history": list(st.loss_history[:step]), "log_history": list(st.log_history),
                "trainer": self.checkpoint_record()}

    def _save_checkpoint(self, step: int) -> None:
        path = checkpoints.save_checkpoint(self.args.output_dir, step, self.train_state, self._state_record(step),
                                           self.write_checkpoint_files, self.args.save_total_limit)
        if path is not None:
            self._fire("on_save", checkpoint=str(path))

    def _restore(self, path: Path) -> int:
        """Load checkpoint `path` into self.train_state and self.state; the step it was saved at."""
        restored, meta = checkpoints.restore_checkpoint(path, self.train_state, self.args.optim)
        self.train_state = commit_to_devices(restored)
        step = int(meta["global_step"])
        if meta.get("seed", self.args.seed) != self.args.seed:
            log.warning("unsloth_jax: %s was saved by a run with seed=%s, this one has seed=%s: the data order (and "
                        "GRPO's sampling) differ from the interrupted run's", path, meta["seed"], self.args.seed)
        self.state.global_step = step
        self.state.loss_history = list(meta.get("loss_history", []))
        self.state.log_history = list(meta.get("log_history", []))
        self.restore_trainer_state(meta.get("trainer", {}), path)
        return step

    # ------------------------------------------------------------------------------------ evaluation
    def _evaluates_after(self, done: int, total: int, epoch_at) -> bool:
        """Whether eval_strategy asks for an evaluation after `done` of `total` steps, the last excepted (training
        ends with one)."""
        a = self.args
        if not self.has_eval_data() or done >= total:
            return False
        if a.eval_strategy == "steps":
            return done % (a.eval_steps or a.logging_steps) == 0
        if a.eval_strategy == "epoch":
            return int(epoch_at(done)) > int(epoch_at(done - 1))
        return False

    def _evaluate_now(self, steplog: StepLog, done: int) -> None:
        """Evaluate the live weights (written into the model) and log the eval entry at step `done`."""
        self.write_back(self.train_state["trainable"])
        entry = {**self.evaluate(), "epoch": self.state.epoch, "step": done}
        steplog.log(entry)
        self._fire("on_evaluate", metrics=entry)

    # ----------------------------------------------------------------------------------------- train
    def train(self, resume_from_checkpoint: bool | str | None = None) -> TrainOutput:
        """Train for the configured steps; resume_from_checkpoint=True continues from the newest checkpoint in
        output_dir (a path: from that checkpoint; None: args.resume_from_checkpoint). The trained weights are
        written back into the model (in place). Returns a TrainOutput; trainer.state keeps the log history."""
        try:
            return self._train(resume_from_checkpoint)
        except KeyboardInterrupt:
            if distributed.is_main_process():
                print(self._interrupted_message(), file=sys.stderr, flush=True)
            raise
        finally:
            self._close_reporters()

    # How to continue an interrupted run, given the newest checkpoint (or None): the CLI sets its command line.
    resume_hint: Callable[[Path | None], str] | None = None

    def _interrupted_message(self) -> str:
        """What Ctrl-C prints: the step reached, the newest checkpoint and how to resume from it."""
        found = checkpoints.checkpoints_in(self.args.output_dir)
        newest = found[-1][1] if found else None
        head = f"unsloth_jax: training interrupted at step {self.state.global_step}; "
        if self.resume_hint is not None:
            return head + self.resume_hint(newest)
        if newest is None:
            return head + ("no checkpoint was saved, so a new run starts over (TrainingArguments(save_steps=N) "
                           "writes one every N steps)")
        return (head + f"the newest checkpoint is {newest}; continue with "
                f"trainer.train(resume_from_checkpoint={str(newest)!r}) (or resume_from_checkpoint=True: the newest "
                "in output_dir)")

    def _train(self, resume_from_checkpoint) -> TrainOutput:
        args = self.args
        if resume_from_checkpoint is None:
            resume_from_checkpoint = args.resume_from_checkpoint
        resume = checkpoints.resume_path(resume_from_checkpoint, args.output_dir)
        out = Path(args.output_dir).resolve()
        checkpoints.prepare_output_dir(out, resuming=resume is not None, overwrite=args.overwrite_output_dir,
                                       own_earlier=self._trained_into == out)
        self._trained_into = None
        main = distributed.is_main_process()
        run = self.prepare_run()
        self.train_state = run.train_state
        self.control = TrainerControl()
        self.state = TrainerState(max_steps=run.total, logging_steps=args.logging_steps,
                                  num_train_epochs=args.num_train_epochs,
                                  train_batch_size=args.per_device_train_batch_size)
        start = 0
        if resume is not None:
            start = self._restore(resume)
            checkpoints.keep_metrics_until(args.output_dir, start)
            if main:
                print(f"Resuming from {resume} at step {start}")
        try:
            lines = self.run_summary_lines(start)
            self._open_reporters()
            if main:
                for line in [self._summary_line(run), *lines]:
                    print(line)
            result = self._loop(run, start)
            self._trained_into = out  # a later train() of this object may replace these files (not a crashed run's)
            return result
        finally:
            self.write_back(self.train_state["trainable"])
            self.train_state = None  # the optimizer state is not kept alive after train()

    def _loop(self, run: RunPlan, start: int) -> TrainOutput:
        args, total = self.args, run.total
        main = distributed.is_main_process()
        # only process 0 shows a bar; on it tqdm's own defaults (TQDM_DISABLE, ...) apply
        bar = tqdm(total=total, initial=start, desc=f"{self.name} training" if self.name else "Training",
                   unit="step", **({} if main else {"disable": True}))
        compile_time = CompileTime()
        float(run.schedule(start))  # the logged learning rate's jnp ops compile on this first call, before timing
        t0 = time.perf_counter()
        steplog = StepLog(args, self.state, run.schedule, run.epoch_at, bar, t0, self._on_log)
        self.state.epoch = run.epoch_at(start)
        self._fire("on_train_begin")
        bad_in_row = 0
        done = start
        last_step = total - 1  # the step logged as the last (earlier when a callback stops training)
        pending = None  # (step, metrics) of the step called last, read one step late (module docstring)
        shapes_seen = set()

        def call_step(batch):
            idle = pending is None
            before = compile_time.take()
            if idle:  # e.g. eager ops run for the first time while logging, or a trainer's host work
                steplog.exclude(before, compiled=True)
            t_call = time.perf_counter()
            self.train_state, metrics = self.run_step(self.train_state, batch)
            compiled = compile_time.take()
            if idle and compiled:
                if not is_ready(metrics):  # the call returned before running: all of it was compiling and loading
                    compiled = max(compiled, time.perf_counter() - t_call)
                steplog.exclude(compiled, compiled=True)
            return metrics

        def finish(step_idx, m, warmup):
            nonlocal bad_in_row
            m = jax.device_get(m)
            stamp = time.perf_counter()
            compile_time.take()  # compiled while steps ran: that time stays in the window
            if int(m["skipped"]):
                bad_in_row += 1
                if main:
                    tqdm.write(f"step {step_idx + 1}: non-finite loss or gradient ({float(m['loss'])}); update "
                               "skipped")
                if bad_in_row >= args.max_nonfinite_steps:
                    raise TrainingError(f"{bad_in_row} non-finite steps in a row (last at step {step_idx + 1}); "
                                        f"stopping. {self.nonfinite_hint}; saved checkpoints are untouched.")
            else:
                bad_in_row = 0
            steplog.step(step_idx, m, stamp, last=step_idx == last_step, warmup=warmup)

        def read_pending():
            nonlocal pending
            if pending is not None:
                finish(*pending)
                pending = None

        def excluded(fn, *a):  # run fn outside the timed window (a save, an evaluation), no step running
            read_pending()
            t = time.perf_counter()
            fn(*a)
            steplog.exclude(time.perf_counter() - t)
            compile_time.take()  # (inside the time just left out)

        try:
            with compile_time:
                for step in range(start, total):
                    if pending is not None and is_ready(pending[1]):
                        read_pending()
                    batch = self.next_batch(step)
                    shape = _shapes(batch)
                    new_shape = shape not in shapes_seen  # the step compiles: its first run is a warm-up
                    if pending is not None and (new_shape or is_ready(pending[1])):
                        read_pending()
                    shapes_seen.add(shape)
                    metrics = call_step(batch)
                    read_pending()
                    pending = (step, metrics, new_shape)
                    done = step + 1
                    self.state.global_step, self.state.epoch = done, run.epoch_at(done)
                    bar.update(1)
                    self._fire("on_step_end")
                    control = self.control
                    if done < total and (control.should_save or (args.save_steps and done % args.save_steps == 0)):
                        excluded(self._save_checkpoint, done)
                        control.should_save = False
                    if control.should_evaluate or self._evaluates_after(done, total, run.epoch_at):
                        excluded(self._evaluate_now, steplog, done)
                        control.should_evaluate = False
                    if control.should_training_stop:
                        last_step = step
                        break
                read_pending()
        finally:
            bar.close()
        t_end = time.perf_counter()
        if args.save_steps or self.control.should_save:
            self._save_checkpoint(done)
        return self._finish(run, steplog, start, done, t0, t_end)

    def _finish(self, run: RunPlan, steplog: StepLog, start: int, done: int, t0: float, t_end: float) -> TrainOutput:
        """Log the eval entry (with eval data) and the run summary; the TrainOutput of this call."""
        args, state = self.args, self.state
        state.global_step = done
        ran = done - start
        metrics = train_metrics(t0, t_end, steps_run=ran, total_steps=run.total,
                                planned_samples=run.planned_samples,
                                losses_run=state.loss_history[len(state.loss_history) - ran:], epoch=state.epoch)
        if self.has_eval_data() and args.eval_strategy != "no":
            self._evaluate_now(steplog, done)
        metrics.update(self.final_metrics())
        steplog.log({**metrics, "step": done})
        self._fire("on_train_end")
        if distributed.is_main_process():
            print(json.dumps(metrics))
        return TrainOutput(done, metrics["train_loss"], metrics)


def _shapes(batch) -> tuple:
    """The shapes of a batch's arrays, with their paths (a new value means the step compiles)."""
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    return tuple((jax.tree_util.keystr(p), tuple(x.shape)) for p, x in leaves if hasattr(x, "shape"))
