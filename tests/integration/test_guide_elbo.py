"""``result.guide`` in numpyro's own ELBO: its sites have the model's event dims (a site in a
plate is not one event of q's shape), so ``Trace_ELBO`` accepts it, and its estimate of the
bound is the fit's own (the guide's log density is q's).

* Independent group means, conjugate: q is the exact posterior, so log p(x, y) − log q(x) is
  log p(y) at every draw and the two bounds agree to rounding.
* Group scales fitted on the log scale (not exact): ``Trace_ELBO`` with 4,000 draws has a
  standard error of about 0.005 nats here (the spread of three keys' estimates), the fit's
  own bound is exact for its q; 0.03 is six standard errors.
* Eight schools with its latents in one joint block (``structure="joint"``: θ is a member of
  the block, a ``Delta`` site with its log-Jacobian per school): both bounds are Monte Carlo
  estimates, each with a standard error under 0.03 nats; 0.1 is over three of their joint
  standard error.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.infer import Predictive, Trace_ELBO

from blrppl import blr_fit


def group_means(group, y=None):
    with numpyro.plate("groups", 4):
        theta = numpyro.sample("theta", dist.Normal(0.0, 3.0))
    with numpyro.plate("n", group.shape[0]):
        numpyro.sample("y", dist.Normal(theta[group], 1.0), obs=y)


def group_scales(group, y=None):
    with numpyro.plate("groups", 3):
        s = numpyro.sample("s", dist.Gamma(2.0, 2.0))
    with numpyro.plate("n", group.shape[0]):
        numpyro.sample("y", dist.Normal(0.0, s[group]), obs=y)


def eight_schools(J, sigma, y=None):
    mu = numpyro.sample("mu", dist.Normal(0, 5))
    tau = numpyro.sample("tau", dist.HalfCauchy(5))
    with numpyro.plate("J", J):
        theta = numpyro.sample("theta", dist.Normal(mu, tau))
        numpyro.sample("obs", dist.Normal(theta, sigma), obs=y)


rng = np.random.default_rng(0)
GROUPS = np.repeat(np.arange(4), 5)
SCALE_GROUPS = np.repeat(np.arange(3), 10)
SCHOOLS = (8, np.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0]))
CASES = {
    "exact": (group_means, {"group": GROUPS, "y": jnp.asarray(rng.normal(size=20) + GROUPS)}, {}, 1e-8),
    "log scale": (group_scales, {"group": SCALE_GROUPS, "y": rng.normal(size=30) * (1 + SCALE_GROUPS)}, {}, 0.03),
    "joint block": (
        eight_schools, {"J": SCHOOLS[0], "sigma": SCHOOLS[1], "y": np.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])},
        {"structure": "joint"}, 0.1,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_numpyro_trace_elbo_accepts_the_guide_and_agrees_with_the_fit(case):
    model, data, options, tol = CASES[case]
    result = blr_fit(model, data, rng_key=random.PRNGKey(0), progress_bar=False, refine=False, **options)
    elbo = -Trace_ELBO(num_particles=4000).loss(random.PRNGKey(1), {}, model, result.guide, **data)
    assert abs(float(elbo) - float(result.elbo[-1])) < tol, (elbo, result.elbo[-1])
    # Predictive keeps working with the guide; the model's sites have the model's shapes
    draws = Predictive(model, guide=result.guide, params=result.params, num_samples=3)(
        random.PRNGKey(2), **{k: v for k, v in data.items() if k != "y"}
    )
    assert draws["y" if "y" in draws else "obs"].shape[1:] == np.shape(data["y"])
