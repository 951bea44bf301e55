"""Compile work that grows with the distinct structures of a model, not with its sites.

An AR(2) written with a Python loop has one observed site per step, every one of them the
same structure (a scalar Normal of an affine form). Reading which leaves a density reads is
done once per structure, so its count is the same at 50 and at 200 sites; and the compiled
step's program (the sites stacked into one factor, :mod:`blrppl.graph.stack`) does not grow
with them either. Structural counts only: nothing here is timed.
"""

from __future__ import annotations

import jax
import numpyro
import numpyro.distributions as dist
from jax import random

from blrppl.api import blr_kernel, plan_of
from blrppl.bench.runner import ar2_data, ar2_loop_model
from blrppl.model import functions
from blrppl.model.trace import equation_count

numpyro.enable_x64()


def _density_reads(monkeypatch, num_sites: int) -> int:
    """How many site densities the compiler traced to find the leaves they read, planning
    the AR(2) loop at ``num_sites`` sites."""
    calls = []
    real = functions.dce

    def counted(jaxpr, used):
        calls.append(1)
        return real(jaxpr, used)

    monkeypatch.setattr(functions, "dce", counted)
    plan_of(ar2_loop_model, {"y": ar2_data(num_sites)}, rng_key=random.PRNGKey(0))
    monkeypatch.setattr(functions, "dce", real)
    return len(calls)


def test_density_reads_once_per_structure(monkeypatch):
    small, large = _density_reads(monkeypatch, 50), _density_reads(monkeypatch, 200)
    # (a1, a2 and sigma's priors: three structures, then every y_t one more)
    assert small == large
    assert small <= 4


def test_log_prob_reads_cache_keys_by_layout():
    """Sites of one structure share one answer; another shape is read on its own."""
    cache: dict = {}
    scalar = dist.Normal(0.0, 1.0)
    base, leaves, tree = functions.distribution_leaves({"fn": scalar, "value": 0.0})
    first = functions.log_prob_reads(base, leaves, tree, 0.0, cache)
    again = functions.log_prob_reads(base, leaves, tree, 1.5, cache)
    assert first == again == frozenset(range(len(leaves)))
    assert len(cache) == 1
    vector = dist.Normal(jax.numpy.zeros(3), 1.0)
    base, leaves, tree = functions.distribution_leaves({"fn": vector, "value": jax.numpy.zeros(3)})
    functions.log_prob_reads(base, leaves, tree, jax.numpy.zeros(3), cache)
    assert len(cache) == 2


def test_student_t_cache_keeps_only_read_leaves():
    """The cached answer is the density's own: a StudentT's ``Chi2`` field is not read."""
    cache: dict = {}
    d = dist.StudentT(4.0, 0.0, 1.0)
    base, leaves, tree = functions.distribution_leaves({"fn": d, "value": 0.0})
    plain = functions.log_prob_reads(base, leaves, tree, 0.0)
    cached = [functions.log_prob_reads(base, leaves, tree, 0.0, cache) for _ in range(2)]
    assert cached[0] == cached[1] == plain
    assert len(plain) < len(leaves)


def test_step_program_does_not_grow_with_sites():
    sizes = []
    for num_sites in (50, 200):
        kernel, state = blr_kernel(ar2_loop_model, {"y": ar2_data(num_sites)}, rng_key=random.PRNGKey(0))
        sizes.append(equation_count(jax.make_jaxpr(kernel.step)(state).jaxpr))
    assert sizes[1] == sizes[0]
