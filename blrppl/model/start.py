"""A latent's starting point: a typical value of its prior, strictly inside its support.

The fit starts every continuous latent at one point of its prior (the centre of its block's q
on the unconstrained space). :func:`init_to_prior_mean` chooses it per element among candidates,
the first one finite and strictly inside the support winning:

1. the prior mean (for a transformed distribution, its base distribution's mean pushed through
   the transforms, when each transform is one-to-one);
2. the prior median, ``icdf(0.5)``, where numpyro implements it;
3. when a univariate distribution has neither, the median of a few prior draws on the
   unconstrained space (a folded Student-t, Stan's half-t);
4. a uniform draw in (−2, 2) on the unconstrained space, which is always valid.

"Strictly inside" is checked as the value lying in the support and mapping to a finite point
of the unconstrained space: a mean on the boundary (a folded Normal's base mean, 0, pushed
through ``|x|``; a Beta mean rounded to 1 in float32) is no start, since every density that
reads the latent as a scale or a probability is degenerate there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpyro.distributions as dist
from numpyro.distributions.transforms import biject_to
from numpyro.infer.initialization import init_to_uniform

from blrppl.model.records import effective_support, unwrap

#: prior draws whose median (on the unconstrained space) starts a latent with no usable
#: mean or median
NUM_DRAWS = 15

#: what numpyro raises for a statistic it does not implement (``ImportError``: an ``icdf``
#: that needs tensorflow_probability)
_UNAVAILABLE = (NotImplementedError, ImportError, ValueError, TypeError, AttributeError)


def init_to_prior_mean(site=None):
    """numpyro init strategy: each element of a continuous latent at its prior mean, else its
    prior median, else the median of a few prior draws, else a uniform draw in (−2, 2) on the
    unconstrained space, the first of them finite and strictly inside the support (see the
    module's docstring). Never samples a prior that cannot be sampled (``ImproperUniform``).

    For a transformed distribution, the transform of its base distribution's mean (the
    same for an affine transform): a ``LogNormal(0, 10)`` prior (NumPyro's GP example) has
    mean e⁵⁰, five sds out on the log scale where its latent is fitted, and a fit started
    there ended at kernel variances of e⁴⁸ (ELBO −600 against about −10 from e⁰).

    Args:
        site: a numpyro sample site (a message); None returns the strategy itself.

    Returns:
        The starting value of a continuous latent, None for other sites.
    """
    if site is None:
        return init_to_prior_mean
    if site["type"] != "sample" or site["is_observed"] or site["fn"].support.is_discrete:
        return None
    fallback = init_to_uniform(site)
    support = effective_support(site["fn"])
    if support is not site["fn"].support:
        # numpyro drew on the unconstrained space of the support it reports (e.g. real for a
        # Beta pushed through an affine map): the same draw mapped into the narrower one
        fallback = biject_to(support)(biject_to(site["fn"].support).inv(fallback))
    shape = jnp.shape(fallback)
    candidates = [c for c in (_prior_mean(site["fn"]), _prior_median(site["fn"])) if c is not None]
    if not candidates:
        candidates = [c for c in (_draws_median(site, support),) if c is not None]
    value = fallback
    for candidate in reversed(candidates):  # (the first candidate wins where it is valid)
        candidate = jnp.broadcast_to(jnp.asarray(candidate, dtype=fallback.dtype), shape)
        value = jnp.where(inside_support(candidate, support), candidate, value)
    return value


def inside_support(value, support):
    """Whether each element of ``value`` is finite and strictly inside ``support``: in the
    support, and mapped to a finite point of its unconstrained space (a boolean array of
    ``value``'s shape; the elements of one event share their verdict)."""
    event_ndim = support.event_dim
    ok = jnp.asarray(support(value), dtype=bool) & _all_trailing(jnp.isfinite(value), event_ndim)
    try:
        transform = biject_to(support)
    except NotImplementedError:
        transform = None
    if transform is not None:
        unconstrained = transform.inv(value)
        ok = ok & _all_trailing(jnp.isfinite(unconstrained), transform.domain.event_dim)
    ok = jnp.reshape(ok, jnp.shape(ok) + (1,) * event_ndim)
    return jnp.broadcast_to(ok, jnp.shape(value))


def _all_trailing(x, ndim: int):
    """``x`` reduced by ``all`` over its last ``ndim`` axes."""
    return jnp.all(x, axis=tuple(range(-ndim, 0))) if ndim else x


def _prior_mean(fn):
    """The prior mean of a site's distribution, or None where numpyro has none. For a
    transformed distribution, its base distribution's mean pushed through the transforms
    when they are one-to-one (|x| is not: a folded distribution's base centre maps to the
    boundary of its support), else its own mean (an LKJ prior's identity)."""
    base = unwrap(fn)[0]
    if isinstance(base, dist.TransformedDistribution) and not any(
        isinstance(t, dist.transforms.AbsTransform) for t in base.transforms
    ):
        try:
            mean = base.base_dist.mean
            for t in base.transforms:
                mean = t(mean)
            return 1.0 * mean
        except _UNAVAILABLE:
            pass
    try:
        return 1.0 * fn.mean
    except _UNAVAILABLE:
        return None


def _prior_median(fn):
    """The prior median ``icdf(0.5)`` of a univariate site's distribution, or None where
    numpyro does not implement it."""
    base = unwrap(fn)[0]
    if base.event_shape != ():
        return None
    try:
        return base.icdf(jnp.full(base.batch_shape, 0.5))
    except _UNAVAILABLE:
        return None


def _draws_median(site, support):
    """The median of :data:`NUM_DRAWS` prior draws of a univariate site, taken elementwise on
    the unconstrained space and mapped back; None for a prior that cannot be sampled, or
    whose events are vectors or matrices (their samplers, an LKJ prior's, compile in
    seconds, for a start the uniform draw gives as well)."""
    key = site["kwargs"].get("rng_key")
    if key is None or unwrap(site["fn"])[0].event_shape != ():
        return None
    sample_shape = tuple(site["kwargs"].get("sample_shape") or ())
    try:
        draws = site["fn"](sample_shape=(NUM_DRAWS,) + sample_shape, rng_key=jax.random.fold_in(key, 1))
        transform = biject_to(support)
        return transform(jnp.median(transform.inv(draws), axis=0))
    except _UNAVAILABLE:
        return None
