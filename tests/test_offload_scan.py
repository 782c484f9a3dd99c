"""The "offload" remat mode's prefetching layer scan (unsloth_jax.models.offload): the values and gradients of a
lax.scan over jax.checkpoint layers, for every subset of differentiated inputs, and where the decoder uses it."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from tests.helpers import inner_jaxprs, rel_err
from unsloth_jax import lora, ops
from unsloth_jax.families import text_config
from unsloth_jax.models import CausalLM
from unsloth_jax.models.offload import OFFLOAD_CHUNK_BYTES, OFFLOAD_COMPILER_OPTIONS, copy_chunks, offloaded_layer_scan
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


# one copy per layer input (the whole [12, 16] float32 input is 768 bytes), or four blocks of 3 rows
CHUNKS = {"whole": 2 ** 20, "in_4": 200}


@pytest.mark.parametrize("chunking,prefetch_weights", [("whole", False), ("in_4", False), ("in_4", True)])
@pytest.mark.parametrize("wrt", [("a", "b"), ("a", "b", "h"), ("w",), ("h",)])
def test_prefetched_scan_matches_the_checkpointed_scan(wrt, chunking, prefetch_weights):
    """Loss and gradients with respect to the LoRA leaves only (the training case), with the stack's input,
    with a frozen weight, and with the input alone, over several seeds, with each layer input copied whole
    and in row blocks, and with each layer's weights sliced one iteration ahead; no gradient for what is not
    asked."""
    scan = functools.partial(offloaded_layer_scan, _body, chunk_bytes=CHUNKS[chunking],
                             prefetch_weights=prefetch_weights)
    for seed in range(4):
        h, layers, side = _inputs(seed)

        def loss(diff, scan):
            h_ = diff.get("h", h)
            stack = {k: diff.get(k, v) for k, v in layers.items()}
            return jnp.sum(jnp.sin(scan(h_, stack, side)) ** 2)

        diff = {k: (h if k == "h" else layers[k]) for k in wrt}
        want_loss, want = jax.jit(jax.value_and_grad(functools.partial(loss, scan=_checkpointed_scan)))(diff)
        got_loss, got = jax.jit(jax.value_and_grad(functools.partial(loss, scan=scan)))(diff)
        assert abs(float(got_loss) - float(want_loss)) <= 1e-6 * abs(float(want_loss)), (seed, wrt)
        assert set(got) == set(wrt)
        for k in wrt:
            assert rel_err(np.asarray(got[k]), np.asarray(want[k])) < 1e-5, (seed, k)


def _body_with_named(h, layer, side):
    """_body with a costly value named "kept" (sinh) between its two matmuls."""
    kept = checkpoint_name(jnp.sinh(h @ layer["w"]), "kept")
    return h + jnp.tanh(kept @ layer["w"] + (h @ layer["a"]) @ layer["b"]) * side["scale"]


def _primitive_count(jaxpr, name: str) -> int:
    """How many equations of primitive `name` `jaxpr` holds, with the jaxprs nested in it."""
    return sum((eqn.primitive.name == name) + sum(_primitive_count(inner, name) for inner in inner_jaxprs(eqn))
               for eqn in jaxpr.eqns)


@pytest.mark.parametrize("chunking,prefetch_weights", [("whole", False), ("in_4", True)])
@pytest.mark.parametrize("wrt", [("a", "b"), ("a", "b", "h")])
def test_prefetched_scan_with_kept_values_matches_and_does_not_recompute_them(wrt, chunking, prefetch_weights):
    """keep (the "offload_attention" mechanism): the values the policy saves are offloaded with each layer's
    input and read back in the backward pass: the checkpointed scan's loss and gradients, over several seeds,
    with the kept value computed once per layer (forward only) where plain prefetching computes it twice."""
    keep = jax.checkpoint_policies.save_only_these_names("kept")
    kept_scan = functools.partial(offloaded_layer_scan, _body_with_named, keep=keep, chunk_bytes=CHUNKS[chunking],
                                  prefetch_weights=prefetch_weights)
    for seed in range(4):
        h, layers, side = _inputs(seed)

        def loss(diff, scan):
            stack = {k: diff.get(k, v) for k, v in layers.items()}
            return jnp.sum(jnp.sin(scan(diff.get("h", h), stack, side)) ** 2)

        diff = {k: (h if k == "h" else layers[k]) for k in wrt}
        checkpointed = lambda h, layers, side: jax.lax.scan(  # noqa: E731
            jax.checkpoint(lambda h, x: (_body_with_named(h, x, side), None)), h, layers)[0]
        want_loss, want = jax.jit(jax.value_and_grad(functools.partial(loss, scan=checkpointed)))(diff)
        got_loss, got = jax.jit(jax.value_and_grad(functools.partial(loss, scan=kept_scan)))(diff)
        assert abs(float(got_loss) - float(want_loss)) <= 1e-6 * abs(float(want_loss)), (seed, wrt)
        assert set(got) == set(wrt)
        for k in wrt:
            assert rel_err(np.asarray(got[k]), np.asarray(want[k])) < 1e-5, (seed, k)
    counts = {}
    for name, scan in (("keep", kept_scan), ("plain", functools.partial(offloaded_layer_scan, _body_with_named))):
        jaxpr = jax.make_jaxpr(jax.grad(functools.partial(loss, scan=scan)))({"a": layers["a"]}).jaxpr
        counts[name] = _primitive_count(jaxpr, "sinh")
    assert counts == {"keep": 1, "plain": 2}, counts


def test_copy_chunks_is_the_fewest_equal_row_blocks_within_the_limit():
    mib = 2 ** 20
    assert copy_chunks(2048, 8192) == 1  # 16 MiB: whole
    assert copy_chunks(32768, 8192) == 8  # 256 MiB: 8 x 32 MiB
    assert copy_chunks(98304, 8192) == 24
    assert copy_chunks(1000, 3 * mib) == 100  # 3 GB in blocks of 10 rows (30 MiB)
    assert copy_chunks(7, mib, chunk_bytes=3 * mib) == 7  # no divisor of 7 fits but 7 itself
    assert copy_chunks(32768, 8192, chunk_bytes=None) == 1  # offload_copies=whole
    for rows, row_bytes, limit in [(12, 64, 200), (4096, 10, 999), (30, 7, 50)]:
        k = copy_chunks(rows, row_bytes, limit)
        assert rows % k == 0 and (rows // k) * row_bytes <= max(limit, row_bytes)
        assert all(rows % j or (rows // j) * row_bytes > limit for j in range(1, k)), (rows, row_bytes, limit)
    with pytest.raises(ValueError, match="chunk_bytes"):
        copy_chunks(8, 8, 0)


@pytest.mark.parametrize("chunking,copies", [("whole", 1), ("in_4", 4)])
def test_each_layer_input_goes_to_the_host_and_back_in_its_blocks(chunking, copies):
    """The differentiated program moves `copies` arrays to the host in the forward scan and `copies` back in
    the backward one (the device_put placements in its jaxpr; on the CPU they lower to nothing)."""
    h, layers, side = _inputs(0)
    loss = lambda lr: jnp.sum(offloaded_layer_scan(_body, h, {**layers, **lr}, side,  # noqa: E731
                                                   chunk_bytes=CHUNKS[chunking]))
    text = str(jax.make_jaxpr(jax.grad(loss))({"a": layers["a"], "b": layers["b"]}))
    assert text.count("devices=(MemorySpace.Host,)") == copies
    assert text.count("devices=(MemorySpace.Device,)") == copies


def test_gradient_with_respect_to_a_side_input_is_refused():
    h, layers, side = _inputs(0)
    with pytest.raises(NotImplementedError, match="side inputs"):
        jax.grad(lambda s: jnp.sum(offloaded_layer_scan(_body, h, layers, {"scale": s})))(side["scale"])


CFG = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
       "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5}


def _custom_vjp_calls(remat: str) -> int:
    """How many custom-VJP calls the jaxpr of a small LoRA model's loss holds under `remat`, besides the ones
    it holds under "full" (the kernels' own)."""
    model = CausalLM(text_config(CFG), dtype=jnp.float32, rngs=nnx.Rngs(0))
    lora.add_lora(model, lora.LoraSettings(r=2, lora_alpha=4, target_modules=lora.ALL_TARGETS), jax.random.key(0))
    graphdef, trainable, frozen = lora.split(model)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, size=(2, 9)), jnp.int32)
    batch = {"input_ids": ids, "labels": ids, "attention_mask": jnp.ones_like(ids)}

    def count(mode):
        loss = lambda t: loss_and_count(nnx.merge(graphdef, t, frozen), batch, remat=mode)[0]  # noqa: E731
        return str(jax.make_jaxpr(loss)(trainable)).count("custom_vjp_call")

    return count(remat) - count("full")


def test_the_decoder_runs_the_host_offload_modes_through_the_prefetched_scan_only(monkeypatch):
    """"offload" and "offload_attention" run the layer stack as one custom VJP (the prefetched scan); the
    two-level policy-based mode does not, nor "offload_attention" under the layer-stack setting
    offload_attention=policy. The scan's weight slicing and copies follow the layer-stack settings (prefetching
    by default with kept values only, copies in blocks)."""
    import unsloth_jax.models.layer_stack as layer_stack

    calls = []
    real_scan = layer_stack.offloaded_layer_scan

    def spy(*args, **kwargs):
        calls.append((kwargs["prefetch_weights"], kwargs["chunk_bytes"]))
        return real_scan(*args, **kwargs)

    monkeypatch.setattr(layer_stack, "offloaded_layer_scan", spy)
    for remat, prefetch in (("offload", False), ("offload_attention", True)):
        calls.clear()
        assert _custom_vjp_calls(remat) == 1
        assert set(calls) == {(prefetch, OFFLOAD_CHUNK_BYTES)}, remat
    assert _custom_vjp_calls("offload_every_2") == 0
    calls.clear()
    assert _custom_vjp_calls("offload,offload_weights=prefetch,offload_copies=whole") == 1
    assert set(calls) == {(True, None)}
    assert _custom_vjp_calls("offload_attention,offload_attention=policy") == 0


def test_step_compiler_options_only_for_the_prefetched_offload_on_gpu(monkeypatch):
    import unsloth_jax.train.step as step_mod
    from unsloth_jax.models.layer_stack import LayerStackPolicy

    parse = LayerStackPolicy.parse  # the steps pass the parsed policy
    monkeypatch.delenv(ops.ENV_VAR, raising=False)
    assert step_mod.step_compiler_options(parse("offload")) is None  # the CPU
    monkeypatch.setattr(step_mod, "on_gpu", lambda: True)
    assert step_mod.step_compiler_options(parse("offload")) == OFFLOAD_COMPILER_OPTIONS
    assert step_mod.step_compiler_options(parse("offload_attention")) == OFFLOAD_COMPILER_OPTIONS
    for mode in ("none", "full", "offload_every_4", "save_attention"):
        assert step_mod.step_compiler_options(parse(mode)) is None, mode
    assert step_mod.step_compiler_options(parse("offload_attention,offload_attention=policy")) is None
    with pytest.raises(TypeError, match="remat must be a LayerStackPolicy"):
        step_mod.step_compiler_options("offload")  # below the API the policy is typed
    # the layer-stack policy alone decides; the ops policy policy_jit passes holds kernel choices only
    policy = LayerStackPolicy.parse("offload_attention")
    assert step_mod.step_compiler_options(policy, ops.Policy()) == OFFLOAD_COMPILER_OPTIONS
