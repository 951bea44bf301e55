"""``python -m blrppl.bench.memmap``: a minibatch fit of a regression whose data are larger
than it keeps in memory, read from a ``numpy.memmap`` a minibatch at a time
(:class:`blrppl.HostRows`).

The bench writes N rows of a Normal linear regression with known noise (D covariates,
float64) to ``X.npy`` and ``y.npy`` in ``--dir``, a million rows at a time, accumulating
``XᵀX`` and ``Xᵀy`` for the full-data closed form (the posterior is Gaussian: precision
I + XᵀX/σ², mean its inverse times Xᵀy/σ²). A new process then fits the model with a
subsampled plate on ``HostRows`` of the two memmaps and reports its peak resident memory
(``VmHWM``: the process's whole peak, the Python and JAX runtime included), its resident
memory before the fit, the data's size on disk, the fit's steps and time, and each
coefficient's distance from the closed form in posterior sds.

Examples::

    python -m blrppl.bench.memmap                         # N = 10**7, D = 20 (1.7 GB on disk)
    python -m blrppl.bench.memmap --rows 1000000 --dir /tmp/rows
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

NOISE = 1.0
CHUNK = 1_000_000


def write(folder: pathlib.Path, rows: int, dim: int, seed: int = 0) -> dict:
    """Write the data set (``X.npy``, ``y.npy``) a chunk of rows at a time; its closed form
    (``mean``, ``sd``) and size in bytes."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=dim)
    # (the files are written through file handles, not a mapping: the pages of a written mapping
    # stay resident in this process, and a process started from it inherits that peak in its
    # ru_maxrss)
    files = {}
    for name, shape in (("X", (rows, dim)), ("y", (rows,))):
        with open(folder / f"{name}.npy", "wb") as f:
            np.lib.format.write_array_header_1_0(f, {"descr": "<f8", "fortran_order": False, "shape": shape})
        files[name] = open(folder / f"{name}.npy", "ab")
    xtx, xty = np.zeros((dim, dim)), np.zeros(dim)
    try:
        for start in range(0, rows, CHUNK):
            stop = min(rows, start + CHUNK)
            x = rng.normal(size=(stop - start, dim))
            t = x @ w + NOISE * rng.normal(size=stop - start)
            files["X"].write(np.ascontiguousarray(x, "<f8").tobytes())
            files["y"].write(np.ascontiguousarray(t, "<f8").tobytes())
            xtx += x.T @ x
            xty += x.T @ t
    finally:
        for f in files.values():
            f.close()
    cov = np.linalg.inv(np.eye(dim) + xtx / NOISE**2)
    mean = cov @ xty / NOISE**2
    size = (folder / "X.npy").stat().st_size + (folder / "y.npy").stat().st_size
    return {"mean": mean.tolist(), "sd": np.sqrt(np.diag(cov)).tolist(), "bytes": size}


def _rss_mb(field: str = "VmRSS") -> float:
    """This process's current resident memory (MB; ``field="VmHWM"``: its peak), from /proc;
    else ``ru_maxrss`` for the peak, 0 for the current."""
    try:
        with open("/proc/self/status") as f:
            line = next(l for l in f if l.startswith(field + ":"))
        return int(line.split()[1]) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 if field == "VmHWM" else 0.0


def fit(folder: pathlib.Path, batch: int, num_steps: int) -> dict:
    """The minibatch fit on the memmaps of ``folder`` (in this process): its posterior and
    what it cost."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import numpyro
    import numpyro.distributions as dist
    from jax import random

    from blrppl import HostRows, blr_fit

    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("n", X.shape[0], subsample_size=batch) as idx:
            numpyro.sample("y", dist.Normal(X[idx] @ w, NOISE), obs=y[idx])

    X = HostRows(np.load(folder / "X.npy", mmap_mode="r"))
    y = HostRows(np.load(folder / "y.npy", mmap_mode="r"))
    before = _rss_mb()
    t0 = time.perf_counter()
    result = blr_fit(model, (X, y), rng_key=random.PRNGKey(0), num_steps=num_steps, progress_bar=False)
    seconds = time.perf_counter() - t0
    q = result.posterior["w"]
    return {
        "mean": np.asarray(q.mean).tolist(),
        "sd": np.sqrt(np.diag(np.asarray(q.covariance_matrix))).tolist(),
        "steps": int(result.num_steps),
        "converged": bool(result.converged),
        "seconds": seconds,
        "rss_before_fit_mb": before,
        # (the peak of this process's own memory: ru_maxrss also holds the peak of the process
        # it was forked from)
        "peak_rss_mb": _rss_mb("VmHWM"),
        "rows_read": int(X.reads),
        "read_ahead_used": int(X.read_ahead_used),
    }


def report(truth: dict, got: dict, rows: int, dim: int, batch: int) -> str:
    """The bench's lines of text."""
    mean, sd = np.asarray(truth["mean"]), np.asarray(truth["sd"])
    off = np.abs(np.asarray(got["mean"]) - mean) / sd
    ratio = np.asarray(got["sd"]) / sd
    return "\n".join(
        [
            f"memmap minibatch fit: N = {rows:,} rows x {dim} covariates (+ y), minibatches of {batch:,}",
            f"  data on disk: {truth['bytes'] / 2**20:,.0f} MB; peak resident memory of the fitting process: "
            f"{got['peak_rss_mb']:,.0f} MB (before the fit: {got['rss_before_fit_mb']:,.0f} MB)",
            f"  {got['steps']:,} steps ({'converged' if got['converged'] else 'not converged'}) in "
            f"{got['seconds']:.1f} s; rows read: {got['rows_read']:,} per array, {got['read_ahead_used']:,} "
            "minibatches read ahead",
            f"  |mean - closed form| / sd: max {off.max():.3f} (median {np.median(off):.3f}); "
            f"sd / closed-form sd: {ratio.min():.3f} to {ratio.max():.3f}",
        ]
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m blrppl.bench.memmap", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=20)
    p.add_argument("--batch", type=int, default=10_000)
    p.add_argument("--steps", type=int, default=20_000, help="the fit's num_steps")
    p.add_argument("--dir", default=None, help="where the data are written (default: a temporary directory)")
    p.add_argument("--fit", action="store_true", help=argparse.SUPPRESS)  # (the fitting process)
    args = p.parse_args(argv)
    if args.fit:
        print("RESULT" + json.dumps(fit(pathlib.Path(args.dir), args.batch, args.steps)), flush=True)
        return
    with tempfile.TemporaryDirectory(prefix="blrppl-memmap-") as tmp:
        folder = pathlib.Path(args.dir or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        truth = write(folder, args.rows, args.dim)
        command = [sys.executable, "-m", "blrppl.bench.memmap", "--fit", "--dir", str(folder),
                   "--batch", str(args.batch), "--steps", str(args.steps)]
        proc = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ))
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-3000:])
        line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
        print(report(truth, json.loads(line[len("RESULT"):]), args.rows, args.dim, args.batch))


if __name__ == "__main__":
    main()
