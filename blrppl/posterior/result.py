"""The result of a fit: posteriors per site, draws, summary, ELBO trace."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from blrppl.graph.plan import Plan
from blrppl.posterior.export import point_value

class CompileCounts(NamedTuple):
    """What a fit did before its first step.

    Attributes:
        model_runs: runs of the model's Python code (traces included).
        xla_compilations: XLA compilations the first step waited for (a persistent-cache
            hit or a program read from blrppl's program store is none).
        background_compilations: XLA compilations of the fit's diagnostics and posterior
            export that finished meanwhile on a worker thread (nothing waits for them
            before the first step).
    """

    model_runs: int
    xla_compilations: int
    background_compilations: int = 0


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
        state: the final :class:`blrppl.engine.state.BLRState` (a run can continue from it).
        diagnostics: :class:`blrppl.posterior.diagnostics.Diagnostics`: PSIS k̂ of q against the model
            (k̂ > 0.7: q is a poor approximation, and the fit warns), the last relative ELBO
            change, the steps backtracking undid, the Monte Carlo ELBO noise.
        diagnostic_time: seconds spent on the diagnostics (and the posterior export).
        compile_counts: :class:`CompileCounts` of this fit up to its first step: how often
            the model's Python code ran and how many XLA compilations there were (both
            small when the compiled fit came from the cache).
        model_call: ``(program, args, kwargs)`` the fit ran on (the model's
            :class:`blrppl.model.program.ModelProgram` and its data), from which :meth:`sample`
            computes the model's ``numpyro.deterministic`` sites (None: latents only).
        refinements: when the first fit's diagnostics said q is poor and ``blr_fit`` refined it
            (``refine=True``, the default), one ``Refinement`` per fit compared (``change``,
            ``khat``, ``bound``, ``time``, ``kept``, ``note``; the first is the fit as asked);
            empty when the diagnostics were good, no remedy applied, or ``refine=False``
            (:mod:`blrppl.engine.refine`).
        model_lock: the lock held while the model runs (numpyro's effect handlers keep one
            process-wide stack, so no fit may trace a model meanwhile): the engine's, given by
            the fit (None: no lock).
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
    model_call: Any = dataclasses.field(default=None, repr=False)
    #: names of the model's ``numpyro.deterministic`` sites as the fit traced it (None:
    #: unknown, :meth:`sample` traces the model to find them)
    deterministic_sites: tuple | None = dataclasses.field(default=None, repr=False)
    model_lock: Any = dataclasses.field(default=None, repr=False, compare=False)
    refinements: list = dataclasses.field(default_factory=list, repr=False)
    #: ``key → (log-weights, draws)``: weighted draws of q behind the importance-corrected
    #: summaries and draws (:mod:`blrppl.posterior.importance`; None: not available)
    importance: Any = dataclasses.field(default=None, repr=False, compare=False)
    #: a product grid's mixture of fits, drawn jointly by :meth:`sample`
    #: (:mod:`blrppl.posterior.grid_draws`; None: no grid)
    grid_draws: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def params(self) -> dict:
        """The guide's parameters: the moments of every block's view, named
        ``"{block}_blr_{field}"`` (see :mod:`blrppl.posterior.guide`)."""
        from blrppl.posterior.guide import plan_params

        return plan_params(self.plan, self.nat)

    @property
    def guide(self):
        """A NumPyro guide drawing the latents from this posterior, for
        ``Predictive(model, guide=result.guide, params=result.params)``,
        ``Predictive(result.guide, params=result.params)`` and
        ``numpyro.infer.util.psis_diagnostic``."""
        from blrppl.posterior.guide import PlanGuide

        return PlanGuide(self.plan, self.params)

    def sample(self, rng_key, num_samples: int, importance: bool = False) -> dict:
        """Draws from the posterior: site → array with a leading ``num_samples`` axis.

        With ``importance=True`` the latents are drawn from q's draws reweighted towards the
        posterior (Pareto-smoothed importance resampling, :mod:`blrppl.posterior.importance`):
        closer to the posterior where q is not exact, but repeating values. Where the weights
        are unreliable (their k̂ above 0.7) a warning says so and q's draws are returned; a
        fit without weights (subsampled plates, ``prior=``, enumerated discrete latents, scales
        on a grid) raises a :class:`blrppl.errors.BLRError`. The default is q's own draws, those
        ``posterior``, ``guide`` and ``params`` describe (see the module named).

        Sites fitted together in a joint block are drawn jointly (their correlations kept).
        The latents the fit integrated out (``plan.barren``: no other site reads them, e.g.
        ``obs_mask``'s ``<site>_unobserved``) are drawn from the model given each draw of the
        others, and the model's ``numpyro.deterministic`` sites (among them the sites a
        reparameterisation handler such as ``LocScaleReparam`` rewrites) computed from each
        draw, as ``MCMC.get_samples`` holds them.
        """
        from blrppl.inputs import as_key

        key = as_key(rng_key)
        corrected = self._weighted(key, num_samples, asked=bool(importance), resampled=True) if importance else None
        draws = corrected if corrected is not None else self._sample_latents(key, num_samples)
        draws.update(self._from_model(jax.random.fold_in(key, 1), draws, deterministic=True))
        return draws

    def _weighted(self, key, num_samples: int, asked: bool, resampled: bool):
        """Importance-corrected draws of the latents: with ``resampled``, ``num_samples`` of
        them resampled by their smoothed weights; else ``(draws, smoothed log-weights, k̂)`` of
        at least ``num_samples`` weighted draws. None where the weights are unreliable, all
        equal (q is exact) or, unless ``asked``, not available (``asked``: a BLRError then, a
        warning for unreliable weights)."""
        import warnings

        from blrppl.posterior import importance as imp

        if self.importance is None:
            if not asked:
                return None
            from blrppl.errors import BLRError

            raise BLRError(
                "importance-corrected draws are not available for this fit: it has no importance weights of q "
                "(subsampled plates or prior=), or latents they do not reweigh (enumerated discrete latents, "
                "scales integrated on a grid); use q's draws (importance=False)"
            )
        draws, log_w = imp.weighted_draws(
            self.importance, jax.random.fold_in(key, 2), imp.OVERSAMPLE * num_samples if resampled else num_samples
        )
        log_w, khat = imp.psis_smooth(log_w)
        if not -math.inf < khat <= imp.RELIABLE_KHAT:
            if asked and khat > imp.RELIABLE_KHAT:
                warnings.warn(
                    f"BLRResult: the importance weights of q are unreliable (PSIS k-hat = {khat:.2f} > "
                    f"{imp.RELIABLE_KHAT}): q's own draws are used, uncorrected",
                    UserWarning,
                    stacklevel=3,
                )
            return None
        missing = [n for n in self.posterior if n not in draws]  # (point blocks: held at their estimates)
        if missing:
            extra = self._sample_latents(jax.random.fold_in(key, 3), log_w.size)
            draws.update({n: np.asarray(extra[n]) for n in missing})
        draws = {n: draws[n] for n in self.posterior}
        if resampled:
            return imp.resample(jax.random.fold_in(key, 4), draws, log_w, num_samples)
        return draws, log_w, khat

    def _sample_latents(self, key, num_samples: int) -> dict:
        """Draws of the fitted latent sites (:meth:`sample` without the sites the model
        computes). Drawn eagerly: each operation's program is compiled once per process
        and shape and shared by every result (a program compiled per result cost 0.3 s
        per ``num_samples``, against 5 ms for the eager draws of a second fit)."""
        draws = _draw_latents(self.plan, self.nat, self.posterior, key, int(num_samples))
        if self.grid_draws is not None:
            from blrppl.posterior.grid_draws import draw

            joint = draw(self.grid_draws, jax.random.fold_in(key, 5), int(num_samples))
            draws.update({name: v for name, v in joint.items() if name in draws})
        return {name: draws[name] for name in self.posterior}

    def _from_model(self, key, draws: dict, deterministic: bool) -> dict:
        """The sites the model computes at each of ``draws`` (the fitted latents' values,
        with the fitted ``numpyro.param`` values): the latents integrated out, drawn given
        the others, and with ``deterministic`` the model's deterministic sites; {} without
        a model call or such sites. A model that cannot be run draw by draw warns and
        gives none (the fitted latents' draws stand)."""
        barren = [n for n in self.plan.barren if n not in draws]
        if self.model_call is None or not draws or not (barren or deterministic and self.deterministic_sites != ()):
            return {}
        import warnings

        program, args, kwargs = self.model_call
        params = {b.name: point_value(b, self.nat[b.name]) for b in self.plan.blocks if b.param}
        names = self.deterministic_sites if deterministic else ()
        try:
            return program.computed_sites(args, kwargs, key, draws, params, names, barren, self.model_lock)
        except Exception as err:  # (the model's own code: anything it raises)
            warnings.warn(
                f"BLRResult.sample: the model could not be run at the draws to compute its deterministic "
                f"sites or draw the latents integrated out ({type(err).__name__}: {err}); only the fitted "
                "latent sites are returned",
                UserWarning,
                stacklevel=3,
            )
            return {}

    def summary(
        self,
        prob: float = 0.9,
        num_samples: int = 4000,
        rng_key=None,
        print_table=True,
        exclude_deterministic=True,
        importance="auto",
    ) -> dict:
        """Mean, sd and central ``prob`` interval of every scalar of every site.

        Args:
            exclude_deterministic: leave out the model's ``numpyro.deterministic`` sites (as
                numpyro's ``print_summary`` does by default).
            importance: ``"auto"`` (the default): the estimates from ``num_samples`` draws of q
                weighted by their Pareto-smoothed importance weights where those are reliable
                (k̂ ≤ 0.7, not all equal: :mod:`blrppl.posterior.importance`), q's own draws
                elsewhere; ``True``: the same, warning where the weights are unreliable (a
                :class:`blrppl.errors.BLRError` where the fit has none); ``False``: q's draws.
                The table printed says which.

        Returns:
            site → dict with ``mean``, ``sd``, ``median``, lower and upper quantiles.
        """
        from blrppl.inputs import as_key
        from blrppl.posterior.importance import weighted_stats

        if importance not in (True, False, "auto"):
            from blrppl.errors import BLRError

            raise BLRError(f"summary: importance must be 'auto', True or False, not {importance!r}")
        key = as_key(rng_key)
        weighted = self._weighted(key, num_samples, asked=importance is True, resampled=False) if importance else None
        if weighted is not None:
            draws, log_w, khat = weighted
        else:
            draws, log_w = self._sample_latents(key, num_samples), None
        draws.update(self._from_model(jax.random.fold_in(key, 1), draws, deterministic=not exclude_deterministic))
        lo_q, hi_q = 50 * (1 - prob), 50 * (1 + prob)
        out = {}
        for name, x in draws.items():
            x = np.asarray(x, dtype=float)
            out[name] = weighted_stats(x, log_w, prob) if log_w is not None else {
                "mean": x.mean(0),
                "sd": x.std(0),
                "median": np.median(x, 0),
                f"{lo_q:.1f}%": np.percentile(x, lo_q, axis=0),
                f"{hi_q:.1f}%": np.percentile(x, hi_q, axis=0),
            }
        if print_table:
            print(format_summary(out))
            print(
                f"importance-corrected: {len(log_w)} draws of q weighted towards the posterior (PSIS k-hat = {khat:.2f})"
                if log_w is not None else "from q's draws"
            )
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


def _draw_latents(plan, nat: dict, dists: dict, key, num_samples: int) -> dict:
    """``num_samples`` draws of every latent site: joint blocks drawn jointly (their
    members' coupling kept), chains as whole paths (forward filtering, backward sampling),
    the other blocks from their exported posteriors ``dists``."""
    keys = jax.random.split(key, max(len(plan.blocks), 1))
    out = {}
    for k, b in zip(keys, plan.blocks):
        if b.chain:
            states = b.family.flat(b.family.sample(nat[b.name], k, (num_samples,)))
            out.update(b.chain_site_values(states))
        elif b.members and b.discrete:
            # one draw of the joint state: the members' values keep their coupling
            state = b.family.sample(nat[b.name], k, (num_samples,))
            table = jnp.asarray(b.joint_states)
            for i, m in enumerate(b.members):
                out[m.name] = table[state, i]
        elif b.members:
            x = b.family.sample(nat[b.name], k, (num_samples,))
            for name, u in b.split(x).items():
                member = next(m for m in b.members if m.name == name)
                out[name] = member.transform(u) if member.transform is not None else u
        else:
            out[b.name] = dists[b.name].sample(k, (num_samples,))
    return out


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
