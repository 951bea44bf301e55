"""Rule tables for the closed-form expected log-densities in :mod:`blrppl.rules`.

Three tables, each row hand-written (no expected number is taken from the implementation):

1. point masses: with every argument constant, L is numpyro's ``log_prob``;
2. Monte Carlo: for random moment objects, L equals the average of numpyro's ``log_prob``
   over draws from the corresponding q (within 5 standard errors, fixed keys);
3. messages: λ̃ = ∇_μ L, taken by autodiff with respect to the expectation parameters μ
   of the block (or checked as ∇_λ L = F(λ) λ̃ with F the Fisher of the block's family),
   against the conjugate messages of Winn & Bishop (notes/blr-math.md §3).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
import pytest
from jax.scipy.special import digamma, gammaln
from scipy import special, stats

from blrppl.model.records import given_matrices
from blrppl.moments.kinds import (
    KINDS,
    AffineGaussian,
    BetaIdentity,
    BilinearGaussian,
    Const,
    DirichletIdentity,
    ExpGaussian,
    PowerGamma,
    WishartIdentity,
)
from blrppl.rules import find_rule, registered_rules

LOG_2PI = math.log(2.0 * math.pi)


def rule_of(dist_type, given=()):
    rule = find_rule(dist_type, given)
    assert rule is not None, f"no rule for {dist_type.__name__}"
    return rule


def registry_key(d):
    """The registry key of the rule a distribution object gets (its type, and the matrices
    it was built from that its pytree drops)."""
    given = tuple(given_matrices(d))
    return (type(d), given) if given else type(d)


def expected_log_prob(key, value, **args):
    # jitted: one compilation per call signature instead of one per eager primitive
    rule = rule_of(*key) if isinstance(key, tuple) else rule_of(key)
    return jax.jit(rule.expected_log_prob)(value, **args)


def spd(seed, k):
    """A random symmetric positive definite k × k matrix."""
    a = np.random.default_rng(seed).normal(size=(k, k))
    return a @ a.T / k + 0.3 * np.eye(k)


# ---------------------------------------------------------------------------------------
# 0. declarations
# ---------------------------------------------------------------------------------------

C, G, PG, B, D, W = "const", "affine_gaussian", "power_gamma", "beta", "dirichlet", "wishart"
EG = "exp_gaussian"
BG = "bilinear_gaussian"

#: (kinds per argument, event_ndim) as specified for every rule
DECLARED = {
    dist.Normal: ({"value": {C, G}, "loc": {C, G, BG}, "scale": {C, PG, EG}}, 0),
    dist.MultivariateNormal: ({"value": {C, G}, "loc": {C, G}, "scale_tril": {C}}, 1),
    dist.HalfNormal: ({"value": {C, PG, EG}, "scale": {C, PG, EG}}, 0),
    dist.Gamma: ({"value": {C, PG, EG}, "concentration": {C}, "rate": {C, PG}}, 0),
    dist.Exponential: ({"value": {C, PG, EG}, "rate": {C, PG, EG}}, 0),
    dist.Poisson: ({"value": {C}, "rate": {C, PG, EG}}, 0),
    dist.BernoulliProbs: ({"value": {C}, "probs": {C, B, D}}, 0),
    dist.BinomialProbs: ({"value": {C}, "total_count": {C}, "probs": {C, B, D}}, 0),
    dist.Beta: ({"value": {C, B}, "concentration1": {C}, "concentration0": {C}}, 0),
    dist.CategoricalProbs: ({"value": {C}, "probs": {C, D}}, 0),
    dist.MultinomialProbs: ({"value": {C}, "probs": {C, D}, "total_count": {C}}, 1),
    dist.Dirichlet: ({"value": {C, D}, "concentration": {C}}, 1),
    dist.GaussianRandomWalk: ({"value": {C, G}, "scale": {C, PG, EG}}, 1),
    dist.Wishart: ({"value": {C, W}, "concentration": {C}, "scale_tril": {C}}, 2),
    (dist.MultivariateNormal, ("precision_matrix",)): ({"value": {C, G}, "loc": {C, G}, "precision_matrix": {C, W}}, 1),
}


def test_registered_rules_are_the_declared_ones():
    registered = registered_rules()
    assert set(DECLARED) <= set(registered)
    for rule in registered.values():
        assert set(rule.kinds) == {"value", *rule.arg_names}
        assert all(set(k) <= set(KINDS) for k in rule.kinds.values())
    for key, (kinds, event_ndim) in DECLARED.items():
        rule = rule_of(*key) if isinstance(key, tuple) else rule_of(key)
        assert {k: set(v) for k, v in rule.kinds.items()} == kinds, str(key)
        assert set(rule.arg_names) == set(kinds) - {"value"}
        assert rule.event_ndim == event_ndim


def test_a_parameterisation_without_its_own_rule_gets_the_type_rule():
    assert rule_of(dist.MultivariateNormal, ("precision_matrix",)).given == ("precision_matrix",)
    assert rule_of(dist.MultivariateNormal) is rule_of(dist.MultivariateNormal, ("covariance_matrix",))
    assert rule_of(dist.Normal, ("precision_matrix",)) is rule_of(dist.Normal)


def test_supports():
    rule = rule_of(dist.Normal)
    assert rule.supports({"value": C, "loc": G, "scale": PG})
    assert not rule.supports({"value": C, "loc": G, "scale": G})
    assert not rule_of(dist.Poisson).supports({"value": PG, "rate": PG})
    assert rule_of(dist.Dirichlet).supports({"value": D, "concentration": C})


def test_subclasses_dispatch_to_parent_rule():
    assert rule_of(dist.Chi2) is rule_of(dist.Gamma)
    assert rule_of(dist.BetaProportion) is rule_of(dist.Beta)


# ---------------------------------------------------------------------------------------
# 1. point masses: L = log_prob
# ---------------------------------------------------------------------------------------

CONST_CASES = [
    ("normal", dist.Normal(jnp.array([0.3, -1.0, 2.0]), 0.7), jnp.array([[0.1, 0.2, 0.3], [-2.0, 4.0, 1.5]])),
    ("normal-batched-scale", dist.Normal(1.0, jnp.array([0.5, 2.0])), jnp.array([0.0, 3.0])),
    (
        "mvn",
        dist.MultivariateNormal(
            jnp.array([0.5, -1.0, 0.0]),
            covariance_matrix=jnp.array([[2.0, 0.3, 0.1], [0.3, 1.0, -0.2], [0.1, -0.2, 0.5]]),
        ),
        jnp.array([[0.1, 0.2, 0.3], [1.0, -1.0, 2.0]]),
    ),
    (
        "mvn-batched-tril",
        dist.MultivariateNormal(
            jnp.zeros(2),
            scale_tril=jnp.array([[[1.0, 0.0], [0.5, 2.0]], [[0.3, 0.0], [-0.1, 0.7]], [[1.5, 0.0], [0.0, 1.0]]]),
        ),
        jnp.array([[0.4, -0.3], [1.0, 0.2], [-2.0, 0.1]]),
    ),
    (
        "mvn-precision",
        dist.MultivariateNormal(jnp.array([0.5, -1.0, 0.0]), precision_matrix=jnp.asarray(spd(3, 3))),
        jnp.array([[0.1, 0.2, 0.3], [1.0, -1.0, 2.0]]),
    ),
    (
        "wishart",
        dist.Wishart(jnp.array([3.5, 6.0]), scale_matrix=jnp.stack([jnp.asarray(spd(4, 3)), jnp.eye(3)])),
        jnp.stack([jnp.asarray(spd(5, 3)), jnp.asarray(spd(6, 3))]),
    ),
    ("half-normal", dist.HalfNormal(jnp.array([0.5, 1.0, 3.0])), jnp.array([0.2, 1.7, 0.05])),
    ("gamma", dist.Gamma(jnp.array([0.5, 1.0, 4.0]), jnp.array([2.0, 0.3, 1.0])), jnp.array([0.7, 1e-3, 5.0])),
    ("gamma-a1", dist.Gamma(1.0, 2.0), jnp.array([1e-8, 1.0])),
    ("chi2", dist.Chi2(jnp.array([1.0, 3.0])), jnp.array([0.4, 2.5])),
    ("exponential", dist.Exponential(jnp.array([0.5, 3.0])), jnp.array([[0.1, 2.0], [1e-3, 0.4]])),
    ("poisson", dist.Poisson(jnp.array([0.5, 3.0, 10.0])), jnp.array([0, 2, 13])),
    ("poisson-zero-rate", dist.Poisson(jnp.array([0.0])), jnp.array([0])),
    ("bernoulli", dist.BernoulliProbs(jnp.array([0.2, 0.7, 0.0, 1.0])), jnp.array([1.0, 0.0, 0.0, 1.0])),
    ("binomial", dist.BinomialProbs(jnp.array([0.2, 0.6, 0.9]), jnp.array([5, 10, 3])), jnp.array([1, 7, 3])),
    ("beta", dist.Beta(jnp.array([0.5, 2.0, 3.0]), jnp.array([1.5, 2.0, 0.7])), jnp.array([0.1, 0.5, 0.95])),
    ("beta-proportion", dist.BetaProportion(jnp.array([0.3, 0.6]), 4.0), jnp.array([0.25, 0.5])),
    (
        "categorical",
        dist.CategoricalProbs(jnp.array([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.4, 0.1]])),
        jnp.array([[0, 3], [2, 1], [1, 1]]),
    ),
    (
        "multinomial",
        dist.MultinomialProbs(jnp.array([[0.1, 0.2, 0.7], [0.5, 0.5, 0.0]]), jnp.array([6, 4])),
        jnp.array([[[1, 2, 3], [2, 2, 0]], [[0, 0, 6], [4, 0, 0]]]),
    ),
    (
        "dirichlet",
        dist.Dirichlet(jnp.array([[0.5, 1.0, 2.0], [3.0, 1.0, 1.5]])),
        jnp.array([[0.2, 0.3, 0.5], [0.6, 0.1, 0.3]]),
    ),
    ("improper-uniform", dist.ImproperUniform(dist.constraints.real, (3,), ()), jnp.array([0.5, -2.0, 7.0])),
    ("uniform", dist.Uniform(jnp.array([-1.0, 0.0]), jnp.array([3.0, 0.5])), jnp.array([[0.5, 0.2], [-0.9, 0.49]])),
    (
        "gaussian-random-walk",
        dist.GaussianRandomWalk(jnp.array([0.5, 2.0]), num_steps=4),
        jnp.array([[0.3, -0.2, 0.4, 1.0], [1.5, 2.0, -1.0, 0.0]]),
    ),
]


def test_const_table_covers_every_rule():
    covered = {registry_key(d) for _, d, _ in CONST_CASES}
    assert set(registered_rules()) <= covered


@pytest.mark.parametrize("name, d, value", CONST_CASES, ids=[c[0] for c in CONST_CASES])
def test_point_masses_give_log_prob(name, d, value):
    given = given_matrices(d)
    rule = rule_of(type(d), tuple(given))
    args = {n: Const(jnp.asarray(given[n] if n in given else getattr(d, n))) for n in rule.arg_names}
    out, expected = jax.jit(lambda v, a: (rule.expected_log_prob(v, **a), d.log_prob(v.value)))(Const(value), args)
    if registry_key(d) in DECLARED:
        assert out.shape == expected.shape
    else:  # rules of constant factors may return a scalar that broadcasts
        assert jnp.broadcast_shapes(out.shape, expected.shape) == expected.shape
    np.testing.assert_allclose(jnp.broadcast_to(out, expected.shape), expected, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------
# 2. random moment objects vs Monte Carlo
# ---------------------------------------------------------------------------------------
# Draws and reference log densities use numpy / scipy (no JAX compilation, and a
# reference independent of both the rules and numpyro).


class Gaussians:
    """Independent dense Gaussian blocks w_b ~ N(m_b, S_b) and affine arguments of them."""

    def __init__(self, rng, sizes):
        self.blocks = []
        for k in sizes:
            a = rng.normal(size=(k, k))
            self.blocks.append((rng.normal(size=k), a @ a.T / k + 0.3 * np.eye(k)))

    def affine(self, maps, offset):
        """x = offset + Σ_b J_b w_b, maps[b] = J_b (*shape, K_b) or None."""
        mean = np.asarray(offset, dtype=float)
        left, right = [], []
        for jac, (m, s) in zip(maps, self.blocks):
            if jac is None:
                left.append(None)
                right.append(None)
                continue
            mean = mean + jac @ m
            left.append(np.moveaxis(jac, -1, 0))
            right.append(np.moveaxis(jac @ s, -1, 0))
        return AffineGaussian(mean, tuple(left), tuple(right))

    def sample(self, rng, n):
        return [rng.multivariate_normal(m, s, size=n) for m, s in self.blocks]

    @staticmethod
    def apply(maps, offset, draws):
        x = np.asarray(offset, dtype=float)
        for jac, w in zip(maps, draws):
            if jac is not None:
                x = x + np.einsum("...k,sk->s...", jac, w)
        return x


def power_gamma(coef, power, shape, rate):
    coef, power, shape, rate = np.broadcast_arrays(*(np.asarray(a, dtype=float) for a in (coef, power, shape, rate)))
    return PowerGamma(coef, power, shape, rate)


def sample_power_gamma(rng, pg, n):
    tau = rng.gamma(pg.shape_param, 1.0 / pg.rate, size=(n,) + np.shape(pg.shape_param))
    return pg.coef * tau**pg.power


def sample_dirichlet(rng, alpha, n):
    g = rng.gamma(alpha, size=(n,) + np.shape(alpha))
    return g / g.sum(-1, keepdims=True)


def mvn_logpdf(x, loc, tril):
    """Batched log N(x | loc, L Lᵀ) by a direct formula (numpy)."""
    d = x - loc
    tril = np.broadcast_to(tril, d.shape + d.shape[-1:])
    z = np.linalg.solve(tril, d[..., None])[..., 0]
    half_log_det = np.log(np.diagonal(tril, axis1=-2, axis2=-1)).sum(-1)
    return -0.5 * d.shape[-1] * LOG_2PI - half_log_det - 0.5 * (z**2).sum(-1)


def mc_normal(rng):
    gs = Gaussians(rng, (4, 2))
    jx = (rng.normal(size=(3, 4)), None)
    jl = (rng.normal(size=(3, 4)), np.array([[1.0, 0.0], [0.5, -1.0], [0.0, 2.0]]))
    cx, cl = np.array([0.5, -1.0, 0.0]), 0.3
    scale = power_gamma(1.0, -0.5, [3.0, 5.0, 8.0], [2.0, 1.0, 4.0])
    moments = {"value": gs.affine(jx, cx), "loc": gs.affine(jl, cl), "scale": scale}

    def log_prob(rng, n):
        w = gs.sample(rng, n)
        x, loc = gs.apply(jx, cx, w), gs.apply(jl, cl, w)
        return stats.norm.logpdf(x, loc, sample_power_gamma(rng, scale, n))

    return moments, log_prob


def mc_normal_scaled_gamma(rng):
    # σ = 2 / τ: E[σ⁻²] = E[τ²] / 4, E[log σ] = log 2 − E[log τ]; x const, loc const
    x = np.array([0.4, -1.0])
    scale = power_gamma(2.0, -1.0, [4.0, 6.0], [3.0, 2.0])
    moments = {"value": Const(x), "loc": Const(np.array(0.1)), "scale": scale}

    def log_prob(rng, n):
        return stats.norm.logpdf(x, 0.1, sample_power_gamma(rng, scale, n))

    return moments, log_prob


def mc_mvn_shared_loc(rng):
    # N = 4 observations (const) and one latent loc (3,): the difference object is wider
    # than its column stacks.
    gs = Gaussians(rng, (3,))
    y = rng.normal(size=(4, 3)) * 2.0
    tril = np.array([[1.0, 0.0, 0.0], [0.5, 0.8, 0.0], [-0.3, 0.2, 1.5]])
    jl = (np.eye(3),)
    moments = {"value": Const(y), "loc": gs.affine(jl, 0.0), "scale_tril": Const(tril)}

    def log_prob(rng, n):
        loc = gs.apply(jl, 0.0, gs.sample(rng, n))
        return mvn_logpdf(y, loc[:, None, :], tril)

    return moments, log_prob


def mc_mvn_shared_block(rng):
    # value = w[:3] (scaled by 1 and ½), loc = A w[3:] + c for one 6-dim block, batch of 2
    gs = Gaussians(rng, (6,))
    sel = np.concatenate([np.eye(3), np.zeros((3, 3))], axis=1)
    jx = (np.stack([sel, 0.5 * sel]),)
    jl = (np.concatenate([np.zeros((2, 3, 3)), rng.normal(size=(2, 3, 3))], axis=-1),)
    cl = rng.normal(size=(2, 3))
    tril = np.array(
        [[[1.0, 0.0, 0.0], [0.2, 0.7, 0.0], [0.1, -0.4, 1.2]], [[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.5]]]
    )
    moments = {"value": gs.affine(jx, 0.0), "loc": gs.affine(jl, cl), "scale_tril": Const(tril)}

    def log_prob(rng, n):
        w = gs.sample(rng, n)
        return mvn_logpdf(gs.apply(jx, 0.0, w), gs.apply(jl, cl, w), tril)

    return moments, log_prob


def mc_gaussian_random_walk(rng):
    # a walk of 4 steps = a linear map of one 5-dim Gaussian block, batch of 2 walks; the
    # scale a power of a Gamma block (σ = 2 τ^(−½))
    gs = Gaussians(rng, (5,))
    jx = (rng.normal(size=(2, 4, 5)),)
    cx = rng.normal(size=(2, 4))
    scale = power_gamma(2.0, -0.5, [4.0, 6.0], [3.0, 2.0])
    moments = {"value": gs.affine(jx, cx), "scale": scale}

    def log_prob(rng, n):
        x = gs.apply(jx, cx, gs.sample(rng, n))  # (n, 2, 4)
        sigma = sample_power_gamma(rng, scale, n)  # (n, 2)
        steps = np.concatenate([x[..., :1], np.diff(x, axis=-1)], axis=-1)
        return stats.norm.logpdf(steps, 0.0, sigma[..., None]).sum(-1)

    return moments, log_prob


def mc_half_normal(rng):
    value = power_gamma(1.0, 1.0, [2.0, 5.0], [3.0, 2.0])
    scale = power_gamma(1.0, -0.5, [4.0, 3.0], [1.0, 2.0])

    def log_prob(rng, n):
        return stats.halfnorm.logpdf(sample_power_gamma(rng, value, n), scale=sample_power_gamma(rng, scale, n))

    return {"value": value, "scale": scale}, log_prob


def mc_gamma(rng):
    value = power_gamma(1.0, 1.0, [2.0, 5.0, 1.5], [3.0, 2.0, 0.5])
    rate = power_gamma(2.0, 1.0, [4.0, 3.0, 6.0], [1.0, 2.0, 3.0])
    conc = np.array([0.7, 2.0, 3.5])
    moments = {"value": value, "concentration": Const(conc), "rate": rate}

    def log_prob(rng, n):
        x, b = sample_power_gamma(rng, value, n), sample_power_gamma(rng, rate, n)
        return stats.gamma.logpdf(x, conc, scale=1.0 / b)

    return moments, log_prob


def mc_exponential(rng):
    value = power_gamma(1.0, 1.0, [2.0, 5.0], [3.0, 2.0])
    rate = power_gamma(1.0, [1.0, 0.5], [4.0, 3.0], [1.0, 2.0])

    def log_prob(rng, n):
        x, r = sample_power_gamma(rng, value, n), sample_power_gamma(rng, rate, n)
        return stats.expon.logpdf(x, scale=1.0 / r)

    return {"value": value, "rate": rate}, log_prob


def mc_poisson(rng):
    y = np.array([0.0, 3.0, 7.0])
    rate = power_gamma([1.0, 2.5, 0.5], 1.0, [2.0, 3.0, 9.0], [1.0, 2.0, 0.7])

    def log_prob(rng, n):
        return stats.poisson.logpmf(y, sample_power_gamma(rng, rate, n))

    return {"value": Const(y), "rate": rate}, log_prob


def mc_bernoulli_beta(rng):
    y = np.array([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    probs = BetaIdentity(np.array([2.0, 0.7, 5.0]), np.array([3.0, 1.5, 1.0]))

    def log_prob(rng, n):
        p = rng.beta(probs.alpha, probs.beta, size=(n, 1, 3))
        return stats.bernoulli.logpmf(y, p)

    return {"value": Const(y), "probs": probs}, log_prob


def mc_bernoulli_dirichlet(rng):
    # p = π_k gathered from a Dirichlet(α) with K = 4, k = (0, 2, 3)
    alpha = np.array([1.5, 2.0, 0.8, 3.0])
    ks = np.array([0, 2, 3])
    y = np.array([1.0, 0.0, 1.0])
    probs = DirichletIdentity(alpha[ks], np.full(3, alpha.sum()))

    def log_prob(rng, n):
        return stats.bernoulli.logpmf(y, sample_dirichlet(rng, alpha, n)[:, ks])

    return {"value": Const(y), "probs": probs}, log_prob


def mc_binomial(rng):
    y, n_trials = np.array([2.0, 0.0, 9.0]), np.array([5.0, 4.0, 10.0])
    probs = BetaIdentity(np.array([2.0, 0.7, 5.0]), np.array([3.0, 1.5, 1.0]))
    moments = {"value": Const(y), "probs": probs, "total_count": Const(n_trials)}

    def log_prob(rng, n):
        return stats.binom.logpmf(y, n_trials, rng.beta(probs.alpha, probs.beta, size=(n, 3)))

    return moments, log_prob


def mc_beta(rng):
    value = BetaIdentity(np.array([2.0, 4.0, 1.5]), np.array([3.0, 1.5, 2.0]))
    c1, c0 = np.array([0.5, 2.0, 3.0]), np.array([1.5, 2.0, 0.7])
    moments = {"value": value, "concentration1": Const(c1), "concentration0": Const(c0)}

    def log_prob(rng, n):
        return stats.beta.logpdf(rng.beta(value.alpha, value.beta, size=(n, 3)), c1, c0)

    return moments, log_prob


def mc_categorical(rng):
    alpha = np.array([[1.0, 2.0, 0.5, 3.0], [4.0, 1.0, 1.0, 2.0]])
    z = np.array([[0, 3], [2, 1], [1, 1]])
    probs = DirichletIdentity(alpha, np.broadcast_to(alpha.sum(-1, keepdims=True), alpha.shape))

    def log_prob(rng, n):
        pi = sample_dirichlet(rng, alpha, n)  # (n, 2, 4)
        pi = np.broadcast_to(pi[:, None], (n, 3, 2, 4))
        return np.log(np.take_along_axis(pi, np.broadcast_to(z[None, :, :, None], (n, 3, 2, 1)), -1)[..., 0])

    return {"value": Const(z), "probs": probs}, log_prob


def mc_multinomial(rng):
    # rows of counts (3 rows, 2 groups) with their own totals, each group's π from a Dirichlet
    alpha = np.array([[1.0, 2.0, 0.5, 3.0], [4.0, 1.0, 1.0, 2.0]])
    y = np.array([[[1, 0, 2, 3], [0, 4, 1, 0]], [[5, 0, 0, 1], [2, 2, 2, 2]], [[0, 0, 0, 0], [1, 0, 0, 0]]], float)
    n_total = y.sum(-1)
    probs = DirichletIdentity(alpha, np.broadcast_to(alpha.sum(-1, keepdims=True), alpha.shape))

    def log_prob(rng, n):
        pi = sample_dirichlet(rng, alpha, n)[:, None]  # (n, 1, 2, 4)
        coef = special.gammaln(n_total + 1.0) - special.gammaln(y + 1.0).sum(-1)
        return coef + special.xlogy(y, pi).sum(-1)

    return {"value": Const(y), "probs": probs, "total_count": Const(n_total)}, log_prob


def mc_dirichlet(rng):
    alpha_q = np.array([[1.0, 2.0, 3.0], [4.0, 1.5, 2.0]])
    conc = np.array([[0.5, 1.0, 2.0], [3.0, 1.0, 1.5]])
    value = DirichletIdentity(alpha_q, np.broadcast_to(alpha_q.sum(-1, keepdims=True), alpha_q.shape))

    def log_prob(rng, n):
        x = sample_dirichlet(rng, alpha_q, n)
        norm = special.gammaln(conc.sum(-1)) - special.gammaln(conc).sum(-1)
        return norm + ((conc - 1.0) * np.log(x)).sum(-1)

    return {"value": value, "concentration": Const(conc)}, log_prob


def log_normal(gs, maps, offset):
    """x = exp(a) for a = offset + Σ_b J_b w_b affine in the Gaussian blocks."""
    return ExpGaussian(gs.affine(maps, offset))


def mc_normal_log_normal_scale(rng):
    # σ = exp(a) with a affine in a Gaussian block of its own (a scale fitted on log space),
    # x and loc affine in another block
    gs = Gaussians(rng, (3, 2))
    jx, jl = (rng.normal(size=(4, 3)), None), (0.5 * rng.normal(size=(4, 3)), None)
    js = (None, 0.3 * rng.normal(size=(4, 2)))
    cs = np.array([0.2, -0.5, 0.0, 0.4])
    moments = {"value": gs.affine(jx, 0.3), "loc": gs.affine(jl, -0.2), "scale": log_normal(gs, js, cs)}

    def log_prob(rng, n):
        w = gs.sample(rng, n)
        x, loc, sigma = gs.apply(jx, 0.3, w), gs.apply(jl, -0.2, w), np.exp(gs.apply(js, cs, w))
        return stats.norm.logpdf(x, loc, sigma)

    return moments, log_prob


def mc_poisson_log_link(rng):
    # rate = exp(X w + c): a Poisson regression's log link
    gs = Gaussians(rng, (3,))
    jr, cr = (0.4 * rng.normal(size=(5, 3)),), rng.normal(size=5)
    y = np.array([0.0, 1.0, 4.0, 2.0, 9.0])

    def log_prob(rng, n):
        return stats.poisson.logpmf(y, np.exp(gs.apply(jr, cr, gs.sample(rng, n))))

    return {"value": Const(y), "rate": log_normal(gs, jr, cr)}, log_prob


def mc_half_normal_log_space(rng):
    # the prior of a scale fitted on log space: value = exp(u), u ~ N
    gs = Gaussians(rng, (2,))
    jv = (0.5 * rng.normal(size=(2, 2)),)

    def log_prob(rng, n):
        return stats.halfnorm.logpdf(np.exp(gs.apply(jv, 0.0, gs.sample(rng, n))), scale=1.5)

    return {"value": log_normal(gs, jv, 0.0), "scale": Const(np.array(1.5))}, log_prob


def mc_exponential_log_space(rng):
    # an Exponential prior of a latent fitted on log space, and a log-normal rate
    gs = Gaussians(rng, (2, 2))
    jv, jr = (0.5 * rng.normal(size=(2, 2)), None), (None, 0.3 * rng.normal(size=(2, 2)))

    def log_prob(rng, n):
        w = gs.sample(rng, n)
        return stats.expon.logpdf(np.exp(gs.apply(jv, 0.1, w)), scale=np.exp(-gs.apply(jr, 0.7, w)))

    return {"value": log_normal(gs, jv, 0.1), "rate": log_normal(gs, jr, 0.7)}, log_prob


def mc_gamma_log_space(rng):
    gs = Gaussians(rng, (2,))
    jv = (0.5 * rng.normal(size=(2, 2)),)

    def log_prob(rng, n):
        return stats.gamma.logpdf(np.exp(gs.apply(jv, 0.1, gs.sample(rng, n))), 3.0, scale=1.0 / 1.5)

    moments = {"value": log_normal(gs, jv, 0.1), "concentration": Const(np.array(3.0)), "rate": Const(np.array(1.5))}
    return moments, log_prob


def mc_gaussian_random_walk_log_normal_scale(rng):
    gs = Gaussians(rng, (4, 1))
    jx, js = (rng.normal(size=(4, 4)), None), (None, 0.4 * np.ones((1,)))

    def log_prob(rng, n):
        w = gs.sample(rng, n)
        x, sigma = gs.apply(jx, 0.0, w), np.exp(gs.apply(js, -0.3, w))
        steps = np.concatenate([x[..., :1], np.diff(x, axis=-1)], axis=-1)
        return stats.norm.logpdf(steps, 0.0, sigma[..., None]).sum(-1)

    return {"value": gs.affine(jx, 0.0), "scale": log_normal(gs, js, -0.3)}, log_prob


def wishart_block(rng, batch, dim):
    """Wishart(ν, W) parameters of ``batch`` elements, their moment object and a sampler."""
    df = dim + 1.0 + rng.uniform(0.5, 5.0, size=batch)
    scale = np.stack([spd(int(rng.integers(1000)), dim) for _ in range(batch)])
    mean = df[:, None, None] * scale
    logdet = (
        special.digamma(0.5 * (df[:, None] - np.arange(dim))).sum(-1)
        + dim * math.log(2.0)
        + np.linalg.slogdet(scale)[1]
    )

    def draw(rng, n):
        # Bartlett: Λ = L A Aᵀ Lᵀ, A lower triangular with √χ²(ν − i) on its diagonal and
        # N(0, 1) below it (vectorised; scipy's sampler takes seconds for 10⁵ draws)
        chol = np.linalg.cholesky(scale)
        a = np.tril(rng.normal(size=(n, batch, dim, dim)), -1)
        diag = np.sqrt(rng.chisquare(df[:, None] - np.arange(dim), size=(n, batch, dim)))
        a[..., np.arange(dim), np.arange(dim)] = diag
        la = chol @ a
        return la @ np.swapaxes(la, -1, -2)

    return WishartIdentity(mean, logdet), draw


def mc_wishart(rng):
    value, draw = wishart_block(rng, 2, 3)
    df0, scale0 = np.array([4.0, 5.5]), np.stack([spd(7, 3), 2.0 * np.eye(3)])
    moments = {"value": value, "concentration": Const(df0), "scale_tril": Const(np.linalg.cholesky(scale0))}

    def log_prob(rng, n):
        # the Wishart density by its formula, vectorised (the point-mass table checks the rule's
        # formula against numpyro; here the draws check the expectations)
        lam = draw(rng, n)
        logdet = np.linalg.slogdet(lam)[1]
        trace = np.einsum("bij,nbji->nb", np.linalg.inv(scale0), lam)
        log_norm = 0.5 * df0 * 3 * math.log(2.0) + 0.5 * df0 * np.linalg.slogdet(scale0)[1] + special.multigammaln(0.5 * df0, 3)
        return 0.5 * (df0 - 4.0) * logdet - 0.5 * trace - log_norm

    return moments, log_prob


def mc_mvn_precision_wishart(rng):
    # x (N = 4, const) ~ N(loc, Λ⁻¹) with loc a Gaussian block and Λ a Wishart block read
    # at elements [0, 1, 1, 0] (a mixture's components gathered by its labels)
    gs = Gaussians(rng, (3,))
    y = rng.normal(size=(4, 3))
    wish, draw = wishart_block(rng, 2, 3)
    labels = np.array([0, 1, 1, 0])
    jl = (np.eye(3),)
    moments = {
        "value": Const(y),
        "loc": gs.affine(jl, 0.0),
        "precision_matrix": WishartIdentity(wish.mean_matrix[labels], wish.mean_logdet[labels]),
    }

    def log_prob(rng, n):
        loc = gs.apply(jl, 0.0, gs.sample(rng, n))[:, None, :]
        prec = draw(rng, n)[:, labels]
        return mvn_logpdf(y, loc, np.linalg.cholesky(np.linalg.inv(prec)))

    return moments, log_prob


MC_CASES = [
    (dist.Wishart, mc_wishart),
    ((dist.MultivariateNormal, ("precision_matrix",)), mc_mvn_precision_wishart),
    (dist.Normal, mc_normal),
    (dist.Normal, mc_normal_log_normal_scale),
    (dist.Poisson, mc_poisson_log_link),
    (dist.HalfNormal, mc_half_normal_log_space),
    (dist.Exponential, mc_exponential_log_space),
    (dist.Gamma, mc_gamma_log_space),
    (dist.GaussianRandomWalk, mc_gaussian_random_walk_log_normal_scale),
    (dist.Normal, mc_normal_scaled_gamma),
    (dist.MultivariateNormal, mc_mvn_shared_loc),
    (dist.MultivariateNormal, mc_mvn_shared_block),
    (dist.HalfNormal, mc_half_normal),
    (dist.Gamma, mc_gamma),
    (dist.Exponential, mc_exponential),
    (dist.Poisson, mc_poisson),
    (dist.BernoulliProbs, mc_bernoulli_beta),
    (dist.BernoulliProbs, mc_bernoulli_dirichlet),
    (dist.BinomialProbs, mc_binomial),
    (dist.Beta, mc_beta),
    (dist.CategoricalProbs, mc_categorical),
    (dist.MultinomialProbs, mc_multinomial),
    (dist.Dirichlet, mc_dirichlet),
    (dist.GaussianRandomWalk, mc_gaussian_random_walk),
]
NUM_DRAWS = 100_000


def test_mc_table_covers_every_rule():
    assert {dist_type for dist_type, _ in MC_CASES} == set(DECLARED)


@pytest.mark.parametrize("dist_type, case", MC_CASES, ids=[c.__name__ for _, c in MC_CASES])
def test_matches_monte_carlo(dist_type, case):
    rng = np.random.default_rng(20240917)
    moments, log_prob = case(rng)
    out = np.asarray(expected_log_prob(dist_type, **moments))
    lp = log_prob(rng, NUM_DRAWS)
    assert out.shape == lp.shape[1:]
    assert np.all(np.isfinite(out))
    mean, se = lp.mean(0), lp.std(0) / math.sqrt(NUM_DRAWS)
    np.testing.assert_array_less(np.abs(out - mean), 5.0 * se + 1e-9)


# ---------------------------------------------------------------------------------------
# 3. hand-worked values and conjugate messages
# ---------------------------------------------------------------------------------------


def scalar_gaussian(m, v):
    """A scalar argument equal to a scalar Gaussian block N(m, v)."""
    return AffineGaussian(m, (jnp.ones((1,)),), (v * jnp.ones((1,)),))


def gaussian_message(fn, m, v):
    """∇_μ of fn(m, v) at μ = (m, v + m²) (scalar block)."""

    def in_mu(mu):
        return fn(mu[0], mu[1] - mu[0] ** 2)

    return jax.jit(jax.grad(in_mu))(jnp.array([m, v + m**2]))


def dense_message(fn, m, cov):
    """∇_μ of fn(m, Σ) at μ = (m, Σ + m mᵀ) for a (batch of) dense Gaussian block(s).

    Returns (∇_{μ1}, sym ∇_{μ2}), each with the batch dims of m.
    """

    def in_mu(mu1, mu2):
        return jnp.sum(fn(mu1, mu2 - jnp.einsum("...i,...j->...ij", mu1, mu1)))

    mu2 = cov + jnp.einsum("...i,...j->...ij", m, m)
    g1, g2 = jax.jit(jax.grad(in_mu, argnums=(0, 1)))(m, mu2)
    return g1, 0.5 * (g2 + jnp.swapaxes(g2, -1, -2))


def gamma_log_partition(lam):
    return gammaln(lam[0] + 1.0) - (lam[0] + 1.0) * jnp.log(-lam[1])


def beta_log_partition(lam):
    return gammaln(lam[0] + 1.0) + gammaln(lam[1] + 1.0) - gammaln(lam[0] + lam[1] + 2.0)


def dirichlet_log_partition(lam):
    return jnp.sum(gammaln(lam + 1.0)) - gammaln(jnp.sum(lam + 1.0))


_FISHER = {}


def check_natural_message(fn, log_partition, lam, expected):
    """∇_λ L = F(λ) λ̃ with F = ∇²A (i.e. λ̃ = ∇_μ L), and λ̃ = expected."""
    grad = jax.jit(jax.grad(lambda l: jnp.sum(fn(l))))(lam)
    if log_partition not in _FISHER:
        _FISHER[log_partition] = jax.jit(jax.hessian(log_partition))
    fisher = _FISHER[log_partition](lam)
    np.testing.assert_allclose(grad, fisher @ jnp.asarray(expected, dtype=float), rtol=1e-9, atol=1e-10)


def gamma_block(lam, coef=1.0, power=1.0, shape=()):
    """x = c τ^a with τ ~ Gamma(λ1 + 1, −λ2), broadcast to ``shape``."""
    ones = jnp.ones(shape)
    return PowerGamma(coef * ones, power * ones, (lam[0] + 1.0) * ones, -lam[1] * ones)


# --- Normal ------------------------------------------------------------------------------


def test_normal_scalar_value_by_hand():
    # x = 1.3, loc ~ N(0.2, 0.5), σ = 0.7:  E[(x − loc)²] = 1.1² + 0.5 = 1.71
    out = expected_log_prob(dist.Normal, Const(1.3), loc=scalar_gaussian(0.2, 0.5), scale=Const(0.7))
    expected = -0.5 * LOG_2PI - math.log(0.7) - 0.5 * 1.71 / 0.49
    np.testing.assert_allclose(out, expected, rtol=1e-12)


def test_normal_bilinear_loc_by_hand():
    """loc = w·x with w ~ N(1, 0.5), x ~ N(2, 0.25) independent blocks: E[loc] = 2,
    E[loc²] = E[w²] E[x²] = 1.5 · 4.25 = 6.375; x = 1.3, σ = 0.7:
    E[(x − loc)²] = 1.3² − 2 · 1.3 · 2 + 6.375 = 2.865. The linearisation holds
    Var = 2² · 0.5 + 1² · 0.25 = 2.25 and the product of the deviations 0.5 · 0.25."""
    linear = AffineGaussian(2.0, (jnp.ones((1,)) * 2.0, jnp.ones((1,))), (jnp.ones((1,)) * 2.0 * 0.5, jnp.ones((1,)) * 0.25))
    loc = BilinearGaussian(linear, jnp.asarray(0.5 * 0.25))
    np.testing.assert_allclose(loc.var(), 2.375, rtol=1e-12)
    out = expected_log_prob(dist.Normal, Const(1.3), loc=loc, scale=Const(0.7))
    expected = -0.5 * LOG_2PI - math.log(0.7) - 0.5 * 2.865 / 0.49
    np.testing.assert_allclose(out, expected, rtol=1e-12)
    # and with an affine value sharing w's block: x = w, E[(w − w·x)²] = E[w²] E[(1 − x)²] = 1.5 · 1.25
    value = AffineGaussian(1.0, (jnp.ones((1,)), None), (0.5 * jnp.ones((1,)), None))
    out = expected_log_prob(dist.Normal, value, loc=loc, scale=Const(1.0))
    np.testing.assert_allclose(out, -0.5 * LOG_2PI - 0.5 * 1.5 * 1.25, rtol=1e-12)


@pytest.mark.parametrize("sigma", [0.7, 2.0])
def test_normal_message_to_loc(sigma):
    x = 1.3

    def fn(m, v):
        return expected_log_prob(dist.Normal, Const(x), loc=scalar_gaussian(m, v), scale=Const(sigma))

    msg = gaussian_message(fn, 0.2, 0.5)
    np.testing.assert_allclose(msg, [x / sigma**2, -0.5 / sigma**2], rtol=1e-10)


def test_normal_message_to_value_prior():
    # θ ~ N(m0, s0²) as the prior factor of a Gaussian θ: (m0/s0², −1/(2 s0²))
    m0, s0 = -0.4, 1.5

    def fn(m, v):
        return expected_log_prob(dist.Normal, scalar_gaussian(m, v), loc=Const(m0), scale=Const(s0))

    msg = gaussian_message(fn, 0.3, 0.2)
    np.testing.assert_allclose(msg, [m0 / s0**2, -0.5 / s0**2], rtol=1e-10)


def test_normal_message_to_loc_with_gamma_precision():
    # σ = τ^−½, τ ~ Gamma(3, 2): E[τ] = 1.5 → (1.5 x, −0.75)
    x = -0.8
    scale = PowerGamma(1.0, -0.5, 3.0, 2.0)

    def fn(m, v):
        return expected_log_prob(dist.Normal, Const(x), loc=scalar_gaussian(m, v), scale=scale)

    msg = gaussian_message(fn, 0.2, 0.5)
    np.testing.assert_allclose(msg, [1.5 * x, -0.75], rtol=1e-10)


def test_normal_message_to_precision():
    # → τ: (½, −½ E[(x − loc)²]) with E[(x − loc)²] = (1.3 − 0.2)² + 0.5 = 1.71
    x, loc = Const(1.3), scalar_gaussian(0.2, 0.5)
    lam = jnp.array([2.0 - 1.0, -3.0])  # τ ~ Gamma(2, 3)

    def fn(l):
        return expected_log_prob(dist.Normal, x, loc=loc, scale=gamma_block(l, power=-0.5))

    check_natural_message(fn, gamma_log_partition, lam, [0.5, -0.5 * 1.71])


def test_normal_message_to_precision_batched():
    # N observations sharing one τ: (N/2, −½ Σ_n (y_n − loc)²) (PRML 10.30 without prior)
    y = jnp.array([0.3, -1.2, 2.5, 0.9])
    loc = 0.5
    lam = jnp.array([3.0, -2.0])

    def fn(l):
        return expected_log_prob(dist.Normal, Const(y), loc=Const(loc), scale=gamma_block(l, power=-0.5, shape=(4,)))

    sq = (0.2**2 + 1.7**2 + 2.0**2 + 0.4**2)
    check_natural_message(fn, gamma_log_partition, lam, [2.0, -0.5 * sq])


# multi-element: a plate of N = 3 independent 2-dim dense blocks w_n ~ N(m_n, Σ_n),
# columns-first layout: left[j, n] = J e_j, right[j, n] = J Σ_n e_j.
M3 = jnp.array([[0.5, -0.2], [1.0, 2.0], [-1.5, 0.3]])
S3 = jnp.array([[[1.0, 0.3], [0.3, 0.5]], [[2.0, -0.8], [-0.8, 1.0]], [[0.4, 0.1], [0.1, 0.9]]])


def coordinate(m, cov, i):
    """w_n[i] for each n, as an affine argument of the batch of blocks (columns-first)."""
    k = m.shape[-1]
    left = jnp.broadcast_to(jnp.eye(k)[i][:, None], (k, m.shape[0]))
    right = jnp.moveaxis(cov[:, i, :], -1, 0)
    return AffineGaussian(m[:, i], (left,), (right,))


def test_normal_shared_block_by_hand():
    # x = w[0], loc = w[1]: E[(x − loc)²] = (m0 − m1)² + Σ00 + Σ11 − 2 Σ01
    sigma = jnp.array([0.5, 1.0, 2.0])
    out = expected_log_prob(dist.Normal, coordinate(M3, S3, 0), loc=coordinate(M3, S3, 1), scale=Const(sigma))
    e_sq = jnp.array([0.7**2 + 1.0 + 0.5 - 0.6, 1.0**2 + 2.0 + 1.0 + 1.6, 1.8**2 + 0.4 + 0.9 - 0.2])
    expected = -0.5 * LOG_2PI - jnp.log(sigma) - 0.5 * e_sq / sigma**2
    assert out.shape == (3,)
    np.testing.assert_allclose(out, expected, rtol=1e-12)
    # and with a constant offset and scaling on loc: loc = 2 w[1] − 1
    out2 = expected_log_prob(
        dist.Normal, coordinate(M3, S3, 0), loc=coordinate(M3, S3, 1) * 2.0 - 1.0, scale=Const(sigma)
    )
    m0, m1 = M3[:, 0], M3[:, 1]
    var = S3[:, 0, 0] + 4 * S3[:, 1, 1] - 4 * S3[:, 0, 1]
    expected2 = -0.5 * LOG_2PI - jnp.log(sigma) - 0.5 * ((m0 - 2 * m1 + 1.0) ** 2 + var) / sigma**2
    np.testing.assert_allclose(out2, expected2, rtol=1e-12)


def test_normal_shared_block_message():
    # x = w[0], loc = w[1] for each block: (0, −½σ⁻² [[1, −1], [−1, 1]])
    sigma = jnp.array([0.5, 1.0, 2.0])

    def fn(m, cov):
        return expected_log_prob(dist.Normal, coordinate(m, cov, 0), loc=coordinate(m, cov, 1), scale=Const(sigma))

    g1, g2 = dense_message(fn, M3, S3)
    np.testing.assert_allclose(g1, jnp.zeros((3, 2)), atol=1e-12)
    expected = -0.5 / sigma[:, None, None] ** 2 * jnp.array([[1.0, -1.0], [-1.0, 1.0]])
    np.testing.assert_allclose(g2, expected, rtol=1e-10, atol=1e-12)


def test_normal_regression_message():
    # y_n ~ N(x_nᵀ w, τ⁻¹): → w: (E[τ] Σ y_n x_n, −½ E[τ] Σ x_n x_nᵀ); τ ~ Gamma(4, 2)
    xs = jnp.array([[1.0, 0.5], [1.0, -1.0], [1.0, 2.0]])
    y = jnp.array([0.7, -0.3, 2.2])
    scale = PowerGamma(jnp.ones(3), -0.5 * jnp.ones(3), 4.0 * jnp.ones(3), 2.0 * jnp.ones(3))

    def fn(m, cov):
        loc = AffineGaussian(xs @ m, (xs.T,), ((xs @ cov).T,))
        return expected_log_prob(dist.Normal, Const(y), loc=loc, scale=scale)

    g1, g2 = dense_message(fn, jnp.array([0.1, 0.4]), jnp.array([[0.5, 0.1], [0.1, 0.3]]))
    np.testing.assert_allclose(g1, 2.0 * (y @ xs), rtol=1e-10)
    np.testing.assert_allclose(g2, -0.5 * 2.0 * xs.T @ xs, rtol=1e-10)


# --- MultivariateNormal ------------------------------------------------------------------

TRIL = jnp.array([[1.0, 0.0], [0.6, 0.8]])
PREC = np.linalg.inv(np.asarray(TRIL @ TRIL.T))


def dense_block_arg(m, cov):
    """w_n itself for a plate of dense blocks (N, K): left = identity columns, right = Σ columns."""
    n, k = m.shape
    left = jnp.broadcast_to(jnp.eye(k)[:, None, :], (k, n, k))
    right = jnp.moveaxis(cov, -1, 0)
    return AffineGaussian(m, (left,), (right,))


def test_mvn_batched_block_by_hand():
    x = jnp.array([[0.0, 1.0], [2.0, -1.0], [0.5, 0.5]])
    out = expected_log_prob(dist.MultivariateNormal, Const(x), loc=dense_block_arg(M3, S3), scale_tril=Const(TRIL))
    half_log_det = math.log(1.0) + math.log(0.8)
    d = np.asarray(x - M3)
    expected = [
        -LOG_2PI - half_log_det - 0.5 * (d[n] @ PREC @ d[n] + np.trace(PREC @ np.asarray(S3[n]))) for n in range(3)
    ]
    assert out.shape == (3,)
    np.testing.assert_allclose(out, expected, rtol=1e-12)


def test_mvn_message_to_loc_batched():
    # → w_n: (P x_n, −½ P) per block
    x = jnp.array([[0.0, 1.0], [2.0, -1.0], [0.5, 0.5]])

    def fn(m, cov):
        return expected_log_prob(dist.MultivariateNormal, Const(x), loc=dense_block_arg(m, cov), scale_tril=Const(TRIL))

    g1, g2 = dense_message(fn, M3, S3)
    np.testing.assert_allclose(g1, np.asarray(x) @ PREC, rtol=1e-10)
    np.testing.assert_allclose(g2, np.broadcast_to(-0.5 * PREC, (3, 2, 2)), rtol=1e-10)


def test_mvn_message_shared_loc():
    # N observations, one latent loc w (2,): (P Σ_n x_n, −½ N P)
    x = jnp.array([[0.0, 1.0], [2.0, -1.0], [0.5, 0.5], [1.0, 1.0]])

    def fn(m, cov):
        loc = AffineGaussian(m, (jnp.eye(2),), (cov.T,))
        return expected_log_prob(dist.MultivariateNormal, Const(x), loc=loc, scale_tril=Const(TRIL))

    g1, g2 = dense_message(fn, jnp.array([0.3, -0.2]), jnp.array([[0.7, 0.2], [0.2, 0.4]]))
    np.testing.assert_allclose(g1, PREC @ np.asarray(x.sum(0)), rtol=1e-10)
    np.testing.assert_allclose(g2, -0.5 * 4 * PREC, rtol=1e-10)


def test_mvn_shared_block_message():
    # x = w[:2], loc = w[2:] of one 4-dim block: (0, −½ [[P, −P], [−P, P]])
    sel_x = jnp.concatenate([jnp.eye(2), jnp.zeros((2, 2))], axis=1)
    sel_l = jnp.concatenate([jnp.zeros((2, 2)), jnp.eye(2)], axis=1)

    def arg(sel, m, cov):
        return AffineGaussian(sel @ m, (sel.T,), ((sel @ cov).T,))

    def fn(m, cov):
        return expected_log_prob(
            dist.MultivariateNormal, arg(sel_x, m, cov), loc=arg(sel_l, m, cov), scale_tril=Const(TRIL)
        )

    m = jnp.array([0.1, -0.3, 0.8, 0.2])
    cov = jnp.asarray(spd(3, 4))
    g1, g2 = dense_message(fn, m, cov)
    np.testing.assert_allclose(g1, jnp.zeros(4), atol=1e-12)
    expected = -0.5 * np.block([[PREC, -PREC], [-PREC, PREC]])
    np.testing.assert_allclose(g2, expected, rtol=1e-10, atol=1e-12)
    # value: E[(x − loc)ᵀ P (x − loc)] with Cov[x − loc] = Σxx + Σll − Σxl − Σlx
    out = fn(m, cov)
    c = np.asarray(cov)
    cd = c[:2, :2] + c[2:, 2:] - c[:2, 2:] - c[2:, :2]
    md = np.asarray(m[:2] - m[2:])
    expected_l = -LOG_2PI - math.log(0.8) - 0.5 * (md @ PREC @ md + np.trace(PREC @ cd))
    np.testing.assert_allclose(out, expected_l, rtol=1e-12)


# --- Gamma-block messages ----------------------------------------------------------------

LAM_GAMMA = jnp.array([1.5, -2.0])  # τ ~ Gamma(2.5, 2)


def test_half_normal_message_to_precision():
    x = 1.7

    def fn(l):
        return expected_log_prob(dist.HalfNormal, Const(x), scale=gamma_block(l, power=-0.5))

    check_natural_message(fn, gamma_log_partition, LAM_GAMMA, [0.5, -0.5 * x**2])


def test_gamma_prior_message():
    # τ ~ Gamma(a0, b0) as τ's own prior: (a0 − 1, −b0)
    def fn(l):
        return expected_log_prob(dist.Gamma, gamma_block(l), concentration=Const(3.0), rate=Const(0.5))

    check_natural_message(fn, gamma_log_partition, LAM_GAMMA, [2.0, -0.5])


def test_gamma_rate_message():
    # x ~ Gamma(a, rate = c τ): (a, −c x)
    def fn(l):
        return expected_log_prob(dist.Gamma, Const(0.8), concentration=Const(3.0), rate=gamma_block(l, coef=2.0))

    check_natural_message(fn, gamma_log_partition, LAM_GAMMA, [3.0, -1.6])


def test_exponential_messages():
    # y ~ Exponential(τ): (1, −y); τ ~ Exponential(r) as τ's prior: (0, −r)
    def fn_rate(l):
        return expected_log_prob(dist.Exponential, Const(0.6), rate=gamma_block(l))

    def fn_value(l):
        return expected_log_prob(dist.Exponential, gamma_block(l), rate=Const(1.5))

    check_natural_message(fn_rate, gamma_log_partition, LAM_GAMMA, [1.0, -0.6])
    check_natural_message(fn_value, gamma_log_partition, LAM_GAMMA, [0.0, -1.5])


def test_poisson_message():
    # y_n ~ Poisson(E_n τ) sharing τ: (Σ y_n, −Σ E_n)
    y = jnp.array([0.0, 3.0, 5.0])
    exposure = jnp.array([1.0, 2.0, 0.5])

    def fn(l):
        rate = PowerGamma(exposure, jnp.ones(3), (l[0] + 1.0) * jnp.ones(3), -l[1] * jnp.ones(3))
        return expected_log_prob(dist.Poisson, Const(y), rate=rate)

    check_natural_message(fn, gamma_log_partition, LAM_GAMMA, [8.0, -3.5])


def test_poisson_value_by_hand():
    # y = 2, rate ~ Gamma(3, 2): 2 (ψ(3) − log 2) − 1.5 − log 2
    out = expected_log_prob(dist.Poisson, Const(2.0), rate=PowerGamma(1.0, 1.0, 3.0, 2.0))
    psi3 = 1.5 - 0.5772156649015329
    np.testing.assert_allclose(out, 2 * (psi3 - math.log(2.0)) - 1.5 - math.log(2.0), rtol=1e-12)


# --- Beta-block messages -----------------------------------------------------------------

LAM_BETA = jnp.array([1.0, 2.5])  # p ~ Beta(2, 3.5)


def beta_block(lam, shape=()):
    ones = jnp.ones(shape)
    return BetaIdentity((lam[0] + 1.0) * ones, (lam[1] + 1.0) * ones)


@pytest.mark.parametrize("y", [0.0, 1.0])
def test_bernoulli_beta_message(y):
    def fn(l):
        return expected_log_prob(dist.BernoulliProbs, Const(y), probs=beta_block(l))

    check_natural_message(fn, beta_log_partition, LAM_BETA, [y, 1.0 - y])


def test_bernoulli_beta_message_batched():
    y = jnp.array([1.0, 0.0, 1.0, 1.0, 0.0])

    def fn(l):
        return expected_log_prob(dist.BernoulliProbs, Const(y), probs=beta_block(l, (5,)))

    check_natural_message(fn, beta_log_partition, LAM_BETA, [3.0, 2.0])


def test_binomial_beta_message():
    def fn(l):
        return expected_log_prob(dist.BinomialProbs, Const(3.0), probs=beta_block(l), total_count=Const(10.0))

    check_natural_message(fn, beta_log_partition, LAM_BETA, [3.0, 7.0])


def test_beta_prior_message():
    def fn(l):
        return expected_log_prob(dist.Beta, beta_block(l), concentration1=Const(2.5), concentration0=Const(0.5))

    check_natural_message(fn, beta_log_partition, LAM_BETA, [1.5, -0.5])


def test_bernoulli_value_by_hand():
    # y = 1, p ~ Beta(2, 1): E log p = ψ(2) − ψ(3) = −1/2
    out = expected_log_prob(dist.BernoulliProbs, Const(1.0), probs=BetaIdentity(2.0, 1.0))
    np.testing.assert_allclose(out, -0.5, rtol=1e-12)


# --- Dirichlet-block messages ------------------------------------------------------------

LAM_DIR = jnp.array([0.5, 1.0, -0.3, 2.0])  # α = (1.5, 2, 0.7, 3)


def dirichlet_block(lam, shape=()):
    alpha = lam + 1.0
    return DirichletIdentity(
        jnp.broadcast_to(alpha, shape + alpha.shape), jnp.broadcast_to(alpha.sum(), shape + alpha.shape)
    )


def test_categorical_dirichlet_message():
    def fn(l):
        return expected_log_prob(dist.CategoricalProbs, Const(jnp.array(2)), probs=dirichlet_block(l))

    check_natural_message(fn, dirichlet_log_partition, LAM_DIR, [0.0, 0.0, 1.0, 0.0])


def test_multinomial_dirichlet_message():
    # two rows of counts: the message is their sum, whatever the totals given
    y = jnp.array([[2.0, 0.0, 1.0, 4.0], [0.0, 3.0, 0.0, 1.0]])

    def fn(l):
        return expected_log_prob(
            dist.MultinomialProbs, Const(y), probs=dirichlet_block(l), total_count=Const(jnp.array([7.0, 4.0]))
        )

    check_natural_message(fn, dirichlet_log_partition, LAM_DIR, [2.0, 3.0, 1.0, 5.0])


def test_categorical_dirichlet_message_batched():
    z = jnp.array([0, 2, 2, 3, 0, 0])

    def fn(l):
        return expected_log_prob(dist.CategoricalProbs, Const(z), probs=dirichlet_block(l))

    check_natural_message(fn, dirichlet_log_partition, LAM_DIR, [3.0, 0.0, 2.0, 1.0])


def test_categorical_value_by_hand():
    # E[log π_k] = ψ(α_k) − ψ(α0), α = (1, 1, 2): ψ(2) − ψ(4) = −(1/2 + 1/3) for k = 2
    alpha = jnp.array([1.0, 1.0, 2.0])
    probs = DirichletIdentity(alpha, jnp.full(3, 4.0))
    out = expected_log_prob(dist.CategoricalProbs, Const(jnp.array([2, 0])), probs=probs)
    np.testing.assert_allclose(out, [-(1 / 2 + 1 / 3), -(1 + 1 / 2 + 1 / 3)], rtol=1e-12)


def test_dirichlet_prior_message():
    conc = jnp.array([2.0, 0.5, 1.0, 3.0])

    def fn(l):
        return expected_log_prob(dist.Dirichlet, dirichlet_block(l), concentration=Const(conc))

    check_natural_message(fn, dirichlet_log_partition, LAM_DIR, conc - 1.0)


def test_bernoulli_two_component_dirichlet_message():
    # p = π_0 of a 2-component Dirichlet: 1 − p = π_1, so the message is (y, 1 − y)
    lam = jnp.array([0.4, 1.2])

    def fn(l):
        alpha = l + 1.0
        return expected_log_prob(dist.BernoulliProbs, Const(1.0), probs=DirichletIdentity(alpha[0], alpha.sum()))

    check_natural_message(fn, dirichlet_log_partition, lam, [1.0, 0.0])


def test_gamma_value_by_hand():
    # x ~ q = Gamma(2, 4) (E log x = ψ(2) − log 4, E x = 1/2) under Gamma(3, rate 2)
    out = expected_log_prob(dist.Gamma, PowerGamma(1.0, 1.0, 2.0, 4.0), concentration=Const(3.0), rate=Const(2.0))
    e_log = (1.0 - 0.5772156649015329) - math.log(4.0)
    expected = 3 * math.log(2.0) - math.log(2.0) + 2 * e_log - 2.0 * 0.5
    np.testing.assert_allclose(out, expected, rtol=1e-12)
    assert jnp.allclose(digamma(2.0), 1.0 - 0.5772156649015329)
