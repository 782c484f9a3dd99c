"""Trainer callbacks with transformers' event names and signature: `callbacks=[...]` given to any trainer.

A callback is any object (or a class, instantiated without arguments, as transformers does) with some of the
methods on_train_begin, on_step_end, on_log, on_evaluate, on_save, on_train_end, each called as
`method(args, state, control, **kwargs)`: `state` is trainer.state (global_step, epoch, log_history, ...),
on_log gets `logs=` (the entry just logged), on_evaluate `metrics=`, on_save `checkpoint=` (its directory).
A transformers.TrainerCallback subclass overriding these methods works too. on_step_end runs right after
optimizer step `state.global_step` was started (its loss is logged one step later, see unsloth_jax.train.base).
Setting `control.should_training_stop` ends training after the current step, `control.should_save` saves a
checkpoint at it and `control.should_evaluate` evaluates there (each flag is reset once acted on).
"""
from __future__ import annotations

import dataclasses
import inspect

EVENTS = ("on_train_begin", "on_step_end", "on_log", "on_evaluate", "on_save", "on_train_end")


@dataclasses.dataclass
class TrainerControl:
    """transformers' TrainerControl flags that the loop reads (see the module docstring)."""

    should_training_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False


class CallbackHandler:
    """The callbacks of one trainer, called in order for each event."""

    def __init__(self, callbacks):
        self.callbacks = []
        for cb in callbacks or ():
            if inspect.isclass(cb):
                cb = cb()
            if not any(callable(getattr(cb, e, None)) for e in EVENTS):
                raise TypeError(f"callbacks: {cb!r} has none of the callback methods {', '.join(EVENTS)}")
            self.callbacks.append(cb)

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def fire(self, event: str, args, state, control: TrainerControl, **kwargs) -> None:
        for cb in self.callbacks:
            method = getattr(cb, event, None)
            if callable(method):
                method(args, state, control, **kwargs)
