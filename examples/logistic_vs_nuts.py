"""Logistic regression: BLR (Gauss–Hermite messages, one joint Gaussian) against NUTS.

Run with ``python examples/logistic_vs_nuts.py``.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS

from blrppl import blr_fit


def model(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 2.0))
    with numpyro.plate("n", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w + b), obs=y)


def make_data(n=1000, d=5, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d))
    logits = x @ np.linspace(-1.5, 1.5, d) - 0.5
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-logits))).astype(float)
    return jnp.asarray(x), jnp.asarray(y)


def main(num_warmup=1000, num_samples=1000):
    x, y = make_data()
    start = time.perf_counter()
    result = blr_fit(model, (x, y), progress_bar=False)
    blr_seconds = time.perf_counter() - start
    start = time.perf_counter()
    mcmc = MCMC(NUTS(model), num_warmup=num_warmup, num_samples=num_samples, progress_bar=False)
    mcmc.run(jax.random.key(0), x, y)
    nuts_seconds = time.perf_counter() - start
    nuts = mcmc.get_samples()
    draws = result.sample(jax.random.key(1), 4000)
    rows = []
    for site in ("w", "b"):
        m_nuts, s_nuts = np.mean(nuts[site], 0), np.std(nuts[site], 0)
        m_blr, s_blr = np.mean(draws[site], 0), np.std(draws[site], 0)
        for i in np.ndindex(np.shape(m_nuts)):
            rows.append((f"{site}{list(i) if i else ''}", m_blr[i], m_nuts[i], (m_blr[i] - m_nuts[i]) / s_nuts[i],
                         s_blr[i] / s_nuts[i]))
    print(f"BLR {blr_seconds:.2f} s ({result.num_steps} steps), NUTS {nuts_seconds:.2f} s")
    print(f"{'':6s} {'BLR mean':>9s} {'NUTS mean':>9s} {'err/sd':>7s} {'sd ratio':>8s}")
    for name, a, b, e, r in rows:
        print(f"{name:6s} {a:9.4f} {b:9.4f} {e:7.3f} {r:8.3f}")
    return rows, blr_seconds, nuts_seconds


if __name__ == "__main__":
    main()
