"""LoRA as a functional partition of the param dict.

`add_lora` puts `lora_a` [L, in, r] and `lora_b` [L, r, out] next to each targeted projection's frozen
`kernel`. `split(params)` separates the trainable leaves (LoRA factors, plus any `modules_to_save` or trained
biases) from the frozen ones; `merge` puts them back together. Differentiating a loss of `merge(trainable,
frozen)` with respect to `trainable` alone means frozen weights never get a gradient buffer or optimizer state.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from unsloth_jax.hf.mapping import ATTN_PROJS, MLP_PROJS

ALL_TARGETS = ATTN_PROJS + MLP_PROJS
LORA_KEYS = ("lora_a", "lora_b")

Path = tuple[str, ...]


def _in_out(kernel) -> tuple[int, int]:
    """(in, out) of a stacked projection kernel [L, in, out] or a 4-bit weight (which knows its HF shape)."""
    from unsloth_jax.quant import is_nf4

    if is_nf4(kernel):
        out_f, in_f = kernel.shape  # NF4 weights keep HF's [out, in] (per layer)
        return int(in_f), int(out_f)
    return int(kernel.shape[1]), int(kernel.shape[2])


def add_lora(params: dict, targets: tuple[str, ...], r: int, key: jax.Array, dtype=jnp.float32) -> dict:
    """Return params with LoRA factors on every targeted projection, initialised as PEFT does:
    A ~ kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)), B = 0. Existing factors are replaced."""
    unknown = [t for t in targets if t not in ALL_TARGETS]
    if unknown:
        raise ValueError(f"unknown target module(s) {unknown}; choose from {list(ALL_TARGETS)}")
    if r <= 0:
        raise ValueError(f"LoRA rank r must be positive, got {r}")
    layers = dict(params["layers"])
    keys = jax.random.split(key, len(targets))
    for name, k in zip(targets, keys):
        proj = dict(layers[name])
        n_layers = params["layers"]["input_layernorm"].shape[0]
        fan_in, fan_out = _in_out(proj["kernel"])
        bound = 1.0 / np.sqrt(fan_in)
        proj["lora_a"] = jax.random.uniform(k, (n_layers, fan_in, r), jnp.float32, -bound, bound).astype(dtype)
        proj["lora_b"] = jnp.zeros((n_layers, r, fan_out), dtype)
        layers[name] = proj
    return {**params, "layers": layers}


def is_lora_leaf(path: Path) -> bool:
    return bool(path) and path[-1] in LORA_KEYS


def make_is_trainable(modules_to_save: tuple[str, ...] = (), bias: str = "none",
                      targets: tuple[str, ...] = ALL_TARGETS) -> Callable[[Path], bool]:
    """The rule deciding which param paths train: LoRA factors; top-level params named in `modules_to_save`
    (e.g. "lm_head", "embed_tokens"); biases when bias="all" (every bias) or "lora_only" (biases of targets)."""
    if bias not in ("none", "all", "lora_only"):
        raise ValueError(f"bias must be 'none', 'all' or 'lora_only', got {bias!r}")
    saved = tuple(modules_to_save or ())

    def rule(path: Path) -> bool:
        if is_lora_leaf(path):
            return True
        if path and path[0] in saved:
            return True
        if path and path[-1] == "bias" and bias != "none":
            return bias == "all" or (len(path) >= 2 and path[-2] in targets)
        return False

    return rule


def _walk(tree: dict, prefix: Path = ()):
    for key, value in tree.items():
        path = prefix + (key,)
        if isinstance(value, dict):
            yield from _walk(value, path)
        else:
            yield path, value


def _insert(tree: dict, path: Path, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def split(params: dict, is_trainable: Callable[[Path], bool] = is_lora_leaf) -> tuple[dict, dict]:
    """(trainable, frozen): two nested dicts with disjoint leaves whose union is `params`."""
    trainable: dict = {}
    frozen: dict = {}
    for path, leaf in _walk(params):
        _insert(trainable if is_trainable(path) else frozen, path, leaf)
    return trainable, frozen


def merge(trainable: dict, frozen: dict) -> dict:
    """Inverse of `split`: one nested dict holding the leaves of both."""
    out: dict = {}
    for tree in (frozen, trainable):
        for path, leaf in _walk(tree):
            _insert(out, path, leaf)
    return out


def count(tree: dict) -> int:
    """Number of scalar parameters (4-bit weights count their original elements)."""
    from unsloth_jax.quant import is_nf4

    total = 0
    for _, leaf in _walk(tree):
        if is_nf4(leaf):  # original elements, times the stacked layers
            total += leaf.numel * int(np.prod(leaf.codes.shape[:-1]))
        else:
            total += int(np.prod(leaf.shape))
    return total


def merged_kernels(params: dict, scale: float) -> dict:
    """A copy of params with every LoRA pair folded in: kernel + scale * A @ B (float32 math), factors removed.
    Only for dense kernels; a 4-bit base must be dequantized first."""
    layers = {}
    for name, sub in params["layers"].items():
        if isinstance(sub, dict) and "lora_a" in sub:
            k = sub["kernel"]
            delta = scale * jnp.einsum("lir,lro->lio", sub["lora_a"].astype(jnp.float32), sub["lora_b"].astype(jnp.float32))
            sub = {kk: vv for kk, vv in sub.items() if kk not in LORA_KEYS}
            sub["kernel"] = (k.astype(jnp.float32) + delta).astype(k.dtype)
        layers[name] = sub
    return {**params, "layers": layers}
