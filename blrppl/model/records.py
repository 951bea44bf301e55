"""The records of a traced model's sites, and how a site's distribution is read.

:class:`SiteRecord` holds what the compiler needs to know about one sample site (or
``numpyro.param``). A site's distribution is read with its wrappers unwrapped
(:func:`unwrap`): ``Independent`` becomes reinterpreted event dims, ``ExpandedDistribution``
a broadcast, ``MaskedDistribution`` a mask.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from numpyro.distributions import constraints


@dataclasses.dataclass(frozen=True)
class Plate:
    """A plate a site sits in: ``dim`` counts from the right of the batch dims."""

    name: str
    size: int
    dim: int
    subsample_size: int


@dataclasses.dataclass
class SiteRecord:
    """What the compiler needs to know about one sample site.

    Attributes:
        name: site name.
        observed: True for observed sites and ``numpyro.factor`` terms.
        is_factor: True for ``numpyro.factor`` terms (opaque log-density).
        dist_type: type of the distribution with Independent/Expanded/Masked wrappers removed.
        reinterpreted_ndim: batch dims of ``base`` reinterpreted as event dims.
        has_mask: whether a mask wraps the distribution.
        value_shape: shape of the site value.
        event_ndim: event dims of the full (wrapped) distribution.
        support: the support constraint of the site.
        plates: plates the site is in, outermost first.
        has_scale: whether the site carries a ``scale`` (subsampling, ``handlers.scale``).
        infer: the site's ``infer`` dict.
        init_value: the value the trace used (data for observed sites; the user's initial
            value for ``numpyro.param`` sites).
        unconstrained_init: a continuous latent's ``init_value`` mapped to the unconstrained
            space by ``biject_to(support)`` (None when the support's parameters depend on
            other latents, or for other sites).
        given: the matrices the distribution was built from that its pytree drops
            (:data:`GIVEN_MATRICES`), by name: a rule for that parameterisation reads them.
        is_param: a ``numpyro.param`` site: not random, fitted as a point estimate of the
            model's log density in its own (constrained) space; ``support`` is its
            constraint, ``event_ndim`` its ``event_dim`` (all its dims when unspecified) and
            ``plates`` the plates that index its batch dims.
    """

    name: str
    observed: bool
    is_factor: bool
    dist_type: type
    reinterpreted_ndim: int
    has_mask: bool
    value_shape: tuple
    event_ndim: int
    support: Any
    plates: tuple
    has_scale: bool
    infer: dict
    init_value: Any
    is_param: bool = False
    unconstrained_init: Any = None
    given: tuple = ()

    @property
    def dist_name(self) -> str:
        return self.dist_type.__name__

    @property
    def batch_ndim(self) -> int:
        return len(self.value_shape) - self.event_ndim

    def plate_axes(self) -> tuple[int, ...]:
        """Positions, in the value shape, of the plate dims (outermost plate first)."""
        axes = []
        for plate in self.plates:
            axes.append(self.batch_ndim + plate.dim)
        return tuple(axes)

    def row_axes(self) -> tuple[int, ...]:
        """The leading axes of a latent outside any plate along which its distribution is
        independent, read as if a plate declared them: all but the last axis when the
        distribution, before ``to_event``, has them as batch axes. A latent matrix written
        ``Normal(0, 1).expand([N, D]).to_event(2)`` has independent rows (0,); so has
        ``MultivariateNormal(m, S).expand([N]).to_event(1)``. ``()`` for a site in a plate,
        a vector, or a distribution whose event couples the rows (``LKJCholesky``)."""
        if self.observed or self.is_param or self.plates or len(self.value_shape) < 2:
            return ()
        if self.event_ndim - self.reinterpreted_ndim > 1:
            return ()
        return tuple(range(len(self.value_shape) - 1))


class Param:
    """Marker ``dist_type`` of ``numpyro.param`` sites (they have no distribution)."""


def unwrap(fn):
    """Remove Independent / Expanded / Masked wrappers.

    Returns:
        (base distribution, reinterpreted batch ndims, mask or None)
    """
    reinterpreted = 0
    mask = None
    while True:
        if isinstance(fn, dist.Independent):
            reinterpreted += fn.reinterpreted_batch_ndims
            fn = fn.base_dist
        elif isinstance(fn, dist.ExpandedDistribution):
            fn = fn.base_dist
        elif isinstance(fn, dist.MaskedDistribution):
            m = fn._mask
            if m is not True:
                mask = m if mask is None else jnp.logical_and(mask, m)
            fn = fn.base_dist
        else:
            return fn, reinterpreted, mask


#: matrices a distribution keeps as given beside its pytree leaves: numpyro's
#: ``MultivariateNormal(loc, precision_matrix=Λ)`` holds Λ but flattens to (loc, scale_tril),
#: a function of Λ no rule reads; the precision itself is conjugate to a Wishart block
GIVEN_MATRICES = ("precision_matrix",)


def given_matrices(base) -> dict:
    """The :data:`GIVEN_MATRICES` an unwrapped distribution was built from, by name (read
    before anything touches its lazy properties, which cache under the same names)."""
    held = getattr(base, "__dict__", {})
    return {a: held[a] for a in GIVEN_MATRICES if a in held}


def reduce_wrapped(fn, elementwise):
    """Apply the wrappers of ``fn`` to per-element log-densities of its base distribution.

    Walks from the innermost wrapper out, as ``fn.log_prob`` does: ``Independent`` sums its
    reinterpreted dims, ``MaskedDistribution`` zeroes masked elements at its own level,
    ``ExpandedDistribution`` broadcasts to its batch shape.

    Returns:
        log-density terms with the batch shape of ``fn``.
    """
    chain = []
    while isinstance(fn, (dist.Independent, dist.ExpandedDistribution, dist.MaskedDistribution)):
        chain.append(fn)
        fn = fn.base_dist
    out = elementwise
    for wrapper in reversed(chain):
        if isinstance(wrapper, dist.Independent):
            n = wrapper.reinterpreted_batch_ndims
            out = out.sum(axis=tuple(range(-n, 0))) if n else out
        elif isinstance(wrapper, dist.ExpandedDistribution):
            out = jnp.broadcast_to(out, jnp.broadcast_shapes(jnp.shape(out), wrapper.batch_shape))
        else:
            mask = wrapper._mask
            if mask is not True:
                out = jnp.where(mask, out, 0.0)
    return out


def effective_support(fn):
    """The support of a site's distribution, narrowed where numpyro reports too wide a one:
    a ``TransformedDistribution`` whose transforms are affine reports its last transform's
    codomain, ``real`` by default (``TransformedDistribution(Beta(2, 2), AffineTransform(-1,
    2))``), though its values lie in the image of its base support, (−1, 1): the image is
    the support (its bijection then keeps every value a density sees inside it)."""
    support = fn.support
    event = 0
    base_constraint = support
    while isinstance(base_constraint, constraints.independent):
        event += base_constraint.reinterpreted_batch_ndims
        base_constraint = base_constraint.base_constraint
    base, _, _ = unwrap(fn)
    if base_constraint is not constraints.real or not isinstance(base, dist.TransformedDistribution):
        return support
    current = base.base_dist.support
    while isinstance(current, constraints.independent):
        current = current.base_constraint
    for t in base.transforms:
        if not isinstance(t, dist.transforms.AffineTransform) or t.domain.event_dim != 0:
            return support
        current = dist.transforms.AffineTransform(t.loc, t.scale, domain=current).codomain
    if current is constraints.real:
        return support
    return constraints.independent(current, event) if event else current


def finite_support_values(support) -> np.ndarray | None:
    """The values of a finite discrete support, or None if it is unbounded."""
    if support is constraints.boolean:
        return np.arange(2)
    if isinstance(support, constraints._IntegerInterval):
        lo, hi = np.asarray(support.lower_bound), np.asarray(support.upper_bound)
        if lo.size and hi.size and np.all(lo == lo.flat[0]) and np.all(hi == hi.flat[0]):
            return np.arange(int(lo.flat[0]), int(hi.flat[0]) + 1)
    return None


class TracedSupport(NamedTuple):
    """A support whose parameters are computed in the traced run (from the data, or from
    other latents): rebuilt with concrete values from the run's outputs."""

    treedef: Any


def static_support(support, name, supports):
    """The support itself when its parameters are constants; else a :class:`TracedSupport`
    (no tracer may be kept past the trace), its parameters returned in ``supports``."""
    leaves, treedef = jax.tree.flatten(support)
    if not any(isinstance(x, jax.core.Tracer) for x in leaves):
        return support
    supports[name] = [jnp.asarray(x) for x in leaves]
    return TracedSupport(treedef)


def concrete_support(info, outputs):
    """The support of a site record: traced parameters replaced by their values."""
    support = info["support"]
    if isinstance(support, TracedSupport):
        leaves = [np.asarray(x) for x in outputs["supports"][info["name"]]]
        return jax.tree.unflatten(support.treedef, leaves)
    return support


def value_mask(fn, mask, value):
    """Which elements of a site's value its masks keep, with the value's shape (None
    without a mask). Each ``MaskedDistribution`` level masks its own batch dims, so its
    mask is aligned with the value through that level's event dims."""
    if mask is None:
        return None
    keep = jnp.ones(jnp.shape(value), bool)
    while isinstance(fn, (dist.Independent, dist.ExpandedDistribution, dist.MaskedDistribution)):
        if isinstance(fn, dist.MaskedDistribution) and fn._mask is not True:
            m = jnp.broadcast_to(fn._mask, tuple(fn.batch_shape))
            m = jnp.reshape(m, jnp.shape(m) + (1,) * fn.event_dim)
            keep = keep & jnp.broadcast_to(m, jnp.shape(value))
        fn = fn.base_dist
    return keep
