"""``BLR``: a drop-in for ``numpyro.infer.SVI`` that fits by the Bayesian learning rule.

``BLR(model)`` fits the candidate posterior :func:`blrppl.blr_fit` would choose and exposes
it as a guide (``svi.guide``) with parameters (``svi.get_params(state)``);
``BLR(model, guide=AutoNormal(model))`` fits the autoguide's own family and returns the
autoguide's parameters (see :mod:`blrppl.posterior.autoguides`), so that the rest of a pipeline
written for ``SVI`` (``Predictive``, ``guide.sample_posterior``, ``guide.median``,
``guide.quantiles``, ``psis_diagnostic``) keeps working.

The calls mirror ``SVI``: ``init``, ``update``, ``run``, ``evaluate``, ``get_params``;
the loss is the negative ELBO. One ``update`` is one BLR step (every block updated once,
with the step-size safeguards of :func:`blr_fit`); ``run`` stops early when the
convergence test passes.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from blrppl.engine.grid import MAX_SCALES, grid_sites
from blrppl.engine.prepare import prepare as prepare_fit
from blrppl.engine.run import run as run_fit
from blrppl.engine.state import BLRState
from blrppl.errors import BLRError, UnsupportedGuideError, out_of_memory_as_error
from blrppl.graph import minibatches
from blrppl.graph.data import DataSpec, host_array, split_run_data
from blrppl.model.program import ModelProgram
from blrppl.model.trace import seeded_trace, trace_model
from blrppl.inputs import (
    DEFAULT_NUM_STEPS,
    argument_names,
    as_compiled_dtype,
    as_key,
    call_arguments,
    fit_options,
    refuse_transformation,
)
from blrppl.posterior import autoguides
from blrppl.posterior.guide import PlanGuide, plan_params

#: keywords of ``blr_fit`` that ``BLR`` accepts as options
OPTIONS = (
    "learning_rate",
    "schedule",
    "families",
    "structure",
    "point",
    "mc_curvature",
    "tol",
    "point_space",
    "iterate_average",
    "mesh",
)


class BLRRunResult(NamedTuple):
    """What :meth:`BLR.run` returns, like ``numpyro.infer.svi.SVIRunResult``.

    Attributes:
        params: the guide's parameters.
        state: the final :class:`~blrppl.engine.state.BLRState`.
        losses: negative ELBO after every step.
    """

    params: dict
    state: BLRState
    losses: jax.Array


def _is_traced(tree) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))


def _arrays_of(args, kwargs) -> tuple:
    """A call's array arguments (kept to skip validating the same arrays twice: held, so
    that their identities cannot be reused by new arrays)."""
    leaves = jax.tree.leaves((tuple(args), dict(kwargs)))
    return tuple(x for x in leaves if isinstance(x, (np.ndarray, jax.Array)))


def _same_objects(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


class BLR:
    """Bayesian-learning-rule inference with the interface of ``numpyro.infer.SVI``.

    Example::

        svi = BLR(model)                  # instead of SVI(model, guide, optim, loss)
        res = svi.run(key, 2000, X, y)    # params, state, losses
        Predictive(model, guide=svi.guide, params=res.params, num_samples=500)(key, X)

        guide = AutoNormal(model)
        res = BLR(model, guide).run(key, 2000, X, y)   # res.params: 'w_auto_loc', ...

    Args:
        model: a NumPyro model.
        guide: ``None`` (the candidate posterior blrppl chooses; ``self.guide`` is its
            guide) or one of the autoguides in :data:`blrppl.posterior.autoguides.SUPPORTED`, whose
            family is then fitted.
        **options: keywords of :func:`blrppl.blr_fit` (``learning_rate``, ``schedule``,
            ``families``, ``structure``, ``point``, ``mc_curvature``, ``tol``,
            ``point_space``, ``iterate_average``, ``mesh``: a ``jax.sharding.Mesh`` or a
            device count, over which :meth:`run` shards the data, see docs/scaling.md).

    Attributes:
        guide: the guide to pass to ``Predictive`` (the autoguide given, or a
            :class:`blrppl.posterior.guide.PlanGuide` filled in by ``init``).
        result: the :class:`blrppl.BLRResult` of the last ``run``.
    """

    def __init__(self, model: Callable, guide=None, optim=None, loss=None, **options):
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise BLRError(
                f"BLR does not take {unknown}; its options are {list(OPTIONS)} (an optimiser and "
                "a loss, SVI's third and fourth arguments, are accepted and not used)"
            )
        if optim is not None or loss is not None:
            warnings.warn(
                "BLR does not use an optimiser or a loss: every step is a natural-gradient step on "
                "the ELBO (no learning rate to tune); the ones given are ignored",
                UserWarning,
                stacklevel=2,
            )
        self.model = model
        self.options = dict(options)
        self._fit_options = fit_options(**self.options)  # checked now, not at the first call
        if self._fit_options.mixtures:
            raise BLRError(
                "families=('gaussian-mixture', K) is an option of blr_fit (its mixture is fitted after the single "
                "Gaussian's fit): BLR steps one exponential-family q per block",
                site=self._fit_options.mixtures[0][0],
            )
        self._autoguide = None
        if guide is not None:
            autoguides.check_supported(guide)
            overlap = sorted(set(options) & {"families", "structure", "point", "point_space"})
            if overlap:
                raise BLRError(f"{overlap} cannot be combined with an autoguide, which fixes the family")
            self._autoguide = guide
            self.guide = guide
        else:
            self.guide = PlanGuide()
        self._prepared = None
        self._setup_with = None
        self._checked: tuple = ()
        self._statistics = None
        self._updated_with: tuple = ()
        self.result = None

    # -- setup ---------------------------------------------------------------------
    def _setup(self, rng_key, args, kwargs, init_params, num_steps=DEFAULT_NUM_STEPS, minibatch=False):
        options = dict(self.options)
        init_values = None
        if self._autoguide is not None:
            try:
                model_trace = seeded_trace(self.model, rng_key, args, kwargs)
                records = autoguides.setup(self._autoguide, model_trace, rng_key, args, kwargs)
            except Exception as exc:  # the autoguide's own initialisation failed
                # bad data (NaN, out of support) make numpyro's autoguide fail without saying
                # why: check the data the way every fit does, then report what failed
                trace_model(self.model, args, kwargs, rng_key)
                raise UnsupportedGuideError(
                    f"the autoguide could not be initialised on this model and data "
                    f"({type(exc).__name__}: {exc})"
                ) from exc
            options.update(autoguides.fit_options(self._autoguide, records))
            if init_params:
                init_values = autoguides.init_values(self._autoguide, init_params)
        elif init_params:
            init_values = dict(init_params)
        checked = fit_options(num_steps=num_steps, **options)
        if minibatch:
            minibatches.refuse_options(checked, bool(grid_sites(checked.families_dict)))
        self._setup_with = (rng_key, num_steps)
        with out_of_memory_as_error("compiling the fit"):
            self._prepared = prepare_fit(
                ModelProgram(self.model), args, kwargs, checked, rng_key, init_values=init_values, minibatch=minibatch
            )
        self._checked = _arrays_of(args, kwargs)
        if self._autoguide is None:
            self.guide.plan = self._prepared.plan
        return self._prepared

    def init(self, rng_key, *args, init_params: dict | None = None, **kwargs) -> BLRState:
        """Compile the model for these arguments and return the initial state.

        Args:
            rng_key: a ``jax.random`` key.
            *args, **kwargs: the model's arguments (the data), or one :class:`blrppl.Minibatches`:
                the fit is compiled for its first batch (taken from it), and :meth:`update`
                then takes batches of the same shapes.
            init_params: optional starting values: site → value for ``guide=None``, the
                autoguide's location parameters (``'{site}_auto_loc'``, ``'auto_loc'``)
                otherwise. Scales start at the defaults of :func:`blr_fit`.

        Raises:
            TransformationError: called under ``jax.jit``, ``jax.vmap``, ``jax.grad``: call
                ``init`` outside, then :meth:`update` inside one's own jitted loop.
        """
        refuse_transformation("BLR.init", rng_key, args, kwargs, init_params)
        batches = minibatches.lone(args, kwargs)
        args, kwargs = call_arguments(args, kwargs) if batches is None else batches.first()
        prepared = self._setup(as_key(rng_key), args, kwargs, init_params, minibatch=batches is not None)
        if self._autoguide is None:
            self.guide.params = plan_params(prepared.plan, prepared.state.nat)
        return prepared.state

    def _data(self, args, kwargs) -> tuple:
        """The array arguments of a call, converted like ``blr_fit``'s data, checked against
        those ``init`` compiled for, and validated as every fit validates its data (finite
        observations inside their support, no NaN reaching a distribution's parameters).
        Arrays already validated (the same objects as at the last check) are not checked
        again; traced arrays (a call inside the user's ``jit``) cannot be."""
        prepared = self._require()
        args, kwargs = call_arguments(args, kwargs)
        dyn = self._arrays(prepared, args, kwargs)
        prepared = self._prepared  # (new concrete data: a fit compiled for them)
        seen = _arrays_of(args, kwargs)
        if not _same_objects(seen, self._checked) and not _is_traced(dyn):
            bundle = prepared.bundle
            spec, given = DataSpec.split(args, kwargs, all_static=prepared.data_spec.all_static)
            if not _same_objects(tuple(dyn), given):  # (converted: validated as such)
                args, kwargs = spec.merge(dyn)
            trace_model(self.model, args, kwargs, jax.random.key(0), tracer=bundle.tracer)
            self._checked = seen
        return dyn

    def _run_data(self, prepared, dyn):
        """The compiled chunk's data for these arrays (with their precomputed statistics,
        recomputed only when the arrays are new)."""
        if prepared.bundle.statistics_fn is None and prepared.bundle.tables_fn is None:
            return dyn
        if _is_traced(dyn):
            return prepared.bundle.run_data(dyn)
        if self._statistics is None or not _same_objects(self._statistics[0], tuple(dyn)):
            self._statistics = (tuple(dyn), prepared.bundle.run_data(dyn))
        return self._statistics[1]

    def _arrays(self, prepared, args, kwargs) -> tuple:
        if prepared.data_spec.all_static:
            # the model needed concrete data: the compiled fit holds the data of init
            if _is_traced((args, kwargs)):
                raise BLRError(
                    "this model uses its data as concrete values (len(set(x)), a boolean mask, int() or "
                    "`if` on them), so its compiled fit holds them as constants and cannot take data traced "
                    "by jax.jit, vmap or scan: call update outside the transformation, or compute those "
                    "values outside the model and pass them as arguments"
                )
            spec, _ = DataSpec.split(args, kwargs, all_static=True)
            same = spec.treedef == prepared.data_spec.treedef and all(
                i == j and np.array_equal(np.asarray(a), np.asarray(b))
                for (i, a), (j, b) in zip(spec.static, prepared.data_spec.static)
            )
            if not same:
                self._prepare_for(args, kwargs)
            return ()
        spec, dyn = DataSpec.split(args, kwargs)
        compiled_for = split_run_data(prepared.dyn_data)[0]
        same = spec.treedef == prepared.data_spec.treedef and len(dyn) == len(compiled_for)
        same = same and all(jnp.shape(a) == jnp.shape(b) for a, b in zip(dyn, compiled_for))
        if not same:
            raise BLRError(
                "the model's arguments differ in structure or shape from those BLR.init compiled "
                "for; call init again with the new arguments"
            )
        # (the same values in another dtype: converted to the compiled program's where that keeps them)
        names = argument_names(args, kwargs)
        return tuple(as_compiled_dtype(a, b.dtype, n, "BLR.init") for a, b, n in zip(dyn, compiled_for, names))

    def _prepare_for(self, args, kwargs) -> None:
        """Compile (or fetch from the cache) the fit of a model that uses its data as concrete
        values (``len(set(x))``, ``y[y > 0]``, ``int(x.max())``, ``if`` on a data value) for new
        data: its compiled fit holds the data it was compiled for. The state of the previous
        data carries over when the latents keep their shapes.

        Raises:
            BLRError: the new data change the latent sites' shapes (e.g. another number of
                groups), so the state of the previous data cannot continue.
        """
        before, checked = self._require(), self._checked
        rng_key, num_steps = self._setup_with
        after = self._setup(rng_key, args, kwargs, None, num_steps)
        shapes = [jax.tree.map(jnp.shape, p.state.nat) for p in (before, after)]
        if jax.tree.structure(shapes[0]) != jax.tree.structure(shapes[1]) or shapes[0] != shapes[1]:
            self._prepared, self._checked = before, checked
            if self._autoguide is None:
                self.guide.plan = before.plan
            raise BLRError(
                "this model uses its data as concrete values (len(set(x)), a boolean mask, int() or "
                "`if` on them), and the new data change its latent sites' shapes, so the state of the "
                "data before cannot continue: call init (or run without init_state) with the new data"
            )
        self._updated_with = (object(),)  # (the state's ELBO is of the data before)

    def _require(self):
        if self._prepared is None:
            raise BLRError("call BLR.init (or BLR.run) before update, evaluate or get_params")
        return self._prepared

    # -- SVI interface -------------------------------------------------------------
    def update(self, state: BLRState, *args, forward_mode_differentiation: bool = False, **kwargs):
        """One BLR step: ``(state, *model args) -> (new state, loss)``, loss = −ELBO.

        Runs the compiled step; inside a user's ``jax.jit`` or ``lax.scan`` it is traced
        like any JAX function. ``forward_mode_differentiation`` is accepted for
        compatibility and ignored.
        """
        self._require()
        dyn = self._data(args, kwargs)
        prepared = self._prepared  # (new concrete data: a fit compiled for them)
        data = self._run_data(prepared, dyn)
        one = jnp.asarray(1, jnp.int32)
        history = prepared.history()
        bundle = prepared.bundle
        traced = _is_traced((state, data))
        if traced or not _same_objects(tuple(dyn), self._updated_with):
            # the state's ELBO is of other data (a new minibatch): the step's backtracking
            # compares with the ELBO of these data, computed afresh
            state = state._replace(elbo=jnp.full_like(state.elbo, jnp.nan))
        if not traced:
            self._updated_with = tuple(dyn)
        chunk = bundle.chunk_fn if traced else prepared.run_chunk
        tol = host_array(prepared.tol, jnp.result_type(float))
        new_state = chunk(state, data, one, prepared.rho, history, tol)[0]
        return new_state, -new_state.elbo

    def stable_update(self, state: BLRState, *args, **kwargs):
        """Like :meth:`update`; BLR steps never keep a non-finite state (backtracking)."""
        return self.update(state, *args, **kwargs)

    def evaluate(self, state: BLRState, *args, **kwargs) -> jax.Array:
        """The loss (negative ELBO) at ``state`` for these arguments."""
        self._require()
        dyn = self._data(args, kwargs)
        prepared = self._prepared
        return -prepared.bundle.elbo_fn(state.nat, self._run_data(prepared, dyn), state.rng_key)

    def get_params(self, state: BLRState) -> dict:
        """The guide's parameters at ``state``."""
        prepared = self._require()
        if self._autoguide is not None:
            return autoguides.params(self._autoguide, prepared.plan, state.nat)
        return plan_params(prepared.plan, state.nat)

    def run(
        self,
        rng_key,
        num_steps: int,
        *args,
        progress_bar: bool = True,
        stable_update: bool = False,
        forward_mode_differentiation: bool = False,
        init_state: BLRState | None = None,
        init_params: dict | None = None,
        **kwargs,
    ) -> BLRRunResult:
        """Fit for at most ``num_steps`` steps (stopping earlier at convergence).

        Args:
            rng_key: a ``jax.random`` key.
            num_steps: the most steps to run.
            *args, **kwargs: the model's arguments, or one :class:`blrppl.Minibatches`: a step
                per batch, each read ahead on a host thread (docs/scaling.md).
            progress_bar: show a progress bar.
            stable_update, forward_mode_differentiation: accepted for compatibility with
                ``SVI.run`` and ignored.
            init_state: continue from this state (of a previous ``run`` or ``init``).
            init_params: starting values, as in :meth:`init`.

        Returns:
            :class:`BLRRunResult` ``(params, state, losses)``; the full
            :class:`blrppl.BLRResult` is ``self.result``.
        """
        refuse_transformation("BLR.run", rng_key, args, kwargs, init_state, init_params)
        num_steps = fit_options(num_steps=num_steps).num_steps
        batches, feed = minibatches.lone(args, kwargs), None
        if batches is not None:
            first = batches.first()
            prepared = self._setup(as_key(rng_key), *first, init_params, num_steps, minibatch=True)
            feed = minibatches.BatchFeed.of_fit(batches, first, prepared)
        elif init_state is None or self._prepared is None:
            args, kwargs = call_arguments(args, kwargs)
            prepared = self._setup(as_key(rng_key), args, kwargs, init_params, num_steps)
        else:
            self._require()
            dyn = self._data(args, kwargs)
            prepared = dataclasses.replace(self._prepared, dyn_data=self._run_data(self._prepared, dyn))
        if init_state is not None:
            # its ELBO may be of other data: recomputed for these before the first step
            init_state = init_state._replace(elbo=jnp.full_like(init_state.elbo, jnp.nan))
        state = prepared.state if init_state is None else init_state
        with out_of_memory_as_error("the fit"):
            result = run_fit(prepared, state, num_steps, progress_bar, grid_scales=MAX_SCALES, feed=feed)
        if batches is not None:
            result.message += f"; {minibatches.batches_note(batches)}"
        self.result = result
        params = self.get_params(result.state)
        if self._autoguide is None:
            self.guide.params = params
        return BLRRunResult(params, result.state, jnp.asarray(-result.elbo))
