"""The gated MLP of one decoder layer: down_proj(act(gate_proj(x)) * up_proj(x)) (SwiGLU / GEGLU).

Long sequences run the MLP in sequence tiles: when a call holds more than `chunk_tokens` tokens, the tokens are
split into tiles of `chunk_tokens` and a `lax.scan` runs the MLP on one tile at a time under `jax.checkpoint`,
so the [tokens, intermediate] gate/up/activation tensors (and their gradients) exist for one tile only. The
result is the same function; only the order of the work changes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from unsloth_jax import ops
from unsloth_jax.config import ModelConfig
from unsloth_jax.models.layers import Linear, value_of

DEFAULT_CHUNK_TOKENS = 8192


class MLP(nnx.Module):
    """Gated MLP; `activation` is "silu" (SwiGLU), "gelu" or "gelu_tanh" (GEGLU) from the config.
    `chunk_tokens` (static): tile size of the sequence tiling above (None: never tile). wide: twice
    intermediate_size (Gemma 4's double-wide MLP of its KV-shared layers)."""

    def __init__(self, cfg: ModelConfig, *, stack: tuple[int, ...] = (), dtype=jnp.float32, rngs: nnx.Rngs,
                 chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS, wide: bool = False):
        d, f = cfg.hidden_size, cfg.intermediate_size * (2 if wide else 1)
        common = dict(use_bias=cfg.mlp_bias, stack=stack, dtype=dtype, rngs=rngs)
        self.activation = cfg.activation
        self.chunk_tokens = chunk_tokens
        self.gate_proj = Linear(d, f, **common)
        self.up_proj = Linear(d, f, **common)
        self.down_proj = Linear(f, d, **common)

    def _dense(self, x: jax.Array) -> jax.Array:
        down = self.down_proj
        return ops.glu_linear(self.gate_proj(x), self.up_proj(x), self.activation, value_of(down.kernel),
                              value_of(down.bias), down.lora_factors(), kernel_grad=down.train_kernel)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., D] -> [..., D]."""
        chunk = self.chunk_tokens
        tokens = x.size // x.shape[-1]
        if chunk is None or tokens <= chunk:
            return self._dense(x)
        flat = x.reshape(tokens, x.shape[-1])
        n = -(-tokens // chunk)
        flat = jnp.pad(flat, ((0, n * chunk - tokens), (0, 0)))  # padded rows are computed and dropped
        tile = jax.checkpoint(self._dense, policy=jax.checkpoint_policies.nothing_saveable)
        out = jax.lax.map(tile, flat.reshape(n, chunk, x.shape[-1]))
        return out.reshape(n * chunk, -1)[:tokens].reshape(x.shape)
