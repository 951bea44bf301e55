"""The refinement's time budget inside one candidate fit.

:mod:`blrppl.engine.refine` gives each candidate a deadline (a ``time.perf_counter()`` value):
the end of ``refine_budget`` times the first fit's time. A grid checks it between its fits; a
single fit (another structure, another start) checks it, through :func:`deadline`'s scope, at
the places where it can stop without leaving anything half done: after its compilation, at
every chunk boundary of its loop (:func:`blrppl.engine.loop.run_loop`) and before its
diagnostics. A candidate past the deadline raises :class:`OverBudget`, which the refinement
reports as that candidate's note; the fits already compared are kept. A fit outside the
refinement has no deadline and never checks.
"""

from __future__ import annotations

import contextlib
import contextvars
import time

_DEADLINE: contextvars.ContextVar = contextvars.ContextVar("blrppl_refinement_deadline", default=None)


class OverBudget(Exception):
    """A candidate fit tried by the refinement (:mod:`blrppl.engine.refine`) ran past its deadline."""


@contextlib.contextmanager
def deadline(at: float | None):
    """Within this scope, :func:`check` raises :class:`OverBudget` once ``time.perf_counter()``
    passes ``at`` (None: no deadline)."""
    token = _DEADLINE.set(at)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def check(where: str) -> None:
    """Raise :class:`OverBudget` (its message: stopped ``where``) when the scope's deadline has passed."""
    at = _DEADLINE.get()
    if at is not None and time.perf_counter() > at:
        raise OverBudget(f"stopped {where}: over the refinement's time budget")
