"""Batched LAPACK calls on the CPU, run in chunks on the calling thread, in blrppl's own
programs.

jaxlib's CPU LAPACK kernels (Cholesky, triangular solve, LU, symmetric eigendecomposition)
split a batch of matrices over XLA's intra-op thread pool once the batch holds about
``_FANOUT_FLOPS`` floating-point operations, and the kernel then waits for its pieces
without working on them. The kernel itself runs on a worker of that same pool, so when
every worker is running such a kernel (two suffice on a two-core machine: two independent
Cholesky factorisations of two mixture components' precisions, say) every worker waits for
pieces that no worker is free to run, and the program never finishes, with every thread
idle. A Gaussian mixture fit with Wishart precisions hung this way while compiling.

The lowering rules here wrap jaxlib's: a batch small enough to stay on the calling thread
is lowered as before; a larger one becomes a loop over chunks that each stay under that
size (``lax.map``), so no kernel ever waits on the pool. One kernel loses the intra-op
split of its batch; independent operations still run concurrently.

The rules are never registered with JAX: :func:`lowering_rules` returns them as overrides
that :mod:`blrppl.runtime.compile` passes when it lowers one of blrppl's programs, so the
user's own programs keep JAX's lowering (docs/runtime.md).
"""

from __future__ import annotations

import functools
import math
import os

import jax.numpy as jnp
from jax import lax

#: jaxlib's LAPACK kernels keep a batch on the calling thread while
#: batch size × FLOPs per matrix stays below this (``GetLapackBatchChunkSize``)
_FANOUT_FLOPS = 200_000


def _complex_factor(aval) -> int:
    return 3 if jnp.issubdtype(aval.dtype, jnp.complexfloating) else 1


# Upper bounds on jaxlib's FLOP estimate per matrix, kernel by kernel (jaxlib/cpu/
# lapack_kernels.cc, 0.10: Cholesky n³/3, LU m n min(m, n), symmetric eigendecomposition
# 5 n³, Hermitian 4 n³ × 3). A bound of 4 n³ for every factorisation was below jaxlib's
# 5 n³ for an eigendecomposition (a chunk of 49 matrices of n = 10 was split by jaxlib
# after all). The Cholesky and LU bounds stay at 4 n³ although jaxlib counts less: with
# chunks of jaxlib's own size a per-group logistic regression (50 groups' 20 × 20
# precisions, one call) took 64 ms a step against 54 ms in chunks of 6; the rows of a
# factor model are factorised by halves instead (families/gaussian.py, _batched_inverse)
def _factorisation_cost(avals, params) -> int:
    m, n = avals[0].shape[-2:]
    return 4 * m * n * max(min(m, n), 1) * _complex_factor(avals[0])


def _eigh_cost(avals, params) -> int:
    n = avals[0].shape[-1]
    return n * n * n * (12 if _complex_factor(avals[0]) == 3 else 5)


def _solve_cost(avals, params) -> int:
    """Rows × columns of the right-hand side block × the triangle's order."""
    a, b = avals[:2]
    rows, cols = b.shape[-2:]
    return rows * cols * a.shape[-1] * _complex_factor(b)


def chunk_size(batch: int, cost: int) -> int:
    """Matrices per chunk so that jaxlib runs each chunk on the calling thread (the whole
    batch when it already does)."""
    if batch * cost < _FANOUT_FLOPS:
        return batch
    return max(1, (_FANOUT_FLOPS - 1) // max(cost, 1))


def _other_platforms(ctx, prim, args, params):
    """``prim`` lowered by JAX's own rules: for a program lowered for another platform than
    the CPU alone (an override rule replaces every platform's rule)."""
    from jax._src.interpreters import mlir

    platforms = tuple(ctx.platforms or ctx.module_context.platforms)
    rules = {p: mlir._platform_specific_lowerings[p][prim].rule for p in platforms if prim in mlir._platform_specific_lowerings[p]}
    default = mlir._lowerings[prim].rule if prim in mlir._lowerings else None
    return mlir.lower_per_platform(ctx, str(prim), rules, default, set(), *args, **params)


def _chunked_rule(prim, lapack_rule, cost_of):
    """A CPU lowering rule for ``prim``: jaxlib's ``lapack_rule`` when the batch stays on the
    calling thread, else a loop over chunks that do."""
    from jax._src.interpreters import mlir

    def rule(ctx, *args, **params):
        if tuple(ctx.platforms or ctx.module_context.platforms) != ("cpu",):
            return _other_platforms(ctx, prim, args, params)
        batch_shape = ctx.avals_in[0].shape[:-2]
        batch = math.prod(batch_shape)
        chunk = chunk_size(batch, cost_of(ctx.avals_in, params))
        # every operand carries the same batch dims (the primitives' shape rules ask so)
        if chunk >= batch or any(a.shape[: len(batch_shape)] != batch_shape for a in ctx.avals_in):
            return lapack_rule(ctx, *args, **params)
        dims = len(batch_shape)

        def chunked(*operands):
            count = -(-batch // chunk)
            pad = count * chunk - batch

            def grouped(x):
                x = x.reshape((batch,) + x.shape[dims:])
                # padding repeats the first matrix: a valid input whatever the operation
                x = jnp.concatenate([x, jnp.broadcast_to(x[:1], (pad,) + x.shape[1:])]) if pad else x
                return x.reshape((count, chunk) + x.shape[1:])

            def one(xs):
                out = prim.bind(*xs, **params)
                return tuple(out) if prim.multiple_results else (out,)

            outs = lax.map(one, tuple(grouped(x) for x in operands))
            outs = [o.reshape((count * chunk,) + o.shape[2:])[:batch] for o in outs]
            outs = [o.reshape(batch_shape + o.shape[1:]) for o in outs]
            return outs if prim.multiple_results else outs[0]

        return mlir.lower_fun(chunked, multiple_results=prim.multiple_results)(ctx, *args)

    return rule


@functools.lru_cache(maxsize=1)
def lowering_rules() -> tuple:
    """``(primitive, rule)`` pairs that lower the batched LAPACK primitives in chunks on the
    CPU (module docstring), wrapping jaxlib's rules as JAX has them registered; for
    ``jax.interpreters.mlir.LoweringParameters(override_lowering_rules=...)``. Empty when
    ``BLRPPL_LAPACK_CHUNKS=0`` or when this JAX does not keep the rules where expected.
    Nothing is registered with JAX."""
    if os.environ.get("BLRPPL_LAPACK_CHUNKS", "1") == "0":
        return ()
    try:
        from jax._src.interpreters import mlir
        from jax._src.lax import linalg

        cpu = mlir._platform_specific_lowerings["cpu"]
        wanted = {
            linalg.cholesky_p: _factorisation_cost,
            linalg.lu_p: _factorisation_cost,
            linalg.eigh_p: _eigh_cost,
            linalg.triangular_solve_p: _solve_cost,
        }
        rules = {p: cpu[p].rule for p in wanted if p in cpu}
    except Exception:  # pragma: no cover - a JAX whose internals moved
        return ()
    return tuple((prim, _chunked_rule(prim, lapack_rule, wanted[prim])) for prim, lapack_rule in rules.items())
