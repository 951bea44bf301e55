"""Tracing a NumPyro model into site records.

The model is run once, with latent values taken from numpyro's initialisation strategies
(never by forward sampling a site that cannot be sampled, such as ``ImproperUniform``), and
every sample site is recorded with its distribution unwrapped: ``Independent`` becomes
reinterpreted event dims, ``ExpandedDistribution`` a broadcast, ``MaskedDistribution`` a
mask.
"""

from __future__ import annotations

import dataclasses
import hashlib
from functools import partial
from collections import OrderedDict
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from numpyro import handlers
from numpyro import validation_enabled as numpyro_validation
from numpyro.distributions import constraints
from numpyro.distributions.transforms import biject_to
from numpyro.primitives import Messenger
from numpyro.infer.initialization import init_to_uniform
from jax.extend import core as jex_core

from blrppl.graph.data import DataSpec
from blrppl.runtime.compile import compiler_options
from blrppl.runtime.program_store import compile_program, jit as store_jit, program_key
from blrppl.graph.stable import Stabilise
from blrppl.graph.plan import SubsampledPlate
from blrppl.errors import BLRError, ModelTraceError, ObservedDataError, UnsupportedFactorError, UnsupportedLatentError


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
        unconstrained_init: a continuous latent's ``init_value`` mapped to the unconstrained
            space by ``biject_to(support)`` (None when the support's parameters depend on
            other latents, or for other sites).
        given: the matrices the distribution was built from that its pytree drops
            (:data:`GIVEN_MATRICES`), by name: a rule for that parameterisation reads them.
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
    unconstrained_init: Any = None
    given: tuple = ()

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


#: matrices a distribution keeps as given beside its pytree leaves: numpyro's
#: ``MultivariateNormal(loc, precision_matrix=Λ)`` holds Λ but flattens to (loc, scale_tril),
#: a function of Λ no rule reads; the precision itself is conjugate to a Wishart block
GIVEN_MATRICES = ("precision_matrix",)


def given_matrices(base) -> dict:
    """The :data:`GIVEN_MATRICES` an unwrapped distribution was built from, by name (read
    before anything touches its lazy properties, which cache under the same names)."""
    held = getattr(base, "__dict__", {})
    return {a: held[a] for a in GIVEN_MATRICES if a in held}


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


def effective_support(fn):
    """The support of a site's distribution, narrowed where numpyro reports too wide a one:
    a ``TransformedDistribution`` whose transforms are affine reports its last transform's
    codomain, ``real`` by default (``TransformedDistribution(Beta(2, 2), AffineTransform(-1,
    2))``), though its values lie in the image of its base support, (−1, 1): the image is
    the support (its bijection then keeps every value a density sees inside it)."""
    support = fn.support
    event = 0
    base_constraint = support
    while isinstance(base_constraint, constraints.independent):
        event += base_constraint.reinterpreted_batch_ndims
        base_constraint = base_constraint.base_constraint
    base, _, _ = unwrap(fn)
    if base_constraint is not constraints.real or not isinstance(base, dist.TransformedDistribution):
        return support
    current = base.base_dist.support
    while isinstance(current, constraints.independent):
        current = current.base_constraint
    for t in base.transforms:
        if not isinstance(t, dist.transforms.AffineTransform) or t.domain.event_dim != 0:
            return support
        current = dist.transforms.AffineTransform(t.loc, t.scale, domain=current).codomain
    if current is constraints.real:
        return support
    return constraints.independent(current, event) if event else current


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
    ``ImproperUniform``).

    For a transformed distribution, the transform of its base distribution's mean (the
    same for an affine transform): a ``LogNormal(0, 10)`` prior (NumPyro's GP example) has
    mean e⁵⁰, five sds out on the log scale where its latent is fitted, and a fit started
    there ended at kernel variances of e⁴⁸ (ELBO −600 against about −10 from e⁰)."""
    if site is None:
        return init_to_prior_mean
    if site["type"] != "sample" or site["is_observed"] or site["fn"].support.is_discrete:
        return None
    fallback = init_to_uniform(site)
    support = effective_support(site["fn"])
    if support is not site["fn"].support:
        # numpyro drew on the unconstrained space of the support it reports (e.g. real for a
        # Beta pushed through an affine map): the same draw mapped into the narrower one
        fallback = biject_to(support)(biject_to(site["fn"].support).inv(fallback))
    base = unwrap(site["fn"])[0]
    try:
        if isinstance(base, dist.TransformedDistribution):
            mean = base.base_dist.mean
            for t in base.transforms:
                mean = t(mean)
        else:
            mean = site["fn"].mean
        mean = jnp.broadcast_to(1.0 * mean, jnp.shape(fallback))
    except (NotImplementedError, ValueError, TypeError):
        return fallback
    return jnp.where(jnp.isfinite(mean), mean, fallback)


#: how many times a model's Python code has run in this process (each trace, each re-run):
#: :func:`model_runs` reads it, the compile statistics of a fit report the difference
_MODEL_RUNS = [0]


def model_runs() -> int:
    """The number of times blrppl has run a model's Python code in this process."""
    return _MODEL_RUNS[0]


def count_model_run() -> None:
    """Count one run of a model's Python code (see :func:`model_runs`)."""
    _MODEL_RUNS[0] += 1



def _split_data(args, kwargs):  # noqa: D103
    return args if args is not None else (), kwargs if kwargs is not None else {}


class ModelTracer:
    """A jitted run of the model from its initialisation strategy, traced once.

    Tracing fills ``meta`` with static facts about the sites and gives the program's
    :attr:`fingerprint`; the run is compiled at its first call. A tracer serves every later
    call with data of the same shapes.

    Attributes:
        spec: how the model's arguments split into array leaves and static values.
        meta: static facts about the sites, filled while tracing.
        fingerprint: a hash of the traced program (its equations, the constants it closes
            over, literal values): two models with the same fingerprint compute the same
            densities from the same data, so a compiled fit may be reused only between
            them (a model that reads a global array or a prior scale from its module gets a
            new fingerprint when that value changes).
    """

    def __init__(self, model, spec: DataSpec, init_strategy, dyn, rng_key, meta=None):
        self.spec = spec
        self.meta: dict = {} if meta is None else meta
        jitted = store_jit(partial(_run_once, model, spec, init_strategy, self.meta), "model_run")
        self._traced = jitted.trace(dyn, rng_key)
        # (a site's scale or mask given as a Python or NumPy value, `handlers.scale(scale=c)`,
        # is no operation of the program: its value joins the fingerprint, or a fit compiled
        # for another value would be reused, silently)
        static = repr([(s["name"], s.get("static")) for s in self.meta.get("sites", ())])
        self.fingerprint = program_fingerprint(self._traced.jaxpr, extra=static)
        self._compiled = None
        # a long program (one site per step of a Python loop) runs operation by operation:
        # XLA's compile time grows faster than the program, the run's time only with it
        self.eager = equation_count(self._traced.jaxpr.jaxpr) > EAGER_EQUATIONS and hasattr(self._traced, "out_info")

    def __call__(self, dyn, rng_key):
        if self.eager:
            closed = self._traced.jaxpr
            outs = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *jax.tree.leaves((dyn, rng_key)))
            return jax.tree.unflatten(jax.tree.structure(self._traced.out_info), outs)
        if self._compiled is None:
            options = compiler_options(dyn)
            spec = self.spec
            # (a model that needs concrete data holds them: its run is not stored)
            # (its outputs are keyed by site name, which the program's fingerprint does not see)
            info = getattr(self._traced, "out_info", None)
            key = None
            if info is not None and not spec.all_static:
                outputs = jax.tree.structure(info)
                key = program_key(
                    "model run", self.fingerprint, outputs, self.meta.get("sites"), spec.treedef, spec.static, options
                )
            traced = self._traced
            self._compiled = compile_program(key, lambda *_: traced.lower(), (dyn, rng_key), options)
            self._traced = None
        return self._compiled(dyn, rng_key)


#: a traced run with more equations than this is evaluated eagerly, not compiled
EAGER_EQUATIONS = 3000


def equation_count(jaxpr) -> int:
    """The number of equations of a jaxpr, its sub-programs' included."""
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += equation_count(inner)
    return total


def _static_value(x):
    """A concrete value (a site's scale or mask given as a Python or NumPy value) as
    ``(dtype, shape, digest of its bytes)``; None for None or a traced value (the program
    computes it: its operations are in the fingerprint)."""
    if x is None or isinstance(x, jax.core.Tracer):
        return None
    arr = np.asarray(x)
    if arr.dtype == object:
        return repr(x)
    return (str(arr.dtype), arr.shape, hashlib.blake2b(np.ascontiguousarray(arr).tobytes(), digest_size=8).hexdigest())


def program_fingerprint(closed_jaxpr, extra: str = "") -> str:
    """A hash of a traced program: its printed equations, and the bytes of every constant
    and literal it holds (sub-programs included), and ``extra`` (what the program reads
    outside its operations)."""
    digest = hashlib.blake2b(digest_size=20)
    digest.update(str(closed_jaxpr.jaxpr).encode())
    digest.update(extra.encode())

    def add(value):
        arr = np.asarray(value)
        digest.update(f"{arr.dtype}{arr.shape}".encode())
        digest.update(arr.tobytes() if arr.dtype != object else repr(value).encode())

    for c in closed_jaxpr.consts:
        if jax.dtypes.issubdtype(getattr(c, "dtype", np.float64), jax.dtypes.prng_key):
            c = jax.random.key_data(c)
        add(c)

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            for v in eqn.invars:
                if isinstance(v, jex_core.Literal):
                    add(v.val)
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)
                    for c in getattr(sub, "consts", ()):
                        add(c)

    walk(closed_jaxpr.jaxpr)
    return digest.hexdigest()


def trace_program(model, args=(), kwargs=None, rng_key=None, init_strategy=None) -> ModelTracer:
    """Trace (not yet compile) the run of ``model`` with this data: the :class:`ModelTracer`
    with the program's fingerprint. A model that needs concrete data (e.g. calls
    ``np.asarray`` on an argument) is traced with the data as constants.

    Raises:
        ModelTraceError: the model raised while running with the data given.
    """
    args, kwargs = _split_data(args, kwargs)
    rng_key = jax.random.key(0) if rng_key is None else rng_key
    init_strategy = init_to_prior_mean if init_strategy is None else init_strategy
    spec, dyn = DataSpec.split(args, kwargs)
    meta: dict = {}
    try:
        try:
            return ModelTracer(model, spec, init_strategy, dyn, rng_key, meta)
        except _NEEDS_CONCRETE:
            spec, dyn = DataSpec.split(args, kwargs, all_static=True)
            meta.clear()
            return ModelTracer(model, spec, init_strategy, dyn, rng_key, meta)
    except Exception as exc:  # any failure of the user's model
        last = meta.get("last")
        _raise_trace_error(exc, last.name if last is not None else None, args, kwargs)
    raise AssertionError("unreachable")  # pragma: no cover


def _raise_trace_error(exc, name, args, kwargs):
    from blrppl.inputs import data_hint

    if isinstance(exc, BLRError):
        raise exc  # (blrppl's own check of a site, raised while the model ran: it names the fix)
    if isinstance(exc, AttributeError) and isinstance(getattr(exc, "obj", None), dist.Distribution):
        # (a distribution rebuilt from its pytree before blrppl saw it, by numpyro's scan,
        # without a field its log_prob reads: see _check_pytree)
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
    if isinstance(exc, _NEEDS_CONCRETE):
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


def trace_model(
    model, args=(), kwargs=None, rng_key=None, init_strategy=init_to_prior_mean, tracer=None
):
    """Run ``model`` once and record its sample sites.

    Latent values come from ``init_strategy`` (:func:`init_to_prior_mean` by default; any
    numpyro init strategy works); discrete latents are drawn from their prior. The run is
    jitted with the data's arrays as arguments; a model that needs concrete data (e.g.
    calls ``np.asarray`` on an argument) is run with the data as constants, and the engine
    then does the same.

    Args:
        tracer: a :class:`ModelTracer` of this model for data of the same shapes (from
            :func:`trace_program`, or from an earlier call with the same fingerprint).

    Returns:
        (OrderedDict site name → :class:`SiteRecord` in the order the model runs them,
        the :class:`DataSpec`, the dynamic data leaves, the :class:`ModelTracer`)

    Raises:
        ModelTraceError: the model raised while running with the data given, or a
            distribution's parameters are NaN at the starting point.
        ObservedDataError: observed values are non-finite (outside a mask).
    """
    args, kwargs = _split_data(args, kwargs)
    rng_key = jax.random.key(0) if rng_key is None else rng_key
    if tracer is None:
        tracer = trace_program(model, args, kwargs, rng_key, init_strategy)
    spec = tracer.spec
    dyn = DataSpec.split(args, kwargs, all_static=spec.all_static)[1]
    try:
        outputs = tracer(dyn, rng_key)
    except Exception as exc:  # pragma: no cover - a failure traced fine but failed to run
        _raise_trace_error(exc, None, args, kwargs)
    records: OrderedDict[str, SiteRecord] = OrderedDict()
    for info in tracer.meta["sites"]:
        name = info["name"]
        if info["type"] == "param":
            records[name] = _param_record(info, outputs)
            continue
        value = np.asarray(outputs["values"][name])
        support = _concrete_support(info, outputs)
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
        # (a latent of unbounded discrete support is refused when the model is compiled,
        # unless no other site reads it: obs_mask's missing counts are integrated out)
        records[name] = SiteRecord(
            name=name,
            observed=observed,
            is_factor=info["is_factor"],
            dist_type=info["dist_type"],
            given=info["given"],
            reinterpreted_ndim=info["reinterpreted_ndim"],
            has_mask=info["has_mask"],
            value_shape=tuple(value.shape),
            event_ndim=info["event_ndim"],
            support=support,
            plates=info["plates"],
            has_scale=info["has_scale"],
            infer=info["infer"],
            init_value=value,
            unconstrained_init=_unconstrained_init(outputs, name, info),
        )
    if not any(not r.observed for r in records.values()):
        raise ModelTraceError("the model has no latent sample site or param to infer")
    return records, spec, dyn, tracer


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


def _param_record(info, outputs) -> SiteRecord:
    """The record of a ``numpyro.param`` site, after checking that it can be fitted."""
    name = info["name"]
    value = np.array(outputs["values"][name])  # a copy: the user's init is never touched
    constraint = _concrete_support(info, outputs)
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
        # (``numpyro.param(name)`` without an initial value: numpyro.module looks its
        # parameters up so, and initialises them itself when they are None)
        if not site["args"] or site["args"][0] is None:
            return None
        return jax.tree.map(jnp.asarray, site["args"][0])
    return init_strategy(site)


def _unconstrained_init(outputs, name, info):
    """A latent's starting point on the unconstrained space, when its support is static
    (a support computed in the run is rebuilt from concrete values later: its bijection may
    differ from the traced one)."""
    if name not in outputs.get("unconstrained", {}) or isinstance(info["support"], _TracedSupport):
        return None
    return np.asarray(outputs["unconstrained"][name])


def _run_once(model, spec, init_strategy, meta, dyn, rng_key):
    """Trace the model; static facts go to ``meta``, arrays are returned."""
    count_model_run()
    args, kwargs = spec.merge(dyn)
    last = _LastSite(
        handlers.substitute(handlers.seed(Stabilise(model), rng_key), substitute_fn=partial(_initial, init_strategy))
    )
    meta["last"] = last
    # numpyro validates a distribution's arguments as it is built, eagerly: one small XLA
    # program per operation and shape of every constraint it evaluates (0.5-0.8 s for the
    # constant matrices of a multivariate normal or a Wishart, whose checks then come out
    # traced and are skipped anyway). The run checks the same arguments, those known when
    # the model is traced, inside its own program instead (see _argument_checks)
    validate = bool(dist.Distribution._validate_args)
    with numpyro_validation(False):
        tr = handlers.trace(last).get_trace(*args, **kwargs)
    sites, values, bounds, checks, masks, nan_counts, supports, unconstrained = [], {}, {}, {}, {}, {}, {}, {}
    argument_checks = {}
    plate_sizes = {
        name: int(site["args"][0]) for name, site in tr.items() if site["type"] == "plate"
    }
    for name, site in tr.items():
        if site["type"] == "param":
            kwargs = site.get("kwargs") or {}
            constraint = kwargs.get("constraint", constraints.real)
            if isinstance(site["value"], (tuple, list, dict)):
                # (numpyro.module's parameters: a network's weights as one pytree)
                raise UnsupportedLatentError(
                    f"the param '{name}' holds a pytree of arrays (numpyro.module's network parameters, "
                    f"{len(jax.tree.leaves(site['value']))} arrays): blr_fit fits params that are single arrays; "
                    "write the weights as sample sites with priors (a Bayesian network, fitted as Gaussians) or "
                    "as one numpyro.param per array, or fit this model with numpyro.infer.SVI",
                    site=name,
                )
            value = jnp.asarray(site["value"])
            if not jnp.issubdtype(value.dtype, jnp.floating):
                value = value.astype(jnp.result_type(float))  # e.g. numpyro.param("s", 1)
            values[name] = value
            checks[name] = jnp.all(constraint(value))
            sites.append(
                {
                    "name": name,
                    "type": "param",
                    "support": _static_support(constraint, name, supports),
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
        _check_pytree(name, fn)
        if validate:
            argument_checks[name] = _argument_checks(fn)
        base, reinterpreted, mask = unwrap(fn)
        if isinstance(base, dist.Delta) and not site["is_observed"]:
            # (a point mass has no density to fit a q to: its value is a function of other
            # sites, and its log_density a factor; fitted as a latent it was dropped or stuck)
            raise UnsupportedLatentError(
                f"'{name}' is a latent Delta site: its value is fixed by its arguments, so it has no posterior of "
                f"its own to fit; write numpyro.deterministic('{name}', value) for its value and, when it has a "
                f"log_density, numpyro.factor('{name}_density', log_density) for its density",
                site=name,
            )
        given = tuple(given_matrices(base))
        support = effective_support(fn)
        if isinstance(support, constraints._IntegerInterval):
            bounds[name] = (jnp.asarray(support.lower_bound), jnp.asarray(support.upper_bound))
        values[name] = site["value"]
        if not site["is_observed"] and not support.is_discrete:
            # the starting point on the unconstrained space, computed here (on the host it
            # would compile a program per operation of the bijection)
            try:
                unconstrained[name] = biject_to(support).inv(site["value"])
            except (NotImplementedError, TypeError, ValueError):
                pass
        dist_shape = tuple(fn.batch_shape) + tuple(fn.event_shape)
        try:
            shape_ok = np.broadcast_shapes(np.shape(site["value"]), dist_shape) == np.shape(site["value"])
        except ValueError:
            shape_ok = False
        value_mask_ = value_mask(fn, mask, site["value"]) if shape_ok else None
        if value_mask_ is not None:
            masks[name] = value_mask_
        if site["is_observed"] and not isinstance(base, dist.Unit) and shape_ok:
            value = site["value"]
            if value_mask_ is not None:
                # masked-out observations may be anything (NaN): test a feasible point there
                value = jnp.where(value_mask_, value, base.support.feasible_like(value))
            inside = fn.support(value)
            checks[name] = jnp.all(inside)
        # NaN anywhere in a distribution's parameters, or in a log-density outside its mask
        # (a NaN covariate, or a prior scale computed from NaN data): counted here, refused
        # by trace_model naming the site and the argument
        counts = {a: jnp.sum(jnp.isnan(v)) for a, v in _float_args(base).items()}
        if shape_ok:
            counts["log_prob"] = jnp.sum(jnp.isnan(fn.log_prob(site["value"])))
        nan_counts[name] = counts
        sites.append(
            {
                "name": name,
                "type": "sample",
                "observed": bool(site["is_observed"]),
                "is_factor": isinstance(base, dist.Unit),
                "dist_type": type(base),
                "given": given,
                "reinterpreted_ndim": reinterpreted,
                "has_mask": mask is not None,
                "event_ndim": fn.event_dim,
                "dist_shape": dist_shape,
                "support": _static_support(support, name, supports),
                "plates": tuple(
                    Plate(f.name, plate_sizes.get(f.name, int(f.size)), int(f.dim), int(f.size))
                    for f in reversed(site["cond_indep_stack"])
                ),
                "has_scale": site.get("scale") is not None,
                "infer": dict(site.get("infer") or {}),
                "static": (_static_value(site.get("scale")), _static_value(mask)),
            }
        )
    meta["sites"] = sites
    meta["deterministic"] = tuple(name for name, site in tr.items() if site["type"] == "deterministic")
    return {
        "values": values,
        "bounds": bounds,
        "in_support": checks,
        "arguments_valid": argument_checks,
        "masks": masks,
        "nan_counts": nan_counts,
        "supports": supports,
        "unconstrained": unconstrained,
    }


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


def _check_pytree(name, fn) -> None:
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


def _argument_checks(fn) -> dict:
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


class _TracedSupport(NamedTuple):
    """A support whose parameters are computed in the traced run (from the data, or from
    other latents): rebuilt with concrete values from the run's outputs."""

    treedef: Any


def _static_support(support, name, supports):
    """The support itself when its parameters are constants; else a :class:`_TracedSupport`
    (no tracer may be kept past the trace), its parameters returned in ``supports``."""
    leaves, treedef = jax.tree.flatten(support)
    if not any(isinstance(x, jax.core.Tracer) for x in leaves):
        return support
    supports[name] = [jnp.asarray(x) for x in leaves]
    return _TracedSupport(treedef)


def _concrete_support(info, outputs):
    """The support of a site record: traced parameters replaced by their values."""
    support = info["support"]
    if isinstance(support, _TracedSupport):
        leaves = [np.asarray(x) for x in outputs["supports"][info["name"]]]
        return jax.tree.unflatten(support.treedef, leaves)
    return support


def value_mask(fn, mask, value):
    """Which elements of a site's value its masks keep, with the value's shape (None
    without a mask). Each ``MaskedDistribution`` level masks its own batch dims, so its
    mask is aligned with the value through that level's event dims."""
    if mask is None:
        return None
    keep = jnp.ones(jnp.shape(value), bool)
    while isinstance(fn, (dist.Independent, dist.ExpandedDistribution, dist.MaskedDistribution)):
        if isinstance(fn, dist.MaskedDistribution) and fn._mask is not True:
            m = jnp.broadcast_to(fn._mask, tuple(fn.batch_shape))
            m = jnp.reshape(m, jnp.shape(m) + (1,) * fn.event_dim)
            keep = keep & jnp.broadcast_to(m, jnp.shape(value))
        fn = fn.base_dist
    return keep


def _float_args(base) -> dict:
    """The floating-point arguments of an unwrapped distribution, by name."""
    out = {}
    for a in getattr(base, "arg_constraints", {}):
        v = getattr(base, a, None)
        if isinstance(v, (jax.Array, np.ndarray, float)) and jnp.issubdtype(jnp.result_type(v), jnp.floating):
            out[a] = v
    return out


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
