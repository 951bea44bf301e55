"""Monte Carlo messages to IVON blocks (blrppl.families.GaussianIVON): at a fixed draw, the
surrogate's gradient is IVON's (ĝ, ½ĥ) with ĥ = ĝ (θ − m)/σ², and one step of the family from
that message matches a NumPy recursion of the same draw (Shen et al. 2024, Algorithm 1)."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from blrppl.estimators.monte_carlo import monte_carlo_elementwise
from blrppl.families import DiagGaussianView, GaussianIVON
from blrppl.graph.plan import Block

C = np.array([0.3, -1.0, 2.0])
PRIOR_PREC = 4.0  # a N(0, 1/2) prior on each weight, whose message is exact


class _Model:
    """log f(w) = −Σ_i cosh(w_i − c_i): no closed form, a Monte Carlo factor."""

    def log_probs(self, names, values, data):
        return {"lik": (-jnp.cosh(values["w"] - C), None)}


def _draw(key, mean, var):
    # (the estimator's own draw: its first key of split(key, blocks + 1), one sample)
    eps = np.asarray(random.normal(random.split(key, 2)[0], (1, 3), jnp.float64))[0]
    return mean + np.sqrt(var) * eps


def _surrogate_grad(key, family, view, curvature="auto"):
    block = Block("w", family, family.name, (3,))
    factor = SimpleNamespace(name="lik", neighbours=("w",), discrete=())

    def correction(v):
        return monte_carlo_elementwise(_Model(), [factor], {"w": block}, {"w": v}, {}, None, key, curvature=curvature)[2]

    return jax.grad(correction)(view)


def test_message_is_ivons_estimate_at_one_draw():
    key = random.PRNGKey(3)
    mean, var = np.array([0.1, -0.5, 1.5]), np.array([0.2, 0.05, 0.5])
    view = DiagGaussianView(jnp.asarray(mean), jnp.asarray(var))
    theta = _draw(key, mean, var)
    g = -np.sinh(theta - C)
    h = g * (theta - mean) / var
    for curvature in ("auto", "hessian", "stein"):  # (the family's estimate, whatever mc_curvature says)
        grad = _surrogate_grad(key, GaussianIVON(), view, curvature)
        np.testing.assert_allclose(np.asarray(grad.mean), g, rtol=1e-12)
        np.testing.assert_allclose(np.asarray(grad.var), 0.5 * h, rtol=1e-12)


def test_two_steps_from_fixed_draws_match_the_recursion():
    family = GaussianIVON(beta1=0.9, max_step=None)
    keys = [random.PRNGKey(5), random.PRNGKey(6)]
    rho = 0.4
    nat = family.nat_from_view(DiagGaussianView(jnp.array([0.1, -0.5, 1.5]), jnp.array([0.2, 0.05, 0.5])))
    m, s, mom, w = np.array([0.1, -0.5, 1.5]), 1 / np.array([0.2, 0.05, 0.5]), np.zeros(3), 0.0
    for key in keys:
        view = family.view(nat)
        grad = _surrogate_grad(key, family, view)
        # the prior's exact message: ∂/∂m = −δ m, ∂/∂v = −δ/2
        grad = DiagGaussianView(grad.mean - PRIOR_PREC * view.mean, grad.var - 0.5 * PRIOR_PREC)
        nat = family.update(nat, family.message_at(nat, view, grad), rho)
        # NumPy: IVON's step in the precision s = λ(h + δ), at 1 − β₂ = α = ρ
        theta = _draw(key, m, 1 / s)
        g_hat = -np.sinh(theta - C)
        h_hat = -g_hat * (theta - m) * s  # the loss's curvature estimate (loss = −log f)
        target = h_hat + PRIOR_PREC
        new_s = s + rho * (target - s) + 0.5 * rho**2 * (target - s) ** 2 / s
        mom = 0.9 * mom + 0.1 * (g_hat - PRIOR_PREC * m)
        w = 0.9 * w + 0.1
        m, s = m + rho * (mom / w) / new_s, new_s
    got = family.view(nat)
    np.testing.assert_allclose(np.asarray(got.mean), m, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(got.var), 1 / s, rtol=1e-12)
