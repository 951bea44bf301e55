"""Model data: array leaves travel into jit as arguments, the rest stay static."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from blrppl.inputs import is_numeric_array


#: a model holding more bytes of concrete data than this (one that needs concrete data: its
#: data are constants of its programs) is not kept in the on-disk program store, which would
#: fill with copies of one data set
STORED_STATIC_BYTES = 4 * 2**20


class RunData(NamedTuple):
    """What a compiled fit reads at run time besides its state, when it is more than the
    model's array data.

    Attributes:
        model_data: the model's dynamic data leaves.
        previous_nat: online fits: per matched block, the previous posterior's natural
            parameters (see :mod:`blrppl.posterior.online`).
        statistics: per factor with precomputed data statistics (see
            :mod:`blrppl.estimators.gram`), its statistics.
    """

    model_data: tuple
    previous_nat: dict = {}
    statistics: dict = {}


def split_run_data(data) -> tuple:
    """(model data, previous natural parameters, factor statistics) of run-time data."""
    if isinstance(data, RunData):
        return data.model_data, data.previous_nat, data.statistics
    return data, {}, {}


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """Splits model arguments into array leaves (passed to jit) and static leaves."""

    treedef: Any
    static: tuple  # (index, value) of non-array leaves
    all_static: bool = False  # every leaf static (a model that needs concrete data)

    @staticmethod
    def split(args, kwargs, all_static: bool = False):
        """Split ``(args, kwargs)``; with ``all_static`` every leaf stays a Python constant
        (for models that need concrete data, e.g. ``np.asarray`` of an argument)."""
        leaves, treedef = jax.tree.flatten((tuple(args), dict(kwargs)), is_leaf=lambda x: x is None)
        dynamic, static = [], []
        for i, leaf in enumerate(leaves):
            if is_numeric_array(leaf) and not all_static:
                # (device_put: jnp.asarray of a NumPy array compiles a conversion program)
                dynamic.append(leaf if isinstance(leaf, jax.Array) else jax.device_put(leaf))
            else:
                static.append((i, leaf))
        return DataSpec(treedef, tuple(static), all_static), tuple(dynamic)

    def static_key(self) -> tuple:
        """The static leaves as a hashable key whose text is stable across processes: each
        numeric array by its dtype, shape and a digest of its bytes (a model that needs
        concrete data holds them in its compiled programs, which are keyed by their
        values), every other leaf as it is."""
        return tuple((i, array_digest(v) if is_numeric_array(v) else v) for i, v in self.static)

    def static_bytes(self) -> int:
        """The bytes of the static leaves' numeric arrays (what a model that needs concrete
        data holds as constants)."""
        return sum(int(np.asarray(v).nbytes) for _, v in self.static if is_numeric_array(v))

    def merge(self, dynamic):
        n = len(dynamic) + len(self.static)
        leaves = [None] * n
        static = dict(self.static)
        it = iter(dynamic)
        for i in range(n):
            leaves[i] = static[i] if i in static else next(it)
        args, kwargs = jax.tree.unflatten(self.treedef, leaves)
        return args, kwargs


def array_digest(value) -> tuple:
    """``("array", dtype, shape, digest of the bytes)`` of a concrete array."""
    arr = np.ascontiguousarray(np.asarray(value))
    return ("array", str(arr.dtype), arr.shape, hashlib.blake2b(arr.tobytes(), digest_size=16).hexdigest())


def host_array(value, dtype=None):
    """``jnp.asarray(value, dtype)`` for a concrete value, placed from the host: eager
    ``jnp.asarray``/``jnp.zeros`` compile a small program each (per dtype and shape), which a
    fit's setup would pay in every new process. Traced values go through ``jnp.asarray``."""
    if isinstance(value, jax.core.Tracer):
        return jnp.asarray(value, dtype)
    return jax.device_put(np.asarray(value, dtype))
