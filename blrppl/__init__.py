"""blrppl: Bayesian Learning Rule inference for NumPyro models."""

from blrppl.errors import (
    BLRError,
    FamilyError,
    ModelTraceError,
    ObservedDataError,
    UnsupportedFactorError,
    UnsupportedLatentError,
)

__all__ = [
    "BLRError",
    "FamilyError",
    "ModelTraceError",
    "ObservedDataError",
    "UnsupportedFactorError",
    "UnsupportedLatentError",
]
