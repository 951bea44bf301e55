"""EM: ``numpyro.param`` sites and ``point`` latents as point estimates (float64).

A model whose discrete latents are enumerated and whose continuous quantities are params is
fitted by classical EM: the exact E-step (the Categorical block's update) from the user's
initial values, then exact M-steps (each param's Newton iterations run to convergence) in
model order. The fits are compared, iteration by iteration, with EM written out by hand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.distributions import constraints
from scipy.special import logsumexp

from blrppl import BLRError, FamilyError, ModelTraceError, blr_fit
from blrppl.graph.plan import FactorRole
from describe_table import factor_rows


def fit(model, data, **kw):
    kw.setdefault("progress_bar", False)
    kw.setdefault("rng_key", jax.random.key(0))
    return blr_fit(model, data, **kw)


def block_roles(describe: str) -> dict:
    """Block name → role cell of ``plan.describe()``'s block table."""
    lines = describe.splitlines()
    header = lines[0].split()
    assert header[0] == "block" and header[-1] == "role"
    out = {}
    for line in lines[2:]:
        if not line.strip():
            break
        cells = [c for c in line.strip().split("  ") if c.strip()]
        out[cells[0].strip()] = cells[-1].strip()
    return out


# -- a 1-D Gaussian mixture ---------------------------------------------------------------

RNG = np.random.default_rng(1)
N, K = 300, 3
TRUE_Z = RNG.choice(K, size=N, p=[0.3, 0.3, 0.4])
X = RNG.normal(np.array([-3.0, 0.0, 4.0])[TRUE_Z], np.array([1.0, 0.7, 1.5])[TRUE_Z])
# initial values far from the truth (EM from them takes many iterations to converge)
W0 = np.full(K, 1.0 / K)
M0 = np.array([-1.0, 0.5, 2.0])
S0 = np.full(K, 2.0)
# the MAP-EM prior of the locations: centred on M0, where point latents start (prior mean)
PRIOR_LOC, PRIOR_SCALE = M0, 2.0


def gmm_from(x, w0, m0, s0):
    """The mixture with the params' initial values as arguments (one compiled fit serves
    every starting point)."""
    weights = numpyro.param("weights", w0, constraint=constraints.simplex)
    locs = numpyro.param("locs", m0)
    scales = numpyro.param("scales", s0, constraint=constraints.positive)
    with numpyro.plate("n", x.shape[0]):
        z = numpyro.sample("z", dist.Categorical(weights))
        numpyro.sample("x", dist.Normal(locs[z], scales[z]), obs=x)


def gmm(x):
    gmm_from(x, W0, M0, S0)


def gmm_map(x):
    weights = numpyro.param("weights", W0, constraint=constraints.simplex)
    with numpyro.plate("k", K):
        locs = numpyro.sample("locs", dist.Normal(PRIOR_LOC, PRIOR_SCALE))
    scales = numpyro.param("scales", S0, constraint=constraints.positive)
    with numpyro.plate("n", x.shape[0]):
        z = numpyro.sample("z", dist.Categorical(weights))
        numpyro.sample("x", dist.Normal(locs[z], scales[z]), obs=x)


def log_joint_terms(w, mu, s):
    """log w_k + log N(x_n | μ_k, σ_k), shape (N, K)."""
    return np.log(w) - 0.5 * np.log(2 * np.pi * s**2) - 0.5 * (X[:, None] - mu) ** 2 / s**2


def em_reference(num, map_prior=False):
    """Classical EM (MAP-EM with a Normal prior on the locations), written out: E-step from the
    current values, then M-steps for the weights, the locations and the scales (σ² with the
    new locations). Returns per iteration (w, μ, σ, responsibilities used)."""
    w, mu, s = W0.copy(), M0.copy(), S0.copy()
    out = []
    for _ in range(num):
        terms = log_joint_terms(w, mu, s)
        r = np.exp(terms - logsumexp(terms, axis=1, keepdims=True))
        nk = r.sum(0)
        w = nk / N
        if map_prior:  # argmax of log N(μ | m0, s0²) + Σ_n r_nk log N(x_n | μ, σ_k²), σ_k current
            prec = 1 / PRIOR_SCALE**2 + nk / s**2
            mu = (PRIOR_LOC / PRIOR_SCALE**2 + (r * X[:, None]).sum(0) / s**2) / prec
        else:
            mu = (r * X[:, None]).sum(0) / nk
        s = np.sqrt((r * (X[:, None] - mu) ** 2).sum(0) / nk)
        out.append((w, mu, s, r))
    return out


def log_likelihood(w, mu, s):
    return float(logsumexp(log_joint_terms(w, mu, s), axis=1).sum())


NUM_ITER = 10


@pytest.fixture(scope="module")
def em_run():
    """NUM_ITER steps of one fit from W0, M0, S0."""
    return fit(gmm, {"x": X}, num_steps=NUM_ITER, tol=1e-300)


def test_em_equals_hand_written_em_iteration_by_iteration():
    # the trajectory, one step at a time: each fit makes one step from the previous fit's
    # estimates (given as the params' initial values)
    ref = em_reference(NUM_ITER)
    w, mu, s = W0, M0, S0
    for t, (w_ref, mu_ref, s_ref, r_ref) in enumerate(ref, start=1):
        res = fit(gmm_from, {"x": X, "w0": w, "m0": mu, "s0": s}, num_steps=1, tol=1e-300)
        assert res.num_steps == 1
        est = res.point_estimates()
        assert set(est) == {"weights", "locs", "scales"}
        np.testing.assert_allclose(est["weights"], w_ref, atol=1e-8, err_msg=f"iteration {t}")
        np.testing.assert_allclose(est["locs"], mu_ref, atol=1e-8, err_msg=f"iteration {t}")
        np.testing.assert_allclose(est["scales"], s_ref, atol=1e-8, err_msg=f"iteration {t}")
        # the E-step of iteration t used the values of iteration t − 1
        np.testing.assert_allclose(res.posterior["z"].probs, r_ref, atol=1e-8, err_msg=f"iteration {t}")
        w, mu, s = (np.asarray(est[k]) for k in ("weights", "locs", "scales"))
    # EM is still moving at the last iteration: the comparison is not between fixed points
    assert np.max(np.abs(ref[-1][1] - ref[-2][1])) > 1e-3


def test_em_run_equals_hand_written_em(em_run):
    # the same NUM_ITER iterations inside one run of the loop
    w, mu, s, r = em_reference(NUM_ITER)[-1]
    assert em_run.num_steps == NUM_ITER
    est = em_run.point_estimates()
    np.testing.assert_allclose(est["weights"], w, atol=1e-8)
    np.testing.assert_allclose(est["locs"], mu, atol=1e-8)
    np.testing.assert_allclose(est["scales"], s, atol=1e-8)
    np.testing.assert_allclose(em_run.posterior["z"].probs, r, atol=1e-8)


def test_em_log_likelihood_is_monotone(em_run):
    ref = em_reference(NUM_ITER)
    loglik = [log_likelihood(W0, M0, S0)] + [log_likelihood(w, mu, s) for w, mu, s, _ in ref]
    assert np.all(np.diff(loglik) > 0)
    elbo = em_run.elbo
    assert len(elbo) == NUM_ITER
    # after iteration t the ELBO is E_q[log p(x, z | θ_t)] + H(q) with q the responsibilities
    # under θ_{t−1}: between the log likelihoods at θ_{t−1} and θ_t (EM's proof of ascent)
    for t in range(NUM_ITER):
        assert loglik[t] - 1e-8 <= elbo[t] <= loglik[t + 1] + 1e-8, t
    assert np.all(np.diff(elbo) > 0)


def test_em_plan_and_posterior(em_run):
    res = em_run
    plan = res.plan
    text = plan.describe()
    roles = block_roles(text)
    assert roles == {"weights": "param (M-step)", "locs": "param (M-step)", "scales": "param (M-step)", "z": "posterior"}
    # the E-step comes first, then the M-steps in model order
    assert plan.order == ("z", "weights", "locs", "scales")
    assert "sequential order: z, weights, locs, scales" in text
    # no log|det J| factor for params: the only factors are the model's sites
    assert set(factor_rows(text)) == {"z", "x"}
    assert all(b.point and b.param for b in plan.blocks if b.name != "z")
    # params are point masses at their estimates, with all their dims as event dims
    est = res.point_estimates()
    for name in ("weights", "locs", "scales"):
        post = res.posterior[name]
        assert isinstance(post, dist.Delta)
        assert post.event_shape == (K,) and post.batch_shape == ()
        np.testing.assert_allclose(post.mean, est[name], atol=1e-15)
        draws = res.sample(jax.random.key(1), 5)[name]
        np.testing.assert_allclose(draws, np.broadcast_to(est[name], (5, K)), atol=1e-15)
    np.testing.assert_allclose(np.sum(est["weights"]), 1.0, atol=1e-12)
    stats = res.summary(print_table=False)
    np.testing.assert_allclose(stats["scales"]["sd"], 0.0, atol=1e-12)  # a constant draw


def test_em_converges_to_a_fixed_point_of_em():
    res = fit(gmm, {"x": X}, tol=1e-12, num_steps=2000)
    assert res.converged, res.message
    est = res.point_estimates()
    # one more EM iteration from the fitted values leaves them where they are
    terms = log_joint_terms(est["weights"], est["locs"], est["scales"])
    r = np.exp(terms - logsumexp(terms, axis=1, keepdims=True))
    nk = r.sum(0)
    mu = (r * X[:, None]).sum(0) / nk
    np.testing.assert_allclose(nk / N, est["weights"], atol=1e-5)
    np.testing.assert_allclose(mu, est["locs"], atol=1e-5)
    np.testing.assert_allclose(np.sqrt((r * (X[:, None] - mu) ** 2).sum(0) / nk), est["scales"], atol=1e-5)


def test_map_em_with_a_point_latent_equals_hand_written_map_em():
    ref = em_reference(NUM_ITER, map_prior=True)
    for t in (1, 2, NUM_ITER):
        res = fit(gmm_map, {"x": X}, point=["locs"], num_steps=t, tol=1e-300)
        assert res.num_steps == t
        w, mu, s, _ = ref[t - 1]
        est = res.point_estimates()
        np.testing.assert_allclose(est["weights"], w, atol=1e-8, err_msg=f"iteration {t}")
        np.testing.assert_allclose(est["locs"], mu, atol=1e-8, err_msg=f"iteration {t}")
        np.testing.assert_allclose(est["scales"], s, atol=1e-8, err_msg=f"iteration {t}")
    assert res.plan.order == ("z", "weights", "locs", "scales")
    roles = block_roles(res.plan.describe())
    assert roles["locs"] == "point (unconstrained)" and roles["scales"] == "param (M-step)"
    # the point latent keeps its Gaussian (Laplace) posterior; params are point masses
    assert not isinstance(res.posterior["locs"], dist.Delta)
    assert isinstance(res.posterior["weights"], dist.Delta)
    # MAP-EM raises log p(x, μ | w, σ) (ELBO with no entropy term for point blocks)
    assert np.all(np.diff(res.elbo) > 0)


# -- params with constraints: initial values and closed-form MLEs ----------------------------

Y_NORMAL = np.random.default_rng(2).normal(1.3, 0.6, size=40)
Y_BERN = (np.random.default_rng(3).uniform(size=60) < 0.35).astype(float)
Y_CAT = np.random.default_rng(4).choice(3, size=80, p=[0.2, 0.5, 0.3])
Y_GROUPS = np.random.default_rng(5).normal(0.0, np.array([[0.5], [1.0], [2.0]]), size=(3, 30))


def normal_mle(y):
    loc = numpyro.param("loc", 0.0)
    scale = numpyro.param("scale", 3.0, constraint=constraints.positive)
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Normal(loc, scale), obs=y)


def bernoulli_mle(y):
    p = numpyro.param("p", 0.8, constraint=constraints.interval(0.1, 0.9))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Bernoulli(probs=p), obs=y)


def bernoulli_unit(y):
    p = numpyro.param("p", 0.5, constraint=constraints.unit_interval)
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Bernoulli(probs=p), obs=y)


def categorical_mle(y):
    probs = numpyro.param("probs", np.array([0.6, 0.3, 0.1]), constraint=constraints.simplex)
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Categorical(probs), obs=y)


def grouped_scales(y):
    # one scale per group: a param inside a plate, its batch dim indexed by the plate
    with numpyro.plate("g", y.shape[0], dim=-2):
        scale = numpyro.param("scale", np.ones((y.shape[0], 1)), constraint=constraints.positive, event_dim=0)
        with numpyro.plate("n", y.shape[1]):
            numpyro.sample("y", dist.Normal(0.0, scale), obs=y)


MLE_CASES = {
    "normal": (normal_mle, Y_NORMAL, lambda y: {"loc": y.mean(), "scale": y.std()}),
    "bernoulli-interval": (bernoulli_mle, Y_BERN, lambda y: {"p": y.mean()}),
    "bernoulli-unit": (bernoulli_unit, Y_BERN, lambda y: {"p": y.mean()}),
    "categorical-simplex": (categorical_mle, Y_CAT, lambda y: {"probs": np.bincount(y, minlength=3) / y.size}),
    "plated-positive": (grouped_scales, Y_GROUPS, lambda y: {"scale": np.sqrt((y**2).mean(1, keepdims=True))}),
}


@pytest.mark.parametrize("case", list(MLE_CASES))
def test_param_estimate_is_the_closed_form_mle(case):
    model, y, mle = MLE_CASES[case]
    res = fit(model, (y,), tol=1e-14)
    assert res.converged, res.message
    est = res.point_estimates()
    for name, value in mle(y).items():
        np.testing.assert_allclose(est[name], value, atol=1e-8, err_msg=name)
        assert isinstance(res.posterior[name], dist.Delta)
    assert all(role == "param (M-step)" for role in block_roles(res.plan.describe()).values())


def test_plated_param_posterior_has_its_event_dim():
    res = fit(grouped_scales, (Y_GROUPS,), tol=1e-14)
    post = res.posterior["scale"]
    assert post.event_shape == () and post.batch_shape == (3, 1)
    assert res.plan.block("scale").plate_axes == (0,)


INIT_CASES = {
    # model, data, the initial values the model declares
    "real+positive": (normal_mle, Y_NORMAL, {"loc": 0.0, "scale": 3.0}),
    "interval": (bernoulli_mle, Y_BERN, {"p": 0.8}),
    "simplex": (categorical_mle, Y_CAT, {"probs": [0.6, 0.3, 0.1]}),
}


@pytest.mark.parametrize("case", list(INIT_CASES))
def test_params_start_from_the_users_initial_value(case):
    model, y, init = INIT_CASES[case]
    # a vanishing step (ρ = 1e-12) leaves every param where the fit started
    res = fit(model, (y,), num_steps=1, learning_rate=1e-12)
    for name, value in init.items():
        np.testing.assert_allclose(res.point_estimates()[name], value, atol=1e-9, err_msg=name)


def test_params_start_from_the_initial_value_in_the_first_em_step():
    # one parallel sweep updates every block from the initial state: the scale's M-step
    # uses the location's initial value, not its new one
    res = fit(normal_mle, (Y_NORMAL,), num_steps=1, schedule="parallel")
    est = res.point_estimates()
    np.testing.assert_allclose(est["loc"], Y_NORMAL.mean(), atol=1e-10)
    np.testing.assert_allclose(est["scale"], np.sqrt(np.mean((Y_NORMAL - 0.0) ** 2)), atol=1e-10)


def test_initial_values_are_never_mutated():
    w0, m0, s0, x = W0.copy(), M0.copy(), S0.copy(), X.copy()
    data = {"x": X, "w0": W0, "m0": M0, "s0": S0}
    res = fit(gmm_from, data, num_steps=1, tol=1e-300)
    np.testing.assert_array_equal(W0, w0)
    np.testing.assert_array_equal(M0, m0)
    np.testing.assert_array_equal(S0, s0)
    np.testing.assert_array_equal(X, x)
    assert set(data) == {"x", "w0", "m0", "s0"} and data["m0"] is M0
    assert not np.allclose(res.point_estimates()["locs"], M0)


def test_a_param_no_factor_uses_keeps_its_initial_value():
    def model(y):
        loc = numpyro.param("loc", 0.0)
        numpyro.param("unused", 2.5, constraint=constraints.positive)
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Normal(loc, 1.0), obs=y)

    res = fit(model, (Y_NORMAL,), tol=1e-14)
    est = res.point_estimates()
    np.testing.assert_allclose(est["loc"], Y_NORMAL.mean(), atol=1e-10)
    np.testing.assert_allclose(est["unused"], 2.5, atol=1e-14)
    assert "unused" not in res.plan.order
    assert "kept at their initial value" in res.plan.describe()


def test_a_param_with_a_latent_is_the_marginal_mle():
    # y_n ~ N(μ, σ² + τ²) after integrating μ_n ~ N(m, τ²): with latent μ_n (Gaussian, exact
    # VB posterior) and params m, σ fixed τ, EM's fixed point is the marginal MLE of m: ȳ
    def model(y):
        m = numpyro.param("m", -2.0)
        with numpyro.plate("n", y.shape[0]):
            mu = numpyro.sample("mu", dist.Normal(m, 0.8))
            numpyro.sample("y", dist.Normal(mu, 0.5), obs=y)

    res = fit(model, (Y_NORMAL,), tol=1e-14, num_steps=5000)
    assert res.converged, res.message
    np.testing.assert_allclose(res.point_estimates()["m"], Y_NORMAL.mean(), atol=1e-7)


Y_CAUCHY = np.random.default_rng(6).standard_cauchy(25) + 1.0


def cauchy_location(y):
    # far from the data, where the log likelihood is convex in the location (−log(1 + r²) is
    # convex for |r| > 1): plain Newton would step away; the safeguarded M-step climbs
    loc = numpyro.param("loc", 40.0)
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Cauchy(loc, 1.0), obs=y)


def test_m_step_on_a_non_concave_likelihood():
    def loglik(a):
        return -np.log1p((Y_CAUCHY[:, None] - a) ** 2).sum(0)

    # at the initial value the curvature is positive: Newton's plain step would go downhill
    r = Y_CAUCHY - 40.0
    assert np.sum((2 * r**2 - 2) / (1 + r**2) ** 2) > 0
    # the global maximum: a fine grid, then Newton's method from the best grid point
    grid = np.linspace(-20, 20, 400_001)
    a = grid[np.argmax(loglik(grid))]
    for _ in range(50):
        r = Y_CAUCHY - a
        g = np.sum(2 * r / (1 + r**2))
        h = np.sum((2 * r**2 - 2) / (1 + r**2) ** 2)
        a -= g / h
    res = fit(cauchy_location, (Y_CAUCHY,), tol=1e-14)
    assert res.converged, res.message
    assert [f.estimator for f in res.plan.factors] == ["delta"]  # no closed-form rule: log f at the point
    est = float(res.point_estimates()["loc"])
    # a local maximum of the likelihood, and here the global one
    np.testing.assert_allclose(est, a, atol=1e-8)


# -- point latents: unconstrained (Laplace) and constrained (MAP) modes ---------------------

A0, B0 = 3.0, 2.0
Y_POIS = np.array([2, 0, 3, 1, 4, 2, 1])


def gamma_poisson(y):
    lam = numpyro.sample("lam", dist.Gamma(A0, B0))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Poisson(lam), obs=y)


@pytest.mark.parametrize(
    "space, mode",
    [
        # posterior Gamma(a, b) with a = A0 + Σy, b = B0 + N: mode of log λ's density is a / b,
        # mode of λ's density is (a − 1) / b
        ("unconstrained", (A0 + Y_POIS.sum()) / (B0 + Y_POIS.size)),
        ("constrained", (A0 + Y_POIS.sum() - 1) / (B0 + Y_POIS.size)),
    ],
)
def test_point_space(space, mode):
    kw = {} if space == "unconstrained" else {"point_space": space}
    res = fit(gamma_poisson, (Y_POIS,), point=["lam"], tol=1e-14, **kw)
    assert res.converged, res.message
    np.testing.assert_allclose(res.point_estimates()["lam"], mode, atol=1e-8)
    names = {f.name for f in res.plan.factors}
    assert ("lam:jacobian" in names) == (space == "unconstrained")
    jacobians = {f.name for f in res.plan.factors if f.role == FactorRole.JACOBIAN}
    assert jacobians == ({"lam:jacobian"} if space == "unconstrained" else set())
    assert block_roles(res.plan.describe())["lam"] == f"point ({space})"
    # Laplace's precision on the unconstrained space: −d²/du² of the objective at the mode
    a = A0 + Y_POIS.sum() - (space == "constrained")
    b = B0 + Y_POIS.size
    # objective a·u − b·eᵘ (constrained: the density of λ at λ = eᵘ), curvature b·eᵘ = a at the mode
    np.testing.assert_allclose(1 / res.posterior["lam"].base_dist.variance, a, rtol=1e-8)


# -- bad input -------------------------------------------------------------------------------


def test_param_with_a_discrete_constraint():
    def model(y):
        k = numpyro.param("k", 2, constraint=constraints.nonnegative_integer)
        numpyro.sample("y", dist.Normal(k, 1.0), obs=y)

    with pytest.raises(ModelTraceError, match="'k'.*numpyro.sample"):
        fit(model, (Y_NORMAL,))


def test_param_initial_value_outside_its_constraint():
    def model(y):
        s = numpyro.param("s", -1.0, constraint=constraints.positive)
        numpyro.sample("y", dist.Normal(0.0, s), obs=y)

    with pytest.raises(ModelTraceError, match="'s'.*outside its constraint"):
        fit(model, (Y_NORMAL,))


def test_param_without_a_bijection():
    def model(y):
        v = numpyro.param("v", jnp.array([0.6, 0.8]), constraint=constraints.sphere)
        numpyro.sample("y", dist.Normal(v[0], 1.0), obs=y)

    with pytest.raises(FamilyError, match="'v'.*biject_to"):
        fit(model, (Y_NORMAL,))


def test_param_in_a_subsampled_plate():
    def model(y):
        with numpyro.plate("n", y.shape[0], subsample_size=10):
            loc = numpyro.param("loc", jnp.zeros(y.shape[0]), event_dim=0)
            numpyro.sample("y", dist.Normal(loc, 1.0), obs=numpyro.subsample(y, event_dim=0))

    with pytest.raises(ModelTraceError, match="'loc'.*subsample"):
        fit(model, (Y_NORMAL,))


def test_point_or_families_naming_a_param():
    with pytest.raises(FamilyError, match="'scale'.*point="):
        fit(normal_mle, (Y_NORMAL,), point=["scale"])
    with pytest.raises(FamilyError, match="'scale'.*families="):
        fit(normal_mle, (Y_NORMAL,), families={"scale": "gamma"})


def test_bad_point_space():
    with pytest.raises(BLRError, match="point_space"):
        fit(gamma_poisson, (Y_POIS,), point=["lam"], point_space="native")


# -- float32 ---------------------------------------------------------------------------------

F32_CODE = r"""
import json, sys
import jax, numpy as np
assert not jax.config.jax_enable_x64
sys.path.insert(0, "tests")
from integration import test_em as T
from blrppl import blr_fit
res = blr_fit(T.gmm, {"x": T.X.astype(np.float32)}, num_steps=T.NUM_ITER, tol=1e-30, progress_bar=False)
est = res.point_estimates()
print("RESULT" + json.dumps({
    "estimates": {k: np.asarray(v, dtype=float).tolist() for k, v in est.items()},
    "dtypes": sorted({str(np.asarray(v).dtype) for v in est.values()}),
    "elbo": np.asarray(res.elbo, dtype=float).tolist(),
}))
"""


def test_em_in_float32():
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "JAX_ENABLE_X64": "0", "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", F32_CODE], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.split("RESULT", 1)[1])
    assert result["dtypes"] == ["float32"]
    w, mu, s, _ = em_reference(NUM_ITER)[-1]
    # float32 rounding (ε ≈ 1.2e-7) accumulated over 10 iterations of sums over 300 points
    np.testing.assert_allclose(result["estimates"]["weights"], w, atol=1e-5)
    np.testing.assert_allclose(result["estimates"]["locs"], mu, atol=1e-5)
    np.testing.assert_allclose(result["estimates"]["scales"], s, atol=1e-5)
    assert np.all(np.isfinite(result["elbo"])) and np.all(np.diff(result["elbo"]) > 0)
