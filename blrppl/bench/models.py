"""Benchmark models: classic and synthetic NumPyro models with their data generators.

Every entry of :data:`MODELS` builds a :class:`BenchModel` (model, data, exact reference or
``None``). Data are generated with fixed numpy seeds, so every run fits the same data.

Real data: ``logistic_breast_cancer`` is a logistic regression on the Wisconsin breast cancer
data set (569 tumours, 30 features) that ships inside scikit-learn (``sklearn.datasets``,
no download): install the ``bench`` extra (``pip install blrppl[bench]``; ``make bench`` does).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from scipy import stats

from blrppl.bench import posteriordb
from blrppl.errors import MissingDependencyError


@dataclasses.dataclass
class BenchModel:
    """A benchmark problem.

    Attributes:
        name: the model's name on the command line and in the report.
        model: the NumPyro model BLR fits.
        data: its keyword arguments.
        reference: parameter name → (mean, sd) when known exactly (conjugate models, the
            posteriordb reference draws), else ``None`` (then a long NUTS run is the reference).
        representable: whether BLR's candidate family can represent the posterior (then the
            accuracy targets apply); ``note`` says why not.
        note: one line for the model table.
        sampler_model: the model NUTS and SVI fit when they cannot fit ``model`` itself
            (discrete latents marginalised out); the same posterior over the other sites.
        canonical: maps draws (site → array) to a canonical labelling (mixture components
            sorted), applied to every method's draws before comparing.
        blr_kwargs: extra keywords for ``blr_fit``.
        params: the reference parameter names compared (default: all scalars of all latents).
    """

    name: str
    model: Callable
    data: dict
    reference: dict | None = None
    representable: bool = True
    note: str = ""
    sampler_model: Callable | None = None
    canonical: Callable | None = None
    blr_kwargs: dict = dataclasses.field(default_factory=dict)
    params: list | None = None
    source: str = "synthetic"


#: name → builder of a :class:`BenchModel`
MODELS: dict = {}


def _bench(fn):
    MODELS[fn.__name__] = fn
    return fn


# ----------------------------------------------------------------------------- models


def linear_regression_model(X, y=None):
    """Bayesian linear regression: β ~ N(0, 10²), noise precision τ ~ Gamma(1, 1)."""
    beta = numpyro.sample("beta", dist.Normal(0.0, 10.0).expand([X.shape[1]]).to_event(1))
    tau = numpyro.sample("tau", dist.Gamma(1.0, 1.0))
    with numpyro.plate("N", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ beta, 1.0 / jnp.sqrt(tau)), obs=y)


def logistic_model(X, y=None):
    """Logistic regression with N(0, 2.5²) priors on the coefficients (intercept column in X)."""
    beta = numpyro.sample("beta", dist.Normal(0.0, 2.5).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("N", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ beta), obs=y)


def poisson_model(X, y=None):
    """Poisson regression with a log link and N(0, 1) priors."""
    beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("N", X.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.exp(X @ beta)), obs=y)


def eight_schools_model(sigma, y=None):
    """Centred eight schools: θ_j ~ N(μ, τ²), μ ~ N(0, 5²), τ ~ half-Cauchy(5)."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
    with numpyro.plate("J", sigma.shape[0]):
        theta = numpyro.sample("theta", dist.Normal(mu, tau))
        numpyro.sample("y", dist.Normal(theta, sigma), obs=y)


def random_intercepts_model(county, x, num_counties, y=None):
    """Radon-like varying intercepts: a_j ~ N(μ_a, σ_a²), y ~ N(a_county + b x, σ²)."""
    mu_a = numpyro.sample("mu_a", dist.Normal(0.0, 10.0))
    sigma_a = numpyro.sample("sigma_a", dist.HalfNormal(5.0))
    b = numpyro.sample("b", dist.Normal(0.0, 10.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(5.0))
    with numpyro.plate("county", num_counties):
        a = numpyro.sample("a", dist.Normal(mu_a, sigma_a))
    with numpyro.plate("N", x.shape[0]):
        numpyro.sample("y", dist.Normal(a[county] + b * x, sigma), obs=y)


NG_M0, NG_K0, NG_A0, NG_B0 = 0.0, 1.0, 2.0, 2.0


def normal_gamma_model(y):
    """Normal–Gamma: τ ~ Gamma(a0, b0), μ | τ ~ N(m0, 1/(κ0 τ)), y_i ~ N(μ, 1/τ)."""
    tau = numpyro.sample("tau", dist.Gamma(NG_A0, NG_B0))
    mu = numpyro.sample("mu", dist.Normal(NG_M0, 1.0 / jnp.sqrt(NG_K0 * tau)))
    with numpyro.plate("N", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1.0 / jnp.sqrt(tau)), obs=y)


def beta_bernoulli_model(y):
    """Beta–Bernoulli: p ~ Beta(2, 2), y_i ~ Bernoulli(p)."""
    p = numpyro.sample("p", dist.Beta(2.0, 2.0))
    with numpyro.plate("N", y.shape[0]):
        numpyro.sample("y", dist.Bernoulli(probs=p), obs=y)


GMM_K, GMM_SD = 3, 1.0


def mixture_model(y):
    """Gaussian mixture with known component sd: w ~ Dir(1), μ_k ~ N(0, 10²), z_i ~ Cat(w)."""
    w = numpyro.sample("w", dist.Dirichlet(jnp.ones(GMM_K)))
    with numpyro.plate("k", GMM_K):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("N", y.shape[0]):
        z = numpyro.sample("z", dist.Categorical(w))
        numpyro.sample("y", dist.Normal(mu[z], GMM_SD), obs=y)


def mixture_marginal_model(y):
    """:func:`mixture_model` with z summed out (for NUTS and SVI, which cannot enumerate here)."""
    w = numpyro.sample("w", dist.Dirichlet(jnp.ones(GMM_K)))
    with numpyro.plate("k", GMM_K):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("N", y.shape[0]):
        numpyro.sample(
            "y", dist.MixtureSameFamily(dist.Categorical(w), dist.Normal(mu, GMM_SD)), obs=y
        )


def _sort_components(draws: dict) -> dict:
    """Relabel mixture components by increasing mean (removes label switching)."""
    if "mu" not in draws:
        return draws
    mu = np.asarray(draws["mu"])
    order = np.argsort(mu, axis=-1)
    out = dict(draws)
    out["mu"] = np.take_along_axis(mu, order, axis=-1)
    if "w" in draws:
        out["w"] = np.take_along_axis(np.asarray(draws["w"]), order, axis=-1)
    out.pop("z", None)
    return out


ROBUST_DF = 4.0


def robust_regression_model(X, y=None):
    """Student-t robust regression (ν = 4 fixed): β ~ N(0, 10²), σ ~ half-Normal(5)."""
    beta = numpyro.sample("beta", dist.Normal(0.0, 10.0).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(5.0))
    with numpyro.plate("N", X.shape[0]):
        numpyro.sample("y", dist.StudentT(ROBUST_DF, X @ beta, sigma), obs=y)


BNN_HIDDEN = 4


def bnn_model(X, y=None):
    """One-hidden-layer tanh network (4 units), N(0, 1) weights, Gaussian noise sd 0.1."""
    D = X.shape[1]
    w1 = numpyro.sample("w1", dist.Normal(0.0, 1.0).expand([D, BNN_HIDDEN]).to_event(2))
    w2 = numpyro.sample("w2", dist.Normal(0.0, 1.0).expand([BNN_HIDDEN]).to_event(1))
    h = jnp.tanh(X @ w1)
    with numpyro.plate("N", X.shape[0]):
        numpyro.sample("y", dist.Normal(h @ w2, 0.1), obs=y)


# The four fits issue 55 found slower than NUTS (written as NumPyro users write them).


def gp_poisson_model(dist_matrix, log_pop, tools=None):
    """A Gaussian-process prior over a 10 × 10 distance matrix with a Poisson likelihood (the
    tools-of-Oceanic-societies model of McElreath's Statistical Rethinking, on simulated
    islands): k ~ MVN(0, η² exp(−ρ² D²) + 0.01 I), tools ~ Poisson(a P^b / g · exp(k))."""
    n = dist_matrix.shape[0]
    etasq = numpyro.sample("etasq", dist.Exponential(2.0))
    rhosq = numpyro.sample("rhosq", dist.Exponential(0.5))
    cov = etasq * jnp.exp(-rhosq * dist_matrix**2) + 0.01 * jnp.eye(n)
    k = numpyro.sample("k", dist.MultivariateNormal(jnp.zeros(n), covariance_matrix=cov))
    a = numpyro.sample("a", dist.Exponential(1.0))
    b = numpyro.sample("b", dist.Exponential(1.0))
    g = numpyro.sample("g", dist.Exponential(1.0))
    rate = a * jnp.exp(b * log_pop) / g * jnp.exp(k)
    with numpyro.plate("society", n):
        numpyro.sample("tools", dist.Poisson(rate), obs=tools)


def lkj_slopes_model(cafe, afternoon, wait=None):
    """Varying intercepts and slopes with an LKJ prior on their correlation (the cafés of
    Statistical Rethinking, simulated): (a_j, b_j) ~ MVN((a, b), diag(σ) R diag(σ))."""
    num_cafes = int(np.max(cafe)) + 1
    a = numpyro.sample("a", dist.Normal(5.0, 2.0))
    b = numpyro.sample("b", dist.Normal(-1.0, 0.5))
    sigma_cafe = numpyro.sample("sigma_cafe", dist.Exponential(1.0).expand([2]).to_event(1))
    chol_corr = numpyro.sample("chol_corr", dist.LKJCholesky(2, 2.0))
    scale_tril = sigma_cafe[:, None] * chol_corr
    with numpyro.plate("cafes", num_cafes):
        ab = numpyro.sample("ab", dist.MultivariateNormal(jnp.stack([a, b]), scale_tril=scale_tril))
    sigma = numpyro.sample("sigma", dist.Exponential(1.0))
    with numpyro.plate("visits", cafe.shape[0]):
        numpyro.sample("wait", dist.Normal(ab[cafe, 0] + ab[cafe, 1] * afternoon, sigma), obs=wait)


def ordered_logistic_model(X, y=None):
    """An ordered logistic regression (4 ordered categories): cutpoints ordered by
    ``OrderedTransform``, β ~ N(0, 1)."""
    beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    cutpoints = numpyro.sample(
        "cutpoints",
        dist.TransformedDistribution(dist.Normal(0.0, 5.0).expand([3]).to_event(1), dist.transforms.OrderedTransform()),
    )
    with numpyro.plate("n", X.shape[0]):
        numpyro.sample("y", dist.OrderedLogistic(X @ beta, cutpoints), obs=y)


def semi_supervised_hmm_model(num_categories, num_words, supervised_categories, supervised_words, unsupervised_words):
    """NumPyro's semi-supervised HMM: transition and emission probabilities with Dirichlet
    priors, the labelled sequence scored directly and the unlabelled one by the forward
    algorithm (``lax.scan``) in a ``numpyro.factor``."""
    from jax.scipy.special import logsumexp

    with numpyro.plate("prob_plate", num_categories):
        transition_prob = numpyro.sample("transition_prob", dist.Dirichlet(jnp.ones(num_categories)))
        emission_prob = numpyro.sample("emission_prob", dist.Dirichlet(jnp.ones(num_words)))
    numpyro.sample("supervised_categories", dist.Categorical(transition_prob[supervised_categories[:-1]]),
                   obs=supervised_categories[1:])
    numpyro.sample("supervised_words", dist.Categorical(emission_prob[supervised_categories]), obs=supervised_words)
    log_trans, log_emit = jnp.log(transition_prob), jnp.log(emission_prob)

    def forward(log_prob, word):
        return logsumexp(log_prob[:, None] + log_trans, axis=0) + log_emit[:, word], None

    init = log_trans[supervised_categories[-1]] + log_emit[:, unsupervised_words[0]]
    log_prob, _ = jax.lax.scan(forward, init, unsupervised_words[1:])
    numpyro.factor("forward_log_prob", logsumexp(log_prob))


# ---------------------------------------------------------------------- builders


def _design(rng, n, d):
    return np.concatenate([np.ones((n, 1)), rng.normal(size=(n, d - 1))], axis=1)


@_bench
def linear_regression():
    rng = np.random.default_rng(1)
    X = _design(rng, 200, 5)
    y = X @ np.array([1.0, -2.0, 0.5, 0.0, 3.0]) + 0.8 * rng.normal(size=200)
    return BenchModel(
        "linear_regression", linear_regression_model, {"X": X, "y": y},
        note="β Gaussian and τ Gamma, mean-field between them (dependence is weak at N=200)",
    )


def logistic_data(n: int, d: int = 10, seed: int = 2):
    """Synthetic logistic-regression data: intercept column plus ``d-1`` standard normal features."""
    rng = np.random.default_rng(seed)
    X = _design(rng, n, d)
    beta = np.linspace(-1.0, 1.0, d) * 0.8
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-X @ beta))).astype(float)
    return {"X": X, "y": y}


def breast_cancer_data() -> dict:
    """The Wisconsin breast cancer data from scikit-learn: an intercept column and the 30
    standardised features, and y = 1 for a benign tumour."""
    try:
        from sklearn.datasets import load_breast_cancer
    except ImportError as err:
        raise MissingDependencyError(
            "the logistic_breast_cancer benchmark loads its data from scikit-learn, which is not "
            "installed: pip install blrppl[bench]"
        ) from err
    d = load_breast_cancer()
    x = (d.data - d.data.mean(0)) / d.data.std(0)
    return {"X": np.concatenate([np.ones((len(x), 1)), x], axis=1), "y": d.target.astype(float)}


@_bench
def logistic_breast_cancer():
    return BenchModel(
        "logistic_breast_cancer", logistic_model, breast_cancer_data(),
        note="real data (scikit-learn's breast cancer, N=569, D=31, strongly correlated features): "
        "joint Gaussian fits",
        source="real (scikit-learn breast cancer)",
    )


@_bench
def logistic_large():
    return BenchModel(
        "logistic_large", logistic_model, logistic_data(50_000, 10),
        note="N=50,000, D=10: posterior is very close to Gaussian",
    )


@_bench
def poisson_regression():
    rng = np.random.default_rng(3)
    X = _design(rng, 500, 4) * np.array([1.0, 0.5, 0.5, 0.5])
    y = rng.poisson(np.exp(X @ np.array([0.5, 0.4, -0.6, 0.2]))).astype(float)
    return BenchModel("poisson_regression", poisson_model, {"X": X, "y": y}, note="log-link GLM, joint Gaussian fits")


@_bench
def eight_schools():
    sigma = np.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])
    y = np.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
    return BenchModel(
        "eight_schools", eight_schools_model, {"sigma": sigma, "y": y}, representable=False,
        note="funnel between τ and θ: no Gaussian × log-normal family represents it (τ's sd is underestimated)",
        params=["mu", "tau"] + [f"theta[{j}]" for j in range(1, 9)],
    )


@_bench
def random_intercepts():
    rng = np.random.default_rng(4)
    J, N = 30, 400
    county = rng.integers(0, J, size=N)
    county[:J] = np.arange(J)
    a = 1.5 + 0.7 * rng.normal(size=J)
    x = rng.integers(0, 2, size=N).astype(float)
    y = a[county] - 0.6 * x + 0.8 * rng.normal(size=N)
    return BenchModel(
        "random_intercepts", random_intercepts_model,
        {"county": county, "x": x, "num_counties": J, "y": y},
        note="hierarchical Gaussian; mean-field between a and σ_a",
    )


def _normal_gamma_reference(y):
    n, ybar = len(y), float(np.mean(y))
    kn = NG_K0 + n
    mn = (NG_K0 * NG_M0 + n * ybar) / kn
    an = NG_A0 + n / 2
    bn = NG_B0 + 0.5 * np.sum((y - ybar) ** 2) + NG_K0 * n * (ybar - NG_M0) ** 2 / (2 * kn)
    tau = stats.gamma(an, scale=1 / bn)
    mu = stats.t(2 * an, loc=mn, scale=np.sqrt(bn / (an * kn)))
    return {"mu": (float(mu.mean()), float(mu.std())), "tau": (float(tau.mean()), float(tau.std()))}


@_bench
def normal_gamma():
    y = np.random.default_rng(5).normal(1.3, 0.7, size=50)
    return BenchModel(
        "normal_gamma", normal_gamma_model, {"y": y}, reference=_normal_gamma_reference(y),
        note="exact reference (Student-t / Gamma marginals); mean-field q(μ)q(τ) keeps both marginals' means",
    )


@_bench
def beta_bernoulli():
    y = (np.random.default_rng(6).uniform(size=100) < 0.3).astype(float)
    post = stats.beta(2.0 + y.sum(), 2.0 + len(y) - y.sum())
    return BenchModel(
        "beta_bernoulli", beta_bernoulli_model, {"y": y}, reference={"p": (float(post.mean()), float(post.std()))},
        note="conjugate: exact in one step",
    )


@_bench
def gaussian_mixture():
    rng = np.random.default_rng(7)
    w, mu = np.array([0.3, 0.3, 0.4]), np.array([-4.0, 0.0, 5.0])
    z = rng.choice(GMM_K, size=300, p=w)
    y = mu[z] + GMM_SD * rng.normal(size=300)
    return BenchModel(
        "gaussian_mixture", mixture_model, {"y": y}, sampler_model=mixture_marginal_model,
        canonical=_sort_components,
        note="z enumerated by BLR, summed out for NUTS/SVI; components sorted by mean before comparing",
        params=[f"mu[{k}]" for k in range(1, GMM_K + 1)] + [f"w[{k}]" for k in range(1, GMM_K + 1)],
    )


@_bench
def robust_regression():
    rng = np.random.default_rng(8)
    X = _design(rng, 300, 3)
    y = X @ np.array([1.0, 2.0, -1.0]) + 0.5 * rng.standard_t(3.0, size=300)
    return BenchModel(
        "robust_regression", robust_regression_model, {"X": X, "y": y},
        note="Student-t likelihood: no closed form, Gaussian on (β, log σ) by quadrature / Monte Carlo",
    )


@_bench
def bnn():
    rng = np.random.default_rng(9)
    X = rng.uniform(-2, 2, size=(100, 2))
    y = np.tanh(X @ np.array([1.0, -0.5])) - 0.5 * np.tanh(X @ np.array([0.3, 1.0])) + 0.1 * rng.normal(size=100)
    return BenchModel(
        "bnn", bnn_model, {"X": X, "y": y}, representable=False,
        note="multimodal (hidden-unit sign flips and permutations): a Gaussian covers one mode, NUTS mixes between them",
    )


@_bench
def gp_poisson():
    rng = np.random.default_rng(10)
    xy = rng.uniform(0.0, 5.0, size=(10, 2))
    dist_matrix = np.sqrt(((xy[:, None] - xy[None]) ** 2).sum(-1))
    log_pop = rng.normal(8.0, 1.5, size=10)
    k = rng.multivariate_normal(np.zeros(10), 0.2 * np.exp(-0.5 * dist_matrix**2) + 0.01 * np.eye(10))
    tools = rng.poisson(1.2 * np.exp(0.25 * log_pop) * np.exp(k))
    return BenchModel(
        "gp_poisson", gp_poisson_model, {"dist_matrix": dist_matrix, "log_pop": log_pop, "tools": tools},
        note="GP prior over a 10 × 10 distance matrix, Poisson counts (issue 55: 324 s unconverged against NUTS's 40 s)",
    )


@_bench
def lkj_slopes():
    rng = np.random.default_rng(11)
    cafes, visits = 20, 10
    ab = rng.multivariate_normal([3.5, -1.0], [[1.0, -0.35], [-0.35, 0.25]], size=cafes)
    cafe = np.repeat(np.arange(cafes), visits)
    afternoon = np.tile(np.arange(2), cafes * visits // 2)
    wait = ab[cafe, 0] + ab[cafe, 1] * afternoon + 0.5 * rng.normal(size=cafes * visits)
    return BenchModel(
        "lkj_slopes", lkj_slopes_model, {"cafe": cafe, "afternoon": afternoon, "wait": wait},
        note="varying slopes, LKJ(2) correlation (issue 55: 117 s against NUTS's 38 s)",
    )


@_bench
def ordered_logistic():
    rng = np.random.default_rng(12)
    X = rng.normal(size=(10_000, 3))
    latent = X @ np.array([1.0, -0.5, 0.3]) + rng.logistic(size=10_000)
    return BenchModel(
        "ordered_logistic", ordered_logistic_model, {"X": X, "y": np.digitize(latent, [-1.0, 0.0, 1.5])},
        note="ordered logistic on 10⁴ rows (issue 55: 108 s against NUTS's 68 s)",
    )


@_bench
def semi_supervised_hmm():
    rng = np.random.default_rng(13)
    num_categories, num_words = 3, 10
    trans = rng.dirichlet(np.ones(num_categories) * 2.0, size=num_categories) * 0.4 + 0.6 * np.eye(num_categories)
    emit = rng.dirichlet(np.ones(num_words) * 0.5, size=num_categories)
    states = [0]
    for _ in range(599):
        states.append(rng.choice(num_categories, p=trans[states[-1]]))
    states = np.array(states)
    words = np.array([rng.choice(num_words, p=emit[s]) for s in states])
    data = {
        "num_categories": num_categories, "num_words": num_words, "supervised_categories": states[:100],
        "supervised_words": words[:100], "unsupervised_words": words[100:],
    }
    return BenchModel(
        "semi_supervised_hmm", semi_supervised_hmm_model, data,
        note="NumPyro's semi-supervised HMM, forward algorithm in a scan (issue 55: 36 s)",
    )


def names() -> list:
    return list(MODELS)


def load(name: str) -> BenchModel:
    """The benchmark problem ``name``: one of :func:`names` or a posteriordb posterior."""
    if name in MODELS:
        return MODELS[name]()
    if name in posteriordb.POSTERIORS:
        model, data, reference = posteriordb.load(name)
        representable = True
        note = "linear regression: Gaussian β, σ Gaussian on log σ (conjugate-like, nearly exact)"
        if name.startswith("eight_schools"):
            note = "non-centred: θ̃, μ Gaussian, τ log-normal; its skewed τ is approximated"
        return BenchModel(name, model, data, reference, representable=representable, note=note, source="posteriordb")
    raise KeyError(f"unknown benchmark model {name!r}; known: {names() + posteriordb.names()}")
