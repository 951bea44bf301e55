"""Posterior export: fitted natural parameters as numpyro distributions in each site's layout.

Used by :class:`blrppl.posterior.result.BLRResult` (its ``posterior``), by the guide a fit exports
(:mod:`blrppl.posterior.guide`) and by the autoguide parameters (:mod:`blrppl.posterior.autoguides`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist
from numpyro.distributions import constraints

from blrppl.model.functions import canonical_leaves
from blrppl.runtime.compile import compiler_options
from blrppl.runtime.program_store import compile_program, fit_program_key, jit as store_jit
from blrppl.graph.plan import Block


class _SiteLayout(dist.Distribution):
    """A canonical-layout posterior seen in a site's value layout (reshape / transpose)."""

    # a pytree like every numpyro distribution (posteriors come out of a jitted export)
    pytree_data_fields = ("inner",)
    pytree_aux_fields = ("block",)

    def __init__(self, inner: dist.Distribution, block: Block):
        self.inner = inner
        self.block = block
        batch = ()
        super().__init__(batch_shape=batch, event_shape=tuple(block.value_shape), validate_args=False)

    @property
    def support(self):
        return constraints.independent(constraints.real, len(self.block.value_shape))

    def sample(self, key, sample_shape=()):
        return self.block.to_site(self.inner.sample(key, sample_shape))

    def log_prob(self, value):
        lp = self.inner.log_prob(self.block.to_canonical(value))
        nb = len(self.block.batch_shape)
        return jnp.sum(lp, axis=tuple(range(lp.ndim - nb, lp.ndim))) if nb else lp

    @property
    def mean(self):
        return self.block.to_site(self.inner.mean)

    @property
    def variance(self):
        return self.block.to_site(self.inner.variance)


class EnumeratedPosterior(dist.CategoricalProbs):
    """The posterior of an enumerated latent over its consecutive integer values
    ``values[0] … values[-1]`` (``probs[..., k]`` is the probability of ``values[k]``).

    Unlike numpyro's ``Categorical``, whose categories are labels, its ``mean`` and
    ``variance`` are those of the values (a ``DiscreteUniform(0, 10)`` latent has a
    posterior mean), and ``sample`` and ``log_prob`` speak of the values themselves.
    """

    pytree_aux_fields = ("values",)

    def __init__(self, probs, values, *, validate_args=None):
        self.values = tuple(int(v) for v in values)
        super().__init__(probs, validate_args=validate_args)

    @property
    def support(self):
        return constraints.integer_interval(self.values[0], self.values[-1])

    def _value_array(self):
        return jnp.asarray(self.values, dtype=jnp.result_type(float))

    def sample(self, key, sample_shape=()):
        return super().sample(key, sample_shape) + self.values[0]

    def log_prob(self, value):
        return super().log_prob(jnp.asarray(value) - self.values[0])

    def enumerate_support(self, expand=True):
        return super().enumerate_support(expand) + self.values[0]

    @property
    def mean(self):
        return jnp.sum(self.probs * self._value_array(), axis=-1)

    @property
    def variance(self):
        v = self._value_array()
        return jnp.sum(self.probs * v**2, axis=-1) - self.mean**2


class TransformedPosterior(dist.TransformedDistribution):
    """A Gaussian on an unconstrained space pushed through the site's bijection.

    ``mean`` and ``variance`` have no closed form: they are Monte Carlo estimates from
    ``num_draws`` draws with a fixed key (standard error sd/√num_draws).
    """

    num_draws = 4096

    def _draws(self):
        return self.sample(jax.random.key(0), (self.num_draws,))

    @property
    def mean(self):
        return self._draws().mean(0)

    @property
    def variance(self):
        return self._draws().var(0)


def site_distribution(block: Block, nat, event_ndim: int) -> dist.Distribution:
    """The posterior of a block as a numpyro distribution in the site's layout (a point
    mass at the estimate for a ``numpyro.param`` site)."""
    if block.param:
        return dist.Delta(point_value(block, nat), event_dim=event_ndim)
    if block.transform is not None:
        base = _layout_distribution(block, nat, len(block.value_shape) - len(block.batch_shape) if block.family.dense_event else 0)
        return TransformedPosterior(base, block.transform)
    return _layout_distribution(block, nat, event_ndim)


def point_value(block: Block, nat):
    """The constrained value, in the site's layout, of a point block's mean."""
    mean = block.to_site(block.family.view(nat).mean)
    return block.transform(mean) if block.transform is not None else mean


def _layout_distribution(block: Block, nat, event_ndim: int) -> dist.Distribution:
    inner = block.family.to_numpyro(nat)
    if block.family.dense_event:
        bshape, dim = block.batch_shape, inner.event_shape[-1]
        if tuple(block.value_shape) == bshape + (dim,) and block.plate_axes == tuple(range(len(bshape))):
            out = inner
        elif tuple(block.value_shape) == bshape and block.plate_axes == tuple(range(len(bshape))):
            out = dist.Normal(inner.loc[..., 0], jnp.sqrt(inner.covariance_matrix[..., 0, 0]))
        else:
            return _SiteLayout(inner, block)
        extra = event_ndim - len(out.event_shape)
        return out.to_event(extra) if extra > 0 else out
    if block.family.indexes_support:
        return _enumerated(inner.probs, block.support_values, event_ndim)
    if block.discrete:
        return inner
    extra = event_ndim - len(inner.event_shape)
    return inner.to_event(extra) if extra > 0 else inner


def _enumerated(probs, values, event_ndim: int) -> dist.Distribution:
    out = EnumeratedPosterior(probs, values)
    return out.to_event(event_ndim) if event_ndim > 0 else out


def posterior_builder(plan, records, submit):
    """nat → posterior distributions of every site, compiled once where possible (local
    blocks of subsampled plates at their full size); ``submit(fn, *args)`` runs the
    compilation on a worker thread and returns its future."""
    blocks = {b.name: b.full for b in plan.blocks}

    def build(nat):
        out = {}
        for n, b in blocks.items():
            if b.chain:
                # each site's marginals (the chain's joint draws: BLRResult.sample, the guide)
                for m, probs in b.chain_site_probs(b.family.view(nat[n]).probs):
                    out[m.name] = _enumerated(probs, b.support_values, records[m.name].event_ndim)
            elif b.members and b.discrete:
                for m, probs in b.member_probs(b.family.view(nat[n]).probs):
                    out[m.name] = site_distribution(m, m.family.nat_from_view(type(b.family.view(nat[n]))(probs)), records[m.name].event_ndim)
            elif b.members:
                for m, view in b.member_views(b.family.view(nat[n])):
                    out[m.name] = site_distribution(m, m.family.nat_from_view(view), records[m.name].event_ndim)
            else:
                out[n] = site_distribution(b, nat[n], records[n].event_ndim)
        return {name: out[name] for name in records if name in out}

    compiled = []

    def leaves_of(nat):
        # in canonical order: the outputs of a program following numpyro's own flatten
        # order would change with Python's hash seed and miss the persistent cache
        return canonical_leaves(build(nat))[0]

    def prepare(nat, key=None):
        """Start compiling the export for natural parameters of these shapes (on a worker
        thread), or load it from the program store (``key``: the fit's key there, see
        :mod:`blrppl.runtime.program_store`); False for distributions that are not pytrees
        (then built op by op)."""
        if compiled:
            return True
        # (dense blocks: D² elementwise work, which XLA's backend optimisations speed up)
        work = sum(b.size * b.family.dim for b in blocks.values() if b.family.dense_event)
        options = compiler_options((), work, once=True)
        try:
            with numpyro.validation_enabled(False):  # the families' parameters are valid
                _, tree = canonical_leaves(jax.eval_shape(build, nat))
                stored = fit_program_key(key, "export", options)
                future = compile_program(stored, store_jit(leaves_of, "export").lower, (nat,), options, submit, background=True)
        except TypeError:  # a distribution that is not a pytree
            return False
        compiled.append((tree, future))
        return True

    def posteriors(nat):
        # one small compiled call (backend optimisations off: it runs once per fit); op by
        # op, every jnp operation would compile on its own
        if not prepare(nat):
            return build(nat)
        tree, future = compiled[0]
        return tree.unflatten(future.result()(nat))

    posteriors.prepare = prepare
    return posteriors
