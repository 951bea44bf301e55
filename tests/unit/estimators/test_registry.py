"""Estimators are objects registered by name: a group of factors is evaluated by handing each
registered estimator its own factors, in the estimators' order (hand-made factors and
estimators, no model)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from blrppl.estimators import ESTIMATORS, Estimator, estimator_of, register_estimator
from blrppl.estimators.enumeration import _elementwise


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
