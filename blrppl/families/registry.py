"""The families ``families=`` can name: blrppl's own and those a user registers.

:data:`FAMILIES` maps a name to a family class; :func:`register_family` adds a user's
family (a subclass of :class:`blrppl.families.Family`, see docs/extending.md), checking
that it holds what the fit reads of a family, and :func:`unregister_family` removes it.
The compiler reads a family only through its class flags and methods, never through its
name, so a registered family is used wherever its flags say it fits.
"""

from __future__ import annotations

import dataclasses
import math

from blrppl.errors import RegistrationError
from blrppl.families.base import Family
from blrppl.moments import KINDS

#: family name → family class (see :mod:`blrppl.families`)
FAMILIES: dict[str, type[Family]] = {}
#: blrppl's own families (:func:`seal_builtin_families`)
_BUILTIN: dict[str, type[Family]] = {}

#: the supports a family may declare (:attr:`Family.support`)
SUPPORTS = ("real", "positive", "unit_interval", "simplex", "positive_definite", "discrete")

#: the methods of :class:`Family` every registered family overrides
REQUIRED = (
    "initial_nat", "view", "nat_from_view", "mean_params", "nat_from_mean", "log_partition", "sufficient_stats",
    "message_from_view_grad", "is_valid", "sample", "to_numpyro",
)
#: the further methods a continuous family overrides (probe points, the moments of arguments)
REQUIRED_CONTINUOUS = ("linearisation_point", "tangent_sets")
#: the further methods a Gaussian family overrides (Newton steps, Monte Carlo curvatures)
REQUIRED_GAUSSIAN = (
    "view_covariance", "marginal_variance", "curvature_of_hessian", "precision_times", "solve_precision",
    "identity_precision", "positive_curvature",
)

#: names that are options of ``families=``, not families
RESERVED = ("grid", "gaussian-mixture")


def register_family(cls_or_instance, name: str | None = None) -> type[Family]:
    """Make a family available to ``families={site: name}`` of ``blr_fit`` and ``BLR``.

    Args:
        cls_or_instance: a frozen-dataclass subclass of :class:`Family` (or an instance of
            one: its class is registered; a block's configuration comes from
            :meth:`Family.for_value`).
        name: the name ``families=`` uses; by default the class's ``name``. Another name
            registers a subclass whose ``name`` it is (plan tables show it).

    Returns:
        The registered class (so that ``@register_family`` decorates a class).

    Raises:
        RegistrationError: the class is not a frozen Family dataclass, leaves a method the fit
            calls unimplemented, declares an unknown support or argument kind, declares itself
            ``native`` (the defaults stay blrppl's), or the name is taken.
    """
    cls = cls_or_instance if isinstance(cls_or_instance, type) else type(cls_or_instance)
    if not issubclass(cls, Family):
        raise RegistrationError(f"a family is a subclass of blrppl.families.Family, not {cls_or_instance!r}")
    name = cls.name if name is None else name
    if not isinstance(name, str) or not name or name == Family.name or name in RESERVED:
        raise RegistrationError(
            f"family {cls.__name__}: give it a name (class attribute name or name=), not {name!r}"
        )
    if name != cls.name:
        renamed = type(cls.__name__, (cls,), {"name": name, "__module__": cls.__module__})
        cls = dataclasses.dataclass(frozen=True)(renamed)
    _check_family(cls)
    if name in FAMILIES and FAMILIES[name] is not cls:
        raise RegistrationError(
            f"the family name '{name}' is taken by {FAMILIES[name].__qualname__}; pick another name "
            "(or unregister_family it first)"
        )
    FAMILIES[name] = cls
    return cls


def _check_family(cls) -> None:
    where = f"family '{cls.name}' ({cls.__qualname__})"
    params = getattr(cls, "__dataclass_params__", None)
    if not dataclasses.is_dataclass(cls) or params is None or not params.frozen:
        raise RegistrationError(f"{where} must be a frozen dataclass (@dataclasses.dataclass(frozen=True)): hashable")
    if cls.support not in SUPPORTS:
        raise RegistrationError(f"{where}: support {cls.support!r} is not one of {list(SUPPORTS)}")
    if cls.native:
        raise RegistrationError(
            f"{where} declares native = True: a registered family is used where families= names it, "
            "the default family of each support stays blrppl's"
        )
    if cls.argument_kind is not None and cls.argument_kind not in KINDS:
        raise RegistrationError(f"{where}: argument_kind {cls.argument_kind!r} is not one of {list(KINDS)}")
    power = cls.argument_power
    if not isinstance(power, (int, float)) or not math.isfinite(power) or power == 0:
        raise RegistrationError(f"{where}: argument_power must be a finite non-zero number, not {power!r}")
    if power != 1 and not (cls.any_power and cls.argument_kind is not None):
        raise RegistrationError(
            f"{where}: argument_power {power:g} needs argument_kind moments of any power (any_power = True)"
        )
    required = REQUIRED + (() if cls.discrete else REQUIRED_CONTINUOUS) + (REQUIRED_GAUSSIAN if cls.gaussian else ())
    missing = [m for m in required if getattr(cls, m, None) is getattr(Family, m)]
    if missing:
        raise RegistrationError(f"{where} does not implement {', '.join(missing)}")


def unregister_family(name: str) -> type[Family]:
    """Remove a family registered under ``name`` and return its class (blrppl's own
    families cannot be removed)."""
    if name not in FAMILIES:
        raise RegistrationError(f"no family is registered as '{name}'; families: {sorted(FAMILIES)}")
    if _BUILTIN.get(name) is FAMILIES[name]:
        raise RegistrationError(f"'{name}' is one of blrppl's own families; it cannot be unregistered")
    return FAMILIES.pop(name)


def seal_builtin_families() -> None:
    """Record the families registered so far as blrppl's own (called once, after they load)."""
    _BUILTIN.update(FAMILIES)


def user_families() -> tuple:
    """``(name, class)`` of every family registered from outside blrppl."""
    return tuple((n, c) for n, c in sorted(FAMILIES.items()) if _BUILTIN.get(n) is not c)
