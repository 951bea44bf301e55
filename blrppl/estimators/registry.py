"""The estimators of the factors' expected log-densities, as objects registered by name.

A factor f of the plan carries the name of its estimator (:attr:`blrppl.graph.plan.Factor.estimator`,
the name the plan tables show); what the rest of the package asks of the estimator (is it a
closed form, does it draw, does it read its arguments' moments, …) it asks the object
:func:`estimator_of` returns, never the name. Each built-in estimator's object lives in its
own module and registers itself there:

* ``exact`` (:data:`blrppl.estimators.exact.EXACT`): L = E_q[log f] from the closed-form rule;
* ``quadrature`` (:data:`blrppl.estimators.quadrature.QUADRATURE`): Gauss–Hermite nodes;
* ``monte_carlo`` (:data:`blrppl.estimators.monte_carlo.MONTE_CARLO`): draws from q;
* ``delta`` (:data:`blrppl.estimators.delta.DELTA`): log f at the point blocks' means.

Factors on discrete blocks are evaluated by each of them at every enumerated assignment
(:mod:`blrppl.estimators.enumeration`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Estimator:
    """An estimator of a factor's expected log-density L = E_q[log f].

    Attributes:
        name: the name factors carry (:attr:`blrppl.graph.plan.Factor.estimator`) and the
            plan tables show.
        summary: one line saying how L is computed.
        closed_form: L comes from the factor's rule as a function of the moments of its
            arguments' classes (:mod:`blrppl.moments.kinds`): the compiler needs those
            classes, and the messages are exact (conjugacy can be declared by the rule).
        reads_moments: L is a function of the moments of the factor's arguments (their
            marginals under q), so a block is read only through them: a chain or an
            arrowhead block keeps its structure, and a factor reading one scalar of a chain
            per element sees the diagonal of its covariance.
        deterministic: L is computed without random draws.
        draws: the estimator consumes random keys (each evaluation splits one).
        decaying_steps: its messages are noisy: its blocks take a damped ρ and a decaying
            (Robbins–Monro) schedule by default.
        samples_jointly: it draws the whole of each continuous block it reads, so its cost
            grows with the joint dimension of its blocks.
        approximates: L is an approximation whose reason (why no closed form applies) the
            plan keeps in :attr:`blrppl.graph.plan.Factor.why`.
        provisional: the compiler may choose it before the quadrature probes, which run on
            the final blocks, replace it (a structure chosen meanwhile accepts it).
        grid_rule: it has a rule integrating over a few scalars of a joint block
            (:attr:`blrppl.graph.plan.Factor.grid_positions`).
        stackable: factors with this estimator on identical sites may be stacked into one
            vectorised factor (:mod:`blrppl.graph.stack`).
        enumerated: it evaluates L at every enumerated assignment of the factor's discrete
            neighbours (:mod:`blrppl.estimators.enumeration`).
        order: where its factors come among a group's estimators when their terms are summed
            (a fixed order keeps the sum's rounding the same from build to build).
        elementwise: its evaluation, ``elementwise(fns, factors, blocks, views, discrete_values,
            data, wrappers, key, curvature) -> (els, scales, extra)``: per factor of ``factors``
            (those of one group that carry this estimator) L per batch element given the discrete
            values, the site's scale, and a scalar to add to the objective (0.0 but for
            surrogate terms); ``wrappers`` maps a factor to its wrapped distribution and scale.
    """

    name: str
    summary: str = ""
    closed_form: bool = False
    reads_moments: bool = False
    deterministic: bool = True
    draws: bool = False
    decaying_steps: bool = False
    samples_jointly: bool = False
    approximates: bool = False
    provisional: bool = False
    grid_rule: bool = False
    stackable: bool = True
    enumerated: bool = True
    order: int = 100
    elementwise: Callable | None = dataclasses.field(default=None, compare=False, repr=False)

    def describe(self) -> str:
        """The estimator's label in a plan table: its name."""
        return self.name

    def explain(self) -> str:
        """``"<name>: <summary>"``: what the estimator computes."""
        return f"{self.name}: {self.summary}" if self.summary else self.name


#: the registered estimators by name
ESTIMATORS: dict = {}


def register_estimator(obj: Estimator) -> Estimator:
    """Register ``obj`` under its name (replacing an estimator of that name) and return it.

    Args:
        obj: the estimator.

    Returns:
        ``obj``.
    """
    if not isinstance(obj, Estimator):
        raise TypeError(f"an estimator must be an Estimator, not {type(obj).__name__}")
    ESTIMATORS[obj.name] = obj
    return obj


def estimator_of(factor) -> Estimator:
    """The registered estimator of a factor (by :attr:`blrppl.graph.plan.Factor.estimator`).

    Args:
        factor: a plan's factor, or an estimator's name.

    Returns:
        The :class:`Estimator`.

    Raises:
        KeyError: no estimator of that name is registered.
    """
    name = factor if isinstance(factor, str) else factor.estimator
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise KeyError(f"no estimator named {name!r} (registered: {', '.join(ESTIMATORS)})") from None
