"""``python -m blrppl.bench.minibatches``: the time per step of a minibatch fit fed by an
iterator (:class:`blrppl.Minibatches`) against the in-memory minibatch fit, with and without
the read-ahead.

A Normal linear regression with known noise (N rows, D covariates, float64), fitted for a
fixed number of steps (``tol`` so small that no fit converges) in four ways per minibatch size
M: the in-memory fit (the model indexes the arrays with the plate's indices; chunks of 100
steps in one compiled call), the iterator fit (the model takes a batch; a generator cuts each
batch out of the arrays along a new permutation each epoch), the iterator fit whose generator
also sleeps ``--sleep`` seconds per batch (a slow read), and the same without read-ahead
(``Minibatches(..., read_ahead=False)``). Reported: milliseconds per step of the fit's run
(``result.run_time``), the fastest of ``--repeats`` runs (the first run of each compiles).

Examples::

    python -m blrppl.bench.minibatches                    # N = 10**5, D = 5, M = 1,000 and 10,000
    python -m blrppl.bench.minibatches --sizes 500 --steps 300 --repeats 2
"""

from __future__ import annotations

import argparse
import time

import numpy as np

NOISE = 1.0


def _models(rows: int, dim: int, size: int) -> tuple:
    """(the in-memory model, indexing its arrays; the model of one batch)."""
    import numpyro
    import numpyro.distributions as dist

    def indexed(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([dim]).to_event(1))
        with numpyro.plate("n", rows, subsample_size=size) as idx:
            numpyro.sample("y", dist.Normal(X[idx] @ w, NOISE), obs=y[idx])

    def batch(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([dim]).to_event(1))
        with numpyro.plate("n", rows, subsample_size=size):
            numpyro.sample("y", dist.Normal(X @ w, NOISE), obs=y)

    return indexed, batch


def _batches(X, y, size: int, sleep: float):
    """Endless epochs of minibatches along a new permutation each, sleeping ``sleep`` s per batch."""
    rng = np.random.default_rng(1)
    while True:
        order = rng.permutation(X.shape[0])
        for start in range(0, X.shape[0] - size + 1, size):
            if sleep:
                time.sleep(sleep)
            rows = order[start:start + size]
            yield X[rows], y[rows]


def measure(rows: int, dim: int, size: int, steps: int, repeats: int, sleep: float) -> dict:
    """Milliseconds per step of the four fits (see the module docstring), fastest of ``repeats``."""
    from jax import random

    from blrppl import Minibatches, blr_fit

    rng = np.random.default_rng(0)
    X = rng.normal(size=(rows, dim))
    y = X @ np.linspace(-1.0, 1.0, dim) + NOISE * rng.normal(size=rows)
    indexed, batch = _models(rows, dim, size)
    fits = {
        "in-memory fit": lambda: blr_fit(indexed, (X, y), **options),
        "iterator": lambda: blr_fit(batch, Minibatches(_batches(X, y, size, 0.0)), **options),
        "iterator, slow read": lambda: blr_fit(batch, Minibatches(_batches(X, y, size, sleep)), **options),
        "slow read, no read-ahead": lambda: blr_fit(
            batch, Minibatches(_batches(X, y, size, sleep), read_ahead=False), **options
        ),
    }
    options = dict(rng_key=random.PRNGKey(0), num_steps=steps, tol=1e-300, progress_bar=False)
    times = {name: [] for name in fits}
    for _ in range(repeats):
        for name, fit in fits.items():
            result = fit()
            times[name].append(1e3 * result.run_time / max(int(result.num_steps), 1))
    return {name: min(t) for name, t in times.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sleep", type=float, default=0.002)
    args = parser.parse_args(argv)
    import numpyro

    numpyro.enable_x64()
    names = None
    for size in args.sizes:
        got = measure(args.rows, args.dim, size, args.steps, args.repeats, args.sleep)
        if names is None:
            names = list(got)
            print("| M | " + " | ".join(names) + " |")
            print("|---|" + "---|" * len(names))
        print(f"| {size:,} | " + " | ".join(f"{got[n]:.2f}" for n in names) + " |", flush=True)


if __name__ == "__main__":
    main()
