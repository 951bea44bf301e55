"""Scales integrated on a grid (``families={"tau": "grid"}``, :mod:`blrppl.engine.grid`).

Against exact posteriors (below) and against the stored long-NUTS references of
``tests/integration/test_nonconjugate.py`` (a random walk's two scales, a stochastic volatility's shock
size: issue 13's bars for chains).

Float64. The exact reference is eight schools as NumPyro's docs write it (centred): given
the group spread τ, the effects and their mean are Gaussian and y | τ ~ N(0, diag(σ² + τ²) +
25·11ᵀ), so p(τ | y) ∝ p(τ) N(y; 0, Σ(τ)) is a one-dimensional integral the test computes on
a fine grid (20,001 points of log τ), and E[θ | y] = ∫ E[θ | τ, y] p(τ | y) dτ with it.
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

import reference_models as rm
from integration import test_nonconjugate as nc
from blrppl import BLR, blr_fit
from blrppl.errors import BLRError

numpyro.enable_x64()

J, SIGMA, Y = rm.EIGHT_SCHOOLS
eight_schools = rm.eight_schools_model


def exact_eight_schools():
    """(E[τ], sd[τ], E[θ]) of the centred model by quadrature over log τ."""
    u = np.linspace(-12.0, 6.0, 20_001)
    tau = np.exp(u)
    cov = np.diag(SIGMA**2)[None] + tau[:, None, None] ** 2 * np.eye(J)[None] + 25.0
    sign, logdet = np.linalg.slogdet(cov)
    quad = np.einsum("i,kij,j->k", Y, np.linalg.inv(cov), Y)
    log_half_cauchy = np.log(2.0 / (np.pi * 5.0)) - np.log1p((tau / 5.0) ** 2)
    logp = -0.5 * logdet - 0.5 * quad + log_half_cauchy + u  # (+ log |dτ/du|)
    w = np.exp(logp - logp.max())
    w /= w.sum()
    # E[θ | τ, y]: the Gaussian (μ, θ) given τ, its precision and shift in closed form
    means = []
    for t in tau[w > 1e-12]:
        prec = np.zeros((J + 1, J + 1))
        prec[0, 0] = 1 / 25.0 + J / t**2
        prec[0, 1:] = prec[1:, 0] = -1 / t**2
        prec[1:, 1:] = np.diag(1 / t**2 + 1 / SIGMA**2)
        shift = np.concatenate([[0.0], Y / SIGMA**2])
        means.append(np.linalg.solve(prec, shift)[1:])
    theta = np.sum(w[w > 1e-12][:, None] * np.array(means), 0)
    m = np.sum(w * tau)
    return m, np.sqrt(np.sum(w * tau**2) - m**2), theta


@pytest.fixture(scope="module")
def schools_fit():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = blr_fit(eight_schools, (J, SIGMA, Y), families={"tau": "grid"}, rng_key=random.PRNGKey(0),
                         progress_bar=False)
    result.caught = caught
    return result


def test_the_grid_is_judged_as_the_mixture_of_its_fits(schools_fit):
    """PSIS reads the grid's mixture of fits (the effects drawn from the fit at their τ's
    point), not τ and the effects drawn apart (k̂ 0.94 so, and a poor-q warning): measured
    k̂ 0.12, so no poor-q warning; any warning points at the line that called blr_fit."""
    assert schools_fit.diagnostics.khat <= 0.5, schools_fit.diagnostics.describe()
    poor = [w for w in schools_fit.caught if "poor approximation" in str(w.message)]
    assert not poor, [str(w.message) for w in schools_fit.caught]
    assert all(w.filename == __file__ for w in schools_fit.caught)


def test_eight_schools_spread_on_a_grid_equals_the_exact_posterior(schools_fit):
    """τ's posterior mean and sd from the grid within 1 % of the exact ones (a Gaussian q
    over (μ, τ, θ) cannot hold the funnel: the default fit's sd of τ is checked to be off by
    more than 20 % in the same run), and θ's means within 0.5 % of their exact values (the
    mixture of the fits at the grid points, moment-matched)."""
    m, sd, theta = exact_eight_schools()
    draws = schools_fit.sample(random.PRNGKey(1), 200_000)
    tau = np.asarray(draws["tau"])
    # (200,000 independent draws: Monte Carlo error 0.2 % of sd on the mean, 0.2 % on the sd)
    assert abs(tau.mean() - m) < 0.01 * m and abs(tau.std() - sd) < 0.01 * sd, (tau.mean(), tau.std(), m, sd)
    np.testing.assert_allclose(np.asarray(schools_fit.posterior["theta"].mean), theta, rtol=5e-3)
    assert "'tau' integrated on a grid" in schools_fit.message, schools_fit.message
    default = blr_fit(eight_schools, (J, SIGMA, Y), rng_key=random.PRNGKey(0), progress_bar=False, refine=False)
    off = np.asarray(default.sample(random.PRNGKey(1), 200_000)["tau"]).std()
    assert abs(off - sd) > 0.2 * sd, (off, sd)


def local_level(y):
    """A random walk with an unknown step scale seen through noise of sd 0.8, one site per
    day as a Python loop (NumPyro's forecasting idiom without scan)."""
    step = numpyro.sample("step", dist.HalfNormal(1.0))
    level = 0.0
    for t in range(len(y)):
        level = numpyro.sample(f"level_{t}", dist.Normal(level, step))
        numpyro.sample(f"y_{t}", dist.Normal(level, 0.8), obs=y[t])


def test_a_python_loop_walk_on_a_grid_is_its_exact_posterior():
    """20 days written one site per day, the step scale on a grid: the inner fits are exact
    (linear-Gaussian given the scale), so its marginal is p(s | y) ∝ p(s) N(y; 0, s² min(i, j)
    + 0.8² δ_ij), computed in the test over 4,001 points of log s: mean and sd within 1 %.
    Each inner fit is one conjugate block, so the grid reads its exact ELBO (no draws)."""
    rng = np.random.default_rng(1)
    y = np.cumsum(0.5 * rng.normal(size=20)) + 0.8 * rng.normal(size=20)
    result = blr_fit(local_level, (y,), families={"step": "grid"}, rng_key=random.PRNGKey(0), progress_bar=False)
    got = np.asarray(result.sample(random.PRNGKey(1), 200_000)["step"])
    n = len(y)
    base = np.minimum.outer(np.arange(1, n + 1), np.arange(1, n + 1)).astype(float)
    u = np.linspace(-7.0, 3.0, 4001)
    s = np.exp(u)
    cov = s[:, None, None] ** 2 * base + 0.64 * np.eye(n)
    _, logdet = np.linalg.slogdet(cov)
    quad = np.einsum("i,aij,j->a", y, np.linalg.inv(cov), y)
    logp = -0.5 * logdet - 0.5 * quad - 0.5 * s**2 + u  # (HalfNormal(1) and log s's Jacobian)
    w = np.exp(logp - logp.max())
    w /= w.sum()
    m = np.sum(w * s)
    sd = np.sqrt(np.sum(w * s**2) - m**2)
    assert abs(got.mean() - m) < 0.01 * m and abs(got.std() - sd) < 0.01 * sd, (got.mean(), m, got.std(), sd)
    assert "read by their ELBOs" in result.message, result.message


def pooled_players(at_bats, hits=None):
    """NumPyro's baseball pool with its mean fixed (m = 0.25): each player's ability φ_i ~
    Beta(m κ, (1 − m) κ) with a latent concentration κ ~ Pareto(1, 1.5)."""
    kappa = numpyro.sample("kappa", dist.Pareto(1.0, 1.5))
    with numpyro.plate("players", at_bats.shape[0]):
        phi = numpyro.sample("phi", dist.Beta(0.25 * kappa, 0.75 * kappa))
        numpyro.sample("obs", dist.Binomial(at_bats, probs=phi), obs=hits)


def test_a_pooled_beta_on_a_grid_reports_the_mixture_of_its_conjugate_fits():
    """With κ latent the players' abilities are a Gaussian on their logits (a Beta with a
    latent concentration has no closed form); with κ fixed each is Beta, conjugate, and the
    inner fit is exact. The result's φ is the mixture of those Beta fits over the grid,
    moment-matched on the logit scale (4,000 draws of each): against the exact posterior
    (quadrature over 20,001 points of log κ: p(κ | y) ∝ p(κ) Π_i B(a + y_i, b + n_i − y_i) /
    B(a, b), and given κ, logit φ_i has mean ψ(a + y_i) − ψ(b + n_i − y_i) and variance
    ψ′(a + y_i) + ψ′(b + n_i − y_i)), every mean within 0.06 sd and sd within 5 % (the 4,000
    draws' Monte Carlo error: 0.016 sd on a mean, 1.1 % on an sd; measured 0.027 and 2.3 %).
    Before, φ was the fit with κ latent: 0.2 sd off in NumPyro's two-scale example."""
    from scipy.special import betaln, digamma, polygamma

    hits = np.array([18, 16, 14, 13, 12, 11, 10, 10, 9, 7])
    at_bats = np.full(10, 45)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (q draws κ apart from φ: the poor-q warning says so)
        result = blr_fit(pooled_players, (at_bats, hits), families={"kappa": "grid"}, rng_key=random.PRNGKey(0),
                         progress_bar=False)
    assert "the blocks phi take other families with the scales fixed" in result.message, result.message
    u = np.linspace(-3.0, 12.0, 20_001)
    kappa = np.exp(u)
    a, b = 0.25 * kappa, 0.75 * kappa
    logp = np.where(kappa >= 1.0, -1.5 * u, -np.inf)  # (Pareto(1, 1.5) ∝ κ^-2.5, and log κ's Jacobian κ)
    for y, n in zip(hits, at_bats):
        logp = logp + betaln(a + y, b + n - y) - betaln(a, b)
    w = np.exp(logp - logp.max())
    w /= w.sum()
    post_a, post_b = a[:, None] + hits, b[:, None] + at_bats - hits
    mean = w @ (digamma(post_a) - digamma(post_b))
    sd = np.sqrt(w @ (polygamma(1, post_a) + polygamma(1, post_b) + (digamma(post_a) - digamma(post_b)) ** 2) - mean**2)
    q = result.posterior["phi"].base_dist  # (the Gaussian of the logits)
    err, ratio = (np.asarray(q.loc) - mean) / sd, np.asarray(q.scale) / sd
    assert np.max(np.abs(err)) <= 0.06 and np.max(np.abs(ratio - 1.0)) <= 0.05, (err, ratio)


@pytest.mark.parametrize(
    "families, kwargs, match",
    [
        ({"theta": "grid"}, {}, "only a continuous scalar latent.*'theta' has 8 scalar"),
        ({"obs": "grid"}, {}, "names 'obs', which is not a latent sample site"),
        ({"nope": "grid"}, {}, "names 'nope', which is not a latent sample site"),
        ({"tau": "grid"}, {"num_starts": 2}, "one start and without prior="),
        ({"tau": "grid"}, {"structure": "joint"}, "one block with 2 other site.*drop structure='joint'"),
    ],
)
def test_grid_requests_it_cannot_serve_are_clear_errors(families, kwargs, match):
    with pytest.raises(BLRError, match=match):
        blr_fit(eight_schools, (J, SIGMA, Y), families=families, progress_bar=False, **kwargs)


def test_a_matrix_with_one_free_scalar_on_a_grid_is_a_clear_error():
    """A 2 × 2 LKJ Cholesky factor has one free scalar but a matrix value: the grid, which maps
    one scalar to a site's value, refuses it by name and says how to write it (numpyro's
    transform raised an IndexError from inside the grid)."""

    def slopes(y):
        L = numpyro.sample("L", dist.LKJCholesky(2, 2.0))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.MultivariateNormal(jnp.zeros(2), scale_tril=L), obs=y)

    y = np.random.default_rng(0).normal(size=(20, 2))
    with pytest.raises(BLRError, match=r"'L' has one free scalar but a value of shape \(2, 2\).*rho = 2 r - 1"):
        blr_fit(slopes, (y,), families={"L": "grid"}, rng_key=random.PRNGKey(0), progress_bar=False)


def test_more_scales_than_a_grid_holds_is_a_clear_error():
    """Past :data:`blrppl.engine.design.MAX_SCALES` (6) scales the grid refuses by name (its fits
    grow as the square of their number)."""

    def seven_scales(y):
        scales = [numpyro.sample(f"s{i}", dist.HalfNormal(1.0)) for i in range(7)]
        numpyro.sample("y", dist.Normal(0.0, sum(scales)), obs=y)

    with pytest.raises(BLRError, match="7 sites asked for 'grid'.*at most 6 scales"):
        blr_fit(seven_scales, (np.array([0.3, -1.2]),), families={f"s{i}": "grid" for i in range(7)}, progress_bar=False)


def test_the_svi_drop_in_names_grid_as_blr_fit_only():
    """BLR (the SVI drop-in) compiles one fit of every latent: a grid is refused by name."""
    blr = BLR(eight_schools, families={"tau": "grid"})
    with pytest.raises(BLRError, match="'grid'.*blr_fit alone"):
        blr.init(random.PRNGKey(0), J, SIGMA, Y)


def test_a_discrete_site_on_a_grid_is_a_clear_error():
    def coin(y):
        z = numpyro.sample("z", dist.Bernoulli(0.5))
        numpyro.sample("y", dist.Normal(2.0 * z, 1.0), obs=y)

    with pytest.raises(BLRError, match="only a continuous scalar latent.*'z' is not one"):
        blr_fit(coin, (np.array([1.5, 2.2]),), families={"z": "grid"}, progress_bar=False)


@pytest.mark.parametrize(
    "name, scales, latents, sd_rel",
    [
        # (the bar for chains: the walk's states and scales within 10 %, the
        # volatility's within 20 %)
        ("random_walk", ("s", "r"), "x", 0.1),
        ("stochastic_volatility", ("sigma",), "h", 0.2),
    ],
)
def test_chain_scales_integrated_on_a_grid_match_nuts(name, scales, latents, sd_rel):
    """The scales of a chain integrated on a grid of fits with them fixed
    (``families={scale: "grid"}``): each scale's mean within 0.1 NUTS sd and its sd within
    ``sd_rel`` of NUTS's (the default fit's are 0.3× and 0.25×: a funnel no Gaussian q
    holds), and the states (the moment-matched mixture of the fits) still within 0.1 sd and
    ``sd_rel``."""
    model, data = rm.get(name)
    result = blr_fit(model, data, families={s: "grid" for s in scales}, rng_key=random.key(0), progress_bar=False)
    ref, est = nc.reference(name), nc.posterior_moments(result)
    err = {k: abs(est[k][0] - m) / s for k, (m, s) in ref.items()}
    ratio = {k: est[k][1] / s for k, (_, s) in ref.items()}
    assert all(err[k] <= 0.1 and abs(ratio[k] - 1.0) <= sd_rel for k in scales), nc._fmt(
        {**{f"err {k}": err[k] for k in scales}, **{f"ratio {k}": ratio[k] for k in scales}}
    )
    # (the walk's inner fits are exact, one banded block: read by their ELBOs; the
    # volatility's are not, and read by their importance-weighted bounds)
    assert ("importance-weighted" in result.message) == (name == "stochastic_volatility"), result.message
    states = [k for k in ref if k.startswith(f"{latents}[")]
    assert max(err[k] for k in states) <= 0.1, max(err[k] for k in states)
    assert max(abs(ratio[k] - 1.0) for k in states) <= sd_rel, max(abs(ratio[k] - 1.0) for k in states)


def test_a_fit_that_cannot_start_returns_as_without_the_grid():
    """Data whose squares overflow (finite, so no data check refuses them): the fit with the
    scale as latent takes no step, and the grid fit returns it with the same stop warning
    and a note that no grid was run (it raised a bare 'no finite ELBO' error)."""
    y = Y.copy()
    y[2] = 1e200
    with pytest.warns(UserWarning, match="stopped after 0 steps"):
        result = blr_fit(eight_schools, (J, SIGMA, y), families={"tau": "grid"}, rng_key=random.PRNGKey(0),
                         progress_bar=False)
    assert "'tau' not integrated on a grid" in result.message, result.message


def marginalised_scales(y, z):
    """Three scales and nothing else latent (a Gaussian process's kernel parameters are such: its
    latent function is marginalised in the likelihood): y ~ N(0, s1² + s2²), z ~ N(0, s2 s3)."""
    s1 = numpyro.sample("s1", dist.LogNormal(0.0, 1.0))
    s2 = numpyro.sample("s2", dist.LogNormal(0.0, 1.0))
    s3 = numpyro.sample("s3", dist.LogNormal(-0.5, 0.7))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Normal(0.0, (s1**2 + s2**2) ** 0.5), obs=y)
        numpyro.sample("z", dist.Normal(0.0, s2 * s3), obs=z)


def test_every_latent_on_the_grid_is_the_exact_posterior():
    """With every latent on the grid nothing is left to fit: ℓ is the model's log density, and
    a product grid of three scales gives their posterior means and sds (against a quadrature on
    120³ points of the log scales) within 2 % of a posterior sd; before, the grid's
    conditioned model had no latent and the fit raised."""
    rng = np.random.default_rng(0)
    y, z = rng.normal(0.0, 1.3, size=12), rng.normal(0.0, 0.8, size=12)
    result = blr_fit(
        marginalised_scales, (y, z), families={"s1": "grid", "s2": "grid", "s3": "grid"},
        rng_key=random.PRNGKey(0), progress_bar=False,
    )
    u = np.linspace(-6.0, 4.0, 120)
    u1, u2, u3 = np.meshgrid(u, u, u, indexing="ij")
    s1, s2, s3 = np.exp(u1), np.exp(u2), np.exp(u3)
    log_p = (
        dist.LogNormal(0.0, 1.0).log_prob(s1) + dist.LogNormal(0.0, 1.0).log_prob(s2)
        + dist.LogNormal(-0.5, 0.7).log_prob(s3)
        + u1 + u2 + u3  # (densities on log space)
        + dist.Normal(0.0, np.sqrt(s1**2 + s2**2)[..., None]).log_prob(y).sum(-1)
        + dist.Normal(0.0, (s2 * s3)[..., None]).log_prob(z).sum(-1)
    )
    w = np.exp(np.asarray(log_p) - np.max(log_p))
    w /= w.sum()
    draws = result.sample(random.PRNGKey(1), 40_000)
    for name, s in (("s1", s1), ("s2", s2), ("s3", s3)):
        mean = float(np.sum(w * s))
        sd = float(np.sqrt(np.sum(w * (s - mean) ** 2)))
        # (40,000 draws: Monte Carlo error 0.005 sd on the mean, 0.4 % on the sd)
        assert abs(float(np.mean(draws[name])) - mean) < 0.02 * sd, name
        assert abs(float(np.std(draws[name])) / sd - 1.0) < 0.02, name
    assert "on a grid" in result.message
