"""Bad input: every error derives from BLRError and names the site (DESIGN.md §7)."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.contrib.control_flow import scan

import blrppl
from blrppl.api import blr_fit
from blrppl.errors import (
    BLRError,
    FamilyError,
    InitValueError,
    ModelTraceError,
    ObservedDataError,
    ResourceError,
    UnsupportedLatentError,
    is_out_of_memory,
)
from blrppl.engine import build as build_module
from blrppl.engine import run as run_module


def fit(model, data, **kw):
    return blr_fit(model, data, rng_key=jax.random.key(0), progress_bar=False, **kw)


def normal_gamma(y):
    tau = numpyro.sample("tau", dist.Gamma(2.0, 1.0))
    mu = numpyro.sample("mu", dist.Normal(0.0, 1 / jnp.sqrt(tau)))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y_obs", dist.Normal(mu, 1 / jnp.sqrt(tau)), obs=y)


Y = np.array([0.3, -1.2, 2.1, 0.8, 1.5])


def test_error_hierarchy():
    for cls in (
        ModelTraceError,
        UnsupportedLatentError,
        ObservedDataError,
        FamilyError,
        blrppl.UnsupportedFactorError,
    ):
        assert issubclass(cls, BLRError)
    assert blrppl.BLRError is BLRError


# ---------------------------------------------------------------------------------------
# unsupported latents
# ---------------------------------------------------------------------------------------


def test_latent_poisson_is_unsupported():
    def model(y):
        count = numpyro.sample("n_events", dist.Poisson(3.0))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Normal(count, 1.0), obs=y)

    with pytest.raises(UnsupportedLatentError, match="n_events") as info:
        fit(model, {"y": Y})
    assert isinstance(info.value, BLRError)
    assert info.value.site == "n_events"


# ---------------------------------------------------------------------------------------
# observed data
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("container", ["numpy", "jax"])
def test_non_finite_observed_data(bad, container):
    y = Y.copy()
    y[2] = bad
    if container == "jax":
        y = jnp.asarray(y)
    with pytest.raises(ObservedDataError, match="y_obs") as info:
        fit(normal_gamma, {"y": y})
    assert isinstance(info.value, BLRError)
    assert info.value.site == "y_obs"


def test_non_finite_observed_data_positional():
    y = Y.copy()
    y[0] = np.nan
    with pytest.raises(ObservedDataError, match="y_obs"):
        fit(normal_gamma, (y,))


def test_finite_data_that_overflows_stops_with_a_warning():
    """An observation finite in the data but whose square overflows (1e200 in float64):
    the fit cannot continue, keeps its last valid state and says why in a warning, not
    only in ``result.message``."""

    def model(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu, sigma), obs=y)

    with pytest.warns(UserWarning, match="no step size found") as record:
        result = blr_fit(model, {"y": np.array([1.0, 2.0, 1e200])}, rng_key=jax.random.PRNGKey(0), progress_bar=False)
    assert not result.converged and "check the data" in result.message
    assert not any("improper" in str(w.message) for w in record)  # the data, not the priors
    assert np.isfinite(result.posterior["mu"].mean)


def test_misshaped_observed_data():
    """DESIGN.md §7: mis-shaped observed data is an error naming the site."""

    def model(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with numpyro.plate("n", 4):
            numpyro.sample("y_obs", dist.Normal(mu, 1.0), obs=y)

    with pytest.raises(ObservedDataError, match="y_obs"):
        fit(model, {"y": np.ones(5)})


@pytest.mark.parametrize(
    "case",
    ["bernoulli-2", "categorical-5", "poisson-negative"],
)
def test_observed_data_outside_support(case):
    def bernoulli(y):
        p = numpyro.sample("p", dist.Beta(1.0, 1.0))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y_obs", dist.Bernoulli(p), obs=y)

    def categorical(y):
        pi = numpyro.sample("pi", dist.Dirichlet(jnp.ones(3)))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y_obs", dist.Categorical(pi), obs=y)

    def poisson(y):
        lam = numpyro.sample("lam", dist.Gamma(1.0, 1.0))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y_obs", dist.Poisson(lam), obs=y)

    model, y = {
        "bernoulli-2": (bernoulli, np.array([0.0, 1.0, 2.0])),
        "categorical-5": (categorical, np.array([0, 1, 5])),
        "poisson-negative": (poisson, np.array([1.0, -3.0, 2.0])),
    }[case]
    with pytest.raises(ObservedDataError, match="y_obs"):
        fit(model, {"y": y})


# ---------------------------------------------------------------------------------------
# models that cannot be traced, bad data types
# ---------------------------------------------------------------------------------------


def test_model_that_raises_names_last_site():
    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        mean = X @ w  # X has 4 columns: shape mismatch
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Normal(mean, 1.0), obs=y)

    x = np.ones((5, 4))
    with pytest.raises(ModelTraceError, match="'w'") as info:
        fit(model, {"X": x, "y": Y})
    assert isinstance(info.value, BLRError)
    assert info.value.site == "w"


def _negative_prior_scale(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, -1.0))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y_obs", dist.Normal(mu, 1.0), obs=y)


def _negative_scale_inside_to_event(y):
    w = numpyro.sample("w", dist.Normal(0.0, -2.0).expand([3]).to_event(1))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y_obs", dist.Normal(w.sum(), 1.0), obs=y)


def _negative_observation_scale(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y_obs", dist.Normal(mu, -0.5), obs=y)


def _negative_concentration_array(y):
    # (an array built in the model is computed in the traced run, not a constant numpyro checks)
    p = numpyro.sample("p", dist.Dirichlet(jnp.array([1.0, -1.0, 2.0])))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y_obs", dist.Normal(p[0], 1.0), obs=y)


def _scale_from_a_real_latent(y):
    sigma = numpyro.sample("sigma", dist.Normal(0.0, 1.0))  # (meant: HalfNormal; its prior mean 0 is no scale)
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y_obs", dist.Normal(0.0, sigma), obs=y)


def _covariance_not_positive_definite(y):
    w = numpyro.sample("w", dist.MultivariateNormal(jnp.zeros(2), jnp.array([[1.0, 2.0], [2.0, 1.0]])))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y_obs", dist.Normal(w[0] + w[1], 1.0), obs=y)


@pytest.mark.parametrize(
    "model, site, match",
    [
        (_negative_prior_scale, "mu", r"Normal distribution got invalid scale parameter \(it must satisfy Positive"),
        (_negative_scale_inside_to_event, "w", "Normal distribution got invalid scale parameter"),
        (_negative_observation_scale, "y_obs", "Normal distribution got invalid scale parameter"),
        (_covariance_not_positive_definite, "w", "NaN.*not positive definite"),
        (_negative_concentration_array, "p", "Dirichlet distribution got invalid concentration parameter"),
        (_scale_from_a_real_latent, "y_obs", "invalid scale parameter.*starting point.*HalfNormal"),
    ],
)
def test_invalid_constant_arguments_are_refused_naming_their_site(model, site, match):
    """A distribution argument that breaks its constraint at the model's starting point: a
    ModelTraceError naming the site (numpyro's own check, made as the distribution is built,
    named the site before it, a plate, or none, and skipped arrays computed in the model; it
    is now made in the model's traced run: see blrppl.model.checks.argument_checks). The fit
    stopped with "no step size found" on the array (every expected log-density non-finite)."""
    with pytest.raises(ModelTraceError, match=match) as info:
        fit(model, {"y": Y})
    assert info.value.site == site


def test_a_nan_log_density_with_valid_arguments_is_refused_naming_its_site():
    """Arguments inside their constraints (an infinite location is not checked when computed
    in the model, an infinite scale is positive) whose log-density is NaN: (y − ∞)/∞."""

    def model(y, s):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y_obs", dist.Normal(mu + s, s), obs=y)

    with pytest.raises(ModelTraceError, match="log-density of Normal is NaN at 5 element") as info:
        fit(model, {"y": Y, "s": np.array(np.inf)})
    assert info.value.site == "y_obs"


def test_invalid_hyperparameters_passed_as_data_are_refused():
    """Hyperparameters given as data (NumPy arrays, traced in the model's run) are checked as
    constants are, in each of the forms a user passes them."""

    def model(y, concentration, scale):
        p = numpyro.sample("p", dist.Dirichlet(concentration))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y_obs", dist.Normal(p[0], scale), obs=y)

    good = {"y": Y, "concentration": np.ones(3), "scale": np.ones(Y.shape[0])}
    for name, value, site in (("concentration", np.array([1.0, 0.0, 2.0]), "p"), ("scale", -np.ones(Y.shape[0]), "y_obs")):
        with pytest.raises(ModelTraceError, match=f"invalid {name} parameter") as info:
            fit(model, {**good, name: value})
        assert info.value.site == site


def test_model_raising_before_any_site():
    def model(y):
        raise ValueError("boom")

    with pytest.raises(ModelTraceError, match="boom"):
        fit(model, {"y": Y})


TABLE = np.array([[0.9, 0.1], [0.2, 0.8]])  # a NumPy table at module level


def _numpy_table_hmm(y):
    def step(prev, y_t):
        x = numpyro.sample("x", dist.Categorical(TABLE[prev]))  # a NumPy array indexed by a latent
        numpyro.sample("y", dist.Normal(x, 1.0), obs=y_t)
        return x, None

    scan(step, 0, y)


def _branching_model(y):
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    scale = s if s > 1.0 else 1.0  # Python control flow on a latent
    with numpyro.plate("n", len(y)):
        numpyro.sample("y", dist.Normal(0.0, scale), obs=y)


@pytest.mark.parametrize("model, site", [(_numpy_table_hmm, None), (_branching_model, "s")])
def test_a_latent_turned_into_a_numpy_or_python_value_says_how_to_write_it(model, site):
    """NumPyro cannot run these either (its inference traces the model too); the error says
    which construct, not only JAX's message, and not to check the data."""
    with pytest.raises(ModelTraceError, match=r"Python or NumPy value.*jnp.asarray\(table\)\[z\]") as info:
        fit(model, {"y": Y})
    assert "check that `data`" not in str(info.value)
    assert info.value.site == site


def test_a_forecast_inside_a_scan_is_refused_naming_the_site():
    """NumPyro's forecasting idiom (holt_winters with ``future > 0``): a scanned site
    conditioned on fewer values than the scan has steps, the rest drawn at random inside
    the model. The model runs with the data given, but not as inference runs it (latents
    substituted: numpyro's scan then asserts a PRNG key): a ModelTraceError naming the
    scanned site and the fix, not a bare AssertionError."""
    from numpyro.contrib.control_flow import scan

    def model(y, future=2):
        s = numpyro.sample("s", dist.HalfNormal(1.0))

        def step(prev, t):
            x = numpyro.sample("x", dist.Normal(prev, s))
            return x, x

        with numpyro.handlers.condition(data={"x": y}):
            scan(step, 0.0, jnp.arange(y.shape[0] + future))

    with pytest.raises(ModelTraceError, match="Predictive") as info:
        fit(model, (jnp.array([0.1, 0.3, 0.2]),))
    assert info.value.site == "x"
    assert isinstance(info.value.__cause__, AssertionError)


def test_an_enumerated_value_of_probability_zero_is_named_with_the_fix():
    """A zero-inflated Poisson written with its indicator (``Poisson(z * rate)``: a positive
    count has probability 0 at z = 0): q gives every value of z some probability, the ELBO
    is never finite, and the fit stops with the last valid state, naming the latent and
    the fix (marginalise it), not only the data and the priors."""

    def model(y):
        p = numpyro.sample("p", dist.Beta(1.0, 1.0))
        rate = numpyro.sample("rate", dist.Gamma(2.0, 0.5))
        with numpyro.plate("n", y.shape[0]):
            z = numpyro.sample("z", dist.Bernoulli(p))
            numpyro.sample("y", dist.Poisson(z * rate), obs=y)

    y = np.array([0.0, 3.0, 0.0, 5.0, 2.0, 0.0, 4.0, 1.0])
    with pytest.warns(UserWarning, match="ZeroInflatedPoisson"):
        result = fit(model, (y,), num_steps=20)
    assert not result.converged
    assert "enumerated latents ('z')" in result.message


BAD_DATA = pytest.mark.parametrize("data", ["y", 3.0, {1, 2}], ids=["str", "float", "set"])


@BAD_DATA
def test_bad_data_type(data):
    with pytest.raises(BLRError, match="data"):
        fit(normal_gamma, data)


@BAD_DATA
def test_bad_data_type_is_model_trace_error(data):
    with pytest.raises(ModelTraceError):
        fit(normal_gamma, data)


def test_bad_data_type_says_how_to_pass_a_value():
    with pytest.raises(ModelTraceError, match=r"one array \(the model's only argument\), not float; pass other values as \(value,\)"):
        fit(normal_gamma, 3.0)


def test_a_list_of_values_read_as_positional_arguments_says_so():
    """``blr_fit(model, [0.3, -1.2, ...])``: a list is the model's positional arguments, one per
    item; the model's TypeError comes with how to pass one vector of data."""
    with pytest.raises(ModelTraceError, match=r"gave the model 5 positional arguments.*np.asarray\(values\)"):
        fit(normal_gamma, Y.tolist())


def test_wrong_keyword_names():
    with pytest.raises(ModelTraceError):
        fit(normal_gamma, {"not_y": Y})


# ---------------------------------------------------------------------------------------
# family overrides
# ---------------------------------------------------------------------------------------


def test_family_that_does_not_fit_support():
    with pytest.raises(FamilyError, match="tau") as info:
        fit(normal_gamma, {"y": Y}, families={"tau": "beta"})
    assert isinstance(info.value, BLRError)
    assert info.value.site == "tau"


def test_family_override_on_missing_site():
    with pytest.raises(FamilyError, match="sigma"):
        fit(normal_gamma, {"y": Y}, families={"sigma": "gamma"})


def test_family_override_on_observed_site():
    with pytest.raises(FamilyError, match="y_obs"):
        fit(normal_gamma, {"y": Y}, families={"y_obs": "gaussian"})


def test_unknown_family_name():
    with pytest.raises(FamilyError, match="mu"):
        fit(normal_gamma, {"y": Y}, families={"mu": "student_t"})


# ---------------------------------------------------------------------------------------
# the user's data are not mutated
# ---------------------------------------------------------------------------------------


def test_data_not_mutated():
    rng = np.random.default_rng(0)
    x = np.column_stack([np.ones(20), rng.normal(size=20)])
    y = x @ np.array([1.0, 2.0]) + 0.5 * rng.normal(size=20)
    group = np.arange(20, dtype=np.int32) % 3
    y_jax = jnp.asarray(y)

    def model(X, y, group, opts):
        w = numpyro.sample("w", dist.Normal(0.0, opts["scale"]).expand([2]).to_event(1))
        with numpyro.plate("g", 3):
            a = numpyro.sample("a", dist.Normal(0.0, 1.0))
        with numpyro.plate("n", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w + a[group], 0.5), obs=y)

    data = {"X": x, "y": y_jax, "group": group, "opts": {"scale": 2.0}}
    before = copy.deepcopy({k: v for k, v in data.items() if k != "y"})
    before_y = np.array(y_jax)
    ids = {k: id(v) for k, v in data.items()}
    flags = {k: (v.flags.writeable, v.dtype, v.shape) for k, v in data.items() if isinstance(v, np.ndarray)}

    result = fit(model, data)
    assert result.converged, result.message

    assert set(data) == {"X", "y", "group", "opts"}
    assert {k: id(v) for k, v in data.items()} == ids
    np.testing.assert_array_equal(data["X"], before["X"])
    np.testing.assert_array_equal(data["group"], before["group"])
    np.testing.assert_array_equal(np.asarray(data["y"]), before_y)
    assert data["opts"] == {"scale": 2.0}
    for k, v in data.items():
        if isinstance(v, np.ndarray):
            assert (v.flags.writeable, v.dtype, v.shape) == flags[k], k

    # positional data: the tuple's arrays stay as they were too
    args = (x, y)
    x_before, y_before = x.copy(), y.copy()

    def model2(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 2.0).expand([2]).to_event(1))
        with numpyro.plate("n", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)

    fit(model2, args, num_steps=2)
    np.testing.assert_array_equal(args[0], x_before)
    np.testing.assert_array_equal(args[1], y_before)


def _location_scale(y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    w = numpyro.sample("w", dist.Dirichlet(jnp.ones(3)))
    with numpyro.plate("n", 5):
        numpyro.sample("y", dist.Normal(mu + w[0], sigma), obs=y)


@pytest.mark.parametrize(
    "init, message",
    [
        ({"sigma": -1.0}, "'sigma': init value -1 is outside the site's support"),
        ({"sigma": 0.0}, "'sigma': init value 0 is outside the site's support"),
        ({"sigma": np.nan}, "'sigma': init value is not finite"),
        ({"mu": jnp.inf}, "'mu': init value is not finite"),
        ({"mu": [0.0, 1.0]}, r"'mu': init value has shape \(2,\), the site's values have shape \(\)"),
        ({"mu": "zero"}, "'mu': init value must be numeric"),
        ({"w": np.array([0.5, 0.6, 0.1])}, "'w': init value .* is outside the site's support"),
    ],
)
def test_a_starting_value_that_does_not_fit_its_site_is_refused(init, message):
    """A starting value outside its site's support would start the fit from NaN natural
    parameters and return NaN posteriors: it is refused, naming the site."""
    y = np.array([0.1, 0.3, -0.2, 0.5, 0.0])
    with pytest.raises(InitValueError, match=message):
        blrppl.BLR(_location_scale).run(jax.random.key(0), 5, y=y, init_params=init, progress_bar=False)


def test_a_starting_value_inside_the_support_is_used():
    y = np.array([0.1, 0.3, -0.2, 0.5, 0.0])
    result = blrppl.BLR(_location_scale).run(
        jax.random.key(0), 200, y=y, init_params={"sigma": 0.5, "w": np.array([0.2, 0.3, 0.5])}, progress_bar=False
    )
    assert all(np.all(np.isfinite(np.asarray(v))) for v in result.params.values())


# ---------------------------------------------------------------------------------------
# out of memory: a ResourceError, or the fit without its PSIS check
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def out_of_memory():
    """XLA's own out-of-memory error: an array of 2⁵⁰ bytes (more than any address space)."""
    try:
        jnp.zeros((2**24, 2**23)).block_until_ready()
    except Exception as exc:  # noqa: BLE001 (the runtime error's class depends on the jaxlib)
        assert is_out_of_memory(exc), exc
        return exc
    pytest.skip("an array of 2**50 bytes was allocated")


def _raise(exc):
    def raising(*args, **kwargs):
        raise exc

    return raising


def test_out_of_memory_in_the_steps_is_a_resource_error(out_of_memory, monkeypatch):
    monkeypatch.setattr(run_module, "run_loop", _raise(out_of_memory))
    with pytest.raises(ResourceError, match="the fit needs more memory than this machine has"):
        fit(normal_gamma, (Y,))


def test_out_of_memory_in_the_psis_check_returns_the_fit_with_a_warning(out_of_memory, monkeypatch):
    def model(y):
        s = numpyro.sample("s", dist.HalfCauchy(1.0))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.StudentT(4.0, 0.0, s), obs=y)

    monkeypatch.setattr(build_module.CompiledFit, "log_weights_read", _raise(out_of_memory))
    with pytest.warns(UserWarning, match="PSIS k-hat not computed: the model's log density at q's draws needs more") as caught:
        result = fit(model, (Y,))
    # (pointing at the user's call, as blr_fit's other warnings do)
    assert {w.filename for w in caught} == {__file__}
    assert np.isnan(result.diagnostics.khat) and "memory" in result.diagnostics.note
    assert np.isfinite(result.posterior["s"].mean)


def test_out_of_memory_in_blr_run_is_a_resource_error(out_of_memory, monkeypatch):
    """``BLR`` (the drop-in for numpyro's SVI) runs the same loop: the same error."""
    monkeypatch.setattr(run_module, "run_loop", _raise(out_of_memory))
    with pytest.raises(ResourceError, match="the fit needs more memory"):
        blrppl.BLR(normal_gamma).run(jax.random.key(0), 10, Y, progress_bar=False)
