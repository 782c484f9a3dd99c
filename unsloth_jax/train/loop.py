"""What the preference and RL trainers (DPO, ORPO, GRPO) share: the LoRA checks, the optimizer from the
arguments, the split state with the reference weights, and the step loop with TRL/transformers-style logging.

Logging follows transformers' Trainer: every `logging_steps` optimizer steps (and on the first with
`logging_first_step`, and on the last) one entry goes to `trainer.state.log_history`, holding the loss and every
trainer metric averaged over the steps since the previous entry (as TRL averages its metrics), the last
grad_norm, the learning rate, epoch and step; the same entry (plus tokens/s and device memory) is printed and
appended to `output_dir/metrics.jsonl` and sent to the `report_to` integrations (TensorBoard), as SFTTrainer's
are. train() ends with transformers' summary entry and returns a
`TrainOutput`.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from unsloth_jax import lora
from unsloth_jax.backend import device_memory_gib
from unsloth_jax.errors import TrainingError
from unsloth_jax.train import optim
from unsloth_jax.train.logprobs import trains_beyond_lora
from unsloth_jax.train.reporting import Reporters, default_logging_dir
from unsloth_jax.train.state import TrainerState, TrainOutput, train_metrics
from unsloth_jax.train.step import commit_to_devices
from unsloth_jax.train.trainer import _as_records as records_of  # noqa: F401  (re-exported)
from unsloth_jax.train.trainer import SFTTrainer

log = logging.getLogger("unsloth_jax")

# Host-side bookkeeping values of a step's metrics that are not averaged into the log entries.
_NOT_LOGGED = ("skipped", "tokens", "grad_norm")


def pad_token_id(tokenizer, model) -> int:
    """The padding id: the tokenizer's pad, else its eos, else config.json's pad, else 0."""
    for cand in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None),
                 model.config.pad_token_id):
        if cand is not None:
            return int(cand)
    return 0


SEQUENCE_MULTIPLE = 64  # batch lengths are rounded up to this, so a jitted step compiles for few shapes


def round_up(n: int, multiple: int = SEQUENCE_MULTIPLE) -> int:
    """n rounded up to a multiple of `multiple` (at least one multiple)."""
    return max(multiple, -(-int(n) // multiple) * multiple)


def scan_micro_batches(fn, trainable, batch, *, with_grad: bool):
    """Inside a jitted step: sum `fn(trainable, micro) -> (value, aux dict)` over the micro-batches of `batch`
    (every leaf [A, ...]) with lax.scan -> (value sum, aux sums, gradient sum w.r.t. trainable in float32, or
    None without with_grad). Callers scale the sums (mean over micro-batches, or token-weighted)."""
    grad_fn = jax.value_and_grad(fn, has_aux=True)

    def body(carry, micro):
        g_sum, v_sum, aux_sum = carry
        if with_grad:
            (value, aux), g = grad_fn(trainable, micro)
            g_sum = jax.tree.map(lambda s, x: s + x.astype(jnp.float32), g_sum, g)
        else:
            value, aux = fn(trainable, micro)
        return (g_sum, v_sum + value, jax.tree.map(jnp.add, aux_sum, aux)), None

    first = jax.tree.map(lambda a: a[0], batch)
    aux_shape = jax.eval_shape(lambda: fn(trainable, first)[1])
    init = (jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), trainable) if with_grad else None,
            jnp.zeros((), jnp.float32), jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), aux_shape))
    (g_sum, v_sum, aux_sum), _ = jax.lax.scan(body, init, batch)
    return v_sum, aux_sum, g_sum


class RLTrainerBase:
    """Shared constructor and loop of DPOTrainer, ORPOTrainer and GRPOTrainer (see module docstring)."""

    name = "trainer"

    def __init__(self, model, args, tokenizer, processing_class):
        if getattr(model, "lora", None) is None:
            raise TrainingError(f"{type(self).__name__} trains LoRA adapters: call "
                                "FastLanguageModel.get_peft_model(model, ...) first")
        self.model = model
        self.args = args
        self.tokenizer = processing_class if processing_class is not None else tokenizer
        if self.tokenizer is None:
            raise TrainingError(f"{type(self).__name__} needs processing_class=tokenizer to tokenize the dataset")
        self.state = TrainerState()
        self._apply_precision_flags()

    def _apply_precision_flags(self) -> None:
        SFTTrainer._apply_precision_flags(self)  # bf16 / fp16: the same cast as SFT's (it reads .args, .model)

    # ------------------------------------------------------------------------------------- pieces
    def make_optimizer(self, total_steps: int):
        """(schedule, optax optimizer) from the arguments, as SFTTrainer builds them."""
        a = self.args
        warmup = SFTTrainer._warmup_steps(self, total_steps)  # warmup_steps / warmup_ratio as SFT reads them
        schedule = optim.make_schedule(a.lr_scheduler_type, a.learning_rate, total_steps, warmup)
        optimizer = optim.make_optimizer(a.optim, schedule, weight_decay=a.weight_decay, max_grad_norm=a.max_grad_norm,
                                         adam_beta1=a.adam_beta1, adam_beta2=a.adam_beta2, adam_epsilon=a.adam_epsilon)
        return schedule, optimizer

    def split_state(self, need_reference: bool):
        """(graphdef, trainable (a copy: the step donates it), frozen, ref_trainable) of the model, committed to
        their devices. ref_trainable is None (the reference is the base: frozen + adapters dropped) unless the
        model trains weights besides LoRA, whose starting values the reference then needs."""
        graphdef, trainable, frozen = lora.split(self.model)
        trainable = jax.tree.map(jnp.copy, trainable)
        ref_trainable = None
        if need_reference and trains_beyond_lora(self.model):
            ref_trainable = jax.tree.map(jnp.copy, trainable)
        trainable, frozen, ref_trainable = commit_to_devices((trainable, frozen, ref_trainable))
        return graphdef, trainable, frozen, ref_trainable

    def summary_line(self, detail: str) -> None:
        n_train = lora.count(lora.split(self.model)[1])
        a = self.args
        print(f"unsloth_jax {self.name}: {detail}, batch {a.per_device_train_batch_size} x "
              f"{a.gradient_accumulation_steps} accumulation, {self.model.dtype.name}, LoRA r={self.model.lora.r} "
              f"({n_train:,d} trainable), remat={self.model.gradient_checkpointing}")

    # --------------------------------------------------------------------------------------- loop
    def run_steps(self, total: int, schedule, run_step, epoch_at, planned_samples: float,
                  extra_summary=None, evaluate=None) -> TrainOutput:
        """Call `run_step(step) -> metrics` (device or host scalars) for step = 0 .. total-1, reading each step's
        metrics one step late so the host does not stall the device; log as the module docstring says.
        `epoch_at(steps_done)` gives the epoch; `evaluate()` (optional) returns the eval entry logged before the
        summary, as transformers orders them; `extra_summary()` (optional) adds entries to the final metrics.
        Returns transformers' TrainOutput."""
        args = self.args
        self.state = TrainerState(max_steps=total, logging_steps=args.logging_steps,
                                  num_train_epochs=args.num_train_epochs,
                                  train_batch_size=args.per_device_train_batch_size)
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        reporters = Reporters(args.report_to, args.logging_dir or default_logging_dir(args.output_dir),
                              dataclasses.asdict(args))
        if reporters.logging_dir:
            print(f"unsloth_jax: TensorBoard logs -> {reporters.logging_dir}")
        logger = _StepLogger(self, schedule, epoch_at, total, reporters)
        bar = logger.bar
        t0 = time.perf_counter()
        pending = None
        try:
            for step in range(total):
                metrics = run_step(step)
                stamp = time.perf_counter()
                if pending is not None:
                    logger.record(*pending)
                pending = (step, metrics, stamp)
                bar.update(1)
            if pending is not None:
                logger.record(*pending)
            t_end = time.perf_counter()
            self.state.global_step = total
            metrics = train_metrics(t0, t_end, steps_run=total, total_steps=total, planned_samples=planned_samples,
                                    losses_run=self.state.loss_history, epoch=self.state.epoch)
            if evaluate is not None:
                logger.log({**evaluate(), "epoch": self.state.epoch, "step": total})
            if extra_summary is not None:
                metrics.update(extra_summary())
            logger.log({**metrics, "step": total})
        finally:
            bar.close()
            reporters.close()
        print(json.dumps(metrics))
        return TrainOutput(total, metrics["train_loss"], metrics)


class _StepLogger:
    """Per-step bookkeeping of one train() call (see the module docstring)."""

    def __init__(self, trainer: RLTrainerBase, schedule, epoch_at, total: int, reporters: Reporters):
        self.args, self.state, self.schedule, self.epoch_at, self.total = (trainer.args, trainer.state, schedule,
                                                                          epoch_at, total)
        self.reporters = reporters
        self.metrics_path = Path(trainer.args.output_dir) / "metrics.jsonl"
        self.bar = tqdm(total=total, desc=f"{trainer.name} training", unit="step")
        self.window: dict[str, list[float]] = {}
        self.window_tokens, self.window_t0 = 0, time.perf_counter()
        self.bad_in_row = 0

    def record(self, step_idx: int, metrics: dict, stamp: float) -> None:
        m = {k: float(np.asarray(v)) for k, v in jax.device_get(metrics).items()}
        done = step_idx + 1
        if m.get("skipped"):
            self.bad_in_row += 1
            tqdm.write(f"step {done}: non-finite loss or gradient ({m['loss']}); update skipped")
            if self.bad_in_row >= self.args.max_nonfinite_steps:
                raise TrainingError(f"{self.bad_in_row} non-finite steps in a row (last at step {done}); stopping. "
                                    "Lower the learning rate or check the data and reward functions.")
        else:
            self.bad_in_row = 0
        self.state.loss_history.append(m["loss"])
        self.state.global_step, self.state.epoch = done, self.epoch_at(done)
        for k, v in m.items():
            if k not in _NOT_LOGGED:
                self.window.setdefault(k, []).append(v)
        self.window_tokens += int(m.get("tokens", 0))
        a = self.args
        if not (done % a.logging_steps == 0 or done == self.total or (a.logging_first_step and done == 1)):
            return
        entry = {"loss": float(np.mean(self.window.pop("loss")))}
        entry["grad_norm"] = m["grad_norm"]
        entry["learning_rate"] = float(self.schedule(step_idx))
        entry.update({k: float(np.nanmean(v)) if not all(math.isnan(x) for x in v) else float("nan")
                      for k, v in self.window.items()})
        entry["epoch"], entry["step"] = self.state.epoch, done
        self.log(entry)
        record = dict(entry, tokens_per_second=self.window_tokens / max(stamp - self.window_t0, 1e-9))
        mem = device_memory_gib()
        if mem is not None:
            record["memory_gib"] = round(mem, 3)
        self.window, self.window_tokens, self.window_t0 = {}, 0, stamp
        with open(self.metrics_path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        self.bar.set_postfix(loss=f"{entry['loss']:.4f}", lr=f"{entry['learning_rate']:.2e}")
        tqdm.write(json.dumps(record))

    def log(self, entry: dict) -> None:
        """Append `entry` (with its "step") to log_history and send it to the report_to integrations."""
        self.state.log_history.append(entry)
        self.reporters.log(entry, entry["step"])


__all__ = ["RLTrainerBase", "SEQUENCE_MULTIPLE", "records_of", "pad_token_id", "round_up", "scan_micro_batches"]
