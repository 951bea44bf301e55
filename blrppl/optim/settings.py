"""The settings of the IVON optimiser, checked where the user passes them.

Every setting is checked when :func:`blrppl.optim.ivon` is called, not at the first step:
a bad one raises :class:`OptimizerSettingError` naming the setting and the range it must
lie in. The settings the posterior's weight samples need (the effective sample size, the
weight decay, the number of samples per step) travel in the optimiser's state as
:class:`PosteriorSettings`, a pytree without leaves: a jitted step sees them as static.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from blrppl.errors import OptimizerSettingError
from blrppl.inputs import check_schedule

#: the weight decay δ when neither ``weight_decay`` nor ``prior_precision`` is given
DEFAULT_WEIGHT_DECAY = 1e-4


@dataclasses.dataclass(frozen=True)
class PosteriorSettings:
    """What the Gaussian posterior q(θ) = N(m, diag(σ²)) is made of besides its mean and its
    Hessian estimate: σ² = 1 / (ess · (h + weight_decay)).

    Attributes:
        ess: the effective sample size λ (the number of training examples, for a loss that
            is the mean over them).
        weight_decay: δ, the prior precision divided by ``ess``.
        mc_samples: weight samples drawn per step.
    """

    ess: float
    weight_decay: float
    mc_samples: int


# a pytree without leaves, itself its static data (jax.tree_util.register_static, spelled out
# for the jax versions before it)
jax.tree_util.register_pytree_node(PosteriorSettings, lambda s: ((), s), lambda s, _: s)


#: the settings that may be traced values (optax.inject_hyperparams passes its numbers so
#: into a jitted update; they are not checked then, having been checked at ``init``): those
#: the update reads as numbers, not the static settings of the state
TRACEABLE = ("learning_rate", "hess_init", "beta1", "beta2", "clip_radius")


def _concrete(value, name: str) -> None:
    """Refuse a traced static setting (ess, weight decay, samples per step)."""
    if isinstance(value, jax.core.Tracer):
        raise OptimizerSettingError(
            f"ivon's {name} must be a concrete number, not a traced value (it is static: the posterior's "
            f"samples are drawn with it); with optax.inject_hyperparams, list '{name}' in its static_args"
        )


def traced(value, name: str) -> bool:
    """Whether ``value`` is a traced value of a setting that may be one (left unchecked)."""
    return name in TRACEABLE and isinstance(value, jax.core.Tracer)


def _real(value, name: str) -> float:
    """A finite real number from a Python, NumPy or 0-d JAX scalar."""
    _concrete(value, name)
    if isinstance(value, (bool, np.bool_, str)) or callable(value):
        raise OptimizerSettingError(f"ivon's {name} must be a number, not {type(value).__name__} {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise OptimizerSettingError(
            f"ivon's {name} must be a number, not {type(value).__name__} {value!r}"
        ) from None
    if not math.isfinite(number):
        raise OptimizerSettingError(f"ivon's {name} must be finite, not {number}")
    return number


def positive(value, name: str):
    """``value`` as a float, checked finite and > 0 (a traced :data:`TRACEABLE` one as it is)."""
    if traced(value, name):
        return value
    number = _real(value, name)
    if number <= 0.0:
        raise OptimizerSettingError(f"ivon's {name} must be > 0, not {number}")
    return number


def non_negative(value, name: str) -> float:
    """``value`` as a float, checked finite and ≥ 0."""
    number = _real(value, name)
    if number < 0.0:
        raise OptimizerSettingError(f"ivon's {name} must be ≥ 0, not {number}")
    return number


def unit_interval(value, name: str):
    """``value`` as a float, checked in [0, 1) (a traced :data:`TRACEABLE` one as it is)."""
    if traced(value, name):
        return value
    number = _real(value, name)
    if not 0.0 <= number < 1.0:
        raise OptimizerSettingError(f"ivon's {name} must be in [0, 1), not {number}")
    return number


def sample_count(value, name: str) -> int:
    """``value`` as an int, checked ≥ 1 (``name`` as the message writes it: "ivon's mc_samples")."""
    _concrete(value, name.removeprefix("ivon's "))
    if isinstance(value, (np.ndarray, jax.Array)) and value.shape == () and jnp.issubdtype(value.dtype, jnp.integer):
        value = int(value)  # (optax.inject_hyperparams passes its numbers as arrays)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral, np.integer)):
        raise OptimizerSettingError(f"{name} must be an int ≥ 1, not {type(value).__name__} {value!r}")
    if int(value) < 1:
        raise OptimizerSettingError(f"{name} must be an int ≥ 1, not {int(value)}")
    return int(value)


def clip_radius(value) -> float:
    """The clip radius ξ: a number > 0, ``inf`` (no clipping) allowed."""
    if traced(value, "clip_radius"):
        return value
    if isinstance(value, (int, float, np.number, np.ndarray, jax.Array)) and not isinstance(value, (bool, np.bool_)):
        if jnp.shape(value) == () and float(value) == math.inf:
            return math.inf
    return positive(value, "clip_radius")


def learning_rate(value):
    """A learning rate: a number ≥ 0, or a schedule (a callable of the step count, as optax's
    schedules) whose value at step 0 is a finite number ≥ 0."""
    if callable(value):
        return check_schedule(value, "ivon's learning_rate(count)", OptimizerSettingError)
    if traced(value, "learning_rate"):
        return value
    return non_negative(value, "learning_rate")


def weight_decay(value, prior_precision, ess: float) -> float:
    """The weight decay δ from ``weight_decay`` or ``prior_precision`` (δ = prior precision /
    ess), at most one of them given; neither: :data:`DEFAULT_WEIGHT_DECAY`."""
    if value is not None and prior_precision is not None:
        raise OptimizerSettingError(
            "ivon takes weight_decay or prior_precision, not both: weight_decay is prior_precision / ess"
        )
    if prior_precision is not None:
        return non_negative(prior_precision, "prior_precision") / ess
    if value is None:
        return DEFAULT_WEIGHT_DECAY
    return non_negative(value, "weight_decay")
