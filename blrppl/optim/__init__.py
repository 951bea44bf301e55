"""Bayesian deep learning by the Bayesian learning rule: optax-shaped optimisers whose
parameters are the mean of a Gaussian posterior (docs/deep-learning.md).

Public names:

* :func:`ivon` — the IVON optimiser (Shen et al. 2024): an ``optax`` gradient
  transformation fitting a diagonal Gaussian posterior, with its :class:`IVONState`.
* :func:`sample_parameters` — a step's weight samples and their noise, which ``update``
  takes with the gradients there; :func:`value_and_grad` draws them and takes the gradients;
  :func:`standard_noise` — their standard normal draws (one call per dtype, not per leaf).
* :func:`predictive` — the network's outputs at draws from the posterior (their mean is
  the Bayesian model average); :func:`posterior_stddev` — the posterior's spread.
* :class:`OptimizerSettingError` — a setting out of range (a :class:`blrppl.BLRError`).

This package imports optax; ``import blrppl`` does not import it (``blrppl.optim`` is
loaded on first use).
"""

from blrppl.optim.ivon import IVONState, ivon
from blrppl.optim.sampling import (
    find_state,
    posterior_stddev,
    predictive,
    sample_parameters,
    standard_noise,
    value_and_grad,
)
from blrppl.optim.settings import OptimizerSettingError, PosteriorSettings

__all__ = [
    "IVONState",
    "OptimizerSettingError",
    "PosteriorSettings",
    "find_state",
    "ivon",
    "posterior_stddev",
    "predictive",
    "sample_parameters",
    "standard_noise",
    "value_and_grad",
]
