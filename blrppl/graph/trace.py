"""Tracing a NumPyro model into site records.

The model is run once, with latent values taken from numpyro's initialisation strategies
(never by forward sampling a site that cannot be sampled, such as ``ImproperUniform``), and
every sample site is recorded with its distribution unwrapped: ``Independent`` becomes
reinterpreted event dims, ``ExpandedDistribution`` a broadcast, ``MaskedDistribution`` a
mask.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from numpyro import handlers
from numpyro.distributions import constraints
from numpyro.primitives import Messenger
from numpyro.infer.initialization import init_to_median

from blrppl.errors import ModelTraceError, ObservedDataError, UnsupportedLatentError


@dataclasses.dataclass(frozen=True)
class Plate:
    """A plate a site sits in: ``dim`` counts from the right of the batch dims."""

    name: str
    size: int
    dim: int
    subsample_size: int


@dataclasses.dataclass
class SiteRecord:
    """What the compiler needs to know about one sample site.

    Attributes:
        name: site name.
        observed: True for observed sites and ``numpyro.factor`` terms.
        is_factor: True for ``numpyro.factor`` terms (opaque log-density).
        base: the distribution with Independent/Expanded/Masked wrappers removed.
        reinterpreted_ndim: batch dims of ``base`` reinterpreted as event dims.
        has_mask: whether a mask wraps the distribution.
        value_shape: shape of the site value.
        event_ndim: event dims of the full (wrapped) distribution.
        support: the support constraint of the site.
        plates: plates the site is in, outermost first.
        has_scale: whether the site carries a ``scale`` (subsampling, ``handlers.scale``).
        infer: the site's ``infer`` dict.
        init_value: the value the trace used (data for observed sites).
    """

    name: str
    observed: bool
    is_factor: bool
    base: Any
    reinterpreted_ndim: int
    has_mask: bool
    value_shape: tuple
    event_ndim: int
    support: Any
    plates: tuple
    has_scale: bool
    infer: dict
    init_value: Any

    @property
    def dist_name(self) -> str:
        return type(self.base).__name__

    @property
    def batch_ndim(self) -> int:
        return len(self.value_shape) - self.event_ndim

    def plate_axes(self) -> tuple[int, ...]:
        """Positions, in the value shape, of the plate dims (outermost plate first)."""
        axes = []
        for plate in self.plates:
            axes.append(self.batch_ndim + plate.dim)
        return tuple(axes)


def unwrap(fn):
    """Remove Independent / Expanded / Masked wrappers.

    Returns:
        (base distribution, reinterpreted batch ndims, mask or None)
    """
    reinterpreted = 0
    mask = None
    while True:
        if isinstance(fn, dist.Independent):
            reinterpreted += fn.reinterpreted_batch_ndims
            fn = fn.base_dist
        elif isinstance(fn, dist.ExpandedDistribution):
            fn = fn.base_dist
        elif isinstance(fn, dist.MaskedDistribution):
            m = fn._mask
            if m is not True:
                mask = m if mask is None else jnp.logical_and(mask, m)
            fn = fn.base_dist
        else:
            return fn, reinterpreted, mask


def finite_support_values(support) -> np.ndarray | None:
    """The values of a finite discrete support, or None if it is unbounded."""
    if support is constraints.boolean:
        return np.arange(2)
    if isinstance(support, constraints._IntegerInterval):
        lo, hi = np.asarray(support.lower_bound), np.asarray(support.upper_bound)
        if lo.size and hi.size and np.all(lo == lo.flat[0]) and np.all(hi == hi.flat[0]):
            return np.arange(int(lo.flat[0]), int(hi.flat[0]) + 1)
    return None


def _split_data(args, kwargs):
    return args if args is not None else (), kwargs if kwargs is not None else {}


def trace_model(model, args=(), kwargs=None, rng_key=None, init_strategy=init_to_median):
    """Run ``model`` once and record its sample sites.

    Latent values come from ``init_strategy`` (numpyro's ``init_to_median`` by default,
    which falls back to ``init_to_uniform`` for sites that cannot be sampled); discrete
    latents are drawn from their prior.

    Returns:
        OrderedDict site name → :class:`SiteRecord`, in the order the model runs them.

    Raises:
        ModelTraceError: the model raised while running with the data given.
        ObservedDataError: observed values are non-finite.
        UnsupportedLatentError: a latent has unbounded discrete support.
    """
    args, kwargs = _split_data(args, kwargs)
    rng_key = jax.random.key(0) if rng_key is None else rng_key
    seeded = handlers.seed(model, rng_key)
    last = _LastSite(handlers.substitute(seeded, substitute_fn=init_strategy))
    try:
        tr = handlers.trace(last).get_trace(*args, **kwargs)
    except Exception as exc:  # any failure of the user's model
        where = (
            f"after site '{last.name}'" if last.name is not None else "before its first site"
        )
        raise ModelTraceError(
            f"the model could not be run with the data given: it raised {where} "
            f"({type(exc).__name__}: {exc}); check that `data` holds the model's arguments "
            "(a dict of keyword arguments or a tuple of positional ones)",
            site=last.name,
        ) from exc
    records: OrderedDict[str, SiteRecord] = OrderedDict()
    for name, site in tr.items():
        if site["type"] == "param":
            raise ModelTraceError(
                "numpyro.param sites are not fitted by blr_fit; declare the quantity with "
                "numpyro.sample and a prior instead",
                site=name,
            )
        if site["type"] != "sample":
            continue
        fn = site["fn"]
        base, reinterpreted, mask = unwrap(fn)
        observed = bool(site["is_observed"])
        is_factor = isinstance(base, dist.Unit)
        value = site["value"]
        if observed and not is_factor:
            arr = np.asarray(value)
            if np.issubdtype(arr.dtype, np.number) and not np.all(np.isfinite(arr)):
                bad = int(np.size(arr) - np.isfinite(arr).sum())
                raise ObservedDataError(
                    f"{bad} observed value(s) are NaN or infinite; drop them or mask them "
                    "with numpyro.handlers.mask / obs_mask",
                    site=name,
                )
        if not observed and fn.support.is_discrete and finite_support_values(fn.support) is None:
            raise UnsupportedLatentError(
                f"latent {type(base).__name__} has unbounded discrete support ({fn.support}); "
                "only finite discrete latents (Bernoulli, Categorical, bounded integers) can be "
                "enumerated: marginalise it out by hand or give it a bounded support",
                site=name,
            )
        plates = tuple(
            Plate(f.name, int(f.size), int(f.dim), int(f.size))
            for f in reversed(site["cond_indep_stack"])
        )
        records[name] = SiteRecord(
            name=name,
            observed=observed,
            is_factor=is_factor,
            base=base,
            reinterpreted_ndim=reinterpreted,
            has_mask=mask is not None,
            value_shape=tuple(jnp.shape(value)),
            event_ndim=fn.event_dim,
            support=fn.support,
            plates=plates,
            has_scale=site.get("scale") is not None,
            infer=dict(site.get("infer") or {}),
            init_value=value,
        )
    if not any(not r.observed for r in records.values()):
        raise ModelTraceError("the model has no latent sample site to infer")
    return records


class _LastSite(Messenger):
    """Remembers the name of the last site the model reached."""

    def __init__(self, fn=None):
        super().__init__(fn)
        self.name = None

    def process_message(self, msg):
        if msg.get("name") is not None:
            self.name = msg["name"]
