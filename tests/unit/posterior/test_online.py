"""Online (sequential) Bayes: ``blr_fit(model, new_data, prior=previous_result)``.

For a conjugate model the posterior after the first part of the data is in the block's
family, so using it as the prior of the second part is exact: p(x | D₁, D₂) ∝ p(D₂ | x)
p(x | D₁). Sequential fits must therefore equal the batch posterior, computed here by hand
from the textbook closed forms (never from the library), in float64 to 1e-8. The ELBO of an
online fit whose q is the exact posterior equals the log evidence of the new data under the
previous posterior, log ∫ p(D₂ | x) q_prev(x) dx, also in closed form: this checks the
absolute value of E_q[log q_prev] (log-partition and base measure), not only its gradient.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from scipy.special import gammaln, betaln
from scipy.stats import multivariate_normal

import blrppl.engine.build as build
from blrppl.api import blr_fit
from blrppl.errors import BLRError, OnlinePriorError
from blrppl.graph.plan import FactorRole
from describe_table import factor_rows

ATOL = 1e-8
ROOT = Path(__file__).resolve().parents[3]


def fit(model, data, prior=None, **kw):
    return blr_fit(model, data, prior=prior, rng_key=jax.random.key(0), progress_bar=False, **kw)


def split(data: dict, pieces: int) -> list:
    """Equal consecutive parts of every data array (along the data axis)."""
    return [dict(zip(data, parts)) for parts in zip(*(np.split(v, pieces) for v in data.values()))]


def gaussian_view(result, block):
    view = result.plan.block(block).family.view(result.nat[block])
    return np.asarray(view.mean), np.asarray(view.cov)


# ---------------------------------------------------------------------------------------
# cases: model, data, prior parameters, closed-form posterior and log evidence, reader
# ---------------------------------------------------------------------------------------


class LinReg:
    """Known-noise linear regression with a weight vector ``w`` and a separate intercept
    ``b`` (the engine merges them into one joint Gaussian block "(w, b)"); with Z = [X, 1],
    S_n⁻¹ = S₀⁻¹ + ZᵀZ/σ², m_n = S_n (S₀⁻¹ m₀ + Zᵀy/σ²); evidence y ~ N(Z m₀, σ²I + Z S₀ Zᵀ)."""

    sigma, s_w, s_b = 0.7, 2.0, 3.0
    prior = (np.zeros(3), np.diag([4.0, 4.0, 9.0]))

    def __init__(self):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(24, 2))
        self.data = {"X": x, "y": x @ np.array([1.0, -2.0]) + 0.5 + self.sigma * rng.normal(size=24)}

    def model(self, X, y):
        w = numpyro.sample("w", dist.Normal(0.0, self.s_w).expand([2]).to_event(1))
        b = numpyro.sample("b", dist.Normal(0.0, self.s_b))
        with numpyro.plate("n", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w + b, self.sigma), obs=y)

    @staticmethod
    def design(data):
        return np.column_stack([data["X"], np.ones(len(data["y"]))])

    def posterior(self, params, data):
        m0, s0 = params
        z = self.design(data)
        prec = np.linalg.inv(s0) + z.T @ z / self.sigma**2
        cov = np.linalg.inv(prec)
        return cov @ (np.linalg.solve(s0, m0) + z.T @ data["y"] / self.sigma**2), cov

    def log_evidence(self, params, data):
        m0, s0 = params
        z = self.design(data)
        cov = self.sigma**2 * np.eye(len(data["y"])) + z @ s0 @ z.T
        return multivariate_normal(z @ m0, cov).logpdf(data["y"])

    def read(self, result):
        assert [b.name for b in result.plan.blocks] == ["(w, b)"], result.plan.describe()
        return gaussian_view(result, "(w, b)")


class BetaBernoulli:
    prior = (2.0, 3.0)

    def __init__(self):
        self.data = {"y": np.array([1, 0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1], dtype=float)}

    def model(self, y):
        p = numpyro.sample("p", dist.Beta(*self.prior))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Bernoulli(p), obs=y)

    def posterior(self, params, data):
        a, b = params
        k, n = data["y"].sum(), len(data["y"])
        return a + k, b + n - k

    def log_evidence(self, params, data):
        a, b = params
        k, n = data["y"].sum(), len(data["y"])
        return betaln(a + k, b + n - k) - betaln(a, b)

    def read(self, result):
        q = result.posterior["p"]
        return q.concentration1, q.concentration0


class GammaPoisson:
    prior = (2.0, 1.5)

    def __init__(self):
        self.data = {"y": np.array([3, 4, 2, 5, 0, 7, 3, 1, 2, 6, 4, 3], dtype=float)}

    def model(self, y):
        lam = numpyro.sample("lam", dist.Gamma(*self.prior))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Poisson(lam), obs=y)

    def posterior(self, params, data):
        a, b = params
        return a + data["y"].sum(), b + len(data["y"])

    def log_evidence(self, params, data):
        a, b = params
        y = data["y"]
        s, n = y.sum(), len(y)
        return -gammaln(y + 1).sum() + gammaln(a + s) - gammaln(a) + a * np.log(b) - (a + s) * np.log(b + n)

    def read(self, result):
        q = result.posterior["lam"]
        return q.concentration, q.rate


class DirichletCategorical:
    prior = (np.array([1.0, 0.5, 2.0, 1.5]),)

    def __init__(self):
        self.data = {"y": np.array([0, 1, 1, 2, 2, 2, 3, 0, 2, 2, 1, 3], dtype=np.int32)}

    def model(self, y):
        pi = numpyro.sample("pi", dist.Dirichlet(jnp.asarray(self.prior[0])))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Categorical(pi), obs=y)

    def posterior(self, params, data):
        return (params[0] + np.bincount(data["y"], minlength=4),)

    def log_evidence(self, params, data):
        def log_b(alpha):
            return gammaln(alpha).sum() - gammaln(alpha.sum())

        (alpha,) = params
        return log_b(alpha + np.bincount(data["y"], minlength=4)) - log_b(alpha)

    def read(self, result):
        return (result.posterior["pi"].concentration,)


class LogNormalScale:
    """s ~ LogNormal(m₀, s₀), z_n ~ N(log s, σ): the block of s is a Gaussian on u = log s
    with a "s:jacobian" term, which the previous posterior (a density in u) replaces too.
    In u the model is normal–normal, so the batch posterior is Gaussian in u (its prior and
    Jacobian factors are quadratic in u: exact under Gauss–Hermite quadrature)."""

    sigma = 0.5
    prior = (0.3, 0.64)  # mean and variance of u = log s

    def __init__(self):
        rng = np.random.default_rng(3)
        self.data = {"z": 1.2 + self.sigma * rng.normal(size=12)}

    def model(self, z):
        s = numpyro.sample("s", dist.LogNormal(self.prior[0], np.sqrt(self.prior[1])))
        with numpyro.plate("n", z.shape[0]):
            numpyro.sample("z", dist.Normal(jnp.log(s), self.sigma), obs=z)

    def posterior(self, params, data):
        m, v = params
        prec = 1 / v + len(data["z"]) / self.sigma**2
        return (m / v + data["z"].sum() / self.sigma**2) / prec, 1 / prec

    def log_evidence(self, params, data):
        m, v = params
        n = len(data["z"])
        return multivariate_normal(np.full(n, m), self.sigma**2 * np.eye(n) + v).logpdf(data["z"])

    def read(self, result):
        base = result.posterior["s"].base_dist
        return base.loc, base.scale**2


CASES = {
    "linreg_with_intercept": LinReg,
    "beta_bernoulli": BetaBernoulli,
    "gamma_poisson": GammaPoisson,
    "dirichlet_categorical": DirichletCategorical,
    "lognormal_scale_jacobian": LogNormalScale,
}


def assert_params(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), w, rtol=0, atol=ATOL)


def exact_posterior(case, parts):
    params = case.prior
    for part in parts:
        params = case.posterior(params, part)
    return params


@pytest.fixture(scope="module", params=list(CASES))
def fits(request):
    """Per case: the batch fit; a fit of the first half and the online fit of the second
    half on it; three successive fits of thirds, counting compilations."""
    case = CASES[request.param]()
    first, second = split(case.data, 2)
    previous = fit(case.model, first)
    snapshot = jax.tree.map(np.array, previous.nat), {k: v.copy() for k, v in second.items()}
    online = fit(case.model, second, prior=previous)
    batch = fit(case.model, case.data)
    compiles = []
    original = build.compile_fit
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build, "compile_fit", lambda *a, **k: compiles.append(a[0]) or original(*a, **k))
        parts = split(case.data, 3)
        chain = [fit(case.model, parts[0])]
        for part in parts[1:]:
            chain.append(fit(case.model, part, prior=chain[-1]))
    return SimpleNamespace(
        case=case, first=first, second=second, previous=previous, snapshot=snapshot, online=online,
        batch=batch, parts=parts, chain=chain, compiles=len(compiles),
    )


# ---------------------------------------------------------------------------------------
# sequential = batch
# ---------------------------------------------------------------------------------------


def test_two_halves_equal_batch(fits):
    case = fits.case
    want = case.posterior(case.prior, case.data)
    assert_params(case.read(fits.batch), want)
    assert_params(case.read(fits.online), want)
    assert fits.online.converged, fits.online.message
    # the new plan: the priors (and Jacobian) of the matched blocks became one previous-
    # posterior pseudo-factor per block, shown by describe()
    rows = factor_rows(fits.online.plan.describe())
    for block in fits.online.plan.blocks:
        assert f"{block.name}:previous" in rows
        assert f"{block.name}:jacobian" not in rows
        for site in block.sites:
            assert site not in rows
    # the pseudo-factors are told by their role (their names are for display)
    roles = {f.name: f.role for f in fits.online.plan.factors}
    assert {n for n, r in roles.items() if r == FactorRole.PREVIOUS} == {
        f"{b.name}:previous" for b in fits.online.plan.blocks
    }
    assert FactorRole.JACOBIAN not in roles.values()
    observed = {f.name for f in fits.batch.plan.factors if f.observed}
    assert {f.name for f in fits.online.plan.factors if f.observed} == observed


def test_three_updates_equal_batch_and_reuse_one_compiled_fit(fits):
    for k, result in enumerate(fits.chain):
        assert_params(fits.case.read(result), exact_posterior(fits.case, fits.parts[: k + 1]))
    # the first fit and the first online fit compile; the second online update (data and
    # previous posterior of the same shapes, other values) reuses the online fit: the
    # previous natural parameters are run-time data, not constants of the compiled fit
    assert fits.compiles == 2


def test_elbo_is_log_evidence_under_previous_posterior(fits):
    case = fits.case
    want = case.log_evidence(case.posterior(case.prior, fits.first), fits.second)
    np.testing.assert_allclose(fits.online.elbo[-1], want, rtol=0, atol=ATOL)
    # and the batch ELBO is the log evidence of all the data under the model's prior
    np.testing.assert_allclose(fits.batch.elbo[-1], case.log_evidence(case.prior, case.data), rtol=0, atol=ATOL)


def test_user_data_and_previous_result_not_mutated(fits):
    nat_before, data_before = fits.snapshot
    for a, b in zip(jax.tree.leaves(fits.previous.nat), jax.tree.leaves(nat_before)):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert not any(f.role == FactorRole.PREVIOUS for f in fits.previous.plan.factors)
    for k in fits.second:
        np.testing.assert_array_equal(fits.second[k], data_before[k])


def test_online_fit_in_one_step_from_the_previous_posterior():
    """One step with ρ = 1: the previous posterior's message is exact and constant."""
    case = BetaBernoulli()
    first, second = split(case.data, 2)
    online = fit(case.model, second, prior=fit(case.model, first), num_steps=1, learning_rate=1.0)
    assert online.num_steps == 1
    assert_params(case.read(online), case.posterior(case.prior, case.data))


# ---------------------------------------------------------------------------------------
# which blocks take the previous posterior
# ---------------------------------------------------------------------------------------

MIX_SD = 0.7


def gmm(y):
    w = numpyro.sample("w", dist.Dirichlet(jnp.ones(3)))
    with numpyro.plate("k", 3):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("n", y.shape[0]):
        z = numpyro.sample("z", dist.Categorical(w))
        numpyro.sample("y", dist.Normal(mu[z], MIX_SD), obs=y)


def test_local_latents_keep_the_model_prior():
    """Per-datum assignments z (in the data's plate "n") keep their Categorical(w) prior;
    the global w and mu take their previous posteriors.

    Tolerances: the clusters are 5 and 6 apart with sd 0.7, so q(z_n) puts at most ~1e-6 on
    a wrong cluster (measured: the Dirichlet counts are within 4e-6 of the label counts) and
    the online fit, like the batch VMP fit, is the conjugate posterior given the true labels
    up to ~1e-6: counts to 1e-4 (1 + 20 per cluster), means to 1e-5 (measured 1e-7)."""
    rng = np.random.default_rng(0)
    labels = np.tile(np.arange(3), 20)
    y = np.array([-5.0, 0.0, 6.0])[labels] + MIX_SD * rng.normal(size=60)
    previous = fit(gmm, {"y": y[:30]})
    online = fit(gmm, {"y": y[30:]}, prior=previous)
    rows = factor_rows(online.plan.describe())
    assert set(rows) == {"w:previous", "mu:previous", "z", "y"}
    assert set(rows["z"]["neighbours"].split(", ")) == {"z", "w"}
    assert online.converged, online.message
    counts = np.bincount(labels, minlength=3)
    np.testing.assert_allclose(online.posterior["w"].concentration, 1.0 + counts, rtol=0, atol=1e-4)
    prec = 1 / 10.0**2 + counts / MIX_SD**2
    means = np.bincount(labels, weights=y, minlength=3) / MIX_SD**2 / prec
    order = np.argsort(np.asarray(online.posterior["mu"].mean))
    np.testing.assert_allclose(np.asarray(online.posterior["mu"].mean)[order], np.sort(means), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(online.posterior["mu"].variance)[order], 1 / prec[np.argsort(means)], rtol=1e-5)


def test_block_without_counterpart_keeps_its_prior():
    case = BetaBernoulli()
    first, second = split(case.data, 2)

    def extended(y):
        p = numpyro.sample("p", dist.Beta(*case.prior))
        q = numpyro.sample("q", dist.Beta(4.0, 1.0))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Bernoulli(p), obs=y)
        numpyro.sample("extra", dist.Bernoulli(q), obs=1.0)

    online = fit(extended, second, prior=fit(case.model, first))
    assert set(factor_rows(online.plan.describe())) == {"p:previous", "q", "y", "extra"}
    assert_params(case.read(online), case.posterior(case.prior, case.data))
    q = online.posterior["q"]
    np.testing.assert_allclose([q.concentration1, q.concentration0], [5.0, 1.0], atol=ATOL)


# ---------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------


def test_prior_must_be_a_result():
    case = BetaBernoulli()
    with pytest.raises(OnlinePriorError, match="BLRResult"):
        fit(case.model, case.data, prior={"p": dist.Beta(3.0, 4.0)})
    assert issubclass(OnlinePriorError, BLRError)


def test_other_family_names_the_site_and_the_fix():
    case = BetaBernoulli()
    first, second = split(case.data, 2)
    previous = fit(case.model, first, families={"p": "gaussian"})
    with pytest.raises(OnlinePriorError, match="site 'p'.*beta.*families=") as info:
        fit(case.model, second, prior=previous)
    assert info.value.site == "p"


def test_other_shape_names_the_site_and_suggests_a_plate():
    def model(y):
        # one latent per datum but outside the data's plate: a global latent whose shape
        # changes with the data
        z = numpyro.sample("z", dist.Normal(0.0, 1.0).expand([y.shape[0]]).to_event(1))
        numpyro.sample("y", dist.Normal(z, 1.0).to_event(1), obs=y)

    previous = fit(model, {"y": np.zeros(4)})
    with pytest.raises(OnlinePriorError, match=r"site 'z'.*shape.*numpyro.plate") as info:
        fit(model, {"y": np.zeros(5)}, prior=previous)
    assert info.value.site == "z"


def test_other_grouping_names_the_site():
    case = LinReg()
    first, second = split(case.data, 2)
    previous = fit(case.model, first, structure="mean-field")
    with pytest.raises(OnlinePriorError, match=r"site 'w'.*block 'w'.*'\(w, b\)'.*structure="):
        fit(case.model, second, prior=previous)
    # the same options both times work (a mean-field q_prev drops the w–b correlation:
    # assumed-density filtering, no longer the batch posterior)
    online = fit(case.model, second, prior=previous, structure="mean-field")
    assert set(factor_rows(online.plan.describe())) == {"w:previous", "b:previous", "y"}
    assert online.converged, online.message


def test_joint_block_mixing_global_and_local_sites():
    def model(y):
        m = numpyro.sample("m", dist.Normal(0.0, 1.0))
        with numpyro.plate("n", y.shape[0]):
            u = numpyro.sample("u", dist.Normal(m, 1.0))
            numpyro.sample("y", dist.Normal(u, 0.5), obs=y)

    previous = fit(model, {"y": np.arange(4.0)})
    assert previous.plan.blocks[0].members  # m and u merged into one joint Gaussian
    with pytest.raises(OnlinePriorError, match=r"site 'm'.*local.*'u'.*structure='mean-field'"):
        fit(model, {"y": np.arange(4.0)}, prior=previous)
    previous = fit(model, {"y": np.arange(4.0)}, structure="mean-field")
    online = fit(model, {"y": np.arange(5.0)}, prior=previous, structure="mean-field")
    assert set(factor_rows(online.plan.describe())) == {"m:previous", "u", "y"}


# ---------------------------------------------------------------------------------------
# float32
# ---------------------------------------------------------------------------------------

CODE32 = r"""
import json
import jax, numpy as np
import numpyro, numpyro.distributions as dist
assert not jax.config.jax_enable_x64
from blrppl.api import blr_fit

y = np.asarray(json.loads('Y_DATA'), dtype=np.float32)

def model(y):
    mu = numpyro.sample("mu", dist.Normal(1.0, 2.0))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 0.5), obs=y)

r = None
for part in np.split(y, 3):
    r = blr_fit(model, {"y": part}, prior=r, rng_key=jax.random.key(0), progress_bar=False)
q = r.posterior["mu"]
print("RESULT" + json.dumps({"mean": float(q.mean), "var": float(q.variance),
                             "dtypes": sorted({str(x.dtype) for x in jax.tree.leaves(r.nat)}),
                             "converged": bool(r.converged)}))
"""


def test_float32_sequential_updates():
    """Three updates in float32 (fresh interpreter without x64) against the float64 closed
    form at float32 tolerance (rtol 1e-4)."""
    y = 3.0 + 0.5 * np.random.default_rng(1).normal(size=24)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_ENABLE_X64": "0"}
    code = CODE32.replace("Y_DATA", json.dumps(y.tolist()))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert out["dtypes"] == ["float32"] and out["converged"]
    prec = 1 / 4.0 + len(y) / 0.25
    np.testing.assert_allclose(out["var"], 1 / prec, rtol=1e-4)
    np.testing.assert_allclose(out["mean"], (1 / 4.0 + y.sum() / 0.25) / prec, rtol=1e-4)
