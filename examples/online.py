"""Online (sequential) Bayes: feed the data in batches, each fit's posterior becoming the
next fit's prior; for a conjugate model the result equals the batch posterior.

Run with ``python examples/online.py``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist

from blrppl import blr_fit


def model(y):
    rate = numpyro.sample("rate", dist.Gamma(1.0, 1.0))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Poisson(rate), obs=y)


def main(num_batches=5, batch_size=40):
    y = jnp.asarray(np.random.default_rng(0).poisson(3.0, size=num_batches * batch_size), dtype=float)
    result = None
    for k in range(num_batches):
        batch = y[k * batch_size : (k + 1) * batch_size]
        result = blr_fit(model, (batch,), prior=result, progress_bar=False)
        q = result.posterior["rate"]
        print(f"after batch {k + 1}: rate ~ Gamma({float(q.concentration):.1f}, {float(q.rate):.1f}), "
              f"mean {float(q.mean):.4f}, compile {result.compile_time:.2f} s")
    batch_fit = blr_fit(model, (y,), progress_bar=False).posterior["rate"]
    print(f"all data at once: Gamma({float(batch_fit.concentration):.1f}, {float(batch_fit.rate):.1f})")
    return result.posterior["rate"], batch_fit


if __name__ == "__main__":
    main()
