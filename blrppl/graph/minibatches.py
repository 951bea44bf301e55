"""Minibatches from a user's iterator (:class:`Minibatches`), read ahead on a host thread.

NumPyro's minibatch idiom has the model take a minibatch's arrays as its arguments and
declare the data's full size on the plate, without indexing::

    def model(X, y):                                   # X: (M, D), y: (M,), one minibatch
        w = numpyro.sample("w", dist.Normal(0, 1).expand([D]).to_event(1))
        with numpyro.plate("n", N, subsample_size=M):  # N: the whole data set's size
            numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)

and feeds the batches in a Python loop (``svi.update(state, X_batch, y_batch)``). Wrapped in
:class:`Minibatches`, an iterable of such batches (a generator of ``(X_batch, y_batch)``
tuples, a torch-style ``DataLoader``, a ``tf.data``-like iterable of NumPy arrays) is what
``blr_fit`` and ``BLR.run`` fit: each step takes the next batch as the model's arguments.

How the batches reach the steps (:class:`BatchFeed`): each step is one call of the fit's
compiled chunk of steps with a step count of 1, as ``BLR.update`` runs it, on the batch's
arrays. Before that call, the next batch's ``next()``, its conversion (as ``blr_fit``
converts data) and its placement on the device are started on the host's reader thread
(the one :class:`blrppl.HostRows` reads rows on), so the host reads batch t + 1 while the
device runs step t. (:class:`blrppl.HostRows` reads inside the compiled step, through a
host callback, a chunk of 100 steps at a time: that works for an array the step indexes by
the minibatch's indices, which it can ask for again when a step is computed twice. An
iterator is read once and in order, and the model reads its batch as its arguments, so the
batch must be the step's data; a chunk of several steps would have to hold several batches
at once. The price is one return to the host per step: see docs/scaling.md.)
"""

from __future__ import annotations

import collections.abc
import threading

import jax
import numpy as np

from blrppl.errors import BLRError, MinibatchError
from blrppl.graph import host_rows
from blrppl.graph.data import DataSpec, RunData, split_run_data
from blrppl.inputs import argument_names, as_compiled_dtype, model_arguments

#: what :meth:`Minibatches.take` returns once the iterable has no batch left
END = object()


class Minibatches:
    """A subsampled plate's data as an iterable of minibatches, for ``blr_fit`` and
    ``BLR.run``.

    Args:
        batches: the minibatches: an iterable whose items are the model's arguments for one
            step, each a tuple of positional arguments (``(X_batch, y_batch)``), a dict of
            keyword arguments or one array, as ``blr_fit``'s ``data``. Every batch has the
            structure, shapes and dtypes of the first, except that a batch with fewer rows
            (the last of an epoch of N rows in batches of M) is skipped. It is consumed,
            never otherwise changed.
        cycle: start the iterable again when it ends (``iter(batches)`` once more: a list, or
            a DataLoader, which reshuffles) until the fit stops. Default: when ``batches`` is
            re-iterable (not itself an iterator); a one-shot iterator (a generator) ends the
            fit when it ends.
        read_ahead: read each next batch on the host's reader thread while the step before it
            runs (default); False: on the calling thread when its step asks for it (for an
            iterator that must not be advanced from another thread).

    Attributes:
        used: the batches the fit's steps ran on.
        skipped: the short batches skipped.
        passes: the passes begun over the iterable (> 1 when cycling).
        exhausted: whether the iterable ended the fit.

    Raises:
        MinibatchError: ``batches`` is not iterable, or ``cycle=True`` for a one-shot iterator.

    Example::

        def batches():
            for start in range(0, N, M):
                yield X[start:start + M], y[start:start + M]

        result = blr_fit(model, Minibatches(batches()), rng_key=random.PRNGKey(0), num_steps=N // M)
    """

    def __init__(self, batches, cycle: bool | None = None, read_ahead: bool = True):
        if not isinstance(batches, collections.abc.Iterable):
            raise MinibatchError(
                f"Minibatches takes an iterable of minibatches (a generator, a list, a DataLoader), not a "
                f"{type(batches).__name__}"
            )
        one_shot = isinstance(batches, collections.abc.Iterator)
        if cycle and one_shot:
            raise MinibatchError(
                "Minibatches(cycle=True) needs an iterable it can start again (a list, a DataLoader); a one-shot "
                "iterator (a generator) ends when it ends: pass a function's fresh iterables, e.g. a list, or "
                "cycle=False"
            )
        self.batches = batches
        self.cycle = (not one_shot) if cycle is None else bool(cycle)
        self.read_ahead = bool(read_ahead)
        self._iterator = None
        self._lock = threading.Lock()
        self.used = 0
        self.skipped = 0
        self.passes = 0
        self.exhausted = False
        self.taken = 0  # (items taken from the iterable, read ahead included: for the tests)

    def __repr__(self) -> str:
        return f"Minibatches({type(self.batches).__name__}, cycle={self.cycle}, used={self.used})"

    def take(self):
        """The iterable's next item (starting it again at its end when cycling), or
        :data:`END`."""
        with self._lock:
            for _ in range(2):
                if self._iterator is None:
                    self._iterator = iter(self.batches)
                    self.passes += 1
                try:
                    item = next(self._iterator)
                except StopIteration:
                    if not self.cycle:
                        return END
                    self._iterator = None
                    continue
                self.taken += 1
                return item
            return END  # (a re-iterable that yields nothing on a new pass)

    def first(self) -> tuple:
        """``(args, kwargs)`` of the first batch, converted as ``blr_fit`` converts data: the
        arguments the model is traced and compiled with, and step 0's.

        Raises:
            MinibatchError: the iterable yields nothing.
        """
        item = self.take()
        if item is END:
            raise MinibatchError("Minibatches: the iterable yielded no batch")
        return _arguments(item, 0)


def _as_array(x):
    """A batch's array from another library (a torch tensor, a TensorFlow tensor: anything
    with ``__array__``) as a NumPy array; anything else as it is."""
    if hasattr(x, "__array__") and not isinstance(x, (np.ndarray, np.generic, jax.Array)):
        return np.asarray(x)
    return x


def _arguments(item, index: int) -> tuple:
    """``(args, kwargs)`` of the ``index``-th batch (its arrays converted as data)."""
    if isinstance(item, collections.abc.Mapping):
        item = {k: _as_array(v) for k, v in item.items()}
    elif isinstance(item, (tuple, list)):
        item = tuple(_as_array(v) for v in item)
    else:
        item = _as_array(item)
    try:
        return model_arguments(item)
    except BLRError as err:
        raise MinibatchError(f"Minibatches: batch {index}: {err}") from None


def _shape_text(shape) -> str:
    return str(tuple(int(n) for n in shape))


class BatchFeed:
    """The batches of a :class:`Minibatches` for a fit's steps, each read, converted and placed
    on the device on the host's reader thread one step ahead (see the module docstring).

    Args:
        source: the :class:`Minibatches`, its first batch taken (:meth:`Minibatches.first`).
        first: ``(args, kwargs)`` of that first batch.
        data_spec: the :class:`blrppl.graph.data.DataSpec` the fit was compiled for.
        run_data: the fit's run-time data for the first batch (the model's arrays, and an
            online fit's previous posterior).
        statistics: ``arrays → data statistics`` of the plan's factors that read them (the
            compiled fit's :meth:`~blrppl.engine.build.CompiledFit.statistics`), or None.
    """

    def __init__(self, source: Minibatches, first: tuple, data_spec: DataSpec, run_data, statistics=None):
        self.source = source
        self.spec = data_spec
        self.compiled, self.previous, _ = split_run_data(run_data)
        self.names = argument_names(*first)
        self.statistics = statistics
        self._first = run_data  # (step 0's batch: the one the fit was compiled with)
        self._next = None  # (the future of the next batch's arrays)
        self.index = 1  # (the number of the next item taken from the iterable)

    @classmethod
    def of_fit(cls, source: Minibatches, first: tuple, prepared) -> "BatchFeed":
        """The feed of a prepared fit (:class:`blrppl.engine.prepare.Prepared`) compiled for
        the ``first`` batch of ``source``."""
        bundle = prepared.bundle
        statistics = bundle.statistics if bundle.statistics_fn is not None or bundle.tables_fn is not None else None
        return cls(source, first, prepared.data_spec, prepared.dyn_data, statistics)

    def next(self, ahead: bool = True):
        """The run-time data of the next step, or None when the iterable has ended; with
        ``ahead``, the batch after it is read meanwhile on the reader thread.

        Raises:
            MinibatchError: the batch differs from the first in structure, shape or dtype
                (naming the argument), raised at the step that would read it.
        """
        if self._first is not None:
            data, self._first = self._first, None
        else:
            data = self._next.result() if self._next is not None else self._read()
            self._next = None
        if data is None:
            self.source.exhausted = True
            return None
        if ahead and self.source.read_ahead:
            self._next = host_rows._READER.submit(self._read)
        self.source.used += 1
        if not isinstance(data, RunData) and (self.previous or self.statistics is not None):
            stats = self.statistics(data) if self.statistics is not None else {}
            data = RunData(data, dict(self.previous), stats)
        return data

    def close(self) -> None:
        """Wait for a batch still being read ahead (none is taken from the iterable after the
        fit returns); it is not used."""
        if self._next is not None:
            self._next.exception()
            self._next = None

    def _read(self):
        """The next full batch's arrays, placed on the device (short batches skipped), or None."""
        while True:
            item = self.source.take()
            if item is END:
                return None
            index, self.index = self.index, self.index + 1
            arrays = self._arrays(_arguments(item, index), index)
            if arrays is not None:
                return arrays
            self.source.skipped += 1

    def _arrays(self, arguments, index: int):
        """The batch's arrays in the compiled dtypes, or None for a short batch (fewer rows
        along the first axis, the rest alike)."""
        spec, dyn = DataSpec.split(*arguments)
        if spec.treedef != self.spec.treedef or len(dyn) != len(self.compiled):
            raise MinibatchError(
                f"Minibatches: batch {index} has another structure than the first (got "
                f"{spec.treedef}, the fit was compiled for {self.spec.treedef}): yield every batch as the "
                "same tuple or dict of arrays"
            )
        static_same = len(spec.static) == len(self.spec.static) and all(
            i == j and _same_value(a, b) for (i, a), (j, b) in zip(spec.static, self.spec.static)
        )
        if not static_same:
            raise MinibatchError(
                f"Minibatches: batch {index}'s non-array arguments differ from the first batch's: a fit compiles "
                "them in; pass values that change from batch to batch as arrays"
            )
        short = []
        for name, got, want in zip(self.names, dyn, self.compiled):
            if got.shape == want.shape:
                continue
            rows = got.ndim == want.ndim >= 1 and got.shape[1:] == want.shape[1:] and got.shape[0] < want.shape[0]
            if not rows:
                raise MinibatchError(
                    f"Minibatches: batch {index}'s argument {name} has shape {_shape_text(got.shape)}, the first "
                    f"batch's {_shape_text(want.shape)}: every batch needs the first's shapes (a batch with fewer "
                    "rows, an epoch's last, is skipped)"
                )
            short.append((name, got.shape[0]))
        if short and (len(short) < len(dyn) or len({n for _, n in short}) > 1):
            raise MinibatchError(
                f"Minibatches: batch {index} is short in some arguments only ({', '.join(n for n, _ in short)}): "
                "a short batch (an epoch's last, skipped) has fewer rows in every argument"
            )
        if short:
            return None
        out = []
        for name, got, want in zip(self.names, dyn, self.compiled):
            try:
                out.append(as_compiled_dtype(got, want.dtype, name, "the first batch"))
            except BLRError:
                raise MinibatchError(
                    f"Minibatches: batch {index}'s argument {name} is {got.dtype}, with values that {want.dtype}, "
                    "the first batch's dtype (the fit's compiled one), does not hold exactly: yield every batch in "
                    "the first batch's dtypes"
                ) from None
        return tuple(jax.device_put(out))  # (on this thread: the step's call then finds them placed)


def _same_value(a, b) -> bool:
    try:
        return bool(np.array_equal(np.asarray(a), np.asarray(b))) if hasattr(a, "shape") else a == b
    except Exception:  # (values that cannot be compared: taken as different)
        return False


def refuse_options(options, grid: bool) -> None:
    """Refuse the fit options a :class:`Minibatches` fit does not combine with.

    Raises:
        MinibatchError: ``num_starts`` > 1, scales on a grid (``grid``), a mixture family or
            ``mesh=``: they need several fits on the same data, or all of it at once.
    """
    if options.num_starts > 1 or options.mixtures or grid or options.mesh is not None:
        raise MinibatchError(
            "Minibatches fits one start on one device: num_starts > 1, families='grid', ('gaussian-mixture', K) "
            "and mesh= need several fits on the same data or all of it at once; pass the data as arrays for them"
        )


def lone(args, kwargs):
    """The :class:`Minibatches` that a ``BLR`` call's arguments are (its only argument), or None."""
    if len(args) == 1 and not kwargs and isinstance(args[0], Minibatches):
        return args[0]
    if any(isinstance(x, Minibatches) for x in (*args, *kwargs.values())):
        raise MinibatchError("a Minibatches is the model's whole data: pass it as the only argument")
    return None


def batches_note(batches: Minibatches) -> str:
    """What a fit read of ``batches``, for its message."""
    note = f"{batches.used} minibatches from the iterable"
    if batches.passes > 1:
        note += f" ({batches.passes} passes over it)"
    if batches.skipped:
        note += f", {batches.skipped} short batch(es) skipped (fewer rows than the first)"
    return note
