"""GaussianTied (rows sharing one covariance) against GaussianDense with that covariance
given to every row: the dense family is the reference of every map, and of the learning
rule when the rows' messages are equal (the condition under which the compiler ties rows).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blrppl.families import GaussianDense, GaussianNat, GaussianTied

ROWS, D = (4, 3), 3


def _prec(rng, d=D):
    r = rng.normal(size=(d, d))
    return np.eye(d) + r @ r.T / d


@pytest.fixture
def pair():
    """(tied nat, the dense nat of the same rows): η₂ (D, D) against η₂ broadcast per row."""
    rng = np.random.default_rng(0)
    prec = _prec(rng)
    eta1 = jnp.asarray(rng.normal(size=ROWS + (D,)))
    tied = GaussianNat(eta1, jnp.asarray(-0.5 * prec))
    dense = GaussianNat(eta1, jnp.broadcast_to(tied.eta2, ROWS + (D, D)))
    return tied, dense


T, G = GaussianTied(D), GaussianDense(D)


def test_views_entropy_and_densities_are_the_dense_rows(pair):
    tied, dense = pair
    view, entropy = T.rule_view_and_entropy(tied)
    want, want_entropy = G.rule_view_and_entropy(dense)
    assert view.cov.shape == (D, D)  # one covariance, not one per row
    np.testing.assert_allclose(view.mean, want.mean, rtol=1e-12)
    np.testing.assert_allclose(np.broadcast_to(view.cov, want.cov.shape), want.cov, rtol=1e-12)
    np.testing.assert_allclose(entropy, want_entropy, rtol=1e-12)
    np.testing.assert_allclose(T.view(tied).cov, want.cov, rtol=1e-12)
    np.testing.assert_allclose(T.marginal_variance(view), G.marginal_variance(want), rtol=1e-12)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(5,) + ROWS + (D,)))
    np.testing.assert_allclose(T.log_prob(tied, x), G.log_prob(dense, x), rtol=1e-12)
    np.testing.assert_allclose(T.log_partition(tied), G.log_partition(dense), rtol=1e-12)
    got, ref = T.to_numpyro(tied), G.to_numpyro(dense)
    np.testing.assert_allclose(got.mean, ref.mean, rtol=1e-12)
    np.testing.assert_allclose(got.covariance_matrix, ref.covariance_matrix, rtol=1e-12)


def test_exponential_family_identities(pair):
    tied, _ = pair
    # μ = ∇A(λ), with A the sum of the rows' log partitions
    grad = jax.grad(lambda nat: jnp.sum(T.log_partition(nat)))(tied)
    mean_params = T.mean_params(tied)
    np.testing.assert_allclose(mean_params.eta1, grad.eta1, rtol=1e-10)
    np.testing.assert_allclose(mean_params.eta2, grad.eta2, rtol=1e-10)
    back = T.nat_from_mean(mean_params)
    np.testing.assert_allclose(back.eta1, tied.eta1, rtol=1e-10)
    np.testing.assert_allclose(back.eta2, tied.eta2, rtol=1e-10)
    # log q(x) = ⟨λ, T(x)⟩ − A(λ), summed over the rows
    x = jnp.asarray(np.random.default_rng(2).normal(size=ROWS + (D,)))
    stats = T.sufficient_stats(x)
    inner = jnp.sum(tied.eta1 * stats.eta1) + jnp.sum(tied.eta2 * stats.eta2)
    np.testing.assert_allclose(inner - jnp.sum(T.log_partition(tied)), jnp.sum(T.log_prob(tied, x)), rtol=1e-12)
    # a view round trip
    again = T.nat_from_view(T.rule_view(tied))
    np.testing.assert_allclose(again.eta2, tied.eta2, rtol=1e-10)
    np.testing.assert_allclose(again.eta1, tied.eta1, rtol=1e-10)


def _objective(a, b):
    """A conjugate-like objective of a dense view: Σ_p (aᵀ m_p + ⟨B, Σ_p + m_p m_pᵀ⟩) with
    the same B for every row (as the factors of tied rows give)."""

    def value(view):
        cov = jnp.broadcast_to(view.cov, view.mean.shape + (D,))
        second = cov + view.mean[..., :, None] * view.mean[..., None, :]
        return jnp.sum(view.mean * a) + jnp.sum(second * b)

    return value


@pytest.mark.parametrize("rho, retract", [(1.0, False), (0.3, False), (1.0, True)])
def test_learning_rule_step_is_the_dense_step_of_every_row(pair, rho, retract):
    tied, dense = pair
    rng = np.random.default_rng(3)
    a = jnp.asarray(rng.normal(size=ROWS + (D,)))
    b = jnp.asarray(-0.5 * _prec(rng))  # every row's factor adds precision −2B
    value = _objective(a, b)
    view_t, view_d = T.rule_view(tied), G.rule_view(dense)
    msg_t = T.message_at(tied, view_t, jax.grad(value)(view_t))  # (the covariance's gradient sums the rows')
    msg_d = G.message_at(dense, view_d, jax.grad(value)(view_d))
    assert msg_t.eta2.shape == (D, D)
    np.testing.assert_allclose(np.broadcast_to(msg_t.eta2, msg_d.eta2.shape), msg_d.eta2, rtol=1e-12)
    np.testing.assert_allclose(msg_t.eta1, msg_d.eta1, rtol=1e-12)
    np.testing.assert_allclose(T.message_from_view_grad(tied, jax.grad(value)(view_t)).eta1, msg_d.eta1, rtol=1e-12)
    new_t, new_d = T.update(tied, msg_t, rho, retract), G.update(dense, msg_d, rho, retract)
    np.testing.assert_allclose(np.broadcast_to(new_t.eta2, new_d.eta2.shape), new_d.eta2, rtol=1e-10)
    np.testing.assert_allclose(new_t.eta1, new_d.eta1, rtol=1e-10)


def test_validity_and_samples(pair):
    tied, _ = pair
    assert bool(T.is_valid(tied))
    assert not bool(T.is_valid(tied._replace(eta2=-tied.eta2)))
    assert not bool(T.is_valid(tied._replace(eta1=tied.eta1.at[0, 0, 0].set(jnp.nan))))
    n = 4000
    x = T.sample(tied, jax.random.PRNGKey(0), (n,))
    assert x.shape == (n,) + ROWS + (D,)
    view = T.rule_view(tied)
    sd = np.sqrt(np.diagonal(view.cov))
    # means: 4000 draws give a standard error of sd/63 per entry (tolerance: 5 of them)
    assert np.all(np.abs(x.mean(0) - view.mean) < 5 * sd / np.sqrt(n))
    # covariance of each row (pooled over rows: 16000 draws, relative error of a
    # variance ≈ √(2/16000) ≈ 0.011; tolerance 0.06)
    centred = (x - view.mean).reshape(-1, D)
    np.testing.assert_allclose(centred.T @ centred / centred.shape[0], view.cov, atol=0.06 * sd.max() ** 2)
