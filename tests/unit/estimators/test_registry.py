"""Estimators are objects registered by name: a group of factors is evaluated by handing each
registered estimator its own factors, in the estimators' order (hand-made factors and
estimators, no model), and the compiler gives each factor the first registered estimator
that serves it, in their choice order."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

from blrppl.api import plan_of
from blrppl.estimators import ESTIMATORS, Estimator, estimator_of, register_estimator
from blrppl.estimators.enumeration import _elementwise
from blrppl.estimators.monte_carlo import MONTE_CARLO
from blrppl.estimators.registry import EstimatorChoice, FactorCandidate, choose_estimator


@pytest.fixture
def recording_estimators():
    calls = []

    def make(name, order, extra):
        def elementwise(fns, factors, blocks, views, dvals, data, wrappers, key, curvature):
            calls.append((name, tuple(f.name for f in factors), curvature))
            return {f.name: f"{name}:{f.name}" for f in factors}, {f.name: wrappers[f.name][1] for f in factors}, extra
        return register_estimator(Estimator(name=name, order=order, elementwise=elementwise))

    made = [make("late", 5, 2.0), make("early", -1, 0.0), make("middle", 3, 1.5)]
    try:
        yield calls, made
    finally:
        for e in made:
            ESTIMATORS.pop(e.name)


def test_each_estimator_gets_its_own_factors_in_its_order(recording_estimators):
    calls, _ = recording_estimators
    group = [SimpleNamespace(name=n, estimator=e) for n, e in
             [("a", "late"), ("b", "early"), ("c", "late"), ("d", "middle")]]
    wrappers = {f.name: (None, f"scale-{f.name}") for f in group}
    els, scales, extra = _elementwise(None, group, {}, {}, {}, None, wrappers, key=None, curvature="stein")
    assert calls == [("early", ("b",), "stein"), ("middle", ("d",), "stein"), ("late", ("a", "c"), "stein")]
    assert els == {"a": "late:a", "b": "early:b", "c": "late:c", "d": "middle:d"}
    assert scales == {n: f"scale-{n}" for n in "abcd"}
    assert extra == pytest.approx(3.5)  # the surrogate terms of every estimator, summed


def test_the_builtin_estimators_are_registered_with_an_evaluation():
    assert {"exact", "quadrature", "monte_carlo", "delta"} <= set(ESTIMATORS)
    orders = [ESTIMATORS[n].order for n in ("delta", "quadrature", "exact", "monte_carlo")]
    assert orders == sorted(orders)
    assert all(callable(ESTIMATORS[n].elementwise) for n in ("delta", "quadrature", "exact", "monte_carlo"))


def test_an_unknown_estimator_is_named():
    with pytest.raises(KeyError, match="no estimator named 'nope'"):
        estimator_of("nope")


# ------------------------------------------------------------------ choosing an estimator


def logistic(x, y):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0))
    with numpyro.plate("n", len(y)):
        numpyro.sample("y", dist.Bernoulli(logits=w * x), obs=y)


def test_a_registered_estimator_that_serves_a_factor_is_chosen_before_the_builtins():
    """The compiler asks the registered estimators in their choice order: one that serves the
    Bernoulli likelihood first takes it from quadrature, with the choice it returned; once it
    is gone, quadrature serves it again."""
    seen = []

    def serves(candidate):
        seen.append(candidate.name)
        if not candidate.record.dist_name.startswith("Bernoulli"):
            return None
        return EstimatorChoice(arg_kinds=(("log_prob", "monte_carlo"),))

    data = {"x": np.linspace(-1, 1, 20), "y": (np.arange(20) % 2).astype(float)}
    before = {f.name: f.estimator for f in plan_of(logistic, data, rng_key=random.PRNGKey(0)).factors}
    assert before["y"] == "quadrature"
    mine = register_estimator(
        Estimator(name="draws_for_bernoulli", approximates=True, deterministic=False, draws=True,
                  elementwise=MONTE_CARLO.elementwise, serves=serves, choice_order=-1)
    )
    try:
        plan = plan_of(logistic, data, rng_key=random.PRNGKey(1))
        chosen = {f.name: f.estimator for f in plan.factors}
        assert chosen["y"] == "draws_for_bernoulli" and chosen["w"] == "exact"
        assert {"w", "y"} <= set(seen)
        assert dict((f.name, f.arg_kinds) for f in plan.factors)["y"] == (("log_prob", "monte_carlo"),)
    finally:
        ESTIMATORS.pop(mine.name)
    again = {f.name: f.estimator for f in plan_of(logistic, data, rng_key=random.PRNGKey(2)).factors}
    assert again == before


def test_monte_carlo_serves_any_factor_and_an_unserved_one_is_named(monkeypatch):
    candidate = FactorCandidate(
        name="f", record=None, rule=None, blocks={}, neighbours=(), discrete=(), classes={}, closed_form=False,
        projections=(), projection_classes={}, quadrature=False,
    )
    # (no continuous neighbour: delta serves it, before Monte Carlo)
    assert choose_estimator(candidate)[0].name == "delta"
    serving = {n: e for n, e in ESTIMATORS.items() if e.serves is not None}
    for name in serving:
        monkeypatch.setitem(ESTIMATORS, name, Estimator(name=name))
    with pytest.raises(LookupError, match="no registered estimator serves the factor 'f'"):
        choose_estimator(candidate)
