"""E[f(d_A, d_B)²] of products of two Gaussian blocks, read by contraction (``blrppl.moments.products``).

Each case is an argument as users write it (``X @ C.T``, ``jnp.einsum``, ``(U[i] * V[j]).sum(-1)``,
``w * x``, a jitted helper), with per-element dense covariances for the two blocks. The reference
is the definition: f_o(d_A, d_B) = d_Aᵀ H_o d_B with H_o the mixed second derivative of output o,
so E[f_o²] = tr(H_oᵀ Σ_A H_o Σ_B) with the blocks' (block-diagonal) covariances, written here with
dense matrices. Products the contraction cannot follow return None (the caller then pushes every
pair of square roots instead), never a wrong value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import pytest
from jax import random

import reference_models as rm
from blrppl.model.program import ModelProgram
from blrppl.moments.products import product_second_moments

numpyro.enable_x64()

N, M, D = 7, 5, 3
ROWS = np.array([0, 1, 2, 6, 6])
COLS = np.array([1, 1, 4, 0, 3])


def _setup():
    rng = np.random.default_rng(0)
    point = {"X": jnp.asarray(rng.normal(size=(N, D))), "C": jnp.asarray(rng.normal(size=(M, D)))}
    chol = {
        "X": jnp.asarray(np.tril(rng.normal(size=(N, D, D)))),
        "C": jnp.asarray(np.tril(rng.normal(size=(M, D, D)))),
    }
    return point, chol


def _reference(fn, point, chol, whole=False):
    """tr(H_oᵀ Σ_X H_o Σ_C) per output o, dense; with ``whole`` the variance of a product
    plus constants, g_Xᵀ Σ_X g_X + g_Cᵀ Σ_C g_C + tr(H_oᵀ Σ_X H_o Σ_C) (g the gradients at the
    means: f is bilinear, so Var[f] = E[(f − f(m))²] holds these three uncorrelated terms)."""
    def f(x, c):
        return fn({"X": x.reshape(N, D), "C": c.reshape(M, D)})["f"]["loc"]

    x0, c0 = point["X"].reshape(-1), point["C"].reshape(-1)
    hess = jax.jacfwd(jax.jacrev(f, argnums=0), argnums=1)(x0, c0)  # (*out, N D, M D)
    cov_x = jax.scipy.linalg.block_diag(*[l @ l.T for l in chol["X"]])
    cov_c = jax.scipy.linalg.block_diag(*[l @ l.T for l in chol["C"]])
    extra = jnp.einsum("...ij,ik,...kl,jl->...", hess, cov_x, hess, cov_c)
    if not whole:
        return extra
    g_x, g_c = jax.jacfwd(f, argnums=(0, 1))(x0, c0)
    return extra + jnp.einsum("...i,ij,...j->...", g_x, cov_x, g_x) + jnp.einsum("...i,ij,...j->...", g_c, cov_c, g_c)


def _sets(chol):
    """Unit columns and the covariance's columns of each row (the family's tangent sets)."""
    out = {}
    for n, lower in chol.items():
        cov = lower @ jnp.swapaxes(lower, -1, -2)
        rows = cov.shape[0]
        eye = jnp.broadcast_to(jnp.eye(D)[:, None, :], (D, rows, D))
        out[n] = {"left": eye, "right": jnp.moveaxis(cov, -1, 0)}
    return out


def _moments(fn, point, chol):
    sets = _sets(chol)
    out = product_second_moments(fn, point, "X", sets["X"], "C", sets["C"], [("f", "loc")])
    return None if out is None else out["f"]["loc"]


def _contracted(fn, point, chol):
    out = _moments(fn, point, chol)
    return None if out is None else out.extra


def _jitted_matmul(x, c):
    return x @ c.T


READ_BY_CONTRACTION = {
    "matmul plus a bias": lambda p: {"f": {"loc": p["X"] @ p["C"].T + 1.0}},
    "scaled einsum": lambda p: {"f": {"loc": 2.0 * jnp.einsum("nd,md->nm", p["X"], p["C"])}},
    "index pairs, summed": lambda p: {"f": {"loc": jnp.sum(p["X"][ROWS] * p["C"][COLS], -1) - p["X"][:5, 0]}},
    "elementwise": lambda p: {"f": {"loc": (p["X"][:5] * p["C"]).reshape(-1)}},
    "jitted helper, scaled": lambda p: {"f": {"loc": jax.jit(_jitted_matmul)(p["X"], p["C"]) * 3.0}},
    "transposed then divided": lambda p: {"f": {"loc": (p["C"] @ p["X"].T).T / 4.0 + p["C"][:, :1].T}},
    "product placed in a larger array": lambda p: {
        "f": {"loc": jnp.concatenate([p["X"] @ p["C"].T, p["X"][:, :2]], axis=1)}
    },
    "a row of loadings from each side": lambda p: {"f": {"loc": jnp.einsum("d,nd->n", p["C"][2], p["X"])}},
}


@pytest.mark.parametrize("case", sorted(READ_BY_CONTRACTION))
def test_contraction_equals_the_definition(case):
    point, chol = _setup()
    fn = READ_BY_CONTRACTION[case]
    got = _contracted(fn, point, chol)
    assert got is not None, f"{case}: expected the contraction to follow the product"
    want = _reference(fn, point, chol)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


#: arguments whose dependence on X and C is the product alone (plus constants)
PURE = {"matmul plus a bias", "scaled einsum", "elementwise", "jitted helper, scaled", "a row of loadings from each side"}


@pytest.mark.parametrize("case", sorted(READ_BY_CONTRACTION))
def test_whole_variance_of_a_pure_product(case):
    """Var[x] in full (no pushed rows needed) exactly for arguments that read X and C only
    through their product; an added affine term in X or C (``- X[:5, 0]``) leaves it unknown."""
    point, chol = _setup()
    fn = READ_BY_CONTRACTION[case]
    got = _moments(fn, point, chol).variance
    if case not in PURE:
        assert got is None
        return
    np.testing.assert_allclose(got, _reference(fn, point, chol, whole=True), rtol=1e-10, atol=1e-10)


def _scanned(p):
    def body(carry, xc):
        x, c = xc
        return carry, x * c

    _, out = jax.lax.scan(body, 0.0, (p["X"][:5], p["C"]))
    return {"f": {"loc": out}}


LEFT_TO_THE_PUSHES = {
    "sum of two products": lambda p: {"f": {"loc": p["X"] @ p["C"].T + (2.0 * p["X"]) @ p["C"].T}},
    "product inside a scan": _scanned,
    "sum of a contraction": lambda p: {"f": {"loc": jnp.sum(p["X"] @ p["C"].T, axis=0)}},
    "cumulative sum of a product": lambda p: {"f": {"loc": jnp.cumsum(p["X"][:5] * p["C"], axis=0)}},
}


@pytest.mark.parametrize("case", sorted(LEFT_TO_THE_PUSHES))
def test_products_it_cannot_follow_are_left_to_the_pushes(case):
    point, chol = _setup()
    assert _contracted(LEFT_TO_THE_PUSHES[case], point, chol) is None


def test_argument_without_the_product_has_no_extra_moment():
    point, chol = _setup()

    def fn(p):
        return {"f": {"loc": p["X"] @ p["C"].T, "scale": jnp.exp(p["X"][:, 0])}, "g": {"loc": p["C"] + 1.0}}

    sets = _sets(chol)
    out = product_second_moments(fn, point, "X", sets["X"], "C", sets["C"], [("g", "loc"), ("f", "loc")])
    np.testing.assert_array_equal(out["g"]["loc"].extra, np.zeros((M, D)))
    assert out["g"]["loc"].variance is None  # (affine in C: its variance comes from pushed rows)
    np.testing.assert_allclose(
        out["f"]["loc"].extra, _reference(lambda p: {"f": {"loc": fn(p)["f"]["loc"]}}, point, chol)
    )


def test_contraction_is_differentiable_like_the_definition():
    """The messages are gradients of the moments with respect to the covariances."""
    point, chol = _setup()
    fn = READ_BY_CONTRACTION["matmul plus a bias"]
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(N, M)))

    def through(method):
        def total(x, c, lx, lc):
            return jnp.sum(weights * method(fn, {"X": x, "C": c}, {"X": lx, "C": lc}))

        return jax.grad(total, argnums=(0, 1, 2, 3))(point["X"], point["C"], chol["X"], chol["C"])

    def whole_contracted(fn, point, chol):
        return _moments(fn, point, chol).variance

    def whole_reference(fn, point, chol):
        return _reference(fn, point, chol, whole=True)

    for mine, definition in ((_contracted, _reference), (whole_contracted, whole_reference)):
        for got, want in zip(through(mine), through(definition)):
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)


def test_factor_model_steps_equal_with_and_without_the_contraction(monkeypatch):
    """Probabilistic PCA's messages and bound, after three steps from a random start: the
    contraction (whole variance, no pushed rows) and the pushes of every pair of roots agree
    (the data-statistics paths, :mod:`blrppl.estimators.bilinear` and
    :mod:`blrppl.estimators.gram`, kept out: they read neither)."""
    import blrppl.moments.linearised as linearised
    from blrppl.estimators import bilinear, gram
    from blrppl.compiler.families import init_nat
    from blrppl.engine.build import plan_model
    from blrppl.engine.step import initial_state, make_step
    from blrppl.model.trace import trace_model
    from blrppl.inputs import fit_options, model_arguments

    monkeypatch.setattr(bilinear, "eligible", lambda *a, **k: None)
    monkeypatch.setattr(gram, "eligible", lambda *a, **k: None)
    Y = np.random.default_rng(2).normal(size=(12, 5))
    args, kwargs = model_arguments({"Y": Y})
    records, spec, dyn, _ = trace_model(rm.ppca_model, args, kwargs, random.PRNGKey(0))
    with numpyro.validation_enabled(False):
        plan, fns, dyn, init_values, *_ = plan_model(ModelProgram(rm.ppca_model), records, spec, dyn, fit_options(), None, random.PRNGKey(1))
    # (off the saddle at zero means, where the linear part of the product vanishes)
    rng = np.random.default_rng(3)
    for n in ("X", "C"):
        init_values[n] = init_values[n] + rng.normal(size=np.shape(init_values[n]))
    nat = {b.name: init_nat(b.full, init_values[b.name], None) for b in plan.blocks}
    step, elbo, messages, _ = make_step(plan, fns, "sequential")
    state = initial_state(nat, random.PRNGKey(2), plan)
    rho = {b: jnp.asarray(0.5) for b in plan.order}
    state = jax.jit(lambda s: jax.lax.fori_loop(0, 3, lambda _, s: step(s, dyn, rho)[0], s))(state)

    read = []
    contraction = linearised.product_second_moments

    def spy(*a, **k):
        out = contraction(*a, **k)
        read.append(out is not None and out["Y"]["loc"].variance is not None)
        return out

    def evaluate():  # (traced anew under each patch: a new function each time)
        return jax.jit(lambda nat: ({b: messages(nat, (b,), dyn) for b in plan.order}, elbo(nat, dyn)))(state.nat)

    monkeypatch.setattr(linearised, "product_second_moments", spy)
    contracted = evaluate()
    assert read and all(read)
    monkeypatch.setattr(linearised, "product_second_moments", lambda *a, **k: None)
    pushed = evaluate()
    for got, want in zip(jax.tree.leaves(contracted), jax.tree.leaves(pushed)):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
