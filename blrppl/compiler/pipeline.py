"""Compiling a traced model into blocks, a factor graph and a static plan: the driver of the
compiler's passes."""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from blrppl.errors import UnsupportedFactorError
from blrppl.model.functions import ModelFunctions
from blrppl.model.program import ModelProgram
from blrppl.graph.derivatives import is_reverse_only_error
from blrppl.rules import find_rule
from blrppl.compiler.stages import CompileOptions, SiteInputs, StructureLimits
from blrppl.compiler.checks import check_loose_blocks, check_options
from blrppl.compiler.dependencies import barren_latents, find_dependencies
from blrppl.compiler.families import choose_families
from blrppl.compiler.structure import choose_structure, fallback
from blrppl.compiler.large_blocks import ivon_blocks
from blrppl.compiler.estimators import estimate
from blrppl.compiler.finish import finish_plan
from blrppl.compiler.online import online_plan
from blrppl.compiler.conjugacy import conjugate_blocks


def compile_model(
    program: ModelProgram, records, data_spec, data, families=None, rng_key=None, structure=None, point=(),
    point_space="unconstrained", subsampled=(), prior_spec=None,
):
    """Build blocks, the factor graph and the plan of a traced model, pass by pass: the
    options checked, the sites' inputs, their dependencies (without the barren latents), the
    blocks' families, their structure and the factors' estimators (the structure chosen
    again, with fewer choices, when its factors' estimators do not fit it), the plan, a
    previous fit's posterior as the prior of the blocks it matches (online), conjugacy.

    Args:
        program: the model's :class:`blrppl.model.program.ModelProgram` (the compiler's only
            handle on the model).
        records: site records from :func:`blrppl.model.trace.trace_model`.
        data_spec, data: the model's data (static part and array leaves).
        families: optional dict site → family name overriding the default
            (:func:`blrppl.compiler.families.choose_families`).
        rng_key: accepted for the callers that pass one; the compilation draws nothing (every
            structure is read off the model's program).
        structure: ``"joint"``, ``"mean-field"`` or None (the default policy,
            :func:`blrppl.compiler.structure.choose_structure`).
        point: sites fitted by the delta method (Gaussian on the unconstrained space seen
            at its mean; Newton updates; Laplace's method at convergence).
        point_space: ``"unconstrained"`` (the ``point`` sites keep the log|det J| term of
            their bijection: the mode on the unconstrained space) or ``"constrained"`` (no
            such term: the mode of the density in the site's own space).
        subsampled: the model's :class:`blrppl.graph.plan.SubsampledPlate` s (from
            :func:`blrppl.model.trace.subsampled_plates`); ``records`` then hold minibatch
            shapes. Latents inside such a plate become *local* blocks (never merged into a
            joint block, updated first in each step); the model functions use the first M
            elements of each plate unless the data carry a minibatch.
        prior_spec: a previous fit's description (:func:`blrppl.posterior.online.previous_spec`)
            whose posterior replaces the prior of the blocks it matches
            (:func:`blrppl.compiler.online.online_plan`); None: the model's prior.

    ``numpyro.param`` sites become point blocks (``param=True``) on the unconstrained space
    of their constraint, without a log|det J| term (a param is not random: its estimate is
    the maximiser of the model's log density in its own space, as numpyro's SVI fits
    params). In the sequential order a discrete block whose continuous neighbours are all
    point blocks comes first (the E-step from the initial points, as EM starts); the other
    discrete blocks come last, after the continuous blocks in model order.

    Returns:
        (plan, model functions, dynamic data leaves, init values dict (block space),
        networkx graph)
    """
    options = check_options(records, families, point, point_space, structure, subsampled, rng_key)
    inputs = site_inputs(program, data_spec, data, records, options)
    found = find_dependencies(inputs, options)
    keep = set(options.families) | set(options.point) | {r.name for r in inputs.latent if r.is_param}
    barren = barren_latents(inputs.records, found.deps, keep)
    if barren:
        # the sites' inputs and dependencies again without them, their values kept for the
        # model's runs
        kept = collections.OrderedDict((n, r) for n, r in records.items() if n not in barren)
        inputs = site_inputs(program, data_spec, data, kept, options, {n: inputs.site_init[n] for n in barren})
        found = find_dependencies(inputs, options)
    choice = choose_families(inputs, found, options)
    limits = StructureLimits()
    while limits is not None:
        structure = ivon_blocks(choose_structure(inputs, choice, options, limits, found.program), choice.factors, options)
        check_loose_blocks(structure, inputs.records)
        estimates = estimate(inputs, found, choice, structure, options)
        limits = fallback(estimates, options, limits)
    plan, fns, dyn_data, init_values, graph = finish_plan(inputs, found, estimates, options)
    if prior_spec is not None:
        plan, graph, _ = online_plan(plan, graph, records, prior_spec)
    plan = dataclasses.replace(plan, conjugate=conjugate_blocks(plan))
    return plan, fns, dyn_data, init_values, graph


def site_inputs(program: ModelProgram, data_spec, data, records, options: CompileOptions, barren=None) -> SiteInputs:
    """The sites to fit and the model's functions over them (one traced program).

    Args:
        program, data_spec, data, records: as :func:`compile_model`'s.
        options: the checked options.
        barren: latents left out of the fit (:func:`blrppl.compiler.dependencies.barren_latents`)
            → their values in the model's runs.
    """
    plate_indices = {p.name: np.arange(p.subsample_size) for p in options.subsampled}
    latent = [r for r in records.values() if not r.observed]
    site_init = {r.name: np.asarray(r.init_value) for r in latent}
    # (a left-out latent still runs in the model: at its initial value, which nothing reads)
    site_init.update(barren or {})
    unconstrained = {r.name: r.unconstrained_init for r in latent if r.unconstrained_init is not None}
    # params are not sites with a density: they are inputs of the factors, never factors
    sites = collections.OrderedDict((n, r) for n, r in records.items() if not r.is_param)
    rules = {r.name: (None if r.is_factor else find_rule(r.dist_type, r.given)) for r in sites.values()}
    # the model's program, traced once and shared by every evaluation of the passes and by the fit
    program = program.fresh()

    def functions(fill, transforms=None, joints=None):
        return ModelFunctions(program, data_spec, fill, transforms, joints, plate_indices)

    return SiteInputs(data, records, sites, latent, rules, site_init, unconstrained, functions, dict(barren or {}))


def reverse_only_error(program: ModelProgram, data_spec, data, records) -> UnsupportedFactorError:
    """The error for a model whose log-density calls a ``jax.custom_vjp`` function on a path
    from a continuous latent that reverse-only mode (:mod:`blrppl.graph.derivatives`) could not
    differentiate twice either, naming the sites whose log-densities call it (each site's
    density differentiated forward along every continuous latent at its starting point,
    traced only)."""
    latent = [r for r in records.values() if not r.observed and not r.support.is_discrete and not r.is_param]
    site_init = {r.name: np.asarray(r.init_value) for r in records.values() if not r.observed}
    fns = ModelFunctions(program.fresh(), data_spec, site_init)
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
