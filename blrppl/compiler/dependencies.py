"""What each site depends on, read off the model's program, and the barren latents."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist

from blrppl.model.functions import distribution_leaves, log_prob_reads
from blrppl.model.deps import output_forms
from blrppl.model.records import unwrap
from blrppl.model.forms import Const, Power
from blrppl.compiler.stages import CompileOptions, Dependencies, SiteInputs
from blrppl.compiler.checks import check_static_supports


def find_dependencies(inputs: SiteInputs, options: CompileOptions) -> Dependencies:
    """The dependencies, forms and element-wise items of every site, read off the model's
    program (:func:`_dependencies`; a ``scan``'s carries followed to their fixed point), with
    the supports checked static.

    Raises:
        UnsupportedLatentError: see :func:`blrppl.compiler.checks.check_static_supports`.
    """
    deps, forms, elementwise, _, program = _dependencies(
        inputs.functions, inputs.data, inputs.records, inputs.rules, inputs.site_init
    )
    check_static_supports(inputs.records, deps)
    return Dependencies(deps, forms, elementwise, program)


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
    reads_cache: dict = {}

    def all_args(values, data):
        sites = fns.sites(tuple(records), values, data)
        out = {}
        for name, site in sites.items():
            rule = rules[name]
            args = fns.rule_args(site, rule.arg_names) if rule is not None else {}
            args["log_prob"] = site["fn"].log_prob(site["value"])
            args["value"] = jnp.asarray(site["value"])
            base, _, _ = unwrap(site["fn"])
            if base is not site["fn"]:
                # (its elements: each term of the unwrapped density, the program's reading
                # only, not a dependency of the site: see ELEMENTS)
                args[ELEMENTS] = base.log_prob(site["value"])
            if not records[name].is_factor:
                # the parameters of a latent's support (its bijection is fixed at compile time)
                # or of observed data's (which must not bound a latent)
                support_leaves = jax.tree.leaves(site["fn"].support)
                args.update({f"support:{i}": jnp.asarray(x) for i, x in enumerate(support_leaves)})
            if not records[name].is_factor:
                base, leaves, tree = distribution_leaves(site)
                # (only the leaves its density reads: not a field kept for sampling)
                read = log_prob_reads(base, leaves, tree, site["value"], reads_cache)
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
    found, forms, primitives, program = output_forms(all_args, site_init, input_forms, data)
    for items in (*found.values(), *forms.values()):
        items.pop(ELEMENTS, None)
    return found, forms, elementwise, primitives, program


#: the item of the traced program holding a site's unwrapped log-density, one term per
#: element of its distribution (the ``Independent`` axes not summed, masks not applied): what
#: each element reads (:func:`blrppl.compiler.reads.block_reads`); kept out of the
#: dependencies and forms
ELEMENTS = "elements"


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
