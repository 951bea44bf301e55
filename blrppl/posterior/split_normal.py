"""The split normal (two-piece normal): a Gaussian of sd σ_L left of its mode and σ_R right of
it, joined at the mode with one density value there. The marginal of a scale integrated on a
central composite design (:mod:`blrppl.engine.design`), whose few points per axis give a
spread on each side of the mode rather than a shape.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpyro.distributions as dist
from jax.scipy.special import ndtr, ndtri
from numpyro.distributions import constraints


class SplitNormal(dist.Distribution):
    """Density 2 / (σ_L + σ_R) · φ((x − mode) / σ), σ = σ_L left of the mode and σ_R right of it
    (φ the standard normal density): the mode's left holds mass σ_L / (σ_L + σ_R).

    Args:
        loc: the mode.
        left: σ_L > 0.
        right: σ_R > 0.
    """

    arg_constraints = {"loc": constraints.real, "left": constraints.positive, "right": constraints.positive}
    support = constraints.real
    reparametrized_params = ["loc", "left", "right"]
    pytree_data_fields = ("loc", "left", "right")

    def __init__(self, loc, left, right, *, validate_args=None):
        self.loc, self.left, self.right = dist.util.promote_shapes(loc, left, right)
        shape = jax.lax.broadcast_shapes(jnp.shape(loc), jnp.shape(left), jnp.shape(right))
        super().__init__(batch_shape=shape, validate_args=validate_args)

    def _left_mass(self):
        return self.left / (self.left + self.right)

    def sample(self, key, sample_shape=()):
        # (a side with the probability of its mass, then a half-normal on it: no quantile of 0
        # or 1, whose inverse is infinite)
        shape = sample_shape + self.batch_shape
        dtype = jnp.result_type(self.loc, float)
        side_key, size_key = jax.random.split(key)
        left = jax.random.uniform(side_key, shape, dtype=dtype) < self._left_mass()
        size = jnp.abs(jax.random.normal(size_key, shape, dtype=dtype))
        return self.loc + jnp.where(left, -self.left, self.right) * size

    def log_prob(self, value):
        scale = jnp.where(value < self.loc, self.left, self.right)
        z = (value - self.loc) / scale
        return math.log(2.0) - jnp.log(self.left + self.right) - 0.5 * z * z - 0.5 * math.log(2.0 * math.pi)

    def cdf(self, value):
        p = self._left_mass()
        below = 2.0 * p * ndtr((value - self.loc) / self.left)
        above = p + 2.0 * (1.0 - p) * (ndtr((value - self.loc) / self.right) - 0.5)
        return jnp.where(value < self.loc, below, above)

    def icdf(self, q):
        p = self._left_mass()
        below = self.loc + self.left * ndtri(jnp.clip(q / (2.0 * p), 0.0, 0.5))
        above = self.loc + self.right * ndtri(jnp.clip(0.5 + (q - p) / (2.0 * (1.0 - p)), 0.5, 1.0))
        return jnp.where(q < p, below, above)

    @property
    def mean(self):
        return self.loc + math.sqrt(2.0 / math.pi) * (self.right - self.left)

    @property
    def variance(self):
        gap = self.right - self.left
        return (1.0 - 2.0 / math.pi) * gap * gap + self.left * self.right
