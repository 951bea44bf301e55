"""``python -m blrppl.bench.sharding``: what a fit over a device mesh sends between its devices
each step, and how long its step takes on 1, 2, 4 and 8 devices.

A new process with 8 forced host devices (``--xla_force_host_platform_device_count=8``,
float64) fits:

* **collectives**: a conjugate Normal mean, a VMP Gaussian mixture (assignments enumerated
  per datum; in the default and the parallel schedule) and a logistic regression
  (quadrature) over the 8-device mesh, at several N and, for the regression, several numbers
  of coefficients D. For each compiled chunk it reads the optimised program
  (:func:`collectives`): the all-reduces inside the loop's body (run every step, but those in
  a conditional's branch) and outside it (run once a chunk), their count and the bytes of
  their results. A global block's message is a sum over the data, so the bytes per step should not
  depend on N, and should grow with the size of the global natural parameters (D + D² for
  the regression's dense Gaussian), not faster;
* **step time**: the logistic regression at N = 10⁶, D = 10 on 1 device (no mesh) and on
  meshes of 1, 2, 4 and 8 devices: the marginal cost of a step (two refits of the compiled
  fit with different step counts, the difference over the difference in steps; fastest of
  three).

The host devices share this machine's cores, so more devices cannot make a step faster here;
what the figures show is the cost of splitting the step (partitioned work, the all-reduce,
padding) on one machine. On a real mesh each device computes its N/n rows, and the step adds
one all-reduce of the bytes in the first table.

Examples::

    python -m blrppl.bench.sharding                    # prints the tables
    python -m blrppl.bench.sharding --out docs         # and writes docs/sharding-bench.md
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import time

import numpy as np

DEVICES = 8
_BYTES = {"f64": 8, "f32": 4, "f16": 2, "bf16": 2, "s64": 8, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}
_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s")
_CALLED = re.compile(r"(?:body|condition|to_apply|calls|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_COLLECTIVE = re.compile(r"=\s*(.+?)\s+(all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute)(-start)?\(")


def _shape_bytes(text: str) -> int:
    """Bytes of an HLO result shape: ``f64[8,4]{1,0}`` or a tuple ``(f64[], f64[4]{0})``."""
    total = 0
    for dtype, dims in re.findall(r"([a-z]+\d*)\[([0-9,]*)\]", text):
        total += _BYTES.get(dtype, 8) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


def _computations(text: str) -> tuple[dict, str]:
    """HLO module text → (computation name → its lines, the entry computation's name)."""
    comps, entry, name = {}, None, None
    for line in text.splitlines():
        if line and not line.startswith((" ", "}", "HloModule")) and line.rstrip().endswith("{"):
            m = _HEAD.match(line)
            name = m.group(2) if m else line
            comps[name] = []
            if line.startswith("ENTRY"):
                entry = name
        elif name is not None and line.startswith(" "):
            comps[name].append(line)
    return comps, entry


def _reachable(comps: dict, roots, branches: bool = True) -> set:
    """The computations ``roots`` call, directly or not (with ``branches=False``, not through
    a conditional's branches: those every run of the roots runs)."""
    seen, todo = set(), list(roots)
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        for line in comps[c]:
            called = _CALLED.findall(line)
            if not branches and " conditional(" in line:
                called = [n for n in called if not re.search(r"(true|false)_computation=%" + re.escape(n) + r"\b", line)]
                todo += called
                continue
            todo += called
            for group in _BRANCHES.findall(line):
                todo += [s.strip().lstrip("%") for s in group.split(",")]
    return seen


def collectives(text: str) -> dict:
    """The collectives of a compiled program (its optimised HLO text): count and result bytes
    of those in the body of a ``while`` loop (``per_step``: the fit's steps) and of the others
    (``per_chunk``), how many of the loop's sit in a conditional's branch (``conditional``:
    run in the steps that take that branch only), and their kinds."""
    comps, _ = _computations(text)
    bodies = [b for lines in comps.values() for line in lines for b in re.findall(r"body=%([\w.\-]+)", line)]
    in_loop = _reachable(comps, bodies)
    always = _reachable(comps, bodies, branches=False)
    out = {"per_step": [0, 0], "per_chunk": [0, 0], "conditional": 0, "kinds": set()}
    for name, lines in comps.items():
        for line in lines:
            m = _COLLECTIVE.search(line)
            if m:
                where = out["per_step" if name in in_loop else "per_chunk"]
                where[0] += 1
                where[1] += _shape_bytes(m.group(1))
                out["conditional"] += int(name in in_loop and name not in always)
                out["kinds"].add(m.group(2))
    out["kinds"] = sorted(out["kinds"])
    return out


# ---------------------------------------------------------------------- the worker


def _models():
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as dist

    def normal_mean(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    def mixture(y):
        w = numpyro.sample("w", dist.Dirichlet(jnp.ones(3)))
        with numpyro.plate("k", 3):
            mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
            tau = numpyro.sample("tau", dist.Gamma(2.0, 2.0))
        with numpyro.plate("n", y.shape[0]):
            z = numpyro.sample("z", dist.Categorical(w))
            numpyro.sample("y", dist.Normal(mu[z], 1 / jnp.sqrt(tau[z])), obs=y)

    def logistic(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("n", X.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    return normal_mean, mixture, logistic


def _normal_mean_data(rng, n: int, d: int) -> tuple:
    return (2.0 + rng.normal(size=n),)


def _mixture_data(rng, n: int, d: int) -> tuple:
    z = rng.choice(3, size=n, p=[0.2, 0.3, 0.5])
    return (np.array([-5.0, 0.0, 6.0])[z] + 0.7 * rng.normal(size=n),)


def _logistic_data(rng, n: int, d: int) -> tuple:
    X = rng.normal(size=(n, d)) / np.sqrt(d)
    w = rng.normal(size=d)
    return X, (rng.random(n) < 1 / (1 + np.exp(-X @ w))).astype(float)


_DATA = {"normal_mean": _normal_mean_data, "mixture": _mixture_data, "logistic": _logistic_data}


def _data(model_name: str, n: int, d: int, seed: int = 0) -> tuple:
    return _DATA[model_name](np.random.default_rng(seed), n, d)


def _global_size(result, n: int) -> int:
    """Floats in the natural parameters of the fit's global blocks (those with no axis of the
    plate's size ``n``)."""
    import jax

    total = 0
    for nat in result.nat.values():
        leaves = jax.tree.leaves(nat)
        if not any(n in np.shape(x) for x in leaves):
            total += sum(int(np.size(x)) for x in leaves)
    return total


def _collective_rows(log) -> list:
    from jax import random

    from blrppl import blr_fit
    from blrppl.engine import cache

    normal_mean, mixture, logistic = _models()
    cases = [("normal_mean", normal_mean, n, 1, None) for n in (10_000, 1_000_003)]
    cases += [("mixture", mixture, n, 1, schedule) for schedule in (None, "parallel") for n in (10_000, 100_003)]
    cases += [("logistic", logistic, n, 4, None) for n in (10_000, 100_000, 1_000_003)]
    cases += [("logistic", logistic, 10_000, d, None) for d in (2, 16, 64)]
    rows = []
    for model_name, model, n, d, schedule in cases:
        cache.clear()
        result = blr_fit(model, _data(model_name, n, d), rng_key=random.PRNGKey(0), progress_bar=False, mesh=DEVICES,
                         refine=False, schedule=schedule, num_steps=200)
        texts = [c.as_text() for b in cache._CACHE.values() for s in b.sharded.values() for c in s._compiled.values()]
        found = [collectives(t) for t in texts]
        row = {
            "model": model_name, "N": n, "D": d, "global_floats": _global_size(result, n),
            "schedule": schedule or "sequential (default)",
            "per_step": [max(f["per_step"][0] for f in found), max(f["per_step"][1] for f in found)],
            "conditional": max(f["conditional"] for f in found),
            "per_chunk": [max(f["per_chunk"][0] for f in found), max(f["per_chunk"][1] for f in found)],
            "kinds": sorted({k for f in found for k in f["kinds"]}),
        }
        log(json.dumps(row))
        rows.append(row)
    return rows


def _step_rows(n: int, d: int, log) -> list:
    import jax
    from jax import random

    from blrppl import blr_fit

    _, _, logistic = _models()
    data = _data("logistic", n, d)
    rows = []
    for devices in (None, 1, 2, 4, 8):
        mesh = None if devices is None else jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("data",))

        def fit(steps, mesh=mesh):
            t0 = time.perf_counter()
            r = blr_fit(logistic, data, rng_key=random.PRNGKey(0), progress_bar=False, mesh=mesh, refine=False,
                        num_steps=steps, tol=1e-30)
            jax.block_until_ready(r.nat)
            return time.perf_counter() - t0, r

        first, r = fit(10)
        short = min(fit(10)[0] for _ in range(3))
        long = min(fit(40)[0] for _ in range(3))
        row = {"devices": devices or 0, "first_fit_s": first, "step_ms": 1e3 * (long - short) / 30,
               "refit_10_s": short, "converged_elbo": float(np.asarray(r.elbo)[-1])}
        log(json.dumps(row))
        rows.append(row)
    return rows


def worker(n_step: int, d_step: int) -> dict:
    """What the new process runs (8 host devices, float64): both tables' rows."""
    import jax

    assert jax.device_count() >= DEVICES, "the worker needs --xla_force_host_platform_device_count=8"
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    return {"collectives": _collective_rows(log), "steps": _step_rows(n_step, d_step, log), "N": n_step, "D": d_step}


# ---------------------------------------------------------------------- the report


def markdown(out: dict) -> str:
    lines = [
        "# Device-mesh bench (`python -m blrppl.bench.sharding`)",
        "",
        f"Collectives of each compiled chunk over {DEVICES} forced host devices (float64): those in the loop's "
        "body run every step, the others once a chunk of steps. What the figures show: docs/scaling.md.",
        "",
        "| model | schedule | N | D | global natural parameters (floats) | all-reduces per step (in a branch) | "
        "bytes per step | collectives per chunk | bytes per chunk | kinds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out["collectives"]:
        lines.append(
            f"| {r['model']} | {r['schedule']} | {r['N']:,} | {r['D']} | {r['global_floats']} | "
            f"{r['per_step'][0]} ({r['conditional']}) | {r['per_step'][1]:,} | "
            f"{r['per_chunk'][0]} | {r['per_chunk'][1]:,} | {', '.join(r['kinds'])} |"
        )
    lines += [
        "",
        f"Logistic regression, N = {out['N']:,}, D = {out['D']}: marginal cost of a step (fastest of three) "
        f"on {DEVICES} host devices sharing this machine's cores.",
        "",
        "| devices | first fit s (10 steps, compilation included) | ms per step |",
        "|---|---|---|",
    ]
    for r in out["steps"]:
        name = "1 (no mesh)" if r["devices"] == 0 else str(r["devices"])
        lines.append(f"| {name} | {r['first_fit_s']:.2f} | {r['step_ms']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m blrppl.bench.sharding", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write sharding-bench.md to this folder")
    p.add_argument("--rows", type=int, default=1_000_000, help="N of the step-time fits")
    p.add_argument("--dim", type=int, default=10, help="D of the step-time fits")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print("RESULT" + json.dumps(worker(args.rows, args.dim)))
        return 0
    flags = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}").strip()
    env = dict(os.environ, XLA_FLAGS=flags, JAX_ENABLE_X64="1")
    cmd = [sys.executable, "-m", "blrppl.bench.sharding", "--worker", "--rows", str(args.rows), "--dim", str(args.dim)]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        print(f"the worker failed ({proc.returncode})", file=sys.stderr)
        return proc.returncode
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))[len("RESULT"):])
    text = markdown(out)
    print(text)
    if args.out:
        folder = pathlib.Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "sharding-bench.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
