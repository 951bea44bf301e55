"""Checks of a traced model's sites, and the errors that name what to fix.

The traced run of the model (:mod:`blrppl.model.trace`) computes, inside its own program,
whether each site's arguments satisfy their constraints, whether observed values lie in
the support, and how many NaN each argument and log-density holds; the functions here
turn those into errors naming the site and the fix, and refuse distributions blrppl cannot
rebuild from their pytrees.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from numpyro.distributions import constraints
from numpyro.primitives import Messenger

from blrppl.errors import BLRError, ModelTraceError, ObservedDataError, UnsupportedFactorError, UnsupportedLatentError
from blrppl.model.records import Param, SiteRecord, concrete_support, unwrap


NEEDS_CONCRETE = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.NonConcreteBooleanIndexError,
)


#: latent sites of one structure outside any plate (a Python loop's, one per group or step)
#: beyond which a model is refused as it runs, before it is traced further: 3,000 scalar
#: sites of a hierarchical loop grew past 6 GB with no result. Fewer are refused by the
#: structure pass when they stay blocks of their own (:data:`MAX_LOOSE_BLOCKS`); a chain
#: written one site per step (x_t ~ Normal(x_{t-1}, 1)) is one banded block and fits
#: (450 steps: 90 s on 2 busy cores)
MAX_LOOSE_LATENTS = 2000
#: ... and the latent sites of one structure outside any plate that the structure pass
#: leaves as blocks of their own beyond which a model is refused (neither one joint block
#: nor one chain: the step's and the compilation's size grow with each block; on 2 cores,
#: 400 scalar sites of a hierarchical loop fitted jointly in 67 s at 1 GB, 500 left apart
#: reached 7.8 GB with no result after 13 minutes)
MAX_LOOSE_BLOCKS = 400


class LooseLatents(Messenger):
    """Counts the latent sites outside any plate by structure (their names up to digits, the
    distribution's type, the value's shape) while the model runs, and stops the run at the
    first structure past :data:`MAX_LOOSE_LATENTS`, before the rest of the model is traced.

    Raises:
        UnsupportedLatentError: naming the group's first and latest site and the plate that
            would hold them as one site.
    """

    def __init__(self, fn=None):
        super().__init__(fn)
        self.groups: dict = {}

    def postprocess_message(self, msg):
        if msg["type"] != "sample" or msg.get("is_observed") or msg.get("cond_indep_stack"):
            return
        base = unwrap(msg["fn"])[0]
        key = (re.sub(r"[0-9]+", "#", msg["name"]), type(base), tuple(jnp.shape(msg["value"])))
        names = self.groups.setdefault(key, [])
        names.append(msg["name"])
        if len(names) > MAX_LOOSE_LATENTS:
            raise loose_latents_error(names, type(base).__name__, key[0], MAX_LOOSE_LATENTS)


def loose_latent_groups(records, names) -> dict:
    """The latent sites among ``names`` outside any plate, grouped by structure (their names
    up to digits, the distribution's type, the value's shape): key → site names."""
    groups: dict = {}
    for name in names:
        r = records.get(name)
        if r is None or r.observed or r.is_param or r.plates:
            continue
        key = (re.sub(r"[0-9]+", "#", name), r.dist_type, tuple(r.value_shape))
        groups.setdefault(key, []).append(name)
    return groups


def loose_latents_error(names: list, dist_name: str, pattern: str, limit: int) -> UnsupportedLatentError:
    """The error refusing more than ``limit`` latent sites of one structure outside any plate."""
    stem = re.sub(r"[^A-Za-z0-9_]", "", re.sub(r"_*#+_*", "", pattern)) or "z"
    return UnsupportedLatentError(
        f"the model has more than {limit} latent {dist_name} sites of one structure written one "
        f"by one outside any plate ('{names[0]}', ..., '{names[-1]}', e.g. in a Python loop): blr_fit makes "
        "each a block of its own, and its compile time and memory grow faster than their number; declare "
        f"them as one site in a plate and index it where the loop read one site, e.g. `with "
        f"numpyro.plate('{stem}_plate', n): {stem} = numpyro.sample('{stem}', ...)` and then {stem}[i]",
        site=names[0],
    )


def needs_concrete(exc: BaseException) -> bool:
    """Whether ``exc`` is what a model raises when it computes Python values from traced
    data: JAX's concretization errors (``int(x.max())``, ``if x.mean() > 0``,
    ``np.asarray(x)``, a boolean mask ``y[y > 0]``), or the ``TypeError`` of hashing a
    traced value (``len(set(x))``, a dict keyed by data values)."""
    if isinstance(exc, NEEDS_CONCRETE):
        return True
    return isinstance(exc, TypeError) and "unhashable type" in str(exc) and "Tracer" in str(exc)


def raise_trace_error(exc, name, args, kwargs):
    from blrppl.inputs import data_hint

    if isinstance(exc, BLRError):
        raise exc  # (blrppl's own check of a site, raised while the model ran: it names the fix)
    if isinstance(exc, AttributeError) and isinstance(getattr(exc, "obj", None), dist.Distribution):
        # (a distribution rebuilt from its pytree before blrppl saw it, by numpyro's scan,
        # without a field its log_prob reads: see check_pytree)
        field = getattr(exc, "name", None) or "parameters"
        raise _outside_pytree(name, type(exc.obj).__name__, f"'{field}'", (field,)) from exc
    where = f"after site '{name}'" if name is not None else "before its first site"
    if isinstance(exc, ValueError) and "numpyro.subsample" in str(exc):
        raise ObservedDataError(
            f"the model's data do not match its subsampled plate ({exc}); the plate's size "
            "must be the length of the data along the plate's dim: declare it as "
            "numpyro.plate(name, len(data), subsample_size=M)",
            site=name,
        ) from exc
    if isinstance(exc, TypeError) and "carry input and carry output must have equal types" in str(exc):
        # (a scan's initial state of one dtype, its next state of another: an int32 initial
        # state of a hidden Markov chain when x64 makes Categorical draws int64)
        raise ModelTraceError(
            f"the model could not be run: a scan ({where.replace('before its first site', 'before the first site')}) "
            "returns a state whose dtype differs "
            f"from its initial state's ({exc}); give the initial state the dtype the step returns, e.g. "
            "jnp.zeros(n, dtype=int) for a discrete state (int64 under numpyro.enable_x64())",
            site=name,
        ) from exc
    if needs_concrete(exc):
        # (the data were already made concrete: the value comes from a sampled site)
        raise ModelTraceError(
            f"the model could not be run (it raised {where}): it turns a value computed from a sampled site or a "
            f"param into a Python or NumPy value ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0]}), e.g. it indexes a NumPy array with a latent (`table[z]` with "
            "`table = np.array(...)`) or branches on one with `if`; inference runs the model on traced JAX values, "
            "as NumPyro's does: index jax.numpy arrays (`jnp.asarray(table)[z]`) and branch with `jnp.where`",
            site=name,
        ) from exc
    hint = data_hint(args, kwargs)
    if isinstance(exc, TypeError) and "positional argument" in str(exc) and len(args) > 1:
        # (``blr_fit(model, [0.1, 0.4, 0.2])``: a list is the model's positional arguments)
        hint += (
            f"; `data` gave the model {len(args)} positional arguments, one per item of a tuple or list: "
            "pass one vector of data as an array (np.asarray(values)) or inside a tuple ((values,))"
        )
    raise ModelTraceError(
        f"the model could not be run with the data given: it raised {where} "
        f"({type(exc).__name__}: {exc}); check that `data` holds the model's arguments "
        f"(a dict of keyword arguments, a tuple of positional ones, or one array){hint}",
        site=name,
    ) from exc


def _check_nan_arguments(name, info, counts) -> None:
    """Refuse NaN distribution parameters at the starting point: they come from NaN in the
    data the model computes them from."""
    dist_name = info["dist_type"].__name__
    for arg, count in counts.items():
        count = int(count)
        if not count or arg == "log_prob":
            continue
        matrix = "" if not ("matrix" in arg or "tril" in arg) else (
            ", or from a covariance or precision matrix that is not positive definite (its Cholesky factor is NaN)"
        )
        raise ModelTraceError(
            f"argument '{arg}' of {dist_name} has {count} NaN element(s) at the starting point: "
            f"it is computed from data with NaN or infinite values in them (a covariate? an infinite value "
            f"times 0 is NaN){matrix}; replace or drop those rows (a mask does not help here: the gradients "
            "through a NaN covariate are NaN "
            "even where the log-density is masked; masked NaN observations are fine)",
            site=name,
        )


def _check_nan_log_prob(name, info, counts) -> None:
    """Refuse a NaN log-density outside the mask at the starting point."""
    count = int(counts.get("log_prob", 0))
    if count:
        what = "numpyro.factor term" if info["is_factor"] else f"log-density of {info['dist_type'].__name__}"
        raise ModelTraceError(
            f"the {what} is NaN at {count} element(s) at the starting point (outside any mask); "
            "check the data the model computes it from for NaN",
            site=name,
        )


def param_record(info, outputs) -> SiteRecord:
    """The record of a ``numpyro.param`` site, after checking that it can be fitted."""
    name = info["name"]
    value = np.array(outputs["values"][name])  # a copy: the user's init is never touched
    constraint = concrete_support(info, outputs)
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


#: the constraints an argument computed in the traced run is checked against: elementwise
#: bounds (a scale's positivity, a probability's interval, an integer count), cheap and
#: exact. Not a real argument's (its NaN are counted apart, :func:`_check_nan_arguments`,
#: and its check would cost an operation per element of every location computed from the
#: data), nor a matrix's or a simplex's: an eigendecomposition of a Gaussian process's
#: kernel matrix, or a float32 softmax summing to 1 ± 10⁻⁶ (a NaN Cholesky factor and a
#: NaN log-density are refused anyway)
_CHECKED_TRACED = (
    constraints._GreaterThan, constraints._LessThan, constraints._Interval, constraints._IntegerInterval,
    constraints._IntegerGreaterThan, constraints._Boolean,
)


#: what ``Distribution.__init__`` sets on a distribution rebuilt from its pytree
_REBUILT_BY_INIT = frozenset({"_batch_shape", "_event_shape", "_validate_args"})


def _lost_fields(d) -> tuple:
    """Attributes of the distribution ``d`` that its pytree does not carry: set on it, but
    neither named by its ``arg_constraints`` nor its ``pytree_data_fields`` /
    ``pytree_aux_fields`` (numpyro's flattening), nor recomputed (a ``lazy_property``)."""
    leaves, treedef = jax.tree.flatten(d)
    kept = vars(jax.tree.unflatten(treedef, leaves))
    return tuple(
        k for k in vars(d)
        if k not in kept and k not in _REBUILT_BY_INIT
        and not isinstance(getattr(type(d), k, None), dist.util.lazy_property)
    )


def check_pytree(name, fn) -> None:
    """Refuse a site whose distribution (or one it wraps) is of a class defined outside
    numpyro that keeps parameters outside its pytree: blrppl evaluates the model's densities
    from the distributions' pytree leaves (one traced program, vectorised over draws), and
    such a distribution comes back without them (NumPyro's Gaussian-shells example sets
    ``self.loc, self.radius, self.width`` in ``__init__`` with no ``arg_constraints``: its
    ``log_prob`` raised AttributeError from inside the fit)."""
    seen, stack = set(), [fn]
    while stack:
        d = stack.pop()
        if id(d) in seen:
            continue
        seen.add(id(d))
        stack.extend(v for v in vars(d).values() if isinstance(v, dist.Distribution))
        if type(d).__module__.startswith("numpyro."):
            continue
        try:
            lost = _lost_fields(d)
            what = ", ".join(f"'{k}'" for k in lost)
        except Exception as exc:  # (a pytree numpyro cannot rebuild: the same failure, said here)
            lost, what = (), f"parameters its pytree cannot rebuild ({type(exc).__name__}: {exc})"
        if what:
            raise _outside_pytree(name, type(d).__name__, what, lost)


def _outside_pytree(name, cls: str, what: str, lost: tuple) -> UnsupportedFactorError:
    """The error of a site whose distribution class ``cls`` keeps ``what`` (the fields
    ``lost``) outside numpyro's pytree of it."""
    example = ", ".join(f"{k!r}: constraints.real" for k in lost if not k.startswith("_"))
    return UnsupportedFactorError(
        f"the distribution {cls} keeps {what} outside its pytree: numpyro flattens a Distribution "
        "into the fields its arg_constraints (and pytree_data_fields) name, and blrppl (and numpyro's "
        f"scan) rebuild the model's distributions from those fields; declare them in {cls}'s arg_constraints "
        "with each parameter's constraint" + (f" (e.g. arg_constraints = {{{example}}})" if example else "")
        + ", or list them in pytree_data_fields",
        site=name,
    )


def _elementwise_bound(constraint) -> bool:
    """Whether ``constraint`` is one of :data:`_CHECKED_TRACED`, possibly made independent
    over event dims."""
    while isinstance(constraint, constraints._IndependentConstraint):
        constraint = constraint.base_constraint
    return isinstance(constraint, _CHECKED_TRACED)


def argument_checks(fn) -> dict:
    """The checks numpyro's validation makes of a site's distribution (and of the ones it
    wraps: a base distribution, a mixture's components) at the model's starting point:
    message → whether every element satisfies its constraint, computed in the traced run.

    numpyro checks an argument as the distribution is built, and only a concrete one (none
    inside ``jit``). Here arguments computed in the run are checked too (a concentration
    written as ``jnp.array([1.0, -1.0])``, hyperparameters passed as data, a scale computed
    from a latent at its prior mean) against elementwise bounds (:data:`_CHECKED_TRACED`):
    the fit starts from the same point, and an argument outside its constraint there makes
    its expected log-density, and every step, non-finite."""
    out = {}
    pending = [fn]
    while pending:
        d = pending.pop()
        if not isinstance(d, dist.Distribution):
            continue
        pending += [getattr(d, a, None) for a in ("base_dist", "mixing_distribution", "component_distribution")]
        pending += list(getattr(d, "component_distributions", None) or ())
        try:
            arguments = d.get_args()
        except Exception:  # (an argument that cannot be read without more arguments)
            continue
        for param, value in arguments.items():
            constraint = d.arg_constraints.get(param)
            if constraint is None or constraints.is_dependent(constraint):
                continue
            if isinstance(value, jax.core.Tracer) and not _elementwise_bound(constraint):
                continue
            try:
                ok = jnp.all(constraint(value))
            except Exception:  # (a constraint numpyro could not evaluate either)
                continue
            out[f"{type(d).__name__} distribution got invalid {param} parameter (it must satisfy {constraint})"] = ok
    return out


def check_plate_sizes(plates, args, kwargs, records) -> None:
    """A subsampled plate's size must be the number of data elements it indexes: some data
    array must have an axis of that length (a size that matches no array would make the
    minibatches index past the data or never reach part of it).

    Raises:
        ObservedDataError: no data array has an axis of the plate's size.
    """
    from_host = lambda x: type(x).__name__ == "HostRows"  # (blrppl.graph.host_rows: rows read a minibatch at a time)
    arrays = [
        tuple(x.shape)
        for x in jax.tree.leaves((tuple(args), dict(kwargs)), is_leaf=from_host)
        if (isinstance(x, (np.ndarray, jax.Array)) or from_host(x)) and len(x.shape) > 0
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


def check_sample_site(info, outputs) -> tuple:
    """Check a sample site of the traced run (its static facts ``info``, the run's
    ``outputs``): finite observed values of the distribution's shape inside its support,
    arguments inside their constraints and no NaN at the starting point.

    Returns:
        (the site's value, its support with traced parameters made concrete)

    Raises:
        ObservedDataError: observed values are non-finite (outside a mask), of the wrong
            shape or outside the support.
        ModelTraceError: a distribution's arguments are NaN or outside their constraints,
            or its log-density is NaN, at the starting point.
    """
    name = info["name"]
    value = np.asarray(outputs["values"][name])
    support = concrete_support(info, outputs)
    if name in outputs["bounds"]:
        lo, hi = outputs["bounds"][name]
        support = constraints.integer_interval(np.asarray(lo), np.asarray(hi))
    observed = info["observed"]
    mask = outputs["masks"].get(name)
    mask = None if mask is None else np.asarray(mask)
    if observed and not info["is_factor"]:
        finite = np.isfinite(value) if np.issubdtype(value.dtype, np.number) else np.ones(value.shape, bool)
        if mask is not None:
            finite = finite | ~mask
        if not np.all(finite):
            bad = int(np.size(finite) - finite.sum())
            raise ObservedDataError(
                f"{bad} observed value(s) are NaN or infinite; drop them or mask them "
                "with numpyro.handlers.mask / obs_mask",
                site=name,
            )
    # (NaN arguments first: they come from the data, and break every constraint; then
    # arguments outside their constraint, whose log-density is often NaN too)
    _check_nan_arguments(name, info, outputs["nan_counts"][name])
    for message, ok in outputs["arguments_valid"].get(name, {}).items():
        if not bool(ok):
            raise ModelTraceError(
                f"{message} at the model's starting point (each latent at its initial value, by default its "
                "prior mean): a constant, a data value or a value computed from them and the latents; "
                "give one inside the constraint (an argument computed from a latent needs a latent whose "
                "support keeps it there, e.g. a HalfNormal for a scale)",
                site=name,
            )
    _check_nan_log_prob(name, info, outputs["nan_counts"][name])
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
    return value, support
