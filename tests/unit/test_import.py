"""Importing blrppl changes nothing in the user's process: ``$XLA_FLAGS``, JAX's
configuration, JAX's lowering rules and its monitoring listeners are as they were. The
workarounds blrppl needs (XLA's concurrent CPU scheduler off, batched LAPACK calls in chunks)
apply to blrppl's own programs only (docs/runtime.md)."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from blrppl.runtime import compile as runtime_compile
from checks import run_in_new_process

FLAG = runtime_compile.SCHEDULER_FLAG

CODE = r"""
import json, os
import jax
import numpyro, numpyro.distributions, numpyro.infer  # (numpyro's own import is not blrppl's)
from jax._src import monitoring
from jax._src.interpreters import mlir

def snapshot():
    return {
        "XLA_FLAGS": os.environ.get("XLA_FLAGS"),
        "config": {k: repr(v) for k, v in jax.config.values.items()},
        "cpu": {str(p): id(r.rule) for p, r in mlir._platform_specific_lowerings["cpu"].items()},
        "default": {str(p): id(r.rule) for p, r in mlir._lowerings.items()},
        "listeners": [len(monitoring.get_event_listeners()), len(monitoring.get_event_duration_listeners())],
    }

before = snapshot()
import blrppl
after = snapshot()
# rules JAX registered for primitives first imported since (new modules) are not blrppl's
for table in ("cpu", "default"):
    after[table] = {p: r for p, r in after[table].items() if p in before[table]}
print("RESULT" + json.dumps({"before": before, "after": after}))
"""


def test_import_changes_nothing_in_the_process(tmp_path):
    out = run_in_new_process(CODE, tmp_path, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    before, after = out["before"], out["after"]
    assert after["XLA_FLAGS"] == before["XLA_FLAGS"] == "--xla_force_host_platform_device_count=1"
    changed = {k for k in before["config"] if before["config"][k] != after["config"].get(k)}
    assert not changed, changed
    assert after["cpu"] == before["cpu"]
    assert after["default"] == before["default"]
    assert after["listeners"] == before["listeners"]
    assert not (tmp_path / "blrppl").exists()  # (no cache directory either)


def test_blrppls_programs_turn_the_scheduler_off_by_an_option(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    assert runtime_compile.xla_options({"a": 1}) == {"a": 1, FLAG: False}
    monkeypatch.setenv("XLA_FLAGS", f"--{FLAG}=true")  # (a user's own choice is kept)
    assert runtime_compile.xla_options(None) == {}


def test_a_blrppl_program_runs_and_the_users_own_jit_is_untouched():
    def f(a):
        return jnp.linalg.cholesky(a).sum() + 1.0

    a = np.broadcast_to(np.eye(10) * 2.0, (3000, 10, 10))
    program = runtime_compile.jit(f)
    np.testing.assert_allclose(program(a), jax.jit(f)(a), rtol=1e-6)
    assert "stablehlo.while" in program.lower(a).as_text()  # (chunked: blrppl's)
    assert "stablehlo.while" not in jax.jit(f).lower(a).as_text()  # (the user's: JAX's rules)
    # inside the user's own jit, a blrppl program is part of the user's program
    np.testing.assert_allclose(jax.jit(lambda a: program(a) * 2)(a), 2 * jax.jit(f)(a), rtol=1e-6)


def test_every_program_a_fit_compiles_is_lowered_and_compiled_as_blrppls(monkeypatch):
    """The workarounds reach the programs of a fit: each compilation passes the scheduler
    option, and each explicit lowering the chunked LAPACK rules."""
    import numpyro
    import numpyro.distributions as dist

    from blrppl import blr_fit

    lowerings, compilations = [], []
    lower, compile_ = jax.stages.Traced.lower, jax.stages.Lowered.compile

    def recorded_lower(self, *args, _private_parameters=None, **kwargs):
        lowerings.append(_private_parameters)
        return lower(self, *args, _private_parameters=_private_parameters, **kwargs)

    def recorded_compile(self, compiler_options=None, **kwargs):
        compilations.append(dict(compiler_options or {}))
        return compile_(self, compiler_options=compiler_options, **kwargs)

    monkeypatch.setattr(jax.stages.Traced, "lower", recorded_lower)
    monkeypatch.setattr(jax.stages.Lowered, "compile", recorded_compile)
    monkeypatch.setenv("BLRPPL_COMPILATION_CACHE", "0")  # (every program compiled here)
    monkeypatch.delenv("XLA_FLAGS", raising=False)

    def model(X, y=None):
        beta = numpyro.sample("beta", dist.MultivariateNormal(jnp.zeros(3), jnp.eye(3)))
        sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
        with numpyro.plate("n", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ beta, sigma), obs=y)

    rng = np.random.default_rng(0)
    X = rng.normal(size=(40, 3))
    y = X @ np.array([1.0, -0.5, 0.2]) + 0.3 * rng.normal(size=40)
    result = blr_fit(model, {"X": X, "y": y}, progress_bar=False)
    result.sample(jax.random.PRNGKey(0), 3)
    assert lowerings and compilations
    assert all(p is runtime_compile.lowering_parameters() for p in lowerings)
    assert all(c.get(FLAG) is False for c in compilations)
