"""XLA's temporaries for the gradient of L checkpointed layers run as a lax.scan, an unrolled scan and a Python
loop (plain JAX, no project code): does per-layer remat bound memory in straight-line code?

    python bench/remat_unroll_probe.py      # one JSON line per variant (CPU or GPU, whichever jax has)
"""
import json

import jax
import jax.numpy as jnp

LAYERS, TOKENS, HIDDEN, INTERMEDIATE = 8, 2048, 256, 1024


def layer(h, w):
    """A tanh MLP with a residual: h [T, D], w = ([D, F], [F, F]) -> ([T, D], None)."""
    a = jnp.tanh(h @ w[0])
    b = jnp.tanh(a @ w[1])
    return h + 0.1 * (b @ w[0].T), None


def main() -> None:
    ws = (jnp.full((LAYERS, HIDDEN, INTERMEDIATE), 0.01), jnp.full((LAYERS, INTERMEDIATE, INTERMEDIATE), 0.01))
    x = jnp.ones((TOKENS, HIDDEN))
    for prevent_cse in (False, True):
        body = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=prevent_cse)
        loops = {
            "scan": lambda ws: jax.lax.scan(body, x, ws)[0],
            "scan_unrolled": lambda ws: jax.lax.scan(body, x, ws, unroll=True)[0],
            "python_loop": lambda ws: _python_loop(body, x, ws),
        }
        for name, run in loops.items():
            compiled = jax.jit(jax.grad(lambda ws: jnp.sum(run(ws) ** 2))).lower(ws).compile()
            temp = compiled.memory_analysis().temp_size_in_bytes / 2 ** 20
            print(json.dumps({"loop": name, "prevent_cse": prevent_cse, "temp_mib": round(temp, 1),
                              "backend": jax.default_backend(), "jax": jax.__version__}))


def _python_loop(body, x, ws):
    h = x
    for i in range(LAYERS):
        h, _ = body(h, jax.tree.map(lambda a: a[i], ws))
    return h


if __name__ == "__main__":
    main()
