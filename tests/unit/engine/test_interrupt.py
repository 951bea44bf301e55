"""Ctrl-C during a fit stops it at the next chunk boundary with ``KeyboardInterrupt``, even when
Python would drop the interrupt (raised inside a garbage-collection callback, as JAX's are);
the process's SIGINT handling is as it was before and after the fit."""

from __future__ import annotations

import gc
import signal
import threading

import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

from blrppl import blr_fit
from blrppl.engine import loop, run
from blrppl.engine.interrupt import PendingInterrupt, deferred_interrupts

rng = np.random.default_rng(0)
X = rng.normal(size=(50, 2))
Y = (X @ np.array([1.0, -2.0]) + rng.logistic(size=50) > 0).astype(np.float64)


def logistic(x, y):
    """Stochastic BLR on minibatches: it runs to ``num_steps``, chunk after chunk."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    with numpyro.plate("n", x.shape[0], subsample_size=10) as idx:
        numpyro.sample("y", dist.Bernoulli(logits=x[idx] @ w), obs=y[idx])


def sigint_in_a_gc_callback():
    """SIGINT delivered while Python runs a garbage-collection callback: with Python's own
    handler the ``KeyboardInterrupt`` is raised in the callback, printed and dropped."""

    def callback(phase, info):
        if phase == "start":
            gc.callbacks.remove(callback)
            signal.raise_signal(signal.SIGINT)

    gc.callbacks.append(callback)
    gc.collect()


@pytest.fixture
def chunks(monkeypatch):
    """The fit's chunks, counted (with the SIGINT handler each ran under); a SIGINT in a gc
    callback during the first of the test."""
    calls, interrupted = [], []
    run_loop = loop.run_loop

    def counting_run_loop(chunk_fn, *args, **kwargs):
        def chunk(*a):
            calls.append(signal.getsignal(signal.SIGINT))
            out = chunk_fn(*a)
            if not interrupted:
                interrupted.append(True)
                sigint_in_a_gc_callback()
            return out

        return run_loop(chunk, *args, **kwargs)

    monkeypatch.setattr(run, "run_loop", counting_run_loop)
    return calls


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_interrupt_python_would_drop_stops_the_fit_at_the_next_chunk(chunks):
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        blr_fit(logistic, {"x": X, "y": Y}, num_steps=1000, tol=1e-30, rng_key=random.PRNGKey(0), progress_bar=False)
    assert len(chunks) == 1  # (no chunk after the interrupt)
    assert isinstance(chunks[0], PendingInterrupt)
    assert signal.getsignal(signal.SIGINT) is before is signal.default_int_handler
    # and the next fit runs to its end
    chunks.clear()
    result = blr_fit(logistic, {"x": X, "y": Y}, num_steps=250, tol=1e-30, rng_key=random.PRNGKey(0), progress_bar=False)
    assert len(chunks) == 3 and len(result.elbo) == 250


def test_a_second_interrupt_raises_at_once_and_one_left_at_the_end_is_raised():
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupts() as pending:
            signal.raise_signal(signal.SIGINT)  # (recorded)
            assert pending.count == 1
            signal.raise_signal(signal.SIGINT)
            pytest.fail("a second interrupt raises at once")
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupts():
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_users_handler_and_other_threads_are_left_alone():
    seen = []

    def users(signum, frame):
        seen.append(signum)

    previous = signal.signal(signal.SIGINT, users)
    try:
        with deferred_interrupts() as pending:
            assert signal.getsignal(signal.SIGINT) is users
            signal.raise_signal(signal.SIGINT)
            pending.check()
        assert seen == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)
    handlers = []

    def in_thread():
        with deferred_interrupts() as pending:
            handlers.append(signal.getsignal(signal.SIGINT))
            pending.check()

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join()
    assert handlers == [signal.default_int_handler]
