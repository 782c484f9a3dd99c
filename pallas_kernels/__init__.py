"""pallas_kernels: fused Pallas kernels (Triton lowering on NVIDIA GPUs, interpret mode on CPU).

Each public function is a `jax.custom_vjp` whose forward and backward are `pl.pallas_call`s, with a
plain-jnp twin in `pallas_kernels.reference`.
"""
from pallas_kernels._common import resolve_interpret

__all__ = ["resolve_interpret"]
