"""One step of the Bayesian learning rule: messages, natural-parameter updates, ELBO.

For every block b (all at once in the ``parallel`` schedule, one after the other with the
newest neighbours in the ``sequential`` schedule),

    λ_b ← (1 − ρ_b) λ_b + ρ_b Σ_{i ∋ b} λ̃_ib,      λ̃_ib = ∇_{μ_b} E_q[log f_i],

where Σ_i λ̃_ib is the family's conversion of ∇_view Σ_i E_q[log f_i]. A candidate λ outside
the family's domain is never kept: ρ is halved until it is valid (a convex combination of
valid parameters is valid), and after ``max_halvings`` the block keeps its λ.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from blrppl.engine.state import Ahead, BLRInfo, BLRState, initial_state  # noqa: F401 (re-exported)
from blrppl.estimators.enumeration import expected_log_factors, is_jacobian
from blrppl.estimators.monte_carlo import curvature_for
from blrppl.estimators.registry import estimator_of
from blrppl.moments.linearised import base_values
from blrppl.graph.data import split_run_data
from blrppl.graph.derivatives import hessian_of_grad
from blrppl.posterior.online import expected_log_previous, is_previous_posterior


def views_of(plan, nat: dict, blocks=None) -> dict:
    """The view the rules read (``family.rule_view``) of every block (of ``blocks``, default
    the plan's); point (delta-method) blocks are seen at their mean, with zero covariance."""
    out = {}
    for b in plan.blocks if blocks is None else blocks:
        view = b.family.rule_view(nat[b.name])
        if b.point:
            view = view._replace(**{view._fields[1]: jnp.zeros_like(view[1])})
        out[b.name] = view
    return out


def views_and_entropies(plan, nat: dict, blocks=None) -> tuple[dict, dict]:
    """The rule view of every block (of ``blocks``, default the plan's), as
    :func:`views_of`, and the summed entropy H(q_b) of every one that is not a point block,
    both from one factorisation of its parameters (``family.rule_view_and_entropy``)."""
    views, entropies = {}, {}
    for b in plan.blocks if blocks is None else blocks:
        if b.point:
            views[b.name] = views_of(plan, {b.name: nat[b.name]}, (b,))[b.name]
        else:
            views[b.name], entropy = b.family.rule_view_and_entropy(nat[b.name])
            entropies[b.name] = jnp.sum(entropy)
    return views, entropies


def with_views(plan, state: BLRState) -> BLRState:
    """``state`` carrying the views and entropies of its parameters (what a run's loop
    carries from step to step; see :class:`BLRState`)."""
    views, entropies = views_and_entropies(plan, state.nat)
    return state._replace(views=views, entropies=entropies)


#: most Newton iterations of a param block's M-step in one sweep
NEWTON_MAX_ITER = 50
#: halvings of a Newton step's length before a param block's M-step gives up the step
NEWTON_MAX_HALVINGS = 30


def _value_grad_hessian(block, objective_of_mean, mean):
    """L(m), ∇L(m) (shape of ``mean``) and the Hessian blocks of L at m: per plate element
    ``(*B, D, D)`` for dense blocks, the diagonal (shape of ``mean``) for diagonal ones.
    One forward-over-reverse pass gives all three (reverse over reverse for a model with a
    custom reverse-mode rule only, :mod:`blrppl.graph.derivatives`)."""
    shape = mean.shape
    flat = mean.reshape(-1)

    def grad_and_aux(x):
        value, g = jax.value_and_grad(lambda y: objective_of_mean(y.reshape(shape)))(x)
        return g, (value, g)

    h, (value, g) = hessian_of_grad(grad_and_aux, flat, has_aux=True)
    return value, g.reshape(shape), block.family.curvature_of_hessian(h, shape)


def newton_message(block, nat, objective_of_mean, mean):
    """Delta-method message of a point block: with g = ∇L(m) and H = ∇²L(m) of the expected
    log factors at x = m, λ̃ = (g − H m, ½ H); at ρ = 1 the update is Newton's step
    m ← m − H⁻¹ g with precision −H (Laplace's method at convergence)."""
    _, g, h = _value_grad_hessian(block, objective_of_mean, mean)
    return type(nat)(g - block.family.precision_times(h, mean), 0.5 * h)


def newton_maximise(block, nat, objective_of_mean, mean, max_iter=NEWTON_MAX_ITER):
    """The M-step of a param block: maximise L(m) (the expected log factors with the block
    at the point m, on its unconstrained space) by Newton's method to convergence.

    Each iteration takes the step d = P⁻¹ g, P = −∇²L made positive definite where it is not
    (:meth:`~blrppl.families.base.Family.positive_curvature`), halving its length until L
    does not decrease (up to rounding); it stops when the Newton step is at most √ε/100 · (1 + max|m|) (L is then
    maximised to machine precision: Newton converges quadratically), when no halving
    helps, or after ``max_iter`` iterations (every accepted iterate raises L, so a capped
    M-step is still a generalised EM step). For a concave L (every exponential-family
    likelihood in its natural parameters, and the usual parameterisations of weights,
    locations and scales) this is the exact maximiser.

    Returns:
        the message λ̃ = (P m*, −½ P) with P the curvature of the last iteration (at the
        maximiser m* up to the last, tiny, step): at ρ = 1 the block's mean is m* (its
        precision, the observed information, is kept for reference).
    """
    dtype = mean.dtype
    eps = jnp.finfo(dtype).eps
    xtol = jnp.sqrt(eps) * 1e-2

    def cond(carry):
        _, _, it, done = carry
        return (~done) & (it < max_iter)

    def body(carry):
        m, _, it, _ = carry
        value, g, h = _value_grad_hessian(block, objective_of_mean, m)
        prec = block.family.positive_curvature(-h)
        step = block.family.solve_precision(prec, g)
        step = jnp.where(jnp.isfinite(step), step, 0.0)
        slack = 16.0 * eps * jnp.maximum(1.0, jnp.abs(value))

        def acceptable(candidate):
            return jnp.isfinite(candidate) & (candidate >= value - slack)

        # backtracking: the step's length is halved until L does not decrease
        def ls_cond(lc):
            _, k, fc = lc
            return (k == 0) | ((~acceptable(fc)) & (k <= NEWTON_MAX_HALVINGS))

        def ls_body(lc):
            t, k, _ = lc
            t = jnp.where(k == 0, t, 0.5 * t)
            return t, k + 1, objective_of_mean(m + t * step)

        t, _, fc = jax.lax.while_loop(ls_cond, ls_body, (jnp.ones((), dtype), 0, value))
        accepted = acceptable(fc)
        moved = jnp.where(accepted, t, 0.0) * step
        new_m = m + moved
        # converged when the full Newton step is tiny (not a step the line search shortened)
        small = jnp.max(jnp.abs(step)) <= xtol * (1.0 + jnp.max(jnp.abs(new_m)))
        return new_m, prec, it + 1, ~accepted | small

    prec0 = block.family.identity_precision(mean)
    init = (mean, prec0, jnp.zeros((), jnp.int32), jnp.array(False))
    # the curvature kept is the last one computed: at the iterate before the last (tiny) step
    m, prec, _, _ = jax.lax.while_loop(cond, body, init)
    return type(nat)(block.family.precision_times(prec, m), -0.5 * prec)


def make_objective(plan, fns, curvature="auto"):
    """Σ_i E_q[log f_i] over a subset of factors, as a function of the views.

    ``curvature`` is the estimator of Monte Carlo messages to Gaussian blocks
    (:data:`blrppl.estimators.monte_carlo.CURVATURES`), whose surrogate terms have value zero
    and the messages as their gradient; None builds the values alone (the ELBO's: no
    gradient or Hessian estimate is computed only to be multiplied by zero). The objective's
    ``targets`` (None: all) are the blocks whose messages its gradient is taken for: the
    surrogates of the others (zero, with no gradient there) are not built; ``values=False``
    (with ``targets``): only its gradient is read, not its value.

    ``data`` may be a :class:`blrppl.graph.data.RunData`: in an online fit it carries the
    previous posterior's natural parameters, read by the ``"<block>:previous"``
    pseudo-factors, factors whose expectation comes from data statistics (their spec's
    ``statistics``: :mod:`blrppl.estimators.gram`, :mod:`blrppl.estimators.bilinear`) read
    them from it,
    and stacked factors their tables (:mod:`blrppl.graph.stack`).
    """
    blocks = {b.name: b for b in plan.blocks}

    def objective(views, data, factor_names=None, key=None, targets=None, values=True):
        run = data
        data, previous, statistics = split_run_data(data)
        factors = [f for f in plan.factors if factor_names is None or f.name in factor_names]
        total = expected_log_factors(
            fns,
            [f for f in factors if not is_previous_posterior(f) and not f.spec.from_statistics],
            blocks, views, run if fns.stacks else data, key, curvature_for(curvature, targets, values),
        )
        for f in factors:
            if is_previous_posterior(f):
                n = f.rule.block
                total = total + expected_log_previous(blocks[n], views[n], previous[n])
            elif f.spec.from_statistics:
                total = total + f.spec.statistics.expected_log(f, statistics[f.name], views)
        return total

    return objective


def constant_factors(plan) -> dict:
    """Block → its factors whose messages to it are the same at every q, for blocks of a
    family that ``splits_quadratic`` (a chain's banded Gaussian): factors that read this
    block alone (no other latent, nothing enumerated), each one site's log-density with a
    closed form (:func:`blrppl.compiler.conjugacy.factor_conjugate`), hence quadratic in the
    block: a random walk's or an AR prior with known coefficients, a Normal observation
    of an affine form with a known scale. Empty under subsampling.

    For such a factor E_q[log f] = log f(m) + Σ_c ⟨G_c, c⟩ over the view's covariance
    leaves c, G = ∂E/∂view being the same at every view: the step takes its message λ̃ at
    the family's fixed view (no input of the run's loop: XLA computes it once, outside
    the loop) and its ELBO term from the model's own log-density at the mean, e.g. a
    walk's increments m_t − m_{t−1} (exact in floating point; expanding the quadratic
    would cancel E[x_t²] against E[x_t x_{t−1}] for a walk far from 0), plus the
    covariance part. Neither reads the tangent rows of the block (a chain's 2(2b + 1)
    colour rows per step)."""
    if plan.subsampled:
        return {}
    from blrppl.compiler.conjugacy import factor_conjugate

    out = {}
    for b in plan.blocks:
        if b.point or b.discrete or not b.family.splits_quadratic:
            continue
        names = tuple(
            f.name
            for f in plan.factors_of(b.name)
            if tuple(f.neighbours) == (b.name,) and not f.discrete and not f.spec.pairs and not f.members
            and not f.spec.from_statistics and not is_jacobian(f) and not is_previous_posterior(f)
            and factor_conjugate(f, b)
        )
        if names:
            out[b.name] = names
    return out


def make_split_expectation(plan, fns, objective):
    """``(expected, constant, grads)``: ``expected(views, data, key)`` = Σ_i E_q[log f_i] over
    every factor, the :func:`constant_factors` (``constant``) taken apart as described
    there; ``grads(n, views, data, key)`` = ∂E/∂view of block n's constant factors at its
    fixed view (the same at every view)."""
    blocks = {b.name: b for b in plan.blocks}
    constant = constant_factors(plan)
    taken = frozenset(f for fs in constant.values() for f in fs)
    rest = frozenset(f.name for f in plan.factors) - taken

    def grads(n, views, data, key=None):
        wanted = set(constant[n])
        return jax.grad(lambda v: objective({**views, n: v}, data, wanted, key))(blocks[n].family.fixed_view(views[n]))

    def expected(views, data, key=None):
        if not constant:
            return objective(views, data, None, key)
        total = objective(views, data, rest, key)
        for n, names in constant.items():
            g = grads(n, views, data, key)
            for lp, scale in fns.log_probs(names, base_values(blocks, views, (n,)), data).values():
                total = total + jnp.sum(lp if scale is None else scale * lp)
            covariance = g._replace(mean=jnp.zeros_like(g.mean))
            total = total + sum(jnp.vdot(a, c) for a, c in zip(jax.tree.leaves(covariance), jax.tree.leaves(views[n])))
        return total

    return expected, constant, grads


def make_elbo(plan, fns, entropies: bool = False):
    """ELBO(λ) = Σ_i E_q[log f_i] + Σ_b H(q_b), over the blocks b that are not point blocks.

    Point blocks (``point`` latents and params) are seen at their mean m, so their terms are
    log f_i(m) and they add no entropy: the ELBO is then the objective that EM (and MAP-EM,
    and Newton's method for point latents) raises at every step, E_q[log p(y, z, m)] +
    H(q(z)), which equals log p(y, m) after an exact E-step. (The Gaussian a point latent
    carries, −∇²L at m, is Laplace's approximation, not a variational parameter.)

    With ``entropies`` the function returns ``(ELBO, {block: H(q_b)})``: an entropy is
    finite exactly when the block's parameters are a valid distribution, which the step reads
    instead of factorising them once more to check.
    """
    objective = make_objective(plan, fns, curvature=None)  # values only
    expected = make_split_expectation(plan, fns, objective)[0]

    def elbo(nat, data, key=None):
        views, parts = views_and_entropies(plan, nat)
        value = expected(views, data, key) + sum(parts.values())
        return (value, parts) if entropies else value

    return elbo


def all_finite(tree) -> jax.Array:
    """Scalar bool: every element of every leaf finite (True for no leaves)."""
    leaves = [jnp.sum(jnp.where(jnp.isfinite(x), 0.0, 1.0)) for x in jax.tree.leaves(tree)]
    return sum(leaves) == 0 if leaves else jnp.array(True)


def relative_delta(old, new):
    """The largest relative change max |λ' − λ| / (1 + |λ|) of a natural parameter between
    two pytrees of them (the loop's convergence test reads it only once the ELBO has
    settled: a reduction over every parameter, 5 % of a long chain's step)."""
    diffs = [
        jnp.max(jnp.abs(a - b) / (1.0 + jnp.abs(a)))
        for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new))
        if jnp.size(a)  # (a chain of one state has no pairs)
    ]
    return jnp.max(jnp.stack(diffs)) if diffs else jnp.zeros(())


def _candidate(family, nat_old, message, r, message_valid, retract, formed):
    """The candidate of :func:`_update_block` at step size ``r``: ``(λ, valid)``, with its
    view and entropy when ``formed``."""
    # a block whose messages may be invalid (non-conjugate Gaussians) retracts when they are
    new = family.update(nat_old, message, r, retract & ~message_valid if retract else False)
    if formed is None:
        extra, checked = (), lambda: family.is_valid(new)
    else:
        view, entropy = formed[0](new)
        entropy = jnp.sum(entropy)
        factorised = jnp.isfinite(entropy) & all_finite(new) & all_finite(view)
        extra, checked = (view, entropy), lambda: factorised
    if message_valid is None or retract:
        return (new, checked(), *extra)
    # at ρ = 1 the candidate is the message, whose validity is known
    return (new, jax.lax.cond(r == 1.0, lambda: message_valid, checked), *extra)


def _update_retracted(family, nat_old, message, rho, max_halvings, formed):
    """:func:`_update_block` of a Gaussian block whose messages may be invalid (non-conjugate:
    an invalid one is retracted), returning also whether the message was valid:
    ``(λ, ok, view, entropy, message valid)``.

    At ρ = 1 the plain candidate is the message itself: its factorisation, which the step
    needs for the view, tells whether the message is a valid natural parameter (no
    factorisation of the message on its own); when it is not, the next candidate is the
    retraction at the same ρ, then ρ is halved. At ρ < 1 the message is checked first (a
    convex combination may be valid when the message is not)."""
    rho = jnp.asarray(rho, dtype=jnp.result_type(float))
    at_one = rho == 1.0
    checked = jax.lax.cond(at_one, lambda: jnp.array(True), lambda: family.is_valid(message))
    first = _candidate(family, nat_old, message, rho, checked, True, formed)
    message_valid = jnp.where(at_one, first[1], checked)
    retry = at_one & ~message_valid  # (the retraction at ρ = 1 before any halving)

    def cond(carry):
        _, k, _, ok, *_ = carry
        return jnp.logical_and(~ok, k < max_halvings)

    def body(carry):
        r, k, *_ = carry
        r = jnp.where(retry & (k == 0), r, 0.5 * r)
        return (r, k + 1, *_candidate(family, nat_old, message, r, message_valid, True, formed))

    _, _, new, ok, view, entropy = jax.lax.while_loop(cond, body, (rho, 0, *first))
    keep = jax.tree.map(lambda a, b: jnp.where(ok, b, a), (nat_old, *formed[1:]), (new, view, entropy))
    return (keep[0], ok, *keep[1:], message_valid)


def _update_block(family, nat_old, message, rho, max_halvings, message_valid=None, retract=False, formed=None):
    """The family's step (1−ρ)λ + ρ λ̃ (improved BLR for Gaussians at ρ < 1), halving ρ
    until the result is valid. Returns ``(λ, ok)``.

    With ``formed = (view_and_entropy, view, entropy)`` (a Gaussian block: its validity is
    that its factorisation succeeds) each candidate is factorised once, for its validity (a
    finite entropy and view) and for the view and entropy the step reads after the update,
    which are returned too: ``(λ, ok, view, entropy)`` (the given ones of ``nat_old`` when no
    candidate is valid)."""

    def candidate(r):
        return _candidate(family, nat_old, message, r, message_valid, retract, formed)

    def cond(carry):
        _, k, _, ok, *_ = carry
        return jnp.logical_and(~ok, k < max_halvings)

    def body(carry):
        r, k, *_ = carry
        return (0.5 * r, k + 1, *candidate(0.5 * r))

    rho = jnp.asarray(rho, dtype=jnp.result_type(float))
    _, _, new, ok, *extra = jax.lax.while_loop(cond, body, (rho, 0, *candidate(rho)))
    keep = jax.tree.map(lambda a, b: jnp.where(ok, b, a), (nat_old, *formed[1:]) if formed else (nat_old,), (new, *extra))
    return (keep[0], ok, *keep[1:])


def decaying_rate(t, tau: float = 10.0, kappa: float = 0.6):
    """(1 + t/τ)^−κ: the step-size decay of blocks with Monte Carlo messages."""
    return (1.0 + t / tau) ** (-kappa)


def _block_sets(plan, constant) -> tuple:
    """``(retracted, exact_gaussian, multiplied, diagonal)``: the names of the plan's blocks
    that the step treats apart.

    * non-conjugate Gaussian blocks (``retracted``): their messages may have an indefinite
      precision (a funnel, a horseshoe); when they do, the step is the improved BLR
      retraction (valid at any ρ) instead of ρ being halved until a convex combination
      happens to be valid;
    * conjugate Gaussian blocks (``exact_gaussian``): their validity at ρ = 1 is read off the
      ELBO's factorisation;
    * blocks a product of latents multiplies (``multiplied``);
    * chains whose factors, once their ``constant`` ones are taken apart, each read one
      scalar per element (``diagonal``): their messages' G is diagonal
      (GaussianBanded.message_at).
    """
    conjugate = dict(plan.conjugate)
    retracted = {
        b.name for b in plan.blocks
        if b.family.gaussian and not b.point and not conjugate.get(b.name, False)
    }
    exact_gaussian = {
        b.name for b in plan.blocks
        if b.family.gaussian and not b.point and conjugate.get(b.name, False)
    }
    multiplied = {n for f in plan.factors for _, ps in f.spec.pairs for pair in ps for n in pair}
    diagonal = {
        b.name for b in plan.blocks
        if b.family.banded and all(
            dict(f.columns).get(b.name) == "scalar" for f in plan.factors_of(b.name) if f.name not in constant.get(b.name, ())
        )
    }
    return retracted, exact_gaussian, multiplied, diagonal


def _messages_of_grads(blocks, nat, views, grads, diagonal) -> dict:
    """Block → Σ_i λ̃_ib from ∂Σ_i E_q[log f_i]/∂view_b (``grads``), by each block's family
    (``message_at``; a chain in ``diagonal`` reads a diagonal G)."""
    return {
        n: blocks[n].family.message_at(nat[n], views[n], g, diagonal=True) if n in diagonal
        else blocks[n].family.message_at(nat[n], views[n], g)
        for n, g in grads.items()
    }


def one_pass_of(plan, objective, schedule: str, constant=None):
    """A :class:`OnePass`, whose ``run(nat, views, data, key)`` gives
    ``(Σ_i E_q[log f_i], Ahead)``: the expected log factors (the ELBO less its entropies)
    and the messages of the blocks a step reads first (every block in the ``parallel``
    schedule, the first one in the ``sequential``), at one q, from one pass over the data:
    the value and the gradient of the objective.

    A step then carries these messages at its q: its update λ' = (1 − ρ)λ + ρ λ̃(λ) reads
    them, and one pass at the updated q gives both the ELBO that accepts or undoes the step
    and the next step's first messages (a rejected step falls back to its state's). The
    iterates are those of messages computed when the step reads them; a step makes one pass
    over the data fewer (over a mesh, one all-reduce a step where every message it reads was
    computed so: docs/scaling.md).

    None (messages computed when read) for a plan with subsampled plates, factors taken
    apart as :func:`constant_factors` (the ELBO's value is formed otherwise there), factors
    that draw (Monte Carlo messages: carried, they come from other draws than the messages
    computed when read, which changes every fixed-key fit; no bias was found, the quartic
    factor's sds 0.928 against 0.927 of the exact ones over 8 keys and 5 copies, but the
    fixed-key tests of these fits are not yet checked against it), or first blocks whose
    messages are not that gradient: point blocks (Newton's method) and a lone conjugate
    block taken at its fixed view (:func:`_fixed_view_block`).
    """
    constant = constant_factors(plan) if constant is None else constant
    names = tuple(plan.order) if schedule == "parallel" else tuple(plan.order[:1])
    _, _, multiplied, diagonal = _block_sets(plan, constant)
    blocks = {b.name: b for b in plan.blocks}
    draws = any(is_jacobian(f) or estimator_of(f).draws for f in plan.factors)
    if plan.subsampled or constant or draws or not names or any(blocks[n].point for n in names):
        return None
    if _fixed_view_block(plan, names, multiplied) is not None:
        return None

    def run(nat, views, data, key=None):
        def obj(sub):
            return objective({**views, **sub}, data, None, key, names, True)

        value, grads = jax.value_and_grad(obj)({n: views[n] for n in names})
        msgs = _messages_of_grads(blocks, nat, views, grads, diagonal)
        return value, carried_messages(plan, msgs)

    return OnePass(names, run)


def carried_messages(plan, msgs: dict) -> Ahead:
    """:class:`Ahead` of the messages ``msgs``: with whether each non-Gaussian block's is a
    valid natural parameter (what its update reads; a Gaussian block's update checks its
    message itself), checked beside the pass that computed them rather than in the next
    step: over a mesh, a check over a per-datum block's elements (an all-reduce) then
    joins the pass's sums in one."""
    valid = {n: plan.block(n).family.is_valid(m) for n, m in msgs.items() if not plan.block(n).family.gaussian}
    return Ahead(msgs, valid)


class OnePass(NamedTuple):
    """What :func:`one_pass_of` returns: the blocks whose messages a step carries, and
    ``run(nat, views, data, key) -> (Σ_i E_q[log f_i], Ahead)``."""

    blocks: tuple
    run: Callable


def _fixed_view_block(plan, names, multiplied):
    """The block whose messages :func:`_make_messages` takes at its family's fixed view, or
    None: one conjugate block alone, with no batch dims (a batched block's elements may be
    coupled by a factor, whose expectation is then not linear in each element's μ): its
    messages do not depend on its q, and its family may take them at a fixed view (no
    factorisation of its current parameters); not a block a product multiplies (its second
    moment reads square roots of its covariance, whose derivative at the fixed view's Σ = 0
    is not finite)."""
    if len(names) != 1:
        return None
    block = plan.block(names[0])
    if block.point or block.name in multiplied or block.batch_shape or not dict(plan.conjugate).get(block.name):
        return None
    return block


def _make_messages(plan, objective, constant, constant_grads):
    """``messages(nat, names, data, key=None, views=None) -> {block: λ̃}``: the summed
    messages Σ_i λ̃_ib of the factors of the blocks ``names`` (all from the same views)."""
    blocks = {b.name: b for b in plan.blocks}
    factors_of = {b.name: tuple(f.name for f in plan.factors_of(b.name)) for b in plan.blocks}
    _, _, multiplied, diagonal = _block_sets(plan, constant)

    def messages(nat, names, data, key=None, views=None):
        views = views_of(plan, nat) if views is None else views
        wanted = set().union(*(factors_of[n] for n in names)) if names else set()

        # (the value is read by the Newton solves of point blocks only)
        values = any(blocks[n].point for n in names)

        def obj(sub):
            return objective({**views, **sub}, data, wanted, key, names, values)

        smooth = [n for n in names if not blocks[n].point]
        one = _fixed_view_block(plan, names, multiplied)
        fixed = one.family.fixed_view(views[one.name]) if one is not None else None
        if fixed is not None:
            (n,) = smooth
            grads = jax.grad(obj)({n: fixed})
            return {n: blocks[n].family.message_from_fixed_view_grad(grads[n])}
        # the factors whose messages are the same at every q are taken at the fixed view
        # (see constant_factors), the others at the current one
        split = [n for n in smooth if n in constant]
        wanted -= {f for n in split for f in constant[n]}
        grads = jax.grad(obj)({n: views[n] for n in smooth}) if smooth else {}
        out = _messages_of_grads(blocks, nat, views, grads, diagonal)
        for n in split:
            fixed_msg = blocks[n].family.message_from_fixed_view_grad(constant_grads(n, views, data, key))
            out[n] = jax.tree.map(jnp.add, out[n], fixed_msg)
        for n in names:
            if blocks[n].point:
                view = views[n]
                solve = newton_maximise if blocks[n].param else newton_message
                out[n] = solve(blocks[n], nat[n], lambda m, n=n, view=view: obj({n: view._replace(mean=m)}), view.mean)
        return out

    return messages


def _make_update(plan, nat, views, entropies, proper, deferred, retracted, exact_gaussian, max_halvings):
    """``update(n, msg, rate) -> ok``: update block n of ``nat`` in place by its message at
    step size ``rate``, and its view and entropy after it: from the update's own
    factorisation for Gaussian blocks, else formed again. Records in ``proper`` whether the
    message was a valid natural parameter, and in ``deferred`` what the ELBO's
    factorisation decides of a conjugate Gaussian block's message. ``valid``: whether ``msg``
    is a valid natural parameter, when known (a carried message's, :func:`one_pass_of`)."""
    blocks = {b.name: b for b in plan.blocks}

    def update(n, msg, rate, valid=None):
        family = blocks[n].family
        formed = None
        if n in retracted or n in exact_gaussian:
            formed = (family.rule_view_and_entropy, views[n], entropies[n])
        if n in exact_gaussian:
            # at ρ = 1 the new parameters are the message, factorised once by the ELBO's
            # entropy: a message that is not a valid natural parameter makes it non-finite
            # and the step is undone; at ρ < 1 the message is checked here
            valid_msg = jax.lax.cond(rate == 1.0, lambda: jnp.array(True), lambda: family.is_valid(msg))
            deferred[n] = (rate, valid_msg, msg)
            nat[n], ok, views[n], entropies[n] = _update_block(family, nat[n], msg, rate, max_halvings, valid_msg, False, formed)
            return ok
        if n in retracted:
            nat[n], ok, views[n], entropies[n], proper[n] = _update_retracted(
                family, nat[n], msg, rate, max_halvings, formed
            )
            return ok
        proper[n] = family.is_valid(msg) if valid is None else valid
        nat[n], ok = _update_block(family, nat[n], msg, rate, max_halvings, proper[n])
        view, entropy = views_and_entropies(plan, nat, (blocks[n],))
        views.update(view)
        entropies.update(entropy)
        return ok

    return update


def _make_exact_step(plan, messages, expected, constant, schedule, block_rate, max_halvings, one_pass=None):
    """The step of a plan without subsampled plates (exact ELBOs): see :func:`make_step`;
    ``constant``: the plan's :func:`constant_factors`; ``one_pass``: the schedule's
    :func:`one_pass_of` (used when the state carries its messages)."""
    retracted, exact_gaussian, _, _ = _block_sets(plan, constant)
    draws = any(is_jacobian(f) or estimator_of(f).draws for f in plan.factors)

    def step(state, data, rho):
        nat = dict(state.nat)
        valid = jnp.array(True)
        proper, deferred = {}, {}
        if draws:
            key, key_elbo, *keys = jax.random.split(state.rng_key, len(plan.order) + 2)
        else:  # nothing draws: no threefry program in the step (its lowering and compile cost)
            key = key_elbo = state.rng_key
            keys = [key] * len(plan.order)

        # each block's view (and entropy) is formed at each of its updates (a Gaussian's from
        # the factorisation that checks the update), and read by the messages of the blocks
        # after it and by the ELBO (a dense block's factorisation is its costliest part: not
        # repeated for every reader); those of the state's own parameters come with it
        # inside a run's loop (the previous step formed them)
        carried = state.views is not None
        if carried:
            views, entropies = dict(state.views), dict(state.entropies)
        else:
            views, entropies = views_and_entropies(plan, nat)
        update = _make_update(plan, nat, views, entropies, proper, deferred, retracted, exact_gaussian, max_halvings)

        def rate(n):
            return rho[n] * block_rate(n, state.step) * state.damping

        # the messages at the state's q come with it when the previous step's pass computed them
        ahead = state.messages is not None and one_pass is not None
        if schedule == "parallel":
            names = tuple(plan.order)
            msgs = state.messages.sums if ahead else messages(nat, names, data, keys[0], views)
            known = state.messages.valid if ahead else {}
            for n in names:
                valid = valid & update(n, msgs[n], rate(n), known.get(n))
        else:
            for i, (n, k) in enumerate(zip(plan.order, keys)):
                if ahead and i == 0:
                    valid = valid & update(n, state.messages.sums[n], rate(n), state.messages.valid.get(n))
                else:
                    valid = valid & update(n, messages(nat, (n,), data, k, views)[n], rate(n))
        if ahead:
            # (one pass at the updated q: its ELBO and the next step's messages)
            expected_value, next_msgs = one_pass.run(nat, views, data, key_elbo)
            elbo = expected_value + sum(entropies.values())
        else:
            elbo = expected(views, data, key_elbo) + sum(entropies.values())
        for n, (r, valid_msg, msg) in deferred.items():
            at_message = jnp.isfinite(entropies[n]) & all_finite(msg)
            proper[n] = jnp.where(r == 1.0, at_message, valid_msg)
        new_state = state._replace(nat=nat, step=state.step + 1, elbo=elbo, rng_key=key)
        if carried:
            new_state = new_state._replace(views=views, entropies=entropies)
        if ahead:
            new_state = new_state._replace(messages=next_msgs)
        return new_state, BLRInfo(elbo=elbo, valid=valid, proper=proper)

    return step


def make_step(
    plan,
    fns,
    schedule: str,
    rate_fn: Callable | None = None,
    max_halvings: int = 30,
    decay_blocks=(),
    curvature: str = "auto",
    global_rate: Callable | None = None,
):
    """Build ``step(state, data, rho) -> (state, info)``.

    The step size of block b at step t is ρ_b(t) = ``rho[b]`` · ``rate_fn(t)``: ``rho`` is a
    dict of scalars passed at run time (so that one compiled step serves every choice of
    per-block step sizes), ``rate_fn`` a static schedule (constant 1 by default; for
    ``decay_blocks``, the blocks with Monte Carlo messages, :func:`decaying_rate`).

    Args:
        plan: the compiled plan.
        fns: model functions.
        schedule: ``"sequential"`` or ``"parallel"``.
        rate_fn: optional callable of the step number.
        decay_blocks: names of blocks whose default schedule decays.
        curvature: estimator of Monte Carlo messages to Gaussian blocks (see
            :data:`blrppl.estimators.monte_carlo.CURVATURES`).
        global_rate: for plans with subsampled plates (stochastic BLR, see
            :mod:`blrppl.engine.subsample`), the step-size schedule of the global blocks
            when ``rate_fn`` is None (e.g. :func:`blrppl.engine.subsample.svi_rate`); None
            means a constant 1 (ρ then comes from ``rho`` alone). Local blocks always take
            ρ = 1 on their minibatch elements.

    Returns:
        ``(step, elbo_fn, messages, carry)``: ``carry(state, data)`` is the state as a run's
        loop carries it (:func:`with_views`; with :func:`one_pass_of`, also the messages
        its step reads first; None under subsampling).
    """
    user_rate = rate_fn
    decay_blocks = frozenset(decay_blocks)

    def block_rate(n, t):
        if user_rate is not None:
            return user_rate(t)
        return decaying_rate(t) if n in decay_blocks else 1.0

    objective = make_objective(plan, fns, curvature)
    values = make_objective(plan, fns, curvature=None)  # the ELBO's: no message surrogates
    expected, constant, constant_grads = make_split_expectation(plan, fns, values)
    messages = _make_messages(plan, objective, constant, constant_grads)
    if plan.subsampled:
        from blrppl.engine import subsample

        def rate_of_global(t):
            if user_rate is not None:
                return user_rate(t)
            return global_rate(t) if global_rate is not None else 1.0

        elbo_fn = subsample.minibatch_elbo(plan, values, views_of)
        step = subsample.make_minibatch_step(
            plan,
            messages,
            elbo_fn,
            lambda family, nat, msg, rho: _update_block(family, nat, msg, rho, max_halvings),
            BLRState,
            BLRInfo,
            schedule,
            rate_of_global,
        )
        return step, elbo_fn, messages, None
    one_pass = one_pass_of(plan, objective, schedule, constant)
    step = _make_exact_step(plan, messages, expected, constant, schedule, block_rate, max_halvings, one_pass)
    return step, make_elbo(plan, fns), messages, _make_carry(plan, messages, one_pass)


def _make_carry(plan, messages, one_pass):
    """``carry(state, data) -> state``: ``state`` with its views and entropies
    (:func:`with_views`) and, when the step computes its messages ahead (``one_pass``, see
    :func:`one_pass_of`), the messages at its q."""

    def carry(state, data):
        state = with_views(plan, state)
        if one_pass is None:
            return state
        # (nothing draws: one_pass_of)
        msgs = messages(state.nat, one_pass.blocks, data, state.rng_key, state.views)
        return state._replace(messages=carried_messages(plan, msgs))

    return carry
