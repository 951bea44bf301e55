"""One process of ``test_distributed.py``'s fits over two processes (run by the test, not
collected): ``python distributed_worker.py --process-id I --port P``.

It joins a two-process JAX program on localhost (gloo collectives), fits a conjugate Normal
mean on its own rows of 1,003 (process 0 the first 400, process 1 the other 603: unequal
shares, padded differently) over a mesh of both processes' devices, checks that a model
with a latent per datum is refused with ``MeshError``, and prints ``RESULT{json}``.
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
    print("RESULT" + json.dumps(out), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
