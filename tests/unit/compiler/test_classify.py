"""The class of each distribution argument, read off the model's program: its form
(:mod:`blrppl.model.forms`) and which elements of its blocks it reads
(:mod:`blrppl.compiler.reads`), as a table of expressions and their hand-worked classes.

Each expression is a function of the latent values and the data; its class is what the
compiler's classification (:func:`blrppl.compiler.classify.argument_class`) gives it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blrppl import families as fam
from blrppl.compiler.classify import argument_class
from blrppl.compiler.blocks import blocks_by_site
from blrppl.compiler.reads import ElementReads
from blrppl.graph.plan import Block
from blrppl.model import forms as fm
from blrppl.model.deps import output_forms

N = 6


def make_blocks():
    return {
        # dense Gaussian, no plate
        "w": Block("w", fam.GaussianDense(3), "gaussian", (3,)),
        "b": Block("b", fam.GaussianDense(1), "gaussian", ()),
        # Gaussian with one independent element per group (plate axis 0)
        "a": Block("a", fam.GaussianDense(1), "gaussian", (4,), (0,)),
        # plated Gaussian with a 2-d event: value (4, 2), plate axis 0
        "v": Block("v", fam.GaussianDense(2), "gaussian", (4, 2), (0,)),
        # plate axis not leading: value (2, 4), plate axis 1
        "u": Block("u", fam.GaussianDense(2), "gaussian", (2, 4), (1,)),
        "tau": Block("tau", fam.Gamma(), "gamma", (4,)),
        "s": Block("s", fam.Gamma(), "gamma", ()),
        "p": Block("p", fam.Beta(), "beta", (3,)),
        "pi": Block("pi", fam.Dirichlet(3), "dirichlet", (3,)),
        "rows": Block("rows", fam.Dirichlet(3), "dirichlet", (2, 3)),
        "z": Block("z", fam.Categorical(4), "categorical", (N,), (), (0, 1, 2, 3)),
    }


def make_data():
    rng = np.random.default_rng(0)
    return (
        jnp.asarray(rng.normal(size=(N, 3))),  # X
        jnp.asarray(np.arange(N) % 4),  # group, into 4
        jnp.asarray(np.array([2, 0, 1, 1, 2, 0])),  # idx, into 3
        jnp.asarray(rng.uniform(0.5, 2.0, size=N)),  # positive constants
        jnp.asarray(np.array([1, 0, 1, 1, 0, 0])),  # row index, into 2
    )


# (name, function of (values, data), structural dependencies, expected kind, expected blocks,
#  expected full)
CASES = [
    # constants
    ("data only", lambda v, d: d[0].sum(1), (), "const", (), ()),
    ("discrete only", lambda v, d: jnp.asarray([0.0, 1.0, 2.0, 3.0])[v["z"]], ("z",), "const", (), ()),
    # affine in Gaussian blocks
    ("X @ w + b", lambda v, d: d[0] @ v["w"] + v["b"], ("w", "b"), "affine_gaussian", ("w", "b"), ()),
    ("a[group]", lambda v, d: v["a"][d[1]], ("a",), "affine_gaussian", ("a",), ()),
    ("a[group] * x - w0", lambda v, d: v["a"][d[1]] * d[3] - v["w"][0], ("a", "w"), "affine_gaussian", ("a", "w"), ()),
    ("a.sum()", lambda v, d: v["a"].sum(), ("a",), "affine_gaussian", ("a",), ("a",)),
    ("cumsum(a)", lambda v, d: jnp.cumsum(v["a"]), ("a",), "affine_gaussian", ("a",), ("a",)),
    ("v[group] @ c", lambda v, d: v["v"][d[1]] @ jnp.array([1.0, -2.0]), ("v",), "affine_gaussian", ("v",), ()),
    ("u[:, group].T", lambda v, d: v["u"][:, d[1]].T, ("u",), "affine_gaussian", ("u",), ()),
    ("u.sum(1)", lambda v, d: v["u"].sum(1), ("u",), "affine_gaussian", ("u",), ("u",)),
    ("where(data, w, -w)", lambda v, d: jnp.where(d[0] > 0, v["w"], -v["w"]), ("w",), "affine_gaussian", ("w",), ()),
    ("a[z]", lambda v, d: v["a"][v["z"]], ("a", "z"), "affine_gaussian", ("a",), ()),
    # not affine
    ("w**2", lambda v, d: v["w"] ** 2, ("w",), "opaque", ("w",), ()),
    # (the exp of an affine Gaussian is log-normal; a product of two blocks is bilinear)
    ("exp(w)", lambda v, d: jnp.exp(v["w"]), ("w",), "exp_gaussian", ("w",), ()),
    # piecewise linear: zero second derivative almost everywhere, caught by the secant test
    ("abs(w)", lambda v, d: jnp.abs(v["w"]), ("w",), "opaque", ("w",), ()),
    ("relu(w)", lambda v, d: jax.nn.relu(v["w"]), ("w",), "opaque", ("w",), ()),
    ("w0 * w1", lambda v, d: v["w"][0] * v["w"][1], ("w",), "opaque", ("w",), ()),
    ("a[group] * b", lambda v, d: v["a"][d[1]] * v["b"], ("a", "b"), "bilinear_gaussian", ("a", "b"), ()),
    ("a.sum() * b", lambda v, d: v["a"].sum() * v["b"], ("a", "b"), "opaque", ("a", "b"), ()),
    # powers of a Gamma block
    ("1/sqrt(tau)", lambda v, d: 1 / jnp.sqrt(v["tau"]), ("tau",), "power_gamma", ("tau",), ()),
    ("tau[group]", lambda v, d: v["tau"][d[1]], ("tau",), "power_gamma", ("tau",), ()),
    ("2*tau**3", lambda v, d: 2 * v["tau"] ** 3, ("tau",), "power_gamma", ("tau",), ()),
    ("x / tau[group]", lambda v, d: d[3] / v["tau"][d[1]], ("tau",), "power_gamma", ("tau",), ()),
    ("broadcast scalar s", lambda v, d: jnp.full(N, 1.0) / v["s"], ("s",), "power_gamma", ("s",), ()),
    ("tau + 1", lambda v, d: v["tau"] + 1, ("tau",), "opaque", ("tau",), ()),
    ("-tau", lambda v, d: -v["tau"], ("tau",), "opaque", ("tau",), ()),
    ("exp(tau)", lambda v, d: jnp.exp(v["tau"]), ("tau",), "opaque", ("tau",), ()),
    ("maximum(tau, 1)", lambda v, d: jnp.maximum(v["tau"], 1.0), ("tau",), "opaque", ("tau",), ()),
    ("tau * tau[::-1]", lambda v, d: v["tau"] * v["tau"][::-1], ("tau",), "opaque", ("tau",), ()),
    # Beta block itself
    ("p", lambda v, d: v["p"], ("p",), "beta", ("p",), ()),
    ("p[idx]", lambda v, d: v["p"][d[2]], ("p",), "beta", ("p",), ()),
    ("1 - p", lambda v, d: 1 - v["p"], ("p",), "opaque", ("p",), ()),
    ("p**2", lambda v, d: v["p"] ** 2, ("p",), "opaque", ("p",), ()),
    ("0.5 * p", lambda v, d: 0.5 * v["p"], ("p",), "opaque", ("p",), ()),
    ("p.mean()", lambda v, d: v["p"].mean(), ("p",), "opaque", ("p",), ()),
    # Dirichlet block itself
    ("pi", lambda v, d: v["pi"], ("pi",), "dirichlet", ("pi",), ()),
    ("rows[row]", lambda v, d: v["rows"][d[4]], ("rows",), "dirichlet", ("rows",), ()),
    ("pi**2", lambda v, d: v["pi"] ** 2, ("pi",), "opaque", ("pi",), ()),
    ("rows.mean(0)", lambda v, d: v["rows"].mean(0), ("rows",), "opaque", ("rows",), ()),
    # mixed families
    ("w0 / tau", lambda v, d: v["w"][0] / v["tau"], ("w", "tau"), "opaque", ("w", "tau"), ()),
    ("p * pi", lambda v, d: v["p"] * v["pi"], ("p", "pi"), "opaque", ("p", "pi"), ()),
]


def _classify(fn, deps):
    blocks = make_blocks()
    # (a value inside each support: the forms are read off the program, not evaluated)
    inside = {"dirichlet": 1.0 / 3.0, "beta": 0.5, "gamma": 1.0, "gaussian": 0.0}
    values = {n: jnp.full(b.value_shape, inside[b.kind]) if not b.discrete else jnp.zeros(b.value_shape, dtype=jnp.int32)
              for n, b in blocks.items()}
    input_forms = {n: fm.Const() if b.discrete else fm.Power(n, 1.0) for n, b in blocks.items()}
    found, forms, _, program = output_forms(
        lambda v, d: {"site": {"arg": jnp.asarray(fn(v, d))}}, values, input_forms, make_data()
    )
    reads = ElementReads(program, blocks)
    return argument_class(
        forms["site"]["arg"], found["site"]["arg"] & set(deps) | set(deps), blocks, blocks_by_site(blocks), reads,
        "site", "arg",
    )


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_classify_table(case):
    _, fn, deps, kind, blocks, full = case
    cls = _classify(fn, deps)
    assert cls.kind == kind, cls.reason
    assert set(cls.blocks) == set(blocks)
    assert tuple(cls.full) == full
    if kind == "opaque":
        assert cls.reason
    else:
        assert cls.reason == ""
