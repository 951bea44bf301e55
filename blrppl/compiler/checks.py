"""Checks of a compilation's inputs: the user's options, the latents' supports, the factors of
subsampled plates and of enumerated latents."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from blrppl import families as fam
from blrppl.errors import FamilyError, UnsupportedFactorError, UnsupportedLatentError
from blrppl.graph.plan import FactorRole
from blrppl.model import checks as model_checks
from blrppl.model.records import SiteRecord
from blrppl.compiler.stages import CompileOptions


def check_options(records, families, point, point_space, structure, subsampled, rng_key) -> CompileOptions:
    """The user's options, checked against the model's sites.

    Args:
        records: site name → :class:`blrppl.model.records.SiteRecord` (params included).
        families, point, point_space, structure, subsampled, rng_key: as ``compile_model``'s.

    Raises:
        FamilyError: ``families=`` or ``point=`` names no latent sample site, a param, or a
            family a point block cannot have; or ``point_space`` is unknown.
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
    return CompileOptions(families, point, point_space, structure, tuple(subsampled), rng_key)


def check_loose_blocks(structure, records) -> None:
    """Refuse a structure that leaves more than :data:`blrppl.model.checks.MAX_LOOSE_BLOCKS`
    latent sites of one structure outside any plate as blocks of their own (neither merged
    into the joint block nor one chain): the sites of a Python loop over groups, which a
    plate would hold as one site.

    Raises:
        UnsupportedLatentError: naming the group's first and last site and the plate that
            would hold them.
    """
    held = set(structure.chains) | (set(structure.members) if structure.merge else set())
    single = [n for n, b in structure.blocks.items() if n not in held and tuple(b.sites) == (n,)]
    for (pattern, dist_type, _), names in model_checks.loose_latent_groups(records, single).items():
        if len(names) > model_checks.MAX_LOOSE_BLOCKS:
            raise model_checks.loose_latents_error(names, dist_type.__name__, pattern, model_checks.MAX_LOOSE_BLOCKS)


def check_static_supports(records, deps) -> None:
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


def check_subsampled(factors, records, blocks, plates) -> list:
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


def check_aligned(factor: SiteRecord, discrete: SiteRecord, name: str):
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
