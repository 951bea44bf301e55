"""``python -m blrppl.bench.deep`` (or ``python -m blrppl.bench --deep``): Bayesian deep learning by
``blr_fit`` against Adam, NumPyro's SVI and NUTS (issue 56).

Two benchmarks, each a markdown table written to ``<out>/deep-learning-bench.md``:

* **digits**: a multilayer perceptron (64 → 32 tanh → 10) on scikit-learn's digits (1,797 8 × 8
  images, 1,347 for training and 450 for testing), N(0, 1) priors on its 2,410 weights, trained
  full batch by Adam (optax, on the mean cross-entropy alone as deep-learning users train, and on
  it with the prior: the MAP of the same model), by NumPyro's SVI with ``AutoNormal``, by
  ``blr_fit`` (IVON blocks: :mod:`blrppl.compiler.large_blocks`) and by the IVON optimiser
  (:func:`blrppl.optim.ivon` on the network's loss, no model; its α and h₀ picked on a held-out
  fifth of the training set): test accuracy, test negative log-likelihood and expected calibration
  error (15 bins) of the predictive class probabilities (the model average over 200 draws of the
  posterior for SVI and the learning rule), and the time per epoch (one full-batch step: the run's
  time after compilation over its steps; Adam's two runs and the IVON optimiser's are timed in
  turn, several times, and the median and range reported);
* **in-between**: a two-layer regression network with its weights as sample sites
  (1,153 weights, two clusters of 50 points) by ``blr_fit`` and by NUTS: the predictive sd at the
  clusters' centres and between them.

Not tests: it needs scikit-learn and optax (``pip install blrppl[bench]``), and runs for minutes.
"""

from __future__ import annotations

import argparse
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import random

HIDDEN = 32
STEPS = 2000
DRAWS = 200
REPEATS = 7


def digits_data():
    """Standardised digits, split 1,347 / 450 (a fixed permutation)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order] / 16.0, y[order]
    mean, sd = x[:1347].mean(0), x[:1347].std(0) + 0.1
    x = (x - mean) / sd
    return (x[:1347], y[:1347]), (x[1347:], y[1347:])


def mlp(params, x):
    """The network's logits."""
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"]


def weights(d, k=10):
    """The MLP's weights as sample sites with N(0, 1) priors."""
    return {
        "w1": numpyro.sample("w1", dist.Normal(0.0, 1.0).expand([d, HIDDEN]).to_event(2)),
        "b1": numpyro.sample("b1", dist.Normal(0.0, 1.0).expand([HIDDEN]).to_event(1)),
        "w2": numpyro.sample("w2", dist.Normal(0.0, 1.0).expand([HIDDEN, k]).to_event(2)),
        "b2": numpyro.sample("b2", dist.Normal(0.0, 1.0).expand([k]).to_event(1)),
    }


def classifier(x, y=None):
    """The MLP as a NumPyro model: N(0, 1) weights, a Categorical likelihood over the data."""
    params = weights(x.shape[1])
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Categorical(logits=mlp(params, x)), obs=y)


def scores(probs, y, seconds_per_epoch) -> dict:
    """Accuracy, NLL and 15-bin expected calibration error of class probabilities ``probs``."""
    probs = np.clip(np.asarray(probs, float), 1e-12, 1.0)
    conf, pred = probs.max(1), probs.argmax(1)
    correct = pred == y
    edges = np.linspace(0.0, 1.0, 16)
    ece = 0.0
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = (conf > lo) & (conf <= hi)
        if inside.any():
            ece += inside.mean() * abs(correct[inside].mean() - conf[inside].mean())
    nll = -np.mean(np.log(probs[np.arange(len(y)), y]))
    return {"accuracy": correct.mean(), "nll": nll, "ece": ece, "epoch_ms": 1000 * seconds_per_epoch}


def _timed(run):
    """``run()`` twice: the second's time (after compilation), and its result."""
    run()
    t0 = time.perf_counter()
    out = run()
    return out, time.perf_counter() - t0


def cross_entropy(params, x, y, prior_precision=0.0):
    """The mean cross-entropy of the network's logits, plus ½ τ |θ|² / n for a N(0, 1/τ) prior
    (τ = 0: the loss deep-learning users train; τ = 1: −log posterior / n of :func:`classifier`)."""
    logp = jax.nn.log_softmax(mlp(params, x))
    loss = -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))
    if prior_precision:
        loss = loss + 0.5 * prior_precision * sum(jnp.sum(v**2) for v in jax.tree.leaves(params)) / len(y)
    return loss


class Timed:
    """A method's jitted full-batch run, timed alternately with the others' (:func:`time_alternately`).

    Attributes:
        run: ``run()``, the whole training run (its result ready: ``jax.block_until_ready``).
        score: ``score(result)``, the test scores of a run's result given its seconds per step
            (``score(result, seconds)``).
        steps: the run's steps.
    """

    def __init__(self, run, score, steps):
        self.run, self.score, self.steps = run, score, steps


def adam(train, test, steps=STEPS, prior_precision=1.0):
    """Adam (optax, 0.01), full batch, on the mean cross-entropy: with ``prior_precision=1`` the
    MAP of :func:`classifier` (the prior as weight decay), with 0 plain Adam as deep-learning
    users run it."""
    import optax

    (x, y), (xt, yt) = train, test
    opt = optax.adam(1e-2)
    loss = lambda p: cross_entropy(p, x, y, prior_precision)  # noqa: E731

    @jax.jit
    def train_all(p):
        def body(carry, _):
            p, s = carry
            u, s = opt.update(jax.grad(loss)(p), s, p)
            return (optax.apply_updates(p, u), s), None

        return jax.lax.scan(body, (p, opt.init(p)), None, length=steps)[0][0]

    params = _initial_params(x.shape[1])
    return Timed(
        lambda: jax.block_until_ready(train_all(params)),
        lambda fitted, seconds: scores(jax.nn.softmax(mlp(fitted, xt)), yt, seconds),
        steps,
    )


def _initial_params(d):
    """The MLP's starting weights (scaled normal, zero biases), shared by Adam and the IVON optimiser."""
    k1, k2 = random.split(random.PRNGKey(0))
    return {
        "w1": random.normal(k1, (d, HIDDEN)) / np.sqrt(d), "b1": jnp.zeros(HIDDEN),
        "w2": random.normal(k2, (HIDDEN, 10)) / np.sqrt(HIDDEN), "b2": jnp.zeros(10),
    }


#: the IVON optimiser's fixed settings on digits: β₂ = 0.999 for a run of a few thousand steps
#: (the docs' advice), the model's N(0, 1) prior; α and h₀ are picked on a held-out part of the
#: training set from :data:`IVON_GRID` (:func:`select_ivon_settings`)
IVON_SETTINGS = {"beta2": 0.999}
IVON_GRID = {"learning_rate": (0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 4.0), "hess_init": (0.01, 0.1, 1.0, 3.0, 10.0)}
#: the standard normal draws of this many steps are drawn by one call (blrppl.optim.standard_noise)
NOISE_BLOCK = 50


def _ivon_run(x, y, steps, settings):
    """``train_all(params, key, lr, h0) -> (mean, state)``: the IVON optimiser's full-batch run
    on the mean cross-entropy, λ = n, prior precision 1, one weight sample per step, the noise
    of :data:`NOISE_BLOCK` steps drawn at once (α and h₀ traced: one compilation for a grid)."""
    import optax

    from blrppl import optim

    value_and_grad = optim.value_and_grad(lambda p: cross_entropy(p, x, y))
    blocks, rest = divmod(steps, NOISE_BLOCK)

    def train_all(p, key, lr, h0):
        opt = optim.ivon(learning_rate=lr, hess_init=h0, ess=len(y), prior_precision=1.0, **settings)

        def step(carry, eps):
            p, s = carry
            _, g, noise = value_and_grad(p, s, eps)
            u, s = opt.update(g, s, p, noise=noise)
            return (optax.apply_updates(p, u), s), None

        def block(carry, k, size=NOISE_BLOCK):
            return jax.lax.scan(step, carry, optim.standard_noise(carry[0], k, size))[0], None

        k_blocks, k_rest = random.split(key)
        carry = jax.lax.scan(block, (p, opt.init(p)), random.split(k_blocks, blocks))[0]
        return block(carry, k_rest, rest)[0] if rest else carry

    return jax.jit(train_all)


def _model_average(state, mean, key, x):
    """The class probabilities averaged over :data:`DRAWS` draws of the IVON posterior."""
    from blrppl import optim

    return jax.nn.softmax(optim.predictive(mlp, state, mean, key, DRAWS, x)).mean(0)


def select_ivon_settings(train, steps=STEPS, held_out=0.2):
    """α and h₀ of :data:`IVON_GRID` with the best NLL on the last ``held_out`` part of the
    training set, fitted on the rest (the test set is not read).

    Returns:
        ``(settings, table)``: the chosen ``{"learning_rate": α, "hess_init": h₀}`` and
        ``{(α, h₀): held-out NLL}``.
    """
    x, y = train
    cut = int(round(len(y) * (1.0 - held_out)))
    train_all = _ivon_run(x[:cut], y[:cut], steps, IVON_SETTINGS)
    params = _initial_params(x.shape[1])
    table = {}
    for lr in IVON_GRID["learning_rate"]:
        for h0 in IVON_GRID["hess_init"]:
            mean, state = train_all(params, random.PRNGKey(1), lr, h0)
            table[(lr, h0)] = scores(_model_average(state, mean, random.PRNGKey(2), x[cut:]), y[cut:], 0.0)["nll"]
    lr, h0 = min(table, key=table.get)
    return {"learning_rate": lr, "hess_init": h0}, table


def ivon_optimiser(train, test, steps=STEPS, chosen=None):
    """The same network and prior by :func:`blrppl.optim.ivon` (no NumPyro model): the mean
    cross-entropy as its loss, λ = the training set's size, prior precision 1 (the model's
    N(0, 1)), one weight sample per full-batch step, and the model average over 200 draws;
    α and h₀ ``chosen`` (default: :func:`select_ivon_settings`)."""
    (x, y), (xt, yt) = train, test
    chosen = chosen or select_ivon_settings(train, steps)[0]
    train_all = _ivon_run(x, y, steps, IVON_SETTINGS)
    params = _initial_params(x.shape[1])
    lr, h0 = jnp.float32(chosen["learning_rate"]), jnp.float32(chosen["hess_init"])
    return Timed(
        lambda: jax.block_until_ready(train_all(params, random.PRNGKey(1), lr, h0)),
        lambda fitted, seconds: scores(_model_average(fitted[1], fitted[0], random.PRNGKey(2), xt), yt, seconds),
        steps,
    )


def time_alternately(methods: dict, repeats=REPEATS) -> dict:
    """Each method's scores, its run timed ``repeats`` times in turn with the others' (the
    machine's other jobs slow them alike): ``epoch_ms`` the median time per step, ``epoch_ms_min``
    and ``epoch_ms_max`` the range."""
    results = {name: m.run() for name, m in methods.items()}  # (compilation)
    times = {name: [] for name in methods}
    for _ in range(repeats):
        for name, m in methods.items():
            t0 = time.perf_counter()
            m.run()
            times[name].append((time.perf_counter() - t0) / m.steps)
    out = {}
    for name, m in methods.items():
        out[name] = m.score(results[name], float(np.median(times[name])))
        out[name]["epoch_ms_min"], out[name]["epoch_ms_max"] = 1000 * min(times[name]), 1000 * max(times[name])
    return out


def svi(train, test, steps=STEPS):
    """NumPyro's SVI with AutoNormal, full batch, Adam at 0.01."""
    from numpyro.infer import SVI, Predictive, Trace_ELBO
    from numpyro.infer.autoguide import AutoNormal

    (x, y), (xt, yt) = train, test
    guide = AutoNormal(classifier, init_scale=0.01)
    engine = SVI(classifier, guide, numpyro.optim.Adam(1e-2), Trace_ELBO())
    result, seconds = _timed(lambda: engine.run(random.PRNGKey(0), steps, x, y, progress_bar=False))
    draws = Predictive(mlp_sites, guide=guide, params=result.params, num_samples=DRAWS)(random.PRNGKey(1), xt)
    return scores(jax.nn.softmax(draws["logits"]).mean(0), yt, seconds / steps)


def mlp_sites(x):
    """The network's logits at the guide's draws (a deterministic site)."""
    numpyro.deterministic("logits", mlp(weights(x.shape[1]), x))


def blr(train, test, steps=STEPS):
    """``blr_fit`` with its defaults (IVON blocks), ``steps`` steps."""
    from numpyro.infer import Predictive

    from blrppl import blr_fit

    (x, y), (xt, yt) = train, test
    result = blr_fit(classifier, {"x": x, "y": y}, rng_key=random.PRNGKey(0), num_steps=steps, progress_bar=False)
    draws = Predictive(mlp_sites, guide=result.guide, num_samples=DRAWS)(random.PRNGKey(1), xt)
    out = scores(jax.nn.softmax(draws["logits"]).mean(0), yt, result.run_time / max(result.num_steps, 1))
    out["steps"] = result.num_steps
    out["families"] = sorted({b.kind for b in result.plan.blocks})
    return out


IN_BETWEEN_HIDDEN = 32  # two tanh layers: 1·32 + 32 + 32·32 + 32 + 32 + 1 = 1,153 weights


def network(x, y=None):
    """A two-layer tanh regression network with its weights as sample sites (noise sd 0.1)."""
    width = IN_BETWEEN_HIDDEN
    w1 = numpyro.sample("w1", dist.Normal(0.0, 1.0).expand([1, width]).to_event(2))
    b1 = numpyro.sample("b1", dist.Normal(0.0, 1.0).expand([width]).to_event(1))
    w2 = numpyro.sample("w2", dist.Normal(0.0, 1.0 / np.sqrt(width)).expand([width, width]).to_event(2))
    b2 = numpyro.sample("b2", dist.Normal(0.0, 1.0).expand([width]).to_event(1))
    w3 = numpyro.sample("w3", dist.Normal(0.0, 1.0 / np.sqrt(width)).expand([width]).to_event(1))
    b3 = numpyro.sample("b3", dist.Normal(0.0, 1.0))
    h = jnp.tanh(x[:, None] @ w1 + b1)
    h = jnp.tanh(h @ w2 + b2)
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(h @ w3 + b3, 0.1), obs=y)


def clusters():
    """Two clusters of 50 points, x in [-2, -1] and [1, 2], y = sin(2x) + noise."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-2.0, -1.0, 50), rng.uniform(1.0, 2.0, 50)])
    return x, np.sin(2.0 * x) + 0.1 * rng.normal(size=100)


def in_between(nuts_samples=500):
    """Predictive sd inside the clusters (x = ±1.5) and between them (x = 0): blr_fit and NUTS."""
    from numpyro.infer import MCMC, NUTS, Predictive

    from blrppl import blr_fit

    x, y = clusters()
    grid = np.array([-1.5, 0.0, 1.5])
    out = {}
    t0 = time.perf_counter()
    result = blr_fit(network, {"x": x, "y": y}, rng_key=random.PRNGKey(0), progress_bar=False)
    seconds = time.perf_counter() - t0
    draws = Predictive(network, guide=result.guide, num_samples=2000)(random.PRNGKey(1), grid)["y"]
    out["blr_fit"] = (np.asarray(draws).std(0), seconds)
    mcmc = MCMC(NUTS(network, max_tree_depth=8), num_warmup=nuts_samples, num_samples=nuts_samples,
                progress_bar=False)
    t0 = time.perf_counter()
    mcmc.run(random.PRNGKey(0), x, y)
    seconds = time.perf_counter() - t0
    draws = Predictive(network, mcmc.get_samples())(random.PRNGKey(1), grid)["y"]
    out["NUTS"] = (np.asarray(draws).std(0), seconds)
    return out


def report(digits: dict, between: dict, selection: dict | None = None) -> str:
    """The two markdown tables (and the held-out NLL of the IVON optimiser's grid, when given)."""
    lines = [
        "| method | test accuracy | test NLL | ECE | ms per epoch | range (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in digits.items():
        spread = f"{s['epoch_ms_min']:.2f}–{s['epoch_ms_max']:.2f}" if "epoch_ms_min" in s else ""
        lines.append(
            f"| {name} | {s['accuracy']:.3f} | {s['nll']:.3f} | {s['ece']:.3f} | {s['epoch_ms']:.2f} | {spread} |"
        )
    if selection:  # the held-out NLL, a row for each α, a column for each h₀
        h0s = sorted({h0 for _, h0 in selection})
        lines += ["", "| held-out NLL | " + " | ".join(f"h₀ = {h0:g}" for h0 in h0s) + " |",
                  "|---" * (len(h0s) + 1) + "|"]
        for lr in sorted({lr for lr, _ in selection}):
            cells = " | ".join(f"{selection[(lr, h0)]:.4f}" if (lr, h0) in selection else "" for h0 in h0s)
            lines.append(f"| α = {lr:g} | {cells} |")
    lines += [
        "",
        "| method | sd at x = −1.5 | sd at x = 0 (between) | sd at x = 1.5 | time (s) |",
        "|---|---|---|---|---|",
    ]
    for name, (sd, seconds) in between.items():
        lines.append(f"| {name} | {sd[0]:.3f} | {sd[1]:.3f} | {sd[2]:.3f} | {seconds:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m blrppl.bench.deep", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-out", help="output directory (default ./bench-out)")
    p.add_argument("--steps", type=int, default=STEPS, help=f"full-batch steps of each method (default {STEPS})")
    p.add_argument("--nuts-samples", type=int, default=500, help="NUTS warm-up and draws (default 500)")
    p.add_argument("--repeats", type=int, default=REPEATS,
                   help=f"alternating timed runs of Adam and the IVON optimiser (default {REPEATS})")
    args = p.parse_args(argv)
    numpyro.enable_x64(False)
    train, test = digits_data()
    chosen, selection = select_ivon_settings(train, args.steps)
    digits = time_alternately(
        {
            "Adam": adam(train, test, args.steps, prior_precision=0.0),
            "Adam (MAP)": adam(train, test, args.steps),
            "blrppl.optim.ivon": ivon_optimiser(train, test, args.steps, chosen),
        },
        args.repeats,
    )
    digits["SVI AutoNormal"] = svi(train, test, args.steps)
    digits["blr_fit (IVON blocks)"] = blr(train, test, args.steps)
    digits = {k: digits[k] for k in ("Adam", "Adam (MAP)", "SVI AutoNormal", "blr_fit (IVON blocks)",
                                      "blrppl.optim.ivon")}
    between = in_between(args.nuts_samples)
    text = report(digits, between, selection)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "deep-learning-bench.md").write_text(text)
    print(text)
    print("the IVON optimiser's α and h₀, picked on the held-out part of the training set:", chosen)
    print("blr_fit on digits:", digits["blr_fit (IVON blocks)"].get("steps"), "steps,",
          digits["blr_fit (IVON blocks)"].get("families"))


if __name__ == "__main__":
    main()
