"""A hidden Markov model of regimes: three states with unknown means, precisions and
transition probabilities, written with ``scan`` as NumPyro's HMM examples write it.

The compiler finds that each step's state reads the previous one and fits the 1,000 states as
one chain block (``plan.describe()`` says "categorical-chain"): its update is the
forward–backward algorithm with the expected log parameters, and the parameters' updates
use the expected transition counts and state occupancies, so the whole fit is variational
Bayes for HMMs (Baum–Welch with posteriors instead of point estimates).

Run with ``python examples/hmm.py``.
"""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import random
from numpyro.contrib.control_flow import scan

from blrppl import blr_fit

TRANS = np.array([[0.95, 0.04, 0.01], [0.03, 0.94, 0.03], [0.02, 0.08, 0.90]])
LOCS = np.array([-1.0, 0.5, 2.0])
SDS = np.array([0.5, 0.3, 0.8])


def regimes(y):
    """x_t ~ Categorical(trans[x_{t−1}]), y_t ~ Normal(loc[x_t], prec[x_t]^−½)."""
    k = len(LOCS)
    trans = numpyro.sample("trans", dist.Dirichlet(jnp.ones((k, k)) + 4.0 * jnp.eye(k)).to_event(1))
    with numpyro.plate("states", k):
        loc = numpyro.sample("loc", dist.Normal(jnp.array([-1.0, 0.0, 1.0]), 2.0))
        prec = numpyro.sample("prec", dist.Gamma(2.0, 1.0))

    def step(prev, y_t):
        x = numpyro.sample("x", dist.Categorical(trans[prev]))
        numpyro.sample("y", dist.Normal(loc[x], 1.0 / jnp.sqrt(prec[x])), obs=y_t)
        return x, None

    scan(step, 0, y)


def simulate(num_steps, rng):
    x = np.zeros(num_steps, int)
    for t in range(1, num_steps):
        x[t] = rng.choice(len(LOCS), p=TRANS[x[t - 1]])
    return x, LOCS[x] + SDS[x] * rng.normal(size=num_steps)


def main(num_steps=1000):
    x, y = simulate(num_steps, np.random.default_rng(0))
    start = time.perf_counter()
    fit = blr_fit(regimes, (jnp.asarray(y),), rng_key=random.PRNGKey(0), progress_bar=False)
    seconds = time.perf_counter() - start
    print(fit.plan.describe())
    probs = np.asarray(fit.posterior["x"].probs)
    decoded = probs.argmax(-1)
    trans = np.asarray(fit.posterior["trans"].mean)
    loc = np.asarray(fit.posterior["loc"].mean)
    sd = 1.0 / np.sqrt(np.asarray(fit.posterior["prec"].mean))
    print(f"\n{num_steps} steps of data: {fit.num_steps} BLR steps, {seconds:.1f} s in all")
    print(f"  states decoded right: {np.mean(decoded == x):.3f}")
    print(f"  means {np.round(loc, 2)} (simulated {LOCS}), sds {np.round(sd, 2)} (simulated {SDS})")
    print(f"  transition probabilities\n{np.round(trans, 3)}\n  (simulated)\n{TRANS}")
    return fit, x, decoded, trans, loc


if __name__ == "__main__":
    main()
