"""The digits bench's pieces (blrppl.bench.deep) on small synthetic data: the two Adam losses,
the IVON optimiser's settings picked on held-out training data, and the alternating timer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import random

from blrppl.bench import deep


def small_data(n=60, d=8, seed=0):
    """Ten classes of standardised inputs (the bench's shapes, fewer of them)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d))
    y = rng.integers(0, 10, size=n)
    return jnp.asarray(x), jnp.asarray(y)


def test_plain_adam_loss_is_the_mean_cross_entropy_and_map_adds_the_prior():
    x, y = small_data()
    params = deep._initial_params(x.shape[1])
    params = jax.tree.map(lambda v: v + 0.1, params)  # (non-zero biases)
    logits = np.asarray(deep.mlp(params, x))
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    want = -np.mean(logp[np.arange(len(y)), np.asarray(y)])
    np.testing.assert_allclose(float(deep.cross_entropy(params, x, y)), want, rtol=1e-12)
    square = sum(float(np.sum(np.asarray(v) ** 2)) for v in jax.tree.leaves(params))
    np.testing.assert_allclose(float(deep.cross_entropy(params, x, y, 1.0)), want + 0.5 * square / len(y), rtol=1e-12)


def test_ivon_settings_are_picked_on_held_out_training_data(monkeypatch):
    """The grid's best held-out NLL, each fit on the rest of the training set: the NLL of each
    grid point recomputed here from a fit on the first 80 % (no test set is passed)."""
    monkeypatch.setattr(deep, "IVON_GRID", {"learning_rate": (0.01, 0.3), "hess_init": (1.0,)})
    monkeypatch.setattr(deep, "NOISE_BLOCK", 3)  # 7 steps: two blocks of 3 and one of 1
    monkeypatch.setattr(deep, "DRAWS", 20)
    x, y = small_data()
    chosen, table = deep.select_ivon_settings((x, y), steps=7)
    assert set(table) == {(0.01, 1.0), (0.3, 1.0)}
    assert table[(chosen["learning_rate"], chosen["hess_init"])] == min(table.values())
    train_all = deep._ivon_run(x[:48], y[:48], 7, deep.IVON_SETTINGS)
    mean, state = train_all(deep._initial_params(8), random.PRNGKey(1), 0.3, 1.0)
    assert int(state.count) == 7
    probs = deep._model_average(state, mean, random.PRNGKey(2), x[48:])
    np.testing.assert_allclose(table[(0.3, 1.0)], deep.scores(probs, np.asarray(y[48:]), 0.0)["nll"], rtol=1e-12)


def test_timing_alternates_the_methods_and_reports_the_spread(monkeypatch):
    calls = []
    clock = iter(np.arange(0.0, 100.0, 0.5))
    monkeypatch.setattr(deep.time, "perf_counter", lambda: float(next(clock)))

    def method(name):
        return deep.Timed(lambda: calls.append(name) or name, lambda out, s: {"out": out, "epoch_ms": 1000 * s}, 10)

    out = deep.time_alternately({"a": method("a"), "b": method("b")}, repeats=3)
    assert calls == ["a", "b"] + ["a", "b"] * 3  # compiled once each, then in turn
    for name in "ab":
        assert out[name]["out"] == name
        # every run took 0.5 s of the fake clock over 10 steps: 50 ms a step
        assert out[name]["epoch_ms"] == pytest.approx(50.0)
        assert out[name]["epoch_ms_min"] == pytest.approx(50.0) and out[name]["epoch_ms_max"] == pytest.approx(50.0)
