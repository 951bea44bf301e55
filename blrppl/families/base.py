"""The protocol every candidate family follows.

A family is an exponential family q(x) = exp(<λ, T(x)> − A(λ)) with base measure 1 (the
sufficient statistics are chosen so that the base measure is constant), held in a
*canonical layout*: leading batch dims (independent elements: plate elements, or the
elements of an elementwise family), then the family's event dims (``event_shape``).

A family object holds only static configuration (e.g. the dimension of a dense Gaussian);
it is a frozen dataclass, hashable, and never holds arrays. Its parameters are pytrees:

* ``nat``  — natural parameters λ (a NamedTuple of arrays, family specific);
* ``mean_params`` — expectation parameters μ = ∇A(λ) = E_q[T(x)], same structure as ``nat``;
* ``view`` — the parameters the expected log-density rules read (e.g. mean and covariance
  of a Gaussian, shape and rate of a Gamma), a NamedTuple.

The Bayesian learning rule update of a block is

    λ ← (1 − ρ) λ + ρ Σ_i λ̃_i,    λ̃_i = ∇_μ E_q[log f_i],

and :meth:`Family.message_from_view_grad` turns the gradient of Σ_i E_q[log f_i] with
respect to the ``view`` into Σ_i λ̃_i, by the family's cheapest exact route.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

Nat = Any
View = Any


@dataclasses.dataclass(frozen=True)
class Family:
    """Base class of candidate families. Subclasses are frozen dataclasses."""

    name: ClassVar[str] = "family"
    #: whether the family is over a finite discrete set (enumerated by the engine)
    discrete: ClassVar[bool] = False

    @property
    def event_shape(self) -> tuple[int, ...]:
        """Event shape of one batch element in the canonical layout."""
        return ()

    # -- parameter maps ---------------------------------------------------------------
    def view(self, nat: Nat) -> View:
        """Natural parameters → the human parameters the rules read."""
        raise NotImplementedError

    def rule_view(self, nat: Nat) -> View:
        """The parameters the expected-log-density rules read inside the fit: the
        :meth:`view` by default; a family may add redundant leaves (e.g. mean parameters) so
        that :meth:`message_from_view_grad` receives the gradient with respect to them."""
        return self.view(nat)

    def rule_view_and_entropy(self, nat: Nat) -> tuple:
        """(:meth:`rule_view`, :meth:`entropy`): what the ELBO reads of a block; a family whose
        two share a factorisation computes it once, and the entropy reuses the mean
        parameters a rule view holds (:meth:`mean_params_in`)."""
        view = self.rule_view(nat)
        mean_params = self.mean_params_in(view)
        return view, self.entropy(nat) if mean_params is None else self.entropy(nat, mean_params)

    def mean_params_in(self, view: View) -> Nat | None:
        """The mean parameters μ a :meth:`rule_view` holds as leaves, or None."""
        return None

    def nat_from_view(self, view: View) -> Nat:
        """Human parameters → natural parameters (inverse of :meth:`view`)."""
        raise NotImplementedError

    def mean_params(self, nat: Nat) -> Nat:
        """Expectation parameters μ = ∇A(λ) = E_q[T(x)]."""
        raise NotImplementedError

    def nat_from_mean(self, mean_params: Nat) -> Nat:
        """Inverse of :meth:`mean_params`."""
        raise NotImplementedError

    def log_partition(self, nat: Nat) -> jax.Array:
        """A(λ), one value per batch element."""
        raise NotImplementedError

    def sufficient_stats(self, x: jax.Array) -> Nat:
        """T(x), same structure as ``nat``, with the leading dims of ``x`` as batch dims."""
        raise NotImplementedError

    def log_prob(self, nat: Nat, x: jax.Array) -> jax.Array:
        """log q(x) = <λ, T(x)> − A(λ), one value per batch element."""
        stats = self.sufficient_stats(x)
        log_z = self.log_partition(nat)
        # Sum over each leaf's own event dims only: ``x`` may carry extra leading sample
        # dims, which must stay (and broadcast against the batch dims of ``nat``).
        inner = sum(
            _sum_event(s * l, jnp.ndim(l) - jnp.ndim(log_z))
            for s, l in zip(jax.tree.leaves(stats), jax.tree.leaves(nat))
        )
        return inner - log_z

    def entropy(self, nat: Nat, mean_params: Nat | None = None) -> jax.Array:
        """H(q) = A(λ) − <λ, μ>, one value per batch element (μ = ``mean_params`` when given)."""
        mean_params = self.mean_params(nat) if mean_params is None else mean_params
        log_z = self.log_partition(nat)
        inner = sum(
            _sum_event(m * l, m.ndim - log_z.ndim)
            for m, l in zip(jax.tree.leaves(mean_params), jax.tree.leaves(nat))
        )
        return log_z - inner

    # -- the learning rule ------------------------------------------------------------
    def message_from_view_grad(self, nat: Nat, view_grad: View) -> Nat:
        """Gradient of L = Σ_i E_q[log f_i] with respect to the view (or the
        :meth:`rule_view`) → ∇_μ L (a ``nat``)."""
        raise NotImplementedError

    def fixed_view(self, view: View) -> View | None:
        """A view like ``view`` at which a conjugate block's messages may be taken without
        knowing its q, or None. When L is linear in the expectation parameters μ (every
        factor conjugate to the block), λ̃ = ∇_μ L is the same at every q; a family whose
        view→μ map makes that gradient cheap at some fixed view returns it here, and
        :meth:`message_from_fixed_view_grad` turns the gradient there into λ̃."""
        return None

    def message_from_fixed_view_grad(self, view_grad: View) -> Nat:
        """λ̃ from the gradient of L at :meth:`fixed_view` (see there)."""
        raise NotImplementedError

    def update(self, nat: Nat, message: Nat, rho, retract: bool = False) -> Nat:
        """One learning-rule step λ ← (1 − ρ) λ + ρ λ̃ (families may retract, see Gaussian;
        ``retract`` asks for the retraction at every ρ, for blocks whose messages may not be
        valid natural parameters themselves)."""
        return jax.tree.map(lambda a, m: (1.0 - rho) * a + rho * m, nat, message)

    def is_valid(self, nat: Nat) -> jax.Array:
        """Scalar bool: every leaf finite and λ inside the natural-parameter domain."""
        raise NotImplementedError

    # -- linearising the model (moments of arguments, blrppl.expressions) ----------------
    def linearisation_point(self, view: View) -> jax.Array:
        """Where the model is linearised to read the moments of affine arguments (canonical
        layout, in the variable :meth:`from_linearisation` maps to the block's value)."""
        raise NotImplementedError

    def from_linearisation(self, x: jax.Array) -> jax.Array:
        """The block's value at the linearisation variable ``x`` (the identity unless the
        family linearises in a transformed variable)."""
        return x

    def tangent_sets(self, view: View, full: bool) -> dict:
        """Stacks of tangents (canonical layout, leading axis: the tangents) pushed through
        the linearised model: tag → stack. What each family's argument moments read back
        from them (:func:`blrppl.expressions.group_moments`)."""
        raise NotImplementedError

    # -- sampling and export ----------------------------------------------------------
    def sample(self, nat: Nat, rng_key: jax.Array, sample_shape: tuple[int, ...] = ()) -> jax.Array:
        """Draws of shape ``sample_shape + batch_shape + event_shape`` (reparameterised
        where the family allows it)."""
        raise NotImplementedError

    def to_numpyro(self, nat: Nat):
        """The numpyro distribution with the same density (batch dims = canonical batch)."""
        raise NotImplementedError

    def batch_shape(self, nat: Nat) -> tuple[int, ...]:
        """Batch shape of a ``nat`` pytree."""
        return jnp.shape(self.log_partition(nat))


def _sum_event(x: jax.Array, n: int) -> jax.Array:
    return x.sum(axis=tuple(range(-n, 0))) if n > 0 else x
