"""Compiled programs kept on disk, so that a new process running the same fit neither traces,
lowers nor compiles them again.

JAX's persistent compilation cache (:func:`blrppl.enable_compilation_cache`, off unless
the user turns it on) skips XLA's work, but it is keyed by the lowered program: a new process still traces every
program in Python and lowers it to look it up, most of a small model's first-fit time.
This store is keyed by what a program is built from, known before it is traced:

    key = hash(program name, model program fingerprint, data layout and shapes, options,
               the plan, blrppl's source, jax's version and trace configuration, device, XLA flags)

and holds the executable (``jax.experimental.serialize_executable``) with its argument and
result structures. Like JAX's cache, an entry is a pickle that loads machine code: the store
trusts its directory as it trusts the installed packages. A stored program is used only when its argument structure, shapes and
dtypes are those of the call at hand; anything that cannot be keyed stably (a part whose
``repr`` holds an object address, e.g. a user's callable option) or serialised (a program
with hoisted constants) is simply not stored. Entries live in ``programs`` of blrppl's
cache directory (``$BLRPPL_CACHE_DIR``, default ``~/.cache/blrppl``:
:func:`blrppl.runtime.cache.cache_dir`), at most :data:`MAX_ENTRIES` of them and
:data:`MAX_BYTES` in all (the least recently used go first); ``BLRPPL_COMPILATION_CACHE=0``
turns the store off.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import enum
import functools
import hashlib
import os
import pathlib
import pickle
import tempfile

import jax
import numpy as np

from blrppl.runtime.cache import cache_dir, turned_off
from blrppl.runtime.compile import Program, compile_lowered
from blrppl.runtime.counting import background, thread_cache_hits

#: entries kept, and their total size; beyond either the least recently used are removed
#: when a new one is written
MAX_ENTRIES = 256
MAX_BYTES = 256 * 2**20

#: the file name suffix of an entry
SUFFIX = ".xla"

#: programs loaded from and written to the store by this process
COUNTS: "collections.Counter[str]" = collections.Counter()


def directory() -> pathlib.Path | None:
    """Where compiled programs are kept, or None when the store is off."""
    if turned_off():
        return None
    return cache_dir() / "programs"


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
    """A hash of blrppl's own source: a stored program is only reused by the code that built it."""
    root = pathlib.Path(__file__).resolve().parents[1]
    digest = hashlib.blake2b(digest_size=16)
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _plain(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str, enum.Enum, tuple))


def _environment() -> tuple:
    """What else a program's executable depends on: versions, device, precision and XLA flags."""
    device = jax.devices()[0]
    import jaxlib

    try:  # (every configuration value jax's own tracing cache is keyed by)
        context = tuple(v for v in jax._src.config.trace_context() if _plain(v))
    except Exception:
        context = (jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision, jax.config.jax_default_prng_impl)
    return (
        jax.__version__,
        jaxlib.__version__,
        device.platform,
        device.device_kind,
        getattr(device.client, "platform_version", ""),
        len(jax.devices()),
        context,
        os.environ.get("XLA_FLAGS", ""),
        _source_digest(),
    )


def program_key(*parts) -> str | None:
    """The store's key of a program built from ``parts``, or None when they have no stable
    text (an object printed by its address differs from process to process)."""
    text = repr((parts, _environment()))
    if " at 0x" in text:
        return None
    return hashlib.blake2b(text.encode(), digest_size=24).hexdigest()


def fit_program_key(fit_key: str | None, name: str, options) -> str | None:
    """The key of a fit's program ``name`` compiled with XLA ``options``, from the fit's own
    key (None: not stored)."""
    return program_key(name, fit_key, options) if fit_key else None


def jit(fn, name: str) -> Program:
    """``jax.jit`` of ``fn`` as one of blrppl's programs (:class:`blrppl.runtime.compile.Program`:
    lowered with blrppl's rules) under the name ``name`` tagged with blrppl's source hash. The name
    is part of JAX's persistent-cache key: a program compiled by this blrppl for the store is
    never one JAX's cache kept for another version (an executable read from that cache is
    not stored, see :func:`compile_program`)."""

    def program(*args, **kwargs):
        return fn(*args, **kwargs)

    program.__name__ = program.__qualname__ = f"blrppl_{name}_{_source_digest()[:10]}"
    return Program(program)


def _signature(args) -> tuple:
    """The argument structure and leaf types a program is called with."""
    leaves, tree = jax.tree.flatten(args)
    return tree, tuple(
        (tuple(np.shape(x)), str(getattr(x, "dtype", None) or np.asarray(x).dtype), bool(getattr(x, "weak_type", False)))
        for x in leaves
    )


def load(key: str | None, args):
    """The stored program of ``key`` if it takes ``args`` (arrays or shape-dtype structs,
    as a tuple of positional arguments), else None."""
    root = directory()
    if key is None or root is None:
        return None
    path = root / (key + SUFFIX)
    if not _handlers_ready():
        return None
    try:
        with open(path, "rb") as f:
            payload, in_tree, out_tree, signature = pickle.load(f)
    except FileNotFoundError:
        return None
    except Exception:  # damaged (e.g. a write cut short): removed, to be written anew
        path.unlink(missing_ok=True)
        return None
    try:
        if signature != _signature((tuple(args), {})):
            return None
        from jax.experimental import serialize_executable

        compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
        os.utime(path)  # (recently used)
        COUNTS["loaded"] += 1
        return compiled
    except Exception:  # from a jaxlib that cannot load it: compiled again
        return None


def store(key: str | None, compiled, args) -> None:
    """Keep ``compiled`` (called with ``args``) under ``key``; programs that cannot be
    serialised, and a store that cannot be written, are skipped."""
    root = directory()
    if key is None or root is None:
        return
    try:
        from jax.experimental import serialize_executable

        unloaded = compiled._executable._unloaded_executable
        if unloaded.host_callbacks or unloaded.ordered_effects or unloaded.unordered_effects:
            return  # (a host callback points into this process)
        payload, in_tree, out_tree = serialize_executable.serialize(compiled)
        data = pickle.dumps((payload, in_tree, out_tree, _signature((tuple(args), {}))))
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, suffix=".tmp", delete=False) as f:
            f.write(data)
        os.replace(f.name, root / (key + SUFFIX))
        COUNTS["stored"] += 1
        _prune(root)
    except Exception:
        return


@functools.lru_cache(maxsize=1)
def _handlers_ready() -> bool:
    """Register the CPU's LAPACK kernels, as lowering a linear-algebra operation does: a
    program loaded without being lowered in this process would otherwise call kernels that
    were never registered (a crash, not an error). False (nothing is loaded) if this jax has
    no such hook."""
    try:
        from jax._src.lax import linalg

        linalg.initialize_lapack()
    except Exception:
        return False
    return True


def _prune(root: pathlib.Path) -> None:
    entries = sorted(((p.stat(), p) for p in root.glob("*" + SUFFIX)), key=lambda e: -e[0].st_mtime)
    total = 0
    for i, (stat, path) in enumerate(entries):
        total += stat.st_size
        if i >= MAX_ENTRIES or total > MAX_BYTES:
            path.unlink(missing_ok=True)


def compile_program(key: str | None, lower, args, options: dict | None, submit=None, background=False):
    """A compiled program: read from the store, or lowered here (``lower(*args)``, tracing in
    Python) and compiled with XLA ``options`` (on a worker thread when ``submit`` is given,
    which then returns a future), then stored.

    Args:
        key: :func:`program_key` of the program (None: neither read nor stored).
        lower: ``args → jax.stages.Lowered``, or a traced program, which is lowered as
            one of blrppl's (:func:`blrppl.runtime.compile.lower`).
        args: the program's positional arguments (arrays or shape-dtype structs).
        options: XLA compiler options.
        submit: ``submit(fn, *args) → future`` running a compilation on a worker thread.
        background: count the compilation as background work (see
            :func:`blrppl.runtime.counting.background`): nothing waits for it before a fit's first step.

    Returns:
        the compiled program, or with ``submit`` a future of it.
    """
    found = load(key, args)
    if found is not None:
        if submit is None:
            return found
        done = concurrent.futures.Future()
        done.set_result(found)
        return done
    lowered = lower(*args)
    if submit is None:
        return _compile_and_store(key, lowered, options, args, background)
    return submit(_compile_and_store, key, lowered, options, args, background)


def _compile_and_store(key, lowered, options, args, in_background=False):
    hits = thread_cache_hits()
    with background() if in_background else contextlib.nullcontext():
        compiled = compile_lowered(lowered, options)
    if thread_cache_hits() == hits:
        # (an executable read from JAX's persistent cache serialises without its kernels:
        # it would load, then fail at its first call; only fresh ones are stored)
        store(key, compiled, args)
    return compiled
