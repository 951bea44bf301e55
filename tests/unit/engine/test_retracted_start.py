"""A non-conjugate Gaussian block at ρ = 1 learns whether its message is valid from the
factorisation of its plain candidate (which is the message), not from a factorisation of
its own (:func:`blrppl.engine.step._update_retracted`).

The run must be the one that checks the message first: same ELBO at every step and same
parameters, on models whose messages are valid (a Poisson random walk, a banded chain) and
invalid (a Student-t location between two far clusters: the likelihood's curvature is
negative there, and the step retracts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

from checks import fresh_fit
from blrppl.engine import step as step_module


def poisson_walk(c):
    x = numpyro.sample("x", dist.GaussianRandomWalk(0.3, num_steps=c.shape[0]))
    with numpyro.plate("t", c.shape[0]):
        numpyro.sample("c", dist.Poisson(jnp.exp(x)), obs=c)


def between_clusters(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("data", len(y)):
        numpyro.sample("y", dist.StudentT(2.0, mu, 0.5), obs=y)


def _cases():
    rng = np.random.default_rng(0)
    return {
        "poisson walk": (poisson_walk, (rng.poisson(np.exp(1.0 + np.cumsum(0.3 * rng.normal(size=60)))).astype(float),)),
        "student-t between clusters": (between_clusters, (np.array([-4.0] * 5 + [4.2] * 5),)),
    }


CASES = _cases()


def _checking_first(family, nat_old, message, rho, max_halvings, formed):
    """The message checked on its own, then the candidates from ρ (the plain path)."""
    valid = family.is_valid(message)
    out = step_module._update_block(family, nat_old, message, rho, max_halvings, valid, True, formed)
    return (*out, valid)


def _fit(model, args, update, monkeypatch, seen):
    def recording(*a):
        out = update(*a)
        jax.debug.callback(lambda v: seen.append(bool(v)), out[-1])
        return out

    monkeypatch.setattr(step_module, "_update_retracted", recording)
    return fresh_fit(model, args, monkeypatch, num_steps=15)


@pytest.mark.parametrize("name", list(CASES))
def test_speculative_start_gives_the_same_run(name, monkeypatch):
    model, args = CASES[name]
    seen, seen_ref = [], []
    fast = _fit(model, args, step_module._update_retracted, monkeypatch, seen)
    reference = _fit(model, args, _checking_first, monkeypatch, seen_ref)
    assert fast.num_steps == reference.num_steps > 1
    assert seen == seen_ref and seen  # the same message validity at every update
    if name == "student-t between clusters":
        assert not all(seen)  # some message was not a valid natural parameter: retracted
    np.testing.assert_allclose(fast.elbo, reference.elbo, rtol=1e-12)
    for a, b in zip(jax.tree.leaves(fast.nat), jax.tree.leaves(reference.nat)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
