"""The typed inputs and outputs of the compiler's passes (:mod:`blrppl.compiler.pipeline`)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple


class CompileOptions(NamedTuple):
    """The user's choices for a compilation, checked against the model's sites.

    Attributes:
        families: site → family name overriding the default.
        point: sites fitted by the delta method.
        point_space: ``"unconstrained"`` or ``"constrained"`` (see ``compile_model``).
        structure: ``"joint"``, ``"mean-field"`` or None (the default policy).
        subsampled: the model's subsampled plates.
        rng_key: unused by the passes (the compilation draws nothing).
    """

    families: dict
    point: tuple
    point_space: str
    structure: str | None
    subsampled: tuple
    rng_key: Any


class SiteInputs(NamedTuple):
    """The sites a compilation fits and what the model's functions are built from.

    Attributes:
        data: the model's dynamic data leaves.
        all_records: every site record (params included; barren latents excluded).
        records: the site records without params (the factors' sites).
        latent: the latent records (params included).
        rules: site → its closed-form rule (None for ``numpyro.factor`` terms).
        site_init: site → its initial value (barren latents' too).
        unconstrained: site → its initial value on the unconstrained space, where the trace
            computed it.
        functions: ``(fill, transforms=None, joints=None)`` → the model's
            :class:`blrppl.model.functions.ModelFunctions` (one shared traced program).
        barren: barren latent → its value in the model's runs (left out of the fit).
    """

    data: Any
    all_records: dict
    records: dict
    latent: list
    rules: dict
    site_init: dict
    unconstrained: dict
    functions: Callable
    barren: dict


class Dependencies(NamedTuple):
    """What the model's program says about each site (:func:`blrppl.compiler.dependencies.find_dependencies`).

    Attributes:
        deps: site → argument → the latent sites it depends on.
        forms: site → item → its form (:mod:`blrppl.model.forms`).
        elementwise: site → the items that may be quadrature projections.
        program: the traced program they were read from (site values and data → every
            site's items, :class:`blrppl.model.deps.TracedProgram`): which elements of the
            blocks each item reads (:mod:`blrppl.compiler.reads`).
    """

    deps: dict
    forms: dict
    elementwise: dict
    program: Any = None


class FamilyChoice(NamedTuple):
    """The blocks after the family policy's fixed point (:func:`blrppl.compiler.families.choose_families`).

    Attributes:
        blocks: name → block (discrete chains included).
        factors: the provisional factors classified on them.
        fns: the model's functions on them.
        init_values: the blocks' initial values.
        on_support: the blocks seen through their value moments.
        cache: ``(key function, dict)`` of the argument classes found.
        chain_reads: factor → ``((chain block, reads),)`` of the discrete chains.
    """

    blocks: dict
    factors: list
    fns: Any
    init_values: dict
    on_support: set
    cache: tuple
    chain_reads: dict


class StructureLimits(NamedTuple):
    """Which structures :func:`blrppl.compiler.structure.choose_structure` may choose (each
    turned off when a choice turned out to give Monte Carlo messages its view cannot serve).

    Attributes:
        arrowhead: whether a joint block beyond the dense limit may be an arrowhead.
        banded: whether a Gaussian block may be a chain.
        merge_joint: whether the default policy may merge dense Gaussian blocks.
    """

    arrowhead: bool = True
    banded: bool = True
    merge_joint: bool = True


class Structure(NamedTuple):
    """The blocks' structure (:func:`blrppl.compiler.structure.choose_structure`).

    Attributes:
        blocks: name → block (chains banded, densified blocks dense), before merging.
        members: the blocks merged into the joint dense block (when ``merge``).
        merge: whether ``members`` become one joint block.
        arrow: the joint block's dense spans when it is an arrowhead.
        densified: the blocks made dense over their plate elements.
        chains: block → its :class:`blrppl.graph.band.Chain`.
        coupled_discrete: groups of discrete blocks merged into one categorical each.
    """

    blocks: dict
    members: list
    merge: bool
    arrow: tuple
    densified: list
    chains: dict
    coupled_discrete: list


class Estimates(NamedTuple):
    """The final blocks and factors with their estimators (:func:`blrppl.compiler.estimators.estimate`).

    Attributes:
        blocks: name → final block.
        factors: the classified factors (Jacobian terms included).
        fns: the model's functions on the final blocks.
        init_values: the final blocks' initial values.
        chains: block → its :class:`blrppl.graph.band.Chain`.
    """

    blocks: dict
    factors: list
    fns: Any
    init_values: dict
    chains: dict
