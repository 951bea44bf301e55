"""Non-conjugate models against long-NUTS references (``tests/data/<model>.json``, made by
``tests/data/make_references.py`` from the models in ``tests/reference_models.py``).

Float64, fixed keys. Accuracy is measured in reference-sd units: |mean − mean_NUTS| / sd_NUTS
and sd / sd_NUTS per scalar parameter. Moments of Gaussian sites are exact; those of sites on
an unconstrained space come from 40 000 draws with a fixed key (Monte Carlo error ≈ 0.005 sd
on means and 0.4 % on sds).
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import reference_models as rm
from checks import assert_every_site_exports
from blrppl import blr_fit

numpyro.enable_x64()

DATA = pathlib.Path(__file__).parents[1] / "data"
NUM_DRAWS = 40_000
_FITS: dict = {}

# Library failures, measured at commit 38428a4 (float64, this file's keys).


def reference(name: str) -> dict:
    """Parameter name → (mean, sd) of the stored NUTS reference."""
    params = json.loads((DATA / f"{name}.json").read_text())["params"]
    return {k: (v["mean"], v["sd"]) for k, v in params.items()}


def reference_cov(name: str):
    """(parameter names, covariance matrix) of the stored NUTS reference."""
    cov = json.loads((DATA / f"{name}.json").read_text())["cov"]
    return cov["names"], np.asarray(cov["matrix"])


def fit(name: str):
    """The blr_fit result of a reference model (fitted once per test session): the fit's own
    estimators against NUTS, so without the refinement (``refine=False``) that would replace a
    poor q by another candidate (tests/integration/test_refine.py tests that)."""
    if name not in _FITS:
        model, data = rm.get(name)
        _FITS[name] = blr_fit(model, data, rng_key=jax.random.key(0), progress_bar=False, refine=False)
        assert_every_site_exports(_FITS[name], model, data)
    return _FITS[name]


def posterior_moments(result) -> dict:
    """Parameter name → (mean, sd) of a fit, named like the references."""
    means, sds, draws = {}, {}, {}
    for k, (site, d) in zip(jax.random.split(jax.random.key(1), len(result.posterior)), result.posterior.items()):
        if isinstance(d, dist.TransformedDistribution):
            draws[site] = d.sample(k, (NUM_DRAWS,))
        else:
            means[site], sds[site] = np.asarray(d.mean)[None], np.sqrt(np.asarray(d.variance))[None]
    out = {k: (float(np.mean(v)), float(np.std(v))) for k, v in rm.flatten(draws).items()}
    m, s = rm.flatten(means), rm.flatten(sds)
    out.update({k: (float(m[k][0]), float(s[k][0])) for k in m})
    return out


def errors(name: str):
    """(|mean error| / sd per parameter, sd ratio per parameter)."""
    ref, est = reference(name), posterior_moments(fit(name))
    assert set(ref) <= set(est), f"fit lacks reference parameters {set(ref) - set(est)}"
    err = {k: abs(est[k][0] - m) / s for k, (m, s) in ref.items()}
    ratio = {k: est[k][1] / s for k, (_, s) in ref.items()}
    return err, ratio


def _fmt(d):
    return ", ".join(f"{k}={v:.3f}" for k, v in d.items())


def assert_means(name, tol):
    err, _ = errors(name)
    assert max(err.values()) <= tol, f"{name}: |mean error|/sd above {tol}: {_fmt(err)}"


def assert_sds(name, rel):
    _, ratio = errors(name)
    bad = {k: r for k, r in ratio.items() if abs(r - 1.0) > rel}
    assert not bad, f"{name}: sd ratio outside 1 ± {rel}: {_fmt(ratio)}"


def assert_converged(result):
    """Converged, with finite ELBOs, and (for deterministic ELBOs) not at a state far below
    the best ELBO the run reached: convergence is not claimed after a collapse."""
    assert result.converged, result.message
    elbo = np.asarray(result.elbo)
    assert np.all(np.isfinite(elbo)), elbo
    best = float(np.max(elbo))
    assert elbo[-1] >= best - 1e-3 * abs(best) - 1e-6, (
        f"claims convergence at ELBO {elbo[-1]:.6g}, below the run's best {best:.6g}: {result.message}"
    )


def likelihood_factor(result, site="y"):
    (factor,) = [f for f in result.plan.factors if f.name == site]
    return factor


#: references whose smallest ESS is below 5000: stochastic volatility's σ mixes slowly against
#: the 2,000 states (4 × 15,000 draws, 13 min); ESS 1544 leaves a Monte Carlo error of 0.025 sd on
#: its means and 1.8 % on its sds, far inside the tolerances its test uses (0.1 sd, 20 %)
MIN_ESS = {"stochastic_volatility": 1500, "student_t_volatility": 1500}


def test_references_are_float64_and_converged():
    assert jnp.result_type(float) == jnp.float64
    for name in rm.MODELS:
        nuts = json.loads((DATA / f"{name}.json").read_text())["nuts"]
        ess = MIN_ESS.get(name, 5000)
        assert nuts["max_rhat"] < 1.01 and nuts["min_ess"] > ess and nuts["divergences"] == 0, (name, nuts)


# ------------------------------------------------------------------ GLMs (quadrature)


@pytest.mark.parametrize("name", ["logistic", "poisson"])
def test_glm_means(name):
    assert_means(name, 0.1)


@pytest.mark.parametrize("name", ["logistic", "poisson"])
def test_glm_sds(name):
    assert_sds(name, 0.15)


@pytest.mark.parametrize("name, estimator", [("logistic", "quadrature"), ("poisson", "exact")])
def test_glm_converges_fast(name, estimator):
    """Logistic: quadrature of the Bernoulli likelihood; Poisson: the log link's closed form
    E[exp(η)] = exp(m + v/2) (a log-normal rate)."""
    result = fit(name)
    assert likelihood_factor(result).estimator == estimator, result.plan.describe()
    assert_converged(result)
    assert result.num_steps <= 50, result.message


# ------------------------------------------------------------------ robust regression


def test_student_t_means():
    assert_means("student_t", 0.1)


def test_student_t_converges():
    assert_converged(fit("student_t"))


def test_student_t_vague_priors_converges():
    """The same regression with Normal(0, 1e4) / HalfNormal(1e4) priors: the posterior
    hardly changes, but the first steps start far from it."""
    assert_converged(fit("student_t_vague"))


def test_student_t_vague_priors_means():
    assert_means("student_t_vague", 0.1)


def _scale_model(y=None):
    sigma = numpyro.sample("sigma", dist.HalfNormal(10.0))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Normal(0.0, sigma), obs=y)


def test_normal_scale_with_small_data():
    """sigma ~ HalfNormal(10), y ~ Normal(0, sigma) with data of sd 0.1: σ's closed-form
    Gamma block against the exact posterior (a 1-D grid)."""
    y = 0.1 * np.random.default_rng(0).normal(size=100)
    result = blr_fit(_scale_model, {"y": y}, rng_key=jax.random.key(0), progress_bar=False)
    grid = np.linspace(1e-3, 0.5, 200_001)
    logp = -0.5 * (grid / 10.0) ** 2 - y.size * np.log(grid) - 0.5 * np.sum(y**2) / grid**2
    w = np.exp(logp - logp.max())
    w /= w.sum()
    mean = float(np.sum(w * grid))
    sd = float(np.sqrt(np.sum(w * (grid - mean) ** 2)))
    q = result.posterior["sigma"]
    est_mean, est_sd = float(q.mean), float(np.sqrt(q.variance))
    assert result.converged, result.message
    assert abs(est_mean - mean) / sd <= 0.1, (est_mean, mean, sd, result.message)
    assert abs(est_sd / sd - 1.0) <= 0.15, (est_sd, sd)


# ------------------------------------------------------------- a long chain of states


def assert_chain_matches_nuts(name, site, length, sd_rel, mean_tol=0.1):
    """The reference model's chain ``site`` got a banded block, the fit converged, and each of
    its ``length`` states has its mean within ``mean_tol`` NUTS sd and its sd within
    ``sd_rel`` of NUTS's."""
    result = fit(name)
    assert result.plan.block(site).family.banded, result.plan.describe()
    assert_converged(result)
    err, ratio = errors(name)
    states = [k for k in err if k.startswith(f"{site}[")]
    assert len(states) == length
    assert max(err[k] for k in states) <= mean_tol, _fmt({k: err[k] for k in states if err[k] > mean_tol})
    bad = {k: ratio[k] for k in states if abs(ratio[k] - 1.0) > sd_rel}
    assert not bad, _fmt(bad)


def test_random_walk_states_match_nuts():
    """600 states (a banded block: longer than any dense one), 120 of them unobserved, with
    unknown step and noise scales: every state's mean within 0.1 NUTS sd and its sd within
    10 % (the issue's bar for chains)."""
    assert_chain_matches_nuts("random_walk", "x", 600, sd_rel=0.1)


def test_random_walk_scales_match_nuts_in_the_mean():
    """The scales' means are close to NUTS; their sds are not (the step scale and the 600
    states form a funnel no Gaussian q holds: docs/limitations.md), so only the means are held
    to 0.2 sd, and the fit's warning names the scale."""
    err, _ = errors("random_walk")
    assert err["s"] <= 0.2 and err["r"] <= 0.2, _fmt({k: err[k] for k in ("s", "r")})
    # (PSIS flags q, and the warning says why: the step scale and the 600 states form a funnel)
    assert "the 600 latents of 'x' have a latent scale ('s')" in fit("random_walk").message, fit("random_walk").message


def test_stochastic_volatility_matches_nuts():
    """2,000 days of returns with a log-volatility chain (persistence known): every factor is
    closed-form (the returns' scale exp(h/2) is log-normal) and h is banded. Every h_t's mean
    within 0.1 NUTS sd and its sd within 20 % (the issue's bar); μ's mean within 0.1 sd;
    σ's mean within 0.35 sd (its sd is too small: σ and the states form a funnel no Gaussian
    q holds, docs/limitations.md; the fit's warning names σ)."""
    assert all(f.estimator in ("exact", "quadrature") for f in fit("stochastic_volatility").plan.factors)
    assert_chain_matches_nuts("stochastic_volatility", "h", 2000, sd_rel=0.2)
    err, _ = errors("stochastic_volatility")
    assert err["mu"] <= 0.1 and err["sigma"] <= 0.35, _fmt({k: err[k] for k in ("mu", "sigma")})
    message = fit("stochastic_volatility").message
    assert "the 2000 latents of 'h' have a latent scale ('sigma')" in message, message


def test_numpyro_stochastic_volatility_example_matches_nuts():
    """NumPyro's own stochastic-volatility example (a random walk of log-scales, a Student-t
    with latent degrees of freedom) on 2,000 days: the returns' factor is a 2-D quadrature
    over (log nu, s_t), so s is a banded chain (it was a Monte Carlo factor and a dense
    2,000 × 2,000 block). Every s_t's mean within 0.1 NUTS sd and its sd within 20 % (the
    issue's bar; measured 0.06 sd and 0.91–1.00); nu's and sigma's means within 0.35 sd
    (measured 0.28 and 0.16: mean-field against the chain, their sds are 0.40 and 0.21 of
    NUTS', docs/limitations.md)."""
    r = likelihood_factor(fit("student_t_volatility"), "r")
    assert r.estimator == "quadrature" and [link for _, _, link in r.spec.links] == ["exp", "exp"]
    assert_chain_matches_nuts("student_t_volatility", "s", 2000, sd_rel=0.2)
    err, _ = errors("student_t_volatility")
    assert err["nu"] <= 0.35 and err["sigma"] <= 0.35, _fmt({k: err[k] for k in ("nu", "sigma")})


def test_numpyro_gp_example_matches_nuts():
    """NumPyro's Gaussian-process example (LogNormal(0, 10) priors on the kernel's variance,
    noise and length scale; 30 points): the priors' means are e⁵⁰, and a fit started there
    ran off to kernel variances of e⁴⁸ (ELBO −600, only k-hat warned). Started at the
    transform of the prior's base mean (e⁰), the log-scale means are within 0.25 NUTS sd and
    the sds within 35 % (a joint Gaussian on the log scale against NUTS' right-skewed log
    variance: measured 0.16 / 0.02 / 0.13 sd and 0.75 / 0.97 / 0.88 for var, noise, length)."""
    result = fit("gp_example")
    assert result.converged, result.message
    stored = json.loads((DATA / "gp_example.json").read_text())["log_params"]
    draws = result.sample(jax.random.key(1), NUM_DRAWS)
    for site, ref in stored.items():
        logs = np.log(np.asarray(draws[site]))
        assert abs(logs.mean() - ref["mean"]) < 0.25 * ref["sd"], (site, logs.mean(), ref)
        assert abs(logs.std() / ref["sd"] - 1) < 0.35, (site, logs.std(), ref)


def test_numpyro_gp_example_is_flagged_narrow_along_its_kernel_variance():
    """The GP example's first fit: PSIS k̂ 0.67 and a relative ESS of 0.56 pass q, yet NUTS'
    log kernel variance is right-skewed, its sd 1.27× q's (1.01 against 0.80). The narrow-q check
    (importance sampling from q widened along each kernel parameter) flags kernel_var alone, its
    estimate within 4 of its standard errors (and 10 %) of NUTS' ratio (q's sd from 40,000
    draws: 0.4 % Monte Carlo error), and the warning says so (measured 1.29 ± 0.03; noise 1.05,
    length 1.09 against NUTS' 1.03 and 1.10)."""
    result = fit("gp_example")
    d = result.diagnostics
    assert [w.site for w in d.narrow] == ["kernel_var"], d.describe()
    assert d.poor(), d.describe()
    stored = json.loads((DATA / "gp_example.json").read_text())["log_params"]
    draws = result.sample(jax.random.key(1), NUM_DRAWS)
    for w in d.widths:
        nuts = stored[w.site]["sd"] / float(np.std(np.log(np.asarray(draws[w.site]))))
        assert abs(w.ratio - nuts) < 4 * w.se + 0.1 * nuts, (w, nuts)
    assert "wider than q along 'kernel_var' 1.3×" in result.message, result.message


def test_item_response_matches_nuts():
    """400 abilities, 100 difficulties and a global mean (501 scalars, beyond the dense limit)
    read through 30,000 Bernoulli answers: one arrowhead block (the abilities diagonal). The
    mean and the per-item effects share an additive direction that a mean-field fit cannot
    hold (an sd off by a factor of 8 before); every mean within 0.1 NUTS sd and every sd
    within 10 % (the issue's bar)."""
    block = fit("item_response").plan.blocks[0]
    assert block.family.arrowhead and block.family.num_globals == 101, fit("item_response").plan.describe()
    assert_converged(fit("item_response"))
    assert_means("item_response", 0.1)
    assert_sds("item_response", 0.1)


def test_imputed_covariate_matches_nuts():
    """A logistic regression on a covariate imputed with ``obs_mask``: the likelihood
    multiplies the coefficient by the imputed entries (Monte Carlo). Every Gaussian in one
    dense block of 127 scalars, the fit ran off (the ELBO falling for 60 steps, coefficients
    of the wrong sign, steps slowing to seconds); a Monte Carlo factor's joint block is
    kept below ``MC_JOINT_MAX_DIM`` scalars. The globals and the missing entries: means
    within 0.25 NUTS sd (measured ≤ 0.1); the coefficients' and missing entries' sds within
    20 % (0.85-0.99); the group means' and their scale's sds at least half NUTS' (0.62-0.67:
    apart from the imputed entries they are fitted as if those were data)."""
    from blrppl.compiler.structure import MC_JOINT_MAX_DIM

    result = fit("imputed_logistic")
    assert result.converged, result.message
    # (its k-hat warns: the advice names the factor and does not send the user to the joint
    # block that ran off)
    assert "Monte Carlo factor 'y'" in result.message and "structure='joint'" not in result.message, result.message
    for b in result.plan.blocks:
        sampled = any(b.name in f.neighbours and f.estimator == "monte_carlo" for f in result.plan.factors)
        assert not (sampled and b.members and b.size > MC_JOINT_MAX_DIM), result.plan.describe()
    missing = np.flatnonzero(np.isnan(rm.imputed_logistic_data()["x"]))
    wanted = {"a", "b_x", "b_z", "x_sigma"} | {f"x_mu[{i}]" for i in range(3)}
    wanted |= {f"x_unobserved[{i}]" for i in missing}
    err, ratio = errors("imputed_logistic")
    err = {k: v for k, v in err.items() if k in wanted}
    ratio = {k: v for k, v in ratio.items() if k in wanted}
    assert len(err) == len(wanted)
    assert max(err.values()) <= 0.25, _fmt(err)
    grouped = {k for k in wanted if k.startswith("x_mu") or k == "x_sigma"}
    assert all(abs(r - 1.0) <= 0.2 for k, r in ratio.items() if k not in grouped), _fmt(ratio)
    assert all(0.5 <= ratio[k] <= 1.05 for k in grouped), _fmt(ratio)


# ------------------------------------------------------- draws across joint blocks


def _site(param: str) -> str:
    return param.split("[")[0]


@pytest.mark.parametrize(
    "name", ["logistic", "poisson", "student_t"]
)
def test_draws_keep_cross_site_correlation(name):
    """``result.sample`` draws the sites of a joint block together: the sd of x_i ± x_j for
    the most correlated pair of parameters of different sites matches the reference."""
    names, cov = reference_cov(name)
    sd = np.sqrt(np.diag(cov))
    corr = cov / np.outer(sd, sd)
    pairs = [(i, j) for i in range(len(names)) for j in range(i) if _site(names[i]) != _site(names[j])]
    i, j = max(pairs, key=lambda p: abs(corr[p]))
    sign = -np.sign(corr[i, j])  # the combination whose variance the correlation shrinks
    ref_sd = float(np.sqrt(cov[i, i] + cov[j, j] + 2 * sign * cov[i, j]))
    draws = rm.flatten(fit(name).sample(jax.random.key(3), NUM_DRAWS))
    est_sd = float(np.std(draws[names[i]] + sign * draws[names[j]]))
    label = f"{names[i]} {'+' if sign > 0 else '-'} {names[j]} (reference corr {corr[i, j]:.2f})"
    assert abs(est_sd / ref_sd - 1.0) <= 0.15, f"{name}: sd of {label}: {est_sd:.4g} vs reference {ref_sd:.4g}"


# -------------------------------------------- opaque factor and simplex (quadrature on a grid)


@pytest.mark.parametrize("name", ["factor", "simplex"])
def test_monte_carlo_models_converge(name):
    result = fit(name)
    assert result.converged, result.message
    assert np.all(np.isfinite(result.elbo))


@pytest.mark.parametrize("name", ["factor", "simplex"])
def test_monte_carlo_models_means(name):
    assert_means(name, 0.25)


def test_factor_term_is_in_the_plan():
    # (a factor of two scalars: the tensor Gauss–Hermite rule over them, not Monte Carlo)
    result = fit("factor")
    factor = likelihood_factor(result, "soft_constraint")
    assert factor.estimator == "quadrature" and not factor.spec.links


def test_simplex_draws_on_the_simplex():
    draws = fit("simplex").sample(jax.random.key(2), 1000)["p"]
    assert draws.shape == (1000, 3)
    np.testing.assert_allclose(np.sum(draws, -1), 1.0, atol=1e-10)
    assert np.all(draws >= 0)


# ------------------------------------------------------------- bad initialisation


def _logistic_scaled(X, y=None, prior_scale=1.0):
    b = numpyro.sample("intercept", dist.Normal(0.0, prior_scale))
    w = numpyro.sample("w", dist.Normal(0.0, prior_scale).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("n", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=b + X @ w), obs=y)


def _poisson_scaled(X, y=None, prior_scale=1.0):
    b = numpyro.sample("intercept", dist.Normal(0.0, prior_scale))
    w = numpyro.sample("w", dist.Normal(0.0, prior_scale).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("n", X.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.exp(b + X @ w)), obs=y)


def _robust_scaled(x, y=None, prior_scale=1.0):
    a = numpyro.sample("alpha", dist.Normal(0.0, prior_scale))
    b = numpyro.sample("beta", dist.Normal(0.0, prior_scale))
    s = numpyro.sample("sigma", dist.HalfNormal(prior_scale))
    with numpyro.plate("n", x.shape[0]):
        numpyro.sample("y", dist.StudentT(4.0, a + b * x, s), obs=y)


_BAD = {
    "logistic": (_logistic_scaled, rm.logistic_data),
    "poisson": (_poisson_scaled, rm.poisson_data),
    "robust": (_robust_scaled, rm.student_t_data),
}


def _finite(tree) -> bool:
    return all(bool(np.all(np.isfinite(np.asarray(x)))) for x in jax.tree.leaves(tree))


def bad_fit(name: str, scale: float):
    """ρ = 1 everywhere and a prior far from the data's scale (fitted once per session)."""
    if (name, scale) not in _FITS:
        model, data_fn = _BAD[name]
        _FITS[name, scale] = blr_fit(
            model, dict(data_fn(), prior_scale=scale), learning_rate=1.0, rng_key=jax.random.key(0), progress_bar=False
        )
    return _FITS[name, scale]


@pytest.mark.parametrize("scale", [1e4, 1e-4], ids=["wide", "narrow"])
@pytest.mark.parametrize("name", list(_BAD))
def test_bad_initialisation_never_nan(name, scale):
    """The fit returns finite parameters and either converges or says why it stopped."""
    result = bad_fit(name, scale)
    assert _finite(result.nat), result.nat
    assert np.all(np.isfinite(result.elbo)), result.elbo
    for site, d in result.posterior.items():
        assert _finite((d.mean, d.variance)), site
    assert result.converged or ("stopped" in result.message or "num_steps" in result.message), result.message


@pytest.mark.parametrize("scale", [1e4, 1e-4], ids=["wide", "narrow"])
@pytest.mark.parametrize("name", list(_BAD))
def test_bad_initialisation_no_false_convergence(name, scale):
    """Where such a fit claims convergence, it did not get there by collapsing: its last ELBO
    is (up to 0.1 %) the best it reached."""
    result = bad_fit(name, scale)
    if result.converged:
        assert_converged(result)

