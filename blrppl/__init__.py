"""blrppl: Bayesian Learning Rule inference for NumPyro models.

Public names:

* :func:`blr_fit` — fit a model; returns a :class:`BLRResult`.
* :func:`blr_kernel` — the rule as a kernel (:class:`BLRKernel`: ``init``, ``step``, and
  the ``plan`` and :class:`KernelData` they were built from) a user's own ``jax.lax.scan``
  steps, with its :class:`BLRState` and :class:`BLRInfo`; the pure start
  ``blrppl.engine.kernel.init(plan, data, key)``.
* :class:`BLRResult` — posteriors per site, draws, summary, ELBO trace, plan, and a
  guide with its params for ``Predictive``.
* :class:`BLR` — a drop-in for ``numpyro.infer.SVI`` (``init``/``update``/``run``/
  ``evaluate``/``get_params``), with the model's own autoguide or the guide BLR chooses.
* :mod:`blrppl.families` — the candidate exponential families.
* :func:`register_rule` / :func:`register_family` (and their ``unregister_``) — a user's
  closed-form rule for a distribution, a user's family (docs/extending.md).
* :func:`enable_compilation_cache` — turn on JAX's persistent compilation cache (never
  done on import: importing blrppl changes nothing in JAX's configuration, ``$XLA_FLAGS``
  or JAX's lowering rules; docs/runtime.md).
* :mod:`blrppl.optim` — Bayesian deep learning without a NumPyro model: the IVON optimiser,
  optax-shaped (docs/deep-learning.md). Loaded on first use, ``blrppl.optim`` or
  ``import blrppl.optim``: ``import blrppl`` does not import optax.
* :class:`HostRows` — a subsampled plate's data read from the host (a ``numpy.memmap``) a
  minibatch at a time (docs/scaling.md).
* :class:`Minibatches` — a subsampled plate's data as an iterable of minibatches (a generator,
  a DataLoader), each read ahead on a host thread (docs/scaling.md).
* the :class:`BLRError` hierarchy.
"""

import importlib

from blrppl import families
from blrppl.api import blr_fit, blr_kernel
from blrppl.engine.kernel import BLRKernel, KernelData
from blrppl.engine.state import BLRInfo, BLRState
from blrppl.errors import (
    BLRError,
    FamilyError,
    InitValueError,
    MeshError,
    HostRowsError,
    MinibatchError,
    MissingDependencyError,
    ModelTraceError,
    ObservedDataError,
    OnlinePriorError,
    OptimizerSettingError,
    RegistrationError,
    ResourceError,
    TransformationError,
    UnsupportedFactorError,
    UnsupportedGuideError,
    UnsupportedLatentError,
)
from blrppl.families import register_family, unregister_family
from blrppl.graph.host_rows import HostRows
from blrppl.graph.minibatches import Minibatches
from blrppl.posterior.result import BLRResult
from blrppl.rules import register_rule, unregister_rule
from blrppl.svi import BLR, BLRRunResult
from blrppl.runtime.cache import enable_compilation_cache

__all__ = [
    "BLR",
    "BLRError",
    "BLRInfo",
    "BLRKernel",
    "BLRResult",
    "BLRRunResult",
    "BLRState",
    "FamilyError",
    "InitValueError",
    "KernelData",
    "MeshError",
    "HostRowsError",
    "HostRows",
    "MinibatchError",
    "Minibatches",
    "MissingDependencyError",
    "ModelTraceError",
    "ObservedDataError",
    "OnlinePriorError",
    "OptimizerSettingError",
    "RegistrationError",
    "ResourceError",
    "TransformationError",
    "UnsupportedFactorError",
    "UnsupportedGuideError",
    "UnsupportedLatentError",
    "blr_fit",
    "blr_kernel",
    "enable_compilation_cache",
    "families",
    "optim",
    "register_family",
    "register_rule",
    "unregister_family",
    "unregister_rule",
]


def __getattr__(name):
    """``blrppl.optim`` on first use (PEP 562): it imports optax, which the rest of blrppl does not need."""
    if name == "optim":
        return importlib.import_module("blrppl.optim")
    raise AttributeError(f"module 'blrppl' has no attribute {name!r}")
