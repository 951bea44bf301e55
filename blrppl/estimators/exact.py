"""The exact estimator: closed-form expected log-densities from the rules registry.

For a factor f with rule R, L = E_q[log f] = Σ_elements R(moments of its arguments), with
the distribution's wrappers applied as ``log_prob`` applies them (reinterpreted event dims
summed, masked elements dropped, expansion) and the site's scale. Factors touching discrete
blocks are enumerated (:mod:`blrppl.estimators.enumeration`).
"""

from __future__ import annotations

import jax.numpy as jnp

from blrppl.graph.trace import reduce_wrapped


def elementwise_expected_log_prob(factor, moments: dict, fn):
    """L per batch element of the factor's (wrapped) distribution ``fn``."""
    moments = dict(moments)
    value = moments.pop("value")
    return reduce_wrapped(fn, factor.rule.expected_log_prob(value, **moments))


def reduce_factor(elementwise, scale):
    """Σ over elements of ``elementwise`` times the site's scale."""
    if scale is not None:
        elementwise = scale * elementwise
    return jnp.sum(elementwise)
