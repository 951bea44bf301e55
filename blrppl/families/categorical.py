"""Categorical and Bernoulli candidate families (minimal parametrisation, discrete)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist

from blrppl.families.base import Family


class CategoricalNat(NamedTuple):
    """Natural parameters of batched Categoricals (also used for their mean parameters).

    Attributes:
        logits: λ_k = log(p_k / p_K), k < K, shape ``(*B, K − 1)``
            (mean parameters: p_k, k < K).
    """

    logits: jax.Array


class BernoulliNat(NamedTuple):
    """Natural parameters of elementwise Bernoullis (also used for their mean parameters).

    Attributes:
        logit: log(p / (1 − p)), shape ``(*B,)`` (mean parameters: p).
    """

    logit: jax.Array


class CategoricalView(NamedTuple):
    """Probabilities of all K outcomes, shape ``(*B, K)`` (K = 2 for a Bernoulli: (1 − p, p))."""

    probs: jax.Array


def _pad_zero(logits: jax.Array) -> jax.Array:
    """(λ₁, …, λ_{K−1}) → (λ₁, …, λ_{K−1}, 0): the logits of all K outcomes."""
    xp = np if isinstance(logits, np.ndarray) else jnp
    return xp.concatenate([logits, xp.zeros_like(logits[..., :1])], axis=-1)


def _stats_dtype(x: jax.Array):
    x = jnp.asarray(x)
    return x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.result_type(float)


@dataclasses.dataclass(frozen=True)
class Categorical(Family):
    """Categorical over {0, …, K − 1} in the minimal parametrisation (outcome K − 1 is the
    reference), event shape ``()``; values are integers.

    * T(x) = onehot(x)[:K − 1]; base measure 1 (counting).
    * λ_k = log(p_k / p_{K−1}), k < K − 1  (:class:`CategoricalNat`, ``(*B, K − 1)``).
    * A(λ) = log(1 + Σ_k e^{λ_k}).
    * μ_k = p_k, k < K − 1.
    * view: :class:`CategoricalView` (all K probabilities).
    * Fisher F(λ) = diag(μ) − μμᵀ.

    BLR update, with g = ∂L/∂p for L = Σ_i E_q[log f_i] = Σ_i Σ_k p_k E[log f_i | x = k]:
    since p_{K−1} = 1 − Σ_{k<K−1} μ_k, the message is exact without a Fisher solve,

        λ̃_k = ∇_{μ_k} L = g_k − g_{K−1},    λ ← (1 − ρ) λ + ρ λ̃;

    at ρ = 1 this is the mean-field / VMP update p_k ∝ exp(g_k).

    Attributes:
        dim: K, the number of categories.
    """

    dim: int
    name: ClassVar[str] = "categorical"
    discrete: ClassVar[bool] = True
    indexes_support: ClassVar[bool] = True
    view_type: ClassVar[type] = CategoricalView
    support: ClassVar[str] = "discrete"
    native: ClassVar[bool] = True

    @classmethod
    def for_value(cls, value_shape: tuple, plate_axes: tuple = (), num_values: int | None = None) -> "Categorical":
        """Over the block's ``num_values`` enumerated values."""
        return cls(num_values)

    def view(self, nat: CategoricalNat) -> CategoricalView:
        """Softmax of the padded logits (on the host for numpy ``nat``)."""
        logits = _pad_zero(nat.logits)
        if isinstance(logits, np.ndarray):
            e = np.exp(logits - logits.max(-1, keepdims=True))
            return CategoricalView(e / e.sum(-1, keepdims=True))
        return CategoricalView(jax.nn.softmax(logits, axis=-1))

    def nat_from_view(self, view: CategoricalView) -> CategoricalNat:
        log_p = (np if isinstance(view.probs, np.ndarray) else jnp).log(view.probs)
        return CategoricalNat(log_p[..., :-1] - log_p[..., -1:])

    def mean_params(self, nat: CategoricalNat) -> CategoricalNat:
        return CategoricalNat(self.view(nat).probs[..., :-1])

    def nat_from_mean(self, mean_params: CategoricalNat) -> CategoricalNat:
        mu = mean_params.logits
        last = 1.0 - mu.sum(-1, keepdims=True)
        return CategoricalNat(jnp.log(mu) - jnp.log(last))

    def log_partition(self, nat: CategoricalNat) -> jax.Array:
        return jax.nn.logsumexp(_pad_zero(nat.logits), axis=-1)

    def sufficient_stats(self, x: jax.Array) -> CategoricalNat:
        return CategoricalNat(jax.nn.one_hot(x, self.dim, dtype=_stats_dtype(x))[..., :-1])

    def log_prob(self, nat: CategoricalNat, x: jax.Array) -> jax.Array:
        log_p = jax.nn.log_softmax(_pad_zero(nat.logits), axis=-1)
        x = jnp.asarray(x).astype(jnp.int32)
        log_p = jnp.broadcast_to(log_p, x.shape + log_p.shape[-1:])
        return jnp.take_along_axis(log_p, x[..., None], axis=-1)[..., 0]

    def entropy(self, nat: CategoricalNat) -> jax.Array:
        log_p = jax.nn.log_softmax(_pad_zero(nat.logits), axis=-1)
        return -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)

    def message_from_view_grad(self, nat: CategoricalNat, view_grad: CategoricalView) -> CategoricalNat:
        g = view_grad.probs
        return CategoricalNat(g[..., :-1] - g[..., -1:])

    def is_valid(self, nat: CategoricalNat) -> jax.Array:
        # (a count, not a logical AND: over a mesh a per-datum block's check then joins the
        # step's sums in one all-reduce)
        return jnp.sum(jnp.where(jnp.isfinite(nat.logits), 0.0, 1.0)) == 0

    def sample(self, nat: CategoricalNat, rng_key: jax.Array, sample_shape: tuple[int, ...] = ()) -> jax.Array:
        """Integer draws in {0, …, K − 1} (not reparameterisable)."""
        logits = _pad_zero(nat.logits)
        return jax.random.categorical(rng_key, logits, axis=-1, shape=tuple(sample_shape) + logits.shape[:-1])

    def to_numpyro(self, nat: CategoricalNat) -> dist.CategoricalProbs:
        return dist.Categorical(probs=self.view(nat).probs)


@dataclasses.dataclass(frozen=True)
class Bernoulli(Family):
    """Independent Bernoulli(p) distributions on {0, 1}, event shape ``()``; values are integers.

    * T(x) = x; base measure 1 (counting).
    * λ = log(p / (1 − p))  (:class:`BernoulliNat`, ``(*B,)``).
    * A(λ) = log(1 + e^λ).
    * μ = p.
    * view: :class:`CategoricalView` with probs (1 − p, p), ``(*B, 2)``.
    * Fisher F(λ) = p (1 − p).

    BLR update, with g = ∂L/∂(1 − p, p) for L = Σ_i E_q[log f_i]:

        λ̃ = ∇_p L = g₁ − g₀,    λ ← (1 − ρ) λ + ρ λ̃.
    """

    name: ClassVar[str] = "bernoulli"
    discrete: ClassVar[bool] = True
    view_type: ClassVar[type] = CategoricalView
    support: ClassVar[str] = "discrete"
    native: ClassVar[bool] = True

    @classmethod
    def fits(cls, support_values: tuple | None) -> bool:
        """Two enumerated values, the first 0 (a 0/1 latent)."""
        return support_values is not None and len(support_values) == 2 and support_values[0] == 0

    def view(self, nat: BernoulliNat) -> CategoricalView:
        """(σ(−logit), σ(logit)) (on the host for a numpy ``nat``)."""
        if isinstance(nat.logit, np.ndarray):
            p1 = 0.5 * (1.0 + np.tanh(0.5 * nat.logit))  # σ(x), without overflow
            return CategoricalView(np.stack([1.0 - p1, p1], axis=-1))
        return CategoricalView(jnp.stack([jax.nn.sigmoid(-nat.logit), jax.nn.sigmoid(nat.logit)], axis=-1))

    def nat_from_view(self, view: CategoricalView) -> BernoulliNat:
        log = (np if isinstance(view.probs, np.ndarray) else jnp).log
        return BernoulliNat(log(view.probs[..., 1]) - log(view.probs[..., 0]))

    def mean_params(self, nat: BernoulliNat) -> BernoulliNat:
        return BernoulliNat(jax.nn.sigmoid(nat.logit))

    def nat_from_mean(self, mean_params: BernoulliNat) -> BernoulliNat:
        p = mean_params.logit
        return BernoulliNat(jnp.log(p) - jnp.log1p(-p))

    def log_partition(self, nat: BernoulliNat) -> jax.Array:
        return jax.nn.softplus(nat.logit)

    def sufficient_stats(self, x: jax.Array) -> BernoulliNat:
        return BernoulliNat(jnp.asarray(x).astype(_stats_dtype(x)))

    def log_prob(self, nat: BernoulliNat, x: jax.Array) -> jax.Array:
        x = jnp.asarray(x).astype(nat.logit.dtype)
        return x * nat.logit - jax.nn.softplus(nat.logit)

    def entropy(self, nat: BernoulliNat) -> jax.Array:
        p = jax.nn.sigmoid(nat.logit)
        return jax.nn.softplus(nat.logit) - p * nat.logit

    def message_from_view_grad(self, nat: BernoulliNat, view_grad: CategoricalView) -> BernoulliNat:
        g = view_grad.probs
        return BernoulliNat(g[..., 1] - g[..., 0])

    def is_valid(self, nat: BernoulliNat) -> jax.Array:
        return jnp.sum(jnp.where(jnp.isfinite(nat.logit), 0.0, 1.0)) == 0  # (see Categorical.is_valid)

    def sample(self, nat: BernoulliNat, rng_key: jax.Array, sample_shape: tuple[int, ...] = ()) -> jax.Array:
        """Integer draws in {0, 1} (not reparameterisable)."""
        shape = tuple(sample_shape) + jnp.shape(nat.logit)
        draws = jax.random.bernoulli(rng_key, jax.nn.sigmoid(nat.logit), shape=shape)
        return draws.astype(jnp.result_type(int))

    def to_numpyro(self, nat: BernoulliNat) -> dist.BernoulliProbs:
        return dist.Bernoulli(probs=jax.nn.sigmoid(nat.logit))
