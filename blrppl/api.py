"""``blr_fit``: fit a NumPyro model by the Bayesian learning rule."""

from __future__ import annotations

import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from blrppl import families as fam
from blrppl.engine.loop import CONVERGED, NONFINITE, make_chunk, run_loop
from blrppl.engine.step import BLRState, make_step
from blrppl.errors import BLRError
from blrppl.graph.compile import compile_model, init_nat
from blrppl.graph.trace import trace_model
from blrppl.result import BLRResult, site_distribution

_SCHEDULES = ("sequential", "parallel")
#: default ρ of blocks with a factor whose message depends on the block itself
NONCONJUGATE_RHO = 0.5


def _split_data(data):
    if data is None:
        return (), {}
    if isinstance(data, dict):
        return (), dict(data)
    if isinstance(data, (tuple, list)):
        return tuple(data), {}
    raise BLRError(
        f"data must be a dict of model keyword arguments or a tuple of positional ones, "
        f"not {type(data).__name__}"
    )


def _perturbed_nat(block, nat, key):
    """A different valid λ for a block (used to test conjugacy)."""
    family = block.family
    view = family.view(nat)
    if block.discrete:
        probs = jax.random.dirichlet(key, jnp.ones(view.probs.shape[-1]), view.probs.shape[:-1])
        return family.nat_from_view(type(view)(probs))
    if block.kind == "gaussian":
        return family.nat_from_view(
            fam.GaussianView(view.mean + 0.3 * jax.random.normal(key, view.mean.shape), 1.7 * view.cov)
        )
    if block.kind == "gaussian-diag":
        return family.nat_from_view(
            fam.DiagGaussianView(view.mean + 0.3 * jax.random.normal(key, view.mean.shape), 1.7 * view.var)
        )
    scale = jnp.exp(0.3 * jax.random.normal(key, jax.tree.leaves(view)[0].shape))
    return family.nat_from_view(type(view)(*[leaf * (1.3 + 0.2 * scale) for leaf in view]))


def _detect_conjugate(plan, messages, nat, data, key) -> dict:
    """A block is conjugate when its incoming messages do not change with its own λ."""
    names = tuple(plan.order)
    fn = jax.jit(lambda n, d: messages(n, names, d))
    base = fn(nat, data)
    tol = 1e-6 if jnp.result_type(float) == jnp.float64 else 1e-3
    out = {}
    for key_b, b in zip(jax.random.split(key, len(plan.blocks)), plan.blocks):
        other = dict(nat)
        other[b.name] = _perturbed_nat(b, nat[b.name], key_b)
        moved = fn(other, data)[b.name]
        same = all(
            bool(jnp.allclose(x, y, rtol=tol, atol=tol))
            for x, y in zip(jax.tree.leaves(base[b.name]), jax.tree.leaves(moved))
        )
        out[b.name] = same
    return out


def blr_fit(
    model: Callable,
    data=None,
    *,
    num_steps: int | None = None,
    learning_rate: float | Callable | None = None,
    schedule: str | None = None,
    families: dict | None = None,
    rng_key=None,
    tol: float | None = None,
    progress_bar: bool = True,
) -> BLRResult:
    """Fit the latent variables of a NumPyro model by the Bayesian learning rule.

    Every latent gets a candidate posterior from an exponential family chosen by its support
    (Gaussian, Gamma, Beta, Dirichlet, Categorical/Bernoulli) and all are fitted by

        λ_b ← (1 − ρ) λ_b + ρ Σ_{i ∋ b} ∇_{μ_b} E_q[log f_i]

    in one jitted loop. For conjugate models one step with ρ = 1 is the exact posterior; for
    conditionally conjugate models the sequential schedule is variational message passing.

    Args:
        model: a NumPyro model.
        data: the model's arguments: a dict of keyword arguments or a tuple of positional ones.
        num_steps: the most steps to run (default 1000).
        learning_rate: ρ, a float or a callable of the step number. By default ρ = 1 for
            blocks whose messages do not depend on their own parameters (conjugate) and
            0.5 for the others.
        schedule: ``"sequential"`` (default; one block at a time with the newest
            neighbours, i.e. VMP) or ``"parallel"`` (all blocks from the same state).
        families: optional overrides, site → family name (``"gaussian"``,
            ``"gaussian-diag"``, ``"gamma"``, ``"beta"``, ``"dirichlet"``,
            ``"categorical"``, ``"bernoulli"``).
        rng_key: a ``jax.random`` key (initialisation of discrete blocks, probes).
        tol: convergence tolerance on the relative ELBO change (default 1e-8 in float64,
            1e-5 in float32); natural parameters must also move less than ``sqrt(tol)``.
        progress_bar: show a progress bar.

    Returns:
        :class:`blrppl.BLRResult`.
    """
    t0 = time.perf_counter()
    args, kwargs = _split_data(data)
    schedule = schedule or "sequential"
    if schedule not in _SCHEDULES:
        raise BLRError(f"schedule must be one of {_SCHEDULES}, not {schedule!r}")
    num_steps = 1000 if num_steps is None else int(num_steps)
    if num_steps < 1:
        raise BLRError("num_steps must be at least 1")
    x64 = jnp.result_type(float) == jnp.float64
    tol = (1e-8 if x64 else 1e-5) if tol is None else float(tol)
    rng_key = jax.random.key(0) if rng_key is None else rng_key
    k_trace, k_probe, k_init, k_conj = jax.random.split(rng_key, 4)

    records = trace_model(model, args, kwargs, k_trace)
    plan, fns, dyn_data, init_values, graph = compile_model(
        model, records, args, kwargs, families=families, rng_key=k_probe
    )
    init_keys = jax.random.split(k_init, len(plan.blocks))
    nat0 = {b.name: init_nat(b, init_values[b.name], k) for b, k in zip(plan.blocks, init_keys)}

    step, elbo_fn, messages = make_step(plan, fns, schedule, lambda n, t: 1.0)
    if learning_rate is None:
        conj = _detect_conjugate(plan, messages, nat0, dyn_data, k_conj)
        rhos = {n: 1.0 if c else NONCONJUGATE_RHO for n, c in conj.items()}
        rho_fn = lambda n, t: rhos[n]  # noqa: E731
    elif callable(learning_rate):
        conj = {}
        rho_fn = lambda n, t: learning_rate(t)  # noqa: E731
    else:
        conj = {}
        rate = float(learning_rate)
        if not 0.0 < rate <= 1.0:
            raise BLRError(f"learning_rate must be in (0, 1], not {rate}")
        rho_fn = lambda n, t: rate  # noqa: E731
    plan = type(plan)(plan.blocks, plan.factors, plan.order, tuple(conj.items()))
    step, _, _ = make_step(plan, fns, schedule, rho_fn)

    chunk_size = min(num_steps, 100)
    chunk = make_chunk(step, chunk_size, tol)
    dtype = jnp.result_type(float)
    state = BLRState(nat=nat0, step=jnp.zeros((), jnp.int32), elbo=jnp.asarray(jnp.nan, dtype))
    compiled = jax.jit(chunk).lower(state, dyn_data, jnp.asarray(num_steps, jnp.int32)).compile()
    t1 = time.perf_counter()
    outcome = run_loop(compiled, state, dyn_data, num_steps, chunk_size, progress_bar)
    jax.block_until_ready(outcome.state)
    t2 = time.perf_counter()

    if outcome.stop == CONVERGED:
        message = f"converged after {outcome.num_steps} steps (relative ELBO change below {tol:g})"
    elif outcome.stop == NONFINITE:
        message = (
            f"stopped after {outcome.num_steps} steps: the next step made the ELBO or a natural "
            "parameter non-finite; the last valid state is returned"
        )
    else:
        message = f"reached num_steps={num_steps} without meeting the convergence test"
    if outcome.invalid_steps:
        message += (
            f"; in {outcome.invalid_steps} step(s) a block found no valid update and kept its "
            "parameters"
        )
    nat = outcome.state.nat
    posterior = {
        b.name: site_distribution(b, nat[b.name], records[b.name].event_ndim) for b in plan.blocks
    }
    return BLRResult(
        posterior=posterior,
        elbo=np.asarray(outcome.elbo),
        num_steps=outcome.num_steps,
        converged=outcome.converged,
        message=message,
        plan=plan,
        nat=nat,
        compile_time=t1 - t0,
        run_time=t2 - t1,
        graph=graph,
    )
