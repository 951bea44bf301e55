"""IVON's family (blrppl.families.GaussianIVON): its update against a NumPy recursion of the
equations of Shen et al. (2024), Algorithm 1, written in the learning rule's precision s."""

import jax.numpy as jnp
import numpy as np
import pytest

from blrppl.families import DiagGaussianView, GaussianIVON
from blrppl.families.gaussian_ivon import positive_average


def _numpy_steps(mean, var, messages, rho, beta1, max_step):
    """The IVON recursion on (m, s = 1/v, g, w) from messages (target precision ŝ, gradient ĝ)."""
    m, s = np.array(mean, float), 1.0 / np.array(var, float)
    g, w = np.zeros_like(m), 0.0
    for target, grad in messages:
        d = target - s
        s = s + rho * d + 0.5 * rho**2 * d**2 / s
        g = beta1 * g + (1 - beta1) * grad
        w = beta1 * w + (1 - beta1)
        step = rho * (g / w) / s
        if max_step is not None:
            step = np.clip(step, -max_step / np.sqrt(s), max_step / np.sqrt(s))
        m = m + step
    return m, 1.0 / s


def _message(family, nat, target, grad):
    """The message whose precision is ``target`` and whose gradient ∂L/∂m is ``grad``, from
    the view gradient (∂L/∂m, ∂L/∂v = −target/2) as the step computes it."""
    view = family.view(nat)
    return family.message_at(nat, view, DiagGaussianView(jnp.asarray(grad), jnp.asarray(-0.5 * target)))


@pytest.mark.parametrize("beta1, max_step", [(0.9, None), (0.0, 1.0), (0.5, 0.3)])
def test_two_steps_match_the_recursion(beta1, max_step):
    rng = np.random.default_rng(0)
    mean, var = rng.normal(size=5), rng.uniform(0.5, 2.0, size=5)
    # (one target precision negative: a curvature sample of the wrong sign)
    messages = [(np.array([3.0, -4.0, 0.5, 10.0, 2.0]), rng.normal(size=5) * 5), (rng.uniform(1, 5, 5), rng.normal(size=5))]
    family = GaussianIVON(beta1=beta1, max_step=max_step)
    nat = family.nat_from_view(DiagGaussianView(jnp.asarray(mean), jnp.asarray(var)))
    for target, grad in messages:
        nat = family.update(nat, _message(family, nat, target, grad), 0.3)
    got = family.view(nat)
    want_mean, want_var = _numpy_steps(mean, var, messages, 0.3, beta1, max_step)
    np.testing.assert_allclose(np.asarray(got.mean), want_mean, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(got.var), want_var, rtol=1e-12)
    assert bool(family.is_valid(nat))


def test_the_clip_bounds_each_step_by_posterior_sds():
    family = GaussianIVON(max_step=1.0)
    nat = family.nat_from_view(DiagGaussianView(jnp.zeros(3), jnp.ones(3)))
    # a huge gradient at the broad start (a network's first draws)
    new = family.update(nat, _message(family, nat, np.full(3, 4.0), np.array([1e6, -1e6, 0.0])), 0.5)
    view = family.view(new)
    sd = np.sqrt(np.asarray(view.var))
    np.testing.assert_allclose(np.abs(np.asarray(view.mean)), [sd[0], sd[1], 0.0], rtol=1e-12)


def test_positive_average_stays_positive_at_any_target():
    prec = jnp.array([1.0, 1e-3, 50.0])
    for target in (-1e6, -1.0, 0.0, 1e6):
        for rate in (1e-5, 0.1, 0.9, 1.0):
            assert bool(jnp.all(positive_average(prec, target, rate) > 0))


def test_state_is_linear_in_the_weights_and_float32_stays_float32():
    family = GaussianIVON()
    x = np.zeros((40, 25), np.float32)
    nat = family.initial_nat(x)
    assert sum(np.size(leaf) for leaf in nat) == 3 * x.size + 1  # (η₁, η₂, momentum, weight)
    nat = family.nat_from_view(DiagGaussianView(jnp.asarray(x), jnp.full(x.shape, 0.01, jnp.float32)))
    new = family.update(nat, _message(family, nat, np.full(x.shape, 2.0, np.float32), np.ones(x.shape, np.float32)), 0.5)
    assert all(leaf.dtype == jnp.float32 for leaf in new)
