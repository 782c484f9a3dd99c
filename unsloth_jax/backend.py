"""Facts about the JAX backend the project runs on: bf16 support, the compute dtype, device memory, the mesh.

Lower layers (checkpoint I/O, models, training) and the API all use these; this module imports only jax.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from unsloth_jax.errors import ConfigError

DTYPE_NAMES = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "float16": jnp.float16, "fp16": jnp.float16,
               "float32": jnp.float32, "fp32": jnp.float32}
COMPUTE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def is_bfloat16_supported() -> bool:
    """True on GPUs of compute capability 8.0 or newer (and TPUs); False on the CPU."""
    dev = jax.devices()[0]
    if dev.platform == "tpu":
        return True
    if dev.platform != "gpu":
        return False
    cc = getattr(dev, "compute_capability", None)
    try:
        return cc is None or float(cc) >= 8.0
    except (TypeError, ValueError):
        return True


def resolve_dtype(dtype, argument: str = "dtype") -> jnp.dtype:
    """None -> bf16 where supported else fp32; accepts names ("bfloat16", "float16", "float32") and jnp dtypes.

    Raises ConfigError naming `argument` for anything else."""
    if dtype is None:
        return jnp.dtype(jnp.bfloat16 if is_bfloat16_supported() else jnp.float32)
    if isinstance(dtype, str):
        if dtype not in DTYPE_NAMES:
            raise ConfigError(f"{argument}={dtype!r} is not supported; use one of {', '.join(sorted(DTYPE_NAMES))} "
                              "or None")
        return jnp.dtype(DTYPE_NAMES[dtype])
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise ConfigError(f"{argument}={dtype!r} is not a dtype; use bfloat16, float16, float32 or None") from None
    if dt not in COMPUTE_DTYPES:
        raise ConfigError(f"{argument}={dt} is not supported; use bfloat16, float16 or float32")
    return dt


def device_memory_gib(kind: str = "bytes_in_use") -> float | None:
    """`kind` ("bytes_in_use" or "peak_bytes_in_use") of the first device in GiB; None where not reported."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        return None
    used = stats.get(kind)
    return None if used is None else used / 2**30


def device_memory_limit() -> int | None:
    """Bytes the first device's allocator may use (memory_stats' bytes_limit); None where not reported (CPU)."""
    try:
        return (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        return None


def host_memory_limit() -> int | None:
    """Bytes of this machine's physical memory (the ceiling for pinned host buffers); None where unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


# The axes of the device mesh (unsloth_jax.distributed.make_mesh): the batch is split over both, frozen
# weights over "fsdp". Named here so that ops and models can read the mesh in context without importing
# the distributed module above them.
MESH_AXES = ("data", "fsdp")


def mesh_batch_axes() -> tuple[str, ...]:
    """The axes of the mesh in context (`jax.set_mesh`) that split the batch (those of MESH_AXES it has), when
    together they split it in more than one part; () otherwise (no mesh, or one device)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    axes = tuple(a for a in MESH_AXES if a in mesh.axis_names)
    parts = 1
    for a in axes:
        parts *= mesh.shape[a]
    return axes if parts > 1 else ()


# JAX used beyond its documented API: each such use is one function here, and tests/test_jax_compat.py checks it
# on the installed jax (0.10.2 and 0.11.2 have it), so a jax without it fails there with the reason.
def vjp_closure(vjp) -> tuple[list, object]:
    """(leaves, treedef) of a function `jax.vjp` returned: the values it closes over (the primal inputs it keeps
    and the residuals), rebuilt by `jax.tree.unflatten(treedef, leaves)`. jax documents no way to hand out a
    VJP's residuals; jax 0.10 and 0.11 register the returned VJP object as a pytree of exactly those values.
    models/offload.py's "offload_attention" scan needs them as values to carry through its own scan."""
    return jax.tree.flatten(vjp)


def is_tracer(x) -> bool:
    """Whether `x` is a value of a trace being built (a tracer), not a constant. `jax.core.Tracer` is public in
    jax 0.10 and 0.11, but jax.core is being emptied (most of its names are deprecated)."""
    return isinstance(x, jax.core.Tracer)


def commit_to_devices(tree):
    """The same arrays, committed to the sharding they already have. jax.jit keys its compiled programs on
    whether each argument is committed: a train step's outputs come back committed (and a step with host
    offload needs committed inputs to keep one compilation), so the trainers commit their state from the start,
    and the generation engine commits the model state it reads, which is otherwise a mix of the loader's
    uncommitted arrays and the trainer's committed ones (after training, every engine program compiled again)."""
    return jax.tree.map(lambda a: jax.device_put(a, a.sharding) if isinstance(a, jax.Array) else a, tree)


def key_names(path) -> tuple[str, ...]:
    """A pytree key path (dict keys, nnx attribute names, sequence indices) as strings, e.g. ("model", "layers",
    "self_attn", "q_proj", "kernel", "value")."""
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
