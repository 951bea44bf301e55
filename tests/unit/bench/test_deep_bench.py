"""The digits bench's pieces (blrppl.bench.deep) on small synthetic data: the two Adam losses,
the minibatch protocol (epochs of shuffled batches, the cosine decay, each method's settings
picked on held-out training data), the scores of a diverged run, and the alternating timer."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import random

from blrppl.bench import deep
from blrppl.optim.sampling import find_state


def small_data(n=60, d=8, seed=0):
    """Ten classes of standardised inputs (the bench's shapes, fewer of them)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d))
    y = rng.integers(0, 10, size=n)
    return jnp.asarray(x), jnp.asarray(y)


def test_plain_adam_loss_is_the_mean_cross_entropy_and_map_adds_the_prior():
    x, y = small_data()
    params = deep.initial_params(x.shape[1])
    params = jax.tree.map(lambda v: v + 0.1, params)  # (non-zero biases)
    logits = np.asarray(deep.mlp(params, x))
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    want = -np.mean(logp[np.arange(len(y)), np.asarray(y)])
    np.testing.assert_allclose(float(deep.cross_entropy(params, x, y)), want, rtol=1e-12)
    square = sum(float(np.sum(np.asarray(v) ** 2)) for v in jax.tree.leaves(params))
    np.testing.assert_allclose(float(deep.cross_entropy(params, x, y, 1.0)), want + 0.5 * square / len(y), rtol=1e-12)
    # a minibatch's loss: the prior over the training set's size, not the batch's
    np.testing.assert_allclose(float(deep.cross_entropy(params, x, y, 1.0, size=600)),
                               want + 0.5 * square / 600, rtol=1e-12)


def test_an_epoch_is_a_permutation_cut_into_whole_batches():
    order = np.asarray(deep.epoch_batches(random.PRNGKey(3), 300, 128))
    assert order.shape == (2, 128)
    assert len(np.unique(order)) == 256 and order.min() >= 0 and order.max() < 300
    other = np.asarray(deep.epoch_batches(random.PRNGKey(4), 300, 128))
    assert not np.array_equal(order, other)  # each epoch its own order


@pytest.mark.parametrize("cosine", [0.0, 1.0])
def test_annealed_scales_the_updates_by_a_cosine_decay_or_not_at_all(cosine):
    opt = deep.annealed(optax.sgd(0.5), cosine, total=8)
    params = jnp.zeros(3)
    state = opt.init(params)
    for t in range(10):
        grads = jnp.array([1.0, -2.0, 3.0])
        updates, state = opt.update(grads, state, params)
        fraction = min(t / 8, 1.0)
        scale = 1.0 - cosine + cosine * 0.5 * (1.0 + math.cos(math.pi * fraction))
        np.testing.assert_allclose(np.asarray(updates), -0.5 * scale * np.asarray(grads), rtol=1e-12, atol=1e-15)


def test_ivon_trainer_takes_a_step_per_minibatch_and_keeps_its_settings():
    x, y = small_data(n=300)
    init, train = deep._ivon_trainer(x, y, epochs=3)
    hyper = {"learning_rate": 0.3, "hess_init": 2.0, "cosine": 1.0}
    carry = train(init(deep.initial_params(8), **hyper), random.PRNGKey(1), **hyper)
    state = find_state(carry[1])  # (the IVON state inside the chain with the decay)
    assert int(state.count) == 3 * 2  # two batches of 128 an epoch
    assert state.posterior.ess == 300 and state.posterior.weight_decay == pytest.approx(1.0 / 300)
    assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(carry))


def test_settings_are_picked_on_held_out_training_data_and_diverged_points_skipped(monkeypatch):
    """A fake method whose held-out probabilities depend on its setting alone (NaN for one: a
    diverged run): the grid's best finite NLL is picked, every point fitted on the first 80 %."""
    x, y = small_data(n=50)
    seen = []

    def trainer(x_fit, y_fit, epochs):
        seen.append((len(y_fit), epochs))
        return (lambda params, sharpness: sharpness), (lambda carry, key, sharpness: carry)

    def probs(sharpness, key, x_held):
        right = jax.nn.one_hot(np.asarray(y[40:]), 10)  # the held-out labels, weighted by sharpness
        logits = jnp.where(sharpness > 5.0, jnp.nan, sharpness * right)
        return jax.nn.softmax(logits)

    method = deep.Method(trainer, {"sharpness": (0.5, 2.0, 4.0, 9.0)}, probs)
    chosen, table = deep.select(method, (x, y), epochs=4)
    assert seen == [(40, 4)]  # built once, on the first 40 of 50 points
    assert chosen == {"sharpness": 4.0}
    assert np.isnan(table[(("sharpness", 9.0),)])
    nll = -np.log(np.exp(2.0) / (np.exp(2.0) + 9.0))
    np.testing.assert_allclose(table[(("sharpness", 2.0),)], nll, rtol=1e-6)


def test_select_says_so_when_every_point_diverged():
    x, y = small_data(n=50)
    method = deep.Method(lambda *a: (lambda p, s: s, lambda c, k, s: c), {"s": (1.0,)},
                         lambda c, k, xh: jnp.full((len(xh), 10), jnp.nan))
    with pytest.raises(RuntimeError, match="diverged"):
        deep.select(method, (x, y), epochs=1)


def test_a_diverged_run_scores_nan_not_a_perfect_calibration():
    probs = np.full((4, 10), np.nan)
    out = deep.scores(probs, np.arange(4), 0.001)
    assert np.isnan(out["nll"]) and np.isnan(out["ece"]) and np.isnan(out["accuracy"])
    assert deep._cell([out], "nll") == "diverged"


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


@pytest.mark.parametrize("epochs, per_epoch, span", [(100, 10, 5), (3, 2, 3), (7, 10, 1), (10, 80, 1), (12, 6, 6)])
def test_ivon_draws_the_noise_of_whole_epochs_about_fifty_steps_at_a_time(epochs, per_epoch, span):
    assert deep.noise_span(epochs, per_epoch) == span


def test_report_gives_the_seeds_range_and_a_time_ratio_only_to_rows_timed_with_adam():
    adam = [{"accuracy": 0.9, "nll": 0.2, "ece": 0.05, "epoch_ms": 0.5, "epoch_ms_min": 0.4, "epoch_ms_max": 0.6},
            {"accuracy": 0.8, "nll": 0.4, "ece": 0.07, "epoch_ms": np.nan}]
    ivon = [{"accuracy": 0.9, "nll": 0.1, "ece": 0.03, "epoch_ms": 0.75, "epoch_ms_min": 0.7, "epoch_ms_max": 0.8}]
    full = [{"accuracy": 0.9, "nll": 0.3, "ece": 0.09, "epoch_ms": 5.0}]
    text = deep.report({"Adam": adam, "IVON": ivon, "SVI": full}, {}, {"IVON": {(("a", 1.0),): 0.5}})
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in text.splitlines() if line.startswith("| ")}
    assert rows["Adam"][2] == "0.300 (0.200–0.400)"  # mean over the seeds, their range
    assert rows["IVON"][5] == "1.50" and rows["SVI"][5] == ""
    assert "| 0.5000 | a = 1 |" in text


def test_a_setting_fixed_in_the_program_builds_one_trainer_per_value_and_is_picked_with_the_rest():
    """The prior precision is fixed in a trainer's program: the held-out search builds one trainer
    per value, fits every point of the other grid with it, and returns the best joint point, whose
    fixed part goes to the trainer again when the pick is refitted."""
    x, y = small_data(n=50)
    built = []

    def trainer(x_fit, y_fit, epochs, tau, batch=128):
        built.append((len(y_fit), tau, batch))
        return (lambda params, sharpness: sharpness * tau), (lambda carry, key, sharpness: carry)

    def labelled(score, key, x_held):  # best where sharpness × tau is nearest 6
        right = jax.nn.one_hot(np.asarray(y[40:]), 10)
        return jax.nn.softmax(right * (10.0 - jnp.abs(score - 6.0)))

    method = deep.with_batch(deep.Method(trainer, {"sharpness": (1.0, 2.0, 3.0)}, labelled, {"tau": (0.5, 3.0)}), 16)
    chosen, table = deep.select(method, (x, y), epochs=2)
    assert built == [(40, 0.5, 16), (40, 3.0, 16)]  # one trainer per fixed value, on the minibatches asked
    assert len(table) == 6 and chosen == {"tau": 3.0, "sharpness": 2.0}
    assert (("sharpness", 2.0), ("tau", 3.0)) in table
    carry = deep.fit(method, x, y, chosen, epochs=2)
    assert built[-1] == (50, 3.0, 16) and float(carry) == pytest.approx(6.0)


def test_the_small_training_sets_table_gives_each_subsets_mean_and_their_mean():
    def run(nll, ece):
        return {"accuracy": 0.9, "nll": nll, "ece": ece, "epoch_ms": 1.0}

    small = {"batch": 32, "subsets": [
        (0, 300, {"Adam": [run(0.2, 0.02), run(0.4, 0.04)], "IVON": [run(0.1, 0.01)]}),
        (300, 600, {"Adam": [run(0.5, 0.05)], "IVON": [run(np.nan, np.nan)]}),
    ]}
    text = "\n".join(deep._small_lines(small))
    assert "| method | images 0–299: NLL / ECE | images 300–599: NLL / ECE | mean NLL | mean ECE |" in text
    assert "| Adam | 0.300 / 0.030 | 0.500 / 0.050 | 0.400 | 0.040 |" in text
    assert "| IVON | 0.100 / 0.010 | diverged | nan | nan |" in text
