"""Factors' arguments and log-densities as functions of the latent values.

:class:`ModelFunctions` evaluates the model's program (:class:`blrppl.model.program.ModelProgram`)
with latent values substituted (block space), pruned to the sites a factor reads; the
helpers below read a site's distribution as a pytree in a hash-seed independent order and
the scalar projections a quadrature factor integrates over.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpyro.distributions as dist

from blrppl.graph.data import DataSpec, RunData
from blrppl.model.program import ModelProgram, dce
from blrppl.model.records import unwrap


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
        program: the model's :class:`ModelProgram` (shared by every ``ModelFunctions`` of
            one compilation).
        data_spec: how to rebuild the model's arguments from the dynamic data leaves.
        fill_values: a valid value for every latent site (used for sites a factor does not
            depend on; their values never reach the factor's arguments).
        plate_indices: plate name → minibatch indices used for subsampled plates when the
            data carry none (:class:`MinibatchData`), e.g. while compiling.
        stacks: stacked factors (:mod:`blrppl.graph.stack`) by name: their entries are built
            from per-fit tables that ``data`` carries (a :class:`blrppl.graph.data.RunData`
            whose ``statistics`` hold them), not from the program.
    """

    def __init__(
        self,
        program: ModelProgram,
        data_spec: DataSpec,
        fill_values: dict,
        transforms: dict | None = None,
        joints: dict | None = None,
        plate_indices: dict | None = None,
        stacks: dict | None = None,
    ):
        self.program = program
        self.data_spec = data_spec
        self.fill_values = fill_values
        self.transforms = dict(transforms or {})
        self.joints = dict(joints or {})
        self.plate_indices = dict(plate_indices or {})
        self.stacks = dict(stacks or {})
        self.vectorise = False

    def vectorised(self) -> "ModelFunctions":
        """These functions evaluating the model's scans whose carries are known ahead as
        maps over their steps (:mod:`blrppl.model.scan_map`): for the programs a fit runs
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
            tables, data = data.statistics, data.model_data
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
        arguments, :class:`blrppl.moments.kinds.ExpGaussian`)."""
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


def log_prob_reads(base, leaves, tree: CanonicalTree, value, cache: dict | None = None) -> frozenset:
    """The positions (canonical order) of the leaves a distribution's ``log_prob`` reads.

    numpyro keeps fields its density never uses (a ``StudentT`` holds a ``Chi2`` of its
    ``df`` for sampling): such a leaf is not a parameter of the factor, and counting it
    would give a Student-t with a latent ``df`` four projections instead of two. Read off
    the density's program (dead-code elimination); every leaf when it cannot be traced.

    Args:
        base, leaves, tree: the unwrapped distribution, its leaves in canonical order and
            the tree that rebuilds it (:func:`distribution_leaves`).
        value: the site's value.
        cache: a dict for the answers found so far, keyed by the distribution's structure
            (its type, tree and the leaves' and value's shapes and dtypes, all the density's
            program depends on): sites of one structure (one per step of a Python loop) are
            read once.
    """
    everything = frozenset(range(len(leaves)))

    def aval(x):
        return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))

    avals = [aval(x) for x in leaves]
    key = None
    if cache is not None:
        key = (type(base), tree.treedef, tree.order, tuple((a.shape, a.dtype) for a in avals),
               jnp.shape(value), jnp.result_type(value))
        try:
            if key in cache:
                return cache[key]
        except (TypeError, ValueError):  # (a tree whose static fields are arrays: not hashable)
            key = None

    def density(ls, v):
        return jnp.sum(tree.unflatten(ls).log_prob(v))

    try:
        closed = jax.make_jaxpr(density)(avals, aval(value))
    except Exception:  # noqa: BLE001 - a density that does not trace abstractly: keep every leaf
        found = everything
    else:
        _, used = dce(closed.jaxpr, [True])
        found = frozenset(i for i in everything if used[i])
    if key is not None:
        cache[key] = found
    return found


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
    return projection_args(factor.spec.links)
