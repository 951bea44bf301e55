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
