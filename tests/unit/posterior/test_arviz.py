"""``BLRResult.to_arviz``: the posterior draws as an ``arviz.InferenceData``."""

from __future__ import annotations

import sys

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import arviz as az  # in the test extra, so CI tests it
from blrppl.api import blr_fit
from blrppl.errors import BLRError, MissingDependencyError


def model(X, y):
    w = numpyro.sample("w", dist.Normal(0.0, 2.0).expand([2]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 3.0))
    with numpyro.plate("k", 3):
        tau = numpyro.sample("tau", dist.Gamma(2.0, 2.0))
    numpyro.sample("t_obs", dist.Poisson(tau), obs=np.array([1.0, 4.0, 2.0]))
    with numpyro.plate("n", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w + b, 0.7), obs=y)


@pytest.fixture(scope="module")
def result():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(30, 2))
    y = x @ np.array([1.0, -2.0]) + 0.5 + 0.7 * rng.normal(size=30)
    return blr_fit(model, {"X": x, "y": y}, rng_key=jax.random.key(0), progress_bar=False)


def test_posterior_group_shapes(result):
    idata = result.to_arviz(num_samples=250, rng_key=jax.random.key(1))
    assert isinstance(idata, az.InferenceData)
    post = idata.posterior
    assert set(post.data_vars) == {"w", "b", "tau"}
    assert post["w"].dims == ("chain", "draw", "w_dim_0")
    assert post["w"].shape == (1, 250, 2)
    assert post["b"].dims == ("chain", "draw") and post["b"].shape == (1, 250)
    assert post["tau"].shape == (1, 250, 3)
    assert np.all(np.isfinite(post["w"].values)) and np.all(post["tau"].values > 0)
    assert post.attrs["inference_library"] == "blrppl"
    # the default: 1000 draws, the same for the same key
    default = result.to_arviz()
    assert default.posterior["w"].shape == (1, 1000, 2)
    np.testing.assert_array_equal(default.posterior["w"].values, result.to_arviz().posterior["w"].values)


def test_arviz_summary_matches_result_summary(result):
    """arviz's means of n₁ = 4000 draws (key 1) against ``result.summary``'s of n₂ = 4000
    independent draws (key 0): the difference of two independent Monte Carlo means has sd
    σ √(1/n₁ + 1/n₂), σ the posterior sd; 5 of those (a 5σ deviation has probability
    ~6e-7 per scalar) bound it; the sds agree within 10% (the relative sd of a sample sd
    is ≈ 1/√(2n) ≈ 1.1%)."""
    n1 = n2 = 4000
    idata = result.to_arviz(num_samples=n1, rng_key=jax.random.key(1))
    table = az.summary(idata, kind="stats", round_to="none")
    ours = result.summary(num_samples=n2, rng_key=jax.random.key(0), print_table=False)
    for name, stats in ours.items():
        mean, sd = np.atleast_1d(stats["mean"]), np.atleast_1d(stats["sd"])
        labels = [name] if np.ndim(stats["mean"]) == 0 else [f"{name}[{i}]" for i in range(mean.size)]
        got_mean = table.loc[labels, "mean"].to_numpy()
        got_sd = table.loc[labels, "sd"].to_numpy()
        np.testing.assert_array_less(np.abs(got_mean - mean), 5 * sd * np.sqrt(1 / n1 + 1 / n2), err_msg=name)
        np.testing.assert_allclose(got_sd, sd, rtol=0.1, err_msg=name)


def test_missing_arviz_says_how_to_install(result, monkeypatch):
    monkeypatch.setitem(sys.modules, "arviz", None)  # `import arviz` raises ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install blrppl\[arviz\]"):
        result.to_arviz()
    assert issubclass(MissingDependencyError, BLRError)


def test_num_samples_must_be_positive(result):
    with pytest.raises(BLRError, match="num_samples"):
        result.to_arviz(num_samples=0)
