"""The models are Flax NNX modules: HF-like module paths, variable types, the NNX training idioms
(nnx.Optimizer(wrt=nnx.LoRAParam), nnx.jit, nnx.value_and_grad with DiffState), orbax checkpoints of nnx.State,
and a compiled step whose size does not grow with depth."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from tests.helpers import rel_err
from unsloth_jax import FastLanguageModel, lora
from unsloth_jax.families import text_config
from unsloth_jax.hf.mapping import tensor_specs
from unsloth_jax.models import CausalLM, NF4Param
from unsloth_jax.models.state import variable_at
from unsloth_jax.quant import quantize_projections
from unsloth_jax.train import make_train_step
from unsloth_jax.train.step import loss_and_count

TINY = {"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5}


def _model(seed: int, layers: int = 2, **extra) -> CausalLM:
    cfg = text_config({**TINY, "num_hidden_layers": layers, **extra})
    return CausalLM(cfg, rngs=nnx.Rngs(seed))


def _batch(rng, b=2, s=12, vocab=96):
    ids = rng.integers(0, vocab, size=(b, s)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[-1, -3:] = 0
    return {"input_ids": jnp.asarray(ids), "labels": jnp.asarray(np.where(mask == 1, ids, -100)),
            "attention_mask": jnp.asarray(mask)}


def test_from_pretrained_returns_the_module_and_paths_read_like_hf(tmp_path):
    from tests.hf_models import save_hf_model

    pytest.importorskip("torch")
    save_hf_model("qwen2", tmp_path, seed=3)
    model, _ = FastLanguageModel.from_pretrained(tmp_path, dtype="float32", load_tokenizer=False, progress=False)
    assert isinstance(model, nnx.Module) and isinstance(model, CausalLM)
    logits = model(np.arange(10)[None] % 200)
    assert logits.shape == (1, 10, model.config.vocab_size) and logits.dtype == jnp.float32
    for name, spec in tensor_specs(model.config).items():
        var = variable_at(model, spec.path)
        assert isinstance(var, nnx.Param)
        # the module path is the HF name without the layer index (weight -> kernel for transposed projections)
        hf_like = re.sub(r"\.layers\.\d+\.", ".layers.", name)
        if spec.kind == "kernel":
            hf_like = hf_like[: -len("weight")] + "kernel"
        assert ".".join(spec.path) == hf_like, (name, spec.path)


def test_variable_types(rng):
    model = _model(int(rng.integers(1 << 30)))
    settings = lora.LoraSettings(r=4, lora_alpha=8, target_modules=lora.ALL_TARGETS)
    lora.add_lora(model, settings, jax.random.PRNGKey(0))
    flat = nnx.to_flat_state(nnx.state(model))
    lora_paths = [p for p, v in flat if isinstance(v, nnx.LoRAParam)]
    assert len(lora_paths) == 14 and all(p[-1] in ("lora_a", "lora_b") for p in lora_paths)
    assert all(isinstance(v, nnx.Param) for _, v in flat)  # LoRAParam is a Param subclass
    quantize_projections(model)
    kinds = {type(lin.kernel) for lin in model.projections().values()}
    assert kinds == {NF4Param}
    _, lo, rest = nnx.split(model, nnx.LoRAParam, ...)
    assert {p for p, _ in nnx.to_flat_state(lo)} == set(lora_paths)
    assert not any(isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(rest))


def test_nnx_optimizer_trains_only_lora_and_matches_the_functional_step(rng):
    """nnx.Optimizer(wrt=nnx.LoRAParam) + nnx.jit + nnx.value_and_grad(DiffState(0, LoRAParam)) updates exactly
    the LoRA factors, by the same SGD step the project's functional train step takes."""
    seed = int(rng.integers(1 << 30))
    model = _model(seed)
    lora.add_lora(model, lora.LoraSettings(r=4, lora_alpha=8, target_modules=lora.ALL_TARGETS),
                  jax.random.PRNGKey(seed))
    for lin in model.projections().values():  # nonzero B so every factor gets a gradient
        lin.lora_b[...] = 0.05 * jax.random.normal(jax.random.PRNGKey(1), lin.lora_b[...].shape)
    batch = _batch(rng)
    graphdef, trainable, frozen = lora.split(model)
    frozen_before = jax.tree.map(np.asarray, frozen)
    trainable_before = [np.asarray(v) for v in jax.tree.leaves(trainable)]

    step = make_train_step(graphdef, optax.sgd(0.5), remat="none", donate=False)
    want, _, _ = step(trainable, frozen, optax.sgd(0.5).init(trainable), {k: v[None] for k, v in batch.items()})

    optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.LoRAParam)

    def loss_fn(m, b):
        loss, _ = loss_and_count(m, b)
        return loss

    @nnx.jit
    def nnx_step(m, opt, b):
        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(m, b)
        assert all(isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(grads))
        opt.update(m, grads)
        return loss

    nnx_step(model, optimizer, batch)
    _, got, frozen_after = lora.split(model)
    jax.tree.map(np.testing.assert_array_equal, frozen_before, jax.tree.map(np.asarray, frozen_after))
    for (p, a), (_, b) in zip(nnx.to_flat_state(got), nnx.to_flat_state(want)):
        assert rel_err(np.asarray(a[...]), np.asarray(b[...])) < 1e-5, p
    moved = [not np.array_equal(np.asarray(a), b) for a, b in zip(jax.tree.leaves(got), trainable_before)]
    assert len(moved) == 14 and all(moved)


def test_orbax_checkpoint_of_nnx_state(tmp_path, rng):
    model = _model(int(rng.integers(1 << 30)))
    lora.add_lora(model, lora.LoraSettings(r=2, lora_alpha=4, target_modules=("q_proj", "down_proj")),
                  jax.random.PRNGKey(int(rng.integers(1 << 30))))
    _, state, _ = lora.split(model)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "lora", state)
    ckptr.wait_until_finished()
    fresh = _model(0)
    lora.add_lora(fresh, model.lora, jax.random.PRNGKey(123))
    _, target, _ = lora.split(fresh)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), target)
    restored = ckptr.restore(tmp_path / "lora", abstract)
    assert isinstance(restored, nnx.State)
    nnx.update(fresh, restored)
    for a, b in zip(jax.tree.leaves(nnx.state(fresh, nnx.LoRAParam)), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_step_program_size_does_not_grow_with_depth(rng):
    """Layers run under lax.scan: the traced step has the same number of equations at 2 and 8 layers."""
    sizes = []
    for layers in (2, 8):
        model = _model(0, layers=layers)
        lora.add_lora(model, lora.LoraSettings(r=2, lora_alpha=4, target_modules=lora.ALL_TARGETS),
                      jax.random.PRNGKey(0))
        graphdef, t, f = lora.split(model)
        opt = optax.adam(1e-3)
        step = make_train_step(graphdef, opt, remat="full", donate=False)
        jaxpr = jax.make_jaxpr(step)(t, f, opt.init(t), {k: v[None] for k, v in _batch(rng).items()})
        text = str(jaxpr)
        sizes.append(text.count("\n"))
    assert sizes[0] == sizes[1], sizes
