"""Host evaluation of jaxprs (blrppl.model.host_eval.run): NumPy for the primitives it has, the
primitive itself for the others, call bodies in place. Each case is checked against JAX's own
evaluation of the same program, exactly (float64: the suite's conftest enables it)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blrppl.model import host_eval


def _inner(a, b):
    return a * 2.0 + b[::-1]


CASES = {
    # (function, arguments): the layout and arithmetic of a stacked factor's table
    "affine members": (lambda s: jnp.stack([s[0] * y + s[1] for y in (0.5, -1.0, 2.0)]), (np.array([1.5, -0.25]),)),
    "slices and squeeze": (lambda x: jnp.squeeze(x[1:2, :]) + x[0], (np.arange(6.0).reshape(2, 3),)),
    "broadcast and transpose": (lambda x: jnp.transpose(jnp.broadcast_to(x, (4, 3))) - 1.0, (np.arange(3.0),)),
    "a jitted call": (lambda a, b: jax.jit(_inner)(a, b) * b, (np.arange(3.0), np.ones(3) * 0.5)),
    "concatenate and reshape": (lambda x: jnp.concatenate([x, -x]).reshape(2, 3), (np.arange(3.0),)),
    # exp and a reduction have no NumPy version here: bound by JAX
    "bound primitives": (lambda x: jnp.sum(jnp.exp(x)) * x, (np.linspace(-1.0, 1.0, 4),)),
    "JVP columns under vmap": (
        lambda s: jax.vmap(lambda t: jax.jvp(lambda u: jnp.stack([u * u, 3.0 * u]), (s,), (t,)), out_axes=(None, 0))(
            jnp.eye(2)
        ),
        (np.array([0.5, 2.0]),),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_run_agrees_with_jax(name):
    fn, args = CASES[name]
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    got = host_eval.run(closed.jaxpr, closed.consts, list(args))
    want = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)
    assert len(got) == len(want) == len(jax.tree.leaves(shapes))
    for g, w in zip(got, want):
        assert np.shape(g) == np.shape(w) and np.asarray(g).dtype == np.asarray(w).dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_stack_is_numpy():
    closed = jax.make_jaxpr(lambda a, b: jnp.stack([a, b], axis=1))(np.ones(3), np.zeros(3))
    eqn = closed.jaxpr.eqns[-1]
    assert eqn.primitive.name == "stack"
    out = host_eval.evaluate(eqn, [np.arange(3.0), -np.arange(3.0)])
    np.testing.assert_array_equal(out[0], np.stack([np.arange(3.0), -np.arange(3.0)], axis=1))


#: operations NumPy rounds as XLA does: evaluated on the host (a model's run of one site per
#: step holds thousands of them; bound one by one, each shape was an XLA compilation)
EXACT = {
    "div": lambda x, y: x / y,
    "sqrt": lambda x, y: jnp.sqrt(jnp.abs(x)),
    "square": lambda x, y: jnp.square(x),
    "integer_pow 2": lambda x, y: x**2,
    "integer_pow 7": lambda x, y: x**7,
    "integer_pow -3": lambda x, y: x ** (-3),
    "is_finite": lambda x, y: jnp.isfinite(x / y),
    "reduce_and": lambda x, y: jnp.all(x > y, axis=1),
    "reduce_or": lambda x, y: jnp.any(x > y),
    "reduce_sum of pairs": lambda x, y: jnp.sum(x[:, :2], axis=1),
    "reduce_sum of one": lambda x, y: jnp.sum(x[:, :1], axis=1),
    "reduce_sum of integers": lambda x, y: jnp.sum((x > 0).astype(jnp.int32)),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", sorted(EXACT))
def test_exact_operations_agree_with_jax_bit_for_bit(name, dtype):
    """Random operands, zeros of both signs and a zero divisor: the same bits as JAX's, and
    no primitive bound."""
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(5, 3)) * 3.0).astype(dtype)
    x[0, :2] = [-0.0, -0.0]
    x[1, 0] = 0.0
    y = rng.normal(size=(5, 3)).astype(dtype)
    y[2, 1] = 0.0
    closed = jax.make_jaxpr(EXACT[name])(x, y)
    bound = []
    real = host_eval.bind
    try:
        host_eval.bind = lambda eqn, values: bound.append(eqn.primitive.name) or real(eqn, values)
        got = host_eval.run(closed.jaxpr, closed.consts, [x, y])
    finally:
        host_eval.bind = real
    want = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, x, y)
    assert not [b for b in bound if b != "pjit"], bound
    for g, w in zip(got, want):
        w = np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.atleast_1d(g).view(np.uint8), np.atleast_1d(w).view(np.uint8))


def test_long_sums_and_keys_are_bound():
    """A float sum of more than two elements (NumPy's order of additions is not XLA's) and
    operations on random keys are left to JAX."""
    closed = jax.make_jaxpr(lambda x: jnp.sum(x))(np.ones(5))
    assert host_eval.evaluate(closed.jaxpr.eqns[-1], [np.ones(5)]) is None
    key = jax.random.key(0)
    closed = jax.make_jaxpr(lambda k: jax.random.split(k)[0])(key)
    got = host_eval.run(closed.jaxpr, closed.consts, [key])
    want = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, key)
    np.testing.assert_array_equal(jax.random.key_data(got[0]), jax.random.key_data(want[0]))
