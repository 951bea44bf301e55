"""The size of the compiled step and the compile time of a first fit, model by model, each in
a fresh process (``python -m blrppl.bench --compile-sizes``).

For the AR(2) written with one site per step (:func:`blrppl.bench.runner.ar2_loop_model`) at
several lengths, NumPyro's partially pooled baseball model, Inference Gym's convection Lorenz
bridge (:func:`lorenz_bridge`, :func:`lorenz_bridge_scales`), and every bench model: the
first fit's compile seconds (``result.compile_time``, ``refine=False``, no compilation cache),
its run seconds, the whole fit's CPU seconds (all threads: on a shared machine the wall
seconds are the load's as much as the fit's), its model runs and XLA compilations, the
number of equations of the step's program (JAX's jaxpr, sub-programs included) and the
number of HLO operations of the step once XLA has optimised it (fusion bodies included). A
program whose size grows with a model's sites, steps or scalars shows up in the last two columns.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.contrib.control_flow import scan

from blrppl.bench.runner import CACHE_ENV, _SCRIPT_HEADER, _in_new_process

#: the AR(2) lengths measured (observed sites after the first two values)
AR2_SITES = (100, 1_000, 10_000)

#: hits in the first 45 at-bats of 1970 of the 18 players of Efron & Morris (1975, J. Amer.
#: Statist. Assoc. 70: 311-319, Table 1)
BASEBALL_HITS = (18, 17, 16, 15, 14, 14, 13, 12, 11, 11, 10, 10, 10, 10, 10, 9, 8, 7)


def baseball_pooled(at_bats, hits=None):
    """NumPyro's partially pooled baseball model: each player's average ``phi`` ~ Beta(m κ,
    (1 − m) κ) about a common ``m`` ~ Uniform(0, 1), ``kappa`` ~ Pareto(1, 1.5), hits ~
    Binomial(at_bats, phi)."""
    m = numpyro.sample("m", dist.Uniform(0, 1))
    kappa = numpyro.sample("kappa", dist.Pareto(1, 1.5))
    with numpyro.plate("players", at_bats.shape[0]):
        phi = numpyro.sample("phi", dist.Beta(m * kappa, (1 - m) * kappa))
        numpyro.sample("obs", dist.Binomial(at_bats, probs=phi), obs=hits)


def baseball_data() -> dict:
    """The model's data: 45 at-bats for each player, and their hits."""
    hits = np.asarray(BASEBALL_HITS, dtype=float)
    return {"at_bats": np.full(hits.shape, 45.0), "hits": hits}


#: the Lorenz bridge's settings (Inference Gym's ``ConvectionLorenzBridge``, after Ambrogioni,
#: Hinne & van Gerven 2020, "Automatic structured variational inference"): Euler steps, their
#: step size, the innovation and observation scales, and the steps observed at each end
LORENZ_STEPS = 30
LORENZ_STEP_SIZE = 0.02
LORENZ_INNOVATION_SCALE = 0.1
LORENZ_OBSERVATION_SCALE = 1.0
LORENZ_OBSERVED_ENDS = 10


def _lorenz_drift(state):
    """The Lorenz system's velocity (σ = 10, ρ = 28, β = 8/3) at ``state`` (last axis x, y, z)."""
    x, y, z = state[..., 0], state[..., 1], state[..., 2]
    return jnp.stack([10.0 * (y - x), x * (28.0 - z) - y, x * y - 8.0 / 3.0 * z], axis=-1)


def _lorenz_states(x0, obs, mask, innovation_scale, observation_scale, step_size):
    """The Euler–Maruyama steps of the Lorenz system from ``x0`` as a NumPyro ``scan``: a latent
    state ``x`` per step, its first coordinate observed as ``y`` where ``mask`` holds."""

    def transition(state, inputs):
        y_t, m_t = inputs
        loc = state + step_size * _lorenz_drift(state)
        x = numpyro.sample("x", dist.Normal(loc, jnp.sqrt(step_size) * innovation_scale).to_event(1))
        numpyro.sample("y", dist.Normal(x[0], observation_scale).mask(m_t), obs=y_t)
        return x, None

    scan(transition, x0, (obs, mask))


def lorenz_bridge(obs, mask, step_size=LORENZ_STEP_SIZE):
    """Inference Gym's convection Lorenz bridge: the initial state ``x0`` ~ N(0, 1)³, then one
    Euler step of the stochastic Lorenz system per observation, ``x[t]`` ~ N(x[t-1] + h f(x[t-1]),
    √h · 0.1), the convection ``x[t][0]`` observed with sd 1 at the first and last steps
    (``mask``; the middle ones are missing)."""
    x0 = numpyro.sample("x0", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
    _lorenz_states(x0, obs, mask, LORENZ_INNOVATION_SCALE, LORENZ_OBSERVATION_SCALE, step_size)


def lorenz_bridge_scales(obs, mask, step_size=LORENZ_STEP_SIZE):
    """The Lorenz bridge with latent scales (Inference Gym's
    ``ConvectionLorenzBridgeUnknownScales``): ``innovation_scale`` and ``observation_scale`` ~
    LogNormal(−1, 1)."""
    innovation_scale = numpyro.sample("innovation_scale", dist.LogNormal(-1.0, 1.0))
    observation_scale = numpyro.sample("observation_scale", dist.LogNormal(-1.0, 1.0))
    x0 = numpyro.sample("x0", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
    _lorenz_states(x0, obs, mask, innovation_scale, observation_scale, step_size)


def lorenz_data(steps: int = LORENZ_STEPS, seed: int = 0) -> dict:
    """A bridge simulated from the model with a fixed seed: ``obs`` (the convection at each
    step, 0 where unobserved) and ``mask`` (the first and last ``min(10, steps // 3)`` steps)."""
    rng = np.random.default_rng(seed)
    h = LORENZ_STEP_SIZE
    state = rng.normal(size=3)
    obs = np.zeros(steps)
    for t in range(steps):
        x, y, z = state
        drift = np.array([10.0 * (y - x), x * (28.0 - z) - y, x * y - 8.0 / 3.0 * z])
        state = state + h * drift + np.sqrt(h) * LORENZ_INNOVATION_SCALE * rng.normal(size=3)
        obs[t] = state[0] + LORENZ_OBSERVATION_SCALE * rng.normal()
    ends = min(LORENZ_OBSERVED_ENDS, steps // 3)
    mask = np.zeros(steps, dtype=bool)
    mask[:ends] = True
    mask[steps - ends:] = True
    return {"obs": np.where(mask, obs, 0.0), "mask": mask}


#: name → (model, data builder) of the models measured besides the bench models
EXTRA_MODELS = {
    "baseball_pooled": (baseball_pooled, baseball_data),
    "lorenz_bridge": (lorenz_bridge, lorenz_data),
    "lorenz_bridge_scales": (lorenz_bridge_scales, lorenz_data),
}


COMPILE_SIZE = _SCRIPT_HEADER + r"""
import jax
from blrppl import blr_fit, blr_kernel
from blrppl.bench import compile_sizes
name = sys.argv[1]
kwargs = {}
if name.startswith("ar2:"):
    from blrppl.bench.runner import ar2_data, ar2_loop_model
    model, data = ar2_loop_model, {"y": ar2_data(int(name.split(":")[1]))}
elif name in compile_sizes.EXTRA_MODELS:
    model, build = compile_sizes.EXTRA_MODELS[name]
    data = build()
else:
    from blrppl.bench import models
    bm = models.load(name)
    model, data, kwargs = bm.model, bm.data, dict(bm.blr_kwargs)
t0, c0 = time.perf_counter(), time.process_time()
r = blr_fit(model, data, progress_bar=False, refine=False, rng_key=jax.random.PRNGKey(0), **kwargs)
total, cpu = time.perf_counter() - t0, time.process_time() - c0
rule = {k: v for k, v in kwargs.items() if k in ("families", "structure", "point", "mc_curvature", "point_space")}
kernel, state = blr_kernel(model, data, rng_key=jax.random.PRNGKey(0), **rule)
print("RESULT" + json.dumps({
    "compile": r.compile_time, "run": r.run_time, "total": total, "cpu": cpu, "model_runs": r.compile_counts.model_runs,
    "xla_compilations": r.compile_counts.xla_compilations, **compile_sizes.step_size(kernel.step, state),
}))
"""


def step_size(step, state) -> dict:
    """The step's program size: ``jaxpr_equations`` (sub-programs included) and
    ``hlo_operations`` of its XLA-optimised module (every instruction of every computation,
    fusion bodies included)."""
    import jax

    from blrppl.model.trace import equation_count

    closed = jax.make_jaxpr(step)(state)
    text = jax.jit(step).lower(state).compile().as_text()
    ops = sum(1 for line in text.splitlines() if " = " in line and not line.lstrip().startswith(("HloModule", "//")))
    return {"jaxpr_equations": equation_count(closed.jaxpr), "hlo_operations": ops}


def measure(names, log=print, timeout: float = 1800) -> list:
    """One row per model of ``names`` (``"ar2:<sites>"``, ``"baseball_pooled"`` or a bench
    model's name), each measured in a fresh process without compilation cache."""
    rows = []
    for name in names:
        row = {"model": name, **_in_new_process(COMPILE_SIZE, [name], {CACHE_ENV: "0"}, timeout)}
        rows.append(row)
        log(
            f"  {name:<45} compile {row['compile']:7.2f} s, step: {row.get('jaxpr_equations', '-')} equations, "
            f"{row.get('hlo_operations', '-')} HLO ops {row.get('error', '')}"
        )
    return rows


def default_names() -> list:
    """The AR(2) at :data:`AR2_SITES`, :data:`EXTRA_MODELS` and every bench model."""
    from blrppl.bench import models, posteriordb

    return [f"ar2:{n}" for n in AR2_SITES] + list(EXTRA_MODELS) + posteriordb.names() + models.names()


def markdown(rows) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| model | compile s | run s | model runs | XLA compilations | step jaxpr equations | step HLO ops |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        model = r["model"].replace("ar2:", "AR(2) loop, ") + (" sites" if r["model"].startswith("ar2:") else "")
        if "error" in r:
            lines.append(f"| {model} | failed: {r['error']} | | | | | |")
            continue
        lines.append(
            f"| {model} | {r['compile']:.2f} | {r['run']:.2f} | {r['model_runs']} | {r['xla_compilations']} | "
            f"{r['jaxpr_equations']} | {r['hlo_operations']} |"
        )
    return "\n".join(lines)


def main(out=None, names=None) -> list:
    """Measure ``names`` (default :func:`default_names`), print the table and write it to
    ``out`` (a path) when given."""
    rows = measure(names or default_names())
    text = markdown(rows)
    print(text)
    if out is not None:
        with open(out, "w") as fh:
            fh.write(text + "\n")
    return rows
