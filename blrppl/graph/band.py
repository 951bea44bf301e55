"""Chains: the bandwidth of a Gaussian block's coupling, found by probing the factors.

A Gaussian block of n scalars (a site's value flattened in C order) is a *chain* of
half-bandwidth b when every element of every factor touching it reads, through all the
arguments it pairs, scalars within b + 1 consecutive positions (a random walk: b = 1; an
AR(p) or a p-lag ``scan``: b = p; a state-space model with a d-dimensional state stored
time-major: b ≤ 2d − 1). Its posterior precision is then banded with half-bandwidth b and
:class:`blrppl.families.GaussianBanded` holds it exactly.

The test is the moment computation itself. For each factor, a random combination u of its
arguments (per element of its batch shape) is linearised in the block, and Var[u_n] is
computed twice under a random covariance Σ = Z Zᵀ: from the Jacobian along the columns of
Z (exact), and from the 2(2b + 1) colour tangents of the banded family
(:meth:`blrppl.families.GaussianBanded.tangent_sets`), which read Σ within the band only.
The two agree for every element exactly when each element's scalars fit in b + 1
consecutive positions (otherwise a product a_j a_k Σ_jk with |j − k| > b is lost or
misplaced, which a random Z reveals with probability 1).
The same run tells, per factor, whether each of its elements reads one scalar (b = 0: the
colour tangents are the ones vector and the diagonal of Σ), as a chain's observations
``y[t] ~ Poisson(exp(x[t]))`` do: their moments then need the two rows
(:meth:`blrppl.families.GaussianBanded.scalar_tangent_sets`), not the 2(2b + 1).
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from blrppl.estimators.registry import estimator_of
from blrppl.model.functions import distribution_leaves, factor_arguments
from blrppl.model.probes import random_point
from blrppl.runtime.compile import compile_lowered, compiler_options, jit
from blrppl.graph.plan import FactorRole
from blrppl.model.records import unwrap

#: half-bandwidths tried: the largest first (a block that is no chain of it is no chain of
#: any smaller one: one compiled probe), then the smaller ones together
CANDIDATES = (1, 2, 3, 4, 6, 8)
#: columns of the random covariance factor Z
_REFERENCE_COLUMNS = 3


def _qualifies(factor, provisional: bool) -> bool:
    """Whether a factor's estimator lets a block it touches be a chain or an arrowhead: it
    reads the block through its arguments' moments (closed form, quadrature), or, while
    the compiler's family policy iterates (``provisional``), it is a provisional choice
    that the quadrature probes, which run on the final blocks, may replace (a logistic or
    Student-t observation of a chain gets quadrature)."""
    estimator = estimator_of(factor)
    return estimator.reads_moments or (provisional and estimator.provisional)


def _every_argument(site: dict) -> dict:
    """The value and every pytree leaf of a site's distribution (a factor with neither a rule
    nor projections: all it may read)."""
    _, leaves, _ = distribution_leaves(site)
    return {"value": site["value"], **{f"leaf{i}": leaf for i, leaf in enumerate(leaves)}}


class _Unpaired(Exception):
    """A factor's arguments do not share the element layout the test assumes."""


def _event_dims(base, arg: str, rule: bool) -> int:
    """Event dims of a rule argument of an unwrapped distribution (its constraint's; a
    quadrature factor's projections: the distribution's event dims)."""
    base_event = len(base.event_shape)
    if arg == "value" or not rule:
        return base_event
    constraint = getattr(base, "arg_constraints", {}).get(arg)
    return getattr(constraint, "event_dim", base_event) if constraint is not None else base_event


def _combiner(site: dict, args: dict, rule, rng: np.random.Generator):
    """A function of the factor's argument arrays → u with one element per group of
    positions the rule pairs: a random combination of every floating argument.

    The groups are the distribution's batch elements (each argument summed over its event
    dims), except for a rule with an ``event_window`` w (:class:`blrppl.rules.registry.Rule`):
    there every position t of the value's last axis is a group, with positions t − w + 1 … t
    of the value and the batch element's other arguments.
    """
    base, _, _ = unwrap(site["fn"])
    full = tuple(site["fn"].batch_shape) + tuple(site["fn"].event_shape)
    event = len(base.event_shape)
    window = getattr(rule, "event_window", None) if event == 1 else None
    elements = full if window else full[: len(full) - event]
    batch_ndim = len(full) - event
    plan = []
    for name, value in args.items():
        value = jnp.asarray(value)
        if not jnp.issubdtype(value.dtype, jnp.floating):
            continue
        ed = min(_event_dims(base, name, rule is not None), value.ndim)
        if window and name == "value":
            plan.append((name, "window", rng.normal(size=window)))
            continue
        if window and ed:
            raise _Unpaired(name)
        batch, tail = value.shape[: value.ndim - ed], value.shape[value.ndim - ed :]
        try:
            paired = np.broadcast_shapes(batch, full[:batch_ndim]) == tuple(full[:batch_ndim])
        except ValueError:
            paired = False
        if not paired:  # (an argument with more elements than the factor)
            raise _Unpaired(name)
        plan.append((name, ed, rng.normal(size=tail) if tail else float(rng.normal())))

    def combine(values: dict):
        u = jnp.zeros(elements)
        for name, ed, weight in plan:
            x = jnp.asarray(values[name])
            if ed == "window":
                x = jnp.broadcast_to(x, elements)
                part = sum(
                    w * jnp.concatenate([jnp.zeros(elements[:-1] + (k,), x.dtype), x[..., : elements[-1] - k]], -1)
                    for k, w in enumerate(weight)
                    if k < elements[-1]
                )
            else:
                part = x * weight
                if ed:
                    part = jnp.sum(part, axis=tuple(range(-ed, 0)))
                if window:
                    part = part[..., None]
            u = u + jnp.broadcast_to(part, elements)
        return u

    return combine


def _probe(
    name: str, blocks: dict, factors, fns, data, rng: np.random.Generator, site_block: dict | None,
    provisional: bool = False,
):
    """``(run, n, names)``: ``run(tangents)`` pushes tangents ``(k, n)`` of the block
    ``name`` at a random point through a random combination of each touching factor's
    arguments per element (:func:`_combiner`), one compiled program per shape of
    ``tangents``: a list of ``(k, elements)`` arrays, one per factor (``names``, in that
    order). None when the block qualifies for no structure (a factor whose estimator does
    not qualify, see :func:`_qualifies`, or no factor)."""
    block = blocks[name]
    n = block.size
    site_block = site_block or {}
    neighbours_of = {f.name: {site_block.get(m, m) for m in f.neighbours} for f in factors}
    touching = [f for f in factors if name in neighbours_of[f.name] and f.role == FactorRole.SITE]
    if n < 3 or not touching or not all(_qualifies(f, provisional) for f in touching):
        return None
    neighbours = set().union(*(neighbours_of[f.name] for f in touching))
    values = {m: np.asarray(random_point(blocks[m], rng)) for m in neighbours}
    wanted = {f.name: factor_arguments(f) if f.rule is not None or f.links else _every_argument for f in touching}
    combiners = {}  # built while tracing (they read only static shapes): no model run on the host

    def combined(x, data):
        point = {**values, name: x.reshape(block.value_shape)}
        out = fns.args_of(wanted, point, data)
        if not combiners:
            sites = fns.sites(tuple(wanted), point, data)
            combiners.update({f.name: _combiner(sites[f.name], out[f.name], f.rule, rng) for f in touching})
        return [combiners[f.name](out[f.name]) for f in touching]

    def pushed(x, tangents, data):
        return jax.vmap(lambda t: jax.jvp(lambda y: combined(y, data), (x,), (t,))[1])(tangents)

    x0 = np.asarray(values[name], dtype=jnp.result_type(float)).reshape(-1)

    def run(tangents) -> list:
        tangents = np.asarray(tangents, x0.dtype)
        lowered = jit(pushed).lower(x0, tangents, data)
        return [np.asarray(o) for o in compile_lowered(lowered, compiler_options(data))(x0, tangents, data)]

    return run, n, tuple(f.name for f in touching)


class Chain(NamedTuple):
    """What the probe found of a chain: its half-bandwidth, and the factors each of whose
    elements reads one scalar of it (through all its arguments)."""

    bandwidth: int
    scalar_reads: frozenset


def chain_bandwidth(
    name: str, blocks: dict, factors, fns, data, rng: np.random.Generator, site_block: dict | None = None,
    provisional: bool = False,
) -> Chain | None:
    """The smallest half-bandwidth b in :data:`CANDIDATES` such that the block ``name`` is a
    chain of bandwidth b (see the module docstring), with the factors that read one scalar
    per element; or None.

    Only blocks whose factors' estimators read them through the moments of their arguments
    qualify (closed form and quadrature; with ``provisional``, the compiler's provisional
    Monte Carlo ones too: it checks the final classes). ``site_block`` maps
    the sites the factors name as neighbours to the block holding them, when ``blocks``
    merges some.
    """
    probe = _probe(name, blocks, factors, fns, data, rng, site_block, provisional)
    if probe is None:
        return None
    run, n, names = probe
    z = rng.normal(size=(n, _REFERENCE_COLUMNS))
    candidates = [b for b in CANDIDATES if 2 * b + 1 < n]
    if not candidates:
        return None

    def fitting(stage, with_scalar: bool = False):
        """The bandwidths of ``stage`` every factor fits, and (``with_scalar``: b = 0 checked
        per factor in the same run) the factors reading one scalar per element."""
        stacks, offsets = [z.T], {}
        for b in stage + ([0] if with_scalar else []):
            offsets[b] = sum(len(s) for s in stacks)
            stacks += list(_colour_sets(z, b))
        outs = run(np.concatenate(stacks, 0))
        fits = [b for b in stage if all(_agrees(o, offsets[b], 2 * b + 1) for o in outs)]
        scalar = frozenset(f for f, o in zip(names, outs) if _agrees(o, offsets[0], 1)) if with_scalar else None
        return fits, scalar

    try:
        widest, scalar = fitting(candidates[-1:], with_scalar=True)
    except _Unpaired:
        return None
    if not widest:
        return None
    smaller = fitting(candidates[:-1])[0] if len(candidates) > 1 else []
    return Chain(smaller[0] if smaller else candidates[-1], scalar)


def arrowhead_locals(
    name: str, blocks: dict, factors, fns, data, rng: np.random.Generator, spans: dict, site_block: dict | None = None
) -> tuple:
    """The largest set of the candidate parts ``spans`` (part → (start, stop) positions in the
    block ``name``) such that every element of every factor touching the block reads at most
    one scalar of their union, through all the arguments it pairs: the block's posterior
    precision is then an arrowhead (diagonal over those *local* scalars, dense over the rest
    and between the two: :class:`blrppl.families.GaussianArrowhead`). Empty when none is.

    The test is the arrowhead family's local tangent pair: with Z a random matrix on the
    positions of a set L (zero elsewhere) and v_j = Σ_c Z_jc², an element's exact variance
    Σ_c (J z_c)_n² equals (J 1_L)_n (J v)_n for every element exactly when each reads at most
    one position of L (two positions j, k give a_j a_k (v_j + v_k) in place of 2 a_j a_k Σ_c
    z_jc z_kc: a random Z tells them apart with probability 1). A union of parts passes
    exactly when each part and each pair of parts does: one compiled probe for all of them.

    The factors' estimators are those of the blocks before the merge (a gather of a
    per-site block can leave a factor Monte Carlo that the merged block gives quadrature):
    only the arguments' structure is probed here, and the compiler checks the final ones.
    """
    probe = _probe(name, blocks, factors, fns, data, rng, site_block, provisional=True)
    parts = [p for p in spans if spans[p][1] - spans[p][0] >= 2]
    if probe is None or not parts:
        return ()
    run, n, _ = probe
    sets = [(p,) for p in parts] + [(p, q) for i, p in enumerate(parts) for q in parts[i + 1 :]]
    stacks = []
    for s in sets:
        z = np.zeros((n, _REFERENCE_COLUMNS))
        for p in s:
            lo, hi = spans[p]
            z[lo:hi] = rng.normal(size=(hi - lo, _REFERENCE_COLUMNS))
        stacks += [z.T, (np.abs(z).sum(1) > 0)[None].astype(float), np.sum(z**2, 1)[None]]
    try:
        outs = run(np.concatenate(stacks, 0))
    except _Unpaired:
        return ()
    width = _REFERENCE_COLUMNS + 2
    passed = {s for k, s in enumerate(sets) if all(_agrees(o[k * width :], _REFERENCE_COLUMNS, 1) for o in outs)}
    best = ()
    for r in range(1, len(parts) + 1):
        for chosen in itertools.combinations([p for p in parts if (p,) in passed], r):
            if all(pair in passed for pair in itertools.combinations(chosen, 2)):
                size = sum(spans[p][1] - spans[p][0] for p in chosen)
                if size > sum(spans[p][1] - spans[p][0] for p in best):
                    best = chosen
    return best


def _colour_sets(z: np.ndarray, b: int) -> tuple:
    """The banded family's colour tangents (:meth:`GaussianBanded.tangent_sets`) for the
    covariance Z Zᵀ within half-bandwidth b, on the host."""
    n, k = z.shape[0], 2 * b + 1
    full = np.zeros((n, 2 * b + 1))  # full[i, b + d] = (Z Zᵀ)[i, i + d]
    for d in range(-b, b + 1):
        lo, hi = max(0, -d), min(n, n - d)
        full[lo:hi, b + d] = np.sum(z[lo:hi] * z[lo + d : hi + d], 1)
    cls = np.arange(n) % k
    left = (cls[None, :] == np.arange(k)[:, None]).astype(float)
    offset = (np.arange(k)[:, None] - cls[None, :] + b) % k
    right = full[np.arange(n)[None, :], offset]
    return left, right


def _agrees(out: np.ndarray, start: int, k: int) -> bool:
    """Whether the colour formula (``k`` left rows from ``start``, then ``k`` right rows)
    reproduces the exact variances (the first rows of ``out``: the reference columns)."""
    exact = np.sum(out[:_REFERENCE_COLUMNS] ** 2, 0)
    formula = np.sum(out[start : start + k] * out[start + k : start + 2 * k], 0)
    scale = np.abs(exact) + 1e-3 * np.max(np.abs(exact), initial=0.0) + np.finfo(out.dtype).tiny
    return bool(np.all(np.abs(formula - exact) <= math.sqrt(np.finfo(out.dtype).eps) * scale))
