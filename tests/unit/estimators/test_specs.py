"""A factor holds one record of its estimator's own extras (``Factor.spec``, of a type defined in
the estimator's module) and one record of how its discrete neighbours are enumerated
(``Factor.enumeration``), not an optional field per estimator: each built-in estimator's
choice on a small model carries a spec of its own type."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import random
from numpyro.distributions import constraints

from blrppl.api import plan_of
from blrppl.estimators.bilinear import BilinearSource
from blrppl.estimators.enumeration import Enumeration
from blrppl.estimators.exact import ExactSpec
from blrppl.estimators.gram import GramSource
from blrppl.estimators.quadrature import QuadratureSpec
from blrppl.estimators.registry import EstimatorChoice
from blrppl.graph.plan import EstimatorSpec, Factor

#: the per-estimator fields a Factor (and an EstimatorChoice) used to carry
OLD_FIELDS = {
    "links", "grid_positions", "powers", "pairs", "gram_block", "gram_pair", "gram_scale_rows", "chain_reads",
    "chain_table", "broadcast_enumeration",
}


def test_factor_and_choice_hold_no_per_estimator_fields():
    assert not OLD_FIELDS & {f.name for f in dataclasses.fields(Factor)}
    assert not OLD_FIELDS & set(EstimatorChoice._fields)
    assert {"spec", "enumeration"} <= {f.name for f in dataclasses.fields(Factor)}
    assert "spec" in EstimatorChoice._fields


def _factors(model, data) -> dict:
    plan = plan_of(model, data, rng_key=random.PRNGKey(0))
    factors = {f.name: f for f in plan.factors}
    for f in factors.values():
        # (specs and enumerations are compared when sites are stacked: they must hash)
        hash((f.spec, f.enumeration))
    return factors


def logistic(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0))
    with numpyro.plate("n", len(x)):
        numpyro.sample("y", dist.Bernoulli(logits=w * x), obs=y)


def test_a_quadrature_factor_records_its_projections():
    x = np.linspace(-2.0, 2.0, 30)
    factors = _factors(logistic, {"x": x, "y": (x > 0).astype(float)})
    spec = factors["y"].spec
    assert factors["y"].estimator == "quadrature" and type(spec) is QuadratureSpec
    assert [link for _, _, link in spec.links] == ["identity"] and spec.grid_positions == ()
    assert type(factors["w"].spec) is ExactSpec and factors["w"].spec == ExactSpec()


def gamma_precision(y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    tau = numpyro.sample("tau", dist.Gamma(2.0, 2.0))
    with numpyro.plate("n", 20):
        numpyro.sample("y", dist.Normal(mu, 1.0 / jnp.sqrt(tau)), obs=y)


def test_an_exact_factor_records_its_gamma_powers():
    y = np.random.default_rng(0).normal(1.0, 0.5, size=20)
    factors = _factors(gamma_precision, {"y": y})
    spec = factors["y"].spec
    assert factors["y"].estimator == "exact" and type(spec) is ExactSpec
    assert spec.powers == (("scale", -0.5),) and spec.pairs == () and not spec.from_statistics
    assert factors["y"].enumeration is None  # (no discrete neighbour)


def pca(Y):
    n, m = Y.shape
    with numpyro.plate("M", m):
        C = numpyro.sample("C", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    with numpyro.plate("N", n):
        X = numpyro.sample("X", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    with numpyro.plate("n", n, dim=-2), numpyro.plate("m", m, dim=-1):
        numpyro.sample("Y", dist.Normal(X @ C.T, 0.5), obs=Y)


def test_an_exact_factor_of_a_product_records_its_pairs_and_statistics():
    Y = np.random.default_rng(1).normal(size=(12, 5))
    spec = _factors(pca, {"Y": Y})["Y"].spec
    assert type(spec) is ExactSpec and spec.pairs == (("loc", (("X", "C"),)),)
    assert spec.statistics == BilinearSource(pair=("X", "C"), scale_rows="") and spec.from_statistics


def regression(X, y=None):
    w = numpyro.sample("w", dist.Normal(jnp.zeros(X.shape[1]), 1.0).to_event(1))
    with numpyro.plate("n", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, 0.3), obs=y)


def test_an_exact_factor_linear_in_a_large_block_records_its_gram_statistics():
    rng = np.random.default_rng(2)
    X = rng.normal(size=(50, 40))
    spec = _factors(regression, {"X": X, "y": rng.normal(size=50)})["y"].spec
    assert type(spec) is ExactSpec and spec.statistics == GramSource("w")


def wide_nonlinear():
    x = numpyro.sample("x", dist.Normal(jnp.zeros(10), 1.0).to_event(1))
    numpyro.factor("soft", -jnp.sum(jnp.cosh(x)))


def param_factor():
    s = numpyro.param("s", 1.0, constraint=constraints.positive)
    numpyro.factor("pull", -((jnp.log(s) - 0.3) ** 2))


def test_monte_carlo_and_delta_factors_record_nothing():
    factors = _factors(wide_nonlinear, {})
    assert factors["soft"].estimator == "monte_carlo" and type(factors["soft"].spec) is EstimatorSpec
    factors = _factors(param_factor, {})
    assert factors["pull"].estimator == "delta" and type(factors["pull"].spec) is EstimatorSpec
    # (what code that does not know the estimator asks of any spec has an answer)
    spec = factors["pull"].spec
    assert (spec.links, spec.powers, spec.pairs, spec.statistics, spec.from_statistics) == ((), (), (), None, False)


def mixture(y=None):
    weights = numpyro.sample("weights", dist.Dirichlet(jnp.ones(3)))
    mu = numpyro.sample("mu", dist.Normal(jnp.zeros(3), 5.0).to_event(1))
    with numpyro.plate("n", 40):
        z = numpyro.sample("z", dist.Categorical(weights))
        numpyro.sample("y", dist.Normal(mu[z], 1.0), obs=y)


def test_an_enumerated_factor_records_how_it_is_enumerated():
    y = np.concatenate([np.random.default_rng(3).normal(m, 1.0, size=(40 // 3 + 1)) for m in (-4, 0, 4)])[:40]
    factors = _factors(mixture, {"y": y})
    assert factors["y"].enumeration == Enumeration(broadcast=True)
    assert factors["mu"].enumeration is None
