"""What SFTTrainer.train() returns and keeps, shaped as transformers' Trainer shapes them: `TrainOutput`
(global_step, training_loss, metrics) and `trainer.state` (`TrainerState`, with `log_history`)."""
from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple


class TrainOutput(NamedTuple):
    """train()'s result: `metrics` has train_runtime, train_samples_per_second, train_steps_per_second,
    train_loss and epoch (as transformers' Trainer computes them; total_flos is not computed)."""

    global_step: int
    training_loss: float
    metrics: dict


@dataclasses.dataclass
class TrainerState:
    """Progress of the current (or last) train() call.

    log_history holds transformers' entries: one per logged step ({loss, grad_norm, learning_rate, epoch,
    step}, loss averaged over the steps since the previous entry), an eval entry when there is an eval_dataset
    ({eval_loss, eval_runtime, eval_samples_per_second, eval_steps_per_second, epoch, step}), and the final
    summary ({train_runtime, ..., epoch, step}). loss_history
    (not in transformers) is the loss of every optimizer step, logged or not.
    """

    epoch: float = 0.0
    global_step: int = 0
    max_steps: int = 0
    logging_steps: int = 500
    num_train_epochs: float = 0.0
    train_batch_size: int | None = None
    log_history: list = dataclasses.field(default_factory=list)
    loss_history: list = dataclasses.field(default_factory=list)


def speed_metrics(split: str, start_time: float, num_samples: float | None = None, num_steps: int | None = None,
                  end_time: float | None = None) -> dict:
    """{split}_runtime (s, 4 decimals) and, when given, {split}_samples_per_second and {split}_steps_per_second
    (3 decimals), as transformers' speed_metrics rounds them. Times are time.perf_counter() readings."""
    runtime = (time.perf_counter() if end_time is None else end_time) - start_time
    out = {f"{split}_runtime": round(runtime, 4)}
    if runtime <= 0:
        return out
    if num_samples is not None:
        out[f"{split}_samples_per_second"] = round(num_samples / runtime, 3)
    if num_steps is not None:
        out[f"{split}_steps_per_second"] = round(num_steps / runtime, 3)
    return out


def planned_train_samples(max_steps: int, batch_size: int, accumulation: int, rows_per_epoch: int,
                          num_train_epochs: float) -> float:
    """Samples (rows) the whole schedule covers, by transformers' rule: max_steps x batch x accumulation when
    max_steps is set, else rows per epoch x num_train_epochs."""
    if max_steps > 0:
        return max_steps * batch_size * accumulation
    return rows_per_epoch * num_train_epochs


def train_metrics(start_time: float, end_time: float, *, steps_run: int, total_steps: int, planned_samples: float,
                  losses_run: list, epoch: float) -> dict:
    """TrainOutput.metrics of a train() call that ran `steps_run` of `total_steps` steps (fewer when resumed):
    samples count only the share of the schedule run in this call, train_loss is the mean loss of its steps."""
    metrics = speed_metrics("train", start_time, num_samples=planned_samples * steps_run / max(total_steps, 1),
                            num_steps=steps_run, end_time=end_time)
    metrics["train_loss"] = sum(losses_run) / max(len(losses_run), 0.001)  # 0.0 after no steps, as transformers
    metrics["epoch"] = epoch
    return metrics
