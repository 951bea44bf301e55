"""State-space models: a local-level model with a month of missing days, written with
``scan`` as NumPyro's time-series examples write it, and a count series whose log-rate is a
random walk. Both chains are far longer than a dense Gaussian block allows; the compiler
finds that each step reads only its neighbour and fits the states with a banded precision
(``plan.describe()`` says "gaussian-banded (bandwidth 1)").

Run with ``python examples/state_space.py``.
"""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.contrib.control_flow import scan

from blrppl import blr_fit


def local_level(y, seen):
    """x_t = x_{t−1} + N(0, s²), y_t ~ N(x_t, r²), y_t missing where ``seen`` is False."""
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    r = numpyro.sample("r", dist.HalfNormal(1.0))

    def step(level, inputs):
        y_t, seen_t = inputs
        level = numpyro.sample("level", dist.Normal(level, s))
        numpyro.sample("y", dist.Normal(level, r).mask(seen_t), obs=y_t)
        return level, level

    scan(step, 0.0, (y, seen))


def counts(c):
    """log λ_t a Gaussian random walk, c_t ~ Poisson(λ_t)."""
    log_rate = numpyro.sample("log_rate", dist.GaussianRandomWalk(0.1, num_steps=c.shape[0]))
    with numpyro.plate("t", c.shape[0]):
        numpyro.sample("c", dist.Poisson(jnp.exp(log_rate)), obs=c)


def main(num_days=2000):
    rng = np.random.default_rng(0)
    level = np.cumsum(0.3 * rng.normal(size=num_days))
    y = level + 0.5 * rng.normal(size=num_days)
    seen = np.ones(num_days, bool)
    seen[num_days // 2 : num_days // 2 + 30] = False  # a month without data
    start = time.perf_counter()
    fit = blr_fit(local_level, (jnp.asarray(np.where(seen, y, 0.0)), jnp.asarray(seen)), progress_bar=False)
    print(fit.plan.describe())
    post = fit.posterior["level"]
    gap = slice(num_days // 2, num_days // 2 + 30)
    print(f"\nlocal level, {num_days} days: {fit.num_steps} steps, {time.perf_counter() - start:.1f} s")
    print(f"  s = {float(fit.posterior['s'].mean):.3f} (simulated 0.3), r = {float(fit.posterior['r'].mean):.3f} (0.5)")
    sd = np.sqrt(np.asarray(post.variance))
    print(f"  posterior sd of the level: {sd[:gap.start].mean():.3f} where observed, up to {sd[gap].max():.3f} in the gap")

    log_rate = 1.5 + np.cumsum(0.05 * rng.normal(size=num_days))  # about 4 counts a day
    c = rng.poisson(np.exp(log_rate)).astype(float)
    start = time.perf_counter()
    count_fit = blr_fit(counts, (jnp.asarray(c),), progress_bar=False)
    est = np.asarray(count_fit.posterior["log_rate"].mean)
    print(f"\ncount series, {num_days} days: {count_fit.num_steps} steps, {time.perf_counter() - start:.1f} s, "
          f"rmse of log λ {np.sqrt(np.mean((est - log_rate) ** 2)):.3f}")
    return fit, level, seen, count_fit, log_rate


if __name__ == "__main__":
    main()
