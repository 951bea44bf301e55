"""Data rows read from the host at each minibatch (:class:`HostRows`): a subsampled plate's
data kept on disk (a ``numpy.memmap``) or in any host array, never placed whole on a device.

A model with a subsampled plate reads its data at the plate's minibatch indices
(``X[idx]`` inside ``numpyro.plate("n", N, subsample_size=M) as idx``). Wrapped in
:class:`HostRows`, such an array stays where it is: inside the fit's compiled step,
``X[idx]`` becomes a host callback (``jax.experimental.io_callback``) that reads the M rows
of the step's minibatch, so the device holds M rows at a time and the host only the rows it
reads: N is bounded by the disk, not by memory. A ``numpy.memmap`` of a whole file is read a
window of the file at a time, each window mapped for its rows and unmapped after them, so the
file's pages that reads touch never stay in the process's resident memory (they stay in the
operating system's page cache, which it can drop).

Each step's rows are read once per array (the step evaluates the model several times; the
reads of one minibatch after the first are served from the last read), and the next step's
rows are read ahead: the step tells the host its next minibatch (:func:`prefetch`, from
:func:`blrppl.engine.subsample.make_minibatch_step`; the next minibatch is a function of the
state's key alone), and a host thread reads them while the device runs the step. A read whose
rows were not read ahead (a step undone and retried) reads them then.

What the model may do with a :class:`HostRows`: index its first axis with the plate's
indices (``X[idx]``, ``X[idx, 2]``, ...: the rows are read, then the rest of the index
applied) and read its ``shape``, ``ndim``, ``dtype`` and ``len``. Anything that needs all
its values (``X @ w``, ``jnp.asarray(X)``) raises :class:`blrppl.errors.HostRowsError`.
"""

from __future__ import annotations

import concurrent.futures
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from blrppl.errors import HostRowsError

#: the HostRows of the fit being prepared or run (:func:`activate`): the step's read-ahead
#: finds the arrays of a plate among them by their length
_ACTIVE: "weakref.WeakSet[HostRows]" = weakref.WeakSet()
#: minibatches read ahead and kept per array
AHEAD = 2
#: the part of a memmap's file one read maps at a time (:func:`_take_sorted`)
WINDOW_BYTES = 32 * 2**20
_READER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="blrppl-rows")


class HostRows:
    """An array whose rows a minibatch fit reads from the host, a minibatch at a time.

    Args:
        source: the rows: a ``numpy.memmap`` (``np.load(path, mmap_mode="r")``) or any array
            with a ``shape``, a ``dtype`` and NumPy indexing of its first axis by an integer
            array (an ``h5py`` dataset, a NumPy array). Never modified.
        dtype: the dtype the model sees (default: the source's, as JAX would convert it:
            float64 data are float32 unless x64 is on).

    Raises:
        HostRowsError: ``source`` has no rows (not an array of at least one dimension).

    Example::

        X = np.load("X.npy", mmap_mode="r")          # 10**7 rows, on disk
        y = np.load("y.npy", mmap_mode="r")

        def model(X, y):
            w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
            with numpyro.plate("n", X.shape[0], subsample_size=1000) as idx:
                numpyro.sample("y", dist.Normal(X[idx] @ w, 1.0), obs=y[idx])

        result = blr_fit(model, (HostRows(X), HostRows(y)), num_steps=3000)
    """

    def __init__(self, source, dtype=None):
        shape = getattr(source, "shape", None)
        if shape is None or len(shape) == 0 or not hasattr(source, "dtype"):
            raise HostRowsError(
                f"HostRows reads rows of an array (a numpy.memmap, np.load(path, mmap_mode='r')), not a "
                f"{type(source).__name__} without rows"
            )
        self.source = source
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(jax.dtypes.canonicalize_dtype(source.dtype if dtype is None else dtype))
        self._lock = threading.Lock()
        self._last = None  # (the indices' bytes, their rows)
        self._ahead: dict = {}  # the indices' bytes → the future of their rows (the last AHEAD)
        self.reads = 0  # (rows read from the source, for the tests and the bench)
        self.read_ahead_used = 0  # (reads served by rows read ahead)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"HostRows({type(self.source).__name__}, shape={self.shape}, dtype={self.dtype})"

    def __getitem__(self, index):
        rest = ()
        if isinstance(index, tuple):
            index, rest = index[0], index[1:]
        if isinstance(index, (slice, type(Ellipsis))) or index is None:
            raise HostRowsError(
                f"{self!r} is read a minibatch at a time: index its rows with the plate's indices "
                "(X[idx] inside numpyro.plate(..., subsample_size=M) as idx), not with a slice"
            )
        if not isinstance(index, jax.core.Tracer):
            rows = jnp.asarray(self.read(np.asarray(index)))
        else:
            out = jax.ShapeDtypeStruct(tuple(index.shape) + self.shape[1:], self.dtype)
            rows = io_callback(self.read, out, index, ordered=False)
        return rows[(slice(None),) * np.ndim(index) + rest] if rest else rows

    def read(self, indices) -> np.ndarray:
        """The rows at ``indices`` (an integer array of any shape; its shape then the rows'),
        read in increasing order (sequential on disk), from the last read or the rows read
        ahead when they are the same."""
        indices = np.asarray(indices)
        key = indices.tobytes()
        with self._lock:
            if self._last is not None and self._last[0] == key:
                return self._last[1]
            ahead = self._ahead.pop(key, None)
        if ahead is not None:
            self.read_ahead_used += 1
        rows = ahead.result() if ahead is not None else self._read(indices)
        with self._lock:
            self._last = (key, rows)
        return rows

    def _read(self, indices) -> np.ndarray:
        flat = indices.reshape(-1).astype(np.int64)
        if flat.size and (flat.min() < -self.shape[0] or flat.max() >= self.shape[0]):
            raise HostRowsError(f"{self!r}: a row index is outside its {self.shape[0]} rows")
        flat = np.where(flat < 0, flat + self.shape[0], flat)
        order = np.argsort(flat, kind="stable")
        rows = np.empty((flat.size,) + self.shape[1:], self.dtype)
        rows[order] = _take_sorted(self.source, flat[order], self.shape).astype(self.dtype, copy=False)
        self.reads += flat.size
        return rows.reshape(indices.shape + self.shape[1:])

    def read_ahead(self, indices) -> None:
        """Start reading the rows at ``indices`` on the host's reader thread."""
        indices = np.array(indices)
        with self._lock:
            # (a step's read-ahead may run before its own reads: the last AHEAD are kept)
            while len(self._ahead) >= AHEAD:
                self._ahead.pop(next(iter(self._ahead)))
            self._ahead[indices.tobytes()] = _READER.submit(self._read, indices)

    def __array__(self, dtype=None, copy=None):
        raise HostRowsError(
            f"{self!r} is read a minibatch at a time and has no values as a whole: the model may index its rows "
            "with the subsampled plate's indices (X[idx]) only; to use all of it, pass the array itself"
        )

    def __jax_array__(self):
        return self.__array__()

    def __eq__(self, other) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)


jax.tree_util.register_pytree_node(HostRows, lambda h: ((), h), lambda h, _: h)


def _windows(source):
    """``(filename, offset, row bytes)`` of a C-ordered ``numpy.memmap`` that maps a whole file's
    array (None for any other source, or a view of part of a mapping: read through it)."""
    if not isinstance(source, np.memmap) or getattr(source, "filename", None) is None:
        return None
    if not source.flags.c_contiguous or isinstance(source.base, np.memmap):
        return None
    return source.filename, int(source.offset), int(source.itemsize * np.prod(source.shape[1:], dtype=np.int64))


def _take_sorted(source, rows_sorted, shape) -> np.ndarray:
    """The rows at the increasing indices ``rows_sorted`` of ``source``. A whole-file memmap is
    read a window of :data:`WINDOW_BYTES` at a time, each mapped for its rows and unmapped after
    them: a read of scattered rows never holds more than one window of the file in the
    process's resident memory (a page fault maps the pages around the faulting one too, so
    reading 10,000 scattered rows through one mapping of a 1.6 GB file held 1 GB of it)."""
    found = _windows(source)
    if found is None:
        return np.asarray(source[rows_sorted])
    filename, offset, row_bytes = found
    per = max(1, WINDOW_BYTES // max(row_bytes, 1))
    window = rows_sorted // per
    cuts = np.flatnonzero(np.diff(window)) + 1
    parts = []
    for chunk in np.split(rows_sorted, cuts):
        if not chunk.size:
            continue
        first = int(chunk[0] // per) * per
        count = min(per, shape[0] - first)
        mapped = np.memmap(
            filename, dtype=source.dtype, mode="r", offset=offset + first * row_bytes, shape=(count,) + shape[1:]
        )
        parts.append(np.array(mapped[chunk - first]))
        del mapped  # (unmapped: its pages leave the process's resident memory)
    return np.concatenate(parts) if parts else np.empty((0,) + shape[1:], source.dtype)


def lengths() -> frozenset:
    """The row counts of the active :class:`HostRows` (the plates whose steps read ahead)."""
    return frozenset(h.shape[0] for h in list(_ACTIVE))


def in_data(tree) -> bool:
    """Whether ``tree`` (a model's arguments) holds a :class:`HostRows`."""
    return bool(_found(tree))


def _found(tree) -> list:
    return [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, HostRows)) if isinstance(x, HostRows)]


def activate(tree) -> None:
    """Make the :class:`HostRows` in ``tree`` (a fit's model arguments) the ones the steps
    read ahead for (none: a fit without them reads nothing ahead)."""
    _ACTIVE.clear()
    for rows in _found(tree):
        _ACTIVE.add(rows)


def _read_ahead(sizes: tuple, *indices) -> None:
    for size, idx in zip(sizes, indices):
        for rows in list(_ACTIVE):
            if rows.shape[0] == size:
                rows.read_ahead(idx)


def prefetch(sizes: tuple, indices: tuple) -> None:
    """Inside a compiled step: have the host read ahead, for every active :class:`HostRows` of
    ``sizes[i]`` rows, the rows at ``indices[i]`` (the next step's minibatch)."""
    io_callback(lambda *idx: _read_ahead(sizes, *idx), None, *indices, ordered=False)
