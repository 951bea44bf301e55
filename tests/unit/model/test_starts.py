"""Every continuous prior NumPyro can sample gets a starting point that is finite and strictly
inside its support (``blrppl.model.start``): the prior mean where it is one, else the
median, else the median of a few draws, else a uniform draw on the unconstrained space.

Each case traces a tiny model (the latent read by an observation, as a scale where its
support is positive) once, as a fit does, and checks the latent's starting value. float64
(the conftest), and a subset in float32 in a fresh interpreter.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.distributions import constraints
from numpyro.distributions import transforms as T
from numpyro.distributions.transforms import biject_to
from scipy import stats

from blrppl.model.records import effective_support
from blrppl.model.trace import trace_model

EYE3 = np.eye(3)
ADJACENCY = np.array([[0.0, 1.0, 0.0], [1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
WEIGHTS = np.array([0.3, 0.7])
HALF_T = dist.FoldedDistribution(dist.StudentT(3.0, 0.0, 10.0))

#: name → a function building the prior (built inside the model, as users write it)
PRIORS = {
    # real line
    "Normal": lambda: dist.Normal(0.0, 1.0),
    "StudentT": lambda: dist.StudentT(3.0, 0.0, 10.0),
    "StudentT without a mean": lambda: dist.StudentT(1.0, 0.0, 10.0),
    "Cauchy": lambda: dist.Cauchy(0.0, 2.5),
    "Laplace": lambda: dist.Laplace(0.0, 1.0),
    "Logistic": lambda: dist.Logistic(0.0, 1.0),
    "SoftLaplace": lambda: dist.SoftLaplace(0.0, 1.0),
    "Gumbel": lambda: dist.Gumbel(0.0, 1.0),
    "AsymmetricLaplace": lambda: dist.AsymmetricLaplace(0.0, 1.0, 2.0),
    "AsymmetricLaplaceQuantile": lambda: dist.AsymmetricLaplaceQuantile(0.0, 1.0, 0.3),
    "VonMises": lambda: dist.VonMises(0.0, 1.0),
    # positive half-line
    "HalfNormal": lambda: dist.HalfNormal(1.0),
    "HalfCauchy": lambda: dist.HalfCauchy(1.0),
    "LogNormal": lambda: dist.LogNormal(0.0, 10.0),
    "Exponential": lambda: dist.Exponential(1.0),
    "Gamma": lambda: dist.Gamma(2.0, 1.0),
    "Chi2": lambda: dist.Chi2(3.0),
    "InverseGamma": lambda: dist.InverseGamma(2.0, 1.0),
    "InverseGamma without a mean": lambda: dist.InverseGamma(0.5, 1.0),
    "Weibull": lambda: dist.Weibull(1.0, 2.0),
    "Pareto": lambda: dist.Pareto(1.0, 1.5),
    "Pareto without a mean": lambda: dist.Pareto(1.0, 0.5),
    "LogUniform": lambda: dist.LogUniform(0.1, 10.0),
    "Levy": lambda: dist.Levy(0.0, 1.0),
    "Gompertz": lambda: dist.Gompertz(1.0, 1.0),
    "Dagum": lambda: dist.Dagum(2.0, 3.0, 1.0),
    "Dagum without a mean": lambda: dist.Dagum(2.0, 0.5, 1.0),
    "LeftTruncatedGamma": lambda: dist.LeftTruncatedGamma(dist.Gamma(2.0, 1.0), low=1.0),
    "RightTruncatedGamma": lambda: dist.RightTruncatedGamma(dist.Gamma(2.0, 1.0), high=1.0),
    "TwoSidedTruncatedGamma": lambda: dist.TwoSidedTruncatedGamma(dist.Gamma(2.0, 1.0), low=1.0, high=3.0),
    "LowerTruncatedPowerLaw": lambda: dist.LowerTruncatedPowerLaw(-2.5, 1.0),
    "DoublyTruncatedPowerLaw": lambda: dist.DoublyTruncatedPowerLaw(-1.5, 1.0, 10.0),
    "TruncatedPolyaGamma": lambda: dist.TruncatedPolyaGamma(),
    # folded (Stan's half-t and half-normal as posteriordb's ports write them)
    "Folded StudentT": lambda: HALF_T,
    "Folded Normal": lambda: dist.FoldedDistribution(dist.Normal(0.0, 1.0)),
    "Folded Normal off centre": lambda: dist.FoldedDistribution(dist.Normal(1.0, 2.0)),
    "Folded Cauchy, a vector": lambda: dist.FoldedDistribution(dist.Cauchy(jnp.array([0.0, 2.0]), 1.0)),
    "Folded StudentT expanded": lambda: HALF_T.expand([3]),
    "Folded StudentT as one event": lambda: HALF_T.expand([3]).to_event(1),
    "Folded StudentT masked": lambda: HALF_T.expand([3]).mask(jnp.array([True, False, True])),
    # truncated
    "TruncatedNormal low": lambda: dist.TruncatedNormal(0.0, 1.0, low=0.0),
    "TruncatedNormal low and high": lambda: dist.TruncatedNormal(0.0, 1.0, low=-1.0, high=2.0),
    "TruncatedNormal in the tail": lambda: dist.TruncatedNormal(0.0, 1.0, low=5.0),
    "TruncatedNormal high": lambda: dist.TruncatedNormal(0.0, 1.0, high=-3.0),
    "Truncated Normal": lambda: dist.TruncatedDistribution(dist.Normal(0.0, 1.0), low=0.5),
    "Truncated StudentT": lambda: dist.TruncatedDistribution(dist.StudentT(3.0, 0.0, 1.0), low=0.0),
    "Truncated Cauchy": lambda: dist.TruncatedDistribution(dist.Cauchy(0.0, 1.0), low=0.0),
    "Truncated Cauchy high": lambda: dist.TruncatedDistribution(dist.Cauchy(0.0, 1.0), high=0.0),
    "Truncated Cauchy low and high": lambda: dist.TruncatedDistribution(dist.Cauchy(0.0, 1.0), low=1.0, high=3.0),
    "TruncatedCauchy": lambda: dist.TruncatedCauchy(0.0, 1.0, low=0.0),
    "Truncated Laplace": lambda: dist.TruncatedDistribution(dist.Laplace(0.0, 1.0), low=0.5),
    "Truncated Logistic": lambda: dist.TruncatedDistribution(dist.Logistic(0.0, 1.0), low=-2.0, high=-1.0),
    "Truncated SoftLaplace": lambda: dist.TruncatedDistribution(dist.SoftLaplace(0.0, 1.0), high=0.0),
    # transformed
    "exp of a Normal": lambda: dist.TransformedDistribution(dist.Normal(0.0, 1.0), T.ExpTransform()),
    "affine of a Normal": lambda: dist.TransformedDistribution(dist.Normal(0.0, 1.0), T.AffineTransform(2.0, 3.0)),
    "sigmoid of a Normal": lambda: dist.TransformedDistribution(dist.Normal(0.0, 1.0), T.SigmoidTransform()),
    "exp of affine of a Normal": lambda: dist.TransformedDistribution(
        dist.Normal(0.0, 1.0), [T.AffineTransform(1.0, 2.0), T.ExpTransform()]
    ),
    "affine of a Beta": lambda: dist.TransformedDistribution(dist.Beta(2.0, 2.0), T.AffineTransform(-1.0, 2.0)),
    "inverse of a Gamma": lambda: dist.TransformedDistribution(dist.Gamma(2.0, 1.0), T.PowerTransform(-1.0)),
    "stick-breaking of Normals": lambda: dist.TransformedDistribution(
        dist.Normal(jnp.zeros(2), 1.0).to_event(1), T.StickBreakingTransform()
    ),
    # mixtures
    "MixtureSameFamily of Normals": lambda: dist.MixtureSameFamily(
        dist.Categorical(WEIGHTS), dist.Normal(jnp.array([-2.0, 2.0]), 1.0)
    ),
    "MixtureSameFamily of Gammas": lambda: dist.MixtureSameFamily(
        dist.Categorical(WEIGHTS), dist.Gamma(jnp.array([2.0, 5.0]), 1.0)
    ),
    "MixtureSameFamily of Cauchys": lambda: dist.MixtureSameFamily(
        dist.Categorical(WEIGHTS), dist.Cauchy(jnp.array([-2.0, 2.0]), 1.0)
    ),
    "MixtureGeneral": lambda: dist.MixtureGeneral(
        dist.Categorical(WEIGHTS), [dist.Normal(0.0, 1.0), dist.StudentT(3.0, 1.0, 1.0)]
    ),
    "MixtureGeneral with a Cauchy": lambda: dist.MixtureGeneral(
        dist.Categorical(WEIGHTS), [dist.Normal(0.0, 1.0), dist.Cauchy(1.0, 1.0)]
    ),
    "MixtureGeneral, positive": lambda: dist.MixtureGeneral(
        dist.Categorical(WEIGHTS), [dist.HalfNormal(1.0), dist.Exponential(1.0)]
    ),
    # intervals
    "Uniform": lambda: dist.Uniform(-3.0, 5.0),
    "Beta": lambda: dist.Beta(2.0, 2.0),
    "Beta, U-shaped": lambda: dist.Beta(0.5, 0.5),
    "Beta with its mean near 1": lambda: dist.Beta(1.0, 1e-3),
    "BetaProportion": lambda: dist.BetaProportion(0.3, 10.0),
    "Kumaraswamy": lambda: dist.Kumaraswamy(2.0, 5.0),
    "RelaxedBernoulli": lambda: dist.RelaxedBernoulliLogits(0.5, 0.3),
    # improper priors by their support
    "ImproperUniform real": lambda: dist.ImproperUniform(constraints.real, (), ()),
    "ImproperUniform positive": lambda: dist.ImproperUniform(constraints.positive, (), ()),
    "ImproperUniform unit interval": lambda: dist.ImproperUniform(constraints.unit_interval, (), ()),
    "ImproperUniform interval": lambda: dist.ImproperUniform(constraints.interval(2.0, 7.0), (), ()),
    "ImproperUniform greater than": lambda: dist.ImproperUniform(constraints.greater_than(3.0), (), (2,)),
    "ImproperUniform less than": lambda: dist.ImproperUniform(constraints.less_than(-3.0), (), ()),
    "ImproperUniform softplus positive": lambda: dist.ImproperUniform(constraints.softplus_positive, (), ()),
    "ImproperUniform ordered": lambda: dist.ImproperUniform(constraints.ordered_vector, (), (3,)),
    "ImproperUniform positive ordered": lambda: dist.ImproperUniform(constraints.positive_ordered_vector, (), (3,)),
    "ImproperUniform simplex": lambda: dist.ImproperUniform(constraints.simplex, (), (3,)),
    "ImproperUniform correlation Cholesky": lambda: dist.ImproperUniform(constraints.corr_cholesky, (), (3, 3)),
    "ImproperUniform lower Cholesky": lambda: dist.ImproperUniform(constraints.lower_cholesky, (), (3, 3)),
    "ImproperUniform positive definite": lambda: dist.ImproperUniform(constraints.positive_definite, (), (3, 3)),
    # vectors and matrices
    "Dirichlet": lambda: dist.Dirichlet(jnp.ones(3)),
    "LKJCholesky": lambda: dist.LKJCholesky(3, 2.0),
    "LKJ": lambda: dist.LKJ(3, 2.0),
    "Wishart": lambda: dist.Wishart(5.0, EYE3),
    "WishartCholesky": lambda: dist.WishartCholesky(5.0, EYE3),
    "InverseWishart": lambda: dist.InverseWishart(5.0, EYE3),
    "MultivariateNormal": lambda: dist.MultivariateNormal(jnp.zeros(3), EYE3),
    "MultivariateStudentT": lambda: dist.MultivariateStudentT(3.0, jnp.zeros(3), EYE3),
    "LowRankMultivariateNormal": lambda: dist.LowRankMultivariateNormal(jnp.zeros(3), jnp.ones((3, 1)), jnp.ones(3)),
    "GaussianRandomWalk": lambda: dist.GaussianRandomWalk(1.0, 5),
    "ZeroSumNormal": lambda: dist.ZeroSumNormal(1.0, (4,)),
    "CAR": lambda: dist.CAR(0.0, 0.5, 1.0, ADJACENCY),
    "MatrixNormal": lambda: dist.MatrixNormal(jnp.zeros((2, 3)), jnp.eye(2), EYE3),
    "GaussianCopulaBeta": lambda: dist.GaussianCopulaBeta(jnp.full(2, 2.0), jnp.full(2, 3.0), correlation_cholesky=jnp.eye(2)),
}


def model(prior):
    """The latent ``x`` read by an observation: as its scale where ``x`` is a positive scalar
    (as the half-t prior of a regression's noise sd), else through its sum."""
    fn = prior()
    x = numpyro.sample("x", fn)
    if fn.event_shape == () and fn.support is constraints.positive:
        numpyro.sample("y", dist.Normal(0.0, x).to_event(jnp.ndim(x)), obs=jnp.full(jnp.shape(x), 0.3))
    else:
        numpyro.sample("y", dist.Normal(jnp.sum(jnp.asarray(x, float)), 1.0), obs=0.3)


def start(prior) -> np.ndarray:
    records, *_ = trace_model(model, (prior,))
    return np.asarray(records["x"].init_value)


@pytest.mark.parametrize("name", list(PRIORS))
def test_every_prior_starts_finite_and_strictly_inside_its_support(name):
    value = start(PRIORS[name])
    fn = PRIORS[name]()
    support = effective_support(fn)
    assert value.shape == tuple(fn.shape())
    assert np.all(np.isfinite(value)), value
    assert np.all(np.asarray(support(value))), value
    # strictly inside: a finite point of the unconstrained space (a scale of 0, a probability of 1 are not)
    assert np.all(np.isfinite(np.asarray(biject_to(support).inv(value)))), value


@pytest.mark.parametrize(
    "prior, expected",
    [
        (lambda: dist.Gamma(2.0, 4.0), 0.5),  # the mean
        (lambda: dist.HalfNormal(2.0), 2.0 * np.sqrt(2.0 / np.pi)),  # the mean
        (lambda: dist.Cauchy(1.5, 2.0), 1.5),  # no mean: the median
        (lambda: dist.HalfCauchy(2.0), 2.0),  # an infinite mean: the median
        (lambda: dist.Levy(0.0, 1.0), stats.levy.median()),  # an infinite mean: the median
        (lambda: dist.TruncatedDistribution(dist.Cauchy(0.0, 1.0), low=0.0), 1.0),  # no mean: the median
        (lambda: dist.LogNormal(0.0, 10.0), 1.0),  # the transform of its base's mean, not e⁵⁰
    ],
)
def test_the_start_is_the_mean_else_the_median(prior, expected):
    np.testing.assert_allclose(start(prior), expected, rtol=1e-12)


def test_a_half_t_starts_inside_its_central_ninety_per_cent():
    """A folded Student-t has neither a mean nor a median in numpyro: it starts at the median of
    15 draws, which lies between the 5 % and 95 % quantiles of |t₃| · 10 but with probability
    P(Binomial(15, 0.05) ≥ 8) < 1e-6 each side."""
    value = start(lambda: HALF_T.expand([4]))
    low, high = 10.0 * stats.t(3).ppf([0.525, 0.975])
    assert np.all((value > low) & (value < high)), value


FLOAT32 = r"""
import json
import jax, jax.numpy as jnp, numpy as np
import numpyro.distributions as dist
from numpyro.distributions import constraints
from numpyro.distributions.transforms import biject_to
assert not jax.config.jax_enable_x64
from unit.model.test_starts import PRIORS, start
from blrppl.model.records import effective_support

out = {}
for name in NAMES:
    value = jnp.asarray(start(PRIORS[name]))
    support = effective_support(PRIORS[name]())
    out[name] = {
        "dtype": str(value.dtype),
        "inside": bool(np.all(np.isfinite(value)) and np.all(support(value))
                       and np.all(np.isfinite(biject_to(support).inv(value)))),
    }
print("RESULT" + json.dumps(out))
"""


def test_starts_in_float32(tmp_path):
    """The boundary cases in float32, where a Beta(1, 0.001)'s mean rounds to 1."""
    from checks import run_in_new_process

    names = [
        "Folded StudentT",
        "Folded StudentT masked",
        "Beta with its mean near 1",
        "Truncated Cauchy",
        "HalfCauchy",
        "LogNormal",
        "ImproperUniform unit interval",
        "LKJCholesky",
    ]
    code = "import sys; sys.path.insert(0, 'tests')\n" + FLOAT32.replace("NAMES", repr(names))
    out = run_in_new_process(code, tmp_path, JAX_ENABLE_X64="0")
    assert all(out[n]["dtype"] == "float32" for n in names), out
    assert all(out[n]["inside"] for n in names), out
