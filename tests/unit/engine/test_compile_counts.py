"""What compiling a fit costs: the model's Python code runs into one traced program
(``ModelProgram``), the counts a fit reports, keys derived without XLA, and conjugate Gaussian
messages taken without factorising the block's precision."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

from blrppl import blr_fit
from blrppl.bench.models import random_intercepts_model
from blrppl.model.program import ModelProgram
from blrppl.families import GaussianDense, GaussianDiag, GaussianNat
from blrppl.families.gaussian import DiagGaussianNat
from blrppl.estimators.gram import GramSource
from blrppl.graph.data import DataSpec
from blrppl.runtime.counting import xla_compilations
from blrppl.model.trace import model_runs
from blrppl.inputs import fit_options, host_fold_in, host_split

X = np.random.default_rng(0).normal(size=(40, 3))
Y = X @ np.array([1.0, -0.5, 0.25]) + 0.3 * np.random.default_rng(1).normal(size=40)


def regression(X, y=None):
    beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("n", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ beta, sigma), obs=y)


def test_a_fit_runs_the_model_at_most_three_times_and_a_refit_compiles_nothing():
    def model(X, y=None):  # a new function: not in the compiled-fit cache
        regression(X, y)

    first = blr_fit(model, {"X": X, "y": Y}, rng_key=random.PRNGKey(0), progress_bar=False)
    assert first.compile_counts.model_runs <= 3
    again = blr_fit(model, {"X": X, "y": Y}, rng_key=random.PRNGKey(0), progress_bar=False)
    # the refit traces the model once (is it the same program?) and compiles nothing
    assert again.compile_counts == (1, 0, 0)
    np.testing.assert_array_equal(first.elbo, again.elbo)


def test_a_refit_with_another_tol_compiles_nothing():
    """``tol`` is an argument of the compiled loop: a looser one stops the same program
    earlier, a tighter one later (the steps themselves are the same)."""

    def model(X, y=None):
        regression(X, y)

    fits = [
        blr_fit(model, {"X": X, "y": Y}, rng_key=random.PRNGKey(0), tol=tol, progress_bar=False)
        for tol in (1e-10, 1e-3, 1e-10)
    ]
    assert [f.compile_counts.xla_compilations for f in fits[1:]] == [0, 0]
    assert fits[1].num_steps < fits[0].num_steps == fits[2].num_steps
    np.testing.assert_array_equal(fits[1].elbo, fits[0].elbo[: fits[1].num_steps])
    assert "1e-03" in fits[1].message or "0.001" in fits[1].message


def test_model_program_traces_once_and_prunes_to_the_sites_asked_for():
    program = ModelProgram(regression)
    spec, data = DataSpec.split((), {"X": X, "y": Y})
    full = {"beta": jnp.array([0.5, 0.0, -1.0]), "sigma": jnp.array(2.0)}
    before = model_runs()
    sites = program.sites(("y",), full, data, {}, spec)
    assert model_runs() - before == 1
    np.testing.assert_allclose(sites["y"]["fn"].loc, X @ np.array([0.5, 0.0, -1.0]), rtol=1e-6)
    np.testing.assert_allclose(sites["y"]["fn"].scale, 2.0)
    np.testing.assert_allclose(sites["y"]["value"], Y, rtol=1e-6)
    # other sites, other values, inside jit and vmap: the same program, no new run
    prior = program.sites(("beta", "sigma"), {**full, "sigma": jnp.array(3.0)}, data, {}, spec)
    assert float(prior["sigma"]["value"]) == 3.0

    @jax.jit
    def log_density(beta):
        entry = program.sites(("y",), {**full, "beta": beta}, data, {}, spec)["y"]
        return entry["fn"].log_prob(entry["value"]).sum()

    betas = jnp.stack([full["beta"], jnp.zeros(3)])
    got = jax.vmap(log_density)(betas)
    want = [dist.Normal(X @ np.asarray(b), 2.0).log_prob(Y).sum() for b in betas]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert model_runs() - before == 1


@pytest.mark.parametrize("partitionable", [True, False])
def test_keys_derived_on_the_host_are_jax_random_keys(partitionable):
    """host_split / host_fold_in / seed_key give exactly jax.random's keys (a fit's random
    streams do not depend on where its keys were derived), without an XLA computation."""
    from blrppl.inputs import seed_key

    old = jax.config.jax_threefry_partitionable
    jax.config.update("jax_threefry_partitionable", partitionable)
    try:
        for seed in (0, 3, 2**40 + 7):
            key = random.key(seed)
            before = xla_compilations()
            got = [np.asarray(random.key_data(k)) for k in host_split(key, 5)]
            folded = [np.asarray(random.key_data(host_fold_in(key, v))) for v in (0, 7, 123_456)]
            made = np.asarray(random.key_data(seed_key(seed)))
            assert xla_compilations() == before
            want = [np.asarray(random.key_data(k)) for k in random.split(key, 5)]
            np.testing.assert_array_equal(got, want)
            want = [np.asarray(random.key_data(random.fold_in(key, v))) for v in (0, 7, 123_456)]
            np.testing.assert_array_equal(folded, want)
            np.testing.assert_array_equal(made, np.asarray(random.key_data(key)))
    finally:
        jax.config.update("jax_threefry_partitionable", old)


# A conjugate (quadratic) expected log-density of a Gaussian block, with hand-worked message:
# L(m, Σ) = −½ t (mᵀGm + 2 hᵀm + tr(GΣ))  ⇒  λ̃ = ∇_μ L = (−t h, −½ t G) at every q.
G = np.array([[2.0, 0.5], [0.5, 1.0]])
H = np.array([0.3, -1.2])
T = 1.7


def _quadratic(view):
    return -0.5 * T * (view.mean @ (G @ view.mean) + 2 * H @ view.mean + jnp.sum(G * view.cov))


@pytest.mark.parametrize("mean, var", [([0.0, 0.0], [1.0, 1.0]), ([2.0, -3.0], [0.2, 5.0])])
def test_fixed_view_message_equals_the_message_at_any_q(mean, var):
    dense = GaussianDense(2)
    prec = np.diag(1.0 / np.asarray(var))
    nat = GaussianNat(jnp.asarray(prec @ np.asarray(mean)), jnp.asarray(-0.5 * prec))
    view = dense.view(nat)
    at_q = dense.message_from_view_grad(nat, jax.grad(_quadratic)(view))
    fixed = dense.message_from_fixed_view_grad(jax.grad(_quadratic)(dense.fixed_view(view)))
    for got in (at_q, fixed):
        np.testing.assert_allclose(got.eta1, -T * H, atol=1e-6)
        np.testing.assert_allclose(got.eta2, -0.5 * T * G, atol=1e-6)
    # elementwise Gaussians have no fixed view: a factor may couple their elements
    diag = GaussianDiag()
    assert diag.fixed_view(diag.view(DiagGaussianNat(jnp.zeros(2), -0.5 * jnp.ones(2)))) is None


def test_a_compilation_that_fails_is_not_kept(monkeypatch):
    """The chunk compiles on a worker thread after the compiled fit is cached: when that
    compilation fails, the fit raises and the next fit compiles again."""
    from blrppl.runtime import program_store

    def model(X, y=None):
        regression(X, y)

    compile_lowered = program_store.compile_lowered

    def broken(lowered, options):
        if threading.current_thread().name.startswith("blrppl-compile"):  # (the fit's chunk)
            raise RuntimeError("XLA failed")
        return compile_lowered(lowered, options)

    with monkeypatch.context() as m:
        m.setattr(program_store, "compile_lowered", broken)
        m.setenv("BLRPPL_COMPILATION_CACHE", "0")  # (nothing read from the program store)
        with pytest.raises(RuntimeError, match="XLA failed"):
            blr_fit(model, {"X": X, "y": Y}, progress_bar=False)
    result = blr_fit(model, {"X": X, "y": Y}, progress_bar=False)
    assert result.converged and np.all(np.isfinite(result.elbo))


def _splits_in_step(model, data):
    """How many ``random_split`` the jitted step of ``model`` holds (each one a threefry
    program lowered and compiled with the fit)."""
    from blrppl.engine.step import initial_state, make_step
    from blrppl.model.trace import trace_model
    from blrppl.compiler.families import init_nat
    from blrppl.compiler.pipeline import compile_model

    records, spec, dyn, _ = trace_model(model, (), data, jax.random.key(0))
    plan, fns, dyn, init, _ = compile_model(ModelProgram(model), records, spec, dyn, rng_key=jax.random.key(1))
    step, _, _, _ = make_step(plan, fns, "sequential")
    nat = {b.name: init_nat(b, init[b.name]) for b in plan.blocks}
    rho = {n: jnp.asarray(1.0) for n in plan.order}
    jaxpr = jax.make_jaxpr(step)(initial_state(nat, jax.random.key(2)), dyn, rho)
    return str(jaxpr).count("random_split"), plan


def test_a_closed_form_step_splits_no_key():
    def conjugate(X, y):
        beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        tau = numpyro.sample("tau", dist.Gamma(2.0, 2.0))
        with numpyro.plate("n", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ beta, 1.0 / jnp.sqrt(tau)), obs=y)

    splits, plan = _splits_in_step(conjugate, {"X": X, "y": Y})
    assert all(f.estimator == "exact" for f in plan.factors)
    assert splits == 0  # nothing draws: the state's key is kept
    # a Monte Carlo factor draws: its key is split off
    splits, plan = _splits_in_step(regression, {"X": X, "y": Y})
    assert any(f.estimator != "exact" for f in plan.factors) and splits > 1


def test_starting_values_are_computed_on_the_host():
    """A fit's initial natural parameters, from concrete values, compile nothing and equal
    the traced computation's (which ``jax.eval_shape`` of the start still uses)."""
    from blrppl.model.trace import trace_model
    from blrppl.compiler.families import choose_family, init_nat

    def model():
        with numpyro.plate("n", 3):
            numpyro.sample("a", dist.Normal(0.0, 1.0))
            numpyro.sample("b", dist.Gamma(2.0, 1.0))
            numpyro.sample("c", dist.Beta(2.0, 2.0))
            numpyro.sample("z", dist.Bernoulli(0.3))
        numpyro.sample("d", dist.Dirichlet(jnp.ones(4)))
        numpyro.sample("k", dist.Categorical(jnp.ones(3) / 3))

    records, _, _, _ = trace_model(model, (), {}, jax.random.key(0))
    rng = np.random.default_rng(0)
    for name, record in records.items():
        for override in ([None, "gaussian-diag"] if name == "a" else [None]):
            block = choose_family(record, override)
            value = np.asarray(record.init_value)
            probs = rng.dirichlet(np.ones(len(block.support_values)), size=block.value_shape) if block.discrete else None
            before = xla_compilations()
            host = init_nat(block, value, probs)
            assert xla_compilations() == before, name
            assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(host)), name
            traced = jax.jit(lambda v, p, block=block: init_nat(block, v, p))(value, probs)
            for got, want in zip(jax.tree.leaves(host), jax.tree.leaves(traced)):
                assert got.dtype == want.dtype
                np.testing.assert_allclose(got, want, rtol=1e-12)


def test_data_statistics_of_priors_compile_no_program_of_their_own(monkeypatch):
    """A Gaussian prior's data statistics read no data: computed inside the fit's programs
    (no program compiled for them before the first step), with the same posterior as when
    they are precomputed."""
    import blrppl.engine.build as build
    from blrppl.engine import prepare as prepare_module
    from blrppl.engine import run as run_module

    # (30 intercepts with μ_a and b: a joint block of 32 scalars, large enough for statistics)
    rng = np.random.default_rng(4)
    county = np.concatenate([np.arange(30), rng.integers(0, 30, size=70)])
    x = rng.integers(0, 2, size=100).astype(float)
    y = 1.0 + 0.5 * rng.normal(size=30)[county] - 0.6 * x + 0.8 * rng.normal(size=100)
    data = {"county": county, "x": x, "num_counties": 30, "y": y}
    monkeypatch.setenv("BLRPPL_COMPILATION_CACHE", "0")  # (nothing from the program store)

    def model(county, x, num_counties, y=None):  # a new function: not in the compiled-fit cache
        random_intercepts_model(county, x, num_counties, y)

    prepared = prepare_module.prepare(ModelProgram(model), (), data, fit_options(), random.PRNGKey(0))
    gram_factors = [f.name for f in prepared.plan.factors if isinstance(f.spec.statistics, GramSource)]
    assert gram_factors and prepared.bundle.statistics_fn is None  # all of them read no data
    assert prepared.bundle._statistics_compiled is None  # (no program of their own)
    assert prepared.compile_counts.xla_compilations <= 2
    result = run_module.run(prepared, prepared.state, 1000, False)

    def model2(county, x, num_counties, y=None):
        random_intercepts_model(county, x, num_counties, y)

    original = build._statistics_fns

    def all_precomputed(plan, fns, data):  # (as before: computed once, before the loop)
        varying, constant = original(plan, fns, data)
        assert varying is None and constant is not None
        return constant, None

    monkeypatch.setattr(build, "_statistics_fns", all_precomputed)
    reference = blr_fit(model2, data, rng_key=random.PRNGKey(0), progress_bar=False, refine=False)
    for name in ("mu_a", "b", "a"):
        np.testing.assert_allclose(result.posterior[name].mean, reference.posterior[name].mean, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(result.elbo[-1], reference.elbo[-1], rtol=1e-10)
