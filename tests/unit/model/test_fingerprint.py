"""The fingerprint of a traced model: equal for the same program, different for any change
of an operation, its parameters, its wiring, a shape or a constant; computed without
printing the program (issue 55: printing a model of 1,000 sites took seconds)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import random
from jax.extend import core as jex_core

from blrppl.model.fingerprint import program_fingerprint
from blrppl.model.trace import trace_program

numpyro.enable_x64()


def _fingerprint(fn, *args):
    return program_fingerprint(jax.make_jaxpr(fn)(*args))


def test_same_program_same_fingerprint():
    x = jnp.arange(3.0)
    assert _fingerprint(lambda a: jnp.sin(a) * 2.0, x) == _fingerprint(lambda b: jnp.sin(b) * 2.0, x)


def test_any_change_changes_the_fingerprint():
    x, y = jnp.arange(3.0), jnp.ones(3)
    programs = [
        (lambda a, b: a - b, (x, y)),
        (lambda a, b: b - a, (x, y)),  # (the wiring: same operations, same types)
        (lambda a, b: a + b, (x, y)),
        (lambda a, b: a - 2.0 * b, (x, y)),
        (lambda a, b: a - 3.0 * b, (x, y)),  # (a literal)
        (lambda a, b: jnp.sum(a - b), (x, y)),
        (lambda a, b: jnp.sum(a - b, keepdims=True), (x, y)),  # (a parameter)
        (lambda a, b: a - b, (jnp.arange(4.0), jnp.ones(4))),  # (a shape)
        (lambda a, b: a - b, (x.astype(jnp.float32), y.astype(jnp.float32))),  # (a dtype)
        (lambda a, b: a - jnp.asarray(np.arange(3.0)), (x, y)),  # (a constant)
        (lambda a, b: a - jnp.asarray(np.arange(3.0) + 1), (x, y)),
        (lambda a, b: jax.lax.scan(lambda c, t: (c + t, c * t), 0.0, a - b)[1], (x, y)),
        (lambda a, b: jax.lax.scan(lambda c, t: (c + t, c - t), 0.0, a - b)[1], (x, y)),  # (a sub-program)
    ]
    prints = [_fingerprint(fn, *args) for fn, args in programs]
    assert len(set(prints)) == len(prints)


def regression(x, y=None):
    w = numpyro.sample("w", dist.Normal(jnp.zeros(x.shape[1]), 1.0).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.StudentT(4.0, jax.nn.softplus(x @ w), sigma), obs=y)


def test_fingerprint_does_not_print_the_program(monkeypatch):
    def refuse(self):
        raise AssertionError("the program was printed")

    monkeypatch.setattr(jex_core.Jaxpr, "__str__", refuse)
    x = random.normal(random.PRNGKey(1), (20, 3))
    tracer = trace_program(regression, (x, jnp.ones(20)), {}, random.PRNGKey(0))
    assert len(tracer.fingerprint) == 40


_IN_PROCESS = """
import jax, jax.numpy as jnp, numpyro
numpyro.enable_x64()
from jax import random
from tests.unit.model.test_fingerprint import regression
from blrppl.model.trace import trace_program
x = random.normal(random.PRNGKey(1), (20, 3))
print(trace_program(regression, (x, jnp.ones(20)), {}, random.PRNGKey(0)).fingerprint)
"""


def test_fingerprint_is_the_same_in_another_process():
    """The program store keys a fit by it across processes (custom derivative rules hold
    functions, printed with their addresses; numpyro orders some fields by hash)."""
    x = random.normal(random.PRNGKey(1), (20, 3))
    here = trace_program(regression, (x, jnp.ones(20)), {}, random.PRNGKey(0)).fingerprint
    root = pathlib.Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", _IN_PROCESS], capture_output=True, text=True, check=True, cwd=root, env=env
    )
    assert out.stdout.split()[-1] == here


def _rule(backward):
    @jax.custom_vjp
    def link(x):
        return jnp.logaddexp(x, 0.0)

    link.defvjp(lambda x: (link(x), x), backward)
    return link


def _linked(link):
    def model(y):
        s = numpyro.sample("s", dist.HalfNormal(1.0))
        numpyro.sample("y", dist.Poisson(link(s)), obs=y)

    return model


def test_custom_vjp_rules_of_the_same_name_and_program_differ():
    """Two ``jax.custom_vjp`` functions with the same primal program and backward passes both
    named ``<lambda>`` (JAX prints only the name): one fit's compiled program served the other,
    whose rule JAX cannot differentiate twice, and the fit ran instead of naming it. The same
    rule traced twice keeps its fingerprint (its fits are reused in this process)."""
    plain = _rule(lambda x, g: (g * jax.nn.sigmoid(x),))
    looped = _rule(lambda x, g: (g * jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (jax.nn.sigmoid(x), c[1] + 1), (x, 0))[0],))
    y = jnp.ones(5)
    prints = [trace_program(_linked(f), (y,), {}, random.PRNGKey(0)).fingerprint for f in (plain, looped, plain)]
    assert prints[0] != prints[1] and prints[0] == prints[2]


def _scaled_by(c):
    def scaled(x):
        return np.asarray(x * c, dtype=np.float32)

    return scaled


def _called(callback):
    def model(y):
        s = numpyro.sample("s", dist.Normal(0.0, 1.0))
        mean = jax.pure_callback(callback, jax.ShapeDtypeStruct((), jnp.float32), s)
        numpyro.sample("y", dist.Normal(mean, 1.0), obs=y)

    return model


def test_callbacks_of_the_same_name_differ():
    """Two ``jax.pure_callback`` functions of one name closing over other values (printed
    with their addresses, which the fingerprint masks): they shared a fingerprint, and a fit
    of one would have run the other's function."""
    once, twice = _scaled_by(1.0), _scaled_by(2.0)
    y = jnp.ones(3)
    prints = [trace_program(_called(f), (y,), {}, random.PRNGKey(0)).fingerprint for f in (once, twice, once)]
    assert prints[0] != prints[1] and prints[0] == prints[2]
