"""Chains of categorical latents (hidden Markov chains): the structured discrete family.

A block of C independent chains of L categorical latents z_{c,0} … z_{c,L−1} over K values
(a hidden Markov model's states, written with ``scan`` or one site per step) has the
posterior family of a chain-structured Markov random field:

    q(z) ∝ exp( Σ_t ψ_t(z_t) + Σ_t Φ_t(z_t, z_{t+1}) )

in the overcomplete parametrisation λ = (ψ, Φ) (unary ``(C, L, K)`` and pairwise
``(C, L − 1, K, K)`` log-potentials), with sufficient statistics the one-hot states and
one-hot pairs, so the mean parameters μ = ∇A(λ) are the marginals q(z_t) and the pair
marginals q(z_t, z_{t+1}). A(λ) is the forward algorithm, the marginals forward–backward
(Rabiner 1989), O(C·L·K²): in a fit, the scaled recursions (each step normalised, K²
products a step), with the log-space ones where the scaled ones leave the dtype's range.

The Bayesian learning rule for a factor graph whose factors each read one state or one
pair of consecutive states: L = Σ_i E_q[log f_i] is linear in μ, so

    ψ̃_t(k) = ∂L/∂q(z_t = k),    Φ̃_t(j, k) = ∂L/∂q(z_t = j, z_{t+1} = k),
    λ ← (1 − ρ) λ + ρ λ̃;

at ρ = 1 this is the structured mean-field (VMP) update q(z) ∝ exp E_{q(other)}[log p]:
Baum–Welch's E-step with the expected log parameters when the transition and emission
probabilities are Dirichlet blocks (MacKay 1997; Beal 2003, ch. 3), the exact posterior
when they are known.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from numpyro.distributions import constraints

from blrppl.families.base import Family
from blrppl.families.categorical import CategoricalView
from blrppl.runtime.compile import jit as _jit


class ChainNat(NamedTuple):
    """Natural parameters of a block of chains (also the layout of their mean parameters).

    Attributes:
        unary: ψ, ``(C, L, K)`` (mean parameters: the marginals q(z_t = k)).
        pair: Φ, ``(C, L − 1, K, K)`` (mean parameters: q(z_t = j, z_{t+1} = k)).
    """

    unary: jax.Array
    pair: jax.Array


class ChainView(NamedTuple):
    """Marginals ``probs`` ``(C, L, K)`` and pair marginals ``pair_probs`` ``(C, L − 1, K, K)``
    (the mean parameters: what the enumerated factors are weighted by)."""

    probs: jax.Array
    pair_probs: jax.Array


def _logsumexp(xp, x, axis):
    m = xp.max(x, axis=axis, keepdims=True)
    m = xp.where(xp.isfinite(m), m, 0.0)
    return xp.squeeze(m, axis) + xp.log(xp.sum(xp.exp(x - m), axis=axis))


def _normalised(xp, x):
    """exp(x) / Σ exp(x) over the last axis: one exponential per element (not a second one
    of x − logsumexp(x), a chain's T·K² pair entries being most of its step's exponentials)."""
    m = xp.max(x, axis=-1, keepdims=True)
    e = xp.exp(x - xp.where(xp.isfinite(m), m, 0.0))
    return e / xp.sum(e, axis=-1, keepdims=True)


#: states (over all chains) above which numpy parameters go through the compiled scan: the
#: host loop costs ~17 µs per state and pass (3.5 s for a chain of 10⁵ states), compiling
#: the scan ~0.2 s
HOST_LOOP_STATES = 5_000


def _forward_backward(nat: ChainNat):
    """(log α, log β, log Z): log α_t(k) = log Σ over z_{<t} of the potentials up to t with
    z_t = k, log β_t(j) the same from the end; log-space recursions (lax.scan for jax
    arrays, a loop over the chain for numpy ones of at most :data:`HOST_LOOP_STATES` states:
    no program compiled on the host for small chains; numpy results for numpy input)."""
    unary, pair = nat
    if isinstance(unary, np.ndarray) and unary.shape[0] * unary.shape[1] > HOST_LOOP_STATES:
        out = _compiled_forward_backward(ChainNat(jnp.asarray(unary), jnp.asarray(pair)))
        return tuple(np.asarray(x) for x in out)
    if isinstance(unary, np.ndarray):
        xp, length = np, unary.shape[1]
        alpha = np.empty_like(unary)
        beta = np.zeros_like(unary)
        alpha[:, 0] = unary[:, 0]
        for t in range(1, length):
            alpha[:, t] = unary[:, t] + _logsumexp(np, alpha[:, t - 1, :, None] + pair[:, t - 1], 1)
        for t in range(length - 2, -1, -1):
            beta[:, t] = _logsumexp(np, pair[:, t] + (unary[:, t + 1] + beta[:, t + 1])[:, None, :], 2)
    else:
        xp, length, step = jnp, unary.shape[1], jax.lax.dynamic_index_in_dim

        def forward(t, alpha):
            before = step(alpha, t - 1, 1, keepdims=False)
            a = jax.nn.logsumexp(before[:, :, None] + step(pair, t - 1, 1, keepdims=False), axis=1)
            return jax.lax.dynamic_update_index_in_dim(alpha, step(unary, t, 1, keepdims=False) + a, t, 1)

        def backward(i, beta):
            t = length - 2 - i
            after = step(unary, t + 1, 1, keepdims=False) + step(beta, t + 1, 1, keepdims=False)
            b = jax.nn.logsumexp(step(pair, t, 1, keepdims=False) + after[:, None, :], axis=2)
            return jax.lax.dynamic_update_index_in_dim(beta, b, t, 1)

        # (the steps index the chain axis in place: see _scaled_view)
        alpha, beta = unary, jnp.zeros_like(unary)
        if length > 1:  # (a loop's body is traced even when it runs no step)
            alpha = jax.lax.fori_loop(1, length, forward, alpha)
            beta = jax.lax.fori_loop(0, length - 1, backward, beta)
    log_z = _logsumexp(xp, alpha[:, -1], -1)
    return alpha, beta, log_z


_compiled_forward_backward = _jit(_forward_backward)


def _scaled_view(nat: ChainNat) -> tuple:
    """(μ, log Z, ok) by the scaled forward–backward (Rabiner 1989, §V.A) on jax arrays.

    With u_t = exp(ψ_t − max ψ_t) and M_t = exp(Φ_t − max Φ_t) (all exponentials taken at
    once, outside the recursions),

        a_0 = u_0,   a_t = (â_{t−1} M_{t−1}) ⊙ u_t,   s_t = Σ_k a_t(k),   â_t = a_t / s_t,
        b_{L−1} = 1, b_t = M_t (u_{t+1} ⊙ b̂_{t+1}),  b̂_t = b_t / Σ_k b_t(k),

    so a_t ∝ α_t, b_t ∝ β_t, q(z_t) ∝ a_t ⊙ b_t, q(z_t, z_{t+1}) ∝ â_t(j) M_t(j, k) u_{t+1}(k)
    b_{t+1}(k), and log Z = Σ_t log s_t + Σ_t max ψ_t + Σ_t max Φ_t. Each step of the
    recursions is K² products, not the K² exponentials of a log-space step, and each is
    normalised on its own. The steps index the chain axis in place (a ``lax.scan`` over the
    chain axis moved to the front ran 4× slower on CPU: XLA transposes its inputs).

    ``ok`` is false when some normaliser (s_t, the backward sums, the marginals' sums) fell
    below √tiny of the dtype: the states carrying the mass were beyond the exponentials'
    range, and the log-space recursion must be used.
    """
    unary, pair = nat
    length = unary.shape[1]
    top_u = jnp.max(unary, -1, keepdims=True)
    u = jnp.exp(unary - top_u)
    top_p = jnp.max(pair, (-2, -1), keepdims=True)
    m = jnp.exp(pair - top_p)
    step = jax.lax.dynamic_index_in_dim

    def forward(t, carry):
        a_hat, out = carry
        a = jnp.sum(a_hat[:, :, None] * step(m, t - 1, 1, keepdims=False), 1) * step(u, t, 1, keepdims=False)
        return a / jnp.sum(a, -1, keepdims=True), jax.lax.dynamic_update_index_in_dim(out, a, t, 1)

    def backward(i, carry):
        t = length - 2 - i
        b_hat, out = carry
        b = jnp.sum(step(m, t, 1, keepdims=False) * (step(u, t + 1, 1, keepdims=False) * b_hat)[:, None, :], 2)
        return b / jnp.sum(b, -1, keepdims=True), jax.lax.dynamic_update_index_in_dim(out, b, t, 1)

    a0, a, b = u[:, 0], u, jnp.ones_like(u)
    if length > 1:  # (a loop's body is traced even when it runs no step)
        _, a = jax.lax.fori_loop(1, length, forward, (a0 / jnp.sum(a0, -1, keepdims=True), a))
        _, b = jax.lax.fori_loop(0, length - 1, backward, (jnp.ones_like(a0), b))
    s = jnp.sum(a, -1)
    log_z = jnp.sum(jnp.log(s), 1) + jnp.sum(top_u[..., 0], 1) + jnp.sum(top_p[..., 0, 0], 1)
    a_hat = a / s[..., None]
    p = a_hat * b
    p_sum = jnp.sum(p, -1, keepdims=True)
    pp = a_hat[:, :-1, :, None] * m * (u[:, 1:] * b[:, 1:])[:, :, None, :]
    pp_sum = jnp.sum(pp, (-2, -1), keepdims=True)
    floor = jnp.sqrt(jnp.finfo(u.dtype).tiny)
    ok = (jnp.min(s, initial=1.0) >= floor) & (jnp.min(jnp.sum(b, -1), initial=1.0) >= floor)
    ok = ok & (jnp.min(p_sum, initial=1.0) >= floor) & (jnp.min(pp_sum, initial=1.0) >= floor)
    ok = ok & jnp.all(jnp.isfinite(log_z))
    return ChainView(p / p_sum, pp / pp_sum), log_z, ok


@dataclasses.dataclass(frozen=True)
class CategoricalChain(Family):
    """C independent chains of ``length`` categorical states over ``dim`` values, in the
    overcomplete chain parametrisation (module docstring). Batch shape ``(C,)``, event
    shape ``(length,)``; values are indices into the block's enumerated values.

    * T(z) = (onehot(z_t), onehot(z_t) ⊗ onehot(z_{t+1})); base measure 1.
    * λ = (ψ, Φ) (:class:`ChainNat`); A(λ) = log Σ_z exp(Σ_t ψ_t(z_t) + Σ_t Φ_t(z_t, z_{t+1})).
    * μ = (q(z_t), q(z_t, z_{t+1})) = :class:`ChainView` (forward–backward).
    * H = A(λ) − ⟨λ, μ⟩.

    The compiler chooses it (:mod:`blrppl.graph.markov`); it is not selectable by name.

    Attributes:
        length: L, the states per chain.
        dim: K, the number of values of each state.
    """

    length: int
    dim: int
    name: ClassVar[str] = "categorical-chain"
    discrete: ClassVar[bool] = True
    indexes_support: ClassVar[bool] = True
    view_type: ClassVar[type] = ChainView
    support: ClassVar[str] = "discrete"

    @classmethod
    def fits(cls, support_values: tuple | None) -> bool:
        return False  # (never a default family: the compiler builds it for a chain)

    @property
    def event_shape(self) -> tuple[int, ...]:
        return (self.length,)

    def view(self, nat: ChainNat) -> ChainView:
        """Marginals and pair marginals by forward–backward."""
        return self._view_and_log_partition(nat)[0]

    def rule_view_and_entropy(self, nat: ChainNat) -> tuple:
        """(μ, H) from one forward–backward: H = A(λ) − ⟨λ, μ⟩ with A = log Z read off the
        same forward pass as the marginals."""
        view, log_z = self._view_and_log_partition(nat)
        return view, log_z - self._inner(nat, view)

    @staticmethod
    def _inner(nat: ChainNat, mu: ChainView) -> jax.Array:
        return jnp.sum(mu.probs * nat.unary, (-2, -1)) + jnp.sum(mu.pair_probs * nat.pair, (-3, -2, -1))

    def _view_and_log_partition(self, nat: ChainNat) -> tuple:
        if not isinstance(nat.unary, np.ndarray):
            view, log_z, ok = _scaled_view(nat)
            return jax.lax.cond(ok, lambda: (view, log_z), lambda: self._log_space_view(nat))
        return self._log_space_view(nat)

    def _log_space_view(self, nat: ChainNat) -> tuple:
        """(μ, log Z) by the forward–backward in log space: numpy arrays, and jax arrays
        whose scaled recursion (:func:`_scaled_view`) left the dtype's range."""
        xp = np if isinstance(nat.unary, np.ndarray) else jnp
        alpha, beta, log_z = _forward_backward(nat)
        # each step normalised on its own (not by the chain's log Z: in float32 the rounding
        # of a log Z of −10⁴ alone would move every marginal by 10⁻³)
        log_p = alpha + beta
        probs = _normalised(xp, log_p)
        log_pair = alpha[:, :-1, :, None] + nat.pair + (nat.unary[:, 1:] + beta[:, 1:])[:, :, None, :]
        shape = log_pair.shape
        flat = xp.reshape(log_pair, shape[:2] + (shape[2] * shape[3],))
        pair = xp.reshape(_normalised(xp, flat), shape)
        return ChainView(probs, pair), log_z

    def nat_from_view(self, view) -> ChainNat:
        """The chain with these marginals: ψ_t = log q(z_t), Φ_t = log q(z_t, z_{t+1}) −
        log q(z_t) − log q(z_{t+1}) (a chain is the product of its pair marginals over its
        marginals). A :class:`~blrppl.families.CategoricalView` of per-state probabilities
        (flat positions, see :meth:`canonical`) gives independent states (a fit's start)."""
        xp = np if isinstance(view.probs, np.ndarray) else jnp
        tiny = np.finfo(np.float32).tiny
        if isinstance(view, CategoricalView):
            probs = self.canonical(view.probs)
            unary = xp.log(xp.maximum(probs, tiny))
            c = probs.shape[0]
            return ChainNat(unary, xp.zeros((c, max(self.length - 1, 0), self.dim, self.dim), unary.dtype))
        log_p = xp.log(xp.maximum(view.probs, tiny))
        log_pair = xp.log(xp.maximum(view.pair_probs, tiny))
        return ChainNat(log_p, log_pair - log_p[:, :-1, :, None] - log_p[:, 1:, None, :])

    def canonical(self, x):
        """Per-position arrays in the block's flat position order (position p = t·C + c,
        leading axis) → ``(C, L, ...)``."""
        xp = np if isinstance(x, np.ndarray) else jnp
        tail = x.shape[1:]
        return xp.swapaxes(xp.reshape(x, (self.length, -1) + tail), 0, 1)

    def flat(self, x):
        """Draws ``(*S, C, L)`` → ``(*S, L·C)`` in flat position order."""
        xp = np if isinstance(x, np.ndarray) else jnp
        x = xp.swapaxes(x, -1, -2)
        return xp.reshape(x, x.shape[:-2] + (-1,))

    def mean_params(self, nat: ChainNat) -> ChainView:
        return self.view(nat)

    def mean_params_in(self, view: ChainView) -> ChainView:
        return view

    def log_partition(self, nat: ChainNat) -> jax.Array:
        return _forward_backward(nat)[2]

    def sufficient_stats(self, x: jax.Array) -> ChainNat:
        x = jnp.asarray(x).astype(jnp.int32)
        one = jax.nn.one_hot(x, self.dim, dtype=jnp.result_type(float))
        return ChainNat(one, one[..., :-1, :, None] * one[..., 1:, None, :])

    def log_prob(self, nat: ChainNat, x: jax.Array) -> jax.Array:
        """log q(z) = Σ_t ψ_t(z_t) + Σ_t Φ_t(z_t, z_{t+1}) − A(λ), the potentials read at the
        states (not ⟨T(z), λ⟩ with one-hot pairs: T·K² numbers per draw)."""
        x = jnp.asarray(x).astype(jnp.int32)
        lead = x.shape[:-2]
        unary = jnp.broadcast_to(nat.unary, lead + nat.unary.shape)
        inner = jnp.sum(jnp.take_along_axis(unary, x[..., None], -1)[..., 0], -1)
        if self.length > 1:
            pair = jnp.reshape(nat.pair, nat.pair.shape[:-2] + (self.dim * self.dim,))
            pair = jnp.broadcast_to(pair, lead + pair.shape)
            codes = x[..., :-1] * self.dim + x[..., 1:]
            inner = inner + jnp.sum(jnp.take_along_axis(pair, codes[..., None], -1)[..., 0], -1)
        return inner - self.log_partition(nat)

    def entropy(self, nat: ChainNat, mean_params: ChainView | None = None) -> jax.Array:
        if mean_params is None:
            return self.rule_view_and_entropy(nat)[1]
        return self.log_partition(nat) - self._inner(nat, mean_params)

    def message_from_view_grad(self, nat: ChainNat, view_grad: ChainView) -> ChainNat:
        """λ̃ = ∇_μ L: the view is μ itself."""
        return ChainNat(view_grad.probs, view_grad.pair_probs)

    def is_valid(self, nat: ChainNat) -> jax.Array:
        return jnp.all(jnp.isfinite(nat.unary)) & jnp.all(jnp.isfinite(nat.pair))

    def sample(self, nat: ChainNat, rng_key: jax.Array, sample_shape: tuple[int, ...] = ()) -> jax.Array:
        """Exact joint draws ``(*sample_shape, C, L)`` by forward filtering, backward
        sampling: z_{L−1} ~ α_{L−1}, z_t | z_{t+1} ∝ α_t(z_t) exp Φ_t(z_t, z_{t+1}).

        The conditionals' CDFs over z_t, for every t and value of z_{t+1}, are formed once
        before the loop (T·K² exponentials in all, normalised in log space); each step of a
        draw reads one column of them (no exponential per draw and step)."""
        nat = jax.tree.map(jnp.asarray, nat)
        alpha, _, _ = _forward_backward(nat)
        shape = tuple(sample_shape) + alpha.shape[:1]
        # one uniform per state, drawn before the loop (no PRNG work inside it): each state
        # is its conditional's inverse CDF at its uniform
        u = jax.random.uniform(rng_key, shape + (self.length,), alpha.dtype)

        def draw(cdf, u_t):
            return jnp.sum(u_t[..., None] > cdf[..., :-1], axis=-1).astype(jnp.int32)

        last = draw(jnp.cumsum(_normalised(jnp, alpha[:, -1]), -1), u[..., -1])
        if self.length == 1:
            return last[..., None]
        # cdf[c, t, :, j]: the CDF of z_t given z_{t+1} = j
        cond = jnp.swapaxes(_normalised(jnp, jnp.swapaxes(alpha[:, :-1, :, None] + nat.pair, -1, -2)), -1, -2)
        cdf = jnp.cumsum(cond, -2)
        chains = jnp.arange(alpha.shape[0])
        step = jax.lax.dynamic_index_in_dim

        def back(i, carry):
            t = self.length - 2 - i
            nxt, out = carry
            z = draw(step(cdf, t, 1, keepdims=False)[chains, :, nxt], step(u, t, -1, keepdims=False))
            return z, jax.lax.dynamic_update_index_in_dim(out, z, t, -1)

        out = jnp.zeros(shape + (self.length,), jnp.int32).at[..., -1].set(last)
        # (the chain axis indexed in place, as in the forward–backward: see _scaled_view)
        return jax.lax.fori_loop(0, self.length - 1, back, (last, out))[1]

    def to_numpyro(self, nat: ChainNat) -> "MarkovChainPosterior":
        return MarkovChainPosterior(nat.unary, nat.pair)


class MarkovChainPosterior(dist.Distribution):
    """The posterior of a block of hidden Markov chains: batch ``(C,)``, event ``(L,)``,
    values the state indices (see :class:`CategoricalChain`). ``sample`` draws whole
    chains (forward filtering, backward sampling); ``log_prob`` is the exact log q(z);
    ``marginals`` are the per-state probabilities."""

    arg_constraints = {"unary": constraints.real, "pair": constraints.real}
    pytree_data_fields = ("unary", "pair")

    def __init__(self, unary, pair, *, validate_args=None):
        self.unary, self.pair = unary, pair
        c, length, k = jnp.shape(unary)
        self._family = CategoricalChain(length, k)
        super().__init__(batch_shape=(c,), event_shape=(length,), validate_args=validate_args)

    @constraints.dependent_property(is_discrete=True, event_dim=1)
    def support(self):
        return constraints.integer_interval(0, self._family.dim - 1)

    def tree_flatten(self):
        return (self.unary, self.pair), None

    @classmethod
    def tree_unflatten(cls, aux, params):
        return cls(*params, validate_args=False)

    def sample(self, key, sample_shape=()):
        return self._family.sample(ChainNat(self.unary, self.pair), key, sample_shape)

    def log_prob(self, value):
        return self._family.log_prob(ChainNat(self.unary, self.pair), value)

    @property
    def marginals(self):
        return self._family.view(ChainNat(self.unary, self.pair)).probs

    @property
    def mean(self):
        return jnp.sum(self.marginals * jnp.arange(self._family.dim), -1)

    @property
    def variance(self):
        k = jnp.arange(self._family.dim)
        return jnp.sum(self.marginals * k**2, -1) - self.mean**2
