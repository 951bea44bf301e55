"""``python -m blrppl.bench``: BLR vs numpyro SVI vs NUTS on the benchmark models.

Examples::

    python -m blrppl.bench                        # everything; writes ./bench-out/benchmarks.md + plots
    python -m blrppl.bench --out docs             # what make bench runs: the committed report
    python -m blrppl.bench --quick --out /tmp/b   # a quick subset with short runs
    python -m blrppl.bench --model eight_schools --out /tmp/b
    python -m blrppl.bench --scaling-only --out /tmp/b
    python -m blrppl.bench --deep --out /tmp/b    # Bayesian deep learning (blrppl.bench.deep)
    python -m blrppl.bench --mixtures --out /tmp/b  # Gaussian mixtures on a small BNN (blrppl.bench.mixtures)

Reference posteriors of models without a shipped one are long NUTS runs cached under
``$BLRPPL_CACHE`` (default ``~/.cache/blrppl/bench``), keyed by the model's name and source
code, the data, and the versions of blrppl and numpyro.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import numpyro

QUICK_MODELS = ("beta_bernoulli", "linear_regression", "logistic_breast_cancer", "kidiq-kidscore_interaction")


def all_models() -> list:
    from blrppl.bench import models, posteriordb

    return posteriordb.names() + models.names()


def _clear_compiled():
    import gc

    import jax

    from blrppl.engine import cache

    cache.clear()
    jax.clear_caches()
    gc.collect()


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m blrppl.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", help="run only this model (repeatable); see --list")
    p.add_argument("--list", action="store_true", help="list the models and exit")
    p.add_argument("--quick", action="store_true", help=f"a quick subset {QUICK_MODELS}, short runs, no scaling")
    p.add_argument("--out", default="bench-out", help="output directory (default ./bench-out; "
                   "make bench writes the report to docs/)")
    p.add_argument("--methods", default="blr,svi_normal,svi_mvn,nuts", help="comma-separated subset")
    p.add_argument("--blr-steps", type=int, default=None, help="BLR's num_steps (default: blr_fit's)")
    p.add_argument("--svi-steps", type=int, default=None, help="SVI steps (default 10000; --quick 2000)")
    p.add_argument("--nuts-warmup", type=int, default=None, help="NUTS warm-up (default 1000; --quick 500)")
    p.add_argument("--nuts-samples", type=int, default=None, help="NUTS draws (default 1000; --quick 500)")
    p.add_argument("--no-reference", action="store_true",
                   help="judge against this run's NUTS instead of the long cached reference run")
    p.add_argument("--scaling", dest="scaling", action="store_true", default=None,
                   help="run the logistic-regression scaling study (default: on for the full run)")
    p.add_argument("--no-scaling", dest="scaling", action="store_false")
    p.add_argument("--scaling-only", action="store_true", help="only the scaling study")
    p.add_argument("--scaling-max", type=int, default=1_000_000, help="largest N of the scaling study")
    p.add_argument("--site-sizes", default="10,100,1000",
                   help="per-step site counts of the AR(2) compile-time study (comma-separated)")
    p.add_argument("--compile-sizes", action="store_true",
                   help="only the compiled step's size (jaxpr equations, HLO ops) and the compile time of the AR(2) "
                   "loop at 100/1,000/10,000 sites, the baseball model, the Lorenz bridges and every bench model, each in a "
                   "fresh process "
                   "(blrppl.bench.compile_sizes); the table goes to <out>/compile_sizes.md")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--float32", action="store_true", help="run in float32 (default float64)")
    p.add_argument("--deep", action="store_true",
                   help="only the Bayesian deep-learning bench (blrppl.bench.deep: digits MLP, in-between sd)")
    p.add_argument("--mixtures", action="store_true",
                   help="only the Gaussian mixtures' bench (blrppl.bench.mixtures: a two-unit BNN, K = 1, 4, 8, NUTS)")
    return p.parse_args(argv)


def _fresh_compilation_cache() -> str | None:
    """A new, empty persistent compilation cache and program store for this run (first fits
    compile for real), unless they are off; removed when the process exits."""
    import atexit
    import os
    import shutil
    import tempfile

    import blrppl
    from blrppl.runtime.cache import DIR_ENV, turned_off

    if turned_off():
        return None
    root = pathlib.Path(tempfile.mkdtemp(prefix="blrppl-bench-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    os.environ[DIR_ENV] = str(root / "blrppl")  # (the program store: blrppl/programs)
    return blrppl.enable_compilation_cache(root / "blrppl" / "jax")


def main(argv=None) -> int:
    args = parse(argv)
    if args.deep:
        from blrppl.bench import deep

        deep.main(["--out", args.out])
        return 0
    if args.mixtures:
        from blrppl.bench import mixtures

        return mixtures.main(["--out", args.out] + (["--float32"] if args.float32 else []))
    if not args.float32:
        numpyro.enable_x64()
    if args.compile_sizes:
        from blrppl.bench import compile_sizes

        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        compile_sizes.main(out / "compile_sizes.md", args.model)
        return 0
    _fresh_compilation_cache()
    from blrppl.bench import models, report, runner

    if args.list:
        print("\n".join(all_models()))
        return 0
    partial = bool(args.quick or args.model)
    out = pathlib.Path(args.out)
    names = args.model or (list(QUICK_MODELS) if args.quick else all_models())
    names = [] if args.scaling_only else names
    unknown = [n for n in names if n not in all_models()]
    if unknown:
        print(f"unknown model(s) {unknown}; known: {all_models()}", file=sys.stderr)
        return 2
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    bad = [m for m in methods if m not in runner.METHODS]
    if bad:
        print(f"unknown method(s) {bad}; known: {runner.METHODS}", file=sys.stderr)
        return 2
    svi_steps = args.svi_steps or (2000 if args.quick else runner.SVI_STEPS)
    warmup = args.nuts_warmup or (500 if args.quick else runner.NUTS_WARMUP)
    samples = args.nuts_samples or (500 if args.quick else runner.NUTS_SAMPLES)
    do_scaling = args.scaling_only or (args.scaling if args.scaling is not None else not partial)

    t0 = time.perf_counter()
    print(f"blrppl benchmark: {len(names)} model(s), methods {','.join(methods)}, output {out}", flush=True)
    runs = []
    for name in names:
        print(f"{name}:", flush=True)
        bm = models.load(name)
        runs.append(
            runner.run_model(
                bm, methods, args.blr_steps, svi_steps, warmup, samples,
                use_reference=not args.no_reference, log=lambda s: print(s, flush=True),
            )
        )
        # free the compiled executables of this model (the process would otherwise hold
        # hundreds of them; LLVM then runs out of memory for new ones)
        _clear_compiled()
        acc = runs[-1].accuracy
        print("  max |mean err| / ref sd: " + ", ".join(
            f"{m} {a['max_mean_err_sd']:.3g}" for m, a in acc.items()), flush=True)
    rows, dense, sites, hand, chains, hmms, pcas, gmms, funnels, zoos = [], [], [], [], [], [], [], [], [], []
    plate_free = []
    if do_scaling:
        print("scaling (BLR, logistic regression, D=10):", flush=True)
        sizes = [n for n in (1_000, 10_000, 100_000, 1_000_000) if n <= args.scaling_max]
        rows = runner.scaling(sizes, log=lambda s: print(s, flush=True))
        _clear_compiled()
        print("dense regression (BLR vs a hand-written solve):", flush=True)
        dense = [runner.dense_regression(log=lambda s: print(s, flush=True))]
        _clear_compiled()
        print("compile time per site (AR(2) with one site per step, fresh processes):", flush=True)
        sizes = [int(x) for x in args.site_sizes.split(",") if x.strip()]
        sites = runner.site_scaling(sizes, log=lambda s: print(s, flush=True))
        print("latent matrices without plates (PCA with and without plates, fresh processes):", flush=True)
        plate_free = runner.plate_free_pca(log=lambda s: print(s, flush=True))
        print("a hand-written BLR loop against blr_fit (logistic regression, fresh processes):", flush=True)
        # (N = 200: the size of the small bench models, where compilation is most of any fit)
        hand = [runner.hand_logistic_comparison(n, log=lambda s: print(s, flush=True)) for n in (200, 5_000)]
        print("long chains (a Poisson random walk against a hand-written banded solve):", flush=True)
        chains = runner.chain_scaling(log=lambda s: print(s, flush=True))
        _clear_compiled()
        print("hidden Markov chains (K = 5, against a hand-written forward-backward):", flush=True)
        hmms = runner.hmm_scaling(log=lambda s: print(s, flush=True))
        _clear_compiled()
        print("scales of many latents (blr_fit against a full-rank Gaussian and NUTS):", flush=True)
        funnels = runner.scale_funnel(log=lambda s: print(s, flush=True))
        _clear_compiled()
        print("probabilistic PCA (BayesPy's timing problems, side by side when bayespy is installed):", flush=True)
        pcas = runner.vmp_pca(log=lambda s: print(s, flush=True))
        _clear_compiled()
        print("Gaussian mixture with Wishart precisions (BayesPy's timing problems):", flush=True)
        gmms = runner.vmp_gmm(log=lambda s: print(s, flush=True))
        _clear_compiled()
        print("factor analysis, masked matrix factorisation, ARD regression (side by side with BayesPy):", flush=True)
        zoos = runner.vmp_zoo(log=lambda s: print(s, flush=True))
        _clear_compiled()
    out.mkdir(parents=True, exist_ok=True)
    plots = {} if args.no_plots else report.plots(runs, rows, out / "benchmarks", doc_dir=out)
    settings = {
        "dtype": "float32" if args.float32 else "float64",
        "SVI": f"Adam(step_size={runner.SVI_LR}), {svi_steps} steps, 1 particle (numpyro's SVI docstring "
        "example runs 2000 steps of Adam(0.0005); more steps at a larger step size give SVI more room to "
        "converge)",
        "NUTS": f"1 chain, {warmup} warm-up, {samples} draws",
        "reference": "shipped/exact where available, else "
        + ("this run's NUTS" if args.no_reference else
           f"NUTS {runner.REF_CHAINS} chains × ({runner.REF_WARMUP} + {runner.REF_SAMPLES}) cached in {runner.cache_dir()}"),
    }
    text = report.markdown(runs, rows, settings, plots, dense, sites, hand, chains, hmms, pcas, gmms, funnels, zoos,
                           plate_free_rows=plate_free)
    path = out / "benchmarks.md"
    path.write_text(text)
    print(f"wrote {path} ({time.perf_counter() - t0:.0f} s in all)", flush=True)
    for line in report._shortfalls(runs):
        print("shortfall: " + line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
