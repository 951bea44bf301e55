"""Classic variational message passing models with contractions of Gaussian latents.

Probabilistic PCA with ARD, Bayesian matrix factorisation with missing entries, factor
analysis and ARD regression: each loading/factor row is a Gaussian block with a full
covariance over the latent dimension, each precision a Gamma block, and the likelihood's
mean ``X @ C.T`` (or ``sum(U[row] * V[col], -1)``) a contraction read exactly through
the rows' first and second moments, E[(x·c)²] = tr(E[x xᵀ] E[c cᵀ]).

The reference of each model is the textbook coordinate-ascent VB (Bishop 2006, §10.1 and
§12.2.4; Winn & Bishop 2005; Ilin & Raiko 2010 for the missing entries), written here in
numpy with the same factorisation. Each sweep updates the blocks in the order of the plan.
Two claims per model, in float64:

- one step of the fit is one sweep of the textbook updates (from the fit's state after a
  few steps, to 1e-9): the update equations are the textbook ones;
- the fit's ELBO never falls.
"""

from __future__ import annotations

import numpy as np
import numpyro
import numpyro.distributions as dist
import jax.numpy as jnp
import pytest
from jax import random

import reference_models as rm
from blrppl import blr_fit

pytestmark = pytest.mark.filterwarnings("ignore:blr_fit. q may be a poor approximation")

N, M, D = 30, 12, 3
A0, B0 = 1e-3, 1e-3  # BayesPy's ARD and noise priors


def _data(seed=0, seen=0.8):
    rng = np.random.default_rng(seed)
    y = rng.normal(size=(N, D)) @ rng.normal(size=(D, M)) + 0.5 * rng.normal(size=(N, M))
    return y, rng.random((N, M)) < seen


def _gamma(d):
    d = getattr(d, "base_dist", d)
    return np.asarray(d.concentration), np.asarray(d.rate)


def _mvn(d):
    return np.asarray(d.mean), np.asarray(d.covariance_matrix)


def _second(mean, cov):
    """E[x xᵀ] per row."""
    return cov + np.einsum("...d,...e->...de", mean, mean)


def _gaussian_rows(prior_prec, w, y, tau, other_mean, other_second):
    """q of each row r of one side given the other's moments, with τ_rk the noise precision
    of entry (r, k) and w_rk whether it is seen:
    Λ_r = P + Σ_k w_rk τ_rk E[o_k o_kᵀ],  m_r = Λ_r⁻¹ Σ_k w_rk τ_rk y_rk E[o_k]."""
    weight = w * tau
    cov = np.linalg.inv(prior_prec + np.einsum("rk,kde->rde", weight, other_second))
    return np.einsum("rde,re->rd", cov, (weight * y) @ other_mean), cov


def _squares(w, y, xm, x2, cm, c2):
    """Σ over seen entries of E[(y − x·c)²] = y² − 2y E[x]·E[c] + tr(E[x xᵀ] E[c cᵀ])."""
    return w * (y**2 - 2 * y * (xm @ cm.T) + np.einsum("nde,med->nm", x2, c2))


def _assert_steps(fit_a, fit_b, to_q, sweep):
    """fit_b (one more step than fit_a) is one textbook sweep from fit_a's q."""
    want = sweep(to_q(fit_a))
    for k, (got, ref) in enumerate(zip(to_q(fit_b), want)):
        np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-12, err_msg=f"q entry {k}")


def _fits(model, data, steps=6):
    """Fits of ``steps`` and ``steps + 1`` sweeps (one compiled program)."""
    key = random.PRNGKey(0)
    a = blr_fit(model, data, num_steps=steps, tol=1e-30, rng_key=key, progress_bar=False)
    b = blr_fit(model, data, num_steps=steps + 1, tol=1e-30, rng_key=key, progress_bar=False)
    return a, b


def _monotone(fit):
    elbo = np.asarray(fit.elbo)
    return bool(np.all(np.diff(elbo) >= -1e-9 * np.abs(elbo[1:])))


# ----------------------------------------------------------------- probabilistic PCA with ARD


def ppca(Y, seen):
    """BayesPy's PCA example: α_d ~ Gamma(10⁻³, 10⁻³), C_m ~ N(0, diag(α)⁻¹),
    X_n ~ N(0, I), τ ~ Gamma(10⁻³, 10⁻³), Y ~ N(X Cᵀ, τ⁻¹), missing entries masked."""
    alpha = numpyro.sample("alpha", dist.Gamma(A0, B0).expand([D]).to_event(1))
    with numpyro.plate("M", M):
        C = numpyro.sample("C", dist.Normal(0.0, 1 / jnp.sqrt(alpha)).to_event(1))
    with numpyro.plate("N", N):
        X = numpyro.sample("X", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
    tau = numpyro.sample("tau", dist.Gamma(A0, B0))
    with numpyro.plate("n", N, dim=-2), numpyro.plate("m", M, dim=-1):
        numpyro.sample("Y", dist.Normal(X @ C.T, 1 / jnp.sqrt(tau)).mask(seen), obs=jnp.where(seen, Y, 0.0))


def _ppca_q(fit):
    p = fit.posterior
    return (*_gamma(p["alpha"]), *_mvn(p["C"]), *_mvn(p["X"]), *_gamma(p["tau"]))


def _ppca_sweep(y, w):
    def sweep(q):
        _, _, cm, cc, xm, xc, ta, tb = q
        c2 = _second(cm, cc)
        aa, ab = A0 + 0.5 * M + 0 * cm[0], B0 + 0.5 * np.einsum("mdd->d", c2)
        cm, cc = _gaussian_rows(np.diag(aa / ab), w.T, y.T, ta / tb, xm, _second(xm, xc))
        xm, xc = _gaussian_rows(np.eye(D), w, y, ta / tb, cm, _second(cm, cc))
        sq = _squares(w, y, xm, _second(xm, xc), cm, _second(cm, cc))
        return aa, ab, cm, cc, xm, xc, A0 + 0.5 * w.sum(), B0 + 0.5 * sq.sum()

    return sweep


@pytest.fixture(scope="module")
def ppca_fits():
    y, seen = _data()
    y = np.where(seen, y, np.nan)  # missing entries as a user's array has them
    return (y, seen), _fits(ppca, {"Y": y, "seen": seen})


def test_ppca_contraction_is_read_exactly(ppca_fits):
    _, (fit, _) = ppca_fits
    text = fit.plan.describe()
    assert "loc:bilinear_gaussian" in text, text
    # (the likelihood from data statistics: the textbook sweeps below check that path)
    assert dict((f.name, f.spec.statistics) for f in fit.plan.factors)["Y"].pair == ("X", "C"), text
    assert [b.name for b in fit.plan.blocks] == ["alpha", "C", "X", "tau"], text
    assert all(conj for _, conj in fit.plan.conjugate), text
    assert fit.posterior["X"].covariance_matrix.shape == (N, D, D)  # a full covariance per row
    # PSIS flags q (mean-field between the factors, a posterior symmetric under rotations):
    # the note says so, and does not send the user to a joint block fitted by Monte Carlo
    assert fit.diagnostics.khat > 0.7
    assert "fitted apart" in fit.message and "structure='joint'" not in fit.message


def test_ppca_step_is_the_textbook_sweep(ppca_fits):
    (y, seen), (a, b) = ppca_fits
    _assert_steps(a, b, _ppca_q, _ppca_sweep(np.where(seen, y, 0.0), seen.astype(float)))
    assert _monotone(b)


def ppca_complete(Y, seen):
    """:func:`ppca` under another name (a compiled fit of its own)."""
    return ppca(Y, seen)


def ppca_masks(Y, seen):
    """:func:`ppca` under another name (a compiled fit of its own)."""
    return ppca(Y, seen)


def test_ppca_rows_without_missing_entries_share_one_covariance():
    # every row of X then has the precision I + τ Σ_m E[c_m c_mᵀ]: the plan holds one
    # covariance for all of them, and the steps are still the textbook sweeps
    y, _ = _data()
    seen = np.ones_like(y, dtype=bool)
    a, b = _fits(ppca_complete, {"Y": y, "seen": seen})
    blocks = {blk.name: blk for blk in b.plan.blocks}
    assert blocks["X"].family.tied_rows, b.plan.describe()
    assert "gaussian (rows share one covariance)" in b.plan.describe()
    assert b.nat["X"].eta2.shape == (D, D)
    assert b.posterior["X"].covariance_matrix.shape == (N, D, D)
    _assert_steps(a, b, _ppca_q, _ppca_sweep(y, seen.astype(float)))
    assert _monotone(b)


def test_other_data_with_a_mask_gives_rows_their_own_covariances():
    # the compiled fit of complete data ties X's rows; the same model on data of the same
    # shapes with missing entries must not reuse it
    y, seen = _data()
    _fits(ppca_masks, {"Y": y, "seen": np.ones_like(seen)}, steps=1)
    a, b = _fits(ppca_masks, {"Y": np.where(seen, y, 0.0), "seen": seen})
    assert not any(blk.family.tied_rows for blk in b.plan.blocks), b.plan.describe()
    _assert_steps(a, b, _ppca_q, _ppca_sweep(np.where(seen, y, 0.0), seen.astype(float)))


# ------------------------------------------------ matrix factorisation from (row, col) pairs


def matrix_factorisation(row, col, rating=None):
    """Ratings of seen (user, item) pairs only, as index arrays: rating ~ N(U_row·V_col, τ⁻¹)."""
    tau = numpyro.sample("tau", dist.Gamma(1.0, 1.0))
    with numpyro.plate("users", N):
        U = numpyro.sample("U", dist.Normal(jnp.zeros(D), 1.0).to_event(1))
    with numpyro.plate("items", M):
        V = numpyro.sample("V", dist.Normal(jnp.zeros(D), 1.0).to_event(1))
    with numpyro.plate("ratings", len(row)):
        numpyro.sample("rating", dist.Normal(jnp.sum(U[row] * V[col], axis=-1), 1 / jnp.sqrt(tau)), obs=rating)


def _mf_q(fit):
    p = fit.posterior
    return (*_gamma(p["tau"]), *_mvn(p["U"]), *_mvn(p["V"]))


def _mf_sweep(y, w, tau_first=True):
    def tau_update(um, uc, vm, vc):
        sq = _squares(w, y, um, _second(um, uc), vm, _second(vm, vc))
        return 1.0 + 0.5 * w.sum(), 1.0 + 0.5 * sq.sum()

    def sweep(q):
        ta, tb, um, uc, vm, vc = q
        if tau_first:
            ta, tb = tau_update(um, uc, vm, vc)
        um, uc = _gaussian_rows(np.eye(D), w, y, ta / tb, vm, _second(vm, vc))
        vm, vc = _gaussian_rows(np.eye(D), w.T, y.T, ta / tb, um, _second(um, uc))
        if not tau_first:
            ta, tb = tau_update(um, uc, vm, vc)
        return ta, tb, um, uc, vm, vc

    return sweep


def test_matrix_factorisation_from_index_pairs():
    y, seen = _data(seed=1, seen=0.6)
    row, col = np.nonzero(seen)
    a, b = _fits(matrix_factorisation, {"row": row, "col": col, "rating": y[row, col]})
    text = a.plan.describe()
    assert "loc:bilinear_gaussian" in text and all(c for _, c in a.plan.conjugate), text
    assert dict((f.name, f.spec.statistics) for f in a.plan.factors)["rating"].pair == ("U", "V"), text
    _assert_steps(a, b, _mf_q, _mf_sweep(np.where(seen, y, 0.0), seen.astype(float)))
    assert _monotone(b)


def unplated_factorisation(Y):
    """The same likelihood over the whole matrix with the factors as single (N, D) and (M, D)
    sites (``to_event(2)``, no plates): one Gaussian block each, fitted as if its rows were
    declared in a plate (each row's D scalars coupled, the rows apart)."""
    U = numpyro.sample("U", dist.Normal(jnp.zeros((N, D)), 1.0).to_event(2))
    V = numpyro.sample("V", dist.Normal(jnp.zeros((M, D)), 1.0).to_event(2))
    tau = numpyro.sample("tau", dist.Gamma(1.0, 1.0))
    numpyro.sample("Y", dist.Normal(U @ V.T, 1 / jnp.sqrt(tau)).to_event(2), obs=Y)


def _rows_q(fit):
    """q of the unplated fit in the row-wise layout: each row's mean and covariance (the
    site's q is one multivariate normal per row, its rows an event of the site)."""
    p = fit.posterior
    return (*_gamma(p["tau"]), *_mvn(p["U"].base_dist), *_mvn(p["V"].base_dist))


def test_unplated_factor_sites_give_the_same_steps():
    y, _ = _data(seed=4)
    a, b = _fits(unplated_factorisation, {"Y": y})
    assert [blk.name for blk in a.plan.blocks] == ["U", "V", "tau"], a.plan.describe()
    assert [blk.batch_shape for blk in a.plan.blocks[:2]] == [(N,), (M,)]
    assert a.posterior["U"].event_shape == (N, D)
    assert "loc:bilinear_gaussian" in a.plan.describe()
    _assert_steps(a, b, _rows_q, _mf_sweep(y, np.ones_like(y), tau_first=False))


# ------------------------------------------------------------------------ factor analysis


def factor_analysis(Y):
    """Y_n ~ N(W x_n + μ, diag(ψ)⁻¹) with a noise precision per column, written with einsum."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0).expand([M]).to_event(1))
    psi = numpyro.sample("psi", dist.Gamma(1.0, 1.0).expand([M]).to_event(1))
    with numpyro.plate("M", M):
        W = numpyro.sample("W", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
    with numpyro.plate("N", N):
        X = numpyro.sample("X", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
        numpyro.sample("Y", dist.Normal(jnp.einsum("nd,md->nm", X, W) + mu, 1 / jnp.sqrt(psi)).to_event(1), obs=Y)


def _fa_q(fit):
    p = fit.posterior
    mu = p["mu"]
    mu_var = np.asarray(mu.variance) if not hasattr(mu, "covariance_matrix") else np.diagonal(mu.covariance_matrix)
    return (np.asarray(mu.mean), mu_var, *_gamma(p["psi"]), *_mvn(p["W"]), *_mvn(p["X"]))


def _fa_sweep(y):
    ones = np.ones_like(y)

    def sweep(q):
        _, _, pa, pb, wm, wc, xm, xc = q
        psi = pa / pb
        # q(μ_m): N(0, 100) prior, N observations of y − E[x]·E[w_m] each with precision ψ_m
        prec = 1e-2 + N * psi
        mm = psi * np.sum(y - xm @ wm.T, axis=0) / prec
        mv = 1 / prec
        r = y - mm
        sq = _squares(ones, r, xm, _second(xm, xc), wm, _second(wm, wc)) + mv
        pa, pb = 1.0 + 0.5 * N + 0 * mm, 1.0 + 0.5 * sq.sum(axis=0)
        psi = pa / pb
        wm, wc = _gaussian_rows(np.eye(D), ones.T, r.T, psi[:, None], xm, _second(xm, xc))
        xm, xc = _gaussian_rows(np.eye(D), ones, r, psi, wm, _second(wm, wc))
        return mm, mv, pa, pb, wm, wc, xm, xc

    return sweep


def test_factor_analysis_step_is_the_textbook_sweep():
    y, _ = _data(seed=2)
    a, b = _fits(factor_analysis, {"Y": y})
    assert [blk.name for blk in a.plan.blocks] == ["mu", "psi", "W", "X"], a.plan.describe()
    assert all(c for _, c in a.plan.conjugate), a.plan.describe()
    _assert_steps(a, b, _fa_q, _fa_sweep(y))
    assert _monotone(b)


def centred_factor_analysis(Y):
    """Factor analysis of centred data: a noise precision per column and no mean, so the
    likelihood is read from data statistics, each column's terms weighted by its ψ_m."""
    rm.factor_analysis_model(Y, D)


def _centred_fa_sweep(y):
    ones = np.ones_like(y)

    def sweep(q):
        pa, pb, wm, wc, xm, xc = q
        sq = _squares(ones, y, xm, _second(xm, xc), wm, _second(wm, wc))
        pa, pb = 1.0 + 0.5 * N + 0 * pa, 1.0 + 0.5 * sq.sum(axis=0)
        psi = pa / pb
        wm, wc = _gaussian_rows(np.eye(D), ones.T, y.T, psi[:, None], xm, _second(xm, xc))
        xm, xc = _gaussian_rows(np.eye(D), ones, y, psi, wm, _second(wm, wc))
        return pa, pb, wm, wc, xm, xc

    return sweep


def test_centred_factor_analysis_reads_data_statistics_and_takes_the_textbook_sweep():
    """The noise precision per column is read with the product X @ W.T from data statistics
    (each column's terms weighted by E[ψ_m]; the rows of X share one covariance): the step
    is still the textbook sweep (it ran D² pushes of the model per step, 234 against 12 ms
    per step for PCA at BayesPy's 2,000 × 100, D = 40 size)."""
    y, _ = _data(seed=4)
    a, b = _fits(centred_factor_analysis, {"Y": y})
    (lik,) = [f for f in a.plan.factors if f.observed]
    assert (lik.spec.statistics.pair, lik.spec.statistics.scale_rows) == (("X", "W"), "W"), a.plan.describe()
    assert {n for n, _, _ in a.plan.tied} == {"X"}, a.plan.describe()
    _assert_steps(a, b, lambda fit: (*_gamma(fit.posterior["psi"]), *_mvn(fit.posterior["W"]), *_mvn(fit.posterior["X"])),
                  _centred_fa_sweep(y))
    assert _monotone(b)


def test_a_half_cauchy_noise_scale_keeps_the_likelihood_closed_form():
    """Factor analysis as users often write it: a HalfCauchy noise scale (a Gaussian on log
    space) beside a per-column mean. The scale stays apart from the mean, so the likelihood
    reads the product and the log-normal scale in closed form (joined with the mean, it was
    Monte Carlo)."""

    def model(Y):
        sigma = numpyro.sample("sigma", dist.HalfCauchy(1.0))
        mu = numpyro.sample("mu", dist.Normal(0.0, 5.0).expand([M]).to_event(1))
        with numpyro.plate("items", M):
            W = numpyro.sample("W", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
        with numpyro.plate("people", N):
            z = numpyro.sample("z", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
            numpyro.sample("Y", dist.Normal(z @ W.T + mu, sigma).to_event(1), obs=Y)

    from blrppl.api import plan_of

    plan = plan_of(model, {"Y": _data(seed=5)[0]})
    text = plan.describe()
    assert [b.name for b in plan.blocks] == ["sigma", "mu", "W", "z"], text
    (y_factor,) = [f for f in plan.factors if f.name == "Y"]
    assert y_factor.estimator == "exact", text
    assert "loc:bilinear_gaussian, scale:exp_gaussian" in text, text


# ------------------------------------------------------------------- ARD linear regression


def ard_regression(X, y=None):
    alpha = numpyro.sample("alpha", dist.Gamma(A0, B0).expand([X.shape[1]]).to_event(1))
    w = numpyro.sample("w", dist.Normal(0.0, 1 / jnp.sqrt(alpha)).to_event(1))
    tau = numpyro.sample("tau", dist.Gamma(A0, B0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, 1 / jnp.sqrt(tau)), obs=y)


def test_ard_regression_reaches_the_textbook_fixed_point():
    """Bishop (2006) §7.2.2 / Tipping (2001) as VB: q(α) q(w) q(τ); two of six inputs
    carry no signal and their α grow large. 200 textbook sweeps from the fit move nothing."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(60, 6))
    y = x @ np.array([1.5, -2.0, 0.0, 0.7, 0.0, 1.0]) + 0.3 * rng.normal(size=60)
    fit = blr_fit(ard_regression, {"X": x, "y": y}, num_steps=3000, tol=1e-14, rng_key=random.PRNGKey(0), progress_bar=False)
    assert fit.converged, fit.message
    p = fit.posterior
    aa, ab = _gamma(p["alpha"])
    wm, wc = _mvn(p["w"])
    ta, tb = _gamma(p["tau"])
    q = (aa, ab, wm, wc, ta, tb)
    for _ in range(200):
        aa = A0 + 0.5 + 0 * wm
        ab = B0 + 0.5 * (wm**2 + np.diag(wc))
        wc = np.linalg.inv(np.diag(aa / ab) + ta / tb * x.T @ x)
        wm = ta / tb * wc @ x.T @ y
        ta = A0 + 0.5 * len(y)
        tb = B0 + 0.5 * (np.sum((y - x @ wm) ** 2) + np.trace(x.T @ x @ wc))
    for got, want in zip(q, (aa, ab, wm, wc, ta, tb)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-10)
    assert _monotone(fit)


# ------------------------------------------------------------- contractions that stay opaque


def test_contraction_over_plate_elements_is_not_read_as_a_product():
    """Σ_i a_i b_i over a plate couples every element of a and b: the row-wise moments do
    not hold it, and the plan says why instead of a wrong closed form."""

    def model(y):
        with numpyro.plate("i", 8):
            a = numpyro.sample("a", dist.Normal(0.0, 1.0))
            b = numpyro.sample("b", dist.Normal(0.0, 1.0))
        numpyro.sample("y", dist.Normal(jnp.sum(a * b), 1.0), obs=y)

    from blrppl.api import plan_of

    text = plan_of(model, {"y": 1.0}).describe()
    assert "loc:bilinear_gaussian" not in text and "monte_carlo" in text, text


# ------------------------------------------ one side of the product unplated (one dense block)

def _loadings(plated):
    def model(Y):
        if plated:
            with numpyro.plate("M", Y.shape[1]):
                C = numpyro.sample("C", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        else:
            C = numpyro.sample("C", dist.Normal(0.0, 1.0).expand([Y.shape[1], 2]).to_event(2))
        with numpyro.plate("N", Y.shape[0]):
            X = numpyro.sample("X", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            numpyro.sample("Y", dist.Normal(X @ C.T, 0.3).to_event(1), obs=Y)

    return model


def test_unplated_loadings_take_the_same_steps_as_plated_ones():
    """Loadings written as one unplated (M, D) site are one dense Gaussian block: a conjugate
    block with no plate, whose messages were taken at the fixed view Σ = 0, where the square
    roots of its covariance (the product's second moment) have no derivative: every message
    was NaN and the fit stopped as 'improper'. Its VB steps are the plated loadings' steps
    (the posterior of the rows factorises)."""
    rng = np.random.default_rng(3)
    y = rng.normal(size=(30, 2)) @ rng.normal(size=(2, 5)) + 0.3 * rng.normal(size=(30, 5))
    fits = [blr_fit(_loadings(p), (y,), num_steps=20, tol=1e-30, progress_bar=False) for p in (True, False)]
    assert fits[1].num_steps == 20 and "improper" not in fits[1].message, fits[1].message
    np.testing.assert_allclose(fits[1].elbo, fits[0].elbo, rtol=1e-10)
    np.testing.assert_allclose(fits[1].posterior["X"].mean, fits[0].posterior["X"].mean, rtol=1e-8, atol=1e-10)


def test_online_update_of_a_factor_model():
    """Sequential Bayes on a factor model: the second half's fit takes the first half's
    loadings posterior as its prior (a previous-posterior factor), converges, and leaves the
    loadings surer than after the first half (every marginal variance smaller)."""
    rng = np.random.default_rng(5)
    y = rng.normal(size=(60, 2)) @ rng.normal(size=(2, 5)) + 0.3 * rng.normal(size=(60, 5))
    model = _loadings(False)
    first = blr_fit(model, (y[:30],), progress_bar=False)
    second = blr_fit(model, (y[30:],), prior=first, progress_bar=False)
    assert second.converged, second.message
    assert "C:previous" in second.plan.describe()
    assert np.all(np.asarray(second.posterior["C"].variance) < np.asarray(first.posterior["C"].variance))


def _masked_loadings():
    """A new model function (a compiled fit of its own: a fit compiled on data with missing
    entries keeps the rows' own covariances for complete data of the same shapes)."""

    def model(Y, seen):
        with numpyro.plate("M", Y.shape[1]):
            C = numpyro.sample("C", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        with numpyro.plate("N", Y.shape[0]):
            X = numpyro.sample("X", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            numpyro.sample("Y", dist.Normal(X @ C.T, 0.3).mask(seen).to_event(1), obs=Y)

    return model


@pytest.mark.parametrize("complete", [(True, False), (False, True), (True, True)], ids=["tied-then-own", "own-then-tied", "tied-then-tied"])
def test_online_update_between_rows_with_one_and_with_own_covariances(complete):
    """The loadings' rows share one covariance after complete data, not after data with
    missing entries: either posterior is the prior of a fit on the other kind of data (the
    rows then have their own covariances unless both fits tie them)."""
    rng = np.random.default_rng(5)
    y = rng.normal(size=(60, 2)) @ rng.normal(size=(2, 5)) + 0.3 * rng.normal(size=(60, 5))
    seen = [np.ones((30, 5), bool) if c else rng.random((30, 5)) < 0.7 for c in complete]
    model = _masked_loadings()
    first = blr_fit(model, (y[:30], seen[0]), progress_bar=False)
    second = blr_fit(model, (y[30:], seen[1]), prior=first, progress_bar=False)
    assert first.plan.block("C").family.tied_rows == complete[0], first.plan.describe()
    assert second.plan.block("C").family.tied_rows == all(complete), second.plan.describe()
    assert second.converged and "C:previous" in second.plan.describe(), second.message
    assert np.all(np.asarray(second.posterior["C"].variance) < np.asarray(first.posterior["C"].variance))

