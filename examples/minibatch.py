"""Minibatch BLR (stochastic VI): a subsampled plate against the full-batch fit.

Run with ``python examples/minibatch.py``.
"""

from __future__ import annotations

import numpy as np
import numpyro
import numpyro.distributions as dist
import jax.numpy as jnp

from blrppl import blr_fit

NOISE = 1.0


def make_model(subsample_size=None):
    def model(x, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
        with numpyro.plate("data", x.shape[0], subsample_size=subsample_size) as idx:
            numpyro.sample("y", dist.Normal(x[idx] @ w, NOISE), obs=y[idx])

    return model


def main(n=10_000, batch=100, num_steps=3000):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(n, 3)))
    y = x @ jnp.asarray([0.5, -1.0, 2.0]) + NOISE * jnp.asarray(rng.normal(size=n))
    full = blr_fit(make_model(), (x, y), progress_bar=False)
    mini = blr_fit(make_model(batch), (x, y), num_steps=num_steps, progress_bar=False)
    m_full, sd_full = np.asarray(full.posterior["w"].mean), np.sqrt(np.diag(full.posterior["w"].covariance_matrix))
    m_mini, sd_mini = np.asarray(mini.posterior["w"].mean), np.sqrt(np.diag(mini.posterior["w"].covariance_matrix))
    print(mini.plan.describe())
    print(f"full batch: {full.num_steps} steps, {full.run_time:.3f} s; minibatch: {mini.num_steps} steps of "
          f"{batch}, {mini.run_time:.3f} s")
    print(f"mean error / full-batch sd: {np.round((m_mini - m_full) / sd_full, 4)}")
    print(f"sd ratio: {np.round(sd_mini / sd_full, 4)}")
    return (m_mini - m_full) / sd_full, sd_mini / sd_full


if __name__ == "__main__":
    main()
