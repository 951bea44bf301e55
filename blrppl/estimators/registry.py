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

Each says which factors it serves (:attr:`Estimator.serves`, asked in
:attr:`Estimator.choice_order` by :func:`choose_estimator`): the compiler chooses a factor's
estimator through them, never by name.

Factors on discrete blocks are evaluated by each of them at every enumerated assignment
(:mod:`blrppl.estimators.enumeration`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

from blrppl.graph.plan import EstimatorSpec


class FactorCandidate(NamedTuple):
    """What the compiler knows of a factor when it chooses the factor's estimator: each
    registered estimator's :attr:`Estimator.serves` reads it and says whether it serves the
    factor, and how.

    Attributes:
        name: the factor's (site's) name.
        record: its :class:`blrppl.model.records.SiteRecord`.
        rule: its closed-form rule (None: no rule for the distribution, or a
            ``numpyro.factor`` term).
        blocks: block name → :class:`blrppl.graph.plan.Block`.
        neighbours: the blocks it reads; ``discrete`` those of them that are discrete.
        discrete: see ``neighbours``.
        classes: argument name (``"value"`` and the rule's) → its
            :class:`blrppl.model.classes.ArgumentClass`, where the rule applies.
        closed_form: the rule has a closed form for every argument's class.
        projections: the scalar projections a quadrature rule may integrate over (items
            ``"value"``, ``"shift:<i>"`` or ``"leaf:<i>"``), each with its classes by link in
            ``projection_classes``; empty when quadrature is off.
        projection_classes: ``(name, item index, link)`` → class.
        quadrature: whether quadrature estimators may serve it.
        site_reads: the latent sites it reads, where blocks hold several (None: unknown).
    """

    name: str
    record: Any
    rule: Any
    blocks: dict
    neighbours: tuple
    discrete: tuple
    classes: dict
    closed_form: bool
    projections: tuple
    projection_classes: dict
    quadrature: bool
    site_reads: Any = None


class EstimatorChoice(NamedTuple):
    """How an estimator serves a factor: the fields of its
    :class:`blrppl.graph.plan.Factor` that the estimator sets.

    Attributes:
        rule: the closed-form rule it evaluates (None: it needs none).
        arg_kinds: the kind of each argument (and of the value) as it reads them.
        arg_blocks: the blocks each argument depends on.
        columns: for each Gaussian neighbour, how its columns are read (``"gather"`` or
            ``"full"``).
        spec: its own record of the factor (:attr:`blrppl.graph.plan.Factor.spec`), of a
            type defined in the estimator's module (an
            :class:`blrppl.graph.plan.EstimatorSpec`; the base record for an estimator
            with nothing to record).
    """

    rule: Any = None
    arg_kinds: tuple = ()
    arg_blocks: tuple = ()
    columns: tuple = ()
    spec: EstimatorSpec = EstimatorSpec()


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
            (:attr:`blrppl.estimators.quadrature.QuadratureSpec.grid_positions`).
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
        serves: ``serves(candidate) -> EstimatorChoice | None``: whether it serves a factor
            (a :class:`FactorCandidate`), and how; None: the compiler never chooses it.
        choice_order: the order in which the compiler asks the estimators that serve
            factors (lowest first): the first that serves a factor is its estimator.
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
    serves: Callable | None = dataclasses.field(default=None, compare=False, repr=False)
    choice_order: int = 100

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


def choose_estimator(candidate: FactorCandidate) -> tuple:
    """The estimator of a factor: the first registered estimator, by
    :attr:`Estimator.choice_order`, whose :attr:`Estimator.serves` serves it.

    Returns:
        ``(estimator, choice)``: the :class:`Estimator` and its :class:`EstimatorChoice`.

    Raises:
        LookupError: no registered estimator serves the factor.
    """
    for estimator in sorted((e for e in ESTIMATORS.values() if e.serves is not None), key=lambda e: e.choice_order):
        choice = estimator.serves(candidate)
        if choice is not None:
            return estimator, choice
    raise LookupError(f"no registered estimator serves the factor '{candidate.name}'")
