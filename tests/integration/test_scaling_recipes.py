"""The recipes of docs/scaling.md run as written and give what the page says.

Each recipe is a whole script on the page; it is read from the page (the fenced Python block
holding its marker) and run unchanged, with a few lines appended that report its results:

* **a device mesh**, in a new process with 8 host devices
  (``--xla_force_host_platform_device_count=8``), float64: the fits over 8 devices and over a
  mesh of 4, and ``BLR(model, mesh=8).run``, equal the one-device fits to 1e-10 (the sharded
  fit sums the same terms in another order: per-device partial sums, then the all-reduce);
* **two processes** (``jax.distributed`` on localhost, one CPU device each, float64): the
  script started twice, as the page says, with a free port in place of the page's 12345; both
  processes' posteriors equal the one-process fit on all rows to 1e-8 and stop at its step
  (see tests/integration/test_distributed.py for the tolerance);
* **minibatches read from disk** (``HostRows``), in this process: the posterior is within 0.1
  posterior sd of the full-data closed form and its sds within 5 % (the minibatch fit's error
  over whole epochs of a random reshuffling; see tests/integration/test_host_rows.py);
* **minibatches from an iterator** (``Minibatches``, a generator of blocks read from disk), in this
  process: the same checks (see tests/integration/test_minibatches.py).
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "scaling.md"


def recipe(marker: str) -> str:
    """The page's one fenced Python block that contains ``marker``."""
    text = PAGE.read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"docs/scaling.md has {len(found)} Python blocks with {marker!r}"
    return found[0]


def run_script(source: str, cwd, env_extra: dict, args=(), timeout: int = 600):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env_extra}
    return subprocess.Popen(
        [sys.executable, "-c", source, *args], cwd=cwd, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )


def reported(out: str) -> dict:
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT")]
    assert len(lines) == 1, out
    return json.loads(lines[0][len("RESULT"):])


def _close(a, b, rtol):
    a, b = np.asarray(a, float), np.asarray(b, float)
    assert a.shape == b.shape
    assert np.all(np.abs(a - b) <= rtol * np.maximum(1.0, np.abs(b))), (a, b)


MESH_REPORT = '''
import json as _json
_one = blr_fit(model, (X, y), rng_key=random.PRNGKey(0))
_one_run = BLR(model).run(random.PRNGKey(0), 1000, X, y)
def _w(r):
    q = r.posterior["w"]
    return {"mean": np.asarray(q.mean).tolist(), "cov": np.asarray(q.covariance_matrix).tolist(),
            "steps": int(r.num_steps)}
print("RESULT" + _json.dumps({
    "devices": jax.device_count(),
    "mesh8": _w(result), "mesh4": _w(result_4), "one": _w(_one),
    "run": {k: np.asarray(v).tolist() for k, v in run.params.items()},
    "one_run": {k: np.asarray(v).tolist() for k, v in _one_run.params.items()},
}))
'''


def test_the_mesh_recipe_equals_the_one_device_fit(tmp_path):
    proc = run_script(
        recipe("mesh=8") + MESH_REPORT, tmp_path,
        {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_ENABLE_X64": "1", "JAX_PLATFORMS": "cpu"},
    )
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    got = reported(out)
    assert got["devices"] == 8
    for name in ("mesh8", "mesh4"):
        assert got[name]["steps"] == got["one"]["steps"]
        _close(got[name]["mean"], got["one"]["mean"], 1e-10)
        _close(got[name]["cov"], got["one"]["cov"], 1e-10)
    assert set(got["run"]) == set(got["one_run"])
    for k in got["run"]:
        _close(got["run"][k], got["one_run"][k], 1e-10)


def _definitions(source: str) -> dict:
    """The imports and functions of a script, run without its other statements (the recipe's
    model and data without its joining a distributed program)."""
    tree = ast.parse(source)
    tree.body = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom, ast.FunctionDef))]
    names: dict = {}
    exec(compile(tree, "docs/scaling.md", "exec"), names)
    return names


PROCESS_REPORT = '''
import json as _json
_q = result.posterior["w"]
print("RESULT" + _json.dumps({"process": i, "mean": np.asarray(_q.mean).tolist(),
      "sd": np.sqrt(np.diag(np.asarray(_q.covariance_matrix))).tolist(), "steps": int(result.num_steps)}))
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_the_two_process_recipe_gives_the_one_process_posterior(tmp_path):
    import jax
    from jax import random

    from blrppl import blr_fit

    if not hasattr(jax.config, "jax_cpu_collectives_implementation"):
        pytest.skip("this jax has no CPU collectives option (jax_cpu_collectives_implementation)")
    source = recipe("jax.distributed.initialize")
    assert "localhost:12345" in source
    script = source.replace("localhost:12345", f"localhost:{_free_port()}") + PROCESS_REPORT
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_ENABLE_X64": "1", "JAX_PLATFORMS": "cpu"}
    procs = [run_script(script, tmp_path, env, args=(str(i),)) for i in (0, 1)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        if p.returncode and "gloo" in err.lower() and "not" in err.lower() and "available" in err.lower():
            pytest.skip(f"this platform lacks JAX's gloo CPU collectives: {err[-500:]}")
        assert p.returncode == 0, err[-3000:]
        outs.append(reported(out))
    assert sorted(o["process"] for o in outs) == [0, 1]

    names = _definitions(source)
    X0, y0 = names["load_rows"](0)
    X1, y1 = names["load_rows"](1)
    one = blr_fit(names["model"], (np.concatenate([X0, X1]), np.concatenate([y0, y1])),
                  rng_key=random.PRNGKey(0), progress_bar=False)
    q = one.posterior["w"]
    for out in outs:
        assert out["steps"] == int(one.num_steps)
        _close(out["mean"], q.mean, 1e-8)
        _close(out["sd"], np.sqrt(np.diag(np.asarray(q.covariance_matrix))), 1e-8)


def test_the_host_rows_recipe_fits_data_read_from_disk(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names: dict = {}
    exec(compile(recipe("HostRows(X)"), "docs/scaling.md", "exec"), names)
    result = names["result"]
    assert result.converged
    _near_closed_form(result, tmp_path)


def _near_closed_form(result, folder):
    """The recipe's regression (prior N(0, I), noise sd 1, data saved in ``folder``): means
    within 0.1 sd of the full-data closed form, sds within 5 %."""
    X, y = np.load(folder / "X.npy"), np.load(folder / "y.npy")
    cov = np.linalg.inv(np.eye(X.shape[1]) + X.T @ X)
    mean, sd = cov @ (X.T @ y), np.sqrt(np.diag(cov))
    q = result.posterior["w"]
    got_sd = np.sqrt(np.diag(np.asarray(q.covariance_matrix)))
    assert np.max(np.abs(np.asarray(q.mean) - mean) / sd) < 0.1
    np.testing.assert_allclose(got_sd, sd, rtol=0.05)


def test_the_iterator_recipe_fits_batches_read_from_disk(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names: dict = {}
    exec(compile(recipe("Minibatches(batches("), "docs/scaling.md", "exec"), names)
    result = names["result"]
    _near_closed_form(result, tmp_path)
    assert "minibatches from the iterable" in result.message
