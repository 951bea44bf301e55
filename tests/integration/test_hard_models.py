"""Models that used to come back far from NUTS while reporting convergence: a horseshoe
regression, a logistic GLMM with a latent random-effect scale, two coupled enumerated
latents in one plate, and a prior-only multimodal model (flagged by PSIS k̂).

References (``tests/data/<model>.json``, ``tests/data/make_references.py``): long NUTS runs
(4 × 10,000 draws or more, R-hat < 1.01) and a well-tuned numpyro SVI with AutoNormal on the
same model; accuracy is in reference-sd units. Float64, fixed keys; blocks on an
unconstrained space are summarised from 40,000 draws (Monte Carlo error ≈ 0.005 sd).
"""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import numpyro
import pytest

import reference_models as rm
from blrppl import blr_fit
from checks import assert_every_site_exports
from integration.test_nonconjugate import posterior_moments

numpyro.enable_x64()

DATA = pathlib.Path(__file__).parents[1] / "data"
_FITS: dict = {}


def model_and_data(name):
    entry = rm.MODELS.get(name) or rm.DIAGNOSTIC_MODELS[name]
    return entry[0], entry[1]()


def fit(name, **options):
    key = (name, tuple(sorted(options.items())))
    if key not in _FITS:
        model, data = model_and_data(name)
        _FITS[key] = blr_fit(model, data, rng_key=jax.random.PRNGKey(0), progress_bar=False, **options)
        assert_every_site_exports(_FITS[key], model, data)
    return _FITS[key]


def reference(name, key="params"):
    stored = json.loads((DATA / f"{name}.json").read_text())[key]
    return {k: (v["mean"], v["sd"]) for k, v in stored.items()}


def errors(name, estimate):
    ref = reference(name)
    return {k: abs(estimate[k][0] - m) / s for k, (m, s) in ref.items()}


def _fmt(d):
    return ", ".join(f"{k}={v:.3f}" for k, v in d.items())


@pytest.mark.parametrize(
    "name, tol, options",
    [("glmm_admissions", 0.5, {}), ("coupled_discrete", 0.1, {}), ("horseshoe", 0.5, {"structure": "mean-field"})],
)
def test_means_within_tolerance_and_at_least_as_close_as_svi(name, tol, options):
    """The horseshoe in the family of the SVI it is compared with (mean-field, AutoNormal):
    the default joint Gaussian has a higher ELBO (−188.3 against −191.1) but holds the
    funnel between a coefficient and its local scale worse (w[3] 0.69 sd off), which k̂
    flags (see test_default_horseshoe_is_flagged)."""
    result = fit(name, **options)
    assert result.converged, result.message
    est = posterior_moments(result)
    blr = errors(name, est)
    svi = errors(name, reference(name, "svi"))
    if name == "horseshoe":  # the coefficients (the scales' posteriors are heavy-tailed)
        blr = {k: v for k, v in blr.items() if k.startswith("w[")}
        svi = {k: v for k, v in svi.items() if k.startswith("w[")}
    assert max(blr.values()) <= tol, f"{name}: BLR |mean error|/sd {_fmt(blr)}"
    assert max(blr.values()) <= max(svi.values()), f"{name}: BLR {_fmt(blr)}; SVI {_fmt(svi)}"
    assert np.mean(list(blr.values())) <= np.mean(list(svi.values())), f"{name}: BLR {_fmt(blr)}; SVI {_fmt(svi)}"


def test_glmm_sds():
    est = posterior_moments(fit("glmm_admissions"))
    ratio = {k: est[k][1] / s for k, (_, s) in reference("glmm_admissions").items()}
    assert all(0.75 <= r <= 1.25 for r in ratio.values()), _fmt(ratio)


def test_coupled_discrete_latents_share_one_block():
    result = fit("coupled_discrete")
    (joint,) = [b for b in result.plan.blocks if b.discrete]
    assert joint.sites == ("y", "z") and joint.kind == "categorical"
    assert result.diagnostics.khat <= 0.7
    # the joint state keeps the coupling: z's draws follow q[y]
    draws = result.sample(jax.random.PRNGKey(1), 400)
    y, z = np.asarray(draws["y"]), np.asarray(draws["z"])
    q = np.asarray(result.posterior["q"].mean)
    for value in (0, 1):
        rate = z[y == value].mean()
        assert abs(rate - q[value]) < 0.05, (value, rate, q)


def test_default_horseshoe_is_flagged():
    """The default fit (one joint Gaussian over the log scales and coefficients) cannot hold the
    horseshoe's funnels; it is not silently wrong: k̂ > 0.7 and a warning. (The first fit's flag:
    refine=False, which also spares the refinement's 15 s.)"""
    model, data = model_and_data("horseshoe")
    with pytest.warns(UserWarning, match="poor approximation"):
        result = blr_fit(model, data, rng_key=jax.random.PRNGKey(0), progress_bar=False, refine=False)
    assert result.converged, result.message
    assert result.diagnostics.khat > 0.7
