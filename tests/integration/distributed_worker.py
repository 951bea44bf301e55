"""One process of ``test_distributed.py``'s fits over two processes (run by the test, not
collected): ``python distributed_worker.py --process-id I --port P``.

It joins a two-process JAX program on localhost (gloo collectives), fits a conjugate Normal
mean on its own rows of 1,003 (process 0 the first 400, process 1 the other 603: unequal
shares, padded differently) over a mesh of both processes' devices, and a grouped model (group
effects in a plate of 8, a heavy-tailed group scale) with its PSIS k̂; checks that a model
with a latent per datum, a mixture family and scales on a grid are refused with
``MeshError``, and prints ``RESULT{json}``.
"""

from __future__ import annotations

import argparse
import json

import jax

NUM_ROWS, SPLIT = 1003, 400


def normal_mean(y):
    import numpyro
    import numpyro.distributions as dist

    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def local_means(y):
    import numpyro
    import numpyro.distributions as dist

    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("n", y.shape[0]):
        theta = numpyro.sample("theta", dist.Normal(mu, 1.0))
        numpyro.sample("y", dist.Normal(theta, 0.5), obs=y)


def counted_mean(y, n):
    import numpyro
    import numpyro.distributions as dist

    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("n", n):
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def grouped(g, y):
    """Eight schools' shape: group effects in a plate of 8 (the same in every process), rows in
    the data's plate, a heavy-tailed group scale (a poor Gaussian q: k̂ well above 0.7)."""
    import numpyro
    import numpyro.distributions as dist

    tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    with numpyro.plate("groups", 8):
        theta = numpyro.sample("theta", dist.Normal(mu, tau))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Normal(theta[g], 60.0), obs=y)


def grouped_rows(process_id: int):
    """This process's rows (group of each row, value) of a grouped data set (seed 1)."""
    import numpy as np

    rng = np.random.default_rng(1)
    g = np.arange(NUM_ROWS) % 8
    y = rng.normal(size=8)[g] * 3.0 + 60.0 * rng.normal(size=NUM_ROWS)
    rows = slice(0, SPLIT) if process_id == 0 else slice(SPLIT, None)
    return g[rows], y[rows]


def posterior(result, sites) -> dict:
    """Means and sds of ``sites`` and the fit's k̂, steps and warnings, as JSON values."""
    import numpy as np

    out = {s: [np.asarray(result.posterior[s].mean).tolist(), np.sqrt(np.asarray(result.posterior[s].variance)).tolist()]
           for s in sites}
    return {**out, "khat": result.diagnostics.khat, "steps": int(result.num_steps)}


def rows(process_id: int):
    """This process's rows of the data set (seed 0)."""
    import numpy as np

    y = 2.0 + np.random.default_rng(0).normal(size=NUM_ROWS)
    return y[:SPLIT] if process_id == 0 else y[SPLIT:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{args.port}", num_processes=2, process_id=args.process_id)
    import numpy as np
    from jax import random

    from blrppl import MeshError, blr_fit

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    y = rows(args.process_id)
    given = y.copy()
    result = blr_fit(normal_mean, (y,), rng_key=random.PRNGKey(0), mesh=mesh, progress_bar=False)
    q = result.posterior["mu"]
    out = {
        "process": jax.process_index(),
        "devices": jax.device_count(),
        "mean": float(q.mean),
        "sd": float(np.sqrt(q.variance)),
        "steps": int(result.num_steps),
        "elbo": np.asarray(result.elbo).tolist(),
        "unchanged": bool(np.array_equal(y, given)),
        "note": result.diagnostics.note,
    }
    try:
        blr_fit(local_means, (y,), rng_key=random.PRNGKey(0), mesh=mesh, progress_bar=False)
        out["refused"] = None
    except MeshError as exc:
        out["refused"] = str(exc)
    try:  # (a plate's size given as a number: this process's, not the global one)
        blr_fit(counted_mean, (y, len(y)), rng_key=random.PRNGKey(0), mesh=mesh, progress_bar=False)
        out["counted"] = None
    except MeshError as exc:
        out["counted"] = str(exc)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = blr_fit(grouped, grouped_rows(args.process_id), rng_key=random.PRNGKey(0), mesh=mesh, progress_bar=False)
    out["grouped"] = posterior(found, ("mu", "theta"))
    out["grouped_warnings"] = [str(w.message) for w in caught]
    for name, families in (("mixture", {"mu": ("gaussian-mixture", 2)}), ("grid", {"tau": "grid"})):
        try:
            blr_fit(grouped, grouped_rows(args.process_id), rng_key=random.PRNGKey(0), mesh=mesh, progress_bar=False,
                    families=families)
            out[name] = None
        except MeshError as exc:
            out[name] = str(exc)
    print("RESULT" + json.dumps(out), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
