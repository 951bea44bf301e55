"""User code as NumPyro users write it, and bad input: every entry point normalises what it
is given or refuses it with a BLRError that names the site, option or argument.

Written in the users' idiom (``random.PRNGKey(0)``, pandas and lists as data, masks,
``obs_mask``, module-level globals read by the model), one test per reproduction of the
issue "Works on user code as users write it": each failed before the API boundary layer
(``blrppl/inputs.py``) and the fixes it names. Exact answers are conjugate closed forms
(float64).
"""

from __future__ import annotations

import pickle
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pandas as pd
import pytest
from jax import random
from numpyro import handlers
from numpyro.contrib.control_flow import scan
from numpyro.infer import Trace_ELBO
from numpyro.infer.autoguide import AutoNormal
from numpyro.infer.reparam import LocScaleReparam

from blrppl import BLR, BLRError, ModelTraceError, ObservedDataError, UnsupportedFactorError, blr_fit
from blrppl.api import plan_of

numpyro.enable_x64()

Y = np.array([1.2, 0.4, 2.1, 1.7, 0.9, 1.4])


def normal_model(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", len(y)):
        numpyro.sample("obs", dist.Normal(mu, 1.0), obs=y)


def exact_normal(y, prior_sd=1.0):
    """Posterior (mean, variance) of mu for normal_model-like models (unit noise)."""
    y = np.asarray(y)
    prec = 1.0 / prior_sd**2 + y.size
    return y.sum() / prec, 1.0 / prec


def fit(model, data, **kw):
    kw.setdefault("progress_bar", False)
    return blr_fit(model, data, **kw)


# -- 1. the compiled-fit cache sees what the model closes over ---------------------------

OBSERVED = np.array([1.0, 1.0, 1.0])
PRIOR_SD = 1.0


def global_model():
    mu = numpyro.sample("mu", dist.Normal(0.0, PRIOR_SD))
    with numpyro.plate("data", OBSERVED.shape[0]):
        numpyro.sample("obs", dist.Normal(mu, 1.0), obs=OBSERVED)


def test_cache_sees_module_globals():
    global OBSERVED, PRIOR_SD
    saved = OBSERVED, PRIOR_SD
    try:
        for obs, sd in [(np.array([1.0, 1.0, 1.0]), 1.0), (np.array([5.0, 4.0, 6.0]), 1.0), (np.array([5.0, 4.0, 6.0]), 0.1)]:
            OBSERVED, PRIOR_SD = obs, sd
            q = fit(global_model, None).posterior["mu"]
            mean, var = exact_normal(obs, sd)
            np.testing.assert_allclose([q.mean, q.variance], [mean, var], rtol=1e-10)
    finally:
        OBSERVED, PRIOR_SD = saved


def test_cache_sees_closures_and_reuses_identical_programs():
    import blrppl.engine.cache as cache

    def make(scale):
        def model(y):
            mu = numpyro.sample("mu", dist.Normal(0.0, scale))
            with numpyro.plate("data", len(y)):
                numpyro.sample("obs", dist.Normal(mu, 1.0), obs=y)

        return model

    for scale in (1.0, 3.0):
        q = fit(make(scale), {"y": Y}).posterior["mu"]
        np.testing.assert_allclose([q.mean, q.variance], exact_normal(Y, scale), rtol=1e-10)
    # the same model with new data of the same shape reuses its compiled fit
    model = make(2.0)
    fit(model, {"y": Y})
    size = len(cache._CACHE)
    q = fit(model, {"y": Y + 1.0}).posterior["mu"]
    assert len(cache._CACHE) == size
    np.testing.assert_allclose([q.mean, q.variance], exact_normal(Y + 1.0, 2.0), rtol=1e-10)


# -- 4. NaN in a covariate ---------------------------------------------------------------


def regression(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)


def test_nan_covariate_is_refused_naming_the_site_and_argument():
    X = np.ones((8, 2))
    X[3, 1] = np.nan
    with pytest.raises(ModelTraceError, match=r"site 'y'.*argument 'loc'"):
        fit(regression, {"X": X, "y": np.ones(8)})


def test_infinite_covariate_is_refused_saying_so():
    # (X @ w at the prior mean w = 0: inf × 0 is NaN; the message names infinite values too)
    X = np.ones((8, 2))
    X[3, 1] = np.inf
    with pytest.raises(ModelTraceError, match=r"site 'y'.*argument 'loc'.*NaN or infinite values"):
        fit(regression, {"X": X, "y": np.ones(8)})


class GaussianShell(dist.Distribution):
    # (NumPyro's Gaussian-shells example, as written there: parameters set in __init__, no
    # arg_constraints, so numpyro's pytree of it carries none of them)
    support = dist.constraints.real_vector

    def __init__(self, loc, radius, width):
        self.loc, self.radius, self.width = loc, radius, width
        super().__init__(batch_shape=loc.shape[:-1], event_shape=loc.shape[-1:])

    def sample(self, key, sample_shape=()):
        return jnp.zeros(sample_shape + self.shape())

    def log_prob(self, value):
        normalizer = (-0.5) * (jnp.log(2.0 * jnp.pi) + 2.0 * jnp.log(self.width))
        d = jnp.linalg.norm(value - self.loc, axis=-1)
        return normalizer - 0.5 * ((d - self.radius) / self.width) ** 2


class DeclaredShell(GaussianShell):
    arg_constraints = {
        "loc": dist.constraints.real_vector, "radius": dist.constraints.positive, "width": dist.constraints.positive,
    }


class TaggedNormal(dist.Normal):
    def __init__(self, loc, scale, width=1.0):
        self.width = width  # (kept outside the pytree: read by nothing here, refused all the same)
        super().__init__(loc, scale)


def _shells(shell):
    def model(center1, center2, radius, width):
        z = numpyro.sample("z", dist.Bernoulli(0.5), infer={"enumerate": "parallel"})
        x = numpyro.sample("x", dist.Uniform(-6.0, 6.0).expand([2]).to_event(1))
        center = jnp.stack([center1, center2])[z]
        numpyro.sample("shell", shell(center, radius, width), obs=x)

    return model


_SHELL_DATA = (jnp.array([-3.5, 0.0]), jnp.array([3.5, 0.0]), 2.0, 0.1)


def test_a_distribution_whose_pytree_drops_its_parameters_is_refused_naming_them():
    """A Distribution subclass keeping its parameters outside numpyro's pytree (no
    ``arg_constraints``): the fit evaluates densities from pytree leaves, and its
    ``log_prob`` raised AttributeError from inside the fit. Refused naming the site, the
    fields and the fix; with ``arg_constraints`` declared, the same model is planned; a
    numpyro subclass's extra field, wrapped by ``expand``, is found too."""
    with pytest.raises(UnsupportedFactorError, match=r"site 'shell'.*GaussianShell keeps 'loc', 'radius', 'width'.*arg_constraints"):
        fit(_shells(GaussianShell), _SHELL_DATA)
    plan = plan_of(_shells(DeclaredShell), _SHELL_DATA, rng_key=random.PRNGKey(0))
    assert {b.name for b in plan.blocks} == {"z", "x"}, plan.describe()

    def tagged(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        numpyro.sample("y", TaggedNormal(mu, 1.0, width=2.0).expand([len(y)]), obs=y)

    with pytest.raises(UnsupportedFactorError, match=r"site 'y'.*TaggedNormal keeps 'width'"):
        fit(tagged, (np.ones(3),))

    def shells_in_scan(y):
        # (numpyro's scan rebuilds its sites' distributions from their pytrees itself: the
        # missing field's AttributeError is read as the same cause)
        centre = numpyro.sample("centre", dist.Normal(0.0, 1.0).expand([2]).to_event(1))

        def step(carry, y_t):
            numpyro.sample("y", GaussianShell(centre, 2.0, 0.1), obs=y_t)
            return carry, None

        scan(step, None, y)

    with pytest.raises(UnsupportedFactorError, match=r"GaussianShell keeps '(loc|radius|width)'.*arg_constraints"):
        fit(shells_in_scan, (np.ones((4, 2)),))


def test_nan_prior_argument_from_data_is_refused():
    def model(scales, y):
        s = numpyro.sample("s", dist.HalfNormal(scales))
        numpyro.sample("y", dist.Normal(0.0, s), obs=y)

    with pytest.raises(ModelTraceError, match=r"site 's'.*'scale'"):
        fit(model, (np.array([1.0, np.nan]), np.ones(2)))


# -- 5. the SVI drop-in validates data on every call -------------------------------------


def poisson_model(counts):
    rate = numpyro.sample("rate", dist.Gamma(2.0, 1.0))
    with numpyro.plate("data", len(counts)):
        numpyro.sample("counts", dist.Poisson(rate), obs=counts)


@pytest.mark.parametrize(
    "bad, match",
    [(np.array([1.0, np.nan, 2.0, 0.0]), "NaN"), (np.array([1.0, -1.0, 2.0, 0.0]), "support")],
    ids=["nan", "negative-count"],
)
def test_svi_calls_validate_their_data(bad, match):
    svi = BLR(poisson_model)
    state = svi.init(random.PRNGKey(0), np.array([1.0, 3.0, 2.0, 0.0]))
    calls = {
        "update": lambda: svi.update(state, bad),
        "evaluate": lambda: svi.evaluate(state, bad),
        "run": lambda: svi.run(random.PRNGKey(1), 5, bad, init_state=state, progress_bar=False),
    }
    for name, call in calls.items():
        with pytest.raises(ObservedDataError, match=f"site 'counts'.*{match}"):
            call()
    # good data still work after a refusal
    state, loss = svi.update(state, np.array([1.0, 3.0, 2.0, 0.0]))
    assert np.isfinite(loss)


# -- 6. convergence only when the test passed ----------------------------------------------


def test_nan_learning_rate_is_refused_or_stops():
    with pytest.raises(BLRError, match="learning_rate"):
        fit(normal_model, {"y": Y}, learning_rate=lambda t: jnp.nan)
    result = fit(normal_model, {"y": Y}, learning_rate=lambda t: jnp.where(t < 3, 0.5, jnp.nan))
    assert not result.converged
    assert result.num_steps == 3 and "learning_rate" in result.message  # steps t = 0, 1, 2
    assert np.all(np.isfinite(result.elbo))


def test_improper_posterior_is_not_converged_and_names_the_latents():
    def model(y):
        a = numpyro.sample("a", dist.ImproperUniform(dist.constraints.real, (), ()))
        b = numpyro.sample("b", dist.ImproperUniform(dist.constraints.real, (), ()))
        with numpyro.plate("data", len(y)):
            numpyro.sample("obs", dist.Normal(a + b, 1.0), obs=y)

    with pytest.warns(UserWarning, match=r"'a', 'b'.*improper"):
        result = fit(model, {"y": Y}, num_steps=50)
    assert not result.converged
    assert "improper" in result.message


# -- 7. every key spelling, at every entry point ------------------------------------------

KEYS = {"PRNGKey": random.PRNGKey(0), "key": random.key(0), "seed": 0, "numpy-uint32": np.array([0, 0], np.uint32)}


@pytest.mark.parametrize("spelling", list(KEYS))
def test_blr_fit_and_result_take_every_key_spelling(spelling):
    key = KEYS[spelling]
    result = fit(normal_model, {"y": Y}, rng_key=key)
    reference = fit(normal_model, {"y": Y}, rng_key=random.key(0))
    np.testing.assert_array_equal(result.elbo, reference.elbo)
    draws = result.sample(key, 10)
    np.testing.assert_array_equal(draws["mu"], reference.sample(random.key(0), 10)["mu"])
    assert result.summary(rng_key=key, print_table=False)["mu"]["mean"].shape == ()


@pytest.mark.parametrize("spelling", ["PRNGKey", "seed"])
def test_blr_class_takes_every_key_spelling(spelling):
    key = KEYS[spelling]
    X = np.random.default_rng(0).normal(size=(20, 2))
    y = X @ np.array([1.0, -1.0]) + np.random.default_rng(1).normal(size=20)
    svi = BLR(regression, AutoNormal(regression))
    res = svi.run(key, 50, X, y, progress_bar=False)
    assert np.isfinite(res.losses[-1])
    state = svi.init(key, X, y)
    state, loss = svi.update(state, X, y)
    assert np.isfinite(loss)


@pytest.mark.parametrize("key", ["abc", 1.5, -1, np.ones(2), random.split(random.key(0), 3)])
def test_bad_keys_are_refused_by_name(key):
    with pytest.raises(BLRError, match="rng_key"):
        fit(normal_model, {"y": Y}, rng_key=key)


# -- 8. posteriors of every block kind and event rank -------------------------------------


def zoo(X, y, counts, groups):
    w1 = numpyro.sample("w1", dist.Normal(0.0, 1.0).expand([2, 3]).to_event(2))
    w2 = numpyro.sample("w2", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
    scale = numpyro.sample("scale", dist.HalfNormal(1.0).expand([2, 2]).to_event(2))
    probs = numpyro.sample("probs", dist.Dirichlet(jnp.ones(3)).expand([2]).to_event(1))
    rate = numpyro.sample("rate", dist.Gamma(2.0, 1.0))
    p = numpyro.sample("p", dist.Beta(2.0, 2.0))
    with numpyro.plate("groups", 2):
        a = numpyro.sample("a", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        z = numpyro.sample("z", dist.Bernoulli(p))
        loc = X @ w1[:, 0] + w2.sum() + a[groups, z] + z
        numpyro.sample("y", dist.Normal(loc, scale[0, 0] * scale[1, 1]), obs=y)
        numpyro.sample("counts", dist.Poisson(rate), obs=counts)
        numpyro.sample("g", dist.Categorical(probs[z]), obs=groups)


def test_posterior_of_every_site_and_block_kind():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(15, 2))
    data = {"X": X, "y": rng.normal(size=15), "counts": rng.poisson(2.0, 15).astype(float), "groups": rng.integers(0, 2, 15)}
    result = fit(zoo, data, num_steps=3)
    shapes = {"w1": (2, 3), "w2": (3,), "scale": (2, 2), "probs": (2, 3), "rate": (), "p": (), "a": (2, 2), "z": (15,)}
    assert set(result.posterior) == set(shapes)
    draws = result.sample(random.PRNGKey(1), 4)
    for site, shape in shapes.items():
        q = result.posterior[site]
        assert jnp.shape(q.mean) == shape, site
        assert jnp.shape(q.variance) == shape, site
        assert np.all(np.isfinite(q.mean)) and np.all(np.asarray(q.variance) >= 0), site
        assert draws[site].shape == (4,) + shape, site
        assert q.sample(random.PRNGKey(2), (3,)).shape == (3,) + shape, site


def eight_schools_reparam(sigma, y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
    shift = numpyro.param("shift", 0.0)
    with numpyro.plate("J", len(sigma)):
        with handlers.reparam(config={"theta": LocScaleReparam(centered=0)}):
            theta = numpyro.sample("theta", dist.Normal(mu, tau))
        numpyro.deterministic("theta_shifted", theta + shift)
        numpyro.sample("obs", dist.Normal(theta, sigma), obs=y)


def test_draws_hold_the_deterministic_sites_as_mcmc_samples_do():
    """As ``MCMC.get_samples``: ``numpyro.deterministic`` sites (here a reparameterised
    ``theta`` and one reading a ``numpyro.param``) computed from each draw of the latents;
    ``summary`` leaves them out unless asked, as numpyro's ``print_summary`` does."""
    y = np.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
    sigma = np.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])
    result = fit(eight_schools_reparam, {"sigma": sigma, "y": y}, num_steps=20)
    draws = result.sample(random.PRNGKey(1), 50)
    assert set(draws) == {"mu", "tau", "theta_decentered", "shift", "theta", "theta_shifted"}
    expected = draws["mu"][:, None] + draws["tau"][:, None] * draws["theta_decentered"]
    np.testing.assert_allclose(draws["theta"], expected, rtol=1e-5, atol=1e-5)
    shift = result.point_estimates()["shift"]
    np.testing.assert_allclose(draws["theta_shifted"], expected + shift, rtol=1e-5, atol=1e-5)
    assert set(result.summary(print_table=False)) == {"mu", "tau", "theta_decentered", "shift"}
    assert "theta" in result.summary(print_table=False, exclude_deterministic=False)


def positions_model(idx, y):
    """Sizes read from the data with NumPy, as NumPyro's annotation example reads its
    ``positions``: the model needs concrete data."""
    n = int(np.max(idx)) + 1
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0).expand([n]).to_event(1))
    numpyro.deterministic("mu2", 2.0 * mu)
    numpyro.sample("y", dist.Normal(mu[idx], 1.0), obs=y)


def test_deterministic_sites_of_a_model_that_reads_its_data_concretely():
    """``sample`` runs the model at the draws with the data as given (NumPy: the model's
    ``int(np.max(idx))`` works, as with numpyro's own Predictive), not only as JAX arrays
    (traced there under Predictive's vmap): the deterministic site is returned, no warning."""
    import warnings

    idx = np.array([0, 1, 2, 0, 1, 2])
    result = fit(positions_model, (idx, np.arange(6.0)), num_steps=20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        draws = result.sample(random.PRNGKey(1), 50)
    np.testing.assert_allclose(draws["mu2"], 2.0 * draws["mu"], rtol=1e-6)


def dirichlet_gamma_model(groups, counts):
    p = numpyro.sample("p", dist.Dirichlet(jnp.ones(3)))
    rate = numpyro.sample("rate", dist.Gamma(2.0, 1.0))
    with numpyro.plate("n", len(groups)):
        numpyro.sample("g", dist.Categorical(p), obs=groups)
        numpyro.sample("c", dist.Poisson(rate), obs=counts)


def test_draws_run_no_model_code_and_follow_the_posterior():
    """``sample`` knows from the fit's trace that the model has no deterministic sites and
    does not run it again (it traced the model at every call), a second call compiles
    nothing, and the draws follow the closed-form posteriors Dirichlet(1 + counts) and
    Gamma(2 + Σc, 1 + n) (4 standard errors of 4,000 draws; the sd within 5 %)."""
    from blrppl.runtime.counting import xla_compilations
    from blrppl.model.trace import model_runs

    rng = np.random.default_rng(0)
    groups, counts = rng.integers(0, 3, 40), rng.poisson(3.0, 40).astype(float)
    result = fit(dirichlet_gamma_model, {"groups": groups, "counts": counts})
    runs = model_runs()
    draws = result.sample(random.PRNGKey(1), 4000)
    assert model_runs() == runs
    compiled = xla_compilations()
    again = result.sample(random.PRNGKey(2), 4000)
    assert xla_compilations() == compiled
    assert not np.allclose(again["rate"], draws["rate"])
    alpha = 1.0 + np.bincount(groups, minlength=3)
    p_mean = alpha / alpha.sum()
    p_sd = np.sqrt(p_mean * (1 - p_mean) / (alpha.sum() + 1))
    np.testing.assert_array_less(np.abs(draws["p"].mean(0) - p_mean), 4 * p_sd / np.sqrt(4000))
    shape, rate = 2.0 + counts.sum(), 1.0 + len(counts)
    assert abs(draws["rate"].mean() - shape / rate) < 4 * np.sqrt(shape) / rate / np.sqrt(4000)
    np.testing.assert_allclose(draws["rate"].std(), np.sqrt(shape) / rate, rtol=0.05)


# -- 9. masks: masked NaN observations contribute nothing ----------------------------------

Y_MISSING = np.array([1.2, np.nan, 2.1, 1.7, np.nan, 1.4])
OBSERVED_PART = Y_MISSING[~np.isnan(Y_MISSING)]


def obs_mask_model(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", len(y)):
        numpyro.sample("obs", dist.Normal(mu, 1.0), obs=y, obs_mask=~np.isnan(y))


def handler_mask_model(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", len(y)), handlers.mask(mask=~jnp.isnan(y)):
        numpyro.sample("obs", dist.Normal(mu, 1.0), obs=y)


@pytest.mark.parametrize("model", [obs_mask_model, handler_mask_model], ids=["obs_mask", "handlers.mask"])
def test_masked_nan_observations(model):
    result = fit(model, {"y": Y_MISSING})
    assert result.converged, result.message
    mean, var = exact_normal(OBSERVED_PART)
    q = result.posterior["mu"]
    np.testing.assert_allclose([q.mean, q.variance], [mean, var], rtol=1e-10)
    if model is obs_mask_model:
        # the imputation latent, read by no other site, is integrated out of the fit and
        # drawn given mu: the posterior predictive N(E[mu], var(mu) + 1) at the missing
        # positions (4 sd of 20,000 draws: 0.03 sd for the mean, 0.04 for the variance), and
        # the combined site holds the data where observed
        assert result.plan.barren == ("obs_unobserved",) and "obs_unobserved" not in result.posterior
        missing = np.isnan(Y_MISSING)
        draws = result.sample(random.PRNGKey(1), 20_000)
        imputed = np.asarray(draws["obs_unobserved"])[:, missing]
        sd = np.sqrt(var + 1.0)
        np.testing.assert_array_less(np.abs(imputed.mean(0) - mean), 4 * sd / np.sqrt(20_000))
        np.testing.assert_allclose(imputed.var(0), var + 1.0, rtol=4 * np.sqrt(2 / 20_000))
        np.testing.assert_array_equal(np.asarray(draws["obs"])[:, ~missing], np.broadcast_to(OBSERVED_PART, (20_000, 4)))


def test_unmasked_nan_is_still_refused():
    with pytest.raises(ObservedDataError, match="site 'obs'.*NaN"):
        fit(normal_model, {"y": Y_MISSING})


# -- 11. data of every array-like type, options of the wrong type --------------------------


@pytest.mark.parametrize(
    "y",
    [
        Y.tolist(),
        pd.Series(Y),
        pd.Series(Y, dtype=object).values,
        jnp.asarray(Y),
        pd.DataFrame({"y": Y})["y"],
    ],
    ids=["list", "series", "object-array", "jax", "column"],
)
def test_array_likes_are_converted(y):
    q = fit(normal_model, {"y": y}).posterior["mu"]
    np.testing.assert_allclose([q.mean, q.variance], exact_normal(Y), rtol=1e-10)


@pytest.mark.parametrize(
    "data",
    [Y, jnp.asarray(Y), pd.Series(Y), pd.DataFrame({"y": Y})["y"].to_frame()],
    ids=["numpy", "jax", "series", "dataframe"],
)
def test_one_array_is_the_models_only_argument(data):
    """``blr_fit(model, y)``, as ``mcmc.run(key, y)`` passes it: the model's one positional
    argument (a DataFrame reaches the model as it is: the model reads its column). Refused
    before as neither a dict nor a tuple."""
    model = normal_model if not isinstance(data, pd.DataFrame) else _frame_model
    q = fit(model, data).posterior["mu"]
    np.testing.assert_allclose([q.mean, q.variance], exact_normal(Y), rtol=1e-10)


def _frame_model(frame):
    normal_model(jnp.asarray(frame["y"].to_numpy()))


@pytest.mark.parametrize(
    "y, error, match",
    [
        (np.array(["1.2", "0.4"]), ModelTraceError, "(?s)site 'obs'.*not numbers"),
        (Y + 1j, ObservedDataError, "complex"),
        ([1, 0, 1], ModelTraceError, "(?s)site 'obs'.*Python list"),
        # (a DataFrame reaches the model as it is; observed as an array it cannot be used)
        (pd.DataFrame({"y": Y}), ModelTraceError, r"(?s)site 'obs'.*pandas DataFrame.*\.to_numpy\(\)"),
    ],
    ids=["strings", "complex", "int-list", "dataframe"],
)
def test_unusable_data_are_refused_by_name(y, error, match):
    with pytest.raises(error, match=match):
        fit(normal_model, {"y": y})


@pytest.mark.parametrize(
    "option, match",
    [
        ({"learning_rate": "fast"}, "learning_rate"),
        ({"learning_rate": np.nan}, "learning_rate"),
        ({"families": ["mu"]}, "families"),
        ({"tol": -1}, "tol"),
        ({"tol": 0}, "tol"),
        ({"num_steps": 2.5}, "num_steps"),
        ({"num_steps": True}, "num_steps"),
        ({"schedule": 1}, "schedule"),
        ({"point": [1]}, "point"),
        ({"mc_curvature": None}, "mc_curvature"),
        ({"progress_bar": "no"}, "progress_bar"),
        ({"prior": "previous"}, "prior"),
    ],
)
def test_bad_options_are_refused_by_name(option, match):
    with pytest.raises(BLRError, match=match):
        fit(normal_model, {"y": Y}, **option)


def test_point_takes_one_name():
    result = fit(normal_model, {"y": Y}, point="mu")
    assert result.plan.block("mu").point


def test_svi_positional_form_and_autonormal_with_nan_data():
    with pytest.warns(UserWarning, match="optimiser"):
        svi = BLR(normal_model, AutoNormal(normal_model), numpyro.optim.Adam(0.01), Trace_ELBO())
    with pytest.raises(ObservedDataError, match="site 'obs'.*NaN"):
        svi.run(random.PRNGKey(0), 10, Y_MISSING, progress_bar=False)


# -- 12. threads ---------------------------------------------------------------------------


def test_concurrent_fits_from_threads():
    def scale_model(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        s = numpyro.sample("s", dist.Gamma(2.0, 1.0))
        with numpyro.plate("data", len(y)):
            numpyro.sample("obs", dist.Normal(mu, s), obs=y)

    results, errors = {}, []

    def work(i):
        try:
            model = normal_model if i % 2 else scale_model
            results[i] = fit(model, {"y": Y[: 3 + i]}, num_steps=20)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    for i in (1, 3):
        q = results[i].posterior["mu"]
        np.testing.assert_allclose([q.mean, q.variance], exact_normal(Y[: 3 + i]), rtol=1e-10)


# -- 10. bounded integer latents, mixture likelihoods, supports that depend on latents -----


def test_discrete_uniform_latent_is_enumerated_exactly():
    y = np.array([2.6, 3.4, 2.9, 3.8, 3.1])

    def model(y):
        k = numpyro.sample("k", dist.DiscreteUniform(1, 6))
        with numpyro.plate("data", len(y)):
            numpyro.sample("obs", dist.Normal(k, 1.0), obs=y)

    result = fit(model, {"y": y})
    values = np.arange(1, 7)
    log_post = np.array([-0.5 * np.sum((y - k) ** 2) for k in values])
    exact = np.exp(log_post - log_post.max())
    exact /= exact.sum()
    q = result.posterior["k"]
    np.testing.assert_allclose(q.probs, exact, atol=1e-10)
    np.testing.assert_allclose(q.mean, exact @ values, atol=1e-10)
    np.testing.assert_allclose(q.variance, exact @ values**2 - (exact @ values) ** 2, atol=1e-10)
    draws = q.sample(random.PRNGKey(0), (200,))
    assert draws.min() >= 1 and draws.max() <= 6


def test_mixture_same_family_likelihood_against_a_grid():
    rng = np.random.default_rng(4)
    y = np.concatenate([rng.normal(-2.0, 1.0, 18), rng.normal(2.0, 1.0, 42)])

    def model(y):
        loc = numpyro.sample("loc", dist.Normal(jnp.array([-1.0, 1.0]), 2.0).to_event(1))
        mix = dist.MixtureSameFamily(dist.Categorical(probs=jnp.array([0.3, 0.7])), dist.Normal(loc, 1.0))
        with numpyro.plate("data", len(y)):
            numpyro.sample("obs", mix, obs=y)

    result = fit(model, {"y": y}, rng_key=random.PRNGKey(1))
    # the exact posterior on a grid (one mode: the unequal weights and the prior order the
    # components; the swapped mode has a likelihood e^-20 times smaller)
    g = np.linspace(-4.0, 4.0, 401)
    a, b = np.meshgrid(g, g, indexing="ij")
    comp = -0.5 * (y[None, None, :] - np.stack([a, b])[..., None]) ** 2
    loglik = np.logaddexp(np.log(0.3) + comp[0], np.log(0.7) + comp[1]).sum(-1)
    logp = loglik - 0.5 * ((a + 1.0) ** 2 + (b - 1.0) ** 2) / 4.0
    w = np.exp(logp - logp.max())
    w /= w.sum()
    mean = np.array([(w * a).sum(), (w * b).sum()])
    sd = np.sqrt(np.array([(w * a**2).sum(), (w * b**2).sum()]) - mean**2)
    q = result.posterior["loc"]
    # Monte Carlo messages (16 draws a step, decaying steps): means within 0.15 sd
    assert np.all(np.abs(np.asarray(q.mean) - mean) < 0.15 * sd), (q.mean, mean, sd)
    assert np.all(np.abs(np.sqrt(np.asarray(q.variance)) / sd - 1.0) < 0.2), (np.sqrt(q.variance), sd)


def test_change_point_with_a_global_categorical():
    rng = np.random.default_rng(5)
    y = np.concatenate([rng.poisson(2.0, 25), rng.poisson(7.0, 25)]).astype(float)

    def model(y):
        early = numpyro.sample("early", dist.Exponential(0.2))
        late = numpyro.sample("late", dist.Exponential(0.2))
        tau = numpyro.sample("tau", dist.Categorical(logits=jnp.zeros(len(y))))
        rate = jnp.where(jnp.arange(len(y)) < tau, early, late)
        with numpyro.plate("data", len(y)):
            numpyro.sample("obs", dist.Poisson(rate), obs=y)

    result = fit(model, {"y": y})
    # exact p(tau | y): the rates integrate out (Gamma(1, 0.2) priors, Poisson counts)
    from scipy.special import gammaln

    def log_marginal(c):
        return gammaln(1.0 + c.sum()) - (1.0 + c.sum()) * np.log(0.2 + c.size) - gammaln(c + 1).sum()

    log_post = np.array([log_marginal(y[:t]) + log_marginal(y[t:]) for t in range(len(y))])
    assert int(np.argmax(result.posterior["tau"].probs)) == int(np.argmax(log_post))
    t = int(np.argmax(log_post))
    for site, part in [("early", y[:t]), ("late", y[t:])]:
        exact_mean = (1.0 + part.sum()) / (0.2 + part.size)
        assert abs(float(result.posterior[site].mean) - exact_mean) < 0.1 * exact_mean


def test_support_depending_on_a_latent_is_refused():
    def model(y):
        b = numpyro.sample("b", dist.Gamma(2.0, 1.0))
        x = numpyro.sample("x", dist.Uniform(0.0, b))
        numpyro.sample("obs", dist.Normal(x, 1.0), obs=y)

    from blrppl import UnsupportedLatentError

    with pytest.raises(UnsupportedLatentError, match=r"'x'.*depends on.*'b'") as info:
        fit(model, {"y": 0.5})
    assert info.value.site == "x"


def test_data_bounded_by_a_latent_is_refused():
    """``y ~ Uniform(0, b)`` observed, ``b`` latent: the data bound b (b ≥ max y), which
    numpyro's log_prob does not score (without the bound b would shrink to 0)."""

    def model(y):
        b = numpyro.sample("b", dist.Gamma(2.0, 0.1))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Uniform(0.0, b), obs=y)

    from blrppl import UnsupportedFactorError

    with pytest.raises(UnsupportedFactorError, match=r"'y'.*depends on.*'b'") as info:
        fit(model, {"y": jnp.array([0.5, 3.0, 6.5])})
    assert info.value.site == "y"


def test_support_from_the_data_follows_the_data():
    def model(upper, y):
        x = numpyro.sample("x", dist.Uniform(0.0, upper))
        numpyro.sample("obs", dist.Normal(x, 0.1), obs=y)

    for upper in (1.0, 10.0):
        result = fit(model, {"upper": jnp.asarray(upper), "y": jnp.asarray(5.0)})
        draws = result.sample(random.PRNGKey(0), 500)["x"]
        assert float(draws.max()) < upper
        if upper == 10.0:
            assert abs(float(draws.mean()) - 5.0) < 0.05


# -- 2. mixtures start where their prior points ---------------------------------------------

MIX_Y = np.concatenate(
    [np.random.default_rng(6).normal(m, 1.0, 40) for m in (-4.0, 0.3, 4.5)]
)
PRIOR_LOCS = np.array([-5.0, 0.0, 5.0])


def ordered_mixture(y):
    weights = numpyro.sample("weights", dist.Dirichlet(jnp.ones(3)))
    locs = numpyro.sample("locs", dist.Normal(PRIOR_LOCS, 2.0).to_event(1))
    with numpyro.plate("data", len(y)):
        z = numpyro.sample("z", dist.Categorical(weights))
        numpyro.sample("obs", dist.Normal(locs[z], 1.0), obs=y)


def cavi_from_prior(y, iters=500):
    """Textbook coordinate-ascent VB (Bishop §10.2 with a known unit noise), started by an
    E-step at the prior means: the prior-ordered fixed point."""
    from scipy.special import digamma

    m, v, alpha = PRIOR_LOCS.copy(), np.ones(3), np.full(3, 1.5)
    for _ in range(iters):
        logr = digamma(alpha) - digamma(alpha.sum()) - 0.5 * (y[:, None] - m) ** 2 - 0.5 * v
        r = np.exp(logr - logr.max(1, keepdims=True))
        r /= r.sum(1, keepdims=True)
        alpha = 1.0 + r.sum(0)
        prec = 0.25 + r.sum(0)
        m, v = (PRIOR_LOCS / 4.0 + r.T @ y) / prec, 1.0 / prec
    return m, v, alpha


def test_mixture_reaches_the_prior_ordered_optimum_from_every_key():
    m, v, alpha = cavi_from_prior(MIX_Y)
    assert np.all(np.diff(m) > 0)
    for seed in range(10):
        result = fit(ordered_mixture, {"y": MIX_Y}, rng_key=random.PRNGKey(seed), tol=1e-12, refine=False)
        assert result.converged, result.message
        q = result.posterior["locs"]
        np.testing.assert_allclose(q.mean, m, atol=1e-6, err_msg=f"key {seed}")
        np.testing.assert_allclose(np.diag(q.covariance_matrix), v, atol=1e-6)
        np.testing.assert_allclose(result.posterior["weights"].concentration, alpha, atol=1e-5)


def test_exchangeable_mixture_finds_the_clusters_and_num_starts_keeps_the_best():
    def exchangeable(y):
        weights = numpyro.sample("weights", dist.Dirichlet(jnp.ones(3)))
        locs = numpyro.sample("locs", dist.Normal(0.0, 10.0).expand([3]).to_event(1))
        with numpyro.plate("data", len(y)):
            z = numpyro.sample("z", dist.Categorical(weights))
            numpyro.sample("obs", dist.Normal(locs[z], 1.0), obs=y)

    single = [fit(exchangeable, {"y": MIX_Y}, rng_key=seed) for seed in range(3)]
    best = fit(exchangeable, {"y": MIX_Y}, rng_key=0, num_starts=3)
    assert "best of 3 starts" in best.message
    assert best.elbo[-1] >= max(r.elbo[-1] for r in single) - 1e-6
    centres = np.sort(np.asarray(best.posterior["locs"].mean))
    np.testing.assert_allclose(centres, [MIX_Y[:40].mean(), MIX_Y[40:80].mean(), MIX_Y[80:].mean()], atol=0.3)


# -- 3. a log link far below its data --------------------------------------------------------


@pytest.mark.parametrize("rate", [7e4, 1e6, 1e9])
def test_poisson_log_link_with_large_counts(rate):
    def model(X, counts):
        a = numpyro.sample("a", dist.Normal(0.0, 1.0))
        b = numpyro.sample("b", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", len(counts)):
            numpyro.sample("counts", dist.Poisson(jnp.exp(a + b * X)), obs=counts)

    rng = np.random.default_rng(7)
    X = rng.normal(size=40)
    counts = rng.poisson(rate * np.exp(0.1 * X)).astype(float)
    result = fit(model, (X, counts))
    assert result.converged, result.message
    # the posterior sds are about 1/sqrt(40 * rate): the means are the Poisson GLM's MLE
    # (the N(0, 1) priors move them by less than 1e-4 sd)
    import scipy.optimize

    def nll(theta):
        eta = theta[0] + theta[1] * X
        return np.sum(np.exp(eta) - counts * eta)

    mle = scipy.optimize.minimize(nll, [np.log(counts.mean()), 0.0], method="Newton-CG",
                                  jac=lambda t: np.array([np.sum(np.exp(t[0] + t[1] * X) - counts),
                                                          np.sum((np.exp(t[0] + t[1] * X) - counts) * X)]),
                                  hess=lambda t: np.array([[np.sum(np.exp(t[0] + t[1] * X)), np.sum(np.exp(t[0] + t[1] * X) * X)],
                                                           [np.sum(np.exp(t[0] + t[1] * X) * X), np.sum(np.exp(t[0] + t[1] * X) * X**2)]]),
                                  options={"xtol": 1e-14}).x
    sd = 1.0 / np.sqrt(40 * rate)
    assert abs(float(result.posterior["a"].mean) - mle[0]) < 0.05 * sd
    assert abs(float(result.posterior["b"].mean) - mle[1]) < 0.05 * sd


def imputed_with_masked_prior(x):
    """NumPyro's imputation idiom (its ``bayesian_imputation`` example): the missing entries
    drawn with ``.mask(False)`` (no density of their own) and placed into the observed
    covariate, whose density is the only one they have."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    missing = np.flatnonzero(np.isnan(x))
    x_impute = numpyro.sample("x_impute", dist.Normal(mu, 1.0).expand([missing.size]).mask(False))
    x = jnp.asarray(x).at[missing].set(x_impute)
    numpyro.sample("x", dist.Normal(mu, 1.0), obs=x)


def test_masked_out_prior_of_an_imputed_latent_is_not_counted():
    """``x_impute``'s prior is masked out, as numpyro scores it: the posterior is that of
    the observed site alone (before: its prior was counted too, every imputed entry's
    variance halved, NumPyro's example's scale 2.5 NUTS sd too small). Linear-Gaussian:
    exact in one step; the joint posterior of (mu, x_impute) is computed here."""
    x = np.array([0.3, np.nan, 1.2, -0.4, np.nan, 0.8])
    r = blr_fit(imputed_with_masked_prior, {"x": x}, rng_key=random.PRNGKey(0), progress_bar=False)
    assert r.converged, r.message
    seen = x[~np.isnan(x)]
    # mu | seen ~ N(m, v) with prior N(0, 10²), each x_impute | mu ~ N(mu, 1)
    v = 1.0 / (1.0 / 100.0 + seen.size)
    m = v * seen.sum()
    np.testing.assert_allclose(float(r.posterior["mu"].mean), m, rtol=1e-8)
    np.testing.assert_allclose(np.asarray(r.posterior["x_impute"].mean), [m, m], rtol=1e-8)
    np.testing.assert_allclose(np.asarray(r.posterior["x_impute"].variance), [v + 1.0, v + 1.0], rtol=1e-8)


# -- counts with per-row totals ----------------------------------------------------------------


def test_total_count_is_data_in_the_stand_ins():
    """numpyro keeps a Multinomial's ``total_count`` as pytree metadata; its stand-in holds it
    as a leaf (the same density), so per-row totals computed from traced data can be carried."""
    from blrppl.graph.stable import counts_as_data

    logits = jnp.array([[0.1, -0.3, 0.5], [1.0, 0.0, -1.0]])
    totals = jnp.array([4, 6])
    value = jnp.array([[1.0, 1.0, 2.0], [5.0, 0.0, 1.0]])
    for d in (
        dist.Multinomial(totals, logits=logits),
        dist.Multinomial(totals, probs=jax.nn.softmax(logits)),
        dist.DirichletMultinomial(jnp.exp(logits), total_count=totals),
    ):
        stand_in = counts_as_data(d)
        assert type(stand_in) is not type(d) and isinstance(stand_in, type(d))
        assert any(leaf is totals for leaf in jax.tree.leaves(stand_in))
        np.testing.assert_allclose(jax.jit(lambda q, v: q.log_prob(v))(stand_in, value), d.log_prob(value), rtol=1e-12)
        assert type(pickle.loads(pickle.dumps(stand_in))) is type(stand_in)
    normal = dist.Normal(0.0, 1.0)
    assert counts_as_data(normal) is normal


def test_counts_with_per_row_totals_fit():
    """``Multinomial(counts.sum(-1), ...)`` and ``DirichletMultinomial(..., total_count=...)``
    as users write them for rows of counts with different totals: the totals are computed from
    the traced data (a JAX TypeError out of the compiled loop before). The Dirichlet case is
    exact in tests/integration/test_conjugate.py; here a softmax regression and a Dirichlet-multinomial
    with Gamma concentrations follow the data's shares."""
    rng = np.random.default_rng(0)
    counts = rng.multinomial(12, [0.2, 0.3, 0.5], 40).astype(float)
    counts[::3] = rng.multinomial(5, [0.2, 0.3, 0.5], len(counts[::3]))

    def softmax_regression(counts):
        b = numpyro.sample("b", dist.Normal(0.0, 3.0).expand([3]).to_event(1))
        with numpyro.plate("rows", counts.shape[0]):
            numpyro.sample("counts", dist.Multinomial(counts.sum(-1), logits=b), obs=counts)

    def dirichlet_multinomial(counts):
        conc = numpyro.sample("conc", dist.Gamma(2.0, 0.5).expand([3]).to_event(1))
        with numpyro.plate("rows", counts.shape[0]):
            numpyro.sample("counts", dist.DirichletMultinomial(conc, total_count=counts.sum(-1)), obs=counts)

    shares = counts.sum(0) / counts.sum()
    r = fit(softmax_regression, {"counts": counts}, rng_key=random.PRNGKey(0))
    b = np.asarray(r.posterior["b"].mean)
    np.testing.assert_allclose(np.exp(b) / np.exp(b).sum(), shares, atol=0.02)
    r = fit(dirichlet_multinomial, {"counts": counts}, rng_key=random.PRNGKey(0))
    conc = np.asarray(r.sample(random.PRNGKey(1), 200)["conc"]).mean(0)
    np.testing.assert_allclose(conc / conc.sum(), shares, atol=0.05)


@jax.custom_vjp
def softplus_with_rule(x):
    """softplus with its derivative given as a reverse-mode rule only (jax.custom_vjp)."""
    return jnp.logaddexp(x, 0.0)


softplus_with_rule.defvjp(lambda x: (softplus_with_rule(x), x), lambda x, g: (g * jax.nn.sigmoid(x),))


def poisson_walk(y, link=softplus_with_rule):
    s = numpyro.sample("s", dist.HalfNormal(1.0))

    def step(h, y_t):
        h = numpyro.sample("h", dist.Normal(h, s))
        numpyro.sample("y", dist.Poisson(link(h)), obs=y_t)
        return h, None

    scan(step, 0.0, y)


def test_a_link_with_a_custom_vjp_rule_fits_as_its_plain_form():
    """JAX takes no forward-mode derivative through a jax.custom_vjp function, and the fit's
    second derivatives (the Monte Carlo messages' Hessian-vector products, the dependency
    audit of a scan) are forward over reverse: such a model is compiled again reverse over
    reverse. A Poisson walk whose rate is a softplus with a custom rule takes the same steps
    as the same walk with jnp.logaddexp (the same draws: equal to rounding). It raised
    JAX's TypeError."""
    y = np.random.default_rng(0).poisson(2.0, 30).astype(float)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the walk's scale is a funnel: the poor-q warning says so)
        # (the first fits' steps: refine=False, which also spares the refinement's grid, 14 s each)
        ruled = blr_fit(poisson_walk, (y,), rng_key=random.PRNGKey(0), progress_bar=False, refine=False)
        plain = blr_fit(lambda y: poisson_walk(y, lambda h: jnp.logaddexp(h, 0.0)), (y,), rng_key=random.PRNGKey(0),
                        progress_bar=False, refine=False)
    assert ruled.num_steps == plain.num_steps
    for name in plain.params:
        np.testing.assert_allclose(ruled.params[name], plain.params[name], rtol=1e-10, atol=1e-12)


def decay(y, ts, solve=True):
    """An exponential decay dz/dt = −k z from z(0) = 2 observed with noise: solved by JAX's
    ODE solver as NumPyro's ODE example does (odeint has a custom_vjp rule), or in closed form."""
    from jax.experimental.ode import odeint

    k = numpyro.sample("k", dist.LogNormal(0.0, 1.0))
    if solve:
        z = odeint(lambda z, t, k: -k * z, jnp.array([2.0]), ts, k, rtol=1e-10, atol=1e-10)[:, 0]
    else:
        z = 2.0 * jnp.exp(-k * ts)
    numpyro.sample("y", dist.Normal(z, 0.1), obs=y)


def test_an_ode_solved_by_odeint_fits_as_its_closed_form():
    """odeint's reverse-mode rule solves the adjoint ODE with odeint again, so reverse over
    reverse differentiates it: the fit equals the closed-form model's to the fits' own
    tolerance (both stop at a relative ELBO change below 1e-8, from k's median: the solved
    one after 26 steps, the closed form after 6; measured 1.1e-6 relative on q's variance,
    8e-8 on its mean). It raised JAX's TypeError."""
    ts = jnp.linspace(0.0, 3.0, 6)
    y = 2.0 * np.exp(-0.7 * np.asarray(ts)) + 0.1 * np.random.default_rng(0).normal(size=6)
    solved = blr_fit(decay, (y, ts), rng_key=random.PRNGKey(0), progress_bar=False)
    exact = blr_fit(decay, (y, ts, False), rng_key=random.PRNGKey(0), progress_bar=False)
    assert solved.converged, solved.message
    for name in exact.params:
        np.testing.assert_allclose(solved.params[name], exact.params[name], rtol=1e-5)


def test_a_custom_vjp_rule_that_cannot_be_differentiated_again_is_named():
    """A rule whose backward pass runs a lax.while_loop (which JAX differentiates forward
    only): neither forward over reverse nor reverse over reverse exists, and the error names
    the site, the construct and what to write instead (it was JAX's TypeError)."""

    def looped_sigmoid(x):
        return jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (jax.nn.sigmoid(x) + 0.0 * c[0], c[1] + 1), (x, 0))[0]

    @jax.custom_vjp
    def link(x):
        return jnp.logaddexp(x, 0.0)

    link.defvjp(lambda x: (link(x), x), lambda x, g: (g * looped_sigmoid(x),))
    y = np.random.default_rng(0).poisson(2.0, 30).astype(float)
    with pytest.raises(UnsupportedFactorError, match="'y' calls a function with a custom reverse-mode derivative only"):
        blr_fit(lambda y: poisson_walk(y, link), (y,), rng_key=random.PRNGKey(0), progress_bar=False)


SCALE = 1.0


def scaled_normal(y):
    """Normal–normal with the likelihood scaled by the module's SCALE (a Python float that
    numpyro's ``handlers.scale`` keeps outside the traced program)."""
    a = numpyro.sample("a", dist.Normal(0.0, 5.0))
    with numpyro.plate("n", len(y)), handlers.scale(scale=SCALE):
        numpyro.sample("y", dist.Normal(a, 1.0), obs=y)


def test_a_scale_or_mask_given_as_a_python_value_is_part_of_the_compiled_fit():
    """``handlers.scale(scale=c)`` and ``handlers.mask(mask=flag)`` with c and flag Python
    values (closed over, or a module global changed between fits) are no operation of the
    traced program: a fit compiled for another value was reused (in this process and from the
    program store in the next), and the posterior was the first value's, silently. Each fit
    is now its exact conjugate posterior: precision 1/25 + c·N, or 1/25 without the prior
    masked out."""
    y = np.random.default_rng(6).normal(1.0, 1.0, 37)

    def with_prior(flag):
        def model(y):
            with handlers.mask(mask=flag):
                a = numpyro.sample("a", dist.Normal(0.0, 5.0))
            numpyro.sample("y", dist.Normal(a, 1.0).expand([len(y)]).to_event(1), obs=y)

        return model

    try:
        for scale in (1.0, 4.0, 10.0):
            globals()["SCALE"] = scale  # (as a user edits a module constant between fits)
            fit = blr_fit(scaled_normal, (y,), rng_key=random.PRNGKey(0), progress_bar=False)
            variance = float(fit.posterior["a"].variance)
            np.testing.assert_allclose(variance, 1.0 / (1.0 / 25.0 + scale * len(y)), rtol=1e-10)
    finally:
        globals()["SCALE"] = 1.0
    # (the prior masked out: the likelihood alone, precision N)
    for flag in (True, False):
        fit = blr_fit(with_prior(flag), (y,), rng_key=random.PRNGKey(0), progress_bar=False)
        precision = (1.0 / 25.0 if flag else 0.0) + len(y)
        np.testing.assert_allclose(float(fit.posterior["a"].variance), 1.0 / precision, rtol=1e-10)


@pytest.mark.parametrize("log_density", [0.0, "square"])
def test_a_latent_delta_site_is_refused_by_name(log_density):
    """``numpyro.sample("d", dist.Delta(v, log_density=...))`` unobserved: a point mass at a
    function of other sites, with no posterior of its own. Fitted as a latent, its
    log_density was dropped (the posterior of ``a`` was the one without it, reported exact) or
    the fit stopped at its first step; it is refused, naming the site and the rewrite."""

    def model(y):
        a = numpyro.sample("a", dist.Normal(0.0, 1.0))
        density = -(a**2) if log_density == "square" else log_density
        d = numpyro.sample("d", dist.Delta(2.0 * a, log_density=density))
        numpyro.sample("y", dist.Normal(d, 1.0), obs=y)

    with pytest.raises(BLRError, match=r"'d' is a latent Delta site.*numpyro.deterministic\('d', value\)"):
        blr_fit(model, (jnp.array([1.0, 2.0, 3.0]),), rng_key=random.PRNGKey(0), progress_bar=False)


def weibull_times(y):
    """Weibull survival times with Gamma priors on the concentration and the scale."""
    k = numpyro.sample("k", dist.Gamma(2.0, 1.0))
    lam = numpyro.sample("lam", dist.Gamma(2.0, 1.0))
    with numpyro.plate("N", len(y)):
        numpyro.sample("y", dist.Weibull(lam, k), obs=y)


def test_a_start_whose_expectations_overflow_is_narrowed_and_the_fit_is_the_posterior():
    """From the default start (unit variances on log k and log λ) the Weibull's (y/λ)^k
    overflows at the quadrature's outer nodes: no step size kept the ELBO finite and the fit
    stopped after 0 steps, returning its start. A fresh start that takes no step is started
    again with its Gaussian blocks narrowed; the fit then matches the exact posterior of
    (log k, log λ) (quadrature on a 601² grid): means within 0.05 sd and sds within 5 %
    (a Gaussian q of a nearly Gaussian posterior: measured 0.002 sd and 0.984×)."""
    y = np.random.default_rng(1).weibull(2.0, size=60) * 3.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no stop warning: the fit converged)
        fit = blr_fit(weibull_times, (y,), rng_key=random.PRNGKey(0), progress_bar=False)
    assert fit.converged and fit.num_steps > 0, fit.message
    mean, cov = np.asarray(fit.params["(k, lam)_blr_mean"]), np.asarray(fit.params["(k, lam)_blr_cov"])
    u, v = np.meshgrid(np.linspace(-1.0, 2.0, 601), np.linspace(0.3, 1.9, 601), indexing="ij")
    k, lam = np.exp(u), np.exp(v)
    logp = np.log(k) - k + np.log(lam) - lam + u + v  # (Gamma(2, 1) priors, the logs' Jacobians)
    logp = logp + len(y) * (np.log(k) - k * np.log(lam)) + (k - 1) * np.log(y).sum()
    logp = logp - np.sum(np.exp(k[..., None] * (np.log(y) - np.log(lam)[..., None])), -1)
    w = np.exp(logp - logp.max())
    w /= w.sum()
    exact_mean = np.array([np.sum(w * u), np.sum(w * v)])
    exact_sd = np.sqrt(np.array([np.sum(w * u**2), np.sum(w * v**2)]) - exact_mean**2)
    assert np.all(np.abs(mean - exact_mean) <= 0.05 * exact_sd), (mean, exact_mean, exact_sd)
    np.testing.assert_allclose(np.sqrt(np.diag(cov)), exact_sd, rtol=0.05)


def _blocked_draw(y):
    a = numpyro.sample("a", dist.Normal(0.0, 5.0))
    with handlers.block():
        numpyro.sample("hidden", dist.Normal(0.0, 1.0))
    numpyro.sample("y", dist.Normal(a, 1.0).expand([len(y)]).to_event(1), obs=y)


def _stax_module(x, y):
    from jax.example_libraries.stax import Dense

    net = numpyro.module("nn", Dense(1), (x.shape[1],))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    numpyro.sample("y", dist.Normal(net(x).squeeze(-1), sigma).to_event(1), obs=y)


@pytest.mark.parametrize(
    "model, match",
    [
        # (a site numpyro hides from the trace still draws with a key, which no run has: the
        # message said only "AssertionError")
        (_blocked_draw, r"random value that is no site of its trace \(a sample site inside handlers.block"),
        # (numpyro.module's weights, one param holding a pytree: it blamed the data)
        (_stax_module, r"param 'nn\$params' holds a pytree of arrays \(numpyro.module"),
    ],
)
def test_draws_outside_the_trace_and_network_modules_are_named(model, match):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(30, 4)), rng.normal(size=30)
    args = (y,) if model is _blocked_draw else (x, y)
    with pytest.raises(BLRError, match=match):
        blr_fit(model, args, rng_key=random.PRNGKey(0), progress_bar=False)
