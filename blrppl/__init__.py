"""blrppl: Bayesian Learning Rule inference for NumPyro models.

Public names:

* :func:`blr_fit` — fit a model; returns a :class:`BLRResult`.
* :class:`BLRResult` — posteriors per site, draws, summary, ELBO trace, plan, and a
  guide with its params for ``Predictive``.
* :class:`BLR` — a drop-in for ``numpyro.infer.SVI`` (``init``/``update``/``run``/
  ``evaluate``/``get_params``), with the model's own autoguide or the guide BLR chooses.
* :mod:`blrppl.families` — the candidate exponential families.
* the :class:`BLRError` hierarchy.
"""

from blrppl import families
from blrppl.api import blr_fit
from blrppl.errors import (
    BLRError,
    FamilyError,
    InitValueError,
    MissingDependencyError,
    ModelTraceError,
    ObservedDataError,
    OnlinePriorError,
    UnsupportedFactorError,
    UnsupportedGuideError,
    UnsupportedLatentError,
)
from blrppl.result import BLRResult
from blrppl.svi import BLR, BLRRunResult
from blrppl.graph.data import enable_compilation_cache as _enable_compilation_cache

#: JAX's persistent compilation cache, where blrppl keeps compiled fits across processes (None:
#: off, see blrppl.graph.data.enable_compilation_cache)
COMPILATION_CACHE = _enable_compilation_cache()

__all__ = [
    "BLR",
    "BLRError",
    "BLRResult",
    "BLRRunResult",
    "FamilyError",
    "InitValueError",
    "MissingDependencyError",
    "ModelTraceError",
    "ObservedDataError",
    "OnlinePriorError",
    "UnsupportedFactorError",
    "UnsupportedGuideError",
    "UnsupportedLatentError",
    "blr_fit",
    "families",
]
