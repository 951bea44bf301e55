"""Helpers shared by the closed-form rules (private)."""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax.scipy.special import xlog1py, xlogy

from blrppl.moments import Const

#: log(2π)
LOG_2PI = math.log(2.0 * math.pi)


def const_value(arg):
    """The array of an argument the rule only accepts as :class:`~blrppl.moments.Const`."""
    if not isinstance(arg, Const):
        raise TypeError(f"expected a constant argument, got kind {arg.kind!r}")
    return arg.value


def _floating(x):
    """``x`` as a float array: integer counts would give ``xlogy``'s derivative rule a float0
    tangent when the other argument is differentiated (a constant that depends on a point
    block)."""
    x = jnp.asarray(x)
    return x if jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(jnp.result_type(float))


def x_expect_log(x, arg):
    """x · E[log arg], with 0 · log 0 = 0 for a constant ``arg`` (as numpyro's ``xlogy``)."""
    if isinstance(arg, Const):
        return xlogy(_floating(x), arg.value)
    return x * arg.expect_log()


def x_expect_log1m(x, arg):
    """x · E[log(1 − arg)], with 0 · log 0 = 0 for a constant ``arg``."""
    if isinstance(arg, Const):
        return xlog1py(_floating(x), -arg.value)
    return x * arg.expect_log1m()


def batch_shape(*args, event_ndim: int = 0):
    """Broadcast batch shape of moment objects, dropping ``event_ndim`` trailing dims of each."""
    shapes = []
    for arg in args:
        shape = tuple(arg.shape)
        shapes.append(shape[: len(shape) - event_ndim] if event_ndim else shape)
    return lax.broadcast_shapes(*shapes)


def broadcast_batch(out, shape):
    """``out`` broadcast to the factor's batch shape (a no-op when it already has it)."""
    out = jnp.asarray(out)
    if out.shape == tuple(shape):
        return out
    return jnp.broadcast_to(out, lax.broadcast_shapes(out.shape, tuple(shape)))
