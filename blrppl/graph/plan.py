"""The static plan the jitted step is built from: blocks, factors and estimators.

A *block* is one latent site with its candidate family and the map between the site's
value layout and the family's canonical layout (batch dims first). A *factor* is one
sample site's log-density term, with the blocks it touches, the kind of each argument and
the estimator that computes its expected log-density.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from blrppl.families.base import Family


def _split(x, sizes, axis: int) -> list:
    """``x`` cut along ``axis`` into consecutive pieces of ``sizes``."""
    if hasattr(jax.lax, "split"):  # (JAX ≥ 0.4.36)
        return jax.lax.split(x, sizes, axis=axis) if sizes else []
    return jnp.split(x, np.cumsum(sizes)[:-1], axis=axis)


def _strided_view(view, positions: np.ndarray, member):
    """The marginal view of a member stored time-major in a banded joint block: its means
    and variances, and the covariance of each scalar with the next ``d`` of its own
    (``d`` ≤ the member family's bandwidth) where their distance in the block is within
    the block's band (zero past it: the band is all the view holds)."""
    from blrppl.families.gaussian import GaussianView
    from blrppl.families._band import to_dense
    from blrppl.families.gaussian_banded import BandedGaussianView

    width = member.family.bandwidth + 1 if member.family.banded else member.size
    n, band = positions.size, view.cov.shape[-1] - 1
    ahead = np.arange(width)[None, :] + np.arange(n)[:, None]
    distance = positions[np.minimum(ahead, n - 1)] - positions[:, None]
    held = (ahead < n) & (distance <= band)
    rows = jnp.where(held, view.cov[positions[:, None], np.where(held, distance, 0)], 0.0)
    if member.family.banded:
        return BandedGaussianView(view.mean[positions], rows)
    return GaussianView(view.mean[positions], to_dense(rows))


def site_values(members, flat_values) -> dict:
    """Flat positions (leading dims allowed) → {member site: value of its shape}."""
    lead = jnp.shape(flat_values)[:-1]
    out, offset = {}, 0
    for m in members:
        size = int(math.prod(m.value_shape))
        out[m.name] = jnp.reshape(flat_values[..., offset : offset + size], lead + tuple(m.value_shape))
        offset += size
    return out


@dataclasses.dataclass(frozen=True)
class SubsampledPlate:
    """A plate declared with ``subsample_size``: each step sees ``subsample_size`` of its
    ``size`` elements (a minibatch drawn by random reshuffling).

    Attributes:
        name: plate name.
        size: N, the number of elements.
        subsample_size: M, the minibatch size.
        dim: the plate's dim (counted from the right of the batch dims).
    """

    name: str
    size: int
    subsample_size: int
    dim: int

    @property
    def scale(self) -> float:
        """N/M: the weight of a minibatch term in the full-data objective."""
        return self.size / self.subsample_size

    @property
    def steps_per_epoch(self) -> int:
        """Minibatches per pass over the data (the last N mod M elements of a reshuffled
        order wait for the next epoch)."""
        return self.size // self.subsample_size


@dataclasses.dataclass(frozen=True)
class LocalAxis:
    """Where a local block meets its subsampled plate.

    Attributes:
        plate: name of the subsampled plate.
        axis: position of the plate in the block's value shape.
        size: N, the plate's full size.
    """

    plate: str
    axis: int
    size: int


@dataclasses.dataclass(frozen=True)
class Block:
    """One latent site and its candidate family.

    Attributes:
        name: site name.
        family: the candidate family (static configuration).
        kind: family name (``"gaussian"``, ``"gamma"``, ...), for display and messages: what
            the code reads of a block's family are the family's own flags and methods.
        value_shape: shape of the site value.
        plate_axes: for dense Gaussian blocks, axes of the value that are independent plate
            elements (batch dims of the canonical layout); the remaining axes are flattened
            into the dense event dimension.
        support_values: for discrete blocks, the values enumerated.
        transform: for Gaussian blocks on an unconstrained space, the bijection to the
            site's support (``numpyro.distributions.biject_to``); the block variable u is
            unconstrained and the site value is ``transform(u)``.
        site_shape: shape of the site value when it differs from ``value_shape`` (the
            shape of the block variable), as for the simplex (K values, K − 1 unconstrained).
        members: for a joint block, the blocks of the sites it holds: a dense Gaussian over
            their scalars, or a categorical over the product of their values (discrete
            latents coupled in a factor, e.g. ``z``'s probabilities depending on ``y``).
        point: a delta-method block: factors see it at its mean and its update is a
            Newton step (its precision is the negative Hessian: Laplace's method).
        param: a ``numpyro.param`` site (always also ``point``): not random, no prior, no
            log|det J| term; its update maximises the expected log factors over its value
            (Newton's method on the unconstrained space iterated to convergence: the
            M-step of EM) and its posterior is a point mass.
        local: for a *local* block (a latent inside a subsampled plate), the
            :class:`LocalAxis` of that plate: ``value_shape`` is then the minibatch shape
            (the plate axis has the subsample size M) and the fitted state holds λ for all
            N elements (:attr:`full`).
        interleaved: for a joint Gaussian block, how many of its last members are stored
            time-major: members of the same leading length L (a state-space model's state
            written as one site per component, ``level`` and ``slope`` in a ``scan``) laid
            out step by step, ``[a_0, b_0, a_1, b_1, …]``, after the other members
            concatenated: a chain in its steps has a banded precision in that order
            (:meth:`split`, :meth:`join`, :meth:`member_positions`).
        value_moments: a Gaussian block on an interval's logit space (a persistence
            ``phi ~ Uniform(-1, 1)``) whose closed-form factors read its site value
            φ = g(u) as a first power (``phi * (x_prev - mu)``): they see φ through its
            moments E[g(u)], Var[g(u)] under q (Gauss–Hermite), exact for densities whose
            expectation depends on the argument only through its first two moments
            (:func:`blrppl.moments.linearised.support_view`). Their messages to it are not
            conjugate (they depend on q(u)).
    """

    name: str
    family: Family
    kind: str
    value_shape: tuple
    plate_axes: tuple = ()
    support_values: tuple | None = None
    transform: Any = None
    site_shape: tuple | None = None
    members: tuple = ()
    point: bool = False
    param: bool = False
    local: "LocalAxis | None" = None
    value_moments: bool = False
    interleaved: int = 0

    @property
    def sites(self) -> tuple:
        """Names of the sites the block holds (one, or several for a joint block)."""
        return tuple(m.name for m in self.members) if self.members else (self.name,)

    def time_major_layout(self) -> tuple:
        """(members concatenated first, members stored time-major, their steps L, each
        one's scalars per step) of a joint block (:attr:`interleaved`)."""
        cut = len(self.members) - self.interleaved
        head, tail = self.members[:cut], self.members[cut:]
        steps = tail[0].value_shape[0] if tail else 0
        return head, tail, steps, [m.size // steps for m in tail]

    def split(self, x):
        """Block value (site layout, optional leading dims) → {member site: block-space value}."""
        lead = jnp.shape(x)[:-1]
        head, tail, steps, widths = self.time_major_layout()
        # one split operation, not a slice per member (a joint block may hold many sites)
        sizes = [m.size for m in head] + ([steps * sum(widths)] if tail else [])
        pieces = _split(x, sizes, len(lead))
        out = {m.name: jnp.reshape(p, lead + m.value_shape) for m, p in zip(head, pieces)}
        if tail:
            rows = jnp.reshape(pieces[-1], lead + (steps, sum(widths)))
            for m, p in zip(tail, _split(rows, widths, len(lead) + 1)):
                out[m.name] = jnp.reshape(p, lead + m.value_shape)
        return out

    def join(self, parts: dict):
        """:meth:`split`'s inverse: {member site: value} (no leading dims) → the block value
        (NumPy arrays stay NumPy)."""
        head, tail, steps, _ = self.time_major_layout()
        values = [parts[m.name] for m in self.members]
        xp = np if all(isinstance(v, np.ndarray) for v in values) else jnp
        flat = [xp.ravel(parts[m.name]) for m in head]
        if tail:
            flat.append(xp.concatenate([xp.reshape(parts[m.name], (steps, -1)) for m in tail], axis=1).ravel())
        return xp.concatenate(flat)

    def member_positions(self) -> list:
        """For each member of a joint block, the block positions of its scalars (C order)."""
        head, tail, steps, widths = self.time_major_layout()
        out, offset = [], 0
        for m in head:
            out.append(np.arange(offset, offset + m.size))
            offset += m.size
        stride, column = sum(widths), 0
        for w in widths:
            out.append((offset + stride * np.arange(steps)[:, None] + column + np.arange(w)[None, :]).ravel())
            column += w
        return out

    def member_views(self, view):
        """(member block, its marginal Gaussian view) for each member of a joint block."""
        from blrppl.families.gaussian import DiagGaussianView, GaussianView
        from blrppl.families._band import to_dense
        from blrppl.families.gaussian_banded import BandedGaussianView

        out, offset = [], 0
        for m, positions in zip(self.members, self.member_positions()):
            sl = slice(offset, offset + m.size)
            if self.family.banded and not (positions.size and positions[-1] - positions[0] == m.size - 1):
                out.append((m, _strided_view(view, positions, m)))
                continue
            if self.family.arrowhead:
                # a local member: its marginal variances; a global one: its dense block
                glob = np.searchsorted(self.family.global_index, np.arange(sl.start, sl.stop))
                if m.family.dense_event:
                    out.append((m, GaussianView(view.mean[sl], view.glob[np.ix_(glob, glob)])))
                else:
                    loc = np.searchsorted(self.family.local_index, np.arange(sl.start, sl.stop))
                    shape = tuple(m.value_shape)
                    out.append((m, DiagGaussianView(view.mean[sl].reshape(shape), view.var[loc].reshape(shape))))
            elif self.family.banded:
                # the band rows of the member's stretch, without the entries past its end (a
                # member within one band is dense: every covariance of it is in the band)
                inside = np.arange(m.size)[:, None] + np.arange(view.cov.shape[-1])[None, :] < m.size
                band = jnp.where(inside, view.cov[sl], 0.0)
                if m.family.banded:
                    out.append((m, BandedGaussianView(view.mean[sl], band)))
                else:
                    out.append((m, GaussianView(view.mean[sl], to_dense(band[:, : m.size]))))
            else:
                out.append((m, GaussianView(view.mean[sl], view.cov[sl, sl])))
            offset += m.size
        return out

    @property
    def joint_states(self) -> np.ndarray:
        """For a joint discrete block: ``(K, members)``, the members' values in each of the
        block's K states (the product of their supports, the first member slowest)."""
        return np.array(list(itertools.product(*[m.support_values for m in self.members])))

    def discrete_site_values(self, state, broadcast: bool = False) -> dict:
        """Site → value array (every element at one value) of a discrete block in state
        ``state`` (an index into ``support_values``; traceable); with ``broadcast``, of
        shape 1 along every dim (see :attr:`blrppl.estimators.enumeration.Enumeration.broadcast`)."""
        shape = (1,) * len(self.value_shape) if broadcast else self.value_shape
        if self.members:
            row = jnp.asarray(self.joint_states)[state]
            return {m.name: jnp.full(shape, row[i], dtype=row.dtype) for i, m in enumerate(self.members)}
        support = jnp.asarray(self.support_values)
        return {self.name: jnp.full(shape, support[state], dtype=support.dtype)}

    def member_probs(self, probs) -> list:
        """(member block, its marginal probabilities ``(*B, K_m)``) for each member of a joint
        discrete block whose state probabilities are ``probs`` ``(*B, K)``."""
        sizes = [len(m.support_values) for m in self.members]
        table = jnp.reshape(probs, jnp.shape(probs)[:-1] + tuple(sizes))
        lead = jnp.ndim(probs) - 1
        out = []
        for i, m in enumerate(self.members):
            others = tuple(lead + j for j in range(len(sizes)) if j != i)
            out.append((m, jnp.sum(table, axis=others) if others else table))
        return out

    @property
    def discrete(self) -> bool:
        return self.family.discrete

    @property
    def chain(self) -> bool:
        """Whether the block is a chain of discrete latents (a hidden Markov chain): its value
        is the flat sequence of its sites' positions (:mod:`blrppl.graph.markov`)."""
        return getattr(self.family, "length", None) is not None and self.family.discrete

    def chain_site_values(self, states) -> dict:
        """Chain positions' states (indices into ``support_values``, flat position order,
        leading dims allowed) → {site: value}."""
        return site_values(self.members or (self._site_block(),), jnp.asarray(self.support_values)[states])

    def _site_block(self) -> "Block":
        return dataclasses.replace(self, value_shape=self.site_shape or self.value_shape)

    def chain_site_probs(self, probs) -> list:
        """(member site block, its marginals ``(*shape, K)``) from the chain's marginals
        ``(C, L, K)``."""
        flat = jnp.reshape(jnp.swapaxes(probs, 0, 1), (-1, probs.shape[-1]))
        out, offset = [], 0
        for m in self.members or (self._site_block(),):
            size = int(math.prod(m.value_shape))
            out.append((m, jnp.reshape(flat[offset : offset + size], tuple(m.value_shape) + flat.shape[-1:])))
            offset += size
        return out

    @property
    def subsample_scale(self) -> float:
        """N/M for a local block (its minibatch terms stand for all N elements), else 1."""
        if self.local is None:
            return 1.0
        return self.local.size / self.value_shape[self.local.axis]

    @property
    def nat_axis(self) -> int:
        """Axis of the subsampled plate in the leaves of the natural parameters (canonical
        layout: a dense Gaussian's plate axes lead in ``plate_axes`` order; the other
        families keep the value layout, with event dims last)."""
        if self.local is None:
            raise ValueError(f"block '{self.name}' is not local")
        if self.family.dense_event:
            return self.plate_axes.index(self.local.axis)
        return self.local.axis

    @property
    def full(self) -> "Block":
        """A local block at its full size (N elements along the subsampled plate): the layout
        of its fitted state and posterior. A global block is returned as it is."""
        if self.local is None:
            return self
        axis, size = self.local.axis, self.local.size

        def widen(shape):
            return None if shape is None else tuple(size if a == axis else s for a, s in enumerate(shape))

        return dataclasses.replace(self, value_shape=widen(self.value_shape), site_shape=widen(self.site_shape))

    @property
    def _perm(self):
        other = tuple(a for a in range(len(self.value_shape)) if a not in self.plate_axes)
        return self.plate_axes + other

    @property
    def batch_shape(self) -> tuple:
        """Batch shape of the canonical layout."""
        return self.family.canonical_batch_shape(tuple(self.value_shape), tuple(self.plate_axes))

    @property
    def size(self) -> int:
        """Number of scalar latent dimensions."""
        return int(math.prod(self.value_shape))

    @property
    def element_size(self) -> int:
        """Scalars per plate element of a dense family (D for the rows of ``X`` in
        ``X @ C.T``), else 1: the terms of one element of a product of two blocks."""
        if not self.family.dense_event:
            return 1
        return int(math.prod(s for i, s in enumerate(self.value_shape) if i not in self.plate_axes))

    def to_canonical(self, x):
        """Site layout → canonical layout (``x`` may carry leading sample dims)."""
        if not self.family.dense_event:
            return x
        xp = np if isinstance(x, np.ndarray) else jnp
        lead = xp.ndim(x) - len(self.value_shape)
        perm = tuple(range(lead)) + tuple(lead + a for a in self._perm)
        x = xp.transpose(x, perm)
        return xp.reshape(x, xp.shape(x)[:lead] + self.batch_shape + (-1,))

    def to_site(self, x):
        """Canonical layout → site layout (``x`` may carry leading sample dims)."""
        if not self.family.dense_event:
            return x
        xp = np if isinstance(x, np.ndarray) else jnp
        lead = xp.ndim(x) - len(self.batch_shape) - 1
        permuted = tuple(self.value_shape[a] for a in self._perm)
        x = xp.reshape(x, xp.shape(x)[:lead] + permuted)
        inv = np.argsort(self._perm)
        return xp.transpose(x, tuple(range(lead)) + tuple(lead + int(a) for a in inv))


class FactorRole:
    """What a factor's term is (:attr:`Factor.role`)."""

    #: a sample site's log-density (or, stacked, several sites')
    SITE = "site"
    #: the log|det J| term of a Gaussian block on an unconstrained space (a pseudo-factor)
    JACOBIAN = "jacobian"
    #: the previous posterior of an online update, the prior of its block (a pseudo-factor)
    PREVIOUS = "previous"


@dataclasses.dataclass(frozen=True)
class EstimatorSpec:
    """What an estimator records of one factor beyond the fields every factor has
    (:attr:`Factor.spec`): the base of each estimator's own record, which lives in the
    estimator's module (:class:`blrppl.estimators.exact.ExactSpec`,
    :class:`blrppl.estimators.quadrature.QuadratureSpec`). An estimator with nothing to
    record (Monte Carlo, delta, the pseudo-factors) uses this empty record.

    (It is defined here, not in :mod:`blrppl.estimators`, because the estimators' modules
    import this one.)

    The class attributes below are the answers every spec gives to the questions code that
    does not know the factor's estimator asks of any factor; a spec that records them
    declares them as fields of its own. They are the only such questions: an estimator's
    other extras are read by its own module only.

    Attributes:
        links: ``(name, leaf index or "value", link)`` of each scalar projection η = g⁻¹(leaf)
            the factor is read through, for a factor without a rule (its arguments,
            :func:`blrppl.model.functions.factor_arguments`); empty here.
        powers: ``(argument, a)`` of every argument that is c·τ^a in a Gamma block; empty here.
        pairs: ``(argument, ((A, B), ...))`` of every argument that is a product of affine
            forms of the Gaussian blocks A and B; empty here.
        statistics: the data statistics the factor's expectation comes from instead of its
            arguments' moments (:class:`blrppl.estimators.gram.GramSource`,
            :class:`blrppl.estimators.bilinear.BilinearSource`); None here.
    """

    links = ()
    powers = ()
    pairs = ()
    statistics = None

    @property
    def from_statistics(self) -> bool:
        """Whether the factor's expectation comes from data statistics (:attr:`statistics`)
        rather than from the moments of its arguments."""
        return self.statistics is not None


@dataclasses.dataclass(frozen=True)
class Factor:
    """One log-density term of the model.

    Attributes:
        name: site name.
        dist_name: name of the (unwrapped) distribution.
        observed: whether the site is observed (else it is the prior of its own block).
        neighbours: blocks the factor touches, in model order.
        discrete: the discrete neighbours (enumerated).
        estimator: the name of its estimator: ``"exact"`` (closed-form rule),
            ``"quadrature"``, ``"monte_carlo"`` or ``"delta"`` (no closed form, but every
            continuous neighbour is a point block: log f at the points, exact). What the
            estimator is (closed form, deterministic, ...) is asked of its registered object,
            :func:`blrppl.estimators.registry.estimator_of`, never of the name.
        rule: the rule computing the expected log-density.
        arg_kinds: kind of each argument and of the value (see :mod:`blrppl.moments.kinds`).
        arg_blocks: blocks each argument depends on.
        columns: for each Gaussian neighbour, ``"gather"`` (each element of an argument
            uses one plate element of the block) or ``"full"`` (elements mix plate elements).
        reinterpreted_ndim: trailing batch dims summed as event dims.
        subsampled: names of the subsampled plates the factor sits in (its minibatch
            terms carry the weight N/M, applied by numpyro's plate as the site's scale).
        why: for a factor without a closed form, why (the argument whose form no rule
            reads, and what that form is: read off the model's program).
        members: for a stacked factor (:mod:`blrppl.graph.stack`), the sites it holds (its
            elements along a new leading axis); empty for one site.
        role: what the term is, a :class:`FactorRole` (a site's log-density, or a
            pseudo-factor: a block's log|det J| term or an online update's previous
            posterior; pseudo-factors are named ``"<block>:jacobian"`` and
            ``"<block>:previous"`` for display only).
        spread: for a latent's prior, ``(argument, sites)`` of each argument setting its
            spread (a scale, a covariance, a concentration) that reads other latent sites
            (a hierarchical model's group sd, a Beta's pooled concentration): what its
            poor-q advice names (:func:`blrppl.engine.advice.poor_q_advice`).
        spec: the estimator's own record of the factor, an :class:`EstimatorSpec` of the
            estimator's type (an exact factor's Gamma powers, multiplied pairs and data
            statistics; a quadrature factor's projections or the scalars its grid rule reads).
        enumeration: how the factor's discrete neighbours are enumerated, a
            :class:`blrppl.estimators.enumeration.Enumeration` (the chain positions each
            element reads, a chain's transition table, labels passed with size-1 plate dims);
            None for a factor without discrete neighbours, or enumerated the default way.
    """

    name: str
    dist_name: str
    observed: bool
    neighbours: tuple
    discrete: tuple
    estimator: str
    rule: Any
    arg_kinds: tuple
    arg_blocks: tuple
    columns: tuple
    reinterpreted_ndim: int
    subsampled: tuple = ()
    why: str = ""
    members: tuple = ()
    role: str = FactorRole.SITE
    spread: tuple = ()
    spec: EstimatorSpec = EstimatorSpec()
    enumeration: Any = None

    @property
    def kinds(self) -> dict:
        return dict(self.arg_kinds)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static description of a compiled model: what is fitted and how.

    Attributes:
        blocks: the latent blocks, in model order.
        factors: the factors, in model order.
        order: the order in which the sequential schedule updates blocks.
        conjugate: per block, whether every factor's message to it is independent of its
            own parameters (then ρ = 1 is an exact coordinate step).
        subsampled: the :class:`SubsampledPlate` s of the model (empty: every step sees
            all the data). With subsampled plates the blocks inside them are *local*
            (``Block.local``) and the others *global*.
        tied: ``(block, factor, side)`` for every factor on a block whose rows share one
            covariance (:class:`blrppl.families.GaussianTied`): the facts of the data the
            plan was compiled on that a fit on other data checks again
            (:func:`blrppl.compiler.finish.tied_blocks`).
        barren: latent sites left out of the fit because no other site reads them
            (:func:`blrppl.compiler.dependencies.barren_latents`): integrated out exactly, drawn
            from the model given the others.
        event_ndims: ``(site, event dims)`` of every latent site as the model samples it (its
            distribution's ``event_dim``; the dims before them are batch dims, plates'
            among them), for a guide whose sites match the model's.
    """

    blocks: tuple
    factors: tuple
    order: tuple
    conjugate: tuple = ()
    subsampled: tuple = ()
    tied: tuple = ()
    barren: tuple = ()
    event_ndims: tuple = ()

    @property
    def local_blocks(self) -> tuple:
        """Names of the local blocks (latents inside a subsampled plate)."""
        return tuple(b.name for b in self.blocks if b.local is not None)

    def plate(self, name: str) -> SubsampledPlate:
        for p in self.subsampled:
            if p.name == name:
                return p
        raise KeyError(name)

    def block(self, name: str) -> Block:
        for b in self.blocks:
            if b.name == name:
                return b
        raise KeyError(name)

    def factors_of(self, name: str) -> tuple:
        return tuple(f for f in self.factors if name in f.neighbours)

    def role(self, name: str) -> str:
        """What a block's fit is: ``"posterior"`` (a candidate posterior), ``"param (M-step)"``
        (a ``numpyro.param`` point estimate), ``"point (unconstrained)"`` (delta method with
        the log|det J| term: Laplace on the unconstrained space) or ``"point (constrained)"``
        (delta method without it: the mode in the site's own space)."""
        b = self.block(name)
        if b.param:
            return "param (M-step)"
        if b.point:
            jacobian = any(f.role == FactorRole.JACOBIAN and f.neighbours == (name,) for f in self.factors)
            return "point (unconstrained)" if jacobian or b.transform is None else "point (constrained)"
        return "posterior"

    def structure_digest(self) -> str:
        """A digest of what compiling found from the data beyond ``describe()``: the chain
        positions each factor element reads (programs built for one are wrong for another)."""
        h = hashlib.blake2b(digest_size=16)
        for f in self.factors:
            if f.enumeration is None:
                continue
            for name, reads in f.enumeration.chain_reads:
                h.update(f"{f.name}/{name}".encode())
                h.update(np.ascontiguousarray(reads.lo).tobytes())
                h.update(np.ascontiguousarray(reads.hi).tobytes())
            if f.enumeration.table is not None:
                h.update(f"{f.name}/table".encode())
        return h.hexdigest()

    def describe(self) -> str:
        """A readable table of blocks (site, family, shape, role) and factors (site,
        distribution, neighbours, estimator), then the order of the sequential sweep."""
        conj = dict(self.conjugate)
        sub = bool(self.subsampled)
        rows = [("block", "family", "shape", "size", "conjugate", "role") + (("scope",) if sub else ())]
        for b in self.blocks:
            full = b.full
            kind = f"{b.kind} (bandwidth {b.family.bandwidth})" if b.family.banded else b.kind
            if b.interleaved:
                steps = ", ".join(m.name for m in b.time_major_layout()[1])
                kind = kind[:-1] + f"; {steps} step by step)" if b.family.banded else f"{kind} ({steps} step by step)"
            if b.family.tied_rows:
                kind = f"{b.kind} (rows share one covariance)"
            if b.family.arrowhead:
                local = ", ".join(m.name for m in b.members if not m.family.dense_event)
                kind = f"{b.kind} ({b.family.num_globals} dense + {local} diagonal)"
            if b.chain:
                width = full.size // b.family.length
                kind = f"{b.kind} ({width} × {b.family.length} states: forward-backward)"
            row = (b.name, kind, str(full.value_shape), str(full.size), str(conj.get(b.name, "-")), self.role(b.name))
            if sub:
                if b.local is None:
                    scope = "global"
                else:
                    p = self.plate(b.local.plate)
                    scope = f"local ({p.name}: {p.subsample_size} of {p.size} per step)"
                row += (scope,)
            rows.append(row)
        out = _table(rows)
        why = any(f.why for f in self.factors)
        rows = [("factor", "distribution", "neighbours", "estimator", "arguments") + (("scale",) if sub else ())]
        rows[0] += ("why not exact",) if why else ()
        for f in self.factors:
            args = ", ".join(f"{k}:{v}" for k, v in f.arg_kinds)
            statistics = f.spec.statistics
            shown = statistics is not None and statistics.shown(self)
            estimator = f"{f.estimator} (data statistics)" if shown else f.estimator
            if f.members:
                estimator += f" ({len(f.members)} sites stacked)"
            table = f.enumeration.table if f.enumeration is not None else None
            if table is not None:
                k = table.states.shape[0]
                estimator += f" (one {k} × {k} table)"
            row = (f.name, f.dist_name, ", ".join(f.neighbours) or "-", estimator, args)
            if sub:
                scale = math.prod(self.plate(p).scale for p in f.subsampled)
                row += (f"N/M = {scale:g}" if f.subsampled else "1",)
            rows.append(row + ((f.why or "-",) if why else ()))
        fixed = [b.name for b in self.blocks if b.name not in self.order]
        tail = "sequential order: " + (", ".join(self.order) or "-")
        if fixed:
            tail += "\nkept at their initial value (no factor uses them): " + ", ".join(fixed)
        if self.barren:
            tail += (
                "\nintegrated out (no other site reads them; drawn from the model given the others): "
                + ", ".join(self.barren)
            )
        out = out + "\n\n" + _table(rows) + "\n\n" + tail
        if sub:
            plates = ", ".join(
                f"'{p.name}' ({p.subsample_size} of {p.size} elements per step, reshuffled every "
                f"{p.steps_per_epoch} steps)"
                for p in self.subsampled
            )
            out = f"subsampled plates: {plates}\n\n" + out
        return out

    def __str__(self) -> str:
        return self.describe()


def _table(rows) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for k, r in enumerate(rows):
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
