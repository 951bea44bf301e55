"""NumPyro autoguides fitted by the Bayesian learning rule.

``BLR(model, guide=AutoNormal(model))`` fits the autoguide's family and returns the
autoguide's own parameters, so that ``guide.sample_posterior``, ``guide.median``,
``guide.quantiles`` and ``Predictive(model, guide=guide, params=params)`` work unchanged.

=============================== ======================================================
autoguide                       what is fitted
=============================== ======================================================
``AutoNormal``                  a diagonal Gaussian per site on its unconstrained space
``AutoDiagonalNormal``          the same, parameters flattened (``auto_loc``, ``auto_scale``)
``AutoMultivariateNormal``      one dense Gaussian over every unconstrained latent
``AutoLowRankMultivariateNormal`` the dense Gaussian, projected on low rank + diagonal
``AutoLaplaceApproximation``    point blocks on the unconstrained space (MAP there; the
                                guide computes the Hessian at ``auto_loc`` itself)
``AutoDelta``                   point blocks (MAP); see :data:`POINT_SPACE`
=============================== ======================================================

The low-rank guide's covariance WWᵀ + diag(ψ) is the principal-factor fit of the dense
posterior covariance Σ: ψ and the top-r eigenpairs of Σ − diag(ψ) are iterated; the BLR
does not fit that family directly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from numpyro import handlers
from numpyro.distributions import biject_to
from numpyro.infer import autoguide as ag

from blrppl.errors import UnsupportedGuideError
from blrppl.families._band import to_dense
from blrppl.posterior.export import point_value

#: autoguides whose family BLR fits (most specific first)
SUPPORTED = (
    ag.AutoLaplaceApproximation,
    ag.AutoLowRankMultivariateNormal,
    ag.AutoMultivariateNormal,
    ag.AutoDiagonalNormal,
    ag.AutoNormal,
    ag.AutoDelta,
)

#: iterations of the principal-factor fit of the low-rank guide
LOW_RANK_ITERATIONS = 200


def _guide_class(guide):
    for cls in SUPPORTED:
        if type(guide) is cls:
            return cls
    return None


def check_supported(guide) -> None:
    """Raise :class:`UnsupportedGuideError` unless ``guide`` is one of :data:`SUPPORTED`."""
    if _guide_class(guide) is None:
        names = ", ".join(c.__name__ for c in SUPPORTED)
        raise UnsupportedGuideError(
            f"BLR cannot fit a guide of type {type(guide).__name__}; supported: {names}, or "
            "guide=None (BLR then chooses the family and svi.guide is its guide)"
        )


def setup(guide, model_trace, rng_key, args, kwargs) -> dict:
    """Run the autoguide once (as ``SVI.init`` does) so that its prototype exists.

    ``model_trace`` is numpyro's trace of one seeded run of the model
    (:func:`blrppl.model.trace.seeded_trace`), checked for discrete latents first.

    Returns:
        site → True for the continuous latent sites the autoguide covers.
    """
    for name, site in model_trace.items():
        if site["type"] == "sample" and not site["is_observed"] and site["fn"].support.is_discrete:
            raise UnsupportedGuideError(
                f"autoguides cannot represent the discrete latent '{name}'; use BLR(model) "
                "(guide=None), which enumerates discrete latents",
                site=name,
            )
    guide_trace = handlers.trace(handlers.seed(guide, rng_key)).get_trace(*args, **kwargs)
    guide._blr_param_shapes = {
        n: jnp.shape(s["value"]) for n, s in guide_trace.items() if s["type"] == "param"
    }
    return {name: True for name in guide._init_locs}


def fit_options(guide, sites) -> dict:
    """The ``blr_fit`` options that give the autoguide's family."""
    guide_class = _guide_class(guide)
    names = list(sites)
    if guide_class in (ag.AutoNormal, ag.AutoDiagonalNormal):
        return {"families": {n: "gaussian-diag" for n in names}, "structure": "mean-field"}
    if guide_class in (ag.AutoMultivariateNormal, ag.AutoLowRankMultivariateNormal):
        return {"families": {n: "gaussian" for n in names}, "structure": "joint"}
    if guide_class is ag.AutoLaplaceApproximation:
        return {"point": tuple(names), "structure": "mean-field"}
    return {"point": tuple(names), "structure": "mean-field", **POINT_SPACE}


#: options of AutoDelta's point blocks (MAP in the constrained space, like AutoDelta)
POINT_SPACE: dict = {"point_space": "constrained"}


def _site_support(guide, name):
    return guide.prototype_trace[name]["fn"].support


def init_values(guide, init_params: dict) -> dict:
    """Starting site values (constrained) from an autoguide's location parameters."""
    guide_class = _guide_class(guide)
    prefix = guide.prefix
    out = {}
    if guide_class in (ag.AutoNormal, ag.AutoDelta):
        for name in guide._init_locs:
            key = f"{name}_{prefix}_loc"
            if key in init_params:
                loc = jnp.asarray(init_params[key])
                out[name] = loc if guide_class is ag.AutoDelta else biject_to(_site_support(guide, name))(loc)
        return out
    key = f"{prefix}_loc"
    if key in init_params:
        for name, u in _per_site(guide, jnp.asarray(init_params[key])).items():
            out[name] = biject_to(_site_support(guide, name))(u)
    return out


def _groups(plan, nat, full: bool):
    """Per group of jointly-fitted sites: (sites, flat mean, flat covariance or variance),
    the flat layout being each site's unconstrained value flattened, sites in order."""
    out = []
    for b in plan.blocks:
        if b.param:
            continue  # the model's own params are not the autoguide's
        view = b.family.view(nat[b.name])
        if b.family.banded:
            # (the whole covariance of a chain: an autoguide's full-rank scale holds it)
            var = jnp.linalg.inv(to_dense(-2.0 * nat[b.name].eta2)) if full else view.cov[..., 0]
            sites = b.members or (b,)
            mean = view.mean
            if b.interleaved:  # (members stored time-major: back to each site's scalars in turn)
                order = np.concatenate(b.member_positions())
                mean, var = mean[order], var[np.ix_(order, order)] if full else var[order]
            out.append(([(m.name, m.value_shape) for m in sites], mean, var))
        elif b.members:
            var = view.cov if full else jnp.diagonal(view.cov)
            out.append(([(m.name, m.value_shape) for m in b.members], view.mean, var))
        elif b.family.gaussian and not b.family.dense_event:
            out.append(([(b.name, b.value_shape)], view.mean.reshape(-1), view.var.reshape(-1)))
        elif b.family.dense_event:
            index = np.asarray(b.to_site(np.arange(b.size).reshape(b.batch_shape + (-1,)))).reshape(-1)
            mean = view.mean.reshape(-1)[index]
            if b.point:
                var = None
            elif full:
                dim = view.mean.shape[-1]
                cov = jax.scipy.linalg.block_diag(*view.cov.reshape(-1, dim, dim))
                var = cov[np.ix_(index, index)]
            else:
                var = jnp.diagonal(view.cov, axis1=-2, axis2=-1).reshape(-1)[index]
            out.append(([(b.name, b.value_shape)], mean, var))
    return out


def _flat_moments(guide, plan, nat, full: bool):
    """Mean and covariance (or variance) of the unconstrained latents, flattened in the
    autoguide's own order (its ``_init_locs``)."""
    offsets, means, vars_ = {}, [], []
    start = 0
    for g, (sites, mean, var) in enumerate(_groups(plan, nat, full)):
        pos = 0
        for name, shape in sites:
            size = int(np.prod(shape))
            offsets[name] = (start + pos, size)
            pos += size
        start += pos
        means.append(mean)
        vars_.append(var)
    order = np.concatenate([np.arange(*_span(offsets[n])) for n in guide._init_locs])
    mean = jnp.concatenate(means)[order]
    if any(v is None for v in vars_):
        return mean, None
    if full:
        cov = jax.scipy.linalg.block_diag(*[jnp.atleast_2d(v) for v in vars_])
        return mean, cov[np.ix_(order, order)]
    return mean, jnp.concatenate(vars_)[order]


def _span(offset):
    start, size = offset
    return start, start + size


def _per_site(guide, flat) -> dict:
    """Flat vector in the autoguide's order → site → unconstrained value."""
    out, start = {}, 0
    for name, init in guide._init_locs.items():
        shape = jnp.shape(init)
        size = int(np.prod(shape))
        out[name] = flat[start : start + size].reshape(shape)
        start += size
    return out


def low_rank(cov, rank: int):
    """Principal-factor fit cov ≈ F Fᵀ + diag(ψ), returned as numpyro's parameters
    (cov_factor W = F / √ψ row-wise, scale √ψ)."""
    diag = jnp.diagonal(cov)
    psi = 0.5 * diag

    def body(_, psi):
        evals, evecs = jnp.linalg.eigh(cov - jnp.diag(psi))
        top = evecs[:, -rank:] * jnp.sqrt(jnp.clip(evals[-rank:], 0.0))
        return jnp.clip(diag - jnp.sum(top**2, axis=1), 1e-6 * diag)

    psi = jax.lax.fori_loop(0, LOW_RANK_ITERATIONS, body, psi)
    evals, evecs = jnp.linalg.eigh(cov - jnp.diag(psi))
    factor = evecs[:, -rank:] * jnp.sqrt(jnp.clip(evals[-rank:], 0.0))
    scale = jnp.sqrt(psi)
    return factor / scale[:, None], scale


def params(guide, plan, nat) -> dict:
    """The autoguide's parameters (constrained values, as ``SVI.get_params`` gives them),
    with the model's own ``numpyro.param`` values under their names."""
    model_params = {b.name: point_value(b, nat[b.name]) for b in plan.blocks if b.param}
    return {**_guide_params(guide, plan, nat), **model_params}


def _guide_params(guide, plan, nat) -> dict:
    guide_class = _guide_class(guide)
    prefix = guide.prefix
    if guide_class in (ag.AutoNormal, ag.AutoDelta):
        mean, var = _flat_moments(guide, plan, nat, full=False)
        locs = _per_site(guide, mean)
        if guide_class is ag.AutoDelta:
            return {
                f"{n}_{prefix}_loc": biject_to(_site_support(guide, n))(u) for n, u in locs.items()
            }
        scales = _per_site(guide, jnp.sqrt(var))
        out = {}
        for n in locs:
            out[f"{n}_{prefix}_loc"] = locs[n]
            out[f"{n}_{prefix}_scale"] = scales[n]
        return out
    if guide_class is ag.AutoDiagonalNormal:
        mean, var = _flat_moments(guide, plan, nat, full=False)
        return {f"{prefix}_loc": mean, f"{prefix}_scale": jnp.sqrt(var)}
    if guide_class is ag.AutoLaplaceApproximation:
        mean, _ = _flat_moments(guide, plan, nat, full=False)
        return {f"{prefix}_loc": mean}
    mean, cov = _flat_moments(guide, plan, nat, full=True)
    if guide_class is ag.AutoMultivariateNormal:
        return {f"{prefix}_loc": mean, f"{prefix}_scale_tril": jnp.linalg.cholesky(cov)}
    rank = int(round(guide.latent_dim**0.5)) if guide.rank is None else guide.rank
    factor, scale = low_rank(cov, rank)
    return {f"{prefix}_loc": mean, f"{prefix}_cov_factor": factor, f"{prefix}_scale": scale}
