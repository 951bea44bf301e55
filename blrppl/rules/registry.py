"""Registry of closed-form expected log-densities, keyed by numpyro distribution type.

blrppl's own rules register on import of :mod:`blrppl.rules`; a user's rules through the same
:func:`register_rule` (public as ``blrppl.register_rule``), which checks each declaration,
and :func:`unregister_rule` (docs/extending.md).

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
import inspect
from typing import Callable, Mapping

from numpyro.distributions import Distribution

from blrppl.errors import RegistrationError
from blrppl.moments import KINDS, PowerGamma

#: dist_type → its rule; (dist_type, given) → the rule of a parameterisation (a
#: distribution built from matrices its pytree drops, see ``given`` of :func:`register_rule`)
_RULES: dict = {}
#: the rules blrppl registers itself (:func:`seal_builtin_rules`), by key
_BUILTIN: dict = {}


@dataclasses.dataclass(frozen=True, eq=False)
class Rule:
    """A closed-form expected log-density (a registration: compared and hashed by identity,
    so that compiled fits are keyed by the rules they were built with).

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
        conjugate: the arguments in whose blocks L is linear in the expectation parameters
            when they are of a kind other than ``power_gamma`` (affine Gaussian arguments
            of a Normal: L quadratic in the block; Beta, Dirichlet, Wishart identities), so
            that a factor reading a block only through them is conjugate to it
            (:func:`blrppl.compiler.conjugacy.factor_conjugate`).
    """

    dist_type: type
    arg_names: tuple[str, ...]
    kinds: Mapping[str, frozenset]
    expected_log_prob: Callable
    event_ndim: int = 0
    conjugate_powers: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    event_window: int | None = None
    given: tuple = ()
    conjugate: frozenset = frozenset()

    def supports(self, kinds: Mapping[str, str]) -> bool:
        """Whether the rule has a closed form for arguments of these kinds."""
        return all(kinds[name] in self.kinds[name] for name in ("value",) + self.arg_names)


def register_rule(
    dist_type: type,
    *,
    kinds: Mapping[str, tuple[str, ...]],
    event_ndim: int = 0,
    conjugate_powers: Mapping[str, tuple] | None = None,
    conjugate: bool | tuple[str, ...] = False,
    event_window: int | None = None,
    given: tuple = (),
):
    """Decorator registering ``f(value, **args)`` as the rule of ``dist_type``.

    Also public as ``blrppl.register_rule``: a user's rule for a distribution blrppl has no
    rule for (docs/extending.md). The declaration is checked when it is made: a malformed
    one raises :class:`blrppl.errors.RegistrationError`.

    Args:
        dist_type: a numpyro ``Distribution`` subclass (its subclasses without a rule of their
            own get this one).
        kinds: ``"value"`` and every argument name the rule reads (attributes of the
            distribution, in order) → the moment kinds accepted (:data:`blrppl.moments.KINDS`).
        event_ndim: trailing value dims the rule sums over.
        conjugate_powers: arguments of kind ``power_gamma`` → the exponents a of the Gamma
            block τ (the argument is c·τ^a) for which L is linear in (E log τ, E τ).
        conjugate: the arguments (``True``: all) in whose other kinds' blocks L is linear in
            the expectation parameters (the Normal's, quadratic in an affine Gaussian loc):
            a block every factor of which is conjugate takes exact steps at ρ = 1 (a lone one
            converges in one step). Powers of Gamma blocks: ``conjugate_powers``.
        event_window: see :class:`Rule`.
        given: the rule of the distributions built from these matrices (the default rule
            serves the others).
    """
    arg_names = _checked_kinds(dist_type, kinds, given)
    names = ("value",) + arg_names
    powers = _checked_powers(dist_type, kinds, conjugate_powers)
    linear = _checked_conjugate(conjugate, names)
    if linear is None:
        raise RegistrationError(
            f"rule of {dist_type.__name__}: conjugate= is True, False or argument names among {list(names)}, "
            f"not {conjugate!r}"
        )
    if not isinstance(event_ndim, int) or event_ndim < 0:
        raise RegistrationError(f"rule of {dist_type.__name__}: event_ndim must be an integer >= 0, not {event_ndim!r}")
    if event_window is not None and (not isinstance(event_window, int) or event_window < 1):
        raise RegistrationError(f"rule of {dist_type.__name__}: event_window must be None or an integer >= 1")
    key = (dist_type, tuple(given)) if given else dist_type

    def decorate(fn):
        _check_signature(dist_type, fn, arg_names)
        if key in _RULES:
            raise RegistrationError(
                f"{dist_type.__name__} already has a rule ({_RULES[key].expected_log_prob.__qualname__}); "
                "unregister_rule it first"
            )
        _RULES[key] = Rule(
            dist_type=dist_type,
            arg_names=arg_names,
            kinds={k: frozenset(v) for k, v in kinds.items()},
            expected_log_prob=fn,
            event_ndim=event_ndim,
            conjugate_powers=powers,
            event_window=event_window,
            given=tuple(given),
            conjugate=frozenset(linear),
        )
        return fn

    return decorate


def _checked_kinds(dist_type, kinds, given) -> tuple:
    """The argument names of a rule declaration (``kinds``' keys but ``"value"``), checked."""
    if not (isinstance(dist_type, type) and issubclass(dist_type, Distribution)):
        raise RegistrationError(f"a rule is registered for a numpyro Distribution subclass, not {dist_type!r}")
    where = f"rule of {dist_type.__name__}"
    if not isinstance(kinds, Mapping) or "value" not in kinds:
        raise RegistrationError(f"{where}: kinds= maps 'value' and each argument to the moment kinds it accepts")
    try:
        params = set(inspect.signature(dist_type).parameters)
    except (TypeError, ValueError):  # (a constructor without a signature: its arg_constraints only)
        params = set()
    known = set(getattr(dist_type, "arg_constraints", {})) | params | set(given)
    for name, accepted in kinds.items():
        if name != "value" and name not in known:
            raise RegistrationError(
                f"{where}: '{name}' is not an argument of {dist_type.__name__} (its arguments: {sorted(known)})"
            )
        if isinstance(accepted, str) or not accepted or not all(isinstance(k, str) for k in accepted):
            raise RegistrationError(f"{where}: kinds['{name}'] must be a non-empty tuple of kinds, not {accepted!r}")
        unknown = sorted(set(accepted) - set(KINDS))
        if unknown:
            raise RegistrationError(f"{where}: unknown moment kind(s) {unknown} for '{name}'; kinds: {list(KINDS)}")
    return tuple(k for k in kinds if k != "value")


def _checked_powers(dist_type, kinds, conjugate_powers) -> dict:
    """``conjugate_powers`` as a dict of float tuples, each key an argument that accepts
    Gamma powers."""
    out = {}
    for name, powers in dict(conjugate_powers or {}).items():
        if PowerGamma.kind not in kinds.get(name, ()):
            raise RegistrationError(
                f"rule of {dist_type.__name__}: conjugate_powers names '{name}', which does not accept "
                f"'{PowerGamma.kind}' in kinds="
            )
        try:
            out[name] = tuple(float(a) for a in powers)
        except TypeError:
            raise RegistrationError(
                f"rule of {dist_type.__name__}: conjugate_powers['{name}'] must be a tuple of numbers, not {powers!r}"
            ) from None
    return out


def _checked_conjugate(conjugate, names: tuple) -> tuple | None:
    """The argument names ``conjugate=`` declares (``True``: all of ``names``), or None when
    it is neither a bool nor a collection of them."""
    if conjugate is True or conjugate is False:
        return names if conjugate else ()
    if isinstance(conjugate, str):
        return None
    try:
        linear = tuple(conjugate)
    except TypeError:
        return None
    return linear if set(linear) <= set(names) else None


def _check_signature(dist_type, fn, arg_names) -> None:
    """A rule is called ``fn(value, **args)``."""
    if not callable(fn):
        raise RegistrationError(f"rule of {dist_type.__name__}: register_rule decorates a function, not {fn!r}")
    try:
        inspect.signature(fn).bind(None, **{a: None for a in arg_names})
    except TypeError as exc:
        raise RegistrationError(
            f"rule of {dist_type.__name__}: {fn.__qualname__} must take (value, {', '.join(arg_names)}) ({exc})"
        ) from None
    except ValueError:  # (a callable without a signature: not checked)
        pass


def unregister_rule(dist_type: type, given: tuple = ()) -> Rule:
    """Remove the rule of ``dist_type`` (of its parameterisation built from ``given``) and
    return it; raises :class:`blrppl.errors.RegistrationError` when there is none."""
    key = (dist_type, tuple(given)) if given else dist_type
    if key not in _RULES:
        raise RegistrationError(f"no rule is registered for {getattr(dist_type, '__name__', dist_type)!r}")
    return _RULES.pop(key)


def seal_builtin_rules() -> None:
    """Record the rules registered so far as blrppl's own (called once, after they load)."""
    _BUILTIN.update(_RULES)


def user_rules() -> tuple:
    """``(key, rule)`` of every registration that differs from blrppl's own rules (a user's
    rule, or ``None`` for a built-in rule unregistered): what compiled fits depend on beyond
    blrppl's source."""
    keys = sorted(set(_RULES) | set(_BUILTIN), key=repr)
    return tuple((k, _RULES.get(k)) for k in keys if _RULES.get(k) is not _BUILTIN.get(k))


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
