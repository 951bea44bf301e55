"""The exact estimator: closed-form expected log-densities from the rules registry.

For a factor f with rule R, L = E_q[log f] = Σ_elements R(moments of its arguments),
with the distribution's reinterpreted event dims summed, masked elements dropped and the
site's scale applied. Factors touching discrete blocks are enumerated
(:mod:`blrppl.estimators.enumeration`).
"""

from __future__ import annotations

import jax.numpy as jnp


def elementwise_expected_log_prob(factor, moments: dict):
    """L per batch element of the factor (event and reinterpreted dims summed)."""
    moments = dict(moments)
    value = moments.pop("value")
    out = factor.rule.expected_log_prob(value, **moments)
    if factor.reinterpreted_ndim:
        out = out.sum(axis=tuple(range(-factor.reinterpreted_ndim, 0)))
    return out


def reduce_factor(elementwise, mask, scale):
    """Σ over elements of ``elementwise`` with the site's mask and scale."""
    if mask is not None:
        elementwise = jnp.where(mask, elementwise, 0.0)
    if scale is not None:
        elementwise = scale * elementwise
    return jnp.sum(elementwise)
