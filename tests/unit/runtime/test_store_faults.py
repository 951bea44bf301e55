"""The program store is a cache and never blocks a fit: read-only, damaged, with a file in its
path, full, or filled by two processes at once, every fit gives the result of a fit without
the store, bit for bit, with at most one warning."""

from __future__ import annotations

import errno
import functools
import json
import os
import pathlib
import pickle
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

from blrppl import blr_fit
from blrppl.runtime import program_store
from checks import ROOT, run_in_new_process

Y = np.array([0.3, -1.2, 0.8, 2.1, 0.4])


def make_model():
    """A new function each call: the in-memory cache of compiled fits is keyed on it, so
    each fit goes to the program store (or compiles)."""

    def model(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        with numpyro.plate("n", len(y)):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    return model


def summary(result) -> dict:
    return {
        "mean": np.asarray(result.posterior["mu"].loc).tolist(),
        "scale": np.asarray(result.posterior["mu"].scale).tolist(),
        "elbo": np.asarray(result.elbo).tolist(),
    }


def fit() -> dict:
    return summary(blr_fit(make_model(), {"y": Y}, rng_key=random.PRNGKey(0), progress_bar=False))


@pytest.fixture(scope="module")
def reference():
    """The fit without the store."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("BLRPPL_COMPILATION_CACHE", "0")
        return fit()


@pytest.fixture
def store_root(tmp_path, monkeypatch):
    """A fresh store, its warning not yet given in this process; the store's directory."""
    monkeypatch.setenv("BLRPPL_CACHE_DIR", str(tmp_path / "blrppl"))
    monkeypatch.delenv("BLRPPL_COMPILATION_CACHE", raising=False)
    monkeypatch.setattr(program_store, "_WARNED", [])
    return tmp_path / "blrppl" / "programs"


def counted(run) -> tuple[dict, dict, list]:
    """``run()``, the store's counts during it, and the store's warnings."""
    before = program_store.COUNTS.copy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run()
    counts = {k: program_store.COUNTS[k] - before[k] for k in ("loaded", "stored", "faults")}
    return out, counts, [w for w in caught if issubclass(w.category, program_store.ProgramStoreWarning)]


#: set in the process :func:`in_a_fresh_process` starts: the name of the test it runs
SCENARIO_ENV = "BLRPPL_STORE_SCENARIO"


def in_a_fresh_process(test):
    """Run ``test`` in a new pytest process: what it counts (programs written to and read from
    the store) depends on which programs this process compiled before, and a test worker that
    ran other files first holds some already."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        if os.environ.get(SCENARIO_ENV) == test.__name__:
            return test(*args, **kwargs)
        env = {**os.environ, SCENARIO_ENV: test.__name__}
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::{test.__name__}"],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=900,
        )
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]

    return run


def read_only(monkeypatch, root: pathlib.Path) -> None:
    """Make the store read-only: by its mode, and (for root, whom modes do not stop) by
    every write of the store's module under ``root`` failing as on a read-only file system."""
    for path in [root, *root.iterdir()]:
        path.chmod(0o555 if path.is_dir() else 0o444)

    def refuse(path):
        if str(path).startswith(str(root)):
            raise PermissionError(errno.EROFS, "Read-only file system", str(path))

    def guarded(original):
        def call(path, *args, **kwargs):
            refuse(path)
            return original(path, *args, **kwargs)

        return call

    monkeypatch.setattr(program_store.os, "utime", guarded(os.utime))
    monkeypatch.setattr(program_store.os, "replace", guarded(os.replace))
    monkeypatch.setattr(pathlib.Path, "unlink", guarded(pathlib.Path.unlink))
    named = tempfile.NamedTemporaryFile
    monkeypatch.setattr(program_store.tempfile, "NamedTemporaryFile", lambda *a, dir, **k: refuse(dir) or named(*a, dir=dir, **k))


@in_a_fresh_process
def test_a_read_only_store_serves_its_entries_and_a_truncated_one_is_compiled(store_root, reference, monkeypatch):
    first, counts, _ = counted(fit)
    assert first == reference and counts["stored"] >= 3
    entries = sorted(store_root.glob("*.xla"))
    data = entries[0].read_bytes()
    entries[0].write_bytes(data[: len(data) // 2])
    read_only(monkeypatch, store_root)
    try:
        second, counts, warned = counted(fit)
        assert second == reference
        assert counts["loaded"] == len(entries) - 1  # (served, though its time cannot be touched)
        assert counts["stored"] == 0 and len(warned) == 1
        assert "BLRPPL_COMPILATION_CACHE=0" in str(warned[0].message)
        third, _, warned = counted(fit)  # (one warning per process)
        assert third == reference and not warned
    finally:
        for path in [store_root, *store_root.iterdir()]:
            path.chmod(0o755 if path.is_dir() else 0o644)


def test_damaged_entries_are_written_anew(store_root, reference):
    counted(fit)
    entries = sorted(store_root.glob("*.xla"))
    for i, entry in enumerate(entries):  # truncated, garbage, an executable that does not load
        data = entry.read_bytes()
        if i % 3 == 2:
            payload, in_tree, out_tree, signature = pickle.loads(data)
            data = pickle.dumps((payload[: len(payload) // 2], in_tree, out_tree, signature))
        entry.write_bytes(data[:7] if i % 3 == 0 else b"\x80\x04garbage" + data[:40] if i % 3 == 1 else data)
    again, counts, warned = counted(fit)
    assert again == reference and counts["loaded"] == 0 and counts["stored"] == len(entries) and not warned
    refilled, counts, _ = counted(fit)
    assert refilled == reference and counts["loaded"] == len(entries)


@pytest.mark.parametrize("blocked", ["cache dir", "programs"])
def test_a_file_in_the_stores_path(store_root, reference, blocked):
    path = store_root.parent if blocked == "cache dir" else store_root
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("not a directory")
    result, counts, warned = counted(fit)
    assert result == reference and counts["stored"] == counts["loaded"] == 0
    assert len(warned) == 1
    assert path.read_text() == "not a directory"


class _FullFile:
    """A temporary file on a full disk: created, then its write fails."""

    def __init__(self, file):
        self._file = file
        self.name = file.name

    def write(self, data):
        self._file.write(data[: len(data) // 3])
        self._file.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()


@in_a_fresh_process
def test_a_full_disk_leaves_no_partial_files_and_old_ones_are_pruned(store_root, reference, monkeypatch):
    store_root.mkdir(parents=True)
    stale = store_root / "tmpstale.tmp"  # (left by a write cut short long ago)
    stale.write_bytes(b"partial")
    os.utime(stale, (time.time() - 2 * program_store.STALE_SECONDS,) * 2)
    fresh = store_root / "tmpwriting.tmp"  # (another process writing now)
    fresh.write_bytes(b"partial")
    named = tempfile.NamedTemporaryFile
    with monkeypatch.context() as m:
        m.setattr(program_store.tempfile, "NamedTemporaryFile", lambda *a, **k: _FullFile(named(*a, **k)))
        result, counts, warned = counted(fit)
    assert result == reference and counts["stored"] == 0 and len(warned) == 1
    assert "No space left" in str(warned[0].message)
    assert sorted(p.name for p in store_root.iterdir()) == ["tmpstale.tmp", "tmpwriting.tmp"]
    # space again: the programs are stored, the stale file pruned, the other writer's kept
    again, counts, warned = counted(fit)
    assert again == reference and counts["stored"] >= 3 and not warned
    assert not stale.exists() and fresh.exists()


FIT_CODE = r"""
import json
import numpy as np, numpyro, numpyro.distributions as dist
from jax import random
numpyro.enable_x64()
from blrppl import blr_fit

def model(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("n", len(y)):
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

r = blr_fit(model, {"y": np.array(%s)}, rng_key=random.PRNGKey(0), progress_bar=False)
print("RESULT" + json.dumps({"mean": np.asarray(r.posterior["mu"].loc).tolist(),
    "scale": np.asarray(r.posterior["mu"].scale).tolist(), "elbo": np.asarray(r.elbo).tolist()}))
""" % json.dumps(Y.tolist())


def test_two_processes_filling_one_store_at_once(tmp_path, reference):
    env = dict(os.environ, BLRPPL_CACHE_DIR=str(tmp_path / "blrppl"))
    env.pop("BLRPPL_COMPILATION_CACHE", None)
    procs = [
        subprocess.Popen([sys.executable, "-c", FIT_CODE], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        line = next(l for l in out.splitlines() if l.startswith("RESULT"))
        assert json.loads(line[len("RESULT"):]) == reference
    programs = tmp_path / "blrppl" / "programs"
    assert list(programs.glob("*.xla")) and not list(programs.glob("*.tmp"))
    # what they stored serves a third
    assert run_in_new_process(FIT_CODE, tmp_path) == reference


# With JAX's persistent cache on, the program compiled again after a damaged entry comes from
# JAX's cache: it cannot be stored as it is (it would load, then fail at its first call).
REFILL_CODE = r"""
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
import blrppl
from blrppl.runtime import program_store
blrppl.enable_compilation_cache()

def fn(x):
    return jnp.linalg.cholesky(x @ x.T + jnp.eye(3)).sum() + jnp.sin(x)

x = jnp.arange(9.0).reshape(3, 3) / 9
key = program_store.program_key("refill", os.environ["TAG"])
compiled = program_store.compile_program(key, jax.jit(fn).lower, (x,), None)
loaded = program_store.load(key, (x,))
print("RESULT" + json.dumps({
    "value": np.asarray(compiled(x)).tolist(),
    "loaded": None if loaded is None else np.asarray(loaded(x)).tolist(),
    "counts": dict(program_store.COUNTS),
}))
"""


def test_the_store_refills_after_a_damaged_entry_with_jaxs_cache_on(tmp_path):
    tag = f"{time.time_ns()}"
    first = run_in_new_process(REFILL_CODE, tmp_path, TAG=tag)
    assert first["counts"]["stored"] == 1 and first["loaded"] == first["value"]
    (entry,) = (tmp_path / "blrppl" / "programs").glob("*.xla")
    entry.write_bytes(b"damaged")
    second = run_in_new_process(REFILL_CODE, tmp_path, TAG=tag)
    assert second["counts"]["stored"] == 1 and second["value"] == first["value"]
    assert second["loaded"] == first["value"]  # (stored afresh: it runs)
    third = run_in_new_process(REFILL_CODE, tmp_path, TAG=tag)
    assert third["counts"]["loaded"] == 2 and third["counts"].get("stored", 0) == 0
    assert third["value"] == first["value"]
