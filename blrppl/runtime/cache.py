"""Where blrppl keeps compiled programs on disk, and JAX's persistent compilation cache,
which blrppl turns on only when asked (:func:`enable_compilation_cache`)."""

from __future__ import annotations

import os
import pathlib

#: environment variable naming blrppl's cache directory (default ``~/.cache/blrppl``, or
#: ``$XDG_CACHE_HOME/blrppl``)
DIR_ENV = "BLRPPL_CACHE_DIR"

#: environment variable that turns blrppl's program store and :func:`enable_compilation_cache`
#: off ("0", "off", "false", "no")
CACHE_ENV = "BLRPPL_COMPILATION_CACHE"


def turned_off() -> bool:
    """Whether ``$BLRPPL_COMPILATION_CACHE`` turns blrppl's caches off."""
    return os.environ.get(CACHE_ENV, "").strip().lower() in ("0", "off", "false", "no")


def cache_dir() -> pathlib.Path:
    """blrppl's cache directory: ``$BLRPPL_CACHE_DIR``, else ``$XDG_CACHE_HOME/blrppl``, else
    ``~/.cache/blrppl``."""
    chosen = os.environ.get(DIR_ENV)
    if chosen:
        return pathlib.Path(chosen).expanduser()
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(root) / "blrppl"


def compilation_cache_dir() -> pathlib.Path:
    """The default directory of JAX's persistent compilation cache when blrppl turns it on:
    ``jax`` in :func:`cache_dir`."""
    return cache_dir() / "jax"


def enable_compilation_cache(path: str | os.PathLike | None = None) -> str | None:
    """Turn on JAX's persistent compilation cache for the whole process, so that running the
    same fit in a new process compiles nothing with XLA again.

    blrppl never does this by itself: it changes JAX's configuration for every program of
    the process, the user's included. JAX's thresholds are lowered so that fits' many small
    compilations are kept too (``jax_persistent_cache_min_compile_time_secs = 0``,
    ``jax_persistent_cache_min_entry_size_bytes = 0``). blrppl's own program store
    (``programs`` in :func:`cache_dir`) is on without this call.

    Args:
        path: the cache directory; by default the one already configured in JAX
            (``jax_compilation_cache_dir``, which is then kept with its thresholds), else
            ``jax`` in blrppl's cache directory (``$BLRPPL_CACHE_DIR``, default
            ``~/.cache/blrppl``).

    Returns:
        the cache directory in use, or None when ``$BLRPPL_COMPILATION_CACHE`` is
        ``0``/``off``/``false`` or the directory cannot be created (nothing is changed then).
    """
    import jax

    if turned_off():
        return None
    if path is None and jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    chosen = pathlib.Path(path).expanduser() if path is not None else compilation_cache_dir()
    try:
        chosen.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: no persistent cache
        return None
    jax.config.update("jax_compilation_cache_dir", str(chosen))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return str(chosen)
