"""The factors' argument classes and estimators (closed form, quadrature, delta, Monte Carlo)."""

from __future__ import annotations

import dataclasses

import numpyro.distributions as dist

from blrppl import moments as mom
from blrppl.estimators.registry import FactorCandidate, choose_estimator
from blrppl.model.functions import LINKS
from blrppl.model.classes import ArgumentClass, classify_form, constant_class, too_many_columns
from blrppl.model.classes import OPAQUE, needs_gather_test
from blrppl.model.forms import inverse_link
from blrppl.graph.plan import Factor
from blrppl.compiler.blocks import blocks_by_site
from blrppl.compiler.checks import check_aligned
from blrppl.compiler.reads import ElementReads, coupled_blocks, mixed_blocks, whole_matrices


#: the most scalar projections per element a quadrature factor may have
MAX_PROJECTIONS = 2


def classify_factors(
    records, rules, deps, blocks, *, forms, program, quadrature=True, cache=None, elementwise=None,
    provisional=False, site_reads=None,
):
    """Classify every factor's arguments and choose its estimator, from the model's program
    alone: each argument's form (:mod:`blrppl.model.forms`) and which elements of its blocks
    it reads (:mod:`blrppl.compiler.reads`).

    Args:
        records, rules, deps, blocks: the model's sites, their rules, what each argument
            depends on, and the blocks.
        forms: site → item → form (:mod:`blrppl.model.forms`).
        program: the traced program the forms were read from
            (:attr:`blrppl.compiler.stages.Dependencies.program`): which elements of its
            blocks each argument reads decides what the forms leave to the plates.
        quadrature: find the quadrature projections of the factors without a closed form
            (``False`` while the family policy iterates: only exactness is needed there, and
            such factors get a provisional ``"monte_carlo"`` estimator).
        cache: ``(key function, dict)``: argument classes found earlier, under the key the
            function gives a (factor, argument); a cached argument is not classified again.
        elementwise: site → the items that may be quadrature projections (see
            :func:`blrppl.compiler.dependencies._dependencies`).
        provisional: the blocks may still change (the family policy iterates, chains are
            not found yet): an argument mixing the elements of a large plated block stays
            affine (:func:`blrppl.model.classes.too_many_columns` decides on the final blocks).
        site_reads: the latent sites each factor reads, where blocks hold several.
    """
    elementwise = elementwise or {}
    key_of, known = cache if cache is not None else (None, {})
    site_blocks = blocks_by_site(blocks)
    nbrs, classes, found = {}, {}, {}
    reads = ElementReads(program, blocks)
    for name, r in records.items():
        rule = rules[name]
        neighbours = tuple(n for n in blocks if any(n in d for d in deps[name].values()))
        discrete = tuple(n for n in neighbours if blocks[n].discrete)
        for d in discrete:
            # (a chain's reads are found by blrppl.graph.markov)
            if blocks[d].local is not None:
                for site in blocks[d].sites:
                    check_aligned(r, records[site], name)
        nbrs[name] = (neighbours, discrete)
        if rule is None:
            continue
        for arg in ("value",) + rule.arg_names:
            key = key_of(name, arg) if key_of is not None else None
            if key is not None and key in known:
                classes[(name, arg)] = known[key]
                continue
            cls = argument_class(forms[name][arg], deps[name][arg], blocks, site_blocks, reads, name, arg, True)
            classes[(name, arg)] = found[key] = cls
    if key_of is not None:
        known.update({k: c for k, c in found.items() if k is not None})
    classes = _paired(records, rules, classes, blocks, reads)
    classes = _independent_scales(records, rules, classes)
    classes = _own_uniform_priors(records, rules, classes, site_blocks)
    if not provisional:
        classes = {k: too_many_columns(c, blocks) if c.kind in _GAUSSIAN_KINDS else c for k, c in classes.items()}

    exact = {}
    for name in records:
        rule = rules[name]
        if rule is None:
            exact[name] = None
            continue
        kinds = {arg: classes[(name, arg)].kind for arg in ("value",) + rule.arg_names}
        exact[name] = rule.supports(kinds)
    candidates, quad_classes = {}, {}
    if quadrature:
        missing = {n for n in records if not exact[n]}
        candidates, quad_classes = _quadrature_projections(
            records, deps, blocks, nbrs, missing, elementwise, forms, site_blocks, reads
        )
    return _factors(records, rules, blocks, nbrs, classes, exact, candidates, quad_classes, quadrature, site_reads)


def argument_class(form, deps, blocks, site_blocks, reads, name, item, value_moments=True) -> ArgumentClass:
    """One argument's class: from its dependencies alone (constants, point blocks), else from
    its form and, where the form leaves the plates open, its element reads.

    Args:
        form: the item's form (:mod:`blrppl.model.forms`).
        deps: the blocks it depends on.
        blocks, site_blocks: the blocks, and each site's (block name, own block).
        reads: the program's :class:`blrppl.compiler.reads.ElementReads`.
        name, item: the site and its item (``"value"``, an argument, ``"leaf:i"``).
        value_moments: see :func:`blrppl.model.classes.classify_form`.
    """
    constant = constant_class(deps, blocks)
    if constant is not None:
        return constant
    cls, reason = classify_form(
        form, deps, blocks, site_blocks, value_moments=value_moments, mixed=reads.mixed(name, item, deps)
    )
    if cls.gather:
        cls = _confirm_gather(cls, reads.of(name, item), blocks)
    return dataclasses.replace(cls, reason=reason) if cls.opaque and reason and not cls.reason else cls


_GAUSSIAN_KINDS = (mom.AffineGaussian.kind, mom.ExpGaussian.kind)


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


def _paired(records, rules, classes, blocks, reads) -> dict:
    """``classes`` with the plated Gaussian blocks that a factor's arguments read at
    different elements (each argument "gather") added to those arguments' ``full`` blocks:
    the factor couples those elements (:func:`blrppl.compiler.reads.coupled_blocks`)."""
    out = dict(classes)
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
        coupled = coupled_blocks({a: reads.of(name, a) for a in ("value",) + rule.arg_names}, shared, blocks)
        for n in coupled:
            for arg in shared[n]:
                cls = out[(name, arg)]
                out[(name, arg)] = dataclasses.replace(cls, full=tuple(sorted(set(cls.full) | {n})))
    return out


def _confirm_gather(cls: ArgumentClass, reads: dict, blocks: dict) -> ArgumentClass:
    """A class the forms decided up to the plates (:attr:`ArgumentClass.gather`), settled by
    the argument's element reads: a matrix-valued block must be read in whole matrices; a
    multiplied block (``pairs``) whose elements mix makes the argument opaque; any other mixed
    block is read through its full covariance columns (``full``)."""
    whole = {n for n in cls.gather if blocks[n].family.whole_events}
    broken = sorted(n for n in whole if not whole_matrices(reads, blocks[n]))
    if broken:
        family = blocks[broken[0]].family.name.capitalize()
        reason = f"reads parts of the {family} matrices of '{broken[0]}', or mixes them (not whole matrices)"
        return ArgumentClass(OPAQUE, cls.blocks, reason=reason)
    mixed = [n for n in mixed_blocks(reads, blocks, [n for n in cls.gather if n not in whole], True)]
    multiplied = {n for pair in cls.pairs for n in pair}
    bad = [n for n in mixed if n in multiplied]
    if bad:
        reason = f"a contraction of products of latents over the plate elements of '{bad[0]}'"
        return ArgumentClass(OPAQUE, cls.blocks, reason=reason)
    return dataclasses.replace(cls, gather=(), full=tuple(sorted(set(cls.full) | set(mixed))))


def _quadrature_projections(records, deps, blocks, nbrs, names, elementwise, forms, site_blocks, reads) -> tuple:
    """Quadrature candidates among ``names`` (no closed form, continuous neighbours all
    Gaussian, a few distribution leaves or the value depending on them), and the class of
    each candidate projection under each link."""
    candidates, classes = {}, {}
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
                form = inverse_link(forms[name][item], link)
                classes[(name, index, link)] = argument_class(
                    form, deps[name][item], blocks, site_blocks, reads, name, item, False
                )
    return candidates, classes


def _factors(
    records, rules, blocks, nbrs, classes, exact, candidates, quad_classes, quadrature, site_reads=None,
) -> list:
    """The :class:`Factor` s, each with the estimator the registry chooses for it
    (:func:`blrppl.estimators.registry.choose_estimator`) from its argument classes and its
    quadrature projections (``site_reads``: the latent sites each factor reads, where blocks
    hold several)."""
    factors, site_reads = [], site_reads or {}
    for name, r in records.items():
        rule = rules[name]
        neighbours, discrete = nbrs[name]
        args = ("value",) + rule.arg_names if exact[name] else ()
        candidate = FactorCandidate(
            name=name, record=r, rule=rule, blocks=blocks, neighbours=tuple(neighbours), discrete=tuple(discrete),
            classes={arg: classes[(name, arg)] for arg in args}, closed_form=bool(exact[name]),
            projections=tuple(candidates.get(name, ())) if quadrature else (), projection_classes=quad_classes,
            quadrature=bool(quadrature), site_reads=site_reads.get(name),
        )
        estimator, choice = choose_estimator(candidate)
        why = _why_not_exact(name, r, rule, classes) if estimator.approximates else ""
        factors.append(
            Factor(
                name=name,
                dist_name=r.dist_name,
                observed=r.observed,
                neighbours=neighbours,
                discrete=discrete,
                estimator=estimator.name,
                rule=choice.rule,
                arg_kinds=choice.arg_kinds,
                arg_blocks=choice.arg_blocks,
                columns=choice.columns,
                reinterpreted_ndim=r.reinterpreted_ndim,
                why=why,
                spec=choice.spec,
            )
        )
    return factors


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
