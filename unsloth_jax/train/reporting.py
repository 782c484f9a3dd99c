"""`report_to` integrations of SFTTrainer. TensorBoard is the one implemented: event files written with
tensorboardX under `logging_dir`, with transformers' tag names (train/loss, train/learning_rate, eval/loss, ...)
so runs from both land side by side in one TensorBoard."""
from __future__ import annotations

import json
import numbers
import os
import socket
from datetime import datetime

INTEGRATIONS = ("tensorboard",)


def resolve_report_to(value) -> list[str]:
    """The integrations `report_to` names, as a list: None, "none" and [] give []; "all" gives every integration
    implemented here; a string or a list of strings otherwise. Unknown names are a ValueError naming them."""
    if value is None:
        return []
    if isinstance(value, str):
        names = [value]
    elif isinstance(value, (list, tuple)):
        names = list(value)
    else:
        raise TypeError(f"report_to must be a string, a list of strings or None, got {value!r} "
                        f"({type(value).__name__})")
    chosen: list[str] = []
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"report_to entries must be strings, got {name!r} ({type(name).__name__})")
        key = name.strip().lower()
        if key == "none":
            continue
        if key == "all":
            chosen += INTEGRATIONS
        elif key in INTEGRATIONS:
            chosen.append(key)
        else:
            raise ValueError(f"report_to {name!r} is not supported; use 'tensorboard', 'none' or 'all' "
                             "(other transformers integrations are not implemented)")
    return list(dict.fromkeys(chosen))  # drop repeats, keep order


def default_logging_dir(output_dir) -> str:
    """transformers' default: OUTPUT_DIR/runs/<Mon01_12-30-59>_<hostname>."""
    stamp = datetime.now().strftime("%b%d_%H-%M-%S")
    return os.path.join(str(output_dir), "runs", f"{stamp}_{socket.gethostname()}")


def tensorboard_tag(key: str) -> str:
    """transformers' tag for a logged key: eval_loss -> eval/loss, loss -> train/loss."""
    if key.startswith("eval_"):
        return "eval/" + key[len("eval_"):]
    return "train/" + key


class TensorBoardReporter:
    """Writes each logged dict's numbers as scalars at the dict's step."""

    def __init__(self, log_dir):
        try:
            from tensorboardX import SummaryWriter
        except ImportError as e:
            raise ImportError("report_to='tensorboard' needs tensorboardX: pip install tensorboardX "
                              "(or pass report_to='none')") from e
        self.log_dir = str(log_dir)
        self._writer = SummaryWriter(logdir=self.log_dir)

    def log_args(self, args: dict) -> None:
        self._writer.add_text("args", json.dumps(args, indent=2, default=str))

    def log(self, logs: dict, step: int) -> None:
        for key, value in logs.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, numbers.Real):
                continue
            self._writer.add_scalar(tensorboard_tag(key), float(value), int(step))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class Reporters:
    """The integrations of one train() call, fed together."""

    def __init__(self, names: list[str], logging_dir, args: dict):
        self.reporters = []
        self.logging_dir = None
        if "tensorboard" in names:
            self.logging_dir = str(logging_dir)
            tb = TensorBoardReporter(self.logging_dir)
            tb.log_args(args)
            self.reporters.append(tb)

    def log(self, logs: dict, step: int) -> None:
        for r in self.reporters:
            r.log(logs, step)

    def close(self) -> None:
        for r in self.reporters:
            r.close()
        self.reporters = []
