"""Registry of closed-form expected log-densities, keyed by numpyro distribution type.

A rule computes L = E_q[log p(value | args)] elementwise (one value per batch element of
the distribution, event dims summed) from one moment object per argument (see
:mod:`blrppl.moments`). The compiler asks :func:`find_rule` for the rule of a factor's
(unwrapped) distribution and checks :attr:`Rule.supports` against the kinds it found for
the arguments; if the rule accepts them the factor's estimator is ``exact``.
Messages are never written by hand: they are ∇_μ L, obtained by autodiff through the
moment objects and the family's natural-gradient conversion.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

#: dist_type → its rule; (dist_type, given) → the rule of a parameterisation (a
#: distribution built from matrices its pytree drops, see ``given`` of :func:`register_rule`)
_RULES: dict = {}


@dataclasses.dataclass(frozen=True)
class Rule:
    """A closed-form expected log-density.

    Attributes:
        dist_type: the numpyro distribution class.
        arg_names: attributes of the distribution the rule reads (besides ``value``).
        kinds: for ``value`` and each argument, the moment kinds the rule accepts.
        expected_log_prob: ``f(value, **args) -> array`` of the distribution's batch shape.
        event_ndim: number of trailing value dims the rule sums over (MVN, Dirichlet: 1).
        conjugate_powers: for arguments that may be a power c·τ^a of a Gamma block, the
            exponents a for which L is linear in τ's expectation parameters (E log τ, E τ),
            i.e. the factor is conjugate to the Gamma block (e.g. a Normal scale τ^−½).
        given: the constructor matrices the rule reads that the distribution's pytree drops
            (``("precision_matrix",)`` for a ``MultivariateNormal`` built from its
            precision), or ``()`` for the rule of every other parameterisation.
        event_window: for a rule with event dims, w when it reads covariances of the value
            only between positions of the last axis at most w − 1 apart (a random walk's
            increments: 2), else None (any two positions of an event). A chain's banded
            block (:mod:`blrppl.graph.band`) holds only nearby covariances.
    """

    dist_type: type
    arg_names: tuple[str, ...]
    kinds: Mapping[str, frozenset]
    expected_log_prob: Callable
    event_ndim: int = 0
    conjugate_powers: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    event_window: int | None = None
    given: tuple = ()

    def supports(self, kinds: Mapping[str, str]) -> bool:
        """Whether the rule has a closed form for arguments of these kinds."""
        return all(kinds[name] in self.kinds[name] for name in ("value",) + self.arg_names)


def register_rule(
    dist_type: type,
    *,
    kinds: Mapping[str, tuple[str, ...]],
    event_ndim: int = 0,
    conjugate_powers: Mapping[str, tuple] | None = None,
    event_window: int | None = None,
    given: tuple = (),
):
    """Decorator registering ``f(value, **args)`` as the rule of ``dist_type``.

    ``kinds`` maps ``"value"`` and every argument name to the moment kinds accepted; its
    keys other than ``"value"`` are the argument names, in order. ``conjugate_powers``
    maps arguments to the Gamma-block exponents for which the rule is conjugate;
    ``event_window`` see :class:`Rule`. ``given``: the rule of the distributions built from
    these matrices (the default rule serves the others).
    """

    def decorate(fn):
        arg_names = tuple(k for k in kinds if k != "value")
        _RULES[(dist_type, tuple(given)) if given else dist_type] = Rule(
            dist_type=dist_type,
            arg_names=arg_names,
            kinds={k: frozenset(v) for k, v in kinds.items()},
            expected_log_prob=fn,
            event_ndim=event_ndim,
            conjugate_powers=dict(conjugate_powers or {}),
            event_window=event_window,
            given=tuple(given),
        )
        return fn

    return decorate


def find_rule(dist_type: type, given: tuple = ()) -> Rule | None:
    """The rule registered for ``dist_type`` (or its nearest registered base class) built
    from the matrices ``given``: the parameterisation's own rule when there is one, else
    the type's rule."""
    for cls in dist_type.__mro__:
        if given and (cls, tuple(given)) in _RULES:
            return _RULES[(cls, tuple(given))]
        if cls in _RULES:
            return _RULES[cls]
    return None


def registered_rules() -> dict:
    """A copy of the registry: dist_type → rule, and (dist_type, given) → the rule of that
    parameterisation."""
    return dict(_RULES)
