"""The JAX the project uses beyond its documented API, checked on the installed jax (imports jax and
unsloth_jax.backend only, so it also runs where flax is absent). Each failure names what is missing and who needs it."""
from __future__ import annotations

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np

from unsloth_jax.backend import is_tracer, vjp_closure


def test_vjp_closure_holds_the_residuals():
    """backend.vjp_closure: the function jax.vjp returns is a pytree whose leaves are its inputs and residuals,
    rebuilt by unflatten; models/offload.py's "offload_attention" scan carries the residuals through its scan."""
    policy = jax.checkpoint_policies.save_only_these_names("kept")

    def f(x, w):
        y = jax.ad_checkpoint.checkpoint_name(jnp.sin(x * w), "kept")
        return jnp.cos(y) * w

    x = jnp.asarray(np.random.default_rng().standard_normal(7), jnp.float32)
    w = jnp.asarray(np.random.default_rng().standard_normal(7), jnp.float32)

    @jax.jit
    def grads(x, w):
        out, vjp = jax.vjp(jax.checkpoint(f, policy=policy), x, w)
        leaves, tree = vjp_closure(vjp)
        inputs = {id(x), id(w)}
        residuals = [a for a in leaves if id(a) not in inputs and is_tracer(a)]
        assert residuals and all(a.shape == (7,) for a in residuals), (
            f"jax {jax.__version__}: the function jax.vjp returns no longer flattens to its residuals "
            f"(leaves {[getattr(a, 'shape', a) for a in leaves]}); backend.vjp_closure needs another way to "
            "reach them, or models/offload.py's offload_attention scan another design")
        rebuilt = jax.tree.unflatten(tree, leaves)
        return rebuilt(jnp.ones_like(out))

    gx, gw = grads(x, w)
    want = jax.grad(lambda x, w: f(x, w).sum(), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(gx, want[0], rtol=1e-6)
    np.testing.assert_allclose(gw, want[1], rtol=1e-6)


def test_is_tracer():
    """backend.is_tracer: tells a trace's values from constants (models/offload.py, the VJP closure's leaves)."""
    assert hasattr(jax.core, "Tracer"), (
        f"jax {jax.__version__} has no jax.core.Tracer; backend.is_tracer needs another test for a traced value")
    seen = []
    concrete = jnp.ones(2)
    jax.jit(lambda x: seen.append((is_tracer(x), is_tracer(np.ones(2)), is_tracer(concrete))) or x)(1.0)
    assert seen == [(True, False, False)]


def test_offload_policy_outcomes_are_public():
    """models/layer_stack.py's OffloadWithAttention policy returns jax.ad_checkpoint.Offloadable / Recompute."""
    missing = [n for n in ("Offloadable", "Recompute") if not hasattr(jax.ad_checkpoint, n)]
    assert not missing, (f"jax {jax.__version__}: jax.ad_checkpoint lacks {missing}, which the offload_attention "
                         "remat policy (models/layer_stack.py, OffloadWithAttention) returns")
    assert jax.ad_checkpoint.Offloadable(src="device", dst="pinned_host").dst == "pinned_host"


def test_no_private_jax_in_the_packages():
    """jax._src is private (it changes without notice between releases): nothing in the packages uses it; a use
    JAX has no public API for goes in unsloth_jax/backend.py, checked above."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    uses = [f"{f.relative_to(root)}:{k}" for pkg in ("unsloth_jax", "pallas_kernels", "bench")
            for f in sorted((root / pkg).rglob("*.py"))
            for k, line in enumerate(f.read_text().splitlines(), 1) if "jax._src" in line or "jaxlib._" in line]
    assert not uses, f"private jax modules used at {uses}"
