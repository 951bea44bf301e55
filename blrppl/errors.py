"""Errors raised by blrppl.

Every error derives from :class:`BLRError` and names the site it is about, so that a
user can find the line of the model to change.
"""

from __future__ import annotations

import contextlib


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


class RegistrationError(BLRError):
    """A rule or a family registered from outside blrppl (:func:`blrppl.register_rule`,
    :func:`blrppl.register_family`) is malformed: an unknown moment kind, an argument the
    distribution does not have, a family missing a method the fit calls, a name taken."""


class ResourceError(BLRError):
    """A program compiled for the model needs more memory than the machine has (XLA could
    not allocate its arrays): the model's log density evaluated at many values at once, or
    data too large for one step."""


class OptimizerSettingError(BLRError):
    """A setting of :func:`blrppl.optim.ivon` is out of range or of the wrong type, or the
    optimiser's functions got arguments that do not fit each other (a gradient of another
    shape than its parameter, a state that holds no IVON state)."""


class MeshError(BLRError):
    """``mesh=`` of a fit is not one blrppl can shard over: not a ``jax.sharding.Mesh`` of one
    axis nor a device count, more devices than there are, or a model without a plate to
    shard its data along."""


class HostRowsError(ObservedDataError):
    """A :class:`blrppl.HostRows` array (data read from the host a minibatch at a time) used
    in a way that needs all its values, indexed with something else than a minibatch's
    indices, or built from something that has no rows."""


class MinibatchError(ObservedDataError):
    """A :class:`blrppl.Minibatches` iterable whose batches a fit cannot read: a batch of
    another structure, shape or dtype than the first, an iterable that yields nothing, or a
    model or option the minibatches of an iterator do not combine with."""


class TransformationError(BLRError):
    """A fit was called under a JAX transformation (``jax.jit``, ``jax.vmap``, ``jax.grad``,
    ``lax.scan``, ...): a fit traces and compiles the model itself, on concrete data."""


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is XLA's out-of-memory error (``RESOURCE_EXHAUSTED``: a JAX runtime
    error, whose class name depends on the jaxlib version)."""
    return "RESOURCE_EXHAUSTED" in str(exc) and type(exc).__name__.endswith("RuntimeError")


def out_of_memory_detail(exc: BaseException) -> str:
    """XLA's own words on what it could not allocate (its first line, without the code)."""
    line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return line.replace("RESOURCE_EXHAUSTED: ", "").strip()


@contextlib.contextmanager
def out_of_memory_as_error(what: str):
    """Turn XLA's out-of-memory error inside the block into a :class:`ResourceError` saying
    what ran out (``what``: e.g. "the fit")."""
    try:
        yield
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        raise ResourceError(
            f"{what} needs more memory than this machine has ({out_of_memory_detail(exc)}): a step evaluates "
            "the model's log density at many values at once (Monte Carlo draws, quadrature nodes, enumerated "
            "values); fewer elements per fit (a subsampled plate: numpyro.plate(..., subsample_size=M)) or a "
            "distribution with smaller intermediates needs less"
        ) from None
