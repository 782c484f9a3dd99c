"""The gated MLP of one decoder layer: down_proj(act(gate_proj(x)) * up_proj(x)) (SwiGLU / GEGLU)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from unsloth_jax import ops
from unsloth_jax.config import ModelConfig
from unsloth_jax.models.layers import Linear


class MLP(nnx.Module):
    """Gated MLP; `activation` is "silu" (SwiGLU), "gelu" or "gelu_tanh" (GEGLU) from the config."""

    def __init__(self, cfg: ModelConfig, *, stack: tuple[int, ...] = (), dtype=jnp.float32, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        common = dict(use_bias=cfg.mlp_bias, stack=stack, dtype=dtype, rngs=rngs)
        self.activation = cfg.activation
        self.gate_proj = Linear(d, f, **common)
        self.up_proj = Linear(d, f, **common)
        self.down_proj = Linear(f, d, **common)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., D] -> [..., D]."""
        return self.down_proj(ops.glu(self.gate_proj(x), self.up_proj(x), self.activation))
