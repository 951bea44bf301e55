"""The factors' argument classes and estimators (closed form, quadrature, delta, Monte Carlo)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import numpyro.distributions as dist

from blrppl import moments as mom
from blrppl.estimators.registry import FactorCandidate, choose_estimator
from blrppl.model.functions import LINKS, projection_args
from blrppl.model.classes import ArgumentClass, classify_form, constant_class, too_many_columns
from blrppl.model.probes import gather_probe, pairing_probe, probe_argument, random_point, run_probes
from blrppl.model.classes import needs_gather_test
from blrppl.model.forms import inverse_link
from blrppl.graph.plan import Factor
from blrppl.compiler.blocks import blocks_by_site
from blrppl.compiler.checks import check_aligned


#: the most scalar projections per element a quadrature factor may have
MAX_PROJECTIONS = 2


def classify_factors(
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
            :func:`blrppl.compiler.dependencies._dependencies`).
        forms: site → item → form (:mod:`blrppl.model.forms`): an argument whose form
            decides its class is not probed (:func:`blrppl.model.classes.classify_form`), and
            the form names what makes the others opaque.
        provisional: the blocks may still change (the family policy iterates, chains are
            not found yet): an argument mixing the elements of a large plated block stays
            affine (:func:`blrppl.model.classes.too_many_columns` decides on the final blocks).
    """
    elementwise = elementwise or {}
    rng = np.random.default_rng(np.asarray(jax.random.key_data(rng_key)).ravel())
    key_of, known = cache if cache is not None else (None, {})
    site_blocks = blocks_by_site(blocks)
    probes, nbrs, keys, decided, reasons = {}, {}, {}, {}, {}
    for name, r in records.items():
        rule = rules[name]
        neighbours = tuple(n for n in blocks if any(n in d for d in deps[name].values()))
        discrete = tuple(n for n in neighbours if blocks[n].discrete)
        for d in discrete:
            # (elsewhere the chain probe finds what each element reads: blrppl.graph.markov)
            if blocks[d].local is not None:
                for site in blocks[d].sites:
                    check_aligned(r, records[site], name)
        nbrs[name] = (neighbours, discrete)
        if rule is None:
            continue
        for arg in ("value",) + rule.arg_names:
            keys[(name, arg)] = key_of(name, arg) if key_of is not None else None
            if keys[(name, arg)] in known:
                continue
            constant = constant_class(deps[name][arg], blocks)
            if constant is not None:
                decided[(name, arg)] = constant
                if forms is not None:
                    reasons[(name, arg)] = ""
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
    the factor couples those elements (:func:`blrppl.model.probes.pairing_probe`)."""
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
                constant = constant_class(deps[name][item], blocks)
                if constant is not None:
                    probes[(name, index, link)] = constant
                    continue
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
                links=choice.links,
                powers=choice.powers,
                pairs=choice.pairs,
                why=why,
                grid_positions=choice.grid_positions,
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
