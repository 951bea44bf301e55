"""Stochastic (minibatch) BLR for models with subsampled plates: SVI (Hoffman et al. 2013).

A plate declared ``numpyro.plate(name, N, subsample_size=M)`` makes every latent inside it
*local* (one candidate factor per element, λ kept for all N elements) and every other latent
*global*. Each step

1. takes the next minibatch B of M indices of every subsampled plate from a random
   reshuffling of its N elements (a fresh permutation every ⌊N/M⌋ steps: each element is
   visited once per epoch, no index twice within a step or an epoch). The permutation is
   never stored: it is a keyed bijection of [0, N) (:func:`permuted`, a Feistel network
   over the smallest domain of 4^h ≥ N elements, walked back into [0, N) by cycle
   walking; Black & Rogaway 2002), so the state holds its round keys, not N indices, and a
   step computes the M positions it needs: memory O(M), not O(N), for plates read from
   disk (:class:`blrppl.HostRows`);
2. re-runs the model with B substituted for the plate's subsample (:class:`MinibatchData`),
   so numpyro scales every site inside the plate by N/M;
3. **local step**: gathers λ_b[B] of each local block and sets it, with ρ = 1, to the sum of
   its messages on the minibatch (the scale N/M of the plate is divided out: element n's
   posterior depends on its own factors only),

       λ_b[n] ← Σ_{i ∋ b} λ̃_ib[n],      n ∈ B,

   then scatters it back; elements outside B keep their λ;
4. **global step**, with the fresh local parameters,

       λ_g ← (1 − ρ_t) λ_g + ρ_t (λ̃_prior + (N/M) Σ_{n ∈ B} λ̃_{n→g}),   ρ_t = (t + τ)^−κ,

   (κ = 0.7, τ = 10 by default): the bracket is an unbiased estimate of the full-batch
   message, since the likelihood terms carry the site scale N/M and the priors of global
   blocks carry none (in an online fit, ``prior=``, λ̃_prior is the previous posterior's λ,
   which the step reads beside the minibatch: :func:`minibatch_data`);
5. keeps a tail average of every global block, reported as its posterior: λ̄_g =
   Σ_s (s + 1) λ_g(s) / Σ_s (s + 1) over the steps s since the last-but-one power of two
   (the last half to three quarters of the run: a doubling trick), i.e. Polyak–Ruppert
   averaging with weights growing linearly in the step over a suffix of the run, which
   forgets the transient from the initial state however far it started.

The first step (t = 0) skips the local step: the global blocks move first from the random
initial local parameters of the minibatch, which breaks the symmetry of mixture components
that all start at the same prior mean (the full-batch sequential schedule breaks it the same
way by updating continuous blocks first).

The ELBO of a step is its minibatch estimate: the global factors and entropies plus N/M times
the minibatch's factors and local entropies. It is never used for backtracking; the loop
tests convergence on windowed means of it.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from blrppl.graph import host_rows
from blrppl.graph.data import RunData, host_array, split_run_data
from blrppl.model.functions import MinibatchData

#: forgetting rate κ and delay τ of the default global step size ρ_t = (t + τ)^−κ
SVI_KAPPA = 0.7
SVI_TAU = 10.0
#: rounds of the keyed permutation behind random reshuffling (:func:`permuted`)
ROUNDS = 8


def svi_rate(t, kappa: float = SVI_KAPPA, tau: float = SVI_TAU):
    """ρ_t = (t + τ)^−κ: the default step size of global blocks under subsampling (Robbins–
    Monro for κ ∈ (0.5, 1])."""
    return (t + tau) ** (-kappa)


class MinibatchState(NamedTuple):
    """What subsampling adds to the carried state.

    Attributes:
        order: plate → the round keys of the current epoch's permutation of ``arange(N)``
            (uint32, :data:`ROUNDS`; :func:`permuted`).
        indices: plate → the minibatch of the last step (int32, length M).
        average: global block → average of its natural parameters, weights ∝ t + 1, over
            the current segment of steps [2^k − 1, t].
        weight: Σ (t + 1) over the current segment.
        previous: the same average over the previous segment [2^(k−1) − 1, 2^k − 1).
        previous_weight: its Σ (t + 1).
    """

    order: dict
    indices: dict
    average: dict
    weight: jax.Array
    previous: dict
    previous_weight: jax.Array


def initial_minibatch_state(plan, nat) -> MinibatchState:
    """Zero round keys (new ones drawn at the first step), empty average (built on the host: a
    fit's start compiles nothing)."""
    dtype = jnp.result_type(float)
    glob = {b.name: nat[b.name] for b in plan.blocks if b.local is None}
    return MinibatchState(
        order={p.name: host_array(np.zeros(ROUNDS), np.uint32) for p in plan.subsampled},
        indices={p.name: host_array(np.arange(p.subsample_size), np.int32) for p in plan.subsampled},
        average=glob,
        weight=host_array(0.0, dtype),
        previous=glob,
        previous_weight=host_array(0.0, dtype),
    )


def tail_average(mb: MinibatchState, t, nat: dict) -> MinibatchState:
    """Add λ_g(t) with weight t + 1 to the current segment's average; a segment starts at
    every t = 2^k − 1, when the current one becomes the previous one."""
    dtype = mb.weight.dtype
    start = jnp.bitwise_and(t + 1, t) == 0

    def pick(new, old):
        return jax.tree.map(lambda a, b: jnp.where(start, a, b), new, old)

    previous = pick(mb.average, mb.previous)
    previous_weight = jnp.where(start, mb.weight, mb.previous_weight)
    weight = jnp.where(start, 0.0, mb.weight).astype(dtype)
    weight = weight + (t + 1).astype(dtype)
    gamma = (t + 1).astype(dtype) / weight
    average = {n: jax.tree.map(lambda a, x: a + gamma * (x - a), mb.average[n], nat[n]) for n in mb.average}
    return mb._replace(average=average, weight=weight, previous=previous, previous_weight=previous_weight)


def _mix(x):
    """A uint32 → uint32 mixing function (MurmurHash3's finaliser): each output bit depends on
    every input bit."""
    x = x ^ (x >> 16)
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _feistel(x, keys, half: int):
    """A keyed bijection of [0, 4^half) (uint32): :data:`ROUNDS` Feistel rounds over the two
    halves of ``2 · half`` bits."""
    mask = np.uint32((1 << half) - 1)
    left, right = x >> np.uint32(half), x & mask
    for r in range(ROUNDS):
        left, right = right, left ^ (_mix(right ^ keys[r]) & mask)
    return (left << np.uint32(half)) | right


def permuted(positions, keys, n: int):
    """π(positions) for the permutation π of [0, ``n``) that the round keys ``keys`` (uint32,
    :data:`ROUNDS`) name: the Feistel bijection of the smallest [0, 4^h) holding ``n``,
    applied again to a value until it falls in [0, n) (cycle walking: the walk from a value
    in [0, n) returns to [0, n) at a unique value, so π is a bijection; 4^h < 4n, so the walk
    takes fewer than 4 rounds on average). Int32 positions in, int32 values out."""
    half = max(1, (max(int(n) - 1, 1).bit_length() + 1) // 2)
    keys = jnp.asarray(keys, jnp.uint32)
    first = _feistel(jnp.asarray(positions).astype(jnp.uint32), keys, half)

    def walk(x):
        return jnp.where(x >= n, _feistel(x, keys, half), x)

    return jax.lax.while_loop(lambda x: jnp.any(x >= n), walk, first).astype(jnp.int32)


def draw_minibatch(plan, order: dict, step, key):
    """Random reshuffling: at the start of each epoch (every ⌊N/M⌋ steps) new round keys of a
    permutation (:func:`permuted`); the minibatch is the permutation at the epoch's next M
    positions. Returns (round keys, indices)."""
    keys = jax.random.split(key, max(len(plan.subsampled), 1))
    new_order, indices = {}, {}
    for p, k in zip(plan.subsampled, keys):
        pos = jnp.mod(step, p.steps_per_epoch)
        rounds = jnp.where(pos == 0, jax.random.bits(k, (ROUNDS,), jnp.uint32), order[p.name])
        new_order[p.name] = rounds
        positions = pos * p.subsample_size + jnp.arange(p.subsample_size, dtype=jnp.int32)
        indices[p.name] = permuted(positions, rounds, p.size)
    return new_order, indices


def gather_local(block, nat, indices):
    """λ of a local block at the minibatch elements (the plate axis of every leaf)."""
    idx = indices[block.local.plate]
    return jax.tree.map(lambda x: jnp.take(x, idx, axis=block.nat_axis), nat)


def scatter_local(block, nat_full, nat_batch, indices):
    """Write the minibatch elements of a local block back into its full λ."""
    idx = indices[block.local.plate]
    where = (slice(None),) * block.nat_axis + (idx,)
    return jax.tree.map(lambda x, v: x.at[where].set(v, unique_indices=True), nat_full, nat_batch)


def minibatch_elbo(plan, objective, views_of):
    """ELBO estimate on a minibatch: Σ_i E_q[log f_i] (sites inside subsampled plates scaled
    N/M by numpyro) + Σ_b w_b H(q_b) with w_b = N/M for local blocks (their minibatch
    elements) and 1 for global ones."""

    def elbo(nat, data, key=None):
        views = views_of(plan, nat)
        entropy = 0.0
        for b in plan.blocks:
            h = jnp.sum(b.family.entropy(nat[b.name]))
            entropy = entropy + (h if b.local is None else b.subsample_scale * h)
        return objective(views, data, None, key) + entropy

    return elbo


def global_update(update_block, family, nat, message, rho):
    """The step of a global block: Hoffman's convex combination (1 − ρ) λ + ρ λ̂ whenever
    the message λ̂ is itself a valid natural parameter (as for conjugate factors, where it
    is the posterior given the minibatch scaled to N: the combination is then valid too),
    else the family's update (improved BLR retraction for Gaussians, ρ halved until valid).

    The retraction would add ½ρ² Ĝ S⁻¹ Ĝ (Ĝ = λ̂'s precision − S) to the precision: far from
    the optimum, with Ĝ of the order of N, that is orders of magnitude too confident, and
    the slow decay of ρ_t would keep the run far from the optimum for hundreds of steps.
    """
    plain = jax.tree.map(lambda a, m: (1.0 - rho) * a + rho * m, nat, message)
    usable = family.is_valid(message)
    kept, ok = update_block(family, nat, message, rho)
    return jax.tree.map(lambda p, k: jnp.where(usable, p, k), plain, kept), ok | usable


def minibatch_data(data, indices: dict):
    """The run data of one step on the minibatch ``indices``: the model's data leaves paired
    with the minibatch (:class:`MinibatchData`); an online fit's previous posterior (and any
    factor statistics) kept beside them in a :class:`blrppl.graph.data.RunData`, as the
    objective reads them (the model's data leaves alone are what the model is run on)."""
    model_data, previous, statistics = split_run_data(data)
    batch = MinibatchData(tuple(model_data), indices)
    return RunData(batch, previous, statistics) if (previous or statistics) else batch


def make_minibatch_step(
    plan,
    messages: Callable,
    elbo_fn: Callable,
    update_block: Callable,
    state_type,
    info_type,
    schedule: str,
    global_rate: Callable,
):
    """Build the SVI ``step(state, data, rho) -> (state, info)`` (see the module docstring).

    Args:
        plan: a plan with subsampled plates.
        messages: ``messages(nat, names, data, key)`` → summed messages of the blocks
            ``names`` (minibatch natural parameters, the data of :func:`minibatch_data`).
        elbo_fn: :func:`minibatch_elbo`.
        update_block: ``(family, nat, message, rho) -> (nat, ok)``.
        state_type, info_type: the engine's BLRState and BLRInfo.
        schedule: ``"sequential"`` (one block after another, local blocks first) or
            ``"parallel"`` (all local blocks at once, then all global blocks at once).
        global_rate: t → the step-size factor of global blocks (multiplied by ``rho[b]``
            and the loop's damping).
    """
    blocks = {b.name: b for b in plan.blocks}
    local = tuple(n for n in plan.order if blocks[n].local is not None)
    glob = tuple(n for n in plan.order if blocks[n].local is None)
    # (plates whose data are read from the host, blrppl.graph.host_rows: their next rows read ahead)
    ahead = tuple(p for p in plan.subsampled if p.size in host_rows.lengths())

    def step(state, data, rho):
        t = state.step
        mb = state.minibatch
        key, key_elbo, key_batch, *keys = jax.random.split(state.rng_key, len(plan.order) + 3)
        order, indices = draw_minibatch(plan, mb.order, t, key_batch)
        if ahead:  # (the next step draws from the key this step passes on, as above)
            following = draw_minibatch(plan, order, t + 1, jax.random.split(key, len(plan.order) + 3)[2])[1]
            host_rows.prefetch(tuple(p.size for p in ahead), tuple(following[p.name] for p in ahead))
        batch = minibatch_data(data, indices)
        old = {n: gather_local(blocks[n], state.nat[n], indices) if n in local else state.nat[n] for n in plan.order}
        nat = dict(old)
        dtype = jnp.result_type(float)
        # the first step leaves the local blocks to the global ones (symmetry breaking)
        local_rho = jnp.where(t > 0, 1.0, 0.0).astype(dtype) * state.damping
        global_rho = {n: rho[n] * global_rate(t) * state.damping for n in glob}
        valid = jnp.array(True)

        def local_message(n, msg):
            # numpyro scaled the minibatch's sites by N/M; element n's own factors are unscaled
            return jax.tree.map(lambda m: m / blocks[n].subsample_scale, msg)

        def apply(n, msg):
            if n in local:
                return update_block(blocks[n].family, nat[n], local_message(n, msg), local_rho)
            return global_update(update_block, blocks[n].family, nat[n], msg, global_rho[n])

        if schedule == "parallel":
            groups = [g for g in (local, glob) if g]
            for group, k in zip(groups, keys):
                msgs = messages(nat, group, batch, k)
                for n in group:
                    nat[n], ok = apply(n, msgs[n])
                    valid = valid & ok
        else:
            for n, k in zip(plan.order, keys):
                nat[n], ok = apply(n, messages(nat, (n,), batch, k)[n])
                valid = valid & ok
        elbo = elbo_fn(nat, batch, key_elbo)
        full = {n: nat[n] for n in glob}
        for n in local:
            full[n] = scatter_local(blocks[n], state.nat[n], nat[n], indices)
        averaged = tail_average(mb._replace(order=order, indices=indices), t, nat)
        new_state = state._replace(nat=full, step=t + 1, elbo=elbo, rng_key=key, minibatch=averaged)
        return new_state, info_type(elbo=elbo, valid=valid)

    return step


def averaged_nat(plan, state) -> dict:
    """The fitted natural parameters with the global blocks replaced by their tail averages
    (the local blocks as they are)."""
    mb = state.minibatch
    if mb is None:
        return state.nat
    total = mb.weight + mb.previous_weight
    if not float(total) > 0:
        return state.nat
    wc, wp = mb.weight / total, mb.previous_weight / total
    avg = {n: jax.tree.map(lambda c, p: wc * c + wp * p, mb.average[n], mb.previous[n]) for n in mb.average}
    return {**state.nat, **avg}
