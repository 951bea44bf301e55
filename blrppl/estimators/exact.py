"""The exact estimator: closed-form expected log-densities from the rules registry.

For a factor f with rule R, L = E_q[log f] = Σ_elements R(moments of its arguments), with
the distribution's wrappers applied as ``log_prob`` applies them (reinterpreted event dims
summed, masked elements dropped, expansion) and the site's scale. Factors touching discrete
blocks are enumerated (:mod:`blrppl.estimators.enumeration`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from blrppl import moments as mom
from blrppl.estimators.registry import Estimator, EstimatorChoice, register_estimator
from blrppl.graph.plan import EstimatorSpec
from blrppl.model.records import reduce_wrapped, unwrap
from blrppl.moments.linearised import group_moments

@dataclasses.dataclass(frozen=True)
class ExactSpec(EstimatorSpec):
    """What the exact estimator records of a factor (:attr:`blrppl.graph.plan.Factor.spec`).

    Attributes:
        powers: ``(argument, a)`` of every argument that is c·τ^a in a Gamma block (a is
            None when it differs between elements): what conjugacy and the Gamma family's
            moments read.
        pairs: ``(argument, ((A, B), ...))`` of every argument that is a product of affine
            forms of the Gaussian blocks A and B (``bilinear_gaussian``).
        statistics: None, or where the factor's expectation comes from instead of its
            arguments' moments, set when the plan is finished
            (:func:`blrppl.compiler.finish.finish_plan`): a
            :class:`blrppl.estimators.gram.GramSource` (a Normal linear in one large dense
            Gaussian block) or a :class:`blrppl.estimators.bilinear.BilinearSource` (a
            Normal whose location multiplies rows of two Gaussian blocks). Either answers
            ``blocks`` (the blocks whose rows the statistics are of), ``scale_rows``,
            ``dense_work``, ``shown(plan)``, ``compute(fns, factor, blocks, data, rows)`` and
            ``expected_log(factor, statistics, views)``.
    """

    powers: tuple = ()
    pairs: tuple = ()
    statistics: Any = None


#: closed form: for a factor f with rule R,
#: L = E_q[log f] = Σ_elements R(moments of its arguments' classes)
EXACT = register_estimator(
    Estimator(
        name="exact",
        summary="closed form, L = Σ_elements R(moments of the arguments) from the rule R",
        closed_form=True,
        reads_moments=True,
        order=2,
        elementwise=lambda fns, fs, blocks, views, dvals, data, wrappers, key, curvature: (
            _exact_elementwise(fns, fs, blocks, views, dvals, data, wrappers)
        ),
        serves=lambda candidate: _serves(candidate),
        choice_order=0,
    )
)


def _serves(candidate) -> EstimatorChoice | None:
    """A factor whose rule has a closed form for the classes of all its arguments: their
    kinds and blocks, the powers of Gamma blocks and the pairs of multiplied Gaussian
    blocks they read, and whether each Gaussian neighbour is read through its full
    covariance columns (an argument mixing its elements) or one element per element."""
    if not candidate.closed_form:
        return None
    kinds, arg_blocks, full, powers, pairs = [], [], set(), [], []
    for arg in ("value",) + candidate.rule.arg_names:
        cls = candidate.classes[arg]
        kinds.append((arg, cls.kind))
        arg_blocks.append((arg, cls.blocks))
        full.update(cls.full)
        if cls.kind == mom.PowerGamma.kind:
            powers.append((arg, cls.power))
        if cls.kind == mom.BilinearGaussian.kind:
            pairs.append((arg, cls.pairs))
    gauss = [n for n in candidate.neighbours if candidate.blocks[n].family.gaussian]
    columns = tuple((n, "full" if n in full else "gather") for n in gauss)
    return EstimatorChoice(
        rule=candidate.rule, arg_kinds=tuple(kinds), arg_blocks=tuple(arg_blocks), columns=columns,
        spec=ExactSpec(powers=tuple(powers), pairs=tuple(pairs)),
    )


def _exact_elementwise(fns, factors, blocks, views, discrete_values, data, wrappers) -> tuple:
    """L per element of each closed-form factor from its rule, given the discrete values (the
    moments of every factor's arguments built in one pass), the sites' scales, and 0.0."""
    moments = group_moments(fns, factors, blocks, views, discrete_values, data, on_support=True)
    els = {f.name: elementwise_expected_log_prob(f, moments[f.name], wrappers[f.name][0]) for f in factors}
    return els, {f.name: wrappers[f.name][1] for f in factors}, 0.0


def elementwise_expected_log_prob(factor, moments: dict, fn):
    """L per batch element of the factor's (wrapped) distribution ``fn``: the rule's terms
    broadcast to the batch shape of ``fn``'s base distribution first (enumerated labels may
    come with size-1 plate dims, see :attr:`blrppl.estimators.enumeration.Enumeration.broadcast`),
    then its wrappers applied."""
    return reduce_wrapped(fn, unwrapped_expected_log_prob(factor, moments, fn))


def unwrapped_expected_log_prob(factor, moments: dict, fn):
    """L per batch element of the base distribution of ``fn`` (its wrappers not applied)."""
    moments = dict(moments)
    value = moments.pop("value")
    out = factor.rule.expected_log_prob(value, **moments)
    base_shape = unwrap(fn)[0].batch_shape
    return jnp.broadcast_to(out, jnp.broadcast_shapes(jnp.shape(out), base_shape))


def reduce_factor(elementwise, scale):
    """Σ over elements of ``elementwise`` times the site's scale."""
    if scale is not None:
        elementwise = scale * elementwise
    return jnp.sum(elementwise)
