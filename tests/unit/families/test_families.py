"""Family suite: every candidate family against its exponential-family identities,
closed-form Fisher matrices, Monte Carlo, numpyro and scipy.

Each family is exercised on a batch of several elements with random valid parameters drawn
with fixed seeds. The reference quantities (Fisher matrices, scipy distributions) are
computed here from the natural parameters with numpy, independently of the family code.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import numpyro.distributions as dist
import scipy.special
import scipy.stats
from jax.flatten_util import ravel_pytree

from blrppl.families import gaussian as gaussian_module
from blrppl.families import (
    FAMILIES,
    Bernoulli,
    BernoulliNat,
    Beta,
    BetaNat,
    BetaView,
    Categorical,
    CategoricalNat,
    CategoricalView,
    Dirichlet,
    DirichletNat,
    DirichletView,
    Family,
    Gamma,
    GammaNat,
    GammaView,
    GaussianDense,
    GaussianDiag,
    GaussianNat,
    GaussianView,
    DiagGaussianNat,
    DiagGaussianView,
    Wishart,
)

D = 3  # dense Gaussian dimension
K = 4  # Dirichlet / Categorical categories


class Case(NamedTuple):
    family: Family
    batch: tuple[int, ...]
    #: numpy generator → random valid nat with batch shape ``batch``
    make_nat: Callable[[np.random.Generator], Any]
    #: nat → a nat outside the natural-parameter domain (finite)
    make_invalid: Callable[[Any], Any]
    #: nat of one element → Fisher matrix in the flattened (ravel_pytree) coordinates
    ref_fisher: Callable[[Any], np.ndarray]
    #: nat of one element → (logpdf(x), entropy) from scipy
    ref_scipy: Callable[[Any], tuple[Callable[[np.ndarray], float], float]]


# -- random valid parameters (numpy, fixed seeds) --------------------------------------------


def _gaussian_nat(rng):
    w = rng.normal(size=(2, 2, D, D))
    prec = w @ np.swapaxes(w, -1, -2) / D + 0.5 * np.eye(D)
    m = rng.normal(size=(2, 2, D))
    return GaussianNat(jnp.asarray(np.einsum("...ij,...j->...i", prec, m)), jnp.asarray(-0.5 * prec))


def _diag_nat(rng):
    m = rng.normal(size=(2, 3))
    v = rng.uniform(0.3, 2.0, size=(2, 3))
    return DiagGaussianNat(jnp.asarray(m / v), jnp.asarray(-0.5 / v))


def _gamma_nat(rng):
    a = rng.uniform(0.5, 5.0, size=(2, 3))
    b = rng.uniform(0.5, 3.0, size=(2, 3))
    return GammaNat(jnp.asarray(a - 1.0), jnp.asarray(-b))


def _beta_nat(rng):
    ab = rng.uniform(0.5, 5.0, size=(2, 4))
    return BetaNat(jnp.asarray(ab[0] - 1.0), jnp.asarray(ab[1] - 1.0))


def _dirichlet_nat(rng):
    return DirichletNat(jnp.asarray(rng.uniform(0.5, 5.0, size=(3, K)) - 1.0))


def _categorical_nat(rng):
    return CategoricalNat(jnp.asarray(rng.normal(size=(2, 3, K - 1))))


def _bernoulli_nat(rng):
    return BernoulliNat(jnp.asarray(1.5 * rng.normal(size=(5,))))


def _set(nat, field: str, index, value):
    """A copy of ``nat`` with ``nat.field[index] = value`` (numpy, no compilation)."""
    leaf = np.array(getattr(nat, field))
    leaf[index] = value
    return nat._replace(**{field: jnp.asarray(leaf)})


# -- reference Fisher matrices (numpy, from the natural parameters) --------------------------


def _np(x):
    return np.asarray(x, dtype=np.float64)


def _gaussian_moments(nat):
    prec = -2.0 * _np(nat.eta2)
    cov = np.linalg.inv(prec)
    return cov @ _np(nat.eta1), cov


def _gaussian_fisher(nat):
    """Cov[T(x)], T = (x, vec(x xᵀ)), by Isserlis' theorem."""
    m, s = _gaussian_moments(nat)
    f12 = np.einsum("ij,k->ijk", s, m) + np.einsum("ik,j->ijk", s, m)
    f22 = (
        np.einsum("ik,jl->ijkl", s, s)
        + np.einsum("il,jk->ijkl", s, s)
        + np.einsum("i,k,jl->ijkl", m, m, s)
        + np.einsum("i,l,jk->ijkl", m, m, s)
        + np.einsum("j,k,il->ijkl", m, m, s)
        + np.einsum("j,l,ik->ijkl", m, m, s)
    )
    f12 = f12.reshape(D, D * D)
    return np.block([[s, f12], [f12.T, f22.reshape(D * D, D * D)]])


def _diag_fisher(nat):
    v = -0.5 / _np(nat.eta2)
    m = _np(nat.eta1) * v
    return np.array([[v, 2 * m * v], [2 * m * v, 2 * v**2 + 4 * m**2 * v]])


def _gamma_fisher(nat):
    a, b = _np(nat.eta1) + 1.0, -_np(nat.eta2)
    return np.array([[scipy.special.polygamma(1, a), 1 / b], [1 / b, a / b**2]])


def _beta_fisher(nat):
    al, be = _np(nat.eta1) + 1.0, _np(nat.eta2) + 1.0
    t1, t2, t0 = scipy.special.polygamma(1, [al, be, al + be])
    return np.array([[t1 - t0, -t0], [-t0, t2 - t0]])


def _dirichlet_fisher(nat):
    alpha = _np(nat.eta) + 1.0
    return np.diag(scipy.special.polygamma(1, alpha)) - scipy.special.polygamma(1, alpha.sum())


def _categorical_fisher(nat):
    p = scipy.special.softmax(np.append(_np(nat.logits), 0.0))[:-1]
    return np.diag(p) - np.outer(p, p)


def _bernoulli_fisher(nat):
    p = scipy.special.expit(_np(nat.logit))
    return np.array([[p * (1 - p)]])


# -- scipy references -------------------------------------------------------------------------


def _gaussian_scipy(nat):
    m, s = _gaussian_moments(nat)
    d = scipy.stats.multivariate_normal(m, s)
    return d.logpdf, d.entropy()


def _diag_scipy(nat):
    v = -0.5 / _np(nat.eta2)
    d = scipy.stats.norm(_np(nat.eta1) * v, np.sqrt(v))
    return d.logpdf, d.entropy()


def _gamma_scipy(nat):
    d = scipy.stats.gamma(_np(nat.eta1) + 1.0, scale=-1.0 / _np(nat.eta2))
    return d.logpdf, d.entropy()


def _beta_scipy(nat):
    d = scipy.stats.beta(_np(nat.eta1) + 1.0, _np(nat.eta2) + 1.0)
    return d.logpdf, d.entropy()


def _dirichlet_scipy(nat):
    d = scipy.stats.dirichlet(_np(nat.eta) + 1.0)
    return (lambda x: d.logpdf(x / x.sum())), d.entropy()


def _categorical_scipy(nat):
    p = scipy.special.softmax(np.append(_np(nat.logits), 0.0))
    d = scipy.stats.multinomial(1, p)
    return (lambda x: d.logpmf(np.eye(K)[int(x)])), d.entropy()


def _bernoulli_scipy(nat):
    d = scipy.stats.bernoulli(scipy.special.expit(_np(nat.logit)))
    return (lambda x: d.logpmf(int(x))), d.entropy()


CASES = {
    "gaussian": Case(
        GaussianDense(D),
        (2, 2),
        _gaussian_nat,
        lambda nat: _set(nat, "eta2", (1, 0), -np.asarray(nat.eta2[1, 0])),
        _gaussian_fisher,
        _gaussian_scipy,
    ),
    "gaussian-diag": Case(
        GaussianDiag(),
        (2, 3),
        _diag_nat,
        lambda nat: _set(nat, "eta2", (1, 2), 0.5),
        _diag_fisher,
        _diag_scipy,
    ),
    "gamma": Case(
        Gamma(),
        (2, 3),
        _gamma_nat,
        lambda nat: _set(nat, "eta1", (0, 1), -1.5),
        _gamma_fisher,
        _gamma_scipy,
    ),
    "beta": Case(
        Beta(),
        (4,),
        _beta_nat,
        lambda nat: _set(nat, "eta2", 3, -1.0),
        _beta_fisher,
        _beta_scipy,
    ),
    "dirichlet": Case(
        Dirichlet(K),
        (3,),
        _dirichlet_nat,
        lambda nat: _set(nat, "eta", (2, 1), -1.2),
        _dirichlet_fisher,
        _dirichlet_scipy,
    ),
    "categorical": Case(
        Categorical(K),
        (2, 3),
        _categorical_nat,
        lambda nat: _set(nat, "logits", (1, 0, 2), np.inf),
        _categorical_fisher,
        _categorical_scipy,
    ),
    "bernoulli": Case(
        Bernoulli(),
        (5,),
        _bernoulli_nat,
        lambda nat: _set(nat, "logit", 3, -np.inf),
        _bernoulli_fisher,
        _bernoulli_scipy,
    ),
}

NAMES = list(CASES)


@pytest.fixture(params=NAMES)
def case_name(request):
    return request.param


@pytest.fixture
def case(case_name):
    return CASES[case_name]


def make_nat(name: str):
    return CASES[name].make_nat(np.random.default_rng(NAMES.index(name)))


@pytest.fixture
def nat(case_name):
    return make_nat(case_name)


# -- helpers ------------------------------------------------------------------------------------
# (numpy where possible: every eager jax op on a new shape is an XLA compilation)


def assert_tree_close(actual, expected, rtol=1e-9, atol=1e-10):
    assert type(actual) is type(expected), (type(actual), type(expected))
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert np.shape(a) == np.shape(e)
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


def elements(case: Case, tree) -> list:
    """The per-element pytrees (numpy) of a batched pytree (batch dims flattened, C order)."""
    n = math.prod(case.batch)
    flat = jax.tree.map(lambda leaf: np.asarray(leaf).reshape((n,) + leaf.shape[len(case.batch) :]), tree)
    return [jax.tree.map(lambda leaf: leaf[i], flat) for i in range(n)]


def ravel(tree) -> np.ndarray:
    """Leaves flattened and concatenated in ``jax.flatten_util.ravel_pytree`` order."""
    return np.concatenate([np.ravel(np.asarray(leaf)) for leaf in jax.tree.leaves(tree)])


def minimal_basis(case: Case, nat_elem) -> np.ndarray:
    """Columns span the (minimal) natural-parameter space inside the flattened coordinates.

    The identity, except for the dense Gaussian whose η₂ is symmetric: one column per
    (i ≤ j), with ones at (i, j) and (j, i).
    """
    size = ravel(nat_elem).size
    if not isinstance(case.family, GaussianDense):
        return np.eye(size)
    cols = [np.eye(size)[:, i] for i in range(D)]
    for i in range(D):
        for j in range(i, D):
            col = np.zeros(size)
            col[D + i * D + j] = col[D + j * D + i] = 1.0
            cols.append(col)
    return np.stack(cols, axis=1)


def nonlinear_loss(view) -> jax.Array:
    """A smooth non-linear function of the view, separable over batch elements."""
    return sum(jnp.sum(jnp.sin(leaf) + 0.1 * leaf**2 + 0.05 * leaf**3) for leaf in jax.tree.leaves(view))


@functools.lru_cache(maxsize=None)
def per_element(name: str):
    """Per batch element of case ``name``: hessian of A, ∇_λ of ``nonlinear_loss(view)`` (both
    in the flattened coordinates of the element's nat), and the family's message for
    ``nonlinear_loss`` computed on the whole batch."""
    case = CASES[name]
    fam = case.family

    @jax.jit
    def run(nat):
        n = math.prod(case.batch)
        flat_nat = jax.tree.map(lambda leaf: leaf.reshape((n,) + leaf.shape[len(case.batch) :]), nat)

        def one(elem):
            flat, unravel = ravel_pytree(elem)
            hess = jax.hessian(lambda v: fam.log_partition(unravel(v)))(flat)
            grad = jax.grad(lambda v: nonlinear_loss(fam.view(unravel(v))))(flat)
            return hess, grad

        hess, grad = jax.vmap(one)(flat_nat)
        return hess, grad, fam.message_from_view_grad(nat, jax.grad(nonlinear_loss)(fam.view(nat)))

    return jax.tree.map(np.asarray, run(make_nat(name)))


def _weights(case: Case):
    shape = case.batch + case.family.event_shape
    return np.linspace(0.5, 1.5, math.prod(shape)).reshape(shape)


#: families sampled through jax's Gamma sampler: slow to compile and to run on a CPU
GAMMA_SAMPLED = ("gamma", "beta", "dirichlet")


def num_draws(name: str) -> int:
    return 20_000 if name in GAMMA_SAMPLED else 200_000


#: families whose reparameterisation gradient is checked (one Gamma sampler suffices: Beta
#: and Dirichlet draws are normalised Gamma draws from jax.random)
REPARAM_CHECKED = ("gaussian", "gaussian-diag", "gamma")


@functools.lru_cache(maxsize=None)
def draws(name: str):
    """``num_draws(name)`` draws for case ``name`` (fixed key) and, for the families in
    ``REPARAM_CHECKED``, the pathwise gradient w.r.t. nat of Σ weights · (MC mean of x), from
    one compilation, as compiling the samplers dominates the run time of this file."""
    case = CASES[name]
    fam = case.family
    key = jax.random.key(7)
    n = num_draws(name)
    if name not in REPARAM_CHECKED:
        return jax.jit(lambda nat: fam.sample(nat, key, (n,)))(make_nat(name)), None

    def f(nat):
        x = fam.sample(nat, key, (n,))
        return jnp.sum(_weights(case) * x.mean(0)), x

    (_, x), grad = jax.jit(jax.value_and_grad(f, has_aux=True))(make_nat(name))
    return x, grad


# -- registry and protocol ----------------------------------------------------------------------


#: families with their own suite: the Wishart's natural parameter −½W⁻¹ is a symmetric matrix, so
#: its Fisher matrix in the flattened coordinates of this suite is singular (tests/unit/families/test_wishart.py
#: checks the same identities: ∇A = μ, round trips, entropy and density against scipy, Monte
#: Carlo, messages, validity, float32)
#: IVON's family carries its gradient momentum among its natural parameters (leaves that are
#: not an exponential family's): tests/unit/families/test_gaussian_ivon.py checks its update
#: against a NumPy recursion of IVON's equations
OWN_SUITE = {"wishart", "gaussian-ivon"}


def test_registry_names_and_hashability():
    assert set(FAMILIES) == set(CASES) | OWN_SUITE
    for name, cls in FAMILIES.items():
        assert cls.name == name
        assert name in OWN_SUITE or isinstance(CASES[name].family, cls)
    assert GaussianDense(3) == GaussianDense(3) and hash(GaussianDense(3)) == hash(GaussianDense(3))
    assert GaussianDense(3) != GaussianDense(4)
    assert Categorical(K).discrete and Bernoulli().discrete and not Gamma().discrete
    with pytest.raises(dataclasses.FrozenInstanceError):
        GaussianDense(3).dim = 4  # type: ignore[misc]


def test_family_is_a_static_jit_argument(case, nat):
    fn = jax.jit(lambda fam, n: fam.log_partition(n), static_argnums=0)
    first = fn(case.family, nat)
    # an equal (not identical) family object hits the same cache entry
    again = fn(dataclasses.replace(case.family), nat)
    np.testing.assert_array_equal(first, again)
    assert fn._cache_size() == 1


def test_shapes(case, nat):
    fam = case.family
    log_z, entropy, mean, view, valid = jax.eval_shape(
        lambda n: (fam.log_partition(n), fam.entropy(n), fam.mean_params(n), fam.view(n), fam.is_valid(n)),
        nat,
    )
    assert fam.batch_shape(nat) == case.batch
    assert log_z.shape == entropy.shape == case.batch and valid.shape == ()
    assert jax.tree.map(jnp.shape, mean) == jax.tree.map(jnp.shape, nat)
    for leaf in jax.tree.leaves(nat) + jax.tree.leaves(view):
        assert leaf.shape[: len(case.batch)] == case.batch


# -- exponential-family identities ---------------------------------------------------------------


def test_nat_mean_round_trip(case, nat):
    fam = case.family

    @jax.jit
    def round_trip(nat):
        mean = fam.mean_params(nat)
        nat_back = fam.nat_from_mean(mean)
        return mean, nat_back, fam.mean_params(nat_back)

    mean, nat_back, mean_back = round_trip(nat)
    assert_tree_close(nat_back, nat, rtol=1e-8, atol=1e-9)
    assert_tree_close(mean_back, mean, rtol=1e-8, atol=1e-9)


def test_view_round_trip(case, nat):
    fam = case.family

    @jax.jit
    def round_trip(nat):
        view = fam.view(nat)
        nat_back = fam.nat_from_view(view)
        return view, nat_back, fam.view(nat_back)

    view, nat_back, view_back = round_trip(nat)
    assert_tree_close(nat_back, nat, rtol=1e-9, atol=1e-10)
    assert_tree_close(view_back, view, rtol=1e-9, atol=1e-10)
    if fam.discrete:  # computed on the host for numpy parameters (a fit's discrete start)
        host = fam.view(jax.tree.map(np.asarray, nat))
        assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(host))
        assert_tree_close(host, view, rtol=1e-12, atol=1e-14)
        assert_tree_close(fam.nat_from_view(host), nat, rtol=1e-9, atol=1e-10)


def test_grad_log_partition_is_mean_params(case, nat):
    fam = case.family
    grad_log_partition = jax.grad(lambda n: fam.log_partition(n).sum())
    grad, mean = jax.jit(lambda nat: (grad_log_partition(nat), fam.mean_params(nat)))(nat)
    assert_tree_close(grad, mean, rtol=1e-9, atol=1e-10)


def test_fisher_is_hessian_and_positive_definite(case, case_name, nat):
    hessians, _, _ = per_element(case_name)
    for elem, hess in zip(elements(case, nat), hessians, strict=True):
        np.testing.assert_allclose(hess, case.ref_fisher(elem), rtol=1e-8, atol=1e-10)
        basis = minimal_basis(case, elem)
        assert np.linalg.eigvalsh(basis.T @ hess @ basis).min() > 1e-8


def test_mean_params_match_monte_carlo(case, case_name, nat):
    """E_q[T(x)] from 200k draws (20k for Gamma-sampled families); tolerance 5 Monte Carlo
    standard errors per entry."""
    fam = case.family
    x = draws(case_name)[0]
    n = num_draws(case_name)
    assert x.shape == (n,) + case.batch + fam.event_shape
    stats, mean = jax.jit(lambda nat, x: (fam.sufficient_stats(x), fam.mean_params(nat)))(nat, x)
    for mc, exact in zip(jax.tree.leaves(stats), jax.tree.leaves(mean), strict=True):
        mc = np.asarray(mc)
        se = mc.std(axis=0) / math.sqrt(n)
        assert np.all(np.isfinite(mc))
        assert np.all(np.abs(mc.mean(axis=0) - np.asarray(exact)) <= 5.0 * se + 1e-12)
    if fam.discrete:
        num_values = fam.dim if isinstance(fam, Categorical) else 2
        assert np.all((np.asarray(x) >= 0) & (np.asarray(x) < num_values))


def test_entropy_and_log_prob_match_numpyro(case, case_name, nat):
    fam = case.family
    d = fam.to_numpyro(nat)
    assert d.batch_shape == case.batch
    assert d.event_shape == fam.event_shape
    x = draws(case_name)[0][:7]  # an extra sample dim, broadcast over the batch

    @jax.jit
    def compare(nat, x):
        d = fam.to_numpyro(nat)
        return (fam.log_prob(nat, x), d.log_prob(x), Family.log_prob(fam, nat, x)), (
            fam.entropy(nat),
            d.entropy(),
            Family.entropy(fam, nat),
            fam.rule_view_and_entropy(nat)[1],  # from the mean parameters the rule view holds
        )

    (lp, lp_ref, lp_default), (ent, ent_ref, ent_default, ent_elbo) = compare(nat, x)
    assert lp.shape == (7,) + case.batch
    assert np.all(np.isfinite(lp))
    np.testing.assert_allclose(lp, lp_ref, rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(ent, ent_ref, rtol=1e-9, atol=1e-10)
    # families overriding log_prob / entropy (for stability) agree with the defaults
    # log q = <λ, T(x)> − A(λ) and H = A(λ) − <λ, μ>
    np.testing.assert_allclose(lp, lp_default, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(ent, ent_default, rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(ent_elbo, ent_ref, rtol=1e-9, atol=1e-10)


def test_entropy_and_log_prob_match_scipy(case, case_name, nat):
    fam = case.family
    x = draws(case_name)[0][0]
    lp, ent = jax.jit(lambda nat, x: (fam.log_prob(nat, x), fam.entropy(nat)))(nat, x)
    xs = elements(case, x)
    for i, elem in enumerate(elements(case, nat)):
        logpdf, entropy = case.ref_scipy(elem)
        ref = logpdf(np.asarray(xs[i], dtype=np.float64))
        np.testing.assert_allclose(np.ravel(lp)[i], ref, rtol=1e-8, atol=1e-10)
        np.testing.assert_allclose(np.ravel(ent)[i], entropy, rtol=1e-8, atol=1e-10)


# -- messages ----------------------------------------------------------------------------------


def test_message_of_conjugate_loss_is_its_coefficient(case, case_name, nat):
    """L linear in μ, L = <c, μ>: ∇_μ L = c exactly, whatever q is (checks the Fisher solve)."""
    fam = case.family
    rng = np.random.default_rng(100 + NAMES.index(case_name))
    c = jax.tree.map(lambda leaf: rng.normal(size=leaf.shape), nat)
    if isinstance(fam, GaussianDense):  # η₂ lives in the symmetric matrices
        c = c._replace(eta2=0.5 * (c.eta2 + np.swapaxes(c.eta2, -1, -2)))

    def loss(view):
        mean = fam.mean_params(fam.nat_from_view(view))
        return sum(jnp.sum(ci * mi) for ci, mi in zip(jax.tree.leaves(c), jax.tree.leaves(mean)))

    message = jax.jit(lambda nat: fam.message_from_view_grad(nat, jax.grad(loss)(fam.view(nat))))(nat)
    assert_tree_close(message, c, rtol=1e-8, atol=1e-8)


def test_message_of_nonlinear_loss_is_natural_gradient(case, case_name, nat):
    """message == F⁻¹ ∇_λ L with F = hessian(A), per element (in minimal coordinates)."""
    hessians, grads, message = per_element(case_name)
    per_elem = zip(elements(case, nat), elements(case, message), hessians, grads, strict=True)
    for elem, msg, hess, grad_nat in per_elem:
        basis = minimal_basis(case, elem)
        expected = basis @ np.linalg.solve(basis.T @ hess @ basis, basis.T @ grad_nat)
        np.testing.assert_allclose(ravel(msg), expected, rtol=1e-7, atol=1e-9)


# -- sampling ----------------------------------------------------------------------------------


@pytest.mark.parametrize("sample_shape", [(), (5,), (2, 3)])
def test_sample_shapes(case, nat, sample_shape):
    fam = case.family
    x = jax.eval_shape(lambda n: fam.sample(n, jax.random.key(0), sample_shape), nat)
    assert x.shape == sample_shape + case.batch + fam.event_shape
    if fam.discrete:
        assert jnp.issubdtype(x.dtype, jnp.integer)
    else:
        assert x.dtype == jax.tree.leaves(nat)[0].dtype


EXACT_MEAN_OF_X = {
    "gaussian": lambda fam, nat: fam.view(nat).mean,
    "gaussian-diag": lambda fam, nat: fam.view(nat).mean,
    "gamma": lambda fam, nat: fam.view(nat).shape / fam.view(nat).rate,
}


@pytest.mark.parametrize("name", REPARAM_CHECKED)
def test_sample_is_reparameterised(name):
    """The pathwise gradient of a Monte Carlo mean of x matches the gradient of E[x]."""
    case = CASES[name]
    fam = case.family
    mc = draws(name)[1]
    exact_loss = lambda n: jnp.sum(_weights(case) * EXACT_MEAN_OF_X[name](fam, n))  # noqa: E731
    exact = jax.jit(jax.grad(exact_loss))(make_nat(name))
    for a, e in zip(jax.tree.leaves(mc), jax.tree.leaves(exact), strict=True):
        np.testing.assert_allclose(a, e, rtol=0.05, atol=0.02)


# -- validity ----------------------------------------------------------------------------------


def test_is_valid(case, nat):
    fam = case.family
    is_valid = jax.jit(fam.is_valid)
    valid = is_valid(nat)
    assert valid.shape == () and valid.dtype == jnp.bool_
    assert bool(valid)
    invalid = case.make_invalid(nat)
    assert not bool(is_valid(invalid))
    for field in nat._fields:
        with_nan = _set(nat, field, (-1,) * getattr(nat, field).ndim, np.nan)
        assert not bool(is_valid(with_nan))
    assert not bool(fam.is_valid(invalid))  # also outside jit


# -- jit / vmap / float32 ----------------------------------------------------------------------


def test_vmap_matches_batched(case, nat):
    fam = case.family

    @jax.jit
    def both(nat):
        view_grad = jax.grad(nonlinear_loss)(fam.view(nat))
        methods = [
            (fam.log_partition, (nat,)),
            (fam.mean_params, (nat,)),
            (fam.nat_from_mean, (fam.mean_params(nat),)),
            (fam.view, (nat,)),
            (fam.entropy, (nat,)),
            (fam.message_from_view_grad, (nat, view_grad)),
        ]
        return [(jax.vmap(m)(*args), m(*args)) for m, args in methods], jax.vmap(fam.is_valid)(nat)

    pairs, valid = both(nat)
    for mapped, batched in pairs:
        assert_tree_close(mapped, batched, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(valid, np.ones(case.batch[0], dtype=bool))


def test_float32(case, case_name, nat):
    fam = case.family
    nat32 = jax.tree.map(lambda leaf: np.asarray(leaf, np.float32), nat)

    @jax.jit
    def run(nat32, x):
        view32 = fam.view(nat32)
        mean32 = fam.mean_params(nat32)
        return {
            "view": view32,
            "mean_params": mean32,
            "nat_from_mean": fam.nat_from_mean(mean32),
            "nat_from_view": fam.nat_from_view(view32),
            "log_partition": fam.log_partition(nat32),
            "entropy": fam.entropy(nat32),
            "log_prob": fam.log_prob(nat32, x),
            "message": fam.message_from_view_grad(nat32, jax.grad(nonlinear_loss)(view32)),
            "grad_log_partition": jax.grad(lambda n: fam.log_partition(n).sum())(nat32),
        }, fam.is_valid(nat32)

    x64 = np.asarray(draws(case_name)[0][:4])
    x = x64 if fam.discrete else x64.astype(np.float32)
    outputs, valid = run(nat32, x)
    # drawing in float32 (the Gamma samplers only by shape: compiling them is slow)
    sample = lambda n: fam.sample(n, jax.random.key(1), (4,))  # noqa: E731
    drawn = jax.eval_shape(sample, nat32) if case_name in GAMMA_SAMPLED else jax.jit(sample)(nat32)
    assert drawn.dtype == (x64.dtype if fam.discrete else jnp.float32)
    if not fam.discrete and case_name not in GAMMA_SAMPLED:
        assert np.all(np.isfinite(drawn))
    for what, out in outputs.items():
        for leaf in jax.tree.leaves(out):
            assert leaf.dtype == jnp.float32, what
            assert np.all(np.isfinite(leaf)), what
    assert bool(valid)
    assert_tree_close(outputs["nat_from_mean"], nat32, rtol=2e-3, atol=2e-3)
    assert_tree_close(outputs["nat_from_view"], nat32, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(outputs["entropy"], jax.jit(fam.entropy)(nat), rtol=1e-4, atol=1e-5)


# -- mean → natural inversions by Newton over a wide range -------------------------------------


def _round_trip(fam: Family, nat):
    return jax.jit(lambda nat: fam.view(fam.nat_from_mean(fam.mean_params(nat))))(nat)


def test_gamma_nat_from_mean_wide_range():
    rng = np.random.default_rng(21)
    a = 10.0 ** rng.uniform(-2.0, 3.0, size=2000)
    b = 10.0 ** rng.uniform(-2.0, 2.0, size=2000)
    back = _round_trip(Gamma(), GammaNat(a - 1.0, -b))
    np.testing.assert_allclose(back.shape, a, rtol=1e-7)
    np.testing.assert_allclose(back.rate, b, rtol=1e-7)


@pytest.mark.parametrize("k", [3, 20])
def test_dirichlet_nat_from_mean_wide_range(k):
    alpha = 10.0 ** np.random.default_rng(k).uniform(-2.0, 3.0, size=(500, k))
    back = _round_trip(Dirichlet(k), DirichletNat(alpha - 1.0)).concentration
    np.testing.assert_allclose(back, alpha, rtol=1e-6)


def test_beta_nat_from_mean_wide_range():
    ab = 10.0 ** np.random.default_rng(5).uniform(-2.0, 3.0, size=(2, 1000))
    back = _round_trip(Beta(), BetaNat(ab[0] - 1.0, ab[1] - 1.0))
    np.testing.assert_allclose(back.alpha, ab[0], rtol=1e-6)
    np.testing.assert_allclose(back.beta, ab[1], rtol=1e-6)


@pytest.mark.parametrize("name", ["gamma", "beta", "dirichlet"])
def test_float32_message_is_accurate_over_a_wide_range(name):
    """The Fisher solves avoid the cancellations that grow with the concentration: the
    float32 message agrees with the float64 one to 1e-4 of its size for α up to 1e4."""
    fam = CASES[name].family
    rng = np.random.default_rng(31)
    alpha = 10.0 ** rng.uniform(-2.0, 4.0, size=(300,) + fam.event_shape)
    scale = 10.0 ** rng.uniform(-2.0, 4.0, size=alpha.shape)
    nat = {
        "gamma": lambda: GammaNat(alpha - 1.0, -scale),
        "beta": lambda: BetaNat(alpha - 1.0, scale - 1.0),
        "dirichlet": lambda: DirichletNat(alpha - 1.0),
    }[name]()
    view_grad = jax.tree.map(lambda leaf: rng.normal(size=leaf.shape), fam.view(nat))
    solve = jax.jit(fam.message_from_view_grad)
    m64 = np.stack([np.asarray(leaf).reshape(300, -1) for leaf in solve(nat, view_grad)], -1).reshape(300, -1)
    to32 = lambda tree: jax.tree.map(lambda leaf: np.asarray(leaf, np.float32), tree)  # noqa: E731
    m32 = np.stack([np.asarray(leaf).reshape(300, -1) for leaf in solve(to32(nat), to32(view_grad))], -1)
    err = np.abs(m32.reshape(300, -1) - m64).max(-1) / np.abs(m64).max(-1)
    assert err.max() < 1e-4


# -- linearising the model: what each family pushes through it (hand-worked) ----------------

#: family, view, (linearisation point, block value there), {tag: tangent stack} by default
LINEARISATION = [
    (Gamma(), GammaView(jnp.array(2.0), jnp.array(3.0)), (0.0, 1.0), {"gamma": [1.0, 2.0, 3.0]}),
    (Beta(), BetaView(jnp.array(2.0), jnp.array(6.0)), (0.25, 0.25), {"beta": [2.0, 6.0]}),
    (Dirichlet(2), DirichletView(jnp.array([1.0, 3.0])), ([0.25, 0.75], [0.25, 0.75]),
     {"dirichlet": [[1.0, 3.0], [4.0, 4.0]]}),
    (GaussianDiag(), DiagGaussianView(jnp.array([1.0, 2.0]), jnp.array([4.0, 9.0])), ([1.0, 2.0], [1.0, 2.0]),
     {"left": [[1.0, 1.0]], "right": [[4.0, 9.0]]}),
    # columns j of Σ = [[2, 1], [1, 3]]: Σ e_0 = (2, 1), Σ e_1 = (1, 3)
    (GaussianDense(2), GaussianView(jnp.array([1.0, 2.0]), jnp.array([[2.0, 1.0], [1.0, 3.0]])), ([1.0, 2.0], [1.0, 2.0]),
     {"left": [[1.0, 0.0], [0.0, 1.0]], "right": [[2.0, 1.0], [1.0, 3.0]]}),
]


@pytest.mark.parametrize("family,view,point,tangents", LINEARISATION, ids=[type(c[0]).__name__ for c in LINEARISATION])
def test_linearisation_point_and_tangents(family, view, point, tangents):
    x = family.linearisation_point(view)
    np.testing.assert_allclose(x, point[0])
    np.testing.assert_allclose(family.from_linearisation(x), point[1])
    got = family.tangent_sets(view, full=False)
    assert set(got) == set(tangents)
    for tag, want in tangents.items():
        np.testing.assert_allclose(got[tag], want)


def test_full_columns_of_a_plated_dense_gaussian_are_one_per_scalar():
    """Two plate elements of a 2-D Gaussian: four columns, each nonzero at its own element."""
    cov = jnp.stack([jnp.array([[2.0, 1.0], [1.0, 3.0]]), jnp.array([[5.0, 0.0], [0.0, 7.0]])])
    got = GaussianDense(2).tangent_sets(GaussianView(jnp.zeros((2, 2)), cov), full=True)
    assert got["left"].shape == got["right"].shape == (4, 2, 2)
    np.testing.assert_allclose(got["left"].reshape(4, 4), np.eye(4))
    want = np.zeros((4, 2, 2))
    want[0, 0], want[1, 0], want[2, 1], want[3, 1] = [2.0, 1.0], [1.0, 3.0], [5.0, 0.0], [0.0, 7.0]
    np.testing.assert_allclose(got["right"], want)


# -- what each family tells the code outside it (hand-worked) --------------------------------

#: family, (gaussian, dense_event, indexes_support), view type, canonical batch shape of a
#: value of shape (2, 5, 3) whose axis 0 is a plate
KNOWLEDGE = [
    (GaussianDense(15), (True, True, False), GaussianView, (2,)),
    (GaussianDiag(), (True, False, False), DiagGaussianView, (2, 5, 3)),
    (Gamma(), (False, False, False), GammaView, (2, 5, 3)),
    (Beta(), (False, False, False), BetaView, (2, 5, 3)),
    (Dirichlet(3), (False, False, False), DirichletView, (2, 5)),
    (Categorical(4), (False, False, True), CategoricalView, (2, 5, 3)),
    (Bernoulli(), (False, False, False), CategoricalView, (2, 5, 3)),
]


@pytest.mark.parametrize("family,flags,view_type,batch", KNOWLEDGE, ids=[type(c[0]).__name__ for c in KNOWLEDGE])
def test_family_flags_view_type_and_canonical_batch_shape(family, flags, view_type, batch):
    assert (family.gaussian, family.dense_event, family.indexes_support) == flags
    assert family.view_type is view_type
    assert isinstance(family.view(family.nat_from_view(_some_view(family))), view_type)
    assert family.canonical_batch_shape((2, 5, 3), (0,)) == batch


#: family, (support, native), the family built for a value of shape (2, 5, 3) whose axis 0 is
#: a plate (with 4 enumerated values for the discrete ones), enumerated values it fits
CHOICE = [
    (GaussianDense, ("real", True), GaussianDense(15), [None]),
    (GaussianDiag, ("real", False), GaussianDiag(), [None]),
    (Gamma, ("positive", True), Gamma(), [None]),
    (Beta, ("unit_interval", True), Beta(), [None]),
    (Dirichlet, ("simplex", True), Dirichlet(3), [None]),
    (Wishart, ("positive_definite", True), Wishart(3), [None]),
    (Categorical, ("discrete", True), Categorical(4), [(0, 1), (0, 1, 2, 3), (1, 2)]),
    (Bernoulli, ("discrete", True), Bernoulli(), [(0, 1)]),
]


@pytest.mark.parametrize("cls,support,built,fits", CHOICE, ids=[c[0].__name__ for c in CHOICE])
def test_family_support_and_configuration_for_a_block(cls, support, built, fits):
    assert (cls.support, cls.native) == support
    assert cls.for_value((2, 5, 3), (0,), 4) == built
    assert all(cls.fits(values) for values in fits)
    assert FAMILIES[cls.name] is cls
    if cls is Bernoulli:  # only a 0/1 latent
        assert not cls.fits((1, 2)) and not cls.fits((0, 1, 2))


def test_default_family_is_the_first_native_one_that_fits():
    natives = [c for c in FAMILIES.values() if c.native]
    for support, values, want in [("discrete", (0, 1), Bernoulli), ("discrete", (0, 1, 2), Categorical),
                                  ("real", None, GaussianDense), ("positive", None, Gamma)]:
        assert next(c for c in natives if c.support == support and c.fits(values)) is want


def test_dense_canonical_batch_shape_follows_the_plate_axes_order():
    assert GaussianDense(5).canonical_batch_shape((2, 5, 3), (2, 0)) == (3, 2)
    assert GaussianDense(30).canonical_batch_shape((2, 5, 3), ()) == ()


def _some_view(family):
    """A valid view of one element (two for the elementwise families)."""
    return {
        GaussianDense: lambda: GaussianView(jnp.zeros(family.event_shape), jnp.eye(*family.event_shape)),
        GaussianDiag: lambda: DiagGaussianView(jnp.zeros(2), jnp.ones(2)),
        Gamma: lambda: GammaView(jnp.ones(2), jnp.ones(2)),
        Beta: lambda: BetaView(jnp.ones(2), jnp.ones(2)),
        Dirichlet: lambda: DirichletView(jnp.ones(family.event_shape)),
        Categorical: lambda: CategoricalView(jnp.full((4,), 0.25)),
        Bernoulli: lambda: CategoricalView(jnp.array([0.5, 0.5])),
    }[type(family)]()


#: family, initial value (canonical layout), the view of its initial natural parameters
INITIAL = [
    (GaussianDense(2), [1.0, 2.0], GaussianView(jnp.array([1.0, 2.0]), jnp.eye(2))),
    (GaussianDiag(), [1.0, 2.0], DiagGaussianView(jnp.array([1.0, 2.0]), jnp.ones(2))),
    # shape 10, rate 10/x: mean x
    (Gamma(), [2.0, 0.5], GammaView(jnp.array([10.0, 10.0]), jnp.array([5.0, 20.0]))),
    # α = 2x + ½, β = 2(1 − x) + ½
    (Beta(), [0.25, 0.5], BetaView(jnp.array([1.0, 1.5]), jnp.array([2.0, 1.5]))),
    # α = K x + ½
    (Dirichlet(2), [0.25, 0.75], DirichletView(jnp.array([1.0, 2.0]))),
]


@pytest.mark.parametrize("family,x,view", INITIAL, ids=[type(c[0]).__name__ for c in INITIAL])
def test_initial_nat(family, x, view):
    got = family.view(family.initial_nat(jnp.asarray(x)))
    for a, b in zip(got, view):
        np.testing.assert_allclose(a, b, rtol=1e-12)


@pytest.mark.parametrize(
    "family, nat, density",
    [
        # (float32 draws of concentrations 0.1 round to 0: 3 in 36,000 of Beta(0.1, 0.9), where
        # its density is infinite and PSIS k̂ of a fit came out inf)
        (Beta(), BetaNat(jnp.full(36, -0.9, jnp.float32), jnp.full(36, -0.1, jnp.float32)),
         lambda x: dist.Beta(0.1, 0.9).log_prob(x)),
        (Dirichlet(3), DirichletNat(jnp.full((12, 3), -0.9, jnp.float32)),
         lambda x: dist.Dirichlet(jnp.full(3, 0.1)).log_prob(x)),
        (Gamma(), GammaNat(jnp.full(36, -0.95, jnp.float32), jnp.full(36, -1.0, jnp.float32)),
         lambda x: dist.Gamma(0.05, 1.0).log_prob(x)),
    ],
)
def test_float32_draws_of_small_concentrations_stay_inside_the_open_support(family, nat, density):
    x = family.sample(nat, jax.random.key(0), (1000,))
    assert x.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(density(x)))), int(np.sum(~np.isfinite(np.asarray(density(x)))))


def test_gaussian_curvature_algebra_dense():
    """P = [[2, 1], [1, 3]]: P (1, 2) = (4, 7); an indefinite P gets |eigenvalues|."""
    fam = GaussianDense(2)
    prec, x = jnp.array([[2.0, 1.0], [1.0, 3.0]]), jnp.array([1.0, 2.0])
    np.testing.assert_allclose(fam.precision_times(prec, x), [4.0, 7.0])
    np.testing.assert_allclose(fam.solve_precision(prec, jnp.array([4.0, 7.0])), x, rtol=1e-12)
    np.testing.assert_allclose(fam.identity_precision(jnp.zeros((3, 2))), np.broadcast_to(np.eye(2), (3, 2, 2)))
    view = GaussianView(x, prec)
    np.testing.assert_allclose(fam.view_covariance(view), prec)
    np.testing.assert_allclose(fam.marginal_variance(view), [2.0, 3.0])
    np.testing.assert_allclose(fam.positive_curvature(prec), prec)  # positive definite: kept
    np.testing.assert_allclose(fam.positive_curvature(jnp.diag(jnp.array([1.0, -4.0]))), np.diag([1.0, 4.0]))
    # two plate elements of dimension 2: the Hessian's diagonal 2×2 blocks, couplings dropped
    h = jnp.arange(16.0).reshape(4, 4)
    np.testing.assert_allclose(fam.curvature_of_hessian(h, (2, 2)), [[[0, 1], [4, 5]], [[10, 11], [14, 15]]])


def test_gaussian_curvature_algebra_diagonal():
    fam = GaussianDiag()
    prec, x = jnp.array([2.0, 4.0]), jnp.array([1.0, 2.0])
    np.testing.assert_allclose(fam.precision_times(prec, x), [2.0, 8.0])
    np.testing.assert_allclose(fam.solve_precision(prec, jnp.array([2.0, 8.0])), x)
    np.testing.assert_allclose(fam.identity_precision(x), [1.0, 1.0])
    view = DiagGaussianView(x, prec)
    np.testing.assert_allclose(fam.view_covariance(view), prec)
    np.testing.assert_allclose(fam.marginal_variance(view), prec)
    np.testing.assert_allclose(fam.positive_curvature(jnp.array([1.0, -4.0])), [1.0, 4.0])
    np.testing.assert_allclose(fam.curvature_of_hessian(jnp.arange(4.0).reshape(2, 2), (2,)), [0.0, 3.0])


@pytest.mark.parametrize("shared", [True, False], ids=["rows share S", "one row differs"])
def test_dense_rows_view_and_entropy_with_and_without_a_shared_precision(shared):
    """A plated dense Gaussian whose rows share one precision S (factorised once) and one
    whose rows do not (factorised row by row): m = S⁻¹ η₁, Σ = S⁻¹ and the entropy
    ½ D (1 + log 2π) − ½ log|S| per row, against numpy's inverse and log-determinant."""
    rng = np.random.default_rng(7)
    rows, dim = 6, 4
    r = rng.normal(size=(dim, dim))
    prec = np.broadcast_to(np.eye(dim) + r @ r.T, (rows, dim, dim)).copy()
    if not shared:
        prec[3] += np.diag(np.arange(1.0, dim + 1))
    eta1 = rng.normal(size=(rows, dim))
    family = GaussianDense(dim)
    view, entropy = family.rule_view_and_entropy(GaussianNat(jnp.asarray(eta1), jnp.asarray(-0.5 * prec)))
    cov = np.linalg.inv(prec)
    np.testing.assert_allclose(view.cov, cov, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(view.mean, np.einsum("nij,nj->ni", cov, eta1), rtol=1e-10, atol=1e-12)
    want = 0.5 * dim * (1 + np.log(2 * np.pi)) - 0.5 * np.linalg.slogdet(prec)[1]
    np.testing.assert_allclose(entropy, want, rtol=1e-12)


@pytest.mark.parametrize("dim", [17, 40, 64])
def test_a_batch_of_large_precisions_is_inverted_by_halves(dim):
    # more than BLOCK_LEAF rows: Σ and log|S| by Schur complements of halves (a factor model's
    # rows with missing entries), equal to the inverse and determinant numpy computes; a
    # matrix that is not positive definite gives NaN in its own row only
    rng = np.random.default_rng(dim)
    a = rng.normal(size=(5, dim, dim))
    prec = a @ np.swapaxes(a, -1, -2) / dim + 0.05 * np.eye(dim)
    prec[3] -= 2.0 * np.linalg.eigvalsh(prec[3]).max() * np.eye(dim)  # negative definite
    eta1 = rng.normal(size=(5, dim))
    fam = GaussianDense(dim)
    view, entropy = fam.rule_view_and_entropy(GaussianNat(jnp.asarray(eta1), jnp.asarray(-0.5 * prec)))
    good = [0, 1, 2, 4]
    cov = np.linalg.inv(prec[good])
    np.testing.assert_allclose(np.asarray(view.cov)[good], cov, rtol=1e-9, atol=1e-9 * np.abs(cov).max())
    np.testing.assert_allclose(np.asarray(view.mean)[good], np.einsum("bij,bj->bi", cov, eta1[good]), rtol=1e-8, atol=1e-9)
    want = 0.5 * dim * (1.0 + math.log(2 * math.pi)) - 0.5 * np.linalg.slogdet(prec[good])[1]
    np.testing.assert_allclose(np.asarray(entropy)[good], want, rtol=1e-10)
    assert np.all(np.isnan(np.asarray(view.cov)[3])) and np.isnan(np.asarray(entropy)[3])
    assert fam.dim > gaussian_module.BLOCK_LEAF
