"""The training log of every trainer: log_history entries with transformers'/TRL's keys, metrics.jsonl (with
tokens/s net of compile time), stdout, the progress bar, the report_to integrations and the callbacks' on_log.

Every `logging_steps` optimizer steps (and on the first with logging_first_step, and on the last) one entry
goes to `trainer.state.log_history`: the loss and every other metric the step returned (DPO's rewards/*, GRPO's
reward, ...) averaged over the steps since the previous entry (NaNs ignored, as TRL averages), the last
grad_norm, the learning rate, epoch and step. The same entry plus tokens_per_second (the window's tokens over
the time its steps ran: compiling, checkpoint saves and evaluations left out), compile_seconds (when the window
compiled) and memory_gib is appended to output_dir/metrics.jsonl and printed (not when the "unsloth_jax" logger's
level is set above INFO: the CLI's -q).

A warm-up step (the first of a train() call, and the first run of each newly compiled batch shape: XLA's first
run of a program is several times slower than the next) is left out of its window's tokens_per_second when the
window has other steps; a window of warm-up steps only (the first step's entry, with logging_first_step) reports
warmup_seconds (their time, compiling left out) instead of a tokens_per_second that would read as the run's speed.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

from unsloth_jax import distributed
from unsloth_jax.backend import device_memory_gib

# Step metrics that are bookkeeping, not log keys: averaged into no entry.
NOT_LOGGED = ("skipped", "tokens", "grad_norm")


def is_ready(metrics: dict) -> bool:
    """Whether the step that returned `metrics` has finished (host values count as finished)."""
    ready = getattr(metrics["loss"], "is_ready", None)
    return ready is None or ready()


class CompileTime:
    """Wall seconds jax spends tracing, lowering and compiling while this context is entered, from
    jax.monitoring's compile events (nested events counted once). take() returns the seconds since its last call."""

    EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
              "/jax/core/compile/backend_compile_duration")

    def __init__(self):
        self._spans: list[tuple[float, float]] = []

    def _record(self, event: str, start: float, end: float, **kwargs) -> None:
        if event in self.EVENTS:
            self._spans.append((start, end))

    def __enter__(self) -> "CompileTime":
        jax.monitoring.register_event_time_span_listener(self._record)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_time_span_listener(self._record)

    def take(self) -> float:
        spans, self._spans = self._spans, []
        total, reached = 0.0, float("-inf")
        for start, end in sorted(spans):
            if end > reached:
                total += end - max(start, reached)
                reached = end
        return total


class StepLog:
    """The per-step bookkeeping of one train() call (see the module docstring). `on_log(entry)` is called for
    every entry logged (the trainer's report_to integrations and callbacks)."""

    def __init__(self, args, state, schedule, epoch_at, bar, t0: float, on_log):
        self.args, self.state, self.schedule, self.epoch_at, self.bar = args, state, schedule, epoch_at, bar
        self.on_log = on_log
        self.metrics_path = Path(args.output_dir) / "metrics.jsonl"
        self.window: dict[str, list[float]] = {}
        self.window_tokens, self.window_t0 = 0, t0
        self.window_steps = 0  # steps recorded in the current window
        self.window_excluded = 0.0  # seconds of the current window not spent running steps (compiling, saving)
        self.window_compiled = 0.0  # of which compiling
        self.warm_seconds, self.warm_tokens, self.warm_steps = 0.0, 0, 0  # the window's warm-up steps
        self.prev_stamp, self.excluded_since_prev = t0, 0.0  # the last step's end; time left out since then

    def _logs_at(self, done: int, last: bool) -> bool:
        a = self.args
        return done % a.logging_steps == 0 or last or (a.logging_first_step and done == 1)

    def exclude(self, seconds: float, compiled: bool = False) -> None:
        """Leave `seconds` (compiling, a checkpoint save, an evaluation) out of the current window's
        tokens_per_second."""
        self.window_excluded += seconds
        self.excluded_since_prev += seconds
        if compiled:
            self.window_compiled += seconds

    def step(self, step_idx: int, m: dict, stamp: float, last: bool, warmup: bool = False) -> None:
        """Record optimizer step `step_idx` (0-based) from its host metrics `m` (scalars), finished at time
        `stamp` (a warm-up step with `warmup`, module docstring); log an entry when logging_steps says so."""
        done = step_idx + 1
        m = {k: float(np.asarray(v)) for k, v in m.items()}
        self.state.loss_history.append(m["loss"])
        for k, v in m.items():
            if k not in NOT_LOGGED:
                self.window.setdefault(k, []).append(v)
        tokens = int(m.get("tokens", 0))
        self.window_tokens += tokens
        if warmup:  # its own time: since the previous step ended, less what was left out meanwhile
            self.warm_seconds += max(stamp - self.prev_stamp - self.excluded_since_prev, 0.0)
            self.warm_tokens += tokens
            self.warm_steps += 1
        self.window_steps += 1
        self.prev_stamp, self.excluded_since_prev = stamp, 0.0
        if not self._logs_at(done, last):
            return
        entry = {"loss": float(np.mean(self.window.pop("loss"))), "grad_norm": m["grad_norm"],
                 "learning_rate": float(self.schedule(step_idx))}
        entry.update({k: _nanmean(v) for k, v in self.window.items()})
        entry["epoch"], entry["step"] = self.epoch_at(done), done
        seconds = stamp - self.window_t0 - self.window_excluded
        warm_only = self.warm_steps == self.window_steps
        if warm_only:
            tokens_per_second, warmup_seconds = None, seconds
        else:
            tokens_per_second, warmup_seconds = ((self.window_tokens - self.warm_tokens)
                                                 / max(seconds - self.warm_seconds, 1e-9)), None
        compiled = self.window_compiled
        self.window, self.window_tokens, self.window_t0 = {}, 0, stamp
        self.window_excluded = self.window_compiled = 0.0
        self.warm_seconds, self.warm_tokens, self.warm_steps, self.window_steps = 0.0, 0, 0, 0
        self.log(entry)
        self._write_record(entry, tokens_per_second, compiled, warmup_seconds)

    def log(self, entry: dict) -> None:
        """Append `entry` (with its "step") to log_history and pass it to on_log."""
        self.state.log_history.append(entry)
        self.on_log(entry)

    def _write_record(self, entry: dict, tokens_per_second: float | None, compile_seconds: float,
                      warmup_seconds: float | None = None) -> None:
        """One metrics.jsonl line (also printed) and the progress bar's postfix."""
        record = {"step": entry["step"], "loss": entry["loss"], "learning_rate": entry["learning_rate"],
                  "grad_norm": entry["grad_norm"]}
        if tokens_per_second is None:
            record["warmup_seconds"] = round(warmup_seconds, 4)  # no steady-state speed to report yet
        else:
            record["tokens_per_second"] = tokens_per_second
        record["epoch"] = entry["epoch"]
        if compile_seconds > 0:
            record["compile_seconds"] = round(compile_seconds, 3)  # left out of tokens_per_second
        record.update({k: v for k, v in entry.items() if k not in record})
        mem = device_memory_gib()
        if mem is not None:
            record["memory_gib"] = round(mem, 3)
        if not distributed.is_main_process():  # process 0 writes metrics.jsonl and the console log
            return
        with open(self.metrics_path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        speed = {} if tokens_per_second is None else {"tok_s": f"{tokens_per_second:.0f}"}
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['learning_rate']:.2e}", **speed,
                             **({"mem": f"{mem:.1f}G"} if mem is not None else {}))
        if logging.getLogger("unsloth_jax").level <= logging.INFO:  # -q (or the level set to WARNING): no step lines
            tqdm.write(json.dumps(record))


def _nanmean(values: list[float]) -> float:
    """Mean without the NaNs; NaN when every value is NaN."""
    kept = [v for v in values if not math.isnan(v)]
    return float(np.mean(kept)) if kept else float("nan")
