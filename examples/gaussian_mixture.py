"""A Gaussian mixture by variational message passing: Dirichlet weights, Gaussian means,
Gamma precisions per component and enumerated Categorical assignments, all updated in closed form.

Run with ``python examples/gaussian_mixture.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist

numpyro.enable_x64()  # VMP crawls off the symmetric start; float32's tolerance would stop it early

from blrppl import blr_fit  # noqa: E402

K = 3
TRUE_MEANS = (-4.0, 0.0, 5.0)


def model(y):
    weights = numpyro.sample("weights", dist.Dirichlet(jnp.ones(K)))
    with numpyro.plate("components", K):
        means = numpyro.sample("means", dist.Normal(0.0, 10.0))
        precisions = numpyro.sample("precisions", dist.Gamma(2.0, 2.0))
    with numpyro.plate("n", y.shape[0]):
        z = numpyro.sample("z", dist.Categorical(weights))
        numpyro.sample("y", dist.Normal(means[z], 1.0 / jnp.sqrt(precisions[z])), obs=y)


def make_data(n=600, seed=0):
    rng = np.random.default_rng(seed)
    z = rng.integers(0, K, size=n)
    return jnp.asarray(np.asarray(TRUE_MEANS)[z] + rng.normal(size=n))


def main():
    y = make_data()
    result = blr_fit(model, (y,), rng_key=jax.random.key(1), progress_bar=False)
    means = np.sort(np.asarray(result.posterior["means"].mean))
    print(result.message)
    print(f"posterior means of the components: {np.round(means, 3)} (simulated with {TRUE_MEANS})")
    print(f"ELBO: first {result.elbo[0]:.2f}, last {result.elbo[-1]:.2f}, "
          f"never decreasing: {bool(np.all(np.diff(result.elbo) >= -1e-6 * np.abs(result.elbo[1:])))}")
    return result, means


if __name__ == "__main__":
    main()
