"""Distribution arguments as functions of the blocks: classification and moments.

For each factor, every argument the rule reads (and the value) is a function of the
neighbouring blocks, obtained by re-running the model with substituted latent values.
At compile time :func:`classify_argument` probes that function by autodiff at random
points:

* ``const``           — depends on no continuous block, or only on point (delta-method)
  blocks, which the factors see at their mean;
* ``affine_gaussian`` — affine in Gaussian blocks (second directional derivative exactly
  zero, as forward-over-forward autodiff gives for linear maps such as ``X @ w + b`` or
  ``a[group]``);
* ``power_gamma``     — c·τ^a in one Gamma block τ (``log`` of it is affine in ``log τ``),
  e.g. ``1 / jnp.sqrt(tau)``;
* ``beta`` / ``dirichlet`` — the block itself, possibly indexed;
* ``opaque``          — anything else.

Arguments that touch a plated block must use one plate element per output element
("gather" structure) for the elementwise moments to be exact. This is tested with random
sign patterns over plate elements: the squared directional derivative is the same for
every pattern exactly when a single element contributes. Dense Gaussian blocks whose
elements mix (e.g. a sum over a plate) use one column per scalar of the block instead.

At run time :func:`group_moments` builds the moment objects of :mod:`blrppl.moments`
from the blocks' ``view`` parameters with one ``jax.linearize`` of the model per factor:
means of affine arguments are values at the block means and their covariance columns are
JVPs along the block's covariance columns; gathered Gamma/Beta/Dirichlet parameters are
JVPs of the (linear) indexing map applied to the parameter arrays.
"""

from __future__ import annotations

import dataclasses
import math
import traceback
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import jax.extend.core as jax_core
import numpy as np
import numpyro.distributions as dist
from numpyro import handlers
from numpyro.primitives import Messenger

from blrppl import moments as mom
from blrppl.errors import BLRError, ModelTraceError
from blrppl.estimators.monte_carlo import tensor_gauss_hermite
from blrppl.graph import forms as fm, scan_map
from blrppl.graph.data import DataSpec, RunData
from blrppl.runtime.compile import compile_lowered, compiler_options, jit as _jit
from blrppl.graph.plan import Block
from blrppl.graph.stable import Stabilise, rewrapped
from blrppl.products import ProductMoments, product_second_moments
from blrppl.graph.trace import PlateIndices, count_model_run, given_matrices, unwrap, value_mask

#: dense Gaussian blocks whose elements mix in an argument get one column per scalar,
#: up to this many scalars; beyond it the argument is opaque
MAX_FULL_COLUMNS = 2048

#: a product of two Gaussian blocks reads E[f(d_A, d_B)²] through |S_A|·|S_B| pushes of the
#: model (|S| the tangents of a block: the scalars of one plate element); beyond this many the
#: argument is opaque (an unplated N × D latent would need N·D tangents)
MAX_BILINEAR_PUSHES = 4096
_NUM_SIGN_PATTERNS = 16
_NUM_PROBES = 2


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
        their steps (:mod:`blrppl.graph.scan_map`: the same values, without the loop).

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
            jaxpr, used_inputs = _dce(closed.jaxpr, used)
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


def _dce(jaxpr, used_outputs):
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
#: pytrees of arrays or it reads values concretely: the model is then run eagerly instead
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


class MinibatchData(NamedTuple):
    """The model's data together with the minibatch of every subsampled plate: what the
    engine passes as ``data`` to :class:`ModelFunctions` under subsampling.

    Attributes:
        leaves: the model's dynamic data leaves.
        indices: plate name → integer indices of the minibatch (length M).
    """

    leaves: tuple
    indices: dict


def table_key(name: str) -> str:
    """Where run-time data (:class:`blrppl.graph.data.RunData`) keep a stacked factor's table
    (its name would be the key of the data statistics of the same factor)."""
    return f"{name}:table"


class ModelFunctions:
    """Evaluates factors' arguments as a function of the latent values.

    The model's program (:class:`ModelProgram`: the model traced once, shared by every
    ``ModelFunctions`` of one compilation) is evaluated with the latent values substituted,
    pruned to the wanted sites, so a factor does not pay for the rest of the model.

    Args:
        model: the numpyro model.
        data_spec: how to rebuild the model's arguments from the dynamic data leaves.
        fill_values: a valid value for every latent site (used for sites a factor does not
            depend on; their values never reach the factor's arguments).
        plate_indices: plate name → minibatch indices used for subsampled plates when the
            data carry none (:class:`MinibatchData`), e.g. while compiling.
        program: the model's :class:`ModelProgram` (a new one if None).
        stacks: stacked factors (:mod:`blrppl.graph.stack`) by name: their entries are built
            from per-fit tables that ``data`` carries (a :class:`blrppl.graph.data.RunData`
            whose ``statistics`` hold them), not from the program.
    """

    def __init__(
        self,
        model,
        data_spec: DataSpec,
        fill_values: dict,
        transforms: dict | None = None,
        joints: dict | None = None,
        plate_indices: dict | None = None,
        program: ModelProgram | None = None,
        stacks: dict | None = None,
    ):
        self.model = model
        self.program = program if program is not None and program.model is model else ModelProgram(model)
        self.data_spec = data_spec
        self.fill_values = fill_values
        self.transforms = dict(transforms or {})
        self.joints = dict(joints or {})
        self.plate_indices = dict(plate_indices or {})
        self.stacks = dict(stacks or {})
        self.vectorise = False

    def vectorised(self) -> "ModelFunctions":
        """These functions evaluating the model's scans whose carries are known ahead as
        maps over their steps (:mod:`blrppl.graph.scan_map`): for the programs a fit runs
        many times. (The compiler's structural analyses read the scans as written.)"""
        out = ModelFunctions.__new__(ModelFunctions)
        out.__dict__.update(self.__dict__)
        out.vectorise = True
        return out

    def with_stacks(self, stacks: dict, data=None, tables=None) -> "ModelFunctions":
        """These functions with the stacked factors ``stacks`` (by name), and their
        ``tables`` for the data leaves ``data`` when already computed."""
        out = ModelFunctions.__new__(ModelFunctions)
        out.__dict__.update(self.__dict__)
        out.stacks = dict(stacks)
        known = {table_key(n): t for n, t in tables.items()} if tables is not None else None
        out._tables = (tuple(jax.tree.leaves(data)), known) if known is not None else ((), None)
        return out

    def stack_tables(self, data, compute) -> dict:
        """The stacked factors' tables for the data leaves ``data``: ``compute(stack, self,
        data)`` per stack, unless the last tables were computed for these very arrays."""
        leaves = tuple(jax.tree.leaves(data))
        known, tables = getattr(self, "_tables", ((), None))
        if tables is None or len(known) != len(leaves) or any(a is not b for a, b in zip(known, leaves)):
            tables = {table_key(name): compute(stack, self, data) for name, stack in self.stacks.items()}
            if not any(isinstance(x, jax.core.Tracer) for x in leaves):
                self._tables = (leaves, tables)
        return tables

    def site_values(self, values: dict) -> dict:
        """Every latent site's value (its own, constrained space) with ``values`` (block
        space) substituted and the fill values elsewhere."""
        full = dict(self.fill_values)
        for n, v in values.items():
            if n in self.joints:
                full.update(self.joints[n].split(v))
            else:
                full[n] = v
        for n, t in self.transforms.items():
            full[n] = t(full[n])
        return full

    def sites(self, names, values: dict, data, exp_inputs=None) -> dict:
        """Run the model with ``values`` (block space: unconstrained for transformed blocks)
        substituted; the messages of the sites ``names``. ``data`` may be a
        :class:`MinibatchData` (the minibatch of each subsampled plate), or a
        :class:`blrppl.graph.data.RunData` carrying the stacked factors' tables.
        ``exp_inputs``: see :meth:`ModelProgram.sites`."""
        tables = {}
        if isinstance(data, RunData):
            tables, data = data.statistics, data.model
        indices = self.plate_indices
        if isinstance(data, MinibatchData):
            indices = {**indices, **data.indices}
            data = data.leaves
        full = self.site_values(values)
        plain = tuple(n for n in names if n not in self.stacks)
        out = self.program.sites(plain, full, data, indices, self.data_spec, self.vectorise, exp_inputs) if plain else {}
        for n in names:
            if n in self.stacks:
                out[n] = self.stacks[n].site(tables[table_key(n)], full)
        return {n: out[n] for n in names}

    @staticmethod
    def rule_args(site: dict, arg_names, logged=(), exp_inputs=None) -> dict:
        """The arguments ``arg_names`` of a site's unwrapped distribution, and its value;
        those in ``logged`` as their logarithm (read from ``exp_inputs``, see
        :meth:`ModelProgram.sites`, when the program computed them as ``exp(z)``)."""
        base, _, _ = unwrap(site["fn"])
        given = site.get("given", {})
        raw = {a: given[a] if a in given else getattr(base, a) for a in arg_names}
        raw["value"] = site["value"]
        args = {}
        for a, x in raw.items():
            if a in logged:
                found = (exp_inputs or {}).get(id(x))
                x = found[1] if found is not None and found[0] is x else jnp.log(x)
            args[a] = jnp.asarray(x)
        return args

    def args_of(self, wanted: dict, values: dict, data, logged=None) -> dict:
        """Arguments of several sites: ``wanted`` maps site → argument names (rule arguments)
        or → a function of the site's trace entry returning a dict of arrays. ``logged``
        maps sites to the names of arguments returned as their logarithm (log-normal
        arguments, :class:`blrppl.moments.ExpGaussian`)."""
        exp_inputs = {} if logged else None
        sites = self.sites(tuple(wanted), values, data, exp_inputs)
        return {
            name: extract(sites[name]) if callable(extract)
            else self.rule_args(sites[name], extract, (logged or {}).get(name, ()), exp_inputs)
            for name, extract in wanted.items()
        }

    def log_probs(self, names, values: dict, data) -> dict:
        """Each site's log-density (wrappers and scale applied), summed over its elements
        except for the batch dims, as ``(log_prob array, scale)``."""
        sites = self.sites(tuple(names), values, data)
        return {n: (sites[n]["fn"].log_prob(sites[n]["value"]), sites[n].get("scale")) for n in names}

    def factor_args(self, name: str, arg_names, values: dict, data) -> dict:
        """The rule arguments and value of site ``name`` (unwrapped distribution)."""
        return self.args_of({name: arg_names}, values, data)[name]

    def factor_wrappers(self, names, data) -> dict:
        """The wrapped distribution and scale of each site (used for the wrappers — event
        dims, masks, expansion — which do not depend on latent values)."""
        sites = self.sites(tuple(names), {}, data)
        return {name: (sites[name]["fn"], sites[name].get("scale")) for name in names}


# -- projections for quadrature -----------------------------------------------------------

#: link g and inverse of the scalar projections a quadrature factor integrates over
LINKS = {
    "identity": (lambda x: x, lambda y: y),
    "exp": (jnp.exp, jnp.log),
    "sigmoid": (jax.nn.sigmoid, jax.scipy.special.logit),
}


class CanonicalTree(NamedTuple):
    """How to rebuild a pytree from its leaves in :func:`canonical_leaves` order."""

    treedef: Any
    order: tuple  # flatten positions, in canonical order

    def unflatten(self, leaves):
        flat = [None] * len(self.order)
        for position, leaf in zip(self.order, leaves):
            flat[position] = leaf
        return jax.tree_util.tree_unflatten(self.treedef, flat)


def canonical_leaves(tree) -> tuple[list, CanonicalTree]:
    """A pytree's leaves in an order that does not depend on Python's hash seed.

    numpyro flattens a distribution's fields in the order of a set of their names, which
    changes from process to process: programs built from that order (which leaf a
    quadrature projection reads, the outputs of a posterior export) would differ between
    processes and miss the persistent compilation cache. Here every distribution's fields
    are visited by name.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    ids = jax.tree_util.tree_unflatten(treedef, list(range(len(leaves))))
    order: list = []

    def walk(x):
        if isinstance(x, dist.Distribution):
            for name in sorted(type(x).gather_pytree_data_fields()):
                walk(x.__dict__.get(name))
            return
        for sub in jax.tree_util.tree_leaves(x, is_leaf=lambda y: isinstance(y, dist.Distribution)):
            if isinstance(sub, dist.Distribution):
                walk(sub)
            elif isinstance(sub, int) and not isinstance(sub, bool) and sub not in seen:
                seen.add(sub)
                order.append(sub)

    seen: set = set()
    walk(ids)
    order += [i for i in range(len(leaves)) if i not in seen]  # none expected; kept complete
    return [leaves[i] for i in order], CanonicalTree(treedef, tuple(order))


def distribution_leaves(site: dict):
    """(unwrapped distribution, its pytree leaves in canonical order, the
    :class:`CanonicalTree` that rebuilds it) of a site's trace entry."""
    base, _, _ = unwrap(site["fn"])
    leaves, tree = canonical_leaves(base)
    return base, leaves, tree


def log_prob_reads(base, leaves, tree: CanonicalTree, value) -> frozenset:
    """The positions (canonical order) of the leaves a distribution's ``log_prob`` reads.

    numpyro keeps fields its density never uses (a ``StudentT`` holds a ``Chi2`` of its
    ``df`` for sampling): such a leaf is not a parameter of the factor, and counting it
    would give a Student-t with a latent ``df`` four projections instead of two. Read off
    the density's program (dead-code elimination); every leaf when it cannot be traced.
    """
    everything = frozenset(range(len(leaves)))

    def aval(x):
        return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))

    def density(ls, v):
        return jnp.sum(tree.unflatten(ls).log_prob(v))

    try:
        closed = jax.make_jaxpr(density)([aval(x) for x in leaves], aval(value))
    except Exception:  # noqa: BLE001 - a density that does not trace abstractly: keep every leaf
        return everything
    _, used = _dce(closed.jaxpr, [True])
    return frozenset(i for i in everything if used[i])


def projection_args(links) -> Callable:
    """Extractor of the projections η = g⁻¹(leaf) of a quadrature factor from a site entry.

    ``links`` holds ``(name, index, link)``: ``index`` is a leaf position of the unwrapped
    distribution, ``"value"``, or ``"shift:<i>"`` for value − leaf i (a translation
    family's value minus its location).
    """

    def extract(site):
        _, leaves, _ = distribution_leaves(site)
        out = {}
        for name, index, link in links:
            if index == "value":
                x = site["value"]
            elif isinstance(index, str):  # "shift:<i>"
                x = jnp.asarray(site["value"]) - leaves[shift_leaf(index)]
            else:
                x = leaves[index]
            out[name] = LINKS[link][1](jnp.asarray(x))
        return out

    return extract


def shift_leaf(index: str) -> int:
    """The location leaf of a ``"shift:<i>"`` projection."""
    return int(index.split(":")[1])


def factor_arguments(factor):
    """What :meth:`ModelFunctions.args_of` extracts for a factor."""
    if factor.rule is not None:
        return factor.rule.arg_names
    return projection_args(factor.links)


# -- probing -----------------------------------------------------------------------------


def random_point(block: Block, rng: np.random.Generator) -> np.ndarray:
    """A random value of a block's site, inside its support (host-side numpy)."""
    shape = block.value_shape
    if block.discrete:
        return rng.choice(np.asarray(block.support_values), size=shape)
    return block.family.random_value(rng, shape)


def _second_derivative(fn, point, tangent):
    """d²/ds² fn(point + s·tangent) at s = 0 (forward over forward: exact zeros for affine fn)."""

    def first(s):
        return fn(jax.tree.map(lambda p, t: p + s * t, point, tangent))

    def d1(s):
        return jax.jvp(first, (s,), (jnp.ones_like(s),))[1]

    s0 = jnp.zeros(())
    return jax.jvp(d1, (s0,), (jnp.ones_like(s0),))[1]


def _sign_tangents(block: Block, rng: np.random.Generator, elementwise: bool):
    """Random sign patterns over the block's elements (or plate elements), site layout."""
    if elementwise:
        signs = rng.choice([-1.0, 1.0], size=(_NUM_SIGN_PATTERNS,) + block.value_shape)
        return signs * np.exp(0.3 * rng.normal(size=block.value_shape))
    bshape = block.batch_shape
    dim = math.prod(block.value_shape) // max(math.prod(bshape), 1)
    signs = rng.choice([-1.0, 1.0], size=(_NUM_SIGN_PATTERNS,) + bshape + (1,))
    canon = signs * rng.normal(size=(dim,))
    return np.stack([block.to_site(c) for c in canon])


def _element_size(block: Block) -> int:
    """Tangents of a Gaussian block read elementwise: the scalars of one plate element (all of
    them for an unplated block) when it holds their covariance, else one."""
    if not block.family.dense_event:
        return 1
    return block.size // max(math.prod(block.batch_shape), 1)


def _needs_gather_test(block: Block, elementwise: bool) -> bool:
    return math.prod(block.value_shape if elementwise else block.batch_shape) > 1


def _whole_tangents(block: Block, rng: np.random.Generator):
    """Random signs over a matrix-valued block's elements times one coded matrix C
    (C_ij = iD + j + 1): the JVP of an argument that reads whole matrices in place (a
    gather, a broadcast, a transpose) squares to C² or (Cᵀ)² in every output matrix."""
    dim = block.value_shape[-1]
    signs = rng.choice([-1.0, 1.0], size=(_NUM_SIGN_PATTERNS,) + tuple(block.value_shape[:-2]) + (1, 1))
    return signs * _code_matrix(dim)


def _code_matrix(dim: int) -> np.ndarray:
    return np.arange(1.0, dim * dim + 1.0).reshape(dim, dim)


def _whole_ok(sq, dim: int) -> bool:
    """Whether every output matrix of the squared JVPs ``sq`` is c² C² or c² (Cᵀ)² for one
    c ≠ 0 per matrix (whole matrices read in place, each times a constant)."""
    sq = np.asarray(sq)
    if sq.ndim < 3 or sq.shape[-2:] != (dim, dim):
        return False
    code = np.square(_code_matrix(dim))
    c2 = sq[..., :1, :1]  # c² from C₀₀ = 1
    if not np.all(np.isfinite(sq)) or np.any(c2 <= 0):
        return False
    tol = 1e-5 if sq.dtype == np.float64 else 1e-3
    as_is = np.all(np.abs(sq - c2 * code) <= tol * c2 * code, axis=(-2, -1))
    transposed = np.all(np.abs(sq - c2 * code.T) <= tol * c2 * code, axis=(-2, -1))
    return bool(np.all(as_is | transposed))


#: the kind of an argument no closed-form rule reads (beside :data:`blrppl.moments.KINDS`)
OPAQUE = "opaque"


@dataclasses.dataclass(frozen=True)
class ArgumentClass:
    """Result of classifying one argument.

    Attributes:
        kind: one of :data:`blrppl.moments.KINDS` (the ``kind`` of its moment class) or
            :data:`OPAQUE`.
        blocks: continuous blocks it depends on.
        full: Gaussian blocks whose plate elements mix in this argument.
        reason: why the argument is opaque (empty otherwise).
        power: for ``power_gamma``, the exponent a when it is the same for every element.
        pairs: for ``bilinear_gaussian``, the (left, right) pairs of blocks whose product it
            holds (:class:`blrppl.moments.BilinearGaussian`).
        gather: plated blocks whose plate elements the argument must not mix for the class
            to hold (a contraction ``X @ C.T`` over the event axis of each row): a decision
            of the forms that a probe confirms (:func:`gather_probe`).
    """

    kind: str
    blocks: tuple
    full: tuple = ()
    reason: str = ""
    power: float | None = None
    pairs: tuple = ()
    gather: tuple = ()

    @property
    def opaque(self) -> bool:
        """Whether no closed-form rule reads the argument."""
        return self.kind == OPAQUE


@dataclasses.dataclass
class ArgumentProbe:
    """Probes of one argument: host-side random inputs, a traceable computation of the probe
    values, and the decision taken from them.

    ``compute(inputs, data)`` is pure JAX so that the probes of every argument of a model run
    in one compiled call; ``decide(outputs)`` runs on the host.
    """

    group: str
    cont: tuple
    inputs: dict
    compute: Callable | None
    decide: Callable


def probe_argument(fn, deps: frozenset, blocks: dict, rng: np.random.Generator) -> ArgumentProbe:
    """Plan the probes that classify ``fn(values, data)`` (a function of latent site values).

    Args:
        fn: maps (dict of latent site values, data) to the argument.
        deps: names of the blocks the argument depends on (structurally).
        blocks: name → :class:`Block` for every latent site.
        rng: host random generator for probe points.
    """
    cont = tuple(n for n in deps if not blocks[n].discrete)
    disc = tuple(n for n in deps if blocks[n].discrete)
    if not cont:
        return ArgumentProbe("const", (), {}, None, lambda out: ArgumentClass("const", ()))
    if all(blocks[n].point for n in cont):
        # point blocks are seen at their mean: the argument is a constant of the factor's
        # expectation (its value, at the points, still depends on them for their updates)
        return ArgumentProbe("const", (), {}, None, lambda out: ArgumentClass("const", ()))
    gaussian = all(blocks[n].family.gaussian for n in cont)
    if gaussian:
        group = mom.AffineGaussian.kind
    elif len(cont) == 1 and blocks[cont[0]].family.argument_kind is not None:
        # one Gamma, Beta or Dirichlet block: probed for its family's argument kind
        group = blocks[cont[0]].family.argument_kind
    else:
        reason = "depends on several non-Gaussian blocks"
        return ArgumentProbe(
            "opaque", cont, {}, None, lambda out: ArgumentClass("opaque", cont, reason=reason)
        )

    inputs = {"points": [], "tangents": [], "signs": []}
    for _ in range(_NUM_PROBES):
        inputs["points"].append({n: random_point(blocks[n], rng) for n in cont + disc})
        inputs["tangents"].append({n: rng.normal(size=blocks[n].value_shape) for n in cont})
        signs = {}
        for n in cont:
            elementwise = not gaussian or not blocks[n].family.dense_event
            if _needs_gather_test(blocks[n], elementwise):
                signs[n] = _sign_tangents(blocks[n], rng, elementwise)
        inputs["signs"].append(signs)
    # secant targets from the first point: the second point, a reflection (−x for Gaussian
    # blocks, 1/τ for Gamma blocks: across the kinks of abs, relu, max(τ, 1)), a far point
    first, second = inputs["points"][0], inputs["points"][1]
    powers = not gaussian and blocks[cont[0]].family.any_power
    if gaussian:
        inputs["secants"] = [
            {n: second[n] for n in cont},
            {n: -first[n] for n in cont},
            {n: 3.0 * second[n] for n in cont},
        ]
    elif powers:
        inputs["secants"] = [
            {n: second[n] for n in cont},
            {n: 1.0 / first[n] for n in cont},
            {n: second[n] ** 3 for n in cont},
        ]
    if not gaussian and blocks[cont[0]].family.whole_events:
        inputs["whole"] = _whole_tangents(blocks[cont[0]], rng)
    if gaussian:
        compute, decide = _gaussian_probe(fn, cont, blocks)
    elif powers:
        compute, decide = _gamma_probe(fn, cont[0])
    else:
        compute, decide = _identity_probe(fn, cont[0], blocks[cont[0]].family)
    return ArgumentProbe(group, cont, inputs, compute, decide)


def too_many_columns(cls: "ArgumentClass", blocks: dict) -> "ArgumentClass":
    """``cls``, or opaque when it mixes the plate elements of a block with more than
    :data:`MAX_FULL_COLUMNS` scalars that no banded family holds (one column per scalar of
    it would be pushed through the model: memory quadratic in its size)."""
    for n in cls.full:
        b = blocks[n]
        if b.size > MAX_FULL_COLUMNS and b.batch_shape and not b.family.banded:
            return ArgumentClass("opaque", cls.blocks, reason=f"mixes the elements of the large block '{n}'")
    return cls


def gather_probe(fn, cls: ArgumentClass, blocks: dict, rng: np.random.Generator) -> ArgumentProbe:
    """Confirm a class the forms decided up to the plates (:attr:`ArgumentClass.gather`):
    along random sign patterns over a block's plate elements, the squared JVP of an argument
    reading one plate element per output element does not change. A multiplied block
    (``pairs``) whose elements mix makes the argument opaque; any other block is read
    through its full covariance columns (``full``)."""
    point = {n: random_point(blocks[n], rng) for n in cls.blocks}
    whole = {n for n in cls.gather if blocks[n].family.whole_events}
    signs = {
        n: _whole_tangents(blocks[n], rng) if n in whole else _sign_tangents(blocks[n], rng, not blocks[n].family.dense_event)
        for n in cls.gather
    }

    def compute(inputs, data):
        return {n: _jvp_squares(fn, inputs["point"], n, s, data) for n, s in inputs["signs"].items()}

    def decide(outputs) -> ArgumentClass:
        broken = sorted(n for n in whole if not _whole_ok(outputs[n], blocks[n].value_shape[-1]))
        if broken:
            family = blocks[broken[0]].family.name.capitalize()
            reason = f"reads parts of the {family} matrices of '{broken[0]}', or mixes them (not whole matrices)"
            return ArgumentClass(OPAQUE, cls.blocks, reason=reason)
        mixed = sorted(n for n, sq in outputs.items() if n not in whole and not _gather_ok(sq))
        multiplied = {n for pair in cls.pairs for n in pair}
        bad = [n for n in mixed if n in multiplied]
        if bad:
            reason = f"a contraction of products of latents over the plate elements of '{bad[0]}'"
            return ArgumentClass(OPAQUE, cls.blocks, reason=reason)
        return dataclasses.replace(cls, gather=(), full=tuple(sorted(set(cls.full) | set(mixed))))

    return ArgumentProbe(cls.kind, cls.blocks, {"point": point, "signs": signs}, compute, decide)


def pairing_probe(fn, shared: dict, point: dict, blocks: dict, rng: np.random.Generator) -> ArgumentProbe:
    """Plan the probe that tells which plated Gaussian blocks a factor's arguments read at
    different elements (``value = x[1:]`` with ``loc = x[:-1]``): each argument alone reads
    one plate element per output element, yet the pair couples neighbours.

    Along a tangent m and its products s ⊙ m with random sign patterns s over the plate
    elements, an argument a reading element p_a(n) at output n has J_a(s ⊙ m)_n =
    s_{p_a(n)} J_a(m)_n; two arguments read the same element exactly when their ratios agree
    for every pattern.

    Args:
        fn: maps (latent values, data) to the factor's arguments (a dict).
        shared: block → the arguments that read it elementwise ("gather").
        point: the probe point (every neighbour block).
        blocks: name → :class:`Block`.
        rng: host random generator.

    Returns:
        a probe whose decision is the set of blocks whose elements the factor couples.
    """
    inputs = {"point": point, "tangents": {}}
    for n in shared:
        b = blocks[n]
        elementwise = not b.family.dense_event
        if elementwise:
            base = np.exp(0.3 * rng.normal(size=b.value_shape))
            signs = rng.choice([-1.0, 1.0], size=(_NUM_SIGN_PATTERNS,) + b.value_shape)
            inputs["tangents"][n] = np.concatenate([base[None], signs * base])
        else:
            dim = math.prod(b.value_shape) // max(math.prod(b.batch_shape), 1)
            event = rng.normal(size=(dim,))
            signs = rng.choice([-1.0, 1.0], size=(_NUM_SIGN_PATTERNS,) + b.batch_shape + (1,))
            canon = np.concatenate([np.ones((1,) + b.batch_shape + (1,)), signs]) * event
            inputs["tangents"][n] = np.stack([b.to_site(c) for c in canon])

    def compute(inputs, data):
        out = {}
        for n, tangents in inputs["tangents"].items():
            p = inputs["point"]

            def along(t, n=n, p=p):
                return jax.jvp(lambda x: fn({**p, n: x}, data), (p[n],), (t,))[1]

            pushed = jax.vmap(along)(tangents)
            out[n] = {a: pushed[a] for a in shared[n]}
        return out

    def decide(outputs) -> frozenset:
        coupled = set()
        for n, args in outputs.items():
            arrays = [np.asarray(v) for v in args.values()]
            shape = np.broadcast_shapes(*(a.shape for a in arrays))
            arrays = [np.broadcast_to(a, shape) for a in arrays]
            ratios, valid = [], []
            for a in arrays:
                base = a[0]
                ok = np.abs(base) > 1e3 * np.finfo(a.dtype).eps * (np.max(np.abs(base), initial=0.0) + 1e-30)
                ratios.append(np.where(ok, a[1:] / np.where(ok, base, 1.0), 0.0))
                valid.append(ok)
            for i in range(len(arrays)):
                for j in range(i + 1, len(arrays)):
                    both = valid[i] & valid[j]
                    if np.any(both & (np.sign(ratios[i]) != np.sign(ratios[j]))):
                        coupled.add(n)
        return frozenset(coupled)

    return ArgumentProbe("pairing", tuple(shared), inputs, compute, decide)


def _secant_ok(diff, slope) -> bool:
    """f(x1) − f(x0) == J(x0)(x1 − x0), as for every affine map."""
    diff, slope = np.asarray(diff), np.asarray(slope)
    if not (np.all(np.isfinite(diff)) and np.all(np.isfinite(slope))):
        return False
    rtol = 1e-6 if diff.dtype == np.float64 else 1e-3
    scale = 1.0 + (np.abs(diff).max() if diff.size else 0.0)
    return bool(np.allclose(diff, slope, rtol=rtol, atol=rtol * 1e-3 * scale))


def _gather_ok(sq) -> bool:
    sq = np.asarray(sq)
    ref = sq[0]
    tol = 1e-5 if sq.dtype == np.float64 else 1e-3
    return bool(np.all(np.abs(sq - ref) <= tol * (np.abs(ref) + 1e-12)))


def _jvp_squares(fn, point, name, tangents, data):
    def jvp_of(t):
        return jax.jvp(lambda x: fn({**point, name: x}, data), (point[name],), (t,))[1]

    return jnp.square(jax.vmap(jvp_of)(tangents))


def _gaussian_probe(fn, cont, blocks):
    def compute(inputs, data):
        out = []
        for point, tangent, signs in zip(inputs["points"], inputs["tangents"], inputs["signs"]):

            def restricted(x, point=point):
                return fn({**point, **x}, data)

            d2 = _second_derivative(restricted, {n: point[n] for n in cont}, tangent)
            sq = {n: _jvp_squares(fn, point, n, signs[n], data) for n in signs}
            out.append({"d2": d2, "sq": sq, "val": fn(point, data)})
        # secants from the first probe point: exact for affine maps, not across kinks (abs, relu)
        p0 = inputs["points"][0]
        x0 = {n: p0[n] for n in cont}
        secants = []
        for target in inputs["secants"]:
            step = jax.tree.map(lambda a, b: b - a, x0, target)
            f0, slope = jax.jvp(lambda x: fn({**p0, **x}, data), (x0,), (step,))
            secants.append((fn({**p0, **target}, data) - f0, slope))
        out.append({"secant": secants})
        return out

    def decide(outputs):
        full = set()
        if not all(_secant_ok(*sec) for sec in outputs[-1]["secant"]):
            return ArgumentClass("opaque", cont, reason="not affine in its Gaussian blocks")
        for o in outputs[:-1]:
            d2 = np.asarray(o["d2"])
            # exact zeros for linear maps; a link's inverse composed with the link (log∘exp)
            # leaves rounding-level curvature
            tol = (1e-8 if d2.dtype == np.float64 else 1e-4) * (1.0 + np.abs(np.asarray(o["val"])))
            if not bool(np.all(np.abs(d2) <= tol)):
                return ArgumentClass("opaque", cont, reason="not affine in its Gaussian blocks")
            full.update(n for n, sq in o["sq"].items() if not _gather_ok(sq))
        return ArgumentClass("affine_gaussian", cont, tuple(sorted(full)))

    return compute, decide


def _gamma_probe(fn, name):
    def compute(inputs, data):
        out = []
        for point, tangent, signs in zip(inputs["points"], inputs["tangents"], inputs["signs"]):

            def log_fn(u, point=point):
                return jnp.log(fn({**point, name: jnp.exp(u[name])}, data))

            u0 = {name: jnp.log(point[name])}
            val = fn(point, data)
            d2 = _second_derivative(log_fn, u0, {name: tangent[name]})
            slope = jax.jvp(log_fn, (u0,), ({name: jnp.ones_like(u0[name])},))[1]
            o = {"val": val, "d2": d2, "slope": slope}
            if name in signs:
                log_point = {**point, name: u0[name]}
                o["sq"] = _jvp_squares(lambda v, d: log_fn({name: v[name]}), log_point, name, signs[name], data)
            out.append(o)
        # secants in log space from the first probe point (catch kinks such as max(τ, 1))
        p0 = inputs["points"][0]

        def log_at(u):
            return jnp.log(fn({**p0, name: jnp.exp(u)}, data))

        u0 = jnp.log(p0[name])
        secants = []
        for target in inputs["secants"]:
            u1 = jnp.log(target[name])
            g0, slope = jax.jvp(log_at, (u0,), (u1 - u0,))
            secants.append((log_at(u1) - g0, slope))
        out.append({"secant": secants})
        return out

    def decide(outputs):
        if not all(_secant_ok(*sec) for sec in outputs[-1]["secant"]):
            return ArgumentClass("opaque", (name,), reason="not a power of its Gamma block")
        for o in outputs[:-1]:
            val = np.asarray(o["val"])
            if not np.all(val > 0):
                return ArgumentClass("opaque", (name,), reason="not positive")
            if not np.all(np.abs(np.asarray(o["d2"])) <= 1e-6 * (1 + np.abs(val))):
                return ArgumentClass("opaque", (name,), reason="not a power of its Gamma block")
            if "sq" in o and not _gather_ok(o["sq"]):
                return ArgumentClass("opaque", (name,), reason="mixes elements of its Gamma block")
        slope = np.asarray(outputs[0]["slope"]).ravel()
        power = float(slope[0]) if slope.size and np.allclose(slope, slope[0], rtol=1e-6, atol=1e-9) else None
        return ArgumentClass("power_gamma", (name,), power=power)

    return compute, decide


def _identity_probe(fn, name, family):
    def compute(inputs, data):
        out = []
        for point, signs in zip(inputs["points"], inputs["signs"]):
            x = point[name]

            def lin_fn(v, point=point):
                return fn({**point, name: v}, data)

            val, slope_x = jax.jvp(lin_fn, (x,), (x,))
            _, slope_1 = jax.jvp(lin_fn, (x,), (jnp.ones_like(x),))
            o = {"val": val, "slope_x": slope_x, "slope_1": slope_1}
            if name in signs:
                o["sq"] = _jvp_squares(fn, point, name, signs[name], data)
            if "whole" in inputs:
                o["whole"] = _jvp_squares(fn, point, name, inputs["whole"], data)
            out.append(o)
        return out

    def decide(outputs):
        for o in outputs:
            # (a whole-event family reads c Λ too: its moments carry the constant)
            ok = np.allclose(o["val"], o["slope_x"], rtol=1e-6, atol=1e-9) and (
                family.whole_events or np.allclose(o["slope_1"], 1.0, rtol=1e-6)
            )
            if not ok:
                return ArgumentClass("opaque", (name,), reason=f"not the {family.name} block itself")
            if "whole" in o and not _whole_ok(o["whole"], family.dim):
                return ArgumentClass("opaque", (name,), reason=f"reads parts of its {family.name} matrices")
            if "sq" in o and not _gather_ok(o["sq"]):
                return ArgumentClass("opaque", (name,), reason=f"mixes elements of its {family.name} block")
        return ArgumentClass(family.argument_kind, (name,))

    return compute, decide


def run_probes(probes: dict, data) -> dict:
    """Run the probes of many arguments in one compiled call and classify each.

    Args:
        probes: key → :class:`ArgumentProbe`.
        data: dynamic model data.

    Returns:
        key → :class:`ArgumentClass`.
    """
    # positions as keys inside jit: probe keys mix names, ints and "value" (not sortable)
    active = [(k, p) for k, p in probes.items() if p.compute is not None]

    def compute_all(inputs, data):
        return [p.compute(x, data) for (_, p), x in zip(active, inputs)]

    outputs = {}
    if active:
        inputs = [p.inputs for _, p in active]
        compiled = compile_lowered(_jit(compute_all).lower(inputs, data), compiler_options(data))
        outputs = {k: out for (k, _), out in zip(active, compiled(inputs, data))}
    return {k: p.decide(outputs.get(k)) for k, p in probes.items()}


# -- moments at run time ------------------------------------------------------------------


def _base_point(block: Block, view):
    """Where the model is linearised, in the block's site layout (Gaussian blocks at their
    mean, Gamma blocks at log τ = 0 so a power c·τ^a reads c, Beta/Dirichlet blocks at
    their mean: :meth:`blrppl.families.Family.linearisation_point`)."""
    return block.to_site(block.family.linearisation_point(view))


def base_values(blocks: dict, views: dict, names) -> dict:
    """Block values at the base point (see :func:`_base_point`), Gamma blocks as τ = 1."""
    return {n: blocks[n].family.from_linearisation(_base_point(blocks[n], views[n])) for n in names}


def _tangent_sets(block: Block, view, full: bool) -> dict:
    """Stacks of tangents (site layout) to push through the linearised model."""
    return _site_layout(block, block.family.tangent_sets(view, full))


def _site_layout(block: Block, sets: dict) -> dict:
    return {tag: jax.vmap(block.to_site)(stack) for tag, stack in sets.items()}


#: pushed floats (tangent rows × argument elements) above which each block's tangents are
#: pushed on their own (see :func:`_push_tangents`)
SPLIT_PUSH_FLOATS = 1 << 20


def _push_tangents(lin, point: dict, sets: dict, out, row_wise=frozenset()) -> dict:
    """Every block's tangent sets pushed through the linearised model ``lin``.

    Returns ``(block, tag) → pushes``: the arguments' pushes of that set's rows, a pytree
    with the rows as leading axis, or for a block in ``row_wise`` a list of one pytree per
    row.

    Small groups push every block's rows in one batched JVP (the others' tangents zero):
    one copy of the linear model in the program. Once rows × argument elements exceed
    :data:`SPLIT_PUSH_FLOATS`, each block's rows are pushed on their own with the other
    blocks' tangents unbatched zeros, so an argument pays only for the rows of the blocks
    it reads: in a mixture, the D² pushed rows of a precision matrix's Wishart block no
    longer run through the mean's N × D gather, nor the mean's 2D rows through the
    precision's N × D × D one.

    The blocks in ``row_wise`` (Gamma, Beta, Dirichlet, Wishart: a few rows, each read by
    its own moment) push one row at a time, each row an unbatched JVP: a row no argument
    reads is dead code the compiler drops, with its share of the gathers' transposes (a
    Dirichlet read only through E[log π], as a Categorical's probabilities are, pushes one
    row of its three: in a hidden Markov chain's K² enumerated runs of ``trans[prev]`` the
    scatter-add of the gradient was the step's costliest operation).
    """
    zeros = {n: jnp.zeros_like(x) for n, x in point.items()}
    pushed = {}
    for n in row_wise & sets.keys():
        for tag, stack in sets[n].items():
            pushed[(n, tag)] = [lin({**zeros, n: row}) for row in stack]
    sets = {n: tags for n, tags in sets.items() if n not in row_wise}
    if not sets:
        return pushed
    rows, offsets = {}, {}
    for n, tags in sets.items():
        total = 0
        for tag, stack in tags.items():
            rows[(n, tag)] = (total, total + stack.shape[0])
            total += stack.shape[0]
        offsets[n] = total
    count = sum(offsets.values())
    elements = sum(math.prod(jnp.shape(x)) for x in jax.tree.leaves(out))
    if len(sets) == 1 or count * elements <= SPLIT_PUSH_FLOATS:
        start, tangents = 0, {}
        for n, tags in sets.items():
            stack = jnp.concatenate(list(tags.values()), axis=0)
            before = jnp.zeros((start,) + point[n].shape, point[n].dtype)
            after = jnp.zeros((count - start - offsets[n],) + point[n].shape, point[n].dtype)
            tangents[n] = jnp.concatenate([before, stack, after], axis=0)
            start += offsets[n]
        joint = jax.vmap(lambda t: lin({**zeros, **t}))(tangents)
        by_block, start = {}, 0
        for n in sets:
            by_block[n] = jax.tree.map(lambda x, lo=start, hi=start + offsets[n]: x[lo:hi], joint)
            start += offsets[n]
    else:
        by_block = {}
        for n, tags in sets.items():
            stack = jnp.concatenate(list(tags.values()), axis=0)
            by_block[n] = jax.vmap(lambda t, n=n: lin({**zeros, n: t}))(stack)
    for (n, tag), (lo, hi) in rows.items():
        pushed[(n, tag)] = jax.tree.map(lambda x, lo=lo, hi=hi: x[lo:hi], by_block[n])
    return pushed


#: Gauss–Hermite nodes per dimension of :func:`support_view`, by scalars per plate element
SUPPORT_NODES = {1: 32, 2: 20, 3: 10}


def support_view(block: Block, view):
    """The Gaussian on u = g⁻¹(φ) whose linearisation gives the site value φ = g(u) its
    exact first two moments under q(u) = N(m, Σ) (a block with :attr:`Block.value_moments`,
    g elementwise), per plate element:

        u* = g⁻¹(E[g(u)]),    Σ* = Cov[g(u)] / (g'(u*) g'(u*)ᵀ)  (elementwise),

    E and Cov by a tensor Gauss–Hermite rule over the element's scalars. The model
    linearised at u* reads φ = E[g(u)]; a tangent t along u moves φ by g'(u*) ⊙ t, so the
    covariance Σ* along u is Cov[g(u)] along φ. An argument affine in φ (or a product of φ
    with an independent Gaussian block) then has its exact mean and variance, and the
    rules' expectations of Normal-type densities, which depend on such an argument through
    those only, are exact. Differentiable in (m, Σ): the messages are the gradients through
    the quadrature (not conjugate).
    """
    family, transform = block.family, block.transform
    mean = family.linearisation_point(view)  # canonical layout
    dense = hasattr(view, "cov")
    d = mean.shape[-1] if dense else 1
    grid, weights = tensor_gauss_hermite(SUPPORT_NODES[d], d)
    grid, weights = jnp.asarray(grid, mean.dtype), jnp.asarray(weights, mean.dtype)
    if dense:
        u = mean + jnp.einsum("...ij,kj->k...i", jnp.linalg.cholesky(view.cov), grid)
    else:
        u = mean + jnp.sqrt(jnp.maximum(view.var, 0.0)) * grid[:, 0].reshape((-1,) + (1,) * mean.ndim)
    g = jax.vmap(block.to_canonical)(transform(jax.vmap(block.to_site)(u)))
    wk = weights.reshape((-1,) + (1,) * mean.ndim)
    g_mean = jnp.sum(wk * g, axis=0)
    centred = g - g_mean
    u_star = transform.inv(block.to_site(g_mean))
    slope = block.to_canonical(jax.jvp(transform, (u_star,), (jnp.ones_like(u_star),))[1])
    u_star = block.to_canonical(u_star)
    if dense:
        g_cov = jnp.einsum("k,k...i,k...j->...ij", weights, centred, centred)
        cov = g_cov / (slope[..., :, None] * slope[..., None, :])
        # (a q far in the tails, where g saturates in floating point: its own mean and covariance)
        ok = jnp.all(jnp.isfinite(u_star) & (slope > 0), -1) & jnp.all(jnp.isfinite(cov), (-2, -1))
        return view._replace(
            mean=jnp.where(ok[..., None], u_star, mean), cov=jnp.where(ok[..., None, None], cov, view.cov)
        )
    var = jnp.sum(wk * jnp.square(centred), axis=0) / jnp.square(slope)
    ok = jnp.isfinite(u_star) & jnp.isfinite(var) & (slope > 0)
    return view._replace(mean=jnp.where(ok, u_star, mean), var=jnp.where(ok, var, view.var))


def group_moments(
    fns: ModelFunctions, factors, blocks: dict, views: dict, discrete_values: dict, data, on_support: bool = False
) -> dict:
    """Moment objects of every argument (and value) of several factors, from one
    linearisation of the model and one batched JVP.

    Args:
        fns: model evaluation functions.
        factors: :class:`blrppl.graph.plan.Factor` objects sharing their discrete neighbours.
        blocks: name → Block.
        views: name → the block's ``view`` (the moments are differentiable in these).
        discrete_values: name → site value of each enumerated discrete neighbour.
        data: dynamic model data.
        on_support: the factors are closed-form (their arguments were classified with
            ``value_moments``): blocks with :attr:`Block.value_moments` are seen through
            :func:`support_view`.

    Returns:
        factor name → {argument → moment object}.
    """
    if on_support:
        views = {
            n: support_view(blocks[n], v) if blocks[n].value_moments and not blocks[n].members else v
            for n, v in views.items()
        }
    cont = []
    for f in factors:
        cont += [n for n in f.neighbours if n not in f.discrete and n not in cont]
    wanted = {f.name: factor_arguments(f) for f in factors}
    point = {n: _base_point(blocks[n], views[n]) for n in cont}
    # log-normal arguments are linearised on log space: their logs, not exp(log) / exp(log)
    logged = {f.name: frozenset(a for a, k in f.kinds.items() if k == mom.ExpGaussian.kind) for f in factors}
    logged = {n: a for n, a in logged.items() if a}

    def model_args(x):
        vals = dict(discrete_values)
        for n in cont:
            vals[n] = blocks[n].family.from_linearisation(x[n])
        return fns.args_of(wanted, vals, data, logged)

    if not cont:  # (constants as the model computes them: nothing is on log space)
        out = fns.args_of(wanted, dict(discrete_values), data)
        return {f.name: {a: mom.Const(v) for a, v in out[f.name].items()} for f in factors}

    out, lin = jax.linearize(model_args, point)
    full = {n for f in factors for n, mode in f.columns if mode == "full"}
    # (a chain's factor whose elements each read one of its scalars takes the two rows of
    # its diagonal, pushed on their own; the 2(2b + 1) colour rows are pushed for the
    # others, and are dead code the compiler drops when no factor reads them)
    scalar = {(f.name, n) for f in factors for n, mode in f.columns if mode == "scalar"}
    sets = {n: _tangent_sets(blocks[n], views[n], n in full) for n in cont}
    row_wise = frozenset(n for n in cont if not blocks[n].family.gaussian)
    pushed = _push_tangents(lin, point, sets, out, row_wise)
    zeros = {n: jnp.zeros_like(x) for n, x in point.items()}
    for n in {n for _, n in scalar}:
        for tag, stack in _site_layout(blocks[n], blocks[n].family.scalar_tangent_sets(views[n])).items():
            pushed[(n, "scalar_" + tag)] = jax.vmap(lambda t, n=n: lin({**zeros, n: t}))(stack)

    def rows_of(n, tag, fname, arg):
        rows = pushed[(n, "scalar_" + tag if (fname, n) in scalar else tag)]
        return [r[fname][arg] for r in rows] if isinstance(rows, list) else rows[fname][arg]

    gauss = [n for n in cont if blocks[n].family.gaussian]
    paired = {n for f in factors for _, ps in f.pairs for pair in ps for n in pair}
    roots = {}
    for n in paired:
        root = blocks[n].family.tangent_roots(views[n], n in full)
        roots[n] = None if root is None else jax.vmap(blocks[n].to_site)(root)
    extra = _bilinear_extra(model_args, point, sets, roots, factors)
    result = {}
    for f in factors:
        kinds, arg_blocks = f.kinds, dict(f.arg_blocks)
        fgauss = [n for n in f.neighbours if n in gauss]
        moments = {}
        for arg, _ in f.arg_kinds:
            kind, value = kinds[arg], out[f.name][arg]
            used = arg_blocks[arg]
            if kind == mom.Const.kind:
                moments[arg] = mom.Const(value)
            elif kind == mom.AffineGaussian.kind:
                left = tuple(rows_of(n, "left", f.name, arg) if n in used else None for n in fgauss)
                right = tuple(rows_of(n, "right", f.name, arg) if n in used else None for n in fgauss)
                moments[arg] = mom.AffineGaussian(value, left, right)
            elif kind == mom.BilinearGaussian.kind:
                left = tuple(rows_of(n, "left", f.name, arg) if n in used else None for n in fgauss)
                right = tuple(rows_of(n, "right", f.name, arg) if n in used else None for n in fgauss)
                pairs = dict(f.pairs)[arg]
                found = [extra[pair][f.name][arg] for pair in pairs]
                whole = _whole_product_variance(f, arg, pairs, found)
                if whole is not None:
                    # the product's variance in full: the linear part's rows of its two
                    # blocks are not read (nor computed: XLA drops unused pushes)
                    drop = set(pairs[0])
                    left = tuple(None if n in drop else r for n, r in zip(fgauss, left))
                    right = tuple(None if n in drop else r for n, r in zip(fgauss, right))
                    moments[arg] = mom.BilinearGaussian(mom.AffineGaussian(value, left, right), whole)
                else:
                    moments[arg] = mom.BilinearGaussian(
                        mom.AffineGaussian(value, left, right), sum(m.extra for m in found)
                    )
            elif kind == mom.ExpGaussian.kind:
                # x = exp(a) with a affine: a and its rows were pushed (``logged`` above)
                left = tuple(rows_of(n, "left", f.name, arg) if n in used else None for n in fgauss)
                right = tuple(rows_of(n, "right", f.name, arg) if n in used else None for n in fgauss)
                moments[arg] = mom.ExpGaussian(mom.AffineGaussian(value, left, right))
            elif kind == mom.PowerGamma.kind:
                # each row pushed through x = c τ^a at τ = 1 is multiplied by the slope c a
                slope, shape_t, rate_t, *mean_t = rows_of(used[0], "gamma", f.name, arg)
                mean_params = [m / slope for m in mean_t] if mean_t else [None, None]
                # the exponent a is the argument form's, known at trace time
                power = dict(f.powers).get(arg)
                power = slope / value if power is None else float(power)
                moments[arg] = mom.PowerGamma(value, power, shape_t / slope, rate_t / slope, *mean_params)
            elif kind == mom.BetaIdentity.kind:
                alpha, beta, *mean_params = rows_of(used[0], "beta", f.name, arg)
                moments[arg] = mom.BetaIdentity(alpha, beta, *mean_params)
            elif kind == mom.DirichletIdentity.kind:
                conc, tot, *mean_params = rows_of(used[0], "dirichlet", f.name, arg)
                moments[arg] = mom.DirichletIdentity(conc, tot, *mean_params)
            elif kind == mom.WishartIdentity.kind:
                # whole matrices in place, each times a constant c (checked at compile time):
                # rows E[Λ], E[log|Λ|] and 1 come back as c E[Λ], c E[log|Λ|] and c, and
                # log|cΛ| = D log c + log|Λ|
                # (packed in one row for D > 1, see Wishart.tangent_sets)
                pushed_rows = rows_of(used[0], "wishart", f.name, arg)
                mean = pushed_rows[0]
                if mean.shape[-1] == 1:
                    c, c_logdet = pushed_rows[2][..., 0, 0], pushed_rows[1][..., 0, 0]
                else:
                    c, c_logdet = pushed_rows[1][..., 0, 1], pushed_rows[1][..., 0, 0]
                moments[arg] = mom.WishartIdentity(mean, c_logdet / c + mean.shape[-1] * jnp.log(c))
            else:
                raise ValueError(f"factor '{f.name}': argument '{arg}' is {kind}")
        result[f.name] = moments
    return result


def _whole_product_variance(f, arg: str, pairs, found):
    """Var[x] under q(A) q(B) of an argument x that depends on the blocks A and B of its
    one pair only through their product, when the contraction gave it and no other argument
    of the factor reads A or B (no covariance with them is needed); else None."""
    if len(pairs) != 1 or found[0].variance is None:
        return None
    blocks = set(pairs[0])
    if any(set(used) & blocks for other, used in f.arg_blocks if other != arg):
        return None
    return found[0].variance


def _bilinear_extra(model_args, point: dict, sets: dict, roots: dict, factors) -> dict:
    """The second moments of every bilinear argument, per pair of blocks (A, B) it
    multiplies (:class:`blrppl.moments.BilinearGaussian`):
    {(A, B): {factor: {argument: ProductMoments}}} (:class:`blrppl.products.ProductMoments`:
    E[f(d_A, d_B)²], and the whole variance where the contraction gives it).

    E[(d_Aᵀ J d_B)²] = tr(Jᵀ Σ_A J Σ_B), each f(a, b) below the mixed second derivative of
    the arguments along a (in A) and b (in B). With square roots Σ_A = Σ_k s_k s_kᵀ and
    Σ_B = Σ_l s'_l s'_lᵀ (``roots``: the Cholesky columns of each plate element) it is
    Σ_{k,l} f(s_k, s'_l)²: |S|·|T| pushes. Otherwise, with Σ_A = Σ_s l_s r_sᵀ and
    Σ_B = Σ_t l'_t r'_tᵀ the blocks' tangent sets (``left`` and ``right``, as for affine
    arguments), it is Σ_{s,t} f(r_s, l'_t) f(l_s, r'_t): 2·|S|·|T| pushes.

    With square roots on both sides, a product the program takes as a primitive (``X @ C.T``,
    ``w * x``, ``(U[i] * V[j]).sum(-1)``) is read instead as a contraction of the two factors'
    covariances (:func:`blrppl.products.product_second_moments`): for ``X @ C.T``, one
    (N, D²) @ (D², M) product in place of D² pushes of (N, M).
    """
    pairs = sorted({pair for f in factors for _, ps in f.pairs for pair in ps})
    zeros = {n: jnp.zeros_like(x) for n, x in point.items()}

    def tile(x, k):
        return jnp.tile(x, (k,) + (1,) * (x.ndim - 1))

    out = {}
    for a, b in pairs:
        rooted = roots.get(a) is not None and roots.get(b) is not None
        wanted = [(f.name, arg) for f in factors for arg, ps in f.pairs if (a, b) in ps]
        if rooted:
            # a product the program takes as a primitive: one contraction of covariances
            contracted = product_second_moments(model_args, point, a, sets[a], b, sets[b], wanted)
            if contracted is not None:
                out[(a, b)] = contracted
                continue
        if rooted:
            ka, kb = roots[a].shape[0], roots[b].shape[0]
            ta, tb = jnp.repeat(roots[a], kb, axis=0), tile(roots[b], ka)
        else:
            la, ra = sets[a]["left"], sets[a]["right"]
            lb, rb = sets[b]["left"], sets[b]["right"]
            ka, kb = la.shape[0], lb.shape[0]
            ta = jnp.concatenate([jnp.repeat(ra, kb, axis=0), jnp.repeat(la, kb, axis=0)])
            tb = jnp.concatenate([tile(lb, ka), tile(rb, ka)])

        def mixed(u, v, a=a, b=b):
            def along_a(x):
                return jax.jvp(model_args, (x,), ({**zeros, a: u},))[1]

            return jax.jvp(along_a, (point,), ({**zeros, b: v},))[1]

        pushed = jax.vmap(mixed)(ta, tb)
        half = ka * kb

        def square(x, rooted=rooted, half=half):
            return jnp.sum(jnp.square(x), axis=0) if rooted else jnp.sum(x[:half] * x[half:], axis=0)

        out[(a, b)] = {
            f.name: {arg: ProductMoments(square(pushed[f.name][arg]), None) for arg, ps in f.pairs if (a, b) in ps}
            for f in factors
        }
    return out


# -- classification from the argument forms -------------------------------------------------


def classify_form(form, deps, blocks: dict, site_blocks: dict, value_moments: bool = False) -> tuple:
    """The class of an argument read off its form (:mod:`blrppl.graph.forms`), without probes.

    A form that is affine, a power of a Gamma latent or a Beta/Dirichlet latent itself gives
    that class; any other form gives ``"opaque"`` with the reason the form names (safe: an
    opaque argument is only fitted by quadrature or Monte Carlo instead of a closed form).

    Args:
        form: the argument's form, in terms of the latent sites.
        deps: the blocks the argument depends on.
        blocks: block name → :class:`Block`.
        site_blocks: site → (its block's name, the block of the site itself: the member of a
            joint block, else the block).
        value_moments: in an affine or bilinear form, read the sites of blocks with
            :attr:`Block.value_moments` (on their own) as Gaussians on their site's space, as
            closed-form rules see them through :func:`support_view` (not for quadrature
            projections, which integrate the block's own Gaussian).

    Returns:
        ``(class, reason)``: the :class:`ArgumentClass`, or ``None`` when only the probes can
        tell (arguments that also read point blocks, that mix the elements of a plated
        block, or a Beta/Dirichlet latent times a constant that may be 1); and the reason an
        argument is opaque (``""`` otherwise).
    """
    cont = tuple(n for n in deps if not blocks[n].discrete)
    if not cont or any(blocks[n].point for n in cont):
        return None, ""
    if isinstance(form, fm.Opaque):
        return ArgumentClass("opaque", cont, reason=form.reason), form.reason
    atoms = {s: site_blocks[s] for s in fm.sites_of(form) if s in site_blocks}
    if isinstance(form, fm.Const) or {n for n, _ in atoms.values()} != set(cont):
        return None, ""
    # (only first powers and products: the moments E[φ], Var[φ] say nothing of exp(φ))
    on_support = value_moments and (
        fm.first_powers(form) or isinstance(form, fm.Affine) or fm.as_bilinear(form) is not None
    )
    spaces = {
        s: "affine" if on_support and own.value_moments and not blocks[n].members else fm.site_space(own)
        for s, (n, own) in atoms.items()
    }

    def gathered(elementwise: bool):
        """No mixing, or no block that the gather test applies to."""
        if not fm.mixes(form):
            return True
        return not any(_needs_gather_test(blocks[n], elementwise or not blocks[n].family.dense_event) for n in cont)

    def decided(kind, **kw):
        # (Gaussian kinds read mixed elements through their covariance columns)
        elementwise = kind not in (mom.AffineGaussian.kind, mom.ExpGaussian.kind)
        return (ArgumentClass(kind, cont, **kw), "") if gathered(elementwise) else (None, "")

    reason = fm.why_not_exact(form)
    # (first powers of Gaussian sites: ``A * x_prev`` of a scan's carry over time steps)
    if isinstance(form, fm.Affine) or (fm.first_powers(form) and set(spaces.values()) == {"affine"}):
        off = sorted(s for s, sp in spaces.items() if sp != "affine")
        if not off:
            return decided("affine_gaussian")
        space = {
            "exp": "a Gaussian on log space", "sigmoid": "a Gaussian on logit space",
            "other": "a Gaussian on a transformed space",
        }.get(spaces[off[0]], f"a {spaces[off[0]].capitalize()}")
        reason = f"affine in '{off[0]}', whose block is {space}"
    elif fm.as_bilinear(form) is not None and set(spaces.values()) == {"affine"}:
        bil = fm.as_bilinear(form)
        left = {atoms[x][0] for x in bil.left if x in atoms}
        right = {atoms[x][0] for x in bil.right if x in atoms}
        pairs = tuple(sorted((a, b) for a in left for b in right))
        pushes = {(a, b): _element_size(blocks[a]) * _element_size(blocks[b]) for a, b in pairs}
        heavy = next(((a, b) for (a, b), k in pushes.items() if k > MAX_BILINEAR_PUSHES), None)
        if left & right:
            reason = "a product of latents fitted in one block"
        elif heavy is not None:
            big = max(heavy, key=lambda n: _element_size(blocks[n]))
            reason = (
                f"a product of latents whose exact second moment needs {pushes[heavy]} pushes of the model per "
                f"step ('{big}' has {_element_size(blocks[big])} scalars per plate element: declare its rows in a "
                "numpyro.plate)"
            )
        elif bil.mixes and left and right:
            # a contraction (X @ C.T): exact when each element reads one plate element of
            # each block, whose covariance within the element (the contracted event axis)
            # the block holds; the forms carry no axes, so a probe checks the plates
            flat = sorted(n for n in left | right if not blocks[n].family.dense_event)
            if flat:
                reason = (
                    f"a contraction of products of latents (e.g. X @ C.T) reading '{flat[0]}', "
                    "whose family holds no covariance within an element"
                )
            else:
                gather = tuple(n for n in cont if _needs_gather_test(blocks[n], not blocks[n].family.dense_event))
                return ArgumentClass(mom.BilinearGaussian.kind, cont, pairs=pairs, gather=gather), ""
        elif left and right:
            return decided(mom.BilinearGaussian.kind, pairs=pairs)
    elif isinstance(form, fm.Linked) and form.link == "exp" and set(spaces.values()) == {"affine"} and gathered(False):
        return decided(mom.ExpGaussian.kind)  # exp of an affine Gaussian: log-normal
    elif isinstance(form, fm.LogPower | fm.LogProduct) and set(spaces.values()) == {"exp"}:
        return decided("affine_gaussian")  # log of exp(u): affine in the block's value u
    elif isinstance(form, fm.Logit) and set(spaces.values()) == {"sigmoid"}:
        return decided("affine_gaussian")  # logit of sigmoid(u)
    elif isinstance(form, fm.Power):
        ((_, own),) = atoms.values()
        (space,) = spaces.values()
        family = own.family
        if family.argument_kind is not None and family.any_power:
            return decided(family.argument_kind, power=form.power)
        if family.argument_kind is not None and form.power == 1.0:
            if family.whole_events:
                # whole matrices in place, each times a constant (β Λ of a Normal–Wishart
                # prior): a probe confirms it (the forms carry no axes)
                return ArgumentClass(family.argument_kind, cont, gather=cont), ""
            if form.unit:
                return decided(family.argument_kind)
            return None, reason  # c times the latent: the probes tell whether c is 1
        if space == "exp":
            return decided(mom.ExpGaussian.kind)  # c · exp(a u): log-normal
        if space in ("exp", "sigmoid", "other"):
            where = {"exp": "log space", "sigmoid": "logit space", "other": "a transformed space"}[space]
            reason = f"{fm.why_not_exact(form)}, whose Gaussian is on {where}"
    return ArgumentClass("opaque", cont, reason=reason), reason
