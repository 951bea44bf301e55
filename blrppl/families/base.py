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
    #: whether the family is a Gaussian over real values: its view holds a ``mean`` and a
    #: ``cov`` (dense) or ``var`` (diagonal), and its point blocks take Newton steps
    gaussian: ClassVar[bool] = False
    #: whether the canonical layout moves the value's plate axes first (the batch dims) and
    #: flattens the other axes into one event axis (a dense Gaussian's); otherwise the
    #: canonical layout is the value layout
    dense_event: ClassVar[bool] = False
    #: whether the family is a Gaussian with a banded precision (its view holds the band of
    #: the covariance only: :class:`blrppl.families.GaussianBanded`)
    banded: ClassVar[bool] = False
    #: whether a quadratic expected log-density is taken apart at every step: the
    #: messages of a factor that reads only this block and has a closed form quadratic in
    #: it (a Gaussian random walk's prior, a Normal observation of an affine form) are the
    #: same at every q, and its expectation is log f(m) + Σ ⟨∂E/∂c, c⟩ over the view's
    #: covariance leaves c (linear in them), so the step reads neither through the
    #: tangent rows of the family (a chain's 2(2b + 1) colour rows; see
    #: :func:`blrppl.engine.step.constant_factors`)
    splits_quadratic: ClassVar[bool] = False
    #: whether the family is a Gaussian with an arrowhead precision (``GaussianArrowhead``)
    arrowhead: ClassVar[bool] = False
    #: whether the family's rows share one covariance (``GaussianTied``: its rule view holds
    #: the rows' means and one ``(D, D)`` covariance)
    tied_rows: ClassVar[bool] = False
    #: whether the family's value is an index into its block's enumerated values (the site's
    #: value is ``support_values[x]``), not the site's value itself
    indexes_support: ClassVar[bool] = False
    #: the NamedTuple type of :meth:`view` (its fields name the guide's parameters)
    view_type: ClassVar[type] = tuple
    #: the support of the latents the family represents: ``"real"``, ``"positive"``,
    #: ``"unit_interval"``, ``"simplex"``, ``"positive_definite"`` or ``"discrete"`` (a Gaussian also represents any
    #: other support on its unconstrained space)
    support: ClassVar[str] = "real"
    #: the kind of moments (:mod:`blrppl.moments`) of an argument that is the latent itself,
    #: or None (a Gaussian's arguments are affine forms of it: ``"affine_gaussian"``)
    argument_kind: ClassVar[str | None] = None
    #: whether any power c·x^a of the latent (not only x itself) has closed-form moments of
    #: :attr:`argument_kind` (a Gamma's E[x^k] and E[log x])
    any_power: ClassVar[bool] = False
    #: the power of its block's variable τ that the latent is (x = τ^p): an argument c·x^a
    #: is read as c·τ^(p·a) by the moments of :attr:`argument_kind` (an inverse-Gamma
    #: variance σ² = τ⁻¹ of a Gamma precision: −1, so that a Normal scale σ = τ^(−½) is
    #: conjugate); 1 for a family whose latent is its variable
    argument_power: ClassVar[float] = 1.0
    #: whether an argument that is the latent itself must read whole events in place, each
    #: possibly times a constant (a Wishart's E[log|Λ|] is not an expectation of Λ's entries:
    #: no sub-matrices; E[log|cΛ|] = D log c + E[log|Λ|])
    whole_events: ClassVar[bool] = False
    #: whether the family is the default for latents of its support (the first native family
    #: in :data:`blrppl.families.FAMILIES` that :meth:`fits` them)
    native: ClassVar[bool] = False
    #: (Gaussian families) whether Monte Carlo messages to the block estimate its curvature
    #: by the reparameterisation trick, ∇ log f(x) (x − m) / v at each draw, without the
    #: control variate (IVON's estimate, :mod:`blrppl.families.gaussian_ivon`)
    reparam_curvature: ClassVar[bool] = False
    #: whether the family is a mixture of Gaussians (:mod:`blrppl.families.gaussian_mixture`):
    #: never a block's family in a compiled fit, only in a mixture fit's result, whose draws,
    #: export and guide read it through :meth:`sample` and :meth:`to_numpyro`
    mixture: ClassVar[bool] = False
    #: the draws per step of a Monte Carlo factor group that reads the block (None: the
    #: estimator's default, :data:`blrppl.estimators.monte_carlo.NUM_SAMPLES`)
    mc_draws: ClassVar = None

    @classmethod
    def fits(cls, support_values: tuple | None) -> bool:
        """Whether the family can represent a latent of its support with these enumerated
        values (``None`` for a continuous latent)."""
        return True

    @classmethod
    def for_value(cls, value_shape: tuple, plate_axes: tuple = (), num_values: int | None = None) -> "Family":
        """The family's configuration for a block with values of shape ``value_shape``
        (``plate_axes``: the value's plate axes; ``num_values``: a discrete block's number of
        enumerated values)."""
        return cls()

    @property
    def event_shape(self) -> tuple[int, ...]:
        """Event shape of one batch element in the canonical layout."""
        return ()

    def canonical_batch_shape(self, value_shape: tuple, plate_axes: tuple) -> tuple:
        """Batch shape of the canonical layout of a value of shape ``value_shape``.

        Args:
            value_shape: shape of the block's value.
            plate_axes: the value's axes that are plate elements (read by families whose
                canonical layout flattens the other axes, see :attr:`dense_event`).

        Returns:
            The value's leading dims, without the family's event dims.
        """
        return tuple(value_shape[: len(value_shape) - len(self.event_shape)])

    def initial_nat(self, x: jax.Array) -> Nat:
        """Broad natural parameters centred on the initial value ``x`` (canonical layout); a
        numpy ``x`` gives numpy parameters, computed on the host (no XLA program)."""
        raise NotImplementedError

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

    def message_at(self, nat: Nat, view: View, view_grad: View) -> Nat:
        """:meth:`message_from_view_grad` when the block's view at ``nat`` is at hand (a family
        whose conversion needs the view, e.g. a Gaussian's mean, reads it instead of
        factorising its parameters once more)."""
        return self.message_from_view_grad(nat, view_grad)

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

    # -- linearising the model (moments of arguments, blrppl.moments.linearised) ----------------
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
        from them (:func:`blrppl.moments.linearised.group_moments`)."""
        raise NotImplementedError

    def tangent_roots(self, view: View, full: bool):
        """A stack of tangents s_k (canonical layout, leading axis k) with Σ = Σ_k s_k s_kᵀ
        over what one element of a non-mixing argument reads (a square root of the
        covariance), or None when the family has none: products of latents read
        E[(d_Aᵀ J d_B)²] = Σ_{k,l} f(s_k, s'_l)² through half the pushes of the left/right
        sets (:func:`blrppl.moments.linearised.group_moments`)."""
        return None

    # -- Gaussian families: covariances and Newton steps (engine, Monte Carlo) ----------
    def view_covariance(self, view: View) -> jax.Array:
        """The covariance a Gaussian view holds, in the family's curvature layout: per plate
        element ``(*B, D, D)`` (dense) or the variances (diagonal)."""
        raise NotImplementedError

    def marginal_variance(self, view: View) -> jax.Array:
        """Per-scalar variances of a Gaussian view (canonical layout, shape of the mean)."""
        raise NotImplementedError

    def covariance_column(self, view: View, index: int) -> jax.Array | None:
        """Cov[x, x_i] of a Gaussian view with no plate elements, ``x`` its mean flattened
        (C order) and ``i`` = ``index``: the direction in which x moves, given x_i, under q
        (E[x | x_i] = m + (x_i − m_i) Cov[x, x_i] / Var[x_i]). None where the view does not
        hold that column (:mod:`blrppl.posterior.narrow` then leaves the scalar out)."""
        return None

    def curvature_of_hessian(self, hessian: jax.Array, shape: tuple) -> jax.Array:
        """The family's curvature layout of the Hessian ``(n, n)`` of a function of the
        flattened mean (shape ``shape``): its per-plate-element blocks (dense) or its
        diagonal (diagonal), the couplings a Gaussian of the family cannot hold dropped."""
        raise NotImplementedError

    def precision_times(self, prec: jax.Array, x: jax.Array) -> jax.Array:
        """P x for a curvature ``prec`` in the family's layout and a mean-shaped ``x``."""
        raise NotImplementedError

    def solve_precision(self, prec: jax.Array, g: jax.Array) -> jax.Array:
        """P⁻¹ g for a curvature ``prec`` in the family's layout and a mean-shaped ``g``."""
        raise NotImplementedError

    def identity_precision(self, mean: jax.Array) -> jax.Array:
        """The identity curvature (family layout) for a mean of this shape."""
        raise NotImplementedError

    def positive_curvature(self, prec: jax.Array) -> jax.Array:
        """``prec`` made positive definite: unchanged where it is (per plate element), else
        with its eigenvalues replaced by their absolute values, floored at
        √ε · max(1, max|eig|)."""
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
