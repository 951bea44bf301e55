"""The classes of distribution arguments: what a closed-form rule can read of each.

An argument (or a site's value) of a factor is a function of the neighbouring blocks. Its
class (:class:`ArgumentClass`) names the moment object the rules get for it (a ``kind`` of
:mod:`blrppl.moments.kinds`), or :data:`OPAQUE`. :func:`classify_form` reads the class off
the argument's form (:mod:`blrppl.model.forms`), and off what its elements read
(:mod:`blrppl.compiler.reads`) where the form leaves the plates open:

* ``const``           — depends on no continuous block, or only on point (delta-method)
  blocks, which the factors see at their mean;
* ``affine_gaussian`` — affine in Gaussian blocks (``X @ w + b``, ``a[group]``);
* ``power_gamma``     — c·τ^a in one Gamma block τ (``log`` of it is affine in ``log τ``),
  e.g. ``1 / jnp.sqrt(tau)``;
* ``beta`` / ``dirichlet`` — the block itself, possibly indexed;
* ``opaque``          — anything else, with the reason.

Arguments that touch a plated block must use one plate element per output element
("gather" structure) for the elementwise moments to be exact (:func:`needs_gather_test`
says when the question arises). Dense Gaussian blocks whose elements mix (e.g. a sum over a
plate) use one column per scalar of the block instead.
"""

from __future__ import annotations

import dataclasses
import math

from blrppl.graph.plan import Block
from blrppl.model import forms as fm
from blrppl.moments import kinds as mom


#: dense Gaussian blocks whose elements mix in an argument get one column per scalar,
#: up to this many scalars; beyond it the argument is opaque
MAX_FULL_COLUMNS = 2048

#: a product of two Gaussian blocks reads E[f(d_A, d_B)²] through |S_A|·|S_B| pushes of the
#: model (|S| the tangents of a block: the scalars of one plate element); beyond this many the
#: argument is opaque (an unplated N × D latent would need N·D tangents)
MAX_BILINEAR_PUSHES = 4096


def element_size(block: Block) -> int:
    """Tangents of a Gaussian block read elementwise: the scalars of one plate element (all of
    them for an unplated block) when it holds their covariance, else one."""
    if not block.family.dense_event:
        return 1
    return block.size // max(math.prod(block.batch_shape), 1)


def needs_gather_test(block: Block, elementwise: bool) -> bool:
    """Whether an argument reading ``block`` may mix its elements: more than one element
    (each scalar when ``elementwise``, else each plate element) for the question to arise."""
    return math.prod(block.value_shape if elementwise else block.batch_shape) > 1


#: the kind of an argument no closed-form rule reads (beside :data:`blrppl.moments.kinds.KINDS`)
OPAQUE = "opaque"


@dataclasses.dataclass(frozen=True)
class ArgumentClass:
    """Result of classifying one argument.

    Attributes:
        kind: one of :data:`blrppl.moments.kinds.KINDS` (the ``kind`` of its moment class) or
            :data:`OPAQUE`.
        blocks: continuous blocks it depends on.
        full: Gaussian blocks whose plate elements mix in this argument.
        reason: why the argument is opaque (empty otherwise).
        power: for ``power_gamma``, the exponent a when it is the same for every element.
        pairs: for ``bilinear_gaussian``, the (left, right) pairs of blocks whose product it
            holds (:class:`blrppl.moments.kinds.BilinearGaussian`).
        gather: plated blocks whose plate elements the argument must not mix for the class
            to hold (a contraction ``X @ C.T`` over the event axis of each row): a decision
            of the forms that the element reads settle (:func:`blrppl.compiler.classify._confirm_gather`).
    """

    kind: str
    blocks: tuple
    full: tuple = ()
    reason: str = ""
    power: float | None = None
    pairs: tuple = ()
    gather: tuple = ()

    @property
    def opaque(self) -> bool:
        """Whether no closed-form rule reads the argument."""
        return self.kind == OPAQUE


def too_many_columns(cls: "ArgumentClass", blocks: dict) -> "ArgumentClass":
    """``cls``, or opaque when it mixes the plate elements of a block with more than
    :data:`MAX_FULL_COLUMNS` scalars that no banded family holds (one column per scalar of
    it would be pushed through the model: memory quadratic in its size)."""
    for n in cls.full:
        b = blocks[n]
        if b.size > MAX_FULL_COLUMNS and b.batch_shape and not b.family.banded:
            return ArgumentClass("opaque", cls.blocks, reason=f"mixes the elements of the large block '{n}'")
    return cls


def block_power(family, power: float | None) -> float | None:
    """The exponent of the block's variable τ in an argument c·x^a of its latent x = τ^p:
    p·a (:attr:`blrppl.families.Family.argument_power`), or None (no common exponent)."""
    return None if power is None else family.argument_power * power


def constant_class(deps, blocks: dict) -> ArgumentClass | None:
    """``"const"`` for an argument that reads no continuous latent, or point blocks only (seen at
    their means: a constant of the factor's expectation, whose value at the points still
    depends on them for their updates); None otherwise. Decided from the dependencies alone."""
    cont = [n for n in deps if not blocks[n].discrete]
    return ArgumentClass("const", ()) if all(blocks[n].point for n in cont) else None


def _power_class(form, atoms: dict, spaces: dict, cont: tuple, decided, reason: str) -> tuple:
    """``(class or None, reason)`` of c · x^a in one latent x (a :class:`blrppl.model.forms.Power`):
    its family's argument kind (a power of a Gamma, the Beta/Dirichlet/Wishart latent itself),
    or a log-normal for a Gaussian on log space; None with the reason otherwise."""
    ((_, own),) = atoms.values()
    (space,) = spaces.values()
    family = own.family
    if family.argument_kind is not None and family.any_power:
        return decided(family.argument_kind, power=block_power(family, form.power))
    if family.argument_kind is not None and form.power == 1.0:
        if family.whole_events:
            # whole matrices in place, each times a constant (β Λ of a Normal–Wishart prior):
            # the element reads confirm it (the forms carry no axes)
            return ArgumentClass(family.argument_kind, cont, gather=cont), ""
        if form.unit:
            return decided(family.argument_kind)
        # c times the latent, c read from data (not the latent itself unless c is 1)
        reason = f"a constant times the {family.name.capitalize()} latent '{next(iter(atoms))}'"
    if space == "exp":
        return decided(mom.ExpGaussian.kind)  # c · exp(a u): log-normal
    if space in ("sigmoid", "other"):
        where = {"sigmoid": "logit space", "other": "a transformed space"}[space]
        reason = f"{fm.why_not_exact(form)}, whose Gaussian is on {where}"
    return None, reason


def _with_points(form, deps, blocks: dict, site_blocks: dict, value_moments: bool, mixed) -> tuple:
    """:func:`classify_form` of an argument that reads point blocks beside others. Point
    blocks are Gaussians whose factors see them at their mean: such an argument has a closed
    form only when it is affine in all of its blocks."""
    cont = tuple(n for n in deps if not blocks[n].discrete)
    cls, reason = classify_form(
        form, deps, {n: dataclasses.replace(b, point=False) for n, b in blocks.items()}, site_blocks,
        value_moments, mixed,
    )
    if cls is None or cls.kind in (mom.AffineGaussian.kind, OPAQUE):
        return cls, reason
    reason = "not affine in its Gaussian blocks, one of them fitted as a point"
    return ArgumentClass(OPAQUE, cont, reason=reason), reason


def classify_form(
    form, deps, blocks: dict, site_blocks: dict, value_moments: bool = False, mixed=None
) -> tuple:
    """The class of an argument read off its form (:mod:`blrppl.model.forms`): affine, a power
    of a Gamma latent, a Beta/Dirichlet latent itself...; else ``"opaque"`` with the reason
    the form names (safe: fitted by quadrature or Monte Carlo instead of a closed form).

    Args:
        form: the argument's form, in terms of the latent sites.
        deps: the blocks the argument depends on.
        blocks: block name → :class:`Block`.
        site_blocks: site → (its block's name, the block of the site itself: the member of a
            joint block, else the block).
        value_moments: in an affine or bilinear form, read the sites of blocks with
            :attr:`Block.value_moments` (on their own) as Gaussians on their site's space, as
            closed-form rules see them through :func:`support_view` (not for quadrature
            projections, which integrate the block's own Gaussian).
        mixed: ``gaussian_kind → blocks`` of which some element reads several granules
            (:func:`blrppl.compiler.reads.mixed_blocks`); None: the form's ``mixes`` decides.

    Returns:
        ``(class, reason)``: the :class:`ArgumentClass` (``None`` only without ``mixed``, for
        an argument that mixes the elements of a plated block); and the reason an argument is
        opaque (``""`` otherwise).
    """
    cont = tuple(n for n in deps if not blocks[n].discrete)
    if not cont or all(blocks[n].point for n in cont):
        return ArgumentClass("const", ()), ""
    if any(blocks[n].point for n in cont):
        return _with_points(form, deps, blocks, site_blocks, value_moments, mixed)
    if isinstance(form, fm.Opaque):
        return ArgumentClass("opaque", cont, reason=form.reason), form.reason
    atoms = {s: site_blocks[s] for s in fm.sites_of(form) if s in site_blocks}
    if isinstance(form, fm.Const) or {n for n, _ in atoms.values()} != set(cont):
        reason = "reads its latents in a way the program's forms do not follow"
        return ArgumentClass(OPAQUE, cont, reason=reason), reason
    # (only first powers and products: the moments E[φ], Var[φ] say nothing of exp(φ))
    on_support = value_moments and (
        fm.first_powers(form) or isinstance(form, fm.Affine) or fm.as_bilinear(form) is not None
    )
    spaces = {
        s: "affine" if on_support and own.value_moments and not blocks[n].members else fm.site_space(own)
        for s, (n, own) in atoms.items()
    }

    def gathered(elementwise: bool):
        """No mixing, or no block that the gather test applies to."""
        if mixed is not None:
            return not mixed(not elementwise)
        if not fm.mixes(form):
            return True
        return not any(needs_gather_test(blocks[n], elementwise or not blocks[n].family.dense_event) for n in cont)

    def decided(kind, **kw):
        # (Gaussian kinds read mixed elements through their covariance columns)
        elementwise = kind not in (mom.AffineGaussian.kind, mom.ExpGaussian.kind)
        if gathered(elementwise):
            return ArgumentClass(kind, cont, **kw), ""
        if mixed is None:
            return None, ""
        spread = mixed(not elementwise)
        if kind == mom.AffineGaussian.kind:
            return ArgumentClass(kind, cont, full=spread, **kw), ""
        why = f"mixes the elements of '{spread[0]}'"
        return ArgumentClass(OPAQUE, cont, reason=why), why

    reason = fm.why_not_exact(form)
    # (first powers of Gaussian sites: ``A * x_prev`` of a scan's carry over time steps)
    if isinstance(form, fm.Affine) or (fm.first_powers(form) and set(spaces.values()) == {"affine"}):
        off = sorted(s for s, sp in spaces.items() if sp != "affine")
        if not off:
            return decided("affine_gaussian")
        space = {
            "exp": "a Gaussian on log space", "sigmoid": "a Gaussian on logit space",
            "other": "a Gaussian on a transformed space",
        }.get(spaces[off[0]], f"a {spaces[off[0]].capitalize()}")
        reason = f"affine in '{off[0]}', whose block is {space}"
    elif fm.as_bilinear(form) is not None and set(spaces.values()) == {"affine"}:
        bil = fm.as_bilinear(form)
        left = {atoms[x][0] for x in bil.left if x in atoms}
        right = {atoms[x][0] for x in bil.right if x in atoms}
        pairs = tuple(sorted((a, b) for a in left for b in right))
        pushes = {(a, b): element_size(blocks[a]) * element_size(blocks[b]) for a, b in pairs}
        heavy = next(((a, b) for (a, b), k in pushes.items() if k > MAX_BILINEAR_PUSHES), None)
        if left & right:
            reason = "a product of latents fitted in one block"
        elif heavy is not None:
            big = max(heavy, key=lambda n: element_size(blocks[n]))
            reason = (
                f"a product of latents whose exact second moment needs {pushes[heavy]} pushes of the model per "
                f"step ('{big}' has {element_size(blocks[big])} scalars per plate element: declare its rows in a "
                "numpyro.plate)"
            )
        elif bil.mixes and left and right:
            # a contraction (X @ C.T): exact when each element reads one plate element of
            # each block, whose covariance within the element (the contracted event axis)
            # the block holds; the forms carry no axes: the element reads check the plates
            flat = sorted(n for n in left | right if not blocks[n].family.dense_event)
            if flat:
                reason = (
                    f"a contraction of products of latents (e.g. X @ C.T) reading '{flat[0]}', "
                    "whose family holds no covariance within an element"
                )
            else:
                gather = tuple(n for n in cont if needs_gather_test(blocks[n], not blocks[n].family.dense_event))
                return ArgumentClass(mom.BilinearGaussian.kind, cont, pairs=pairs, gather=gather), ""
        elif left and right:
            return decided(mom.BilinearGaussian.kind, pairs=pairs)
    elif isinstance(form, fm.Linked) and form.link == "exp" and set(spaces.values()) == {"affine"} and gathered(False):
        return decided(mom.ExpGaussian.kind)  # exp of an affine Gaussian: log-normal
    elif isinstance(form, fm.LogPower | fm.LogProduct) and set(spaces.values()) == {"exp"}:
        return decided("affine_gaussian")  # log of exp(u): affine in the block's value u
    elif isinstance(form, fm.Logit) and set(spaces.values()) == {"sigmoid"}:
        return decided("affine_gaussian")  # logit of sigmoid(u)
    elif isinstance(form, fm.Power):
        found, why = _power_class(form, atoms, spaces, cont, decided, reason)
        if found is not None:
            return found, why
        reason = why
    return ArgumentClass("opaque", cont, reason=reason), reason
