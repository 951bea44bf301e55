"""Ctrl-C during a fit's loop, kept until the loop can act on it.

Python raises ``KeyboardInterrupt`` wherever the main thread happens to run Python code when
SIGINT arrives; during a fit that is now and then one of JAX's garbage-collection callbacks,
whose exceptions Python prints and drops ("Exception ignored in ..."), and the fit then ran
to its end (about one first fit in eight). While a fit's loop runs, :func:`deferred_interrupts`
replaces Python's default SIGINT handler by one that records the interrupt; the loop asks
(:meth:`PendingInterrupt.check`) between chunks, and ``KeyboardInterrupt`` is raised there, in
the loop. The compiled chunk holds the main thread in XLA anyway: Python's handler could run
no earlier. A second Ctrl-C before the next chunk boundary raises at once.

Nothing else in the user's process changes: the handler is installed only on the main
thread, only in place of Python's own (a handler of the user's, or SIGINT ignored, is left
as it is), and restored when the loop ends.
"""

from __future__ import annotations

import contextlib
import signal
import threading


class PendingInterrupt:
    """The SIGINT handler of a fit's loop: it counts interrupts, raising only at a second
    one; :meth:`check` raises ``KeyboardInterrupt`` for a recorded one."""

    def __init__(self):
        self.count = 0

    def __call__(self, signum, frame):
        self.count += 1
        if self.count > 1:
            self.count = 0
            raise KeyboardInterrupt

    def check(self) -> None:
        """Raise ``KeyboardInterrupt`` if an interrupt arrived since the last check."""
        if self.count:
            self.count = 0
            raise KeyboardInterrupt


class _NoHandler:
    """Where no handler of blrppl's is installed: interrupts are Python's (or the user's)."""

    def check(self) -> None:
        """Nothing to raise: interrupts arrive as their handler delivers them."""


@contextlib.contextmanager
def deferred_interrupts():
    """While the block runs, SIGINT is recorded and raised as ``KeyboardInterrupt`` at the
    block's :meth:`PendingInterrupt.check` calls (and at its end, if one is left).

    Yields:
        the handler (:class:`PendingInterrupt`), or an object whose ``check`` does nothing
        when SIGINT is not Python's default handler's to replace (another thread, a handler
        of the user's). Inside another such block, that block's handler.
    """
    if threading.current_thread() is not threading.main_thread():
        yield _NoHandler()
        return
    current = signal.getsignal(signal.SIGINT)
    if isinstance(current, PendingInterrupt):  # (a loop inside a loop: one handler)
        yield current
        return
    if current is not signal.default_int_handler:
        yield _NoHandler()
        return
    pending = PendingInterrupt()
    signal.signal(signal.SIGINT, pending)
    try:
        yield pending
        pending.check()
    finally:
        if signal.getsignal(signal.SIGINT) is pending:
            signal.signal(signal.SIGINT, current)
