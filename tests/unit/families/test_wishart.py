"""Wishart precision matrices: the family, and Gaussian models with Wishart precisions.

The family is checked against its exponential-family identities, scipy and Monte Carlo;
the models against closed forms (the conjugate update, one step) and against the textbook
coordinate-ascent VB of a Gaussian mixture with full precisions (Bishop 2006, §10.2, with
independent priors on the means and precisions as BayesPy writes the model), written here in
numpy. All in float64 unless the test says otherwise.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.infer import Predictive
from scipy import special, stats

from blrppl import blr_fit
from blrppl.api import plan_of
from blrppl.families import Wishart, WishartNat, WishartRuleView, WishartView

pytestmark = pytest.mark.filterwarnings("ignore:blr_fit. q may be a poor approximation")


def _spd(seed, dim, jitter=0.3):
    a = np.random.default_rng(seed).normal(size=(dim, dim))
    return a @ a.T / dim + jitter * np.eye(dim)


def _nat(df, scale):
    df, scale = np.asarray(df, float), np.asarray(scale, float)
    return WishartNat(jnp.asarray(-0.5 * np.linalg.inv(scale)), jnp.asarray(0.5 * (df - scale.shape[-1] - 1.0)))


def _expected_logdet(df, scale):
    dim = scale.shape[-1]
    return special.digamma(0.5 * (df - np.arange(dim))).sum() + dim * math.log(2.0) + np.linalg.slogdet(scale)[1]


# ------------------------------------------------------------------------------- the family

FAMILY = Wishart(3)
#: (ν, W) per batch element: near the lower limit ν > D − 1, moderate, and very large
PARAMS = [(2.3, _spd(0, 3)), (7.0, _spd(1, 3, 1.0)), (4e3, _spd(2, 3) / 4e3)]
NAT = WishartNat(*(jnp.stack(leaves) for leaves in zip(*(_nat(df, w) for df, w in PARAMS))))


def test_mean_params_log_partition_and_entropy_match_scipy():
    mean = FAMILY.mean_params(NAT)
    grad = jax.grad(lambda n: FAMILY.log_partition(n).sum())(NAT)
    entropy = FAMILY.entropy(NAT)
    x = np.stack([_spd(10 + b, 3) for b in range(3)])
    log_prob = FAMILY.log_prob(NAT, jnp.asarray(x))
    for b, (df, w) in enumerate(PARAMS):
        np.testing.assert_allclose(mean.eta_mat[b], df * w, rtol=1e-10)
        np.testing.assert_allclose(mean.eta_logdet[b], _expected_logdet(df, w), rtol=1e-10)
        np.testing.assert_allclose(grad.eta_mat[b], df * w, rtol=1e-8)  # ∇A = μ
        np.testing.assert_allclose(grad.eta_logdet[b], _expected_logdet(df, w), rtol=1e-8)
        np.testing.assert_allclose(entropy[b], stats.wishart(df, w).entropy(), rtol=1e-9)
        np.testing.assert_allclose(log_prob[b], stats.wishart(df, w).logpdf(x[b]), rtol=1e-9)


def test_nat_mean_round_trip_and_view():
    back = FAMILY.nat_from_mean(FAMILY.mean_params(NAT))
    np.testing.assert_allclose(back.eta_logdet, NAT.eta_logdet, rtol=1e-8)
    np.testing.assert_allclose(back.eta_mat, NAT.eta_mat, rtol=1e-8)
    view = FAMILY.view(NAT)
    for b, (df, w) in enumerate(PARAMS):
        np.testing.assert_allclose(view.df[b], df, rtol=1e-12)
        np.testing.assert_allclose(view.scale_matrix[b], w, rtol=1e-9)
    again = FAMILY.nat_from_view(view)
    np.testing.assert_allclose(again.eta_mat, NAT.eta_mat, rtol=1e-9)


def test_mean_params_match_monte_carlo():
    # (at ν = 2.3 the Bartlett draws' chi-square with 0.3 degrees of freedom underflows to 0
    # in some draws: log|Λ| = −inf; the Monte Carlo check uses ν = 3.5 there)
    nat = NAT._replace(eta_logdet=NAT.eta_logdet.at[0].set(0.5 * (3.5 - 4.0)))
    n = 20_000
    draws = np.asarray(jax.jit(lambda v: FAMILY.sample(v, random.PRNGKey(0), (n,)))(nat))
    mean = jax.jit(FAMILY.mean_params)(nat)
    for stat, ref in ((draws, mean.eta_mat), (np.linalg.slogdet(draws)[1], mean.eta_logdet)):
        se = stat.std(0) / math.sqrt(n)
        np.testing.assert_array_less(np.abs(stat.mean(0) - np.asarray(ref)), 5.0 * se + 1e-12)


def test_conjugate_message_is_its_coefficients_through_either_view():
    """L = tr(A E[Λ]) + c E[log|Λ|] sends (sym A, c): from the rule view's μ leaves directly,
    and from the plain view (ν, W) through the inverse map μ → (ν, W)."""
    a = np.random.default_rng(3).normal(size=(3, 3, 3))
    c = np.array([0.7, -0.2, 2.0])

    def loss_of_mean(mean, logdet):
        return jnp.sum(jnp.asarray(a) * mean) + jnp.sum(jnp.asarray(c) * logdet)

    def loss_of_view(view):
        df, w = view
        return loss_of_mean(df[:, None, None] * w, jax.vmap(_jax_logdet_mean)(df, w))

    want = WishartNat(0.5 * (a + np.swapaxes(a, -1, -2)), c)

    @jax.jit
    def messages(nat):
        rule_grad = jax.grad(lambda v: loss_of_mean(*v))(FAMILY.rule_view(nat))
        via_view = FAMILY.message_from_view_grad(nat, jax.grad(loss_of_view)(FAMILY.view(nat)))
        return FAMILY.message_from_view_grad(nat, WishartRuleView(*rule_grad)), via_view

    for got in messages(NAT):
        # (ν = 4000: the pull-back through (ν, W) loses about 8 digits to cancellation)
        np.testing.assert_allclose(got.eta_mat, want.eta_mat, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(got.eta_logdet, want.eta_logdet, rtol=1e-6, atol=1e-9)


def test_view_inverts_without_pivoting():
    """W = (−2 η_mat)⁻¹ through the Cholesky factor: no pivoted LU, whose permutation is a
    loop of scatters per matrix in the compiled step."""
    assert "while" not in jax.jit(FAMILY.view).lower(NAT).as_text()
    assert "while" in jax.jit(lambda n: jnp.linalg.inv(n.eta_mat)).lower(NAT).as_text()  # (the test can fail)


def _jax_logdet_mean(df, w):
    return FAMILY.mean_params(FAMILY.nat_from_view(WishartView(df, w))).eta_logdet


def test_validity_and_float32():
    valid = jax.jit(FAMILY.is_valid)
    assert bool(valid(NAT))
    assert not bool(valid(NAT._replace(eta_logdet=NAT.eta_logdet.at[0].set(-1.0))))  # ν = D − 1
    assert not bool(valid(NAT._replace(eta_mat=-NAT.eta_mat)))  # W not positive definite
    nat32 = jax.tree.map(lambda x: x.astype(jnp.float32), NAT)
    back, draws = jax.jit(
        lambda n: (FAMILY.nat_from_mean(FAMILY.mean_params(n)), FAMILY.sample(n, random.PRNGKey(1), (4,)))
    )(nat32)
    assert back.eta_mat.dtype == jnp.float32
    np.testing.assert_allclose(back.eta_logdet, NAT.eta_logdet, rtol=2e-3)
    assert draws.shape == (4, 3, 3, 3) and draws.dtype == jnp.float32


# ------------------------------------------------------------- known mean: one exact step


def known_mean(X, seen):
    Lam = numpyro.sample("Lam", dist.Wishart(4.0, scale_matrix=jnp.array([[1.0, 0.3], [0.3, 2.0]])))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("x", dist.MultivariateNormal(jnp.array([0.5, -1.0]), precision_matrix=Lam).mask(seen), obs=X)


def test_precision_of_a_gaussian_is_exact_in_one_step():
    rng = np.random.default_rng(0)
    x = rng.multivariate_normal([0.5, -1.0], [[1.0, 0.6], [0.6, 2.0]], size=50)
    seen = rng.random(50) < 0.8
    fit = blr_fit(known_mean, (x, seen), num_steps=5, progress_bar=False)
    assert fit.num_steps == 1 and fit.converged, fit.message
    assert "precision_matrix:wishart" in fit.plan.describe()
    d = x[seen] - np.array([0.5, -1.0])
    w0 = np.array([[1.0, 0.3], [0.3, 2.0]])
    q = fit.posterior["Lam"]
    np.testing.assert_allclose(q.concentration, 4.0 + seen.sum(), rtol=1e-12)
    np.testing.assert_allclose(q.scale_matrix, np.linalg.inv(np.linalg.inv(w0) + d.T @ d), rtol=1e-10)
    # the ELBO at the exact posterior is the log evidence: (2π)^(−ND/2) Z_N / Z₀ with
    # Z = 2^(νD/2) |W|^(ν/2) Γ_D(ν/2) (entropy, log partition and both rules together)
    def log_z(df, w):
        return 0.5 * df * 2 * math.log(2.0) + 0.5 * df * np.linalg.slogdet(w)[1] + special.multigammaln(0.5 * df, 2)

    df_n, w_n = 4.0 + seen.sum(), np.linalg.inv(np.linalg.inv(w0) + d.T @ d)
    evidence = -seen.sum() * math.log(2 * math.pi) + log_z(df_n, w_n) - log_z(4.0, w0)
    np.testing.assert_allclose(fit.elbo[-1], evidence, rtol=1e-10)
    # sequential Bayes: the second half's fit with the first half's posterior as its prior
    # is the batch posterior
    half = 25
    first = blr_fit(known_mean, (x[:half], seen[:half]), progress_bar=False)
    second = blr_fit(known_mean, (x[half:], seen[half:]), prior=first, progress_bar=False)
    np.testing.assert_allclose(second.posterior["Lam"].concentration, df_n, rtol=1e-12)
    np.testing.assert_allclose(second.posterior["Lam"].scale_matrix, w_n, rtol=1e-10)
    pred = Predictive(known_mean, guide=fit.guide, params=fit.params, num_samples=7)(random.PRNGKey(1), x, seen)
    assert pred["x"].shape == (7, 50, 2) and np.all(np.isfinite(pred["x"]))
    draws = Predictive(fit.guide, params=fit.params, num_samples=7)(random.PRNGKey(2), x, seen)
    assert draws["Lam"].shape == (7, 2, 2)
    assert np.all(np.linalg.eigvalsh(draws["Lam"]) > 0)


# ---------------------------------------------- Gaussian mixture with Wishart precisions

K, D, N = 3, 2, 60
NU0, W0 = D + 1.0, np.eye(D)  # precision prior
P0 = np.eye(D) / 100.0  # prior precision of the means (centred at 0)


def gmm(X):
    pi = numpyro.sample("pi", dist.Dirichlet(jnp.ones(K)))
    with numpyro.plate("components", K):
        mu = numpyro.sample("mu", dist.MultivariateNormal(jnp.zeros(D), precision_matrix=jnp.asarray(P0)))
        Lam = numpyro.sample("Lam", dist.Wishart(NU0, scale_matrix=jnp.asarray(W0)))
    with numpyro.plate("data", X.shape[0]):
        z = numpyro.sample("z", dist.Categorical(pi))
        numpyro.sample("x", dist.MultivariateNormal(mu[z], precision_matrix=Lam[z]), obs=X)


BETA0 = 0.05  # Normal–Wishart prior: μ_k ~ N(0, (β₀ Λ_k)⁻¹)


def normal_wishart_gmm(X):
    """Bishop's (2006, §10.2) mixture: the means' prior precision is β₀ Λ_k."""
    pi = numpyro.sample("pi", dist.Dirichlet(jnp.ones(K)))
    with numpyro.plate("components", K):
        Lam = numpyro.sample("Lam", dist.Wishart(NU0, scale_matrix=jnp.asarray(W0)))
        mu = numpyro.sample("mu", dist.MultivariateNormal(jnp.zeros(D), precision_matrix=BETA0 * Lam))
    with numpyro.plate("data", X.shape[0]):
        z = numpyro.sample("z", dist.Categorical(pi))
        numpyro.sample("x", dist.MultivariateNormal(mu[z], precision_matrix=Lam[z]), obs=X)


def _gmm_data():
    rng = np.random.default_rng(1)
    centres = np.array([[0.0, 0.0], [3.0, 0.5], [0.0, 3.0]])
    scales = [np.array([[1.0, 0.5], [0.5, 1.0]]), 0.4 * np.eye(2), np.array([[0.3, 0.0], [0.0, 1.2]])]
    return np.concatenate([rng.multivariate_normal(c, s, size=N // K) for c, s in zip(centres, scales)])


def _gmm_q(fit):
    p = fit.posterior
    return (
        np.asarray(p["pi"].concentration),
        np.asarray(p["mu"].mean),
        np.asarray(p["mu"].covariance_matrix),
        np.asarray(p["Lam"].concentration),
        np.asarray(p["Lam"].scale_matrix),
        np.asarray(p["z"].probs),
    )


def _gmm_sweep(x, beta0=None, lam_first=False):
    """Textbook VB, in the plan's order π, μ, Λ, z (π, Λ, μ, z with ``lam_first``); with
    ``beta0`` the means' prior precision is β₀ Λ_k (q(μ) q(Λ) still mean-field: each update
    uses the other's moments)."""

    def scatter(m, s):  # E[(x_n − μ_k)(x_n − μ_k)ᵀ], (N, K, D, D)
        d = x[:, None, :] - m[None]
        return np.einsum("nki,nkj->nkij", d, d) + s[None]

    def sweep(q):
        _, m, s, df, w, r = q
        nk = r.sum(0)
        alpha = 1.0 + nk

        def update_mu(df, w):
            prec_mean = df[:, None, None] * w
            prior = P0 if beta0 is None else beta0 * prec_mean
            s = np.linalg.inv(prior + nk[:, None, None] * prec_mean)
            return np.einsum("kij,kjl,kl->ki", s, prec_mean, r.T @ x), s

        def update_lam(m, s):
            w_inv = np.linalg.inv(W0) + np.einsum("nk,nkij->kij", r, scatter(m, s))
            df = NU0 + nk
            if beta0 is not None:  # the means' prior: ½ log|β₀Λ| − ½ β₀ tr(Λ E[μμᵀ])
                df = df + 1.0
                w_inv = w_inv + beta0 * (np.einsum("ki,kj->kij", m, m) + s)
            return df, np.linalg.inv(w_inv)

        if lam_first:
            df, w = update_lam(m, s)
            m, s = update_mu(df, w)
        else:
            m, s = update_mu(df, w)
            df, w = update_lam(m, s)
        prec_mean = df[:, None, None] * w
        logdet = np.array([_expected_logdet(df[k], w[k]) for k in range(K)])
        log_r = (
            special.digamma(alpha) - special.digamma(alpha.sum()) + 0.5 * logdet - 0.5 * D * math.log(2 * math.pi)
            - 0.5 * np.einsum("kij,nkji->nk", prec_mean, scatter(m, s))
        )
        r = np.exp(log_r - special.logsumexp(log_r, axis=1, keepdims=True))
        return alpha, m, s, df, w, r

    return sweep


@pytest.fixture(scope="module")
def gmm_fits():
    x = _gmm_data()
    key = random.PRNGKey(0)
    a = blr_fit(gmm, {"X": x}, num_steps=5, tol=1e-30, rng_key=key, progress_bar=False)
    b = blr_fit(gmm, {"X": x}, num_steps=6, tol=1e-30, rng_key=key, progress_bar=False)
    return x, a, b


def test_mixture_with_wishart_precisions_is_closed_form(gmm_fits):
    _, fit, _ = gmm_fits
    text = fit.plan.describe()
    assert [b.name for b in fit.plan.blocks] == ["pi", "mu", "Lam", "z"], text
    assert all(conj for _, conj in fit.plan.conjugate), text
    assert "precision_matrix:wishart" in text and "value:wishart" in text, text
    elbo = np.asarray(fit.elbo)
    assert np.all(np.diff(elbo) >= -1e-9 * np.abs(elbo[1:]))
    # mean-field between labels and components: PSIS flags q (k̂ 0.85 here), and the note
    # says why without sending the user to a joint block (every factor is closed-form)
    assert fit.diagnostics.khat > 0.7
    assert "relabelling" in fit.message and "structure='joint'" not in fit.message, fit.message


def test_the_loop_of_a_wishart_plan_compiles_optimised(gmm_fits):
    """A plan with a Wishart block (a step of many small matrix kernels) compiles its loop
    optimised however small its data; without the Wishart block the same plan would not."""
    import dataclasses

    from blrppl.engine.build import _step_work
    from blrppl.runtime.compile import SMALL_DATA

    _, fit, _ = gmm_fits
    assert _step_work(fit.plan, 0) == SMALL_DATA
    without = dataclasses.replace(fit.plan, blocks=tuple(b for b in fit.plan.blocks if b.name != "Lam"))
    assert _step_work(without, 0) == 0


def test_mixture_step_is_one_textbook_sweep(gmm_fits):
    x, fit_a, fit_b = gmm_fits
    want = _gmm_sweep(x)(_gmm_q(fit_a))
    for k, (got, ref) in enumerate(zip(_gmm_q(fit_b), want)):
        np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-12, err_msg=f"q entry {k}")


def test_normal_wishart_mixture_step_is_one_textbook_sweep():
    """The means' prior precision β₀ Λ_k is Λ_k times a constant: conjugate to both blocks."""
    x = _gmm_data()
    key = random.PRNGKey(0)
    a = blr_fit(normal_wishart_gmm, {"X": x}, num_steps=5, tol=1e-30, rng_key=key, progress_bar=False)
    b = blr_fit(normal_wishart_gmm, {"X": x}, num_steps=6, tol=1e-30, rng_key=key, progress_bar=False)
    text = a.plan.describe()
    assert all(conj for _, conj in a.plan.conjugate), text
    assert [blk.name for blk in a.plan.blocks] == ["pi", "Lam", "mu", "z"], text
    want = _gmm_sweep(x, BETA0, lam_first=True)(_gmm_q(a))
    for k, (got, ref) in enumerate(zip(_gmm_q(b), want)):
        np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-12, err_msg=f"q entry {k}")


def test_mixture_step_test_can_fail(gmm_fits):
    """The same comparison with the precision prior's scale changed by 0.1 % fails."""
    x, fit_a, fit_b = gmm_fits
    global W0
    saved = W0
    try:
        W0 = saved * 1.001
        want = _gmm_sweep(x)(_gmm_q(fit_a))
    finally:
        W0 = saved
    assert not np.allclose(_gmm_q(fit_b)[4], want[4], rtol=1e-9, atol=1e-12)


def test_mixture_step_with_each_blocks_tangents_pushed_alone(gmm_fits, monkeypatch):
    """Large groups push each block's tangents on their own (the others' unbatched zeros):
    forced here on the small mixture, its steps are still the textbook sweeps."""
    import blrppl.moments.linearised as linearised

    monkeypatch.setattr(linearised, "SPLIT_PUSH_FLOATS", 0)
    monkeypatch.setenv("BLRPPL_COMPILATION_CACHE", "0")  # (a stored program would be the joint one)

    def split_gmm(X):  # (a model of its own: not the compiled joint fit from memory)
        gmm(X)

    x, fit_a, _ = gmm_fits
    b = blr_fit(split_gmm, {"X": x}, num_steps=6, tol=1e-30, rng_key=random.PRNGKey(0), progress_bar=False)
    want = _gmm_sweep(x)(_gmm_q(fit_a))
    for k, (got, ref) in enumerate(zip(_gmm_q(b), want)):
        np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-12, err_msg=f"q entry {k}")


def test_one_by_one_precision_is_exact_in_one_step():
    """D = 1: the Wishart's E[log|Λ|] and 1 are pushed as two rows (one packed row needs an
    off-diagonal entry)."""

    def model(X):
        lam = numpyro.sample("lam", dist.Wishart(3.0, scale_matrix=jnp.array([[0.5]])))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("x", dist.MultivariateNormal(jnp.array([1.0]), precision_matrix=2.0 * lam), obs=X)

    x = np.random.default_rng(3).normal(1.0, 0.7, size=(40, 1))
    fit = blr_fit(model, (x,), num_steps=5, progress_bar=False)
    assert fit.num_steps == 1 and fit.converged, fit.message
    q = fit.posterior["lam"]
    np.testing.assert_allclose(q.concentration, 3.0 + 40, rtol=1e-12)
    d = x - 1.0
    np.testing.assert_allclose(q.scale_matrix, 1.0 / (1.0 / 0.5 + 2.0 * d.T @ d), rtol=1e-10)


# ------------------------------------------------- what is not a Wishart identity stays correct


def _reading(read):
    def model(X):
        Lam = numpyro.sample("Lam", dist.Wishart(4.0, scale_matrix=jnp.eye(2)))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("x", dist.MultivariateNormal(jnp.zeros(2), precision_matrix=read(Lam)), obs=X)

    return model


@pytest.mark.parametrize(
    "read, exact",
    [
        (lambda lam: lam.T, True),  # the same matrix
        (lambda lam: jnp.broadcast_to(lam, (30, 2, 2)), True),  # one per observation
        (lambda lam: jnp.diag(jnp.diag(lam)), False),  # part of it: E[log|diag Λ|] ≠ E[log|Λ|]
    ],
    ids=["transposed", "broadcast", "diagonal"],
)
def test_only_whole_matrices_are_read_as_the_wishart_block(read, exact):
    """A precision that is the Wishart latent itself (transposed, broadcast) is conjugate;
    a part of it is not, and the block moves to a Gaussian on the
    unconstrained space (Monte Carlo), never a wrong closed form."""
    x = np.random.default_rng(2).normal(size=(30, 2))
    plan = plan_of(_reading(read), (x,))
    assert (plan.blocks[0].family.name == "wishart") == exact, plan.describe()
    assert ("x       MultivariateNormal  Lam         exact" in plan.describe()) == exact, plan.describe()


# ------------------------------------------- correlated random effects (a hierarchical model)

G = 12


def random_effects(g, x, y=None):
    """Per-group intercept and slope with an unknown precision, as a NumPyro user writes it."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0).expand([2]).to_event(1))
    Lam = numpyro.sample("Lam", dist.Wishart(3.0, scale_matrix=jnp.eye(2)))
    tau = numpyro.sample("tau", dist.Gamma(1.0, 1.0))
    with numpyro.plate("groups", G):
        b = numpyro.sample("b", dist.MultivariateNormal(mu, precision_matrix=Lam))
    with numpyro.plate("obs", len(x)):
        numpyro.sample("y", dist.Normal(b[g, 0] + b[g, 1] * x, 1 / jnp.sqrt(tau)), obs=y)


def test_precision_of_random_effects_is_the_textbook_update():
    """With both the value (b_g) and the loc (μ) Gaussian, one step of the precision is
    ν = 3 + G, W⁻¹ = I + Σ_g E[(b_g − μ)(b_g − μ)ᵀ] from the newest q(μ), q(b) (mean-field:
    those updated before q(Λ) in the plan's order from this step, the others from the last)."""
    rng = np.random.default_rng(0)
    g, x = rng.integers(G, size=120), rng.normal(size=120)
    b = rng.multivariate_normal([1.0, -0.5], [[0.5, 0.3], [0.3, 0.4]], size=G)
    y = b[g, 0] + b[g, 1] * x + 0.3 * rng.normal(size=120)
    fits = [
        blr_fit(random_effects, (g, x, y), structure="mean-field", num_steps=n, tol=1e-30, progress_bar=False)
        for n in (4, 5)
    ]
    text = fits[0].plan.describe()
    assert "value:affine_gaussian, loc:affine_gaussian, precision_matrix:wishart" in text, text
    assert all(conj for _, conj in fits[0].plan.conjugate), text
    order = [blk.name for blk in fits[0].plan.blocks]
    newest = {n: fits[1] if order.index(n) < order.index("Lam") else fits[0] for n in ("mu", "b")}
    q_mu, q_b = newest["mu"].posterior["mu"], newest["b"].posterior["b"]
    d = np.asarray(q_b.mean) - np.asarray(q_mu.mean)
    scatter = (np.asarray(q_b.covariance_matrix) + np.asarray(q_mu.covariance_matrix)).sum(0) + d.T @ d
    q = fits[1].posterior["Lam"]
    np.testing.assert_allclose(q.concentration, 3.0 + G, rtol=1e-12)
    np.testing.assert_allclose(q.scale_matrix, np.linalg.inv(np.eye(2) + scatter), rtol=1e-9)


def weighted(X, w):
    Lam = numpyro.sample("Lam", dist.Wishart(3.0, scale_matrix=jnp.eye(2)))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("x", dist.MultivariateNormal(jnp.zeros(2), precision_matrix=w[:, None, None] * Lam), obs=X)


def test_a_precision_times_known_weights_is_exact_in_one_step():
    """x_n ~ N(0, (w_n Λ)⁻¹): each matrix times its own constant, E[log|w_n Λ|] = D log w_n +
    E[log|Λ|]: ν = 3 + N, W⁻¹ = I + Σ_n w_n x_n x_nᵀ, and the ELBO is the log evidence."""
    rng = np.random.default_rng(4)
    x, w = rng.normal(size=(40, 2)), rng.uniform(0.5, 2.0, size=40)
    fit = blr_fit(weighted, (x, w), progress_bar=False)
    assert fit.num_steps == 1, fit.plan.describe()
    w_n = np.linalg.inv(np.eye(2) + np.einsum("n,ni,nj->ij", w, x, x))
    np.testing.assert_allclose(fit.posterior["Lam"].scale_matrix, w_n, rtol=1e-10)

    def log_z(df, scale):
        return df * math.log(2.0) + 0.5 * df * np.linalg.slogdet(scale)[1] + special.multigammaln(0.5 * df, 2)

    evidence = -40 * math.log(2 * math.pi) + np.sum(np.log(w)) + log_z(43.0, w_n) - log_z(3.0, np.eye(2))
    np.testing.assert_allclose(fit.elbo[-1], evidence, rtol=1e-10)
