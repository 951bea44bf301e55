"""Fits over two processes (``jax.distributed`` on localhost, gloo CPU collectives,
:mod:`blrppl.engine.processes`) equal the one-process fit on all rows.

Two new processes join one distributed JAX program, each with its own CPU devices, and each
fits on its own rows with ``mesh=`` a mesh over both processes' devices:

* ``examples/two_processes.py`` (2 devices per process, 4 in all): a conjugate Normal
  regression (its data statistics ``XᵀX`` summed over both processes) and a logistic
  regression (quadrature), 500 and 501 rows;
* ``tests/integration/distributed_worker.py`` (1 device per process): a conjugate Normal
  mean on 400 and 603 rows; a model with a latent per datum and one whose plate's size is
  a number given with the rows are refused with ``MeshError``.

Each process's posterior must equal the one-process fit on all 1,001 (1,003) rows to 1e-8
relative in float64: the two fits sum the same terms in another order (per-device partial
sums, then the all-reduce), whose rounding is 1e-16 per operation times a few thousand
operations; a fit that read one process's rows only, or lost a padded row, is off by a
whole fraction of the posterior's sd (1/sqrt(500) of the mean's scale and more). Both
processes must stop at the same step as the one-process fit.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys
import warnings

import jax
import numpy as np
import pytest
from jax import random

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = pathlib.Path(__file__).with_name("distributed_worker.py")


def _example():
    spec = importlib.util.spec_from_file_location("two_processes", ROOT / "examples" / "two_processes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _launch(example, **options):
    if not hasattr(jax.config, "jax_cpu_collectives_implementation"):
        pytest.skip("this jax has no CPU collectives option (jax_cpu_collectives_implementation)")
    os.environ.setdefault("JAX_ENABLE_X64", "1")
    try:
        return example.launch(timeout=300, **options)
    except RuntimeError as exc:
        if "gloo" in str(exc).lower() and "not" in str(exc).lower() and "available" in str(exc).lower():
            pytest.skip(f"this platform lacks JAX's gloo CPU collectives: {exc}")
        raise


def _close(a, b, rtol=1e-8):
    a, b = np.asarray(a, float), np.asarray(b, float)
    assert a.shape == b.shape
    assert np.all(np.abs(a - b) <= rtol * np.maximum(1.0, np.abs(b))), (a, b)


def test_two_processes_give_the_one_process_posterior(monkeypatch):
    from blrppl import blr_fit

    monkeypatch.setenv("JAX_ENABLE_X64", "1")
    example = _example()
    outs = _launch(example, devices_per_process=2)
    assert sorted(o["process"] for o in outs) == [0, 1]
    for name, model in example.MODELS.items():
        one = example.summary(blr_fit(model, example.data(name), rng_key=random.PRNGKey(0), progress_bar=False))
        for out in outs:
            assert out["devices"] == 4 and out["local_devices"] == 2
            got = out[name]
            assert got["steps"] == one["steps"], (name, got["steps"], one["steps"])
            _close(got["mean"], one["mean"])
            _close(got["sd"], one["sd"])
            _close(got["elbo"], one["elbo"])


def test_two_processes_of_one_device_each_and_unequal_shares(monkeypatch):
    from blrppl import blr_fit

    monkeypatch.setenv("JAX_ENABLE_X64", "1")
    sys.path.insert(0, str(WORKER.parent))
    try:
        import distributed_worker as worker
    finally:
        sys.path.remove(str(WORKER.parent))
    outs = _launch(_example(), devices_per_process=1, script=str(WORKER))
    y = np.concatenate([worker.rows(0), worker.rows(1)])
    one = blr_fit(worker.normal_mean, (y,), rng_key=random.PRNGKey(0), progress_bar=False)
    q = one.posterior["mu"]
    for out in outs:
        assert out["devices"] == 2
        assert out["steps"] == one.num_steps
        _close(out["mean"], float(q.mean))
        _close(out["sd"], float(np.sqrt(q.variance)))
        _close(out["elbo"], np.asarray(one.elbo))
        assert out["unchanged"]
        assert out["refused"] is not None and "theta" in out["refused"] and "one entry per datum" in out["refused"]
        assert out["counted"] is not None and "X.shape[0]" in out["counted"]

    # group effects in a plate of 8 are replicated, not split with the rows: the posterior is the
    # one-process fit's; k̂ reads the model's density at q's draws over both processes' rows (the
    # same draws: the one-process k̂ to rounding; from one process's rows it is another number)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        g, y = (np.concatenate(parts) for parts in zip(worker.grouped_rows(0), worker.grouped_rows(1)))
        one = worker.posterior(
            blr_fit(worker.grouped, (g, y), rng_key=random.PRNGKey(0), progress_bar=False, refine=False),
            ("mu", "theta"),
        )
    assert one["khat"] > 0.7  # (q is poor here: the warning's case)
    for out in outs:
        got = out["grouped"]
        assert got["steps"] == one["steps"]
        for site in ("mu", "theta"):
            _close(got[site][0], one[site][0])
            _close(got[site][1], one[site][1])
        assert abs(got["khat"] - one["khat"]) < 1e-6
        (poor,) = [w for w in out["grouped_warnings"] if "poor approximation" in w]
        assert "do not run over several processes" in poor
        assert "'mu'" in out["mixture"] and "several processes" in out["mixture"]
        assert "'tau'" in out["grid"] and "several processes" in out["grid"]
