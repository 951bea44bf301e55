"""The compiler's choice of IVON blocks (blrppl.compiler.large_blocks): a Monte Carlo factor
reading many Gaussian scalars (a network's likelihood) gets its weights as elementwise
Gaussians updated by IVON's rule, with O(d) state; small networks keep their dense plan."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import random

from blrppl.api import blr_kernel, plan_of
from blrppl.compiler.large_blocks import IVON_MIN_DIM


def network(x, y=None, hidden=20):
    d = x.shape[1]
    w1 = numpyro.sample("w1", dist.Normal(0.0, 1.0).expand([d, hidden]).to_event(2))
    b1 = numpyro.sample("b1", dist.Normal(0.0, 1.0).expand([hidden]).to_event(1))
    w2 = numpyro.sample("w2", dist.Normal(0.0, 1.0 / np.sqrt(hidden)).expand([hidden]).to_event(1))
    b2 = numpyro.sample("b2", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(jnp.tanh(x @ w1 + b1) @ w2 + b2, 0.1), obs=y)


def _data(n=50, d=2):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, d))
    return {"x": x, "y": np.sin(x[:, 0]) + 0.1 * rng.normal(size=n)}


def _families(plan):
    return {b.name: b.kind for b in plan.blocks}


def test_a_large_network_gets_ivon_blocks():
    hidden = 1250  # 2 × 1250 + 1250 + 1250 + 1 = 5001 weights
    plan = plan_of(lambda x, y: network(x, y, hidden), _data(), rng_key=random.PRNGKey(0))
    assert _families(plan) == {n: "gaussian-ivon" for n in ("w1", "b1", "w2", "b2")}
    assert sum(b.size for b in plan.blocks) == 5001 > IVON_MIN_DIM


def test_a_small_network_keeps_its_dense_plan():
    plan = plan_of(network, _data(), rng_key=random.PRNGKey(0))
    assert "gaussian-ivon" not in _families(plan).values()


def test_the_users_families_are_kept():
    plan = plan_of(
        lambda x, y: network(x, y, 400), _data(), rng_key=random.PRNGKey(0), families={"b2": "gaussian-diag"}
    )
    kinds = _families(plan)
    assert kinds["b2"] == "gaussian-diag" and kinds["w1"] == "gaussian-ivon"


def test_a_5000_weight_network_steps_with_linear_state():
    hidden = 1250
    t0 = time.perf_counter()
    kernel, state = blr_kernel(lambda x, y: network(x, y, hidden), _data(), rng_key=random.PRNGKey(0))
    # the state holds the mean, precision and momentum of each weight (and one weight per
    # block): no d × d matrix
    sizes = sum(np.size(leaf) for leaf in jax.tree.leaves(state.nat))
    assert sizes <= 3 * 5001 + 4
    step = jax.jit(kernel.step)
    elbos = []
    for _ in range(20):
        state, info = step(state)
        elbos.append(float(info.elbo))
    elapsed = time.perf_counter() - t0
    assert np.all(np.isfinite(elbos)) and bool(info.valid)
    # (measured: ~10 s with compilation on 2 CPU cores; a dense 5001 × 5001 block would hold
    # 200 MB per matrix and factorise it at every step)
    assert elapsed < 120.0
    means = {n: np.asarray(v.eta1 / (-2.0 * v.eta2)) for n, v in state.nat.items()}
    assert all(np.all(np.isfinite(m)) for m in means.values())
