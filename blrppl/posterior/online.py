"""Online (sequential) Bayes: a previous fit's posterior as the prior of a new fit.

``blr_fit(model, new_data, prior=previous_result)`` fits the new data with the previous
candidate posterior q_prev standing in for the model's prior (sequential Bayes,
p(x | old, new) ∝ p(new | x) p(x | old) ≈ p(new | x) q_prev(x)).

**Which blocks take q_prev.** A block of the new plan takes its previous posterior when

* it is *global*: none of its sites is in a plate that also holds an observed site (or a
  ``numpyro.factor``). A *local* latent, e.g. a per-datum mixture assignment or a per-datum
  random effect, belongs to the data it was fitted with: the new data have new local
  latents, which keep the model's prior;
* the previous plan has a block holding the same sites, with the same family, value
  shape and layout (and, for joint blocks, the same member sites in the same order).

A global block whose sites were fitted in the previous plan with another family, shape or
grouping raises :class:`blrppl.errors.OnlinePriorError` (fit both with the same
``families=``, ``structure=``, ``point=`` options). A block of the new plan whose sites the
previous plan does not have keeps the model's prior.

**What is replaced.** For a matched block b, the factors that are the prior of its sites
(each latent site's own distribution, and the ``"<b>:jacobian"`` pseudo-factor of a block
on an unconstrained space, since q_prev is a density on that space) are replaced by one
pseudo-factor ``"<b>:previous"`` with

    E_q[log q_prev(x)] = ⟨λ_prev, μ_q⟩ − A(λ_prev)     (+ log h = 0: every candidate
                                                        family has base measure h = 1),

whose message is the constant λ̃ = ∇_μ E_q[log q_prev] = λ_prev: exact, since q_prev is in
the block's family. Summed with the factors of the new data, the ELBO is
E_q[log p(new | x)] + E_q[log q_prev(x)] + H(q), a lower bound on log ∫ p(new | x) q_prev(x) dx
(equal to it when q is the exact posterior, e.g. for conjugate models).

**Assumed-density filtering.** q_prev is a product over blocks, so the prior of a matched
block no longer depends on the other latents: a hierarchical prior p(w | τ) becomes
q_prev(w) q_prev(τ), the dependence the previous posterior held only through its
mean-field factorisation being dropped. A global block with no counterpart loses the
information the removed priors of matched sites carried about it.

The plan's side of this (which blocks match, their pseudo-factors) is the compiler's online
pass (:mod:`blrppl.compiler.online`); this module reads the previous result. The previous
natural parameters are passed to the compiled fit as run-time data
(:class:`blrppl.graph.data.RunData`), so that successive updates with data of the same shapes reuse one
compiled fit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from blrppl import families as fam
from blrppl.errors import OnlinePriorError

#: suffix of the name of the pseudo-factor holding a block's previous posterior (for
#: display: the factor is recognised by its :attr:`~blrppl.graph.plan.Factor.role`)
PREVIOUS_SUFFIX = ":previous"


@dataclasses.dataclass(frozen=True)
class PreviousPosterior:
    """The "rule" of a ``"<block>:previous"`` pseudo-factor: E_q[log q_prev] in closed form."""

    block: str


def is_previous_posterior(factor) -> bool:
    """Whether a factor is the previous-posterior pseudo-factor of an online fit."""
    return isinstance(factor.rule, PreviousPosterior)


@dataclasses.dataclass(frozen=True)
class BlockSignature:
    """What must agree between a previous block and a new one (hashable: part of the key
    of the compiled-fit cache)."""

    name: str
    kind: str
    family: fam.Family
    value_shape: tuple
    plate_axes: tuple
    sites: tuple
    layouts: tuple  # per site: (name, value shape, bijection name or None, site shape)


def _layouts(block) -> tuple:
    return tuple(
        (m.name, tuple(m.value_shape), None if m.transform is None else type(m.transform).__name__,
         None if m.site_shape is None else tuple(m.site_shape))
        for m in (block.members or (block,))
    )


def signature(block) -> BlockSignature:
    return BlockSignature(
        block.name, block.kind, block.family, tuple(block.value_shape), tuple(block.plate_axes),
        block.sites, _layouts(block),
    )


def previous_spec(previous) -> tuple:
    """The static description of a previous fit that the new fit's plan depends on.

    Raises:
        OnlinePriorError: ``previous`` is not a :class:`blrppl.BLRResult`.
    """
    from blrppl.posterior.result import BLRResult

    if not isinstance(previous, BLRResult):
        raise OnlinePriorError(
            f"prior= takes the BLRResult of a previous blr_fit, not {type(previous).__name__}; "
            "to change the model's prior itself, edit the model"
        )
    return tuple(signature(b) for b in previous.plan.blocks)


def previous_nat(previous, matched, like: dict) -> dict:
    """λ_prev of the matched blocks, in the current float dtype, checked against the
    structure and shapes ``like`` (the new fit's natural parameters)."""
    dtype = jnp.result_type(float)
    out = {}
    for name in matched:
        site = previous.plan.block(name).sites[0]
        nat = previous.nat.get(name) if isinstance(previous.nat, dict) else None
        want = like[name]
        if nat is not None and previous.plan.block(name).family.tied_rows and jnp.ndim(want.eta2) > 2:
            # (rows that shared one covariance, now each with its own)
            nat = nat._replace(eta2=np.broadcast_to(np.asarray(nat.eta2), np.shape(want.eta2)))
        ok = nat is not None and jax.tree.structure(nat) == jax.tree.structure(want)
        ok = ok and all(np.shape(a) == np.shape(b) for a, b in zip(jax.tree.leaves(nat), jax.tree.leaves(want)))
        if not ok:
            raise OnlinePriorError(
                f"site '{site}': the previous result's natural parameters of block {name!r} do "
                "not have the structure its plan describes; pass the BLRResult blr_fit returned",
                site=site,
            )
        if not all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(nat)):
            raise OnlinePriorError(
                f"site '{site}': the previous posterior of block {name!r} has non-finite natural "
                "parameters; check that the previous fit converged (result.message)",
                site=site,
            )
        out[name] = jax.tree.map(lambda x: jnp.asarray(x, dtype), nat)
    return out


def _mean_params_of_view(family, view):
    """μ = E_q[T(x)] from a block's view, differentiable in the view and valid for point
    blocks (zero covariance)."""
    if isinstance(family, fam.GaussianDense):
        mean, cov = view
        return fam.GaussianNat(mean, cov + mean[..., :, None] * mean[..., None, :])
    if isinstance(family, fam.GaussianDiag):
        mean, var = view
        return fam.DiagGaussianNat(mean, var + mean**2)
    if isinstance(family, fam.Categorical):
        return fam.CategoricalNat(view.probs[..., :-1])
    if isinstance(family, fam.Bernoulli):
        return fam.BernoulliNat(view.probs[..., 1])
    # the μ leaves of a rule view (Gamma, Beta, Dirichlet, Wishart): the message is λ_prev exactly
    held = family.mean_params_in(view)
    if held is not None:
        return held
    return family.mean_params(family.nat_from_view(view))


def expected_log_previous(block, view, nat_prev):
    """E_q[log q_prev(x)] = Σ_elements ⟨λ_prev, μ_q⟩ − A(λ_prev) (base measure 1).

    Its message ∇_μ = λ_prev does not depend on q: one step with ρ = 1 sets the block to
    λ_prev + the messages of the new data (the conjugate update of sequential Bayes).
    """
    mean_params = _mean_params_of_view(block.family, view)
    inner = sum(jnp.sum(l * m) for l, m in zip(jax.tree.leaves(nat_prev), jax.tree.leaves(mean_params)))
    return inner - jnp.sum(block.family.log_partition(nat_prev))
