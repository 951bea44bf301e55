"""The model as one traced program: every sample site's trace entry from the latent values.

:class:`ModelProgram` runs the model's Python code once per input signature into a jaxpr,
and evaluates it, pruned to the sites asked for, with the latent values substituted (the
model is run again only when it cannot be traced). The trace entries are the
distributions as the factors read them: an observed value feasible where masked, a
latent's prior without masks (:func:`feasible_where_masked`, :func:`without_mask`).
"""

from __future__ import annotations

import traceback

import jax
import jax.numpy as jnp
import jax.extend.core as jax_core
import numpy as np
import numpyro.distributions as dist
from numpyro import handlers
from numpyro.primitives import Messenger

from blrppl.errors import BLRError, ModelTraceError
from blrppl.graph.data import DataSpec
from blrppl.graph.stable import Stabilise, rewrapped
from blrppl.model import scan_map
from blrppl.model.records import given_matrices, unwrap, value_mask
from blrppl.model.trace import PlateIndices, count_model_run, full_size_model, trace_model, trace_program


class _Collected(Exception):
    """Raised to stop the model once every wanted site has run."""


class _Record(Messenger):
    """Collects the trace entry (``fn``, ``value``, ``scale``) of every sample site, as the
    factors read them: observed values feasible where masked, latents' priors unmasked."""

    def __init__(self, fn):
        super().__init__(fn)
        self.sites = {}

    def postprocess_message(self, msg):
        if msg["type"] != "sample" or msg.get("name") is None:
            return
        self.sites[msg["name"]] = _entry(msg)


def _entry(msg) -> dict:
    """A sample site's trace entry as the factors read it (see :class:`_Record`), with the
    matrices its distribution was built from that its pytree drops (``given``)."""
    site = {k: msg[k] for k in ("fn", "value", "scale")}
    if msg.get("is_observed"):
        site["value"] = feasible_where_masked(msg["fn"], msg["value"])
    else:
        site["fn"] = without_mask(msg["fn"])
    given = given_matrices(unwrap(msg["fn"])[0])
    if given:
        site["given"] = given
    return site


class ModelProgram:
    """The model as one traced program: (every latent's value, data leaves, minibatch
    indices) → every sample site's trace entry (distribution, value, scale).

    The model's Python code runs once per input signature (the shapes and dtypes of the
    inputs; under ``vmap`` or ``grad`` the signature of one example), into a jaxpr; every
    later request evaluates that jaxpr, pruned (dead-code elimination) to the sites asked
    for. Distributions travel as pytrees (numpyro's distributions are registered ones).
    A model whose entries are not pytrees of arrays falls back to running the model (once
    per request, stopped after the last wanted site), as does a site the program does not
    record.
    """

    def __init__(self, model):
        self.model = model
        self._traced: dict = {}
        self._pruned: dict = {}
        self._with_exp: dict = {}
        self._specs: dict = {}

    # Everything below the entry points (the compiler, the engine) holds the model only as
    # this program: these are the ways they run it.

    @property
    def identity(self):
        """What identifies the model in the compiled-fit cache (the model function itself)."""
        return self.model

    def fresh(self) -> "ModelProgram":
        """The same model as a new program (nothing traced yet)."""
        return ModelProgram(self.model)

    def trace(self, args=(), kwargs=None, rng_key=None, init_strategy=None):
        """The model's program traced with this data (:func:`blrppl.model.trace.trace_program`)."""
        return trace_program(self.model, args, kwargs, rng_key, init_strategy)

    def records(self, args=(), kwargs=None, rng_key=None, tracer=None):
        """The model run once, its sites recorded (:func:`blrppl.model.trace.trace_model`)."""
        return trace_model(self.model, args, kwargs, rng_key, tracer=tracer)

    def at_full_size(self, plates) -> "ModelProgram":
        """The model with every subsampled plate in ``plates`` using all its elements."""
        return ModelProgram(full_size_model(self.model, plates))

    def conditioned(self, sites) -> "ModelProgram":
        """The model with ``sites`` observed at the values of the keyword argument
        ``_blr_grid`` (run-time data: one compiled fit serves every value)."""
        model = self.model

        def conditioned(*args, _blr_grid=None, **kwargs):
            values = {site: _blr_grid[i] for i, site in enumerate(sites)}
            with handlers.condition(data=values):
                return model(*args, **kwargs)

        return ModelProgram(conditioned)

    def log_density_fn(self, args, kwargs, name: str):
        """``value → the model's log joint density`` (Σ log p over its sites, masks and scales
        applied) with the keyword argument ``name`` set to ``value``, compiled once: for a model
        none of whose sample sites is latent (every latent conditioned, as :meth:`conditioned`
        makes them for a grid over all of them)."""
        from numpyro.infer.util import log_density

        args, kwargs = tuple(args), dict(kwargs)
        return jax.jit(lambda value: log_density(self.model, args, {**kwargs, name: value}, {})[0])

    def computed_sites(self, args, kwargs, key, draws: dict, params: dict, names, barren: list, lock=None) -> dict:
        """The sites the model computes at each of ``draws`` (the fitted latents' values,
        leading axis the draws; ``params`` the fitted ``numpyro.param`` values), run as
        numpyro's ``Predictive`` runs it: the latents ``barren`` (integrated out of the fit)
        drawn given the others, and the deterministic sites ``names`` (None: those of the
        model's trace at the first draw).

        The data are tried as given (as the user's own ``Predictive`` passes them: a model
        may read them concretely, ``int(np.max(idx))``), then with NumPy arrays as JAX
        arrays, as the fit passed them (``Predictive`` vmaps the model over the draws, and a
        NumPy array indexed by a traced value fails). ``lock`` is held while the model runs
        (numpyro's effect handlers keep one process-wide stack).

        Raises:
            Exception: whatever the model raises at the draws with both forms of the data.
        """
        import contextlib

        from numpyro.infer import Predictive

        converted = jax.tree.map(_as_jax, (args, kwargs))
        calls = [(args, kwargs)]
        if any(a is not b for a, b in zip(jax.tree.leaves((args, kwargs)), jax.tree.leaves(converted))):
            calls.append(converted)
        for i, (call_args, call_kwargs) in enumerate(calls):
            try:
                with lock or contextlib.nullcontext(), handlers.block():
                    wanted = names
                    if wanted is None:
                        # (JAX arrays: numpyro's scan indexes a substituted value by its traced step)
                        first = {name: jnp.asarray(x[0]) for name, x in draws.items()}
                        seeded = handlers.seed(handlers.substitute(self.model, data={**params, **first}), 0)
                        trace = handlers.trace(seeded).get_trace(*call_args, **call_kwargs)
                        wanted = [n for n, site in trace.items() if site["type"] == "deterministic"]
                    wanted = list(barren) + [n for n in wanted if n not in draws and n not in barren]
                    if not wanted:
                        return {}
                    predictive = Predictive(
                        self.model, posterior_samples=draws, params=params, return_sites=wanted, batch_ndims=1
                    )
                    values = predictive(key, *call_args, **call_kwargs)
                return {n: values[n] for n in wanted if n in values}
            except Exception:  # (the model's own code: anything it raises)
                if i + 1 == len(calls):
                    raise
        return {}

    def _run(self, full, args, kwargs, indices, names=None, tracing=False):
        count_model_run()
        model = handlers.substitute(Stabilise(self.model), data=full)
        if indices:
            model = PlateIndices(model, indices)
        runner = _Record(model) if names is None else _StopAfter(model, names)
        try:
            runner(*args, **kwargs)
        except _Collected:
            pass
        except BLRError:
            raise
        except Exception as exc:
            if tracing and isinstance(exc, _NOT_TRACEABLE):
                raise  # (the program falls back to running the model: see _trace)
            raise _substituted_run_error(exc, runner.sites if names is None else {}) from exc
        return runner.sites

    def _trace(self, signature, spec, inputs):
        flat, in_tree = jax.tree.flatten(inputs)

        def program(*leaves):
            full, data, indices = jax.tree.unflatten(in_tree, leaves)
            args, kwargs = spec.merge(data)
            return self._run(full, args, kwargs, indices, tracing=True)

        avals = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x), weak_type=_weak(x)) for x in flat]
        try:
            closed, shapes = jax.make_jaxpr(program, return_shape=True)(*avals)
        except _NOT_TRACEABLE:
            return None  # entries that are not pytrees of arrays, or values read concretely
        out_leaves, out_tree = jax.tree.flatten(shapes)
        sizes = jax.tree.unflatten(out_tree, [1] * len(out_leaves))
        slices, start = {}, 0
        for name, entry in sizes.items():
            n = len(jax.tree.leaves(entry))
            slices[name] = (start, start + n)
            start += n
        return closed, out_tree, slices

    def sites(
        self, names, full: dict, data, indices: dict, spec: DataSpec, vectorise: bool = False, exp_inputs=None,
    ) -> dict:
        """The trace entries of the sites ``names`` with latent values ``full`` (every
        latent, constrained), data leaves ``data`` and plate minibatch ``indices``; with
        ``vectorise``, the program's scans whose carries are known ahead run as maps over
        their steps (:mod:`blrppl.model.scan_map`: the same values, without the loop).

        With a dict ``exp_inputs``, each entry leaf that the program computes as ``exp(z)``
        is recorded there as ``id(leaf) → (leaf, z)``: a log-normal argument's log is then
        read, not computed as ``log(exp(z))`` (whose pushed rows would be divided by
        ``exp(z)`` elementwise, an exponential and a division per element and row that XLA
        does not simplify away)."""
        inputs = (full, tuple(data), dict(indices))
        flat, in_tree = jax.tree.flatten(inputs)
        self._specs[id(spec)] = spec  # (a spec holding arrays is not hashable: keyed by identity, kept alive)
        signature = (id(spec), in_tree, tuple((jnp.shape(x), jnp.result_type(x), _weak(x)) for x in flat))
        if signature not in self._traced:
            self._traced[signature] = self._trace(signature, spec, inputs)
        traced = self._traced[signature]
        if traced is None or any(n not in traced[2] for n in names):
            args, kwargs = spec.merge(data)
            return self._run(full, args, kwargs, indices, names)
        closed, out_tree, slices = traced
        wanted = frozenset(names)
        key = (signature, wanted, vectorise)
        if key not in self._pruned:
            used = [False] * out_tree.num_leaves
            for n in wanted:
                a, b = slices[n]
                used[a:b] = [True] * (b - a)
            jaxpr, used_inputs = dce(closed.jaxpr, used)
            consts = closed.consts
            if vectorise:
                jaxpr, consts = scan_map.vectorise(jaxpr, consts)
            self._pruned[key] = (jaxpr, consts, used_inputs, used)
        jaxpr, consts, used_inputs, used = self._pruned[key]
        logged = ()
        if exp_inputs is not None:
            # (the same pruned program with the exponentials' inputs as extra outputs)
            if key not in self._with_exp:
                self._with_exp[key] = _with_exp_inputs(jaxpr)
            jaxpr, logged = self._with_exp[key]
        outs = jax.core.eval_jaxpr(jaxpr, consts, *[x for x, u in zip(flat, used_inputs) if u])
        outs, extra = outs[: len(outs) - len(logged)], outs[len(outs) - len(logged):]
        outs = iter(outs)
        leaves = [next(outs) if u else None for u in used]
        if logged:
            kept = [leaf for leaf in leaves if leaf is not None]
            for position, z in zip(logged, extra):
                exp_inputs[id(kept[position])] = (kept[position], z)
        entries = jax.tree.unflatten(out_tree, leaves)
        return {n: entries[n] for n in names}


def _as_jax(x):
    """A numeric NumPy array as a JAX array; anything else as it is."""
    if isinstance(x, np.ndarray) and np.issubdtype(x.dtype, np.number):
        return jnp.asarray(x)
    return x


def _weak(x) -> bool:
    return bool(getattr(jax.typeof(x), "weak_type", False)) if isinstance(x, jax.Array) else not hasattr(x, "dtype")


def _with_exp_inputs(jaxpr):
    """``jaxpr`` with an output appended for each of its outputs computed by ``exp`` (at
    its top level): the exponential's input. Returns (the jaxpr, the positions of those
    outputs)."""
    made_by_exp = {eqn.outvars[0]: eqn.invars[0] for eqn in jaxpr.eqns if eqn.primitive.name == "exp"}
    # (an output may be a literal, which is not hashable: never an exponential's result)
    logged = tuple(i for i, v in enumerate(jaxpr.outvars) if not isinstance(v, jax_core.Literal) and v in made_by_exp)
    if not logged:
        return jaxpr, ()
    extra = [made_by_exp[jaxpr.outvars[i]] for i in logged]
    try:
        debug = jaxpr.debug_info
        if debug is not None and debug.result_paths is not None:
            debug = debug._replace(result_paths=tuple(debug.result_paths) + ("exp_input",) * len(extra))
        return jaxpr.replace(outvars=list(jaxpr.outvars) + extra, debug_info=debug), logged
    except (AttributeError, TypeError, ValueError):  # pragma: no cover - another jax layout
        return jaxpr, ()


def dce(jaxpr, used_outputs):
    """``jaxpr`` pruned to the outputs ``used_outputs``: (pruned jaxpr, which inputs it keeps).
    (JAX's dead-code elimination is internal: without it the whole program is kept, and the
    unused outputs are computed and dropped.)"""
    try:
        from jax._src.interpreters import partial_eval as pe

        return pe.dce_jaxpr(jaxpr, used_outputs)
    except (ImportError, AttributeError):  # pragma: no cover - another jax layout
        outs = list(jaxpr.outvars)
        pruned = jaxpr.replace(outvars=[v for v, u in zip(outs, used_outputs) if u])
        return pruned, [True] * len(jaxpr.invars)


#: what running the model abstractly (for its program) raises when its entries are not


_NOT_TRACEABLE = (TypeError, jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError)


def _substituted_run_error(exc: Exception, sites: dict) -> ModelTraceError:
    """The error of a model that ran with the data given (its trace) but raised ``exc`` when
    run with its latent sites set to given values, as inference runs it (``sites``: those it
    ran before)."""
    last = next(reversed(sites)) if sites else None
    where = f" after site '{last}'" if last is not None else ""
    hint = ""
    scanned = [f for f, _ in traceback.walk_tb(exc.__traceback__) if f.f_code.co_name == "_subs_wrapper"]
    if isinstance(exc, AssertionError) and scanned:
        # numpyro's scan draws the steps past a conditioned series' end at random: no
        # inference fits them (numpyro's own samplers stop there as well)
        site = scanned[-1].f_locals.get("site")
        last = site.get("name", last) if isinstance(site, dict) else last
        where = f" at site '{last}'"
        hint = (
            "; a site inside a scan is conditioned on fewer values than the scan has steps, and numpyro "
            "draws the remaining steps at random (a forecast inside the model): condition the observed "
            "steps only (a scan over them), and forecast after the fit with numpyro's Predictive"
        )
    elif isinstance(exc, AssertionError) and any(
        "numpyro" in f.f_code.co_filename and f.f_code.co_name in ("sample", "rsample", "_sample", "__call__")
        for f, _ in traceback.walk_tb(exc.__traceback__)
    ):
        # (numpyro's samplers assert a random key: a draw no site of the trace holds)
        hint = (
            "; the model draws a random value that is no site of its trace (a sample site inside "
            "handlers.block, a distribution's .sample called in the model): inference runs the model "
            "without a random key; make it a site of the model (it is then fitted) or pass "
            "the value as data"
        )
    what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return ModelTraceError(
        f"the model could not be run with its latent sites set to values, as inference runs it: it "
        f"raised{where} ({what}){hint}",
        site=last,
    )


class _StopAfter(Messenger):
    """Collects the messages of the wanted sites and stops the model after the last one."""

    def __init__(self, fn, names):
        super().__init__(fn)
        self.remaining = set(names)
        self.sites = {}

    def postprocess_message(self, msg):
        if msg.get("name") in self.remaining:
            if msg["type"] == "sample":
                self.sites[msg["name"]] = _entry(msg)
            else:
                self.sites[msg["name"]] = {k: msg[k] for k in ("fn", "value", "scale")}
            self.remaining.discard(msg["name"])
            if not self.remaining:
                raise _Collected


def feasible_where_masked(fn, value):
    """An observed value with its masked-out elements replaced by a point of the support
    (as numpyro's ``MaskedDistribution.log_prob`` does): a NaN observation under a mask then
    contributes nothing, not even a NaN gradient through the rules."""
    base, _, mask = unwrap(fn)
    if mask is None:
        return value
    value = jnp.asarray(value)
    try:
        feasible = base.support.feasible_like(value)
    except NotImplementedError:
        feasible = jnp.zeros_like(value)
    keep = value_mask(fn, mask, value)
    return jnp.where(keep, value, feasible)


def without_mask(fn):
    """A continuous latent's distribution with its masks removed: masked-out elements of a
    latent's own prior keep that prior. (numpyro gives them a flat improper density; they
    are padding, e.g. the observed positions of ``obs_mask``'s ``<site>_unobserved`` latent
    or the steps past a sequence's end, which no other factor reads, and the prior keeps
    their posterior proper.) A discrete latent keeps its masks, as in numpyro: its flat
    density over finitely many values is proper, and a masked step of a hidden Markov chain
    then reads neither the previous state nor the transition probabilities (kept, its
    prior would add phantom transitions to their posterior)."""
    if getattr(fn.support, "is_discrete", False) or _masked_out(fn):
        return fn
    return strip_masks(fn)


def _masked_out(fn) -> bool:
    """Whether a level of ``fn`` is ``.mask(False)``: the latent has no density of its own
    (NumPyro's imputation idiom: ``x_impute`` drawn with ``.mask(False)`` and placed into
    an observed site, whose density is its only one), as numpyro scores it."""
    while isinstance(fn, (dist.Independent, dist.ExpandedDistribution, dist.MaskedDistribution)):
        if isinstance(fn, dist.MaskedDistribution) and fn._mask is False:
            return True
        fn = fn.base_dist
    return False


def strip_masks(fn):
    """``fn`` without its ``MaskedDistribution`` levels (the wrappers around them kept)."""
    return rewrapped(fn, lambda leaf: leaf, drop_masks=True)
