"""Closed-form E_q[log GaussianRandomWalk(value | scale)]."""

from __future__ import annotations

import jax.numpy as jnp
import numpyro.distributions as dist

from blrppl.moments.kinds import slice_last
from blrppl.rules._common import LOG_2PI, broadcast_batch
from blrppl.rules.registry import register_rule


@register_rule(
    dist.GaussianRandomWalk,
    kinds={"value": ("const", "affine_gaussian"), "scale": ("const", "power_gamma", "exp_gaussian")},
    event_ndim=1,
    conjugate_powers={"scale": (-0.5,)},
    event_window=2,
    conjugate=True,
)
def gaussian_random_walk_expected_log_prob(value, scale):
    r"""E_q[log GRW(x | σ)] for a walk x ∈ R^T started at 0, summed over its steps.

    The walk's increments d = D x (d_0 = x_0, d_t = x_t − x_{t−1}) are independent
    N(0, σ²), so with m = E[x] and C = Cov[x] over the event dim,

    .. math::
        L = \sum_t \left[-\tfrac12 \log 2\pi - E[\log σ]
            - \tfrac12 E[σ^{-2}] \left((Dm)_t^2 + (D C D^\top)_{tt}\right)\right],

    (D C Dᵀ)_tt = C_tt + C_{t−1,t−1} − 2 C_{t,t−1} (the variance of each increment, read
    elementwise: the rule's ``event_window`` is 2): a quadratic in x, so the message to a
    Gaussian block of x is exact, (0, −½ E[σ⁻²] DᵀD) for a walk observed nowhere, and to a
    Gamma precision τ with σ = τ^(−½), (T/2, −½ E[Σ_t d_t²]).

    Args:
        value: x (*, T), const or affine_gaussian.
        scale: σ, const, power_gamma or exp_gaussian (one per walk).

    Returns:
        L with the walk's batch shape.
    """
    # E[d_t²] = E[d_t]² + Var[d_t], elementwise over the increments (only C_tt, C_{t−1,t−1}
    # and C_{t,t−1} are read: a chain's banded block holds them)
    steps_sq = slice_last(value, 0, 1).mean_square()
    if value.shape[-1] > 1:
        steps = slice_last(value, 1) - slice_last(value, 0, -1)
        steps_sq = jnp.concatenate([steps_sq, steps.mean_square()], axis=-1)
    sq = jnp.sum(steps_sq, axis=-1)
    mean = jnp.asarray(value.mean())
    num_steps = mean.shape[-1]
    out = num_steps * (-0.5 * LOG_2PI - scale.expect_log()) - 0.5 * scale.expect_pow(-2.0) * sq
    return broadcast_batch(out, jnp.broadcast_shapes(tuple(value.shape)[:-1], tuple(scale.shape)))
