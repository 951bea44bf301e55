"""Replace numpyro's SVI by BLR in an existing pipeline: only the construction changes.

The pipeline below (model, autoguide, fit, Predictive, posterior summary) is written for
``numpyro.infer.SVI``; it runs once with SVI and once with ``BLR``, and prints both.

Run with ``python examples/svi_pipeline.py``.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import SVI, Predictive, Trace_ELBO
from numpyro.infer.autoguide import AutoNormal

from blrppl import BLR


def model(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 5.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(x @ w + b, sigma), obs=y)


def make_data(n=500, d=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d))
    y = x @ np.linspace(-1.0, 1.0, d) + 0.5 + 0.7 * rng.normal(size=n)
    return jnp.asarray(x), jnp.asarray(y)


def pipeline(make_inference, x, y, num_steps):
    """An SVI pipeline; ``make_inference(model, guide)`` is the only line that differs."""
    guide = AutoNormal(model)
    inference = make_inference(model, guide)
    start = time.perf_counter()
    run = inference.run(jax.random.key(0), num_steps, x, y, progress_bar=False)
    seconds = time.perf_counter() - start
    predictive = Predictive(model, guide=guide, params=run.params, num_samples=200)
    y_rep = predictive(jax.random.key(1), x)["y"]
    quantiles = guide.quantiles(run.params, [0.05, 0.5, 0.95])
    return {
        "seconds": seconds,
        "steps": len(run.losses),
        "final loss": float(run.losses[-1]),
        "param shapes": {k: tuple(jnp.shape(v)) for k, v in run.params.items()},
        "y_rep mean abs error": float(jnp.mean(jnp.abs(y_rep.mean(0) - y))),
        "quantiles": quantiles,
    }


def main(svi_steps: int = 5000):
    x, y = make_data()
    runs = {
        f"SVI (Adam 0.01, {svi_steps} steps)": pipeline(
            lambda m, g: SVI(m, g, numpyro.optim.Adam(0.01), Trace_ELBO()), x, y, svi_steps
        ),
        "BLR": pipeline(lambda m, g: BLR(m, g), x, y, 1000),
    }
    for name, out in runs.items():
        print(f"\n== {name}: {out['steps']} steps, {out['seconds']:.2f} s, final loss {out['final loss']:.3f}")
        print(f"  params: {out['param shapes']}")
        print(f"  mean |E[y_rep] - y|: {out['y_rep mean abs error']:.4f}")
        for site, q in out["quantiles"].items():
            print(f"  {site:6s} 5% / 50% / 95%: {np.round(np.asarray(q).T, 3).tolist()}")
    return runs


if __name__ == "__main__":
    main()
