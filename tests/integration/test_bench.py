"""The benchmark suite: its metrics, its models, and its CLI on one tiny model.

The full benchmark is not run here (``make bench``); these tests check that the pieces work:
the accuracy metrics on hand-made inputs (exact arithmetic), every bench model tracing with its
data and the kinds not fitted elsewhere fitting with ``blr_fit`` for a few steps (finite ELBO,
draws of every latent), and the CLI writing a report
with the expected columns.
"""

from __future__ import annotations

import functools
import math
import os

import numpy as np
import pytest
from jax import random

from blrppl.api import blr_fit
from blrppl.bench import __main__ as cli
from blrppl.bench import models, report, runner
from blrppl.model.trace import trace_model
from checks import assert_every_site_exports


# ------------------------------------------------------------------------ metrics


def test_accuracy_on_hand_made_inputs():
    reference = {"a": (1.0, 0.5), "b": (0.2, 2.0), "c": (-3.0, 1.0)}
    estimate = {"a": (1.05, 2.0), "b": (0.0, 1.0), "c": (-3.0, 1.0), "unused": (9.0, 9.0)}
    acc = runner.accuracy(estimate, reference)
    # |1.05 − 1| / 0.5 = 0.1, |0 − 0.2| / 2 = 0.1, 0 → max 0.1; sd ratios 4, 0.5, 1
    assert acc["max_mean_err_sd"] == pytest.approx(0.1)
    assert acc["sd_ratio_min"] == pytest.approx(0.5)
    assert acc["sd_ratio_max"] == pytest.approx(4.0)


def test_accuracy_worst_parameter_dominates_and_missing_is_nan():
    reference = {"a": (0.0, 1.0), "b": (10.0, 0.1)}
    acc = runner.accuracy({"a": (0.05, 1.0), "b": (10.3, 0.1)}, reference)
    assert acc["max_mean_err_sd"] == pytest.approx(3.0)  # |10.3 − 10| / 0.1
    assert acc["sd_ratio_min"] == pytest.approx(1.0) and acc["sd_ratio_max"] == pytest.approx(1.0)
    missing = runner.accuracy({"a": (0.0, 1.0)}, reference)
    assert math.isnan(missing["max_mean_err_sd"]) and math.isnan(missing["sd_ratio_max"])
    assert math.isnan(runner.accuracy({"a": (0.0, 1.0)}, {})["max_mean_err_sd"])


def test_accuracy_leaves_out_what_the_reference_holds_fixed():
    """An LKJ Cholesky factor's [0, 0] element is 1 in every draw (sd 0): it is no measure of
    accuracy, and dividing by its sd would fail."""
    reference = {"L[1,1]": (1.0, 0.0), "L[2,1]": (0.3, 0.2)}
    acc = runner.accuracy({"L[1,1]": (1.0, 0.0), "L[2,1]": (0.4, 0.1)}, reference)
    assert acc["max_mean_err_sd"] == pytest.approx(0.5) and acc["sd_ratio_max"] == pytest.approx(0.5)


def _run(err, blr_total, nuts_total):
    blr = runner.MethodResult("blr", compile_time=blr_total / 2, run_time=blr_total / 2)
    nuts = runner.MethodResult("nuts", compile_time=1.0, run_time=nuts_total - 1.0)
    bm = models.BenchModel("m", None, {}, note="why")
    acc = {"blr": {"max_mean_err_sd": err, "sd_ratio_min": 1.0, "sd_ratio_max": 1.0}}
    return runner.ModelRun("m", bm, {}, "exact", {"blr": blr, "nuts": nuts}, acc)


@pytest.mark.parametrize(
    "err, blr_total, nuts_total, expected",
    [
        (0.05, 1.0, 20.0, (True, True)),
        (0.1, 1.0, 10.0, (True, False)),  # the time limit is strict: 1.0 is not < 0.1 × 10
        (0.11, 0.5, 10.0, (False, True)),
        (float("nan"), 0.5, 10.0, (None, True)),
    ],
)
def test_verdict_flags(err, blr_total, nuts_total, expected):
    assert report.verdict(_run(err, blr_total, nuts_total)) == expected


def test_shortfalls_name_the_model_and_reason():
    lines = report._shortfalls([_run(0.5, 5.0, 10.0)])
    assert len(lines) == 2
    assert lines[0].startswith("m: BLR means off by up to 0.5") and lines[0].endswith("why.")
    assert lines[1].startswith("m: BLR total 5 s vs NUTS 10 s")
    # compile times 2.5 s (BLR) and 1 s (NUTS); 2.5 > 0.1 × 10; no refit time measured
    assert "compilation is 2.5 s of BLR's and 1 s of NUTS's (BLR's compilation alone" in lines[1]
    assert "refits" not in lines[1]
    run = _run(0.05, 5.0, 30.0)
    run.results["blr"].refit_time = 0.25
    (line,) = report._shortfalls([run])
    assert "over 0.1" not in line and line.endswith("without compilation BLR refits in 0.25 s, NUTS runs 29 s.")


def test_summary_shows_a_refits_step_cost_and_fixed_cost():
    run = _run(0.05, 2.0, 8.0)
    run.accuracy["nuts"] = {"max_mean_err_sd": 0.0, "sd_ratio_min": 1.0, "sd_ratio_max": 1.0}
    run.results["blr"].refit_time = 0.25
    # (a refit of 0.25 s whose 20 steps cost 10 ms each: 50 ms fixed)
    run.results["blr"].step_time, run.results["blr"].refit_fixed = 0.01, 0.25 - 20 * 0.01
    text = report.markdown([run])
    assert "| BLR refit s | BLR step ms | BLR refit fixed ms | NUTS run s |" in text
    assert "| 0.25 | 10 | 50 | 7 |" in text
    # (not measured: dashes)
    run.results["blr"].step_time = run.results["blr"].refit_fixed = float("nan")
    assert "| 0.25 | – | – | 7 |" in report.markdown([run])


def test_step_cost_is_the_marginal_run_time_of_a_step(monkeypatch):
    # each run's loop: 3 ms of dispatch and 2 ms per step, plus noise the fastest of three removes
    calls = []

    class Fit:
        def __init__(self, n, noise):
            self.num_steps, self.run_time = n, 0.003 + 0.002 * n + noise

    def fake_fit(model, data, progress_bar, num_steps, tol, refine, **kw):
        calls.append((num_steps, tol, refine))
        return Fit(num_steps, 0.001 * (len(calls) % 3))

    monkeypatch.setattr(runner, "blr_fit", fake_fit)
    assert runner.step_cost(None, {}, {}) == pytest.approx(0.002)
    assert {c[0] for c in calls} == {1, runner.MARGINAL_STEPS}
    assert all(tol == 1e-30 and refine is False for _, tol, refine in calls)


def test_report_sections_for_first_fits_sites_and_the_hand_written_loop():
    run = _run(0.05, 2.0, 8.0)
    run.accuracy["nuts"] = {"max_mean_err_sd": 0.0, "sd_ratio_min": 1.0, "sd_ratio_max": 1.0}
    run.results["blr"].fresh_process = {
        "total": 2.0, "compile": 1.5, "model_runs": 2, "xla_compilations": 2, "background_compilations": 2
    }
    run.results["blr"].second_process = {"compile": 0.25, "total": 0.5}
    sites = [
        {"sites": 10, "compile": 2.0, "total": 2.5, "steps": 12, "model_runs": 2, "xla_compilations": 5},
        {"sites": 100, "compile": 3.8, "total": 4.5, "steps": 12, "model_runs": 2, "xla_compilations": 30},
    ]
    hand = [{"N": 5000, "blr_total": 3.0, "blr_compile": 2.0, "blr_steps": 8, "hand_total": 2.0, "hand_steps": 8,
             "ratio": 1.5, "max_mean_diff_sd": 1e-5, "max_sd_rel_diff": 2e-5, "nuts_total": 8.0}]
    text = report.markdown([run], site_rows=sites, hand_rows=hand)
    # first fit 2 s against NUTS's 8 s: ratio 0.25
    # (2 compilations waited for, 2 more in the background)
    assert "| m | 2 | 1.5 | 8 | 0.25 | 2 | 2 (+2) | 0.25 / 0.5 |" in text
    # 2 s over 10 sites: 200 ms per site; then 1.8 s more for 90 more sites: 20 ms per added site
    assert "| 10 | 2 | 200 | - | 2.5 | 12 | 2 | 5 |" in text
    assert "| 100 | 3.8 | 38 | 20 | 4.5 | 12 | 2 | 30 |" in text
    # the hand-written loop takes 2 / 8 of NUTS's time, blr_fit 3 / 8
    assert "| 5,000 | 3 | 2 | 8 | 2 | 8 | 1.50 | 1e-05 | 2e-05 | 8 | 0.25 | 0.38 |" in text
    run.results["blr"].fresh_process = {}
    assert "First fit in a fresh process" not in report.markdown([run])


def test_refinement_section_puts_the_first_and_the_kept_fit_beside_nuts():
    """A model whose refinement ran: the first fit alone, the kept candidate (what it changed),
    their errors, sd ratios, k̂ and seconds, and NUTS's; a model without refinement has no row,
    and no model with one: no section."""
    run = _run(0.05, 2.0, 8.0)
    run.accuracy["nuts"] = {"max_mean_err_sd": 0.02, "sd_ratio_min": 0.98, "sd_ratio_max": 1.01}
    assert "Refinement by default" not in report.markdown([run])
    blr = run.results["blr"]
    blr.khat = 0.55
    blr.refinements = [("as asked", 0.95, -50.0, 0.5, False, ""), ("families={'tau': 'grid'}", 0.55, -49.5, 1.5, True, "")]
    blr.first_fit = {
        "khat": 0.95, "time": 0.5,
        "accuracy": {"max_mean_err_sd": 0.4, "sd_ratio_min": 0.3, "sd_ratio_max": 1.1},
    }
    text = report.markdown([run])
    assert "## Refinement by default" in text
    assert "| m | 0.4 | 0.3–1.1 | 0.95 | 0.5 | families={'tau': 'grid'} | 0.05 |" in text
    assert "| 0.55 | 2 | 0.02 | 8 | 1 |" in text


def test_pca_section_puts_blrppl_and_bayespy_side_by_side():
    to_test = {"wall": 2.5, "steps": 31, "elbo": -93.0}
    blr = {"per_step": 0.02, "elbo": -100.0, "full_wall": 3.0, "full_steps": 40, "full_elbo": -90.0, "to_test": to_test}
    bayespy = {"per_iter": 0.004, "elbo": -120.0, "full_wall": 0.5, "full_steps": 30, "full_elbo": -95.0}
    rows = [
        {"M": 20, "N": 500, "D": 10, "steps": 10, "blr": blr, "bayespy": bayespy, "floor": {"wall": 0.35, "sweeps": 30},
         "numpyro_read": 0.42},
        {"M": 100, "N": 2000, "D": 40, "steps": 10, "blr": None, "bayespy": None},
    ]
    text = report.markdown([], pca_rows=rows)
    # 20 ms against 4 ms per iteration: 5× slower; to BayesPy's test 2.5 s (31 steps) against
    # BayesPy's 0.5 s (30 iterations), then blrppl's own test 3.0 s (40 steps)
    assert ("| 20 | 500 | 10 | 20.0 | 4.0 | 5.00× | -100.0 | -120.0 | 2.5 (31) | 0.5 (30) | -93.0 | -95.0 | 3.0 (40) "
            "| -90.0 | 0.35 (30) | 0.42 |") in text
    assert "| 100 | 2,000 | 40 | not run (work per step) | – | – | – | – | – | – | – | – | – | – | – | – |" in text
    gmm = [{"K": 10, "N": 200, "D": 2, "steps": 10, "blr": {**blr, "per_step": 0.001, "to_test": {}}, "bayespy": None}]
    text = report.markdown([], gmm_rows=gmm)
    assert "Wishart precisions side by side with BayesPy" in text
    assert "| 10 | 200 | 2 | 1.0 | – | – | -100.0 | – | – | – | – | – | 3.0 (40) | -90.0 | – | – |" in text
    zoo = [
        {"problem": "bmf", "spec": (20, 500, 10, 0.3), "steps": 10, "blr": {**blr, "to_test": to_test}, "bayespy": bayespy,
         "numpyro_read": 0.1},
        {"problem": "ard", "spec": (100_000, 100), "steps": 10, "blr": {"per_step": 0.001, "elbo": -5.0, "to_test": to_test},
         "bayespy": None, "numpyro_read": None},
    ]
    text = report.markdown([], zoo_rows=zoo)
    # (no columns of blrppl's own test in the zoo's table)
    assert ("| matrix factorisation, entries missing | 20 × 500, D = 10, 30 % missing | 20.0 | 4.0 | 5.00× | -100.0 "
            "| -120.0 | 2.5 (31) | 0.5 (30) | -93.0 | -95.0 | 0.10 |") in text
    assert "| ARD linear regression | 100,000 × 100 | 1.0 | – | – | -5.0 | – | 2.5 (31) | – | -93.0 | – | – |" in text


@pytest.mark.parametrize(
    "bounds, steps",
    [
        # BayesPy stops at the first iteration whose bound rose by less than 10⁻⁵ relative to
        # the mean magnitude of it and the one before: here the fourth (a rise of 10⁻³ over 100)
        ([-200.0, -120.0, -100.1, -100.099], 4),
        ([-200.0, -120.0, -100.0, -100.0, -90.0], 4),  # an unchanged bound stops it
        ([-200.0, -120.0, -121.0], 3),  # so does a fall
        ([-200.0, -120.0, -100.0], None),  # still rising by more
        ([-200.0], None),  # one bound: no test yet
        ([-1e6, -1e6 + 9.0, -1e6 + 18.0], 2),  # 9 in 10⁶ is below 10⁻⁵
        ([-200.0, float("nan")], 2),
    ],
)
def test_bayespy_stop_is_bayespys_convergence_test(bounds, steps):
    assert runner.bayespy_stop(bounds) == steps


def test_zoo_problems_are_the_models_written_as_users_write_them():
    """Each side-by-side problem is a NumPyro model with its data (the bench's new processes
    build them from their names) whose log density NumPyro finds a finite start for, and the
    masked factorisation's data miss about the fraction asked."""
    from numpyro.infer.util import initialize_model

    for problem, spec in (("fa", (5, 30, 2)), ("bmf", (5, 30, 2, 0.3)), ("ard", (40, 3)), ("pca", (5, 30, 2))):
        model, data = runner.vmp_problem(problem, spec)
        info = initialize_model(random.PRNGKey(0), model, model_kwargs=data)[0]
        assert np.isfinite(float(info.potential_energy)), problem
    missing = np.isnan(runner.bmf_data(50, 400, 4, 0.3))
    assert abs(missing.mean() - 0.3) < 0.02  # (20,000 entries: sd 0.003)
    with pytest.raises(ValueError, match="unknown VMP problem"):
        runner.vmp_problem("lda", ())


def test_hmm_section_and_its_two_hand_written_passes():
    """The HMM rows' references: the scaled forward–backward equals the log-space one (the
    ratio's reference) on a small random chain, and the report puts both beside the step."""
    import jax.numpy as jnp

    rng = np.random.default_rng(3)
    log_trans = jnp.asarray(np.log(rng.dirichlet(np.ones(4), size=4)))
    log_lik = jnp.asarray(3.0 * rng.normal(size=(30, 4)))
    log_init = jnp.asarray(np.full(4, -np.log(4)))
    log_space = np.asarray(runner._forward_backward_pass(log_init, log_trans, log_lik))
    scaled = np.asarray(runner._scaled_forward_backward_pass(log_init, log_trans, log_lik))
    np.testing.assert_allclose(scaled, log_space, atol=1e-5)
    row = {"T": 1000, "first_fit": 5.6, "compile_time": 5.4, "run_time": 0.021, "steps": 15, "per_step": 0.9e-3,
           "forward_backward": 0.45e-3, "ratio": 2.0, "scaled_pass": 0.1e-3, "decoded": 1.0, "state_floats": 30010}
    assert "| 1,000 | 5.6 | 5.4 | 0.021 | 15 | 0.90 | 0.45 | 2.0 | 0.10 | 1.000 | 30,010 |" in report.markdown([], hmm_rows=[row])


def test_hand_written_floors_fit_the_vmp_problems():
    """The bench's hand-written JAX fits (the floor under a compiled fit's wall time) run and
    do what they say: the mixture's responsibilities sort two well-separated clusters (from random responsibilities
    both components start at the grand mean: some 40 sweeps break the symmetry), the
    PCA's noise precision E[τ] comes near the data's (unit noise: about 1); and the time any
    NumPyro inference pays before its first step (the model's log density compiled) is taken."""
    from blrppl.bench import runner

    rng = np.random.default_rng(0)
    X = np.concatenate([rng.normal(size=(40, 2)) - 6.0, rng.normal(size=(40, 2)) + 6.0])
    wall, resp = runner._jax_floor_gmm(X, 2, 60)
    labels = np.argmax(np.asarray(resp), axis=1)
    assert wall > 0 and len(set(labels[:40])) == 1 and len(set(labels[40:])) == 1 and labels[0] != labels[-1]
    wall, (C, _, _, tau) = runner._jax_floor_pca(runner.pca_data(8, 300, 4), 4, 50)
    assert wall > 0 and np.all(np.isfinite(np.asarray(C))) and 0.7 < float(tau) < 1.4
    # (what any NumPyro inference pays first: the model's log density compiled; a model
    # whose density it cannot evaluate would raise here)
    assert runner._numpyro_read(runner.gmm_model, {"X": X, "num_components": 2}) > 0


def test_hand_written_blr_loop_reaches_the_variational_fixed_point():
    """At the fixed point of the Gaussian VI of logistic regression, ∇_m ELBO = Xᵀ E[y − σ(η)]
    − m/σ₀² = 0 and S⁻¹ = I/σ₀² + Xᵀ diag(E[σ'(η)]) X, with η_n ~ N(x_nᵀm, x_nᵀSx_n) (the
    expectations by Gauss–Hermite with 40 nodes, here and in the loop)."""
    rng = np.random.default_rng(0)
    X = np.column_stack([np.ones(200), rng.normal(size=(200, 2))])
    y = (rng.uniform(size=200) < 1 / (1 + np.exp(-X @ np.array([0.5, -1.0, 2.0])))).astype(float)
    mean, sd, steps = runner.hand_blr_logistic(X, y, prior_sd=2.5, tol=1e-12, nodes=40)
    assert 1 < steps < 1000
    # rebuild S from the fixed-point condition (independent of the loop's own state)
    nodes, weights = np.polynomial.hermite_e.hermegauss(40)
    weights = weights / np.sqrt(2 * np.pi)
    prec = np.eye(3) / 2.5**2
    for _ in range(50):  # S appears on both sides: iterate the condition to its fixed point
        cov = np.linalg.inv(prec)
        eta = (X @ mean)[:, None] + np.sqrt(np.einsum("ni,ij,nj->n", X, cov, X))[:, None] * nodes
        p = 1 / (1 + np.exp(-eta))
        prec = np.eye(3) / 2.5**2 + X.T @ (((p * (1 - p)) @ weights)[:, None] * X)
    grad = X.T @ ((y[:, None] - p) @ weights) - mean / 2.5**2
    np.testing.assert_allclose(grad, 0.0, atol=1e-6)
    np.testing.assert_allclose(sd, np.sqrt(np.diag(np.linalg.inv(prec))), rtol=1e-6)


# ------------------------------------------------------------------------- models


def test_reference_cache_key_depends_on_data(monkeypatch, tmp_path):
    monkeypatch.setenv("BLRPPL_CACHE", str(tmp_path))
    assert runner.cache_dir() == tmp_path
    a = models.load("linear_regression")
    b = models.load("linear_regression")
    assert runner.data_hash(a) == runner.data_hash(b)  # deterministic data
    b.data = {**b.data, "y": b.data["y"] + 1e-9}
    assert runner.data_hash(a) != runner.data_hash(b)
    # the model's code is part of the key (an edited model gets a new reference run)
    c = models.load("linear_regression")

    def edited(*args, **kwargs):
        return a.model(*args, **kwargs)

    c.model = edited
    assert runner.data_hash(a) != runner.data_hash(c)


def test_default_output_is_bench_out(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.parse([]).out == "bench-out"


def test_exact_references():
    bb = models.load("beta_bernoulli")
    y = bb.data["y"]
    a, b = 2.0 + y.sum(), 2.0 + len(y) - y.sum()
    assert bb.reference["p"][0] == pytest.approx(a / (a + b))
    ng = models.load("normal_gamma")
    # μ's marginal is Student-t centred at the conjugate posterior mean
    n, ybar = len(ng.data["y"]), ng.data["y"].mean()
    assert ng.reference["mu"][0] == pytest.approx(n * ybar / (models.NG_K0 + n))


def test_sort_components_relabels_jointly():
    draws = {"mu": np.array([[3.0, -1.0, 0.0]]), "w": np.array([[0.5, 0.2, 0.3]]), "z": np.zeros((1, 4))}
    out = models._sort_components(draws)
    np.testing.assert_array_equal(out["mu"], [[-1.0, 0.0, 3.0]])
    np.testing.assert_array_equal(out["w"], [[0.2, 0.3, 0.5]])
    assert "z" not in out


def test_breast_cancer_without_scikit_learn_names_the_extra(monkeypatch):
    import sys

    from blrppl.errors import MissingDependencyError

    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # import fails
    with pytest.raises(MissingDependencyError, match=r"blrppl\[bench\]"):
        models.load("logistic_breast_cancer")


def test_breast_cancer_data_is_standardised():
    data = models.breast_cancer_data()
    X, y = data["X"], data["y"]
    assert X.shape == (569, 31) and set(np.unique(y)) == {0.0, 1.0}
    np.testing.assert_allclose(X[:, 0], 1.0)
    np.testing.assert_allclose(X[:, 1:].mean(0), 0.0, atol=1e-12)
    np.testing.assert_allclose(X[:, 1:].std(0), 1.0, rtol=1e-12)


#: bench models fitted here (a few steps); the others are the same kinds of model as the
#: fits tested elsewhere, and are only traced (compiling each costs several seconds)
FITTED = ("bnn", "random_intercepts", "logistic_breast_cancer")


@pytest.mark.parametrize("name", [n for n in models.names() if n not in FITTED])
def test_every_bench_model_traces(name):
    bm = models.load(name)
    args, kwargs = (bm.data, {}) if isinstance(bm.data, tuple) else ((), bm.data)
    records = trace_model(bm.model, args, kwargs, __import__("jax").random.key(0))[0]
    assert any(not r.observed for r in records.values())
    assert any(r.observed for r in records.values())


@pytest.mark.parametrize("name", FITTED)
def test_bench_models_fit_with_blr(name):
    bm = models.load(name)
    result = blr_fit(bm.model, bm.data, num_steps=3, progress_bar=False, **bm.blr_kwargs)
    assert np.all(np.isfinite(result.elbo))
    draws = result.sample(__import__("jax").random.key(0), 10)
    summary, _ = runner._summaries(bm, draws, bm.model)
    names = bm.params or list((bm.reference or summary))
    for k in names:
        assert k in summary and np.isfinite(summary[k][0]), k
    assert_every_site_exports(result, bm.model, bm.data)


# ---------------------------------------------------------------------------- CLI


def _close_jax_cache():
    try:
        from jax._src import compilation_cache
    except ImportError:  # pragma: no cover - a JAX without the module: nothing to close
        return
    compilation_cache.reset_cache()


def test_cli_writes_report_with_expected_columns(tmp_path, monkeypatch, request):
    # the CLI points the process at a fresh compilation cache of its own (removed at exit):
    # its directory and JAX's cache settings are put back after the test
    import jax

    if "BLRPPL_CACHE_DIR" in os.environ:  # (set again by the CLI: put back after the test)
        monkeypatch.setenv("BLRPPL_CACHE_DIR", os.environ["BLRPPL_CACHE_DIR"])
    else:
        monkeypatch.delenv("BLRPPL_CACHE_DIR", raising=False)
    for name in (
        "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs", "jax_persistent_cache_min_entry_size_bytes"
    ):
        request.addfinalizer(functools.partial(jax.config.update, name, jax.config.values[name]))
    # (JAX opens its persistent cache once per process and keeps it after the settings are
    # put back: closed here, or later tests of this worker would read their programs from it,
    # and the program store's tests would see no program to store)
    request.addfinalizer(_close_jax_cache)
    out = tmp_path / "out"
    rc = cli.main([
        "--model", "beta_bernoulli", "--out", str(out), "--blr-steps", "5", "--svi-steps", "20",
        "--nuts-warmup", "10", "--nuts-samples", "10", "--methods", "blr",
    ])
    assert rc == 0
    text = (out / "benchmarks.md").read_text()
    header = "| " + " | ".join(report.COLUMNS) + " |"
    assert header in text
    # (SVI and NUTS are left out: SVI's eager final ELBO and PSIS cost 17 s of op-by-op
    # compiles here, NUTS runs twice (compile timing, then the run) for 13 s; their rows are
    # formatted by the same code as BLR's, tested on constructed runs above)
    assert "| beta_bernoulli | blr |" in text
    assert "| beta_bernoulli | exact | yes |" in text  # summary row: the exact Beta reference
    assert "## Scaling" not in text  # a single-model run skips the scaling study
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "benchmarks" / "elbo_vs_time.png").stat().st_size > 0
    assert "](benchmarks/elbo_vs_time.png)" in text


def test_cli_rejects_unknown_model(tmp_path):
    assert cli.main(["--model", "nope", "--out", str(tmp_path)]) == 2


def test_marginal_plots_put_blr_beside_nuts(tmp_path):
    pytest.importorskip("matplotlib")
    run = _run(0.05, 1.0, 20.0)
    rng = np.random.default_rng(0)
    run.results["nuts"].draws = {"p": rng.normal(size=300), "q": rng.normal(size=300)}
    run.results["blr"].draws = {"p": rng.normal(size=300)}
    written = report.plots([run], [], tmp_path)
    assert (tmp_path / "marginals.png").stat().st_size > 0
    assert any(path.endswith("marginals.png") for path in written.values())


def test_funnel_section_and_its_problems():
    """The scale-funnel rows' data (the walk's middle fifth unseen and zeroed, the returns'
    scale near exp(−9/2)) and the report's row: each sd beside its ratio to NUTS's, a joint
    fit that did not converge marked."""
    walk = runner.walk_scales_data(50)
    assert walk["seen"].sum() == 40 and not walk["seen"][20:30].any() and np.all(walk["y"][20:30] == 0.0)
    returns = runner.volatility_data(2000)["y"]
    assert 0.3 < np.std(returns) / np.exp(-4.5) < 3.0
    row = {"problem": "walk", "scale": "s", "nuts": (0.295, 0.0287), "blr": (0.2935, 0.0086), "joint": (0.156, 0.0004),
           "joint_converged": False, "full_rank": (0.337, 0.0117), "latent_ratios": (0.93, 1.04),
           "grid": (0.2961, 0.0289), "grid_wall": 11.42, "grid_latent_ratios": (0.99, 1.01)}
    text = report.markdown([], funnel_rows=[row])
    assert ("| walk | s | 0.295 (0.0287) | 0.293 (0.0086) | 0.30 | 0.156 (0.0004) | 0.01 (not converged) | "
            "0.337 (0.0117) | 0.41 | 0.93–1.04 | 0.296 (0.0289) | 1.01 | 11.4 | 0.99–1.01 |") in text, text


def test_mixtures_bench_scores_draws_by_their_held_out_predictive():
    """The bench's network is unchanged by a hidden unit's sign flip (its modes), and its
    score is log (1/S) Σ_s N(y | f(x; w_s), σ²) averaged over the points, against a direct
    computation in float64."""
    from scipy import stats

    from blrppl.bench import mixtures

    (x, y), _ = mixtures.data()
    w = {"w_in": np.array([1.5, -0.7]), "b_in": np.array([0.3, 0.2]), "w_out": np.array([0.9, -1.1]), "b_out": 0.1}
    flipped = dict(w, w_in=w["w_in"] * [-1, 1], b_in=w["b_in"] * [-1, 1], w_out=w["w_out"] * [-1, 1])
    np.testing.assert_allclose(mixtures.network(w, x), mixtures.network(flipped, x), rtol=1e-12)
    draws = {s: np.stack([np.asarray(w[s], float), np.asarray(w[s], float) * 0.5]) for s in mixtures.SITES}
    f = [np.tanh(x[:, None] * d["w_in"] + d["b_in"]) @ d["w_out"] + d["b_out"]
         for d in ({s: draws[s][i] for s in mixtures.SITES} for i in range(2))]
    expected = np.mean(np.log(0.5 * sum(stats.norm.pdf(y, fi, mixtures.NOISE) for fi in f)))
    np.testing.assert_allclose(mixtures.predictive_log_likelihood(draws, x, y), expected, rtol=1e-10)
    text = mixtures.table([{"method": "NUTS", "lpd": -0.5, "seconds": 2.0, "khat": float("nan"), "bound": float("nan")}])
    assert text.splitlines()[2] == "| 0 | NUTS | -0.500 |  |  | 2.0 |"


# ------------------------------------------------------------ compile sizes (issue 55)


def test_compile_sizes_counts_the_step_program():
    """The step's size is counted from its own program: a larger loop body, more equations
    and HLO operations."""
    import jax.numpy as jnp

    from blrppl.bench import compile_sizes

    small = compile_sizes.step_size(lambda x: jnp.sin(x) + 1.0, jnp.ones(3))
    large = compile_sizes.step_size(lambda x: jnp.sin(jnp.cos(jnp.exp(x) * 2.0)) + jnp.sum(x), jnp.ones(3))
    assert 0 < small["jaxpr_equations"] < large["jaxpr_equations"]
    assert 0 < small["hlo_operations"] < large["hlo_operations"]


def test_compile_sizes_table_and_models():
    from blrppl.bench import compile_sizes

    names = compile_sizes.default_names()
    assert names[:6] == ["ar2:100", "ar2:1000", "ar2:10000", "baseball_pooled", "lorenz_bridge", "lorenz_bridge_scales"]
    assert set(models.names()) <= set(names)
    rows = [
        {"model": "ar2:100", "compile": 2.5, "run": 0.5, "model_runs": 2, "xla_compilations": 48, "jaxpr_equations": 1164,
         "hlo_operations": 2183},
        {"model": "baseball_pooled", "compile": float("nan"), "error": "did not finish"},
    ]
    text = compile_sizes.markdown(rows).splitlines()
    assert text[2] == "| AR(2) loop, 100 sites | 2.50 | 0.50 | 2 | 48 | 1164 | 2183 |"
    assert "failed: did not finish" in text[3]
    # (the baseball model as NumPyro writes it traces with its data)
    records = trace_model(compile_sizes.baseball_pooled, (), compile_sizes.baseball_data(), random.PRNGKey(0))[0]
    assert {"m", "kappa", "phi", "obs"} <= set(records)
    # (the Lorenz bridge, a scan of Euler steps: a latent state per step, the convection
    # observed at the first and last ten of its 30 steps)
    data = compile_sizes.lorenz_data()
    assert data["mask"].sum() == 20 and not data["mask"][10:20].any()
    records = trace_model(compile_sizes.lorenz_bridge_scales, (), data, random.PRNGKey(0))[0]
    assert {"innovation_scale", "observation_scale", "x0", "x", "y"} <= set(records)
    assert records["x"].value_shape == (30, 3) and not records["x"].observed
