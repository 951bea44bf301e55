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

_RULES: dict[type, "Rule"] = {}


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
):
    """Decorator registering ``f(value, **args)`` as the rule of ``dist_type``.

    ``kinds`` maps ``"value"`` and every argument name to the moment kinds accepted; its
    keys other than ``"value"`` are the argument names, in order. ``conjugate_powers``
    maps arguments to the Gamma-block exponents for which the rule is conjugate;
    ``event_window`` see :class:`Rule`.
    """

    def decorate(fn):
        arg_names = tuple(k for k in kinds if k != "value")
        _RULES[dist_type] = Rule(
            dist_type=dist_type,
            arg_names=arg_names,
            kinds={k: frozenset(v) for k, v in kinds.items()},
            expected_log_prob=fn,
            event_ndim=event_ndim,
            conjugate_powers=dict(conjugate_powers or {}),
            event_window=event_window,
        )
        return fn

    return decorate


def find_rule(dist_type: type) -> Rule | None:
    """The rule registered for ``dist_type`` (or its nearest registered base class)."""
    for cls in dist_type.__mro__:
        if cls in _RULES:
            return _RULES[cls]
    return None


def registered_rules() -> dict[type, Rule]:
    """A copy of the registry."""
    return dict(_RULES)
