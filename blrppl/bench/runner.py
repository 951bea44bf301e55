"""Fit a benchmark model by BLR, numpyro SVI (AutoNormal, AutoMultivariateNormal) and NUTS.

Compile and run time are measured separately for every method:

* BLR: ``BLRResult.compile_time`` (tracing, probing, XLA compilation, conjugacy probe) and
  ``run_time`` (the jitted loop).
* SVI: ``svi.init`` plus the ahead-of-time lowering and compilation of a ``lax.scan`` chunk of
  ``svi.update`` steps (data passed as arguments, not baked in; the XLA options ``blr_fit``
  uses, i.e. backend optimisation off below 200,000 data elements); the run is the compiled
  chunks, timed chunk by chunk (the ELBO-against-wall-time curve).
* NUTS: numpyro compiles inside ``MCMC.warmup``/``run``; a first tiny run (5 warm-up, 5 draws)
  is timed as the compile time, and the run time is the full run's time less that (a full
  run compiles again: every ``MCMC`` object jits its own sampler, so the full run's wall time
  is the total).

Accuracy is measured per reference parameter (Stan-style names, ``beta[1]``): the error of the
posterior mean in reference sds, and the ratio of posterior sd to reference sd.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import inspect
import json
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.contrib.control_flow import scan
from numpyro.infer import MCMC, NUTS, SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoMultivariateNormal, AutoNormal
from numpyro.infer.importance import psis_diagnostic

from blrppl.api import blr_fit
from blrppl.runtime.cache import CACHE_ENV, DIR_ENV
from blrppl.runtime.compile import compile_lowered, compiler_options as _compiler_options
from blrppl.bench import posteriordb
from blrppl.bench.models import BenchModel

#: SVI: Adam, 5× the steps at 10× the step size of the SVI docstring's example (2000 steps of
#: Adam(0.0005)); ``--svi-steps`` changes the count
SVI_STEPS = 10_000
SVI_LR = 0.005
SVI_CHUNK = 100
#: NUTS as asked: 1 chain, 1000 warm-up, 1000 draws
NUTS_WARMUP = 1000
NUTS_SAMPLES = 1000
#: the long reference run (cached): chains × (warm-up + draws)
REF_CHAINS = 4
REF_WARMUP = 500
REF_SAMPLES = 1000
#: draws taken from variational posteriors for the summaries
NUM_DRAWS = 4000
METHODS = ("blr", "svi_normal", "svi_mvn", "nuts")


@dataclasses.dataclass
class MethodResult:
    """One method on one model."""

    method: str
    compile_time: float = float("nan")
    run_time: float = float("nan")
    elbo: float = float("nan")
    #: BLR: iterations; SVI: steps (one gradient each); NUTS: leapfrog steps (gradients)
    iterations: int = 0
    grad_evals: int | None = None
    #: (wall seconds since the run started, ELBO) pairs
    trace: list = dataclasses.field(default_factory=list)
    #: reference parameter → (mean, sd)
    summary: dict = dataclasses.field(default_factory=dict)
    #: parameter → a few hundred draws (for the marginal plots)
    draws: dict = dataclasses.field(default_factory=dict)
    error: str = ""
    converged: bool | None = None
    #: BLR: wall seconds of a second ``blr_fit`` on the same model and data (the compiled fit
    #: reused: tracing from the cache, initialisation, the loop, the posterior export)
    refit_time: float = float("nan")
    #: BLR: a step's marginal wall seconds (:func:`step_cost`) and the refit's fixed cost, its
    #: wall seconds less its steps' marginal cost (the model's trace and cache lookup, the start,
    #: the loop's dispatch, the diagnostics, the export; a refined fit's candidates too)
    step_time: float = float("nan")
    refit_fixed: float = float("nan")
    #: PSIS k̂ of the method's q (BLR: ``result.diagnostics``; SVI: numpyro's psis_diagnostic)
    khat: float = float("nan")
    #: BLR: the curvature estimator of each block with Monte Carlo messages
    curvature: str = ""
    #: BLR: compile and total seconds of the first fit in a second process (persistent cache)
    second_process: dict = dataclasses.field(default_factory=dict)
    #: BLR: the first fit in a fresh process without any compilation cache: compile and total
    #: seconds, model runs and XLA compilations before the first step
    fresh_process: dict = dataclasses.field(default_factory=dict)
    #: BLR: the fits the default refinement compared (``result.refinements``: change, k̂, bound,
    #: seconds, kept), empty when it did not run
    refinements: list = dataclasses.field(default_factory=list)
    #: BLR, where the refinement ran: the first fit alone (``refine=False``): its ``summary``
    #: (parameter → (mean, sd)), ``khat`` and wall ``time``
    first_fit: dict = dataclasses.field(default_factory=dict)

    @property
    def total_time(self) -> float:
        return self.compile_time + self.run_time


# ------------------------------------------------------------------------- metrics


def accuracy(estimate: dict, reference: dict) -> dict:
    """Largest |mean − ref mean| / ref sd and the range of sd / ref sd over ``reference``'s
    parameters (NaN when a parameter is missing). Parameters the reference holds fixed (sd 0:
    the unit diagonal of an LKJ Cholesky factor, its zero upper triangle) are left out."""
    reference = {k: (m, s) for k, (m, s) in reference.items() if s > 0}
    if not reference:
        return {"max_mean_err_sd": float("nan"), "sd_ratio_min": float("nan"), "sd_ratio_max": float("nan")}
    errs, ratios = [], []
    for k, (m, s) in reference.items():
        if k not in estimate:
            errs.append(float("nan"))
            ratios.append(float("nan"))
            continue
        errs.append(abs(estimate[k][0] - m) / s)
        ratios.append(estimate[k][1] / s)
    errs, ratios = np.asarray(errs), np.asarray(ratios)
    return {
        "max_mean_err_sd": float(np.max(errs)),
        "sd_ratio_min": float(np.min(ratios)),
        "sd_ratio_max": float(np.max(ratios)),
    }


def _summaries(bm: BenchModel, draws: dict, model) -> tuple[dict, dict]:
    """(parameter → (mean, sd), parameter → up to 1000 draws) of site draws."""
    draws = {k: np.asarray(v) for k, v in draws.items()}
    if bm.canonical is not None:
        draws = bm.canonical(draws)
    flat = posteriordb.flatten_draws(draws, model, bm.data)
    summary = {k: (float(np.mean(v)), float(np.std(v))) for k, v in flat.items()}
    return summary, {k: v[:1000] for k, v in flat.items()}


# ------------------------------------------------------------------------- methods


def fit_blr(bm: BenchModel, num_steps: int | None = None) -> MethodResult:
    kwargs = dict(bm.blr_kwargs)
    if num_steps is not None:
        kwargs["num_steps"] = num_steps
    t0 = time.perf_counter()
    r = blr_fit(bm.model, bm.data, progress_bar=False, **kwargs)
    wall = time.perf_counter() - t0
    # (ready before the refit is timed: JAX dispatches asynchronously)
    draws = jax.block_until_ready(r.sample(jax.random.key(1), NUM_DRAWS))
    summary, kept = _summaries(bm, draws, bm.model)
    elbo = np.asarray(r.elbo, float)
    times = r.run_time * np.arange(1, len(elbo) + 1) / max(len(elbo), 1)
    # compile_time covers tracing to the first state; what blr_fit spends after its loop
    # (building the posterior distributions) is counted as run time
    run_time = max(wall - r.compile_time, r.run_time)
    t0 = time.perf_counter()
    again = blr_fit(bm.model, bm.data, progress_bar=False, **kwargs)
    refit = time.perf_counter() - t0
    step = step_cost(bm.model, bm.data, kwargs)
    return MethodResult(
        "blr", r.compile_time, run_time, float(elbo[-1]) if len(elbo) else float("nan"), int(r.num_steps),
        None, list(zip(times.tolist(), elbo.tolist())), summary, kept, converged=bool(r.converged),
        refit_time=refit, step_time=step, refit_fixed=refit - int(again.num_steps) * step, khat=float(r.diagnostics.khat), curvature=_curvatures(r.plan, kwargs),
        refinements=[tuple(x) for x in r.refinements], first_fit=_first_fit(bm, kwargs) if r.refinements else {},
    )


#: the steps of the longer of the two runs :func:`step_cost` compares (the shorter takes one)
MARGINAL_STEPS = 11


def step_cost(model, data, kwargs: dict, steps: int = MARGINAL_STEPS, repeats: int = 3) -> float:
    """A step's marginal wall seconds in a refit (the compiled fit reused): the loop's run
    time of ``steps`` steps less that of one step, each the fastest of ``repeats`` runs (a
    shared machine only adds time), over ``steps`` − 1; the runs neither stop early
    (``tol=1e-30``) nor refine. What a refit costs besides its steps (:attr:`MethodResult.refit_fixed`)
    is its wall time less its steps times this."""
    def fastest(n):
        runs = [
            blr_fit(model, data, progress_bar=False, **{**kwargs, "num_steps": n, "tol": 1e-30, "refine": False})
            for _ in range(repeats)
        ]
        return min(x.run_time for x in runs), int(runs[-1].num_steps)

    one, _ = fastest(1)
    many, taken = fastest(steps)
    return max(many - one, 0.0) / max(taken - 1, 1)


def _first_fit(bm: BenchModel, kwargs: dict) -> dict:
    """The first fit alone (``refine=False``, the compiled fit reused) of a model the default
    refinement changed: its summary, k̂ and wall seconds, beside the kept fit's."""
    t0 = time.perf_counter()
    r = blr_fit(bm.model, bm.data, progress_bar=False, **{**kwargs, "refine": False})
    seconds = time.perf_counter() - t0
    summary, _ = _summaries(bm, jax.block_until_ready(r.sample(jax.random.key(1), NUM_DRAWS)), bm.model)
    return {"summary": summary, "khat": float(r.diagnostics.khat), "time": seconds}


def _curvatures(plan, kwargs) -> str:
    """"block: estimator" for every Gaussian block with Monte Carlo messages ("" if none)."""
    from blrppl.estimators.monte_carlo import auto_curvature
    from blrppl.estimators.registry import estimator_of

    chosen = kwargs.get("mc_curvature", "auto")
    out = []
    for b in plan.blocks:
        if b.family.gaussian and any(estimator_of(f).draws for f in plan.factors_of(b.name)):
            out.append(f"{b.name}: {auto_curvature(b) if chosen == 'auto' else chosen}")
    return "; ".join(out)


#: the start of the scripts run in new processes: their arguments, then the dtype
_SCRIPT_HEADER = r"""
import json, sys, time
import numpyro
if sys.argv[-1] == "float64":
    numpyro.enable_x64()
"""

SECOND_PROCESS = _SCRIPT_HEADER + r"""
import blrppl
from blrppl import blr_fit
blrppl.enable_compilation_cache()
from blrppl.bench import models
bm = models.load(sys.argv[1])
t0 = time.perf_counter()
r = blr_fit(bm.model, bm.data, progress_bar=False, **bm.blr_kwargs)
total = time.perf_counter() - t0
counts = r.compile_counts
print("RESULT" + json.dumps({"compile": r.compile_time, "total": total, "model_runs": counts.model_runs,
                             "xla_compilations": counts.xla_compilations,
                             "background_compilations": counts.background_compilations}))
"""


def second_process_fit(bm: BenchModel) -> dict:
    """The same script run twice, as a user reruns it: ``blr_fit``'s first fit of the model in
    a new Python process, then in another one that finds what the first left in a new cache
    directory (blrppl's program store and JAX's persistent cache); the second's compile and
    total seconds, model runs and XLA compilations."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="blrppl-bench-cache-") as cache:
        env = {DIR_ENV: os.path.join(cache, "blrppl"), CACHE_ENV: "1"}
        first = _in_new_process(SECOND_PROCESS, [bm.name], env)
        if first.get("error"):
            return first
        return _in_new_process(SECOND_PROCESS, [bm.name], env)


def fresh_process_fit(bm: BenchModel) -> dict:
    """``blr_fit``'s first fit of the model in a new Python process with no compilation
    cache (``BLRPPL_COMPILATION_CACHE=0``): what a user's first run of a script costs, with
    the model runs and XLA compilations before its first step."""
    return _in_new_process(SECOND_PROCESS, [bm.name], {CACHE_ENV: "0"})


def _in_new_process(script: str, args: list, env: dict, timeout: float = 1800) -> dict:
    """Run ``script`` (which prints ``RESULT<json>``) in a new Python process with the
    current dtype as its last argument; its JSON, or NaNs and an ``error`` when it failed or
    did not finish within ``timeout`` seconds."""
    import subprocess
    import sys

    dtype = "float64" if jnp.result_type(float) == jnp.float64 else "float32"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", script, *map(str, args), dtype], capture_output=True, text=True,
            env={**os.environ, **env}, timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"compile": float("nan"), "total": float("nan"), "error": f"did not finish within {timeout:g} s"}
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT")), None)
    if proc.returncode != 0 or line is None:
        tail = (proc.stderr.strip().splitlines() or [""])[-1][:200]
        return {"compile": float("nan"), "total": float("nan"), "error": tail}
    return json.loads(line[len("RESULT"):])


def fit_svi(bm: BenchModel, guide_kind: str, num_steps: int = SVI_STEPS, lr: float = SVI_LR) -> MethodResult:
    model = bm.sampler_model or bm.model
    guide = {"svi_normal": AutoNormal, "svi_mvn": AutoMultivariateNormal}[guide_kind](model)
    svi = SVI(model, guide, numpyro.optim.Adam(lr), Trace_ELBO())
    data = {k: v for k, v in bm.data.items() if not isinstance(v, (int, float))}
    static = {k: v for k, v in bm.data.items() if isinstance(v, (int, float))}
    chunk_len = min(SVI_CHUNK, num_steps)

    t0 = time.perf_counter()
    state = svi.init(jax.random.key(0), **bm.data)

    def chunk(state, data):
        def body(s, _):
            s, loss = svi.update(s, **data, **static)
            return s, loss

        return jax.lax.scan(body, state, None, length=chunk_len)

    # the same XLA options blr_fit uses (backend optimisation off for small data)
    compiled = compile_lowered(jax.jit(chunk).lower(state, data), _compiler_options(bm.data))
    compile_time = time.perf_counter() - t0

    trace, losses, t1 = [], [], time.perf_counter()
    done = 0
    while done < num_steps:
        state, loss = compiled(state, data)
        loss = np.asarray(jax.block_until_ready(loss))
        done += chunk_len
        losses.append(loss)
        trace.append((time.perf_counter() - t1, -float(np.mean(loss))))
    params = svi.get_params(state)
    run_time = time.perf_counter() - t1
    # the final ELBO with 200 particles (standard error ≈ sd(loss)/√200)
    final = Trace_ELBO(num_particles=200).loss(jax.random.key(2), params, model, guide, **bm.data)
    draws = guide.sample_posterior(jax.random.key(1), params, sample_shape=(NUM_DRAWS,))
    summary, kept = _summaries(bm, draws, model)
    try:
        khat = float(psis_diagnostic(jax.random.key(3), params, model, guide, **bm.data))
    except Exception:  # a model numpyro's diagnostic cannot run (e.g. enumerated sites)
        khat = float("nan")
    return MethodResult(
        guide_kind, compile_time, run_time, -float(final), done, done, trace, summary, kept, khat=khat,
    )


def _mcmc(model, warmup, samples, chains, key, data):
    mcmc = MCMC(
        NUTS(model), num_warmup=warmup, num_samples=samples, num_chains=chains,
        chain_method="sequential", progress_bar=False,
    )
    mcmc.warmup(key, **data, extra_fields=("num_steps",), collect_warmup=True)
    steps = int(np.sum(mcmc.get_extra_fields()["num_steps"]))
    mcmc.run(mcmc.post_warmup_state.rng_key, **data, extra_fields=("num_steps",))
    steps += int(np.sum(mcmc.get_extra_fields()["num_steps"]))
    return mcmc, steps


def fit_nuts(bm: BenchModel, warmup: int = NUTS_WARMUP, samples: int = NUTS_SAMPLES) -> MethodResult:
    model = bm.sampler_model or bm.model
    t0 = time.perf_counter()
    _mcmc(model, min(5, warmup), min(5, samples), 1, jax.random.key(3), bm.data)
    compile_time = time.perf_counter() - t0
    t1 = time.perf_counter()
    mcmc, steps = _mcmc(model, warmup, samples, 1, jax.random.key(4), bm.data)
    wall = time.perf_counter() - t1
    summary, kept = _summaries(bm, mcmc.get_samples(), model)
    # the full run compiles again (a fresh MCMC object): its wall time is the total, of which
    # the tiny run's time is the compile estimate (capped, on a noisy machine, at the total)
    compile_time = min(compile_time, wall)
    return MethodResult(
        "nuts", compile_time, wall - compile_time, float("nan"), warmup + samples, steps,
        [], summary, kept,
    )


# ------------------------------------------------------------------------ reference


def cache_dir() -> pathlib.Path:
    """``$BLRPPL_CACHE`` or ``~/.cache/blrppl/bench``."""
    root = os.environ.get("BLRPPL_CACHE")
    return pathlib.Path(root) if root else pathlib.Path.home() / ".cache" / "blrppl" / "bench"


def _source(fn) -> str:
    """A function's source code ("" when it has none, e.g. a built-in)."""
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return repr(fn)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def data_hash(bm: BenchModel) -> str:
    """The key of a cached reference run: the model's name and source code (and its sampler
    model's), the data, the run's length and the versions of blrppl and numpyro."""
    h = hashlib.sha256()
    h.update(bm.name.encode())
    h.update(_source(bm.model).encode())
    if bm.sampler_model is not None:
        h.update(_source(bm.sampler_model).encode())
    h.update(f"blrppl {_version('blrppl')} numpyro {_version('numpyro')}".encode())
    h.update(f"{REF_CHAINS}x{REF_WARMUP}+{REF_SAMPLES}".encode())
    for k in sorted(bm.data):
        h.update(k.encode())
        h.update(np.ascontiguousarray(np.asarray(bm.data[k], dtype=float)).tobytes())
    return h.hexdigest()[:16]


def reference(bm: BenchModel, log=print) -> tuple[dict, str]:
    """(parameter → (mean, sd), its source) for ``bm``: its exact/posteriordb reference, else a
    long NUTS run (``REF_CHAINS`` × ``REF_SAMPLES`` after ``REF_WARMUP``) cached on disk."""
    if bm.reference is not None:
        return bm.reference, "exact" if bm.source != "posteriordb" else "posteriordb draws"
    path = cache_dir() / f"{bm.name}-{data_hash(bm)}.json"
    if path.exists():
        return {k: tuple(v) for k, v in json.loads(path.read_text()).items()}, f"NUTS {REF_CHAINS}×{REF_SAMPLES} (cached)"
    log(f"  reference: NUTS {REF_CHAINS} chains × ({REF_WARMUP} + {REF_SAMPLES}) for {bm.name} ...")
    t0 = time.perf_counter()
    mcmc, _ = _mcmc(bm.sampler_model or bm.model, REF_WARMUP, REF_SAMPLES, REF_CHAINS, jax.random.key(5), bm.data)
    summary, _ = _summaries(bm, mcmc.get_samples(), bm.sampler_model or bm.model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary))
    log(f"  reference done in {time.perf_counter() - t0:.0f} s, cached at {path}")
    return summary, f"NUTS {REF_CHAINS}×{REF_SAMPLES} (computed)"


@dataclasses.dataclass
class ModelRun:
    """All methods on one model, with the reference they are judged against."""

    name: str
    bench: BenchModel
    reference: dict
    reference_source: str
    results: dict  # method → MethodResult
    accuracy: dict  # method → accuracy dict


def run_model(
    bm: BenchModel,
    methods=METHODS,
    blr_steps: int | None = None,
    svi_steps: int = SVI_STEPS,
    nuts_warmup: int = NUTS_WARMUP,
    nuts_samples: int = NUTS_SAMPLES,
    use_reference: bool = True,
    log=print,
) -> ModelRun:
    results = {}
    for method in methods:
        try:
            if method == "blr":
                res = fit_blr(bm, blr_steps)
                if blr_steps is None:
                    res.fresh_process = fresh_process_fit(bm)
                if jax.config.jax_compilation_cache_dir and blr_steps is None:
                    res.second_process = second_process_fit(bm)
            elif method.startswith("svi"):
                res = fit_svi(bm, method, svi_steps)
            elif method == "nuts":
                res = fit_nuts(bm, nuts_warmup, nuts_samples)
            else:
                raise ValueError(f"unknown method {method!r}")
        except Exception as err:  # a method failing on a model is a result, not a crash
            res = MethodResult(method, error=f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}")
        results[method] = res
        log(
            f"  {bm.name:<40} {method:<10} compile {res.compile_time:7.2f} s  run {res.run_time:7.2f} s  "
            f"ELBO {res.elbo:12.3f}  iters {res.iterations}" + (f"  ERROR {res.error}" if res.error else "")
        )
    if use_reference:
        ref, source = reference(bm, log)
    elif "nuts" in results and not results["nuts"].error:
        ref, source = results["nuts"].summary, "this run's NUTS"
    else:
        ref, source = {}, "none"
    names = bm.params or list(ref)
    ref = {k: ref[k] for k in names if k in ref}
    acc = {m: accuracy(r.summary, ref) for m, r in results.items()}
    for r in results.values():
        if r.first_fit:  # (the first fit alone, where the refinement replaced it)
            r.first_fit["accuracy"] = accuracy(r.first_fit["summary"], ref)
    return ModelRun(bm.name, bm, ref, source, results, acc)


# -------------------------------------------------------------------------- scaling


def scaling(sizes=(1_000, 10_000, 100_000, 1_000_000), d: int = 10, log=print) -> list:
    """BLR on logistic regression of growing N: compile, run, steps, time per step."""
    from blrppl.bench.models import logistic_data, logistic_model

    rows = []
    for n in sizes:
        data = logistic_data(int(n), d)
        r = blr_fit(logistic_model, data, progress_bar=False)
        row = {
            "N": int(n),
            "compile_time": r.compile_time,
            "run_time": r.run_time,
            "steps": int(r.num_steps),
            "per_step": r.run_time / max(int(r.num_steps), 1),
        }
        rows.append(row)
        log(
            f"  scaling N={n:>9,}  compile {row['compile_time']:6.2f} s  run {row['run_time']:7.3f} s  "
            f"steps {row['steps']}  {1e3 * row['per_step']:.2f} ms/step"
        )
    return rows


# ------------------------------------------------------------------- dense regression


def dense_regression(d: int = 2_000, n: int = 3_000, seed: int = 0, log=print) -> dict:
    """An exact Bayesian linear regression with D = ``d`` coefficients (w ~ N(0, I), unit
    noise) fitted by ``blr_fit`` in its first fit of the model (compilation included) and by
    a hand-written NumPy solve of the same posterior (XᵀX + I, one Cholesky, two triangular
    solves, the posterior sds from the Cholesky factor's inverse; the median of three runs),
    on the same data."""
    import scipy.linalg

    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    y = X @ (rng.normal(size=d) / np.sqrt(d)) + rng.normal(size=n)

    def model(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("n", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)

    t0 = time.perf_counter()
    result = blr_fit(model, (X, y), progress_bar=False)
    q = result.posterior["w"]
    mean = np.asarray(q.mean)
    sd = np.sqrt(np.asarray(q.variance))
    blr_total = time.perf_counter() - t0

    def hand_solve():
        prec = X.T @ X + np.eye(d)
        chol = np.linalg.cholesky(prec)
        mean = scipy.linalg.cho_solve((chol, True), X.T @ y)
        chol_inv = scipy.linalg.solve_triangular(chol, np.eye(d), lower=True)
        return mean, np.sqrt(np.sum(chol_inv**2, axis=0))

    # the median of three runs: one run of the hand solve varies by ±30 % on a shared machine
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        exact_mean, exact_sd = hand_solve()
        times.append(time.perf_counter() - t0)
    hand = float(np.median(times))

    row = {
        "D": d,
        "N": n,
        "blr_total": blr_total,
        "compile_time": result.compile_time,
        "run_time": result.run_time,
        "steps": int(result.num_steps),
        "hand": hand,
        "ratio": blr_total / hand,
        "max_mean_err_sd": float(np.max(np.abs(mean - exact_mean) / exact_sd)),
        "max_sd_rel_err": float(np.max(np.abs(sd / exact_sd - 1.0))),
    }
    log(
        f"  dense regression D={d} N={n}: blr_fit {blr_total:.2f} s (compile {row['compile_time']:.2f} s, "
        f"run {row['run_time']:.2f} s, {row['steps']} step(s)), hand-written solve {hand:.2f} s, "
        f"ratio {row['ratio']:.2f}, max |mean err| {row['max_mean_err_sd']:.2g} sd"
    )
    return row


# ------------------------------------------------------------------- long chains


def poisson_walk_model(c):
    """Counts c_t ~ Poisson(exp(x_t)) with x a Gaussian random walk (step sd 0.1)."""
    x = numpyro.sample("x", dist.GaussianRandomWalk(0.1, num_steps=c.shape[0]))
    with numpyro.plate("t", c.shape[0]):
        numpyro.sample("c", dist.Poisson(jnp.exp(x)), obs=c)


def _thomas_pass(diag, off, v):
    """A hand-written tridiagonal solve (S x = v, S symmetric with diagonal ``diag`` and
    off-diagonal ``off``): the Thomas algorithm as one forward and one backward ``lax.scan``."""

    def forward(carry, inp):
        c_prev, d_prev = carry
        a, b, c, d = inp  # sub-diagonal, diagonal, super-diagonal, right-hand side
        denom = b - a * c_prev
        c_new, d_new = c / denom, (d - a * d_prev) / denom
        return (c_new, d_new), (c_new, d_new)

    sub = jnp.concatenate([jnp.zeros(1, diag.dtype), off])
    sup = jnp.concatenate([off, jnp.zeros(1, diag.dtype)])
    zero = jnp.zeros((), diag.dtype)
    _, (cs, ds) = jax.lax.scan(forward, (zero, zero), (sub, diag, sup, v))

    def backward(x_next, inp):
        c, d = inp
        x = d - c * x_next
        return x, x

    _, xs = jax.lax.scan(backward, zero, (cs, ds), reverse=True)
    return xs


def _fit_row(n: int, r) -> dict:
    """A chain bench row's fields of the fit ``r`` of length ``n``: times, steps, time per
    step and the floats its fitted state holds."""
    return {
        "T": int(n),
        "compile_time": r.compile_time,
        "run_time": r.run_time,
        "steps": int(r.num_steps),
        "per_step": r.run_time / max(int(r.num_steps), 1),
        "state_floats": int(sum(np.size(leaf) for leaf in jax.tree.leaves(r.nat))),
    }


#: runs behind each time of a chain row (each side: ``blr_fit``'s runs and the hand-written
#: pass), the fastest taken: a shared machine only ever adds time, and at 10⁴ a step lasts a
#: few tenths of a millisecond, where the median of a few runs moved by 30 % between runs
CHAIN_REPEATS = 7


def _fastest_time(fn, *args, repeats: int = CHAIN_REPEATS) -> float:
    """Seconds of one call of the jitted ``fn`` (compiled by a first call, not timed): the
    fastest of ``repeats``."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.min(times))


def _first_fit_and_step(model, args) -> dict:
    """A chain bench row's fit fields: ``blr_fit``'s first fit (wall seconds, compile, run,
    steps; :func:`_fit_row`), and its time per step after the first as the classic-VMP rows
    measure it (:func:`_blr_timing`): the run times of 10 steps less that of one, each the
    fastest of :data:`CHAIN_REPEATS`, over 9 (a run's fixed cost, starting the loop and
    reading the state back, left out)."""
    t0 = time.perf_counter()
    r = blr_fit(model, args, progress_bar=False)
    wall = time.perf_counter() - t0

    def fastest_run(steps):
        runs = [blr_fit(model, args, num_steps=steps, tol=1e-30, progress_bar=False) for _ in range(CHAIN_REPEATS)]
        return min(x.run_time for x in runs)

    one, ten = fastest_run(1), fastest_run(10)
    return {**_fit_row(len(args[0]), r), "first_fit": wall, "per_step": max(ten - one, 0.0) / 9}, r


def chain_scaling(sizes=(1_000, 10_000, 100_000), log=print) -> list:
    """A random walk observed through Poisson counts (log link), T = ``sizes``: ``blr_fit``'s
    first fit of each length (wall time, compile, run, steps) and its time per step after
    the first (:func:`_first_fit_and_step`) against one hand-written banded solve pass of the same length, timed in the same run: the Thomas algorithm in JAX
    (two ``lax.scan``, jitted, compile excluded, the fastest of :data:`CHAIN_REPEATS`) and LAPACK's banded Cholesky solve
    (``scipy.linalg.solveh_banded``)."""
    import scipy.linalg

    rows = []
    for n in sizes:
        rng = np.random.default_rng(n)
        c = rng.poisson(np.exp(1.5 + np.cumsum(0.02 * rng.normal(size=n)))).astype(float)
        fit, r = _first_fit_and_step(poisson_walk_model, (c,))
        diag = jnp.asarray(2.0 + rng.uniform(size=n))
        off = jnp.asarray(-np.ones(n - 1) * 0.9)
        v = jnp.asarray(rng.normal(size=n))
        thomas = _fastest_time(jax.jit(_thomas_pass), diag, off, v)
        ab = np.stack([np.concatenate([[0.0], np.asarray(off)]), np.asarray(diag)])
        lapack = []
        for _ in range(CHAIN_REPEATS):
            t0 = time.perf_counter()
            scipy.linalg.solveh_banded(ab, np.asarray(v))
            lapack.append(time.perf_counter() - t0)
        row = {
            **fit,
            "bandwidth": r.plan.block("x").family.bandwidth if r.plan.block("x").family.banded else None,
            "thomas": thomas,
            "lapack": float(np.min(lapack)),
        }
        per_step = row["per_step"]
        row["ratio"] = per_step / row["thomas"]
        rows.append(row)
        log(
            f"  chain T={n:>7,}  bandwidth {row['bandwidth']}  compile {row['compile_time']:6.2f} s  run "
            f"{row['run_time']:7.3f} s  steps {row['steps']}  {1e3 * per_step:.2f} ms/step; hand-written pass "
            f"{1e3 * row['thomas']:.2f} ms (JAX), {1e3 * row['lapack']:.2f} ms (LAPACK); step / pass {row['ratio']:.1f}"
        )
    return rows


# ---------------------------------------------------------------- hidden Markov chains

#: states of the bench's hidden Markov model
HMM_STATES = 5


def hmm_model(y):
    """A K = 5 hidden Markov model as NumPyro's HMM examples write it (``scan``): Dirichlet
    transition rows, Normal emissions with unknown means (sd 0.5)."""
    k = HMM_STATES
    trans = numpyro.sample("trans", dist.Dirichlet(jnp.ones((k, k)) + 4.0 * jnp.eye(k)).to_event(1))
    with numpyro.plate("states", k):
        loc = numpyro.sample("loc", dist.Normal(jnp.linspace(-4.0, 4.0, k), 1.0))

    def step(prev, y_t):
        x = numpyro.sample("x", dist.Categorical(trans[prev]))
        numpyro.sample("y", dist.Normal(loc[x], 0.5), obs=y_t)
        return x, None

    scan(step, 0, y)


def hmm_data(n: int, seed: int = 0) -> tuple:
    """States and observations of :func:`hmm_model` (sticky transitions, means 2 apart)."""
    rng = np.random.default_rng(seed)
    k = HMM_STATES
    trans = np.full((k, k), 0.05 / (k - 1)) + 0.95 * np.eye(k) - 0.05 / (k - 1) * np.eye(k)
    x = np.zeros(n, int)
    u = rng.random(n)
    cum = np.cumsum(trans, 1)
    for t in range(1, n):
        x[t] = min(int(np.searchsorted(cum[x[t - 1]], u[t])), k - 1)
    return x, np.linspace(-4.0, 4.0, k)[x] + 0.5 * rng.normal(size=n)


def _forward_backward_pass(log_init, log_trans, log_lik):
    """A hand-written forward–backward in log space (two ``lax.scan``): the marginals."""

    def forward(a, ll):
        a = ll + jax.nn.logsumexp(a[:, None] + log_trans, axis=0)
        return a, a

    a0 = log_init + log_lik[0]
    _, alpha = jax.lax.scan(forward, a0, log_lik[1:])
    alpha = jnp.concatenate([a0[None], alpha])

    def backward(b, ll):
        b = jax.nn.logsumexp(log_trans + (ll + b)[None, :], axis=1)
        return b, b

    _, beta = jax.lax.scan(backward, jnp.zeros_like(a0), log_lik[1:], reverse=True)
    beta = jnp.concatenate([beta, jnp.zeros_like(a0)[None]])
    return jax.nn.softmax(alpha + beta, axis=-1)


def _scaled_forward_backward_pass(log_init, log_trans, log_lik):
    """:func:`_forward_backward_pass` by the scaled recursions (Rabiner 1989, §V.A: each step
    normalised, the exponentials taken once outside the two ``lax.scan``): the marginals."""
    trans = jnp.exp(log_trans - jnp.max(log_trans))
    lik = jnp.exp(log_lik - jnp.max(log_lik, -1, keepdims=True))

    def forward(a, lik_t):
        a = (a @ trans) * lik_t
        return a / jnp.sum(a), a / jnp.sum(a)

    a0 = jnp.exp(log_init) * lik[0]
    a0 = a0 / jnp.sum(a0)
    _, alpha = jax.lax.scan(forward, a0, lik[1:])
    alpha = jnp.concatenate([a0[None], alpha])

    def backward(b, lik_t):
        b = trans @ (lik_t * b)
        return b / jnp.sum(b), b / jnp.sum(b)

    _, beta = jax.lax.scan(backward, jnp.ones_like(a0), lik[1:], reverse=True)
    beta = jnp.concatenate([beta, jnp.ones_like(a0)[None]])
    p = alpha * beta
    return p / jnp.sum(p, -1, keepdims=True)


def hmm_scaling(sizes=(1_000, 10_000, 100_000), log=print) -> list:
    """:func:`hmm_model` for T = ``sizes``: ``blr_fit``'s first fit of each length (wall
    time, compile, run, steps, states decoded right) and its time per step after the first
    (:func:`_first_fit_and_step`) against one hand-written
    forward–backward pass of the same length and K, timed in the same run (jitted, compile
    excluded, the fastest of :data:`CHAIN_REPEATS`): in log space (the issue's reference, and
    the ratio's) and scaled (:func:`_scaled_forward_backward_pass`, shown beside it)."""
    rows = []
    k = HMM_STATES
    for n in sizes:
        x, y = hmm_data(n, seed=n)
        fit, r = _first_fit_and_step(hmm_model, (y,))
        rng = np.random.default_rng(n)
        log_trans = jnp.asarray(np.log(rng.dirichlet(np.ones(k), size=k)))
        log_lik = jnp.asarray(rng.normal(size=(n, k)))
        log_init = jnp.asarray(np.full(k, -np.log(k)))
        fb = _fastest_time(jax.jit(_forward_backward_pass), log_init, log_trans, log_lik)
        scaled = _fastest_time(jax.jit(_scaled_forward_backward_pass), log_init, log_trans, log_lik)
        decoded = np.asarray(r.posterior["x"].probs).argmax(-1)
        row = {**fit, "forward_backward": fb, "scaled_pass": scaled, "decoded": float(np.mean(decoded == x))}
        per_step = row["per_step"]
        row["ratio"] = per_step / row["forward_backward"]
        rows.append(row)
        log(
            f"  HMM K={k} T={n:>7,}  first fit {row['first_fit']:6.2f} s  compile {row['compile_time']:6.2f} s  run {row['run_time']:7.3f} s  steps "
            f"{row['steps']}  {1e3 * per_step:.2f} ms/step; hand-written forward-backward {1e3 * row['forward_backward']:.2f} "
            f"ms (scaled: {1e3 * row['scaled_pass']:.2f} ms); step / pass {row['ratio']:.1f}; states decoded right "
            f"{row['decoded']:.3f}"
        )
    return rows


# ------------------------------------------------------------- scales of many latents

#: the persistence of :func:`volatility_model`'s log-volatility (known)
VOLATILITY_PERSISTENCE = 0.95


def walk_scales_model(y, seen):
    """A local-level model with unknown step and noise scales (some days unobserved):
    s, r ~ HalfNormal(1), x ~ GaussianRandomWalk(s), y_t ~ Normal(x_t, r) where seen."""
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    r = numpyro.sample("r", dist.HalfNormal(1.0))
    x = numpyro.sample("x", dist.GaussianRandomWalk(s, num_steps=y.shape[0]))
    with numpyro.plate("t", y.shape[0]):
        numpyro.sample("y", dist.Normal(x, r).mask(seen), obs=y)


def walk_scales_data(n: int = 600, seed: int = 0) -> dict:
    """``n`` days of a random walk (step 0.3) seen through noise of sd 0.5, the middle fifth
    unobserved."""
    rng = np.random.default_rng(seed)
    y = np.cumsum(0.3 * rng.normal(size=n)) + 0.5 * rng.normal(size=n)
    seen = np.ones(n, bool)
    seen[2 * n // 5 : 3 * n // 5] = False
    return {"y": np.where(seen, y, 0.0), "seen": seen}


def volatility_model(y):
    """Stochastic volatility with a known persistence, written with ``scan``: μ ~ N(−9, 2),
    σ ~ HalfNormal(1), h_t ~ N(μ + φ(h_{t−1} − μ), σ) from h_0 = μ, y_t ~ N(0, exp(h_t/2))."""
    mu = numpyro.sample("mu", dist.Normal(-9.0, 2.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))

    def step(h_prev, y_t):
        h = numpyro.sample("h", dist.Normal(mu + VOLATILITY_PERSISTENCE * (h_prev - mu), sigma))
        numpyro.sample("y", dist.Normal(0.0, jnp.exp(h / 2.0)), obs=y_t)
        return h, None

    scan(step, mu, y)


def volatility_data(n: int = 300, seed: int = 0) -> dict:
    """``n`` daily returns from :func:`volatility_model` with μ = −9, σ = 0.3."""
    rng = np.random.default_rng(seed)
    h, prev = np.empty(n), -9.0
    for t in range(n):
        prev = -9.0 + VOLATILITY_PERSISTENCE * (prev + 9.0) + 0.3 * rng.normal()
        h[t] = prev
    return {"y": np.exp(h / 2.0) * rng.normal(size=n)}


#: (name, model, data, the scale, the latents it scales, the scales integrated on a grid)
FUNNEL_PROBLEMS = (
    ("random walk (600 days, 120 unseen)", walk_scales_model, walk_scales_data, "s", "x", ("s", "r")),
    ("stochastic volatility (300 days)", volatility_model, volatility_data, "sigma", "h", ("sigma",)),
)


def _moments(draws: dict, names) -> dict:
    return {k: (float(np.mean(draws[k])), float(np.std(draws[k]))) for k in names}


def scale_funnel(problems=FUNNEL_PROBLEMS, svi_steps: int = 20_000, warmup: int = NUTS_WARMUP, samples: int = 2_000,
                 draws: int = 4_000, log=print) -> list:
    """A scale that many latents' prior reads, against NUTS: ``blr_fit`` (the latents a chain
    block, the scale fitted apart), ``blr_fit(structure="joint")`` (one dense Gaussian over
    everything), a full-rank Gaussian fitted by numpyro's SVI (``AutoMultivariateNormal``,
    ``svi_steps`` of Adam from 0.005 decaying to 2.5·10⁻⁴, 8 particles) and ``blr_fit`` with
    the problem's scales integrated on a grid (``families={scale: "grid"}``): the scale's mean
    and sd under each, and the range of the latents' sd ratios to NUTS under ``blr_fit`` and
    under the grid. Where even the full-rank Gaussian's sd of the scale is far below NUTS's,
    the shortfall is the Gaussian family's (a funnel), not the factorisation's."""
    rows = []
    for name, model, data_fn, scale, latents, gridded in problems:
        data = data_fn()
        key = jax.random.PRNGKey(0)
        mcmc = MCMC(NUTS(model), num_warmup=warmup, num_samples=samples, progress_bar=False)
        mcmc.run(key, **data)
        ref = mcmc.get_samples()
        row = {"problem": name, "scale": scale, "nuts": _moments(ref, [scale])[scale]}
        fit = blr_fit(model, data, rng_key=key, progress_bar=False)
        post = fit.sample(jax.random.PRNGKey(1), draws)
        row["blr"] = _moments(post, [scale])[scale]
        ratios = np.std(np.asarray(post[latents]), 0) / np.std(np.asarray(ref[latents]), 0)
        row["latent_ratios"] = (float(ratios.min()), float(ratios.max()))
        joint = blr_fit(model, data, rng_key=key, structure="joint", progress_bar=False)
        row["joint"] = _moments(joint.sample(jax.random.PRNGKey(1), draws), [scale])[scale]
        row["joint_converged"] = bool(joint.converged)
        guide = AutoMultivariateNormal(model)
        optim = numpyro.optim.ClippedAdam(step_size=lambda i: SVI_LR * 0.05 ** (i / svi_steps))
        res = SVI(model, guide, optim, Trace_ELBO(num_particles=8)).run(key, svi_steps, progress_bar=False, **data)
        full = guide.sample_posterior(jax.random.PRNGKey(1), res.params, sample_shape=(draws,))
        row["full_rank"] = _moments(full, [scale])[scale]
        t0 = time.perf_counter()
        grid = blr_fit(model, data, rng_key=key, families={s: "grid" for s in gridded}, progress_bar=False)
        row["grid_wall"] = time.perf_counter() - t0
        post = grid.sample(jax.random.PRNGKey(1), draws)
        row["grid"] = _moments(post, [scale])[scale]
        ratios = np.std(np.asarray(post[latents]), 0) / np.std(np.asarray(ref[latents]), 0)
        row["grid_latent_ratios"] = (float(ratios.min()), float(ratios.max()))
        rows.append(row)
        sd = row["nuts"][1]
        log(
            f"  {name}: {scale} sd NUTS {sd:.4f}, blr_fit {row['blr'][1]:.4f} ({row['blr'][1] / sd:.2f}x), joint "
            f"{row['joint'][1]:.4f} ({row['joint'][1] / sd:.2f}x{'' if row['joint_converged'] else ', not converged'}), "
            f"full-rank SVI {row['full_rank'][1]:.4f} ({row['full_rank'][1] / sd:.2f}x), grid {row['grid'][1]:.4f} "
            f"({row['grid'][1] / sd:.2f}x, {row['grid_wall']:.1f} s); {latents} sd ratios "
            f"{row['latent_ratios'][0]:.2f}-{row['latent_ratios'][1]:.2f} (grid "
            f"{row['grid_latent_ratios'][0]:.2f}-{row['grid_latent_ratios'][1]:.2f})"
        )
    return rows


# ------------------------------------------------------------- compile time per site

SITE_SCALING = _SCRIPT_HEADER + r"""
from blrppl import blr_fit
from blrppl.bench.runner import ar2_data, ar2_loop_model
y = ar2_data(int(sys.argv[1]))
t0 = time.perf_counter()
r = blr_fit(ar2_loop_model, {"y": y}, progress_bar=False)
total = time.perf_counter() - t0
print("RESULT" + json.dumps({"compile": r.compile_time, "total": total, "run": r.run_time,
                             "steps": int(r.num_steps), "model_runs": r.compile_counts.model_runs,
                             "xla_compilations": r.compile_counts.xla_compilations,
                             "background_compilations": r.compile_counts.background_compilations}))
"""


def ar2_loop_model(y):
    """AR(2) written as users write a loop: one observed site per time step."""
    a1 = numpyro.sample("a1", dist.Normal(0.0, 0.5))
    a2 = numpyro.sample("a2", dist.Normal(0.0, 0.5))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    for t in range(2, len(y)):
        numpyro.sample(f"y_{t}", dist.Normal(a1 * y[t - 1] + a2 * y[t - 2], sigma), obs=y[t])


def ar2_data(num_sites: int, seed: int = 0) -> np.ndarray:
    """A simulated AR(2) series with ``num_sites`` observations after its first two."""
    rng = np.random.default_rng(seed)
    y = np.zeros(num_sites + 2)
    for t in range(2, num_sites + 2):
        y[t] = 0.5 * y[t - 1] - 0.3 * y[t - 2] + rng.normal()
    return y


def site_scaling(sizes=(10, 100, 1_000), log=print, timeout: float = 600) -> list:
    """``blr_fit``'s first fit of :func:`ar2_loop_model` with ``sizes`` per-step sites, each in
    a fresh process without compilation cache (given up after ``timeout`` seconds): compile
    seconds and seconds per site."""
    rows = []
    for n in sizes:
        row = {"sites": int(n), **_in_new_process(SITE_SCALING, [n], {CACHE_ENV: "0"}, timeout)}
        rows.append(row)
        log(
            f"  AR(2) loop, {n:>5} sites: compile {row['compile']:7.2f} s ({row['compile'] / n * 1e3:.1f} ms/site), "
            f"model runs {row.get('model_runs')}, XLA compilations {row.get('xla_compilations')} {row.get('error', '')}"
        )
    return rows


# ------------------------------------------------ latent matrices written without plates

PLATE_FREE_PCA = _SCRIPT_HEADER + r"""
import numpy as np
import numpyro, numpyro.distributions as dist
from blrppl import blr_fit
n, m, d, free = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "free"
rng = np.random.default_rng(0)
Y = rng.normal(size=(n, d)) @ rng.normal(size=(m, d)).T + 0.5 * rng.normal(size=(n, m))

def plates(Y):
    with numpyro.plate("features", m):
        C = numpyro.sample("C", dist.Normal(0.0, 1.0).expand([d]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("rows", n):
        X = numpyro.sample("X", dist.Normal(0.0, 1.0).expand([d]).to_event(1))
        numpyro.sample("Y", dist.Normal(X @ C.T, sigma).to_event(1), obs=Y)

def plate_free(Y):
    X = numpyro.sample("X", dist.Normal(0.0, 1.0).expand([n, d]).to_event(2))
    C = numpyro.sample("C", dist.Normal(0.0, 1.0).expand([m, d]).to_event(2))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    numpyro.sample("Y", dist.Normal(X @ C.T, sigma).to_event(2), obs=Y)

t0 = time.perf_counter()
r = blr_fit(plate_free if free else plates, Y, progress_bar=False)
total = time.perf_counter() - t0
import jax
sigma = np.asarray(r.sample(jax.random.PRNGKey(1), 4000)["sigma"])
print("RESULT" + json.dumps({"total": total, "compile": r.compile_time, "steps": int(r.num_steps),
                             "sigma_mean": float(sigma.mean()), "sigma_sd": float(sigma.std())}))
"""


def plate_free_pca(shape=(500, 20, 10), log=print, timeout: float = 1200) -> list:
    """Probabilistic PCA (N, M, D = ``shape``) written with plates and without (latent
    matrices ``expand([N, D]).to_event(2)``), each a first fit in a fresh process without
    compilation cache: total seconds and the noise sd's posterior. Target: the plate-free
    model's posterior is the plate version's (noise sd within 1 %) in at most twice its time."""
    rows = []
    for layout in ("plates", "free"):
        row = {"layout": layout, "shape": list(shape),
               **_in_new_process(PLATE_FREE_PCA, [*shape, layout], {CACHE_ENV: "0"}, timeout)}
        rows.append(row)
        log(f"  PCA {shape} {layout:>6}: total {row.get('total', float('nan')):7.2f} s, "
            f"sigma {row.get('sigma_mean', float('nan')):.4f} ± {row.get('sigma_sd', float('nan')):.4f} "
            f"{row.get('error', '')}")
    return rows


# ------------------------------------------------- a hand-written BLR loop, for scale

HAND_LOGISTIC = _SCRIPT_HEADER + r"""
import jax, numpy as np
from blrppl.bench.models import logistic_data
from blrppl.bench.runner import hand_blr_logistic
data = logistic_data(int(sys.argv[1]))
t0 = time.perf_counter()
mean, sd, steps = hand_blr_logistic(data["X"], data["y"])
total = time.perf_counter() - t0
print("RESULT" + json.dumps({"total": total, "steps": steps, "mean": np.asarray(mean).tolist(),
                             "sd": np.asarray(sd).tolist()}))
"""

BLR_LOGISTIC = _SCRIPT_HEADER + r"""
import numpy as np
from blrppl import blr_fit
from blrppl.bench.models import logistic_data, logistic_model
data = logistic_data(int(sys.argv[1]))
t0 = time.perf_counter()
r = blr_fit(logistic_model, data, progress_bar=False)
q = r.posterior["beta"]
mean, sd = np.asarray(q.mean), np.sqrt(np.diag(np.asarray(q.covariance_matrix)))
total = time.perf_counter() - t0
print("RESULT" + json.dumps({"total": total, "compile": r.compile_time, "steps": int(r.num_steps),
                             "mean": mean.tolist(), "sd": sd.tolist()}))
"""

NUTS_LOGISTIC = _SCRIPT_HEADER + r"""
import jax
from blrppl.bench.models import logistic_data, logistic_model
from blrppl.bench.runner import NUTS_SAMPLES, NUTS_WARMUP, _mcmc
data = logistic_data(int(sys.argv[1]))
t0 = time.perf_counter()
_mcmc(logistic_model, NUTS_WARMUP, NUTS_SAMPLES, 1, jax.random.key(0), data)
print("RESULT" + json.dumps({"total": time.perf_counter() - t0}))
"""


def hand_blr_logistic(X, y, prior_sd: float = 2.5, tol: float = 1e-8, max_steps: int = 1000, nodes: int = 20):
    """The Bayesian learning rule for logistic regression written by hand: q(β) = N(m, S),
    the expected gradient and Hessian of each log-likelihood term ℓ_n from Gauss–Hermite
    quadrature over its linear predictor η_n = x_nᵀβ ~ N(x_nᵀm, x_nᵀSx_n), the natural
    parameters moved towards the BLR target

        S⁻¹ ← (1 − ρ) S⁻¹ + ρ (S₀⁻¹ − Xᵀ diag(E[∂²ℓ_n]) X),
        S⁻¹m ← (1 − ρ) S⁻¹m + ρ Xᵀ(E[∂ℓ_n] − E[∂²ℓ_n] x_nᵀm),

    with ρ halved when a step lowers the ELBO and doubled (up to 1) after it is accepted,
    until the ELBO changes by less than ``tol`` (relative). One jitted ``while_loop``, no
    compiler; returns (mean, sd, accepted steps)."""
    import jax.scipy.linalg as jsl

    X = jnp.asarray(X)
    y = jnp.asarray(y)
    nodes_x, weights = np.polynomial.hermite_e.hermegauss(nodes)
    weights = jnp.asarray(weights / np.sqrt(2 * np.pi))
    nodes_x = jnp.asarray(nodes_x)
    d = X.shape[1]
    prior_prec = jnp.eye(d) / prior_sd**2

    def moments(prec, prec_mean):
        chol = jnp.linalg.cholesky(prec)
        mean = jsl.cho_solve((chol, True), prec_mean)
        half = jsl.solve_triangular(chol, X.T, lower=True)
        eta_mean, eta_var = X @ mean, jnp.sum(half**2, axis=0)
        eta = eta_mean[:, None] + jnp.sqrt(eta_var)[:, None] * nodes_x
        # E[ℓ_n], E[∂ℓ_n], E[∂²ℓ_n] for ℓ(η) = yη − log(1 + e^η)
        p = jax.nn.sigmoid(eta)
        ell = ((y[:, None] * eta - jax.nn.softplus(eta)) * weights).sum(1)
        grad = ((y[:, None] - p) * weights).sum(1)
        hess = (-(p * (1 - p)) * weights).sum(1)
        cov = jsl.cho_solve((chol, True), jnp.eye(d))
        kl = 0.5 * (
            jnp.trace(cov) / prior_sd**2 + mean @ mean / prior_sd**2 - d
            + 2 * d * jnp.log(prior_sd) + 2 * jnp.sum(jnp.log(jnp.diag(chol)))
        )
        return mean, eta_mean, grad, hess, ell.sum() - kl

    def step(carry):
        prec, prec_mean, elbo, rho, change, i = carry
        _, eta_mean, grad, hess, _ = moments(prec, prec_mean)
        target_prec = prior_prec - X.T @ (hess[:, None] * X)
        target_prec_mean = X.T @ (grad - hess * eta_mean)
        new_prec = (1 - rho) * prec + rho * target_prec
        new_prec_mean = (1 - rho) * prec_mean + rho * target_prec_mean
        new_elbo = moments(new_prec, new_prec_mean)[4]
        accept = jnp.isfinite(new_elbo) & (new_elbo >= elbo - 1e-9 * jnp.abs(elbo))
        change = jnp.where(accept, jnp.abs(new_elbo - elbo) / jnp.maximum(1.0, jnp.abs(new_elbo)), change)
        return (
            jnp.where(accept, new_prec, prec),
            jnp.where(accept, new_prec_mean, prec_mean),
            jnp.where(accept, new_elbo, elbo),
            jnp.where(accept, jnp.minimum(1.0, 2 * rho), 0.5 * rho),
            change,
            i + accept.astype(jnp.int32),
        )

    def run():
        prec_mean = jnp.zeros(d)
        elbo = moments(prior_prec, prec_mean)[4]
        one = jnp.ones((), prior_prec.dtype)
        init = (prior_prec, prec_mean, elbo, one, jnp.inf * one, jnp.zeros((), jnp.int32))
        prec, prec_mean, _, _, _, steps = jax.lax.while_loop(
            lambda c: (c[4] > tol) & (c[5] < max_steps) & (c[3] > 1e-12), step, init
        )
        mean = jnp.linalg.solve(prec, prec_mean)
        return mean, jnp.sqrt(jnp.diag(jnp.linalg.inv(prec))), steps

    mean, sd, steps = jax.jit(run)()
    return np.asarray(mean), np.asarray(sd), int(steps)


def hand_logistic_comparison(n: int = 5_000, log=print) -> dict:
    """``blr_fit``'s first fit of logistic regression (D = 10) and the hand-written BLR loop
    (:func:`hand_blr_logistic`), each in a fresh process without compilation cache: their
    wall times (compilation included), the ratio, and how far apart their posteriors are; and
    NUTS on the same data in the same way (the floor a jitted loop sets on the ratio to NUTS)."""
    hand = _in_new_process(HAND_LOGISTIC, [n], {CACHE_ENV: "0"})
    blr = _in_new_process(BLR_LOGISTIC, [n], {CACHE_ENV: "0"})
    nuts = _in_new_process(NUTS_LOGISTIC, [n], {CACHE_ENV: "0"})
    row = {"N": n, "blr_total": blr["total"], "blr_compile": blr.get("compile"), "blr_steps": blr.get("steps"),
           "hand_total": hand["total"], "hand_steps": hand.get("steps"), "ratio": blr["total"] / hand["total"],
           "nuts_total": nuts["total"]}
    if "mean" in hand and "mean" in blr:
        sd = np.asarray(hand["sd"])
        row["max_mean_diff_sd"] = float(np.max(np.abs(np.asarray(blr["mean"]) - np.asarray(hand["mean"])) / sd))
        row["max_sd_rel_diff"] = float(np.max(np.abs(np.asarray(blr["sd"]) / sd - 1.0)))
    log(
        f"  logistic N={n}: blr_fit first fit {row['blr_total']:.2f} s, hand-written BLR loop {row['hand_total']:.2f} s, "
        f"ratio {row['ratio']:.2f}, posteriors {row.get('max_mean_diff_sd', float('nan')):.2g} sd apart; "
        f"NUTS {row['nuts_total']:.2f} s"
    )
    return row


# ------------------------------------------------- classic VMP models, side by side with BayesPy

#: BayesPy's PCA timing problems (M observed dimensions, N samples, D latent dimensions)
PCA_PROBLEMS = ((20, 500, 10), (100, 2000, 40))
#: VB iterations timed per problem
VMP_ITERATIONS = 10
#: blrppl reads the second moments of X @ C.T as a contraction of the rows' covariances, an
#: (N, D²) @ (D², M) product: problems above this many multiply-adds per step are not fitted
#: (BayesPy's 2000 × 100, D = 40 problem is 3.2·10⁸)
PCA_MAX_WORK = 2e9


def pca_model(Y, latent_dim: int = 10):
    """Probabilistic PCA with ARD, as BayesPy's PCA example writes it: α_d ~ Gamma(10⁻³, 10⁻³),
    C_m ~ N(0, diag(α)⁻¹), X_n ~ N(0, I), τ ~ Gamma(10⁻³, 10⁻³), Y ~ N(X Cᵀ, τ⁻¹)."""
    _ard_pca(Y, latent_dim)


def _ard_pca(Y, d: int, seen=None):
    """:func:`pca_model`'s sites, the likelihood masked by ``seen`` when given."""
    n, m = Y.shape
    alpha = numpyro.sample("alpha", dist.Gamma(1e-3, 1e-3).expand([d]).to_event(1))
    with numpyro.plate("M", m):
        C = numpyro.sample("C", dist.Normal(0.0, 1 / jnp.sqrt(alpha)).to_event(1))
    with numpyro.plate("N", n):
        X = numpyro.sample("X", dist.Normal(0.0, 1.0).expand([d]).to_event(1))
    tau = numpyro.sample("tau", dist.Gamma(1e-3, 1e-3))
    with numpyro.plate("n", n, dim=-2), numpyro.plate("m", m, dim=-1):
        likelihood = dist.Normal(X @ C.T, 1 / jnp.sqrt(tau))
        numpyro.sample("Y", likelihood if seen is None else likelihood.mask(seen), obs=Y)


def pca_data(m: int, n: int, d: int, seed: int = 0) -> np.ndarray:
    """An N × M matrix of rank d/2 plus unit-scale noise (half the latent dimensions are
    pruned by ARD)."""
    rng = np.random.default_rng(seed)
    rank = max(1, d // 2)
    return rng.normal(size=(n, rank)) @ rng.normal(size=(rank, m)) + rng.normal(size=(n, m))


def _bayespy_pca(Y, d: int, iterations: int, seed: int = 0, ard: bool = True, noise_per_column: bool = False):
    """BayesPy's own PCA model on the same data and priors (:func:`_bayespy_timing`); without
    ``ard`` the loadings' prior is N(0, 1) (factor analysis, with ``noise_per_column``: a
    noise precision per observed dimension); missing entries (NaN) are masked out."""
    from bayespy.inference import VB
    from bayespy.nodes import Gamma, GaussianARD, SumMultiply

    def build():
        n, m = Y.shape
        X = GaussianARD(0, 1, plates=(1, n), shape=(d,))
        priors = []
        if ard:
            alpha = Gamma(1e-3, 1e-3, plates=(d,))
            priors.append(alpha)
            C = GaussianARD(0, alpha, plates=(m, 1), shape=(d,))
        else:
            C = GaussianARD(0, 1, plates=(m, 1), shape=(d,))
        tau = Gamma(1e-3, 1e-3, plates=(m, 1) if noise_per_column else ())
        Yn = GaussianARD(SumMultiply("d,d->", X, C), tau)
        seen = ~np.isnan(Y.T)
        Yn.observe(np.where(seen, Y.T, 0.0), mask=True if seen.all() else seen)
        np.random.seed(seed)
        C.initialize_from_random()
        return VB(Yn, X, C, *priors, tau)  # X first, from the random C (C first collapses to C = 0)

    return _bayespy_timing(build, iterations)


def _bayespy_timing(build, iterations: int) -> dict:
    """BayesPy's VB of the model ``build()`` returns: ms per iteration (the median after the
    first) and the bound after ``iterations``, then a fresh full fit to its own convergence
    test: its wall seconds, iterations and final bound (a bench row's ``bayespy`` entry)."""
    q = build()
    q.update(repeat=iterations, tol=0.0, verbose=False)
    per_iter = float(np.median(q.cputime[1 : q.iter]))
    bound = float(q.compute_lowerbound())
    t0 = time.perf_counter()
    full = build()
    full.update(repeat=10_000, verbose=False)
    return {"per_iter": per_iter, "elbo": bound, "full_wall": time.perf_counter() - t0, "full_steps": int(full.iter),
            "full_elbo": float(full.compute_lowerbound())}


def _jax_floor_pca(Y, d: int, iterations: int, seed: int = 0) -> tuple:
    """Wall seconds of the least an XLA-compiled fit of :func:`pca_model` costs in a new
    program: BayesPy's PCA updates (q(X rows) with one shared covariance, q(C rows), q(α),
    q(τ)) written by hand in JAX as one jitted loop of ``iterations`` sweeps, compiled at
    XLA's lowest optimisation level (the cheapest compile; blrppl's own for small data),
    traced, compiled and run once: no model to read, no plan, no diagnostics. The floor
    under any JAX fit's compile-included wall time of the same problem. Returns the wall
    seconds and the fit (C's means and covariance, E[α], E[τ])."""
    from jax.scipy.linalg import cho_solve

    a0 = b0 = 1e-3

    def sweep(_, carry):
        C, cov_c, alpha, tau = carry
        n, m = Y.shape
        prec_x = jnp.eye(d) + tau * (C.T @ C + m * cov_c)
        cov_x = cho_solve((jnp.linalg.cholesky(prec_x), True), jnp.eye(d))
        X = tau * Y @ C @ cov_x
        xx = X.T @ X + n * cov_x
        prec_c = jnp.diag(alpha) + tau * xx
        cov_c = cho_solve((jnp.linalg.cholesky(prec_c), True), jnp.eye(d))
        C = tau * Y.T @ X @ cov_c
        cc = C.T @ C + m * cov_c
        alpha = (a0 + 0.5 * m) / (b0 + 0.5 * jnp.diag(cc))
        err = jnp.sum(Y * Y) - 2.0 * jnp.sum((Y @ C) * X) + jnp.sum(xx * cc)
        tau = (a0 + 0.5 * n * m) / (b0 + 0.5 * err)
        return C, cov_c, alpha, tau

    def fit(Y, C0):
        start = (C0, jnp.zeros((d, d), Y.dtype), jnp.ones(d, Y.dtype), jnp.ones((), Y.dtype))
        return jax.lax.fori_loop(0, iterations, sweep, start)

    Y = np.asarray(Y)
    return _first_call(fit, Y, np.random.default_rng(seed).normal(size=(Y.shape[1], d)))


def _first_call(fn, data, start) -> tuple:
    """Wall seconds of tracing, compiling (blrppl's options for ``data``: XLA's lowest level
    for small data) and running ``fn(data, start)`` once, and its result."""
    t0 = time.perf_counter()
    compiled = compile_lowered(jax.jit(fn).lower(data, start), _compiler_options(data))
    out = jax.block_until_ready(compiled(data, start))
    return time.perf_counter() - t0, out


def _numpyro_read(model, data: dict, seed: int = 0) -> float:
    """Wall seconds of what any NumPyro inference of ``model`` (NUTS, SVI, blrppl) does before
    its first step: trace its log density (``numpyro.infer.util.log_density``, the data's
    arrays as arguments of the program, not constants folded into it: ARD regression's
    100,000 × 100 inputs took 3.5 s to compile as constants) in a new ``jax.jit``, compile it
    and evaluate it once, at a draw from the prior (drawn beforehand, not timed): the faster of XLA's default
    options and those of :func:`_first_call` (its lowest optimisation level for small data,
    not always the faster to compile: the small mixture's density took 0.41 s with the
    default options, 0.81 s at the lowest level)."""
    from numpyro import handlers
    from numpyro.infer.util import log_density

    def draw(key):
        trace = handlers.trace(handlers.seed(model, key)).get_trace(**data)
        return {n: s["value"] for n, s in trace.items() if s["type"] == "sample" and not s["is_observed"]}

    with numpyro.validation_enabled(False):
        point = jax.block_until_ready(jax.jit(draw)(jax.random.PRNGKey(seed)))
    arrays = {k: v for k, v in data.items() if isinstance(v, np.ndarray)}
    others = {k: v for k, v in data.items() if k not in arrays}
    times = []
    for options in (None, _compiler_options(arrays)):
        t0 = time.perf_counter()
        lowered = jax.jit(lambda values, arrays: log_density(model, (), {**others, **arrays}, values)[0]).lower(point, arrays)
        jax.block_until_ready(compile_lowered(lowered, options)(point, arrays))
        times.append(time.perf_counter() - t0)
    return min(times)


#: BayesPy's convergence test (``VB.update``): the bound rose by less than this, relative, in
#: one iteration. blrppl's own test at the same ``tol`` (``blr_fit(tol=...)``: the ELBO's
#: relative change with its parameters settled, or its spread over 20 steps) is stricter:
#: it never stops before BayesPy's would, and often hundreds of steps later, at a higher bound
BAYESPY_TOL = 1e-5


def bayespy_stop(elbo, tol: float = BAYESPY_TOL) -> int | None:
    """The number of steps after which BayesPy's convergence test (``VB.update``) stops a run
    whose bound after each step is ``elbo``: the first step whose bound rose by less than
    ``tol`` relative to the mean magnitude of it and the bound before (a fall included);
    None when no step did."""
    bound = np.asarray(elbo, float)
    if len(bound) < 2:
        return None
    rise = (bound[1:] - bound[:-1]) / (0.5 * (np.abs(bound[1:]) + np.abs(bound[:-1])))
    hits = np.flatnonzero(~(rise >= tol))  # (a NaN rise stops it too)
    return int(hits[0]) + 2 if len(hits) else None


#: a first fit of a side-by-side VMP problem (:func:`vmp_problem`) stopped after a given
#: number of steps, in a new process: what a user's first run to that step costs
TO_BAYESPY_TEST = _SCRIPT_HEADER + r"""
from blrppl import blr_fit
from blrppl.bench import runner
model, data = runner.vmp_problem(sys.argv[1], json.loads(sys.argv[2]))
t0 = time.perf_counter()
r = blr_fit(model, data, num_steps=int(sys.argv[3]), tol=runner.BAYESPY_TOL, progress_bar=False)
total = time.perf_counter() - t0
print("RESULT" + json.dumps({"total": total, "compile": r.compile_time, "steps": len(r.elbo), "elbo": float(r.elbo[-1])}))
"""


def _to_bayespy_test(problem: str, spec, elbo) -> dict:
    """blrppl run to BayesPy's convergence test, compile included: the step at which the test
    stops the bounds ``elbo`` of a fit of problem ``(problem, spec)`` (:func:`bayespy_stop`), then
    a first fit of that many steps in a new Python process with no compilation cache
    (blrppl's program store and JAX's persistent cache off), as a user's first run of the
    problem: its wall seconds (data made beforehand; imports not counted, as for BayesPy),
    steps and final bound (the same steps from the same start: the bound of ``elbo`` there)."""
    steps = bayespy_stop(elbo)
    if steps is None:
        return {"wall": None, "steps": None, "elbo": None, "error": "BayesPy's test never stopped the run"}
    out = _in_new_process(TO_BAYESPY_TEST, [problem, json.dumps(list(spec)), steps], {CACHE_ENV: "0"})
    if out.get("error"):
        return {"wall": None, "steps": steps, "elbo": float(elbo[steps - 1]), "error": out["error"]}
    return {"wall": out["total"], "steps": out["steps"], "elbo": out["elbo"]}


def _blr_timing(problem: str, spec, size: int, iterations: int, own_test: bool = True) -> dict:
    """``blr_fit`` on the side-by-side problem ``(problem, spec)`` (:func:`vmp_problem`): its
    time per step over ``iterations`` steps (compile excluded) and its bound; a full fit to
    its own convergence test at :data:`BAYESPY_TOL` (wall seconds, compile included, steps,
    bound; left out with ``own_test=False``: hundreds of slow steps past BayesPy's test on
    the large masked factorisation); and a first fit to BayesPy's convergence test in a new
    process (:func:`_to_bayespy_test`, key ``to_test``).

    The steps are timed on later fits: the first one's run time includes waiting for its
    loop, which compiles in the background while the fit is set up. As for BayesPy (its
    median after the first), the time per iteration leaves out what a run costs besides its
    steps (starting the loop, reading the state back): it is the difference between the run
    times of ``iterations`` steps and of one step (each the fastest of five runs), over
    ``iterations`` − 1.

    The first fit of the problem in the run is compiled for real (``tol`` and the number of
    steps are arguments of the compiled loop: the fits that follow reuse its programs). It
    is the full fit, or without it fits of growing length from the same start until
    BayesPy's test stops one (their bounds are a prefix of one sequence)."""
    model, data = vmp_problem(problem, spec)
    row = {}
    if own_test:
        t0 = time.perf_counter()
        full = blr_fit(model, data, num_steps=2_000, tol=BAYESPY_TOL, progress_bar=False)
        row.update(full_wall=time.perf_counter() - t0, full_steps=len(full.elbo), full_elbo=float(full.elbo[-1]))
        first, elbo = full, full.elbo
    else:
        first = None
        for cap in (50, 200, 1_000, 2_000):
            fit = blr_fit(model, data, num_steps=cap, tol=BAYESPY_TOL, progress_bar=False)
            first, elbo = first or fit, fit.elbo
            if bayespy_stop(elbo) is not None or len(elbo) < cap:
                break

    def fastest_run(steps):
        # (the fastest of five: a shared machine only ever adds time, and at a fraction of a
        # millisecond per step the median of three could put a 1-step run above a 10-step one)
        runs = [blr_fit(model, data, num_steps=steps, tol=1e-30, progress_bar=False) for _ in range(5)]
        return runs[-1], min(x.run_time for x in runs)

    _, one = fastest_run(1)
    r, many = fastest_run(iterations)
    row.update({**_fit_row(size, r), "compile_time": first.compile_time, "elbo": float(r.elbo[-1])})
    row["per_step"] = max(many - one, 0.0) / max(int(r.num_steps) - 1, 1)
    row["to_test"] = _to_bayespy_test(problem, spec, elbo)
    return row



def _test_log(t: dict | None) -> str:
    if not t:
        return ""
    if t.get("wall") is None:
        return f"; to BayesPy's test: {t.get('error')}"
    return f"; to BayesPy's test {t['wall']:.1f} s (new process), {t['steps']} steps, bound {t['elbo']:.1f}"


def _vmp_log(name: str, b: dict | None, bp: dict | None) -> str:
    return (
        f"  {name}: "
        + ("blrppl not run (too much work per step)" if b is None else
           f"blrppl {1e3 * b['per_step']:.1f} ms/iteration (compile {b['compile_time']:.1f} s), "
           f"bound {b['elbo']:.1f}"
           + (f"; full fit {b['full_wall']:.1f} s, {b['full_steps']} steps" if "full_wall" in b else "")
           + _test_log(b.get("to_test")))
        + ("" if bp is None else f"; BayesPy {1e3 * bp['per_iter']:.1f} ms/iteration, bound {bp['elbo']:.1f}; "
           f"full fit {bp['full_wall']:.1f} s, {bp['full_steps']} iterations")
    )


def vmp_pca(problems=PCA_PROBLEMS, iterations: int = VMP_ITERATIONS, log=print) -> list:
    """:func:`pca_model` on BayesPy's PCA timing problems: ``blr_fit``'s ms per iteration
    (``iterations`` steps, compile excluded) and lower bound, against BayesPy 0.6's VMP on
    the same data (when the optional ``bayespy`` package is installed), plus the wall time
    of a full fit of each to its own convergence test (compile included for blrppl)."""
    try:
        import bayespy  # noqa: F401
    except ImportError:
        bayespy = None
    rows = []
    for m, n, d in problems:
        _, data = vmp_problem("pca", (m, n, d))
        Y = data["Y"]
        row = {"M": m, "N": n, "D": d, "steps": iterations}
        row["blr"] = _blr_timing("pca", (m, n, d), n, iterations) if d**2 * m * n <= PCA_MAX_WORK else None
        row["bayespy"] = None if bayespy is None else _bayespy_pca(Y, d, iterations)
        # (BayesPy's iterations when it ran, else blrppl's steps)
        sweeps = (row["bayespy"] or {}).get("full_steps") or (row["blr"] or {}).get("full_steps") or 100
        row["floor"] = {"wall": _jax_floor_pca(Y, d, sweeps)[0], "sweeps": sweeps}
        row["numpyro_read"] = _numpyro_read(pca_model, data)
        rows.append(row)
        log(_vmp_log(f"PCA M={m} N={n} D={d}", row["blr"], row["bayespy"]))
    return rows


#: BayesPy's Gaussian-mixture timing problems (K components, N samples, D dimensions)
GMM_PROBLEMS = ((10, 200, 2), (40, 2000, 10))


def gmm_model(X, num_components: int = 10):
    """A Gaussian mixture with full precisions, as BayesPy's mixture example writes it:
    π ~ Dirichlet(10⁻⁵), μ_k ~ N(0, (10⁻⁵ I)⁻¹), Λ_k ~ Wishart(D, rate 10⁻⁵ I),
    z_n ~ Categorical(π), x_n ~ N(μ_{z_n}, Λ_{z_n}⁻¹)."""
    n, d = X.shape
    k = num_components
    pi = numpyro.sample("pi", dist.Dirichlet(jnp.full(k, 1e-5)))
    with numpyro.plate("components", k):
        mu = numpyro.sample("mu", dist.MultivariateNormal(jnp.zeros(d), precision_matrix=1e-5 * jnp.eye(d)))
        Lam = numpyro.sample("Lam", dist.Wishart(float(d), rate_matrix=1e-5 * jnp.eye(d)))
    with numpyro.plate("data", n):
        z = numpyro.sample("z", dist.Categorical(pi))
        numpyro.sample("x", dist.MultivariateNormal(mu[z], precision_matrix=Lam[z]), obs=X)


def gmm_data(k: int, n: int, d: int, seed: int = 0) -> np.ndarray:
    """N points from k well-separated Gaussian clusters with random full covariances."""
    rng = np.random.default_rng(seed)
    centres = 4.0 * rng.normal(size=(k, d))
    labels = rng.integers(k, size=n)
    factors = rng.normal(size=(k, d, d)) / np.sqrt(d)
    return centres[labels] + np.einsum("nij,nj->ni", factors[labels], rng.normal(size=(n, d)))


def _bayespy_gmm(X, k: int, iterations: int, seed: int = 0):
    """BayesPy's own mixture on the same data and priors (:func:`_bayespy_timing`)."""
    from bayespy.inference import VB
    from bayespy.nodes import Categorical, Dirichlet, Gaussian, Mixture, Wishart

    def build():
        n, d = X.shape
        alpha = Dirichlet(1e-5 * np.ones(k))
        z = Categorical(alpha, plates=(n,))
        mu = Gaussian(np.zeros(d), 1e-5 * np.identity(d), plates=(k,))
        lam = Wishart(d, 1e-5 * np.identity(d), plates=(k,))  # BayesPy's V is the rate matrix
        y = Mixture(z, Gaussian, mu, lam)
        y.observe(X)
        np.random.seed(seed)
        z.initialize_from_random()
        return VB(y, mu, lam, z, alpha)

    return _bayespy_timing(build, iterations)


def _jax_floor_gmm(X, k: int, iterations: int, seed: int = 0) -> tuple:
    """:func:`_jax_floor_pca` for :func:`gmm_model`: Bishop's (2006, §10.2) mixture updates
    with q(μ_k) and q(Λ_k) apart (BayesPy's factorisation) by hand in JAX, ``iterations``
    sweeps from random responsibilities, traced, compiled at XLA's lowest optimisation level
    and run once. Returns the wall seconds and the responsibilities."""
    from jax.scipy.linalg import cho_solve
    from jax.scipy.special import digamma, logsumexp

    n, d = X.shape
    alpha0, beta0, nu0, w0_inv = 1e-5, 1e-5, float(d), 1e-5 * np.eye(d)
    eye = np.eye(d)

    def sweep(_, resp):
        counts = resp.sum(0) + 1e-12
        log_pi = digamma(alpha0 + counts) - digamma(k * alpha0 + n)
        # q(Λ_k) from the responsibilities at the means' last values, q(μ_k) given E[Λ_k]
        xbar = (resp.T @ X) / counts[:, None]
        centred = X[None] - xbar[:, None]
        scatter = jnp.einsum("nk,kni,knj->kij", resp, centred, centred)
        nu = nu0 + counts
        w = jax.vmap(lambda s: cho_solve((jnp.linalg.cholesky(w0_inv + s), True), eye))(scatter)
        lam = nu[:, None, None] * w
        prec_mu = beta0 * eye + counts[:, None, None] * lam
        cov_mu = jax.vmap(lambda p: cho_solve((jnp.linalg.cholesky(p), True), eye))(prec_mu)
        mean_mu = jnp.einsum("kij,kjl,kl->ki", cov_mu, lam, counts[:, None] * xbar)
        logdet = jnp.sum(digamma(0.5 * (nu[:, None] - np.arange(d)[None])), -1) + d * np.log(2.0) + jnp.linalg.slogdet(w)[1]
        diff = X[None] - mean_mu[:, None]
        quad = jnp.einsum("kni,kij,knj->nk", diff, lam, diff) + jnp.einsum("kij,kji->k", lam, cov_mu)[None]
        log_r = log_pi[None] + 0.5 * logdet[None] - 0.5 * quad
        return jnp.exp(log_r - logsumexp(log_r, axis=1, keepdims=True))

    def fit(X, resp0):
        return jax.lax.fori_loop(0, iterations, sweep, resp0)

    X = np.asarray(X)
    return _first_call(fit, X, np.random.default_rng(seed).dirichlet(np.ones(k), size=n))


def vmp_gmm(problems=GMM_PROBLEMS, iterations: int = VMP_ITERATIONS, log=print) -> list:
    """:func:`gmm_model` on BayesPy's mixture timing problems: ``blr_fit``'s ms per iteration
    (``iterations`` steps, compile excluded) and lower bound, against BayesPy 0.6's VMP on the
    same data (when the optional ``bayespy`` package is installed), plus the wall time of a
    full fit of each to its own convergence test (compile included for blrppl)."""
    try:
        import bayespy  # noqa: F401
    except ImportError:
        bayespy = None
    rows = []
    for k, n, d in problems:
        _, data = vmp_problem("gmm", (k, n, d))
        X = data["X"]
        row = {"K": k, "N": n, "D": d, "steps": iterations, "blr": _blr_timing("gmm", (k, n, d), n, iterations)}
        row["bayespy"] = None if bayespy is None else _bayespy_gmm(X, k, iterations)
        sweeps = (row["bayespy"] or {}).get("full_steps") or (row["blr"] or {}).get("full_steps") or 100
        row["floor"] = {"wall": _jax_floor_gmm(X, k, sweeps)[0], "sweeps": sweeps}
        row["numpyro_read"] = _numpyro_read(gmm_model, data)
        rows.append(row)
        log(_vmp_log(f"GMM K={k} N={n} D={d}", row["blr"], row["bayespy"]))
    return rows


# ------------------------------------------- the other classic VMP models, side by side with BayesPy


def fa_model(Y, latent_dim: int = 10):
    """Factor analysis: W_m ~ N(0, I), X_n ~ N(0, I), a noise precision per observed dimension
    ψ_m ~ Gamma(10⁻³, 10⁻³), Y_n ~ N(W X_n, diag(ψ)⁻¹)."""
    n, m = Y.shape
    psi = numpyro.sample("psi", dist.Gamma(1e-3, 1e-3).expand([m]).to_event(1))
    with numpyro.plate("M", m):
        W = numpyro.sample("W", dist.Normal(0.0, 1.0).expand([latent_dim]).to_event(1))
    with numpyro.plate("N", n):
        X = numpyro.sample("X", dist.Normal(0.0, 1.0).expand([latent_dim]).to_event(1))
        numpyro.sample("Y", dist.Normal(X @ W.T, 1 / jnp.sqrt(psi)).to_event(1), obs=Y)


def fa_data(m: int, n: int, d: int, seed: int = 0) -> np.ndarray:
    """:func:`pca_data` with a noise scale per column, drawn from [0.5, 2]."""
    rng = np.random.default_rng(seed)
    rank = max(1, d // 2)
    scales = rng.uniform(0.5, 2.0, size=m)
    return rng.normal(size=(n, rank)) @ rng.normal(size=(rank, m)) + scales * rng.normal(size=(n, m))


def bmf_model(Y, latent_dim: int = 10):
    """Bayesian matrix factorisation with missing entries: :func:`pca_model` with the NaN
    entries of ``Y`` masked out."""
    _ard_pca(jnp.nan_to_num(Y), latent_dim, ~jnp.isnan(Y))


def bmf_data(m: int, n: int, d: int, missing: float, seed: int = 0) -> np.ndarray:
    """:func:`pca_data` with a fraction ``missing`` of its entries NaN, at random."""
    Y = pca_data(m, n, d, seed)
    Y[np.random.default_rng(seed + 1).random(Y.shape) < missing] = np.nan
    return Y


def ard_model(X, y=None):
    """Linear regression with ARD priors (Tipping 2001, as VB): α_i ~ Gamma(10⁻³, 10⁻³),
    w_i ~ N(0, α_i⁻¹), τ ~ Gamma(10⁻³, 10⁻³), y_n ~ N(x_n·w, τ⁻¹)."""
    alpha = numpyro.sample("alpha", dist.Gamma(1e-3, 1e-3).expand([X.shape[1]]).to_event(1))
    w = numpyro.sample("w", dist.Normal(0.0, 1 / jnp.sqrt(alpha)).to_event(1))
    tau = numpyro.sample("tau", dist.Gamma(1e-3, 1e-3))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, 1 / jnp.sqrt(tau)), obs=y)


def ard_data(n: int, d: int, seed: int = 0) -> tuple:
    """N standard normal rows of d inputs, 30 % of the weights non-zero, noise sd 0.5."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    w = rng.normal(size=d) * (rng.random(d) < 0.3)
    return X, X @ w + 0.5 * rng.normal(size=n)


def _bayespy_ard(X, y, iterations: int):
    """BayesPy's linear regression with ARD on the same data and priors (:func:`_bayespy_timing`)."""
    from bayespy.inference import VB
    from bayespy.nodes import Gamma, GaussianARD, SumMultiply

    def build():
        alpha = Gamma(1e-3, 1e-3, plates=(X.shape[1],))
        w = GaussianARD(0, alpha, shape=(X.shape[1],))
        tau = Gamma(1e-3, 1e-3)
        obs = GaussianARD(SumMultiply("i,i", w, X), tau)
        obs.observe(y)
        return VB(obs, w, alpha, tau)

    return _bayespy_timing(build, iterations)


def vmp_problem(problem: str, spec) -> tuple:
    """``(model, data)`` of a side-by-side VMP problem: ``pca`` (M, N, D), ``gmm`` (K, N, D),
    ``fa`` (M, N, D), ``bmf`` (M, N, D, fraction missing) or ``ard`` (N, D); made alike in
    the bench and in its new processes (:data:`TO_BAYESPY_TEST`)."""
    if problem == "pca":
        m, n, d = spec
        return pca_model, {"Y": pca_data(m, n, d), "latent_dim": d}
    if problem == "gmm":
        k, n, d = spec
        return gmm_model, {"X": gmm_data(k, n, d), "num_components": k}
    if problem == "fa":
        m, n, d = spec
        return fa_model, {"Y": fa_data(m, n, d), "latent_dim": d}
    if problem == "bmf":
        m, n, d, missing = spec
        return bmf_model, {"Y": bmf_data(m, n, d, missing), "latent_dim": d}
    if problem == "ard":
        n, d = spec
        X, y = ard_data(n, d)
        return ard_model, {"X": X, "y": y}
    raise ValueError(f"unknown VMP problem {problem!r}")


#: the other classic VMP models of the issue, each at BayesPy's small PCA size and a large one
ZOO_PROBLEMS = (
    ("fa", (20, 500, 10)),
    ("fa", (100, 2000, 40)),
    ("bmf", (20, 500, 10, 0.3)),
    ("bmf", (100, 2000, 40, 0.3)),
    ("ard", (1000, 20)),
    ("ard", (100_000, 100)),
)


def _bayespy_zoo(problem: str, data: dict, iterations: int) -> dict:
    if problem == "ard":
        return _bayespy_ard(data["X"], data["y"], iterations)
    return _bayespy_pca(data["Y"], data["latent_dim"], iterations, ard=problem == "bmf", noise_per_column=problem == "fa")


def vmp_zoo(problems=ZOO_PROBLEMS, iterations: int = VMP_ITERATIONS, log=print) -> list:
    """Factor analysis, matrix factorisation with missing entries and ARD regression
    (:func:`vmp_problem`) against BayesPy 0.6's VMP of the same models (when the optional
    ``bayespy`` package is installed): ms per iteration (compile excluded) and bounds, and
    the wall time of each run to BayesPy's convergence test (compile included for blrppl,
    in a new process: :func:`_to_bayespy_test`)."""
    try:
        import bayespy  # noqa: F401
    except ImportError:
        bayespy = None
    rows = []
    for problem, spec in problems:
        model, data = vmp_problem(problem, spec)
        row = {"problem": problem, "spec": tuple(spec), "steps": iterations}
        row["blr"] = _blr_timing(problem, spec, spec[1] if problem != "ard" else spec[0], iterations, own_test=False)
        row["bayespy"] = None if bayespy is None else _bayespy_zoo(problem, data, iterations)
        row["numpyro_read"] = _numpyro_read(model, data)
        rows.append(row)
        log(_vmp_log(f"{problem} {spec}", row["blr"], row["bayespy"]))
    return rows
