"""The program store: compiled programs kept on disk by key, so that a new process running the
same fit loads them instead of tracing, lowering and compiling; never reused for other
arguments, other data values in the same shapes, or another model."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blrppl.runtime import program_store
from blrppl.runtime.program_store import compile_program, load, program_key, store
from checks import run_in_new_process


@pytest.fixture
def store_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("BLRPPL_CACHE_DIR", str(tmp_path / "blrppl"))
    monkeypatch.delenv("BLRPPL_COMPILATION_CACHE", raising=False)
    return tmp_path / "blrppl" / "programs"


#: programs new to every test run (JAX's persistent cache has not seen them: an executable
#: read from it is never stored), one per test
_RUN = int(np.random.default_rng().integers(1, 2**16))


def _program(tag: int):
    offset = (_RUN * 64 + tag) * 2.0**-60

    def double(x):
        return {"y": 2.0 * x["a"] + jnp.sum(x["b"]) + offset}

    return jax.jit(double).lower


ARGS = ({"a": jnp.arange(3.0), "b": jnp.ones(2)},)


def test_a_stored_program_is_loaded_for_the_same_arguments_only(store_dir):
    key = program_key("double", 1)
    compiled = compile_program(key, _program(1), ARGS, None)
    assert len(list(store_dir.glob("*.xla"))) == 1
    loaded = load(key, ARGS)
    assert loaded is not None
    np.testing.assert_array_equal(loaded(*ARGS)["y"], compiled(*ARGS)["y"])
    # other shapes, another dtype, another structure, another key: not this program
    assert load(key, ({"a": jnp.arange(4.0), "b": jnp.ones(2)},)) is None
    assert load(key, ({"a": jnp.arange(3, dtype=jnp.int32), "b": jnp.ones(2)},)) is None
    assert load(key, ({"a": jnp.arange(3.0), "c": jnp.ones(2)},)) is None
    assert load(program_key("double", 2), ARGS) is None


def test_keys_are_none_for_parts_printed_by_address_and_nothing_is_stored_then(store_dir):
    assert program_key("double", object()) is None
    assert program_key("double", lambda x: x) is None
    assert program_key("double", (1, "a", 2.5, None)) == program_key("double", (1, "a", 2.5, None))
    compiled = compile_program(None, _program(2), ARGS, None)
    np.testing.assert_allclose(compiled(*ARGS)["y"], [2.0, 4.0, 6.0])
    assert not store_dir.exists()


def test_a_damaged_entry_is_compiled_again(store_dir):
    key = program_key("double", "damaged")
    compile_program(key, _program(3), ARGS, None)
    (entry,) = store_dir.glob("*.xla")
    entry.write_bytes(b"not a program")
    assert load(key, ARGS) is None and not entry.exists()  # (removed: written anew later)
    again = compile_program(key, _program(4), ARGS, None)
    np.testing.assert_allclose(again(*ARGS)["y"], [2.0, 4.0, 6.0])
    assert load(key, ARGS) is not None


def test_programs_with_host_callbacks_are_not_stored(store_dir):
    def noisy(x):
        jax.debug.callback(lambda v: None, x)
        return x + 1.0

    compile_program(program_key("noisy"), jax.jit(noisy).lower, (jnp.ones(2),), None)
    assert not store_dir.exists() or not list(store_dir.glob("*.xla"))


def test_the_store_keeps_the_most_recently_used_entries(store_dir, monkeypatch):
    monkeypatch.setattr(program_store, "MAX_ENTRIES", 2)
    keys = [program_key("double", i) for i in range(3)]
    for i, key in enumerate(keys):
        compile_program(key, _program(10 + i), ARGS, None)
        os.utime(store_dir / (key + ".xla"), (1000 + i, 1000 + i))
    store(program_key("double", 3), _program(13)(*ARGS).compile(), ARGS)
    kept = {p.stem for p in store_dir.glob("*.xla")}
    assert kept == {keys[2], program_key("double", 3)}


def test_turned_off_with_the_compilation_cache(store_dir, monkeypatch):
    monkeypatch.setenv("BLRPPL_COMPILATION_CACHE", "0")
    key = program_key("double", "off")
    compile_program(key, _program(5), ARGS, None)
    assert load(key, ARGS) is None and not store_dir.exists()


# A fit in new processes: a Gaussian block with a dense precision (LAPACK kernels, which a
# process that loads its programs without lowering them must still register) and a Gamma one.
CODE = r"""
import json, os
import numpy as np, numpyro, numpyro.distributions as dist
from jax import random
numpyro.enable_x64()
from blrppl import blr_fit
from blrppl.runtime import program_store

def fit(site, prior_scale, data_seed, reference):
    def model(X, y=None):
        beta = numpyro.sample(site, dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        sigma = numpyro.sample("sigma", dist.HalfNormal(prior_scale))
        with numpyro.plate("n", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ beta, sigma), obs=y)

    rng = np.random.default_rng(data_seed)
    X = rng.normal(size=(30, 3))
    y = X @ np.array([1.0, -0.5, 0.25]) + 0.3 * rng.normal(size=30)
    before = program_store.COUNTS.copy()
    r = blr_fit(model, {"X": X, "y": y}, rng_key=random.PRNGKey(0), progress_bar=False)
    out = {
        "mean": np.asarray(r.posterior[site].mean).tolist(),
        "sd": np.sqrt(np.diag(np.asarray(r.posterior[site].covariance_matrix))).tolist(),
        "elbo": np.asarray(r.elbo).tolist(),
        "khat": r.diagnostics.khat,
        "loaded": program_store.COUNTS["loaded"] - before["loaded"],
        "stored": program_store.COUNTS["stored"] - before["stored"],
        "compilations": r.compile_counts.xla_compilations,
    }
    if reference:  # the same fit compiled here, without the store
        os.environ["BLRPPL_COMPILATION_CACHE"] = "0"
        def model2(X, y=None):  # (a new function: not in the compiled-fit cache either)
            model(X, y)
        ref = blr_fit(model2, {"X": X, "y": y}, rng_key=random.PRNGKey(0), progress_bar=False)
        del os.environ["BLRPPL_COMPILATION_CACHE"]
        out["reference"] = {"mean": np.asarray(ref.posterior[site].mean).tolist(), "elbo": np.asarray(ref.elbo).tolist()}
    return out

# each fit of the list in turn, in this one process
print("RESULT" + json.dumps([fit(**f) for f in json.loads(os.environ["FITS"])]))
"""


def _fits(cache, *fits):
    """Fits in one new process, each a dict of ``site``, ``prior_scale``, ``data_seed``,
    ``reference`` overriding the first fit's."""
    default = {"site": "beta", "prior_scale": 1.0, "data_seed": 0, "reference": False}
    return run_in_new_process(CODE, cache, FITS=json.dumps([{**default, **f} for f in fits]))


def test_a_second_process_loads_the_fit_and_reuses_it_only_for_the_same_program(tmp_path):
    (first,) = _fits(tmp_path, {})
    assert first["loaded"] == 0 and first["stored"] >= 3  # model run, chunk, export (, diagnostics)
    # a second process: the same fit, then other data in the same shapes (the same programs,
    # this data's posterior as computed without the store), another model program (a prior
    # constant changed: nothing loaded), the same program with a site renamed (nothing
    # loaded: the outputs are keyed by name)
    second, other, changed, renamed = _fits(
        tmp_path, {}, {"data_seed": 1, "reference": True}, {"prior_scale": 2.0}, {"site": "coef"}
    )
    assert second["loaded"] == first["stored"] and second["stored"] == 0 and second["compilations"] == 0
    assert second["mean"] == first["mean"] and second["sd"] == first["sd"] and second["elbo"] == first["elbo"]
    assert second["khat"] == first["khat"]
    assert other["loaded"] == first["stored"]
    assert other["mean"] == other["reference"]["mean"] and other["elbo"] == other["reference"]["elbo"]
    assert other["mean"] != first["mean"]
    assert changed["loaded"] == 0 and changed["stored"] >= 3
    assert renamed["loaded"] == 0 and renamed["mean"] == first["mean"]
