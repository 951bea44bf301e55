"""Importance-corrected summaries and draws: q's draws reweighted towards the posterior.

With x_s ~ q and log w_s = log p(x_s, y) − log q(x_s) (the weights behind the fit's PSIS k̂,
:mod:`blrppl.posterior.diagnostics`), self-normalised importance sampling estimates any
posterior expectation as

    E_p[f] ≈ Σ_s w̃_s f(x_s) / Σ_s w̃_s,

where w̃ are the Pareto-smoothed weights (Vehtari, Simpson, Gelman, Yao & Gabry 2024, §3):
the M = ⌈min(S/5, 3√S)⌉ largest raw weights are replaced by the expected order statistics of
the generalised Pareto fitted to them,

    w̃_(S−M+z) = w_cut + σ/k · ((1 − (z − ½)/M)^(−k) − 1),   z = 1 … M,

capped at the largest raw weight. The estimate is reliable where k̂ ≤ 0.7 (the weights'
variance is finite and the smoothing's bias small); beyond, it is not used
(:data:`RELIABLE_KHAT`). Draws corrected for use as samples are drawn from the S weighted
draws with probabilities w̃_s / Σ w̃ (sampling importance resampling, Rubin 1988): they
repeat, so S is taken at least four times the draws asked for.

Which is the default: ``BLRResult.summary`` corrects by default where the weights are
reliable, since its means, sds and quantiles are then closer to the posterior's than q's (on
the draws the fit already evaluates for k̂, at the cost of the model at S draws);
``BLRResult.sample`` returns q's draws by default, so that its draws, ``result.posterior``,
``result.guide`` and ``Predictive`` over the guide describe the same distribution and are
independent (resampled draws repeat: an effective sample size below their number), and
corrects with ``importance=True``.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from blrppl.posterior.diagnostics import KHAT_WARN, gpd_fit

#: PSIS k̂ up to which the corrected estimates are used (Vehtari et al. 2024: beyond 0.7 the
#: importance sampling estimate's error is not controlled)
RELIABLE_KHAT = KHAT_WARN

#: resampled draws come from at least this many times as many weighted draws
OVERSAMPLE = 4


def psis_smooth(log_weights) -> tuple:
    """``(smoothed log-weights normalised to sum 1, k̂)`` of importance log-weights: the
    largest M replaced by the generalised Pareto's expected order statistics (module
    docstring). Weights that are all equal are returned as they are (k̂ = −∞); any that is
    not finite gives k̂ = ∞ and the raw weights."""
    lw = np.asarray(log_weights, dtype=float).ravel()
    if lw.size < 10 or not np.all(np.isfinite(lw)):
        return lw - np.log(max(lw.size, 1)), math.inf
    lw = lw - lw.max()
    if lw.min() > -1e-6:
        return np.full(lw.size, -math.log(lw.size)), -math.inf
    n = lw.size
    tail = int(math.ceil(min(0.2 * n, 3.0 * math.sqrt(n))))
    order = np.argsort(lw)
    cutoff = max(lw[order[-tail - 1]], np.log(np.finfo(float).tiny))
    top = order[lw[order] > cutoff]
    if top.size <= 4:
        return lw - _logsumexp(lw), math.inf
    exceed = np.exp(lw[top]) - math.exp(cutoff)
    k, sigma = gpd_fit(exceed)
    z = np.arange(1, top.size + 1, dtype=float)
    p = (z - 0.5) / top.size
    if abs(k) < 1e-12:
        quantiles = -sigma * np.log1p(-p)
    else:
        quantiles = sigma / k * ((1.0 - p) ** (-k) - 1.0)
    smoothed = lw.copy()
    smoothed[top] = np.log(np.minimum(math.exp(cutoff) + quantiles, 1.0))  # (1: the largest raw weight)
    return smoothed - _logsumexp(smoothed), k


def _logsumexp(x):
    top = x.max()
    return top + np.log(np.sum(np.exp(x - top)))


def weighted_draws(source, key, min_draws: int) -> tuple:
    """``(draws, log-weights)``: at least ``min_draws`` weighted draws of q from ``source``
    (``key → (log-weights (S,), site → (S, *shape))``), called with keys folded from ``key``."""
    parts, total, i = [], 0, 0
    while total < min_draws:
        log_w, draws = source(jax.random.fold_in(key, i))
        parts.append((np.asarray(log_w, dtype=float), {k: np.asarray(v) for k, v in draws.items()}))
        total += parts[-1][0].size
        i += 1
    log_w = np.concatenate([lw for lw, _ in parts])
    draws = {k: np.concatenate([d[k] for _, d in parts]) for k in parts[0][1]}
    return draws, log_w


def resample(key, draws: dict, log_weights, num_samples: int) -> dict:
    """``num_samples`` draws from the weighted draws, each chosen with probability its
    normalised smoothed weight ``exp(log_weights)`` (with replacement)."""
    p = np.exp(np.asarray(log_weights, dtype=float))
    index = np.asarray(jax.random.choice(key, p.size, (int(num_samples),), p=p / p.sum()))
    return {k: np.asarray(v)[index] for k, v in draws.items()}


def weighted_stats(x, log_weights, prob: float) -> dict:
    """Mean, sd, median and central ``prob`` interval of draws ``x`` (leading axis) under the
    normalised weights ``exp(log_weights)``: the self-normalised importance estimates."""
    x = np.asarray(x, dtype=float)
    w = np.exp(np.asarray(log_weights, dtype=float))
    w = w / w.sum()
    wb = w.reshape((-1,) + (1,) * (x.ndim - 1))
    mean = np.sum(wb * x, axis=0)
    sd = np.sqrt(np.maximum(np.sum(wb * (x - mean) ** 2, axis=0), 0.0))
    lo_q, hi_q = 50 * (1 - prob), 50 * (1 + prob)
    flat = x.reshape(x.shape[0], -1)
    order = np.argsort(flat, axis=0)
    cum = np.cumsum(w[order], axis=0)  # (per column, the weight up to each sorted draw)

    def quantile(q):
        cols = np.arange(flat.shape[1])
        rows = order[np.argmax(cum >= q - 1e-12, axis=0), cols]
        return flat[rows, cols].reshape(x.shape[1:])

    return {
        "mean": mean,
        "sd": sd,
        "median": quantile(0.5),
        f"{lo_q:.1f}%": quantile(lo_q / 100),
        f"{hi_q:.1f}%": quantile(hi_q / 100),
    }
