"""Scans whose carries are known ahead, evaluated as maps over their steps
(`blrppl.model.scan_map`): the same values and gradients as the scan as written, for the
carries users' models make (NumPyro's scan: a step counter, the previous state read from
the substituted values, a PRNG key; a carry of two lags), and a true recurrence left as a
scan."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro import handlers
from numpyro.contrib.control_flow import scan

from blrppl.model import scan_map

T = 7


def _scans(jaxpr) -> int:
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "scan"
        for sub in scan_map.subjaxprs(eqn):
            count += _scans(sub)
    return count


def _both(fn, *args):
    """(fn's outputs evaluated as written, as vectorised, scans left in the vectorised
    program)."""
    closed = jax.make_jaxpr(fn)(*args)
    flat = jax.tree.leaves(args)
    written = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *flat)
    jaxpr, consts = scan_map.vectorise(closed.jaxpr, closed.consts)
    mapped = jax.core.eval_jaxpr(jaxpr, consts, *flat)
    return written, mapped, _scans(jaxpr)


def counter_reads_const(xs):
    table = jnp.arange(T * 2.0).reshape(T, 2)

    def body(carry, x):
        i, prev = carry
        row = table[i]
        return (i + 1, x), row * prev + x

    return jax.lax.scan(body, (0, 1.0), xs)


def counter_reads_const_reversed(xs):
    table = jnp.arange(T * 2.0).reshape(T, 2)

    def body(carry, x):
        i, prev = carry
        return (i + 1, x), table[i] * prev - x

    return jax.lax.scan(body, (0, 1.0), xs, reverse=True)


def two_lags(xs):
    """AR(2)-like: the carry holds the last two inputs (the second is the first's last value)."""

    def body(carry, x):
        a, b = carry
        return (x, a), x - 0.5 * a + 0.25 * b

    return jax.lax.scan(body, (0.0, 0.0), xs)


def key_carry(xs):
    def body(carry, x):
        key, prev = carry
        key, sub = random.split(key)
        return (key, x), x * prev + random.normal(sub)

    return jax.lax.scan(body, (random.PRNGKey(0), 0.0), xs)


def nested(xs):
    def inner(c, v):
        return c, jnp.sin(v) * c

    def body(prev, x):
        _, ys = jax.lax.scan(inner, prev, jnp.stack([x, 2 * x, 3 * x]))
        return x, ys.sum()

    return jax.lax.scan(body, 1.0, xs)


def recurrence(xs):
    def body(c, x):
        return jnp.tanh(c) * 0.9 + x, c * x

    return jax.lax.scan(body, 0.5, xs)


# (function, scans left after vectorising)
CASES = [
    (counter_reads_const, 0),
    (counter_reads_const_reversed, 0),
    (two_lags, 0),
    (key_carry, 1),  # (the key's recurrence stays a scan; the rest is mapped)
    (nested, 0),
    (recurrence, 1),
]


@pytest.mark.parametrize("fn,left", CASES, ids=[c[0].__name__ for c in CASES])
def test_values_equal_the_scan(fn, left):
    xs = jnp.linspace(-1.0, 2.0, T)
    written, mapped, scans = _both(fn, xs)
    assert scans == left
    for a, b in zip(written, mapped):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("fn", [c[0] for c in CASES[:3]], ids=[c[0].__name__ for c in CASES[:3]])
def test_gradients_equal_the_scan(fn):
    xs = jnp.linspace(-1.0, 2.0, T)

    def loss(evaluate):
        def f(x):
            closed = jax.make_jaxpr(fn)(xs)
            jaxpr, consts = (closed.jaxpr, closed.consts) if evaluate is None else evaluate(closed.jaxpr, closed.consts)
            outs = jax.core.eval_jaxpr(jaxpr, consts, x)
            return sum(jnp.sum(o**2) for o in outs if jnp.issubdtype(o.dtype, jnp.floating))

        return jax.grad(f)(xs)

    np.testing.assert_allclose(np.asarray(loss(scan_map.vectorise)), np.asarray(loss(None)), rtol=1e-12)


def random_walk(y):
    """A Gaussian random walk observed with noise, one site per step (NumPyro's scan)."""
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))

    def step(prev, y_t):
        x = numpyro.sample("x", dist.Normal(prev, sigma))
        numpyro.sample("y", dist.Normal(x, 0.5), obs=y_t)
        return x, None

    scan(step, 0.0, y)


def hmm(y):
    """A hidden Markov model as NumPyro's examples write it (`trans[prev]`)."""
    trans = numpyro.sample("trans", dist.Dirichlet(jnp.ones((3, 3))).to_event(1))

    def step(prev, y_t):
        z = numpyro.sample("z", dist.Categorical(trans[prev]))
        numpyro.sample("y", dist.Normal(jnp.array([-1.0, 0.0, 1.0])[z], 0.5), obs=y_t)
        return z, None

    scan(step, 0, y)


def _log_joint(model, values, y):
    tr = handlers.trace(handlers.substitute(model, data=values)).get_trace(y)
    return sum(jnp.sum(s["fn"].log_prob(s["value"])) for s in tr.values() if s["type"] == "sample")


@pytest.mark.parametrize(
    "model,values",
    [
        (random_walk, {"sigma": jnp.asarray(0.7), "x": jnp.cumsum(jnp.linspace(-0.3, 0.4, T))}),
        (hmm, {"trans": jnp.array([[0.8, 0.1, 0.1], [0.2, 0.7, 0.1], [0.3, 0.3, 0.4]]), "z": jnp.array([0, 1, 1, 2, 0, 0, 2])}),
    ],
    ids=["random_walk", "hmm"],
)
def test_numpyro_scan_models(model, values):
    """A NumPyro model's log joint with its values substituted: the same with no scan left."""
    y = jnp.asarray(np.random.default_rng(0).normal(size=T))
    written, mapped, scans = _both(lambda v: _log_joint(model, v, y), values)
    assert scans == 0
    np.testing.assert_allclose(float(mapped[0]), float(written[0]), rtol=1e-13)
    floats = {k: v for k, v in values.items() if jnp.issubdtype(v.dtype, jnp.floating)}

    def grad(vectorised):
        def f(v):
            closed = jax.make_jaxpr(lambda w: _log_joint(model, {**values, **w}, y))(floats)
            jaxpr, consts = scan_map.vectorise(closed.jaxpr, closed.consts) if vectorised else (closed.jaxpr, closed.consts)
            return jax.core.eval_jaxpr(jaxpr, consts, *jax.tree.leaves(v))[0]

        return jax.grad(f)(floats)

    for k in floats:
        np.testing.assert_allclose(np.asarray(grad(True)[k]), np.asarray(grad(False)[k]), rtol=1e-12)

