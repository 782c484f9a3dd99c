"""make_optimizer's AdamW (float32 and 8-bit moments), applied by the train step piece by piece in place, gives
the params and state of the update it replaced (an optax chain over whole leaves with tree.map: the previous
implementation, kept here as the reference), and XLA's memory analysis of the compiled update and train step
shows its temporaries bounded by a few pieces where the tree.map update held float32 copies of every leaf."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from unsloth_jax.train import make_optimizer, make_schedule
from unsloth_jax.train.optim import _dequantize, _quantize, _Q8, AdamWState, chunk_count, embedding_labels
from unsloth_jax.train.step import apply_gradients


# ------------------------------------------------------------------- the previous implementation (reference)
class _OldAdam8bitState(NamedTuple):
    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates


def _old_scale_by_adam_8bit(b1, b2, eps):
    """The tree.map 8-bit Adam this change replaced, as it was."""

    def init(params):
        mu = jax.tree.map(lambda p: _quantize(jnp.zeros(p.shape, jnp.float32), True), params)
        nu = jax.tree.map(lambda p: _quantize(jnp.zeros(p.shape, jnp.float32), False), params)
        return _OldAdam8bitState(jnp.zeros((), jnp.int32), mu, nu)

    def update(updates, state, params=None):
        count = state.count + 1
        is_q = lambda x: isinstance(x, _Q8)  # noqa: E731
        mu = jax.tree.map(lambda g, q: b1 * _dequantize(q, g, True) + (1 - b1) * g.astype(jnp.float32),
                          updates, state.mu, is_leaf=is_q)
        nu = jax.tree.map(lambda g, q: b2 * _dequantize(q, g, False) + (1 - b2) * jnp.square(g.astype(jnp.float32)),
                          updates, state.nu, is_leaf=is_q)
        c1 = 1 - b1 ** count.astype(jnp.float32)
        c2 = 1 - b2 ** count.astype(jnp.float32)
        direction = jax.tree.map(lambda m, v, g: ((m / c1) / (jnp.sqrt(v / c2) + eps)).astype(g.dtype), mu, nu, updates)
        return direction, _OldAdam8bitState(count, jax.tree.map(lambda m: _quantize(m, True), mu),
                                            jax.tree.map(lambda v: _quantize(v, False), nu))

    return optax.GradientTransformation(init, update)


def _old_in_float32(tx):
    f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)  # noqa: E731
    return optax.GradientTransformation(lambda p: tx.init(f32(p)), lambda u, s, p=None: tx.update(f32(u), s, f32(p)))


def _old_chain(optim, schedule, *, weight_decay, max_grad_norm, embedding_schedule=None, b1=0.9, b2=0.999, eps=1e-8):
    """make_optimizer's chain before this change: clip -> in_float32(Adam) -> decay -> -lr (per label)."""
    lr = optax.scale_by_learning_rate(schedule)
    if embedding_schedule is not None:
        lr = optax.multi_transform({"default": lr, "embedding": optax.scale_by_learning_rate(embedding_schedule)},
                                   embedding_labels)
    adam = _old_scale_by_adam_8bit(b1, b2, eps) if optim == "adamw_8bit" else optax.scale_by_adam(b1, b2, eps)
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), _old_in_float32(adam),
                       optax.add_decayed_weights(weight_decay), lr)


def _old_apply(tx, params, state, grads, loss):
    """apply_gradients before this change: cast, global norm, guard, tx.update, optax.apply_updates, keep."""
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(norm)
    grads = jax.tree.map(lambda g: jnp.where(finite, g, 0.0), grads)
    updates, new_state = tx.update(grads, state, params)
    keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
    return (jax.tree.map(keep, optax.apply_updates(params, updates), params),
            jax.tree.map(keep, new_state, state))


def _adam_moments(state):
    """(count, mu, nu) of the Adam part of an old chain's state."""
    kinds = (optax.ScaleByAdamState, _OldAdam8bitState)
    node = next(x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, kinds)) if isinstance(x, kinds))
    return node.count, node.mu, node.nu


# --------------------------------------------------------------------------------------------- tests
SHAPES = {"model": {"layers": {"mlp": (4, 64, 256), "bias": (4, 32)}, "embed_tokens": {"weight": (96, 64)},
                    "norm": (64,)},
          "lm_head": {"weight": (64, 96)}}
CHUNK = 2048  # elements per piece: the stacked [4, 64, 256] leaf goes one layer at a time, the [96, 64] embedding
# in 3 pieces of 32 rows


def _tree(fn):
    return jax.tree.map(fn, SHAPES, is_leaf=lambda x: isinstance(x, tuple))


def _check_8bit_close(new_p, old_p, new_s, old_moments, like, where):
    """8-bit: float32 rounding differences can move a moment across a code boundary, and that element's later
    steps then differ by about one code. So: every dequantized moment within 3 codes of its block's scale of the
    reference, all but 1% of moments and params equal to float32 rounding, and params within 3e-3."""
    is_q = lambda x: isinstance(x, _Q8)  # noqa: E731
    same, total = 0, 0
    for new_m, old_m, signed, top in ((new_s.mu, old_moments[0], True, 127), (new_s.nu, old_moments[1], False, 255)):
        for qa, qb, p in zip(jax.tree.leaves(new_m, is_leaf=is_q), jax.tree.leaves(old_m, is_leaf=is_q),
                             jax.tree.leaves(like)):
            a, b = np.asarray(_dequantize(qa, p, signed)), np.asarray(_dequantize(qb, p, signed))
            step = np.repeat(np.asarray(qb.scale), 256)[: a.size].reshape(a.shape) / top
            assert np.all(np.abs(a - b) <= 3 * step + 1e-30), where
            close = np.isclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())
            same, total = same + close.sum(), total + close.size
    for a, b in zip(jax.tree.leaves(new_p), jax.tree.leaves(old_p)):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, atol=3e-3, err_msg=where)
        close = np.isclose(a, b, rtol=2e-6, atol=1e-7)
        same, total = same + close.sum(), total + close.size
    assert same > 0.99 * total, f"{where}: {same} of {total} equal"


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_8bit"])
def test_fused_update_equals_tree_map_update(optim, rng):
    """Four float32 steps (no clipping, clipping, a non-finite loss that must be skipped, clipping) with weight
    decay, a separate embedding rate and a token-count divisor: params, moments and counts after each step
    match the previous tree.map chain (8-bit: up to float32 rounding at a code boundary, _check_8bit_close)."""
    assert chunk_count(SHAPES["model"]["layers"]["mlp"], CHUNK) == 4
    assert chunk_count(SHAPES["model"]["embed_tokens"]["weight"], CHUNK) == 3
    sched = make_schedule("linear", 3e-2, 10, 2)
    emb_sched = make_schedule("linear", 1e-2, 10, 2)
    kw = dict(weight_decay=0.1, max_grad_norm=1.0, embedding_schedule=emb_sched)
    new_tx = make_optimizer(optim, sched, chunk_elements=CHUNK, **kw)
    old_tx = _old_chain(optim, sched, **kw)
    params = _tree(lambda s: jnp.asarray(rng.standard_normal(s), jnp.float32))
    new_p, new_s = params, new_tx.init(params)
    old_p, old_s = params, old_tx.init(params)
    assert isinstance(new_s, AdamWState)
    new_step = jax.jit(lambda p, s, g, loss, d: apply_gradients(new_tx, p, s, g, loss, grad_divisor=d)[:2])
    old_step = jax.jit(lambda p, s, g, loss, d: _old_apply(old_tx, p, s, jax.tree.map(lambda x: x / d, g), loss))
    finite_steps = 0
    for k, (scale, loss) in enumerate([(1e-3, 1.0), (5.0, 1.0), (5.0, np.nan), (2.0, 1.0)]):
        tokens = float(rng.integers(1, 50))
        g_sum = _tree(lambda s: jnp.asarray(scale * tokens * rng.standard_normal(s), jnp.float32))
        new_p, new_s = new_step(new_p, new_s, g_sum, jnp.float32(loss), jnp.float32(tokens))
        old_p, old_s = old_step(old_p, old_s, g_sum, jnp.float32(loss), jnp.float32(tokens))
        finite_steps += int(np.isfinite(loss))
        count, mu, nu = _adam_moments(old_s)
        assert int(new_s.count) == int(count) == finite_steps
        if optim == "adamw_8bit":
            _check_8bit_close(new_p, old_p, new_s, (mu, nu), params, f"step {k}")
        else:
            for a, b in zip(jax.tree.leaves(new_p), jax.tree.leaves(old_p)):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-7, err_msg=f"step {k}")
            for a, b in zip(jax.tree.leaves((new_s.mu, new_s.nu)), jax.tree.leaves((mu, nu))):
                # float32 rounding (the global norm summed in another order), relative to the moment's scale
                np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-6 * np.abs(b).max(), err_msg=f"step {k}")
    moved = [not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(new_p),
                                                                               jax.tree.leaves(params))]
    assert all(moved)


def test_init_equals_tree_map_init():
    """init builds the same zeros as the previous init (8-bit: _quantize of float32 zeros) without them."""
    params = _tree(lambda s: jnp.ones(s, jnp.bfloat16))
    sched = make_schedule("constant", 1e-3, 10, 0)
    for optim in ("adamw_torch", "adamw_8bit"):
        new = make_optimizer(optim, sched).init(params)
        _, mu, nu = _adam_moments(_old_chain(optim, sched, weight_decay=0.0, max_grad_norm=1.0).init(params))
        for a, b in zip(jax.tree.leaves((new.mu, new.nu)), jax.tree.leaves((mu, nu))):
            assert a.shape == b.shape and a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# A stacked-model-shaped tree: 16 layers, hidden 256, MLP 1024, a 4096-row embedding (float32 on the CPU: its
# bf16 handling upcasts dynamic slices of whole arrays, which a GPU does not).
L, H, I, V = 16, 256, 1024, 4096
BIG = {"model": {"layers": {"up": (L, H, I), "down": (L, I, H), "q": (L, H, H), "norm": (L, H)},
                 "embed_tokens": {"weight": (V, H)}}}
SLICE = H * I  # one layer of the largest leaf


def _update_temp_bytes(tx, apply) -> int:
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), BIG, is_leaf=lambda x: isinstance(x, tuple))
    state = jax.eval_shape(tx.init, params)
    f = jax.jit(lambda p, s, g, loss: apply(tx, p, s, g, loss)[:2], donate_argnums=(0, 1))
    compiled = f.lower(params, state, params, jax.ShapeDtypeStruct((), jnp.float32)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_8bit"])
def test_update_temporaries_are_a_few_pieces(optim):
    """XLA's memory analysis of the compiled update (params and state donated, gradients given): with pieces of
    one layer slice, its temporaries stay below 8 float32 copies of one slice (the old piece and the new one of
    each array, and the float32 moments in between); the tree.map update needed more than float32 copies of
    every parameter at once."""
    sched = make_schedule("linear", 1e-3, 10, 0)
    temp = _update_temp_bytes(make_optimizer(optim, sched, weight_decay=0.01, chunk_elements=SLICE), apply_gradients)
    bound = 8 * 4 * SLICE
    all_f32 = 4 * sum(int(np.prod(s)) for s in jax.tree.leaves(BIG, is_leaf=lambda x: isinstance(x, tuple)))
    old = _update_temp_bytes(_old_chain(optim, sched, weight_decay=0.01, max_grad_norm=1.0), _old_apply)
    print(f"{optim}: temp {temp / 2**20:.1f} MiB (bound {bound / 2**20:.1f}); tree.map update {old / 2**20:.1f} MiB; "
          f"float32 params {all_f32 / 2**20:.1f} MiB")
    assert temp < bound
    assert old > all_f32 > 4 * bound


def _step_temp_bytes(optimizer, cfg) -> int:
    from unsloth_jax import lora
    from unsloth_jax.models.decoder import CausalLM
    from unsloth_jax.train import make_train_step

    model = nnx.eval_shape(lambda: CausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    lora.enable_full_finetuning(model)
    graphdef, trainable, frozen = lora.split(model)
    ids = jax.ShapeDtypeStruct((1, 1, 64), jnp.int32)
    step = make_train_step(graphdef, optimizer, remat="full")
    compiled = step.lower(trainable, frozen, jax.eval_shape(optimizer.init, trainable),
                          {"input_ids": ids, "labels": ids, "attention_mask": ids}).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_8bit_train_step_temporaries_stay_near_sgd():
    """The whole full fine-tuning step (abstract float32 model, 8 layers of hidden 256 / MLP 1024): 8-bit AdamW's
    temporaries exceed those of SGD (gradients, activations, no optimizer state) by less than half a float32
    copy of the weights; the tree.map 8-bit update exceeded them by more than one."""
    transformers = pytest.importorskip("transformers")
    from unsloth_jax.families import text_config

    hf = transformers.AutoConfig.for_model("llama", hidden_size=H, intermediate_size=I, num_hidden_layers=8,
                                           num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                                           tie_word_embeddings=False)
    cfg = text_config(hf.to_dict(), "test")
    sched = make_schedule("linear", 1e-3, 10, 0)
    f32_params = 4 * (8 * (3 * H * I + 2 * H * H + 2 * H * (H // 2)) + 2 * V * H)
    sgd = _step_temp_bytes(make_optimizer("sgd", sched), cfg)
    new = _step_temp_bytes(make_optimizer("adamw_8bit", sched, chunk_elements=SLICE), cfg)
    old = _step_temp_bytes(_old_chain("adamw_8bit", sched, weight_decay=0.0, max_grad_norm=1.0), cfg)
    print(f"step temp: sgd {sgd / 2**20:.1f} MiB, 8-bit {new / 2**20:.1f} MiB, tree.map 8-bit {old / 2**20:.1f} MiB; "
          f"float32 weights {f32_params / 2**20:.1f} MiB")
    assert new - sgd < 0.5 * f32_params
    assert old - sgd > f32_params


def test_8bit_full_finetuning_resume_matches_uninterrupted(tmp_path, rng):
    """The optimizer state (AdamWState with 8-bit codes) survives an orbax checkpoint: full fine-tuning with
    adamw_8bit interrupted after its step-3 checkpoint and resumed ends with the uninterrupted run's losses and
    weights."""
    pytest.importorskip("transformers")
    from tests.helpers import interrupted_run
    from tests.hf_models import save_hf_model
    from unsloth_jax import FastLanguageModel, SFTTrainer, TrainingArguments, lora

    save_hf_model("llama", tmp_path / "hf", seed=int(rng.integers(1 << 30)))
    data = [{"input_ids": rng.integers(1, 256, int(rng.integers(8, 24))).tolist()} for _ in range(12)]

    def trainer_for(out):
        model, _ = FastLanguageModel.from_pretrained(tmp_path / "hf", dtype="float32", full_finetuning=True,
                                                     load_tokenizer=False, progress=False)
        args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, max_steps=6, save_steps=3,
                                 learning_rate=1e-3, optim="adamw_8bit", weight_decay=0.01, logging_steps=1, seed=1)
        trainer = SFTTrainer(model=model, train_dataset=data, args=args, max_seq_length=32)
        trainer._pad_id = lambda: 0
        return trainer, model

    full_trainer, model_full = trainer_for(tmp_path / "full")
    full_trainer.train()
    interrupted_run(trainer_for(tmp_path / "part")[0], at_step=3)
    resumed_trainer, model_resumed = trainer_for(tmp_path / "part")
    resumed_trainer.train(resume_from_checkpoint=True)
    np.testing.assert_allclose(resumed_trainer.state.loss_history[3:], full_trainer.state.loss_history[3:], rtol=1e-6)
    for x, y in zip(jax.tree.leaves(lora.split(model_full)[1]), jax.tree.leaves(lora.split(model_resumed)[1])):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)
