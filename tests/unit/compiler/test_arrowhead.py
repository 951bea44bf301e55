"""Arrowhead blocks: many per-group effects and a few shared ones in one joint Gaussian.

An item-response model reads, per answer, one student's ability, one question's difficulty
and a global mean: the posterior precision is diagonal over the abilities and dense over
the rest and between the two. Beyond the dense limit the compiler finds that structure
(each factor element reads at most one ability) and fits one arrowhead block; a linear-
Gaussian version is conjugate to it, so one step must give the exact posterior, written
here with a dense numpy solve.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.infer import Predictive

from blrppl import blr_fit
from blrppl.api import plan_of

STUDENTS, QUESTIONS, ANSWERS = 450, 60, 4000
NOISE = 0.5


def scores_model(student, question, score=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    with numpyro.plate("students", STUDENTS):
        ability = numpyro.sample("ability", dist.Normal(0.0, 1.0))
    with numpyro.plate("questions", QUESTIONS):
        difficulty = numpyro.sample("difficulty", dist.Normal(0.0, 1.0))
    numpyro.deterministic("first_gap", ability[0] - difficulty[0])
    with numpyro.plate("answers", len(student)):
        numpyro.sample("score", dist.Normal(mu + ability[student] - difficulty[question], NOISE), obs=score)


def scores_data(seed=0):
    rng = np.random.default_rng(seed)
    pair = rng.choice(STUDENTS * QUESTIONS, ANSWERS, replace=False)
    student, question = pair // QUESTIONS, pair % QUESTIONS
    score = 0.3 + rng.normal(size=STUDENTS)[student] - rng.normal(size=QUESTIONS)[question]
    return {"student": jnp.asarray(student), "question": jnp.asarray(question), "score": score + NOISE * rng.normal(size=ANSWERS)}


def exact_posterior(student, question, score):
    """Mean, covariance and log evidence of (mu, ability, difficulty): prior N(0, P0⁻¹),
    score = A x + noise, so P = P0 + AᵀA/σ², m = P⁻¹ Aᵀ y / σ²."""
    n = 1 + STUDENTS + QUESTIONS
    a = np.zeros((len(score), n))
    rows = np.arange(len(score))
    a[:, 0] = 1.0
    a[rows, 1 + np.asarray(student)] = 1.0
    a[rows, 1 + STUDENTS + np.asarray(question)] = -1.0
    prior_prec = np.ones(n)
    prior_prec[0] = 1 / 4.0
    prec = np.diag(prior_prec) + a.T @ a / NOISE**2
    b = a.T @ score / NOISE**2
    cov = np.linalg.inv(prec)
    mean = cov @ b
    _, logdet = np.linalg.slogdet(prec)
    log_z = -0.5 * (
        len(score) * np.log(2 * np.pi * NOISE**2) + score @ score / NOISE**2 - b @ mean + logdet - np.sum(np.log(prior_prec))
    )
    return mean, cov, log_z


@pytest.fixture(scope="module")
def scores_fit():
    data = scores_data()
    return data, blr_fit(scores_model, data, rng_key=random.PRNGKey(0), progress_bar=False)


def test_item_response_block_is_an_arrowhead(scores_fit):
    _, fit = scores_fit
    block = fit.plan.block("(mu, ability, difficulty)")
    assert block.family.arrowhead and block.sites == ("mu", "ability", "difficulty")
    assert block.family.num_globals == 1 + QUESTIONS  # the abilities are the diagonal part
    assert "gaussian-arrowhead (61 dense + ability diagonal)" in fit.plan.describe()


def test_linear_gaussian_item_response_is_exact_in_one_step(scores_fit):
    data, fit = scores_fit
    mean, cov, log_z = exact_posterior(data["student"], data["question"], data["score"])
    assert fit.converged and fit.num_steps == 1
    sd = np.sqrt(np.diag(cov))
    parts = {"mu": slice(0, 1), "ability": slice(1, 1 + STUDENTS), "difficulty": slice(1 + STUDENTS, None)}
    for site, sl in parts.items():
        post = fit.posterior[site]
        np.testing.assert_allclose(np.ravel(post.mean), mean[sl], atol=1e-8)
        np.testing.assert_allclose(np.sqrt(np.ravel(post.variance)), sd[sl], rtol=1e-8)
    assert abs(float(fit.elbo[-1]) - log_z) < 1e-8 * abs(log_z)


def test_arrowhead_draws_keep_the_coupling(scores_fit):
    """Joint draws (result.sample and the guide under Predictive) have the exact covariance
    between an ability and a difficulty, which the per-site marginals do not hold: 20,000
    draws give its correlation within 4 standard errors (≈ 4 × (1 − r²)/√n), and 4,000
    guide draws the sd of their difference within 4 standard errors (≈ 4/√(2m))."""
    data, fit = scores_fit
    _, cov, _ = exact_posterior(data["student"], data["question"], data["score"])
    i, j = 1, 1 + STUDENTS  # ability[0], difficulty[0]
    r = cov[i, j] / np.sqrt(cov[i, i] * cov[j, j])
    n = 20_000
    draws = fit.sample(random.PRNGKey(1), n)
    got = np.corrcoef(draws["ability"][:, 0], draws["difficulty"][:, 0])[0, 1]
    assert abs(got - r) < 4 * (1 - r**2) / np.sqrt(n), (got, r)
    m = 4000  # (the guide's draws of every score: m × 4,000 values)
    pred = Predictive(scores_model, guide=fit.guide, num_samples=m)(
        random.PRNGKey(2), data["student"], data["question"]
    )
    gap_sd = np.sqrt(cov[i, i] + cov[j, j] - 2 * cov[i, j])
    assert abs(np.std(pred["first_gap"]) / gap_sd - 1) < 4 / np.sqrt(2 * m)
    assert pred["score"].shape == (m, ANSWERS)


def test_pairwise_comparisons_are_no_arrowhead():
    """A Bradley–Terry model reads two players' strengths per game: no set of members has
    one scalar per element, so there is no arrowhead (mean-field over the 520 scalars)."""
    players, games = 520, 3000
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, players, games), rng.integers(0, players, games)
    strength = rng.normal(size=players)
    won = (rng.random(games) < 1 / (1 + np.exp(strength[b] - strength[a]))).astype(float)

    def model(a, b, won=None):
        home = numpyro.sample("home", dist.Normal(0.0, 1.0))
        with numpyro.plate("players", players):
            s = numpyro.sample("s", dist.Normal(0.0, 1.0))
        with numpyro.plate("games", len(a)):
            numpyro.sample("won", dist.Bernoulli(logits=home + s[a] - s[b]), obs=won)

    plan = plan_of(model, {"a": a, "b": b, "won": won})
    assert not any(blk.family.arrowhead for blk in plan.blocks), plan.describe()


# -- non-conjugate: the arrowhead holds the dense Gaussian's optimum -------------------------

COUNTIES, VISITS = 30, 300


def counts_model(county, x, counts=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    beta = numpyro.sample("beta", dist.Normal(0.0, 1.0))
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    with numpyro.plate("county", COUNTIES):
        a = numpyro.sample("a", dist.Normal(0.0, tau))
    with numpyro.plate("visits", len(county)):
        numpyro.sample("counts", dist.Poisson(jnp.exp(mu + a[county] + beta * x)), obs=counts)


def test_poisson_group_effects_reach_the_dense_optimum(monkeypatch):
    """Every exact message of these factors lies in the arrowhead pattern, so the arrowhead
    family holds the dense Gaussian's fixed point: both fits (the dense limit lowered to
    25 scalars so that the small model gets an arrowhead) agree once both have settled."""
    from blrppl.compiler import structure as compile_mod

    rng = np.random.default_rng(3)
    county, x = rng.integers(0, COUNTIES, VISITS), rng.normal(size=VISITS)
    counts = rng.poisson(np.exp(0.3 + 0.5 * rng.normal(size=COUNTIES)[county] + 0.4 * x))
    data = {"county": county, "x": x, "counts": counts}
    monkeypatch.setattr(compile_mod, "JOINT_MAX_DIM", 25)
    fits = {
        s: blr_fit(counts_model, data, rng_key=random.PRNGKey(0), structure=s, tol=1e-30, num_steps=300, progress_bar=False)
        for s in (None, "joint")
    }
    arrow, dense = fits[None], fits["joint"]
    assert arrow.plan.blocks[0].family.arrowhead and arrow.plan.blocks[0].family.num_globals == 3
    assert not dense.plan.blocks[0].family.arrowhead
    for fit in (arrow, dense):  # at the fixed point, up to rounding (the last bits may cycle)
        assert np.ptp(fit.elbo[-20:]) <= 1e-12 * abs(fit.elbo[-1])
    for site in ("mu", "beta", "tau", "a"):
        p, q = arrow.posterior[site], dense.posterior[site]
        np.testing.assert_allclose(np.ravel(p.mean), np.ravel(q.mean), rtol=1e-7, atol=1e-9)
        np.testing.assert_allclose(np.ravel(p.variance), np.ravel(q.variance), rtol=1e-6)
    np.testing.assert_allclose(float(arrow.elbo[-1]), float(dense.elbo[-1]), rtol=1e-10)


def test_monte_carlo_factors_fall_back_to_mean_field(monkeypatch):
    """A Student-t with latent degrees of freedom, location and scale reads three projections
    per element: Monte Carlo, which the arrowhead's view cannot serve. The structure was
    found; the compiler compiles again without it (the blocks of before: one per site)."""
    from blrppl.compiler import structure as compile_mod

    def model(group, y=None):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        d = numpyro.sample("d", dist.Normal(1.5, 0.5))
        s = numpyro.sample("s", dist.Normal(0.0, 1.0))
        with numpyro.plate("groups", 120):
            a = numpyro.sample("a", dist.Normal(0.0, 1.0))
        with numpyro.plate("obs", len(group)):
            numpyro.sample("y", dist.StudentT(jnp.exp(d), mu + a[group], jnp.exp(s)), obs=y)

    rng = np.random.default_rng(4)
    group = rng.integers(0, 120, 800)
    monkeypatch.setattr(compile_mod, "JOINT_MAX_DIM", 100)
    plan = plan_of(model, {"group": group, "y": rng.normal(size=120)[group] + rng.standard_t(5, size=800)})
    assert [b.name for b in plan.blocks] == ["mu", "d", "s", "a"], plan.describe()
    assert next(f for f in plan.factors if f.name == "y").estimator == "monte_carlo"


def test_a_param_keeps_its_block_when_the_structure_falls_back(monkeypatch):
    """The fallback from an arrowhead whose factor is Monte Carlo chooses the structure again:
    a ``numpyro.param`` the likelihood reads keeps its point block (the compilation run again
    from the start dropped the params: ``c`` stayed at its initial value, never fitted)."""
    from blrppl.compiler import structure as compile_mod

    def model(group, y=None):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        d = numpyro.sample("d", dist.Normal(1.5, 0.5))
        s = numpyro.sample("s", dist.Normal(0.0, 1.0))
        c = numpyro.param("c", 0.5)
        with numpyro.plate("groups", 120):
            a = numpyro.sample("a", dist.Normal(0.0, 1.0))
        with numpyro.plate("obs", len(group)):
            numpyro.sample("y", dist.StudentT(jnp.exp(d), mu + c + a[group], jnp.exp(s)), obs=y)

    rng = np.random.default_rng(4)
    group = rng.integers(0, 120, 800)
    monkeypatch.setattr(compile_mod, "JOINT_MAX_DIM", 100)
    plan = plan_of(model, {"group": group, "y": rng.normal(size=120)[group] + rng.standard_t(5, size=800)})
    assert [b.name for b in plan.blocks] == ["mu", "d", "s", "c", "a"], plan.describe()
    assert next(b for b in plan.blocks if b.name == "c").param
    assert "c" in next(f for f in plan.factors if f.name == "y").neighbours
