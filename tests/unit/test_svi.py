"""BLR as a drop-in for numpyro's SVI: pipelines, autoguides, guides for Predictive."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import SVI, Predictive, Trace_ELBO
from numpyro.infer import autoguide as ag
from numpyro.infer.importance import psis_diagnostic

from blrppl import BLR, BLRError, UnsupportedGuideError, blr_fit
from blrppl.posterior.autoguides import low_rank

NOISE = 0.5
PRIOR_SD = 2.0


def linreg(x, y=None):
    """Conjugate linear regression (known noise): the posterior is exactly Gaussian."""
    w = numpyro.sample("w", dist.Normal(0.0, PRIOR_SD).expand([x.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, PRIOR_SD))
    with numpyro.plate("n", x.shape[0]):
        numpyro.sample("y", dist.Normal(x @ w + b, NOISE), obs=y)


def scaled_linreg(x, y=None):
    """Linear regression with an unknown noise scale (a constrained latent)."""
    w = numpyro.sample("w", dist.Normal(0.0, PRIOR_SD).expand([x.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, PRIOR_SD))
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with numpyro.plate("n", x.shape[0]):
        numpyro.sample("y", dist.Normal(x @ w + b, s), obs=y)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 3))
    y = x @ np.array([1.0, -1.0, 0.5]) + 0.3 + NOISE * rng.normal(size=60)
    return x, y


def exact_posterior(x, y):
    """Mean and covariance of (w, b) in the flat order [b, w] (numpyro's autoguides
    flatten sites in model order: w then b — the caller reorders)."""
    design = np.hstack([x, np.ones((len(x), 1))])
    prec = design.T @ design / NOISE**2 + np.eye(4) / PRIOR_SD**2
    cov = np.linalg.inv(prec)
    return cov @ design.T @ y / NOISE**2, cov, prec


def pipeline(make_svi, guide_cls, model, x, y, num_steps):
    """A pipeline as written for numpyro's SVI; only ``make_svi`` differs between runs."""
    guide = guide_cls(model)
    svi = make_svi(model, guide)
    svi_result = svi.run(jax.random.key(0), num_steps, x, y, progress_bar=False)
    params = svi_result.params
    predictive = Predictive(model, guide=guide, params=params, num_samples=50)
    y_pred = predictive(jax.random.key(1), x)["y"]
    draws = guide.sample_posterior(jax.random.key(2), params, sample_shape=(400,))
    summary = {k: (np.mean(v, 0), np.std(v, 0)) for k, v in draws.items()}
    return {
        "params": params,
        "shapes": {k: jnp.shape(v) for k, v in params.items()},
        "y_pred": y_pred,
        "median": guide.median(params),
        # AutoDelta has no quantiles in numpyro
        "quantiles": None if isinstance(guide, ag.AutoDelta) else guide.quantiles(params, [0.05, 0.5, 0.95]),
        "summary": summary,
        "losses": svi_result.losses,
        "state": svi_result.state,
    }


GUIDES = [
    ag.AutoNormal,
    ag.AutoDiagonalNormal,
    ag.AutoMultivariateNormal,
    ag.AutoLowRankMultivariateNormal,
    ag.AutoLaplaceApproximation,
    ag.AutoDelta,
]


def svi_params(guide_cls, model, x, y):
    """The params numpyro's SVI gives the same autoguide (names, shapes, constraints)."""
    svi = SVI(model, guide_cls(model), numpyro.optim.Adam(0.05), Trace_ELBO())
    return svi.get_params(svi.init(jax.random.key(0), x, y))


def test_pipeline_runs_with_svi_and_with_blr(data):
    """The same pipeline code, run once with SVI and once with BLR: same outputs' structure."""
    x, y = data
    with_svi = pipeline(
        lambda m, g: SVI(m, g, numpyro.optim.Adam(0.05), Trace_ELBO()), ag.AutoNormal, scaled_linreg, x, y, 300
    )
    with_blr = pipeline(lambda m, g: BLR(m, g), ag.AutoNormal, scaled_linreg, x, y, 1000)
    assert with_blr["shapes"] == with_svi["shapes"]
    assert with_blr["y_pred"].shape == with_svi["y_pred"].shape == (50, len(y))
    for key in ("median", "quantiles", "summary"):
        assert jax.tree.structure(with_blr[key]) == jax.tree.structure(with_svi[key])


@pytest.mark.parametrize("guide_cls", GUIDES, ids=lambda c: c.__name__)
def test_pipeline_runs_unchanged_with_identical_params(guide_cls, data):
    x, y = data
    with_blr = pipeline(lambda m, g: BLR(m, g), guide_cls, scaled_linreg, x, y, 1000)
    reference = svi_params(guide_cls, scaled_linreg, x, y)
    assert with_blr["shapes"] == {k: jnp.shape(v) for k, v in reference.items()}
    assert with_blr["y_pred"].shape == (50, len(y))
    assert set(with_blr["median"]) == {"w", "b", "s"}
    # the BLR fit is converged: the posterior median of b is near the least-squares intercept
    assert abs(float(with_blr["median"]["b"]) - 0.3) < 0.3
    assert np.all(np.isfinite(with_blr["losses"]))


def test_multivariate_normal_guide_is_the_exact_posterior(data):
    """Linear regression with known noise: AutoMultivariateNormal can represent the
    posterior, so BLR's fit is exact (float64)."""
    x, y = data
    mean, cov, _ = exact_posterior(x, y)
    guide = ag.AutoMultivariateNormal(linreg)
    res = BLR(linreg, guide).run(jax.random.key(0), 100, x, y, progress_bar=False)
    order = [0, 1, 2, 3]  # the autoguide flattens w then b, as the exact solution
    np.testing.assert_allclose(res.params["auto_loc"], mean[order], atol=1e-8)
    tril = res.params["auto_scale_tril"]
    np.testing.assert_allclose(tril @ tril.T, cov, atol=1e-8)


def test_normal_guide_is_the_mean_field_optimum(data):
    """For a Gaussian posterior N(m, P⁻¹) the best fully factorised Gaussian has mean m and
    variances 1/P_ii: AutoNormal's loc and scale must be those."""
    x, y = data
    mean, _, prec = exact_posterior(x, y)
    guide = ag.AutoNormal(linreg)
    res = BLR(linreg, guide, tol=1e-14).run(jax.random.key(0), 2000, x, y, progress_bar=False)
    np.testing.assert_allclose(res.params["w_auto_loc"], mean[:3], atol=1e-7)
    np.testing.assert_allclose(res.params["b_auto_loc"], mean[3], atol=1e-7)
    sd = 1.0 / np.sqrt(np.diag(prec))
    np.testing.assert_allclose(res.params["w_auto_scale"], sd[:3], rtol=1e-7)
    np.testing.assert_allclose(res.params["b_auto_scale"], sd[3], rtol=1e-7)


def test_laplace_guide_loc_is_the_unconstrained_map(data):
    """AutoLaplaceApproximation: auto_loc maximises log p(x, T(u)) + log|T'(u)|."""
    x, y = data
    guide = ag.AutoLaplaceApproximation(scaled_linreg)
    # point blocks are updated one site at a time (coordinate-wise Newton): a tight tol
    res = BLR(scaled_linreg, guide, tol=1e-15).run(jax.random.key(0), 500, x, y, progress_bar=False)
    loc = res.params["auto_loc"]
    grad = jax.grad(lambda z: -guide._loss_fn({"auto_loc": z}))(loc)
    assert np.max(np.abs(grad)) < 1e-6
    # the guide's own Laplace step (Hessian at auto_loc) works on these params
    post = guide.get_posterior(res.params)
    assert np.all(np.isfinite(post.covariance_matrix))


def test_low_rank_projection_recovers_a_low_rank_plus_diagonal_covariance():
    rng = np.random.default_rng(1)
    factor = rng.normal(size=(6, 2))
    psi = rng.uniform(0.5, 1.5, size=6)
    cov = jnp.asarray(factor @ factor.T + np.diag(psi))
    w, scale = low_rank(cov, 2)
    f = w * scale[:, None]
    np.testing.assert_allclose(f @ f.T + np.diag(scale**2), cov, atol=1e-6)


def test_init_params_start_from_the_given_locs(data):
    x, y = data
    guide = ag.AutoNormal(linreg)
    svi = BLR(linreg, guide, learning_rate=1e-9)  # (almost) no movement: the start shows
    state = svi.init(jax.random.key(0), x, y, init_params={"b_auto_loc": jnp.asarray(1.25)})
    np.testing.assert_allclose(svi.get_params(state)["b_auto_loc"], 1.25, atol=1e-6)


def test_update_steps_equal_run_and_loss_is_negative_elbo(data):
    x, y = data
    svi = BLR(scaled_linreg)
    state = svi.init(jax.random.key(0), x, y)
    losses = []
    for _ in range(5):
        state, loss = svi.update(state, x, y)
        losses.append(float(loss))
    ran = BLR(scaled_linreg).run(jax.random.key(0), 5, x, y, progress_bar=False)
    np.testing.assert_allclose(losses, ran.losses[:5], rtol=1e-10)
    for a, b in zip(jax.tree.leaves(state.nat), jax.tree.leaves(ran.state.nat)):
        np.testing.assert_allclose(a, b, rtol=1e-10)
    np.testing.assert_allclose(svi.evaluate(state, x, y), losses[-1], rtol=1e-8)
    params = svi.get_params(state)
    assert set(params) == {"(w, b, s)_blr_mean", "(w, b, s)_blr_cov"}


def test_update_traces_inside_jit_and_scan(data):
    x, y = data
    svi = BLR(scaled_linreg)
    state0 = svi.init(jax.random.key(0), x, y)

    @jax.jit
    def many(state):
        def body(st, _):
            st, loss = svi.update(st, x, y)
            return st, loss

        return jax.lax.scan(body, state, None, length=5)

    state, losses = many(state0)
    eager = state0
    for _ in range(5):
        eager, _ = svi.update(eager, x, y)
    np.testing.assert_allclose(losses[-1], -eager.elbo, rtol=1e-10)


def test_guide_for_predictive_and_psis(data):
    """The guide BLR chooses works in Predictive (both forms) and psis_diagnostic; on a
    conjugate model the posterior is exact, so the importance weights are constant and
    k-hat is far below 0.5."""
    x, y = data
    svi = BLR(linreg)
    res = svi.run(jax.random.key(0), 100, x, y, progress_bar=False)
    pred = Predictive(linreg, guide=svi.guide, params=res.params, num_samples=200)(jax.random.key(1), x)
    assert pred["y"].shape == (200, len(y))
    draws = Predictive(svi.guide, params=res.params, num_samples=4000)(jax.random.key(2), x)
    mean, cov, _ = exact_posterior(x, y)
    sd = np.sqrt(np.diag(cov))
    # 4000 draws: standard error sd/63; 5 standard errors
    assert np.all(np.abs(draws["w"].mean(0) - mean[:3]) < 5 * sd[:3] / np.sqrt(4000))
    k_hat = psis_diagnostic(jax.random.key(3), res.params, linreg, svi.guide, x, y, num_particles=500)
    assert k_hat < 0.3
    # the result offers the same guide
    result = blr_fit(linreg, (x, y), progress_bar=False)
    k_hat = psis_diagnostic(jax.random.key(3), result.params, linreg, result.guide, x, y, num_particles=500)
    assert k_hat < 0.3


def test_guide_log_density_of_a_joint_block_with_a_transformed_member(data):
    """The guide's density of (w, b, s) is the joint Gaussian of (w, b, log s) with the
    change of variables: log q = log N(u; m, Σ) − log s."""
    x, y = data
    result = blr_fit(scaled_linreg, (x, y), progress_bar=False)
    params = result.params
    seeded = numpyro.handlers.seed(numpyro.handlers.substitute(result.guide, params), 0)
    trace = numpyro.handlers.trace(seeded).get_trace(x)
    log_q = sum(jnp.sum(s["fn"].log_prob(s["value"])) for s in trace.values() if s["type"] == "sample")
    u = trace["_blr_latent"]["value"]
    by_hand = dist.MultivariateNormal(
        params["(w, b, s)_blr_mean"], params["(w, b, s)_blr_cov"]
    ).log_prob(u) - u[-1]
    np.testing.assert_allclose(log_q, by_hand, rtol=1e-10)
    np.testing.assert_allclose(trace["s"]["value"], jnp.exp(u[-1]), rtol=1e-12)


def test_errors(data):
    x, y = data
    # SVI's positional form BLR(model, guide, optim, loss) works: the optimiser and loss are
    # ignored with a warning (no learning rate to tune)
    with pytest.warns(UserWarning, match="optimiser"):
        BLR(linreg, None, numpyro.optim.Adam(0.01), Trace_ELBO())
    with pytest.raises(BLRError, match="options"):
        BLR(linreg, None, optimizer="adam")
    with pytest.raises(BLRError, match="learning_rate"):
        BLR(linreg, learning_rate="fast")
    with pytest.raises(UnsupportedGuideError, match="AutoNormal"):
        BLR(linreg, ag.AutoIAFNormal(linreg))
    with pytest.raises(UnsupportedGuideError, match="supported"):
        BLR(linreg, lambda x, y=None: None)
    with pytest.raises(BLRError, match="autoguide"):
        BLR(linreg, ag.AutoNormal(linreg), structure="joint")
    svi = BLR(linreg)
    with pytest.raises(BLRError, match="init"):
        svi.update(None, x, y)
    with pytest.raises(BLRError, match="not fitted"):
        Predictive(linreg, guide=svi.guide, num_samples=2)(jax.random.key(0), x)
    state = svi.init(jax.random.key(0), x, y)
    with pytest.raises(BLRError, match="shape"):
        svi.update(state, x[:10], y[:10])

    def mixture(y=None):
        z = numpyro.sample("z", dist.Bernoulli(0.5))
        numpyro.sample("y", dist.Normal(z, 1.0), obs=y)

    with pytest.raises(UnsupportedGuideError, match="discrete"):
        BLR(mixture, ag.AutoNormal(mixture)).init(jax.random.key(0), 1.0)


def test_auto_delta_is_the_constrained_mode():
    """Gamma(a, b) prior, Poisson counts: AutoDelta's MAP in the constrained space is
    (a + Σy − 1) / (b + N) (no log|det J| term), not the unconstrained mode (a + Σy) / (b + N)."""
    a, b = 3.0, 2.0
    y = jnp.asarray([2.0, 0.0, 4.0, 1.0, 3.0])

    def model(y):
        rate = numpyro.sample("rate", dist.Gamma(a, b))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Poisson(rate), obs=y)

    guide = ag.AutoDelta(model)
    res = BLR(model, guide, tol=1e-14).run(jax.random.key(0), 200, y, progress_bar=False)
    np.testing.assert_allclose(res.params["rate_auto_loc"], (a + y.sum() - 1) / (b + len(y)), rtol=1e-8)


def scale_param_model(y=None):
    """A prior scale as a numpyro.param (type-II maximum likelihood / empirical Bayes)."""
    scale = numpyro.param("scale", 1.0, constraint=dist.constraints.positive)
    w = numpyro.sample("w", dist.Normal(0.0, scale).expand([3]).to_event(1))
    with numpyro.plate("n", 4):
        numpyro.sample("y", dist.Normal(w[jnp.arange(4) % 3], 1.0), obs=y)


def test_model_params_are_in_params_and_reach_predictive():
    y = jnp.asarray([1.5, -0.5, 2.0, 1.0])
    result = blr_fit(scale_param_model, {"y": y}, progress_bar=False)
    fitted = result.point_estimates()["scale"]
    assert float(fitted) != 1.0
    np.testing.assert_allclose(result.params["scale"], fitted)
    # the guide samples only latents; Predictive substitutes the fitted param into the model
    trace = numpyro.handlers.trace(
        numpyro.handlers.seed(numpyro.handlers.substitute(scale_param_model, result.params), 0)
    ).get_trace()
    np.testing.assert_allclose(trace["scale"]["value"], fitted)
    draws = Predictive(result.guide, params=result.params, num_samples=10)(jax.random.key(0))
    assert set(draws) == {"w"}
    pred = Predictive(scale_param_model, guide=result.guide, params=result.params, num_samples=10)(
        jax.random.key(0)
    )
    assert pred["y"].shape == (10, 4)
    # an autoguide's params also carry the model's params, as SVI.get_params does
    guide = ag.AutoNormal(scale_param_model)
    res = BLR(scale_param_model, guide).run(jax.random.key(0), 200, y=y, progress_bar=False)
    svi = SVI(scale_param_model, ag.AutoNormal(scale_param_model), numpyro.optim.Adam(0.01), Trace_ELBO())
    assert set(res.params) == set(svi.get_params(svi.init(jax.random.key(0), y=y)))


def test_minibatch_model_runs_through_blr():
    """A subsampled model through the SVI interface: run, then further updates."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(400, 2)))
    y = x @ jnp.asarray([1.0, -2.0]) + 0.5 * jnp.asarray(rng.normal(size=400))

    def model(x, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        with numpyro.plate("data", x.shape[0], subsample_size=40) as idx:
            numpyro.sample("y", dist.Normal(x[idx] @ w, 0.5), obs=y[idx])

    svi = BLR(model)
    res = svi.run(jax.random.key(0), 300, x, y, progress_bar=False)
    mean = res.params["w_blr_mean"]
    # full-batch posterior sd is about 0.5/sqrt(400) = 0.025: within 0.1 of the truth
    np.testing.assert_allclose(mean, [1.0, -2.0], atol=0.1)
    state, loss = svi.update(res.state, x, y)
    assert np.isfinite(loss) and int(state.step) == int(res.state.step) + 1
