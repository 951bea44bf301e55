"""One fit over two processes on one machine (``jax.distributed``, CPU, localhost).

Run with ``python examples/two_processes.py``: it starts two copies of itself, each a
process of one distributed JAX program with 2 CPU devices of its own, and prints what each
fitted. Each copy (``python examples/two_processes.py --process-id I --port P``):

1. chooses gloo for JAX's CPU collectives and joins the program
   (``jax.distributed.initialize`` with a coordinator on ``localhost:P``);
2. takes its own rows of the data: process 0 the first 500, process 1 the other 501 (here
   cut from one simulated data set; in practice each process reads its own files);
3. fits the model on its rows with ``mesh=`` a mesh over both processes' devices
   (``jax.devices()``): the model reads its plate's size off its data, which inside the fit
   are the global arrays of all 1,001 rows;
4. prints the posterior as JSON (``RESULT{...}``): the same in both processes.

Both processes must call the fit with the same model, options and ``rng_key``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys

NUM_ROWS = 1001
SPLIT = 500  # (process 0's rows; process 1 holds the rest)


def normal_regression(X, y):
    """A Normal linear regression with known noise (conjugate: its fit is exact)."""
    import numpyro
    import numpyro.distributions as dist

    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("n", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)


def logistic_regression(X, y):
    """A logistic regression (its expectations by quadrature)."""
    import numpyro
    import numpyro.distributions as dist

    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("n", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


MODELS = {"normal": normal_regression, "logistic": logistic_regression}


def data(model: str, rows=slice(None)):
    """The simulated data set of ``model`` (``NUM_ROWS`` rows, seed 0), or its ``rows``."""
    import numpy as np

    rng = np.random.default_rng(0)
    X = rng.normal(size=(NUM_ROWS, 3))
    w = np.array([1.0, -0.5, 0.2])
    if model == "normal":
        y = X @ w + 0.5 * rng.normal(size=NUM_ROWS)
    else:
        y = (rng.random(NUM_ROWS) < 1.0 / (1.0 + np.exp(-X @ w))).astype(float)
    return X[rows], y[rows]


def summary(result) -> dict:
    """The posterior of ``w`` (means, sds), the steps run and the last ELBO, as JSON values."""
    import numpy as np

    q = result.posterior["w"]
    return {
        "mean": np.asarray(q.mean).tolist(),
        "sd": np.sqrt(np.diag(np.asarray(q.covariance_matrix))).tolist(),
        "steps": int(result.num_steps),
        "elbo": float(np.asarray(result.elbo)[-1]),
    }


def worker(process_id: int, port: int, num_processes: int = 2) -> dict:
    """One process of the fit: join, fit both models on this process's rows, summarise."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"localhost:{port}", num_processes=num_processes, process_id=process_id
    )
    import numpy as np
    from jax import random

    from blrppl import blr_fit

    rows = slice(0, SPLIT) if process_id == 0 else slice(SPLIT, NUM_ROWS)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    out = {"process": jax.process_index(), "devices": jax.device_count(), "local_devices": jax.local_device_count()}
    for name, model in MODELS.items():
        X, y = data(name, rows)
        result = blr_fit(model, (X, y), rng_key=random.PRNGKey(0), mesh=mesh, progress_bar=False)
        out[name] = summary(result)
    jax.distributed.shutdown()
    return out


def free_port() -> int:
    """A free TCP port on localhost for the coordinator."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(devices_per_process: int = 2, timeout: float = 600.0, script: str | None = None) -> list:
    """Start the two processes (``script``, this one by default, with ``--process-id`` and
    ``--port``), each with ``devices_per_process`` CPU devices, and return what each printed
    after ``RESULT`` (JSON)."""
    port = free_port()
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices_per_process}"
    ).strip()
    # (the processes import blrppl from this checkout, as this script does when run from its root)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(script or __file__), "--process-id", str(i), "--port", str(port)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        for i in range(2)
    ]
    outs = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"process exited with {proc.returncode}:\n{stderr[-3000:]}")
            line = next(l for l in stdout.splitlines() if l.startswith("RESULT"))
            outs.append(json.loads(line[len("RESULT"):]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--process-id", type=int, default=None)
    parser.add_argument("--port", type=int, default=None)
    args = parser.parse_args()
    if args.process_id is None:
        for out in launch():
            print(json.dumps(out))
    else:
        print("RESULT" + json.dumps(worker(args.process_id, args.port)), flush=True)


if __name__ == "__main__":
    main()
