"""Filling an NNX module from a nested dict of arrays (a checkpoint read by `unsloth_jax.hf.loading`).

    model = nnx.eval_shape(lambda: CausalLM(cfg, dtype=dt, rngs=nnx.Rngs(0)))   # no memory allocated
    fill(model, {"model": {"embed_tokens": {"weight": array}, ...}})

A value that is an `NF4Weight` or an `FP8Weight` replaces the dense variable by an `NF4Param` / `FP8Param` (a
quantized base); every other value must match the variable's shape and becomes its value. Every variable must be
given one.
"""
from __future__ import annotations

import numpy as np
from flax import nnx

from pallas_kernels.fp8 import FP8Weight
from pallas_kernels.nf4_format import NF4Weight
from unsloth_jax.models.layers import FP8Param, NF4Param


def _flat(tree: dict, prefix: tuple = ()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flat(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def variable_at(module: nnx.Module, path: tuple[str, ...]) -> nnx.Variable:
    """The variable at attribute path `path` (e.g. ("model", "norm", "weight")); KeyError naming the path."""
    node = module
    for key in path:
        node = getattr(node, key, None)
        if node is None:
            raise KeyError(f"{'.'.join(path)}: the model has no attribute {key!r} here")
    if not isinstance(node, nnx.Variable):
        raise KeyError(f"{'.'.join(path)}: not a variable")
    return node


def fill(module: nnx.Module, values: dict) -> nnx.Module:
    """Set the variables of `module` (built abstractly with nnx.eval_shape, or real) from `values`, a nested dict
    keyed by attribute names. Raises KeyError naming a path that `module` lacks or a variable left unset, and
    ValueError naming a path whose shape differs."""
    given = set()
    for path, value in _flat(values):
        parent = module
        for key in path[:-1]:
            parent = getattr(parent, key, None)
            if parent is None:
                raise KeyError(f"{'.'.join(path)}: the model has no module {key!r}")
        var = getattr(parent, path[-1], None)
        if not isinstance(var, nnx.Variable):
            raise KeyError(f"{'.'.join(path)}: the model has no variable here")
        if isinstance(value, NF4Weight):
            setattr(parent, path[-1], NF4Param(value))
        elif isinstance(value, FP8Weight):
            setattr(parent, path[-1], FP8Param(value))
        else:
            want = np.shape(var.get_value())
            if tuple(np.shape(value)) != tuple(want):
                raise ValueError(f"{'.'.join(path)}: shape {list(np.shape(value))}, but the model expects {list(want)}")
            var.set_value(value)
        given.add(path)
    missing = [".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(module)) if tuple(p) not in given]
    if missing:
        raise KeyError(f"no value for {len(missing)} variable(s): {', '.join(missing[:8])}")
    return module
