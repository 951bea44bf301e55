"""How blrppl lowers, compiles, counts and caches its own programs, without changing JAX's
configuration for the rest of the process (docs/runtime.md).

* :mod:`blrppl.runtime.compile` — lowering and compiling blrppl's programs, with the XLA
  scheduler option and the chunked LAPACK lowering applied to them alone.
* :mod:`blrppl.runtime.lapack` — the chunked lowering of batched LAPACK calls.
* :mod:`blrppl.runtime.program_store` — compiled programs kept on disk.
* :mod:`blrppl.runtime.counting` — XLA compilations counted.
* :mod:`blrppl.runtime.cache` — cache directories, and :func:`blrppl.enable_compilation_cache`.
"""
