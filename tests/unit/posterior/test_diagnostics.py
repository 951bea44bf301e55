"""PSIS k̂ on every fit (``blrppl/posterior/diagnostics.py``): the estimator on weights with a known tail,
and the fits it must pass (exact and close posteriors) and flag (a funnel, a multimodal
posterior q cannot hold)."""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.contrib.control_flow import scan

import reference_models as rm
from blrppl import blr_fit
from blrppl.api import plan_of
from blrppl.posterior.diagnostics import (
    ESS_CLOSE, ESS_POOR, KHAT_WARN, NUM_DRAWS, VMAP_ALL, draws_at_once, num_draws, psis_khat, relative_ess,
)
from blrppl.engine.advice import poor_q_advice

numpyro.enable_x64()


@pytest.mark.parametrize("var, low, high", [(0.5, -3.0, 0.5), (5.0, 0.7, 2.0)])
def test_khat_of_a_known_tail(var, low, high):
    """x ~ q = N(0, 1) weighted to p = N(0, var): q wider than p gives bounded weights (k̂ well
    below 0.5), q narrower than p (var = 5) unbounded ones with a heavy tail (k̂ > 0.7; the
    estimate agrees with arviz.psislw to rounding). As many draws as a fit uses, fixed seed."""
    x = np.random.default_rng(0).normal(size=NUM_DRAWS)
    log_w = -0.5 * x**2 / var + 0.5 * x**2
    assert low < psis_khat(log_w) < high


def test_khat_edge_cases():
    assert psis_khat(np.zeros(NUM_DRAWS)) == -math.inf  # q is the posterior
    assert psis_khat(np.full(NUM_DRAWS, 3.0) + 1e-12 * np.arange(NUM_DRAWS)) == -math.inf
    bad = np.zeros(NUM_DRAWS)
    bad[3] = np.nan
    assert psis_khat(bad) == math.inf


@pytest.mark.parametrize(
    "log_weights, ess",
    [
        (np.zeros(10), 1.0),  # equal weights
        (np.array([0.0] + [-1e4] * 9), 0.1),  # one of ten dominates
        (np.log([1.0, 1.0, 2.0, 2.0]), 36.0 / (4 * 10.0)),  # (Σw)² / (S Σw²) = 6² / (4 · 10)
        (np.log([3.0, 1.0]) + 50.0, 16.0 / (2 * 10.0)),  # shifted: only ratios count
        (np.array([0.0, np.nan]), math.nan),
        (np.array([0.0, np.inf]), math.nan),
    ],
)
def test_relative_ess_table(log_weights, ess):
    got = relative_ess(log_weights)
    if math.isnan(ess):
        assert math.isnan(got)
    else:
        assert got == pytest.approx(ess, rel=1e-12)


def test_heavy_tail_of_nearly_equal_weights_is_a_note_not_a_warning():
    """A Normal with unknown mean and HalfNormal scale (100 points): the Gaussian on log s is
    nearly exact (every importance weight within a few % of the others: relative ESS ≥ 0.95),
    yet the Pareto fit to the largest of them gives k̂ > 0.7. The fit does not warn; its
    message gives k̂ and the ESS."""
    def model(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        s = numpyro.sample("s", dist.HalfNormal(2.0))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu, s), obs=y)

    y = np.random.default_rng(0).normal(1.0, 1.5, size=100)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        result = fit(model, {"y": y}, rng_key=random.PRNGKey(0))
    d = result.diagnostics
    assert d.khat > KHAT_WARN and d.ess >= ESS_CLOSE, d
    assert "k-hat" in result.message and "effective" in result.message
    assert "relative ESS" in d.describe()


eight_schools = rm.eight_schools_model  # (NumPyro's README model, centred)


def eight_schools_noncentred(J, sigma, y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
    with numpyro.plate("J", J):
        z = numpyro.sample("z", dist.Normal(0.0, 1.0))
        numpyro.sample("obs", dist.Normal(mu + tau * z, sigma), obs=y)


SCHOOLS = rm.EIGHT_SCHOOLS


def test_a_bulk_too_narrow_warns_though_khat_is_below_its_threshold(monkeypatch):
    """The centred eight schools: a Gaussian on log τ fitted with θ (τ's sd 0.34× NUTS', no
    mass near τ = 0) has importance weights of which few are effective (a relative ESS of
    0.005–0.25 over twelve draw keys), with a k̂ that draws put on either side of 0.7 (0.58–1.26,
    median 0.8). With k̂ below 0.7 (as two keys in twelve drew it) the fit still warns, naming
    the ESS and how far a mean may be. The non-centred form, whose q is close (τ's sd within
    20 % of NUTS'), does not."""
    from blrppl.engine import run as run_module

    with pytest.warns(UserWarning, match="poor approximation"):
        # (the first fit's own flag: refined, its kept grid is judged as the grid's mixture and is good)
        result = fit(eight_schools, SCHOOLS, rng_key=random.PRNGKey(0), refine=False)
    assert result.diagnostics.ess < ESS_POOR, result.diagnostics
    monkeypatch.setattr(run_module, "psis_khat", lambda log_weights: 0.58)
    with pytest.warns(UserWarning, match="draws effective") as record:
        result = fit(eight_schools, SCHOOLS, rng_key=random.PRNGKey(0), refine=False)
    d = result.diagnostics
    assert d.khat <= KHAT_WARN and d.ess < ESS_POOR, d
    assert "of q's sds" in str(record[0].message)
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        result = fit(eight_schools_noncentred, SCHOOLS, rng_key=random.PRNGKey(0))
    assert result.diagnostics.ess >= ESS_POOR


def fit(model, data, **kw):
    kw.setdefault("progress_bar", False)
    return blr_fit(model, data, **kw)


def test_exact_conjugate_fit_has_no_tail():
    """One conjugate block: exact in one step, k̂ = −∞ without drawing."""
    def model(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", len(y)):
            numpyro.sample("obs", dist.Normal(mu, 1.0), obs=y)

    result = fit(model, {"y": np.array([0.3, 1.2, 0.8])})
    d = result.diagnostics
    assert d.khat == -math.inf and d.num_draws == 0
    assert d.rejected_steps == 0 and d.elbo_noise == 0.0


def test_exact_factorised_fit_has_constant_weights():
    """Two conjugate blocks with separate data: the posterior factorises, so the mean-field q
    found by the fit is exact and the drawn importance weights are all equal (k̂ = −∞ from
    NUM_DRAWS draws: the weights are computed, not skipped)."""
    def model(y, z):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        tau = numpyro.sample("tau", dist.Gamma(2.0, 1.0))
        with numpyro.plate("data", len(y)):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)
            numpyro.sample("z", dist.Poisson(tau), obs=z)

    result = fit(model, {"y": np.array([0.3, 1.2, 0.8]), "z": np.array([2.0, 0.0, 5.0])})
    d = result.diagnostics
    assert result.converged
    assert d.khat == -math.inf and d.num_draws == NUM_DRAWS


def test_logistic_regression_q_is_close():
    """N = 500: k̂ at the fit's key; over other diagnostic keys it spreads over 0.3–0.65 (the
    estimate's Monte Carlo noise at 1000 draws)."""
    model, data = rm.get("logistic")
    result = fit(model, data, rng_key=random.PRNGKey(0))
    assert result.diagnostics.khat <= 0.5, result.diagnostics


def test_funnel_is_flagged():
    """Neal's funnel (no data): a Gaussian q misses its neck; k̂ 0.87 at the fit's key (0.6–1.1
    over other diagnostic keys)."""
    def funnel():
        v = numpyro.sample("v", dist.Normal(0.0, 3.0))
        numpyro.sample("x", dist.Normal(0.0, jnp.exp(v / 2)).expand([9]).to_event(1))

    with pytest.warns(UserWarning, match="poor approximation"):
        result = fit(funnel, None, refine=False)
    assert result.diagnostics.khat > KHAT_WARN and result.diagnostics.ess < ESS_CLOSE
    assert "k-hat" in result.message


def test_only_the_kept_start_warns():
    """With ``num_starts`` the fit warns once, of the start it keeps (the funnel's q is poor
    from every start: each start's own warning was printed before, three for one fit)."""
    def funnel():
        v = numpyro.sample("v", dist.Normal(0.0, 3.0))
        numpyro.sample("x", dist.Normal(0.0, jnp.exp(v / 2)).expand([9]).to_event(1))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fit(funnel, None, num_starts=3, refine=False)  # (the starts' warnings, not the refinement's)
    poor = [str(w.message) for w in caught if "poor approximation" in str(w.message)]
    assert "best of 3 starts" in result.message
    assert len(poor) == 1, poor
    assert f"{result.diagnostics.khat:.2f}" in poor[0]


def test_summary_prints_the_diagnostics(capsys):
    model, data = rm.get("poisson")
    result = fit(model, data)
    result.summary(num_samples=100)
    out = capsys.readouterr().out
    assert "PSIS k-hat" in out and "rejected steps" in out and result.message in out


def test_prior_only_multimodal_model_is_flagged():
    """A four-component mixture prior with no data: its posterior (the prior) has four modes
    q cannot hold (k̂ ≈ 1.1–1.7 over diagnostic keys)."""
    model = rm.DIAGNOSTIC_MODELS["prior_mixture"][0]
    with pytest.warns(UserWarning, match="poor approximation"):
        result = fit(model, None, refine=False)
    assert result.diagnostics.khat > KHAT_WARN


def test_draws_are_budgeted_by_the_enumerated_evaluations():
    """A mixture with K = 40 components and N·D = 20,000 data evaluates each element at the 40
    values of its label: 100 draws (not 1000), 5 at a time (5 × 40 × 20,000 ≤ VMAP_ALL), where
    the 1,000 draws 50 at a time of the unenumerated count held 7 GB in the bench's mixture."""
    data = {"X": np.zeros((2000, 10))}
    assert num_draws(data) == 1000
    assert num_draws(data, enumerated=40) == 100
    assert draws_at_once(20_000 * 40, 100) == 5 and 5 * 20_000 * 40 <= VMAP_ALL
    assert draws_at_once(10, 1000) == 1000  # small models: every draw at once


@pytest.mark.parametrize(
    "shape, work, draws",
    [
        ((500, 20), 1, 1000),  # 10⁴ elements: every draw
        ((500, 20), 11, 900),  # X @ C.T with D = 10: 1.1·10⁵ per draw, 10⁸ // 1.1·10⁵ = 909 → 900
        ((2000, 100), 1, 500),  # 2·10⁵ elements
        ((2000, 100), 41, 100),  # D = 40: 8.2·10⁶ per draw, 12 affordable: the floor of 100
    ],
)
def test_draws_are_budgeted_by_the_work_of_an_element(shape, work, draws):
    assert num_draws({"Y": np.zeros(shape)}, 1, work) == draws


def cjs(capture_history):
    """Cormack–Jolly–Seber with a survival probability per occasion, written as NumPyro's
    capture–recapture example writes it (``scan``, an enumerated survival state per animal and
    occasion, masked before the first capture)."""
    n, _ = capture_history.shape
    rho = numpyro.sample("rho", dist.Uniform(0.0, 1.0))

    def transition(carry, y):
        first_capture_mask, z = carry
        phi_t = numpyro.sample("phi", dist.Uniform(0.0, 1.0))
        with numpyro.plate("animals", n, dim=-1):
            with numpyro.handlers.mask(mask=first_capture_mask):
                mu_z_t = first_capture_mask * phi_t * z + (1 - first_capture_mask)
                z = numpyro.sample("z", dist.Bernoulli(dist.util.clamp_probs(mu_z_t)), infer={"enumerate": "parallel"})
                numpyro.sample("y", dist.Bernoulli(dist.util.clamp_probs(rho * z)), obs=y)
        return (first_capture_mask | y.astype(bool), z), None

    first = capture_history[:, 0].astype(bool)
    scan(transition, (first, jnp.ones(n, dtype=jnp.int64)), jnp.swapaxes(capture_history[:, 1:], 0, 1))


def test_poor_q_advice_counts_only_blocks_a_joint_block_could_hold():
    """The advice for a Monte Carlo factor over blocks kept apart by the 64-scalar joint limit
    counts the Gaussian blocks it reads, not an enumerated chain next to them: the survival
    states (560 of them) beside 8 probabilities are no joint block that ran off. (The advice
    said 'reads 568 scalars in blocks fitted apart … at most 64 scalars'.)"""
    h = (np.random.default_rng(0).random((80, 8)) < 0.4).astype(np.int64)
    plan = plan_of(cjs, (h,), rng_key=random.PRNGKey(0))
    assert plan.block("z").chain and dict((f.name, f.estimator) for f in plan.factors)["z"] == "monte_carlo"
    assert "fitted apart" not in poor_q_advice(plan), poor_q_advice(plan)


def _two_poisson_coefficient_vectors(X, y):
    w1 = numpyro.sample("w1", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    w2 = numpyro.sample("w2", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("N", X.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.exp(X @ w1 + X[:, ::-1] @ w2)), obs=y)


def _poisson_and_beta(X, y, c):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    p = numpyro.sample("p", dist.Beta(1.0, 1.0))
    with numpyro.plate("N", X.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.exp(X @ w)), obs=y)
        numpyro.sample("c", dist.Bernoulli(p), obs=c)


_rng = np.random.default_rng(1)
_X, _counts, _flags = 0.1 * _rng.normal(size=(60, 4)), _rng.poisson(1.0, 60).astype(float), (_rng.random(60) < 0.3) * 1.0


@pytest.mark.parametrize(
    "model, args, structure, joint_advised",
    [
        # (two dense Gaussian blocks kept apart: structure='joint' would merge them)
        (_two_poisson_coefficient_vectors, (_X, _counts), "mean-field", True),
        # (the same model fitted with structure='joint': one block, nothing left to join)
        (_two_poisson_coefficient_vectors, (_X, _counts), "joint", False),
        # (one dense Gaussian beside a Beta: structure='joint' merges Gaussian blocks only)
        (_poisson_and_beta, (_X, _counts, _flags), None, False),
    ],
)
def test_generic_poor_q_advice_offers_structure_joint_only_when_it_would_join_blocks(
    model, args, structure, joint_advised
):
    """The generic advice suggested structure='joint' to a user who had passed it (and to a plan
    with one Gaussian block, which it leaves as it is). Plans only: no fit."""
    options = {} if structure is None else {"structure": structure}
    plan = plan_of(model, args, rng_key=random.PRNGKey(0), **options)
    advice = poor_q_advice(plan)
    assert advice.startswith("compare with NUTS, or try "), advice  # (the generic advice)
    assert ("structure='joint'" in advice) == joint_advised, (advice, [b.name for b in plan.blocks])
    # (one start: several are offered, as other families; a fit from several is not sent there again)
    assert "other families=" in advice and "num_starts=4" in advice, advice
    again = poor_q_advice(plan, num_starts=4)
    assert "num_starts" not in again and again.endswith("other families="), again


def test_noise_of_a_window_with_an_infinite_elbo_is_nan_without_numpy_warnings():
    """A Monte Carlo fit whose last ELBOs include −∞ (an enumerated value of probability 0):
    numpy's 'invalid value encountered in subtract' (∞ − ∞ in np.std) reached the user."""
    from types import SimpleNamespace

    from blrppl.engine import run as run_module

    prepared = SimpleNamespace(
        bundle=SimpleNamespace(window=4, log_weights_fn=None), plan=SimpleNamespace(subsampled=("n",))
    )
    outcome = SimpleNamespace(elbo=np.array([-5.0, -4.0, -np.inf, -3.0, -np.inf]), rejected_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        diagnostics = run_module._diagnose(prepared, outcome, None)
    assert math.isnan(diagnostics.elbo_noise) and math.isnan(diagnostics.elbo_rel_change)
    outcome.elbo = np.array([-5.0, -4.0, -3.5, -3.0, -3.25])
    assert run_module._diagnose(prepared, outcome, None).elbo_noise == pytest.approx(np.std([-4.0, -3.5, -3.0, -3.25]))


@pytest.mark.parametrize(
    "elbo, fell_from",
    [
        # (a poor start whose Monte Carlo steps drift away: NumPyro's mortality example, one seed)
        ([-2.02e8, -1.17e9, -9.9e8, -2.4e11, -9.1e13, -2.35e38, -2.35e38], "-2.02e+08 (step 1)"),
        ([-50.0, -40.0, -9e3], "-40 (step 2)"),  # (|best| < 100: the fall must pass 1,000)
        ([-1200.0, -1100.0, -1150.0, -1120.0], None),  # Monte Carlo noise
        ([-50.0, -40.0, -900.0], None),  # less than max(|best|, 100) × 10 below
        ([-2e8, -1e9, -np.inf], None),  # (a last step that is not finite is the stop message's)
        ([-np.inf, -3.0], None),
        ([-3.0], None),
    ],
)
def test_divergence_note_compares_the_last_elbo_with_the_best(elbo, fell_from):
    from blrppl.engine.advice import divergence_note

    note = divergence_note(np.array(elbo))
    if fell_from is None:
        assert note is None
    else:
        assert f"fell from {fell_from}" in note and "mc_curvature='reparam'" in note


def test_a_fit_whose_elbo_ran_away_warns_that_it_diverged(monkeypatch):
    """The outcome of the steps given a diverging ELBO path: the result's message and a
    warning at the caller's line say so."""
    from blrppl.engine import run as run_module

    real = run_module.run_loop

    def diverging(*args, **kwargs):
        outcome = real(*args, **kwargs)
        return outcome._replace(elbo=np.array([-12.0, -11.0, -3e5]), num_steps=3)

    monkeypatch.setattr(run_module, "run_loop", diverging)

    def model(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    with pytest.warns(UserWarning, match=r"diverged: its ELBO fell from -11 \(step 2\) to -3e\+05") as record:
        result = blr_fit(model, (np.array([0.3, -0.2, 1.1]),), rng_key=random.PRNGKey(0), progress_bar=False)
    assert "diverged" in result.message and not result.converged
    assert any(w.filename == __file__ for w in record if "diverged" in str(w.message))



def _normal_mean(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def test_a_fit_whose_blocks_stopped_updating_is_not_converged(monkeypatch):
    """A run that met its convergence test while its block found no valid update in most of
    its last steps (its parameters kept, so the ELBO stood still): not converged, and the
    message and a warning say what failed."""
    from blrppl.engine import run as run_module

    real = run_module.run_loop

    def stalled(*args, **kwargs):
        outcome = real(*args, **kwargs)
        valid = np.ones(30, bool)
        valid[-15:] = False
        valid[-1] = True
        return outcome._replace(elbo=np.full(30, -12.0), num_steps=30, valid=valid, invalid_steps=14)

    monkeypatch.setattr(run_module, "run_loop", stalled)
    with pytest.warns(UserWarning, match="in 14 of the last 20 steps a block found no valid update"):
        result = blr_fit(_normal_mean, (np.array([0.3, -0.2, 1.1]),), rng_key=random.PRNGKey(0), progress_bar=False)
    assert not result.converged
    assert result.message.startswith("met the convergence test after 30 steps"), result.message
    assert "not converged" in result.message


def test_a_fit_with_an_infinite_khat_is_not_converged(monkeypatch):
    """PSIS k̂ = ∞ from weights that are not finite at some draws of q (so is their ESS): the
    fit is not converged and its message says why."""
    from blrppl.engine import run as run_module

    monkeypatch.setattr(run_module, "psis_khat", lambda log_weights: math.inf)
    monkeypatch.setattr(run_module, "relative_ess", lambda log_weights: math.nan)
    monkeypatch.setattr(run_module, "one_exact_block", lambda plan: False)  # (k̂ is drawn, not −∞ by rule)
    with pytest.warns(UserWarning, match="PSIS k-hat is infinite"):
        result = blr_fit(_normal_mean, (np.array([0.3, -0.2, 1.1]),), rng_key=random.PRNGKey(0), progress_bar=False)
    assert not result.converged
    assert "not converged: PSIS k-hat is infinite" in result.message

def _walk_with_unknown_step(y):
    step = numpyro.sample("step", dist.HalfNormal(1.0))
    x = numpyro.sample("x", dist.GaussianRandomWalk(step, num_steps=len(y)))
    numpyro.sample("y", dist.Normal(x, 0.5), obs=y)


def _volatility_scan(returns):
    mu = numpyro.sample("mu", dist.Normal(-9.0, 2.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))

    def step(h_prev, r):
        h = numpyro.sample("h", dist.Normal(mu + 0.95 * (h_prev - mu), sigma))
        numpyro.sample("r", dist.Normal(0.0, jnp.exp(h / 2.0)), obs=r)
        return h, None

    scan(step, mu, returns)


def _loop_walk(y):
    s = numpyro.sample("s", dist.Exponential(1.0))
    x = 0.0
    for t in range(len(y)):
        x = numpyro.sample(f"x_{t}", dist.Normal(x, s))
        numpyro.sample(f"y_{t}", dist.Normal(x, 1.0), obs=y[t])


def _noise_scale_only(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("n", len(y)):
        numpyro.sample("y", dist.Normal(mu, sigma), obs=y)


def _few_groups(y):
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    with numpyro.plate("g", 3):
        a = numpyro.sample("a", dist.Normal(0.0, tau))
    numpyro.sample("y", dist.Normal(a[jnp.arange(len(y)) % 3], 1.0), obs=y)


def _baseball_partially_pooled(at_bats, hits=None):
    # (NumPyro's baseball example as written there: Beta abilities pooled by m and κ)
    m = numpyro.sample("m", dist.Uniform(0, 1))
    kappa = numpyro.sample("kappa", dist.Pareto(1, 1.5))
    num_players = at_bats.shape[0]
    with numpyro.plate("num_players", num_players):
        phi_prior = dist.Beta(m * kappa, (1 - m) * kappa)
        phi = numpyro.sample("phi", phi_prior)
        return numpyro.sample("obs", dist.Binomial(at_bats, probs=phi), obs=hits)


def _dirichlet_pool(counts):
    alpha = numpyro.sample("alpha", dist.Gamma(2.0, 0.5))
    with numpyro.plate("g", counts.shape[0]):
        p = numpyro.sample("p", dist.Dirichlet(alpha * jnp.array([0.5, 0.3, 0.2])))
        numpyro.sample("y", dist.Multinomial(20, p), obs=counts)


def _gamma_pool(y, shape=True):
    a = numpyro.sample("a", dist.Exponential(1.0)) if shape else 2.0
    b = numpyro.sample("b", dist.Exponential(1.0))
    with numpyro.plate("g", len(y)):
        lam = numpyro.sample("lam", dist.Gamma(a, b))
        numpyro.sample("y", dist.Poisson(lam), obs=y)


def _softplus_scale(y):
    # (a scale no closed form reads: the prior of x is fitted by Monte Carlo or quadrature)
    s = numpyro.sample("s", dist.Normal(0.0, 1.0))
    with numpyro.plate("g", len(y)):
        x = numpyro.sample("x", dist.Normal(0.0, jax.nn.softplus(s) + 0.1))
        numpyro.sample("y", dist.Normal(x, 1.0), obs=y)


def _neal_funnel(dim=10):
    # (NumPyro's funnel example, centred, as it writes it: no data)
    y = numpyro.sample("y", dist.Normal(0, 3))
    numpyro.sample("x", dist.Normal(jnp.zeros(dim - 1), jnp.exp(y / 2)))


_ys = np.random.default_rng(0).normal(size=40)
_hits = np.array([18, 17, 16, 15, 14, 14, 13, 12, 11, 11, 10, 10, 10, 10, 10, 9, 8, 7])
_counts = np.random.default_rng(0).multinomial(20, [0.5, 0.3, 0.2], size=12)


@pytest.mark.parametrize(
    "model, args, named",
    [
        # (a latent scale of many latents' prior: the advice names both and the funnel)
        (_walk_with_unknown_step, (np.cumsum(_ys),), ("('step')", "40 latents of 'x'", "families={'step': 'grid'}")),
        (_volatility_scan, (0.01 * _ys,), ("('sigma')", "40 latents of 'h'", "families={'sigma': 'grid'}")),
        (eight_schools, SCHOOLS, ("8 latents of 'theta'", "('tau')", "families={'tau': 'grid'}")),
        (_loop_walk, (np.cumsum(_ys[:20]),), ("20 latents of 'x_0' … 'x_19'", "('s')", "families={'s': 'grid'}")),
        (_softplus_scale, (_ys[:12],), ("('s')", "12 latents of 'x'", "families={'s': 'grid'}")),
        (_neal_funnel, (), ("('y')", "9 latents of 'x'", "families={'y': 'grid'}")),
        # (a latent concentration: the latents' spread shrinks as it grows)
        (_baseball_partially_pooled, (np.full(18, 45), _hits),
         ("latent concentration ('m', 'kappa')", "18 latents of 'phi'", "families={'m': 'grid', 'kappa': 'grid'}")),
        (_dirichlet_pool, (_counts,), ("latent concentration ('alpha')", "families={'alpha': 'grid'}")),
        (_gamma_pool, (_hits,), ("latent concentration ('a')", "18 latents of 'lam'", "families={'a': 'grid'}")),
        # (a latent scale of observations only, or of fewer than 8 latents: no funnel; a
        # Gamma's latent rate only shifts its latents' logarithms)
        (_noise_scale_only, (_ys,), None),
        (_few_groups, (_ys,), None),
        (lambda y: _gamma_pool(y, shape=False), (_hits,), None),
    ],
)
def test_poor_q_advice_names_a_scale_of_many_latents_and_its_funnel(model, args, named):
    """A scale that the prior of many latents reads (a walk's step size, the spread of group
    effects, a volatility's shock size) and those latents form a funnel no Gaussian q holds:
    the poor-q advice says so and names them, instead of suggesting structure='joint' (which
    fits the random-walk reference no better: it ran off), and offers a grid for a scale
    that is a scalar site (in a block of its own, or the positive scalar member of the
    latents' joint block: eight schools' τ); a Beta's, Dirichlet's or Gamma's latent
    concentration alike, read off the prior's arguments when it has no closed form. Plans
    only: no fit."""
    advice = poor_q_advice(plan_of(model, args, rng_key=random.PRNGKey(0)))
    if named is None:
        assert "funnel" not in advice, advice
    else:
        assert "funnel" in advice and all(n in advice for n in named), advice
        assert "try structure='joint'" not in advice, advice
        assert ("'grid'" in advice) == any("grid" in n for n in named), advice
        # (not that the latents' marginals stay close: the funnel's x came out 0.03–0.11× its sd)
        assert "latent scale" not in advice or "and of the latents where the data say little" in advice, advice


def _two_component_mixture(y):
    w = numpyro.sample("w", dist.Dirichlet(jnp.ones(2)))
    with numpyro.plate("components", 2):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("n", y.shape[0]):
        z = numpyro.sample("z", dist.Categorical(w))
        numpyro.sample("y", dist.Normal(mu[z], 1.0), obs=y)


_SEPARATED = np.where(np.random.default_rng(0).random(100) < 0.4, -8.0, 8.0) + np.random.default_rng(1).normal(size=100)


def test_label_switching_alone_is_an_information_not_a_warning():
    """Two components 16 sds apart: every datum's component is certain, q is the posterior's
    copy for one labelling (k̂ = −∞ at q's draws, which the relabelled copy does not reach).
    The fit does not warn; its message says, as an information, that the relabelled copies
    are no poor fit."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        result = fit(_two_component_mixture, (_SEPARATED,), rng_key=random.PRNGKey(0))
    assert result.converged
    assert "relabelling" in result.message and "no poor fit" in result.message, result.message


def test_poor_q_advice_of_a_mixture_names_its_assignments_not_its_relabelling():
    """The cause the poor-q warning gives a closed-form mixture is its assignments fitted apart
    from its components (data between components do not widen them); relabelling is no cause,
    since k̂ is read at q's draws."""
    from blrppl.api import plan_of

    advice = poor_q_advice(plan_of(_two_component_mixture, (_SEPARATED,)))
    assert "relabelling" not in advice
    assert "assignments are fitted apart from its components" in advice
