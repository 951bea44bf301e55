"""Which blocks take exact coordinate steps (conjugacy, read off the plan)."""

from __future__ import annotations

import numpy as np

from blrppl import moments as mom
from blrppl.estimators.registry import estimator_of


def conjugate_blocks(plan) -> tuple:
    """``(block, conjugate)`` for every block: its factors' messages do not depend on its own
    q, so that ρ = 1 is an exact coordinate step.

    Read off the plan, not measured: a discrete block is conjugate (its enumerated message
    is E[log f | value]); a continuous block is when every factor touching it is
    (:func:`factor_conjugate`).
    """
    out = []
    for b in plan.blocks:
        if b.discrete:
            out.append((b.name, True))
            continue
        conj = not b.point and all(factor_conjugate(f, b) for f in plan.factors_of(b.name))
        out.append((b.name, conj))
    return tuple(out)


def factor_conjugate(f, b) -> bool:
    """Whether the message of factor ``f`` to the continuous block ``b`` does not depend on
    q(b): ``f`` has a closed form (``exact``), its rule declares itself conjugate in the
    other arguments that read ``b`` (:func:`_declared_conjugate`) and, for a Gamma block,
    each power c·τ^a of it in an argument is one of the rule's ``conjugate_powers``. (blrppl's
    own closed-form rules declare every argument: they see a
    Gaussian block only through affine arguments of Normal-type densities, whose
    expectations are quadratic in it, and Beta/Dirichlet blocks only as the probabilities
    of Bernoulli, Binomial and Categorical observations or as the value of their own prior:
    every such expectation is linear in the block's expectation parameters.)"""
    if not estimator_of(f).closed_form or b.value_moments or (b.batch_shape and (b.name, "full") in f.columns):
        # (a factor mixing independent elements of the block: its message to one element
        # depends on the others' q, mean-field coordinate steps iterate)
        return False
    blocks_of = dict(f.arg_blocks)
    if any(k == mom.ExpGaussian.kind and b.name in blocks_of.get(a, ()) for a, k in f.arg_kinds):
        return False  # (a log-normal scale: E[σ⁻²] = exp(−2m + 2v) is not linear in μ)
    if not _declared_conjugate(f, b):
        return False
    # the powers c·τ^a of the factor's arguments: each reads one Gamma block
    for arg, power in f.spec.powers:
        if b.name not in blocks_of.get(arg, ()):
            continue
        allowed = f.rule.conjugate_powers.get(arg, ()) if f.rule is not None else ()
        if power is None or not any(np.isclose(power, a) for a in allowed):
            return False
    return True


def _declared_conjugate(f, b) -> bool:
    """Whether the rule of ``f`` declares itself linear in the expectation parameters of ``b``
    through every argument that reads it (:attr:`blrppl.rules.Rule.conjugate`), but for the
    powers of Gamma blocks (checked against its ``conjugate_powers``)."""
    powered, blocks_of = dict(f.spec.powers), dict(f.arg_blocks)
    return all(
        a in powered or a in f.rule.conjugate for a, _ in f.arg_kinds if b.name in blocks_of.get(a, ())
    )
