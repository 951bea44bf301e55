"""Which automatic-differentiation mode the fit's second derivatives use.

blr_fit differentiates the model's log-density twice: Hessian-vector products for the
Monte Carlo messages, Newton steps of point blocks. Forward over reverse (``jax.jvp`` of
``jax.grad``) is the cheap way, and JAX refuses it through a function that defines its
reverse mode only (``jax.custom_vjp``: ``jax.experimental.ode.odeint``, a user's clipped
gradient). Such a model is compiled again in *reverse-only* mode: reverse over reverse,
which needs the custom rule's backward pass to be differentiable in reverse mode (an adjoint
ODE solve is: it is ``odeint`` again). The same products, at more work (each reverse pass
stores the forward pass it differentiates).
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

_REVERSE_ONLY = contextvars.ContextVar("blrppl_reverse_only", default=False)


def reverse_only() -> bool:
    """Whether the model being compiled is differentiated in reverse mode only."""
    return _REVERSE_ONLY.get()


@contextlib.contextmanager
def reverse_only_mode():
    """Compile in reverse-only mode (see the module docstring)."""
    token = _REVERSE_ONLY.set(True)
    try:
        yield
    finally:
        _REVERSE_ONLY.reset(token)


def is_reverse_only_error(exc: BaseException) -> bool:
    """Whether ``exc`` is JAX refusing a forward-mode derivative of a function that has only a
    custom reverse-mode rule (``jax.custom_vjp``)."""
    return isinstance(exc, TypeError) and "custom_vjp" in str(exc) and "forward-mode" in str(exc)


def is_no_reverse_error(exc: BaseException) -> bool:
    """Whether ``exc`` is JAX refusing a reverse-mode derivative (of a ``lax.while_loop``: in
    reverse-only mode, a custom rule's backward pass that loops)."""
    return "Reverse-mode differentiation does not work" in str(exc)


def hvp(f, x, t):
    """∇²f(x) t for a scalar ``f`` of an array ``x``: ``jax.jvp`` of ``jax.grad`` (forward over
    reverse), or in reverse-only mode ∇_x ⟨∇f(x), t⟩ (reverse over reverse; the Hessian is
    symmetric, so both are H t)."""
    if reverse_only():
        return jax.grad(lambda y: jnp.vdot(jax.grad(f)(y), t))(x)
    return jax.jvp(jax.grad(f), (x,), (t,))[1]


def grad_and_hvps(f, x, ts):
    """``(∇f(x), ∇²f(x) t for each t along the leading axis of ts)``: one linearisation of
    ``jax.grad(f)`` at x (forward over reverse: the gradient is its primal output, so ``f`` is
    traced once for the gradient and every product), or in reverse-only mode the gradient
    and :func:`hvp` of each t."""
    if reverse_only():
        return jax.grad(f)(x), jax.vmap(lambda t: hvp(f, x, t))(ts)
    g, products = jax.linearize(jax.grad(f), x)
    return g, jax.vmap(products)(ts)


def hessian_of_grad(fn, x, has_aux: bool = False):
    """The Jacobian of a gradient function ``fn`` at ``x`` (the Hessian): ``jax.jacfwd``, or in
    reverse-only mode ``jax.jacrev``."""
    return (jax.jacrev if reverse_only() else jax.jacfwd)(fn, has_aux=has_aux)(x)
