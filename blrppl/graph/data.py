"""Model data: array leaves travel into jit as arguments, the rest stay static."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import threading
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from blrppl.inputs import is_numeric_array


class RunData(NamedTuple):
    """What a compiled fit reads at run time besides its state, when it is more than the
    model's array data.

    Attributes:
        model: the model's dynamic data leaves.
        previous_nat: online fits: per matched block, the previous posterior's natural
            parameters (see :mod:`blrppl.online`).
        statistics: per factor with precomputed data statistics (see
            :mod:`blrppl.estimators.gram`), its statistics.
    """

    model: tuple
    previous_nat: dict = {}
    statistics: dict = {}


def split_run_data(data) -> tuple:
    """(model data, previous natural parameters, factor statistics) of run-time data."""
    if isinstance(data, RunData):
        return data.model, data.previous_nat, data.statistics
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

    def merge(self, dynamic):
        n = len(dynamic) + len(self.static)
        leaves = [None] * n
        static = dict(self.static)
        it = iter(dynamic)
        for i in range(n):
            leaves[i] = static[i] if i in static else next(it)
        args, kwargs = jax.tree.unflatten(self.treedef, leaves)
        return args, kwargs


#: below this many data elements, compile time dominates run time and XLA's backend
#: optimisations are turned off (several times faster to compile)
SMALL_DATA = 200_000

#: XLA's CPU fusion emitters roughly double the compile time of a fit's loop and its probes;
#: without them the loop runs at the same speed on 10⁵–10⁶ data rows and up to 1.5× slower on
#: small data (diamonds: 0.3 → 0.45 s of run for 1.4 s less compilation). The YNNPACK
#: library fusions of recent jaxlibs are off: as YNN fusions a step's sums over 10⁵ elements
#: ran at 5–60 ns per element (a Poisson random walk of 10⁵ steps: 24 → 14 ms per step
#: without), and with only matrix products kept as YNN fusions, fits of a small factor model
#: on a loaded machine came out NaN now and then (a model's first run with 30 NaN entries of
#: ``X @ C.T``, or every step rejected): 10 of 336 fits in a loop of fresh compiles against 0
#: of 213 without, and 5 of 41 runs of its test file with pytest's two workers against 0 of 30
#: (plain dots of its shapes compiled and run alone never failed); the large PCA's step
#: 13.7 → 15.6 ms without; a jaxlib without the option drops it.
_FAST_COMPILE = {"xla_cpu_use_fusion_emitters": False, "xla_cpu_experimental_ynn_fusion_type": ""}


#: XLA options this jaxlib rejected (unknown options are errors, not ignored): found at the
#: first compilation that passes them, then left out
_REJECTED: set = set()


def compile_lowered(lowered, options: dict | None):
    """``lowered.compile`` with XLA ``options``, leaving out those this jaxlib does not know
    (a compilation that names one fails; it is retried without it)."""
    options = {k: v for k, v in (options or {}).items() if k not in _REJECTED}
    try:
        return lowered.compile(compiler_options=options or None)
    except Exception as exc:  # XlaRuntimeError / JaxRuntimeError, depending on the jaxlib version
        bad = {k for k in options if f"'{k}'" in str(exc) or f" {k}" in str(exc)}
        if not bad:
            raise
        _REJECTED.update(bad)
        return compile_lowered(lowered, options)


def compiler_options(data, size: int | None = None, dense_work: int = 0, once: bool = False) -> dict | None:
    """XLA options for compiling a function of ``data``: the CPU fusion emitters off, and
    backend optimisations off for small data, where compiling dominates running.

    ``size`` overrides the data's size as the measure of the elementwise work per call
    (a fit whose large data enter only through precomputed statistics does little
    elementwise work per step: its linear algebra runs as fast unoptimised).

    ``dense_work`` is the work of small data whose elements each carry dense arithmetic
    (a D × D precision per point and label, D² products per entry of ``X @ C.T``): from
    :data:`SMALL_DATA` on, such a program is compiled at optimisation level 1, which
    costs little more to compile than level 0 and runs its elementwise loops 2–4× faster
    (BayesPy's PCA, 500 × 20 with D = 10: 68 → 20 ms per step for 0.8 s more compiling;
    the K = 40 mixture: 26 → 13 ms).

    ``once``: a program each fit runs once (its diagnostics' draws, its posterior's export)
    is compiled at most at level 1. It compiles beside the fit's loop, on the same cores:
    at XLA's default level the diagnostics of a 2,000 × 100 matrix factorisation took
    2.9 s to compile (1.5 s at level 1) and ran as fast at level 1 (1.7 s), as did those of
    a logistic regression on 10⁶ rows (1.15 s); first fits of ARD regression on 10⁵ × 100
    inputs 4.2 → 3.1 s, of the large PCA 10.7 → 8.2 s."""
    if size is None:
        size = sum(int(np.prod(jnp.shape(x))) for x in jax.tree.leaves(data))
    options = dict(_FAST_COMPILE)
    if size < SMALL_DATA:
        options["xla_backend_optimization_level"] = 1 if dense_work >= SMALL_DATA else 0
    elif once:
        options["xla_backend_optimization_level"] = 1
    return options


def host_array(value, dtype=None):
    """``jnp.asarray(value, dtype)`` for a concrete value, placed from the host: eager
    ``jnp.asarray``/``jnp.zeros`` compile a small program each (per dtype and shape), which a
    fit's setup would pay in every new process. Traced values go through ``jnp.asarray``."""
    if isinstance(value, jax.core.Tracer):
        return jnp.asarray(value, dtype)
    return jax.device_put(np.asarray(value, dtype))


#: XLA compilations in this process (a persistent-cache hit is none): read by
#: :func:`xla_compilations`, counted by a JAX monitoring listener registered at import;
#: index 1 counts those run in :func:`background` (programs nothing waits for yet)
_XLA_COMPILATIONS = [0, 0]
_THREAD = threading.local()


def _counter() -> int:
    return 1 if getattr(_THREAD, "background", False) else 0


def _count_compilation(event: str, duration: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _XLA_COMPILATIONS[_counter()] += 1


def _count_cache_hit(event: str, **_) -> None:
    # JAX's backend-compilation event times a persistent-cache read too (it wraps
    # ``compile_or_get_cached``): a hit, recorded before that event ends, is taken back off
    if event == "/jax/compilation_cache/cache_hits":
        _XLA_COMPILATIONS[_counter()] -= 1
        _THREAD.cache_hits = thread_cache_hits() + 1


jax.monitoring.register_event_duration_secs_listener(_count_compilation)
jax.monitoring.register_event_listener(_count_cache_hit)


def xla_compilations() -> int:
    """The number of XLA compilations in this process since blrppl was imported, those in
    :func:`background` left out (every thread's: a fit's count includes other threads'
    compilations while it compiled)."""
    return _XLA_COMPILATIONS[0]


def thread_cache_hits() -> int:
    """The number of JAX persistent-cache reads in this thread since blrppl was imported."""
    return getattr(_THREAD, "cache_hits", 0)


def background_compilations() -> int:
    """The number of XLA compilations run in :func:`background` since blrppl was imported."""
    return _XLA_COMPILATIONS[1]


@contextlib.contextmanager
def background():
    """Count the XLA compilations in this block (this thread) as background work: programs
    compiled on a worker thread that a fit does not wait for before its first step (its
    diagnostics and posterior export)."""
    before = getattr(_THREAD, "background", False)
    _THREAD.background = True
    try:
        yield
    finally:
        _THREAD.background = before


#: environment variable that turns the persistent compilation cache off ("0", "off", "false")
CACHE_ENV = "BLRPPL_COMPILATION_CACHE"


def compilation_cache_dir() -> pathlib.Path:
    """Where blrppl keeps JAX's persistent compilation cache: ``$XDG_CACHE_HOME/blrppl/jax``
    (``~/.cache/blrppl/jax`` by default)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(root) / "blrppl" / "jax"


def enable_compilation_cache() -> str | None:
    """Turn on JAX's persistent compilation cache (called when blrppl is imported), so that
    running the same fit in a new process compiles nothing with XLA again: the executables
    of every compilation are kept in :func:`compilation_cache_dir`.

    Left alone when ``$BLRPPL_COMPILATION_CACHE`` is ``0``/``off``/``false`` or the user set
    ``jax_compilation_cache_dir`` already (their cache, their settings). Otherwise JAX's
    thresholds are lowered so that fits' many small compilations are kept too.

    Returns:
        the cache directory in use, or None.
    """
    if os.environ.get(CACHE_ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return None
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    path = compilation_cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: no persistent cache
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return str(path)
