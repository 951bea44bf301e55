"""Stand-ins for numpyro distributions whose ``log_prob`` overflows, or which a traced
program cannot carry.

A fit evaluates a factor's log-density wherever q puts mass, often far from the data at the
start (Σ = I on an unconstrained scale). numpyro's truncated Normals normalise by a difference
of CDFs, which is 0 in float arithmetic once the truncation point lies some 13 (float32) to 38
(float64) sds beyond the location: ``TruncatedNormal(20., 0.05, high=2.).log_prob(1.)`` is
``+inf``, and a fit whose first step meets one stops with no valid step. The stand-ins here
compute the same density with the log-normaliser from ``log_ndtr`` (stable in both tails):

    log p(x) = log N(x; μ, σ) − log(Φ(β) − Φ(α)),   α = (low − μ)/σ, β = (high − μ)/σ,

with log(1 − Φ(α)) = log Φ(−α), and for two sides the difference taken in the tail where both
CDFs are smallest (log Φ(β) + log(1 − exp(log Φ(α) − log Φ(β))), reflected when α > 0).

numpyro's ``Multinomial`` (probs or logits) and ``DirichletMultinomial`` keep ``total_count``
as a static (pytree metadata) field. Per-row totals (``Multinomial(counts.sum(-1), p)``) make
it an array, computed from the data, which the traced model program cannot hold as metadata
(JAX saw a tracer leak out of it, or arrays compared as metadata). Their stand-ins are the
same distributions with ``total_count`` a pytree leaf (:func:`counts_as_data`).

:class:`Stabilise` is the effect handler that swaps them in at every sample site (inside
``Independent``, ``Masked`` and ``Expanded`` wrappers), for every run of the model a fit makes.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpyro.distributions as dist
from jax.scipy.special import log_ndtr
from numpyro.primitives import Messenger


def _log1mexp(x):
    """log(1 − eˣ) for x ≤ 0, accurate near 0 and for large −x (Mächler 2012)."""
    return jnp.where(x > -0.6931471805599453, jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def _standardised(base, bound):
    return (bound - base.loc) / base.scale


class LeftTruncatedNormal(dist.LeftTruncatedDistribution):
    """A Normal truncated below ``low``: log-normaliser log Φ(−α)."""

    def log_prob(self, value):
        return self.base_dist.log_prob(value) - log_ndtr(-_standardised(self.base_dist, self.low))


class RightTruncatedNormal(dist.RightTruncatedDistribution):
    """A Normal truncated above ``high``: log-normaliser log Φ(β)."""

    def log_prob(self, value):
        return self.base_dist.log_prob(value) - log_ndtr(_standardised(self.base_dist, self.high))


class TwoSidedTruncatedNormal(dist.TwoSidedTruncatedDistribution):
    """A Normal truncated to [low, high]: log(Φ(β) − Φ(α)) in the lower tail, or, reflected,
    log(Φ(−α) − Φ(−β)) when α > 0."""

    def log_prob(self, value):
        a = _standardised(self.base_dist, self.low)
        b = _standardised(self.base_dist, self.high)
        upper = a > 0  # both bounds above the location: reflect
        hi = jnp.where(upper, log_ndtr(-a), log_ndtr(b))
        lo = jnp.where(upper, log_ndtr(-b), log_ndtr(a))
        return self.base_dist.log_prob(value) - (hi + _log1mexp(lo - hi))


def rewrapped(fn, leaf, drop_masks: bool = False):
    """``fn`` with its innermost distribution (under ``Independent``, ``Masked`` and
    ``Expanded`` wrappers) replaced by ``leaf(innermost)``, the wrappers rebuilt around it
    (``Masked`` ones left out with ``drop_masks``); ``fn`` itself when nothing changed."""
    if isinstance(fn, dist.MaskedDistribution):
        inner = rewrapped(fn.base_dist, leaf, drop_masks)
        if drop_masks:
            return inner
        return fn if inner is fn.base_dist else dist.MaskedDistribution(inner, fn._mask)
    if isinstance(fn, dist.Independent):
        inner = rewrapped(fn.base_dist, leaf, drop_masks)
        return fn if inner is fn.base_dist else dist.Independent(inner, fn.reinterpreted_batch_ndims)
    if isinstance(fn, dist.ExpandedDistribution):
        inner = rewrapped(fn.base_dist, leaf, drop_masks)
        return fn if inner is fn.base_dist else inner.expand(fn.batch_shape)
    return leaf(fn)


def _with_total_count_as_data(base: type) -> type:
    """A subclass of ``base`` (same name) whose pytree holds ``total_count`` as a leaf."""

    def data_fields(cls):
        return tuple(base.gather_pytree_data_fields.__func__(cls)) + ("total_count",)

    def aux_fields(cls):
        return tuple(f for f in base.gather_pytree_aux_fields.__func__(cls) if f != "total_count")

    # (named as numpyro's class, for describe(); found by pickle under its qualified name)
    qualname = f"{base.__name__}WithCountsAsData"
    stand_in = type(base.__name__, (base,), {
        "__module__": __name__,
        "__qualname__": qualname,
        "__doc__": f"numpyro's ``{base.__name__}`` with ``total_count`` a pytree leaf (see the module docstring).",
        "gather_pytree_data_fields": classmethod(data_fields),
        "gather_pytree_aux_fields": classmethod(aux_fields),
    })
    globals()[qualname] = stand_in
    return stand_in


#: numpyro's distributions with a static ``total_count`` → their stand-ins
_COUNTS_AS_DATA = {
    base: _with_total_count_as_data(base)
    for base in (dist.MultinomialProbs, dist.MultinomialLogits, dist.DirichletMultinomial)
}


def counts_as_data(fn):
    """``fn`` (a leaf distribution) with its ``total_count`` moved into its pytree's leaves
    (the same distribution: only how it flattens differs); anything else unchanged."""
    stand_in = _COUNTS_AS_DATA.get(type(fn))
    if stand_in is None:
        return fn
    out = stand_in.__new__(stand_in)
    out.__dict__.update(fn.__dict__)
    return out


def _stable_leaf(fn):
    fn = counts_as_data(fn)
    if type(fn.base_dist if hasattr(fn, "base_dist") else None) is not dist.Normal:
        return fn
    if type(fn) is dist.LeftTruncatedDistribution:
        return LeftTruncatedNormal(fn.base_dist, low=fn.low, validate_args=False)
    if type(fn) is dist.RightTruncatedDistribution:
        return RightTruncatedNormal(fn.base_dist, high=fn.high, validate_args=False)
    if type(fn) is dist.TwoSidedTruncatedDistribution:
        return TwoSidedTruncatedNormal(fn.base_dist, low=fn.low, high=fn.high, validate_args=False)
    return fn


def stabilise(fn):
    """``fn`` with a truncated Normal (at any depth of ``Independent``, ``Masked`` and
    ``Expanded`` wrappers) replaced by its stable stand-in; anything else unchanged."""
    return rewrapped(fn, _stable_leaf)


class Stabilise(Messenger):
    """Effect handler: every sample site's distribution through :func:`stabilise`."""

    def process_message(self, msg):
        if msg["type"] == "sample":
            msg["fn"] = stabilise(msg["fn"])
