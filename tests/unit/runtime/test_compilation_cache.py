"""Persistent compilation: with :func:`blrppl.enable_compilation_cache`, a second process
running the same fit compiles nothing with XLA (its programs come from blrppl's program
store or JAX's persistent cache, and the fit counts no compilation), and
``BLRPPL_COMPILATION_CACHE=0`` turns both off. Without the call JAX's cache stays off (JAX's
configuration is the user's) and blrppl's program store alone keeps the fit's programs."""

from __future__ import annotations

from checks import run_in_new_process

CODE = r"""
import collections, json, os
import jax
events = collections.Counter()
jax.monitoring.register_event_listener(lambda name, **kw: events.update([name]))
import numpy as np, numpyro, numpyro.distributions as dist
import blrppl
from blrppl import blr_fit
from blrppl.runtime import program_store
path = blrppl.enable_compilation_cache() if os.environ.get("ENABLE") == "1" else None

def model(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with numpyro.plate("n", len(y)):
        numpyro.sample("y", dist.Normal(mu, s), obs=y)

# (refine=False: the counts are the first fit's; a refinement may keep a candidate, such as a
# mixture started from the first fit, whose compiled fit is the first one's and counts none)
r = blr_fit(model, {"y": np.array([0.1, 0.5, -0.3])}, progress_bar=False, refine=False)
print("RESULT" + json.dumps({
    "dir": path,
    "jax_dir": jax.config.jax_compilation_cache_dir,
    "loaded": program_store.COUNTS["loaded"],
    "stored": program_store.COUNTS["stored"],
    "hits": events["/jax/compilation_cache/cache_hits"],
    "misses": events["/jax/compilation_cache/cache_misses"],
    "mean": float(r.posterior["mu"].mean),
    "counted": r.compile_counts.xla_compilations,
}))
"""


def run(tmp_path, **env_extra):
    return run_in_new_process(CODE, tmp_path, **{"ENABLE": "1", **env_extra})


def test_second_process_compiles_nothing(tmp_path):
    first = run(tmp_path)
    assert first["dir"] == str(tmp_path / "blrppl" / "jax")
    second = run(tmp_path)
    assert second["misses"] == 0  # (JAX's cache compiled nothing either)
    assert second["mean"] == first["mean"]
    # the fit's own count: a cache read is not a compilation (JAX times it as one)
    assert first["counted"] > 0 and second["counted"] == 0


def test_cache_can_be_turned_off(tmp_path):
    off = run(tmp_path, BLRPPL_COMPILATION_CACHE="0")
    assert off["dir"] is None and off["hits"] == 0
    assert not (tmp_path / "blrppl").exists()


def test_jaxs_cache_stays_off_unless_asked(tmp_path):
    first = run(tmp_path, ENABLE="0")
    assert first["dir"] is None and first["jax_dir"] is None
    assert first["hits"] == first["misses"] == 0
    assert not (tmp_path / "blrppl" / "jax").exists()
    assert first["stored"] > 0 and (tmp_path / "blrppl" / "programs").is_dir()
    second = run(tmp_path, ENABLE="0")
    assert second["loaded"] > 0 and second["mean"] == first["mean"]
