"""blr_fit on posteriordb posteriors (``blrppl.bench.posteriordb``) against their reference
draws (10 chains × 1000 NUTS draws, good to about 0.01 sd).

Float64, fixed keys. Moments come from 20 000 draws of ``result.sample`` with a fixed key
(sd of transformed sites and of eight schools' ``theta`` have no closed form), mapped to the
reference's Stan names; Monte Carlo error ≈ 0.007 sd on means and 0.5 % on sds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import pytest

from blrppl import blr_fit
from blrppl.bench import posteriordb as pdb

numpyro.enable_x64()

NUM_DRAWS = 20_000
REGRESSIONS = [
    "sblrc-blr",
    "kidiq-kidscore_interaction",
    "earnings-logearn_interaction",
    "mesquite-logmesquite_logvash",
    "nes2000-nes",
    "kilpisjarvi_mod-kilpisjarvi",
    "diamonds-diamonds",
]
EIGHT_SCHOOLS = "eight_schools-eight_schools_noncentered"
_FITS: dict = {}



REGRESSION_CASES = list(REGRESSIONS)


def fit(name: str):
    """(result, accuracy) of blr_fit on a posterior, computed once per session."""
    if name not in _FITS:
        model, data, ref = pdb.load(name)
        result = blr_fit(model, data, rng_key=jax.random.key(0), progress_bar=False)
        est = pdb.summarize(result.sample(jax.random.key(1), NUM_DRAWS), model, data, ref)
        _FITS[name] = (result, pdb.compare(est, ref))
    return _FITS[name]


def _fmt(d):
    return ", ".join(f"{k}={v:.3f}" for k, v in d.items())


# -------------------------------------------------------------- the ports themselves


@pytest.mark.parametrize("name", REGRESSIONS + [EIGHT_SCHOOLS])
def test_load_gives_model_data_and_reference(name):
    model, data, ref = pdb.load(name)
    assert ref and all(s > 0 for _, s in ref.values())
    # one forward pass of the model with a value per latent; deterministic sites included
    trace = numpyro.handlers.trace(
        numpyro.handlers.substitute(
            numpyro.handlers.seed(model, 0),
            substitute_fn=lambda site: (
                jnp.ones(site["fn"].shape()) if site["type"] == "sample" and not site.get("is_observed") else None
            ),
        )
    ).get_trace(**data)
    draws = {k: jnp.asarray(s["value"])[None] for k, s in trace.items() if s["type"] == "sample" and not s["is_observed"]}
    flat = pdb.flatten_draws(draws, model, data)
    assert set(ref) <= set(flat), set(ref) - set(flat)


@pytest.mark.parametrize(
    "name",
    ["kidiq-kidscore_interaction", "earnings-logearn_interaction", "mesquite-logmesquite_logvash", "nes2000-nes"],
)
def test_flat_prior_ports_match_least_squares(name):
    """With a flat prior on β the posterior mean of β is the least-squares fit whatever σ's
    prior: the reference agrees with the ported design matrix and transformed data."""
    _, data, ref = pdb.load(name)
    beta = np.linalg.lstsq(data["X"], data["y"], rcond=None)[0]
    err = {f"beta[{i + 1}]": abs(b - ref[f"beta[{i + 1}]"][0]) / ref[f"beta[{i + 1}]"][1] for i, b in enumerate(beta)}
    assert max(err.values()) < 0.05, _fmt(err)


def test_flatten_draws_uses_stan_names():
    draws = {"beta": np.arange(6.0).reshape(2, 3), "sigma": np.ones(2), "L": np.zeros((2, 2, 2))}
    flat = pdb.flatten_draws(draws)
    assert list(flat) == ["beta[1]", "beta[2]", "beta[3]", "sigma", "L[1,1]", "L[1,2]", "L[2,1]", "L[2,2]"]
    np.testing.assert_array_equal(flat["beta[2]"], [1.0, 4.0])


def test_eight_schools_theta_is_derived():
    model, data, _ = pdb.load(EIGHT_SCHOOLS)
    draws = {"theta_trans": np.ones((3, 8)), "mu": np.full(3, 2.0), "tau": np.full(3, 0.5)}
    flat = pdb.flatten_draws(draws, model, data)
    np.testing.assert_allclose(flat["theta[4]"], 2.5)


# ------------------------------------------------------------------- accuracy of blr_fit


@pytest.mark.parametrize("name", REGRESSION_CASES)
def test_regression_means(name):
    result, acc = fit(name)
    assert acc["max_mean_err_sd"] <= 0.1, f"{name}: |mean error|/sd: {_fmt(acc['mean_err_sd'])}; {result.message}"


@pytest.mark.parametrize("name", REGRESSION_CASES)
def test_regression_sds(name):
    result, acc = fit(name)
    bad = {k: r for k, r in acc["sd_ratio"].items() if abs(r - 1.0) > 0.15}
    assert not bad, f"{name}: sd ratio: {_fmt(acc['sd_ratio'])}; {result.message}"


def test_eight_schools_means():
    result, acc = fit(EIGHT_SCHOOLS)
    assert acc["max_mean_err_sd"] <= 0.3, f"|mean error|/sd: {_fmt(acc['mean_err_sd'])}; {result.message}"
