"""NumPyro ports of posteriordb regression posteriors, with their reference summaries.

The Stan programs are in ``stan-dev/posteriordb`` (BSD-3-Clause; the licence is shipped in
``data/posteriordb/LICENCE.md`` next to the data). Each port follows its Stan program:

* Stan's implicit flat priors are ``dist.ImproperUniform(support, (), shape)``;
* ``transformed data`` is computed here in numpy, once, by :func:`load`;
* transformed parameters that the reference stores (eight schools' ``theta``) are
  ``numpyro.deterministic`` sites.

Usage::

    model, data, reference = load("kidiq-kidscore_interaction")
    result = blr_fit(model, data)
    estimate = summarize(model, data, result)       # 'beta[1]' -> (mean, sd), like reference

:func:`flatten_draws` maps draws of the model's sites (a dict, or a fit result) to the
reference's parameter names with Stan's 1-based indexing.
"""

from __future__ import annotations

import functools
import json
import zipfile
from importlib import resources

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.distributions import constraints

#: posterior name → (data file stem, port)
POSTERIORS: dict = {}


def _posterior(name: str, data: str):
    def register(fn):
        POSTERIORS[name] = (data, fn)
        return fn

    return register


def _flat(support, shape=()):
    """Stan's implicit (improper) flat prior on ``support``."""
    return dist.ImproperUniform(support, (), tuple(shape))


# --------------------------------------------------------------------------- models


def blr(X, y=None):
    """sblrc-blr (blr.stan): linear regression, Normal(0, 10) priors, half-normal σ."""
    D = X.shape[1]
    beta = numpyro.sample("beta", dist.Normal(0.0, 10.0).expand([D]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(10.0))
    with numpyro.plate("N", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ beta, sigma), obs=y)


def linear_flat(X, y=None):
    """Linear regression ``y ~ normal(X beta, sigma)`` with flat priors on β and σ > 0
    (logearn_interaction, logmesquite_logvash, nes): ``X`` holds the intercept column."""
    beta = numpyro.sample("beta", _flat(constraints.real_vector, (X.shape[1],)))
    sigma = numpyro.sample("sigma", _flat(constraints.positive))
    with numpyro.plate("N", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ beta, sigma), obs=y)


def kidscore_interaction(X, y=None):
    """kidiq-kidscore_interaction: flat β, σ ~ half-Cauchy(0, 2.5)."""
    beta = numpyro.sample("beta", _flat(constraints.real_vector, (X.shape[1],)))
    sigma = numpyro.sample("sigma", dist.HalfCauchy(2.5))
    with numpyro.plate("N", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ beta, sigma), obs=y)


def kilpisjarvi(x, y=None, pmualpha=0.0, psalpha=1.0, pmubeta=0.0, psbeta=1.0):
    """kilpisjarvi_mod-kilpisjarvi: Normal priors on intercept and slope (uncentred x), flat σ."""
    alpha = numpyro.sample("alpha", dist.Normal(pmualpha, psalpha))
    beta = numpyro.sample("beta", dist.Normal(pmubeta, psbeta))
    sigma = numpyro.sample("sigma", _flat(constraints.positive))
    with numpyro.plate("N", x.shape[0]):
        numpyro.sample("y", dist.Normal(alpha + beta * x, sigma), obs=y)


def diamonds(Xc, Y=None):
    """diamonds-diamonds (brms): centred design matrix without the intercept column,
    b ~ Normal(0, 1), Intercept ~ Student-t(3, 8, 10), σ ~ half-Student-t(3, 0, 10)."""
    b = numpyro.sample("b", dist.Normal(0.0, 1.0).expand([Xc.shape[1]]).to_event(1))
    intercept = numpyro.sample("Intercept", dist.StudentT(3.0, 8.0, 10.0))
    # student_t_lpdf(sigma | 3, 0, 10) - student_t_lccdf(0 | 3, 0, 10) on sigma > 0
    sigma = numpyro.sample("sigma", dist.TruncatedDistribution(dist.StudentT(3.0, 0.0, 10.0), low=0.0))
    with numpyro.plate("N", Xc.shape[0]):
        numpyro.sample("Y", dist.Normal(intercept + Xc @ b, sigma), obs=Y)


def eight_schools_noncentered(sigma, y=None):
    """eight_schools-eight_schools_noncentered: θ = μ + τ θ̃ exposed as ``theta``."""
    J = sigma.shape[0]
    theta_trans = numpyro.sample("theta_trans", dist.Normal(0.0, 1.0).expand([J]).to_event(1))
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
    theta = numpyro.deterministic("theta", theta_trans * tau + mu)
    with numpyro.plate("J", J):
        numpyro.sample("y", dist.Normal(theta, sigma), obs=y)


# ------------------------------------------------------------ data (transformed data)


def _columns(*cols):
    return np.stack([np.asarray(c, dtype=float) for c in cols], axis=1)


@_posterior("sblrc-blr", "sblrc")
def _sblrc(d):
    return blr, {"X": np.asarray(d["X"], float).reshape(d["N"], d["D"]), "y": np.asarray(d["y"], float)}


@_posterior("kidiq-kidscore_interaction", "kidiq")
def _kidiq(d):
    hs, iq = np.asarray(d["mom_hs"], float), np.asarray(d["mom_iq"], float)
    X = _columns(np.ones_like(hs), hs, iq, hs * iq)
    return kidscore_interaction, {"X": X, "y": np.asarray(d["kid_score"], float)}


@_posterior("earnings-logearn_interaction", "earnings")
def _earnings(d):
    height, male = np.asarray(d["height"], float), np.asarray(d["male"], float)
    X = _columns(np.ones_like(height), height, male, height * male)
    return linear_flat, {"X": X, "y": np.log(np.asarray(d["earn"], float))}


@_posterior("mesquite-logmesquite_logvash", "mesquite")
def _mesquite(d):
    d1, d2 = np.asarray(d["diam1"], float), np.asarray(d["diam2"], float)
    ch, th = np.asarray(d["canopy_height"], float), np.asarray(d["total_height"], float)
    X = _columns(
        np.ones_like(d1),
        np.log(d1 * d2 * ch),
        np.log(d1 * d2),
        np.log(d1 / d2),
        np.log(th),
        np.asarray(d["group"], float),
    )
    return linear_flat, {"X": X, "y": np.log(np.asarray(d["weight"], float))}


@_posterior("nes2000-nes", "nes2000")
def _nes(d):
    age = np.asarray(d["age_discrete"])
    one = np.ones(len(age))
    X = _columns(
        one,
        d["real_ideo"],
        d["race_adj"],
        age == 2,
        age == 3,
        age == 4,
        d["educ1"],
        d["gender"],
        d["income"],
    )
    return linear_flat, {"X": X, "y": np.asarray(d["partyid7"], float)}


@_posterior("kilpisjarvi_mod-kilpisjarvi", "kilpisjarvi_mod")
def _kilpisjarvi(d):
    data = {"x": np.asarray(d["x"], float), "y": np.asarray(d["y"], float)}
    data.update({k: float(d[k]) for k in ("pmualpha", "psalpha", "pmubeta", "psbeta")})
    return kilpisjarvi, data


@_posterior("diamonds-diamonds", "diamonds")
def _diamonds(d):
    X = np.asarray(d["X"], float).reshape(d["N"], d["K"])
    if d.get("prior_only", 0):
        raise ValueError("diamonds: prior_only data is not supported")
    Xc = X[:, 1:] - X[:, 1:].mean(axis=0)
    return diamonds, {"Xc": Xc, "Y": np.asarray(d["Y"], float)}


@_posterior("eight_schools-eight_schools_noncentered", "eight_schools")
def _eight_schools(d):
    return eight_schools_noncentered, {"sigma": np.asarray(d["sigma"], float), "y": np.asarray(d["y"], float)}


# ------------------------------------------------------------------------ loading

_DATA = "data/posteriordb"


def _read(name: str) -> bytes:
    return resources.files("blrppl.bench").joinpath(f"{_DATA}/{name}").read_bytes()


@functools.lru_cache(maxsize=None)
def _raw_data(stem: str) -> dict:
    import io

    with zipfile.ZipFile(io.BytesIO(_read(f"{stem}.json.zip"))) as z:
        (member,) = [m for m in z.namelist() if m.endswith(".json")]
        return json.loads(z.read(member))


def names() -> list:
    """The posteriors :func:`load` knows."""
    return list(POSTERIORS)


def reference_summary(name: str) -> dict:
    """Reference parameter name (``'beta[1]'``) → (mean, sd) from the posteriordb draws."""
    summary = json.loads(_read(f"{name}.summary.json"))
    return {k: (float(v["mean"]), float(v["sd"])) for k, v in summary.items()}


def load(name: str):
    """``(model, data_kwargs, reference_summary)`` of a posteriordb posterior.

    ``data_kwargs`` are numpy arrays (and floats) for ``blr_fit(model, data_kwargs)`` or
    ``MCMC.run(key, **data_kwargs)``; ``reference_summary`` maps each reference parameter
    name to (mean, sd).
    """
    if name not in POSTERIORS:
        raise KeyError(f"unknown posterior {name!r}; known: {names()}")
    stem, port = POSTERIORS[name]
    model, data = port(_raw_data(stem))
    return model, data, reference_summary(name)


# ------------------------------------------------------------- draws → Stan names


def _sites_with_deterministic(model, data, draws: dict) -> dict:
    """Add the model's deterministic sites, computed from ``draws`` of its latent sites."""
    n = int(np.shape(next(iter(draws.values())))[0])

    def one(sample):
        tr = numpyro.handlers.trace(numpyro.handlers.substitute(numpyro.handlers.seed(model, 0), sample)).get_trace(
            **data
        )
        return {k: s["value"] for k, s in tr.items() if s["type"] == "deterministic"}

    if n == 0:
        return dict(draws)
    first = jax.eval_shape(one, {k: jnp.asarray(v[0]) for k, v in draws.items()})
    if not first:
        return dict(draws)  # no deterministic sites: the model is not run on every draw
    # ready before returning: JAX dispatches asynchronously, and the timing of whatever
    # runs next must not include this work
    det = jax.block_until_ready(jax.vmap(one)({k: jnp.asarray(v) for k, v in draws.items()}))
    return {**draws, **det}


def flatten_draws(draws, model=None, data=None) -> dict:
    """Stan-named draws: ``{'beta[1]': array (num_draws,), 'sigma': ...}``.

    Args:
        draws: a dict site → array with a leading draw axis, or a fit result with a
            ``sample(key, n)`` method (then 4000 draws with a fixed key are taken).
        model, data: when given, the model's deterministic sites (eight schools' ``theta``)
            are computed from the draws and included.
    """
    if hasattr(draws, "sample") and not isinstance(draws, dict):
        draws = draws.sample(jax.random.key(0), 4000)
    draws = {k: np.asarray(v) for k, v in draws.items()}
    if model is not None:
        draws = {k: np.asarray(v) for k, v in _sites_with_deterministic(model, data or {}, draws).items()}
    out = {}
    for site, x in draws.items():
        if x.ndim == 1:
            out[site] = x
            continue
        for idx in np.ndindex(x.shape[1:]):
            out[f"{site}[{','.join(str(i + 1) for i in idx)}]"] = x[(slice(None),) + idx]
    return out


def summarize(draws, model=None, data=None, names=None) -> dict:
    """Parameter name → (mean, sd) of draws (see :func:`flatten_draws`), restricted to
    ``names`` (e.g. the reference summary's keys) when given."""
    flat = flatten_draws(draws, model, data)
    keys = list(flat) if names is None else list(names)
    return {k: (float(np.mean(flat[k])), float(np.std(flat[k]))) for k in keys}


def compare(estimate: dict, reference: dict) -> dict:
    """Per-posterior accuracy: largest |mean error| in reference sds, and the range of
    estimated/reference sd ratios (over the reference's parameters)."""
    errs = {k: abs(estimate[k][0] - m) / s for k, (m, s) in reference.items()}
    ratios = {k: estimate[k][1] / s for k, (_, s) in reference.items()}
    return {
        "max_mean_err_sd": max(errs.values()),
        "sd_ratio_min": min(ratios.values()),
        "sd_ratio_max": max(ratios.values()),
        "mean_err_sd": errs,
        "sd_ratio": ratios,
    }
