"""float32 works (DESIGN.md §6): fits run in a fresh interpreter without x64.

The test session itself runs in float64 (tests/conftest.py), so the float32 fits run in a
subprocess; it prints the posterior parameters as JSON and this test compares them with the
closed-form posteriors computed here in float64, at float32 tolerances (rtol 1e-4).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]

CODE = r"""
import json
import jax, jax.numpy as jnp, numpy as np
import numpyro, numpyro.distributions as dist
assert not jax.config.jax_enable_x64
from blrppl.api import blr_fit

y_nn = np.asarray(json.loads('Y_NN'), dtype=np.float32)
y_bb = np.asarray(json.loads('Y_BB'), dtype=np.float32)

def normal_normal(y):
    mu = numpyro.sample("mu", dist.Normal(1.0, 2.0))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 0.5), obs=y)

def beta_bernoulli(y):
    p = numpyro.sample("p", dist.Beta(2.0, 3.0))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Bernoulli(p), obs=y)

out = {}
for name, model, y in [("nn", normal_normal, y_nn), ("bb", beta_bernoulli, y_bb)]:
    r = blr_fit(model, {"y": y}, rng_key=jax.random.key(0), progress_bar=False)
    q = r.posterior["mu" if name == "nn" else "p"]
    if name == "nn":
        params = {"mean": q.mean, "var": q.variance}
    else:
        params = {"a": q.concentration1, "b": q.concentration0}
    out[name] = {
        "params": {k: float(v) for k, v in params.items()},
        "dtypes": sorted({str(jnp.asarray(v).dtype) for v in params.values()}
                         | {str(x.dtype) for x in jax.tree.leaves(r.nat)}),
        "elbo": [float(e) for e in r.elbo],
        "elbo_dtype": str(np.asarray(r.elbo).dtype),
        "converged": bool(r.converged),
        "message": r.message,
        "finite_samples": bool(np.all(np.isfinite(np.asarray(r.sample(jax.random.key(1), 100)[
            "mu" if name == "nn" else "p"])))),
    }

# every key spelling of NumPyro's docs (a raw uint32 PRNGKey, an int seed) in float32 too
from jax import random
from numpyro.infer.autoguide import AutoNormal
from blrppl import BLR
keys = {"PRNGKey": random.PRNGKey(0), "seed": 0, "key": random.key(0)}
out["keys"] = {k: [float(e) for e in blr_fit(normal_normal, {"y": y_nn}, rng_key=v, progress_bar=False).elbo]
               for k, v in keys.items()}
svi = BLR(normal_normal, AutoNormal(normal_normal))
out["svi_loss"] = float(svi.run(random.PRNGKey(0), 20, y_nn, progress_bar=False).losses[-1])

# a log link far below its data: counts of 1e6 and 1e9 from a prior at 0
def poisson(y):
    a = numpyro.sample("a", dist.Normal(0.0, 1.0))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.exp(a)), obs=y)

out["poisson"] = {}
for lam in (1e6, 1e9):
    y = np.random.default_rng(0).poisson(lam, 50).astype(np.float32)
    r = blr_fit(poisson, {"y": y}, progress_bar=False)
    out["poisson"][str(lam)] = {"mean": float(r.posterior["a"].mean), "log_ybar": float(np.log(y.astype(float).mean())),
                                "converged": bool(r.converged), "message": r.message}

# an exchangeable mixture in float32 (k-means++ start: no symmetric plateau)
def mixture(y):
    w = numpyro.sample("w", dist.Dirichlet(jnp.ones(3)))
    locs = numpyro.sample("locs", dist.Normal(0.0, 10.0).expand([3]).to_event(1))
    with numpyro.plate("n", y.shape[0]):
        z = numpyro.sample("z", dist.Categorical(w))
        numpyro.sample("y", dist.Normal(locs[z], 1.0), obs=y)

rng = np.random.default_rng(6)
y_mix = np.concatenate([rng.normal(m, 1.0, 40) for m in (-4.0, 0.3, 4.5)]).astype(np.float32)
r = blr_fit(mixture, {"y": y_mix}, rng_key=random.PRNGKey(1), progress_bar=False)
out["mixture"] = {"locs": sorted(float(v) for v in np.asarray(r.posterior["locs"].mean)),
                  "centres": [float(y_mix[i * 40:(i + 1) * 40].mean()) for i in range(3)],
                  "converged": bool(r.converged)}

# NumPyro's stochastic-volatility example (a Student-t with latent df and log-scale by 2-D
# quadrature over a 2,000-state banded walk) on the data of its float64 NUTS reference
import sys
sys.path.insert(0, "tests")
import reference_models as rm
model, data = rm.get("student_t_volatility")
r = blr_fit(model, data, rng_key=random.PRNGKey(0), progress_bar=False)
s = r.posterior["s"]
out["student_t_volatility"] = {"mean": np.asarray(s.mean).tolist(), "sd": np.sqrt(np.asarray(s.variance)).tolist(),
                               "dtype": str(np.asarray(s.mean).dtype), "converged": bool(r.converged),
                               "message": r.message, "elbo": [float(e) for e in r.elbo]}

# a GP prior over a 10 x 10 distance matrix, Poisson counts whose rate is a P^b / g exp(k): from
# unit variances the Monte Carlo messages of the log scales overflow in float32
model, data = rm.get("oceanic_gp")
for name, refine in (("oceanic_gp_first", False), ("oceanic_gp", True)):
    r = blr_fit(model, data, rng_key=random.PRNGKey(0), progress_bar=False, refine=refine)
    out[name] = {n: [np.ravel(r.posterior[n].mean).tolist(), np.sqrt(np.ravel(r.posterior[n].variance)).tolist()]
                 for n in ("etasq", "rhosq", "a", "b", "g", "k")}
    out[name].update(converged=bool(r.converged), message=r.message, steps=int(r.num_steps),
                     poor=bool(r.diagnostics.poor()), khat=float(r.diagnostics.khat))

# an AR(1) state with a bounded persistence (read through its moments) started from its
# stationary distribution (integrated on a grid): both quadratures in single precision
from unit.estimators.test_grid import stationary_ar1, stationary_ar1_data
r = blr_fit(stationary_ar1, {"y": stationary_ar1_data().astype(np.float32)}, rng_key=random.PRNGKey(0),
            progress_bar=False, refine=False)
u = r.posterior["phi"].base_dist
out["stationary_ar1"] = {"x": np.asarray(r.posterior["x"].mean).tolist(), "u": [float(u.mean), float(u.variance)],
                         "dtype": str(np.asarray(r.posterior["x"].mean).dtype), "converged": bool(r.converged),
                         "message": r.message, "elbo": [float(e) for e in r.elbo]}

# a local linear trend written as two sites of one scan, stored step by step in one banded block
from integration.test_state_space import _trend_data, local_linear_trend_scan
r = blr_fit(local_linear_trend_scan, {"y": _trend_data(40).astype(np.float32)}, rng_key=random.PRNGKey(0),
            progress_bar=False)
out["local_linear_trend"] = {
    n: {"mean": np.ravel(r.posterior[n].mean).tolist(), "var": np.ravel(r.posterior[n].variance).tolist()}
    for n in ("level0", "slope0", "level", "slope")
}
out["local_linear_trend"]["steps"] = int(r.num_steps)

# eight schools (NumPyro's docs, centred) with the spread integrated on a grid
r = blr_fit(rm.eight_schools_model, rm.EIGHT_SCHOOLS, families={"tau": "grid"}, rng_key=random.PRNGKey(0),
            progress_bar=False)
tau = np.asarray(r.sample(random.PRNGKey(1), 200_000)["tau"], dtype=np.float64)
out["schools_grid"] = {"tau": [float(tau.mean()), float(tau.std())], "theta": np.asarray(r.posterior["theta"].mean).tolist(),
                       "dtype": str(np.asarray(r.posterior["theta"].mean).dtype)}

# the narrow-q check in single precision: a hand-built q a tenth as wide as the exact posterior
# (N(z / 1.25, 0.2) for each site) along x, read by the fit's compiled check
def two_means(z1, z2):
    x = numpyro.sample("x", dist.Normal(0.0, 1.0))
    y = numpyro.sample("y", dist.Normal(0.0, 1.0))
    numpyro.sample("z1", dist.Normal(x, 0.5), obs=z1)
    numpyro.sample("z2", dist.Normal(y, 0.5), obs=z2)

from blrppl.engine.build import model_data
from blrppl.engine.prepare import prepare
from blrppl.families.gaussian import GaussianView
from blrppl.inputs import fit_options
from blrppl.model.program import ModelProgram
from blrppl.posterior.narrow import widths
z = (np.float32(0.8), np.float32(-0.4))
p = prepare(ModelProgram(two_means), z, {}, fit_options(structure="joint"), random.PRNGKey(0))
(b,) = p.plan.blocks
q = GaussianView(jnp.asarray(z) / 1.25, jnp.diag(jnp.asarray([0.01, 1.0], jnp.float32) * 0.2))
found = widths(p.bundle.narrow_sites, *p.bundle.narrow({b.name: b.family.nat_from_view(q)},
                                                       model_data(p.plan, p.dyn_data), random.PRNGKey(1)))
out["narrow"] = {w.site: [w.ratio, w.se, w.narrow()] for w in found}
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def float32_run():
    rng = np.random.default_rng(0)
    y_nn = (3.0 + 0.5 * rng.normal(size=20)).astype(np.float32)
    y_bb = np.array([1, 0, 1, 1, 1, 0, 1, 1, 0, 1], dtype=np.float32)
    code = CODE.replace("Y_NN", json.dumps(y_nn.tolist())).replace("Y_BB", json.dumps(y_bb.tolist()))
    env = dict(os.environ)
    env.pop("JAX_ENABLE_X64", None)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT") :]), y_nn.astype(np.float64), y_bb.astype(np.float64)


def test_float32_dtypes(float32_run):
    out, _, _ = float32_run
    for name in ("nn", "bb"):
        assert out[name]["dtypes"] == ["float32"], (name, out[name]["dtypes"])
        assert out[name]["elbo_dtype"] == "float32"


def test_float32_normal_normal(float32_run):
    out, y, _ = float32_run
    r = out["nn"]
    assert r["converged"], r["message"]
    assert np.all(np.isfinite(r["elbo"])) and r["finite_samples"]
    precision = 1 / 2.0**2 + len(y) / 0.5**2
    mean = (1.0 / 2.0**2 + y.sum() / 0.5**2) / precision
    np.testing.assert_allclose(r["params"]["mean"], mean, rtol=1e-4)
    np.testing.assert_allclose(r["params"]["var"], 1 / precision, rtol=1e-4)


def test_float32_beta_bernoulli(float32_run):
    out, _, y = float32_run
    r = out["bb"]
    assert r["converged"], r["message"]
    assert np.all(np.isfinite(r["elbo"])) and r["finite_samples"]
    np.testing.assert_allclose(r["params"]["a"], 2.0 + y.sum(), rtol=1e-4)
    np.testing.assert_allclose(r["params"]["b"], 3.0 + len(y) - y.sum(), rtol=1e-4)


def test_float32_every_key_spelling(float32_run):
    out, _, _ = float32_run
    elbos = out["keys"]
    assert elbos["PRNGKey"] == elbos["key"] == elbos["seed"]
    assert np.isfinite(out["svi_loss"])


def test_float32_poisson_counts_up_to_1e9(float32_run):
    out, _, _ = float32_run
    for lam, r in out["poisson"].items():
        assert r["converged"], (lam, r["message"])
        # the posterior sd of a is about 1/sqrt(50 * lam) < 1.5e-4: the mean is log(ȳ) up to
        # float32 rounding of a ~ 20
        assert abs(r["mean"] - r["log_ybar"]) < 1e-4 * max(1.0, abs(r["log_ybar"])), (lam, r)


def test_float32_exchangeable_mixture_finds_the_clusters(float32_run):
    out, _, _ = float32_run
    r = out["mixture"]
    assert r["converged"]
    np.testing.assert_allclose(r["locs"], r["centres"], atol=0.3)


def test_float32_numpyro_stochastic_volatility_matches_nuts(float32_run):
    """NumPyro's stochastic-volatility example in float32 (its (s, nu) quadrature and the
    banded walk's passes in single precision): converged with finite ELBOs, every state's
    sd within 20 % of the float64 NUTS reference (the float64 fit's bar,
    tests/integration/test_nonconjugate.py) and its mean within 0.3 NUTS sd: float32's default stopping
    rule (relative ELBO change 1e-5, 0.05 nats of an ELBO of 5,000) ends while the first
    days' states, which few returns pull, still move (measured 0.22 sd at s[7], 0.03 sd on
    average; 0.10 with tol=1e-6, 0.06 in float64)."""
    out, _, _ = float32_run
    r = out["student_t_volatility"]
    assert r["converged"], r["message"]
    assert r["dtype"] == "float32" and np.all(np.isfinite(r["elbo"]))
    params = json.loads((ROOT / "tests" / "data" / "student_t_volatility.json").read_text())["params"]
    ref_mean = np.array([params[f"s[{t}]"]["mean"] for t in range(len(r["mean"]))])
    ref_sd = np.array([params[f"s[{t}]"]["sd"] for t in range(len(r["mean"]))])
    err = np.abs(np.asarray(r["mean"]) - ref_mean) / ref_sd
    ratio = np.asarray(r["sd"]) / ref_sd
    assert err.max() <= 0.3 and err.mean() <= 0.05, (err.argmax(), err.max(), err.mean())
    assert np.abs(ratio - 1.0).max() <= 0.2, (np.abs(ratio - 1.0).argmax(), ratio.min(), ratio.max())


def test_float32_bounded_persistence_and_grid_match_float64(float32_run):
    """The stationary AR(1) of tests/unit/estimators/test_grid.py (a persistence on (−1, 1) read through its
    moments, a start integrated on a grid) in float32 matches the same fit in float64: the
    states' means within 2e-3 (a hundredth of their sd; float32 stops at a relative ELBO
    change of 1e-5), q(u) of the persistence within 1 %. The first fits (``refine=False``):
    both are poor (importance ESS 0.21-0.22), and which remedies the refinement tries depends
    on Monte Carlo estimates near their thresholds (the narrow-q check read the persistence at
    1.33 ± 0.06 in float32, flagged, and 1.31 ± 0.09 in float64, not), not on the precision's
    numerics this test compares."""
    import jax
    from unit.estimators.test_grid import stationary_ar1, stationary_ar1_data

    from blrppl import blr_fit

    out, _, _ = float32_run
    r = out["stationary_ar1"]
    assert r["converged"], r["message"]
    assert r["dtype"] == "float32" and np.all(np.isfinite(r["elbo"]))
    ref = blr_fit(
        stationary_ar1, {"y": stationary_ar1_data()}, rng_key=jax.random.key(0), progress_bar=False, refine=False
    )
    u = ref.posterior["phi"].base_dist
    np.testing.assert_allclose(r["x"], np.asarray(ref.posterior["x"].mean), atol=2e-3)
    np.testing.assert_allclose(r["u"], [float(u.mean), float(u.variance)], rtol=1e-2)


def test_float32_two_component_state_is_exact(float32_run):
    """The local linear trend of tests/integration/test_state_space.py (level and slope, two sites of one
    scan, stored step by step in one banded block) in float32: one step, the exact posterior
    (float64, computed here) to float32 precision."""
    from integration.test_state_space import _trend_data, exact_gaussian, local_linear_trend_scan

    out, _, _ = float32_run
    r = out["local_linear_trend"]
    assert r["steps"] == 1
    shapes = {"level0": (), "slope0": (), "level": (40,), "slope": (40,)}
    mean, cov = exact_gaussian(local_linear_trend_scan, {"y": _trend_data(40)}, shapes)
    means = np.concatenate([r[n]["mean"] for n in shapes])
    variances = np.concatenate([r[n]["var"] for n in shapes])
    np.testing.assert_allclose(means, mean, atol=1e-4 * np.abs(mean).max())
    np.testing.assert_allclose(variances, np.diag(cov), rtol=1e-4)


def test_float32_eight_schools_spread_on_a_grid(float32_run):
    """The grid's fits in float32 (each from the model's starting state: started from its
    neighbour's, a fit at τ = e⁻⁶ carried a precision the fits at larger τ did not recover
    from, and τ came out 0.003): τ's mean and sd within 2 % of the exact posterior's, θ's
    means within 1 %."""
    from unit.engine.test_scale_grid import exact_eight_schools

    out = float32_run[0]["schools_grid"]
    m, sd, theta = exact_eight_schools()
    assert out["dtype"] == "float32"
    assert abs(out["tau"][0] - m) < 0.02 * m and abs(out["tau"][1] - sd) < 0.02 * sd, (out["tau"], m, sd)
    np.testing.assert_allclose(out["theta"], theta, rtol=1e-2)


def test_float32_narrow_q_check_sees_a_q_a_tenth_as_wide(float32_run):
    """The narrow-q check in single precision: on a hand-built q whose sd along x is a tenth of
    the exact posterior's, x is flagged with a ratio within 15 % of 10 and y is read as 1
    (within 10 %) and not flagged (tests/unit/posterior/test_narrow.py has the float64 case)."""
    found = float32_run[0]["narrow"]
    assert set(found) == {"x", "y"}
    (rx, _, nx), (ry, _, ny) = found["x"], found["y"]
    assert abs(rx / 10.0 - 1.0) < 0.15 and nx, found
    assert abs(ry - 1.0) < 0.1 and not ny, found


def _near_gp_reference(r) -> list:
    """The sites of a float32 oceanic GP fit off NUTS's reference: a mean more than 1.5 of its
    sds away, or an sd outside 0.3–2× its."""
    params = json.loads((ROOT / "tests" / "data" / "oceanic_gp.json").read_text())["params"]
    off = []
    for site in ("etasq", "rhosq", "a", "b", "g", "k"):
        names = [f"k[{i}]" for i in range(10)] if site == "k" else [site]
        ref_mean = np.array([params[n]["mean"] for n in names])
        ref_sd = np.array([params[n]["sd"] for n in names])
        mean, sd = (np.asarray(x) for x in r[site])
        if not (np.all(np.abs(mean - ref_mean) <= 1.5 * ref_sd) and np.all((sd >= 0.3 * ref_sd) & (sd <= 2.0 * ref_sd))):
            off.append((site, mean.tolist(), sd.tolist(), ref_mean.tolist(), ref_sd.tolist()))
    return off


def test_float32_gp_poisson_started_narrowed_lands_near_nuts(float32_run):
    """A GP prior over a 10 × 10 distance matrix with Poisson counts whose rate is
    a P^b / g · exp(k) (populations of 10²–10⁵): in float32, from unit variances on the log
    scales, the Monte Carlo messages overflowed; the fit drifted off in its first hundred steps,
    then kept its parameters in 900 of the next 900 and ended up to 635 NUTS sd away, not
    converged. A fresh start stuck for most of a chunk now starts again narrowed and converges.
    A Gaussian q holds this funnel only roughly (PSIS k̂ ≈ 0.5–1, warned): the default fit's
    means within 1.03 NUTS sd (b, the exponent) and sds 0.48–1.33× the reference's (2026-12-08);
    the bounds leave room for that, and none for hundreds of sds.

    The first fit alone (``refine=False``) is fragile here: on one machine it landed as the
    default fit does; on another (the same code and package versions) it converged after
    141 steps with the variances of a, b, g and k collapsed (b 5.4 sds off, PSIS k̂ 1.73, its
    bound 48,000 nats below the candidates'), as did key 1 (two of keys 0–7 there). It must then say
    so (the poor-q warning). The default refinement recovered it on a quiet machine (an
    over-dispersed start, k̂ 0.67) and kept it under load (its time budget spent on the grid
    candidate first): either fit lands near NUTS or warns, never silently off."""
    out, _, _ = float32_run
    r = out["oceanic_gp"]
    assert r["converged"], r["message"]
    assert not _near_gp_reference(r) or r["poor"], (r["khat"], _near_gp_reference(r))
    first = out["oceanic_gp_first"]
    assert first["converged"], first["message"]
    assert not _near_gp_reference(first) or first["poor"], (first["khat"], _near_gp_reference(first))
