"""Tracing a NumPyro model into site records.

The model is run once, with latent values taken from numpyro's initialisation strategies
(never by forward sampling a site that cannot be sampled, such as ``ImproperUniform``), and
every sample site is recorded with its distribution unwrapped: ``Independent`` becomes
reinterpreted event dims, ``ExpandedDistribution`` a broadcast, ``MaskedDistribution`` a
mask.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from collections import OrderedDict
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from numpyro import handlers
from numpyro.distributions import constraints
from numpyro.primitives import Messenger
from numpyro.infer.initialization import init_to_uniform

from blrppl.graph.data import DataSpec
from blrppl.graph.plan import SubsampledPlate
from blrppl.errors import ModelTraceError, ObservedDataError, UnsupportedFactorError, UnsupportedLatentError


@dataclasses.dataclass(frozen=True)
class Plate:
    """A plate a site sits in: ``dim`` counts from the right of the batch dims."""

    name: str
    size: int
    dim: int
    subsample_size: int


@dataclasses.dataclass
class SiteRecord:
    """What the compiler needs to know about one sample site.

    Attributes:
        name: site name.
        observed: True for observed sites and ``numpyro.factor`` terms.
        is_factor: True for ``numpyro.factor`` terms (opaque log-density).
        dist_type: type of the distribution with Independent/Expanded/Masked wrappers removed.
        reinterpreted_ndim: batch dims of ``base`` reinterpreted as event dims.
        has_mask: whether a mask wraps the distribution.
        value_shape: shape of the site value.
        event_ndim: event dims of the full (wrapped) distribution.
        support: the support constraint of the site.
        plates: plates the site is in, outermost first.
        has_scale: whether the site carries a ``scale`` (subsampling, ``handlers.scale``).
        infer: the site's ``infer`` dict.
        init_value: the value the trace used (data for observed sites; the user's initial
            value for ``numpyro.param`` sites).
        is_param: a ``numpyro.param`` site: not random, fitted as a point estimate of the
            model's log density in its own (constrained) space; ``support`` is its
            constraint, ``event_ndim`` its ``event_dim`` (all its dims when unspecified) and
            ``plates`` the plates that index its batch dims.
    """

    name: str
    observed: bool
    is_factor: bool
    dist_type: type
    reinterpreted_ndim: int
    has_mask: bool
    value_shape: tuple
    event_ndim: int
    support: Any
    plates: tuple
    has_scale: bool
    infer: dict
    init_value: Any
    is_param: bool = False

    @property
    def dist_name(self) -> str:
        return self.dist_type.__name__

    @property
    def batch_ndim(self) -> int:
        return len(self.value_shape) - self.event_ndim

    def plate_axes(self) -> tuple[int, ...]:
        """Positions, in the value shape, of the plate dims (outermost plate first)."""
        axes = []
        for plate in self.plates:
            axes.append(self.batch_ndim + plate.dim)
        return tuple(axes)


class Param:
    """Marker ``dist_type`` of ``numpyro.param`` sites (they have no distribution)."""


def unwrap(fn):
    """Remove Independent / Expanded / Masked wrappers.

    Returns:
        (base distribution, reinterpreted batch ndims, mask or None)
    """
    reinterpreted = 0
    mask = None
    while True:
        if isinstance(fn, dist.Independent):
            reinterpreted += fn.reinterpreted_batch_ndims
            fn = fn.base_dist
        elif isinstance(fn, dist.ExpandedDistribution):
            fn = fn.base_dist
        elif isinstance(fn, dist.MaskedDistribution):
            m = fn._mask
            if m is not True:
                mask = m if mask is None else jnp.logical_and(mask, m)
            fn = fn.base_dist
        else:
            return fn, reinterpreted, mask


def reduce_wrapped(fn, elementwise):
    """Apply the wrappers of ``fn`` to per-element log-densities of its base distribution.

    Walks from the innermost wrapper out, as ``fn.log_prob`` does: ``Independent`` sums its
    reinterpreted dims, ``MaskedDistribution`` zeroes masked elements at its own level,
    ``ExpandedDistribution`` broadcasts to its batch shape.

    Returns:
        log-density terms with the batch shape of ``fn``.
    """
    chain = []
    while isinstance(fn, (dist.Independent, dist.ExpandedDistribution, dist.MaskedDistribution)):
        chain.append(fn)
        fn = fn.base_dist
    out = elementwise
    for wrapper in reversed(chain):
        if isinstance(wrapper, dist.Independent):
            n = wrapper.reinterpreted_batch_ndims
            out = out.sum(axis=tuple(range(-n, 0))) if n else out
        elif isinstance(wrapper, dist.ExpandedDistribution):
            out = jnp.broadcast_to(out, jnp.broadcast_shapes(jnp.shape(out), wrapper.batch_shape))
        else:
            mask = wrapper._mask
            if mask is not True:
                out = jnp.where(mask, out, 0.0)
    return out


def finite_support_values(support) -> np.ndarray | None:
    """The values of a finite discrete support, or None if it is unbounded."""
    if support is constraints.boolean:
        return np.arange(2)
    if isinstance(support, constraints._IntegerInterval):
        lo, hi = np.asarray(support.lower_bound), np.asarray(support.upper_bound)
        if lo.size and hi.size and np.all(lo == lo.flat[0]) and np.all(hi == hi.flat[0]):
            return np.arange(int(lo.flat[0]), int(hi.flat[0]) + 1)
    return None


def init_to_prior_mean(site=None):
    """numpyro init strategy: the prior mean where it is finite, else a uniform draw in
    (−2, 2) on the unconstrained space. Never samples the prior (cheap to compile, works for
    ``ImproperUniform``)."""
    if site is None:
        return init_to_prior_mean
    if site["type"] != "sample" or site["is_observed"] or site["fn"].support.is_discrete:
        return None
    fallback = init_to_uniform(site)
    try:
        mean = jnp.broadcast_to(1.0 * site["fn"].mean, jnp.shape(fallback))
    except (NotImplementedError, ValueError, TypeError):
        return fallback
    return jnp.where(jnp.isfinite(mean), mean, fallback)


def _split_data(args, kwargs):  # noqa: D103
    return args if args is not None else (), kwargs if kwargs is not None else {}


class ModelTracer:
    """A jitted run of the model from its initialisation strategy.

    Static facts about the sites are collected in ``meta`` the first time the function is
    traced; later calls with data of the same shapes reuse the compiled run.
    """

    def __init__(self, model, spec: DataSpec, init_strategy):
        self.spec = spec
        self.meta: dict = {}
        self.fn = jax.jit(partial(_run_once, model, spec, init_strategy, self.meta))

    def __call__(self, dyn, rng_key):
        return self.fn(dyn, rng_key)


def trace_model(
    model, args=(), kwargs=None, rng_key=None, init_strategy=init_to_prior_mean, tracer=None
):
    """Run ``model`` once and record its sample sites.

    Latent values come from ``init_strategy`` (:func:`init_to_prior_mean` by default; any
    numpyro init strategy works); discrete latents are drawn from their prior. The run is jitted with the data's arrays as
    arguments; a model that needs concrete data (e.g. calls ``np.asarray`` on an argument)
    is run again with the data as constants, and the engine then does the same.

    Args:
        tracer: a :class:`ModelTracer` from an earlier call with data of the same shapes.

    Returns:
        (OrderedDict site name → :class:`SiteRecord` in the order the model runs them,
        the :class:`DataSpec`, the dynamic data leaves, the :class:`ModelTracer`)

    Raises:
        ModelTraceError: the model raised while running with the data given.
        ObservedDataError: observed values are non-finite.
        UnsupportedLatentError: a latent has unbounded discrete support.
    """
    args, kwargs = _split_data(args, kwargs)
    rng_key = jax.random.key(0) if rng_key is None else rng_key
    if tracer is None:
        spec, dyn = DataSpec.split(args, kwargs)
        tracer = ModelTracer(model, spec, init_strategy)
    else:
        spec, dyn = tracer.spec, DataSpec.split(args, kwargs)[1]
    try:
        try:
            outputs = tracer(dyn, rng_key)
        except _NEEDS_CONCRETE:
            spec, dyn = DataSpec.split(args, kwargs, all_static=True)
            tracer = ModelTracer(model, spec, init_strategy)
            outputs = tracer(dyn, rng_key)
    except Exception as exc:  # any failure of the user's model
        last = tracer.meta.get("last")
        name = last.name if last is not None else None
        where = f"after site '{name}'" if name is not None else "before its first site"
        if isinstance(exc, ValueError) and "numpyro.subsample" in str(exc):
            raise ObservedDataError(
                f"the model's data do not match its subsampled plate ({exc}); the plate's size "
                "must be the length of the data along the plate's dim: declare it as "
                "numpyro.plate(name, len(data), subsample_size=M)",
                site=name,
            ) from exc
        raise ModelTraceError(
            f"the model could not be run with the data given: it raised {where} "
            f"({type(exc).__name__}: {exc}); check that `data` holds the model's arguments "
            "(a dict of keyword arguments or a tuple of positional ones)",
            site=name,
        ) from exc
    records: OrderedDict[str, SiteRecord] = OrderedDict()
    for info in tracer.meta["sites"]:
        name = info["name"]
        if info["type"] == "param":
            records[name] = _param_record(info, outputs)
            continue
        value = np.asarray(outputs["values"][name])
        support = info["support"]
        if name in outputs["bounds"]:
            lo, hi = outputs["bounds"][name]
            support = constraints.integer_interval(np.asarray(lo), np.asarray(hi))
        observed = info["observed"]
        if observed and not info["is_factor"]:
            if np.issubdtype(value.dtype, np.number) and not np.all(np.isfinite(value)):
                bad = int(np.size(value) - np.isfinite(value).sum())
                raise ObservedDataError(
                    f"{bad} observed value(s) are NaN or infinite; drop them or mask them "
                    "with numpyro.handlers.mask / obs_mask",
                    site=name,
                )
        if observed and not info["is_factor"]:
            try:
                shape = np.broadcast_shapes(value.shape, info["dist_shape"])
            except ValueError:
                shape = None
            if shape != value.shape:
                raise ObservedDataError(
                    f"observed value of shape {value.shape} does not match the distribution's "
                    f"shape {info['dist_shape']} (batch + event); check the data and the plates "
                    "around the site",
                    site=name,
                )
            if not bool(outputs["in_support"][name]):
                raise ObservedDataError(
                    f"observed values lie outside the support {support} of "
                    f"{info['dist_type'].__name__}",
                    site=name,
                )
        if not observed and support.is_discrete and finite_support_values(support) is None:
            raise UnsupportedLatentError(
                f"latent {info['dist_type'].__name__} has unbounded discrete support ({support}); "
                "only finite discrete latents (Bernoulli, Categorical, bounded integers) can be "
                "enumerated: marginalise it out by hand or give it a bounded support",
                site=name,
            )
        records[name] = SiteRecord(
            name=name,
            observed=observed,
            is_factor=info["is_factor"],
            dist_type=info["dist_type"],
            reinterpreted_ndim=info["reinterpreted_ndim"],
            has_mask=info["has_mask"],
            value_shape=tuple(value.shape),
            event_ndim=info["event_ndim"],
            support=support,
            plates=info["plates"],
            has_scale=info["has_scale"],
            infer=info["infer"],
            init_value=value,
        )
    if not any(not r.observed for r in records.values()):
        raise ModelTraceError("the model has no latent sample site or param to infer")
    return records, spec, dyn, tracer


def _param_record(info, outputs) -> SiteRecord:
    """The record of a ``numpyro.param`` site, after checking that it can be fitted."""
    name = info["name"]
    value = np.array(outputs["values"][name])  # a copy: the user's init is never touched
    constraint = info["support"]
    if constraint.is_discrete:
        raise ModelTraceError(
            f"numpyro.param has the discrete constraint {constraint}; params are fitted by "
            "Newton's method on a continuous space: declare the quantity with numpyro.sample "
            "(a finite discrete latent is enumerated) instead",
            site=name,
        )
    if not np.all(np.isfinite(value)):
        raise ModelTraceError("numpyro.param has a NaN or infinite initial value", site=name)
    if not bool(outputs["in_support"][name]):
        raise ModelTraceError(
            f"the initial value of numpyro.param lies outside its constraint {constraint}; "
            "give an initial value inside it (it is the starting point of the fit)",
            site=name,
        )
    event_dim = info["event_dim"]
    shape = tuple(value.shape)
    if event_dim is None:  # numpyro: every dim is an event dim, nothing is batched
        event_ndim, plates = len(shape), ()
    else:
        event_ndim = int(event_dim)
        batch_ndim = len(shape) - event_ndim
        plates = []
        for p in info["plates"]:
            axis = batch_ndim + p.dim
            if axis < 0 or shape[axis] == 1:
                continue  # the param broadcasts along this plate
            if p.subsample_size != p.size:
                raise ModelTraceError(
                    f"numpyro.param(..., event_dim={event_dim}) sits in the subsampled plate "
                    f"'{p.name}' (subsample_size={p.subsample_size} of {p.size}); blr_fit "
                    "does not subsample params: drop subsample_size, or move the param "
                    "outside the plate",
                    site=name,
                )
            plates.append(p)
        plates = tuple(plates)
    return SiteRecord(
        name=name,
        observed=False,
        is_factor=False,
        dist_type=Param,
        reinterpreted_ndim=0,
        has_mask=False,
        value_shape=shape,
        event_ndim=event_ndim,
        support=constraint,
        plates=plates,
        has_scale=False,
        infer={},
        init_value=value,
        is_param=True,
    )


def _initial(init_strategy, site):
    """Initial values: ``init_strategy`` for latent sites; a param's own initial value as a
    JAX array (as numpyro's SVI hands params to the model: a NumPy initial value would
    otherwise reach the model as NumPy and fail to index with traced arrays)."""
    if site["type"] == "param":
        return jnp.asarray(site["args"][0]) if site["args"] else None
    return init_strategy(site)


def _run_once(model, spec, init_strategy, meta, dyn, rng_key):
    """Trace the model; static facts go to ``meta``, arrays are returned."""
    args, kwargs = spec.merge(dyn)
    last = _LastSite(handlers.substitute(handlers.seed(model, rng_key), substitute_fn=partial(_initial, init_strategy)))
    meta["last"] = last
    tr = handlers.trace(last).get_trace(*args, **kwargs)
    sites, values, bounds, checks = [], {}, {}, {}
    plate_sizes = {
        name: int(site["args"][0]) for name, site in tr.items() if site["type"] == "plate"
    }
    for name, site in tr.items():
        if site["type"] == "param":
            kwargs = site.get("kwargs") or {}
            constraint = kwargs.get("constraint", constraints.real)
            value = jnp.asarray(site["value"])
            if not jnp.issubdtype(value.dtype, jnp.floating):
                value = value.astype(jnp.result_type(float))  # e.g. numpyro.param("s", 1)
            values[name] = value
            checks[name] = jnp.all(constraint(value))
            sites.append(
                {
                    "name": name,
                    "type": "param",
                    "support": constraint,
                    "event_dim": kwargs.get("event_dim"),
                    "plates": tuple(
                        Plate(f.name, plate_sizes.get(f.name, int(f.size)), int(f.dim), int(f.size))
                        for f in reversed(site["cond_indep_stack"])
                    ),
                }
            )
            continue
        if site["type"] != "sample":
            continue
        fn = site["fn"]
        base, reinterpreted, mask = unwrap(fn)
        support = fn.support
        if isinstance(support, constraints._IntegerInterval):
            bounds[name] = (jnp.asarray(support.lower_bound), jnp.asarray(support.upper_bound))
        values[name] = site["value"]
        if site["is_observed"] and not isinstance(base, dist.Unit):
            checks[name] = jnp.all(fn.support(site["value"]))
        sites.append(
            {
                "name": name,
                "type": "sample",
                "observed": bool(site["is_observed"]),
                "is_factor": isinstance(base, dist.Unit),
                "dist_type": type(base),
                "reinterpreted_ndim": reinterpreted,
                "has_mask": mask is not None,
                "event_ndim": fn.event_dim,
                "dist_shape": tuple(fn.batch_shape) + tuple(fn.event_shape),
                "support": support,
                "plates": tuple(
                    Plate(f.name, plate_sizes.get(f.name, int(f.size)), int(f.dim), int(f.size))
                    for f in reversed(site["cond_indep_stack"])
                ),
                "has_scale": site.get("scale") is not None,
                "infer": dict(site.get("infer") or {}),
            }
        )
    meta["sites"] = sites
    return {"values": values, "bounds": bounds, "in_support": checks}


class PlateIndices(Messenger):
    """Chooses the elements subsampled plates use: ``indices`` maps a plate name to the
    integer indices of its minibatch (length M ≤ N), which the model then sees as the
    plate's subsample (``with numpyro.plate(...) as idx``, ``numpyro.subsample``); numpyro's
    plate scales the sites inside it by N/M. With ``arange(N)`` the plate is not subsampled.

    The engine passes indices explicitly because its re-runs of the model carry no seed
    handler (numpyro would otherwise draw them from a PRNG key).
    """

    def __init__(self, fn=None, indices=None):
        super().__init__(fn)
        self.indices = dict(indices or {})

    def process_message(self, msg):
        if msg["type"] == "plate" and msg.get("name") in self.indices:
            idx = self.indices[msg["name"]]
            msg["value"] = jnp.asarray(idx)
            msg["args"] = (msg["args"][0], int(jnp.shape(idx)[0]))


def subsampled_plates(records) -> tuple:
    """The plates declared with a ``subsample_size`` below their size, outermost first.

    Raises:
        UnsupportedFactorError: a site sits in two subsampled plates (nested subsampling),
            or a plate name is used with different sizes.
    """
    found: dict = {}
    for r in records.values():
        inside = [p for p in r.plates if p.subsample_size != p.size]
        if len(inside) > 1:
            names = ", ".join(f"'{p.name}'" for p in inside)
            raise UnsupportedFactorError(
                f"the site is inside the nested subsampled plates {names}; blr_fit subsamples "
                "one plate per site: give the other plate(s) no subsample_size",
                site=r.name,
            )
        for p in inside:
            known = found.setdefault(p.name, SubsampledPlate(p.name, p.size, p.subsample_size, p.dim))
            if (known.size, known.subsample_size) != (p.size, p.subsample_size):
                raise UnsupportedFactorError(
                    f"plate '{p.name}' is declared with size {known.size} / subsample_size "
                    f"{known.subsample_size} and again with {p.size} / {p.subsample_size}; "
                    "declare it once and reuse the plate object",
                    site=r.name,
                )
    return tuple(found.values())


def check_plate_sizes(plates, args, kwargs, records) -> None:
    """A subsampled plate's size must be the number of data elements it indexes: some data
    array must have an axis of that length (a size that matches no array would make the
    minibatches index past the data or never reach part of it).

    Raises:
        ObservedDataError: no data array has an axis of the plate's size.
    """
    arrays = [
        np.shape(x)
        for x in jax.tree.leaves((tuple(args), dict(kwargs)))
        if isinstance(x, (np.ndarray, jax.Array)) and np.ndim(x) > 0
    ]
    if not arrays:
        return
    for p in plates:
        if any(p.size in shape for shape in arrays):
            continue
        sites = [r.name for r in records.values() if r.observed and any(q.name == p.name for q in r.plates)]
        shapes = ", ".join(str(tuple(s)) for s in arrays)
        raise ObservedDataError(
            f"the subsampled plate '{p.name}' has size {p.size} but no data array has an axis "
            f"of that length (data shapes: {shapes}); declare the plate with the number of data "
            f"elements, e.g. numpyro.plate('{p.name}', len(y), subsample_size={p.subsample_size})",
            site=sites[0] if sites else None,
        )


def full_size_model(model, plates):
    """``model`` with every subsampled plate in ``plates`` using all its elements (for
    validating all observed data and initialising every element of the local latents)."""
    indices = {p.name: np.arange(p.size) for p in plates}

    def full(*args, **kwargs):
        return PlateIndices(model, indices)(*args, **kwargs)

    return full


_NEEDS_CONCRETE = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
)


class _LastSite(Messenger):
    """Remembers the name of the last site the model reached."""

    def __init__(self, fn=None):
        super().__init__(fn)
        self.name = None

    def process_message(self, msg):
        if msg.get("name") is not None:
            self.name = msg["name"]
