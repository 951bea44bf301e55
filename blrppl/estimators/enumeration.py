"""Enumeration of discrete blocks.

A factor touching discrete blocks d_1..d_m (each enumerated over its support values, every
element of a block set to the same value at once, which is exact because each element of
the factor uses the aligned element of each discrete block) has

    L = Σ_{k_1..k_m} Π_j q_j(k_j) · E_q[log f | d_1 = k_1, …, d_m = k_m],

so the message to a Categorical block is ∂L/∂q_j(k) = E_q[log f | d_j = k] (weighted by the
other discrete blocks), the VMP message of a discrete variable.

A chain block (:class:`blrppl.families.CategoricalChain`) is enumerated over pairs of values
(a, b): the states at even chain steps set to a, at odd ones to b. A factor element that
reads two consecutive states sees each pair of values exactly once over the K² pairs, and
is weighted by their pair marginal q(z_t, z_{t+1}); one reading one state is weighted by its
marginal q(z_t) (divided by the K times each value recurs). Only the chain positions each
element reads matter (:class:`blrppl.graph.markov.Reads`, found when compiling), so the
same K² runs serve every factor of the chain. Without a factor reading two states, K runs
(a = b) do. A transition that every step reads through one table runs K times instead
(:mod:`blrppl.graph.chain_table`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from blrppl.estimators.exact import reduce_factor, unwrapped_expected_log_prob
from blrppl.estimators.monte_carlo import expected_log_jacobian
from blrppl.estimators.registry import estimator_of
from blrppl.moments.linearised import group_moments
from blrppl.graph import chain_table
from blrppl.graph.chain_table import static_rows
from blrppl.graph.plan import FactorRole
from blrppl.model.records import reduce_wrapped


@dataclasses.dataclass(frozen=True)
class Enumeration:
    """How a factor's discrete neighbours are enumerated, when not the default way
    (:attr:`blrppl.graph.plan.Factor.enumeration`; None is the default: every element of
    each discrete block set to each value in turn, with the values' full shape).

    Attributes:
        chain_reads: for a factor of a hidden Markov chain, the chain positions each of its
            elements reads: ``((chain block, reads),)`` with a
            :class:`blrppl.graph.markov.Reads` per chain block.
        table: for a factor of a hidden Markov chain whose elements read pairs of states
            through the same K × K table (a transition ``trans[prev]``), its layout
            (:class:`blrppl.graph.chain_table.ChainTable`): K runs of the model instead of
            K² (checked at compile time); None otherwise.
        broadcast: the factor's enumerated discrete values may be passed with size-1 plate
            dims (every element at one value) and its expected log-density broadcast over
            its elements: its arguments were checked, at compile time, to equal the full ones
            broadcast (a mixture's ``mu[z]`` is then one row per component, not N copies of it).
    """

    chain_reads: tuple = ()
    table: Any = None
    broadcast: bool = False


#: the default enumeration (a factor's :attr:`blrppl.graph.plan.Factor.enumeration` is None)
DEFAULT = Enumeration()


def enumeration_of(factor) -> Enumeration:
    """The factor's :class:`Enumeration` (:data:`DEFAULT` when it has none)."""
    return factor.enumeration if factor.enumeration is not None else DEFAULT


def with_enumeration(factor, **changes):
    """``factor`` with the fields ``changes`` of its :class:`Enumeration` replaced (its
    enumeration None when it is then the default)."""
    enumeration = dataclasses.replace(enumeration_of(factor), **changes)
    return dataclasses.replace(factor, enumeration=None if enumeration == DEFAULT else enumeration)


def is_jacobian(factor) -> bool:
    """Whether a factor is the log|det J| term of an unconstrained block (not a site)."""
    return factor.role == FactorRole.JACOBIAN


def _elementwise(fns, group, blocks, views, dvals, data, wrappers, key, curvature="auto"):
    """Per-element E_q[log f | discrete values] of a group of factors, their scales, and a
    scalar term to add (the explicit-curvature surrogate of Monte Carlo factors)."""
    by_estimator: dict = {}
    for f in group:
        by_estimator.setdefault(estimator_of(f), []).append(f)
    els, scales, extra = {}, {}, 0.0
    for estimator in sorted(by_estimator, key=lambda e: (e.order, e.name)):
        e, sc, x = estimator.elementwise(
            fns, by_estimator[estimator], blocks, views, dvals, data, wrappers, key, curvature
        )
        els.update(e)
        scales.update(sc)
        if not (isinstance(x, float) and x == 0.0):  # (a surrogate term: Monte Carlo's curvature)
            extra = x if isinstance(extra, float) and extra == 0.0 else extra + x
    return els, scales, extra


def _states(block, group) -> int:
    """Enumerated states of a discrete block for a group of factors: its values, or for a
    chain the K² pairs when some factor element reads two of its states, else K."""
    k = len(block.support_values)
    if block.chain and any(np.any(dict(enumeration_of(f).chain_reads)[block.name].hi >= 0) for f in group):
        return k * k
    return k


def _chain_states(block, state, k: int, pairs: bool):
    """Flat positions' value indices of enumerated state ``state``: (a, b) = divmod(state, K)
    at even / odd chain steps (a = b = state without pairs)."""
    width = block.size // block.family.length
    odd = jnp.asarray((np.arange(block.size) // width) % 2 == 1)
    a, b = (state // k, state % k) if pairs else (state, state)
    return jnp.where(odd, b, a)


def _chain_weights(factor, name, view, num_states: int):
    """``(num_states, *elements)``: for each enumerated state (a, b) of the chain ``name``
    (:func:`_chain_states`) and element of ``factor``, the chain marginal of the states the
    element reads (module docstring). Formed once for all states by reshaping the element's
    marginals (no gather indexed by the state: its derivative would be a scatter per state
    and element)."""
    reads = dict(enumeration_of(factor).chain_reads)[name]
    k = view.probs.shape[-1]
    width = view.probs.shape[0]
    lo = np.clip(reads.lo, 0, None)
    # the state at an even chain step is a, at an odd one b: an element whose first state
    # sits at an odd step reads (b, a)
    odd = (lo // width) % 2 == 1
    length = view.probs.shape[1]
    # (*elements, K): view.probs[lo % width, lo // width], rows of the flattened marginals
    probs = static_rows(jnp.reshape(view.probs, (width * length,) + view.probs.shape[2:]), (lo % width) * length + lo // width)
    if num_states > k:
        by_a = jnp.repeat(probs, k, axis=-1)  # [a·K + b] = q(z = a)
        by_b = jnp.tile(probs, (1,) * (probs.ndim - 1) + (k,))  # [a·K + b] = q(z = b)
        single = jnp.where(odd[..., None], by_b, by_a) * (k / num_states)
    else:
        single = probs
    if num_states > k and view.pair_probs.shape[1]:
        t = np.minimum(lo // width, view.pair_probs.shape[1] - 1)
        steps = view.pair_probs.shape[1]
        # (*elements, K, K): q(z_t = v, z_{t+1} = w) = view.pair_probs[lo % width, t]
        pair = static_rows(
            jnp.reshape(view.pair_probs, (width * steps,) + view.pair_probs.shape[2:]), (lo % width) * steps + t
        )
        shape = pair.shape[:-2] + (k * k,)
        pair = jnp.where(odd[..., None], jnp.reshape(jnp.swapaxes(pair, -1, -2), shape), jnp.reshape(pair, shape))
        single = jnp.where((reads.hi >= 0)[..., None], pair, single)
    weight = jnp.where((reads.lo >= 0)[..., None], single, 1.0 / num_states)
    return jnp.moveaxis(weight, -1, 0)


#: a chain's enumerated states run in chunks of at most this many states × elements: all K²
#: at once, a K = 5 HMM of 10⁵ steps held (25, 10⁵, 5) arrays per intermediate, past the
#: caches (in chunks of 5 states: about 135 -> 120 ms per step; no change at 10⁴ steps)
CHUNK_STATE_ELEMENTS = 1 << 20


def _map_states(one, combos, chain_weights: dict):
    """``jax.vmap(one)(combos)``, in a sequential map over chunks of the states when a
    chain's weights say the group is large (:data:`CHUNK_STATE_ELEMENTS`)."""
    count = combos.shape[0]
    elements = max((math.prod(w.shape[1:]) for w in chain_weights.values()), default=0)
    size = max((d for d in range(1, count + 1) if count % d == 0 and d * elements <= CHUNK_STATE_ELEMENTS), default=1)
    if size == count:
        return jax.vmap(one)(combos)
    out = jax.lax.map(jax.vmap(one), combos.reshape((count // size, size) + combos.shape[1:]))
    return jax.tree.map(lambda x: x.reshape((count,) + x.shape[2:]), out)


def _tabled_terms(fns, group, blocks, views, data, wrappers):
    """Σ_i E_q[log f_i] over factors of one chain read as tables of state pairs
    (:mod:`blrppl.graph.chain_table`): the model run K times with the tables' layouts, each
    element's expected log-density read off the runs and weighted by its marginals there."""
    name = group[0].discrete[0]
    block, view = blocks[name], views[name]
    states = jnp.asarray(group[0].enumeration.table.states)  # (every factor of the chain: one layout)

    def run(s):
        dvals = block.chain_site_values(s)
        moments = group_moments(fns, group, blocks, views, dvals, data, on_support=True)
        return {f.name: unwrapped_expected_log_prob(f, moments[f.name], wrappers[f.name][0]) for f in group}

    runs = jax.vmap(run)(states)
    total = 0.0
    for f in group:
        base = runs[f.name]
        flat = jnp.reshape(base, base.shape[:1] + (-1,))
        terms = chain_table.expected_log_terms(f.enumeration.table, flat, view)
        els = reduce_wrapped(wrappers[f.name][0], jnp.reshape(terms, base.shape[1:]))
        total = total + reduce_factor(els, wrappers[f.name][1])
    return total


def expected_log_factors(fns, factors, blocks, views, data, key=None, curvature="auto"):
    """Σ_i E_q[log f_i] over ``factors``, each summed over its elements.

    Factors sharing the same discrete neighbours are evaluated together: one run of the
    model per enumerated assignment (and per Monte Carlo sample for sampled factors).
    """
    if not factors:
        return 0.0
    key = jax.random.key(0) if key is None else key
    # only Monte Carlo factors and log|det J| terms draw: without them no key is split (each
    # split is a threefry program that every fit's programs would lower and compile)
    draws = any(is_jacobian(f) or estimator_of(f).draws for f in factors)
    total = 0.0
    for f in factors:
        if is_jacobian(f):
            key, sub = jax.random.split(key)
            block = blocks[f.neighbours[0]]
            # a local block's minibatch stands for all N elements, as its sites' scale says
            scale = block.subsample_scale
            term = expected_log_jacobian(block, views[f.neighbours[0]], sub)
            total = total + (term if scale == 1.0 else scale * term)
    factors = [f for f in factors if not is_jacobian(f)]
    if not factors:
        return total
    wrappers = fns.factor_wrappers([f.name for f in factors if estimator_of(f).closed_form], data)
    groups: dict = {}
    for f in factors:
        # (factors reading pairs of a chain's states run K² times, the others K times; a
        # factor read as a table of pairs, K times: chain_table)
        enumeration = enumeration_of(f)
        pairs = "table" if enumeration.table is not None else any(np.any(r.hi >= 0) for _, r in enumeration.chain_reads)
        groups.setdefault((f.discrete, pairs), []).append(f)
    for (names, pairs), group in groups.items():
        key, sub = jax.random.split(key) if draws else (key, key)
        if pairs == "table":
            total = total + _tabled_terms(fns, group, blocks, views, data, wrappers)
            continue
        if not names:
            els, scales, extra = _elementwise(fns, group, blocks, views, {}, data, wrappers, sub, curvature)
            total = total + extra
        else:
            sizes = [_states(blocks[d], group) for d in names]
            combos = jnp.asarray(np.array(list(itertools.product(*[range(k) for k in sizes]))))

            # labels of shape 1 along their plates when every factor allows it (checked when
            # compiling): the arguments' moments are one row per value, not one per element
            broadcast = all(enumeration_of(f).broadcast for f in group)

            chain_weights = {
                (f.name, d): _chain_weights(f, d, views[d], sizes[j])
                for j, d in enumerate(names) if blocks[d].chain for f in group
            }

            def one(combo, names=names, group=group, sizes=sizes, broadcast=broadcast, chain_weights=chain_weights):
                dvals, weight = {}, {f.name: 1.0 for f in group}
                for j, d in enumerate(names):
                    b = blocks[d]
                    if b.chain:
                        k = len(b.support_values)
                        states = _chain_states(b, combo[j], k, sizes[j] > k)
                        dvals.update(b.chain_site_values(states))
                        for f in group:
                            weight[f.name] = weight[f.name] * jnp.take(chain_weights[f.name, d], combo[j], axis=0)
                        continue
                    dvals.update(b.discrete_site_values(combo[j], broadcast))
                    w = jnp.take(views[d].probs, combo[j], axis=-1)
                    weight = {n: v * w for n, v in weight.items()}
                els, scales, _ = _elementwise(fns, group, blocks, views, dvals, data, wrappers, sub)
                return {n: v * weight[n] for n, v in els.items()}, scales

            els, scales = _map_states(one, combos, chain_weights)
            els = jax.tree.map(lambda x: x.sum(0), els)
            scales = {n: None if s is None else s[0] for n, s in scales.items()}
        for f in group:
            total = total + reduce_factor(els[f.name], scales[f.name])
    return total
