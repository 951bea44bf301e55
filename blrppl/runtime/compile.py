"""Lowering and compiling blrppl's own programs, with two workarounds that apply to them
alone (docs/runtime.md):

* XLA's CPU scheduler that runs independent operations concurrently is turned off by a
  compiler option of each program (:data:`SCHEDULER_FLAG`), not through ``$XLA_FLAGS``: it
  can leave a compiled program waiting forever with every thread idle (a probabilistic PCA
  fit hung in 5 of 6 runs on this project's CI machine, 0 of 13 without it). A user's own
  setting of the flag in ``$XLA_FLAGS`` is kept.
* batched LAPACK calls are lowered in chunks that stay on the calling thread
  (:mod:`blrppl.runtime.lapack`), by override rules passed to the lowering of each program
  (:func:`lower`), not registered with JAX.

A program is blrppl's when it is lowered by :func:`lower` (or a :func:`jit` program's
``trace``/``lower``/call) and compiled by :func:`compile_lowered`. Programs that the user
jits around blrppl's code are the user's, and compile as JAX compiles them.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from blrppl.runtime import lapack

#: the XLA option of the concurrency-optimised CPU scheduler, off in blrppl's programs
SCHEDULER_FLAG = "xla_cpu_enable_concurrency_optimized_scheduler"

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


@functools.lru_cache(maxsize=1)
def lowering_parameters():
    """JAX's lowering parameters of blrppl's programs: the chunked LAPACK rules as overrides
    (None: JAX's defaults, when there are none or this JAX has no such parameters)."""
    rules = lapack.lowering_rules()
    if not rules:
        return None
    try:
        from jax._src.interpreters import mlir

        return mlir.LoweringParameters(override_lowering_rules=rules)
    except Exception:  # pragma: no cover - a JAX whose internals moved
        return None


def lower(traced):
    """Lower a traced program (``jax.jit(f).trace(...)``) as one of blrppl's: with the
    chunked LAPACK rules (:mod:`blrppl.runtime.lapack`)."""
    if isinstance(traced, Traced):
        traced = traced._traced
    parameters = lowering_parameters()
    if parameters is None:
        return traced.lower()
    return traced.lower(_private_parameters=parameters)


def xla_options(options: dict | None) -> dict:
    """``options`` with the concurrency-optimised scheduler off, unless the user set
    :data:`SCHEDULER_FLAG` in ``$XLA_FLAGS`` (their choice is kept)."""
    options = dict(options or {})
    if SCHEDULER_FLAG not in os.environ.get("XLA_FLAGS", ""):
        options.setdefault(SCHEDULER_FLAG, False)
    return options


def compile_lowered(lowered, options: dict | None):
    """``lowered.compile`` with XLA ``options`` and blrppl's own (:func:`xla_options`),
    leaving out those this jaxlib does not know (a compilation that names one fails; it is
    retried without it). ``lowered`` may also be a traced program, lowered by :func:`lower`."""
    if not hasattr(lowered, "compile"):
        lowered = lower(lowered)
    options = {k: v for k, v in xla_options(options).items() if k not in _REJECTED}
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


class Traced:
    """A traced program of blrppl's (``jax.stages.Traced``) whose :meth:`lower` is
    :func:`lower`; its other attributes are the traced program's."""

    def __init__(self, traced):
        self._traced = traced

    def lower(self):
        """The program lowered by :func:`lower`."""
        return lower(self._traced)

    def __getattr__(self, name):
        return getattr(self._traced, name)


class Program:
    """``jax.jit(fn)`` as one of blrppl's programs: :meth:`trace` and :meth:`lower` lower it
    with blrppl's rules, and a call with concrete arguments runs it compiled by
    :func:`compile_lowered` (once per argument structure, shapes and dtypes). Called with
    traced arguments (inside another program) it is ``jax.jit(fn)``, part of that program."""

    def __init__(self, fn, options: dict | None = None):
        self._jitted = jax.jit(fn)
        self._options = options
        self._compiled: dict = {}
        self.__wrapped__ = fn

    def trace(self, *args, **kwargs) -> Traced:
        """The program traced for these arguments; its ``lower()`` is blrppl's."""
        return Traced(self._jitted.trace(*args, **kwargs))

    def lower(self, *args, **kwargs):
        """The program lowered for these arguments by :func:`lower`."""
        return lower(self._jitted.trace(*args, **kwargs))

    def __call__(self, *args, **kwargs):
        leaves, tree = jax.tree.flatten((args, kwargs))
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            return self._jitted(*args, **kwargs)
        try:
            key = (tree, tuple(jax.typeof(x) for x in leaves), _trace_context())
            hash(key)
        except TypeError:  # (a leaf JAX would reject: its own error)
            return self._jitted(*args, **kwargs)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = compile_lowered(self.lower(*args, **kwargs), self._options)
        return compiled(*args, **kwargs)


def _trace_context() -> tuple:
    try:  # (the configuration values JAX's own tracing cache is keyed by)
        from jax._src import config

        return config.trace_context()
    except Exception:  # pragma: no cover - a JAX without this private helper
        return (jax.config.jax_enable_x64,)


def jit(fn, options: dict | None = None) -> Program:
    """``fn`` as one of blrppl's programs (:class:`Program`), compiled with XLA ``options``
    besides blrppl's own when called."""
    return Program(fn, options=options)
