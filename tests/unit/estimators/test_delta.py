"""Delta-method (point) blocks: Newton's method step for step, Laplace at convergence."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

from blrppl import FamilyError, blr_fit

RNG = np.random.default_rng(0)
N, D = 100, 3
X = RNG.normal(size=(N, D))
Y = (RNG.uniform(size=N) < 1 / (1 + np.exp(-X @ np.array([1.0, -1.0, 0.5])))).astype(float)
PRIOR_MEAN = 0.1  # non-zero: numpyro's Bernoulli-logits density has a kink in its autodiff at 0


def logreg(x, y):
    w = numpyro.sample("w", dist.Normal(PRIOR_MEAN, 1.0).expand([D]).to_event(1))
    with numpyro.plate("n", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)


def log_joint(w):
    z = X @ w
    return -0.5 * jnp.sum((w - PRIOR_MEAN) ** 2) + jnp.sum(Y * z - jnp.logaddexp(0.0, z))


def newton_iterates(num):
    """Hand-written Newton's method from the prior mean (the blocks' initial value)."""
    w = jnp.full(D, PRIOR_MEAN)
    out = []
    for _ in range(num):
        h = jax.hessian(log_joint)(w)
        w = w - jnp.linalg.solve(h, jax.grad(log_joint)(w))
        out.append((w, h))
    return out


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_point_block_with_unit_step_is_newtons_method(steps):
    res = blr_fit(logreg, (X, Y), point=["w"], learning_rate=1.0, num_steps=steps, tol=1e-14, progress_bar=False)
    w, h = newton_iterates(steps)[-1]
    post = res.posterior["w"]
    np.testing.assert_allclose(post.mean, w, atol=1e-10)
    # the precision is the negative Hessian at the iterate the step started from
    np.testing.assert_allclose(post.covariance_matrix, np.linalg.inv(-h), atol=1e-10)


def test_point_block_converges_to_laplace():
    res = blr_fit(logreg, (X, Y), point=["w"], learning_rate=1.0, tol=1e-14, progress_bar=False)
    assert res.converged, res.message
    mode = newton_iterates(20)[-1][0]
    post = res.posterior["w"]
    np.testing.assert_allclose(post.mean, mode, atol=1e-8)
    np.testing.assert_allclose(post.covariance_matrix, np.linalg.inv(-jax.hessian(log_joint)(mode)), atol=1e-8)
    assert res.plan.block("w").point


def test_point_must_name_a_continuous_latent():
    with pytest.raises(FamilyError, match="nope"):
        blr_fit(logreg, (X, Y), point=["nope"], progress_bar=False)
    with pytest.raises(FamilyError, match="'y'"):
        blr_fit(logreg, (X, Y), point=["y"], progress_bar=False)
