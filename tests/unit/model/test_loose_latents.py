"""Latent sites of one structure written one by one outside any plate (a Python loop over
groups): past :data:`blrppl.model.checks.MAX_LOOSE_LATENTS` of them the model is refused
as it runs, before the rest of it is traced, and past :data:`MAX_LOOSE_BLOCKS` when the
structure pass leaves them blocks of their own, each time with an error naming the sites
and the plate that would hold them; a chain written one site per step (one banded or
joint block), sites in plates and sites of distinct structures are not refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

from blrppl import UnsupportedLatentError
from blrppl.api import plan_of
from blrppl.model import checks

ROOT = Path(__file__).resolve().parents[3]


def groups_in_a_loop(y, reached):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfNormal(2.0))
    for g in range(len(y)):
        reached.append(g)
        theta = numpyro.sample(f"theta_{g}", dist.Normal(mu, tau))
        numpyro.sample(f"y_{g}", dist.Normal(theta, 1.0), obs=y[g])


def test_a_loop_of_too_many_latent_sites_is_refused_as_the_model_runs(monkeypatch):
    monkeypatch.setattr(checks, "MAX_LOOSE_LATENTS", 20)
    reached: list = []
    y = np.zeros(200)
    with pytest.raises(UnsupportedLatentError) as info:
        plan_of(lambda y: groups_in_a_loop(y, reached), {"y": y}, rng_key=random.PRNGKey(0))
    message = str(info.value)
    assert "'theta_0'" in message and "'theta_20'" in message and "numpyro.plate" in message
    assert info.value.site == "theta_0"
    # stopped at the 21st group's latent: the other 179 groups were never traced
    assert max(reached) == 20


def random_walk(y):
    x = 0.0
    for t in range(len(y)):
        x = numpyro.sample(f"x_{t}", dist.Normal(x, 1.0))
        numpyro.sample(f"y_{t}", dist.Normal(x, 0.5), obs=y[t])


def test_loose_latents_left_as_blocks_of_their_own_are_refused_by_the_structure_pass(monkeypatch):
    monkeypatch.setattr(checks, "MAX_LOOSE_BLOCKS", 10)
    y = np.linspace(-1.0, 1.0, 30)
    model = lambda y: groups_in_a_loop(y, [])  # noqa: E731
    with pytest.raises(UnsupportedLatentError, match="more than 10 latent Normal sites") as info:
        plan_of(model, {"y": y}, rng_key=random.PRNGKey(0), structure="mean-field")
    assert "'theta_0'" in str(info.value) and "numpyro.plate" in str(info.value)
    # merged into one joint block (the default at this size), or a chain: fitted
    assert len(plan_of(model, {"y": y}, rng_key=random.PRNGKey(0)).blocks) <= 2
    plan = plan_of(random_walk, {"y": y}, rng_key=random.PRNGKey(0))
    assert len(plan.blocks) == 1 and len(plan.blocks[0].sites) == 30


def mixed_structures(y):
    # 30 scalar and 30 vector latents, and 30 latents in a plate: no group is past 40
    for g in range(30):
        a = numpyro.sample(f"a_{g}", dist.Normal(0.0, 1.0))
        b = numpyro.sample(f"b_{g}", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        with numpyro.plate(f"p_{g}", 2):
            c = numpyro.sample(f"c_{g}", dist.Normal(0.0, 1.0))
        numpyro.sample(f"y_{g}", dist.Normal(a + b.sum() + c.sum(), 1.0), obs=y[g])


def test_groups_below_the_limit_or_of_other_structures_are_fitted(monkeypatch):
    monkeypatch.setattr(checks, "MAX_LOOSE_LATENTS", 40)
    plan = plan_of(mixed_structures, {"y": np.zeros(30)}, rng_key=random.PRNGKey(0))
    sites = {n for b in plan.blocks for n in b.sites}
    assert {"a_0", "b_29", "c_7"} <= sites


MEMORY_CODE = """
import json, resource
import numpy as np
import numpyro, numpyro.distributions as dist
from jax import random
from blrppl import blr_fit, UnsupportedLatentError

def model(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfNormal(2.0))
    for g in range(len(y)):
        theta = numpyro.sample(f"theta_{g}", dist.Normal(mu, tau))
        numpyro.sample(f"y_{g}", dist.Normal(theta, 1.0), obs=y[g])

try:
    blr_fit(model, np.random.default_rng(0).normal(size=3000), rng_key=random.PRNGKey(0), progress_bar=False)
    error = None
except UnsupportedLatentError as exc:
    error = type(exc).__name__
# the peak resident memory of this process: VmHWM (the getrusage figure is kept across
# exec, so a child of a large test worker would report the worker's peak)
try:
    with open("/proc/self/status") as status:
        peak = next(int(l.split()[1]) for l in status if l.startswith("VmHWM:")) / 1024
except (OSError, StopIteration):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print("RESULT" + json.dumps({"error": error, "maxrss_mb": peak}))
"""

#: the peak memory of the process refusing 3,000 loose sites (JAX's import alone: ~300 MB)
MEMORY_BOUND_MB = 1024


def test_three_thousand_scalar_sites_in_a_loop_are_refused_within_a_memory_bound():
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", MEMORY_CODE], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(next(l for l in out.stdout.splitlines() if l.startswith("RESULT"))[len("RESULT"):])
    assert got["error"] == "UnsupportedLatentError"
    assert got["maxrss_mb"] < MEMORY_BOUND_MB, got
