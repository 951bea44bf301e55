"""Every example runs (with fewer steps where it has a knob) and shows what it claims."""

import importlib.util
import pathlib

import jax
import numpy as np

from blrppl import optim

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_svi_pipeline_example():
    runs = load("svi_pipeline").main(svi_steps=300)
    (svi_name, svi), (blr_name, blr) = runs.items()
    assert blr_name == "BLR"
    assert svi["param shapes"] == blr["param shapes"]
    assert blr["steps"] < 1000  # converged before the cap
    # the data were simulated with intercept 0.5 and noise sd 0.7 (N=500): the 90% intervals
    # of a converged fit hold them
    lo, _, hi = np.asarray(blr["quantiles"]["b"])
    assert lo < 0.5 < hi
    lo, _, hi = np.asarray(blr["quantiles"]["sigma"])
    assert lo < 0.7 < hi


def test_quickstart_example():
    result, stats, draws, y_rep = load("quickstart").main()
    assert result.converged
    assert set(draws) == {"mu", "tau"} and draws["mu"].shape == (1000,)
    assert y_rep.shape == (200, 100)
    # data: N(1.5, 0.5²), 100 points: the posterior mean of mu is within 4 sd (0.05) of 1.5
    assert abs(float(stats["mu"]["mean"]) - 1.5) < 0.2


def test_gaussian_mixture_example():
    result, means = load("gaussian_mixture").main()
    # 600 points, unit noise, separated components: means within 0.3 of the simulated ones
    np.testing.assert_allclose(means, [-4.0, 0.0, 5.0], atol=0.3)
    assert np.all(np.diff(result.elbo) >= -1e-6 * np.abs(result.elbo[1:]))


def test_mixture_posterior_example(tmp_path):
    """The mixture holds both modes of y ~ N(θ², 1) and the single Gaussian cannot: the TV
    distances are read on the example's grid of 4001 points (its error on these smooth densities
    is far below the margins), and each mode's exact mass is ½ by symmetry."""
    path = tmp_path / "mixture.png"
    fits, note = load("mixture_posterior").main(num_steps=600, plot_path=str(path))
    one, mixture = fits["one Gaussian"], fits["mixture of 8"]
    # one Gaussian over two modes ~0.2 wide at ±2 puts most of its mass between or beside them
    assert one["tv"] > 0.5 and mixture["tv"] < 0.1 and mixture["tv"] < one["tv"] / 5
    np.testing.assert_allclose([mixture["mass below 0"], mixture["mass above 0"]], 0.5, atol=0.05)
    assert note == f"plot saved to {path}" and path.stat().st_size > 0 or note.startswith("matplotlib is not installed")


def test_mixture_posterior_example_without_matplotlib(monkeypatch, tmp_path):
    """Without matplotlib the example says so and saves nothing."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    grid = np.linspace(-1.0, 1.0, 5)
    note = load("mixture_posterior").plot(grid, np.ones(5), {}, tmp_path / "p.png")
    assert note == "matplotlib is not installed: no plot saved" and not (tmp_path / "p.png").exists()


def test_logistic_vs_nuts_example():
    rows, blr_seconds, nuts_seconds = load("logistic_vs_nuts").main(num_warmup=200, num_samples=600)
    # 600 NUTS draws: the Monte Carlo error of a NUTS mean is ~sd/sqrt(ESS) <= 0.06 sd; the
    # Gaussian approximation of a 1000-point logistic regression is within a few hundredths
    for name, blr_mean, nuts_mean, err, ratio in rows:
        assert abs(err) < 0.2, name
        assert 0.8 < ratio < 1.2, name


def test_minibatch_example():
    err, ratio = load("minibatch").main(n=2000, batch=100, num_steps=2000)
    assert np.max(np.abs(err)) < 0.1
    np.testing.assert_allclose(ratio, 1.0, rtol=0.1)


def test_online_example():
    online, batch = load("online").main(num_batches=3, batch_size=40)
    np.testing.assert_allclose(online.concentration, batch.concentration, rtol=1e-6)
    np.testing.assert_allclose(online.rate, batch.rate, rtol=1e-6)


def test_state_space_example():
    fit, level, seen, count_fit, log_rate = load("state_space").main(num_days=800)
    assert fit.plan.block("level").family.banded and count_fit.plan.block("log_rate").family.banded
    assert fit.converged and count_fit.converged
    # 800 days of a walk with step sd 0.3 and noise sd 0.5: the scales are known to within
    # a few hundredths (posterior sds ≈ 0.02); the states in the unobserved month are less
    # certain than the observed ones
    assert abs(float(fit.posterior["s"].mean) - 0.3) < 0.1 and abs(float(fit.posterior["r"].mean) - 0.5) < 0.1
    sd = np.sqrt(np.asarray(fit.posterior["level"].variance))
    assert sd[~seen].min() > sd[seen].max()
    err = np.asarray(fit.posterior["level"].mean) - level
    assert np.sqrt(np.mean(err**2)) < 0.5
    est = np.asarray(count_fit.posterior["log_rate"].mean)
    # (about 4 counts a day: each day alone pins log λ to ±0.5; the walk prior pools ~10 days)
    assert np.sqrt(np.mean((est - log_rate) ** 2)) < 0.25


def test_hmm_example():
    fit, x, decoded, trans, loc = load("hmm").main(num_steps=500)
    assert "categorical-chain (1 × 500 states" in fit.plan.describe()
    assert fit.converged
    # the regimes' means are 1.5 or more apart with sds ≤ 0.8: almost every state is decoded
    assert np.mean(decoded == x) > 0.95
    # each regime holds ≥ 80 of the 500 days: a mean's standard error is ≤ 0.8/sqrt(80) ≈ 0.09
    np.testing.assert_allclose(loc, [-1.0, 0.5, 2.0], atol=0.25)
    # rows of the transition matrix: ≥ 80 transitions each, standard errors ≤ 0.03
    assert np.all(np.diag(trans) > 0.8)


def test_classic_vmp_example():
    pca, gmm = load("classic_vmp").main()
    ard = np.sort(np.asarray(pca.posterior["alpha"].mean))
    # rank 2 data in 4 latent dimensions: two kept (precision about 1), two pruned (precision
    # hundreds of times larger); the noise sd recovered within 5 %
    assert ard[1] < 5.0 and ard[2] > 100 * ard[1]
    assert abs(float(1 / np.sqrt(pca.posterior["tau"].mean)) - 0.3) < 0.015
    # the mixture: separated components, so each fitted covariance (the inverse of E[Λ]) is
    # its points' sample covariance, up to the Wishart prior's weight (ν₀ = 3 against 100
    # points: a few %)
    mod = load("classic_vmp")
    x = mod.mixture_data()
    means = np.asarray(gmm.posterior["mu"].mean)
    covariances = np.linalg.inv(np.asarray(gmm.posterior["Lam"].mean))
    for j, centre in enumerate(mod.CENTRES):
        k = int(np.argmin(np.linalg.norm(means - np.asarray(centre), axis=1)))
        points = x[100 * j : 100 * (j + 1)]
        np.testing.assert_allclose(means[k], points.mean(0), atol=0.02)
        np.testing.assert_allclose(covariances[k], np.cov(points.T, bias=True), atol=0.05)
    for fit in (pca, gmm):
        elbo = np.asarray(fit.elbo)
        assert np.all(np.diff(elbo) >= -1e-9 * np.abs(elbo[1:]))


def test_ivon_mlp_example():
    rows, state, settings = load("ivon_mlp").main()
    # two half-moons with noise sd 0.25 overlap little: every fit classifies more than 90% of
    # the 1000 test points, with a test NLL well below that of a coin (log 2 = 0.69)
    for name, (accuracy, nll) in rows.items():
        assert accuracy > 0.9 and nll < 0.35, name
    # the posterior has learned from the data: every weight's sd is below its prior sd
    # 1/√(ess·δ), and the Hessian estimate has moved from its start (sd 1/√(ess(h₀ + δ)))
    sd = np.concatenate([np.ravel(s) for s in jax.tree.leaves(optim.posterior_stddev(state))])
    ess, delta, h0 = settings["ess"], settings["weight_decay"], settings["hess_init"]
    assert np.all(np.isfinite(sd)) and sd.max() < 1 / np.sqrt(ess * delta)
    assert abs(np.median(sd) / (1 / np.sqrt(ess * (h0 + delta))) - 1) > 0.1


def test_deep_learning_docs_example():
    """The example of docs/deep-learning.md runs as written and fits its data."""
    page = (EXAMPLES.parent / "docs" / "deep-learning.md").read_text()
    code = page.split("```python\n", 1)[1].split("```", 1)[0]
    names = {}
    exec(compile(code, "docs/deep-learning.md", "exec"), names)
    x, mean, sd = (np.asarray(names[k]) for k in ("x", "mean", "sd"))
    # 256 points with noise sd 0.1 on sin(x): the model average is within 0.15 of the curve
    # (rms; about the noise's sd), and its spread is that of a function known to within a few
    # hundredths (between 0 and the noise's sd)
    assert np.sqrt(np.mean((mean - np.sin(x[:, 0])) ** 2)) < 0.15
    assert np.all(sd > 0) and np.all(sd < 0.1)
