"""What the rules read of a site's distribution: the leaves its density uses, and arguments read
on log space."""

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest


@pytest.mark.parametrize(
    "make, read",
    [
        # canonical leaves: _chi2 (concentration, df, rate), df, loc, scale; the Chi2 is kept
        # for sampling only
        (lambda: dist.StudentT(jnp.full(3, 4.0), 0.0, jnp.ones(3)), {3, 4, 5}),
        # concentration, df, rate: the density is the Gamma's
        (lambda: dist.Chi2(jnp.full(3, 4.0)), {0, 2}),
        (lambda: dist.Normal(0.0, jnp.ones(3)), {0, 1}),
    ],
)
def test_log_prob_reads_only_the_leaves_the_density_uses(make, read):
    from blrppl.model.functions import canonical_leaves, log_prob_reads

    d = make()
    leaves, tree = canonical_leaves(d)
    assert log_prob_reads(d, leaves, tree, jnp.ones(3)) == frozenset(read)


def _log_link_model(y):
    h = numpyro.sample("h", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
    numpyro.sample("y", dist.Poisson(jnp.exp(h)).to_event(1), obs=y)
    numpyro.sample("w", dist.Poisson(2.0 * jnp.exp(h)).to_event(1), obs=y)


@pytest.mark.parametrize(
    "site, expected",
    [
        # the rate is exp(h): its log is read from the program, exact where exp(h) overflows
        ("y", [800.0, 0.0, -1.0]),
        # 2 exp(h) is not an exponential's result: log of the value (inf at the overflow)
        ("w", [np.inf, np.log(2.0), np.log(2.0) - 1.0]),
    ],
)
def test_log_normal_arguments_are_read_on_log_space(site, expected):
    from blrppl.model.functions import ModelFunctions
    from blrppl.model.program import ModelProgram
    from blrppl.graph.data import DataSpec

    spec, dyn = DataSpec.split((np.array([1.0, 2.0, 3.0]),), {})
    inputs = {}
    sites = ModelProgram(_log_link_model).sites(
        ("y", "w"), {"h": jnp.array([800.0, 0.0, -1.0])}, dyn, {}, spec, exp_inputs=inputs
    )
    logged = ModelFunctions.rule_args(sites[site], ("rate",), {"rate"}, inputs)
    np.testing.assert_allclose(logged["rate"], expected, rtol=1e-15)
    plain = ModelFunctions.rule_args(sites[site], ("rate",))
    np.testing.assert_allclose(plain["rate"], np.exp(expected))
