"""The API boundary: what users pass, normalised or refused by name.

Every public entry point (:func:`blrppl.blr_fit`, every method of :class:`blrppl.BLR`,
:meth:`blrppl.BLRResult.sample` and friends) sends what the user passed through this
module before anything else sees it:

* **keys** (:func:`as_key`): a typed key (``jax.random.key(0)``), a raw ``uint32`` key
  (``jax.random.PRNGKey(0)``, the spelling of NumPyro's docs) or an int seed all become a
  typed key;
* **options** (:func:`fit_options`): the keywords of :func:`blrppl.blr_fit` are checked
  and frozen into a hashable :class:`FitOptions` (which is also part of the key of the
  compiled-fit cache);
* **data** (:func:`model_arguments`): a dict of keyword arguments, a tuple of positional
  ones, or one array (the model's only positional argument); pandas Series/Index and
  numeric object arrays become NumPy arrays, lists of numbers with a float among them
  become float arrays, complex arrays are refused naming the argument, and nothing the
  user passed is modified.

Anything refused raises a :class:`blrppl.BLRError` that names the option or argument and
the fix.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from blrppl.engine.processes import check_mesh, spans_processes
from blrppl.errors import BLRError, MeshError, ModelTraceError, ObservedDataError, TransformationError

#: schedules of the natural-parameter updates
SCHEDULES = ("sequential", "parallel")
#: values of ``structure=``
STRUCTURES = (None, "joint", "mean-field")
#: values of ``point_space=``
POINT_SPACES = ("unconstrained", "constrained")
#: the most steps of a fit when ``num_steps`` is not given
DEFAULT_NUM_STEPS = 1000


# -- JAX transformations ---------------------------------------------------------------


def _under_transformation() -> bool:
    """Whether JAX is tracing in this thread (a ``jit``, ``vmap``, ``grad``, ``scan``... in
    progress); False where this JAX has no such query."""
    try:
        from jax._src import core

        return not core.trace_state_clean()
    except Exception:  # pragma: no cover - a JAX whose internals moved
        return False


def refuse_transformation(entry: str, *values) -> None:
    """Refuse a fit called under a JAX transformation, or with traced arrays among
    ``values`` (its data, key, starting values).

    Args:
        entry: the entry point, as the user called it (``"blr_fit"``, ``"BLR.init"``).
        *values: what the user passed (any pytrees).

    Raises:
        TransformationError: saying why a fit cannot run there and what to do instead.
    """
    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(values))
    if not traced and not _under_transformation():
        return
    raise TransformationError(
        f"{entry} cannot run under a JAX transformation (jax.jit, jax.vmap, jax.grad, lax.scan, ...)"
        f"{': it was given traced arrays' if traced else ''}. A fit traces and compiles the model itself, "
        "runs its own jitted loop on concrete data and returns Python objects. Call it outside the "
        "transformed function (a loop over data sets or keys in Python, one fit each); to run the "
        "learning rule inside your own jitted code, take kernel, state = blrppl.blr_kernel(model, data) "
        "outside it and call kernel.step(state) inside (e.g. in jax.lax.scan), or BLR.update after BLR.init."
    )


# -- keys ----------------------------------------------------------------------------


def as_key(key, name: str = "rng_key"):
    """A typed ``jax.random`` key from any spelling NumPyro users write.

    Args:
        key: ``None`` (the key of seed 0), a typed key (``jax.random.key(0)``), raw key data
            (``jax.random.PRNGKey(0)``, a ``uint32`` array) or an int seed.
        name: what the key is called in error messages.

    Raises:
        BLRError: anything else (a string, a float, a batch of keys...).
    """
    if key is None:
        return seed_key(0)
    if isinstance(key, (bool, np.bool_)):
        raise BLRError(_key_message(name, key))
    if isinstance(key, (numbers.Integral, np.integer)):
        if not 0 <= int(key) < 2**63:
            raise BLRError(f"{name}: an int seed must be non-negative and below 2**63, not {key}")
        return seed_key(int(key))
    if isinstance(key, (jax.Array, np.ndarray)) and not isinstance(key, jax.core.Tracer):
        dtype = key.dtype
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            if key.shape != ():
                raise BLRError(f"{name} must be one key, not a batch of keys of shape {key.shape}")
            return key
        if dtype == np.uint32:
            try:
                wrapped = jax.random.wrap_key_data(key if isinstance(key, jax.Array) else jax.device_put(key))
            except (TypeError, ValueError):
                wrapped = None
            if wrapped is not None and wrapped.shape == ():
                return wrapped
    if isinstance(key, jax.core.Tracer):
        if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
            return key
        return jax.random.wrap_key_data(key)
    raise BLRError(_key_message(name, key))


def seed_key(seed: int):
    """``jax.random.key(seed)``, built on the host (no XLA computation) for the default
    threefry implementation, whose key of a seed holds its high and low 32-bit words."""
    if str(jax.config.jax_default_prng_impl) != "threefry2x32":
        return jax.random.key(seed)
    words = np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], np.uint32)
    return jax.random.wrap_key_data(words)


_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _threefry2x32(k1, k2, x1, x2):
    """The Threefry-2x32 block cipher with 20 rounds (Salmon et al. 2011, "Parallel random
    numbers: as easy as 1, 2, 3"), on NumPy ``uint32`` arrays (arithmetic modulo 2³²): the
    hash under JAX's default PRNG."""
    k1, k2 = np.uint32(k1), np.uint32(k2)
    ks = (k1, k2, k1 ^ k2 ^ np.uint32(0x1BD11BDA))
    x = [np.asarray(x1, np.uint32) + ks[0], np.asarray(x2, np.uint32) + ks[1]]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x[0] = x[0] + x[1]
            x[1] = (x[1] << np.uint32(r)) | (x[1] >> np.uint32(32 - r))
            x[1] = x[0] ^ x[1]
        x[0] = x[0] + ks[(i + 1) % 3]
        x[1] = x[1] + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x


def _threefry_words(key):
    """The two key words of a concrete threefry key, or None for other keys."""
    if isinstance(key, jax.core.Tracer) or str(jax.random.key_impl(key)) not in ("threefry2x32", "fry"):
        return None
    data = np.asarray(jax.random.key_data(key))
    return (data[0], data[1]) if data.shape == (2,) else None


def host_split(key, num: int) -> list:
    """``list(jax.random.split(key, num))`` computed on the host (no XLA computation: a
    fit's setup would otherwise compile a split program in every new process); the same
    keys as ``jax.random.split`` for threefry keys (others, and traced keys, are split by
    ``jax.random``)."""
    words = _threefry_words(key)
    if words is None:
        return list(jax.random.split(key, num))
    with np.errstate(over="ignore"):
        if jax.config.jax_threefry_partitionable:
            hi, lo = _threefry2x32(*words, np.zeros(num, np.uint32), np.arange(num, dtype=np.uint32))
            data = np.stack([hi, lo], axis=1)
        else:
            counts = np.arange(2 * num, dtype=np.uint32)
            data = np.concatenate(_threefry2x32(*words, counts[:num], counts[num:])).reshape(num, 2)
    return [jax.random.wrap_key_data(d) for d in data]


def host_fold_in(key, value: int):
    """``jax.random.fold_in(key, value)`` computed on the host (see :func:`host_split`)."""
    words = _threefry_words(key)
    if words is None:
        return jax.random.fold_in(key, value)
    with np.errstate(over="ignore"):
        a, b = _threefry2x32(*words, np.zeros(1, np.uint32), np.array([value], np.uint32))
    return jax.random.wrap_key_data(np.concatenate([a, b]))


def _key_message(name, key) -> str:
    shape = f" of shape {np.shape(key)} and dtype {getattr(key, 'dtype', type(key).__name__)}" if hasattr(key, "shape") else ""
    return (
        f"{name} must be a jax.random key (jax.random.key(0) or jax.random.PRNGKey(0)) or an int "
        f"seed, not {type(key).__name__}{shape}"
    )


# -- options -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FitOptions:
    """The checked options of a fit (hashable).

    Attributes:
        num_steps: the most steps to run.
        learning_rate: ρ: None (the defaults of :func:`blrppl.blr_fit`), a float in (0, 1]
            or a callable of the step number.
        schedule: ``"sequential"`` or ``"parallel"``; None: the plan's default
            (:func:`blrppl.engine.build.default_schedule`).
        families: ``(site, family name)`` pairs, sorted.
        structure: ``None``, ``"joint"`` or ``"mean-field"``.
        point: sites fitted by the delta method.
        mc_curvature: curvature estimator of Monte Carlo messages.
        tol: relative ELBO tolerance of the convergence test.
        progress_bar: show a progress bar.
        point_space: ``"unconstrained"`` or ``"constrained"``.
        iterate_average: report tail-averaged global blocks under subsampling.
        num_starts: fits from different starting points (mixtures); the best ELBO is kept.
        mesh: the ``jax.sharding.Mesh`` (one axis) the data are sharded over, or None
            (:mod:`blrppl.engine.sharding`); not part of the compiled fit's key: the sharded
            programs are kept on the compiled fit per mesh.
        mixtures: ``(site, K)`` pairs, sorted: the sites ``families=`` asked a mixture of K
            diagonal Gaussians for (:mod:`blrppl.engine.mixture`); ``families`` gives them
            the diagonal Gaussian the mixture starts from.
    """

    num_steps: int = DEFAULT_NUM_STEPS
    learning_rate: Any = None
    schedule: str | None = None
    families: tuple = ()
    structure: str | None = None
    point: tuple = ()
    mc_curvature: str = "auto"
    tol: float = 1e-8
    progress_bar: bool = True
    point_space: str = "unconstrained"
    iterate_average: bool = True
    num_starts: int = 1
    mesh: Any = None
    mixtures: tuple = ()

    @property
    def families_dict(self) -> dict:
        return dict(self.families)

    @property
    def rate_fn(self) -> Callable | None:
        """The step-size schedule, when ``learning_rate`` is a callable."""
        return self.learning_rate if callable(self.learning_rate) else None

    def compiled(self) -> tuple:
        """The options the compiled fit depends on (part of its cache key)."""
        return (
            self.families,
            self.schedule,
            self.rate_fn,
            self.structure,
            self.point,
            self.mc_curvature,
            self.learning_rate is None,
            self.point_space,
        )


def _real(x, name: str) -> float:
    """A finite real number from a Python/NumPy/JAX scalar."""
    if isinstance(x, (bool, np.bool_)) or isinstance(x, str):
        raise BLRError(f"{name} must be a number, not {type(x).__name__} {x!r}")
    try:
        value = float(x)
    except (TypeError, ValueError):
        raise BLRError(f"{name} must be a number, not {type(x).__name__} {x!r}") from None
    if not math.isfinite(value):
        raise BLRError(f"{name} must be finite, not {value}")
    return value


def _int(x, name: str, low: int) -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (numbers.Integral, np.integer)):
        if isinstance(x, (float, np.floating)) and float(x).is_integer():
            x = int(x)
        else:
            raise BLRError(f"{name} must be an int, not {type(x).__name__} {x!r}")
    if int(x) < low:
        raise BLRError(f"{name} must be at least {low}, not {int(x)}")
    return int(x)


def _names(x, name: str) -> tuple:
    """A tuple of site names from a name or an iterable of names."""
    if x is None:
        return ()
    if isinstance(x, str):
        return (x,)
    try:
        items = tuple(x)
    except TypeError:
        raise BLRError(f"{name} must be a site name or a list of site names, not {type(x).__name__}") from None
    bad = [v for v in items if not isinstance(v, str)]
    if bad:
        raise BLRError(f"{name} must hold site names (strings), not {bad[0]!r}")
    return items


#: ``blr_fit``'s default ``refine_budget``, in multiples of the first fit's time: the remedies
#: the poor-q advice names are a grid (a few fits' worth of run time and one compilation), the
#: other structure (one fit and its compilation) and a few starts (one run each, the compiled
#: fit reused); five first fits let the main ones run, and bound a pipeline's cost at about six
#: times that of its fits without refinement (:mod:`blrppl.engine.refine`)
REFINE_BUDGET = 5.0


def refine_options(refine, refine_budget) -> tuple:
    """``blr_fit``'s ``refine`` (a bool) and ``refine_budget`` (a finite number ≥ 0, in
    multiples of the first fit's time; None: the default), checked: ``(refine, budget)``.

    Raises:
        BLRError: either of the wrong type or out of range.
    """
    if not isinstance(refine, (bool, np.bool_)):
        raise BLRError(f"refine must be True or False, not {type(refine).__name__} {refine!r}")
    if refine_budget is None:
        return bool(refine), REFINE_BUDGET
    if isinstance(refine_budget, (bool, np.bool_)) or not isinstance(refine_budget, (numbers.Real, np.number)):
        raise BLRError(
            f"refine_budget must be a number (multiples of the first fit's time), not {type(refine_budget).__name__} "
            f"{refine_budget!r}"
        )
    if not math.isfinite(float(refine_budget)) or float(refine_budget) < 0:
        raise BLRError(f"refine_budget must be a finite number ≥ 0 (0: no refinement), not {refine_budget!r}")
    return bool(refine), float(refine_budget)


def check_schedule(schedule, call: str, error: type = BLRError):
    """A step-size schedule (a callable of an int count) whose value at count 0 is a finite
    number ≥ 0, else ``error`` saying so; ``call`` is how the message writes the call
    (``"learning_rate(step)"``)."""
    try:
        first = float(jnp.asarray(schedule(jnp.zeros((), jnp.int32))))
    except Exception as exc:  # the user's schedule
        count = call[call.index("(") + 1 : -1]
        raise error(
            f"{call} must return a number for an int {count}; at {count} 0 it raised {type(exc).__name__}: {exc}"
        ) from exc
    if not (math.isfinite(first) and first >= 0.0):
        count = call[call.index("(") + 1 : -1]
        raise error(f"{call} must be a finite number ≥ 0; at {count} 0 it is {first}")
    return schedule


def check_learning_rate(learning_rate):
    """None, a float in (0, 1], or a callable of the step whose value at step 0 is a finite
    number ≥ 0 (ρ = 0 freezes; a callable is checked again at every step of the fit)."""
    if learning_rate is None:
        return None
    if callable(learning_rate):
        return check_schedule(learning_rate, "learning_rate(step)")
    rate = _real(learning_rate, "learning_rate")
    if not 0.0 < rate <= 1.0:
        raise BLRError(f"learning_rate must be in (0, 1], not {rate}")
    return rate


def fit_options(
    *,
    num_steps=None,
    learning_rate=None,
    schedule=None,
    families=None,
    structure=None,
    point=None,
    mc_curvature="auto",
    tol=None,
    progress_bar=True,
    point_space="unconstrained",
    iterate_average=True,
    num_starts=1,
    mesh=None,
) -> FitOptions:
    """Check the keywords of :func:`blrppl.blr_fit` and freeze them.

    Raises:
        BLRError: an option of the wrong type or out of range, naming it and its values.
    """
    from blrppl.estimators.monte_carlo import CURVATURES

    num_steps = DEFAULT_NUM_STEPS if num_steps is None else _int(num_steps, "num_steps", 1)
    learning_rate = check_learning_rate(learning_rate)
    if schedule is not None and (not isinstance(schedule, str) or schedule not in SCHEDULES):
        raise BLRError(f"schedule must be one of {SCHEDULES}, not {schedule!r}")
    if families is None:
        families = {}
    if not isinstance(families, Mapping):
        raise BLRError(
            f"families must be a dict site → family name (e.g. {{'w': 'gaussian-diag'}}), not "
            f"{type(families).__name__}"
        )
    families, mixtures = _mixture_families(families, structure)
    for site, family in families.items():
        if not isinstance(site, str) or not isinstance(family, str):
            raise BLRError(f"families must map site names to family names (strings), not {site!r}: {family!r}")
    if not isinstance(structure, (str, type(None))) or structure not in STRUCTURES:
        raise BLRError(f"structure must be 'joint' or 'mean-field', not {structure!r}")
    point = _names(point, "point")
    if not isinstance(mc_curvature, str) or mc_curvature not in CURVATURES:
        raise BLRError(f"mc_curvature must be one of {CURVATURES}, not {mc_curvature!r}")
    x64 = jnp.result_type(float) == jnp.float64
    if tol is None:
        tol = 1e-8 if x64 else 1e-5
    else:
        tol = _real(tol, "tol")
        if not 0.0 < tol < 1.0:
            raise BLRError(f"tol is a relative ELBO change and must lie in (0, 1), e.g. 1e-6; not {tol}")
    if not isinstance(point_space, str) or point_space not in POINT_SPACES:
        raise BLRError(f"point_space must be 'unconstrained' or 'constrained', not {point_space!r}")
    for flag, value in (("progress_bar", progress_bar), ("iterate_average", iterate_average)):
        if not isinstance(value, (bool, np.bool_, numbers.Integral)):
            raise BLRError(f"{flag} must be True or False, not {value!r}")
    return FitOptions(
        num_steps=num_steps,
        learning_rate=learning_rate,
        schedule=schedule,
        families=tuple(sorted(families.items())),
        structure=structure,
        point=point,
        mc_curvature=mc_curvature,
        tol=tol,
        progress_bar=bool(progress_bar),
        point_space=point_space,
        iterate_average=bool(iterate_average),
        num_starts=_int(num_starts, "num_starts", 1),
        mesh=as_mesh(mesh),
        mixtures=mixtures,
    )


def as_mesh(mesh):
    """The device mesh of ``mesh=``: None, a ``jax.sharding.Mesh`` of one axis, or an int n,
    the first n of ``jax.devices()`` as a mesh of one axis named ``"data"``.

    Raises:
        MeshError: a mesh of several axes, one over several processes that does not hold this
            process's devices grouped by process, a count that is not a positive int or exceeds the devices there are, or anything else.
    """
    if mesh is None:
        return None
    if isinstance(mesh, jax.sharding.Mesh):
        if len(mesh.axis_names) != 1:
            raise MeshError(
                f"mesh= must have one axis (the plates are sharded along it), not {len(mesh.axis_names)} "
                f"{tuple(mesh.axis_names)}: build it as jax.sharding.Mesh(np.array(jax.devices()), ('data',))"
            )
        if spans_processes(mesh):
            check_mesh(mesh)  # (a fit over several processes: blrppl.engine.processes)
        return mesh
    if isinstance(mesh, (bool, np.bool_)) or not isinstance(mesh, numbers.Integral):
        raise MeshError(
            f"mesh= must be a jax.sharding.Mesh of one axis or a device count (an int), not {type(mesh).__name__}"
        )
    devices = jax.devices()
    if int(mesh) < 1:
        raise MeshError(f"mesh={int(mesh)}: give a device count of at least 1 (or a jax.sharding.Mesh)")
    if int(mesh) > len(devices):
        raise MeshError(
            f"mesh={int(mesh)} devices, but JAX sees {len(devices)} ({devices[0].platform}): give at most "
            f"{len(devices)} (on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts "
            "makes N host devices)"
        )
    return jax.sharding.Mesh(np.array(devices[: int(mesh)]), ("data",))


def _mixture_families(families: Mapping, structure) -> tuple:
    """``families=`` with its mixtures read off: ``(families, mixtures)``, every site asked
    for ``"gaussian-mixture"`` or ``("gaussian-mixture", K)`` listed as ``(site, K)`` and given
    the Gaussian its mixture starts from (:mod:`blrppl.engine.mixture`): by default none (the
    block the fit gives it), with ``structure="joint"`` dense, merged into the joint block,
    with ``structure="mean-field"`` diagonal, a block of its own.

    Raises:
        BLRError: a tuple that is not ``("gaussian-mixture", K)`` with K a positive integer,
            naming the site and the spelling.
    """
    from blrppl.families.gaussian_mixture import DEFAULT_COMPONENTS, NAME

    out, mixtures = {}, []
    for site, family in families.items():
        if family == NAME:
            family = (NAME, DEFAULT_COMPONENTS)
        if not isinstance(family, tuple):
            out[site] = family
            continue
        count = family[1] if len(family) == 2 else None
        if (
            len(family) != 2 or family[0] != NAME or isinstance(count, (bool, np.bool_))
            or not isinstance(count, numbers.Integral) or count < 1
        ):
            raise BLRError(
                f"families= gives {family!r}: a mixture is spelled ('{NAME}', K) with K a positive integer "
                f"(e.g. ('{NAME}', 4)), or '{NAME}' for {DEFAULT_COMPONENTS} components",
                site=site if isinstance(site, str) else None,
            )
        if structure is not None:  # (by default the fit's own block, see blrppl.engine.mixture)
            out[site] = "gaussian" if structure == "joint" else "gaussian-diag"
        mixtures.append((site, int(count)))
    return out, tuple(sorted(mixtures))


# -- data ----------------------------------------------------------------------------


def model_arguments(data) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of the model from ``data`` (a dict of keyword arguments, a tuple of
    positional ones, or one array: the model's only positional argument), with array-likes
    converted (see the module docstring).

    Raises:
        ModelTraceError: ``data`` is neither a dict, a tuple/list nor an array, or a dict key
            is not a string.
        ObservedDataError: an argument holds complex numbers.
    """
    if data is None:
        return (), {}
    if isinstance(data, Mapping):
        bad = [k for k in data if not isinstance(k, str)]
        if bad:
            raise ModelTraceError(f"data must be a dict of the model's keyword arguments; {bad[0]!r} is not a name")
        return (), {k: _convert(v, k) for k, v in data.items()}
    if isinstance(data, (tuple, list)):
        return tuple(_convert(v, f"data[{i}]") for i, v in enumerate(data)), {}
    if _lone_array(data):
        # (the model's only argument, as NumPyro's ``mcmc.run(key, data)`` passes it)
        return (_convert(data, "data"),), {}
    raise ModelTraceError(
        "data must be a dict of model keyword arguments, a tuple of positional ones or one array (the "
        f"model's only argument), not {type(data).__name__}; pass other values as (value,) or {{'name': value}}"
    )


def _lone_array(x) -> bool:
    """An array given as ``data`` itself: a NumPy or JAX array, or a pandas Series, Index or
    DataFrame."""
    return isinstance(x, (np.ndarray, jax.Array)) or _pandas(x, "Series", "Index", "DataFrame")


def _pandas(x, *kinds: str) -> bool:
    """Whether ``x`` is a pandas object of one of these class names (pandas is not imported)."""
    return (type(x).__module__ or "").startswith("pandas") and type(x).__name__ in kinds


def call_arguments(args, kwargs) -> tuple[tuple, dict]:
    """The model arguments of a ``BLR`` call (``*args, **kwargs``), converted like ``data``."""
    return (
        tuple(_convert(v, f"args[{i}]") for i, v in enumerate(args)),
        {k: _convert(v, k) for k, v in kwargs.items()},
    )


def _is_number(x) -> bool:
    return isinstance(x, (numbers.Number, np.number)) and not isinstance(x, (bool, np.bool_))


def _numeric_list(x) -> bool:
    """A (nested, rectangular) list of real numbers with at least one float in it."""
    flat = []

    def walk(v):
        if isinstance(v, list):
            return all(walk(u) for u in v)
        if _is_number(v) and not isinstance(v, (complex, np.complexfloating)):
            flat.append(v)
            return True
        return False

    if not walk(x) or not flat or not any(isinstance(v, (float, np.floating)) for v in flat):
        return False
    try:
        arr = np.asarray(x)
    except ValueError:  # ragged
        return False
    return arr.dtype != object


def _convert(x, name: str):
    """One data argument (or a container of them), converted; the user's object is never
    modified (conversions make new arrays)."""
    if isinstance(x, list) and _numeric_list(x):
        return np.asarray(x, dtype=float)
    if isinstance(x, dict):
        return type(x)({k: _convert(v, f"{name}[{k!r}]") for k, v in x.items()}) if type(x) is dict else x
    if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
        return type(x)(_convert(v, f"{name}[{i}]") for i, v in enumerate(x))
    if _pandas(x, "Series", "Index"):
        x = x.to_numpy()
    if isinstance(x, np.ndarray):
        if x.dtype == object:
            try:
                converted = np.asarray(x.tolist(), dtype=float)
            except (TypeError, ValueError):
                return x  # not numbers: the model decides what it does with them
            if converted.shape == x.shape:
                return converted
            return x
        if np.issubdtype(x.dtype, np.complexfloating):
            raise ObservedDataError(
                f"data argument '{name}' holds complex numbers; blrppl fits real-valued models "
                "(pass the real and imaginary parts as separate real arrays)"
            )
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and jnp.issubdtype(x.dtype, jnp.complexfloating):
        raise ObservedDataError(f"data argument '{name}' holds complex numbers; blrppl fits real-valued models")
    return x


def argument_names(args, kwargs) -> list[str]:
    """The names of the array arguments among ``(args, kwargs)`` (``'y'``, ``'args[0]'``,
    ``"data['x']"``), in the order of :meth:`blrppl.graph.data.DataSpec.split`'s arrays."""
    paths = jax.tree_util.tree_flatten_with_path((tuple(args), dict(kwargs)), is_leaf=lambda x: x is None)[0]
    names = []
    for path, leaf in paths:
        if not is_numeric_array(leaf):
            continue
        first = path[1]
        name = str(getattr(first, "key", None)) if path[0].idx == 1 else f"args[{getattr(first, 'idx', 0)}]"
        names.append(name + jax.tree_util.keystr(path[2:]))
    return names


def as_compiled_dtype(value, dtype, name: str, entry: str):
    """An array argument in ``dtype``, the dtype a program was compiled for, when it came in
    another: converted when the conversion is numpy's promotion (booleans and integers to
    floats, a safe cast) or keeps its values (checked on concrete values: float64 data
    that float32 holds exactly, integral floats to integers).

    Args:
        value: the argument (a NumPy or JAX array, possibly traced).
        dtype: the dtype the program takes.
        name: the argument's name, for the error.
        entry: the call that compiled the program (``"BLR.init"``), for the error.

    Raises:
        BLRError: a conversion that would change values (or cannot be checked on traced
            values), naming the argument, its dtype and the one compiled for.
    """
    if value.dtype == dtype:  # (also keys, whose dtypes numpy does not know)
        return value
    source, target = np.dtype(value.dtype), np.dtype(dtype)
    traced = isinstance(value, jax.core.Tracer)
    floats = jnp.issubdtype(source, jnp.floating), jnp.issubdtype(target, jnp.floating)
    if (floats[1] and not floats[0]) or np.can_cast(source, target, "safe"):  # (numpy's promotion)
        return jnp.asarray(value, target) if traced else jax.device_put(np.asarray(value).astype(target))
    if not traced:
        host = np.asarray(value)
        with np.errstate(invalid="ignore", over="ignore"):
            cast = host.astype(target)
            same = cast == host
            if all(floats):
                same |= np.isnan(host) & np.isnan(cast)
        if bool(np.all(same)):
            return jax.device_put(cast)
    raise BLRError(
        f"data argument '{name}' is {source}, with values that {target} (the dtype {entry} compiled "
        f"for) does not hold exactly; pass it as {target}, or call {entry} again with these arguments"
    )


def is_numeric_array(x) -> bool:
    """Arrays that travel into jit as data: JAX arrays, and NumPy arrays of numbers or
    booleans (other NumPy arrays, e.g. of strings, reach the model as they are)."""
    if isinstance(x, jax.Array):
        return True
    if isinstance(x, np.ndarray) and not isinstance(x, np.generic):
        return bool(np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_)
    return False


def data_hint(args, kwargs) -> str:
    """A hint for a model that failed on its data: arguments that are Python lists,
    arrays of non-numbers or pandas DataFrames (passed as they are, for a model that reads
    their columns), which NumPyro models cannot compute with as arrays ("" if none)."""
    hints = []
    for name, x in [(f"args[{i}]", v) for i, v in enumerate(args)] + list(kwargs.items()):
        if isinstance(x, list):
            hints.append(f"'{name}' is a Python list (pass np.asarray({name}))")
        elif _pandas(x, "DataFrame"):
            hints.append(f"'{name}' is a pandas DataFrame, passed as it is (pass its .to_numpy() for a model that computes with it as an array)")
        elif isinstance(x, np.ndarray) and not is_numeric_array(x):
            hints.append(f"'{name}' is an array of {x.dtype} values, not numbers")
    return ("; data argument " + ", ".join(hints)) if hints else ""
