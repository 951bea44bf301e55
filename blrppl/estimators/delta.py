"""The delta estimator: factors whose continuous neighbours are all point blocks.

A point (delta-method) block is seen by the factors at its mean m, so a factor f whose
continuous neighbours are all point blocks has

    L = E_q[log f] = log f(m_1, …, m_k),

exact and deterministic, whatever the distribution (enumerated over the factor's discrete
neighbours like every other estimator). Used for factors without a closed-form rule, such
as a Normal whose scale is ``exp`` of a param's unconstrained value or ``numpyro.factor``
terms of params.
"""

from __future__ import annotations

from blrppl.estimators.registry import Estimator, EstimatorChoice, register_estimator
from blrppl.moments.linearised import base_values

#: log f at the point blocks' means m: L = log f(m_1, …, m_k), exact and deterministic
DELTA = register_estimator(
    Estimator(
        name="delta",
        summary="log f at the point blocks, L = log f(m_1, …, m_k)",
        order=0,
        elementwise=lambda fns, fs, blocks, views, dvals, data, wrappers, key, curvature: (
            *delta_elementwise(fns, fs, blocks, views, dvals, data), 0.0
        ),
        serves=lambda candidate: _serves(candidate),
        choice_order=10,
    )
)


def _serves(candidate) -> EstimatorChoice | None:
    """A factor without a closed form whose continuous neighbours (if any) are all point
    blocks: log f at the points (enumerated over its discrete neighbours) is exact."""
    cont = [n for n in candidate.neighbours if n not in candidate.discrete]
    if not all(candidate.blocks[n].point for n in cont):
        return None
    return EstimatorChoice(arg_kinds=(("log_prob", "delta"),))


def delta_elementwise(fns, factors, blocks, views, discrete_values, data):
    """Per-element log f at the points (given the discrete values), and the sites' scales."""
    cont = []
    for f in factors:
        cont += [n for n in f.neighbours if n not in f.discrete and n not in cont]
    points = base_values(blocks, views, cont)
    out = fns.log_probs(tuple(f.name for f in factors), {**discrete_values, **points}, data)
    els = {n: lp for n, (lp, _) in out.items()}
    scales = {n: sc for n, (_, sc) in out.items()}
    return els, scales
