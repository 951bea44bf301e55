"""Minibatch fits reading their data from a ``numpy.memmap`` a minibatch at a time
(:class:`blrppl.HostRows`, :mod:`blrppl.graph.host_rows`).

A Normal linear regression with known noise, N = 20,000 rows on disk in minibatches of
2,000 (subsampled plate):

* the fit reading the memmap equals the minibatch fit on the same arrays in memory (same
  key, hence the same minibatches) to 1e-10: the rows read on the host are the rows the
  in-memory fit gathers on the device;
* its posterior is within 0.1 posterior sd of the full-data closed form (a conjugate Gaussian:
  precision I + XᵀX/σ², mean its inverse times Xᵀy/σ²) and its sds within 5 %: the fit runs
  to convergence over whole epochs of a random reshuffling, whose minibatch noise cancels
  over each epoch (measured: 0.005 sd at N/M = 10); the checks leave a factor 20 of margin;
* an online fit (``prior=``) on disk equals the same online fit in memory;
* while it runs, no device array holds more than a minibatch of rows (read inside the
  step's host callbacks, where the step's buffers are alive), and each step's rows were
  read once per array, most of them ahead of the step.
"""

from __future__ import annotations

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

from blrppl import BLRError, HostRows, blr_fit

N, D, M, NOISE = 20_000, 3, 2_000, 1.0


def model(X, y):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("n", X.shape[0], subsample_size=M) as idx:
        numpyro.sample("y", dist.Normal(X[idx] @ w, NOISE), obs=y[idx])


def full_batch(X, y):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("n", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, NOISE), obs=y)


class Watched:
    """A memmap's rows as a source that records, at each read (inside the compiled step),
    the largest leading dimension of the floating-point arrays alive on the devices."""

    def __init__(self, source):
        self.source, self.shape, self.dtype, self.largest = source, source.shape, source.dtype, 0
        # (arrays alive before the fit, other tests' in the same process among them, are not the fit's)
        # (held, so that their ids are not reused by the fit's arrays)
        self.alive_before = jax.live_arrays()
        self.before = {id(a) for a in self.alive_before}

    def __getitem__(self, idx):
        live = [
            a.shape[0] for a in jax.live_arrays()
            if a.ndim and np.issubdtype(a.dtype, np.floating) and id(a) not in self.before
        ]
        self.largest = max([self.largest, *live])
        return self.source[idx]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(N, D))
    y = X @ np.array([1.0, -0.5, 0.2]) + NOISE * rng.normal(size=N)
    folder = tmp_path_factory.mktemp("rows")
    for name, value in (("X", X), ("y", y)):
        mm = np.lib.format.open_memmap(folder / f"{name}.npy", mode="w+", dtype=value.dtype, shape=value.shape)
        mm[:] = value
        mm.flush()
        del mm
    return X, y, np.load(folder / "X.npy", mmap_mode="r"), np.load(folder / "y.npy", mmap_mode="r")


def test_memmap_minibatches_equal_the_in_memory_fit_and_the_closed_form(data):
    X, y, mX, my = data
    rows_X, rows_y = HostRows(mX), HostRows(my)
    on_disk = blr_fit(model, (rows_X, rows_y), rng_key=random.PRNGKey(0), num_steps=3000, progress_bar=False)
    in_memory = blr_fit(model, (X, y), rng_key=random.PRNGKey(0), num_steps=3000, progress_bar=False)
    assert on_disk.converged and on_disk.num_steps == in_memory.num_steps
    q, q_mem = on_disk.posterior["w"], in_memory.posterior["w"]
    np.testing.assert_allclose(q.mean, q_mem.mean, rtol=1e-10)
    np.testing.assert_allclose(q.covariance_matrix, q_mem.covariance_matrix, rtol=1e-10)
    precision = np.eye(D) + X.T @ X / NOISE**2
    cov = np.linalg.inv(precision)
    mean, sd = cov @ (X.T @ y) / NOISE**2, np.sqrt(np.diag(cov))
    assert np.all(np.abs(np.asarray(q.mean) - mean) < 0.1 * sd)
    np.testing.assert_allclose(np.sqrt(np.diag(q.covariance_matrix)), sd, rtol=0.05)
    # one read of each step's rows per array, nearly all of them read ahead
    steps = on_disk.num_steps
    for rows in (rows_X, rows_y):
        assert steps * M <= rows.reads <= (steps + 3) * M
        assert rows.read_ahead_used >= steps - 2
    np.testing.assert_array_equal(np.asarray(mX), X)  # (the user's data are not modified)


def test_no_device_holds_the_whole_data(data):
    _, _, mX, my = data
    watched = Watched(mX)
    result = blr_fit(
        lambda X, y: model(X, y), (HostRows(watched), HostRows(my)), rng_key=random.PRNGKey(1), num_steps=50,
        progress_bar=False,
    )
    assert result.num_steps == 50
    assert 0 < watched.largest <= M


def test_a_full_batch_model_on_host_rows_is_refused(data):
    _, _, mX, my = data
    with pytest.raises(BLRError, match=r"X\[idx\]"):
        blr_fit(full_batch, (HostRows(mX), HostRows(my)), rng_key=random.PRNGKey(0), progress_bar=False)


def test_an_online_fit_on_disk_equals_the_online_fit_in_memory(data):
    """``prior=`` with rows read from the memmap: the second half's fit (100 steps) with the
    first half's posterior as its prior equals, on disk, the same fit on the arrays in memory
    (same key, hence the same minibatches) to 1e-10."""
    X, y, mX, my = data
    half = N // 2
    previous = blr_fit(model, (X[:half], y[:half]), rng_key=random.PRNGKey(0), num_steps=100, progress_bar=False)
    fits = {
        where: blr_fit(model, second, prior=previous, rng_key=random.PRNGKey(1), num_steps=100, progress_bar=False)
        for where, second in (("disk", (HostRows(mX[half:]), HostRows(my[half:]))), ("memory", (X[half:], y[half:])))
    }
    q, q_mem = fits["disk"].posterior["w"], fits["memory"].posterior["w"]
    assert "w:previous" in fits["disk"].plan.describe()
    np.testing.assert_allclose(q.mean, q_mem.mean, rtol=1e-10)
    np.testing.assert_allclose(q.covariance_matrix, q_mem.covariance_matrix, rtol=1e-10)
