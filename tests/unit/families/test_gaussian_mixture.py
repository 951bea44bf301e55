"""The Gaussian mixture's rule (``blrppl.families.gaussian_mixture``) on inputs whose step is
known by hand: float64 (the test conftest enables x64), exact comparisons."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
import pytest
from jax import random
from jax.scipy.stats import norm

from blrppl.families import gaussian_mixture as gm


def _nat(weights, means, variances):
    return gm.MixtureNat(
        jnp.log(jnp.asarray(weights)), jnp.asarray(means, float)[:, None], 1.0 / jnp.asarray(variances, float)[:, None]
    )


def test_log_q_derivatives_match_autodiff():
    nat = _nat([0.2, 0.5, 0.3], [-1.0, 0.5, 2.0], [0.5, 1.0, 0.25])
    for x in (-1.3, 0.0, 0.7, 2.4):
        x = jnp.array([x])
        log_q, grad, hess = gm.mixture_log_q_derivatives(nat, x)
        want = jax.scipy.special.logsumexp(
            jnp.log(jnp.array([0.2, 0.5, 0.3])) + norm.logpdf(x[0], nat.mean[:, 0], jax.lax.rsqrt(nat.prec[:, 0]))
        )
        np.testing.assert_allclose(log_q, want, rtol=1e-12)
        np.testing.assert_allclose(log_q, gm.mixture_log_prob(nat, x), rtol=1e-12)
        np.testing.assert_allclose(grad, jax.grad(lambda v: gm.mixture_log_prob(nat, v))(x), rtol=1e-10)
        np.testing.assert_allclose(hess, jnp.diag(jax.hessian(lambda v: gm.mixture_log_prob(nat, v))(x)), rtol=1e-10)


def test_one_component_on_a_gaussian_target_is_newtons_step():
    """K = 1 and p = N(μ, 1/P) (diagonal): E[∇F] = P (m − μ) and E[∇²F] = P − s at every draw,
    so at s = P the precision stays and the mean lands on μ in one step at ρ = 1."""
    mu, prec = jnp.array([0.3, -1.0]), jnp.array([4.0, 0.25])
    nat = gm.MixtureNat(jnp.zeros(1), (mu + 0.4 / jnp.sqrt(prec))[None], prec[None])

    def log_p(x):
        return jnp.sum(norm.logpdf(x, mu, jax.lax.rsqrt(prec)))

    new, _ = gm.mixture_step(nat, log_p, random.PRNGKey(0), 1.0, 8)
    np.testing.assert_allclose(new.prec[0], prec, rtol=1e-12)
    np.testing.assert_allclose(new.mean[0], mu, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(new.logits, 0.0, atol=1e-12)


def test_precision_step_from_another_precision():
    """At s ≠ P the precision takes the positivity-preserving average s + ρ(P − s) + ½ρ²(P − s)²/s."""
    mu, prec = jnp.array([0.0]), jnp.array([2.0])
    s = 0.5
    nat = gm.MixtureNat(jnp.zeros(1), mu[None], jnp.array([[s]]))

    def log_p(x):
        return jnp.sum(norm.logpdf(x, mu, jax.lax.rsqrt(prec)))

    rho = 0.3
    new, _ = gm.mixture_step(nat, log_p, random.PRNGKey(1), rho, 4)
    d = 2.0 - s
    np.testing.assert_allclose(new.prec[0, 0], s + rho * d + 0.5 * rho**2 * d**2 / s, rtol=1e-12)
    np.testing.assert_allclose(new.mean[0], 0.0, atol=1e-12)


def test_exact_mixture_is_a_fixed_point_and_weights_step_to_the_masses():
    """p = 0.7 N(−6, 1) + 0.3 N(6, 1): q = p is a fixed point of every step; from weights
    ½, ½ with the right components, E_{q_k}[F] = log(½/π_k) (the components overlap by
    less than e⁻¹⁸), and one step at ρ = 1 gives the weights (0.7, 0.3)."""
    target = _nat([0.7, 0.3], [-6.0, 6.0], [1.0, 1.0])

    def log_p(x):
        return gm.mixture_log_prob(target, x)

    same, _ = gm.mixture_step(target, log_p, random.PRNGKey(2), 0.5, 16)
    for a, b in zip(same, target):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9)
    even = target._replace(logits=jnp.log(jnp.array([0.5, 0.5])))
    new, _ = gm.mixture_step(even, log_p, random.PRNGKey(3), 1.0, 16)
    np.testing.assert_allclose(jax.nn.softmax(new.logits), [0.7, 0.3], rtol=1e-7)
    np.testing.assert_allclose(new.mean, target.mean, atol=1e-7)


def test_precision_stays_positive_where_log_q_is_convex():
    """A component between two modes of p (∇² log p > 0 there): the plain step would make s
    negative; the positivity-preserving one keeps it positive and finite."""

    def log_p(x):
        t = x[0]
        return norm.logpdf(t, 0.0, 2.0) + norm.logpdf(4.0, t**2, 1.0)  # modes at ±2, a trough at 0

    nat = _nat([0.5, 0.5], [0.0, 2.0], [0.01, 0.1])
    f_mean, grad, hess, _ = gm.mixture_messages(nat, log_p, jnp.array([[0.5], [-0.5]]))
    assert float(nat.prec[0, 0] + hess[0, 0]) < 0  # the target precision is negative here
    new, _ = gm.mixture_step(nat, log_p, random.PRNGKey(4), 0.9, 8)
    assert bool(gm.GaussianMixture(2, (1,)).is_valid(new))
    assert np.all(np.asarray(new.prec) > 0)
    # the mean moves at most MAX_STEP of the new sd
    assert np.all(np.abs(np.asarray(new.mean - nat.mean)) <= gm.MAX_STEP / np.sqrt(np.asarray(new.prec)) + 1e-12)


def test_weights_floored():
    logits = gm.floor_weights(jnp.array([0.0, -50.0, -3.0]))
    w = np.asarray(jax.nn.softmax(logits))
    np.testing.assert_allclose(w.sum(), 1.0, rtol=1e-12)
    assert w.min() >= gm.MIN_WEIGHT * (1 - 1e-9)
    np.testing.assert_allclose(np.exp(np.asarray(logits)), w, rtol=1e-12)


def test_spread_start():
    mean, var, start = jnp.array([2.0, 1.0]), jnp.array([0.04, 4.0]), jnp.array([0.0, 0.0])
    nat = gm.spread_start(mean, var, start, 5, random.PRNGKey(0))
    np.testing.assert_allclose(nat.mean[0], mean)
    np.testing.assert_allclose(nat.prec, np.broadcast_to(1.0 / np.asarray(var), (5, 2)))
    np.testing.assert_allclose(nat.logits, 0.0)
    # antithetic pairs about the start, at least START_SD wide (the first coordinate's sd is 0.2)
    np.testing.assert_allclose(nat.mean[1:3] + nat.mean[3:5], 0.0, atol=1e-12)
    z = np.asarray(nat.mean[1:3]) / (gm.SPREAD * np.maximum(np.sqrt(np.asarray(var)), gm.START_SD))
    assert np.all(np.abs(z) < 6)


def test_respread_moves_the_lighter_of_two_coincident_components():
    nat = _nat([0.6, 0.3, 0.1], [1.0, 1.0 + 0.01, -5.0], [1.0, 1.02, 1.0])
    before = tuple(np.asarray(a).copy() for a in nat)
    new, moved = gm.respread(nat, random.PRNGKey(0))
    assert moved == 1
    for a, b in zip(nat, before):  # (the input is not mutated)
        np.testing.assert_array_equal(np.asarray(a), b)
    w = np.asarray(jax.nn.softmax(new.logits))
    np.testing.assert_allclose(w, [0.45, 0.45, 0.1], rtol=1e-12)
    assert float(new.mean[1, 0]) != pytest.approx(1.01)
    np.testing.assert_allclose(np.asarray(new.mean)[[0, 2]], np.asarray(nat.mean)[[0, 2]])
    far, none = gm.respread(_nat([0.5, 0.5], [0.0, 3.0], [1.0, 1.0]), random.PRNGKey(0))
    assert none == 0


def test_export_is_a_mixture_same_family():
    nat = gm.MixtureNat(jnp.log(jnp.array([0.25, 0.75])), jnp.array([[0.0, 1.0], [2.0, 3.0]]), jnp.ones((2, 2)) * 4)
    d = gm.GaussianMixture(2, (2,)).to_numpyro(nat)
    assert d.event_shape == (2,) and d.batch_shape == ()
    x = jnp.array([0.5, 1.5])
    np.testing.assert_allclose(d.log_prob(x), gm.mixture_log_prob(nat, x), rtol=1e-12)
    np.testing.assert_allclose(d.mean, [1.5, 2.5], rtol=1e-12)
    view = gm.GaussianMixture(2, (2,)).view(nat)
    np.testing.assert_allclose(gm.GaussianMixture(2, (2,)).marginal_variance(view), d.variance, rtol=1e-12)
    back = gm.GaussianMixture(2, (2,)).nat_from_view(view)
    for a, b in zip(back, nat):
        np.testing.assert_allclose(a, b, rtol=1e-12)


def _dense(weights, means, covs):
    covs = jnp.asarray(covs, float)
    return gm.MixtureNat(jnp.log(jnp.asarray(weights)), jnp.asarray(means, float), jnp.linalg.inv(covs))


COVS = [[[1.0, 0.6], [0.6, 0.5]], [[0.3, -0.1], [-0.1, 2.0]]]


def test_dense_log_q_derivatives_and_export():
    nat = _dense([0.4, 0.6], [[0.0, 1.0], [2.0, -1.0]], COVS)
    assert gm.is_dense(nat) and gm.dense_components((2,)) and not gm.dense_components((1,))
    d = gm.mixture_distribution(nat)
    want = dist.MixtureSameFamily(
        dist.Categorical(probs=jnp.array([0.4, 0.6])), dist.MultivariateNormal(nat.mean, jnp.asarray(COVS))
    )
    for x in ([0.3, 0.2], [2.5, -0.7], [-1.0, 3.0]):
        x = jnp.asarray(x)
        log_q, grad, hess = gm.mixture_log_q_derivatives(nat, x)
        np.testing.assert_allclose(log_q, want.log_prob(x), rtol=1e-12)
        np.testing.assert_allclose(d.log_prob(x), log_q, rtol=1e-12)
        np.testing.assert_allclose(grad, jax.grad(want.log_prob)(x), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(hess, jax.hessian(want.log_prob)(x), rtol=1e-10, atol=1e-12)
    family = gm.GaussianMixture(2, (2,))
    view = family.view(nat)
    np.testing.assert_allclose(view.cov, COVS, rtol=1e-12)
    np.testing.assert_allclose(family.marginal_variance(view), d.variance, rtol=1e-12)
    marginal = gm.marginal_distribution(nat, np.array([1]), ())
    np.testing.assert_allclose(marginal.variance, d.variance[1], rtol=1e-12)
    assert bool(family.is_valid(nat)) and not bool(family.is_valid(nat._replace(prec=-nat.prec)))


def test_dense_one_component_on_a_gaussian_target_is_newtons_step():
    """K = 1, p = N(μ, Σ) with Σ dense: at S = Σ⁻¹ one step at ρ = 1 keeps S and lands on μ."""
    mu, cov = jnp.array([0.3, -1.0]), jnp.asarray(COVS[0])
    prec = jnp.linalg.inv(cov)
    nat = gm.MixtureNat(jnp.zeros(1), (mu + jnp.array([0.2, -0.1]))[None], prec[None])
    target = dist.MultivariateNormal(mu, cov)
    new, _ = gm.mixture_step(nat, target.log_prob, random.PRNGKey(0), 1.0, 8)
    np.testing.assert_allclose(new.prec[0], prec, rtol=1e-10)
    np.testing.assert_allclose(new.mean[0], mu, rtol=1e-10, atol=1e-12)


def test_dense_precision_step_is_the_matrix_average():
    """From S ≠ P on p = N(0, P⁻¹): E[∇²F] = P − S at every draw, and the step is
    S + ρG + ½ρ² G S⁻¹ G with G = P − S (positive definite)."""
    p_cov = jnp.asarray(COVS[1])
    s = jnp.array([[2.0, 0.3], [0.3, 1.0]])
    nat = gm.MixtureNat(jnp.zeros(1), jnp.zeros((1, 2)), s[None])
    rho = 0.4
    new, _ = gm.mixture_step(nat, dist.MultivariateNormal(jnp.zeros(2), p_cov).log_prob, random.PRNGKey(1), rho, 4)
    g = jnp.linalg.inv(p_cov) - s
    np.testing.assert_allclose(new.prec[0], s + rho * g + 0.5 * rho**2 * g @ jnp.linalg.solve(s, g), rtol=1e-10)
    assert np.all(np.linalg.eigvalsh(np.asarray(new.prec[0])) > 0)


def test_dense_start_and_respread():
    nat = gm.spread_start(jnp.array([1.0, 2.0]), jnp.array([0.25, 4.0]), jnp.zeros(2), 3, random.PRNGKey(0), dense=True)
    assert nat.prec.shape == (3, 2, 2) and gm.is_dense(nat)
    np.testing.assert_allclose(nat.prec[0], jnp.diag(jnp.array([4.0, 0.25])))
    twin = nat._replace(mean=nat.mean.at[1].set(nat.mean[0] + 1e-3))
    moved, count = gm.respread(twin, random.PRNGKey(1))
    # (equal weights: either of the twins moves, the other and the third stay)
    stayed = [np.allclose(moved.mean[i], twin.mean[i]) for i in range(3)]
    assert count == 1 and stayed[2] and stayed[:2].count(True) == 1


def test_drop_floored_removes_the_components_the_floor_holds_and_renormalises():
    # weights 0.6, 0.399 and the floor's 0.001: the third goes, the others keep their ratio
    w = np.array([0.6, 0.399, gm.MIN_WEIGHT])
    nat = gm.MixtureNat(jnp.log(jnp.asarray(w)), jnp.arange(3.0)[:, None], jnp.ones((3, 1)))
    out, dropped = gm.drop_floored(nat)
    assert dropped == 1
    np.testing.assert_allclose(np.exp(out.logits), [0.6 / 0.999, 0.399 / 0.999], rtol=1e-12)
    np.testing.assert_array_equal(np.asarray(out.mean), [[0.0], [1.0]])
    # nothing at the floor: unchanged
    same, none = gm.drop_floored(gm.MixtureNat(jnp.log(jnp.asarray([0.5, 0.5])), jnp.zeros((2, 1)), jnp.ones((2, 1))))
    assert none == 0 and same.logits.shape == (2,)
    # every weight but one at the floor (a mixture of one Gaussian in effect): the heaviest stays
    w = np.array([gm.MIN_WEIGHT, 1 - 2 * gm.MIN_WEIGHT, gm.MIN_WEIGHT])
    one, two = gm.drop_floored(gm.MixtureNat(jnp.log(jnp.asarray(w)), jnp.arange(3.0)[:, None], jnp.ones((3, 1))))
    assert two == 2 and np.asarray(one.mean).tolist() == [[1.0]] and float(one.logits[0]) == pytest.approx(0.0)


def test_dense_start_takes_the_single_fits_precision_matrix():
    # a strongly correlated pair: every dense component starts with the single fit's precision,
    # so the start contains the single fit (component 0 is it), correlations and all
    cov = jnp.array([[1.0, 0.99], [0.99, 1.0]])
    mean, var = jnp.array([0.5, -0.5]), jnp.diagonal(cov)
    nat = gm.spread_start(mean, var, jnp.zeros(2), 4, random.PRNGKey(0), dense=True, cov=cov)
    assert nat.prec.shape == (4, 2, 2)
    for k in range(4):
        np.testing.assert_allclose(np.asarray(nat.prec[k]) @ np.asarray(cov), np.eye(2), atol=1e-9)
    np.testing.assert_allclose(np.asarray(nat.mean[0]), [0.5, -0.5])
    # without a covariance matrix: the diagonal precisions of the variances, as before
    diag = gm.spread_start(mean, var, jnp.zeros(2), 4, random.PRNGKey(0), dense=True)
    np.testing.assert_allclose(np.asarray(diag.prec[0]), np.eye(2))


def test_kept_components_and_the_first_component():
    w = np.array([0.6, gm.MIN_WEIGHT, 0.399])
    nat = gm.MixtureNat(jnp.log(jnp.asarray(w)), jnp.arange(3.0)[:, None], jnp.ones((3, 1)))
    assert gm.kept_components(nat).tolist() == [True, False, True]
    first = gm.first_component(nat)
    assert first.logits.tolist() == [0.0] and first.mean.tolist() == [[0.0]] and first.prec.shape == (1, 1)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_gaussians_as_one_component_and_back(dtype):
    """A dense and a diagonal Gaussian as a mixture of one component (the blocks the mixture's
    fit refits given the mixture) and back: the same mean and covariance, the mixture's
    density and entropy the Gaussian's; a dense block with plate axes is not one."""
    from blrppl.families.gaussian import DiagGaussianView, GaussianDense, GaussianDiag, GaussianView

    cov = jnp.array([[2.0, 0.6, 0.0], [0.6, 1.0, -0.3], [0.0, -0.3, 0.5]], dtype)
    views = [
        (GaussianDense(3), GaussianView(jnp.array([0.5, -1.0, 2.0], dtype), cov)),
        (GaussianDiag(), DiagGaussianView(jnp.array([[0.5, -1.0], [0.0, 3.0]], dtype), jnp.array([[2.0, 0.5], [1.0, 4.0]], dtype))),
    ]
    rtol = 1e-12 if dtype == jnp.float64 else 1e-5
    x = jnp.array([0.1, -0.4, 1.5], dtype)
    for family, view in views:
        nat = gm.as_component(view)
        assert nat.logits.shape == (1,) and nat.mean.dtype == dtype and gm.mixture_is_valid(nat)
        back = gm.component_view(nat, type(view))
        for a, b in zip(back, view):
            np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol)
        family_nat = family.nat_from_view(view)
        point = x if isinstance(view, GaussianView) else x[:2].reshape(1, 2) + jnp.zeros((2, 2), dtype)
        np.testing.assert_allclose(
            gm.mixture_log_prob(nat, point), jnp.sum(family.log_prob(family_nat, point)), rtol=rtol
        )
        np.testing.assert_allclose(gm.component_entropy(nat), jnp.sum(family.entropy(family_nat)), rtol=rtol)
    batched = GaussianView(jnp.zeros((2, 3), dtype), jnp.broadcast_to(cov, (2, 3, 3)))
    assert gm.as_component(batched) is None


def test_a_dense_precision_past_the_dtypes_precision_is_not_valid():
    """A dense component whose precision is singular to the dtype's precision (its Cholesky
    factor can still come out finite) is not valid: the step that made it is not taken."""
    mean = jnp.zeros((1, 2))
    assert gm.mixture_is_valid(gm.MixtureNat(jnp.zeros(1), mean, jnp.diag(jnp.array([1.0, 1e10]))[None]))
    assert not gm.mixture_is_valid(gm.MixtureNat(jnp.zeros(1), mean, jnp.diag(jnp.array([1.0, 1e20]))[None]))
    f32 = gm.MixtureNat(jnp.zeros(1, jnp.float32), mean.astype(jnp.float32), jnp.diag(jnp.array([1.0, 1e10], jnp.float32))[None])
    assert not gm.mixture_is_valid(f32)


def test_entropy_estimate_of_a_bimodal_mixture_against_a_grid():
    """H(q) = −∫ q log q of 0.3 N(−2, 0.5²) + 0.7 N(1.5, 0.8²) on a grid against the estimate
    from 20,000 draws: within four of its Monte Carlo standard errors (the sd of log q over
    the draws / √S, about 0.006)."""
    nat = gm.MixtureNat(jnp.log(jnp.array([0.3, 0.7])), jnp.array([-2.0, 1.5]), 1.0 / jnp.array([0.5, 0.8]) ** 2)
    grid = np.linspace(-8.0, 8.0, 32001)
    q = 0.3 * norm.pdf(grid, -2.0, 0.5) + 0.7 * norm.pdf(grid, 1.5, 0.8)
    exact = -np.sum(q * np.log(q)) * (grid[1] - grid[0])
    draws = np.asarray(gm.mixture_distribution(nat).sample(random.PRNGKey(0), (20_000,)))
    log_q = np.log(0.3 * norm.pdf(draws, -2.0, 0.5) + 0.7 * norm.pdf(draws, 1.5, 0.8))
    se = np.std(log_q) / np.sqrt(draws.size)
    estimate = float(gm.entropy_estimate(nat, random.PRNGKey(0), 20_000))
    assert abs(estimate - exact) < 4 * se
    assert abs(estimate - (-np.mean(log_q))) < 1e-6  # (the same draws: the key's)
