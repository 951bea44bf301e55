"""``python -m blrppl.bench --mixtures``: Gaussian mixtures fitted by the learning rule on a small
Bayesian neural network whose posterior has sign-flip modes (issue 53), against NUTS.

The network: one input, two tanh hidden units with biases, a linear output with a bias, N(0, 1)
priors on its 7 weights and Gaussian noise of known sd :data:`NOISE`. Flipping the signs of a
hidden unit's input weight, bias and output weight leaves the function unchanged, and so does
swapping the two units: the posterior has (at least) 2² · 2 = 8 equivalent modes, and a single
Gaussian holds one. The data: :data:`N_TRAIN` inputs spread over [−3, 3] with a gap in the middle
(where the modes' functions may differ), the held-out set :data:`N_TEST` inputs over the whole
range.

``blr_fit`` fits the weights as one joint block (``structure="joint"``), a mixture of K dense
Gaussians over all of them (``families={site: ("gaussian-mixture", K)}`` for every weight site:
one mixture over the joint block), for K = 1, 4, 8; NUTS runs one chain of
:data:`NUTS_WARMUP` + :data:`NUTS_SAMPLES`. Each is scored by its held-out predictive
log-likelihood, the mean over test points of log (1/S) Σ_s N(y | f(x; w_s), NOISE²) over S
posterior draws (:data:`DRAWS`), and its time. The table goes to ``<out>/mixtures-bench.md``.

A second table (:func:`bound_rows`) puts the mixture beside the single Gaussian on every model
of the main bench (issue 53: the mixture contains the single component, so its ELBO should be
at least the single Gaussian's): each model's first fit (``refine=False``), then a mixture of
:data:`BOUND_COMPONENTS` over every site of its global Gaussian blocks (at most
:data:`blrppl.engine.refine.MIXTURE_MAX_DIM` scalars, as the refinement's candidate), both scored
by numpyro's own ``Trace_ELBO`` on ``result.guide`` with :data:`BOUND_DRAWS` draws (one
estimator for both; its standard error is printed beside it).

A third table (``--heavy-tails``, :func:`heavy_tail_rows`) puts the mixture beside the single
Gaussian on models whose coefficients have heavy-tailed scales (issue 53: coefficients within
0.2 NUTS sd and sds within 0.75–1.33× of NUTS's): NumPyro's horseshoe regression with a normal
likelihood (:func:`horseshoe_regression`, as its example writes it) and the eight schools with a
half-Cauchy scale (:func:`blrppl.bench.models.eight_schools_model`). For each, the single Gaussian (``refine=False``) and
mixtures over the coefficients' or the scales' sites, each scored by its coefficients' largest and
mean |mean error| in NUTS sds and the range of their sd ratios (and the global scale's, on its
logarithm: a half-Cauchy scale's posterior sd need not exist), from :data:`HEAVY_DRAWS` draws of
``result.sample`` (deterministic sites included), against NUTS (:data:`HEAVY_CHAINS` chains of
:data:`HEAVY_WARMUP` + :data:`HEAVY_SAMPLES`, target acceptance 0.99; the eight schools sampled
non-centred, the same posterior).

Not a test: the first table runs for a minute or two, the second for about ten.
"""

from __future__ import annotations

import argparse
import pathlib
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import random

from blrppl.bench import models

NOISE = 0.15
N_TRAIN = 40
N_TEST = 200
DRAWS = 1000
NUTS_WARMUP = 500
NUTS_SAMPLES = 500
COMPONENTS = (1, 4, 8)
#: the data sets (and the fits' keys): a held-out score of one data set has the test set's noise
SEEDS = (0, 1, 2)
SITES = ("w_in", "b_in", "w_out", "b_out")
#: the mixtures' components and the ELBO's draws of the bound table
BOUND_COMPONENTS = 4
BOUND_DRAWS = 4000


def network(w, x):
    """The network's output at inputs ``x`` (N,), for weights ``w`` (site → array)."""
    h = jnp.tanh(x[:, None] * w["w_in"] + w["b_in"])
    return h @ w["w_out"] + w["b_out"]


def two_unit_bnn(x, y=None):
    """Two tanh hidden units, N(0, 1) weights, Gaussian noise of sd :data:`NOISE`."""
    w = {
        "w_in": numpyro.sample("w_in", dist.Normal(0.0, 1.0).expand([2]).to_event(1)),
        "b_in": numpyro.sample("b_in", dist.Normal(0.0, 1.0).expand([2]).to_event(1)),
        "w_out": numpyro.sample("w_out", dist.Normal(0.0, 1.0).expand([2]).to_event(1)),
        "b_out": numpyro.sample("b_out", dist.Normal(0.0, 1.0)),
    }
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(network(w, x), NOISE), obs=y)


def data(seed: int = 0):
    """``(train, test)``, each ``(x, y)``: y = tanh(2x − 1) − 0.8 tanh(1.5x + 1) + noise; the
    training inputs leave out (−0.5, 0.5)."""
    rng = np.random.default_rng(seed)

    def truth(x):
        return np.tanh(2.0 * x - 1.0) - 0.8 * np.tanh(1.5 * x + 1.0)

    x = np.concatenate([rng.uniform(-3.0, -0.5, N_TRAIN // 2), rng.uniform(0.5, 3.0, N_TRAIN - N_TRAIN // 2)])
    x_test = rng.uniform(-3.0, 3.0, N_TEST)
    return (x, truth(x) + NOISE * rng.normal(size=x.size)), (x_test, truth(x_test) + NOISE * rng.normal(size=N_TEST))


def predictive_log_likelihood(draws: dict, x, y) -> float:
    """Mean over the points of log (1/S) Σ_s N(y | f(x; w_s), NOISE²) over the S draws."""
    f = jax.vmap(lambda w: network(w, jnp.asarray(x)))({s: jnp.asarray(draws[s]) for s in SITES})
    log_p = dist.Normal(f, NOISE).log_prob(jnp.asarray(y))
    return float(jnp.mean(jax.scipy.special.logsumexp(log_p, axis=0) - np.log(log_p.shape[0])))


def run_blr(train, test, k: int, seed: int = 0) -> dict:
    """``blr_fit`` with a mixture of ``k`` dense Gaussians over the weights' joint block."""
    from blrppl import blr_fit

    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a poor-q warning: the table reports k̂)
        result = blr_fit(
            two_unit_bnn, {"x": train[0], "y": train[1]}, structure="joint",
            families={s: ("gaussian-mixture", k) for s in SITES}, rng_key=random.PRNGKey(seed), progress_bar=False,
        )
    seconds = time.perf_counter() - t0
    draws = result.sample(random.PRNGKey(seed + 1), DRAWS)
    return {
        "method": f"blr_fit, mixture of K = {k}",
        "seed": seed,
        "lpd": predictive_log_likelihood(draws, *test),
        "seconds": seconds,
        "khat": float(result.diagnostics.khat),
        "bound": float(result.diagnostics.bound),
    }


def run_nuts(train, test, seed: int = 0) -> dict:
    """NUTS, one chain of :data:`NUTS_WARMUP` + :data:`NUTS_SAMPLES`."""
    from numpyro.infer import MCMC, NUTS

    t0 = time.perf_counter()
    mcmc = MCMC(NUTS(two_unit_bnn), num_warmup=NUTS_WARMUP, num_samples=NUTS_SAMPLES, progress_bar=False)
    mcmc.run(random.PRNGKey(seed), x=train[0], y=train[1])
    seconds = time.perf_counter() - t0
    return {
        "method": f"NUTS, 1 chain ({NUTS_WARMUP} + {NUTS_SAMPLES})",
        "seed": seed,
        "lpd": predictive_log_likelihood(mcmc.get_samples(), *test),
        "seconds": seconds,
        "khat": float("nan"),
        "bound": float("nan"),
    }


def table(rows: list) -> str:
    """The markdown table of the rows."""
    lines = [
        "| data seed | method | held-out predictive log-likelihood (per point) | PSIS k̂ | importance-weighted bound "
        "| time (s) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        khat = "" if np.isnan(r["khat"]) else f"{r['khat']:.2f}"
        bound = "" if np.isnan(r["bound"]) else f"{r['bound']:.2f}"
        lines.append(f"| {r.get('seed', 0)} | {r['method']} | {r['lpd']:.3f} | {khat} | {bound} | {r['seconds']:.1f} |")
    return "\n".join(lines) + "\n"


def run(components=COMPONENTS, seeds=SEEDS, log=print) -> list:
    """The rows: for each data set (``seeds``), ``blr_fit`` with each K of ``components``, then NUTS
    (the fits' keys are the data's seed)."""
    rows = []
    for seed in seeds:
        train, test = data(seed)
        for k in components:
            rows.append(run_blr(train, test, k, seed))
            log(f"  data {seed}, K = {k}: held-out log-likelihood {rows[-1]['lpd']:.3f}, {rows[-1]['seconds']:.1f} s")
        rows.append(run_nuts(train, test, seed))
        log(f"  data {seed}, NUTS: held-out log-likelihood {rows[-1]['lpd']:.3f}, {rows[-1]['seconds']:.1f} s")
    return rows


def _elbo(model, data, guide, key) -> tuple:
    """numpyro's ``Trace_ELBO`` of ``guide`` (mean, standard error), from :data:`BOUND_DRAWS`
    single-draw estimates."""
    from numpyro.infer import Trace_ELBO

    args, kwargs = (data, {}) if isinstance(data, tuple) else ((), data)
    loss = jax.vmap(lambda k: Trace_ELBO().loss(k, {}, model, guide, *args, **kwargs))
    values = -np.asarray(loss(random.split(key, BOUND_DRAWS)), dtype=float)
    return float(values.mean()), float(values.std() / np.sqrt(values.size))


def bound_rows(names=None, log=print) -> list:
    """The second table's rows (see the module): per bench model, the single Gaussian's and the
    mixture's ELBO (numpyro's ``Trace_ELBO``), their PSIS k̂ and the mixture's sites."""
    from blrppl import blr_fit
    from blrppl.bench import posteriordb
    from blrppl.engine.refine import MIXTURE_MAX_DIM, mixture_sites

    rows = []
    for name in names or posteriordb.names() + models.names():
        bm = models.load(name)
        options = dict(bm.blr_kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            single = blr_fit(bm.model, bm.data, progress_bar=False, refine=False, rng_key=random.PRNGKey(0), **options)
            eligible = mixture_sites(single.plan, dict(options.get("families") or {}))
            size = sum(b.size for b in {id(b): b for b in eligible.values()}.values())
            row = {"model": name, "sites": tuple(eligible), "size": size}
            if not eligible or size > MIXTURE_MAX_DIM:
                rows.append({**row, "single": _elbo(bm.model, bm.data, single.guide, random.PRNGKey(1))})
                log(f"  {name}: no mixture ({size} scalars in global Gaussian blocks)")
                continue
            families = {**(options.pop("families", None) or {}), **{s: ("gaussian-mixture", BOUND_COMPONENTS) for s in eligible}}
            t0 = time.perf_counter()
            mixture = blr_fit(bm.model, bm.data, progress_bar=False, rng_key=random.PRNGKey(0), families=families, **options)
            seconds = time.perf_counter() - t0
        row.update(
            single=_elbo(bm.model, bm.data, single.guide, random.PRNGKey(1)),
            mixture=_elbo(bm.model, bm.data, mixture.guide, random.PRNGKey(1)),
            khat=(float(single.diagnostics.khat), float(mixture.diagnostics.khat)), seconds=seconds,
            components=[b.family.num_components for b in mixture.plan.blocks if b.family.name == "gaussian-mixture"],
        )
        rows.append(row)
        log(f"  {name}: ELBO single {row['single'][0]:.3f}, mixture {row['mixture'][0]:.3f}")
    return rows


def bound_table(rows: list) -> str:
    lines = [
        f"| model | mixture's sites (scalars) | ELBO, single Gaussian | ELBO, mixture of {BOUND_COMPONENTS} | "
        "difference (± 2 se) | components kept | PSIS k̂ single / mixture | mixture s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        single = f"{r['single'][0]:.3f} ± {r['single'][1]:.3f}"
        if "mixture" not in r:
            lines.append(f"| {r['model']} | none ({r['size']} scalars) | {single} | | | | | |")
            continue
        diff = r["mixture"][0] - r["single"][0]
        se = 2 * float(np.hypot(r["mixture"][1], r["single"][1]))
        lines.append(
            f"| {r['model']} | {', '.join(r['sites'])} ({r['size']}) | {single} | {r['mixture'][0]:.3f} ± "
            f"{r['mixture'][1]:.3f} | {diff:+.3f} ± {se:.3f} | {', '.join(map(str, r['components']))} | "
            f"{r['khat'][0]:.2f} / {r['khat'][1]:.2f} | {r['seconds']:.1f} |"
        )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ heavy-tailed scales (issue 53)

#: NUTS's reference for the heavy-tail table: chains, warm-up and kept draws per chain
HEAVY_CHAINS = 4
HEAVY_WARMUP = 1000
HEAVY_SAMPLES = 1000
#: draws of each fit's q behind its moments
HEAVY_DRAWS = 20000
#: the issue's tolerances: |mean error| in NUTS sds, and the sd ratios' range
MEAN_TOL = 0.2
SD_RANGE = (0.75, 1.33)


def horseshoe_regression(X, Y=None):
    """NumPyro's horseshoe regression with a normal likelihood (its example's form): local
    scales ``lambdas`` and a global ``tau``, half-Cauchy; coefficients ``betas`` = tau ·
    lambdas · ``unscaled_betas`` (non-centred); the noise's precision ``prec_obs`` ~ Gamma(3, 1)."""
    d = X.shape[1]
    lambdas = numpyro.sample("lambdas", dist.HalfCauchy(jnp.ones(d)))
    tau = numpyro.sample("tau", dist.HalfCauchy(jnp.ones(1)))
    unscaled = numpyro.sample("unscaled_betas", dist.Normal(0.0, jnp.ones(d)))
    betas = numpyro.deterministic("betas", tau * lambdas * unscaled)
    prec_obs = numpyro.sample("prec_obs", dist.Gamma(3.0, 1.0))
    numpyro.sample("Y", dist.Normal(X @ betas, 1.0 / jnp.sqrt(prec_obs)), obs=Y)


def horseshoe_data(n: int = 100, d: int = 32, noise: float = 0.05) -> dict:
    """The example's data: standard normal covariates, the response 2 x₀ − x₁ + 0.5 x₂ centred,
    plus noise of sd ``noise``."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(n, d))
    Y = X[:, :3] @ np.array([2.0, -1.0, 0.5])
    return {"X": X, "Y": Y - Y.mean() + noise * rng.normal(size=n)}


def eight_schools_noncentred(sigma, y=None):
    """The same posterior over (μ, τ, θ), θ = μ + τ θ̃: what NUTS samples."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
    with numpyro.plate("J", sigma.shape[0]):
        raw = numpyro.sample("theta_raw", dist.Normal(0.0, 1.0))
        theta = numpyro.deterministic("theta", mu + tau * raw)
        numpyro.sample("obs", dist.Normal(theta, sigma), obs=y)


EIGHT_SCHOOLS = {
    "sigma": np.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0]),
    "y": np.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0]),
}


def _mix(k: int, *sites) -> dict:
    return {"families": {s: ("gaussian-mixture", k) for s in sites}}


#: name → (model, the model NUTS samples, data, coefficient sites, scale sites, fits: label → options)
HEAVY_MODELS = {
    "horseshoe regression (NumPyro's example, N = 100, D = 32)": (
        horseshoe_regression, horseshoe_regression, horseshoe_data(), ("betas",), ("tau",),
        {
            "single Gaussian": {"refine": False},
            "mixture K = 4 on unscaled_betas": _mix(4, "unscaled_betas"),
            "mixture K = 8 on unscaled_betas": _mix(8, "unscaled_betas"),
            "mixture K = 4 on lambdas": _mix(4, "lambdas"),
            "mixture K = 4 on tau": _mix(4, "tau"),
            "mixtures K = 4 on lambdas, tau, unscaled_betas": _mix(4, "lambdas", "tau", "unscaled_betas"),
        },
    ),
    "eight schools (tau ~ HalfCauchy(5))": (
        models.eight_schools_model, eight_schools_noncentred, EIGHT_SCHOOLS, ("mu", "theta"), ("tau",),
        {
            "single Gaussian": {"refine": False},
            "mixture K = 4 on theta (joint block)": _mix(4, "theta"),
            "mixture K = 8 on theta (joint block)": _mix(8, "theta"),
            "single Gaussian, mean-field": {"refine": False, "structure": "mean-field"},
            "mixture K = 8 on theta, mean-field": {**_mix(8, "theta"), "structure": "mean-field"},
        },
    ),
}


def _flat_moments(draws: dict, sites, scales=()) -> dict:
    """``site[i]`` → (mean, sd) of the draws (leading axis) of ``sites``, flattened; of the
    logarithm of those in ``scales`` (a half-Cauchy scale's posterior sd need not exist)."""
    out = {}
    for s in sites:
        v = np.asarray(draws[s], dtype=float).reshape(np.shape(draws[s])[0], -1)
        v = np.log(v) if s in scales else v
        for i in range(v.shape[1]):
            out[f"{s}[{i}]"] = (float(v[:, i].mean()), float(v[:, i].std()))
    return out


def _nuts_reference(model, data, sites, scales) -> tuple:
    """(moments of ``sites`` by NUTS (of the logarithms of ``scales``), its divergences, its time)."""
    from numpyro.infer import MCMC, NUTS

    t0 = time.perf_counter()
    mcmc = MCMC(
        NUTS(model, target_accept_prob=0.99), num_warmup=HEAVY_WARMUP, num_samples=HEAVY_SAMPLES,
        num_chains=HEAVY_CHAINS, chain_method="sequential", progress_bar=False,
    )
    mcmc.run(random.PRNGKey(0), extra_fields=("diverging",), **data)
    divergences = int(np.sum(np.asarray(mcmc.get_extra_fields()["diverging"])))
    return _flat_moments(mcmc.get_samples(), sites, scales), divergences, time.perf_counter() - t0


def _scores(moments: dict, ref: dict, names) -> dict:
    """The largest and mean |mean error| in NUTS sds and the sd ratios' range over ``names``."""
    err = np.array([abs(moments[n][0] - ref[n][0]) / ref[n][1] for n in names])
    ratio = np.array([moments[n][1] / ref[n][1] for n in names])
    inside = (err <= MEAN_TOL) & (ratio >= SD_RANGE[0]) & (ratio <= SD_RANGE[1])
    return {"max": float(err.max()), "mean": float(err.mean()), "ratio": (float(ratio.min()), float(ratio.max())),
            "inside": int(inside.sum()), "count": int(err.size)}


def heavy_tail_rows(log=print) -> list:
    """The heavy-tail table's rows (see the module): per model, NUTS and every fit's scores on
    the coefficients and on the scales."""
    from blrppl import blr_fit

    rows = []
    for name, (model, sampler, data, coefs, scales, fits) in HEAVY_MODELS.items():
        ref, divergences, nuts_s = _nuts_reference(sampler, data, coefs + scales, scales)
        log(f"  {name}: NUTS {nuts_s:.0f} s, {divergences} divergences")
        rows.append({"model": name, "fit": f"NUTS ({HEAVY_CHAINS} × {HEAVY_WARMUP} + {HEAVY_SAMPLES}, "
                     f"{divergences} divergent)", "seconds": nuts_s})
        coef_names = [n for n in ref if n.split("[")[0] in coefs]
        scale_names = [n for n in ref if n.split("[")[0] in scales]
        for label, options in fits.items():
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (a poor-q warning: the table reports k̂)
                result = blr_fit(model, data, rng_key=random.PRNGKey(0), progress_bar=False, **options)
            seconds = time.perf_counter() - t0
            moments = _flat_moments(result.sample(random.PRNGKey(1), HEAVY_DRAWS), coefs + scales, scales)
            rows.append({
                "model": name, "fit": label, "seconds": seconds, "khat": float(result.diagnostics.khat),
                "coefs": _scores(moments, ref, coef_names), "scales": _scores(moments, ref, scale_names),
            })
            c = rows[-1]["coefs"]
            log(f"    {label}: coefficients max {c['max']:.2f} sd, ratios {c['ratio'][0]:.2f}-{c['ratio'][1]:.2f}")
    return rows


def heavy_tail_table(rows: list) -> str:
    lines = [
        "| model | fit | coefficients: max / mean \\|mean error\\| (NUTS sd) | coefficients: sd ratio | within "
        "tolerance | log scale: \\|mean error\\| / sd ratio | PSIS k̂ | time (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "coefs" not in r:
            lines.append(f"| {r['model']} | {r['fit']} | | | | | | {r['seconds']:.0f} |")
            continue
        c, s = r["coefs"], r["scales"]
        lines.append(
            f"| {r['model']} | {r['fit']} | {c['max']:.2f} / {c['mean']:.2f} | {c['ratio'][0]:.2f}–{c['ratio'][1]:.2f} "
            f"| {c['inside']} of {c['count']} | {s['max']:.2f} / {s['ratio'][0]:.2f} | {r['khat']:.2f} "
            f"| {r['seconds']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m blrppl.bench --mixtures", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-out")
    p.add_argument("--float32", action="store_true", help="run in float32 (default float64)")
    p.add_argument("--bounds-only", action="store_true", help="only the bound table over the bench models")
    p.add_argument("--heavy-tails", action="store_true", help="only the heavy-tailed scales' table (horseshoe, eight schools)")
    args = p.parse_args(argv)
    if not args.float32:
        numpyro.enable_x64()
    if args.heavy_tails:
        print("Gaussian mixtures on models with heavy-tailed scales, against NUTS:", flush=True)
        text = heavy_tail_table(heavy_tail_rows(log=lambda s: print(s, flush=True)))
        path = pathlib.Path(args.out) / "mixtures-heavy-tails.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(text + f"wrote {path}", flush=True)
        return 0
    print("Gaussian mixtures on a two-hidden-unit Bayesian network (held-out predictive log-likelihood):", flush=True)
    rows = [] if args.bounds_only else run(log=lambda s: print(s, flush=True))
    print("the mixture's ELBO beside the single Gaussian's on every bench model:", flush=True)
    bounds = bound_rows(log=lambda s: print(s, flush=True))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "mixtures-bench.md"
    path.write_text((table(rows) + "\n" if rows else "") + bound_table(bounds))
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
