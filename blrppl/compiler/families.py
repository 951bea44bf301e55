"""The blocks' families: a latent's candidate family and the family policy's fixed point."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.distributions import biject_to, constraints

from blrppl import families as fam
from blrppl.estimators.registry import estimator_of
from blrppl.errors import FamilyError, UnsupportedFactorError, UnsupportedLatentError
from blrppl.model.classes import classify_form
from blrppl.model import forms as fm
from blrppl.graph.plan import Block, LocalAxis
from blrppl.model.records import SiteRecord, finite_support_values
from blrppl.compiler.stages import CompileOptions, Dependencies, FamilyChoice, SiteInputs
from blrppl.compiler.blocks import block_init_values, blocks_by_site, discrete_chains, site_fill, site_transforms
from blrppl.compiler.classify import classify_factors


def choose_families(inputs: SiteInputs, found: Dependencies, options: CompileOptions) -> FamilyChoice:
    """The blocks' families: the family policy iterated to its fixed point with the factors'
    provisional estimators, then the discrete latents read along a chain made chain blocks.

    Family policy ("auto"): every latent starts in the native family of its support; a factor
    whose expected log-density has no closed form for its arguments gets the quadrature or
    Monte Carlo estimator, and every non-Gaussian continuous latent it touches is moved to a
    Gaussian on its unconstrained space (then the other factors of that latent are classified
    again), until nothing changes. A Gamma latent is also moved when a closed-form factor is
    not conjugate to it (e.g. a Normal scale σ = τ, which needs E[τ^−2], finite only for
    shapes above 2, where the Gamma family can wander while fitting). A latent whose family
    the user chose keeps it, and its factors without closed forms use Monte Carlo messages.
    ``numpyro.param`` sites become point blocks (:func:`_param_block`).
    """
    deps = found.deps
    param_blocks = {r.name: _param_block(r) for r in inputs.latent if r.is_param}
    moved: set = set()
    on_support: set = set()
    # an argument's class depends on the blocks it depends on: while the policy iterates,
    # those are known again unless one of them was moved (quadrature projections wait for
    # the final blocks)
    cache = (
        lambda name, arg: (name, arg, tuple(sorted((n, n in moved, n in on_support) for n in deps[name][arg]))), {}
    )
    while True:
        blocks = {
            r.name: param_blocks[r.name] if r.is_param else _latent_block(r, moved, options) for r in inputs.latent
        }
        blocks = _with_value_moments(blocks, found.forms, deps)
        on_support = {n for n, b in blocks.items() if b.value_moments}
        init_values = block_init_values(blocks, inputs.site_init, inputs.unconstrained)
        fns = inputs.functions(site_fill(blocks, inputs.site_init, inputs.unconstrained), site_transforms(blocks))
        factors = classify_factors(
            inputs.records, inputs.rules, deps, blocks, quadrature=False, cache=cache, forms=found.forms,
            program=found.program, provisional=True,
        )
        to_move = _to_move(factors, blocks, options.families)
        if not to_move - moved:
            break
        moved |= to_move
    # discrete latents read along a chain (a hidden Markov model) become one chain block
    blocks, chain_reads = discrete_chains(blocks, factors, fns, inputs.data, found.program)
    return FamilyChoice(blocks, factors, fns, init_values, on_support, cache, chain_reads)


def _latent_block(record: SiteRecord, moved: set, options: CompileOptions) -> Block:
    """The block of a latent sample site: its family (on the unconstrained space once
    ``moved``, or as a point), local when it is inside a subsampled plate."""
    point = record.name in options.point
    block = choose_family(record, options.families.get(record.name), record.name in moved or point)
    return _localise(_as_point(block, point), record, options.subsampled)


def _to_move(factors, blocks: dict, families: dict) -> set:
    """The latents the family policy moves to a Gaussian on their unconstrained space: the
    non-Gaussian continuous neighbours of factors without closed form, and Gamma blocks
    that a closed-form factor reads in a power it is not conjugate to (except the latents
    whose family the user chose)."""
    to_move = set()
    for f in factors:
        if estimator_of(f).closed_form:
            # a Gamma block keeps its family only where the factor is conjugate to it:
            # other powers need moments such as E[τ^-2] that exist only for some shapes
            for arg, power in f.spec.powers:
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
    return to_move


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
        axes = _row_axes(record, ushape) if cls.dense_event else ()
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


def _row_axes(record: SiteRecord, ushape: tuple) -> tuple:
    """The plate axes of a dense Gaussian block: its site's plates, or, outside any plate,
    the leading axes its prior holds independent (:meth:`SiteRecord.row_axes`: a latent
    matrix written without plates is fitted as if its rows were declared in one, and the
    structure pass makes it dense again when a factor mixes its rows, as for any plate)."""
    axes = record.plate_axes()
    if axes:
        return axes
    rows = record.row_axes()
    if rows and tuple(ushape[: len(rows)]) == tuple(record.value_shape[: len(rows)]):
        return rows
    return ()


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


def _as_point(block: Block, point: bool) -> Block:
    return dataclasses.replace(block, point=True) if point else block


def _with_value_moments(blocks: dict, forms, deps) -> dict:
    """``blocks`` with :attr:`Block.value_moments` set on the Gaussians on an interval's
    logit space (:func:`blrppl.model.forms.interval_gaussian`) that some argument
    multiplies with another latent (a persistence in ``phi * (x_prev - mu)``): the closed
    form of that argument's factor sees φ through its moments under q, and the product
    keeps φ apart (variational message passing). Not where some argument reads the block in
    closed form on its logit space (``logits=logit(p)``): those moments are of u, not of φ.
    (An affine read alone, ``a + b * x`` with a bounded b, keeps the joint Gaussian with
    the other coefficients, whose correlations mean-field would lose.)"""
    if forms is None:
        return blocks
    site_blocks = blocks_by_site(blocks)
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
