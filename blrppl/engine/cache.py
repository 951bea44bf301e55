"""The cache of compiled fits, keyed by what can change the answer: the model's traced
program (its fingerprint), the data's layout and static values, the options, a previous
fit's block layout and the float precision (:func:`cache_key`), and the key of a fit's
programs in the on-disk program store (:func:`stored_fit_key`).

:data:`COMPILE_LOCK` is held while a model is traced and compiled (numpyro's effect
handlers keep one process-wide stack).
"""

from __future__ import annotations

import collections
import hashlib
import threading

import jax
import jax.numpy as jnp
import numpy as np

from blrppl import families as fam
from blrppl.graph.data import STORED_STATIC_BYTES
from blrppl.runtime.program_store import program_key
from blrppl.rules import user_rules


#: held while a model is traced and compiled, and while posteriors are exported (numpyro's
#: effect handlers live on one process-wide stack: two threads must not run models at once)
COMPILE_LOCK = threading.RLock()


#: compiled fits, most recent last
_CACHE: "collections.OrderedDict" = collections.OrderedDict()


CACHE_SIZE = 16


def _program_parts(tracer, dyn, options, prior_spec) -> tuple:
    """What a compiled fit depends on besides the model function: the fingerprint of its
    traced program (its code path and every value it closes over), the data's structure,
    static values and array shapes, the options, the previous fit's block layout (online
    fits) and the float precision. A model that needs concrete data (``len(set(x))``,
    ``y[y > 0]``, ``int(x.max())``, ``if`` on a data value) holds its data in its compiled
    fit: they are static values, keyed by a digest of their bytes (new data, a new fit)."""
    spec = tracer.spec
    shapes = tuple((jnp.shape(x), jnp.result_type(x)) for x in dyn)
    return (
        tracer.fingerprint, spec.treedef, spec.static_key(), shapes, options.compiled(), prior_spec,
        jnp.result_type(float), user_extensions(),
    )


def user_extensions() -> tuple:
    """The rules and families registered from outside blrppl (compared by identity): a
    registration changes the plan, so the compiled-fit cache keys them."""
    return fam.user_families() + user_rules()


def cache_key(program, tracer, dyn, options, prior_spec):
    """Hashable key of the compiled-fit cache in memory (the model function, from its
    program's :attr:`~blrppl.model.program.ModelProgram.identity`, and
    :func:`_program_parts`), or None if something is unhashable (then nothing is cached)."""
    key = (program.identity, *_program_parts(tracer, dyn, options, prior_spec))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def data_digest(dyn) -> str:
    """A digest of the values of the model's array data."""
    h = hashlib.blake2b(digest_size=16)
    for x in dyn:
        x = np.asarray(x)
        h.update(f"{x.dtype}{x.shape}".encode())
        h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()


def stored_fit_key(tracer, dyn, options, prior_spec, supports, plan) -> str | None:
    """The key of a compiled fit's programs in the program store
    (:mod:`blrppl.runtime.program_store`): :func:`_program_parts`, the sites' static facts
    (names, distributions, event dims, plates, supports, ``infer``), the latents' support
    values and the plan; None when the fit is not stored (a user's rules or families, or a
    model holding more than :data:`STORED_STATIC_BYTES` of concrete data)."""
    if user_extensions() or tracer.spec.static_bytes() > STORED_STATIC_BYTES:
        return None  # (the store's key hashes blrppl's source, not a user's rules and families)
    parts = _program_parts(tracer, dyn, options, prior_spec)
    return program_key(parts, tracer.meta.get("sites"), supports, plan.describe(), plan.structure_digest())


def support_signature(records) -> tuple:
    """The values of every latent's support parameters (those computed from the data differ
    between data sets of the same shape; a compiled fit holds the bijections they give)."""
    out = []
    for name, r in records.items():
        if r.observed:
            continue
        for x in jax.tree.leaves(r.support):
            arr = np.asarray(x)
            out.append((name, arr.shape, arr.tobytes()))
    return tuple(out)


def lookup(key):
    """The compiled fit cached under ``key`` (None: none, or an uncacheable key)."""
    return _CACHE.get(key) if key is not None else None


def forget(key) -> None:
    """Drop the compiled fit cached under ``key`` (a compilation that failed)."""
    _CACHE.pop(key, None)


def clear() -> None:
    """Drop every cached compiled fit."""
    _CACHE.clear()


def remember(key, bundle) -> None:
    """Cache ``bundle`` under ``key``, dropping the least recently added beyond
    :data:`CACHE_SIZE`."""
    _CACHE[key] = bundle
    while len(_CACHE) > CACHE_SIZE:
        _CACHE.popitem(last=False)
