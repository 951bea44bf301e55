"""A fitted plan as a NumPyro guide, with its parameters, for ``Predictive`` and friends.

The guide draws every latent site from the fitted candidate posterior. Its parameters are
the moments of each block's view, named ``"{block}_blr_{field}"`` (``mu_blr_mean``,
``mu_blr_cov``, ``tau_blr_shape``, ``tau_blr_rate``, ``z_blr_probs``, ...); a point block
has only its mean. Given those parameters, the guide rebuilds each block's natural
parameters with the family's ``nat_from_view`` and draws:

* a single-site block from the site's posterior (on the constrained space, with the
  change-of-variables density for blocks fitted on an unconstrained space);
* a joint block from one auxiliary multivariate normal site ``_blr_latent``, its members
  then being ``Delta`` sites at the transformed values with density −log|det J|, so that
  the guide's log density is exact (``psis_diagnostic`` needs it);
* a point block as a ``Delta`` at its (transformed) mean.

Every site of the guide has the event dims of the model's site (``Plan.event_ndims``): where
q's distribution of a single site does not split along the model's batch dims (a dense
Gaussian over a plated site) it is drawn at an auxiliary site ``_blr_site_{name}`` and the
site is a ``Delta`` at the draw, as numpyro's autoguides do, so that numpyro's ELBOs
(``Trace_ELBO(...).loss(key, {}, model, result.guide, ...)``) accept the guide.

``numpyro.param`` sites of the model are not guide sites: their fitted values are in the
parameters under their own names, which ``Predictive`` substitutes into the model.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist

from blrppl.errors import BLRError
from blrppl.families.gaussian import GaussianView
from blrppl.posterior.export import point_value, site_distribution

#: name of the auxiliary site of a joint block
JOINT_SITE = "_blr_latent"


def param_name(block_name: str, field: str) -> str:
    """Name of the guide parameter holding ``field`` of a block's view."""
    return f"{block_name}_blr_{field}"


def _fields(block, view) -> tuple:
    return view._fields[:1] if block.point else view._fields


def plan_params(plan, nat: dict) -> dict:
    """Guide parameters of fitted natural parameters: ``"{block}_blr_{field}"`` → array,
    and every ``numpyro.param`` site's fitted (constrained) value under its own name, so
    that ``Predictive`` substitutes it into the model."""
    out = {}
    for b in plan.blocks:
        if b.param:
            out[b.name] = point_value(b, nat[b.name])
            continue
        view = b.family.view(nat[b.name])
        for field in _fields(b, view):
            out[param_name(b.name, field)] = getattr(view, field)
    return out


def _site_value(block, u):
    """Block variable (value layout) → site value (constrained), with log|det J| (per element
    of the transform's batch: a scalar for no transform)."""
    if block.transform is None:
        return u, jnp.zeros(())
    x = block.transform(u)
    return x, block.transform.log_abs_det_jacobian(u, x)


def _delta(value, log_density=0.0, event_dim: int | None = None):
    """A point mass at a site's value with ``event_dim`` of the model's site (all the value's
    dims by default); ``log_density`` summed down to its batch shape (the value's dims before
    the event dims)."""
    ndim = jnp.ndim(value)
    event_dim = ndim if event_dim is None else min(event_dim, ndim)
    log_density = jnp.asarray(log_density)
    batch = jnp.shape(value)[: ndim - event_dim]
    if jnp.ndim(log_density) > len(batch):
        log_density = jnp.sum(log_density, axis=tuple(range(len(batch), jnp.ndim(log_density))))
    return dist.Delta(value, log_density=log_density, event_dim=event_dim)


class PlanGuide:
    """``guide(*args, **kwargs)``: a NumPyro guide sampling every latent of a fitted plan.

    The model's arguments are accepted and ignored: the fitted posterior does not depend on
    them. ``plan`` may be attached later (``BLR`` builds its guide before the model is
    compiled).

    Args:
        plan: the compiled plan.
        params: default parameter values (used when no ``params`` are substituted).
    """

    def __init__(self, plan=None, params: dict | None = None):
        self.plan = plan
        self.params = params or {}

    def _event_dim(self, site: str):
        """The model's event dims at ``site`` (None: unknown, all the value's dims)."""
        if getattr(self, "_events", (None,))[0] is not self.plan:  # (made once per plan)
            self._events = (self.plan, dict(self.plan.event_ndims))
        return self._events[1].get(site)

    def __call__(self, *args, **kwargs):
        if self.plan is None:
            raise BLRError("the guide is not fitted yet: call BLR.init or BLR.run first")
        out = {}
        for b in self.plan.blocks:
            if b.param:
                continue  # a model param, not a latent: params= carries its value
            view = self._view(b)
            if b.point:
                u = b.to_site(view.mean)
                value, _ = _site_value(b, u)
                out[b.name] = numpyro.sample(b.name, _delta(value, event_dim=self._event_dim(b.name)))
            elif b.chain:
                # whole chains at an auxiliary site (forward filtering, backward sampling), each
                # site a point mass at its states
                chains = numpyro.sample(
                    f"_blr_chain_{b.name}", b.family.to_numpyro(b.family.nat_from_view(view)).to_event(1),
                    infer={"is_auxiliary": True},
                )
                for name, value in b.chain_site_values(b.family.flat(chains)).items():
                    out[name] = numpyro.sample(name, _delta(value, event_dim=self._event_dim(name)))
            elif b.members and b.discrete:
                # the joint state at an auxiliary site, its members as point masses at their values
                state = numpyro.sample(
                    f"_blr_state_{b.name}", dist.Categorical(probs=view.probs).to_event(len(b.value_shape)),
                    infer={"is_auxiliary": True},
                )
                table = jnp.asarray(b.joint_states)
                for i, m in enumerate(b.members):
                    out[m.name] = numpyro.sample(m.name, _delta(table[state, i], event_dim=self._event_dim(m.name)))
            elif b.members:
                joint = (
                    b.family.to_numpyro(b.family.nat_from_view(view))
                    if b.family.banded or b.family.arrowhead or b.family.mixture
                    else dist.MultivariateNormal(view.mean, view.cov)
                )
                x = numpyro.sample(JOINT_SITE, joint, infer={"is_auxiliary": True})
                for m in b.members:
                    value, ldj = _site_value(m, b.split(x)[m.name])
                    out[m.name] = numpyro.sample(m.name, _delta(value, -ldj, self._event_dim(m.name)))
            else:
                out[b.name] = self._single(b, view)
        return out

    def _single(self, block, view):
        """A single-site block's draw at its site. Where the model's site has fewer event dims
        than q's distribution (a site in a plate, or batched, under a q whose density does not
        split along those dims), q is drawn at an auxiliary site and the site is a point mass
        at the draw with the model's event dims, as numpyro's autoguides do: the guide's log
        density stays q's, and the sites' shapes match the model's (numpyro's ELBOs check)."""
        nat = block.family.nat_from_view(view)
        site_ndim = len(block.site_shape if block.site_shape is not None else block.value_shape)
        q = site_distribution(block, nat, site_ndim)
        event_dim = self._event_dim(block.name)
        if event_dim is None or event_dim >= q.event_dim:
            return numpyro.sample(block.name, q)
        value = numpyro.sample(f"_blr_site_{block.name}", q, infer={"is_auxiliary": True})
        return numpyro.sample(block.name, _delta(value, event_dim=event_dim))

    def _view(self, block):
        """The block's view from its parameters (``numpyro.param``, so that substituted
        values are used)."""
        view_type = block.family.view_type
        fields = view_type._fields[:1] if block.point else view_type._fields
        values = []
        for field in fields:
            name = param_name(block.name, field)
            if name not in self.params:
                raise BLRError(f"the guide's params have no '{name}'", site=block.name)
            values.append(numpyro.param(name, self.params[name]))
        if block.point:
            return GaussianView(values[0], None)
        return view_type(*values)
