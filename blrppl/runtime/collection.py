"""Python's cyclic garbage collector while a fit is traced and compiled.

Tracing a model with one site per step of a Python loop, and reading its program, builds
millions of long-lived objects (equations, variables, abstract values, element tables).
CPython's collector examines every object of the oldest generation at each full
collection, and the objects made while compiling survive into it: with the default
thresholds the full collections of one compilation cost a third of its time at 3,000
sites, a share that grows with the sites. :func:`fewer_full_collections` raises the
threshold of full collections while blrppl compiles (the young generations are still
collected as usual, so short-lived cycles are freed) and restores the user's thresholds
after.
"""

from __future__ import annotations

import contextlib
import gc

#: while compiling: full collections after this many collections of the middle generation
#: (CPython's default is 10; each middle collection follows 10 young ones of 700
#: allocations, so a full collection waits for some 70 million net allocations)
FULL_COLLECTION_THRESHOLD = 10_000


@contextlib.contextmanager
def fewer_full_collections():
    """Within the block, full collections are rare (see the module docstring); the
    thresholds in force before are restored on leaving it."""
    before = gc.get_threshold()
    if len(before) >= 3 and before[0] > 0:
        gc.set_threshold(before[0], before[1], max(before[2], FULL_COLLECTION_THRESHOLD))
    try:
        yield
    finally:
        gc.set_threshold(*before)
