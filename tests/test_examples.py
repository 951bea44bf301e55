"""Every example runs (with fewer steps where it has a knob) and shows what it claims."""

import importlib.util
import pathlib

import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_svi_pipeline_example():
    runs = load("svi_pipeline").main(svi_steps=300)
    (svi_name, svi), (blr_name, blr) = runs.items()
    assert blr_name == "BLR"
    assert svi["param shapes"] == blr["param shapes"]
    assert blr["steps"] < 1000  # converged before the cap
    # the data were simulated with intercept 0.5 and noise sd 0.7 (N=500): the 90% intervals
    # of a converged fit hold them
    lo, _, hi = np.asarray(blr["quantiles"]["b"])
    assert lo < 0.5 < hi
    lo, _, hi = np.asarray(blr["quantiles"]["sigma"])
    assert lo < 0.7 < hi
