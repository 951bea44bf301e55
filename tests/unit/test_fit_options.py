"""blr_fit options: schedules, step sizes, masks, caching of compiled fits, result API."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import blrppl.engine.cache as cache
from blrppl import BLRError, blr_fit

A0, B0, MU0, LAM0 = 2.0, 1.0, 0.0, 0.5
Y = np.random.default_rng(3).normal(1.0, 2.0, size=30)


def normal_gamma(y):
    tau = numpyro.sample("tau", dist.Gamma(A0, B0))
    mu = numpyro.sample("mu", dist.Normal(MU0, 1 / jnp.sqrt(LAM0 * tau)))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1 / jnp.sqrt(tau)), obs=y)


def prml_fixed_point(y):
    """Bishop PRML eqs. 10.26-10.30 iterated to convergence."""
    n, ybar, e_tau = y.size, y.mean(), A0 / B0
    for _ in range(2000):
        mu_n = (LAM0 * MU0 + n * ybar) / (LAM0 + n)
        lam_n = (LAM0 + n) * e_tau
        a_n = A0 + (n + 1) / 2
        b_n = B0 + 0.5 * (np.sum((y - mu_n) ** 2) + n / lam_n + LAM0 * ((mu_n - MU0) ** 2 + 1 / lam_n))
        e_tau = a_n / b_n
    return mu_n, 1 / lam_n, a_n, b_n


def check_fixed_point(result, y, atol=1e-6):
    mu_n, var_n, a_n, b_n = prml_fixed_point(y)
    np.testing.assert_allclose(result.posterior["mu"].mean, mu_n, atol=atol)
    np.testing.assert_allclose(result.posterior["mu"].variance, var_n, atol=atol)
    np.testing.assert_allclose(result.posterior["tau"].concentration, a_n, atol=atol)
    np.testing.assert_allclose(result.posterior["tau"].rate, b_n, atol=atol)


def test_parallel_schedule_reaches_the_vmp_fixed_point():
    res = blr_fit(normal_gamma, {"y": Y}, schedule="parallel", tol=1e-14, num_steps=500, progress_bar=False)
    assert res.converged, res.message
    check_fixed_point(res, Y)


def test_damped_constant_and_callable_step_sizes_reach_the_fixed_point():
    res = blr_fit(normal_gamma, {"y": Y}, learning_rate=0.5, tol=1e-14, num_steps=2000, progress_bar=False)
    assert res.converged, res.message
    check_fixed_point(res, Y)
    res = blr_fit(
        normal_gamma, {"y": Y}, learning_rate=lambda t: 1.0 / (1.0 + t) ** 0.1, tol=1e-14, num_steps=3000,
        progress_bar=False,
    )
    check_fixed_point(res, Y, atol=1e-5)


@pytest.mark.parametrize("rate", [0.0, 1.5, -1.0])
def test_learning_rate_out_of_range_is_an_error(rate):
    with pytest.raises(BLRError, match="learning_rate"):
        blr_fit(normal_gamma, {"y": Y}, learning_rate=rate, progress_bar=False)


def test_schedule_name_is_checked():
    with pytest.raises(BLRError, match="schedule"):
        blr_fit(normal_gamma, {"y": Y}, schedule="random", progress_bar=False)


def test_num_steps_caps_the_run():
    res = blr_fit(normal_gamma, {"y": Y}, num_steps=2, tol=1e-14, progress_bar=False)
    assert res.num_steps == 2 and not res.converged
    assert "num_steps" in res.message and res.elbo.shape == (2,)


def test_second_fit_with_new_data_reuses_the_compiled_fit_and_is_exact():
    y2 = Y[::-1] * 0.5 + 3.0
    first = blr_fit(normal_gamma, {"y": Y}, tol=1e-14, progress_bar=False)
    size = len(cache._CACHE)
    second = blr_fit(normal_gamma, {"y": y2}, tol=1e-14, progress_bar=False)
    assert len(cache._CACHE) == size  # no new compiled fit
    check_fixed_point(first, Y)
    check_fixed_point(second, y2)
    # a new data shape compiles anew
    blr_fit(normal_gamma, {"y": Y[:10]}, tol=1e-14, progress_bar=False)
    assert len(cache._CACHE) == min(size + 1, cache.CACHE_SIZE)


def test_mask_inside_to_event_equals_fit_on_the_kept_values():
    y = np.array([[0.5, 1.0, 40.0], [0.2, 0.3, 60.0], [0.1, 0.4, 70.0]])
    keep = np.array([[True, True, False]] * 3)

    def masked(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        with numpyro.plate("n", 3):
            numpyro.sample("y", dist.Normal(mu, 1.0).expand([3, 3]).mask(keep).to_event(1), obs=y)

    def subset(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        numpyro.sample("y", dist.Normal(mu, 1.0).expand([3, 2]).to_event(2), obs=y[:, :2])

    a = blr_fit(masked, {"y": y}, progress_bar=False).posterior["mu"]
    b = blr_fit(subset, {"y": y}, progress_bar=False).posterior["mu"]
    prec = 1 / 100 + 6.0
    np.testing.assert_allclose(a.mean, y[:, :2].sum() / prec, atol=1e-10)
    np.testing.assert_allclose(a.mean, b.mean, atol=1e-10)
    np.testing.assert_allclose(a.variance, 1 / prec, atol=1e-10)


def test_handlers_mask_drops_observations():
    y = np.array([1.0, 2.0, 100.0, 3.0])
    keep = np.array([True, True, False, True])

    def model(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        with numpyro.plate("n", 4), numpyro.handlers.mask(mask=keep):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    post = blr_fit(model, {"y": y}, progress_bar=False).posterior["mu"]
    np.testing.assert_allclose(post.mean, 6.0 / (3 + 0.01), atol=1e-10)


def test_plated_vector_site_keeps_its_layout():
    """A Gaussian site (plate G) × event (3): one dense 3×3 block per group."""
    g, d = 4, 3
    rng = np.random.default_rng(0)
    x = rng.normal(size=(20, d))
    group = np.arange(20) % g
    y = rng.normal(size=20)

    def model(x, group, y):
        with numpyro.plate("g", g):
            w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([d]).to_event(1))
        with numpyro.plate("n", 20):
            numpyro.sample("y", dist.Normal(jnp.sum(x * w[group], -1), 0.5), obs=y)

    res = blr_fit(model, (x, group, y), num_steps=1, learning_rate=1.0, progress_bar=False)
    post = res.posterior["w"]
    assert post.batch_shape == (g,) and post.event_shape == (d,)
    for k in range(g):
        xs, ys = x[group == k], y[group == k]
        prec = np.eye(d) + xs.T @ xs / 0.25
        np.testing.assert_allclose(post.mean[k], np.linalg.solve(prec, xs.T @ ys / 0.25), atol=1e-8)
        np.testing.assert_allclose(post.covariance_matrix[k], np.linalg.inv(prec), atol=1e-8)
    draws = res.sample(jax.random.key(0), 7)
    assert draws["w"].shape == (7, g, d)


def test_summary_reports_every_scalar(capsys):
    res = blr_fit(normal_gamma, {"y": Y}, progress_bar=False)
    stats = res.summary(num_samples=20000, rng_key=jax.random.key(1))
    printed = capsys.readouterr().out
    assert "mu" in printed and "tau" in printed
    sd = float(np.sqrt(res.posterior["mu"].variance))
    # Monte Carlo error of the mean of 20000 draws: sd / sqrt(20000) ≈ 0.007 sd
    assert abs(stats["mu"]["mean"] - float(res.posterior["mu"].mean)) < 5 * sd / np.sqrt(20000)
    assert abs(stats["mu"]["sd"] / sd - 1) < 0.03


def test_mixture_spellings_are_read_into_the_options():
    """``families=`` may ask a Gaussian mixture by name (4 components) or as (name, K): the
    site is listed with its K and given the Gaussian its mixture starts from (none by
    default: the block the fit gives it; with structure= the structure's); the user's dict
    is not changed."""
    from blrppl.inputs import fit_options

    asked = {"a": "gaussian-mixture", "b": ("gaussian-mixture", 3), "c": "gaussian-diag"}
    kept = dict(asked)
    options = fit_options(families=asked)
    assert asked == kept
    assert options.mixtures == (("a", 4), ("b", 3))
    assert options.families_dict == {"c": "gaussian-diag"}
    assert fit_options(families=asked, structure="mean-field").families_dict == {
        "a": "gaussian-diag", "b": "gaussian-diag", "c": "gaussian-diag"
    }
    assert fit_options(families=asked, structure="joint").families_dict == {
        "a": "gaussian", "b": "gaussian", "c": "gaussian-diag"
    }
    assert fit_options(families={"c": "gaussian-diag"}).mixtures == ()


@pytest.mark.parametrize("asked", [("gaussian-mixture", 0), ("gaussian-mixture", -2), ("gaussian-mixture", 1.0),
                                   ("gaussian-mixture", "4"), ("gaussian-mixture", 2, 3), ("grid", 2)])
def test_mixture_bad_spellings_name_the_site(asked):
    from blrppl.inputs import fit_options

    with pytest.raises(BLRError, match="site 'w'.*\\('gaussian-mixture', K\\)"):
        fit_options(families={"w": asked})
