"""The result of a fit: posteriors per site, draws, summary, ELBO trace."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from numpyro.distributions import constraints

from blrppl.graph.plan import Block, Plan


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
        base = _layout_distribution(block, nat, len(block.value_shape) - len(block.batch_shape) if block.kind == "gaussian" else 0)
        return TransformedPosterior(base, block.transform)
    return _layout_distribution(block, nat, event_ndim)


def point_value(block: Block, nat):
    """The constrained value, in the site's layout, of a point block's mean."""
    mean = block.family.view(nat).mean
    if block.kind == "gaussian":
        mean = block.to_site(mean)
    return block.transform(mean) if block.transform is not None else mean


def _layout_distribution(block: Block, nat, event_ndim: int) -> dist.Distribution:
    inner = block.family.to_numpyro(nat)
    if block.kind == "gaussian":
        bshape, dim = block.batch_shape, inner.event_shape[-1]
        if tuple(block.value_shape) == bshape + (dim,) and block.plate_axes == tuple(range(len(bshape))):
            out = inner
        elif tuple(block.value_shape) == bshape and block.plate_axes == tuple(range(len(bshape))):
            out = dist.Normal(inner.loc[..., 0], jnp.sqrt(inner.covariance_matrix[..., 0, 0]))
        else:
            return _SiteLayout(inner, block)
        extra = event_ndim - len(out.event_shape)
        return out.to_event(extra) if extra > 0 else out
    if block.kind == "categorical":
        out = EnumeratedPosterior(inner.probs, block.support_values)
        extra = event_ndim - len(out.event_shape)
        return out.to_event(extra) if extra > 0 else out
    if block.discrete:
        return inner
    extra = event_ndim - len(inner.event_shape)
    return inner.to_event(extra) if extra > 0 else inner


class CompileCounts(NamedTuple):
    """What a fit did before its first step.

    Attributes:
        model_runs: runs of the model's Python code (traces included).
        xla_compilations: XLA compilations (a persistent-cache hit is none).
    """

    model_runs: int
    xla_compilations: int


@dataclasses.dataclass
class BLRResult:
    """A fitted candidate posterior.

    Attributes:
        posterior: site name → numpyro distribution in the site's constrained space.
        elbo: ELBO after every step.
        num_steps: steps run.
        converged: whether the convergence test passed.
        message: why the fit stopped.
        plan: the compiled plan (``plan.describe()`` prints it).
        nat: natural parameters per block (the fitted state).
        compile_time: seconds spent tracing, probing and compiling.
        run_time: seconds spent in the jitted loop.
        graph: the factor graph (networkx) the plan was compiled from.
        state: the final :class:`blrppl.engine.step.BLRState` (a run can continue from it).
        diagnostics: :class:`blrppl.diagnostics.Diagnostics`: PSIS k̂ of q against the model
            (k̂ > 0.7: q is a poor approximation, and the fit warns), the last relative ELBO
            change, the steps backtracking undid, the Monte Carlo ELBO noise.
        diagnostic_time: seconds spent on the diagnostics (and the posterior export).
        compile_counts: :class:`CompileCounts` of this fit up to its first step: how often
            the model's Python code ran and how many XLA compilations there were (both
            small when the compiled fit came from the cache).
    """

    posterior: dict
    elbo: np.ndarray
    num_steps: int
    converged: bool
    message: str
    plan: Plan
    nat: dict
    compile_time: float = 0.0
    run_time: float = 0.0
    graph: Any = None
    state: Any = None
    diagnostics: Any = None
    diagnostic_time: float = 0.0
    compile_counts: CompileCounts | None = None

    @property
    def params(self) -> dict:
        """The guide's parameters: the moments of every block's view, named
        ``"{block}_blr_{field}"`` (see :mod:`blrppl.guide`)."""
        from blrppl.guide import plan_params

        return plan_params(self.plan, self.nat)

    @property
    def guide(self):
        """A NumPyro guide drawing the latents from this posterior, for
        ``Predictive(model, guide=result.guide, params=result.params)``,
        ``Predictive(result.guide, params=result.params)`` and
        ``numpyro.infer.util.psis_diagnostic``."""
        from blrppl.guide import PlanGuide

        return PlanGuide(self.plan, self.params)

    def sample(self, rng_key, num_samples: int) -> dict:
        """Draws from the posterior: site → array with a leading ``num_samples`` axis.

        Sites fitted together in a joint block are drawn jointly (their correlations kept).
        """
        from blrppl.inputs import as_key

        keys = jax.random.split(as_key(rng_key), max(len(self.plan.blocks), 1))
        out = {}
        for k, b in zip(keys, self.plan.blocks):
            if b.members and b.discrete:
                # one draw of the joint state: the members' values keep their coupling
                state = b.family.sample(self.nat[b.name], k, (num_samples,))
                table = jnp.asarray(b.joint_states)
                for i, m in enumerate(b.members):
                    out[m.name] = table[state, i]
            elif b.members:
                x = b.family.sample(self.nat[b.name], k, (num_samples,))
                for name, u in b.split(x).items():
                    member = next(m for m in b.members if m.name == name)
                    out[name] = member.transform(u) if member.transform is not None else u
            else:
                out[b.name] = self.posterior[b.name].sample(k, (num_samples,))
        return {name: out[name] for name in self.posterior}

    def summary(self, prob: float = 0.9, num_samples: int = 4000, rng_key=None, print_table=True) -> dict:
        """Mean, sd and central ``prob`` interval of every scalar of every site.

        Returns:
            site → dict with ``mean``, ``sd``, ``median``, lower and upper quantiles.
        """
        draws = self.sample(rng_key, num_samples)
        lo_q, hi_q = 50 * (1 - prob), 50 * (1 + prob)
        out = {}
        for name, x in draws.items():
            x = np.asarray(x, dtype=float)
            out[name] = {
                "mean": x.mean(0),
                "sd": x.std(0),
                "median": np.median(x, 0),
                f"{lo_q:.1f}%": np.percentile(x, lo_q, axis=0),
                f"{hi_q:.1f}%": np.percentile(x, hi_q, axis=0),
            }
        if print_table:
            print(format_summary(out))
            print(self.message)
            if self.diagnostics is not None:
                print(self.diagnostics.describe())
        return out

    def point_estimates(self) -> dict:
        """Site → constrained value of every point estimate: the ``numpyro.param`` sites
        (their fitted values) and the ``point`` latents (the mode they converged to, in the
        space ``point_space`` chose; their Gaussian in ``posterior`` is Laplace's
        approximation around it)."""
        return {b.name: point_value(b, self.nat[b.name]) for b in self.plan.blocks if b.point}

    def to_arviz(self, num_samples: int = 1000, rng_key=None):
        """The posterior as an ``arviz.InferenceData`` of independent draws.

        Args:
            num_samples: draws per site (one chain; the draws are independent, so arviz's
                effective sample size is about ``num_samples``).
            rng_key: a ``jax.random`` key (default ``jax.random.key(0)``).

        Returns:
            ``arviz.InferenceData`` with a ``posterior`` group: one variable per site, dims
            ``("chain", "draw", "<site>_dim_0", ...)`` with the site's shape.

        Raises:
            MissingDependencyError: arviz is not installed (``pip install blrppl[arviz]``).
        """
        try:
            import arviz
        except ImportError as err:
            from blrppl.errors import MissingDependencyError

            raise MissingDependencyError(
                "BLRResult.to_arviz needs arviz, which is not installed: pip install blrppl[arviz]"
            ) from err
        if int(num_samples) < 1:
            from blrppl.errors import BLRError

            raise BLRError(f"num_samples must be at least 1, not {num_samples}")
        draws = self.sample(rng_key, int(num_samples))
        posterior = {name: np.asarray(x)[None] for name, x in draws.items()}
        dims = {name: [f"{name}_dim_{i}" for i in range(x.ndim - 2)] for name, x in posterior.items()}
        return arviz.from_dict(posterior=posterior, dims=dims, posterior_attrs={"inference_library": "blrppl"})


def format_summary(stats: dict) -> str:
    cols = None
    rows = []
    for name, s in stats.items():
        cols = list(s)
        mean = np.asarray(s["mean"])
        for idx in np.ndindex(mean.shape):
            label = name + (f"[{','.join(map(str, idx))}]" if idx else "")
            rows.append([label] + [f"{np.asarray(s[c])[idx]:.4g}" for c in cols])
    header = [""] + (cols or [])
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)
