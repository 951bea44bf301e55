"""Joint draws of a product grid's mixture of fits (:mod:`blrppl.posterior.grid_draws`): each
draw takes a grid point, then the scales near it and the other latents from that point's fit.
Stand-in blocks with hand-set fits, so that what each draw must pair is known."""

from __future__ import annotations

import types

import numpy as np
import numpyro.distributions as dist
from jax import random

from blrppl.posterior.grid_draws import GridDraws, GridScale, draw

N = 20_000


class _ShiftedNormal:
    """A stand-in family: N(nat, 1) draws (nat is the mean), on the host."""

    def sample(self, nat, key, shape):
        seed = int(np.asarray(random.key_data(key))[-1])
        return nat + np.random.default_rng(seed).standard_normal(shape)


def _block(name):
    return types.SimpleNamespace(name=name, members=(), family=_ShiftedNormal(), to_site=lambda x: x, transform=None)


def _two_points():
    """Points u = 0 and u = 5 of weights 0.3 and 0.7 (a third of no weight); x's fit at each
    is N(−10, 1) and N(10, 1)."""
    weights = np.array([0.3, 0.7, 0.0])
    scale = GridScale("tau", np.array([0.0, 5.0, 9.0]), 0.01, dist.transforms.ExpTransform())
    return GridDraws(weights, (scale,), ((_block("x"), [-10.0, 10.0, None]),))


def test_each_draw_pairs_the_scale_with_its_points_fit():
    """x > 0 exactly where τ = e^u is near e⁵ (independent draws would pair them at random:
    30 % of the draws with u near 5 would have x near −10)."""
    out = draw(_two_points(), random.PRNGKey(0), N)
    assert set(out) == {"tau", "x"} and out["tau"].shape == out["x"].shape == (N,)
    near_five = np.log(out["tau"]) > 2.5
    np.testing.assert_array_equal(out["x"] > 0, near_five)


def test_the_points_are_drawn_by_their_weights():
    """The share of draws at u = 5 is its weight 0.7 (binomial sd √(0.21/N) = 0.0032: within 4
    of it); the point of no weight is never drawn; each scale's kernel is its width."""
    out = draw(_two_points(), random.PRNGKey(1), N)
    u = np.log(out["tau"])
    assert abs(np.mean(u > 2.5) - 0.7) < 4 * np.sqrt(0.21 / N)
    assert np.max(u) < 6.0
    assert abs(np.std(u[u > 2.5] - 5.0) - 0.01) < 0.001


def test_draws_are_fixed_by_the_key():
    a, b = draw(_two_points(), random.PRNGKey(2), 100), draw(_two_points(), random.PRNGKey(2), 100)
    np.testing.assert_array_equal(a["x"], b["x"])
    c = draw(_two_points(), random.PRNGKey(3), 100)
    assert not np.array_equal(a["x"], c["x"])


def test_sites_lists_the_scales_and_the_blocks():
    assert _two_points().sites() == {"tau", "x"}
