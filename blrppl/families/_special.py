"""Special functions and small solvers shared by the Gamma, Beta and Dirichlet families.

All functions are elementwise over leading dims, dtype preserving (float32 in, float32
out), and free of data-dependent Python control flow, so they jit and vmap.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.scipy.special import digamma

_EULER = 0.5772156649015329

#: fixed iteration counts of the mean → natural parameter inversions; both converge to
#: the conditioning limit of the problem well before (see tests/unit/families/test_families.py)
GAMMA_NEWTON_STEPS = 5
DIRICHLET_NEWTON_STEPS = 16


#: the largest table :func:`formed_once` materialises (larger ones are read element by
#: element, where fusing their computation into the reader costs nothing extra)
FORMED_ONCE_MAX = 1 << 12


def formed_once(fn, *args):
    """``fn(*args)``, computed once where it is formed when it is a small table
    (≤ :data:`FORMED_ONCE_MAX` elements), e.g. ψ(α) − ψ(α₀) of a Dirichlet's rows.

    XLA fuses an elementwise producer into each consumer; when the consumer gathers the
    table by many elements (a hidden Markov chain's K² enumerated transitions at every
    step of the chain, a mixture's components by every point) ψ is then evaluated per
    element (a fifth of a K = 5, T = 1,000 HMM's step). A conditional's result is a
    buffer that consumers read (an optimisation barrier does not survive XLA's CPU
    pipeline); its predicate, the arguments are finite, keeps XLA from removing it, and
    non-finite arguments (parameters no valid state has) give NaN (one copy of ``fn`` in
    the program: a second branch computing ``fn`` costs compile time)."""
    leaves = jax.tree.leaves(args)
    if not any(isinstance(a, jax.core.Tracer) for a in leaves):
        return fn(*args)  # (concrete values: nothing to fuse, and no program to compile)
    shapes = jax.eval_shape(fn, *args)
    if sum(x.size for x in jax.tree.leaves(shapes)) > FORMED_ONCE_MAX:
        return fn(*args)
    finite = jnp.stack([jnp.all(jnp.isfinite(a)) for a in leaves]).all()

    def not_finite(*_):
        return jax.tree.map(lambda s: jnp.full(s.shape, jnp.nan, s.dtype), shapes)

    return jax.lax.cond(finite, fn, not_finite, *args)


def inside_unit_interval(x: jax.Array) -> jax.Array:
    """``x`` clipped to [tiny, 1 − ε] of its dtype: a Beta's or Dirichlet's draw that rounded to
    0 or 1 (float32 draws of Beta(0.1, 0.9): 3 in 36,000 are 0) moved into the open support,
    where every log-density is finite (numpyro's Dirichlet sampler clips alike)."""
    info = jnp.finfo(jnp.result_type(x))
    return jnp.clip(x, info.tiny, 1.0 - info.eps)


#: ψ′ is shifted up by this many steps of its recurrence before its asymptotic series is read
_TRIGAMMA_SHIFT = 10


def trigamma(x: jax.Array) -> jax.Array:
    """ψ′(x) for x > 0 (NaN elsewhere), in a few dozen operations (``polygamma(1, x)`` is
    about ten times the program, in every fit that holds a Gamma block).

    The recurrence ψ′(x) = 1/x² + ψ′(x + 1), applied ``_TRIGAMMA_SHIFT`` times (a sum of
    positive terms, no cancellation), brings the argument to z ≥ 10, where the asymptotic
    series ψ′(z) = 1/z + 1/(2z²) + Σₖ B₂ₖ / z²ᵏ⁺¹ (k = 1…6) is below float64's precision.
    """
    x = jnp.asarray(x)
    z = x + _TRIGAMMA_SHIFT
    w = 1.0 / jnp.square(z)
    # B₂ = 1/6, B₄ = −1/30, B₆ = 1/42, B₈ = −1/30, B₁₀ = 5/66, B₁₂ = −691/2730
    out = (1.0 + 0.5 / z + w * (1 / 6 + w * (-1 / 30 + w * (1 / 42 + w * (-1 / 30 + w * (5 / 66 - w * 691 / 2730)))))) / z
    for k in reversed(range(_TRIGAMMA_SHIFT)):  # smallest terms first
        out = out + 1.0 / jnp.square(x + k)
    return jnp.where(x > 0, out, jnp.nan)


def x_trigamma_minus_one(a: jax.Array) -> jax.Array:
    """a ψ′(a) − 1 (> 0) without the cancellation of the direct formula at large a.

    Above a threshold (20 in float64, 10 in float32) the asymptotic series
    a ψ′(a) − 1 = 1/(2a) + 1/(6a²) − 1/(30a⁴) + 1/(42a⁶) − 1/(30a⁸) + 5/(66a¹⁰) + O(a⁻¹²)
    is truncated below the precision; below it, the direct formula loses under two digits.
    """
    threshold = 20.0 if jnp.result_type(a) == jnp.float64 else 10.0
    x = 1.0 / jnp.maximum(a, threshold)
    x2 = x * x
    series = x * (0.5 + x * (1 / 6 + x2 * (-1 / 30 + x2 * (1 / 42 + x2 * (-1 / 30 + x2 * (5 / 66))))))
    direct = a * trigamma(a) - 1.0
    return jnp.where(a >= threshold, series, direct)


def gamma_shape_from_mean(mean_log: jax.Array, mean: jax.Array) -> jax.Array:
    """Shape a of the Gamma with E[log x] = ``mean_log`` and E[x] = ``mean``.

    Solves ψ(a) − log a = s := E[log x] − log E[x] (< 0) by Minka's generalised Newton
    iteration in 1/a, 1/a ← 1/a − (s + log a − ψ(a)) / (a (a ψ′(a) − 1)), from Minka's
    closed-form initial guess (T. Minka, "Estimating a Gamma distribution", 2002).
    """
    s = mean_log - jnp.log(mean)
    t = jnp.maximum(-s, jnp.finfo(jnp.result_type(s)).tiny)
    a = (3.0 - t + jnp.sqrt((t - 3.0) ** 2 + 24.0 * t)) / (12.0 * t)

    def body(_, a):
        f = s + jnp.log(a) - digamma(a)
        return 1.0 / (1.0 / a - f / (a * x_trigamma_minus_one(a)))

    return jax.lax.fori_loop(0, GAMMA_NEWTON_STEPS, body, a)


# 1/ψ′(x) − x + ½ = Σ_n r_n x⁻ⁿ (n = 1..11) as x → ∞, by inverting the series
# ψ′(x) = 1/x + 1/(2x²) + Σ_k B₂ₖ / x²ᵏ⁺¹
_INV_TRIGAMMA_SERIES = (
    1 / 12,
    1 / 24,
    -1 / 720,
    -11 / 480,
    -113 / 12096,
    527 / 24192,
    79717 / 3628800,
    -34253 / 1036800,
    -28932091 / 479001600,
    8115997 / 106444800,
    574468115113 / 2615348736000,
)


def inv_trigamma_excess(x: jax.Array) -> jax.Array:
    """r(x) = 1/ψ′(x) − x + ½, accurate to a few ulps of 1 for every x > 0.

    1/ψ′(x) ≈ x − ½ for large x, so r is small there and is summed from its asymptotic
    series (x ≥ 20 in float64, x ≥ 10 in float32, truncation below the precision); below,
    the direct formula has absolute error of order x · ε.
    """
    threshold = 20.0 if jnp.result_type(x) == jnp.float64 else 10.0
    t = 1.0 / jnp.maximum(x, threshold)
    series = jnp.zeros_like(t)
    for coef in reversed(_INV_TRIGAMMA_SERIES):
        series = (series + coef) * t
    direct = 1.0 / trigamma(x) - x + 0.5
    return jnp.where(x >= threshold, series, direct)


def sherman_morrison_denominator(alpha: jax.Array) -> jax.Array:
    """s = 1/ψ′(α₀) − Σ_k 1/ψ′(α_k) > 0 over the last axis (kept), α₀ = Σ_k α_k.

    For α₀ ≥ 1 it is evaluated as (K − 1)/2 + r(α₀) − Σ_k r(α_k) with r from
    :func:`inv_trigamma_excess`, avoiding the cancellation of the direct form, whose
    terms grow like α₀; for α₀ < 1 the direct form is the accurate one (all terms ≤ α₀²).
    """
    k = alpha.shape[-1]
    alpha0 = alpha.sum(-1, keepdims=True)
    direct = 1.0 / trigamma(alpha0) - (1.0 / trigamma(alpha)).sum(-1, keepdims=True)
    stable = (k - 1) / 2 + inv_trigamma_excess(alpha0) - inv_trigamma_excess(alpha).sum(-1, keepdims=True)
    return jnp.where(alpha0 < 1.0, direct, stable)


def dirichlet_fisher_solve(alpha: jax.Array, g: jax.Array) -> jax.Array:
    """F⁻¹ g over the last axis, F = diag ψ′(α) − ψ′(α₀) 11ᵀ, by Sherman–Morrison in O(K).

    F⁻¹ g = D⁻¹g + (1ᵀD⁻¹g / s) D⁻¹1 with D = diag ψ′(α) and
    s = 1/ψ′(α₀) − Σ_k 1/ψ′(α_k) > 0 (F is positive definite), from
    :func:`sherman_morrison_denominator`, so the solve stays accurate for large α.
    """
    dg = g / trigamma(alpha)
    return dg + (dg.sum(-1, keepdims=True) / sherman_morrison_denominator(alpha)) / trigamma(alpha)


def _inv_digamma_guess(y: jax.Array) -> jax.Array:
    """Minka's initial guess for ψ⁻¹(y)."""
    return jnp.where(y >= -2.22, jnp.exp(jnp.minimum(y, 80.0)) + 0.5, -1.0 / (jnp.minimum(y, -2.22) + _EULER))


def dirichlet_concentration_from_mean(mean_log: jax.Array) -> jax.Array:
    """Concentration α (last axis) of the Dirichlet with E[log x_k] = ``mean_log[..., k]``.

    Solves ψ(α_k) − ψ(α₀) = μ_k (the gradient of the convex A(λ) − <λ, μ>) by Newton's
    method in log α with the exact Fisher solved by Sherman–Morrison, each log-step
    clipped to [−5, 5]. Initial guess: ψ(x) ≈ log(x − ½) gives α₀ ≈ (K − s)/(2(1 − s)) with
    s = Σ_k exp μ_k < 1, then α_k ≈ ψ⁻¹(ψ(α₀) + μ_k). A fixed number of steps
    (:data:`DIRICHLET_NEWTON_STEPS`).
    """
    k = mean_log.shape[-1]
    s = jnp.exp(mean_log).sum(-1, keepdims=True)
    s = jnp.minimum(s, 1.0 - jnp.finfo(jnp.result_type(s)).eps)
    alpha0 = (k - s) / (2.0 * (1.0 - s))
    alpha = _inv_digamma_guess(digamma(alpha0) + mean_log)

    def body(_, alpha):
        residual = digamma(alpha) - digamma(alpha.sum(-1, keepdims=True)) - mean_log
        step = dirichlet_fisher_solve(alpha, residual) / alpha
        return alpha * jnp.exp(-jnp.clip(step, -5.0, 5.0))

    return jax.lax.fori_loop(0, DIRICHLET_NEWTON_STEPS, body, alpha)
