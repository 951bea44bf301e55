"""Fits over a mesh of several processes' devices (``jax.distributed``): each process holds
its own rows of the data, and every process runs the same fit.

After ``jax.distributed.initialize(...)`` in every process, ``jax.devices()`` lists all
processes' devices and a mesh over them is a mesh like another for
:mod:`blrppl.engine.sharding`: the chunk is compiled by ``jax.jit`` over it (XLA's CPU
collectives, gloo on a CPU, carry the all-reduces between processes). What differs is where
the data come from and how the host reads what a chunk returns:

- **The data** a process passes to the fit are its own rows: every array with a plate axis
  holds this process's entries of it, every other array (hyperparameters, a design of the
  global effects) the same values in every process. The global arrays are built with
  ``jax.make_array_from_process_local_data``, each process's rows on its own devices of the
  mesh; the global plate holds all processes' rows, in the order of the processes in the
  mesh. Processes may hold different numbers of rows: each pads its rows to a common count,
  and the padded rows are removed once, when the data are placed (:func:`place_rows`).
- **The model** reads its plate's size off its data (``numpyro.plate("n", X.shape[0])``):
  the fit's plan is made from the process's own rows (no process sees the others'), and its
  chunk runs on the global arrays, where the same expression gives the global size.
- **Data statistics** (the ``XᵀX`` of Normal factors) are computed again from the global
  arrays, by one program over the mesh.
- **The host reads** of a chunk's outputs (the ELBO, the stopping flags, the state between
  chunks) take the process's own copy of each replicated output
  (:func:`local_values`); the state goes back onto the mesh as the same value in every
  process (:func:`replicated`). The first state is process 0's, sent to the others
  (:func:`same_start`): every process then steps the same state and stops at the same step.

The rows a process holds are those of the model's largest plate; its other plates (groups,
with a group index per row) are the same in every process, and their latents are global
blocks, replicated. The diagnostics that read the data (PSIS k̂'s log-weights, the narrow-q
check) run over the mesh too (:meth:`blrppl.engine.sharding.ShardedChunk.diagnostic`).

What a fit over several processes refuses (:func:`check_processes`): blocks with one entry
per datum (local latents, enumerated assignments; their starting values would be those of
this process's rows), subsampled plates (their plate's size is declared, not read off the
data) and a mesh whose devices are not grouped by process; ``blr_fit`` refuses mixture
families and grids over several processes, and does not run its refinement there.
"""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from blrppl.errors import MeshError


def spans_processes(mesh) -> bool:
    """Whether ``mesh`` holds devices of more than one process."""
    return len({d.process_index for d in mesh.devices.flat}) > 1


def check_mesh(mesh) -> None:
    """Refuse a mesh over several processes that this process cannot run its share of.

    Raises:
        MeshError: the mesh holds none of this process's devices, its devices are not grouped
            by process (each process's devices one after another), or processes hold different
            numbers of its devices.
    """
    owners = [d.process_index for d in mesh.devices.flat]
    if jax.process_index() not in owners:
        raise MeshError(
            f"mesh= holds no device of this process (process {jax.process_index()}): every process of a fit "
            "over several processes runs its share on its own devices; build the mesh from jax.devices() "
            "in every process"
        )
    runs = [p for i, p in enumerate(owners) if i == 0 or owners[i - 1] != p]
    counts = {p: owners.count(p) for p in runs}
    if len(runs) != len(set(runs)) or len(set(counts.values())) != 1:
        raise MeshError(
            "mesh= over several processes must list each process's devices one after another, as many for "
            f"each (its devices belong to processes {owners}): build it as "
            "jax.sharding.Mesh(np.array(jax.devices()), ('data',))"
        )


def check_processes(plan, records, mesh, blocks) -> None:
    """Refuse what a fit over several processes does not support (module docstring).

    Args:
        plan: the fit's plan.
        records: its site records.
        mesh: the mesh (over several processes).
        blocks: the names of the blocks split along a plate (one entry per datum).

    Raises:
        MeshError: a block with one entry per datum, a discrete block or a subsampled plate.
    """
    check_mesh(mesh)
    if plan.subsampled:
        raise MeshError(
            "mesh= over several processes does not run minibatch fits (numpyro.plate(..., subsample_size=)) "
            "yet: fit the full plate, each process with its own rows"
        )
    local = sorted(b.name for b in plan.blocks if b.name in blocks or b.discrete)
    if local:
        raise MeshError(
            f"mesh= over several processes fits global latents only, and blocks {local} have one entry per "
            "datum or are enumerated: fit them on one process's devices (mesh= of jax.local_devices())"
        )


def row_counts(n: int) -> np.ndarray:
    """Every process's row count of one plate (this one's ``n``), in process order."""
    return np.asarray(multihost_utils.process_allgather(np.asarray([n], np.int64))).reshape(-1)


def _process_order(mesh) -> list:
    owners = [d.process_index for d in mesh.devices.flat]
    return [p for i, p in enumerate(owners) if i == 0 or owners[i - 1] != p]


def place_rows(x, axis: int, mesh, name: str):
    """``(global array, global rows)``: this process's rows ``x`` (its entries along ``axis``)
    as one global array split over ``mesh`` along ``name``, every process's rows in the
    order of the processes in the mesh, its plate axis padded at its end to a multiple of
    the device count (the program slices the first ``global rows`` entries out, as on one
    process).

    Raises:
        MeshError: this process or another holds no rows.
    """
    counts = row_counts(x.shape[axis])
    if np.any(counts == 0):
        raise MeshError(
            f"every process of a fit over several processes must hold rows of the data; processes hold {counts.tolist()}"
        )
    order = _process_order(mesh)
    per = mesh.size // len(order)  # (each process's devices in the mesh)
    width = int(-(-counts.max() // per) * per)  # (rows per process, padded)
    x = np.asarray(x)
    pad = width - x.shape[axis]
    if pad:
        x = np.pad(x, [(0, pad if a == axis else 0) for a in range(x.ndim)], mode="edge")
    spec = PartitionSpec(*([None] * axis + [name]))
    sharding = NamedSharding(mesh, spec)
    shape = x.shape[:axis] + (width * len(order),) + x.shape[axis + 1 :]
    padded = jax.make_array_from_process_local_data(sharding, x, shape)
    total = int(counts.sum())
    if np.all(counts == width):
        return padded, total
    # each process's padding removed once: the rows taken in order, padded at the end only
    rows = np.concatenate([np.arange(k * width, k * width + counts[p]) for k, p in enumerate(order)])
    rows = np.concatenate([rows, np.full(-total % mesh.size, rows[-1])])
    compact = jax.jit(lambda a: jnp.take(a, rows, axis=axis), out_shardings=sharding)(padded)
    return compact, total


def replicated(tree, sharding):
    """``tree``'s arrays as global arrays replicated over the mesh of ``sharding``, from the
    same value in every process."""

    def one(x):
        if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
            data = replicated(jax.random.key_data(x), sharding)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        return jax.make_array_from_process_local_data(sharding, np.asarray(x))

    return jax.tree.map(one, tree)


def local_values(tree):
    """A chunk's replicated outputs as arrays on one of this process's devices (its copy)."""

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return x.addressable_data(0)
        return x

    return jax.tree.map(one, tree)


def same_start(state):
    """Process 0's ``state`` in every process (a fit's start, before its first chunk): the
    processes then step one state. Raises nothing; a process whose own start differed (other
    keys or starting values) runs process 0's."""
    keys = [i for i, x in enumerate(jax.tree.leaves(state)) if _is_key(x)]
    leaves, tree = jax.tree.flatten(state)
    raw = [jax.random.key_data(x) if i in keys else x for i, x in enumerate(leaves)]
    raw = multihost_utils.broadcast_one_to_all([np.asarray(x) for x in raw])
    out = [
        jax.random.wrap_key_data(jnp.asarray(r), impl=jax.random.key_impl(x)) if i in keys else jnp.asarray(r, x.dtype)
        for i, (r, x) in enumerate(zip(raw, leaves))
    ]
    return jax.tree.unflatten(tree, out)


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def check_same(leaves) -> None:
    """Refuse arrays without a plate axis (given whole to every process) that differ between
    processes.

    Raises:
        MeshError: they differ (each process's digest of them is compared).
    """
    h = hashlib.sha256()
    for x in leaves:
        x = np.ascontiguousarray(np.asarray(x))
        h.update(str((x.shape, x.dtype)).encode())
        h.update(x.tobytes())
    if not _agree(h.digest()):
        raise MeshError(
            "in a fit over several processes, the data arrays without a plate axis (hyperparameters, a design "
            "of the global effects) must be the same in every process, and they differ: pass each process "
            "the same values, and only its own rows of the arrays along the plate"
        )


def _agree(digest: bytes) -> bool:
    """Whether every process computed the same ``digest`` (one all-gather)."""
    mine = np.frombuffer(digest, np.uint8)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, mine.size)
    return bool(np.all(every == every[0]))


def check_layout(axes) -> None:
    """Refuse data whose arrays split along the plate differ between processes (which would
    leave the processes waiting for each other's collectives).

    Args:
        axes: per data array, its plate axis (None: no plate axis) in this process.

    Raises:
        MeshError: another process found other plate axes in its data.
    """
    if not _agree(hashlib.sha256(repr(tuple(axes)).encode()).digest()):
        raise MeshError(
            f"in a fit over several processes every process must pass the same arrays, split along the same plate "
            f"axis; this process's arrays have plate axes {list(axes)} (None: no plate axis) and another's differ: "
            "give every process at least as many rows as the mesh has devices, in arrays of the same shapes but "
            "for their number of rows"
        )


def trace_error(exc: Exception) -> MeshError:
    """The error for a chunk that does not trace on the global arrays: the model's plate
    size is not read off its data."""
    return MeshError(
        "the fit over several processes runs the model on the global arrays (every process's rows), and the "
        f"model does not trace on them ({type(exc).__name__}: {str(exc)[:300]}): read each plate's size "
        "off the data (numpyro.plate('n', X.shape[0])), not from a number given with this process's rows"
    )
