"""``python -m blrppl.bench.deep`` (or ``python -m blrppl.bench --deep``): Bayesian deep learning by
``blr_fit`` against Adam, NumPyro's SVI and NUTS (issue 56).

Two benchmarks, each a markdown table written to ``<out>/deep-learning-bench.md``:

* **digits**: a multilayer perceptron (64 → 32 tanh → 10) on scikit-learn's digits (1,797 8 × 8
  images, 1,347 for training and 450 for testing). Adam (optax, on the mean cross-entropy alone as
  deep-learning users train, and on it with the N(0, 1) prior: the MAP), and the IVON optimiser
  (:func:`blrppl.optim.ivon` on the network's loss, no model) are trained by one protocol: a fixed
  budget of :data:`EPOCHS` epochs of shuffled minibatches of :data:`BATCH`, each method's settings
  (:data:`METHODS`: the learning rate, constant or decayed to 0 by a cosine, IVON's h₀, and for the
  MAP and IVON the prior precision, :data:`PRIORS`) picked by the NLL on a held-out fifth of the
  training set (:func:`select`; the test set is not read), then trained on the whole training set
  with three seeds. The same protocol also runs on :data:`SMALL_SUBSETS` disjoint training sets of
  :data:`SMALL_IMAGES` images (minibatches of :data:`SMALL_BATCH`, :func:`small_data_rows`), where
  a network memorises its data. NumPyro's SVI with ``AutoNormal`` and
  ``blr_fit`` (IVON blocks: :mod:`blrppl.compiler.large_blocks`) fit the model with N(0, 1) priors
  on its 2,410 weights full batch for :data:`STEPS` steps. Reported: test accuracy, negative
  log-likelihood and expected calibration error (15 bins) of the predictive class probabilities
  (the model average over 200 posterior draws for SVI, ``blr_fit`` and IVON; the mean and range
  over the seeds), and the time per step (a run's time after compilation over its steps; Adam's
  two runs and IVON's are timed in turn, several times, median and range reported);
* **in-between**: a two-layer regression network with its weights as sample sites
  (1,153 weights, two clusters of 50 points) by ``blr_fit`` and by NUTS: the predictive sd at the
  clusters' centres and between them.

Not tests: it needs scikit-learn and optax (``pip install blrppl[bench]``), and runs for minutes.
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import time
from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import random

HIDDEN = 32
STEPS = 2000  # SVI's and blr_fit's full-batch steps
EPOCHS = 100  # Adam's and the IVON optimiser's epochs of minibatches of BATCH
BATCH = 128
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
    probs = np.asarray(probs, float)
    if not np.all(np.isfinite(probs)):  # a diverged run: no score
        return {"accuracy": np.nan, "nll": np.nan, "ece": np.nan, "epoch_ms": 1000 * seconds_per_epoch}
    probs = np.clip(probs, 1e-12, 1.0)
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


def cross_entropy(params, x, y, prior_precision=0.0, size=None):
    """The mean cross-entropy of the network's logits, plus ½ τ |θ|² / n for a N(0, 1/τ) prior
    (τ = 0: the loss deep-learning users train; τ = 1: −log posterior / n of :func:`classifier`);
    n is ``size``, the training set's size (default ``len(y)``: a full batch)."""
    logp = jax.nn.log_softmax(mlp(params, x))
    loss = -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))
    if prior_precision:
        size = len(y) if size is None else size
        loss = loss + 0.5 * prior_precision * sum(jnp.sum(v**2) for v in jax.tree.leaves(params)) / size
    return loss


class Timed:
    """A method's jitted training run, timed alternately with the others' (:func:`time_alternately`).

    Attributes:
        run: ``run()``, the whole training run (its result ready: ``jax.block_until_ready``).
        score: ``score(result)``, the test scores of a run's result given its seconds per step
            (``score(result, seconds)``).
        steps: the run's steps.
    """

    def __init__(self, run, score, steps):
        self.run, self.score, self.steps = run, score, steps


def initial_params(d, width=HIDDEN, key=None):
    """The MLP's starting weights (normal scaled by 1/√fan-in, zero biases); ``key`` default PRNGKey(0)."""
    k1, k2 = random.split(random.PRNGKey(0) if key is None else key)
    return {
        "w1": random.normal(k1, (d, width)) / np.sqrt(d), "b1": jnp.zeros(width),
        "w2": random.normal(k2, (width, 10)) / np.sqrt(width), "b2": jnp.zeros(10),
    }


def epoch_batches(key, n, batch=BATCH):
    """One epoch's minibatches: a permutation of the n examples cut into ``n // batch`` batches of
    ``batch`` indices (the remainder, a different one each epoch, left out of that epoch)."""
    count = n // batch
    return random.permutation(key, n)[: count * batch].reshape(count, batch)


def annealed(transformation, cosine, total):
    """``transformation``'s updates scaled by 1 − c + c · ½(1 + cos(π t / T)), T = ``total``
    steps: a constant learning rate at ``cosine`` c = 0, a cosine decay to 0 at c = 1 (c may be
    traced: one compilation for both)."""
    import optax

    def scale(count):
        fraction = jnp.minimum(jnp.asarray(count, jnp.result_type(float)) / total, 1.0)  # (the default float)
        return 1.0 - cosine + cosine * 0.5 * (1.0 + jnp.cos(jnp.pi * fraction))

    return optax.chain(transformation, optax.scale_by_schedule(scale))


def _adam_trainer(x, y, epochs, prior_precision, batch=BATCH):
    """``(init, train)``: ``init(params, **hyper)`` the carry, ``train(carry, key, **hyper)`` it
    after ``epochs`` epochs of optax's Adam on minibatches of the mean cross-entropy (with the
    prior's ½ τ |θ|² / n when ``prior_precision`` τ > 0: the MAP); ``hyper`` its
    ``learning_rate`` and ``cosine`` (:func:`annealed`)."""
    import optax

    x, y, n = jnp.asarray(x), jnp.asarray(y), len(y)
    total = epochs * (n // batch)

    def init(params, learning_rate, cosine):
        return params, annealed(optax.adam(learning_rate), cosine, total).init(params)

    def train(carry, key, learning_rate, cosine):
        opt = annealed(optax.adam(learning_rate), cosine, total)
        grad = jax.grad(lambda p, idx: cross_entropy(p, x[idx], y[idx], prior_precision, n))

        def step(carry, idx):
            p, s = carry
            u, s = opt.update(grad(p, idx), s, p)
            return (optax.apply_updates(p, u), s), None

        def epoch(carry, k):
            return jax.lax.scan(step, carry, epoch_batches(k, n, batch))[0], None

        return jax.lax.scan(epoch, carry, random.split(key, epochs))[0]

    return jax.jit(init), jax.jit(train)


#: the IVON optimiser's fixed settings on digits: β₂ = 0.999 for a run of about a thousand
#: steps (the docs' advice), the model's N(0, 1) prior (prior precision 1), λ = the training
#: set's size; α and h₀ are picked on held-out training data (:func:`select`)
IVON_SETTINGS = {"beta2": 0.999}


#: the IVON optimiser's standard normal draws are drawn about this many steps at a time
#: (threefry on the CPU costs per call: docs/deep-learning.md, "Benchmark")
NOISE_STEPS = 50


def noise_span(epochs: int, per_epoch: int) -> int:
    """The epochs whose draws one call makes: the largest divisor of ``epochs`` whose steps are at
    most :data:`NOISE_STEPS` (one epoch when an epoch alone has more)."""
    return max(d for d in range(1, epochs + 1) if epochs % d == 0 and (d == 1 or d * per_epoch <= NOISE_STEPS))


def _ivon_trainer(x, y, epochs, prior_precision=1.0, batch=BATCH):
    """``(init, train)`` of the IVON optimiser as :func:`_adam_trainer`'s (hyperparameters
    ``learning_rate`` α, ``hess_init`` h₀ and ``cosine``; ``prior_precision`` the Gaussian
    prior's precision, fixed in the program): one weight draw per step, the draws of
    :func:`noise_span` epochs by one call of ``standard_noise``."""
    import optax

    from blrppl import optim

    x, y, n = jnp.asarray(x), jnp.asarray(y), len(y)
    total, span = epochs * (n // batch), noise_span(epochs, n // batch)
    value_and_grad = optim.value_and_grad(lambda p, idx: cross_entropy(p, x[idx], y[idx]))

    def make(learning_rate, hess_init, cosine):
        ivon = optim.ivon(learning_rate=learning_rate, hess_init=hess_init, ess=n, prior_precision=prior_precision,
                          **IVON_SETTINGS)
        return annealed(ivon, cosine, total)  # (α scales the mean's step alone: the same as α's schedule)

    def init(params, learning_rate, hess_init, cosine):
        return params, make(learning_rate, hess_init, cosine).init(params)

    def train(carry, key, learning_rate, hess_init, cosine):
        opt = make(learning_rate, hess_init, cosine)

        def step(carry, idx_eps):
            (p, s), (idx, eps) = carry, idx_eps
            _, g, noise = value_and_grad(p, s, eps, idx)
            u, s = opt.update(g, s, p, noise=noise)
            return (optax.apply_updates(p, u), s), None

        def block(carry, k):  # `span` epochs, their draws by one call
            k_order, k_noise = random.split(k)
            order = jax.vmap(lambda key: epoch_batches(key, n, batch))(random.split(k_order, span))
            order = order.reshape(-1, batch)
            return jax.lax.scan(step, carry, (order, optim.standard_noise(carry[0], k_noise, len(order))))[0], None

        return jax.lax.scan(block, carry, random.split(key, epochs // span))[0]

    return jax.jit(init), jax.jit(train)


def _point_probs(carry, key, x):
    """The class probabilities of a point estimate (Adam's weights)."""
    del key
    return jax.nn.softmax(mlp(carry[0], x))


def _model_average(carry, key, x):
    """The class probabilities averaged over :data:`DRAWS` draws of the IVON posterior."""
    from blrppl import optim

    mean, state = carry
    return jax.nn.softmax(optim.predictive(mlp, state, mean, key, DRAWS, x)).mean(0)


class Method(NamedTuple):
    """A row of the minibatch protocol: ``trainer(x, y, epochs, **fixed) -> (init, train)``, the
    grid of its hyperparameters (picked on held-out training data), ``probs(carry, key, x)``, and
    the grid of the settings ``fixed`` in the trainer's program (one trainer built for each of
    their points: the prior precision, which ``blrppl.optim.ivon`` checks when it is built)."""

    trainer: Callable
    grid: dict
    probs: Callable
    fixed: dict = {}


def split_settings(method: Method, hyper: dict) -> tuple:
    """``(fixed, traced)``: a picked point's settings of the trainer's program and those its
    ``init`` and ``train`` take."""
    fixed = {k: v for k, v in hyper.items() if k in method.fixed}
    return fixed, {k: v for k, v in hyper.items() if k not in method.fixed}


def with_batch(method: Method, batch: int) -> Method:
    """``method`` on minibatches of ``batch``."""
    return method._replace(trainer=partial(method.trainer, batch=batch))


#: the grids searched on held-out training data (:func:`select`); ``cosine`` 0: a constant
#: learning rate, 1: a cosine decay to 0 over the run (:func:`annealed`)
ADAM_GRID = {"learning_rate": (1e-3, 3e-3, 1e-2, 3e-2, 0.1), "cosine": (0.0, 1.0)}
IVON_GRID = {"learning_rate": (0.3, 1.0, 3.0, 10.0, 30.0, 100.0), "hess_init": (0.3, 1.0, 3.0, 10.0, 30.0),
             "cosine": (0.0, 1.0)}
#: the prior precisions τ searched for the MAP and IVON (a N(0, 1/τ) prior on every weight: the
#: weight decay deep-learning users tune, δ = τ / n)
PRIORS = {"prior_precision": (0.01, 0.1, 1.0)}
#: the minibatch protocol's methods (rows of the digits table), each with its grids
METHODS = {
    "Adam": Method(partial(_adam_trainer, prior_precision=0.0), ADAM_GRID, _point_probs),
    "Adam (MAP)": Method(_adam_trainer, ADAM_GRID, _point_probs, PRIORS),
    "blrppl.optim.ivon": Method(_ivon_trainer, IVON_GRID, _model_average, PRIORS),
}


def grid_points(grid: dict) -> list:
    """Every combination of a grid's values, as keyword dictionaries."""
    names = sorted(grid)
    return [dict(zip(names, values)) for values in itertools.product(*(grid[k] for k in names))]


def fit(method: Method, x, y, hyper: dict, epochs=EPOCHS, width=HIDDEN, seed=0, trainer=None):
    """A method trained on ``(x, y)``: its final carry (seed: the starting weights, the batches'
    order and IVON's draws; ``trainer`` the ``(init, train)`` of ``method.trainer(x, y, epochs)``
    when already built)."""
    fixed, hyper = split_settings(method, hyper)
    init, train = trainer or method.trainer(x, y, epochs, **fixed)
    keys = random.split(random.PRNGKey(seed))
    hyper = {k: jnp.float32(v) for k, v in hyper.items()}
    return train(init(initial_params(x.shape[1], width, keys[0]), **hyper), keys[1], **hyper)


def select(method: Method, train, epochs=EPOCHS, width=HIDDEN, held_out=0.2):
    """The point of ``method.grid`` × ``method.fixed`` with the best NLL on the last ``held_out``
    part of the training set, fitted on the rest (the test set is not read).

    Returns:
        ``(hyper, table)``: the chosen keyword dictionary and ``{tuple(sorted(point.items())):
        held-out NLL}``.
    """
    x, y = train
    cut = int(round(len(y) * (1.0 - held_out)))
    table = {}
    for fixed in grid_points(method.fixed):
        trainer = method.trainer(x[:cut], y[:cut], epochs, **fixed)
        for point in grid_points(method.grid):
            carry = fit(method, x[:cut], y[:cut], {**fixed, **point}, epochs, width, trainer=trainer)
            probs = method.probs(carry, random.PRNGKey(2), x[cut:])
            table[tuple(sorted({**fixed, **point}.items()))] = scores(probs, np.asarray(y[cut:]), 0.0)["nll"]
    finite = {k: v for k, v in table.items() if np.isfinite(v)}  # (a diverged run: NaN)
    if not finite:
        raise RuntimeError(f"every point of the grid diverged on the held-out data: {method.grid}")
    return dict(min(finite, key=finite.get)), table


def timed_fit(method: Method, train, test, hyper: dict, epochs=EPOCHS, width=HIDDEN, seed=0,
              batch=BATCH) -> Timed:
    """A method's run for :func:`time_alternately`: trained on ``train`` (``method``'s minibatches
    of ``batch``), scored on ``test``."""
    (x, y), (xt, yt) = train, test
    fixed, hyper = split_settings(method, hyper)
    init, run = method.trainer(x, y, epochs, **fixed)
    keys = random.split(random.PRNGKey(seed))
    hyper = {k: jnp.float32(v) for k, v in hyper.items()}
    start = init(initial_params(x.shape[1], width, keys[0]), **hyper)
    return Timed(
        lambda: jax.block_until_ready(run(start, keys[1], **hyper)),
        lambda carry, seconds: scores(method.probs(carry, random.PRNGKey(2), xt), np.asarray(yt), seconds),
        epochs * (len(y) // batch),
    )


def trajectory(method: Method, train, test, hyper: dict, checkpoints=(10, 30, 100, 300, 1000), width=HIDDEN,
               seed=0, chunk=10) -> dict:
    """The test scores of one run after each number of epochs in ``checkpoints`` (multiples of
    ``chunk``: the run goes ``chunk`` epochs at a time, the learning rate constant throughout).

    Returns:
        ``{epochs: scores}``.
    """
    (x, y), (xt, yt) = train, test
    fixed, hyper = split_settings(method, hyper)
    init, run = method.trainer(x, y, chunk, **fixed)
    keys = random.split(random.PRNGKey(seed))
    hyper = {k: jnp.float32(v) for k, v in hyper.items()}
    carry = init(initial_params(x.shape[1], width, keys[0]), **hyper)
    out, done = {}, 0
    for stop in checkpoints:
        while done < stop:
            carry = run(carry, random.fold_in(keys[1], done), **hyper)
            done += chunk
        out[stop] = scores(method.probs(carry, random.PRNGKey(2), xt), np.asarray(yt), 0.0)
    return out


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


def _cell(runs: list, key: str) -> str:
    """The mean of ``key`` over a method's runs (seeds), and their range when there are several."""
    values = [r[key] for r in runs]
    if not all(np.isfinite(values)):
        return "diverged"
    text = f"{np.mean(values):.3f}"
    return text + (f" ({min(values):.3f}–{max(values):.3f})" if len(values) > 1 else "")


def _selection_lines(name: str, table: dict) -> list:
    """A method's held-out NLL over its grid, best first."""
    lines = ["", f"| {name}: held-out NLL | setting |", "|---|---|"]
    for point, nll in sorted(table.items(), key=lambda item: (not np.isfinite(item[1]), item[1])):
        setting = ", ".join(f"{k} = {v:g}" for k, v in point)
        lines.append(f"| {nll:.4f} | {setting} |" if np.isfinite(nll) else f"| diverged | {setting} |")
    return lines


def report(digits: dict, between: dict, selection: dict | None = None, small: dict | None = None) -> str:
    """The markdown tables: ``digits`` maps a method to its runs' scores (a list, one per seed;
    the first timed), ``selection`` a method to its held-out grid (:func:`select`), ``small`` the
    rows of :func:`small_data_rows`."""
    lines = _digits_lines(digits)
    if small:
        lines += _small_lines(small)
    for name, table in (selection or {}).items():
        lines += _selection_lines(name, table)
    lines += [
        "",
        "| method | sd at x = −1.5 | sd at x = 0 (between) | sd at x = 1.5 | time (s) |",
        "|---|---|---|---|---|",
    ]
    for name, (sd, seconds) in between.items():
        lines.append(f"| {name} | {sd[0]:.3f} | {sd[1]:.3f} | {sd[2]:.3f} | {seconds:.1f} |")
    return "\n".join(lines) + "\n"


def _small_lines(small: dict) -> list:
    """The small training sets' table: each method's test NLL / ECE on each subset (the mean over
    its seeds), and their means over the subsets."""
    subsets = small["subsets"]
    head = " | ".join(f"images {lo}–{hi - 1}: NLL / ECE" for lo, hi, _ in subsets)
    lines = ["", f"| method | {head} | mean NLL | mean ECE |", "|---|" + "---|" * (len(subsets) + 2)]
    for name in subsets[0][2]:
        cells, nll, ece = [], [], []
        for _, _, rows in subsets:
            runs = rows[name]
            n, e = np.mean([r["nll"] for r in runs]), np.mean([r["ece"] for r in runs])
            nll.append(n), ece.append(e)
            cells.append(f"{n:.3f} / {e:.3f}" if np.isfinite(n) else "diverged")
        lines.append(f"| {name} | {' | '.join(cells)} | {np.mean(nll):.3f} | {np.mean(ece):.3f} |")
    return lines


def _digits_lines(digits: dict) -> list:
    """A digits table: each method's scores over its seeds, and its time per step."""
    lines = [
        "| method | test accuracy | test NLL | ECE | ms per step | × Adam | range (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    adam_ms = digits["Adam"][0]["epoch_ms"] if "Adam" in digits else np.nan
    for name, runs in digits.items():
        s = runs[0]
        timed = "epoch_ms_min" in s  # (timed in turn with Adam: the same minibatch steps, a ratio)
        spread = f"{s['epoch_ms_min']:.2f}–{s['epoch_ms_max']:.2f}" if timed else ""
        ratio = f"{s['epoch_ms'] / adam_ms:.2f}" if timed else ""
        lines.append(
            f"| {name} | {_cell(runs, 'accuracy')} | {_cell(runs, 'nll')} | {_cell(runs, 'ece')} | "
            f"{s['epoch_ms']:.3f} | {ratio} | {spread} |"
        )
    return lines


def minibatch_rows(train, test, epochs=EPOCHS, width=HIDDEN, seeds=3, repeats=REPEATS, batch=BATCH):
    """The minibatch protocol's rows: each method of :data:`METHODS` (on minibatches of ``batch``)
    with its grids' point picked on held-out training data (:func:`select`), trained ``seeds``
    times (seed 0 timed in turn with the others, :func:`time_alternately`).

    Returns:
        ``(rows, chosen, tables)``: ``{method: [scores of each seed]}``, the picked points and the
        held-out grids.
    """
    methods = {name: with_batch(m, batch) for name, m in METHODS.items()}
    chosen, tables = {}, {}
    for name, method in methods.items():
        chosen[name], tables[name] = select(method, train, epochs, width)
    timed = time_alternately(
        {name: timed_fit(m, train, test, chosen[name], epochs, width, batch=batch) for name, m in methods.items()},
        repeats,
    )
    rows = {name: [timed[name]] for name in methods}
    (x, y), (xt, yt) = train, test
    for name, method in methods.items():
        trainer = method.trainer(x, y, epochs, **split_settings(method, chosen[name])[0])
        for seed in range(1, seeds):
            carry = fit(method, x, y, chosen[name], epochs, width, seed, trainer=trainer)
            rows[name].append(scores(method.probs(carry, random.PRNGKey(2), xt), np.asarray(yt), np.nan))
    return rows, chosen, tables


#: the small training sets: disjoint runs of this many training images, minibatches of SMALL_BATCH
SMALL_IMAGES, SMALL_BATCH, SMALL_SUBSETS = 300, 32, 4


def small_data_rows(train, test, epochs=EPOCHS, width=HIDDEN, seeds=3, steps=STEPS, images=SMALL_IMAGES,
                    subsets=SMALL_SUBSETS, batch=SMALL_BATCH) -> dict:
    """The minibatch protocol (:func:`minibatch_rows`, settings picked again on each subset's
    held-out fifth) and SVI on ``subsets`` disjoint runs of ``images`` training images: where a
    network can memorise its data, and a posterior's average should pay.

    Returns:
        ``{"batch": batch, "subsets": [(first, stop, rows), ...]}``, ``rows`` as
        :func:`minibatch_rows`' (its time a single run, not alternated) with SVI's row.
    """
    x, y = train
    out = []
    for first in range(0, images * subsets, images):
        part = (x[first:first + images], y[first:first + images])
        rows = minibatch_rows(part, test, epochs, width, seeds, repeats=1, batch=batch)[0]
        rows["SVI AutoNormal (full batch)"] = [svi(part, test, steps)]
        out.append((first, first + images, rows))
    return {"batch": batch, "subsets": out}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m blrppl.bench.deep", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-out", help="output directory (default ./bench-out)")
    p.add_argument("--epochs", type=int, default=EPOCHS,
                   help=f"epochs of minibatches of {BATCH} for Adam and the IVON optimiser (default {EPOCHS})")
    p.add_argument("--width", type=int, default=HIDDEN,
                   help=f"hidden units of their network (default {HIDDEN}; SVI's and blr_fit's keep {HIDDEN})")
    p.add_argument("--seeds", type=int, default=3, help="their runs for the scores' spread (default 3)")
    p.add_argument("--steps", type=int, default=STEPS, help=f"SVI's and blr_fit's full-batch steps (default {STEPS})")
    p.add_argument("--nuts-samples", type=int, default=500, help="NUTS warm-up and draws (default 500)")
    p.add_argument("--repeats", type=int, default=REPEATS,
                   help=f"alternating timed runs of Adam and the IVON optimiser (default {REPEATS})")
    p.add_argument("--small-subsets", type=int, default=SMALL_SUBSETS,
                   help=f"disjoint training sets of {SMALL_IMAGES} images also fitted (default {SMALL_SUBSETS}; 0: none)")
    args = p.parse_args(argv)
    numpyro.enable_x64(False)
    train, test = digits_data()
    digits, chosen, tables = minibatch_rows(train, test, args.epochs, args.width, args.seeds, args.repeats)
    digits["SVI AutoNormal (full batch)"] = [svi(train, test, args.steps)]
    digits["blr_fit (IVON blocks, full batch)"] = [blr(train, test, args.steps)]
    small = None
    if args.small_subsets:
        small = small_data_rows(train, test, args.epochs, args.width, args.seeds, args.steps, subsets=args.small_subsets)
    between = in_between(args.nuts_samples)
    text = report(digits, between, tables, small)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "deep-learning-bench.md").write_text(text)
    print(text)
    print("picked on the held-out fifth of the training set:", chosen)
    blr_row = digits["blr_fit (IVON blocks, full batch)"][0]
    print("blr_fit on digits:", blr_row.get("steps"), "steps,", blr_row.get("families"))


if __name__ == "__main__":
    main()
