"""Golden plans: ``plan.describe()`` of every reference, benchmark and example model, and of
models written the way NumPyro users write the constructs the compiler must read (a scan, a
Python loop of sites, a random walk, a funnel, a change point, a transformed latent...).

Each table is stored in ``tests/plans/data/<model>.txt``. A change in how the compiler reads
models (which family a latent gets, which estimator a factor gets, what the arguments are,
what is merged into a joint block) shows up here as a diff: either an improvement to explain
(then regenerate the files: ``BLRPPL_UPDATE_PLANS=1 pytest tests/plans/test_plans.py``, and commit
them with the reason) or a bug.
"""

from __future__ import annotations

import difflib
import os
import pathlib
import sys

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.contrib.control_flow import scan

import reference_models as rm
from blrppl.api import plan_of
from blrppl.bench import models as bench
from blrppl.bench import posteriordb
from blrppl.errors import MissingDependencyError

numpyro.enable_x64()

PLANS = pathlib.Path(__file__).parent / "data"
EXAMPLES = pathlib.Path(__file__).parents[2] / "examples"
UPDATE = os.environ.get("BLRPPL_UPDATE_PLANS") == "1"


# ------------------------------------------------------------------ constructs users write


def scan_level(y):
    drift = numpyro.sample("drift", dist.Normal(0.0, 1.0))

    def transition(level, y_t):
        level = level + drift
        numpyro.sample("y", dist.Normal(level, 0.1), obs=y_t)
        return level, None

    scan(transition, 0.0, y)


def loop_ar2(y):
    phi = numpyro.sample("phi", dist.Normal(jnp.zeros(2), 0.5).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    for t in range(2, len(y)):
        numpyro.sample(f"y_{t}", dist.Normal(phi[0] * y[t - 1] + phi[1] * y[t - 2], sigma), obs=y[t])


def random_walk(y):
    scale = numpyro.sample("scale", dist.HalfNormal(1.0))
    x = numpyro.sample("x", dist.GaussianRandomWalk(scale, num_steps=len(y)))
    numpyro.sample("y", dist.Normal(x, 0.5), obs=y)


def funnel():
    v = numpyro.sample("v", dist.Normal(0.0, 3.0))
    numpyro.sample("x", dist.Normal(0.0, jnp.exp(v / 2)).expand([9]).to_event(1))


def change_point(counts):
    early = numpyro.sample("early", dist.Exponential(1.0))
    late = numpyro.sample("late", dist.Exponential(1.0))
    tau = numpyro.sample("tau", dist.Categorical(logits=jnp.zeros(len(counts))))
    rate = jnp.where(jnp.arange(len(counts)) < tau, early, late)
    with numpyro.plate("t", len(counts)):
        numpyro.sample("counts", dist.Poisson(rate), obs=counts)


def shifted_beta(y):
    rho = numpyro.sample("rho", dist.TransformedDistribution(dist.Beta(2.0, 2.0), dist.transforms.AffineTransform(-1.0, 2.0)))
    with numpyro.plate("n", len(y)):
        numpyro.sample("y", dist.Normal(rho, 1.0), obs=y)


def masked_regression(X, y, mask):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.Exponential(1.0))
    mu = numpyro.deterministic("mu", X @ w)
    with numpyro.plate("n", X.shape[0]):
        numpyro.sample("y", dist.Normal(mu, sigma).mask(mask), obs=y)


def hierarchical_logistic(group, y, num_groups):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(1.0))
    with numpyro.plate("groups", num_groups):
        a = numpyro.sample("a", dist.Normal(mu, tau))
    with numpyro.plate("n", len(y)):
        numpyro.sample("y", dist.Bernoulli(logits=a[group]), obs=y)


def _constructs():
    rng = np.random.default_rng(0)
    y = np.cumsum(rng.normal(size=12))
    X = rng.normal(size=(20, 3))
    return {
        "scan_level": (scan_level, {"y": 0.5 * np.arange(1, 9) + rng.normal(scale=0.1, size=8)}),
        "loop_ar2": (loop_ar2, {"y": y}),
        "random_walk": (random_walk, {"y": y}),
        "funnel": (funnel, {}),
        "change_point": (change_point, {"counts": np.array([3.0, 5, 4, 6, 1, 0, 2, 1])}),
        "shifted_beta": (shifted_beta, {"y": rng.normal(0.3, 1.0, size=10)}),
        "masked_regression": (
            masked_regression,
            {"X": X, "y": np.where(np.arange(20) % 5 == 0, np.nan, X @ [1.0, -1.0, 0.5]), "mask": np.arange(20) % 5 != 0},
        ),
        "hierarchical_logistic": (
            hierarchical_logistic,
            {"group": np.arange(30) % 4, "y": (rng.uniform(size=30) < 0.4).astype(float), "num_groups": 4},
        ),
    }


# --------------------------------------------------------------------------------- registry


def _examples():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import gaussian_mixture
        import logistic_vs_nuts
        import svi_pipeline
    finally:
        sys.path.remove(str(EXAMPLES))
    x, y = logistic_vs_nuts.make_data()
    xs, ys = svi_pipeline.make_data()
    return {
        "gaussian_mixture": (gaussian_mixture.model, {"y": gaussian_mixture.make_data()}),
        "logistic_vs_nuts": (logistic_vs_nuts.model, {"x": x, "y": y}),
        "svi_pipeline": (svi_pipeline.model, {"x": xs, "y": ys}),
    }


def _bench(name):
    try:
        b = bench.load(name)
    except MissingDependencyError as e:
        pytest.skip(str(e))
    return b.model, b.data, b.blr_kwargs


CASES = (
    [("reference", n) for n in list(rm.MODELS) + list(rm.DIAGNOSTIC_MODELS)]
    + [("bench", n) for n in bench.names() + posteriordb.names()]
    + [("example", n) for n in ("gaussian_mixture", "logistic_vs_nuts", "svi_pipeline")]
    + [("construct", n) for n in _constructs()]
)


def model_of(source, name):
    """(model, data, options) of a case."""
    if source == "reference":
        model, data = rm.get(name)
        return model, data, {}
    if source == "bench":
        return _bench(name)
    if source == "example":
        return (*_examples()[name], {})
    return (*_constructs()[name], {})


@pytest.mark.parametrize("source, name", CASES, ids=[f"{s}-{n}" for s, n in CASES])
def test_plan_matches_its_golden_table(source, name):
    model, data, options = model_of(source, name)
    options = {k: v for k, v in options.items() if k in ("families", "structure", "point", "point_space")}
    text = plan_of(model, data, rng_key=random.PRNGKey(0), **options).describe() + "\n"
    path = PLANS / f"{source}-{name}.txt"
    if UPDATE or not path.exists():
        if not UPDATE:
            pytest.fail(f"no golden plan {path.name}: run with BLRPPL_UPDATE_PLANS=1 and commit it")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    expected = path.read_text()
    diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), "golden", "now"))
    assert text == expected, f"plan of {source} model '{name}' changed:\n{diff}"


def test_every_golden_table_has_a_case():
    """A stale golden file (its model renamed or removed) is an error, not dead weight."""
    names = {f"{s}-{n}.txt" for s, n in CASES}
    stale = sorted(p.name for p in PLANS.glob("*.txt") if p.name not in names)
    assert not stale, f"golden plans without a model: {stale}"
