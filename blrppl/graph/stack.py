"""Sites of one structure stacked into one factor: a model with one site per step compiles once.

A model written with a Python loop (``numpyro.sample(f"y_{t}", ...)`` at every step) has
one factor per site, and a compiled step would hold every site's operations, and their
derivatives, once per site: XLA's compile time grows faster than the number of sites.
Sites (observed, or latents' own priors) whose distributions have one type and one layout,
whose leaves (and values) are affine in the latents' values, and which meet the same blocks
in the same way, become one *stacked* factor. Every leaf ℓ of member i's distribution, and its value, is

    ℓ_i(s) = c_i + J_i s,     s = the values of the latent sites they read (flattened),

with the offsets c_i and Jacobians J_i read once per fit from the model's program: one JVP
per scalar of s, evaluated operation by operation (nothing is compiled whose size grows
with the number of sites; see :func:`stack_table`). The stacked site's distribution holds
the members' leaves on a new leading batch axis, so every estimator sees one vectorised
site, and the compiled step's size no longer depends on the number of members.

The forms (:mod:`blrppl.model.forms`, read off the model's program) say which leaves are
affine in s; for those, c + J s is every member's leaves exactly.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from blrppl.estimators.registry import estimator_of
from blrppl.model.functions import CanonicalTree, distribution_leaves
from blrppl.model import forms as fm
from blrppl.model import host_eval
from blrppl.model.records import unwrap

#: a group of at least this many sites of one structure is stacked (fewer compile as fast
#: one by one)
MIN_MEMBERS = 24
#: the most scalars one leaf's Jacobian table may hold (members × leaf size × |s|)
MAX_TABLE = 1 << 22


@dataclasses.dataclass(frozen=True)
class Stack:
    """A stacked factor: which sites it holds and how its distribution is rebuilt.

    Attributes:
        name: the factor's name (``"<first>…<last>"``).
        members: the stacked sites, in model order.
        sites: the latent sites whose values make s, in model order.
        site_shapes: their value shapes (site space).
        tree: rebuilds one member's distribution from its leaves.
        batch_shape: one member's batch shape (the stacked one is (members, *batch_shape)).
        affine: per leaf, then the value: whether it depends on s (else it is a constant).
    """

    name: str
    members: tuple
    sites: tuple
    site_shapes: tuple
    tree: CanonicalTree
    batch_shape: tuple
    affine: tuple
    observed: bool = True

    @property
    def size(self) -> int:
        """The number of scalars of s."""
        return int(sum(int(np.prod(s)) for s in self.site_shapes))

    def site(self, table: "StackTable", full: dict) -> dict:
        """The stacked site's trace entry at the latent values ``full`` (site space)."""
        s = flat_sites(self, full)
        items = [c if j is None else c + j @ s for c, j in zip(table.offsets, table.jacobians)]
        fn = self.tree.unflatten(items[:-1])
        fn._batch_shape = (len(self.members),) + tuple(self.batch_shape)
        return {"name": self.name, "type": "sample", "fn": fn, "value": items[-1], "scale": None, "is_observed": self.observed}


class StackTable(NamedTuple):
    """The per-fit data of a stacked factor: per leaf, then the value, the offsets c
    (members, *shape) and the Jacobians J (members, *shape, |s|) (None for constants)."""

    offsets: tuple
    jacobians: tuple


def flat_sites(stack: Stack, full: dict):
    """s: the stack's latent sites' values (site space) flattened and concatenated."""
    parts = [jnp.ravel(jnp.asarray(full[n])) for n in stack.sites]
    if not parts:
        return jnp.zeros((0,), jnp.result_type(float))
    return jnp.concatenate([p.astype(jnp.result_type(float)) for p in parts])


def _member_items(stack: Stack, entries: dict) -> tuple:
    """Each leaf, then the value, stacked over the members (members, *shape)."""
    per_member = []
    for m in stack.members:
        base, leaves, _ = distribution_leaves(entries[m])
        value = entries[m]["value"]
        per_member.append(_aligned(leaves, base, stack.batch_shape) + [value if isinstance(value, jax.Array) else jnp.asarray(value)])
    return tuple(jnp.stack(items) for items in zip(*per_member))


def _aligned(leaves, base, batch_shape: tuple) -> list:
    """A member's leaves with a leading 1 per batch dimension that its value adds to its
    distribution's (an observation broadcasting the distribution, ``obs`` of shape (5,)
    for a scalar ``Normal``): stacked over the members, they broadcast against the stacked
    values as each member's leaves broadcast against its own value."""
    extra = (1,) * (len(batch_shape) - len(base.batch_shape))
    if not extra:  # (nothing to add: no reshape traced per member and leaf)
        return [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in leaves]
    return [jnp.reshape(jnp.asarray(x), extra + jnp.shape(x)) for x in leaves]


def _member_batch_shape(base, value) -> tuple | None:
    """A member's batch shape as its value sees it: the distribution's, broadcast with the
    value's leading dimensions (None when they do not broadcast)."""
    shape = np.shape(value)
    lead = shape[: len(shape) - base.event_dim] if len(shape) >= base.event_dim else ()
    try:
        return tuple(np.broadcast_shapes(lead, tuple(base.batch_shape)))
    except ValueError:
        return None


def _site_dict(stack: Stack, full: dict, s) -> dict:
    out, start = dict(full), 0
    for n, shape in zip(stack.sites, stack.site_shapes):
        size = int(np.prod(shape))
        out[n] = s[start : start + size].reshape(shape)
        start += size
    return out


def stack_table(stack: Stack, fns, data) -> StackTable:
    """c and J of every leaf and the value of a stack's members, from the model's program.

    Evaluated on the host (:func:`blrppl.model.host_eval.run`: no compilation whose size
    grows with the members, no eager dispatch of each of their operations): the program
    pruned to the members, and one JVP along each scalar of s, traced once.

    Args:
        stack: the stacked factor.
        fns: the plan's :class:`blrppl.model.functions.ModelFunctions`.
        data: the model's data leaves.
    """
    full = fns.site_values({})
    s0 = flat_sites(stack, full)

    def items(s):
        entries = fns.program.sites(stack.members, _site_dict(stack, full, s), data, fns.plate_indices, fns.data_spec)
        return _member_items(stack, entries)

    if stack.size == 0:
        return StackTable(items(s0), (None,) * len(stack.affine))
    eye = np.eye(stack.size, dtype=s0.dtype)

    def columns(s):
        return jax.vmap(lambda t: jax.jvp(items, (s,), (t,)), out_axes=(None, 0))(eye)

    closed, shapes = jax.make_jaxpr(columns, return_shape=True)(s0)
    s0 = np.asarray(s0)
    primal, tangents = jax.tree.unflatten(jax.tree.structure(shapes), host_eval.run(closed.jaxpr, closed.consts, [s0]))
    offsets, jacobians = [], []
    for value, tangent, affine in zip(primal, tangents, stack.affine):
        if not affine:
            offsets.append(jnp.asarray(value))
            jacobians.append(None)
            continue
        jac = np.moveaxis(tangent, 0, -1).astype(s0.dtype)  # (members, *shape, |s|)
        offsets.append(jnp.asarray(value - jac @ s0))
        jacobians.append(jnp.asarray(jac))
    return StackTable(tuple(offsets), tuple(jacobians))


def _is_affine(form) -> bool:
    return isinstance(form, fm.Affine) or (isinstance(form, fm.Power) and form.power == 1.0)


def _candidate(f, record, forms: dict, blocks: dict) -> bool:
    if f.name not in forms or record is None or record.is_factor or record.is_param:
        return False
    if f.discrete or f.spec.from_statistics or f.subsampled or not estimator_of(f).stackable:
        return False
    if record.has_mask or record.has_scale or record.plates or record.reinterpreted_ndim:
        return False
    for n in f.neighbours:
        b = blocks[n]
        # (a batched or elementwise block: its elements' columns would have to follow the
        # members' axis; left one factor per site)
        if b.discrete or b.batch_shape or (not b.family.dense_event and b.value_shape != ()):
            return False
    items = {k: v for k, v in forms[f.name].items() if k == "value" or k.startswith("leaf:")}
    return all(isinstance(v, fm.Const) or _is_affine(v) for v in items.values())


class _Layout(NamedTuple):
    """A member distribution's layout: its tree, batch shape, each item's (shape, dtype),
    and which items are affine (leaves, then the value)."""

    tree: CanonicalTree
    batch_shape: tuple
    items: tuple
    affine: tuple


def _signature(f, entry, forms: dict):
    """What members of one stack share: the factor's classification, the distribution's
    layout (tree, leaf shapes and dtypes) and which items are affine."""
    base = entry["fn"]
    if unwrap(base)[0] is not base:
        return None  # wrapped (expanded, masked): left one factor per site
    _, leaves, tree = distribution_leaves(entry)
    batch_shape = _member_batch_shape(base, entry["value"])
    if batch_shape is None:
        return None
    items = _aligned(leaves, base, batch_shape) + [jnp.asarray(entry["value"])]
    keys = [f"leaf:{i}" for i in range(len(leaves))] + ["value"]
    # (a leaf the density does not read has no form: a constant of the table, never read)
    affine = tuple(k in forms[f.name] and not isinstance(forms[f.name][k], fm.Const) for k in keys)
    layout = _Layout(tree, batch_shape, tuple((x.shape, x.dtype) for x in items), affine)
    factor = (
        f.observed, f.estimator, id(f.rule), f.arg_kinds, f.arg_blocks, f.columns, f.neighbours, f.spec, f.enumeration,
        f.dist_name, f.why,
    )
    return factor, layout


def _read_sites(f, forms: dict) -> set:
    out: set = set()
    for k, v in forms[f.name].items():
        if k == "value" or k.startswith("leaf:"):
            out |= set(fm.sites_of(v))
    return out


def stack_factors(factors, records: dict, forms: dict, blocks: dict, fns, data):
    """Replace groups of at least :data:`MIN_MEMBERS` factors of one structure by stacked
    factors (see the module docstring).

    Args:
        factors: the plan's factors.
        records: site name → :class:`blrppl.model.records.SiteRecord`.
        forms: site → item → form (:mod:`blrppl.model.forms`).
        blocks: block name → :class:`blrppl.graph.plan.Block`.
        fns: the plan's model functions.
        data: the model's data leaves (the compile-time data).

    Returns:
        ``(factors, stacks, tables)``: the factors with each group replaced by its stacked
        factor (at its first member's place), stack name → :class:`Stack`, and stack name →
        its :class:`StackTable` for ``data``.
    """
    candidates = [f for f in factors if _candidate(f, records.get(f.name), forms, blocks)]
    if len(candidates) < MIN_MEMBERS:
        return list(factors), {}, {}
    full = fns.site_values({})
    entries = fns.program.sites(tuple(f.name for f in candidates), full, data, fns.plate_indices, fns.data_spec)
    groups: dict = {}
    for f in candidates:
        key = _signature(f, entries[f.name], forms)
        if key is not None:
            groups.setdefault(key, []).append(f)
    position = {n: i for i, n in enumerate(records)}
    stacks, tables, replaced = {}, {}, {}
    for (_, layout), members in groups.items():
        if len(members) < MIN_MEMBERS:
            continue
        read = set().union(*(_read_sites(f, forms) for f in members))
        sites = tuple(sorted(read, key=lambda n: position.get(n, len(position))))
        shapes = tuple(tuple(np.shape(full[n])) for n in sites)
        _, leaves, tree = distribution_leaves(entries[members[0].name])
        names = tuple(f.name for f in members)
        stack = Stack(
            name=f"{names[0]}…{names[-1]}", members=names, sites=sites, site_shapes=shapes, tree=tree,
            batch_shape=layout.batch_shape, affine=layout.affine, observed=members[0].observed,
        )
        largest = max((int(np.prod(shape)) for shape, _ in layout.items), default=1)
        if len(names) * largest * stack.size > MAX_TABLE:
            continue
        table = stack_table(stack, fns, data)
        stacks[stack.name] = stack
        tables[stack.name] = table
        first = members[0]
        replaced[first.name] = dataclasses.replace(first, name=stack.name, members=names)
        for f in members[1:]:
            replaced[f.name] = None
    out = [replaced.get(f.name, f) for f in factors]
    return [f for f in out if f is not None], stacks, tables


