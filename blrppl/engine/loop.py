"""The jitted loop: chunks of steps inside ``lax.while_loop``, convergence and stopping.

A chunk runs up to ``chunk_size`` steps without leaving the device; between chunks the host
updates the progress bar. A run stops when

* the relative ELBO change is at most ``tol`` and the largest relative change of a natural
  parameter is at most ``sqrt(tol)`` (converged), or
* a step would make the ELBO or a natural parameter non-finite: that step is discarded and
  the run ends with the last valid state, or
* ``num_steps`` steps have run.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from blrppl.engine.step import BLRState

CONTINUE, CONVERGED, NONFINITE = 0, 1, 2


class LoopOutcome(NamedTuple):
    state: BLRState
    elbo: np.ndarray
    num_steps: int
    converged: bool
    stop: int
    invalid_steps: int


def _all_finite(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def make_chunk(step, chunk_size: int, tol: float):
    """``chunk(state, data, steps_left, rho) -> (state, elbo buffer, steps run, stop code,
    invalid steps)``; ``rho`` is the per-block step-size dict passed to ``step``."""
    param_tol = math.sqrt(tol)

    def chunk(state, data, steps_left, rho):
        dtype = jnp.result_type(float)
        buf = jnp.full((chunk_size,), jnp.nan, dtype)
        limit = jnp.minimum(steps_left, chunk_size)

        def cond(carry):
            _, i, _, stop, _ = carry
            return (i < limit) & (stop == CONTINUE)

        def body(carry):
            st, i, buf, _, invalid = carry
            new, info = step(st, data, rho)
            finite = jnp.isfinite(info.elbo) & _all_finite(new.nat)
            change = jnp.abs(info.elbo - st.elbo) <= tol * jnp.maximum(1.0, jnp.abs(info.elbo))
            conv = finite & change & (info.max_delta <= param_tol) & (st.step > 0)
            new = jax.tree.map(lambda a, b: jnp.where(finite, b, a), st, new)
            buf = buf.at[i].set(jnp.where(finite, info.elbo, jnp.nan))
            stop = jnp.where(~finite, NONFINITE, jnp.where(conv, CONVERGED, CONTINUE))
            invalid = invalid + jnp.where(info.valid, 0, 1).astype(jnp.int32)
            i = i + jnp.where(finite, 1, 0).astype(jnp.int32)
            return new, i, buf, stop.astype(jnp.int32), invalid

        init = (state, jnp.zeros((), jnp.int32), buf, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))
        state, n, buf, stop, invalid = jax.lax.while_loop(cond, body, init)
        return state, buf, n, stop, invalid

    return chunk


def run_loop(chunk_fn, state: BLRState, data, rho, num_steps: int, chunk_size: int, progress_bar: bool):
    """Run chunks until convergence, a stop, or ``num_steps``."""
    elbos, total, stop, invalid = [], 0, CONTINUE, 0
    bar = None
    if progress_bar:
        try:
            from tqdm.auto import tqdm

            bar = tqdm(total=num_steps, desc="blr", leave=False)
        except ImportError:  # pragma: no cover
            bar = None
    while total < num_steps and stop == CONTINUE:
        state, buf, n, stop_arr, inv = chunk_fn(state, data, jnp.asarray(num_steps - total, jnp.int32), rho)
        n = int(n)
        elbos.append(np.asarray(buf)[:n])
        total += n
        stop = int(stop_arr)
        invalid += int(inv)
        if bar is not None:
            bar.update(n)
            if n:
                bar.set_postfix(elbo=f"{float(elbos[-1][-1]):.4g}")
        if n == 0 and stop == CONTINUE:
            break
    if bar is not None:
        bar.close()
    elbo = np.concatenate(elbos) if elbos else np.zeros((0,))
    return LoopOutcome(state, elbo, total, stop == CONVERGED, stop, invalid)
