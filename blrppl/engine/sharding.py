"""Fits over a device mesh (``blr_fit(..., mesh=...)``, ``BLR(..., mesh=...)``): the fit's
chunk of steps compiled once more as one SPMD program over the mesh's devices.

The compiled fit (:mod:`blrppl.engine.build`) is the same as on one device; what changes is
where its arrays live. Each array of the model's data is split along its plate axis over the
mesh's one axis (``NamedSharding(mesh, P(axis))``), and so are the natural parameters of
the blocks whose latents sit in a plate (local latents, enumerated assignments: one entry
per datum); everything else (global blocks, step sizes, the ELBO, data statistics) is
replicated. The chunk is then compiled by ``jax.jit`` with these shardings (GSPMD): XLA
partitions every per-datum computation and inserts the all-reduce that sums each global
message and the ELBO over the devices, inside the one compiled loop. The stopping test reads
that summed ELBO, a replicated value, so every device stops at the same step.

A plate whose size N does not divide the device count is padded: its data arrays are placed
with their plate axis padded to the next multiple (edge values repeated), and the program
slices the first N entries back out before its first step. Inside the program the arrays
have their true size and XLA's partitioner masks the padded tail of the last devices' blocks
out of every sum; the model, its plan and its plate sizes are untouched, so the sharded fit
is the one-device fit up to the order of its sums.

Which axis of an array is its plate axis is read off its shape: the axis whose length is
the largest plate size of the model (of the block's own plates, for natural parameters).
Plates of fewer elements than devices (a mixture's components) are not split: their
arrays and blocks are replicated.
Under ``jit`` with shardings any placement gives the same numbers, so a misread axis costs
communication, never correctness.

The state crosses chunk boundaries replicated and is handed back on the default device
(every :data:`blrppl.engine.build.CHUNK_SIZE` steps: one copy, not one per step), so the
rest of the fit (the stopping loop on the host, the posterior's export, the diagnostics)
runs as on one device.
"""

from __future__ import annotations

import jax
import numpy as np
import numpyro
from jax.sharding import NamedSharding, PartitionSpec

from blrppl.engine import processes
from blrppl.errors import MeshError
from blrppl.graph.data import RunData, split_run_data
from blrppl.runtime.compile import compile_lowered, compiler_options, lower


def plate_sizes(records) -> frozenset:
    """The sizes of the model's plates (full sizes for subsampled ones)."""
    return frozenset(int(p.size) for r in records.values() for p in r.plates)


def check_plated(records, mesh) -> None:
    """Refuse ``mesh=`` for a model with no plate (nothing to shard along).

    Raises:
        MeshError: no site sits in a ``numpyro.plate`` of more than one element.
    """
    if not any(n > 1 for n in plate_sizes(records)):
        raise MeshError(
            f"mesh= ({mesh.size} devices) shards the data along its plates, and this model declares none: "
            "put the data's sites in a numpyro.plate, or fit without mesh="
        )


def plate_axis(shape, sizes) -> int | None:
    """The axis of ``shape`` read as its plate axis: the first axis holding the largest of
    ``sizes`` found in it (None: no plate axis, the array is replicated)."""
    best = None
    for axis, n in enumerate(shape):
        if n > 1 and n in sizes and (best is None or n > shape[best]):
            best = axis
    return best


def block_axes(plan, records) -> dict:
    """Block name → the plate sizes of its latents (blocks outside every plate left out)."""
    out = {}
    for b in plan.blocks:
        sizes = frozenset(int(p.size) for s in b.sites if s in records for p in records[s].plates)
        if sizes:
            out[b.name] = sizes
    return out


def _spec(axis: int | None, name: str) -> PartitionSpec:
    return PartitionSpec() if axis is None else PartitionSpec(*([None] * axis + [name]))


class ShardedChunk:
    """The programs of a compiled fit's chunk over a mesh (module docstring), kept on the
    compiled fit; each fit runs them through its own :class:`MeshChunk`.

    Args:
        chunk_fn: the chunk before compilation (``CompiledFit.chunk_fn``).
        mesh: a ``jax.sharding.Mesh`` of one axis.
        plan: the fit's plan.
        records: its site records (for the plate sizes).
        options: the XLA options of the compiled fit's chunk (None: by the data's size,
            :func:`blrppl.runtime.compile.compiler_options`).
        statistics: model data → the data statistics of the plan's factors
            (``CompiledFit.statistics``), computed again over the mesh from the global data
            when the mesh spans several processes (:mod:`blrppl.engine.processes`).

    Raises:
        MeshError: a mesh over several processes for a plan it cannot run
            (:func:`blrppl.engine.processes.check_processes`).
    """

    def __init__(self, chunk_fn, mesh, plan, records, options=None, statistics=None):
        self.chunk_fn = chunk_fn
        self.statistics = statistics
        self.options = options
        self.mesh = mesh
        self.axis = mesh.axis_names[0]
        # (a plate of fewer elements than devices, a mixture's components, is not split)
        self.sizes = frozenset(n for n in plate_sizes(records) if n >= mesh.size)
        self.processes = processes.spans_processes(mesh)
        if self.processes:
            # (the rows each process holds are those of its largest plate, split even when they are
            # fewer than the devices; the model's other plates, its groups, are the same in every
            # process and replicated, as are their latents)
            self.sizes = frozenset({max(plate_sizes(records))})
        self.blocks = {b: s & self.sizes for b, s in block_axes(plan, records).items() if s & self.sizes}
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self._compiled: dict = {}
        self._diagnostics: dict = {}
        if self.processes:
            processes.check_processes(plan, records, mesh, self.blocks)

    def place(self, data) -> tuple:
        """``(placed data, plate axes)``: the model's data leaves on the mesh, each split along
        its plate axis (padded to a multiple of the device count), previous posteriors and
        statistics replicated. Over several processes, ``data`` are this process's rows
        (:mod:`blrppl.engine.processes`)."""
        if self.processes:
            return self._place_rows(data)
        model_data, previous, statistics = split_run_data(data)
        leaves, tree = jax.tree.flatten(model_data)
        axes, placed = [], []
        for x in leaves:
            x = np.asarray(x)
            axis = plate_axis(x.shape, self.sizes)
            axes.append(None if axis is None else (axis, x.shape[axis]))
            if axis is not None:
                pad = -x.shape[axis] % self.mesh.size
                if pad:
                    widths = [(0, pad if a == axis else 0) for a in range(x.ndim)]
                    x = np.pad(x, widths, mode="edge")
            placed.append(jax.device_put(x, NamedSharding(self.mesh, _spec(axis, self.axis))))
        model_data = jax.tree.unflatten(tree, placed)
        rest = jax.device_put((previous, statistics), self.replicated)
        out = RunData(model_data, *rest) if isinstance(data, RunData) else model_data
        return out, tuple(axes)

    def _place_rows(self, data) -> tuple:
        """:meth:`place` over several processes: every process's rows in one global array per
        leaf, the leaves without a plate axis replicated, the data statistics computed again
        from the global arrays."""
        model_data, previous, statistics = split_run_data(data)
        leaves, tree = jax.tree.flatten(model_data)
        found = [plate_axis(np.shape(x), self.sizes) for x in leaves]
        processes.check_layout(found)
        processes.check_same([x for x, axis in zip(leaves, found) if axis is None])
        axes, placed = [], []
        for x, axis in zip(leaves, found):
            x = np.asarray(x)
            if axis is None:
                axes.append(None)
                placed.append(processes.replicated(x, self.replicated))
            else:
                array, total = processes.place_rows(x, axis, self.mesh, self.axis)
                axes.append((axis, total))
                placed.append(array)
        axes = tuple(axes)
        model_data = jax.tree.unflatten(tree, placed)
        if statistics and self.statistics is not None:
            statistics = jax.jit(lambda d: self.statistics(self._sliced(d, axes)), out_shardings=self.replicated)(
                model_data
            )
        rest = processes.replicated((previous, statistics), self.replicated)
        out = RunData(model_data, *rest) if isinstance(data, RunData) else model_data
        return out, axes

    def _sliced(self, model_data, axes):
        """The model's data inside the program: each array's plate axis sliced back to its
        plate's size (the padded tail removed) and kept split over the mesh."""
        leaves, tree = jax.tree.flatten(model_data)
        leaves = [
            x if at is None else self._constrained(jax.lax.slice_in_dim(x, 0, at[1], axis=at[0]), at[0])
            for x, at in zip(leaves, axes)
        ]
        return jax.tree.unflatten(tree, leaves)

    def _constrained(self, x, axis: int | None):
        if axis is None:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, _spec(axis, self.axis)))

    def _program(self, axes):
        """The chunk as traced over the mesh: the padded data sliced back to their plates'
        sizes, the per-datum blocks' natural parameters split along their plate axis."""

        def sharded(state, data, steps_left, rho, history, tol):
            model_data, previous, statistics = split_run_data(data)
            model_data = self._sliced(model_data, axes)
            data = RunData(model_data, previous, statistics) if isinstance(data, RunData) else model_data
            nat = dict(state.nat)
            for name, sizes in self.blocks.items():
                if name in nat:
                    nat[name] = jax.tree.map(lambda x, s=sizes: self._constrained(x, plate_axis(x.shape, s)), nat[name])
            return self.chunk_fn(state._replace(nat=nat), data, steps_left, rho, history, tol)

        return sharded

    def compiled(self, args, axes):
        """The chunk compiled over the mesh for arguments of these structures, shapes and
        shardings (once per them)."""
        leaves, tree = jax.tree.flatten(args)
        key = (tree, tuple(jax.typeof(x) for x in leaves), tuple(getattr(x, "sharding", None) for x in leaves), axes)
        found = self._compiled.get(key)
        if found is None:
            shardings = jax.tree.map(lambda x: x.sharding, args)
            program = jax.jit(self._program(axes), in_shardings=shardings, out_shardings=self.replicated)
            options = self.options if self.options is not None else compiler_options(jax.tree.leaves(args[1]))
            try:
                traced = program.trace(*args)
            except (ValueError, TypeError, IndexError) as exc:
                if not self.processes:
                    raise
                raise processes.trace_error(exc) from exc
            found = self._compiled[key] = compile_lowered(lower(traced), options)
        return found

    def diagnostic(self, fn, nat, placed, axes, key):
        """``fn(nat, model data, key)``, a program of the fit's diagnostics (PSIS k̂'s
        log-weights, the narrow-q check's draws), over the mesh on the data placed by
        :meth:`place` (``placed``: what the model functions read of them): every global sum
        over the data all-reduced as in the chunk, its outputs replicated and returned on the
        default device (over several processes: this process's copy, the same in every
        process). Compiled once per ``fn`` and the data's structure, shapes and shardings."""
        if self.processes:
            nat, key = processes.replicated((nat, key), self.replicated)
        else:
            nat, key = jax.device_put((nat, key), self.replicated)
        leaves, tree = jax.tree.flatten((nat, placed, key))
        found_key = (fn, tree, tuple(jax.typeof(x) for x in leaves), tuple(x.sharding for x in leaves), axes)
        program = self._diagnostics.get(found_key)
        if program is None:

            def sliced(nat, data, key):
                model_data, previous, statistics = split_run_data(data)
                model_data = self._sliced(model_data, axes)
                return fn(nat, RunData(model_data, previous, statistics) if isinstance(data, RunData) else model_data, key)

            program = self._diagnostics[found_key] = jax.jit(sliced, out_shardings=self.replicated)
        with numpyro.validation_enabled(False):
            out = program(nat, placed, key)
        if self.processes:
            return processes.local_values(out)
        return jax.device_put(out, jax.devices()[0])

    def run(self, state, placed, axes, steps_left, rho, history, tol):
        """The chunk over the mesh on data placed by :meth:`place`; its outputs on the
        default device (over several processes: on one of this process's devices)."""
        if self.processes:
            rest = processes.replicated((state, steps_left, rho, history, tol), self.replicated)
        else:
            rest = jax.device_put((state, steps_left, rho, history, tol), self.replicated)
        args = (rest[0], placed, *rest[1:])
        out = self.compiled(args, axes)(*args)
        if self.processes:
            return processes.local_values(out)
        return jax.device_put(out, jax.devices()[0])


class MeshChunk:
    """One fit's chunk ``(state, data, steps_left, rho, history, tol) -> outputs`` over a mesh:
    a drop-in for :attr:`blrppl.engine.build.CompiledFit.chunk`. Its data are placed on the
    mesh at the first call and kept for the next calls with the same data object (the fit's
    chunks); the placement lives as long as the fit, not as the compiled fit."""

    def __init__(self, programs: ShardedChunk):
        self.programs = programs
        self._placed = None  # (the data as given, the same placed on the mesh, their plate axes)
        self._last = None  # (the state the last call returned)

    @property
    def spans_processes(self) -> bool:
        """Whether the mesh holds several processes' devices (:mod:`blrppl.engine.processes`)."""
        return self.programs.processes

    def _place(self, data) -> tuple:
        if self._placed is None or self._placed[0] is not data:
            self._placed = (data, *self.programs.place(data))
        return self._placed[1:]

    def diagnostic(self, fn, nat, data, read, key):
        """A diagnostics' program ``fn(nat, model data, key)`` over the mesh, on the fit's
        ``data`` as placed for its chunks (``read``: what of the placed run data the model
        functions read, :func:`blrppl.engine.build.model_data`): see
        :meth:`ShardedChunk.diagnostic`."""
        placed, axes = self._place(data)
        return self.programs.diagnostic(fn, nat, read(placed), axes, key)

    def __call__(self, state, data, steps_left, rho, history, tol):
        placed, axes = self._place(data)
        if self.programs.processes and state is not self._last:
            state = processes.same_start(state)  # (a fit's start, or a restart: process 0's)
        out = self.programs.run(state, placed, axes, steps_left, rho, history, tol)
        self._last = out[0]
        return out


def sharded_chunk(bundle, mesh, records) -> MeshChunk:
    """A fit's chunk over ``mesh``; its programs are made once per mesh and kept on the
    compiled fit (``bundle.sharded``), reused by the fits that share it.

    Raises:
        MeshError: the model has no plate (:func:`check_plated`).
    """
    check_plated(records, mesh)
    found = bundle.sharded.get(mesh)
    if found is None:
        found = bundle.sharded[mesh] = ShardedChunk(
            bundle.chunk_fn, mesh, bundle.plan, records, bundle.chunk_options, bundle.statistics
        )
    return MeshChunk(found)
