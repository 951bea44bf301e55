"""The online pass: a previous fit's posterior as the prior of the matched blocks.

Given the static description of a previous fit (:func:`blrppl.posterior.online.previous_spec`),
each global block whose sites were fitted before, with the same family, shape and grouping,
loses its prior factors to one previous-posterior pseudo-factor
(:class:`blrppl.posterior.online.PreviousPosterior`: E_q[log q_prev] in closed form). Local
(per-datum) latents keep the model's prior: they belong to the old data.
"""

from __future__ import annotations

import dataclasses

from blrppl import families as fam
from blrppl.errors import OnlinePriorError
from blrppl.estimators.exact import EXACT
from blrppl.graph.plan import Factor, FactorRole
from blrppl.posterior.online import PREVIOUS_SUFFIX, PreviousPosterior, signature


def online_blocks(plan) -> tuple:
    """The blocks of ``plan`` whose prior is a previous posterior, in the plan's order."""
    return tuple(f.neighbours[0] for f in plan.factors if f.role == FactorRole.PREVIOUS)


def local_sites(records) -> set:
    """Latent sites in a plate that also holds an observed site (per-datum latents)."""
    data_plates = {p.name for r in records.values() if r.observed for p in r.plates}
    return {
        r.name for r in records.values() if not r.observed and any(p.name in data_plates for p in r.plates)
    }


def _mismatch(new, old) -> str | None:
    """Why a previous block cannot be the prior of a new one (None if it can)."""
    if new.sites != old.sites:
        return (
            f"it was fitted in block {old.name!r} and is now in block {new.name!r} "
            "(a different grouping of sites into joint blocks)"
        )
    if new.kind != old.kind:
        return f"its previous posterior is {old.kind}, the new fit gives it a {new.kind} block"
    family_differs = new.family != old.family and not _tie_only(new.family, old.family)
    if new.value_shape != old.value_shape or new.plate_axes != old.plate_axes or family_differs:
        return (
            f"its previous block {old.name!r} has shape {old.value_shape}, the new one has shape "
            f"{new.value_shape}; if this latent is per datum, put it in the data's plate "
            "(numpyro.plate) so that it is local and keeps its prior"
        )
    if new.layouts != old.layouts:
        return f"its layout (shape, bijection) changed from {old.layouts} to {new.layouts}"
    return None


def online_plan(plan, graph, records, spec):
    """Replace the priors of the matched global blocks of ``plan`` by previous-posterior
    pseudo-factors.

    Returns:
        (plan, graph, names of the matched blocks)

    Raises:
        OnlinePriorError: a global site was fitted before with another family, shape or
            grouping; or a joint block mixes global sites fitted before with local ones.
    """
    previous_of = {site: sig for sig in spec for site in sig.sites}
    local = local_sites(records)
    matched = []
    plan = _untie_previous(plan, previous_of)
    for block in plan.blocks:
        known = [s for s in block.sites if s in previous_of]
        is_local = [s for s in block.sites if s in local]
        known_global = [s for s in known if s not in local]
        if not known_global:
            continue  # new latents, or local ones (they belong to the old data): the model's prior
        if is_local:
            raise OnlinePriorError(
                f"site '{known_global[0]}': the joint block {block.name!r} holds global sites with "
                f"a previous posterior ({', '.join(map(repr, known_global))}) and local (per-datum) "
                f"sites ({', '.join(map(repr, is_local))}); a previous posterior can only replace "
                "the prior of a whole block: fit both times with structure='mean-field'",
                site=known_global[0],
            )
        new = signature(block)
        for site in block.sites:
            old = previous_of.get(site)
            if old is not None and getattr(old.family, "mixture", False):
                raise OnlinePriorError(
                    f"site '{site}': its previous posterior is a Gaussian mixture (families=('gaussian-mixture', K)), "
                    "which prior= cannot read yet (a prior is one exponential family's natural parameters): fit the "
                    "previous and the new data together, or the previous data without the mixture",
                    site=site,
                )
            if old is None:
                why = (
                    f"the previous fit has no posterior for it but has one for {', '.join(known)}, "
                    f"which share its block {block.name!r}"
                )
            else:
                why = _mismatch(new, old)
            if why is not None:
                raise OnlinePriorError(
                    f"site '{site}': cannot use the previous posterior as its prior: {why}; fit the "
                    "previous and the new data with the same model and the same families=, "
                    "structure= and point= options, or fit without prior=",
                    site=site,
                )
        matched.append(block.name)

    replaced = set()
    for name in matched:
        replaced |= set(plan.block(name).sites)
    # (a stacked factor of latents' priors is replaced with its members' block)
    dropped = {
        f.name for f in plan.factors
        if not f.observed
        and ({f.name, *f.members} & replaced or (f.role == FactorRole.JACOBIAN and f.neighbours[0] in matched))
    }
    factors = [f for f in plan.factors if f.name not in dropped]
    added = [_previous_factor(plan.block(n)) for n in matched]
    graph = graph.copy()
    graph.remove_nodes_from(("factor", n) for n in dropped)
    for f in added:
        graph.add_node(("factor", f.name), dist=f.dist_name, estimator=f.estimator)
        graph.add_edge(("factor", f.name), ("block", f.neighbours[0]))
    plan = dataclasses.replace(plan, factors=tuple(added) + tuple(factors))
    return plan, graph, tuple(matched)


def _tie_only(new_family, old_family) -> bool:
    """Whether two families differ only in their rows sharing one covariance
    (:class:`blrppl.families.GaussianTied` against :class:`blrppl.families.GaussianDense`)."""
    return (
        isinstance(new_family, fam.GaussianDense) and isinstance(old_family, fam.GaussianDense)
        and new_family.dim == old_family.dim and new_family.tied_rows != old_family.tied_rows
    )


def _untie_previous(plan, previous_of):
    """``plan`` with each block whose rows share one covariance given a covariance per row
    when its previous posterior has one per row (a prior that differs by row: its rows
    no longer share a precision); a block whose previous rows shared one stays tied, and a
    previous tied posterior is read per row by an untied block (:func:`previous_nat`)."""
    untied = {
        b.name for b in plan.blocks
        if b.family.tied_rows and b.sites[0] in previous_of and _tie_only(b.family, previous_of[b.sites[0]].family)
    }
    if not untied:
        return plan
    blocks = tuple(
        dataclasses.replace(b, family=fam.GaussianDense(b.family.dim)) if b.name in untied else b for b in plan.blocks
    )
    return dataclasses.replace(plan, blocks=blocks, tied=tuple(t for t in plan.tied if t[0] not in untied))


def _previous_factor(block) -> Factor:
    return Factor(
        name=block.name + PREVIOUS_SUFFIX,
        dist_name=f"previous posterior ({block.kind})",
        observed=False,
        neighbours=(block.name,),
        discrete=(),
        estimator=EXACT.name,
        rule=PreviousPosterior(block.name),
        arg_kinds=(),
        arg_blocks=(),
        columns=(),
        reinterpreted_ndim=0,
        role=FactorRole.PREVIOUS,
    )
