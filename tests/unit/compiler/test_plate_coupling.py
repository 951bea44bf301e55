"""A factor that mixes the elements of a plate of Gaussian latents (differences of neighbours,
a sum, a cumulative sum, a matrix product) couples them: by default the block is dense over the
plate and the fit is exact; asked for mean-field (``structure="mean-field"`` or a diagonal
family) the fit iterates to the mean-field fixed point, whose means are the exact ones and whose
variances are 1 / diag(precision) (the coordinate-ascent VB fixed point of a Gaussian), never a
one-step "conjugate" answer."""

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

from blrppl import blr_fit

N = 4
RNG = np.random.default_rng(0)
Y = RNG.normal(size=N)
MIX = RNG.normal(size=(3, N))
#: each coupling: (function of x, its matrix A with f(x) = A x)
COUPLINGS = {
    "differences": (lambda x: x[1:] - x[:-1], np.eye(N)[1:] - np.eye(N)[:-1]),
    "sum": (lambda x: jnp.sum(x, keepdims=True), np.ones((1, N))),
    "cumsum": (lambda x: jnp.cumsum(x), np.tril(np.ones((N, N)))),
    "matmul": (lambda x: jnp.asarray(MIX) @ x, MIX),
}


def model(y, d, coupling):
    with numpyro.plate("n", N):
        x = numpyro.sample("x", dist.Normal(0.0, 1.0))
        numpyro.sample("y", dist.Normal(x, 1.0), obs=y)
    numpyro.sample("d", dist.Normal(COUPLINGS[coupling][0](x), 0.5).to_event(1), obs=d)


def exact(coupling, d):
    a = COUPLINGS[coupling][1]
    precision = 2.0 * np.eye(N) + a.T @ a / 0.25
    cov = np.linalg.inv(precision)
    return precision, cov @ (Y + a.T @ d / 0.25), cov


@pytest.mark.parametrize("coupling", list(COUPLINGS))
def test_coupled_plate_is_fitted_dense_and_exact(coupling):
    d = np.random.default_rng(1).normal(size=COUPLINGS[coupling][1].shape[0])  # (the same in any test order)
    _, mean, cov = exact(coupling, d)
    r = blr_fit(model, {"y": Y, "d": d, "coupling": coupling}, rng_key=random.PRNGKey(0), progress_bar=False)
    assert r.converged
    post = r.posterior["x"]
    np.testing.assert_allclose(post.mean, mean, atol=1e-8)
    np.testing.assert_allclose(np.diag(np.asarray(post.covariance_matrix)) if hasattr(post, "covariance_matrix")
                               else np.asarray(post.variance), np.diag(cov), atol=1e-8)


@pytest.mark.parametrize("kwargs", [{"structure": "mean-field"}, {"families": {"x": "gaussian-diag"}}])
def test_mean_field_over_a_coupled_plate_iterates_to_its_fixed_point(kwargs):
    d = np.random.default_rng(2).normal(size=N - 1)
    precision, mean, _ = exact("differences", d)
    r = blr_fit(model, {"y": Y, "d": d, "coupling": "differences"}, rng_key=random.PRNGKey(0),
                progress_bar=False, tol=1e-10, refine=False, **kwargs)
    assert r.converged and r.num_steps > 1
    # (coordinate ascent converges linearly: stopped at a relative ELBO change of 1e-10 per
    # step, an ELBO about 1e-9 short of its optimum, whose square root bounds the means' error
    # in sds of order 1: a few 1e-5)
    np.testing.assert_allclose(r.posterior["x"].mean, mean, atol=1e-4)
    np.testing.assert_allclose(r.posterior["x"].variance, 1.0 / np.diag(precision), rtol=1e-8)
