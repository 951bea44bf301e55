"""Errors raised by blrppl.

Every error derives from :class:`BLRError` and names the site it is about, so that a
user can find the line of the model to change.
"""

from __future__ import annotations


class BLRError(Exception):
    """Base class of every error raised by blrppl.

    Args:
        message: what went wrong and how to fix it.
        site: name of the model site the error is about, if any.
    """

    def __init__(self, message: str, site: str | None = None):
        self.site = site
        if site is not None and f"'{site}'" not in message:
            message = f"site '{site}': {message}"
        super().__init__(message)


class ModelTraceError(BLRError):
    """The model could not be run with the data given (it raised, or returned bad values)."""


class UnsupportedLatentError(BLRError):
    """A latent site has a support no candidate family covers (e.g. unbounded discrete)."""


class ObservedDataError(BLRError):
    """Observed data are non-finite or do not have the shape the model expects."""


class FamilyError(BLRError):
    """A requested family (override) cannot represent the site's support or shape."""


class UnsupportedFactorError(BLRError):
    """No available estimator can compute the expected log-density of a factor."""


class UnsupportedGuideError(BLRError):
    """A guide BLR cannot fit (a custom guide, or an autoguide family it does not have)."""


class OnlinePriorError(BLRError):
    """``prior=`` cannot be used: it is not a previous fit, or a site's previous posterior
    does not fit the site's block in the new fit (family, shape, grouping)."""


class InitValueError(BLRError):
    """A starting value given for a site (``init_params=``) does not fit it: not a finite
    number, another shape, or outside the site's support."""


class MissingDependencyError(BLRError):
    """An optional dependency a feature needs is not installed."""
