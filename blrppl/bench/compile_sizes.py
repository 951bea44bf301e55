"""The size of the compiled step and the compile time of a first fit, model by model, each in
a fresh process (``python -m blrppl.bench --compile-sizes``).

For the AR(2) written with one site per step (:func:`blrppl.bench.runner.ar2_loop_model`) at
several lengths, NumPyro's partially pooled baseball model, and every bench model: the
first fit's compile seconds (``result.compile_time``, ``refine=False``, no compilation cache),
its model runs and XLA compilations, the number of equations of the step's program (JAX's
jaxpr, sub-programs included) and the number of HLO operations of the step once XLA has
optimised it (fusion bodies included). A program whose size grows with a model's sites,
steps or scalars shows up in the last two columns.
"""

from __future__ import annotations

import numpy as np
import numpyro
import numpyro.distributions as dist

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


COMPILE_SIZE = _SCRIPT_HEADER + r"""
import jax
from blrppl import blr_fit, blr_kernel
from blrppl.bench import compile_sizes
name = sys.argv[1]
kwargs = {}
if name.startswith("ar2:"):
    from blrppl.bench.runner import ar2_data, ar2_loop_model
    model, data = ar2_loop_model, {"y": ar2_data(int(name.split(":")[1]))}
elif name == "baseball_pooled":
    model, data = compile_sizes.baseball_pooled, compile_sizes.baseball_data()
else:
    from blrppl.bench import models
    bm = models.load(name)
    model, data, kwargs = bm.model, bm.data, dict(bm.blr_kwargs)
t0 = time.perf_counter()
r = blr_fit(model, data, progress_bar=False, refine=False, rng_key=jax.random.PRNGKey(0), **kwargs)
total = time.perf_counter() - t0
rule = {k: v for k, v in kwargs.items() if k in ("families", "structure", "point", "mc_curvature", "point_space")}
kernel, state = blr_kernel(model, data, rng_key=jax.random.PRNGKey(0), **rule)
print("RESULT" + json.dumps({
    "compile": r.compile_time, "total": total, "model_runs": r.compile_counts.model_runs,
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
    """The AR(2) at :data:`AR2_SITES`, the baseball model and every bench model."""
    from blrppl.bench import models, posteriordb

    return [f"ar2:{n}" for n in AR2_SITES] + ["baseball_pooled"] + posteriordb.names() + models.names()


def markdown(rows) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| model | compile s | model runs | XLA compilations | step jaxpr equations | step HLO ops |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        model = r["model"].replace("ar2:", "AR(2) loop, ") + (" sites" if r["model"].startswith("ar2:") else "")
        if "error" in r:
            lines.append(f"| {model} | failed: {r['error']} | | | | |")
            continue
        lines.append(
            f"| {model} | {r['compile']:.2f} | {r['model_runs']} | {r['xla_compilations']} | "
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
