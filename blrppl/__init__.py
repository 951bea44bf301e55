"""blrppl: Bayesian Learning Rule inference for NumPyro models.

Public names:

* :func:`blr_fit` — fit a model; returns a :class:`BLRResult`.
* :class:`BLRResult` — posteriors per site, draws, summary, ELBO trace, plan, and a
  guide with its params for ``Predictive``.
* :class:`BLR` — a drop-in for ``numpyro.infer.SVI`` (``init``/``update``/``run``/
  ``evaluate``/``get_params``), with the model's own autoguide or the guide BLR chooses.
* :mod:`blrppl.families` — the candidate exponential families.
* :func:`register_rule` / :func:`register_family` (and their ``unregister_``) — a user's
  closed-form rule for a distribution, a user's family (docs/extending.md).
* the :class:`BLRError` hierarchy.
"""

import os as _os

# XLA's CPU scheduler that runs independent operations concurrently can leave a compiled
# program waiting forever with every thread idle (a probabilistic PCA fit hung in 5 of 6
# runs on this project's CI machine, 0 of 13 without it). The option is read when JAX
# creates its CPU client: set here, before any computation, unless the user chose it (a
# warning when JAX has computed already: too late).
def _turn_off_concurrent_scheduler() -> None:
    flag = "xla_cpu_enable_concurrency_optimized_scheduler"
    if flag in _os.environ.get("XLA_FLAGS", ""):
        return
    try:
        from jax._src import xla_bridge

        late = xla_bridge.backends_are_initialized()
    except Exception:  # pragma: no cover - a JAX without this private helper
        late = False
    if late:
        import warnings

        warnings.warn(
            f"blrppl: JAX computed before blrppl was imported, so XLA's {flag} stays on; compiled fits "
            f"can hang with it (seen on factor models). Import blrppl first, or set XLA_FLAGS=--{flag}=false",
            UserWarning,
            stacklevel=3,
        )
        return
    _os.environ["XLA_FLAGS"] = (_os.environ.get("XLA_FLAGS", "") + f" --{flag}=false").strip()


_turn_off_concurrent_scheduler()

# jaxlib's batched LAPACK kernels can wait forever on the thread pool they run on: run
# large batches in chunks on the calling thread instead (see blrppl._lapack)
from blrppl import _lapack  # noqa: E402

_lapack.install()

from blrppl import families  # noqa: E402
from blrppl.api import blr_fit
from blrppl.errors import (
    BLRError,
    FamilyError,
    InitValueError,
    MissingDependencyError,
    ModelTraceError,
    ObservedDataError,
    OnlinePriorError,
    RegistrationError,
    ResourceError,
    UnsupportedFactorError,
    UnsupportedGuideError,
    UnsupportedLatentError,
)
from blrppl.families import register_family, unregister_family
from blrppl.posterior.result import BLRResult
from blrppl.rules import register_rule, unregister_rule
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
    "RegistrationError",
    "ResourceError",
    "UnsupportedFactorError",
    "UnsupportedGuideError",
    "UnsupportedLatentError",
    "blr_fit",
    "families",
    "register_family",
    "register_rule",
    "unregister_family",
    "unregister_rule",
]
