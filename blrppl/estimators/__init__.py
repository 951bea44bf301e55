"""The estimators of the factors' expected log-densities (:mod:`blrppl.estimators.registry`).

Importing the package registers the built-in estimators (each module registers its own).
"""

from blrppl.estimators import delta, exact, monte_carlo, quadrature  # noqa: F401  (registers them)
from blrppl.estimators.registry import ESTIMATORS, Estimator, estimator_of, register_estimator

__all__ = ["ESTIMATORS", "Estimator", "estimator_of", "register_estimator"]
