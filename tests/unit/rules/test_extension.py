"""Extending blrppl from a user's own code, through its public names only.

Written as a user would: everything below that blrppl does not ship (a closed-form rule for
numpyro's ``Laplace``, a distribution of the user's own with a conjugate rule, an
inverse-Gamma family for a variance, an ``InverseGamma`` prior rule) is defined here with
``blrppl.register_rule``, ``blrppl.register_family`` and the public classes of
``blrppl.families``, and every registration is undone by the fixture that made it (the
registries are process-wide). The fits are checked against references computed here by
hand: the Gaussian variational optimum by numerical integration, the textbook posteriors of
a Normal mean and of a Normal variance, and the same model written with numpyro's Normal.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.distributions import constraints
from numpyro.distributions.util import promote_shapes
from jax import random
from jax.scipy.special import erf, gammaln
from scipy import integrate, optimize, stats

import blrppl
from blrppl import RegistrationError, blr_fit
from blrppl.families import Family, Gamma, GammaNat, GammaView


# -- (a) a closed-form rule for a distribution blrppl has no rule for -----------------------


def laplace_expected_log_prob(value, loc, scale):
    r"""E_q[log Laplace(x | loc, b)] = −log 2b − E|x − loc| / b, b constant.

    With d = x − loc Gaussian (mean m, variance v), E|d| is the folded normal's mean
    √(2v/π) exp(−m²/2v) + m erf(m / √(2v)).
    """
    d = value - loc
    m, v = d.mean(), d.var()
    abs_mean = jnp.sqrt(2.0 * v / math.pi) * jnp.exp(-0.5 * m**2 / v) + m * erf(m / jnp.sqrt(2.0 * v))
    b = scale.mean()
    return -jnp.log(2.0 * b) - abs_mean / b


@pytest.fixture
def laplace_rule():
    blrppl.register_rule(
        dist.Laplace,
        kinds={"value": ("const",), "loc": ("const", "affine_gaussian"), "scale": ("const",)},
    )(laplace_expected_log_prob)
    try:
        yield
    finally:
        blrppl.unregister_rule(dist.Laplace)


Y_LAPLACE = np.array([0.3, -1.2, 2.5, 0.8, 1.1, -0.4, 3.0, 0.9, 1.7, 0.2])
PRIOR_SCALE, LAPLACE_SCALE = 3.0, 0.8


def laplace_model(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, PRIOR_SCALE))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Laplace(mu, LAPLACE_SCALE), obs=y)


def gaussian_vi_optimum(y):
    """(mean, sd) of the Gaussian q maximising the ELBO, its expectations integrated
    numerically (no closed form)."""

    def neg_elbo(params):
        m, log_s = params
        s = math.exp(log_s)

        def expected(f):
            return integrate.quad(lambda u: f(u) * stats.norm.pdf(u, m, s), m - 12 * s, m + 12 * s,
                                  points=[float(t) for t in y if m - 12 * s < t < m + 12 * s], limit=200)[0]

        lik = expected(lambda u: np.sum(stats.laplace.logpdf(y, u, LAPLACE_SCALE)))
        prior = expected(lambda u: stats.norm.logpdf(u, 0.0, PRIOR_SCALE))
        return -(lik + prior + log_s + 0.5 * math.log(2 * math.pi * math.e))

    res = optimize.minimize(neg_elbo, x0=[float(np.median(y)), -1.0], method="Nelder-Mead",
                            options={"xatol": 1e-9, "fatol": 1e-12, "maxiter": 4000})
    return res.x[0], math.exp(res.x[1])


def test_a_users_laplace_rule_makes_the_factor_exact_and_fits_the_gaussian_optimum(laplace_rule):
    result = blr_fit(laplace_model, {"y": Y_LAPLACE}, rng_key=random.PRNGKey(0), progress_bar=False)
    factor = next(f for f in result.plan.factors if f.name == "y")
    assert factor.estimator == "exact"
    assert result.converged, result.message
    # the Laplace factor is not quadratic in mu: its message depends on q (no one-step update)
    assert dict(result.plan.conjugate)["mu"] is False
    again = blr_fit(laplace_model, {"y": Y_LAPLACE}, rng_key=random.PRNGKey(0), progress_bar=False)
    assert again.compile_counts.model_runs == 1  # the compiled fit is reused while the rule holds
    m, s = gaussian_vi_optimum(Y_LAPLACE)
    q = result.posterior["mu"]
    np.testing.assert_allclose(float(q.loc), m, atol=2e-4)
    np.testing.assert_allclose(float(q.scale), s, rtol=2e-3)


def test_without_the_rule_the_factor_is_integrated_and_agrees(laplace_rule):
    with_rule = blr_fit(laplace_model, {"y": Y_LAPLACE}, rng_key=random.PRNGKey(0), progress_bar=False)
    blrppl.unregister_rule(dist.Laplace)
    try:
        # (the same model object: the compiled fit of the registered rule is not reused)
        without = blr_fit(laplace_model, {"y": Y_LAPLACE}, rng_key=random.PRNGKey(0), progress_bar=False)
    finally:
        blrppl.register_rule(
            dist.Laplace,
            kinds={"value": ("const",), "loc": ("const", "affine_gaussian"), "scale": ("const",)},
        )(laplace_expected_log_prob)
    factor = next(f for f in without.plan.factors if f.name == "y")
    assert factor.estimator != "exact"
    a, b = with_rule.posterior["mu"], without.posterior["mu"]
    np.testing.assert_allclose(float(b.loc), float(a.loc), atol=0.02)
    np.testing.assert_allclose(float(b.scale), float(a.scale), rtol=0.05)


# -- a user's own distribution, with a conjugate rule ----------------------------------------


class NormalPrecision(dist.Distribution):
    """A Normal parameterised by its precision: a distribution numpyro does not ship."""

    arg_constraints = {"loc": constraints.real, "precision": constraints.positive}
    support = constraints.real
    reparametrized_params = ["loc", "precision"]
    pytree_data_fields = ("loc", "precision")

    def __init__(self, loc, precision, *, validate_args=None):
        self.loc, self.precision = promote_shapes(loc, precision)
        batch_shape = jax.lax.broadcast_shapes(jnp.shape(loc), jnp.shape(precision))
        super().__init__(batch_shape=batch_shape, validate_args=validate_args)

    def sample(self, key, sample_shape=()):
        eps = random.normal(key, tuple(sample_shape) + self.batch_shape)
        return self.loc + eps / jnp.sqrt(self.precision)

    def log_prob(self, value):
        return 0.5 * (jnp.log(self.precision) - math.log(2 * math.pi)) - 0.5 * self.precision * (value - self.loc) ** 2


def normal_precision_expected_log_prob(value, loc, precision):
    """½ (E log τ − log 2π) − ½ E[τ] E[(x − loc)²]: quadratic in loc, linear in (E log τ, E τ)."""
    return 0.5 * (precision.expect_log() - math.log(2 * math.pi)) - 0.5 * precision.mean() * (value - loc).mean_square()


@pytest.fixture
def normal_precision():
    blrppl.register_rule(
        NormalPrecision,
        kinds={"value": ("const", "affine_gaussian"), "loc": ("const", "affine_gaussian"),
               "precision": ("const", "power_gamma")},
        conjugate=True,  # quadratic in an affine Gaussian loc or value
        conjugate_powers={"precision": (1.0,)},
    )(normal_precision_expected_log_prob)
    try:
        yield
    finally:
        blrppl.unregister_rule(NormalPrecision)


Y_NORMAL = np.random.default_rng(3).normal(1.0, 0.6, size=30)


def test_a_conjugate_rule_of_a_users_distribution_gives_the_exact_posterior_in_one_step(normal_precision, x64):
    def model(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", NormalPrecision(mu, 4.0), obs=y)

    result = blr_fit(model, {"y": Y_NORMAL}, rng_key=random.PRNGKey(0), progress_bar=False)
    assert dict(result.plan.conjugate)["mu"] is True and result.num_steps == 1
    precision = 1 / 2.0**2 + 4.0 * Y_NORMAL.size
    q = result.posterior["mu"]
    np.testing.assert_allclose(float(q.loc), 4.0 * Y_NORMAL.sum() / precision, rtol=0, atol=1e-8)
    np.testing.assert_allclose(float(q.scale), precision**-0.5, rtol=0, atol=1e-8)


def test_a_users_distribution_fits_as_its_builtin_twin(normal_precision, x64):
    def model(y, user):
        mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
        tau = numpyro.sample("tau", dist.Gamma(2.0, 1.0))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", NormalPrecision(mu, tau) if user else dist.Normal(mu, 1.0 / jnp.sqrt(tau)), obs=y)

    fits = [blr_fit(model, {"y": Y_NORMAL, "user": user}, rng_key=random.PRNGKey(0), progress_bar=False)
            for user in (True, False)]
    ours, builtin = fits
    assert dict(ours.plan.conjugate) == dict(builtin.plan.conjugate) == {"mu": True, "tau": True}
    for name, fields in [("mu", ("loc", "scale")), ("tau", ("concentration", "rate"))]:
        for field in fields:
            np.testing.assert_allclose(float(getattr(ours.posterior[name], field)),
                                       float(getattr(builtin.posterior[name], field)), rtol=1e-8)


# -- (b) a new family: an inverse-Gamma variance, conjugate to a Normal likelihood ----------


@dataclasses.dataclass(frozen=True)
class InverseGamma(Gamma):
    """q(σ²) = InverseGamma(a, b) on (0, ∞), held as the Gamma(a, rate b) of τ = 1/σ².

    Density in σ²: exp(η₁ log τ + η₂ τ − A(η)) with T = (log τ, τ) = (−log σ², 1/σ²), so
    η = (a + 1, −b) (the Jacobian |dτ/dσ²| = τ² shifts a Gamma's a − 1 by 2),
    A = log Γ(a) − a log b, and μ = (E log τ, E τ) = (ψ(a) − log b, a/b) as for the Gamma:
    the Gamma's mean parameters, Fisher solve and moments of τ's powers apply unchanged.
    The latent is τ^(−1): an argument c·(σ²)^k is read as c·τ^(−k), so the Normal's
    ``scale = sqrt(sigma2)`` is τ^(−½), its conjugate power.
    """

    name: ClassVar[str] = "inverse_gamma"
    native: ClassVar[bool] = False
    argument_power: ClassVar[float] = -1.0

    def initial_nat(self, x):
        """Shape 10, τ's mean 1/x."""
        xp = np if isinstance(x, np.ndarray) else jnp
        return self.nat_from_view(GammaView(xp.full_like(x, 10.0), 10.0 * x))

    def view(self, nat):
        return GammaView(nat.eta1 - 1.0, -nat.eta2)

    def nat_from_view(self, view):
        return GammaNat(view.shape + 1.0, -view.rate)

    def log_partition(self, nat):
        a = nat.eta1 - 1.0
        return gammaln(a) - a * jnp.log(-nat.eta2)

    def sufficient_stats(self, x):
        return GammaNat(-jnp.log(x), 1.0 / x)

    def is_valid(self, nat):
        finite = jnp.all(jnp.isfinite(nat.eta1)) & jnp.all(jnp.isfinite(nat.eta2))
        return finite & jnp.all(nat.eta1 > 1.0) & jnp.all(nat.eta2 < 0.0)

    def sample(self, nat, rng_key, sample_shape=()):
        a, b = self.view(nat)
        shape = tuple(sample_shape) + jnp.broadcast_shapes(a.shape, b.shape)
        return b / jax.random.gamma(rng_key, a, shape=shape, dtype=a.dtype)

    def from_linearisation(self, x):
        return jnp.exp(-x)  # linearised in log τ = −log σ²

    def to_numpyro(self, nat):
        a, b = self.view(nat)
        return dist.InverseGamma(a, b)


def inverse_gamma_expected_log_prob(value, concentration, rate):
    r"""E_q[log InverseGamma(σ² | α, β)] = α log β − log Γ(α) − (α + 1) E[log σ²] − β E[1/σ²]."""
    alpha, beta = concentration.mean(), rate.mean()
    return (alpha * jnp.log(beta) - gammaln(alpha) - (alpha + 1.0) * value.expect_log()
            - beta * value.expect_pow(-1.0))


@pytest.fixture
def inverse_gamma():
    blrppl.register_family(InverseGamma)
    blrppl.register_rule(
        dist.InverseGamma,
        kinds={"value": ("const", "power_gamma"), "concentration": ("const",), "rate": ("const",)},
        conjugate_powers={"value": (-1.0,)},  # σ² = τ⁻¹: linear in (E log τ, E τ)
    )(inverse_gamma_expected_log_prob)
    try:
        yield
    finally:
        blrppl.unregister_rule(dist.InverseGamma)
        blrppl.unregister_family("inverse_gamma")


@pytest.fixture
def x64():
    was = jax.config.jax_enable_x64
    numpyro.enable_x64()
    try:
        yield
    finally:
        numpyro.enable_x64(was)


A0, B0, MU = 3.0, 2.0, 0.5


def variance_model(y):
    sigma2 = numpyro.sample("sigma2", dist.InverseGamma(A0, B0))
    with numpyro.plate("n", y.shape[0]):
        numpyro.sample("y", dist.Normal(MU, jnp.sqrt(sigma2)), obs=y)


def test_the_inverse_gamma_family_fits_the_exact_posterior(inverse_gamma, x64):
    y = np.random.default_rng(0).normal(MU, 1.7, size=25)
    result = blr_fit(variance_model, {"y": y}, families={"sigma2": "inverse_gamma"},
                     rng_key=random.PRNGKey(0), progress_bar=False)
    block = result.plan.block("sigma2")
    assert block.kind == "inverse_gamma"
    assert all(f.estimator == "exact" for f in result.plan.factors)
    assert dict(result.plan.conjugate)["sigma2"] is True
    assert result.num_steps == 1  # a lone conjugate block: one exact step
    a_post = A0 + 0.5 * y.size
    b_post = B0 + 0.5 * np.sum((y - MU) ** 2)
    q = result.posterior["sigma2"]
    assert isinstance(q, dist.InverseGamma)
    np.testing.assert_allclose(float(q.concentration), a_post, rtol=0, atol=1e-8)
    np.testing.assert_allclose(float(q.rate), b_post, rtol=0, atol=1e-8)
    draws = result.sample(random.PRNGKey(1), 4000)["sigma2"]
    np.testing.assert_allclose(np.mean(draws), b_post / (a_post - 1.0), rtol=0.03)


def test_a_registered_family_is_named_like_the_builtins(inverse_gamma):
    assert blrppl.families.FAMILIES["inverse_gamma"] is InverseGamma
    with pytest.raises(RegistrationError, match="taken"):
        blrppl.register_family(dataclasses.make_dataclass(
            "Other", [], bases=(InverseGamma,), frozen=True, namespace={"name": "inverse_gamma"}))


def test_an_instance_and_another_name_register_a_family():
    cls = blrppl.families.register_family(InverseGamma(), name="inv_gamma_2")
    try:
        assert cls.name == "inv_gamma_2" and issubclass(cls, InverseGamma)
        assert blrppl.families.FAMILIES["inv_gamma_2"] is cls
    finally:
        blrppl.families.unregister_family("inv_gamma_2")
    assert "inv_gamma_2" not in blrppl.families.FAMILIES


# -- clear errors for bad registrations ------------------------------------------------------


def _rule(value, loc, scale):
    return value.mean()


@pytest.mark.parametrize(
    "declaration, match",
    [
        (dict(kinds={"loc": ("const",), "scale": ("const",)}), "'value'"),
        (dict(kinds={"value": ("const",), "loc": ("gaussian",), "scale": ("const",)}), "unknown moment kind"),
        (dict(kinds={"value": "const", "loc": ("const",), "scale": ("const",)}), "tuple of kinds"),
        (dict(kinds={"value": ("const",), "mean": ("const",), "scale": ("const",)}), "'mean' is not an argument"),
        (dict(kinds={"value": ("const",), "loc": ("const",), "scale": ("const",)}, conjugate_powers={"scale": (-1,)}),
         "does not accept 'power_gamma'"),
        (dict(kinds={"value": ("const",), "loc": ("const",), "scale": ("const",)}, conjugate=("rate",)),
         "conjugate="),
        (dict(kinds={"value": ("const",), "loc": ("const",), "scale": ("const",)}, event_ndim=-1), "event_ndim"),
    ],
)
def test_a_malformed_rule_declaration_is_a_registration_error(declaration, match):
    with pytest.raises(RegistrationError, match=match):
        blrppl.register_rule(dist.Logistic, **declaration)(_rule)
    assert dist.Logistic not in blrppl.rules.registered_rules()


def test_rule_registration_errors_name_the_problem():
    with pytest.raises(RegistrationError, match="Distribution subclass"):
        blrppl.register_rule(float, kinds={"value": ("const",)})
    with pytest.raises(RegistrationError, match=r"must take \(value, loc, scale\)"):
        blrppl.register_rule(dist.Logistic, kinds={"value": ("const",), "loc": ("const",), "scale": ("const",)})(
            lambda value, loc: value.mean())
    with pytest.raises(RegistrationError, match="already has a rule"):
        blrppl.register_rule(dist.Normal, kinds={"value": ("const",), "loc": ("const",), "scale": ("const",)})(_rule)
    with pytest.raises(RegistrationError, match="no rule is registered"):
        blrppl.unregister_rule(dist.Logistic)
    assert isinstance(RegistrationError("x"), blrppl.BLRError)


def test_family_registration_errors_name_the_problem():
    with pytest.raises(RegistrationError, match="subclass of blrppl.families.Family"):
        blrppl.register_family(dict)

    @dataclasses.dataclass(frozen=True)
    class Half(Family):
        name: ClassVar[str] = "half"
        support: ClassVar[str] = "positive"

    with pytest.raises(RegistrationError, match="does not implement initial_nat"):
        blrppl.register_family(Half)

    for flag, match in [({"support": "ordered"}, "support"), ({"native": True}, "native"),
                        ({"argument_kind": "inverse_gamma"}, "argument_kind"),
                        ({"argument_power": 0.0}, "argument_power")]:
        bad = dataclasses.make_dataclass("Bad", [], bases=(InverseGamma,), frozen=True,
                                         namespace={"name": "bad", **flag})
        with pytest.raises(RegistrationError, match=match):
            blrppl.register_family(bad)
    with pytest.raises(RegistrationError, match="name"):
        blrppl.register_family(InverseGamma, name="grid")
    with pytest.raises(RegistrationError, match="blrppl's own"):
        blrppl.unregister_family("gamma")
    with pytest.raises(RegistrationError, match="no family"):
        blrppl.unregister_family("inverse_gamma")
    assert set(blrppl.families.FAMILIES) == {
        "gaussian", "gaussian-diag", "gaussian-ivon", "gamma", "beta", "dirichlet", "wishart", "bernoulli",
        "categorical",
    }
