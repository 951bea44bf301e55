"""XLA compilations counted in this process, by JAX monitoring listeners registered at the
first use of a counter (never on import)."""

from __future__ import annotations

import contextlib
import threading

import jax

#: XLA compilations since the listeners were registered (a persistent-cache hit is none);
#: index 1 counts those run in :func:`background` (programs nothing waits for yet)
_XLA_COMPILATIONS = [0, 0]
_THREAD = threading.local()
_LISTENING = threading.Lock()
_listening = False


def _counter() -> int:
    return 1 if getattr(_THREAD, "background", False) else 0


def _count_compilation(event: str, duration: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _XLA_COMPILATIONS[_counter()] += 1


def _count_cache_hit(event: str, **_) -> None:
    # JAX's backend-compilation event times a persistent-cache read too (it wraps
    # ``compile_or_get_cached``): a hit, recorded before that event ends, is taken back off
    if event == "/jax/compilation_cache/cache_hits":
        _XLA_COMPILATIONS[_counter()] -= 1
        _THREAD.cache_hits = getattr(_THREAD, "cache_hits", 0) + 1


def listen() -> None:
    """Register the counting listeners with JAX's monitoring, once per process."""
    global _listening
    if _listening:
        return
    with _LISTENING:
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_count_compilation)
            jax.monitoring.register_event_listener(_count_cache_hit)
            _listening = True


def xla_compilations() -> int:
    """The number of XLA compilations in this process since blrppl first counted them (the
    first call of a counter, at the latest a fit's start), those in :func:`background` left
    out (every thread's: a fit's count includes other threads' compilations while it
    compiled)."""
    listen()
    return _XLA_COMPILATIONS[0]


def thread_cache_hits() -> int:
    """The number of JAX persistent-cache reads in this thread since blrppl first counted."""
    listen()
    return getattr(_THREAD, "cache_hits", 0)


def background_compilations() -> int:
    """The number of XLA compilations run in :func:`background` since blrppl first counted."""
    listen()
    return _XLA_COMPILATIONS[1]


@contextlib.contextmanager
def background():
    """Count the XLA compilations in this block (this thread) as background work: programs
    compiled on a worker thread that a fit does not wait for before its first step (its
    diagnostics and posterior export)."""
    listen()
    before = getattr(_THREAD, "background", False)
    _THREAD.background = True
    try:
        yield
    finally:
        _THREAD.background = before
