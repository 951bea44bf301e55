"""blrppl: Bayesian Learning Rule inference for NumPyro models.

Public names:

* :func:`blr_fit` — fit a model; returns a :class:`BLRResult`.
* :class:`BLRResult` — posteriors per site, draws, summary, ELBO trace, plan.
* :mod:`blrppl.families` — the candidate exponential families.
* the :class:`BLRError` hierarchy.
"""

from blrppl import families
from blrppl.api import blr_fit
from blrppl.errors import (
    BLRError,
    FamilyError,
    MissingDependencyError,
    ModelTraceError,
    ObservedDataError,
    OnlinePriorError,
    UnsupportedFactorError,
    UnsupportedLatentError,
)
from blrppl.result import BLRResult

__all__ = [
    "BLRError",
    "BLRResult",
    "FamilyError",
    "MissingDependencyError",
    "ModelTraceError",
    "ObservedDataError",
    "OnlinePriorError",
    "UnsupportedFactorError",
    "UnsupportedLatentError",
    "blr_fit",
    "families",
]
