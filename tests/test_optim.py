"""Schedules equal transformers' get_scheduler; 8-bit AdamW tracks fp32 AdamW; optimizer names map right."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from unsloth_jax.train import make_optimizer, make_schedule, scale_by_adam_8bit


@pytest.mark.parametrize("name", ["linear", "cosine", "constant", "constant_with_warmup"])
def test_schedules_match_transformers(name):
    torch = pytest.importorskip("torch")
    from transformers import get_scheduler

    total, warmup, lr = 37, 5, 3e-4
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=lr)
    sched = get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total)
    theirs = []
    for _ in range(total):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    ours = [float(make_schedule(name, lr, total, warmup)(t)) for t in range(total)]
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-12)


def test_adam_8bit_tracks_fp32_adam(rng):
    """On a least-squares problem, 8-bit AdamW's trajectory stays close to fp32 AdamW's and converges."""
    a = jnp.asarray(rng.standard_normal((64, 700)), jnp.float32)
    target = jnp.asarray(rng.standard_normal((64, 3)), jnp.float32)
    w0 = {"w": jnp.asarray(0.1 * rng.standard_normal((700, 3)), jnp.float32)}
    loss = lambda p: jnp.mean((a @ p["w"] - target) ** 2)  # noqa: E731

    def run(opt, steps=150):
        p, s = w0, opt.init(w0)
        upd = jax.jit(lambda p, s: opt.update(jax.grad(loss)(p), s, p))
        for _ in range(steps):
            u, s = upd(p, s)
            p = optax.apply_updates(p, u)
        return p, s

    sched = make_schedule("constant", 1e-2, 150, 0)
    p32, _ = run(make_optimizer("adamw_torch", sched, max_grad_norm=0))
    p8, s8 = run(make_optimizer("adamw_8bit", sched, max_grad_norm=0))
    assert float(loss(p8)) < 0.2 * float(loss(w0))
    rel = float(jnp.linalg.norm(p8["w"] - p32["w"]) / jnp.linalg.norm(p32["w"] - w0["w"]))
    assert rel < 0.15, rel
    leaves = jax.tree.leaves(s8)
    assert any(x.dtype == jnp.int8 for x in leaves) and any(x.dtype == jnp.uint8 for x in leaves)
    assert not any(x.dtype == jnp.float32 and x.size >= 700 * 3 for x in leaves)  # no full-precision moments


def test_unknown_optimizer_and_scheduler_are_named():
    sched = make_schedule("linear", 1e-3, 10, 0)
    with pytest.raises(ValueError, match="adamw_9bit.*adamw_torch"):
        make_optimizer("adamw_9bit", sched)
    with pytest.raises(ValueError, match="polynomial"):
        make_schedule("polynomial", 1e-3, 10, 0)


def test_scale_by_adam_8bit_is_a_gradient_transformation():
    t = scale_by_adam_8bit()
    params = {"x": jnp.ones((3, 300))}
    state = t.init(params)
    upd, _ = t.update({"x": jnp.full((3, 300), 0.5)}, state)
    np.testing.assert_allclose(np.asarray(upd["x"]), 1.0, rtol=2e-2)  # first Adam step: g/|g| = 1
