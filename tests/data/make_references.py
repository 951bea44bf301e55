"""Long-NUTS reference posteriors for the models of ``tests/reference_models.py``.

    .venv/bin/python tests/data/make_references.py [model ...]

(no model: every model of ``MODELS`` and ``DIAGNOSTIC_MODELS``; a name may come from either.)

For each model: NUTS, 4 chains × 5000 draws after 2000 warm-up steps (float64, fixed seeds,
chains in parallel on 4 host devices; ``NUTS_SETTINGS`` lengthens the runs and raises the target
acceptance of the hard ones), then the mean and sd of every element of every continuous latent
site of the model the tests fit, named ``site[i]`` (0-based flat index; scalar sites keep their
name), their covariance matrix (``cov``: names and matrix, for derived quantities), the data and
NUTS seeds, and the convergence diagnostics (largest split R-hat, smallest effective sample size
over the stored parameters, divergent transitions) are written to ``tests/data/<model>.json``.

Where NUTS cannot run the model the tests fit (``rm.NUTS_MODELS``: a centred horseshoe diverges,
discrete latents need funsor), it samples an equivalent model (non-centred, or with the discrete
latents summed out by hand): the same posterior over the stored sites, stored under the names of
the model the tests fit. Where the posterior has symmetric modes between which the chains hop
(``rm.RELABEL``: Dawid-Skene's relabelled classes), the chains start at ``rm.NUTS_INITS`` and
every draw is mapped into one mode before the moments and diagnostics are taken.
``prior_mixture`` has no NUTS run: its posterior is its prior, whose
moments are written in closed form (``"exact": true``).

For the models of ``SVI_REFERENCES`` the script also fits numpyro's SVI with an ``AutoNormal``
guide to the model the tests fit (``rm.SVI_MODELS`` where an autoguide cannot hold it: the
marginalised model), Adam with an exponentially decaying step size, for each initial step size of
``SVI_STEP_SIZES``; the run with the best final ELBO (estimated with ``SVI_EVAL_PARTICLES``
particles and a fixed key) is kept. Its mean and sd per parameter (from ``SVI_DRAWS`` guide
draws, fixed key) are written under ``"svi"`` (the layout of ``"params"``), its settings, the
ELBO at every checkpoint of every candidate run and its distance to NUTS under ``"svi_settings"``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpyro

numpyro.set_host_device_count(4)
numpyro.enable_x64()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from numpyro import handlers  # noqa: E402
from numpyro.distributions import constraints  # noqa: E402
from numpyro.diagnostics import effective_sample_size, split_gelman_rubin  # noqa: E402
from numpyro.infer import MCMC, NUTS, SVI, Trace_ELBO  # noqa: E402
from numpyro.infer.autoguide import AutoNormal  # noqa: E402
from numpyro.infer.initialization import init_to_value  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import reference_models as rm  # noqa: E402

NUM_CHAINS = 4
NUM_WARMUP = 2000
NUM_SAMPLES = 5000
TARGET_ACCEPT_PROB = 0.9
NUTS_SEEDS = {
    "logistic": 101,
    "poisson": 102,
    "student_t": 103,
    "student_t_vague": 106,
    "factor": 104,
    "simplex": 105,
    "horseshoe": 107,
    "glmm_admissions": 108,
    "coupled_discrete": 109,
    "random_walk": 110,
    "stochastic_volatility": 111,
    "item_response": 112,
    "student_t_volatility": 113,
    "gp_example": 114,
    "imputed_logistic": 115,
    "eight_schools": 116,
    "crossed_glmm": 151,
    "oceanic_gp": 152,
}
#: per-model overrides of the NUTS settings above
NUTS_SETTINGS = {
    # (a funnel of the GP's scale: divergences at the default acceptance)
    "oceanic_gp": {"num_warmup": 3000, "num_samples": 10000, "target_accept_prob": 0.995},
    # w non-centred around its conditional posterior (rm.horseshoe_noncentred_model): no funnel
    # left, but heavy-tailed lambdas; long runs for ESS > 5000 on every parameter
    "horseshoe": {"num_warmup": 3000, "num_samples": 10000, "target_accept_prob": 0.99},
    "glmm_admissions": {"num_warmup": 3000, "num_samples": 10000, "target_accept_prob": 0.95},
    # the step scale s mixes slowly against the 600 states (ESS ≈ 5 % of the draws)
    "random_walk": {"num_warmup": 3000, "num_samples": 30000},
    "stochastic_volatility": {"num_warmup": 2000, "num_samples": 15000},
    # (sampled as rm.item_response_centred_model; the global mean still mixes at ESS ≈ 22 % of the draws)
    "item_response": {"num_samples": 7000},
    # NumPyro's example: the walk's step scale mixes slowly against the 2,000 states (ESS ≈ 2 %
    # of the draws in a 4 × 5,000 run)
    "student_t_volatility": {"num_samples": 25000},
    # the kernel variance mixes slowly (ESS ≈ 20 % of the draws)
    "gp_example": {"num_samples": 10000},
    # (sampled non-centred, rm.eight_schools_noncentred_model: tau mixes at ESS ≈ 30 % of the draws)
    "eight_schools": {"num_samples": 10000, "target_accept_prob": 0.95},
    # (sampled non-centred, rm.crossed_glmm_noncentred_model: the slopes' scale near 0 is a funnel)
    "crossed_glmm": {"num_samples": 10000, "target_accept_prob": 0.95},
}
# issue 51's example models (kept in one block for merging)
NUTS_SEEDS.update({"baseball_pooled": 117, "baseball_logit": 118, "dawid_skene": 119, "change_point": 120})
NUTS_SETTINGS.update(
    {
        # (sampled as rm.baseball_pooled_nuts_model, phi non-centred around its conditional)
        "baseball_pooled": {},
        # (sampled non-centred; the scale mixes at ESS ≈ 40 % of the draws)
        "baseball_logit": {"num_samples": 10000},
        # (the classes summed out by hand; the draws relabelled: rm.RELABEL; ESS ≈ 40 %)
        "dawid_skene": {"num_samples": 10000},
        # (the switch year summed out by hand)
        "change_point": {},
    }
)

#: per model, sites whose posterior has no finite variance (their stored sd does not converge);
#: for the models listed, the log moments of the positive sites are stored as well
#: (``log_params``; the GP example's kernel parameters are fitted on the log scale; the
#: baseball model's Pareto concentration keeps its prior's tail ∝ κ^-2.5)
HEAVY_TAILED = {"horseshoe": ("lambdas",), "gp_example": (), "baseball_pooled": ("kappa",)}

#: references with more parameters store no covariance matrix
MAX_COV_PARAMETERS = 100

#: closed-form references (no NUTS run)
EXACT = ("prior_mixture",)

SVI_REFERENCES = ("horseshoe", "glmm_admissions", "coupled_discrete")
SVI_SEEDS = {"horseshoe": 207, "glmm_admissions": 208, "coupled_discrete": 209}
SVI_STEP_SIZES = (0.005, 0.01, 0.02)
SVI_NUM_STEPS = 100_000
SVI_CHECKPOINTS = 10  # the ELBO is estimated after every SVI_NUM_STEPS / SVI_CHECKPOINTS steps
SVI_DECAY = 0.001  # the step size decays exponentially to SVI_DECAY × its initial value
SVI_PARTICLES = 16  # per gradient step
SVI_EVAL_PARTICLES = 20_000
SVI_DRAWS = 20_000


def nuts_settings(name: str) -> dict:
    settings = {
        "num_chains": NUM_CHAINS,
        "num_warmup": NUM_WARMUP,
        "num_samples": NUM_SAMPLES,
        "target_accept_prob": TARGET_ACCEPT_PROB,
        "max_tree_depth": 10,
    }
    settings.update(NUTS_SETTINGS.get(name, {}))
    return settings


def stored_sites(model, data) -> list:
    """The continuous latent sample sites of ``model``, in model order."""
    tr = handlers.trace(handlers.seed(model, jax.random.key(0))).get_trace(**data)
    return [
        s
        for s, site in tr.items()
        if site["type"] == "sample" and not site["is_observed"] and not site["fn"].support.is_discrete
    ]


def _param_names(site, shape):
    n = int(np.prod(shape, dtype=int))
    return [site] if len(shape) == 0 else [f"{site}[{i}]" for i in range(n)]


def moments(draws: dict) -> dict:
    """{site: (num_draws, *shape)} → {parameter: {mean, sd}}."""
    out = {}
    for site, x in draws.items():
        x = np.asarray(x)
        flat = x.reshape(x.shape[0], -1)
        for i, key in enumerate(_param_names(site, x.shape[1:])):
            out[key] = {"mean": float(flat[:, i].mean()), "sd": float(flat[:, i].std())}
    return out


def reference(name: str) -> dict:
    model, data = rm.get(name)
    sites = stored_sites(model, data)
    sampler = rm.NUTS_MODELS.get(name, model)
    settings = nuts_settings(name)
    t0 = time.perf_counter()
    # (chains started in one of several symmetric modes: rm.NUTS_INITS)
    init = {"init_strategy": init_to_value(values=rm.NUTS_INITS[name]())} if name in rm.NUTS_INITS else {}
    mcmc = MCMC(
        NUTS(
            sampler,
            target_accept_prob=settings["target_accept_prob"],
            max_tree_depth=settings["max_tree_depth"],
            **init,
        ),
        num_warmup=settings["num_warmup"],
        num_samples=settings["num_samples"],
        num_chains=settings["num_chains"],
        chain_method="parallel",
        progress_bar=False,
    )
    mcmc.run(jax.random.key(NUTS_SEEDS[name]), **data)
    jax.block_until_ready(mcmc.get_samples())  # the run is dispatched asynchronously
    seconds = time.perf_counter() - t0
    by_chain = mcmc.get_samples(group_by_chain=True)
    missing = set(sites) - set(by_chain)
    assert not missing, f"{name}: the NUTS model lacks the sites {missing}"
    latent = {k: np.asarray(by_chain[k]) for k in sites}
    if name in rm.RELABEL:  # symmetric modes: every draw mapped into one (rm.RELABEL)
        latent = rm.RELABEL[name](latent)
    params, rhat, ess = {}, [], []
    for site, x in latent.items():  # x: (chains, draws, *shape)
        flat = x.reshape(x.shape[0], x.shape[1], -1)
        for i in range(flat.shape[2]):
            key = site if x.ndim == 2 else f"{site}[{i}]"
            chain_draws = flat[:, :, i]
            params[key] = {"mean": float(chain_draws.mean()), "sd": float(chain_draws.std())}
            rhat.append(float(split_gelman_rubin(chain_draws[..., None])[0]))
            ess.append(float(effective_sample_size(chain_draws[..., None])[0]))
    names = list(params)
    pooled = np.concatenate([x.reshape(x.shape[0] * x.shape[1], -1) for x in latent.values()], axis=1)
    cov = np.cov(pooled, rowvar=False).reshape(len(names), len(names))
    divergences = int(np.asarray(mcmc.get_extra_fields()["diverging"]).sum())
    out = {
        "model": name,
        "params": params,
        # (the covariance only up to MAX_COV_PARAMETERS parameters: the 600 states of a chain
        # would make a 10 MB file, and no test reads its covariance)
        "cov": {"names": names, "matrix": cov.tolist()} if len(names) <= MAX_COV_PARAMETERS else None,
        "seeds": {"data": rm.DATA_SEEDS[name], "nuts": NUTS_SEEDS[name]},
        "nuts": dict(
            settings,
            max_rhat=max(rhat),
            min_ess=min(ess),
            divergences=divergences,
            seconds=seconds,
        ),
        "versions": {"numpyro": numpyro.__version__, "jax": jax.__version__},
    }
    if sampler is not model:
        out["nuts"]["sampled_model"] = sampler.__name__
    if name in rm.RELABEL:
        out["nuts"]["relabelled_by"] = rm.RELABEL[name].__name__
    if init:
        out["nuts"]["init"] = {k: np.asarray(v).tolist() for k, v in rm.NUTS_INITS[name]().items()}
    if name in HEAVY_TAILED:
        out["heavy_tailed"] = [k for k in names if k.split("[")[0] in HEAVY_TAILED[name]]
        tr = handlers.trace(handlers.seed(model, jax.random.key(0))).get_trace(**data)
        positive = [s for s in sites if _positive(tr[s]["fn"].support)]
        out["log_params"] = moments({s: np.log(latent[s]).reshape(-1, *latent[s].shape[2:]) for s in positive})
    return out


def _positive(support) -> bool:
    """Whether a support lies in (0, ∞): positive, or bounded below by a non-negative number
    (a Pareto's)."""
    if support is constraints.positive:
        return True
    bound = getattr(support, "lower_bound", None)
    return isinstance(support, constraints.greater_than) and bound is not None and float(bound) >= 0.0


def exact_reference(name: str) -> dict:
    """``prior_mixture``: x ~ Σ_k w_k Normal(μ_k, s), mean Σ w μ, variance s² + Σ w μ² − mean²."""
    assert name == "prior_mixture", name
    w, mu, s = rm.PRIOR_MIXTURE_WEIGHTS, rm.PRIOR_MIXTURE_LOCS, rm.PRIOR_MIXTURE_SCALE
    mean = float(np.sum(w * mu))
    var = float(s**2 + np.sum(w * mu**2) - mean**2)
    return {
        "model": name,
        "exact": True,
        "method": "closed form: the posterior is the prior, a Gaussian mixture",
        "params": {"x": {"mean": mean, "sd": float(np.sqrt(var))}},
        "cov": {"names": ["x"], "matrix": [[var]]},
        "seeds": {"data": rm.DATA_SEEDS[name], "nuts": None},
        "versions": {"numpyro": numpyro.__version__, "jax": jax.__version__},
    }


def svi_run(model, data, step_size, seed):
    """AutoNormal + Adam (exponentially decaying step size): (guide, params, ELBO checkpoints,
    mean 1-particle loss over each tenth of the run)."""
    guide = AutoNormal(model)
    schedule = lambda i: step_size * SVI_DECAY ** (i / SVI_NUM_STEPS)  # noqa: E731
    svi = SVI(model, guide, numpyro.optim.Adam(schedule), Trace_ELBO(num_particles=SVI_PARTICLES))
    evaluate = Trace_ELBO(num_particles=SVI_EVAL_PARTICLES)
    eval_key = jax.random.key(seed + 1)
    state, elbos, losses = None, [], []
    chunk = SVI_NUM_STEPS // SVI_CHECKPOINTS
    for _ in range(SVI_CHECKPOINTS):
        res = svi.run(jax.random.key(seed), chunk, progress_bar=False, init_state=state, **data)
        state = res.state
        elbos.append(-float(evaluate.loss(eval_key, res.params, model, guide, **data)))
        losses.append(float(np.mean(np.asarray(res.losses))))
    return guide, res.params, elbos, losses


def svi_reference(name: str, params: dict) -> tuple:
    """The ``"svi"`` moments and ``"svi_settings"`` of a model (``params``: the NUTS moments)."""
    model, data = rm.get(name)
    model = rm.SVI_MODELS.get(name, model)
    seed = SVI_SEEDS[name]
    t0 = time.perf_counter()
    runs = {}
    for lr in SVI_STEP_SIZES:
        runs[lr] = svi_run(model, data, lr, seed)
        print(f"  svi {name} step size {lr}: ELBO checkpoints {np.round(runs[lr][2], 3).tolist()}", flush=True)
    best = max(runs, key=lambda lr: runs[lr][2][-1])
    guide, svi_params, elbos, losses = runs[best]
    draws = guide.sample_posterior(jax.random.key(seed + 2), svi_params, sample_shape=(SVI_DRAWS,))
    est = {k: v for k, v in moments({s: draws[s] for s in draws}).items() if k in params}
    assert set(est) == set(params), (name, set(params) ^ set(est))
    est = {k: est[k] for k in params}
    err = {k: abs(est[k]["mean"] - p["mean"]) / p["sd"] for k, p in params.items()}
    ratio = {k: est[k]["sd"] / p["sd"] for k, p in params.items()}
    settings = {
        "guide": "AutoNormal (default init: init_to_uniform, init_scale 0.1)",
        "model": model.__name__,
        "optimizer": "Adam",
        "step_size": best,
        "step_size_schedule": f"step_size * {SVI_DECAY} ** (i / num_steps)",
        "step_sizes_tried": list(SVI_STEP_SIZES),
        "num_steps": SVI_NUM_STEPS,
        "num_particles": SVI_PARTICLES,
        "seed": seed,
        "num_draws": SVI_DRAWS,
        "draws_key": seed + 2,
        "elbo_eval_particles": SVI_EVAL_PARTICLES,
        "elbo_checkpoints": elbos,
        "elbo_checkpoint_steps": [(i + 1) * SVI_NUM_STEPS // SVI_CHECKPOINTS for i in range(SVI_CHECKPOINTS)],
        "mean_loss_per_tenth": losses,
        "final_elbo_by_step_size": {str(lr): runs[lr][2][-1] for lr in SVI_STEP_SIZES},
        "last_elbo_change": elbos[-1] - elbos[-2],
        "max_abs_mean_error_in_nuts_sd": max(err.values()),
        "sd_ratio_min": min(ratio.values()),
        "sd_ratio_max": max(ratio.values()),
        "seconds": time.perf_counter() - t0,
    }
    return est, settings


def main(names):
    for name in names or [*rm.MODELS, *rm.DIAGNOSTIC_MODELS]:
        out = exact_reference(name) if name in EXACT else reference(name)
        if name in SVI_REFERENCES:
            out["svi"], out["svi_settings"] = svi_reference(name, out["params"])
        path = os.path.join(HERE, f"{name}.json")
        with open(path, "w") as fh:
            json.dump(out, fh, indent=1)
        if name in EXACT:
            print(f"{name}: exact, {out['params']} -> {path}", flush=True)
            continue
        n = out["nuts"]
        print(
            f"{name}: {len(out['params'])} parameters, max R-hat {n['max_rhat']:.4f}, "
            f"min ESS {n['min_ess']:.0f}, divergences {n['divergences']}, {n['seconds']:.1f}s -> {path}",
            flush=True,
        )
        if "svi" in out:
            s = out["svi_settings"]
            print(
                f"  svi: step size {s['step_size']}, final ELBO {s['elbo_checkpoints'][-1]:.4f} "
                f"(last change {s['last_elbo_change']:.2e}), max |mean err|/sd {s['max_abs_mean_error_in_nuts_sd']:.3f}, "
                f"sd ratio {s['sd_ratio_min']:.3f}-{s['sd_ratio_max']:.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1:])
