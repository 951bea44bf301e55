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

The store is a cache and never blocks a fit: a store that cannot be read or written (a
read-only directory, a file where a directory should be, a full disk), a damaged entry, or
an entry this jaxlib cannot load is passed over, the program compiled instead, with at most
one warning per process (:class:`ProgramStoreWarning`). A damaged entry is removed where
the directory allows it; an executable JAX's own persistent cache gave is compiled once more
for the store (it cannot be stored itself: see :func:`_compile_and_store`), so that the
store refills; temporary files of writes cut short are removed when the store prunes.
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
import time
import warnings

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

#: the file name suffix of an entry being written; one older than :data:`STALE_SECONDS`
#: is a write cut short (a full disk, a killed process) and is removed when the store prunes
TMP_SUFFIX = ".tmp"
STALE_SECONDS = 3600.0


class ProgramStoreWarning(UserWarning):
    """blrppl's program store could not be used; programs are compiled instead."""


_WARNED = []

#: programs loaded from and written to the store by this process
COUNTS: "collections.Counter[str]" = collections.Counter()


def directory() -> pathlib.Path | None:
    """Where compiled programs are kept, or None when the store is off."""
    if turned_off():
        return None
    try:
        return cache_dir() / "programs"
    except (OSError, RuntimeError):  # (a home directory that cannot be found)
        return None


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


def _fault(root: pathlib.Path, exc: BaseException) -> None:
    """Warn, once per process, that the store at ``root`` could not be used."""
    COUNTS["faults"] += 1
    if _WARNED:
        return
    _WARNED.append(True)
    warnings.warn(
        f"blrppl's program store at {root} could not be used ({type(exc).__name__}: {exc}); "
        "its programs are compiled instead, which only costs time. Make the directory writable, "
        "point $BLRPPL_CACHE_DIR at another one, or set BLRPPL_COMPILATION_CACHE=0 to turn the store off.",
        ProgramStoreWarning,
        stacklevel=2,
    )


def _read(root: pathlib.Path, path: pathlib.Path):
    """The entry at ``path`` unpickled, or None when it is absent or cannot be read; a
    damaged entry is removed (to be written anew) where the directory allows it."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError as exc:  # a file in the path, an unreadable entry or directory
        _fault(root, exc)
        return None
    try:
        payload, in_tree, out_tree, signature = pickle.loads(data)
        return payload, in_tree, out_tree, signature
    except Exception:  # damaged (a write cut short, garbage)
        _discard(root, path)
        return None


def _discard(root: pathlib.Path, path: pathlib.Path) -> None:
    """Remove a damaged entry, to be written anew; in a read-only store it is left (and
    compiled again each time)."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        _fault(root, exc)


def load(key: str | None, args):
    """The stored program of ``key`` if it takes ``args`` (arrays or shape-dtype structs,
    as a tuple of positional arguments), else None. Never raises: a fault of the store
    is a miss."""
    root = directory()
    if key is None or root is None:
        return None
    path = root / (key + SUFFIX)
    if not _handlers_ready():
        return None
    entry = _read(root, path)
    if entry is None:
        return None
    payload, in_tree, out_tree, signature = entry
    try:
        if signature != _signature((tuple(args), {})):
            return None
        from jax.experimental import serialize_executable

        # (on the default device, where it was compiled: JAX's default is every device of
        # the backend, and with several, 8 host devices or GPUs, the program then waits for
        # one shard of each argument per device and fails at its first call)
        compiled = serialize_executable.deserialize_and_load(
            payload, in_tree, out_tree, execution_devices=jax.devices()[:1]
        )
    except Exception:  # damaged inside, or from a jaxlib that cannot load it: compiled again
        _discard(root, path)
        return None
    with contextlib.suppress(OSError):  # (recently used; a read-only store still serves it)
        os.utime(path)
    COUNTS["loaded"] += 1
    return compiled


def _serialised(compiled, args) -> bytes | None:
    """The bytes of an entry holding ``compiled``, or None for a program that cannot be kept
    (a host callback points into this process; a program with hoisted constants)."""
    try:
        from jax.experimental import serialize_executable

        unloaded = compiled._executable._unloaded_executable
        if unloaded.host_callbacks or unloaded.ordered_effects or unloaded.unordered_effects:
            return None
        payload, in_tree, out_tree = serialize_executable.serialize(compiled)
        return pickle.dumps((payload, in_tree, out_tree, _signature((tuple(args), {}))))
    except Exception:
        return None


def store(key: str | None, compiled, args) -> None:
    """Keep ``compiled`` (called with ``args``) under ``key``; programs that cannot be
    serialised are skipped, and a store that cannot be written is passed over (with one
    warning per process). Never raises."""
    root = directory()
    if key is None or root is None:
        return
    data = _serialised(compiled, args)
    if data is None:
        return
    temporary = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, suffix=TMP_SUFFIX, delete=False) as f:
            temporary = f.name
            f.write(data)
        os.replace(temporary, root / (key + SUFFIX))
        temporary = None
        COUNTS["stored"] += 1
    except OSError as exc:  # read-only, a file in the path, a full disk
        _fault(root, exc)
        return
    finally:
        if temporary is not None:  # (a write cut short leaves nothing behind)
            with contextlib.suppress(OSError):
                os.unlink(temporary)
    _prune(root)


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
    """Remove the least recently used entries beyond :data:`MAX_ENTRIES` and
    :data:`MAX_BYTES`, and temporary files older than :data:`STALE_SECONDS`; files another
    process removes meanwhile, and files that cannot be removed, are passed over."""
    now = time.time()
    entries = []
    try:
        paths = list(root.iterdir())
    except OSError:
        return
    for path in paths:
        try:
            stat = path.stat()
            if path.name.endswith(TMP_SUFFIX):
                if now - stat.st_mtime > STALE_SECONDS:
                    path.unlink(missing_ok=True)
            elif path.name.endswith(SUFFIX):
                entries.append((stat, path))
        except OSError:
            continue
    entries.sort(key=lambda e: -e[0].st_mtime)
    total = 0
    for i, (stat, path) in enumerate(entries):
        total += stat.st_size
        if i >= MAX_ENTRIES or total > MAX_BYTES:
            with contextlib.suppress(OSError):
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
        if thread_cache_hits() != hits:
            # an executable read from JAX's persistent cache serialises without its kernels:
            # it would load, then fail at its first call; only fresh ones are stored
            return _refill(key, lowered, options, args, compiled)
    store(key, compiled, args)
    return compiled


#: an XLA option that changes the key JAX's persistent cache gives a program and nothing in
#: the program: the CPU compiler ignores this GPU option (on a GPU it would set the compiler's
#: thread count). Its values :data:`_REFILL_SALTS` are tried in turn, so that a program
#: refilled before (its salted compilation now in JAX's cache too) is refilled again.
_REFILL_OPTION = "xla_gpu_force_compilation_parallelism"
_REFILL_SALTS = (1, 2, 3)


def _present(path: pathlib.Path) -> bool:
    """Whether the entry ``path`` exists (a path that cannot be read: taken as present, not refilled)."""
    try:
        return path.exists()
    except OSError:
        return True


def _refill(key, lowered, options, args, compiled):
    """``compiled`` came from JAX's persistent cache: a program the store should hold (its
    key is stable, the store is on) but does not (it was evicted, damaged, or never
    written) is compiled once more afresh, with :data:`_REFILL_OPTION` so that JAX's cache
    misses, and stored; so the store refills after a damaged entry. Returns the program to
    use (``compiled`` unless a fresh one was made)."""
    root = directory()
    if key is None or root is None or jax.devices()[0].platform != "cpu" or _present(root / (key + SUFFIX)):
        return compiled
    for salt in _REFILL_SALTS:
        hits = thread_cache_hits()
        try:
            fresh = compile_lowered(lowered, {**(options or {}), _REFILL_OPTION: salt})
        except Exception:  # (nothing lost: the program from JAX's cache is used)
            return compiled
        if thread_cache_hits() == hits:
            store(key, fresh, args)
            return fresh
    return compiled
