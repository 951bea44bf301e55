"""The program store and a model that holds its data as constants (``len(set(sex))``): its
programs are keyed by the data's values, so a new process loads them for the same data
only, and other data get their own posterior."""

from __future__ import annotations

import json

from checks import run_in_new_process

CODE = r"""
import json, os
import numpy as np, numpyro, numpyro.distributions as dist
from jax import random
numpyro.enable_x64()
from blrppl import blr_fit
from blrppl.runtime import program_store

def model(sex, height=None):
    a = numpyro.sample("a", dist.Normal(178.0, 20.0).expand([len(set(sex))]))
    with numpyro.plate("n", len(sex)):
        numpyro.sample("height", dist.Normal(a[sex], 5.0), obs=height)

def fit(shift):
    rng = np.random.default_rng(0)
    sex = rng.integers(0, 2, 20)
    height = 150.0 + shift + 10.0 * sex + 5.0 * rng.normal(size=20)
    before = program_store.COUNTS.copy()
    r = blr_fit(model, {"sex": sex, "height": height}, rng_key=random.PRNGKey(0), progress_bar=False)
    precision = 1 / 400 + np.bincount(sex) / 25
    exact = (178.0 / 400 + np.bincount(sex, weights=height) / 25) / precision
    return {
        "mean": np.asarray(r.posterior["a"].mean).tolist(),
        "exact": exact.tolist(),
        "loaded": program_store.COUNTS["loaded"] - before["loaded"],
        "stored": program_store.COUNTS["stored"] - before["stored"],
    }

print("RESULT" + json.dumps([fit(s) for s in json.loads(os.environ["SHIFTS"])]))
"""


def test_a_model_holding_its_data_loads_its_programs_for_the_same_data_only(tmp_path):
    (first,) = run_in_new_process(CODE, tmp_path, SHIFTS=json.dumps([0.0]))
    assert first["loaded"] == 0 and first["stored"] >= 3  # model run, chunk, export (, diagnostics)
    same, other = run_in_new_process(CODE, tmp_path, SHIFTS=json.dumps([0.0, 5.0]))
    assert same["loaded"] == first["stored"] and same["stored"] == 0 and same["mean"] == first["mean"]
    assert other["loaded"] == 0 and other["stored"] >= 3
    for result in (first, other):
        assert max(abs(m - e) / abs(e) for m, e in zip(result["mean"], result["exact"])) < 1e-8
