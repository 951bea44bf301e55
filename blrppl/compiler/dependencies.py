"""What each site depends on, read off the model's program, and the barren latents."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from numpyro.distributions import biject_to

from blrppl.errors import UnsupportedFactorError
from blrppl.model.functions import distribution_leaves, log_prob_reads
from blrppl.runtime.compile import compiler_options
from blrppl.graph.derivatives import reverse_only
from blrppl.runtime.program_store import compile_program, jit as store_jit, program_key
from blrppl.model.deps import output_forms
from blrppl.model.forms import Const, Power
from blrppl.model.trace import program_fingerprint
from blrppl.compiler.stages import CompileOptions, Dependencies, SiteInputs
from blrppl.compiler.checks import check_static_supports


def find_dependencies(inputs: SiteInputs, options: CompileOptions) -> Dependencies:
    """The dependencies, forms and element-wise items of every site, read off the model's
    program (:func:`_dependencies`), with the supports checked static and, for programs the
    analysis follows with more than data flow, the dependencies checked numerically.

    Raises:
        UnsupportedLatentError, UnsupportedFactorError: see :func:`blrppl.compiler.checks._check_static_supports`
            and :func:`_audit_dependencies`.
    """
    deps, forms, elementwise, primitives = _dependencies(
        inputs.functions, inputs.data, inputs.records, inputs.rules, inputs.site_init
    )
    check_static_supports(inputs.records, deps)
    if primitives & AUDITED_PRIMITIVES:
        _audit_dependencies(inputs.functions, inputs.data, inputs.records, deps, inputs.site_init, options.rng_key)
    return Dependencies(deps, forms, elementwise)


def _dependencies(functions, data, records, rules, site_init) -> tuple:
    """Per site: the latent sites its rule arguments and its log-density depend on; and the
    items (``"leaf:i"``, ``"value"``) whose elements each enter the log-density of one
    element only (a univariate distribution whose argument has at most its batch shape):
    only these may be quadrature projections (a mixture's component locations, or a
    multivariate distribution's location, couple their elements in one log-density term).
    Also each item's form (:mod:`blrppl.model.forms`), read off the same jaxpr
    (``functions``: :attr:`blrppl.compiler.stages.SiteInputs.functions`)."""
    fns = functions(site_init)
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


def _audit_dependencies(functions, data, records, deps, site_init, rng_key) -> None:
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
    fns = functions(site_init)
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
        records: site name → :class:`blrppl.model.records.SiteRecord` (params excluded).
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
