"""The "offload" remat mode's prefetching layer scan (unsloth_jax.models.offload): the values and gradients of a
lax.scan over jax.checkpoint layers, for every subset of differentiated inputs, and where the decoder uses it."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers import rel_err
from unsloth_jax import lora
from unsloth_jax.config import ModelConfig
from unsloth_jax.models import CausalLM
from unsloth_jax.models.offload import OFFLOAD_COMPILER_OPTIONS, offloaded_layer_scan
from unsloth_jax.train.step import loss_and_count

LAYERS, TOKENS, HIDDEN, RANK = 5, 12, 16, 2


def _body(h, layer, side):
    """A residual layer with a frozen matrix, a LoRA pair, an integer leaf and a side input."""
    lora_out = (h @ layer["a"]) @ layer["b"]
    return h + jnp.tanh(h @ layer["w"] + lora_out) * side["scale"] + layer["index"].astype(h.dtype) * 1e-2


def _checkpointed_scan(h, layers, side):
    step = jax.checkpoint(lambda h, x: (_body(h, x, side), None))
    return jax.lax.scan(step, h, layers)[0]


def _inputs(seed):
    k = jax.random.split(jax.random.key(seed), 5)
    layers = {"w": jax.random.normal(k[0], (LAYERS, HIDDEN, HIDDEN)) / 4,
              "a": jax.random.normal(k[1], (LAYERS, HIDDEN, RANK)),
              "b": 0.1 * jax.random.normal(k[2], (LAYERS, RANK, HIDDEN)),
              "index": jnp.arange(LAYERS, dtype=jnp.int32)}
    return jax.random.normal(k[3], (TOKENS, HIDDEN)), layers, {"scale": jax.random.normal(k[4], (TOKENS, HIDDEN))}


@pytest.mark.parametrize("wrt", [("a", "b"), ("a", "b", "h"), ("w",), ("h",)])
def test_prefetched_scan_matches_the_checkpointed_scan(wrt):
    """Loss and gradients with respect to the LoRA leaves only (the training case), with the stack's input,
    with a frozen weight, and with the input alone, over several seeds; no gradient for what is not asked."""
    for seed in range(4):
        h, layers, side = _inputs(seed)

        def loss(diff, scan):
            h_ = diff.get("h", h)
            stack = {k: diff.get(k, v) for k, v in layers.items()}
            return jnp.sum(jnp.sin(scan(h_, stack, side)) ** 2)

        diff = {k: (h if k == "h" else layers[k]) for k in wrt}
        want_loss, want = jax.jit(jax.value_and_grad(functools.partial(loss, scan=_checkpointed_scan)))(diff)
        got_loss, got = jax.jit(jax.value_and_grad(functools.partial(
            loss, scan=functools.partial(offloaded_layer_scan, _body))))(diff)
        assert abs(float(got_loss) - float(want_loss)) <= 1e-6 * abs(float(want_loss)), (seed, wrt)
        assert set(got) == set(wrt)
        for k in wrt:
            assert rel_err(np.asarray(got[k]), np.asarray(want[k])) < 1e-5, (seed, k)


def test_gradient_with_respect_to_a_side_input_is_refused():
    h, layers, side = _inputs(0)
    with pytest.raises(NotImplementedError, match="side inputs"):
        jax.grad(lambda s: jnp.sum(offloaded_layer_scan(_body, h, layers, {"scale": s})))(side["scale"])


CFG = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
       "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5}


def _custom_vjp_calls(remat: str) -> int:
    """How many custom-VJP calls the jaxpr of a small LoRA model's loss holds under `remat`, besides the ones
    it holds under "full" (the kernels' own)."""
    model = CausalLM(ModelConfig.from_dict(CFG), dtype=jnp.float32, rngs=nnx.Rngs(0))
    lora.add_lora(model, lora.LoraSettings(r=2, lora_alpha=4, target_modules=lora.ALL_TARGETS), jax.random.key(0))
    graphdef, trainable, frozen = lora.split(model)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, size=(2, 9)), jnp.int32)
    batch = {"input_ids": ids, "labels": ids, "attention_mask": jnp.ones_like(ids)}

    def count(mode):
        loss = lambda t: loss_and_count(nnx.merge(graphdef, t, frozen), batch, remat=mode)[0]  # noqa: E731
        return str(jax.make_jaxpr(loss)(trainable)).count("custom_vjp_call")

    return count(remat) - count("full")


def test_the_decoder_runs_offload_through_the_prefetched_scan_only():
    """"offload" runs the layer stack as one custom VJP (the prefetched scan); the policy-based modes do not."""
    assert _custom_vjp_calls("offload") == 1
    assert _custom_vjp_calls("offload_attention") == 0
    assert _custom_vjp_calls("offload_every_2") == 0


def test_step_compiler_options_only_for_the_prefetched_offload_on_gpu(monkeypatch):
    import unsloth_jax.train.step as step_mod

    assert step_mod.step_compiler_options("offload") is None  # the CPU
    monkeypatch.setattr(step_mod, "on_gpu", lambda: True)
    assert step_mod.step_compiler_options("offload") == OFFLOAD_COMPILER_OPTIONS
    for mode in ("none", "full", "offload_attention", "offload_every_4", "save_attention"):
        assert step_mod.step_compiler_options(mode) is None, mode
