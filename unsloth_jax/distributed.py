"""Several devices: a data x fsdp device mesh, the shardings of the split state and the batch, several hosts.

    initialize()                                        # several hosts: jax.distributed from flags or env
    mesh = make_mesh(data=2, fsdp=4)                    # a jax.sharding.Mesh over jax.devices()
    trainable, frozen, opt_state = shard_state(mesh, (trainable, frozen, opt_state))
    step = make_train_step(graphdef, optimizer, mesh=mesh)      # in/out shardings from the rules below
    batch = global_batch(mesh, local_rows, global_rows)         # [A, B, S], B split over ("data", "fsdp")

Everything else is the compiler's: the step is one jit with in/out shardings, XLA's SPMD partitioner places
the collectives (all-gathers of weights, all-reduces of gradients), jax.distributed joins several hosts.

The rules (`leaf_spec`):
  * the batch [A, B, S]: its rows (axis 1) split over both mesh axes, so every device gets B / (data * fsdp)
    rows; `per_device_train_batch_size` is that number, as in transformers.
  * frozen weights (dense `nnx.Param`, each array of an NF4 `NF4Param`, and any other array leaf, e.g. FP8
    values and scales): split over "fsdp" on their largest axis that fsdp divides, never the stacked layer axis
    (axis 0 of every leaf under `model.layers`), when the leaf holds at least MIN_SHARD_BYTES; else replicated.
    The decoder constrains one layer's slice of the stack to be whole inside its layer scan
    (`unsloth_jax.models.layers.gathered`), so XLA all-gathers one layer's weights at a time, inside the loop
    (and again in the backward pass's recomputation), never the whole model up front.
  * trainable leaves (LoRA factors, `modules_to_save` weights) and the optimizer state: replicated, except
    leaves of at least MIN_TRAINABLE_SHARD_BYTES (embeddings or an lm_head trained in full), split like
    frozen weights. XLA reduces the gradients across the batch shards.
  * metrics: replicated scalars.

Why rules over (path, shape) and not nnx variable metadata (`sharding=` annotations read by
`nnx.get_partition_spec`): the variables are built by the checkpoint loaders and by other modules (NF4 now,
FP8 types later), an `NF4Weight` is a pytree whose arrays (codes [L, nbytes], absmax [L, nblocks], ...) one
annotation per variable cannot describe, and optax's state (the 8-bit state too) carries no annotations. One
rule covers all of them, a new variable type needs no change, and the model need not know the mesh when it is
built.

Several hosts: `initialize()` (coordinator address, process count and id from its arguments, the CLI flags,
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, or a cluster jax detects itself: SLURM, Open
MPI). Every process runs the same program on its own devices; each loads only its rows of the global batch
(`host_rows`, `global_batch`); only process 0 writes logs, metrics and exports (`is_main_process`).
"""
from __future__ import annotations

import logging
import os

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from unsloth_jax.backend import MESH_AXES, key_names
from unsloth_jax.validation import require_int

log = logging.getLogger("unsloth_jax")

# The module whose variables carry a leading layer axis (DecoderModel.layers: L stacked decoder layers).
STACKED = "layers"
MIN_SHARD_BYTES = 4096                # frozen leaves below this stay replicated (scalars, small norms)
MIN_TRAINABLE_SHARD_BYTES = 64 << 20  # trainable leaves (and their optimizer state) below this: replicated
ENV_ADDRESS, ENV_COUNT, ENV_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"


# ------------------------------------------------------------------------------------------------- mesh
def make_mesh(data: int = -1, fsdp: int = 1, *, devices=None) -> Mesh:
    """A ("data", "fsdp") mesh over `devices` (default: every device of every process). -1 for one axis
    means the devices the other leaves; the product must equal the device count. Raises ValueError naming
    the argument at fault."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    sizes = {"data": data, "fsdp": fsdp}
    for name, size in sizes.items():
        if size != -1:
            require_int(name, size, minimum=1)
    if data == -1 and fsdp == -1:
        raise ValueError("make_mesh: at most one of data and fsdp may be -1 (the rest of the devices)")
    for name, other in (("data", "fsdp"), ("fsdp", "data")):
        if sizes[name] == -1:
            if n % sizes[other]:
                raise ValueError(f"make_mesh: {other}={sizes[other]} does not divide the {n} devices")
            sizes[name] = n // sizes[other]
    if sizes["data"] * sizes["fsdp"] != n:
        raise ValueError(f"make_mesh: data={sizes['data']} x fsdp={sizes['fsdp']} = {sizes['data'] * sizes['fsdp']} "
                         f"devices, but {n} are available; make the product {n}, or pass -1 for one of them")
    grid = np.array(devices, dtype=object).reshape(sizes["data"], sizes["fsdp"])
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def parse_mesh(text: str, argument: str = "--mesh") -> dict[str, int]:
    """"data=2,fsdp=4" -> {"data": 2, "fsdp": 4} (either key may be left out; -1 means the rest). Raises
    ValueError naming `argument` and the bad entry."""
    sizes: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in str(text).split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in MESH_AXES:
            raise ValueError(f"{argument}={text!r}: entry {item!r} is not data=N or fsdp=N")
        if key in sizes:
            raise ValueError(f"{argument}={text!r}: {key} is given twice")
        try:
            size = int(value)
        except ValueError:
            raise ValueError(f"{argument}={text!r}: {key}={value.strip()!r} is not an integer") from None
        if size < 1 and size != -1:
            raise ValueError(f"{argument}={text!r}: {key} must be a positive integer or -1, got {size}")
        sizes[key] = size
    if not sizes:
        raise ValueError(f"{argument}={text!r}: give data=N and/or fsdp=N, e.g. data=2,fsdp=4")
    return sizes


def resolve_mesh(mesh, argument: str = "mesh") -> Mesh | None:
    """A Mesh from a Mesh, a dict {"data": n, "fsdp": m}, a string "data=2,fsdp=4", or None (no mesh)."""
    if mesh is None or isinstance(mesh, Mesh):
        if isinstance(mesh, Mesh) and tuple(mesh.axis_names) != MESH_AXES:
            raise ValueError(f"{argument}: the mesh's axes must be {MESH_AXES}, got {tuple(mesh.axis_names)}; "
                             "build it with unsloth_jax.distributed.make_mesh")
        return mesh
    if isinstance(mesh, str):
        mesh = parse_mesh(mesh, argument)
    if isinstance(mesh, dict):
        unknown = set(mesh) - set(MESH_AXES)
        if unknown:
            raise ValueError(f"{argument}: unknown mesh axes {sorted(unknown)}; use {MESH_AXES}")
        return make_mesh(**mesh)
    raise TypeError(f"{argument} must be a jax.sharding.Mesh, a dict or a string like 'data=2,fsdp=4', got "
                    f"{type(mesh).__name__}")


def batch_shards(mesh: Mesh) -> int:
    """How many ways the batch is split: data * fsdp."""
    return int(np.prod([mesh.shape[a] for a in MESH_AXES]))


def describe(mesh: Mesh | None) -> str:
    """'data=2 x fsdp=4 (8 devices, 1 process)' or 'single device'."""
    if mesh is None:
        return "single device"
    procs = len({d.process_index for d in mesh.devices.flat})
    return (f"data={mesh.shape['data']} x fsdp={mesh.shape['fsdp']} ({mesh.devices.size} "
            f"{mesh.devices.flat[0].platform} devices, {procs} process{'es' if procs > 1 else ''})")


# ---------------------------------------------------------------------------------------------- hosts
def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Join several processes into one jax runtime (`jax.distributed.initialize`) before any jax computation.

    The arguments, else JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, else a cluster jax
    detects by itself (SLURM, Open MPI); with none of these (one process), nothing happens. Returns whether
    the runtime was initialized. On the CPU it selects the gloo collectives that multi-process CPU runs need."""
    address = coordinator_address or os.environ.get(ENV_ADDRESS)
    count = num_processes if num_processes is not None else _env_int(ENV_COUNT)
    index = process_id if process_id is not None else _env_int(ENV_ID)
    cluster = any(k in os.environ for k in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"))
    if address is None and count is None and index is None and not cluster:
        return False
    if not cluster and None in (address, count, index):
        missing = [n for n, v in (("coordinator_address", address), ("num_processes", count),
                                  ("process_id", index)) if v is None]
        raise ValueError(f"several processes need coordinator_address, num_processes and process_id (or "
                         f"{ENV_ADDRESS}, {ENV_COUNT}, {ENV_ID}); missing: {', '.join(missing)}")
    if count is not None:
        require_int("num_processes", count, minimum=1)
    if index is not None and count is not None:
        require_int("process_id", index, minimum=0, maximum=count - 1)
    if hasattr(jax.config, "jax_cpu_collectives_implementation"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=address, num_processes=count, process_id=index)
    log.info("unsloth_jax: process %d of %d, %d local device(s)", jax.process_index(), jax.process_count(),
             jax.local_device_count())
    return True


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def is_main_process() -> bool:
    """True on process 0 (the one that writes logs, metrics, checkpoints' metadata and exports)."""
    return jax.process_index() == 0


def sync(name: str) -> None:
    """Wait until every process got here (no-op with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


# ------------------------------------------------------------------------------------------ shardings
def leaf_spec(path, shape, itemsize: int, fsdp: int, min_bytes: int) -> P:
    """The PartitionSpec of one state leaf: its largest axis that `fsdp` divides (not the stacked layer axis
    of leaves under `layers`) split over "fsdp", when the leaf holds at least `min_bytes`; else replicated."""
    shape = tuple(shape)
    if fsdp == 1 or int(np.prod(shape, dtype=np.int64)) * itemsize < min_bytes:
        return P()
    first = 1 if STACKED in key_names(path) else 0
    axes = [a for a in range(first, len(shape)) if shape[a] % fsdp == 0]
    if not axes:
        return P()
    axis = max(axes, key=lambda a: shape[a])  # the first of equally large axes
    return P(*(("fsdp" if a == axis else None) for a in range(len(shape))))


def state_shardings(mesh: Mesh, tree, *, trainable: bool = False):
    """NamedShardings for every array leaf of `tree` (an nnx.State, an optax state, any pytree), by
    `leaf_spec` with MIN_TRAINABLE_SHARD_BYTES for trainable leaves and their optimizer state, MIN_SHARD_BYTES
    for frozen ones."""
    fsdp = mesh.shape["fsdp"]
    min_bytes = MIN_TRAINABLE_SHARD_BYTES if trainable else MIN_SHARD_BYTES

    def one(path, leaf):
        shape = np.shape(leaf)
        itemsize = np.dtype(leaf.dtype).itemsize if hasattr(leaf, "dtype") else 4
        return NamedSharding(mesh, leaf_spec(path, shape, itemsize, fsdp, min_bytes))

    return jax.tree_util.tree_map_with_path(one, tree)


def batch_sharding(mesh: Mesh, ndim: int = 3, axis: int = 1) -> NamedSharding:
    """The batch's sharding: axis `axis` (the rows of [A, B, S]) split over ("data", "fsdp")."""
    return NamedSharding(mesh, P(*((MESH_AXES if a == axis else None) for a in range(ndim))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def put(tree, shardings):
    """`tree`'s arrays placed with `shardings` (a matching pytree). Every process passes the same values (a
    model loaded on each host); on several hosts each one transfers only the shards of its own devices."""
    def one(x, sharding):
        if isinstance(x, jax.ShapeDtypeStruct) or (isinstance(x, jax.Array) and
                                                   x.sharding.is_equivalent_to(sharding, x.ndim)):
            return x  # already there (or only a shape, for lowering)
        if sharding.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
            return jax.device_put(x, sharding)  # one process, or a global array changing its layout
        return jax.make_array_from_callback(np.shape(x), sharding, lambda index: x[index])

    return jax.tree.map(one, tree, shardings)


def shard_state(mesh: Mesh, states: tuple):
    """(trainable, frozen, opt_state) placed on the mesh by the rules (see the module docstring)."""
    trainable, frozen, opt_state = states
    return (put(trainable, state_shardings(mesh, trainable, trainable=True)),
            put(frozen, state_shardings(mesh, frozen)),
            put(opt_state, state_shardings(mesh, opt_state, trainable=True)))


# ---------------------------------------------------------------------------------------------- batch
def host_rows(mesh: Mesh, global_rows: int) -> slice:
    """The rows of a [A, global_rows, S] batch that this process's devices hold (one contiguous range)."""
    shards = batch_shards(mesh)
    if global_rows % shards:
        raise ValueError(f"the global batch of {global_rows} rows does not split over the {shards} devices of "
                         f"the mesh ({describe(mesh)})")
    index_map = batch_sharding(mesh).addressable_devices_indices_map((1, global_rows, 1))
    spans = sorted({(ix[1].start or 0, global_rows if ix[1].stop is None else ix[1].stop)
                    for ix in index_map.values()})
    start, stop = spans[0][0], spans[-1][1]
    if sum(b - a for a, b in spans) != stop - start:
        raise ValueError(f"process {jax.process_index()} holds non-contiguous batch rows {spans}; build the mesh "
                         "with make_mesh over jax.devices() (ordered by process)")
    return slice(start, stop)


def global_batch(mesh: Mesh, local: dict, global_rows: int) -> dict:
    """One global [A, global_rows, S] batch from this process's rows (`host_rows`) of it: numpy int arrays
    [A, rows, S] -> jax.Arrays split over the mesh (`jax.make_array_from_process_local_data`)."""
    sharding = batch_sharding(mesh)
    out = {}
    for key, rows in local.items():
        shape = (rows.shape[0], global_rows) + rows.shape[2:]
        out[key] = jax.make_array_from_process_local_data(sharding, rows, shape)
    return out


# --------------------------------------------------------------------------------------------- memory
def compiled_memory_per_device(compiled) -> int | None:
    """Bytes one device needs for a compiled program (`compiled.memory_analysis()`): arguments + outputs +
    temporaries - donated (aliased) buffers. None where the backend does not report it."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        return None
    if m is None:
        return None
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


__all__ = ["make_mesh", "parse_mesh", "resolve_mesh", "describe", "batch_shards", "initialize", "is_main_process",
           "sync", "leaf_spec", "state_shardings", "batch_sharding", "replicated", "put", "shard_state", "host_rows",
           "global_batch", "compiled_memory_per_device", "MIN_SHARD_BYTES", "MIN_TRAINABLE_SHARD_BYTES"]
