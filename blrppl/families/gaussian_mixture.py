"""Mixtures of K Gaussians fitted by the Bayesian learning rule:
``families={"x": ("gaussian-mixture", K)}``.

The candidate is q(x) = Σ_k π_k N(x; m_k, S_k⁻¹) over a block's unconstrained values
(one mixture over the whole block: its components are Gaussians over all its scalars, with
diagonal precisions S_k = diag(s_k) or dense ones, below). Lin, Khan & Schmidt (2019, "Fast and simple natural-gradient variational inference
with mixture of exponential-family approximations") apply the learning rule to the joint
q(x, z = k) = π_k q_k(x), whose natural gradient splits by component; Khan & Rue (2023, "The
Bayesian Learning Rule", §on mixture candidates) give the same steps. With

    F(x) = log q(x) − log p(x, y)          (the negative ELBO's integrand, −ELBO = E_q[F])

and draws x = m_k + s_k^(−½) ⊙ ε of component k, one step at step size ρ is, per component,

    t_k = s_k + E_{q_k}[diag ∇²F(x)]                  (for K = 1: E_q[−diag ∇² log p])
    s_k ← s_k + ρ (t_k − s_k) + ½ ρ² (t_k − s_k)² / s_k          (positivity-preserving)
    m_k ← m_k − clip(ρ E_{q_k}[∇F(x)] / s_k, ±κ s_k^(−½))
    a_k ← a_k − ρ E_{q_k}[F(x)],   π = softmax(a), floored at π_min

Components are dense (S_k a ``(d, d)`` matrix, :func:`dense_components`) for a block that
is a vector of 2 to :data:`DENSE_MAX_DIM` scalars, diagonal otherwise. A dense precision
takes the matrix form of the same average, with G_k = E_{q_k}[∇²F(x)],

    S_k ← S_k + ρ G_k + ½ ρ² G_k S_k⁻¹ G_k                     (Lin, Schmidt & Khan 2020)

(positive definite whenever S_k is: it is (S_k + ρG_k) S_k⁻¹ (S_k + ρG_k) / 2 + S_k / 2), and
the mean step solves with it, each coordinate clipped at κ of its marginal sd.

The first two lines are the rule's precision step S_k ← S_k + ρ E_{q_k}[∇²F]
(∇_{Σ_k} E_q[F] = ½ π_k E_{q_k}[∇²F] by Price's theorem, and the joint's Fisher divides by
π_k), written as IVON's positivity-preserving average towards the target t_k
(:func:`blrppl.families.gaussian_ivon.positive_average`; Lin, Schmidt & Khan 2020): the
Hessian of log q is positive between the modes, where the plain step could make s_k
negative. The third is the mean step m_k ← m_k − ρ S_k⁻¹ E_{q_k}[∇F] (Bonnet's theorem) at
the new precision, clipped at κ of the component's sds (:data:`MAX_STEP`, a trust region
in q's own scale, as IVON's). The last is the natural-gradient step of the weights' natural
parameters η_k = log π_k − log π_K ← η_k − ρ (E_{q_k}[F] − E_{q_K}[F]), which the logits
a_k take up to a common shift. The gradient and the Hessian of log q of a diagonal mixture
are exact (with responsibilities r_j(x) = π_j q_j(x)/q(x) and g_j = −s_j ⊙ (x − m_j):
∇ log q = Σ_j r_j g_j and diag ∇² log q = Σ_j r_j (g_j² − s_j) − (Σ_j r_j g_j)²); those of
log p come from the model: its gradient by reverse mode, its Hessian (its diagonal, for
diagonal components) exactly (one Hessian-vector product per scalar) for dense components
and for diagonal ones of at most :data:`HESSIAN_MAX_DIM` scalars, else by the
reparameterisation estimate E_{q_k}[∇F(x) ⊙ (x − m_k)] s_k (Stein's lemma; IVON's, :func:`blrppl.families.gaussian_ivon.reparam_curvature`) of the whole of F.
Every expectation is an average over the same ``S`` draws ε (antithetic pairs ±ε) in every
component: common random numbers, so that the weights' steps compare components on the
same noise.

*Collapse guard.* A weight never falls below :data:`MIN_WEIGHT` (the logits are floored
after each step): a component the data do not need keeps a little mass and stays finite.
Two components that meet (every coordinate of their means within :data:`MERGE_SDS` of the
heavier's sds and their sds within 10 % of each other) hold one shape twice; the fit re-spreads the lighter one
(:func:`respread`) in the first half of its steps, at a draw of the heavier over-dispersed by
:data:`SPREAD`, with half their joint weight each: if there is another mode it may find it,
if there is none it comes back. At the end the components still at the floor are dropped
(:func:`drop_floored`); where the single Gaussian's component (the start's first) is the one
left, it is the single Gaussian's fit itself (the optimum of a one-component mixture,
:func:`first_component`), not a Monte Carlo step's noise away from it.

*Start* (:func:`spread_start`): component 0 at the single-component fit's q, the others in
antithetic pairs at over-dispersed points x₀ ± :data:`SPREAD` · w ⊙ z_k about the point x₀
the single fit started from (the model's start), z_k standard normal draws from the fit's
key and w the larger of the single Gaussian's sd and the sd at which ``blr_fit``'s
Gaussians start (1 on the unconstrained space): a single Gaussian fitted to a multimodal
posterior sits in one mode, with an sd that says nothing of where the others are, and the
pairs put components on both sides of the start. Each starts with the single Gaussian's
variances (dense components: its precision matrix, where the single fit held the block's
correlations), all with equal weights.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from numpyro.distributions.transforms import ReshapeTransform
from numpyro.distributions.util import cholesky_of_inverse
from jax.scipy.special import logsumexp

from blrppl.families.base import Family
from blrppl.families.gaussian import DiagGaussianView, GaussianView
from blrppl.families.gaussian_ivon import positive_average

#: the family name ``families=`` uses (an option handled above the compiler, as ``"grid"``)
NAME = "gaussian-mixture"
#: components when ``families={"x": "gaussian-mixture"}`` gives no number
DEFAULT_COMPONENTS = 4
#: the floor of every weight (the collapse guard, see the module)
MIN_WEIGHT = 1e-3
#: κ: the most one step moves a component's mean, in its own sds
MAX_STEP = 1.0
#: blocks of at most this many scalars take the exact diagonal of ∇² log p (one
#: Hessian-vector product per scalar per draw); larger ones Stein's estimate
HESSIAN_MAX_DIM = 16
#: vectors of 2 to this many scalars get dense components, with their exact Hessians (one
#: Hessian-vector product per scalar per draw): a dense single fit of up to this size is then
#: one of the mixtures (its start), so the mixture's ELBO is at least the single Gaussian's
#: (with diagonal components past 16 scalars, the breast cancer regression's 31 coefficients
#: had an ELBO 18 nats below the dense single Gaussian's; dense, 0.2 nats above it)
DENSE_MAX_DIM = 64
#: the over-dispersion of the start's and the re-spread components' means (in sds)
SPREAD = 2.0
#: components whose means are within this many sds in every coordinate are one (see the module)
MERGE_SDS = 0.1
#: the sd ``blr_fit``'s Gaussians start at on the unconstrained space (the start's floor)
START_SD = 1.0


def dense_components(shape: tuple) -> bool:
    """Whether a block of value shape ``shape`` gets dense components: a vector of 2 to
    :data:`DENSE_MAX_DIM` scalars, else diagonal ones."""
    return len(shape) == 1 and 2 <= shape[0] <= DENSE_MAX_DIM


def is_dense(nat) -> bool:
    """Whether ``nat`` holds dense components (precision matrices ``(K, d, d)`` beside means
    ``(K, d)``): read off the shapes, static under ``jit``."""
    return nat.mean.ndim == 2 and nat.prec.ndim == 3 and nat.prec.shape[1:] == (nat.mean.shape[1],) * 2


class MixtureNat(NamedTuple):
    """The parameters of a mixture of K Gaussians over values of shape ``shape``.

    Attributes:
        logits: a, shape ``(K,)``: π = softmax(a).
        mean: m_k, shape ``(K, *shape)``.
        prec: S_k, the precisions: diagonal ``(K, *shape)``, or dense ``(K, d, d)`` for a
            vector of d scalars (:func:`dense_components`).
    """

    logits: jax.Array
    mean: jax.Array
    prec: jax.Array


class MixtureView(NamedTuple):
    """The mixture's human parameters (the guide's): ``weights`` ``(K,)``, each
    component's ``mean`` ``(K, *shape)`` and ``cov``: its variances ``(K, *shape)``
    (diagonal components) or covariance matrices ``(K, d, d)`` (dense ones)."""

    weights: jax.Array
    mean: jax.Array
    cov: jax.Array


@dataclasses.dataclass(frozen=True)
class GaussianMixture(Family):
    """K diagonal Gaussians over a block's unconstrained values (see the module).

    Not a candidate family of the compiler (it is not an exponential family, and no
    estimator's message reaches it): the fit of :mod:`blrppl.engine.mixture` steps it with
    :func:`mixture_step` and the result's plan holds it for the export, the draws and the
    guide, which read only the methods below (the others are :class:`Family`'s, unimplemented).

    Attributes:
        num_components: K.
        shape: the block's value shape (one mixture over all of it).
    """

    name: ClassVar[str] = NAME
    view_type: ClassVar[type] = MixtureView
    mixture: ClassVar[bool] = True

    num_components: int
    shape: tuple

    @property
    def event_shape(self) -> tuple:
        """One mixture over the whole block: its value shape is the event."""
        return tuple(self.shape)

    def view(self, nat: MixtureNat) -> MixtureView:
        cov = jnp.linalg.inv(nat.prec) if is_dense(nat) else 1.0 / nat.prec
        return MixtureView(jax.nn.softmax(nat.logits), nat.mean, cov)

    def nat_from_view(self, view: MixtureView) -> MixtureNat:
        prec = jnp.linalg.inv(view.cov) if is_dense(_as_nat(view)) else 1.0 / view.cov
        return MixtureNat(jnp.log(view.weights), view.mean, prec)

    def marginal_variance(self, view: MixtureView) -> jax.Array:
        """Var[x] of the mixture, elementwise: Σ π_k (v_k + m_k²) − (Σ π_k m_k)², v_k the
        components' variances."""
        var = jnp.diagonal(view.cov, axis1=-2, axis2=-1) if is_dense(_as_nat(view)) else view.cov
        w = _expand(view.weights, view.mean)
        mean = jnp.sum(w * view.mean, 0)
        return jnp.sum(w * (var + view.mean**2), 0) - mean**2

    def to_numpyro(self, nat: MixtureNat) -> dist.Distribution:
        """:func:`mixture_distribution` (event shape ``self.shape``)."""
        return mixture_distribution(nat)

    def sample(self, nat: MixtureNat, rng_key, sample_shape: tuple = ()) -> jax.Array:
        return mixture_distribution(nat).sample(rng_key, tuple(sample_shape))

    def log_prob(self, nat: MixtureNat, x) -> jax.Array:
        return mixture_log_prob(nat, x)

    def is_valid(self, nat: MixtureNat) -> jax.Array:
        return mixture_is_valid(nat)


def _as_nat(view: MixtureView) -> MixtureNat:
    """A view's leaves as a ``MixtureNat`` (for :func:`is_dense`, which reads shapes only)."""
    return MixtureNat(view.weights, view.mean, view.cov)


def mixture_is_valid(nat: MixtureNat) -> jax.Array:
    """Scalar bool: every parameter finite and every precision positive (definite); a dense
    precision also within the dtype's precision of singular (the squared ratio of its Cholesky
    factor's largest and smallest diagonal, a lower bound of its condition number, below 1/eps:
    past it a Cholesky factor can come out finite for a matrix that is not positive definite,
    as a 32-dim precision of the horseshoe's local scales did, eigenvalues from −1e17 to 1e44)."""
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in nat]))
    if is_dense(nat):
        diag = jnp.diagonal(jnp.linalg.cholesky(nat.prec), axis1=-2, axis2=-1)
        eps = jnp.finfo(nat.prec.dtype).eps
        conditioned = jnp.all((jnp.max(diag, -1) / jnp.min(diag, -1)) ** 2 < 1.0 / eps)
        return finite & jnp.all(jnp.isfinite(diag)) & conditioned
    return finite & jnp.all(nat.prec > 0)


def mixture_distribution(nat: MixtureNat) -> dist.Distribution:
    """The mixture as a numpyro ``MixtureSameFamily`` of ``Normal(...).to_event`` (diagonal
    components) or ``MultivariateNormal`` (dense ones), of event shape the block's value shape."""
    if is_dense(nat):
        # (from the precision's Cholesky factor, as blrppl's dense Gaussian: a precision held
        # valid by its Cholesky factor can fail numpyro's eigenvalue check when ill-conditioned)
        comp = dist.MultivariateNormal(nat.mean, scale_tril=cholesky_of_inverse(nat.prec))
    else:
        comp = dist.Normal(nat.mean, jax.lax.rsqrt(nat.prec)).to_event(nat.mean.ndim - 1)
    return dist.MixtureSameFamily(dist.Categorical(logits=nat.logits), comp)


def marginal_distribution(nat: MixtureNat, positions, shape: tuple) -> dist.Distribution:
    """The mixture's marginal over the block scalars ``positions`` (flat, C order), as a
    ``MixtureSameFamily`` of event shape ``shape`` (a member site of a joint block)."""
    k = nat.mean.shape[0]
    idx = np.asarray(positions)
    cat = dist.Categorical(logits=nat.logits)
    mean = jnp.reshape(nat.mean, (k, -1))[:, idx]
    if not is_dense(nat):
        sd = jnp.reshape(jax.lax.rsqrt(nat.prec), (k, -1))[:, idx]
        comp = dist.Normal(jnp.reshape(mean, (k,) + tuple(shape)), jnp.reshape(sd, (k,) + tuple(shape)))
        return dist.MixtureSameFamily(cat, comp.to_event(len(shape)))
    cov = jnp.linalg.inv(nat.prec)[:, idx][:, :, idx]
    if len(shape) == 0:
        return dist.MixtureSameFamily(cat, dist.Normal(mean[:, 0], jnp.sqrt(cov[:, 0, 0])))
    out = dist.MixtureSameFamily(cat, dist.MultivariateNormal(mean, cov))
    if len(shape) == 1:
        return out
    return dist.TransformedDistribution(out, ReshapeTransform(tuple(shape), (idx.size,)))


def _expand(w, like):
    """Weights ``(K,)`` broadcast against ``(K, *shape)``."""
    return jnp.reshape(w, w.shape + (1,) * (jnp.ndim(like) - 1))


def _component_terms(nat: MixtureNat, x):
    """log π_j + log q_j(x) ``(K,)`` and g_j = ∇ log q_j(x) ``(K, *shape)`` at one ``x``."""
    diff = x[None] - nat.mean
    log_w = nat.logits - logsumexp(nat.logits)
    if is_dense(nat):
        s_diff = jnp.einsum("kij,kj->ki", nat.prec, diff)
        log_det = jnp.linalg.slogdet(nat.prec)[1]
        log_comp = 0.5 * (log_det - jnp.sum(diff * s_diff, -1) - diff.shape[-1] * jnp.log(2 * jnp.pi))
        return log_w + log_comp, -s_diff
    axes = tuple(range(1, diff.ndim))
    log_comp = 0.5 * jnp.sum(jnp.log(nat.prec) - nat.prec * diff**2 - jnp.log(2 * jnp.pi), axis=axes)
    return log_w + log_comp, -nat.prec * diff


def mixture_log_prob(nat: MixtureNat, x) -> jax.Array:
    """log q(x) at one value ``x`` of the block's shape."""
    terms, _ = _component_terms(nat, x)
    return logsumexp(terms)


def mixture_log_q_derivatives(nat: MixtureNat, x) -> tuple:
    """(log q(x), ∇ log q(x), ∇² log q(x)) at one ``x``, exactly (see the module): the
    Hessian's diagonal for diagonal components, the whole ``(d, d)`` for dense ones."""
    terms, g = _component_terms(nat, x)
    log_q = logsumexp(terms)
    r = jnp.exp(terms - log_q)
    grad = jnp.sum(_expand(r, g) * g, 0)
    if is_dense(nat):
        outer = jnp.einsum("ki,kj->kij", g, g) - nat.prec
        return log_q, grad, jnp.einsum("k,kij->ij", r, outer) - jnp.outer(grad, grad)
    hess = jnp.sum(_expand(r, g) * (g**2 - nat.prec), 0) - grad**2
    return log_q, grad, hess


def log_p_derivatives(log_p, x, exact_hessian: bool, full: bool = False) -> tuple:
    """(log p(x), ∇ log p(x), diag ∇² log p(x) (with ``full``: the ``(d, d)`` Hessian of
    the flattened x) or None) of ``log_p`` at one ``x``."""
    value, grad = jax.value_and_grad(log_p)(x)
    if not exact_hessian:
        return value, grad, None
    flat = x.reshape(-1)

    def grad_flat(v):
        return jax.grad(log_p)(v.reshape(x.shape)).reshape(-1)

    basis = jnp.eye(flat.size, dtype=flat.dtype)
    cols = jax.vmap(lambda e: jax.jvp(grad_flat, (flat,), (e,))[1])(basis)
    return value, grad, 0.5 * (cols + cols.T) if full else jnp.diagonal(cols).reshape(x.shape)


def mixture_messages(nat: MixtureNat, log_p, eps) -> tuple:
    """The expectations one step reads, per component, over the draws ``eps``.

    Args:
        nat: the mixture.
        log_p: x → log p(x, y) at one value of the block's shape (the other latents, if any,
            drawn inside it: a function of ``x`` only here).
        eps: standard normal draws ``(S, *shape)``, shared by every component.

    Returns:
        ``(E[F] (K,), E[∇F] (K, *shape), E[∇²F] (K, *shape) (its diagonal; dense
        components: (K, d, d)), E[log p] (K,))``.
    """
    dense = is_dense(nat)
    # x = m + R ε with R Rᵀ = S⁻¹: R = L⁻ᵀ for S = L Lᵀ (dense), s^(−½) (diagonal)
    sd = jnp.linalg.cholesky(nat.prec) if dense else jax.lax.rsqrt(nat.prec)
    exact = dense or int(np.prod(eps.shape[1:])) <= HESSIAN_MAX_DIM

    def at(m, s, e):
        x = m + (jax.scipy.linalg.solve_triangular(s, e, trans="T", lower=True) if dense else s * e)
        log_q, gq, hq = mixture_log_q_derivatives(nat, x)
        lp, gp, hp = log_p_derivatives(log_p, x, exact, full=dense)
        grad = gq - gp
        hess = hq - hp if exact else grad * (x - m) / s**2  # (Stein: E[∇F (x − m)] s = E[∇²F])
        return log_q - lp, grad, hess, lp

    per = jax.vmap(lambda m, s: jax.vmap(lambda e: at(m, s, e))(eps))(nat.mean, sd)
    return tuple(jnp.mean(v, axis=1) for v in per)


def mixture_update(nat: MixtureNat, f_mean, grad, hess, rho, max_step: float = MAX_STEP) -> MixtureNat:
    """One step at step size ``rho`` from the expectations of :func:`mixture_messages`
    (the module's equations), the weights floored at :data:`MIN_WEIGHT`."""
    if is_dense(nat):
        # S + ρG + ½ρ² G S⁻¹ G, G = E[∇²F] (the matrix form: Lin, Schmidt & Khan 2020)
        g_sinv_g = jnp.einsum("kij,kjl->kil", hess, jnp.linalg.solve(nat.prec, hess))
        prec = nat.prec + rho * hess + 0.5 * rho**2 * g_sinv_g
        prec = 0.5 * (prec + jnp.swapaxes(prec, -1, -2))
        step = rho * jnp.linalg.solve(prec, grad[..., None])[..., 0]
        bound = max_step * jnp.sqrt(jnp.diagonal(jnp.linalg.inv(prec), axis1=-2, axis2=-1))
    else:
        prec = positive_average(nat.prec, nat.prec + hess, rho)
        step = rho * grad / prec
        bound = max_step * jax.lax.rsqrt(prec)
    mean = nat.mean - jnp.clip(step, -bound, bound)
    logits = nat.logits - rho * f_mean
    logits = floor_weights(logits)
    dtype = jnp.result_type(nat.mean)
    return MixtureNat(logits.astype(dtype), mean.astype(dtype), prec.astype(dtype))


def floor_weights(logits):
    """Normalised logits (logsumexp 0) with every weight at least :data:`MIN_WEIGHT`: the
    weights below it are set to it and the others scaled down to keep the sum 1 (the
    others' ratios unchanged; with K · MIN_WEIGHT < 1 and the others above the floor)."""
    w = jax.nn.softmax(logits)
    low = w < MIN_WEIGHT
    rest = jnp.sum(jnp.where(low, 0.0, w))
    scale = (1.0 - MIN_WEIGHT * jnp.sum(low)) / rest
    return jnp.log(jnp.where(low, MIN_WEIGHT, w * scale))


def kept_components(nat: MixtureNat) -> np.ndarray:
    """Which components :func:`drop_floored` keeps (a boolean mask, on the host): those above
    the weights' floor, and the heaviest."""
    w = np.asarray(jax.nn.softmax(nat.logits), dtype=float)
    keep = w > 1.5 * MIN_WEIGHT
    keep[int(np.argmax(w))] = True
    return keep


def drop_floored(nat: MixtureNat) -> tuple:
    """``(nat, how many components were dropped)``: the fit's end without the components held
    at the weight floor (see the module), the other weights renormalised; the heaviest is
    always kept. On the host.

    The weights' steps have the fixed point π_k ∝ exp(E_{q_k}[log p − log q_k]) (components
    apart), so a component the floor holds is one whose expected log ratio is over
    log(1/:data:`MIN_WEIGHT`) below the others': dropping it lowers the optimal bound
    log Σ_k exp(E_{q_k}[log p − log q_k]) by at most K · MIN_WEIGHT nats, while keeping it at
    the floor costs MIN_WEIGHT times its whole shortfall, which for a component stranded on
    a ridge of the posterior (a start far out along a strongly correlated pair) is millions
    of nats."""
    w = np.asarray(jax.nn.softmax(nat.logits), dtype=float)
    keep = kept_components(nat)
    if keep.all():
        return nat, 0
    logits = np.log(w[keep] / w[keep].sum())
    dtype = nat.mean.dtype
    out = MixtureNat(jnp.asarray(logits, dtype), nat.mean[keep], nat.prec[keep])
    return out, int((~keep).sum())


def first_component(nat: MixtureNat) -> MixtureNat:
    """The mixture of ``nat``'s first component alone (weight 1): of a start
    (:func:`spread_start`), the single Gaussian's fit."""
    return MixtureNat(jnp.zeros((1,), nat.logits.dtype), nat.mean[:1], nat.prec[:1])


def mixture_step(nat: MixtureNat, log_p, key, rho, num_draws: int) -> tuple:
    """One step of the rule: ``(new nat, ELBO estimate Σ_k π_k E_{q_k}[−F])``.

    Args:
        nat: the mixture.
        log_p: x → log p(x, y) at one value (see :func:`mixture_messages`).
        key: the step's key.
        rho: the step size.
        num_draws: S, even: S/2 antithetic pairs.
    """
    half = jax.random.normal(key, (num_draws // 2,) + nat.mean.shape[1:], nat.mean.dtype)
    eps = jnp.concatenate([half, -half])
    f_mean, grad, hess, _ = mixture_messages(nat, log_p, eps)
    elbo = -jnp.sum(jax.nn.softmax(nat.logits) * f_mean)
    return mixture_update(nat, f_mean, grad, hess, rho), elbo


def spread_start(mean, var, start, num_components: int, key, dense: bool = False, cov=None) -> MixtureNat:
    """The start (see the module): component 0 at (``mean``, ``var``), the others in
    antithetic pairs ``start ± SPREAD · w ⊙ z`` about the single fit's own starting point
    ``start``, all with variances ``var`` (``dense``: as diagonal precision matrices of
    the flattened values, or the precision of ``cov``, the single fit's covariance matrix
    when it held one: the mixture then contains the single fit, its correlations kept) and
    equal weights."""
    dtype = jnp.result_type(mean)
    width = jnp.maximum(jnp.sqrt(var), START_SD)
    pairs = jax.random.normal(key, ((num_components) // 2,) + jnp.shape(mean), dtype)
    z = jnp.concatenate([pairs, -pairs])[: num_components - 1]
    means = jnp.concatenate([mean[None], start[None] + SPREAD * width[None] * z])
    prec = jnp.broadcast_to(1.0 / var, means.shape).astype(dtype)
    if dense:
        means = means.reshape(num_components, -1)
        d = means.shape[1]
        if cov is not None and jnp.shape(cov) == (d, d):
            full = jnp.linalg.inv(jnp.asarray(cov, dtype))
            prec = jnp.broadcast_to(0.5 * (full + full.T), (num_components, d, d))
        else:
            prec = jax.vmap(jnp.diag)(prec.reshape(num_components, -1))
    return MixtureNat(jnp.zeros((num_components,), dtype), means.astype(dtype), prec.astype(dtype))


def respread(nat: MixtureNat, key) -> tuple:
    """The collapse guard (see the module): ``(nat, how many components were re-spread)``,
    on the host (NumPy)."""
    logits, mean, prec = (np.array(a, dtype=float) for a in nat)
    k = logits.size
    sd = np.sqrt(np.diagonal(np.linalg.inv(prec), axis1=-2, axis2=-1)) if is_dense(nat) else 1.0 / np.sqrt(prec)
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())
    moved = 0
    for j in np.argsort(logits):  # lightest first
        for i in range(k):
            if i == j or logits[i] < logits[j]:
                continue
            close = np.all(np.abs(mean[j] - mean[i]) <= MERGE_SDS * sd[i])
            alike = np.all(np.abs(sd[j] / sd[i] - 1.0) <= 0.1)
            if close and alike:
                mean[j] = mean[i] + SPREAD * sd[i] * rng.standard_normal(mean[i].shape)
                both = np.logaddexp(logits[i], logits[j]) - np.log(2.0)
                logits[i] = logits[j] = both
                moved += 1
                break
    dtype = nat.mean.dtype
    return MixtureNat(*(jnp.asarray(a, dtype) for a in (logits, mean, prec))), moved


def as_component(view) -> MixtureNat | None:
    """A Gaussian's view as a mixture of one component (weight 1), or None where it is no
    plain Gaussian: a :class:`~blrppl.families.gaussian.DiagGaussianView` (diagonal
    precisions of its shape) or a :class:`~blrppl.families.gaussian.GaussianView` of one
    vector (a dense precision; with plate axes, several covariances: None)."""
    if isinstance(view, DiagGaussianView):
        mean = jnp.asarray(view.mean)
        return MixtureNat(jnp.zeros((1,), mean.dtype), mean[None], (1.0 / view.var)[None])
    if isinstance(view, GaussianView) and jnp.ndim(view.mean) == 1:
        prec = jnp.linalg.inv(view.cov)
        return MixtureNat(jnp.zeros((1,), view.mean.dtype), view.mean[None], (0.5 * (prec + prec.T))[None])
    return None


def component_view(nat: MixtureNat, view_type: type):
    """The inverse of :func:`as_component`: a one-component mixture as the Gaussian's view of
    type ``view_type``."""
    if view_type is DiagGaussianView:
        return DiagGaussianView(nat.mean[0], 1.0 / nat.prec[0])
    cov = jnp.linalg.inv(nat.prec[0])
    return GaussianView(nat.mean[0], 0.5 * (cov + cov.T))


def entropy_estimate(nat: MixtureNat, key, num_draws: int) -> jax.Array:
    """H(q) = −E_q[log q(x)] of a mixture (no closed form) by ``num_draws`` draws of q."""
    draws = mixture_distribution(nat).sample(key, (num_draws,))
    return -jnp.mean(jax.vmap(lambda x: mixture_log_prob(nat, x))(draws))


def component_entropy(nat: MixtureNat) -> jax.Array:
    """The entropy of a one-component mixture (a Gaussian): ½ (d (1 + log 2π) − log |S|)."""
    d = nat.mean[0].size
    log_det = jnp.linalg.slogdet(nat.prec[0])[1] if is_dense(nat) else jnp.sum(jnp.log(nat.prec[0]))
    return 0.5 * (d * (1.0 + jnp.log(2 * jnp.pi)) - log_det)
