"""Compiling a traced model into blocks, a factor graph and a static plan."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import warnings

import jax
import jax.numpy as jnp
import networkx as nx
import numpy as np
import numpyro.distributions as dist
from numpyro.distributions import biject_to, constraints

from blrppl import families as fam
from blrppl import moments as mom
from blrppl.errors import FamilyError, UnsupportedFactorError, UnsupportedLatentError
from blrppl.estimators import bilinear, gram
from blrppl.estimators.monte_carlo import elementwise_bijection
from blrppl.estimators.quadrature import GRID_NODES
from blrppl.expressions import (
    LINKS, ArgumentClass, ModelFunctions, ModelProgram, classify_form, distribution_leaves, factor_arguments, log_prob_reads,
    gather_probe, pairing_probe, probe_argument, projection_args, random_point, run_probes, too_many_columns,
)
from blrppl.expressions import _needs_gather_test as needs_gather_test
from blrppl.graph.band import PROVISIONAL, arrowhead_locals, chain_bandwidth
from blrppl.graph import chain_table, markov
from blrppl.runtime.compile import compile_lowered, compiler_options, jit
from blrppl.graph.derivatives import is_reverse_only_error, reverse_only
from blrppl.runtime.program_store import compile_program, jit as store_jit, program_key
from blrppl.graph.deps import output_forms
from blrppl.graph import forms as fm
from blrppl.graph.forms import Const, Power, inverse_link
from blrppl.graph.plan import Block, Factor, FactorRole, LocalAxis, Plan
from blrppl.graph.stack import stack_factors
from blrppl.graph.trace import SiteRecord, finite_support_values, program_fingerprint
from blrppl.rules import find_rule

def _support_kind(support) -> str:
    base = support
    while isinstance(base, constraints.independent):
        base = base.base_constraint
    if base.is_discrete:
        return "discrete"
    if base is constraints.real or base is constraints.real_vector:
        return "real"
    if base is constraints.positive:
        return "positive"
    if base is constraints.unit_interval or _is_unit_interval(base):
        return "unit_interval"
    if base is constraints.simplex:
        return "simplex"
    if base is constraints.positive_definite:
        return "positive_definite"
    return str(base)


def _is_unit_interval(constraint) -> bool:
    """An interval constraint with constant bounds 0 and 1 (``Uniform(0, 1)``'s support)."""
    if type(constraint) is not type(constraints.interval(0.0, 1.0)):
        return False
    try:
        lower, upper = np.asarray(constraint.lower_bound), np.asarray(constraint.upper_bound)
    except Exception:  # traced bounds: not known at compile time
        return False
    return bool(np.all(lower == 0) and np.all(upper == 1))


def choose_family(record: SiteRecord, override: str | None, unconstrained: bool = False) -> Block:
    """The candidate family of a latent site.

    By default the native family of its support (real → Gaussian, positive → Gamma, unit
    interval → Beta, simplex → Dirichlet, finite discrete → Categorical/Bernoulli); a
    Gaussian on the unconstrained space (``biject_to(support)``) when ``unconstrained`` or
    when the support has no native family (intervals, ordered vectors, Cholesky factors...).
    """
    support = _support_kind(record.support)
    shape = record.value_shape
    if override == "grid":
        raise FamilyError(
            "family 'grid' (a scalar scale integrated on a grid of fits with it fixed) is an option of blr_fit "
            "alone; BLR and plan_of fit every latent in a family of its own",
            site=record.name,
        )
    if override is not None and override not in fam.FAMILIES:
        raise FamilyError(f"unknown family '{override}'; families: {sorted(fam.FAMILIES)}", site=record.name)
    if support == "discrete":
        values = finite_support_values(record.support)
        if values is None:
            raise UnsupportedLatentError(
                f"latent {record.dist_name} has unbounded discrete support ({record.support}); "
                "only finite discrete latents (Bernoulli, Categorical, bounded integers) can be "
                "enumerated: marginalise it out by hand or give it a bounded support",
                site=record.name,
            )
        values = tuple(int(v) for v in values)
        if override is None:
            cls = next(c for c in fam.FAMILIES.values() if c.support == "discrete" and c.native and c.fits(values))
        else:
            cls = fam.FAMILIES[override]
            if cls.support != "discrete" or not cls.fits(values):
                raise FamilyError(
                    f"family '{override}' cannot represent a discrete latent with {len(values)} values; "
                    "use 'categorical'",
                    site=record.name,
                )
        return Block(record.name, cls.for_value(shape, (), len(values)), cls.name, shape, (), values)
    native = {c.support: c for c in reversed(fam.FAMILIES.values()) if c.native and c.support != "discrete"}
    if override is not None:
        cls = fam.FAMILIES[override]
    elif unconstrained or support not in native:
        cls = native["real"]
    else:
        cls = native[support]
    if cls.gaussian:
        transform = None if support == "real" else biject_to(record.support)
        ushape = shape if transform is None else tuple(transform.inverse_shape(shape))
        axes = record.plate_axes() if cls.dense_event else ()
        return Block(record.name, cls.for_value(ushape, axes), cls.name, ushape, axes, None, transform, shape)
    if cls.support != support:
        fits = sorted(n for n, c in fam.FAMILIES.items() if c.support in (support, "real"))
        raise FamilyError(
            f"family '{cls.name}' cannot represent a latent with support {record.support}; "
            f"families that fit it: {fits}",
            site=record.name,
        )
    return Block(record.name, cls.for_value(shape), cls.name, shape)


def init_nat(block: Block, init_value, probs=None):
    """Initial natural parameters: centred on the initial value, broad; discrete blocks
    start from the given random ``probs`` (breaking the symmetry of mixtures). Concrete
    values give numpy parameters, computed on the host: starting a fit compiles nothing."""
    family = block.family
    dtype = jnp.result_type(float)
    xp = jnp if any(isinstance(v, jax.core.Tracer) for v in (init_value, probs)) else np
    if block.discrete:
        return family.nat_from_view(fam.CategoricalView(xp.asarray(probs, dtype)))
    return family.initial_nat(block.to_canonical(xp.asarray(init_value).astype(dtype)))


#: the most scalar projections per element a quadrature factor may have
MAX_PROJECTIONS = 2
#: a factor without closed form or projections whose continuous neighbours are Gaussian
#: blocks of at most this many scalars in all (a chain's stationary start reading a level,
#: a scale and a persistence) is integrated over them by a tensor Gauss–Hermite rule
#: (:func:`blrppl.estimators.quadrature.grid_elementwise`) instead of Monte Carlo
GRID_MAX_DIM = 4
#: ... and when its nodes times its elements (each counted as its event's size squared: a
#: multivariate density costs at least that) are at most this many a step (a plated
#: likelihood of many elements, or a Gaussian process's of many points, stays Monte Carlo:
#: 16 draws)
GRID_MAX_EVALUATIONS = 1 << 21
#: by default, the dense Gaussian blocks are merged into one joint dense Gaussian when
#: their total dimension is at most this
JOINT_MAX_DIM = 500
#: ... and, when a Monte Carlo factor reads the joint block, at most this: a dense block's
#: curvature from a few draws per step is too noisy in more dimensions (a logistic
#: regression on a covariate imputed with ``obs_mask``, 157 scalars joint with the product
#: ``b_x * x``: the ELBO fell from −364 to −877 in 60 steps, coefficients of the wrong sign;
#: apart, 100 steps to NUTS's means within 0.1 sd)
MC_JOINT_MAX_DIM = 64
#: the arguments that set the spread of a latent's prior rather than its location (a
#: scale, a covariance, a Beta's, Dirichlet's or Gamma's concentration): the latent sites
#: they read are recorded as the factor's ``spread`` (the poor-q advice names them)
SPREAD_ARGS = frozenset(
    {"scale", "scale_tril", "covariance_matrix", "precision_matrix", "concentration", "concentration1", "concentration0"}
)
#: Gaussian blocks of at least this many scalars are tested for a chain structure (banded
#: precision, :mod:`blrppl.graph.band`); smaller ones stay dense (exact, and cheap)
BANDED_MIN_DIM = 32


def compile_model(
    model, records, data_spec, data, families=None, rng_key=None, structure=None, point=(),
    point_space="unconstrained", subsampled=(), arrowhead=True, banded=True, _barren=None, merge_joint=True,
):
    """Build blocks, the factor graph and the plan of a traced model.

    Family policy ("auto"): every latent starts in the native family of its support; a factor
    whose expected log-density has no closed form for its arguments gets the quadrature or
    Monte Carlo estimator, and every non-Gaussian continuous latent it touches is moved to a
    Gaussian on its unconstrained space (then the other factors of that latent are classified
    again), until nothing changes. A Gamma latent is also moved when a closed-form factor is
    not conjugate to it (e.g. a Normal scale σ = τ, which needs E[τ^−2], finite only for
    shapes above 2, where the Gamma family can wander while fitting). A latent whose family the user chose keeps it, and its factors
    without closed forms use Monte Carlo messages.

    Args:
        model: the numpyro model.
        records: site records from :func:`blrppl.graph.trace.trace_model`.
        data_spec, data: the model's data (static part and array leaves).
        families: optional dict site → family name overriding the default.
        rng_key: key for the probes.
        structure: ``"joint"`` merges every dense Gaussian block (except ``point`` ones)
            into one dense Gaussian, capturing their posterior correlations like
            AutoMultivariateNormal; ``"mean-field"`` keeps one block per site; by default
            the dense Gaussian blocks without a family override are merged when there are
            several and their total dimension is at most :data:`JOINT_MAX_DIM`, except
            chains (banded) and the scales on log space that a would-be chain's factors read
            (:func:`_scales_of`), and not when a Monte Carlo factor reads a joint block of
            more than :data:`MC_JOINT_MAX_DIM` scalars.
        point: sites fitted by the delta method (Gaussian on the unconstrained space seen
            at its mean; Newton updates; Laplace's method at convergence).
        point_space: ``"unconstrained"`` (the ``point`` sites keep the log|det J| term of
            their bijection: the mode on the unconstrained space) or ``"constrained"`` (no
            such term: the mode of the density in the site's own space).

    ``numpyro.param`` sites become point blocks (``param=True``) on the unconstrained space
    of their constraint, without a log|det J| term (a param is not random: its estimate is
    the maximiser of the model's log density in its own space, as numpyro's SVI fits
    params). In the sequential order a discrete block whose continuous neighbours are all
    point blocks comes first (the E-step from the initial points, as EM starts); the other
    discrete blocks come last, after the continuous blocks in model order.
        subsampled: the model's :class:`blrppl.graph.plan.SubsampledPlate` s (from
            :func:`blrppl.graph.trace.subsampled_plates`); ``records`` then hold minibatch
            shapes. Latents inside such a plate become *local* blocks (never merged into a
            joint block, updated first in each step); the model functions use the first M
            elements of each plate unless the data carry a minibatch.
        arrowhead: whether a joint block beyond :data:`JOINT_MAX_DIM` may be an arrowhead
            (False: the compilation again after an arrowhead whose factors turned out to
            have only Monte Carlo messages, which its view cannot give).
        banded: whether a Gaussian block may be a chain (False: the compilation again after
            a chain whose factors turned out to have only Monte Carlo messages).
        _barren: (internal) latents left out of the fit because no other site reads them
            (:func:`barren_latents`; ``Plan.barren`` names them): the compilation again
            without them, with their values for the model's runs.

    Returns:
        (plan, model functions, dynamic data leaves, init values dict (block space),
        networkx graph)
    """
    families = dict(families or {})
    for name in families:
        if name not in records or records[name].observed:
            raise FamilyError(
                f"families= names '{name}', which is not a latent sample site of the model",
                site=name,
            )
    point = tuple(point or ())
    for name in families:
        if records[name].is_param:
            raise FamilyError(
                "families= names a numpyro.param site; a param is a point estimate, not a "
                "distribution: remove it from families=",
                site=name,
            )
    for name in point:
        if name in records and records[name].is_param:
            raise FamilyError(
                "point= names a numpyro.param site; params are always point estimates (without "
                "a log|det J| term): remove it from point=",
                site=name,
            )
        if name not in records or records[name].observed:
            raise FamilyError(f"point= names '{name}', which is not a latent sample site", site=name)
        if records[name].support.is_discrete:
            raise FamilyError("a discrete latent cannot be a point (delta-method) block", site=name)
        asked = families.get(name)
        if asked is not None and not (asked in fam.FAMILIES and fam.FAMILIES[asked].gaussian):
            raise FamilyError(f"a point block is Gaussian, not '{families[name]}'", site=name)
    if point_space not in ("unconstrained", "constrained"):
        raise FamilyError(f"point_space must be 'unconstrained' or 'constrained', not {point_space!r}")
    rng_key = jax.random.key(1) if rng_key is None else rng_key
    subsampled = tuple(subsampled)
    plate_indices = {p.name: np.arange(p.subsample_size) for p in subsampled}
    all_records = records
    latent = [r for r in records.values() if not r.observed]
    site_init = {r.name: np.asarray(r.init_value) for r in latent}
    # (a left-out latent still runs in the model: at its initial value, which nothing reads)
    site_init.update(_barren or {})
    unconstrained = {r.name: r.unconstrained_init for r in latent if r.unconstrained_init is not None}
    # params are not sites with a density: they are inputs of the factors, never factors
    records = collections.OrderedDict((n, r) for n, r in records.items() if not r.is_param)
    rules = {r.name: (None if r.is_factor else find_rule(r.dist_type, r.given)) for r in records.values()}
    # the model's program, traced once and shared by every evaluation below and by the fit
    program = ModelProgram(model)
    deps, forms, elementwise, primitives = _dependencies(
        model, data_spec, data, records, rules, site_init, plate_indices, program
    )
    _check_static_supports(records, deps)
    site_deps = deps
    if primitives & AUDITED_PRIMITIVES:
        _audit_dependencies(model, data_spec, data, records, deps, site_init, plate_indices, rng_key, program)
    if _barren is None:
        keep = set(families) | set(point) | {r.name for r in latent if r.is_param}
        barren = barren_latents(records, deps, keep)
        if barren:
            return compile_model(
                model, collections.OrderedDict((n, r) for n, r in all_records.items() if n not in barren),
                data_spec, data, families, rng_key, structure, point, point_space, subsampled, arrowhead, banded,
                _barren={n: site_init[n] for n in barren}, merge_joint=merge_joint,
            )
    param_blocks = {r.name: _param_block(r) for r in latent if r.is_param}

    moved: set = set()
    # an argument's class depends on the blocks it depends on: while the policy iterates,
    # those are known again unless one of them was moved (quadrature probes wait for the
    # final blocks)
    probe_cache = (
        lambda name, arg: (name, arg, tuple(sorted((n, n in moved, n in on_support) for n in deps[name][arg]))), {}
    )
    on_support: set = set()
    while True:
        blocks = {
            r.name: param_blocks[r.name]
            if r.is_param
            else _localise(
                _as_point(choose_family(r, families.get(r.name), r.name in moved or r.name in point), r.name in point),
                r,
                subsampled,
            )
            for r in latent
        }
        blocks = _with_value_moments(blocks, forms, deps)
        on_support = {n for n, b in blocks.items() if b.value_moments}
        init_values = _block_init_values(blocks, site_init, unconstrained)
        fns = ModelFunctions(
            model, data_spec, _site_fill(blocks, site_init, unconstrained), _transforms(blocks), plate_indices=plate_indices,
            program=program,
        )
        factors = _classify_factors(
            records, rules, deps, blocks, fns, data, rng_key, quadrature=False, cache=probe_cache, forms=forms,
            provisional=True,
        )
        to_move = set()
        for f in factors:
            if f.estimator == "exact":
                # a Gamma block keeps its family only where the factor is conjugate to it:
                # other powers need moments such as E[τ^-2] that exist only for some shapes
                for arg, power in f.powers:
                    (n,) = dict(f.arg_blocks)[arg]
                    allowed = f.rule.conjugate_powers.get(arg, ())
                    if n not in families and (power is None or not any(np.isclose(power, a) for a in allowed)):
                        to_move.add(n)
                continue
            for n in f.neighbours:
                b = blocks[n]
                if b.discrete or b.family.gaussian:
                    continue
                if n in families:
                    continue  # the user's family is kept: Monte Carlo messages
                to_move.add(n)
        if not to_move - moved:
            break
        moved |= to_move

    # discrete latents read along a chain (a hidden Markov model) become one chain block
    blocks, chain_reads = _discrete_chains(blocks, factors, fns, data, np.random.default_rng(0))

    # a factor that mixes the plate elements of a Gaussian block (a difference of neighbours,
    # a sum over the plate) couples them: the block is dense over all its scalars, exact,
    # unless the user asked for its family or for mean-field, it is too large for the
    # default, or it is a local block of a subsampled plate (then its elements are fitted
    # mean-field, iterated: see conjugate_blocks)
    coupled = [n for n in _plate_coupled(blocks, factors) if n not in families and blocks[n].local is None]
    densified = [
        n for n in coupled if structure == "joint" or (structure is None and blocks[n].size <= JOINT_MAX_DIM)
    ]
    dense = {n: dataclasses.replace(blocks[n], family=fam.GaussianDense(blocks[n].size), plate_axes=()) for n in coupled}

    # a scale on log space that a factor with event dims reads (a random walk's step size):
    # joined with the walk it would leave that factor Monte Carlo only (there is no quadrature
    # over an event); apart, the factor's closed form holds
    apart = set() if structure == "joint" else {
        n for f in factors if f.rule is not None and f.rule.event_ndim
        for a, k in f.arg_kinds if k == mom.ExpGaussian.kind for n in dict(f.arg_blocks)[a]
    }
    # the blocks a product multiplies (``w * x``) stay apart: joined, the product would be
    # quadratic in one block (no closed form); apart, each is a conjugate coordinate step
    # (variational message passing). So does a scale on log space beside a product (a
    # factor model's HalfCauchy noise scale): joined with the product's offset (a per-column
    # mean) it would leave the likelihood Monte Carlo; apart, the Normal's closed form holds
    if structure != "joint":
        apart |= {n for f in factors for _, pairs in f.pairs for pair in pairs for n in pair}
        apart |= on_support  # (seen through their moments, on their own only)
        apart |= {
            n for f in factors if f.pairs
            for a, k in f.arg_kinds if k == mom.ExpGaussian.kind for n in dict(f.arg_blocks)[a]
        }

    def joinable(n, b):
        # a site the user gave a family keeps its own block, unless structure="joint" asks
        # for every dense Gaussian in one; local blocks of a subsampled plate are never merged
        return (
            b.family.dense_event and not b.point and b.local is None and n not in apart
            and (n not in families or structure == "joint")
        )

    members = [n for n, b in {**blocks, **{n: dense[n] for n in densified}}.items() if joinable(n, b)]

    def linked(n):
        # (a chain couples its own elements: some block's elements are mixed by a factor, or
        # it is one vector of a distribution with an event dim, as a GaussianRandomWalk)
        return n in coupled or (blocks[n].family.dense_event and not blocks[n].batch_shape)

    if structure is None and banded:
        # a scale on log space that the factors of a would-be chain read (a walk's step
        # size, an observation noise written one site per step): joined with the chain, each
        # such factor would be a quadrature over a dense block; apart, its closed form holds
        # and the chain is banded, or dense with the affine globals it shares factors with
        # (a level added to every step), as at any length
        scales = {
            m for n in members if blocks[n].size >= BANDED_MIN_DIM and linked(n) for m in _scales_of(n, members, factors)
        }
        apart |= scales
        members = [n for n in members if n not in scales]
    size = sum(blocks[n].size for n in members)
    merge = len(members) > 1 and (structure == "joint" or (structure is None and merge_joint and size <= JOINT_MAX_DIM))
    # chains (each factor element reads a few consecutive scalars: a random walk, an AR(p), a
    # state-space model with its initial state) get a banded precision at any size: first
    # every dense Gaussian together (in model order), else each block alone unless it joins
    # the dense joint block (under "mean-field" too, for a site whose block is dense: a scan's
    # stacked steps; its posterior precision has the chain's band, so the banded block is
    # the same q, fitted in O(n))
    chains = {}
    if structure is None and banded:
        every = [n for n, b in {**blocks, **dense}.items() if joinable(n, b)]
        total = sum(blocks[n].size for n in every)
        # (a long vector site, or more scalar sites than a dense block holds: one per step
        # of a Python loop)
        if len(every) > 1 and total >= BANDED_MIN_DIM and (
            any(blocks[n].size >= BANDED_MIN_DIM // 2 for n in every if linked(n)) or total > JOINT_MAX_DIM
        ):
            # in model order (each site's scalars in turn), else with the sites of one length
            # step by step (a state written as one site per component: level and slope)
            for order, interleaved in ((every, 0), _time_major({**blocks, **dense}, every)):
                if order is None:
                    break
                trial = _merge_joint({**blocks, **dense}, order, interleaved)
                joint = next(n for n, b in trial.items() if b.members and not b.discrete)
                trial_fns = ModelFunctions(
                    model, data_spec, _site_fill(trial, site_init, unconstrained), _transforms(trial),
                    {joint: trial[joint]}, plate_indices, program,
                )
                site_block = {m: joint for m in trial[joint].sites}
                chain = chain_bandwidth(
                    joint, trial, factors, trial_fns, data, np.random.default_rng(0), site_block, PROVISIONAL
                )
                if chain is not None and 3 * (2 * chain.bandwidth + 1) <= trial[joint].size:
                    blocks = {**trial, joint: _banded(trial[joint], chain.bandwidth)}
                    chains[joint], merge, densified = chain, False, []
                    break
    if structure in (None, "mean-field") and banded:
        candidates = [
            n for n, b in blocks.items()
            if b.family.gaussian and not b.point and not b.members and b.local is None and n not in families
            and b.size >= BANDED_MIN_DIM and linked(n) and (structure is None or b.family.dense_event)
        ]
        for n in candidates if not chains else ():
            if not (merge and n in members):
                chain = chain_bandwidth(
                    n, {**blocks, n: dense.get(n, blocks[n])}, factors, fns, data, np.random.default_rng(0),
                    estimators=PROVISIONAL,
                )
                if chain is not None and 3 * (2 * chain.bandwidth + 1) <= blocks[n].size:
                    chains[n] = chain
                    blocks[n] = _banded(blocks[n], chain.bandwidth)
    densified = [n for n in densified if n not in chains]
    if merge:
        members = [n for n in members if n not in chains]
        merge = len(members) > 1
    # beyond the dense limit, an arrowhead: members of which each factor element reads at
    # most one scalar (per-student effects) get a diagonal precision, the others (per-question
    # effects, a global mean) a dense one and the coupling between the two (item-response and
    # hierarchical models)
    arrow = ()
    if structure is None and arrowhead and not chains and not merge:
        every = [n for n, b in {**blocks, **dense}.items() if joinable(n, b)]
        total = sum(blocks[n].size for n in every)
        # (locals are plate elements: a member without a plate is read whole, e.g. a
        # regression's coefficient vector, and no probe is compiled for such models)
        if len(every) > 1 and total > JOINT_MAX_DIM and any(blocks[n].batch_shape for n in every):
            trial = _merge_joint({**blocks, **dense}, every)
            joint = next(n for n, b in trial.items() if b.members and not b.discrete)
            trial_fns = ModelFunctions(
                model, data_spec, _site_fill(trial, site_init, unconstrained), _transforms(trial), {joint: trial[joint]},
                plate_indices, program,
            )
            offsets = np.cumsum([0] + [m.size for m in trial[joint].members])
            spans = {m.name: (int(lo), int(hi)) for m, lo, hi in zip(trial[joint].members, offsets[:-1], offsets[1:])}
            site_block = {m: joint for m in trial[joint].sites}
            plated = {m: span for m, span in spans.items() if blocks[m].batch_shape}
            local = arrowhead_locals(
                joint, trial, factors, trial_fns, data, np.random.default_rng(0), plated, site_block
            )
            if local and total - sum(spans[m][1] - spans[m][0] for m in local) <= JOINT_MAX_DIM:
                arrow = tuple(spans[m] for m in every if m not in local)
                blocks, members, merge, densified = {**blocks, **dense}, every, True, []
    for n in densified:
        blocks[n] = dense[n]
    coupled_discrete = _coupled_discrete(blocks, factors)
    if not merge and not coupled_discrete and not densified and not chains and not chain_reads:
        factors = _classify_factors(
            records, rules, deps, blocks, fns, data, rng_key, cache=probe_cache, elementwise=elementwise, forms=forms
        )
    else:
        for group in coupled_discrete:
            blocks = _merge_discrete(blocks, group)
        if merge:
            blocks = _merge_joint(blocks, members)
        if arrow:
            joint = next(n for n, b in blocks.items() if b.members and not b.discrete)
            blocks[joint] = _arrowhead(blocks[joint], arrow)
        init_values = _block_init_values(blocks, site_init, unconstrained)
        joints = {n: b for n, b in blocks.items() if b.members and not b.discrete}
        fns = ModelFunctions(
            model, data_spec, _site_fill(blocks, site_init, unconstrained), _transforms(blocks), joints, plate_indices, program
        )
        site_block = {s: n for n, b in blocks.items() for s in b.sites}
        site_reads = {name: frozenset().union(*args.values()) for name, args in deps.items()}
        deps = {
            name: {arg: frozenset(site_block[x] for x in d) for arg, d in args.items()}
            for name, args in deps.items()
        }
        guess = {f.name: f.estimator == "exact" for f in factors}
        factors = _classify_factors(
            records, rules, deps, blocks, fns, data, rng_key, guess=guess, elementwise=elementwise, forms=forms,
            site_reads=site_reads,
        )

    factors = [
        dataclasses.replace(f, chain_reads=chain_reads[f.name]) if f.name in chain_reads else f for f in factors
    ]
    factors = [_scalar_columns(f, chains) for f in factors]
    factors += [
        _jacobian_factor(b)
        for b in blocks.values()
        if _transformed(b) and not b.param and not (b.point and point_space == "constrained")
    ]
    for n in [*chains, *(b.name for b in blocks.values() if b.family.arrowhead)]:
        # (a chain or an arrowhead is chosen on the factors' structure, before their final
        # classes: a factor without closed form or quadrature would need draws of the whole
        # block, which its view cannot give; its members are then fitted as without it)
        odd = [f.name for f in factors if n in f.neighbours and f.estimator not in ("exact", "quadrature")]
        if odd:
            return compile_model(
                model, records, data_spec, data, families, rng_key, structure, point, point_space, subsampled,
                arrowhead=arrowhead and n in chains, banded=banded and n not in chains, _barren=_barren,
                merge_joint=merge_joint,
            )
    for n, b in blocks.items():
        # (a large joint block that a factor without closed form or quadrature reads: its
        # members are fitted apart, see MC_JOINT_MAX_DIM)
        if structure is None and b.members and not b.discrete and not b.family.banded and not b.family.arrowhead:
            if b.size > MC_JOINT_MAX_DIM and any(n in f.neighbours and f.estimator == "monte_carlo" for f in factors):
                return compile_model(
                    model, records, data_spec, data, families, rng_key, structure, point, point_space, subsampled,
                    arrowhead=arrowhead, banded=banded, _barren=_barren, merge_joint=False,
                )
    factors = [_with_spread(f, records, rules, site_deps) for f in factors]
    tied = ()
    if subsampled:
        factors = _check_subsampled(factors, records, blocks, {p.name for p in subsampled})
    else:
        # sites of one structure (one per step of a Python loop) become one stacked factor
        factors, stacks, tables = stack_factors(factors, records, forms, blocks, fns, data, np.random.default_rng(0))
        if stacks:
            fns = fns.with_stacks(stacks, data, tables)
        factors = [dataclasses.replace(f, gram_block=gram.eligible(f, blocks, fns, data) or "") for f in factors]
        factors = [_with_gram_pair(f, blocks, fns, data) if not f.gram_block else f for f in factors]
        broadcast = _broadcast_enumerated(factors, blocks, fns, data, np.random.default_rng(0))
        factors = [dataclasses.replace(f, broadcast_enumeration=f.name in broadcast) for f in factors]
        tables = chain_table.tabled(factors, blocks, fns, data, np.random.default_rng(0))
        factors = [dataclasses.replace(f, chain_table=tables.get(f.name)) for f in factors]
        tied = tied_blocks(factors, blocks, fns, data)
        for n in {n for n, _, _ in tied}:
            blocks[n] = dataclasses.replace(blocks[n], family=fam.GaussianTied(blocks[n].family.dim))
    graph = nx.Graph()
    for name, b in blocks.items():
        graph.add_node(("block", name), kind=b.kind, shape=b.value_shape)
    for f in factors:
        graph.add_node(("factor", f.name), dist=f.dist_name, estimator=f.estimator)
        for n in f.neighbours:
            graph.add_edge(("factor", f.name), ("block", n))
    order = _sweep_order(blocks, factors)
    if subsampled:
        # the local step (each minibatch element given the global blocks) comes first, then
        # the global blocks see the fresh local statistics (Hoffman et al. 2013)
        order = tuple(n for n in order if blocks[n].local is not None) + tuple(
            n for n in order if blocks[n].local is None
        )
    plan = Plan(
        blocks=tuple(blocks.values()), factors=tuple(factors), order=order, subsampled=subsampled, tied=tied,
        barren=tuple(_barren or ()),
    )
    return plan, fns, data, init_values, graph


def _with_gram_pair(factor, blocks, fns, data):
    """The factor with its :mod:`blrppl.estimators.bilinear` statistics' blocks, when it is
    eligible for them."""
    found = bilinear.eligible(factor, blocks, fns, data)
    if found is None:
        return factor
    return dataclasses.replace(factor, gram_pair=found[:2], gram_scale_rows=found[2])


def tied_blocks(factors, blocks: dict, fns, data) -> tuple:
    """The plated dense Gaussian blocks whose rows every factor gives the same precision, on
    this data: ``(block, factor, side)`` for each factor on each such block (the facts a fit
    on other data checks again, see :func:`rows_share_precision`).

    A block qualifies when every factor on it reads precomputed data statistics (its own
    prior, :mod:`blrppl.estimators.gram`; a product of two blocks' rows,
    :mod:`blrppl.estimators.bilinear`) and each gives all its rows one precision: the
    prior's per-element precisions κ are equal from row to row; the product's weights
    W2 are equal along the block's rows (no mask, no row-dependent scale). Its fixed point
    in the dense family then has one covariance for all rows, and :class:`GaussianTied`
    holds one (a factor model's rows: one D × D Cholesky per step instead of one per row).
    """
    candidates = {}
    for n, b in blocks.items():
        if type(b.family) is not fam.GaussianDense or b.family.dim < 2 or math.prod(b.batch_shape) < 2:
            continue
        if b.point or b.members or b.local is not None or b.transform is not None:
            continue
        on = [f for f in factors if n in f.neighbours]
        # (rows whose factor weights them by a precision of their own, τ_j, are not tied)
        if on and all(
            (f.gram_block == n or n in f.gram_pair) and f.name not in fns.stacks and f.gram_scale_rows != n for f in on
        ):
            candidates[n] = [(n, f.name, f.gram_pair.index(n) if f.gram_pair else 0) for f in on]
    if not candidates:
        return ()
    by_name = {f.name: f for f in factors}

    def shared(data):
        # (one program for every block's facts: the statistics run the model a few times)
        out = {}
        for n, facts in candidates.items():
            stats = {}
            for _, name, _ in facts:
                f = by_name[name]
                stats[name] = (
                    gram.statistics(fns, f, blocks[n], data) if f.gram_block else bilinear.statistics(fns, f, blocks, data)
                )
            out[n] = rows_share_precision(facts, stats)
        return out

    options = compiler_options(data, 0)
    try:
        holds = compile_lowered(jit(shared).lower(data), options)(data)
    except Exception:  # (a model the statistics cannot evaluate keeps its rows' own covariances)
        return ()
    return tuple(fact for n, facts in candidates.items() if bool(holds[n]) for fact in facts)


def rows_share_precision(facts, stats: dict):
    """Whether the statistics ``stats`` (factor → statistics) give every row of the blocks
    in ``facts`` (:func:`tied_blocks`) one precision (a bool array); facts of factors not in
    ``stats`` are not checked."""
    holds = jnp.array(True)
    for _, name, side in facts:
        if name not in stats:
            continue
        s = stats[name]
        if isinstance(s, gram.ElementStatistics):
            kappa = jnp.reshape(s.kappa, (-1, jnp.shape(s.kappa)[-1]))
            holds = holds & jnp.all(kappa == kappa[:1])
        else:
            holds = holds & jnp.all(s.quad == (s.quad[:1] if side == 0 else s.quad[:, :1]))
    return holds


#: enumerated states whose labels a broadcast check tries per factor: all of them up to
#: this many, else this many at random
BROADCAST_CHECK_STATES = 64


def _broadcast_enumerated(factors, blocks: dict, fns, data, rng: np.random.Generator) -> set:
    """The enumerated factors whose arguments, with their discrete blocks' values of shape 1
    along every dim (every element at one value), equal their arguments with the full values
    broadcast (:attr:`blrppl.graph.plan.Factor.broadcast_enumeration`): checked at a random
    point of their continuous blocks for every enumerated state (or
    :data:`BROADCAST_CHECK_STATES` at random), in one compiled program. A model that reads a
    label's shape (``z.shape[0]``, a reshape to N, a ``scan`` over it) fails the check, or
    raises, and keeps full values."""
    candidates = [
        f for f in factors
        if f.discrete and f.estimator == "exact" and f.role == FactorRole.SITE and f.name not in fns.stacks
        and not any(blocks[d].chain or blocks[d].local is not None for d in f.discrete)
    ]
    if not candidates:
        return set()
    point = {
        n: random_point(blocks[n], rng) for f in candidates for n in f.neighbours if n not in f.discrete
    }
    combos = {}
    for f in candidates:
        sizes = [len(blocks[d].support_values) for d in f.discrete]
        if math.prod(sizes) <= BROADCAST_CHECK_STATES:
            combos[f.name] = np.array(list(itertools.product(*[range(k) for k in sizes])), np.int32)
        else:
            combos[f.name] = np.stack([rng.integers(k, size=BROADCAST_CHECK_STATES) for k in sizes], axis=1).astype(np.int32)

    def agrees(f, combo, data, point):
        full, small = dict(point), dict(point)
        for j, d in enumerate(f.discrete):
            full.update(blocks[d].discrete_site_values(combo[j]))
            small.update(blocks[d].discrete_site_values(combo[j], broadcast=True))
        want = fns.args_of({f.name: factor_arguments(f)}, full, data)[f.name]
        got = fns.args_of({f.name: factor_arguments(f)}, small, data)[f.name]
        ok = jnp.array(True)
        for arg, a in want.items():
            b = got[arg]
            if jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b)) != jnp.shape(a):
                raise ValueError("not broadcast")
            b = jnp.broadcast_to(b, jnp.shape(a))
            if jnp.issubdtype(jnp.result_type(a), jnp.inexact):
                tol = 64 * jnp.finfo(jnp.result_type(a)).eps * (1.0 + jnp.abs(a))
                close = (jnp.abs(a - b) <= tol) | (jnp.isnan(a) & jnp.isnan(b)) | (a == b)
            else:
                close = a == b
            ok = ok & jnp.all(close)
        return ok

    static_false = set()

    # (the point and the states are arguments, not constants: XLA would fold the whole check,
    # K × N × D × D comparisons for a mixture's precisions, at compile time: 17 s for K = 40)
    def check(data, point, combos):
        out = {}
        for f in candidates:
            try:
                out[f.name] = jnp.all(jax.vmap(lambda c, f=f: agrees(f, c, data, point))(combos[f.name]))
            except Exception:  # (a model that cannot run with them, or other shapes: full values)
                static_false.add(f.name)
        return out

    try:
        args = (data, point, combos)
        traced = store_jit(check, "broadcast").trace(*args)
        if not jax.tree.leaves(traced.out_info):
            return set()
        options = compiler_options(data)
        key = program_key("broadcast", program_fingerprint(traced.jaxpr), jax.tree.structure(traced.out_info), options)
        result = compile_program(key, lambda *_: traced.lower(), args, options)(*args)
    except Exception:  # (the check itself failed: full values everywhere)
        return set()
    return {name for name, ok in result.items() if name not in static_false and bool(ok)}


def _param_block(record: SiteRecord) -> Block:
    """The point block of a ``numpyro.param`` site: a Gaussian on the unconstrained space of
    its constraint (``biject_to``), seen by the factors at its mean."""
    try:
        block = choose_family(record, None, unconstrained=True)
    except NotImplementedError as exc:
        raise FamilyError(
            f"numpyro.param has the constraint {record.support}, which has no bijection from "
            "an unconstrained space (numpyro's biject_to); use a constraint such as real, "
            "positive, interval, simplex, or declare the quantity with numpyro.sample",
            site=record.name,
        ) from exc
    return dataclasses.replace(block, point=True, param=True)


def _sweep_order(blocks: dict, factors) -> tuple:
    """The order of the sequential schedule.

    Continuous blocks in model order, then discrete blocks, except that a discrete block
    whose continuous neighbours (through its factors) are all point blocks comes first:
    its update is then the E-step from the points' initial values, so that a model whose
    continuous quantities are params (or ``point`` latents) is classical EM from the user's
    initial values (E-step, then M-steps in model order) rather than starting from the
    random responsibilities discrete blocks are initialised with (right for variational
    Bayes, where the continuous blocks' broad initial posteriors carry no information).
    Param blocks no factor depends on are left out: they keep their initial value.
    """
    neighbours = {n: set() for n in blocks}
    for f in factors:
        for n in f.neighbours:
            neighbours[n].update(f.neighbours)
    first, cont, last = [], [], []
    for n, b in blocks.items():
        if b.param and len(neighbours[n]) == 0:
            continue
        if not b.discrete:
            cont.append(n)
            continue
        others = [blocks[m] for m in neighbours[n] if m != n and not blocks[m].discrete]
        (first if others and all(m.point for m in others) else last).append(n)
    return tuple(first + cont + last)


def _localise(block: Block, record: SiteRecord, subsampled) -> Block:
    """Mark a block inside a subsampled plate as local (its :class:`LocalAxis`)."""
    names = {p.name: p for p in subsampled}
    for plate, axis in zip(record.plates, record.plate_axes()):
        if plate.name in names:
            if block.value_shape[axis] != names[plate.name].subsample_size:
                raise UnsupportedFactorError(
                    f"the latent's axis {axis} should hold the {names[plate.name].subsample_size} "
                    f"minibatch elements of the subsampled plate '{plate.name}' but has size "
                    f"{block.value_shape[axis]}",
                    site=record.name,
                )
            return dataclasses.replace(block, local=LocalAxis(plate.name, axis, plate.size))
    return block


def _check_subsampled(factors, records, blocks, plates) -> list:
    """Record each factor's subsampled plates; a local block may only meet factors inside
    its own plate, element by element."""
    out = []
    for f in factors:
        if f.role == FactorRole.JACOBIAN:
            b = blocks[f.neighbours[0]]
            inside = (b.local.plate,) if b.local is not None else ()
        else:
            inside = tuple(p.name for p in records[f.name].plates if p.name in plates)
        for n in f.neighbours:
            b = blocks[n]
            if b.local is None:
                continue
            if b.local.plate not in inside:
                raise UnsupportedFactorError(
                    f"the factor depends on the local latent '{n}' of the subsampled plate "
                    f"'{b.local.plate}' but is not inside that plate; only factors inside the "
                    "plate may use its latents (move the site into the plate, or drop "
                    "subsample_size)",
                    site=f.name,
                )
            if dict(f.columns).get(n) == "full":
                raise UnsupportedFactorError(
                    f"the factor mixes several elements of the local latent '{n}' of the "
                    f"subsampled plate '{b.local.plate}'; under subsampling each element may "
                    "only use its own latent (drop subsample_size to fit it in full batch)",
                    site=f.name,
                )
        out.append(dataclasses.replace(f, subsampled=inside))
    return out


def _as_point(block: Block, point: bool) -> Block:
    return dataclasses.replace(block, point=True) if point else block


def _transforms(blocks) -> dict:
    """Site → bijection from the block space to the site's support."""
    out = {}
    for n, b in blocks.items():
        for m in b.members or (b,):
            if m.transform is not None:
                out[m.name] = m.transform
    return out


def _transformed(block) -> bool:
    return any(m.transform is not None for m in (block.members or (block,)))


def _site_fill(blocks, site_init, unconstrained=None) -> dict:
    """Per site, a valid value in block space (unconstrained for transformed sites, from
    ``unconstrained`` where it holds the site: the trace computed it)."""
    out = {}
    unconstrained = unconstrained or {}
    for b in blocks.values():
        for m in b.members or (b,):
            x = site_init[m.name]
            if m.transform is None:
                out[m.name] = x
            elif m.name in unconstrained:
                out[m.name] = unconstrained[m.name]
            else:
                out[m.name] = m.transform.inv(x)
    for name, x in site_init.items():
        out.setdefault(name, x)  # a latent left out of the fit (barren_latents): its initial value
    return out


def barren_latents(records, deps, keep=()) -> tuple:
    """The latents that no other site reads, and those read only by such latents (repeated
    until none is left), except ``keep``: barren nodes of the model's graph. Integrating one
    out removes its density, ∫ p(x | θ) dx = 1, and nothing else: the posterior of the other
    latents is the same without it, and x given them is drawn from p(x | θ) (``sample``,
    ``Predictive``). Fitted instead, with a q that cannot follow how p(x | θ) changes with
    θ, such latents act on θ like draws of data: ``obs_mask``'s ``<site>_unobserved``
    (imputed values, and padding at the observed positions) made a Normal's scale 0.66× as
    uncertain as NUTS found it. Left alone when nothing else would remain (a model without
    data fits its prior).

    Args:
        records: site name → :class:`blrppl.graph.trace.SiteRecord` (params excluded).
        deps: site → argument → the latent sites it depends on (:func:`_dependencies`).
        keep: latents never left out (named in ``families=`` or ``point=``).
    """
    latent = [n for n, r in records.items() if not r.observed]
    reads = {n: set().union(*deps[n].values()) - {n} if deps.get(n) else set() for n in records}
    gone: set = set()
    while True:
        read = set().union(*(reads[n] for n in records if n not in gone))
        new = {n for n in latent if n not in gone and n not in read and n not in keep}
        if not new:
            break
        gone |= new
    if not gone or all(n in gone for n in latent):
        return ()
    return tuple(n for n in latent if n in gone)


def _block_init_values(blocks, site_init, unconstrained=None) -> dict:
    """Initial values in block space (unconstrained for transformed Gaussian blocks, the
    members' values concatenated for joint blocks; NumPy arrays stay on the host)."""
    fill = _site_fill(blocks, site_init, unconstrained)
    out = {}
    for n, b in blocks.items():
        if b.members and b.discrete:
            out[n] = fill[b.members[0].name]  # (unused: discrete blocks start from probabilities)
        elif b.members:
            out[n] = b.join({m.name: fill[m.name] for m in b.members})
        else:
            out[n] = fill[n]
    return out


#: discrete latents coupled in a factor are fitted as one categorical over the product of
#: their values when it has at most this many states per element
MAX_JOINT_STATES = 4096


def _coupled_discrete(blocks: dict, factors) -> list:
    """Groups of (global, or in the same plates) discrete blocks that some factor enumerates
    together: their mean-field product q(y) q(z) cannot hold a factor that couples them
    (``z``'s probabilities depending on ``y``), so each group becomes one joint categorical
    block when its elements have the same shape and at most :data:`MAX_JOINT_STATES` states."""
    out = []
    for group in _discrete_groups(blocks, factors):
        parts = [blocks[n] for n in group]
        if len(group) < 2 or any(b.chain for b in parts):
            continue
        shapes = {b.value_shape for b in parts}
        states = math.prod(len(b.support_values) for b in parts)
        if len(shapes) == 1 and states <= MAX_JOINT_STATES and all(b.local is None for b in parts):
            out.append(group)
    return out


def _discrete_groups(blocks: dict, factors) -> list:
    """Groups of discrete blocks that some factor enumerates together (model order; the
    factors may name the sites of a block that holds several)."""
    parent = {n: n for n, b in blocks.items() if b.discrete}
    block_of = {s: n for n, b in blocks.items() if b.discrete for s in b.sites}

    def find(a):
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for f in factors:
        names = [block_of[d] for d in f.discrete if d in block_of]
        for a, b in zip(names, names[1:]):
            parent[find(a)] = find(b)
    groups: dict = {}
    for n in parent:
        groups.setdefault(find(n), []).append(n)
    return [tuple(n for n in blocks if n in g) for g in groups.values()]


def _discrete_chains(blocks: dict, factors, fns, data, rng: np.random.Generator) -> tuple:
    """Blocks with every group of discrete latents read along a chain replaced by one
    :class:`blrppl.families.CategoricalChain` block, and factor → ``((block, Reads),)``.

    A group is probed (:mod:`blrppl.graph.markov`) when it has more than one position. If
    every factor element reads its aligned positions, the enumeration's own assumption
    holds: the group stays as it is, unless it is several sites (one per step of a loop)
    whose joint categorical would be too large and whose factors each read two consecutive
    ones (then it is a chain). Otherwise each element's positions are decoded: pairs with one
    stride make a chain; single positions read out of alignment (a gather by an index
    array) make independent states read through the same map.

    Raises:
        UnsupportedFactorError: a factor reads the group in a pattern no first-order chain
            holds.
    """
    reads_of: dict = {}
    out = dict(blocks)
    for group in _discrete_groups(blocks, factors):
        parts = [blocks[n] for n in group]
        if any(b.members for b in parts):
            continue
        if any(b.local is not None for b in parts):
            # (subsampled plates: their factors' plates are checked instead)
            _warn_if_local_chain(group, parts, factors, fns, data)
            continue
        size = sum(b.size for b in parts)
        if size <= 1:
            continue
        probe = markov.Probe(group, blocks, factors, fns, data, rng)
        if markov.is_aligned(probe):
            states = math.prod(len(b.support_values) for b in parts)
            if len(group) == 1 or states <= MAX_JOINT_STATES or len({b.value_shape for b in parts}) != 1:
                continue
            reads = markov.aligned_chain_reads(parts, probe.touching, lambda f: _factor_batch(fns, f, data))
            layout = markov.chain_layout(reads, size) if reads else None
            if layout is None:
                continue
        else:
            if len({b.support_values for b in parts}) != 1:
                f = next(f for f in probe.touching)
                raise markov.unsupported(f, group, probe.touching)
            reads = markov.probe_reads(probe)
            layout = markov.chain_layout(reads, size)
            if layout is None:
                if any(np.any(r.hi >= 0) for r in reads.values()):
                    f = next(f for f in probe.touching if np.any(reads[f.name].hi >= 0))
                    raise markov.unsupported(f, group, probe.touching)
                layout = markov.ChainLayout(1, size)
        k = len(parts[0].support_values)
        family = fam.CategoricalChain(layout.length, k)
        if len(group) == 1:
            chain = dataclasses.replace(
                parts[0], family=family, kind=family.name, value_shape=(size,), site_shape=parts[0].value_shape
            )
        else:
            name = f"({group[0]}, …, {group[-1]})" if len(group) > 3 else "(" + ", ".join(group) + ")"
            chain = Block(name, family, family.name, (size,), (), parts[0].support_values, members=tuple(parts))
        out = _replace_members(out, group, chain)
        for f in probe.touching:
            reads_of[f.name] = reads_of.get(f.name, ()) + ((chain.name, reads[f.name]),)
    return out, reads_of


def _warn_if_local_chain(group, parts, factors, fns, data) -> None:
    """Warn when discrete latents in a subsampled plate, one site per step, form a chain: they
    are fitted mean-field across steps."""
    if len(parts) < 2 or len({b.value_shape for b in parts}) != 1:
        return
    reads = markov.aligned_chain_reads(parts, factors, lambda f: _factor_batch(fns, f, data))
    if reads and markov.chain_layout(reads, sum(b.size for b in parts)) is not None:
        warnings.warn(
            f"blr_fit: the discrete latents {group[0]} … {group[-1]} form a chain inside a subsampled plate: they are "
            "fitted mean-field across steps (a chain block is not available under subsampling; fit without "
            "subsample_size for the forward-backward posterior)",
            UserWarning,
            stacklevel=2,
        )


def _factor_batch(fns, f, data) -> tuple:
    """A factor's element-wise batch shape (of its log-density at the fill values)."""
    return tuple(jax.eval_shape(lambda d: fns.log_probs((f.name,), {}, d)[f.name][0], data).shape)


def _merge_discrete(blocks: dict, members: tuple) -> dict:
    """Replace the discrete blocks ``members`` by one categorical block over the product of
    their values (states in ``itertools.product`` order of the members' supports)."""
    parts = tuple(blocks[n] for n in members)
    states = math.prod(len(b.support_values) for b in parts)
    joint = Block(
        "(" + ", ".join(members) + ")", fam.Categorical(states), fam.Categorical.name, parts[0].value_shape, (),
        tuple(range(states)), members=parts,
    )
    return _replace_members(blocks, members, joint)


def _replace_members(blocks: dict, members, joint: Block) -> dict:
    """``blocks`` with ``members`` replaced by ``joint``, at the first member's place."""
    out = {}
    for n, b in blocks.items():
        if n == members[0]:
            out[joint.name] = joint
        elif n not in members:
            out[n] = b
    return out


def _scales_of(n: str, members: list, factors: list) -> set:
    """The blocks of ``members`` other than ``n`` that a factor reads as a scale on log space
    (an argument ``exp(z)``: a walk's step size, an observation noise) beside another
    argument that reads block ``n`` (not ``exp(mu + x)``'s level ``mu``: one argument)."""
    out = set()
    for f in factors:
        reads = dict(f.arg_blocks)
        for a, k in f.arg_kinds:
            if k == mom.ExpGaussian.kind and any(n in reads[b] for b, _ in f.arg_kinds if b != a):
                out |= {m for m in reads[a] if m != n and m in members}
    return out


def _plate_coupled(blocks: dict, factors: list) -> list:
    """The Gaussian blocks with independent elements (plate elements, or a diagonal
    family's scalars) that some closed-form factor mixes (its arguments use them through
    ``"full"`` columns, see :class:`blrppl.graph.plan.Factor`)."""
    out = []
    for f in factors:
        for n, columns in f.columns:
            b = blocks[n]
            if columns == "full" and b.family.gaussian and b.batch_shape and n not in out:
                out.append(n)
    return out


def _scalar_columns(f: Factor, chains: dict) -> Factor:
    """The factor with ``"scalar"`` columns for each chain it reads one scalar of per
    element (:class:`blrppl.graph.band.Chain`), when its messages come from its arguments'
    moments (closed form or quadrature): their covariances are then the diagonal of the
    chain's Σ (:meth:`blrppl.families.GaussianBanded.scalar_tangent_sets`)."""
    if f.estimator not in ("exact", "quadrature"):
        return f
    columns = tuple((n, "scalar" if n in chains and f.name in chains[n].scalar_reads else mode) for n, mode in f.columns)
    return f if columns == f.columns else dataclasses.replace(f, columns=columns)


def _banded(block: Block, bandwidth: int) -> Block:
    """A Gaussian block (or joint block) with a banded precision over its scalars in C order
    (each member's part too: the marginal of a stretch of a chain is a chain; a member
    stored time-major, every S-th scalar, exports the covariances of its scalars S·d apart
    for S·d within the band: bandwidth b // S, at least 1)."""
    family = fam.GaussianBanded(block.size, bandwidth)
    head, tail, _, widths = block.time_major_layout() if block.members else ((), (), 0, [])
    stride = {m.name: sum(widths) for m in tail}
    parts = []
    for m in block.members:
        width = max(bandwidth // stride.get(m.name, 1), 1)
        if m.size > width + 1:
            m = dataclasses.replace(m, family=fam.GaussianBanded(m.size, width), kind=family.name)
        parts.append(m)
    return dataclasses.replace(block, family=family, kind=family.name, plate_axes=(), members=tuple(parts))


def _arrowhead(block: Block, globals_: tuple) -> Block:
    """A joint Gaussian block with an arrowhead precision: dense over the positions of
    ``globals_`` ((start, stop) spans), diagonal over the others (its local members: each
    holds its marginal variances, a diagonal family)."""
    family = fam.GaussianArrowhead(block.size, globals_)
    parts, offset = [], 0
    for m in block.members:
        if (offset, offset + m.size) not in globals_:
            m = dataclasses.replace(m, family=fam.GaussianDiag(), kind=fam.GaussianDiag.name)
        parts.append(m)
        offset += m.size
    return dataclasses.replace(block, family=family, kind=family.name, members=tuple(parts))


def _merge_joint(blocks: dict, members: list, interleaved: int = 0) -> dict:
    """Replace the blocks ``members`` by one dense Gaussian over all their scalars (the last
    ``interleaved`` of them stored step by step: :attr:`Block.interleaved`)."""
    parts = tuple(
        Block(n, fam.GaussianDense(blocks[n].size), fam.GaussianDense.name, blocks[n].value_shape, (), None,
              blocks[n].transform, blocks[n].site_shape)
        for n in members
    )
    size = sum(p.size for p in parts)
    joint = Block(
        "(" + ", ".join(members) + ")", fam.GaussianDense(size), fam.GaussianDense.name, (size,), members=parts,
        interleaved=interleaved,
    )
    return _replace_members(blocks, members, joint)


def _time_major(blocks: dict, members: list) -> tuple:
    """``(order, interleaved)`` for a joint block whose members of the most common leading
    length L (at least two of them) are stored step by step after the others
    (:attr:`Block.interleaved`), or ``(None, 0)`` when no two members share a length."""
    lengths: dict = {}
    for n in members:
        shape = blocks[n].value_shape
        if len(shape) >= 1 and shape[0] > 1:
            lengths.setdefault(shape[0], []).append(n)
    shared = [ns for ns in lengths.values() if len(ns) > 1]
    if not shared:
        return None, 0
    tail = max(shared, key=lambda ns: sum(blocks[n].size for n in ns))
    return [n for n in members if n not in tail] + tail, len(tail)


def _dependencies(model, data_spec, data, records, rules, site_init, plate_indices=None, program=None) -> tuple:
    """Per site: the latent sites its rule arguments and its log-density depend on; and the
    items (``"leaf:i"``, ``"value"``) whose elements each enter the log-density of one
    element only (a univariate distribution whose argument has at most its batch shape):
    only these may be quadrature projections (a mixture's component locations, or a
    multivariate distribution's location, couple their elements in one log-density term).
    Also each item's form (:mod:`blrppl.graph.forms`), read off the same jaxpr."""
    fns = ModelFunctions(model, data_spec, site_init, plate_indices=plate_indices, program=program)
    elementwise: dict = {}

    def all_args(values, data):
        sites = fns.sites(tuple(records), values, data)
        out = {}
        for name, site in sites.items():
            rule = rules[name]
            args = fns.rule_args(site, rule.arg_names) if rule is not None else {}
            args["log_prob"] = site["fn"].log_prob(site["value"])
            args["value"] = jnp.asarray(site["value"])
            if not records[name].is_factor:
                # the parameters of a latent's support (its bijection is fixed at compile time)
                # or of observed data's (which must not bound a latent)
                support_leaves = jax.tree.leaves(site["fn"].support)
                args.update({f"support:{i}": jnp.asarray(x) for i, x in enumerate(support_leaves)})
            if not records[name].is_factor:
                base, leaves, tree = distribution_leaves(site)
                # (only the leaves its density reads: not a field kept for sampling)
                read = log_prob_reads(base, leaves, tree, site["value"])
                args.update({f"leaf:{i}": leaf for i, leaf in enumerate(leaves) if i in read})
                items = _elementwise_items(base, leaves)
                loc = _location_leaf(base, leaves)
                if loc is not None and {"value", f"leaf:{loc}"} <= items:
                    # a translation family sees value and location only through their difference
                    args[f"shift:{loc}"] = jnp.asarray(site["value"]) - leaves[loc]
                    items = items | {f"shift:{loc}"}
                elementwise[name] = items
            out[name] = args
        return out

    latent = {r.name: r for r in records.values() if r.name in site_init}
    input_forms = {
        # an enumerated latent's value is an index the enumeration fixes: a constant of each
        # term; params are atoms like latents (their blocks are points)
        n: Const() if n in latent and latent[n].support.is_discrete else Power(n, 1.0)
        for n in site_init
    }
    found, forms, primitives = output_forms(all_args, site_init, input_forms, data)
    return found, forms, elementwise, primitives


#: primitives whose bodies the dependency analysis follows with more than data flow (a
#: ``scan``'s carries, to a fixed point): a program using them has its dependencies checked
#: numerically (the others are followed exactly, or conservatively: every output depends on
#: every input)
AUDITED_PRIMITIVES = frozenset({"scan"})


def _audit_dependencies(model, data_spec, data, records, deps, site_init, plate_indices, rng_key, program=None) -> None:
    """The dependencies read off the model's program, checked numerically: the derivative of
    every site's log-density along a random direction of every continuous latent, at a
    random point near the starting point (one compiled call). A latent a log-density
    depends on that the structural analysis missed would otherwise be left at its prior,
    silently.

    Raises:
        UnsupportedFactorError: a site's log-density depends on a latent its dependencies
            do not list (naming both: a construct the analysis does not follow).
    """
    latent = [r for r in records.values() if not r.observed and not r.support.is_discrete]
    if not latent:
        return
    rng = np.random.default_rng(np.asarray(jax.random.key_data(rng_key)).ravel())
    # the random point is built inside the one compiled call (op by op, every operation of
    # the bijections would compile a program of its own)
    noise = {r.name: 0.1 * rng.normal(size=np.shape(r.unconstrained_init if r.unconstrained_init is not None
                                                    else biject_to(r.support).inv(jnp.asarray(site_init[r.name]))))
             for r in latent}
    tangents = {r.name: rng.normal(size=np.shape(site_init[r.name])) for r in latent}
    fns = ModelFunctions(model, data_spec, site_init, plate_indices=plate_indices, program=program)
    names = tuple(n for n in records if n in deps)

    def log_probs(values, data):
        out = fns.log_probs(names, values, data)
        return {n: jnp.sum(lp if sc is None else sc * lp) for n, (lp, sc) in out.items()}

    # one batched JVP: direction k moves latent k only
    order = [r.name for r in latent]
    stacked = {
        n: np.stack([tangents[n] if m == n else np.zeros_like(tangents[n]) for m in order]) for n in order
    }

    def random_point():
        fill = {}
        for r in latent:
            t = biject_to(r.support)
            fill[r.name] = t(t.inv(jnp.asarray(site_init[r.name])) + noise[r.name])
        return fill

    def derivatives(data):
        fill = random_point()

        def along(t):
            return jax.jvp(lambda x: log_probs(x, data), (fill,), (t,))

        return jax.vmap(along)(stacked)

    def reverse_derivatives(data):
        # (the same slopes from reverse mode, one pass per site: a function with a custom
        # reverse-mode rule only, jax.custom_vjp, has no forward mode)
        values, pullback = jax.vjp(lambda x: log_probs(x, data), random_point())
        grads = jax.vmap(lambda c: pullback(c)[0])(
            {n: jnp.eye(len(names), dtype=jnp.result_type(v))[i] for i, (n, v) in enumerate(values.items())}
        )
        slopes = {
            n: jnp.stack([jnp.vdot(grads[m][i], jnp.asarray(tangents[m], grads[m].dtype)) for m in order])
            for i, n in enumerate(values)
        }
        return {n: jnp.broadcast_to(v, (len(order),)) for n, v in values.items()}, slopes

    # (a program of its own, stored like the fit's: keyed by its traced program, whose
    # fingerprint holds the random point and directions, and its outputs' site names)
    traced = store_jit(reverse_derivatives if reverse_only() else derivatives, "audit").trace(data)
    options = compiler_options(data)
    key = program_key("audit", program_fingerprint(traced.jaxpr), jax.tree.structure(traced.out_info), options)
    values, slopes = compile_program(key, lambda *_: traced.lower(), (data,), options)(data)
    values, slopes = jax.tree.map(np.asarray, (values, slopes))  # (indexed on the host)
    for k, latent_name in enumerate(order):
        for site in names:
            slope, value = float(slopes[site][k]), float(values[site][k])
            if not (np.isfinite(slope) and np.isfinite(value)):
                continue
            listed = set().union(*deps[site].values()) if deps[site] else set()
            if latent_name not in listed and latent_name != site and abs(slope) > 1e-8 * (1.0 + abs(value)):
                raise UnsupportedFactorError(
                    f"the log-density of this site depends on the latent '{latent_name}' (its derivative "
                    f"along it is {slope:.3g}) but the analysis of the model's program found no "
                    "such dependence: a construct blr_fit does not follow; please report the model",
                    site=site,
                )


def _check_static_supports(records, deps) -> None:
    """A latent's support may depend on the data but not on other latents: its bijection to
    an unconstrained space (and its family) is chosen once, at compile time.

    Observed data may not bound a continuous latent either (``y ~ Uniform(0, b)``).

    Raises:
        UnsupportedLatentError: e.g. ``x ~ Uniform(0, b)`` with ``b`` latent.
        UnsupportedFactorError: e.g. observed ``y ~ Uniform(0, b)`` with ``b`` latent.
    """
    for name, args in deps.items():
        others = sorted(set().union(*(d for k, d in args.items() if k.startswith("support:"))) - {name})
        if records[name].observed:
            # (a continuous latent bounding observed data, y ~ Uniform(0, b): numpyro's
            # log_prob ignores the support, so the bound would be fitted as if unconstrained)
            bounds = [o for o in others if o in records and not records[o].support.is_discrete]
            if bounds and not records[name].is_factor:
                listed = ", ".join(f"'{o}'" for o in bounds)
                raise UnsupportedFactorError(
                    f"the support of observed site '{name}' ({records[name].dist_name}) depends on the "
                    f"latent(s) {listed}: the data bound them (e.g. b >= max(y) for y ~ Uniform(0, b)), a "
                    "constraint numpyro's log_prob does not score and blr_fit cannot fit; reparameterise, "
                    "e.g. b = numpyro.deterministic('b', y.max() + d) with d ~ a positive prior",
                    site=name,
                )
            continue
        if others:
            listed = ", ".join(f"'{o}'" for o in others)
            raise UnsupportedLatentError(
                f"the support of latent '{name}' ({records[name].dist_name}) depends on the "
                f"latent(s) {listed}; blr_fit fixes each latent's support when it compiles the "
                "model: reparameterise, e.g. for x ~ Uniform(0, b) sample u ~ Uniform(0, 1) and "
                "take x = numpyro.deterministic(name, b * u)",
                site=name,
            )


#: distributions whose density depends on value and ``loc`` only through value − loc
TRANSLATION_FAMILIES = (
    dist.Normal, dist.StudentT, dist.Laplace, dist.Cauchy, dist.Logistic, dist.Gumbel, dist.SoftLaplace,
)


def _location_leaf(base, leaves) -> int | None:
    """The leaf index of a translation family's ``loc`` (None for other distributions)."""
    if type(base) not in TRANSLATION_FAMILIES:
        return None
    loc = getattr(base, "loc", None)
    return next((i for i, leaf in enumerate(leaves) if leaf is loc), None)


def _elementwise_items(base, leaves) -> frozenset:
    """The leaves (and the value) of a distribution whose elements are per-element
    parameters: the distribution is univariate and the leaf broadcasts to its batch shape."""
    if tuple(base.event_shape):
        return frozenset()
    batch = tuple(base.batch_shape)
    out = {"value"}
    for i, leaf in enumerate(leaves):
        shape = tuple(np.shape(leaf))
        try:
            if np.broadcast_shapes(shape, batch) == batch:
                out.add(f"leaf:{i}")
        except ValueError:
            pass
    return frozenset(out)


def _jacobian_factor(block: Block) -> Factor:
    """The log|det J| term of a Gaussian block on an unconstrained space."""
    transforms = [m.transform for m in (block.members or (block,)) if m.transform is not None]
    elementwise = all(elementwise_bijection(t) is not None for t in transforms)
    return Factor(
        name=f"{block.name}:jacobian",
        dist_name="log|det J| (" + ", ".join(sorted({type(t).__name__ for t in transforms})) + ")",
        observed=False,
        neighbours=(block.name,),
        discrete=(),
        estimator="quadrature" if elementwise else "monte_carlo",
        rule=None,
        arg_kinds=(),
        arg_blocks=(),
        columns=(),
        reinterpreted_ndim=0,
        role=FactorRole.JACOBIAN,
    )


def _classify_factors(
    records, rules, deps, blocks, fns, data, rng_key, *, quadrature=True, cache=None, guess=None, elementwise=None,
    forms=None, provisional=False, site_reads=None,
):
    """Classify every factor's arguments and choose its estimator.

    Args:
        records, rules, deps, blocks, fns, data: the model, its blocks and its data.
        rng_key: key of the probe points.
        quadrature: probe the quadrature projections of the factors without a closed form
            (``False`` while the family policy iterates: only exactness is needed there, and
            such factors get a provisional ``"monte_carlo"`` estimator).
        cache: ``(key function, dict)``: argument classes found earlier, under the key the
            function gives a (factor, argument); a cached argument is not probed again.
        guess: factor → whether it was exact before (e.g. before a joint merge): the
            quadrature probes of the others run in the same compiled call as the argument
            probes; any factor the guess got wrong is probed in a second call.
        elementwise: site → the items that may be quadrature projections (see
            :func:`_dependencies`).
        forms: site → item → form (:mod:`blrppl.graph.forms`): an argument whose form
            decides its class is not probed (:func:`blrppl.expressions.classify_form`), and
            the form names what makes the others opaque.
        provisional: the blocks may still change (the family policy iterates, chains are
            not found yet): an argument mixing the elements of a large plated block stays
            affine (:func:`blrppl.expressions.too_many_columns` decides on the final blocks).
    """
    elementwise = elementwise or {}
    rng = np.random.default_rng(np.asarray(jax.random.key_data(rng_key)).ravel())
    key_of, known = cache if cache is not None else (None, {})
    site_blocks = _site_blocks(blocks)
    probes, nbrs, keys, decided, reasons = {}, {}, {}, {}, {}
    for name, r in records.items():
        rule = rules[name]
        neighbours = tuple(n for n in blocks if any(n in d for d in deps[name].values()))
        discrete = tuple(n for n in neighbours if blocks[n].discrete)
        for d in discrete:
            # (elsewhere the chain probe finds what each element reads: blrppl.graph.markov)
            if blocks[d].local is not None:
                for site in blocks[d].sites:
                    _check_aligned(r, records[site], name)
        nbrs[name] = (neighbours, discrete)
        if rule is None:
            continue
        for arg in ("value",) + rule.arg_names:
            keys[(name, arg)] = key_of(name, arg) if key_of is not None else None
            if keys[(name, arg)] in known:
                continue
            if forms is not None:
                cls, reasons[(name, arg)] = classify_form(
                    forms[name][arg], deps[name][arg], blocks, site_blocks, value_moments=True
                )
                if cls is not None and not cls.gather:
                    decided[(name, arg)] = cls
                    continue

            def fn(values, data, arg=arg, name=name, rule=rule):
                return fns.factor_args(name, rule.arg_names, values, data)[arg]

            if forms is not None and cls is not None:
                probes[(name, arg)] = gather_probe(fn, cls, blocks, rng)
            else:
                probes[(name, arg)] = probe_argument(fn, deps[name][arg], blocks, rng)
    candidates, quad_probes = {}, {}
    if quadrature and guess is not None:
        not_exact = {n for n in records if not guess.get(n, False)}
        candidates, quad_probes = _quadrature_probes(
            records, deps, blocks, fns, rng, nbrs, not_exact, elementwise, forms, site_blocks
        )
    quad_probes, quad_decided = _split_decided(quad_probes)
    found = run_probes({**probes, **{("quadrature",) + k: p for k, p in quad_probes.items()}}, data)
    found = {
        # an opaque argument's form names what makes it so
        k: dataclasses.replace(c, reason=reasons[k]) if c.opaque and reasons.get(k) else c
        for k, c in found.items()
    }
    found.update(decided)
    classes = {k: (known[keys[k]] if k not in found else found[k]) for k in keys}
    if key_of is not None:
        known.update({keys[k]: found[k] for k in list(probes) + list(decided)})
    classes = _paired(records, rules, classes, blocks, fns, nbrs, data, rng)
    classes = _independent_scales(records, rules, classes)
    classes = _own_uniform_priors(records, rules, classes, site_blocks)
    if not provisional:
        classes = {k: too_many_columns(c, blocks) if c.kind in _GAUSSIAN_KINDS else c for k, c in classes.items()}
    quad_classes = {k[1:]: v for k, v in found.items() if len(k) == 4}  # ("quadrature", name, index, link)
    quad_classes.update(quad_decided)

    exact = {}
    for name in records:
        rule = rules[name]
        if rule is None:
            exact[name] = None
            continue
        kinds = {arg: classes[(name, arg)].kind for arg in ("value",) + rule.arg_names}
        exact[name] = rule.supports(kinds)
    if quadrature:
        probed = {n for n in records if not guess.get(n, False)} if guess is not None else set()
        missing = {n for n in records if not exact[n]} - probed
        more, more_probes = _quadrature_probes(
            records, deps, blocks, fns, rng, nbrs, missing, elementwise, forms, site_blocks
        )
        more_probes, more_decided = _split_decided(more_probes)
        quad_classes.update(more_decided)
        if more_probes:
            quad_classes.update(run_probes(more_probes, data))
        candidates.update(more)
    return _factors(records, rules, blocks, nbrs, classes, exact, candidates, quad_classes, quadrature, site_reads)


_GAUSSIAN_KINDS = (mom.AffineGaussian.kind, mom.ExpGaussian.kind)


def _site_blocks(blocks: dict) -> dict:
    """site → (its block's name, the block of the site itself: the member of a joint block,
    else the block)."""
    return {
        s: (n, m) for n, b in blocks.items() for s, m in (((m.name, m) for m in b.members) if b.members else ((x, b) for x in b.sites))
    }


def _with_value_moments(blocks: dict, forms, deps) -> dict:
    """``blocks`` with :attr:`Block.value_moments` set on the Gaussians on an interval's
    logit space (:func:`blrppl.graph.forms.interval_gaussian`) that some argument
    multiplies with another latent (a persistence in ``phi * (x_prev - mu)``): the closed
    form of that argument's factor sees φ through its moments under q, and the product
    keeps φ apart (variational message passing). Not where some argument reads the block in
    closed form on its logit space (``logits=logit(p)``): those moments are of u, not of φ.
    (An affine read alone, ``a + b * x`` with a bounded b, keeps the joint Gaussian with
    the other coefficients, whose correlations mean-field would lose.)"""
    if forms is None:
        return blocks
    site_blocks = _site_blocks(blocks)
    eligible = {b.name for b in blocks.values() if fm.interval_gaussian(b)}
    gains, conflicts = set(), set()
    for name, items in forms.items():
        for item, form in items.items():
            reads = {site_blocks[x][0] for x in fm.sites_of(form) if x in site_blocks} & eligible
            if not reads:
                continue
            cls, _ = classify_form(form, deps[name][item], blocks, site_blocks)
            bil = fm.as_bilinear(form)
            if cls is not None and not cls.opaque:
                conflicts |= reads
            elif bil is not None:
                gains |= {site_blocks[x][0] for x in bil.left | bil.right if x in site_blocks} & eligible
    flagged = gains - conflicts
    return {n: dataclasses.replace(b, value_moments=n in flagged) if b.value_moments != (n in flagged) else b for n, b in blocks.items()}


def _own_uniform_priors(records, rules, classes, site_blocks) -> dict:
    """``classes`` with the value of a latent's own ``Uniform`` prior with constant bounds
    read as a constant: its density is constant on the support, inside which the site's
    bijection keeps q (:mod:`blrppl.rules.uniform`), so its expectation needs no moments."""
    out = dict(classes)
    for name, r in records.items():
        rule = rules[name]
        if rule is None or rule.dist_type is not dist.Uniform or r.observed or name not in site_blocks:
            continue
        if all(classes[(name, a)].kind == mom.Const.kind for a in rule.arg_names):
            out[(name, "value")] = ArgumentClass(mom.Const.kind, ())
    return out


def _independent_scales(records, rules, classes) -> dict:
    """``classes`` with every log-normal argument (``exp_gaussian``) that shares a Gaussian
    block with another argument of its factor made opaque: the rules factor E[σ⁻² (x − loc)²]
    as E[σ⁻²] E[(x − loc)²], true only when σ is independent of x and loc under q (a joint
    block holding log σ and x correlates them: the factor is then integrated jointly)."""
    out = dict(classes)
    for name in records:
        rule = rules[name]
        if rule is None:
            continue
        args = ("value",) + rule.arg_names
        for arg in args:
            cls = classes[(name, arg)]
            if cls.kind != mom.ExpGaussian.kind:
                continue
            others = set().union(*(classes[(name, a)].blocks for a in args if a != arg))
            shared = sorted(others & set(cls.blocks))
            if shared:
                reason = f"{arg} on log space shares the block '{shared[0]}' with the other arguments"
                out[(name, arg)] = ArgumentClass("opaque", cls.blocks, reason=reason)
    return out


def _paired(records, rules, classes, blocks, fns, nbrs, data, rng) -> dict:
    """``classes`` with the plated Gaussian blocks that a factor's arguments read at
    different elements (each argument "gather") added to those arguments' ``full`` blocks:
    the factor couples those elements (:func:`blrppl.expressions.pairing_probe`)."""
    probes, shared_of = {}, {}
    for name in records:
        rule = rules[name]
        if rule is None or rule.event_ndim:
            continue
        shared = {}
        for arg in ("value",) + rule.arg_names:
            cls = classes[(name, arg)]
            if cls.kind not in _GAUSSIAN_KINDS:
                continue
            for n in cls.blocks:
                b = blocks[n]
                if b.family.gaussian and n not in cls.full and needs_gather_test(b, not b.family.dense_event):
                    shared.setdefault(n, []).append(arg)
        shared = {n: args for n, args in shared.items() if len(args) > 1}
        if not shared:
            continue

        def fn(values, data, name=name, rule=rule):
            return fns.factor_args(name, rule.arg_names, values, data)

        point = {m: random_point(blocks[m], rng) for m in nbrs[name][0]}
        probes[("pairing", name)] = pairing_probe(fn, shared, point, blocks, rng)
        shared_of[name] = shared
    if not probes:
        return classes
    out = dict(classes)
    for (_, name), coupled in run_probes(probes, data).items():
        for n in coupled:
            for arg in shared_of[name][n]:
                cls = out[(name, arg)]
                out[(name, arg)] = dataclasses.replace(cls, full=tuple(sorted(set(cls.full) | {n})))
    return out


def _split_decided(probes: dict) -> tuple:
    """``(probes to run, classes the forms decided)`` of a dict holding both."""
    decided = {k: p for k, p in probes.items() if isinstance(p, ArgumentClass)}
    return {k: p for k, p in probes.items() if k not in decided}, decided


def _quadrature_probes(records, deps, blocks, fns, rng, nbrs, names, elementwise, forms=None, site_blocks=None) -> tuple:
    """Quadrature candidates among ``names`` (no closed form, continuous neighbours all
    Gaussian, a few distribution leaves or the value depending on them) and the probes of
    each candidate projection under each link (:class:`ArgumentClass` es in place of the
    probes where the item's form decides the class)."""
    candidates, probes = {}, {}
    for name, r in records.items():
        neighbours, discrete = nbrs[name]
        cont = [n for n in neighbours if not blocks[n].discrete]
        if (
            name not in names
            or r.is_factor
            or not cont
            or any(not blocks[n].family.gaussian for n in cont)
            or all(blocks[n].point for n in cont)
        ):
            continue
        items = [k for k in deps[name] if k.startswith("leaf:") and deps[name][k] & set(cont)]
        if deps[name]["value"] & set(cont):
            items.append("value")
        shift = next((k for k in deps[name] if k.startswith("shift:")), None)
        if shift is not None and "value" in items and "leaf:" + shift.split(":")[1] in items:
            # value − loc of a translation family: one projection instead of two
            items = [k for k in items if k not in ("value", "leaf:" + shift.split(":")[1])] + [shift]
        if not 1 <= len(items) <= MAX_PROJECTIONS or not set(items) <= elementwise.get(name, frozenset()):
            continue
        candidates[name] = items
        for item in items:
            index = item if item == "value" or item.startswith("shift:") else int(item.split(":")[1])
            for link in LINKS if not item.startswith("shift:") else ("identity",):
                if forms is not None:
                    cls, _ = classify_form(inverse_link(forms[name][item], link), deps[name][item], blocks, site_blocks)
                    if cls is not None:
                        probes[(name, index, link)] = cls
                        continue
                extract = projection_args((("eta", index, link),))

                def fn(values, data, name=name, extract=extract):
                    return fns.args_of({name: extract}, values, data)[name]["eta"]

                probes[(name, index, link)] = probe_argument(fn, deps[name][item], blocks, rng)
    return candidates, probes


def _grid_positions(blocks, cont, reads) -> dict:
    """For each joint dense Gaussian block of ``cont`` (unplated) of which the factor reads
    some members only (``reads``: the latent sites it reads), the block positions of the
    scalars of those members: the grid rule integrates over their marginal (a capture-
    recapture model's survival factor reads the survival probabilities of a joint block that
    also holds the recapture probability: 20² nodes, not 10³)."""
    from blrppl.families.gaussian import GaussianDense

    if reads is None:
        return {}
    out = {}
    for n in cont:
        b = blocks[n]
        if not b.members or b.batch_shape or not isinstance(b.family, GaussianDense):
            continue
        read = [pos for m, pos in zip(b.members, b.member_positions()) if m.name in reads]
        if read and len(read) < len(b.members):
            out[n] = tuple(int(i) for i in np.sort(np.concatenate(read)))
    return out


def _on_grid(blocks, cont, record: SiteRecord, positions=None) -> bool:
    """Whether a factor's continuous neighbours ``cont`` are Gaussian blocks of at most
    :data:`GRID_MAX_DIM` scalars in all (neither points nor minibatch-local; of a joint block,
    the scalars the factor reads, ``positions``), and the cost of the rule's evaluations at
    most :data:`GRID_MAX_EVALUATIONS`."""
    if not cont or not all(blocks[n].family.gaussian and not blocks[n].point and blocks[n].local is None for n in cont):
        return False
    positions = positions or {}
    d = sum(len(positions[n]) if n in positions else blocks[n].size for n in cont)
    if d > GRID_MAX_DIM:
        return False
    shape = tuple(record.value_shape)
    split = len(shape) - record.event_ndim
    cost = math.prod(shape[:split]) * math.prod(shape[split:]) ** 2
    return GRID_NODES[d] ** d * cost <= GRID_MAX_EVALUATIONS


def _factors(
    records, rules, blocks, nbrs, classes, exact, candidates, quad_classes, quadrature, site_reads=None,
) -> list:
    """The :class:`Factor` s from the argument classes and the quadrature projections
    (``site_reads``: the latent sites each factor reads, where blocks hold several)."""
    factors, site_reads = [], site_reads or {}
    for name, r in records.items():
        grid_positions = {}
        rule = rules[name]
        neighbours, discrete = nbrs[name]
        cont = [n for n in neighbours if n not in discrete]
        gauss = [n for n in neighbours if blocks[n].family.gaussian]
        pairs = []
        if exact[name]:
            kinds, arg_blocks, full = [], [], set()
            powers = []
            for arg in ("value",) + rule.arg_names:
                cls = classes[(name, arg)]
                kinds.append((arg, cls.kind))
                arg_blocks.append((arg, cls.blocks))
                full.update(cls.full)
                if cls.kind == mom.PowerGamma.kind:
                    powers.append((arg, cls.power))
                if cls.kind == mom.BilinearGaussian.kind:
                    pairs.append((arg, cls.pairs))
            columns = tuple((n, "full" if n in full else "gather") for n in gauss)
            estimator, links = "exact", ()
        elif all(blocks[n].point for n in neighbours if n not in discrete):
            # no closed form, but every continuous neighbour (if any) is a point block: log f at the
            # points (enumerated over the discrete neighbours) is exact
            estimator, links, columns, powers, rule = "delta", (), (), [], None
            kinds, arg_blocks = [("log_prob", "delta")], []
        else:
            links, kinds, arg_blocks, full, powers = [], [], [], set(), []
            for k, item in enumerate(candidates.get(name, ()) if quadrature else ()):
                index = item if item == "value" or item.startswith("shift:") else int(item.split(":")[1])
                found = next(
                    (
                        link for link in LINKS
                        if (name, index, link) in quad_classes
                        and quad_classes[(name, index, link)].kind == mom.AffineGaussian.kind
                    ),
                    None,
                )
                if found is None:
                    links = None
                    break
                cls = quad_classes[(name, index, found)]
                links.append((f"eta{k}", index, found))
                kinds.append((f"eta{k}", mom.AffineGaussian.kind))
                arg_blocks.append((f"eta{k}", cls.blocks))
                full.update(cls.full)
            grid_positions = _grid_positions(blocks, cont, site_reads.get(name))
            if links:
                estimator = "quadrature"
                columns = tuple((n, "full" if n in full else "gather") for n in gauss)
            elif quadrature and _on_grid(blocks, cont, r, grid_positions):
                # (a few scalars in all: the rule over them is cheap, and deterministic)
                estimator, links, columns = "quadrature", (), ()
                kinds, arg_blocks = [("log_prob", "quadrature")], []
            else:
                estimator, links, columns = "monte_carlo", (), ()
                kinds, arg_blocks = [("log_prob", "monte_carlo")], []
            why = _why_not_exact(name, r, rule, classes)
            rule = None
        if estimator in ("exact", "delta"):
            why = ""
        factors.append(
            Factor(
                name=name,
                dist_name=r.dist_name,
                observed=r.observed,
                neighbours=neighbours,
                discrete=discrete,
                estimator=estimator,
                rule=rule,
                arg_kinds=tuple(kinds),
                arg_blocks=tuple(arg_blocks),
                columns=columns,
                reinterpreted_ndim=r.reinterpreted_ndim,
                links=tuple(links),
                powers=tuple(powers),
                pairs=tuple(pairs),
                why=why,
                grid_positions=tuple(sorted(grid_positions.items())) if estimator == "quadrature" and not links else (),
            )
        )
    return factors


def _with_spread(f, records, rules, site_deps):
    """``f`` with its ``spread``: for a latent's prior, ``(argument, sites)`` of each of its
    :data:`SPREAD_ARGS` that reads other latent sites (``site_deps``: per site and argument,
    the latent sites it depends on)."""
    rule = rules.get(f.name)
    if f.role != FactorRole.SITE or f.observed or rule is None:
        return f
    spread = tuple(
        (arg, tuple(n for n in records if n in site_deps[f.name].get(arg, ()) and n != f.name))
        for arg in rule.arg_names if arg in SPREAD_ARGS
    )
    return dataclasses.replace(f, spread=tuple((arg, sites) for arg, sites in spread if sites))


def _why_not_exact(name, record, rule, classes) -> str:
    """Why a factor has no closed form: the first argument whose form no rule reads (and what
    the form is), or that the site has no rule."""
    if rule is None:
        return "a numpyro.factor term" if record.is_factor else f"no closed-form rule for {record.dist_name}"
    for arg in ("value",) + rule.arg_names:
        cls = classes[(name, arg)]
        if cls.opaque:
            return f"{arg}: {cls.reason}" if cls.reason else f"{arg}: opaque"
    kinds = ", ".join(f"{arg}:{classes[(name, arg)].kind}" for arg in ("value",) + rule.arg_names)
    return f"the rule has no closed form for {kinds}"


def conjugate_blocks(plan) -> tuple:
    """``(block, conjugate)`` for every block: its factors' messages do not depend on its own
    q, so that ρ = 1 is an exact coordinate step.

    Read off the plan, not measured: a discrete block is conjugate (its enumerated message
    is E[log f | value]); a continuous block is when every factor touching it is
    (:func:`factor_conjugate`).
    """
    out = []
    for b in plan.blocks:
        if b.discrete:
            out.append((b.name, True))
            continue
        conj = not b.point and all(factor_conjugate(f, b) for f in plan.factors_of(b.name))
        out.append((b.name, conj))
    return tuple(out)


def factor_conjugate(f, b) -> bool:
    """Whether the message of factor ``f`` to the continuous block ``b`` does not depend on
    q(b): ``f`` has a closed form (``exact``) and, for a Gamma block, each power c·τ^a of it
    in an argument is one of the rule's ``conjugate_powers``. (Closed-form rules see a
    Gaussian block only through affine arguments of Normal-type densities, whose
    expectations are quadratic in it, and Beta/Dirichlet blocks only as the probabilities
    of Bernoulli, Binomial and Categorical observations or as the value of their own prior:
    every such expectation is linear in the block's expectation parameters.)"""
    if f.estimator != "exact" or b.value_moments or (b.batch_shape and (b.name, "full") in f.columns):
        # (a factor mixing independent elements of the block: its message to one element
        # depends on the others' q, mean-field coordinate steps iterate)
        return False
    blocks_of = dict(f.arg_blocks)
    if any(k == mom.ExpGaussian.kind and b.name in blocks_of.get(a, ()) for a, k in f.arg_kinds):
        return False  # (a log-normal scale: E[σ⁻²] = exp(−2m + 2v) is not linear in μ)
    # the powers c·τ^a of the factor's arguments: each reads one Gamma block
    for arg, power in f.powers:
        if b.name not in blocks_of.get(arg, ()):
            continue
        allowed = f.rule.conjugate_powers.get(arg, ()) if f.rule is not None else ()
        if power is None or not any(np.isclose(power, a) for a in allowed):
            return False
    return True


def _check_aligned(factor: SiteRecord, discrete: SiteRecord, name: str):
    """A discrete block can be enumerated for a factor when each element of the factor uses
    the aligned element of the block: the block's plates are among the factor's."""
    fplates = {p.name for p in factor.plates}
    missing = [p.name for p in discrete.plates if p.name not in fplates]
    batch = factor.value_shape[: len(factor.value_shape) - factor.event_ndim]
    try:
        np.broadcast_shapes(tuple(discrete.value_shape), tuple(batch))
        broadcastable = len(discrete.value_shape) <= len(batch) or not discrete.value_shape
    except ValueError:
        broadcastable = False
    if missing or not broadcastable:
        raise UnsupportedFactorError(
            f"factor depends on the discrete latent '{discrete.name}' across its plate(s) "
            f"{missing or [p.name for p in discrete.plates]}; enumeration needs the factor inside "
            "every plate of the discrete latent, using one element of it per element",
            site=name,
        )


def reverse_only_error(model, data_spec, data, records) -> UnsupportedFactorError:
    """The error for a model whose log-density calls a ``jax.custom_vjp`` function on a path
    from a continuous latent that reverse-only mode (:mod:`blrppl.graph.derivatives`) could not
    differentiate twice either, naming the sites whose log-densities call it (each site's
    density differentiated forward along every continuous latent at its starting point,
    traced only)."""
    latent = [r for r in records.values() if not r.observed and not r.support.is_discrete and not r.is_param]
    site_init = {r.name: np.asarray(r.init_value) for r in records.values() if not r.observed}
    fns = ModelFunctions(model, data_spec, site_init)
    point = {r.name: jnp.asarray(site_init[r.name]) for r in latent}
    sites = []
    for name in records:

        def log_prob(values, data, name=name):
            lp, scale = fns.log_probs((name,), values, data)[name]
            return jnp.sum(lp if scale is None else scale * lp)

        # (batched over directions, as the fit's derivatives are: JAX defers a lone JVP of a
        # custom_vjp function to its evaluation, but refuses to batch it)
        try:
            jax.eval_shape(lambda d, t: jax.vmap(lambda t: jax.jvp(lambda x: log_prob(x, d), (point,), (t,)))(t),
                           data, jax.tree.map(lambda x: x[None], point))
        except Exception as exc:  # (another failure is not this error's to name)
            if is_reverse_only_error(exc):
                sites.append(name)
    listed = ", ".join(repr(s) for s in sites) if sites else "some site"
    return UnsupportedFactorError(
        f"the log-density of {listed} calls a function with a custom reverse-mode derivative only "
        "(jax.custom_vjp; jax.experimental.ode.odeint is one), and blr_fit could not differentiate it twice: "
        "not forward over reverse (JAX has no forward mode of such a function), nor reverse over reverse (e.g. "
        "a lax.while_loop in its backward pass). Compute it with operations JAX differentiates twice, e.g. an "
        "ODE solved by a fixed-step Runge-Kutta scheme in lax.scan, or fit this model with NUTS, which needs "
        "first derivatives only",
        site=sites[0] if sites else None,
    )
