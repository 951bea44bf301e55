"""The refinement's choice and its bounds (:mod:`blrppl.engine.refine`), with stand-in fits:
which candidate is kept, the time budget, a failing remedy, and the option checks."""

from __future__ import annotations

import math
import time
import types

import jax.numpy as jnp
import numpy as np

import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

import reference_models as rm
from blrppl import BLRError, blr_fit
from blrppl.engine import refine as refine_mod
from blrppl.inputs import fit_options
from blrppl.posterior.diagnostics import Diagnostics


def _result(khat, bound, ess=0.5, num_draws=1000):
    d = Diagnostics(khat=khat, num_draws=num_draws, elbo_rel_change=0.0, rejected_steps=0, elbo_noise=0.0, ess=ess, bound=bound)
    return types.SimpleNamespace(diagnostics=d, plan=None, nat={}, converged=True)


def _run(monkeypatch, first, outcomes, budget=5.0, seconds=0.0):
    """Refine ``first`` with candidates whose fits give ``outcomes`` (a result, or an exception
    to raise), each taking ``seconds``."""
    cands = [refine_mod.Candidate(f"c{i}", None, None) for i in range(len(outcomes))]
    monkeypatch.setattr(refine_mod, "candidates", lambda *a: cands)
    calls = []

    def fit(options, key, init_values=None, start=0, deadline=None, design=None):
        out = outcomes[len(calls)]
        calls.append(out)
        time.sleep(seconds)
        if isinstance(out, Exception):
            raise out
        return out, [f"warning of c{len(calls) - 1}"]

    result, held, refinements = refine_mod.refine(fit, first, ["first"], fit_options(), None, 1.0, budget, False)
    return result, held, refinements, calls


def test_a_good_first_fit_is_not_refined(monkeypatch):
    first = _result(0.3, -10.0, ess=0.9)
    result, held, refinements, calls = _run(monkeypatch, first, [_result(0.2, -5.0)])
    assert result is first and held == ["first"] and refinements == [] and calls == []


def test_a_fit_that_did_not_converge_is_not_refined(monkeypatch):
    """Stopped by num_steps=: more steps, not another fit, is its remedy."""
    first = _result(0.9, -10.0, ess=0.1)
    first.converged = False
    result, held, refinements, calls = _run(monkeypatch, first, [_result(0.2, -5.0)])
    assert result is first and refinements == [] and calls == []


def test_a_reliable_candidate_beats_a_higher_unreliable_bound(monkeypatch):
    """k̂ > 0.7 makes a bound unreliable (a lucky draw can lift it): a candidate with k̂ 0.5 is
    kept over one with k̂ 0.9 and a higher bound, and the first fit (ESS 0.1: poor) loses to
    the reliable one with the higher bound."""
    first = _result(0.6, -12.0, ess=0.1)
    good, lucky = _result(0.5, -11.0), _result(0.9, -8.0)
    result, held, refinements, _ = _run(monkeypatch, first, [lucky, good])
    assert result is good and held == ["warning of c1"]
    assert [r.kept for r in refinements] == [False, False, True]
    assert [r.change for r in refinements] == ["as asked", "c0", "c1"]


def test_a_bound_without_a_finite_mean_ranks_below_one_with(monkeypatch):
    """With no reliable candidate, one whose k̂ is 1 or more (importance ratios without a
    finite mean: its bound is no estimate) ranks below one with k̂ under 1, whatever its
    bound: NumPyro's semi-supervised HMM kept a mean-field candidate (k̂ 1.46, bound −1384.4)
    over its first fit (k̂ 0.77, −1385.8), and its means went from 0.12 to 0.31 NUTS sd off."""
    first = _result(0.77, -1385.8, ess=0.05)
    no_mean = _result(1.46, -1384.4, ess=0.05)
    result, _, refinements, _ = _run(monkeypatch, first, [no_mean])
    assert result is first and [r.kept for r in refinements] == [True, False]


def test_the_first_fit_is_kept_when_no_candidate_ranks_above_it(monkeypatch):
    first = _result(0.6, -12.0, ess=0.1)
    worse = _result(0.6, -12.5)
    result, _, refinements, _ = _run(monkeypatch, first, [worse])
    assert result is first and refinements[0].kept and not refinements[1].kept


def test_a_noisy_bound_is_discounted_by_its_standard_error(monkeypatch):
    """A bound 0.05 above the first fit's, from weights of relative ESS 0.01 over 1000 draws
    (standard error √(99/1000) ≈ 0.31), does not displace it."""
    first = _result(0.6, -12.0, ess=0.3)
    noisy = _result(0.6, -11.95, ess=0.01)
    result, *_ = _run(monkeypatch, first, [noisy])
    assert result is first


def test_a_failing_remedy_is_reported_and_the_rest_still_run(monkeypatch):
    first = _result(0.9, -12.0, ess=0.1)
    good = _result(0.4, -11.0)
    result, _, refinements, _ = _run(monkeypatch, first, [BLRError("not for this model"), good])
    assert result is good
    assert refinements[1].note.startswith("failed: BLRError") and math.isnan(refinements[1].bound)


def test_the_budget_stops_starting_candidates(monkeypatch):
    """A first fit of 1 s and a budget of 2 (2 s, no floor): a candidate starts while the time
    spent plus one first fit's (the next one's expected cost) is within it: two of 0.6 s run
    (0 + 1 and 0.6 + 1 ≤ 2), the third does not (1.2 + 1 > 2). With a budget of 0 none runs
    and nothing is reported."""
    monkeypatch.setattr(refine_mod, "MIN_UNIT", 0.0)
    first = _result(0.9, -12.0, ess=0.1)
    outcomes = [_result(0.9, -13.0) for _ in range(5)]
    _, _, refinements, calls = _run(monkeypatch, first, outcomes, budget=2.0, seconds=0.6)
    assert len(calls) == 2 and len(refinements) == 3
    result, held, refinements, calls = _run(monkeypatch, first, outcomes, budget=0.0)
    assert calls == [] and refinements == [] and result is first and held == ["first"]


def test_a_fast_first_fit_counts_as_the_floor(monkeypatch):
    """A first fit of 1 s counts as MIN_UNIT = 1.5 s: a budget of 2 is 3 s, and candidates of
    0.6 s start at 0, 0.6, 1.2 and 1.8 s spent (each + 1 ≤ 3), not at 2.4 (2.4 + 1 > 3)."""
    monkeypatch.setattr(refine_mod, "MIN_UNIT", 1.5)
    first = _result(0.9, -12.0, ess=0.1)
    outcomes = [_result(0.9, -13.0) for _ in range(6)]
    _, _, refinements, calls = _run(monkeypatch, first, outcomes, budget=2.0, seconds=0.6)
    assert len(calls) == 4 and len(refinements) == 5


def model(y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


@pytest.mark.parametrize(
    "options, words",
    [
        ({"refine": "yes"}, "refine must be True or False"),
        ({"refine_budget": -1.0}, "refine_budget must be a finite number ≥ 0"),
        ({"refine_budget": float("inf")}, "refine_budget must be a finite number ≥ 0"),
        ({"refine_budget": "5"}, "refine_budget must be a number"),
    ],
)
def test_refine_options_are_checked(options, words):
    with pytest.raises(BLRError, match=words):
        blr_fit(model, {"y": 0.5}, rng_key=random.PRNGKey(0), progress_bar=False, **options)


def test_a_grid_past_its_deadline_stops():
    """The refinement's grid stops at its budget's end (a grid of two scales over a 600-state
    walk took 590 s against a first fit of 6 s): with a deadline already past, its first fit
    with the scales fixed raises OverBudget, which the refinement reports."""
    from blrppl.engine.grid import OverBudget, grid_fit
    from blrppl.model.program import ModelProgram

    J, sigma, y = rm.EIGHT_SCHOOLS
    options = fit_options(families={"tau": "grid"}, progress_bar=False)
    with pytest.raises(OverBudget, match="over the refinement's time budget"):
        grid_fit(ModelProgram(rm.eight_schools_model), (J, sigma, y), {}, options, random.key(0), ["tau"], deadline=0.0)


def test_the_remedies_are_those_the_advice_names():
    """A funnel's advice names a grid (no other structure holds it); a product of two blocks'
    (a factor model) names none, so nothing is refitted; a plan with several dense blocks apart
    gets the generic advice (another structure, more starts)."""
    from blrppl.api import plan_of
    from blrppl.engine.advice import named_remedies

    J, sigma, y = rm.EIGHT_SCHOOLS
    assert named_remedies(plan_of(rm.eight_schools_model, (J, sigma, y))) == (("tau",), False)

    def factor(Y):
        W = numpyro.sample("W", dist.Normal(0.0, 1.0).expand([Y.shape[1], 2]).to_event(2))
        with numpyro.plate("rows", Y.shape[0]):
            z = numpyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            numpyro.sample("Y", dist.Normal(z @ W.T, 1.0).to_event(1), obs=Y)

    Y = np.random.default_rng(0).normal(size=(30, 4))
    assert named_remedies(plan_of(factor, (Y,))) == ((), False)

    def two_regressions(x, y1, y2):
        a = numpyro.sample("a", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        b = numpyro.sample("b", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        with numpyro.plate("n", len(x)):
            numpyro.sample("y1", dist.Bernoulli(logits=a[0] + a[1] * x), obs=y1)
            numpyro.sample("y2", dist.Bernoulli(logits=b[0] + b[1] * x), obs=y2)

    x = np.linspace(-1.0, 1.0, 20)
    plan = plan_of(two_regressions, (x, (x > 0).astype(float), (x < 0.5).astype(float)), structure="mean-field")
    assert named_remedies(plan)[1]


def volatility(returns):
    """NumPyro's stochastic volatility example: σ scales the walk (a funnel), ν is the returns'."""
    sigma = numpyro.sample("sigma", dist.Exponential(50.0))
    s = numpyro.sample("s", dist.GaussianRandomWalk(scale=sigma, num_steps=returns.shape[0]))
    nu = numpyro.sample("nu", dist.Exponential(0.1))
    numpyro.sample("r", dist.StudentT(df=nu, loc=0.0, scale=jnp.exp(s)), obs=returns)


def test_the_hyperparameters_grid_follows_the_funnels():
    """The constrained scalar latents are σ and ν (not the walk): a grid over both on the central
    composite design comes before the funnel's product grid over σ; a grid the user asked, or a site whose family the user named, is not redone."""
    from blrppl.api import plan_of

    returns = np.random.default_rng(0).standard_t(6, size=50) * 0.01
    plan = plan_of(volatility, (returns,))
    assert refine_mod.hyperparameters(plan) == ("sigma", "nu")
    first = types.SimpleNamespace(plan=plan, nat={}, diagnostics=_result(0.9, -1.0).diagnostics)
    changes = [c.change for c in refine_mod.candidates(first, fit_options(), random.PRNGKey(0), False)]
    assert changes == [
        "families={'sigma': 'grid', 'nu': 'grid'} (the hyperparameters)", "families={'sigma': 'grid'}"
    ], changes
    # a grid the user asked for is not redone, nor one over a site the user gave a family
    assert refine_mod.candidates(first, fit_options(), random.PRNGKey(0), True) == []
    named = fit_options(families={"nu": "gaussian"})
    assert [c.change for c in refine_mod.candidates(first, named, random.PRNGKey(0), False)] == [changes[1]]


def test_the_grid_asked_holds_every_funnels_scale_up_to_max_scales():
    """A GLMM with three variance components has three funnels (per-group intercepts, per-item
    intercepts, per-group slopes): the advice and the refinement ask one grid over all three
    scales, not the first funnel's alone. Past ``MAX_SCALES`` (6) scales in all, the first
    funnel's scale alone (seven groups of effects, each with its own scale)."""
    from blrppl.api import plan_of
    from blrppl.engine.advice import named_remedies, poor_q_advice
    from blrppl.engine.design import MAX_SCALES

    model, data = rm.get("crossed_glmm")
    plan = plan_of(model, data)
    assert named_remedies(plan) == (("s_group", "s_slope", "s_item"), False)
    advice = poor_q_advice(plan)
    assert "with the other funnels' scales (s_slope, s_item)" in advice, advice
    assert "families={'s_group': 'grid', 's_slope': 'grid', 's_item': 'grid'}" in advice, advice

    def many_components(y):
        total = 0.0
        for i in range(MAX_SCALES + 1):
            scale = numpyro.sample(f"s{i}", dist.HalfNormal(1.0))
            with numpyro.plate(f"g{i}", 8):
                total = total + numpyro.sample(f"e{i}", dist.Normal(0.0, scale)).sum()
        numpyro.sample("y", dist.Normal(total, 1.0), obs=y)

    assert named_remedies(plan_of(many_components, (np.array(0.5),)))[0] == ("s0",)


def test_a_grid_within_a_fitted_grids_sites_is_not_tried(monkeypatch):
    """After a grid over (σ, ν) fitted, the grid over σ alone is skipped (its scales are
    integrated already); after one that failed, it is tried."""
    first = _result(0.9, -12.0, ess=0.1)
    cands = [
        refine_mod.Candidate("both", None, None, grid_sites=("sigma", "nu")),
        refine_mod.Candidate("sigma", None, None, grid_sites=("sigma",)),
        refine_mod.Candidate("start", None, None),
    ]
    monkeypatch.setattr(refine_mod, "candidates", lambda *a: cands)
    for outcome, tried in ((_result(0.5, -10.0), ["both", "start"]), (BLRError("no"), ["both", "sigma", "start"])):
        calls = []

        def fit(options, key, init_values=None, start=0, deadline=None, design=None, outcome=outcome):
            calls.append(len(calls))
            if calls == [0] and isinstance(outcome, Exception):
                raise outcome
            return (outcome if calls == [0] else _result(0.9, -13.0)), []

        _, _, refinements = refine_mod.refine(fit, first, [], fit_options(), None, 1.0, 5.0, False)
        assert [r.change for r in refinements[1:]] == tried


def bimodal(y=None):
    """y ~ N(θ², 1): a positive y puts the posterior's mass at θ ≈ ±√y, two modes."""
    theta = numpyro.sample("theta", dist.Normal(0.0, 2.0))
    numpyro.sample("y", dist.Normal(theta**2, 1.0), obs=y)


def _first(plan, narrow=()):
    """A stand-in first fit of ``plan`` whose q is poor (k̂ 0.9), with the narrow-q check's
    ``narrow`` sites."""
    from blrppl.posterior.narrow import Width

    d = _result(0.9, -1.0, ess=0.05).diagnostics._replace(narrow=tuple(Width(s, 2.0, 0.1, 0.3) for s in narrow))
    return types.SimpleNamespace(plan=plan, nat={}, diagnostics=d)


def _mixture_changes(first, options, grid_asked=False):
    return [c for c in refine_mod.candidates(first, options, random.PRNGKey(0), grid_asked) if c.options.mixtures]


def test_a_mixture_is_offered_on_the_sites_the_narrow_check_flags():
    """The bimodal model's θ flagged narrow (the posterior wider than q along it: q in one mode,
    or between them) and the advice naming more starts: a mixture of MIXTURE_COMPONENTS
    components over θ is a candidate, after the starts, its block the first fit's (no family
    set: the mixture contains the first fit); with ``structure="joint"`` a dense one, with
    ``structure="mean-field"`` a diagonal one."""
    from blrppl.api import plan_of

    plan = plan_of(bimodal, {"y": 4.0})
    first = _first(plan, narrow=("theta",))
    changes = [c.change for c in refine_mod.candidates(first, fit_options(), random.PRNGKey(0), False)]
    K = refine_mod.MIXTURE_COMPONENTS
    assert changes[-1] == f"families={{'theta': ('gaussian-mixture', {K})}}", changes
    assert any(c.startswith("start ") for c in changes[:-1])
    (cand,) = _mixture_changes(first, fit_options())
    assert cand.options.mixtures == (("theta", K),)
    assert cand.options.families_dict == {}
    (joint,) = _mixture_changes(first, fit_options(structure="joint"))
    assert joint.options.families_dict == {"theta": "gaussian"}
    (apart,) = _mixture_changes(first, fit_options(structure="mean-field"))
    assert apart.options.families_dict == {"theta": "gaussian-diag"}


def test_the_mixture_covers_the_flagged_sites_only():
    """Two Gaussian sites, one flagged narrow: the mixture is over the flagged one; none
    flagged (the check reads scalar sites, and q is poor all the same): over all of them."""
    from blrppl.api import plan_of

    def two(y=None):
        theta = numpyro.sample("theta", dist.Normal(0.0, 2.0))
        with numpyro.plate("j", 3):
            b = numpyro.sample("b", dist.Normal(0.0, 1.0))
            numpyro.sample("y", dist.Normal(theta**2 + b, 1.0), obs=y)

    plan = plan_of(two, {"y": np.array([4.0, 3.5, 4.5])}, structure="mean-field")
    (flagged,) = _mixture_changes(_first(plan, narrow=("theta",)), fit_options(structure="mean-field"))
    assert flagged.options.mixtures == (("theta", refine_mod.MIXTURE_COMPONENTS),)
    (every,) = _mixture_changes(_first(plan), fit_options(structure="mean-field"))
    assert dict(every.options.mixtures).keys() == {"theta", "b"}


def test_no_mixture_where_the_advice_names_a_grid_alone_or_nuts():
    """A funnel's advice names the grid alone (eight schools' τ), a product of blocks' (a
    factor model, whose modes are sign flips with the same predictions) to compare with NUTS:
    no mixture is offered for either, even with their sites flagged narrow."""
    from blrppl.api import plan_of

    J, sigma, y = rm.EIGHT_SCHOOLS
    assert _mixture_changes(_first(plan_of(rm.eight_schools_model, (J, sigma, y)), ("tau",)), fit_options()) == []

    def factor(Y):
        W = numpyro.sample("W", dist.Normal(0.0, 1.0).expand([Y.shape[1], 2]).to_event(2))
        with numpyro.plate("rows", Y.shape[0]):
            z = numpyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
            numpyro.sample("Y", dist.Normal(z @ W.T, 1.0).to_event(1), obs=Y)

    Y = np.random.default_rng(0).normal(size=(30, 4))
    assert _mixture_changes(_first(plan_of(factor, (Y,))), fit_options()) == []


def test_no_mixture_against_the_users_options_or_past_its_size(monkeypatch):
    """Not offered where it would override what the user gave (``num_starts`` > 1, a family
    for the site, a grid asked, a mixture asked), nor over more than MIXTURE_MAX_DIM scalars."""
    from blrppl.api import plan_of

    plan = plan_of(bimodal, {"y": 4.0})
    first = _first(plan, narrow=("theta",))
    assert _mixture_changes(first, fit_options(num_starts=2)) == []
    assert _mixture_changes(first, fit_options(families={"theta": "gaussian"})) == []
    assert _mixture_changes(first, fit_options(), grid_asked=True) == []
    assert refine_mod.mixture_candidates(first, fit_options(families={"theta": ("gaussian-mixture", 2)}), None) == []
    monkeypatch.setattr(refine_mod, "MIXTURE_MAX_DIM", 0)
    assert _mixture_changes(first, fit_options()) == []


def test_the_mixtures_steps_stop_at_the_budgets_end():
    """The refinement's mixture candidate stops at its deadline between chunks of its steps
    (as a single fit does at its loop's chunk boundaries): with the deadline already past, its
    first chunk is not run and OverBudget says where it stopped."""
    from blrppl.engine import budget, mixture
    from blrppl.families import gaussian_mixture as gm

    nat = {"x": gm.spread_start(jnp.zeros(2), jnp.ones(2), jnp.zeros(2), 3, random.PRNGKey(0))}

    def log_joint(xs, rest_nat, key):
        return -0.5 * jnp.sum(xs["x"] ** 2)

    with budget.deadline(0.0), pytest.raises(budget.OverBudget, match="in the mixture's steps"):
        mixture._run_mixture(log_joint, {}, nat, fit_options(num_steps=200), random.PRNGKey(1))
    with budget.deadline(None):  # (no deadline: the steps run)
        out, elbo, _, _ = mixture._run_mixture(log_joint, {}, nat, fit_options(num_steps=100), random.PRNGKey(1))
    assert elbo.shape == (100,) and np.all(np.isfinite(elbo))


def _starts_run(monkeypatch, first, outcomes, same):
    """Refine ``first`` over an over-dispersed start, three more starts and a mixture (stand-in
    fits giving ``outcomes`` in turn), ``same(result)`` saying whether a start found the first
    fit's optimum: ``(refinements, candidates fitted)``."""
    cands = [refine_mod.Candidate("over-dispersed", None, None, remedy=refine_mod.START)]
    cands += [refine_mod.Candidate(f"start {k}", None, None, start=k, remedy=refine_mod.START) for k in (1, 2, 3)]
    cands += [refine_mod.Candidate("mixture", None, None, remedy=refine_mod.MIXTURE)]
    monkeypatch.setattr(refine_mod, "candidates", lambda *a: cands)
    monkeypatch.setattr(refine_mod, "same_optimum", lambda first, result: same(result))
    calls = []

    def fit(options, key, init_values=None, start=0, deadline=None, design=None):
        calls.append(start)
        return outcomes[len(calls) - 1], []

    _, _, refinements = refine_mod.refine(fit, first, [], fit_options(), None, 1.0, 50.0, False)
    ran = [r.change for r in refinements[1:] if not r.note.startswith(refine_mod.NOT_RUN)]
    return refinements, ran


def test_a_start_at_the_first_fits_optimum_ends_the_starts_and_the_mixture(monkeypatch):
    """The semi-supervised HMM's case: q poor by a k̂ under 1 (0.77), no site flagged narrow,
    and the over-dispersed start back at the first fit's optimum: the other starts and the
    mixture are not run, and each is listed with why."""
    first = _result(0.77, -1385.8, ess=0.1)
    refinements, ran = _starts_run(monkeypatch, first, [_result(0.76, -1385.8, ess=0.1)] * 5, lambda r: True)
    assert ran == ["over-dispersed"], refinements
    skipped = {r.change: r.note for r in refinements[1:] if r.note.startswith(refine_mod.NOT_RUN)}
    assert set(skipped) == {"start 1", "start 2", "start 3", "mixture"}, skipped
    assert "optimum again" in skipped["start 1"] and "k-hat" in skipped["mixture"]
    assert refinements[0].kept
    message = refine_mod.summary(refinements)
    assert "tried 1 remedy" in message and "mixture (not run: " in message, message


def test_a_start_at_another_optimum_lets_the_rest_run(monkeypatch):
    """The four-mode θ² model's case: the over-dispersed start settled elsewhere (another
    optimum), so several optima are seen and every start and the mixture run, even after a
    later start found the first fit's optimum again."""
    first = _result(0.98, -5.0, ess=0.1)
    other, again = _result(0.83, -6.6, ess=0.1), _result(0.9, -5.0, ess=0.1)
    outcomes = [other, again, again, again, _result(0.5, -4.9)]
    _, ran = _starts_run(monkeypatch, first, outcomes, lambda r: r is again)
    assert ran == ["over-dispersed", "start 1", "start 2", "start 3", "mixture"]


@pytest.mark.parametrize("khat, narrow", [(1.02, ()), (0.8, ("theta",))])
def test_the_mixture_still_runs_where_the_first_fit_points_at_missed_mass(monkeypatch, khat, narrow):
    """The starts all at one optimum, but the first fit's k̂ is 1 or more (importance ratios
    without a finite mean), or the narrow-q check flags a site: the mixture is run (the starts
    are not)."""
    from blrppl.posterior.narrow import Width

    first = _result(khat, -5.0, ess=0.1)
    first.diagnostics = first.diagnostics._replace(narrow=tuple(Width(s, 2.0, 0.1, 0.3) for s in narrow))
    _, ran = _starts_run(monkeypatch, first, [_result(khat, -5.0, ess=0.1)] * 5, lambda r: True)
    assert ran == ["over-dispersed", "mixture"]


def test_a_start_that_did_not_converge_answers_nothing(monkeypatch):
    """A start stopped by num_steps= is no answer of where the starts lead: the others run."""
    first = _result(0.8, -5.0, ess=0.1)
    stopped = _result(0.8, -5.0, ess=0.1)
    stopped.converged = False
    _, ran = _starts_run(monkeypatch, first, [stopped] + [_result(0.8, -5.0, ess=0.1)] * 4, lambda r: True)
    assert ran == ["over-dispersed", "start 1"]


def test_a_joint_block_is_not_split_into_mean_field():
    """One joint dense block (the semi-supervised HMM's Dirichlet rows, the LKJ varying slopes):
    mean-field is a restriction of it, so no ``structure='mean-field'`` candidate; several blocks
    apart still get ``structure='joint'``."""
    from blrppl.api import plan_of

    def two(x, y1, y2):
        a = numpyro.sample("a", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        b = numpyro.sample("b", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        with numpyro.plate("n", len(x)):
            numpyro.sample("y1", dist.Bernoulli(logits=a[0] + a[1] * x), obs=y1)
            numpyro.sample("y2", dist.Bernoulli(logits=a[1] + b[0] + b[1] * x), obs=y2)

    x = np.linspace(-1.0, 1.0, 20)
    data = (x, (x > 0).astype(float), (x < 0.5).astype(float))
    for structure, offered in ((None, []), ("mean-field", ["structure='joint'"])):
        plan = plan_of(two, data, structure=structure)
        first = types.SimpleNamespace(plan=plan, nat={}, diagnostics=_result(0.9, -1.0).diagnostics)
        changes = [c.change for c in refine_mod.candidates(first, fit_options(), random.PRNGKey(0), False)]
        assert [c for c in changes if c.startswith("structure=")] == offered, (structure, changes)


def test_a_candidates_expected_cost_is_what_it_reruns():
    """A first fit of 10 s, 3 of them compiling: a start reuses the compiled fit (7 s), the
    mixture compiles and runs MIXTURE_COMPONENTS times the steps (3 + 7 K s), a grid or another
    structure a whole first fit; a stand-in without its times counts as a first fit."""
    first = types.SimpleNamespace(compile_time=3.0, run_time=6.5)
    cost = {
        kind: refine_mod.expected_cost(refine_mod.Candidate(kind, None, None, remedy=kind), first, 10.0)
        for kind in (refine_mod.START, refine_mod.MIXTURE, refine_mod.GRID, refine_mod.STRUCTURE)
    }
    assert cost == {"start": 7.0, "mixture": 3.0 + 7.0 * refine_mod.MIXTURE_COMPONENTS, "grid": 10.0, "structure": 10.0}
    stand_in = refine_mod.Candidate("c", None, None, remedy="start")
    assert refine_mod.expected_cost(stand_in, _result(0.9, -1.0), 10.0) == 10.0


def test_a_mixture_past_the_budget_is_not_started_and_a_cheaper_candidate_after_it_is(monkeypatch):
    """Budget 5 × a first fit of 10 s (3 compiling): a mixture expected at 3 + 7 × 8 s is not
    started, and the start listed after it (7 s) still is."""
    first = _result(1.2, -5.0, ess=0.1)
    first.compile_time, first.run_time = 3.0, 7.0
    cands = [
        refine_mod.Candidate("mixture", None, None, remedy=refine_mod.MIXTURE),
        refine_mod.Candidate("start 1", None, None, start=1, remedy=refine_mod.START),
    ]
    monkeypatch.setattr(refine_mod, "candidates", lambda *a: cands)
    monkeypatch.setattr(refine_mod, "same_optimum", lambda first, result: False)
    calls = []

    def fit(options, key, init_values=None, start=0, deadline=None, design=None):
        calls.append(start)
        return _result(1.1, -6.0), []

    _, _, refinements = refine_mod.refine(fit, first, [], fit_options(), None, 10.0, 5.0, False)
    assert calls == [1] and [r.change for r in refinements] == ["as asked", "start 1"]


def test_same_optimum_reads_the_means_in_sds_and_the_bounds():
    """Two fits of one logistic regression from two keys are one optimum; the fit of the data
    with its labels flipped (coefficients of the other sign, many sds away) is another, and so
    is a fit whose bound is 5 nats lower, its means the same."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 3))
    y = (rng.uniform(size=200) < 1 / (1 + np.exp(-X @ np.array([1.0, -0.5, 0.25])))).astype(float)

    def logistic(X, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("N", X.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    def fit(labels, key):
        return blr_fit(logistic, {"X": X, "y": labels}, rng_key=random.PRNGKey(key), progress_bar=False, refine=False)

    first = fit(y, 0)
    assert refine_mod.same_optimum(first, fit(y, 1))
    assert not refine_mod.same_optimum(first, fit(1.0 - y, 0))
    lower_bound = first.diagnostics._replace(bound=first.diagnostics.bound - 5.0)
    lower = types.SimpleNamespace(nat=first.nat, diagnostics=lower_bound)
    assert not refine_mod.same_optimum(first, lower)


def _slopes(scales_as_vector):
    """Varying intercepts and slopes with an LKJ(2) correlation, their scales a vector site (as
    Statistical Rethinking's cafés write them) or one scalar."""

    def model(group, x, y=None):
        if scales_as_vector:
            scale = numpyro.sample("sigma_group", dist.Exponential(1.0).expand([2]).to_event(1))
        else:
            scale = numpyro.sample("sigma_group", dist.Exponential(1.0))
        chol_corr = numpyro.sample("chol_corr", dist.LKJCholesky(2, 2.0))
        scale_tril = (scale[:, None] if scales_as_vector else scale) * chol_corr
        with numpyro.plate("groups", 10):
            ab = numpyro.sample("ab", dist.MultivariateNormal(jnp.zeros(2), scale_tril=scale_tril))
        with numpyro.plate("rows", group.shape[0]):
            numpyro.sample("y", dist.Normal(ab[group, 0] + ab[group, 1] * x, 0.5), obs=y)

    rng = np.random.default_rng(0)
    group, x = np.repeat(np.arange(10), 4), np.tile([0.0, 1.0], 20)
    return model, (group, x, rng.normal(size=40))


def test_a_correlation_factor_is_no_grid_scale_and_the_advice_says_why():
    """A 2 × 2 LKJ Cholesky factor has one free scalar but a matrix value, which a grid cannot
    take: it is no hyperparameter for the refinement's grid, the funnel's grid does not name it,
    and where no grid is offered the advice says which scale sites are not scalars and how to
    write them (the LKJ varying slopes: no remedy was offered and the advice did not say why)."""
    from blrppl.api import plan_of
    from blrppl.engine.advice import named_remedies, poor_q_advice

    plan = plan_of(*_slopes(True))
    assert refine_mod.hyperparameters(plan) == ()
    assert named_remedies(plan) == ((), False)
    advice = poor_q_advice(plan)
    assert "'sigma_group' (shape (2,)), 'chol_corr' (shape (2, 2)) are not" in advice, advice
    assert "r ~ Beta(eta, eta), rho = 2 r - 1" in advice
    scalar = plan_of(*_slopes(False))
    assert refine_mod.hyperparameters(scalar) == ("sigma_group",)
    assert "chol_corr" not in named_remedies(scalar)[0]


@pytest.mark.parametrize("converged", [True, False])
def test_a_candidate_that_passes_the_diagnostics_ends_the_refinement(monkeypatch, converged):
    """Eight schools with ``LocScaleReparam``: the grid over τ took k̂ from 0.62 to 0.06, and the
    mixture tried after it ran to the budget's end (20 s, against the grid's 11 s and NUTS's
    7 s). A converged candidate whose k̂, ESS and narrow-q check pass answers what started the
    refinement: the candidates after it are listed as not run. One that did not converge
    answers nothing."""
    first = _result(0.62, -31.36, ess=0.1)
    passed = _result(0.06, -31.31, ess=0.9)
    passed.converged = converged
    cands = [refine_mod.Candidate("grid", None, None, remedy=refine_mod.GRID)]
    cands += [refine_mod.Candidate("over-dispersed", None, None, remedy=refine_mod.START)]
    cands += [refine_mod.Candidate("mixture", None, None, remedy=refine_mod.MIXTURE)]
    monkeypatch.setattr(refine_mod, "candidates", lambda *a: cands)
    monkeypatch.setattr(refine_mod, "same_optimum", lambda first, result: False)
    calls = []

    def fit(options, key, init_values=None, start=0, deadline=None, design=None):
        calls.append(start)
        return (passed, []) if len(calls) == 1 else (_result(0.6, -31.4, ess=0.1), [])

    result, _, refinements = refine_mod.refine(fit, first, [], fit_options(), None, 1.0, 50.0, False)
    assert not passed.diagnostics.poor()
    if converged:
        assert len(calls) == 1 and result is passed
        notes = {r.change: r.note for r in refinements[2:]}
        assert set(notes) == {"over-dispersed", "mixture"}
        assert all(n.startswith(refine_mod.NOT_RUN) and "passed the diagnostics" in n for n in notes.values())
    else:
        assert len(calls) == 3  # (the over-dispersed start and the mixture run after it)


def test_a_start_back_at_the_first_fits_optimum_does_not_pass_for_it(monkeypatch):
    """A start at the first fit's optimum whose k̂ passes on other draws (0.79 with a close
    ESS against the first fit's 0.89, the same bound) answers nothing the first fit did not:
    the other starts are skipped because a start found the first fit's optimum again, not
    because a fit passed."""
    first = _result(0.89, -104.3, ess=0.1)
    again = _result(0.79, -104.3, ess=0.96)
    assert not again.diagnostics.poor()
    refinements, ran = _starts_run(monkeypatch, first, [again] * 5, lambda r: True)
    assert ran == ["over-dispersed"]
    notes = [r.note for r in refinements[2:]]
    assert notes and all("optimum again" in n or "k-hat" in n for n in notes), notes
    assert not any("passed the diagnostics" in n for n in notes), notes
