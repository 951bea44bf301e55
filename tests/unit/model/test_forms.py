"""Argument forms read off a jaxpr (``blrppl/model/forms.py``): a table of expressions users
write, each with the form worked out by hand, then the classes the forms give once the
blocks are known."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from blrppl import families as fam
from blrppl.model.classes import classify_form
from blrppl.model import forms as fm
from blrppl.model.deps import output_forms
from blrppl.graph.plan import Block

X = np.arange(15.0).reshape(5, 3) / 10.0
G = np.array([0, 1, 2, 3, 1])
SITES = {"w": jnp.ones(3), "a": jnp.ones(4), "tau": jnp.ones(()), "s": jnp.ones(()), "z": jnp.zeros((), jnp.int32)}
INPUT_FORMS = {n: (fm.Const() if n == "z" else fm.Power(n, 1.0)) for n in SITES}


def level_scan(x, data):
    def step(level, _):
        level = level + x["a"][0]
        return level, level

    return lax.scan(step, 0.0, None, length=4)[1]


S = frozenset
#: (expression of the sites x and data (X, G), its form)
TABLE = [
    ("regression", lambda x, d: d[0] @ x["w"] + x["a"][d[1]], fm.Affine(S({"w", "a"}), True)),
    ("gather", lambda x, d: x["a"][d[1]], fm.Power("a", 1.0)),
    ("scaled gather", lambda x, d: 2.0 * x["a"][d[1]], fm.Power("a", 1.0, unit=False)),
    ("times literal one", lambda x, d: x["a"] * 1.0, fm.Power("a", 1.0)),
    ("zeros plus a site", lambda x, d: jnp.zeros(4) + x["a"], fm.Power("a", 1.0)),
    ("reciprocal sqrt", lambda x, d: 1.0 / jnp.sqrt(x["tau"]), fm.Power("tau", -0.5)),
    ("rsqrt", lambda x, d: lax.rsqrt(x["tau"]), fm.Power("tau", -0.5)),
    ("float power", lambda x, d: x["tau"] ** 2.5, fm.Power("tau", 2.5)),
    ("square", lambda x, d: jnp.square(x["tau"]), fm.Power("tau", 2.0)),
    ("product with itself", lambda x, d: x["tau"] * x["tau"], fm.Power("tau", 2.0, mixes=True)),
    ("data times power", lambda x, d: d[0][:, 0] / x["tau"], fm.Power("tau", -1.0, unit=False)),
    ("log", lambda x, d: jnp.log(x["s"]), fm.LogPower("s", 1.0)),
    ("log of a power", lambda x, d: jnp.log(x["s"] ** 2), fm.LogPower("s", 2.0)),
    ("exp of a log", lambda x, d: jnp.exp(0.5 * jnp.log(x["s"])), fm.Power("s", 0.5, unit=False)),
    ("product of scales", lambda x, d: x["tau"] * x["s"], fm.Product(S({("tau", 1.0), ("s", 1.0)}))),
    ("log of a product", lambda x, d: jnp.log(x["tau"] * x["s"]), fm.LogProduct(S({"tau", "s"}))),
    ("sum of logs", lambda x, d: jnp.log(x["tau"]) - 2 * jnp.log(x["s"]), fm.LogProduct(S({"tau", "s"}))),
    ("exp link", lambda x, d: jnp.exp(d[0] @ x["w"]), fm.Linked("exp", S({"w"}), True)),
    ("sigmoid link", lambda x, d: jax.nn.sigmoid(x["a"]), fm.Linked("sigmoid", S({"a"}))),
    ("cumsum", lambda x, d: jnp.cumsum(x["w"]), fm.Affine(S({"w"}), True)),
    ("sum", lambda x, d: jnp.sum(x["w"]), fm.Affine(S({"w"}), True)),
    ("sum of two elements", lambda x, d: x["w"][0] + x["w"][1], fm.Affine(S({"w"}), True)),
    ("constant mask", lambda x, d: jnp.where(d[1][:3] > 0, x["w"], 0.0), fm.Affine(S({"w"}))),
    ("choice of rates", lambda x, d: jnp.where(jnp.arange(4) < x["z"], x["tau"], x["s"]), fm.Choice(S({("tau", 1.0), ("s", 1.0)}))),
    ("discrete index", lambda x, d: x["a"][x["z"]], fm.Power("a", 1.0)),
    ("scan carry", level_scan, fm.Affine(S({"a"}), True)),
    # a lag carried by a scan: the initial state, then the chain's own values
    ("carry from another site", lambda x, d: jnp.where(jnp.arange(3) == 0, x["s"], x["w"]), fm.Choice(S({("s", 1.0), ("w", 1.0)}))),
    ("negated carry", lambda x, d: -jnp.where(jnp.arange(3) == 0, x["s"], x["w"]), fm.Affine(S({"s", "w"}))),
    ("difference of lags", lambda x, d: 0.6 * x["w"] - 0.2 * jnp.where(jnp.arange(3) == 0, x["s"], x["w"]), fm.Affine(S({"s", "w"}), True)),
    ("softplus", lambda x, d: jax.nn.softplus(x["w"]), fm.Opaque("'softplus' of a latent")),
    ("tanh", lambda x, d: jnp.tanh(x["w"]), fm.Opaque("'tanh' of a latent")),
    ("product of latents", lambda x, d: x["w"] @ x["w"], fm.Opaque("a product of latents")),
    # products of affine forms of different sites: bilinear (w * x), with an affine offset
    # (two sites' first powers: a Product, read as bilinear where both are Gaussian)
    ("product of two sites", lambda x, d: x["w"][:3] * x["a"][d[1][:3]], fm.Product(S({("w", 1.0), ("a", 1.0)}))),
    ("product plus offset", lambda x, d: x["s"] * (x["w"] - x["a"][0]) + x["a"][0], fm.Bilinear(S({"s"}), S({"w", "a"}), S({"a"}))),
    ("negated product", lambda x, d: -(x["w"][:3] * x["a"][:3]), fm.Bilinear(S({"a"}), S({"w"}))),
    ("contraction of two sites", lambda x, d: x["w"][:3] @ x["a"][:3], fm.Bilinear(S({"w"}), S({"a"}), mixes=True)),
    # products of different sites summed: bilinear when the sites split into two sides
    # (an AR(2)'s latent coefficients times two lags of the chain); a triangle does not
    ("latent coefficients times lags", lambda x, d: x["s"] * x["w"][1:] + x["tau"] * x["w"][:-1], fm.Bilinear(S({"s", "tau"}), S({"w"}), mixes=True)),
    ("two products sharing a site", lambda x, d: x["s"] * x["w"] + x["w"] * x["a"][:3], fm.Bilinear(S({"a", "s"}), S({"w"}), mixes=True)),
    ("triangle of products", lambda x, d: x["s"] * x["w"] + x["w"] * x["tau"] + x["tau"] * x["s"], fm.Opaque("a sum of a latent's power or link with other terms")),
    ("outer product", lambda x, d: x["w"][:, None] * x["a"][None, :], fm.Product(S({("w", 1.0), ("a", 1.0)}))),
    ("outer product plus offset", lambda x, d: x["w"][:, None] * x["a"][None, :] + x["s"], fm.Bilinear(S({"a"}), S({"w"}), S({"s"}))),
    ("latent choice", lambda x, d: jnp.where(x["w"] > 0, x["w"], 0.0), fm.Opaque("a choice that depends on a latent's value")),
    ("latent index", lambda x, d: x["a"][jnp.argmax(x["w"])], fm.Opaque("an index computed from a latent (dynamic_slice)")),
    ("sum with a power", lambda x, d: x["tau"] ** 2 + 1.0, fm.Opaque("a sum of a latent's power or link with other terms")),
]


@pytest.mark.parametrize("name, fn, expected", TABLE, ids=[t[0] for t in TABLE])
def test_form_of_expression(name, fn, expected):
    _, forms, _, _ = output_forms(lambda x, d: {"out": fn(x, d)}, SITES, INPUT_FORMS, (X, G))
    assert forms["out"] == expected


def test_product_of_two_first_powers_is_bilinear():
    assert fm.as_bilinear(fm.Product(S({("w", 1.0), ("a", 1.0)}))) == fm.Bilinear(S({"a"}), S({"w"}))
    assert fm.as_bilinear(fm.Product(S({("w", 1.0), ("a", 2.0)}))) is None  # (w · a²: not bilinear)
    assert fm.as_bilinear(fm.Affine(S({"w"}))) is None


def test_dependencies_come_from_the_same_jaxpr():
    deps, forms, primitives, _ = output_forms(
        lambda x, d: {"loc": d[0] @ x["w"], "scale": 1.0 / jnp.sqrt(x["tau"])}, SITES, INPUT_FORMS, (X, G)
    )
    assert deps == {"loc": S({"w"}), "scale": S({"tau"})}
    assert {"dot_general", "sqrt", "div"} <= primitives
    assert forms["scale"] == fm.Power("tau", -0.5)


# -- classes once the blocks are known ----------------------------------------------------------

GAUSS = Block("w", fam.GaussianDense(3), "gaussian", (3,))
DIAG = Block("a", fam.GaussianDiag(), "gaussian-diag", (4,))
GAMMA = Block("tau", fam.Gamma(), "gamma", ())


def _log_space(name, shape=()):
    from numpyro.distributions.transforms import ExpTransform

    return Block(name, fam.GaussianDiag(), "gaussian-diag", shape, transform=ExpTransform())


BLOCKS = {"w": GAUSS, "a": DIAG, "tau": GAMMA, "s": _log_space("s")}
SITE_BLOCKS = {n: (n, b) for n, b in BLOCKS.items()}

#: (form, the blocks it depends on, expected kind or None for "the probes decide", power)
CLASSES = [
    (fm.Affine(S({"w"}), True), ("w",), "affine_gaussian", None),  # X @ w: a dense block may mix
    (fm.Affine(S({"a"}), True), ("a",), None, None),  # a diagonal block mixed: columns, probed
    (fm.Power("a", 1.0), ("a",), "affine_gaussian", None),
    # a choice between first powers of Gaussian sites is affine; of a Gamma's, a choice of rates
    (fm.Choice(S({("a", 1.0), ("w", 1.0)})), ("a", "w"), "affine_gaussian", None),
    (fm.Choice(S({("tau", 1.0), ("a", 1.0)})), ("a", "tau"), "opaque", None),
    (fm.Power("tau", -0.5), ("tau",), "power_gamma", -0.5),
    (fm.LogPower("s", 1.0), ("s",), "affine_gaussian", None),  # log of exp(u)
    (fm.Power("s", 1.0), ("s",), "exp_gaussian", None),  # exp(u) itself: log-normal
    (fm.Linked("exp", S({"w"}), True), ("w",), "exp_gaussian", None),  # exp(X @ w): log-normal
    (fm.Linked("exp", S({"a"}), True), ("a",), "opaque", None),  # a diagonal block mixed
    (fm.Linked("sigmoid", S({"w"}), True), ("w",), "opaque", None),
    (fm.Opaque("'tanh' of a latent"), ("w",), "opaque", None),
]


@pytest.mark.parametrize("form, deps, kind, power", CLASSES)
def test_class_of_form(form, deps, kind, power):
    cls, reason = classify_form(form, deps, BLOCKS, SITE_BLOCKS)
    if kind is None:
        assert cls is None
        return
    assert cls.kind == kind and cls.blocks == deps
    if kind == "power_gamma":
        assert cls.power == power
    assert (kind == "opaque") == bool(reason)


def test_inverse_links_read_glm_projections():
    log_rate = fm.inverse_link(fm.Linked("exp", S({"w"}), True), "exp")
    assert classify_form(log_rate, ("w",), BLOCKS, SITE_BLOCKS)[0].kind == "affine_gaussian"
    logit = fm.inverse_link(fm.Linked("sigmoid", S({"w"})), "sigmoid")
    assert logit == fm.Affine(S({"w"}))
    assert isinstance(fm.inverse_link(fm.Linked("exp", S({"w"})), "sigmoid"), fm.Opaque)


def _persistence(read_on_support: bool):
    """φ ~ Uniform(-1, 1): a scalar Gaussian on the interval's logit space."""
    import dataclasses

    from numpyro.distributions import biject_to, constraints

    block = Block("phi", fam.GaussianDense(1), "gaussian", (), transform=biject_to(constraints.interval(-1.0, 1.0)))
    assert fm.interval_gaussian(block)
    return dataclasses.replace(block, value_moments=read_on_support)


#: (form, kind with value_moments, kind without): a persistence read through its moments is
#: affine or bilinear only as a first power; exp(φ), φ², logit(φ) stay opaque
PERSISTENCE_CLASSES = [
    (fm.Bilinear(S({"phi"}), S({"w"}), S()), "bilinear_gaussian", "opaque"),  # phi * w
    (fm.Bilinear(S({"phi"}), S({"w"}), S({"w"})), "bilinear_gaussian", "opaque"),  # w + phi * (w_prev - w)
    (fm.Power("phi", 1.0), "affine_gaussian", "opaque"),
    (fm.Linked("exp", S({"phi"})), "opaque", "opaque"),
    (fm.Power("phi", 2.0), "opaque", "opaque"),
]


@pytest.mark.parametrize("form, on_support, plain", PERSISTENCE_CLASSES)
def test_class_of_a_persistence_read_through_its_moments(form, on_support, plain):
    deps = tuple(sorted(fm.sites_of(form)))
    for flagged, expected in ((True, on_support), (False, plain)):
        blocks = {**BLOCKS, "phi": _persistence(flagged)}
        site_blocks = {n: (n, b) for n, b in blocks.items()}
        cls, _ = classify_form(form, deps, blocks, site_blocks, value_moments=True)
        assert cls.kind == expected, (form, flagged)
        # (quadrature projections classify without value_moments: φ on its own logit space)
        assert classify_form(form, deps, blocks, site_blocks)[0].kind == plain
