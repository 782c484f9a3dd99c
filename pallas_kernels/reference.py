"""Plain-jnp twins of every Pallas kernel: the ground truth in tests and the XLA path in `unsloth_jax.ops`.

Each function here computes exactly what its kernel computes (same signature minus `interpret`), written in
the most direct jnp form so XLA fuses it as it likes. Keep one section per kernel module.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

# ---- rms_norm / rope / glu (owned by pallas_kernels/rms_norm.py, rope.py, glu.py) ----

# ---- lora_linear / cross_entropy (owned by pallas_kernels/lora_linear.py, cross_entropy.py) ----

# ---- flash_attention (owned by pallas_kernels/flash_attention.py) ----

# ---- nf4 (owned by pallas_kernels/nf4.py) ----
