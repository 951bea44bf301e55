"""Where a fit with enumerated discrete latents starts (mixtures, change points, EM).

Variational message passing on a mixture converges to the optimum of the basin it starts
in, and the labels of a mixture's components are arbitrary unless the prior tells them
apart. So the first sweep is chosen from the model:

* **E-step under the prior.** The discrete blocks are updated first, from the continuous
  blocks at their starting point (the prior means): with component priors that differ
  (``locs ~ Normal([-5, 0, 5], 2)``) every datum starts with the component its prior puts
  nearest, and the fit lands in the prior-ordered basin.
* **k-means++ when the prior cannot tell components apart.** If that E-step leaves two
  values of a discrete block with identical responsibilities for every datum (an
  exchangeable prior: ``locs ~ Normal(0, 10).expand([K])``), the symmetry cannot be broken
  by the updates themselves: the block starts instead from hard assignments to K seeds
  chosen by k-means++ (Arthur & Vassilvitskii 2007) among the standardised observations of
  the factors in the block's plate, and the continuous blocks are updated first from them.
  (Without usable observations: random responsibilities.)

``num_starts`` > 1 (:func:`blrppl.blr_fit`) adds starts of the second kind from other keys
and keeps the fit with the best ELBO.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from blrppl.graph.data import host_array

#: responsibilities of two values closer than this for every datum are tied
TIE_TOL = 1e-8
#: weight of the assigned value in a k-means++ start (the rest is spread evenly)
SEED_WEIGHT = 0.9


def discrete_probs(plan, nat) -> dict:
    """Block → responsibilities ``(*batch, K)`` of every discrete block (on the host: no
    program compiled for them)."""
    return {b.name: b.family.view(jax.tree.map(np.asarray, nat[b.name])).probs for b in plan.blocks if b.discrete}


def tied(probs: np.ndarray) -> bool:
    """Whether two values of a discrete block have the same responsibilities everywhere."""
    flat = probs.reshape(-1, probs.shape[-1])
    k = flat.shape[-1]
    for i in range(k):
        for j in range(i + 1, k):
            if np.all(np.abs(flat[:, i] - flat[:, j]) <= TIE_TOL * (np.abs(flat[:, i]) + TIE_TOL)):
                return True
    return False


def features(plan, records, block) -> np.ndarray | None:
    """Per element of a discrete block with one plate axis: the standardised observed values
    of the factors that enumerate it, ``(N, F)`` (None when it has no such factor or layout)."""
    record = records[block.members[0].name if block.members else block.name]
    shape = block.full.value_shape
    if len(shape) != 1 or len(record.plates) != 1:
        return None
    plate = record.plates[0].name
    n = shape[0]
    cols = []
    for f in plan.factors:
        if block.name not in f.discrete or not f.observed or f.name not in records:
            continue
        r = records[f.name]
        axes = dict(zip([p.name for p in r.plates], r.plate_axes()))
        if plate not in axes:
            continue
        y = np.asarray(r.init_value, dtype=float)
        if y.shape[axes[plate]] != n:
            continue
        cols.append(np.moveaxis(y, axes[plate], 0).reshape(n, -1))
    if not cols:
        return None
    x = np.concatenate(cols, axis=1)
    sd = x.std(0)
    x = (x - x.mean(0)) / np.where(sd > 0, sd, 1.0)
    return x if np.all(np.isfinite(x)) else None


def chain_features(plan, records, block) -> np.ndarray | None:
    """Per position of a hidden Markov chain block: the standardised observed values of the
    factors whose elements each read one position (its emissions), ``(P, F)``; positions no
    such element reads (an initial state, masked steps) take the columns' means, 0 once
    standardised. None when no factor reads the chain so."""
    n = int(np.prod(block.full.value_shape))
    cols = []
    for f in plan.factors:
        reads = dict(f.enumeration.chain_reads).get(block.name) if f.enumeration is not None else None
        if reads is None or not f.observed or f.name not in records:
            continue
        lo, hi = np.ravel(reads.lo), np.ravel(reads.hi)
        y = np.asarray(records[f.name].init_value, dtype=float)
        if lo.size == 0 or y.size % lo.size:
            continue
        y = y.reshape(lo.size, -1)
        one = (hi < 0) & (lo >= 0) & (lo < n)
        col = np.full((n, y.shape[1]), np.nan)
        col[lo[one]] = y[one]
        cols.append(col)
    if not cols:
        return None
    x = np.concatenate(cols, axis=1)
    seen = np.isfinite(x)
    if not np.any(seen):
        return None
    count = np.maximum(seen.sum(0), 1)
    mean = np.where(seen, x, 0.0).sum(0) / count
    sd = np.sqrt(np.where(seen, (x - mean) ** 2, 0.0).sum(0) / count)
    x = np.where(seen, (x - mean) / np.where(sd > 0, sd, 1.0), 0.0)
    return x


def kmeans_pp_probs(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Responsibilities ``(N, k)`` of hard assignments to k seeds chosen by k-means++."""
    n = x.shape[0]
    seeds = [int(rng.integers(n))]
    dist2 = np.sum((x - x[seeds[0]]) ** 2, axis=1)
    for _ in range(1, k):
        total = dist2.sum()
        nxt = int(rng.choice(n, p=dist2 / total)) if total > 0 else int(rng.integers(n))
        seeds.append(nxt)
        dist2 = np.minimum(dist2, np.sum((x - x[nxt]) ** 2, axis=1))
    d = np.stack([np.sum((x - x[s]) ** 2, axis=1) for s in seeds], axis=1)
    nearest = np.argmin(d, axis=1)
    probs = np.full((n, k), (1.0 - SEED_WEIGHT) / max(k - 1, 1))
    probs[np.arange(n), nearest] = SEED_WEIGHT if k > 1 else 1.0
    return probs


def seeded_probs(plan, records, rng: np.random.Generator) -> dict:
    """k-means++ responsibilities for every discrete block that has features (a hidden
    Markov chain: its emissions per position, :func:`chain_features`), random ones
    (Dirichlet(1) rows) for the others."""
    out = {}
    for b in plan.blocks:
        if not b.discrete:
            continue
        k = len(b.support_values)
        x = chain_features(plan, records, b) if b.chain else features(plan, records, b)
        if x is not None and x.shape[0] >= k:
            out[b.name] = kmeans_pp_probs(x, k, rng).reshape(tuple(b.full.value_shape) + (k,))
        else:
            out[b.name] = rng.dirichlet(np.ones(k), size=b.full.value_shape)
    return out


def estep_first(chunk, plan, state, data, history, tol: float):
    """The state after one sweep that updates only the discrete blocks (ρ = 1 for them, 0
    for the others), with its step counter reset."""
    dtype = jnp.result_type(float)
    rho = {n: host_array(1.0 if plan.block(n).discrete else 0.0, dtype) for n in plan.order}
    new = chunk(state, data, host_array(1, np.int32), rho, history, host_array(tol, dtype))[0]
    return new._replace(step=state.step, elbo=state.elbo, damping=state.damping)
