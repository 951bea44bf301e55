"""Quick start: fit a NumPyro model with ``blr_fit`` and use the result.

Run with ``python examples/quickstart.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import Predictive

from blrppl import blr_fit


def model(y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    tau = numpyro.sample("tau", dist.Gamma(2.0, 2.0))
    with numpyro.plate("n", 100):
        numpyro.sample("y", dist.Normal(mu, 1.0 / jnp.sqrt(tau)), obs=y)


def main():
    y = jnp.asarray(np.random.default_rng(0).normal(1.5, 0.5, size=100))
    result = blr_fit(model, {"y": y}, progress_bar=False)
    print(result.message)
    print(result.plan.describe())
    stats = result.summary()  # prints a table; returns the numbers
    draws = result.sample(jax.random.key(0), 1000)  # site -> draws
    y_rep = Predictive(model, guide=result.guide, params=result.params, num_samples=200)(jax.random.key(1))["y"]
    print(f"posterior predictive mean {float(y_rep.mean()):.3f} (data mean {float(y.mean()):.3f})")
    return result, stats, draws, y_rep


if __name__ == "__main__":
    main()
