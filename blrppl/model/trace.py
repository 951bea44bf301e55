"""Tracing a NumPyro model into site records.

The model is run once, with latent values taken from numpyro's initialisation strategies
(never by forward sampling a site that cannot be sampled, such as ``ImproperUniform``), and
every sample site is recorded (:class:`blrppl.model.records.SiteRecord`) with its
distribution unwrapped: ``Independent`` becomes reinterpreted event dims,
``ExpandedDistribution`` a broadcast, ``MaskedDistribution`` a mask.
"""

from __future__ import annotations

import hashlib
from functools import partial
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from numpyro import handlers
from numpyro import validation_enabled as numpyro_validation
from numpyro.distributions import constraints
from numpyro.distributions.transforms import biject_to
from numpyro.primitives import Messenger

from blrppl.errors import ModelTraceError, UnsupportedFactorError, UnsupportedLatentError
from blrppl.graph.data import STORED_STATIC_BYTES, DataSpec
from blrppl.runtime.compile import compiler_options
from blrppl.graph.plan import SubsampledPlate
from blrppl.runtime.program_store import compile_program, jit as store_jit, program_key
from blrppl.graph.stable import Stabilise
from blrppl.model import host_eval
from blrppl.model.fingerprint import program_fingerprint
from blrppl.model.checks import (
    LooseLatents,
    argument_checks,
    check_pytree,
    check_sample_site,
    needs_concrete,
    param_record,
    raise_trace_error,
)
from blrppl.model.start import init_to_prior_mean
from blrppl.model.records import (
    Plate,
    SiteRecord,
    TracedSupport,
    effective_support,
    given_matrices,
    static_support,
    unwrap,
    value_mask,
)


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
            # (on the host: NumPy for the operations it rounds as XLA does, each other one
            # bound eagerly; eval_jaxpr would dispatch, and compile once per shape, each)
            closed = self._traced.jaxpr
            outs = host_eval.run(closed.jaxpr, closed.consts, jax.tree.leaves((dyn, rng_key)))
            return jax.tree.unflatten(jax.tree.structure(self._traced.out_info), jax.device_put(outs))
        if self._compiled is None:
            options = compiler_options(dyn)
            spec = self.spec
            # (a model that needs concrete data holds them: its run is keyed by their values,
            # and not stored when they are large)
            # (its outputs are keyed by site name, which the program's fingerprint does not see)
            info = getattr(self._traced, "out_info", None)
            key = None
            if info is not None and spec.static_bytes() <= STORED_STATIC_BYTES:
                outputs = jax.tree.structure(info)
                key = program_key(
                    "model run", self.fingerprint, outputs, self.meta.get("sites"), spec.treedef, spec.static_key(),
                    options,
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
        except Exception as exc:
            if not needs_concrete(exc) or not dyn:
                raise
            spec, dyn = DataSpec.split(args, kwargs, all_static=True)
            meta.clear()
            return ModelTracer(model, spec, init_strategy, dyn, rng_key, meta)
    except Exception as exc:  # any failure of the user's model
        last = meta.get("last")
        if last is not None and last.subsampled and needs_concrete(exc):
            raise _subsampled_concrete_error(exc, last) from exc
        raise_trace_error(exc, last.name if last is not None else None, args, kwargs)
    raise AssertionError("unreachable")  # pragma: no cover


def _subsampled_concrete_error(exc, last) -> ModelTraceError:
    """The error of a model that needs concrete values of its minibatch (a boolean mask of
    ``y[idx]``, a NumPy array indexed by the plate's indices): the minibatch is drawn as
    the fit runs, so its values are not known when the model is traced."""
    plate = last.subsampled[-1]
    return ModelTraceError(
        f"the model needs concrete values inside the subsampled plate '{plate}' "
        f"({type(exc).__name__}: {str(exc).splitlines()[0]}): its minibatch is drawn while the fit runs, so "
        "its values are not known when the model is compiled (nor are a latent's). Index the data with jax.numpy "
        "(`jnp.asarray(y)[idx]`, not a NumPy array indexed by the plate's indices) and write masks "
        "with jnp.where (`jnp.where(y_batch > 0, log_prob, 0.0).sum()`, not `log_prob[y_batch > 0]`), "
        "or fit without subsample_size",
        site=last.name,
    )


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
        raise_trace_error(exc, None, args, kwargs)
    records: OrderedDict[str, SiteRecord] = OrderedDict()
    for info in tracer.meta["sites"]:
        name = info["name"]
        if info["type"] == "param":
            records[name] = param_record(info, outputs)
            continue
        value, support = check_sample_site(info, outputs)
        observed = info["observed"]
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
    if name not in outputs.get("unconstrained", {}) or isinstance(info["support"], TracedSupport):
        return None
    return np.asarray(outputs["unconstrained"][name])


def _run_once(model, spec, init_strategy, meta, dyn, rng_key):
    """Trace the model; static facts go to ``meta``, arrays are returned."""
    count_model_run()
    args, kwargs = spec.merge(dyn)
    last = _LastSite(
        LooseLatents(
            handlers.substitute(handlers.seed(Stabilise(model), rng_key), substitute_fn=partial(_initial, init_strategy))
        )
    )
    meta["last"] = last
    # numpyro validates a distribution's arguments as it is built, eagerly: one small XLA
    # program per operation and shape of every constraint it evaluates (0.5-0.8 s for the
    # constant matrices of a multivariate normal or a Wishart, whose checks then come out
    # traced and are skipped anyway). The run checks the same arguments, those known when
    # the model is traced, inside its own program instead (see argument_checks)
    validate = bool(dist.Distribution._validate_args)
    with numpyro_validation(False):
        tr = handlers.trace(last).get_trace(*args, **kwargs)
    out = {
        key: {}
        for key in (
            "values", "bounds", "in_support", "arguments_valid", "masks", "nan_counts", "supports", "unconstrained"
        )
    }
    plate_sizes = {
        name: int(site["args"][0]) for name, site in tr.items() if site["type"] == "plate"
    }
    sites = []
    templates = lifted_templates(tr)
    for name, site in tr.items():
        if name in templates:
            continue  # (random_flax_module's template: every weight is a sample site of its own)
        if site["type"] == "param":
            sites.append(_param_site(name, site, plate_sizes, out))
        elif site["type"] == "sample":
            sites.append(_sample_site(name, site, plate_sizes, out, validate))
    meta["sites"] = sites
    meta["deterministic"] = tuple(name for name, site in tr.items() if site["type"] == "deterministic")
    return out


def lifted_templates(tr) -> frozenset:
    """The param sites of a trace that only hold a network's template: a pytree named
    ``"<module>$params"`` (numpyro's ``flax_module`` / ``haiku_module``) each of whose arrays
    ``random_flax_module`` (or ``random_haiku_module``) replaced by a sample site
    ``"<module>/<path>"``. Nothing in the model reads their values (the network runs on
    the samples), so the fit has nothing to fit in them; a module with some weights left
    as params (a prior given for some of them) is not a template and stays refused."""
    out = set()
    for name, site in tr.items():
        if site["type"] != "param" or not name.endswith("$params") or not isinstance(site["value"], (dict, list, tuple)):
            continue
        prefix = name[: -len("$params")] + "/"
        lifted = sum(1 for n, s in tr.items() if s["type"] == "sample" and n.startswith(prefix))
        if lifted and lifted == len(jax.tree.leaves(site["value"])):
            out.add(name)
    return frozenset(out)


def _site_plates(site, plate_sizes) -> tuple:
    """The :class:`Plate` objects a traced site sits in, outermost first (a subsampled
    plate's size read off its own trace entry)."""
    return tuple(
        Plate(f.name, plate_sizes.get(f.name, int(f.size)), int(f.dim), int(f.size))
        for f in reversed(site["cond_indep_stack"])
    )


def _param_site(name, site, plate_sizes, out) -> dict:
    """The static facts of a ``numpyro.param`` site of the traced run; its value and the
    check of its constraint go to ``out``."""
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
    out["values"][name] = value
    out["in_support"][name] = jnp.all(constraint(value))
    return {
        "name": name,
        "type": "param",
        "support": static_support(constraint, name, out["supports"]),
        "event_dim": kwargs.get("event_dim"),
        "plates": _site_plates(site, plate_sizes),
    }


def _sample_site(name, site, plate_sizes, out, validate: bool) -> dict:
    """The static facts of a sample site of the traced run; its value, bounds, mask, the
    checks of its arguments and values and its NaN counts go to ``out``."""
    fn = site["fn"]
    check_pytree(name, fn)
    if validate:
        out["arguments_valid"][name] = argument_checks(fn)
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
        out["bounds"][name] = (jnp.asarray(support.lower_bound), jnp.asarray(support.upper_bound))
    out["values"][name] = site["value"]
    if not site["is_observed"] and not support.is_discrete:
        # the starting point on the unconstrained space, computed here (on the host it
        # would compile a program per operation of the bijection)
        try:
            out["unconstrained"][name] = biject_to(support).inv(site["value"])
        except (NotImplementedError, TypeError, ValueError):
            pass
    dist_shape = tuple(fn.batch_shape) + tuple(fn.event_shape)
    try:
        shape_ok = np.broadcast_shapes(np.shape(site["value"]), dist_shape) == np.shape(site["value"])
    except ValueError:
        shape_ok = False
    value_mask_ = value_mask(fn, mask, site["value"]) if shape_ok else None
    if value_mask_ is not None:
        out["masks"][name] = value_mask_
    if site["is_observed"] and not isinstance(base, dist.Unit) and shape_ok:
        value = site["value"]
        if value_mask_ is not None:
            # masked-out observations may be anything (NaN): test a feasible point there
            value = jnp.where(value_mask_, value, base.support.feasible_like(value))
        inside = fn.support(value)
        out["in_support"][name] = jnp.all(inside)
    # NaN anywhere in a distribution's parameters, or in a log-density outside its mask
    # (a NaN covariate, or a prior scale computed from NaN data): counted here, refused
    # by trace_model naming the site and the argument
    counts = {a: jnp.sum(jnp.isnan(v)) for a, v in _float_args(base).items()}
    if shape_ok:
        counts["log_prob"] = jnp.sum(jnp.isnan(fn.log_prob(site["value"])))
    out["nan_counts"][name] = counts
    return {
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
        "support": static_support(support, name, out["supports"]),
        "plates": _site_plates(site, plate_sizes),
        "has_scale": site.get("scale") is not None,
        "infer": dict(site.get("infer") or {}),
        "static": (_static_value(site.get("scale")), _static_value(mask)),
    }


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


def seeded_trace(model, rng_key, args, kwargs) -> dict:
    """numpyro's trace of one run of ``model`` seeded with ``rng_key`` (as ``SVI.init`` runs it
    before an autoguide's first run)."""
    return handlers.trace(handlers.seed(model, rng_key)).get_trace(*args, **kwargs)


def full_size_model(model, plates):
    """``model`` with every subsampled plate in ``plates`` using all its elements (for
    validating all observed data and initialising every element of the local latents)."""
    indices = {p.name: np.arange(p.size) for p in plates}

    def full(*args, **kwargs):
        return PlateIndices(model, indices)(*args, **kwargs)

    return full


class _LastSite(Messenger):
    """Remembers the name of the last site the model reached, and the subsampled plates it
    entered."""

    def __init__(self, fn=None):
        super().__init__(fn)
        self.name = None
        self.subsampled: list = []

    def process_message(self, msg):
        if msg.get("name") is not None:
            self.name = msg["name"]
        if msg.get("type") == "plate" and len(msg.get("args", ())) == 2:
            size, subsample_size = msg["args"]
            if subsample_size is not None and subsample_size != size:
                self.subsampled.append(msg["name"])
