"""Checks shared by test modules (not tests themselves)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
from numpyro import handlers

ROOT = Path(__file__).resolve().parents[1]


def site_shapes(model, data) -> dict:
    """Latent sample site → value shape, from one seeded run of the model."""
    args, kwargs = (tuple(data), {}) if isinstance(data, (tuple, list)) else ((), dict(data or {}))
    trace = handlers.trace(handlers.seed(model, jax.random.key(0))).get_trace(*args, **kwargs)
    return {
        name: tuple(np.shape(site["value"]))
        for name, site in trace.items()
        if site["type"] == "sample" and not site["is_observed"]
    }


def assert_every_site_exports(result, model, data, num_draws: int = 5):
    """Every latent site of the model has a posterior whose mean, variance and draws have
    the site's shape and are finite (variances non-negative), and ``result.sample`` draws it
    (as users ask for them: ``result.posterior[site].mean`` for every site)."""
    shapes = site_shapes(model, data)
    assert set(shapes) <= set(result.posterior), set(shapes) - set(result.posterior)
    draws = result.sample(jax.random.PRNGKey(1), num_draws)
    for site, shape in shapes.items():
        q = result.posterior[site]
        mean, var = np.asarray(q.mean), np.asarray(q.variance)
        assert mean.shape == shape and var.shape == shape, (site, mean.shape, var.shape, shape)
        assert np.all(np.isfinite(mean)) and np.all(var >= 0), site
        assert np.shape(draws[site]) == (num_draws,) + shape, (site, np.shape(draws[site]))
        own = np.asarray(q.sample(jax.random.PRNGKey(2), (num_draws,)))
        assert own.shape == (num_draws,) + shape and np.all(np.isfinite(own)), site


def run_in_new_process(code: str, cache, **env_extra) -> dict:
    """Run ``code`` (which prints ``RESULT<json>``) in a new Python process whose user cache
    directory is ``cache`` (blrppl's: ``cache/blrppl``; no ``$JAX_COMPILATION_CACHE_DIR``):
    its JSON."""
    env = dict(os.environ, XDG_CACHE_HOME=str(cache), BLRPPL_CACHE_DIR=str(Path(cache) / "blrppl"), **env_extra)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def fresh_fit(model, args, monkeypatch, num_steps: int):
    """A fit compiled afresh (a new model function: the in-memory fit cache is keyed on the
    model; no program store: the programs of a run patched by the caller are not stored
    or loaded), ``num_steps`` steps from ``PRNGKey(0)``."""
    from jax import random

    from blrppl import blr_fit

    monkeypatch.setenv("BLRPPL_COMPILATION_CACHE", "0")
    return blr_fit(
        lambda *a: model(*a), args, num_steps=num_steps, tol=1e-30, rng_key=random.PRNGKey(0), progress_bar=False
    )

