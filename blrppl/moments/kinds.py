"""Expectations of distribution arguments under the candidate q.

The compiler classifies every argument of a factor (and its value) as a function of the
blocks (see :mod:`blrppl.model.classes`) and hands the rules one *moment object* per
argument. A moment object answers the expectations a closed-form rule needs, each
elementwise with the argument's shape:

============================  =======================================================
class                          argument is …
============================  =======================================================
:class:`Const`                 a fixed array (data, or an enumerated discrete value)
:class:`AffineGaussian`        affine in one or more Gaussian blocks
:class:`BilinearGaussian`      a product of affine forms of different Gaussian blocks
                               (``w * x``), plus an affine form
:class:`ExpGaussian`           exp of an affine Gaussian (c · σ^a with σ a Gaussian
                               block on log space: a scale fitted log-normal)
:class:`PowerGamma`            c · τ^a with τ a Gamma block (possibly indexed)
:class:`BetaIdentity`          p (possibly indexed) with p a Beta block
:class:`DirichletIdentity`     π (possibly indexed) with π a Dirichlet block
:class:`WishartIdentity`       Λ (whole matrices, possibly indexed) with Λ a Wishart
                               block
============================  =======================================================

Moment objects are pytrees of arrays built inside the jitted step from the blocks'
``view`` parameters, so a rule written with them is differentiable in those parameters;
the message is the gradient (see :meth:`blrppl.families.base.Family.message_from_view_grad`).

Methods a rule may call (each raises :class:`NotImplementedError` where the expectation
has no closed form for that class, which the compiler checks before choosing ``exact``):

* ``mean()``            E[x]
* ``var()``             Var[x] (elementwise)
* ``mean_square()``     E[x²]
* ``expect_log()``      E[log x]
* ``expect_log1m()``    E[log(1 − x)]
* ``expect_pow(k)``     E[x^k]
* ``cov_event(n)``      covariance over the last ``n`` dims (``AffineGaussian`` only)
* ``expect_logdet()``   E[log|X|] of a matrix (``Const``, ``WishartIdentity``)

``AffineGaussian`` supports ``+``, ``-`` and multiplication by constants, with :class:`Const`
and with other ``AffineGaussian`` objects, so that e.g. a Normal rule computes E[(x − loc)²]
exactly even when x and loc depend on the same block.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import digamma, gammaln

#: the kinds a compiler may assign to an argument; rules declare which they support
KINDS = (
    "const", "affine_gaussian", "bilinear_gaussian", "exp_gaussian", "power_gamma", "beta", "dirichlet", "wishart"
)


class Const(NamedTuple):
    """A fixed array x (no block)."""

    value: jax.Array
    kind = "const"
    __array_ufunc__ = None  # numpy arrays defer to our operators

    @property
    def shape(self):
        return jnp.shape(self.value)

    def mean(self):
        return self.value

    def var(self):
        return jnp.zeros_like(jnp.asarray(self.value, dtype=jnp.result_type(float)))

    def mean_square(self):
        return jnp.square(self.value)

    def expect_log(self):
        return jnp.log(self.value)

    def expect_log1m(self):
        return jnp.log1p(-self.value)

    def expect_pow(self, k):
        return jnp.power(self.value, k)

    def expect_logdet(self):
        """log|x| of a positive-definite matrix (last two dims)."""
        return jnp.linalg.slogdet(self.value)[1]

    def cov_event(self, n: int):
        shape = jnp.shape(self.value)
        ev = shape[len(shape) - n :]
        size = int(_prod(ev))
        return jnp.zeros(shape[: len(shape) - n] + (size, size), dtype=jnp.result_type(float))

    def __neg__(self):
        return Const(-self.value)

    def __add__(self, other):
        if isinstance(other, Const):
            return Const(self.value + other.value)
        if isinstance(other, AffineGaussian | BilinearGaussian):
            return other + self
        return Const(self.value + other)

    __radd__ = __add__

    def __sub__(self, other):
        return self + (-other)

    def __rsub__(self, other):
        return (-self) + other

    def __mul__(self, other):
        if isinstance(other, Const):
            return Const(self.value * other.value)
        if isinstance(other, AffineGaussian | BilinearGaussian):
            return other * self
        return Const(self.value * other)

    __rmul__ = __mul__


def _operators_from_combine():
    """``+``, ``-`` and unary ``-`` of a moment class from its ``_combine(other, sign)`` and
    ``*`` (NamedTuple classes take no mixins)."""

    def add(self, other):
        return self._combine(other, 1.0)

    def sub(self, other):
        return self._combine(other, -1.0)

    def rsub(self, other):
        return (-self) + other

    def neg(self):
        return self * -1.0

    return add, add, sub, rsub, neg


def _gaussian_expectations():
    """``expect_log``, ``expect_log1m`` and ``expect_pow`` of a moment class of a Gaussian
    argument: only E[x] and E[x²] (``mean`` and ``mean_square``) are closed-form."""

    def expect_log(self):
        raise NotImplementedError

    def expect_log1m(self):
        raise NotImplementedError

    def expect_pow(self, k):
        if k == 1:
            return self.mean()
        if k == 2:
            return self.mean_square()
        raise NotImplementedError

    return expect_log, expect_log1m, expect_pow


class AffineGaussian(NamedTuple):
    """x = mean + Σ_b J_b (w_b − m_b) with w_b ~ N(m_b, Σ_b) independent Gaussian blocks.

    The random part is stored as pairs of column stacks per block, ``left[b][j] = J_b e_j``
    and ``right[b][j] = J_b Σ_b e_j`` (``j`` over the block's columns, leading axis), so that
    Cov[x_n, y_n] = Σ_b Σ_j left^x[b][j]_n · right^y[b][j]_n for two arguments sharing blocks.

    Attributes:
        mean: E[x], the argument evaluated at the block means.
        left: tuple over blocks of arrays (columns, *shape_b); None where x does not use
            the block (the tuple is indexed by the factor's Gaussian neighbours).
        right: same layout as ``left``.
    """

    mean_value: jax.Array
    left: tuple
    right: tuple
    kind = "affine_gaussian"
    __array_ufunc__ = None

    @property
    def shape(self):
        return jnp.shape(self.mean_value)

    def mean(self):
        return self.mean_value

    def var(self):
        total = jnp.zeros(self.shape, dtype=jnp.result_type(self.mean_value, float))
        for lft, rgt in zip(self.left, self.right):
            if lft is not None:
                total = total + jnp.sum(lft * rgt, axis=0)
        return jnp.broadcast_to(total, self.shape)

    def mean_square(self):
        return jnp.square(self.mean_value) + self.var()

    def cov_event(self, n: int):
        """Covariance over the last ``n`` dims, flattened: shape (*batch, size, size)."""
        shape = self.shape
        batch, ev = shape[: len(shape) - n], shape[len(shape) - n :]
        size = int(_prod(ev))
        total = jnp.zeros(batch + (size, size), dtype=jnp.result_type(self.mean_value, float))
        for lft, rgt in zip(self.left, self.right):
            if lft is None:
                continue
            cols = lft.shape[0]
            lf = _bcast_cols(lft, cols, shape).reshape((cols,) + batch + (size,))
            rf = _bcast_cols(rgt, cols, shape).reshape((cols,) + batch + (size,))
            total = total + jnp.einsum("j...a,j...b->...ab", lf, rf)
        return 0.5 * (total + jnp.swapaxes(total, -1, -2))

    def _combine(self, other, sign):
        if isinstance(other, BilinearGaussian):
            return other * sign + self
        if isinstance(other, AffineGaussian):
            shape = jnp.broadcast_shapes(self.shape, other.shape)
            left, right = [], []
            for la, ra, lb, rb in zip(self.left, self.right, other.left, other.right):
                if la is None and lb is None:
                    left.append(None)
                    right.append(None)
                    continue
                cols = (la if la is not None else lb).shape[0]
                parts_l = [_bcast_cols(la, cols, shape), sign * _bcast_cols(lb, cols, shape)]
                parts_r = [_bcast_cols(ra, cols, shape), sign * _bcast_cols(rb, cols, shape)]
                left.append(parts_l[0] + parts_l[1])
                right.append(parts_r[0] + parts_r[1])
            return AffineGaussian(self.mean_value + sign * other.mean_value, tuple(left), tuple(right))
        value = other.value if isinstance(other, Const) else other
        return AffineGaussian(self.mean_value + sign * value, self.left, self.right)

    __add__, __radd__, __sub__, __rsub__, __neg__ = _operators_from_combine()

    def __mul__(self, other):
        c = other.value if isinstance(other, Const) else other
        if isinstance(other, AffineGaussian):
            raise NotImplementedError("the product of two Gaussian arguments is not affine")
        ndim = max(len(self.shape), jnp.ndim(c))
        left = tuple(None if lft is None else _align_cols(lft, ndim) * c for lft in self.left)
        right = tuple(None if rgt is None else _align_cols(rgt, ndim) * c for rgt in self.right)
        return AffineGaussian(self.mean_value * c, left, right)

    __rmul__ = __mul__

    expect_log, expect_log1m, expect_pow = _gaussian_expectations()


class BilinearGaussian(NamedTuple):
    """x = f(w_A, w_B) + g(w) with f bilinear in two independent Gaussian blocks (or groups
    of blocks) A and B and g affine: ``w * x``, ``phi * (h_prev - mu) + mu``.

    With d_A = w_A − m_A, d_B = w_B − m_B, x − E[x] = f(d_A, m_B) + f(m_A, d_B) + g(d) +
    f(d_A, d_B): the first three terms are the linearisation of x at the means (an
    :class:`AffineGaussian`, ``linear``), and the last is uncorrelated with them and with
    every affine form (its odd moments vanish), so

        E[x] = f(m_A, m_B) + g(m),    Var[x] = Var[linear] + E[f(d_A, d_B)²],

    ``extra`` = E[f(d_A, d_B)²] = tr(Jᵀ Σ_A J Σ_B) per element (summed over the pairs of
    blocks). Both are linear in each block's expectation parameters given the others', so a
    Normal density of x has exact, conjugate messages to each block (variational message
    passing for factor models, Winn & Bishop 2005).

    Attributes:
        linear: the linearisation at the means.
        extra: E[f(d_A, d_B)²], the shape of x.
    """

    linear: AffineGaussian
    extra: jax.Array
    kind = "bilinear_gaussian"
    __array_ufunc__ = None

    @property
    def shape(self):
        return self.linear.shape

    def mean(self):
        return self.linear.mean()

    def var(self):
        return self.linear.var() + self.extra

    def mean_square(self):
        return jnp.square(self.mean()) + self.var()

    def _combine(self, other, sign):
        if isinstance(other, BilinearGaussian):
            raise NotImplementedError("the sum of two products of Gaussian arguments")
        return BilinearGaussian(self.linear._combine(other, sign), self.extra)

    __add__, __radd__, __sub__, __rsub__, __neg__ = _operators_from_combine()

    def __mul__(self, other):
        if isinstance(other, AffineGaussian | BilinearGaussian):
            raise NotImplementedError("the product of a bilinear argument with a Gaussian one")
        c = other.value if isinstance(other, Const) else other
        return BilinearGaussian(self.linear * c, self.extra * jnp.square(c))

    __rmul__ = __mul__

    expect_log, expect_log1m, expect_pow = _gaussian_expectations()


def _moments_from_powers():
    """``mean``, ``mean_square`` and ``var`` of a moment class from its ``expect_pow``."""

    def mean(self):
        return self.expect_pow(1.0)

    def mean_square(self):
        return self.expect_pow(2.0)

    def var(self):
        return self.mean_square() - jnp.square(self.mean())

    return mean, mean_square, var


class ExpGaussian(NamedTuple):
    """x = exp(a) elementwise, a an :class:`AffineGaussian` (so x is log-normal): e.g. a
    scale c · σ^a whose block is a Gaussian on log σ, a = log c + a u.

    With m = E[a] and v = Var[a]:  E[x^k] = exp(k m + ½ k² v),  E[log x] = m. A rule
    reading a scale through these has a closed form (not conjugate: the expectation is not
    linear in the block's mean parameters, and the messages come by autodiff).

    Attributes:
        log: the moment object of log x.
    """

    log: AffineGaussian
    kind = "exp_gaussian"

    @property
    def shape(self):
        return self.log.shape

    def expect_pow(self, k):
        return jnp.exp(k * self.log.mean() + 0.5 * k * k * self.log.var())

    mean, mean_square, var = _moments_from_powers()

    def expect_log(self):
        return self.log.mean()

    def expect_log1m(self):
        raise NotImplementedError


def _static_positive_integer(x, largest: int = 4) -> int | None:
    """``x`` as an int in 1…``largest`` when it is a concrete number equal to one, else None."""
    if isinstance(x, jax.core.Tracer) or np.ndim(x) != 0:
        return None
    try:
        value = float(x)
    except TypeError:
        return None
    return int(value) if value.is_integer() and 1 <= value <= largest else None


class PowerGamma(NamedTuple):
    """x = c · τ^a elementwise, τ ~ Gamma(shape, rate) a Gamma block gathered to x's shape.

    Attributes:
        coef: c (> 0), shape of x.
        power: a (≠ 0), shape of x, or a Python number (then powers of x that are integer
            powers of τ need no Gamma functions, see :meth:`expect_pow`).
        shape_param: Gamma shape α of the τ each element of x uses.
        rate: Gamma rate β of that τ.
        tau_mean_log: E[log τ] = ψ(α) − log β of that τ, or None (then computed from α, β).
        tau_mean: E[τ] = α / β of that τ, or None (then computed from α, β).

    Inside a fit the two mean parameters are the block's own leaves
    (:class:`blrppl.families.GammaRuleView`), and the expectations below are written so that
    conjugate ones (E[log x], and E[x^k] with a k = 1) depend on them alone: their gradient
    then reaches the block's message without the Fisher solve (exact in float32 too).
    """

    coef: jax.Array
    power: jax.Array
    shape_param: jax.Array
    rate: jax.Array
    tau_mean_log: jax.Array | None = None
    tau_mean: jax.Array | None = None
    kind = "power_gamma"

    @property
    def shape(self):
        return jnp.shape(self.coef)

    def expect_pow(self, k):
        """E[x^k] = c^k Γ(α + a k) / Γ(α) · β^(−a k); needs α + a k > 0.

        With the mean parameter E[τ] = α/β at hand it is evaluated as
        c^k E[τ] · Γ(α + a k) / Γ(α + 1) · β^(1 − a k), whose second factor is exactly 1,
        with exactly zero derivatives in (α, β), when a k = 1. When a k is a small positive
        integer known at trace time (``power`` a Python number, as the compiler passes it),
        the Gamma-function ratio is the rising product α (α + 1) ⋯ (α + a k − 1).
        """
        ak = self.power * k
        n = _static_positive_integer(ak)
        if n is not None:
            # E[τⁿ] = α (α + 1) ⋯ (α + n − 1) / βⁿ: no log-gamma in the program; with E[τ] at
            # hand it carries the first factor α / β (and is all of it when a k = 1)
            if self.tau_mean is None:
                out, first = jnp.ones_like(self.shape_param), 0
            else:
                out, first = self.tau_mean, 1
            for j in range(first, n):
                out = out * (self.shape_param + j) / self.rate
            return jnp.power(self.coef, k) * out
        if self.tau_mean is None:
            return jnp.power(self.coef, k) * jnp.exp(
                gammaln(self.shape_param + ak) - gammaln(self.shape_param) - ak * jnp.log(self.rate)
            )
        ratio = jnp.exp(
            gammaln(self.shape_param + ak) - gammaln(self.shape_param + 1.0) - (ak - 1.0) * jnp.log(self.rate)
        )
        return jnp.power(self.coef, k) * self.tau_mean * ratio

    mean, mean_square, var = _moments_from_powers()

    def expect_log(self):
        """E[log x] = log c + a (ψ(α) − log β) = log c + a E[log τ]."""
        if self.tau_mean_log is None:
            return jnp.log(self.coef) + self.power * (digamma(self.shape_param) - jnp.log(self.rate))
        return jnp.log(self.coef) + self.power * self.tau_mean_log

    def expect_log1m(self):
        raise NotImplementedError


class BetaIdentity(NamedTuple):
    """x = p elementwise, p ~ Beta(alpha, beta) a Beta block gathered to x's shape.

    ``mean_log`` and ``mean_log1m`` are E[log p] and E[log(1 − p)], or None (then computed
    from α, β); inside a fit they are the block's own mean-parameter leaves
    (:class:`blrppl.families.BetaRuleView`), so that conjugate expectations reach the
    message without the Fisher solve.
    """

    alpha: jax.Array
    beta: jax.Array
    mean_log: jax.Array | None = None
    mean_log1m: jax.Array | None = None
    kind = "beta"

    @property
    def shape(self):
        return jnp.shape(self.alpha)

    def mean(self):
        return self.alpha / (self.alpha + self.beta)

    def var(self):
        total = self.alpha + self.beta
        return self.alpha * self.beta / (jnp.square(total) * (total + 1.0))

    def mean_square(self):
        return self.var() + jnp.square(self.mean())

    def expect_log(self):
        """E[log p] = ψ(α) − ψ(α + β)."""
        if self.mean_log is not None:
            return self.mean_log
        return digamma(self.alpha) - digamma(self.alpha + self.beta)

    def expect_log1m(self):
        """E[log(1 − p)] = ψ(β) − ψ(α + β)."""
        if self.mean_log1m is not None:
            return self.mean_log1m
        return digamma(self.beta) - digamma(self.alpha + self.beta)

    def expect_pow(self, k):
        """E[p^k] = B(α + k, β) / B(α, β)."""
        return jnp.exp(
            gammaln(self.alpha + k) - gammaln(self.alpha)
            + gammaln(self.alpha + self.beta) - gammaln(self.alpha + self.beta + k)
        )


class DirichletIdentity(NamedTuple):
    """x = π_k elementwise (gathered), π ~ Dirichlet(α) a Dirichlet block.

    Each element of x is one component π_k of one Dirichlet draw; ``concentration`` is
    α_k and ``total`` is α_0 = Σ_k α_k of that draw, both with x's shape. When x is a whole
    probability vector (e.g. ``Categorical(probs=pi)``) its last dim runs over k.

    ``mean_log`` is E[log π_k], or None (then computed from α); inside a fit it is the
    block's own mean-parameter leaf (:class:`blrppl.families.DirichletRuleView`), so that
    conjugate expectations reach the message without the Fisher solve.
    """

    concentration: jax.Array
    total: jax.Array
    mean_log: jax.Array | None = None
    kind = "dirichlet"

    @property
    def shape(self):
        return jnp.shape(self.concentration)

    def mean(self):
        return self.concentration / self.total

    def var(self):
        a, a0 = self.concentration, self.total
        return a * (a0 - a) / (jnp.square(a0) * (a0 + 1.0))

    def mean_square(self):
        return self.var() + jnp.square(self.mean())

    def expect_log(self):
        """E[log π_k] = ψ(α_k) − ψ(α_0)."""
        if self.mean_log is not None:
            return self.mean_log
        return digamma(self.concentration) - digamma(self.total)

    def expect_log1m(self):
        """E[log(1 − π_k)] = ψ(α_0 − α_k) − ψ(α_0) (1 − π_k is Beta(α_0 − α_k, α_k))."""
        return digamma(self.total - self.concentration) - digamma(self.total)

    def expect_pow(self, k):
        a, a0 = self.concentration, self.total
        return jnp.exp(gammaln(a + k) - gammaln(a) + gammaln(a0) - gammaln(a0 + k))


class WishartIdentity(NamedTuple):
    """X = Λ (gathered whole matrices), Λ ~ Wishart(ν, W) a Wishart block.

    ``mean_matrix`` is E[Λ] = ν W with X's shape ``(*, D, D)``; ``mean_logdet`` is
    E[log|Λ|] ``(*,)``. Inside a fit both are the block's own mean-parameter leaves
    (:class:`blrppl.families.WishartRuleView`), so a conjugate expectation sends its
    coefficients as the message. The only expectations: E[X] and E[log|X|] (a Gaussian
    precision's ``tr(Λ S)`` and ``log|Λ|``); elementwise logs and powers have none here.
    """

    mean_matrix: jax.Array
    mean_logdet: jax.Array
    kind = "wishart"

    @property
    def shape(self):
        return jnp.shape(self.mean_matrix)

    def mean(self):
        return self.mean_matrix

    def expect_logdet(self):
        """E[log|Λ|] = Σ_{i=1}^{D} ψ((ν + 1 − i)/2) + D log 2 + log|W|."""
        return self.mean_logdet

    def var(self):
        raise NotImplementedError

    def mean_square(self):
        raise NotImplementedError

    def expect_log(self):
        raise NotImplementedError

    def expect_log1m(self):
        raise NotImplementedError

    def expect_pow(self, k):
        if k == 1:
            return self.mean_matrix
        raise NotImplementedError


def _align_cols(cols_array, ndim):
    """Insert unit axes after the column axis so that the array has 1 + ``ndim`` dims.

    Column stacks may have fewer dims than the argument (after adding a wider constant);
    aligning them lets them broadcast against arrays of the argument's shape.
    """
    missing = ndim - (cols_array.ndim - 1)
    if missing <= 0:
        return cols_array
    return cols_array.reshape(cols_array.shape[:1] + (1,) * missing + cols_array.shape[1:])


def slice_last(x, start: int, stop: int | None = None):
    """The moment object of ``x[..., start:stop]`` (a ``Const`` or an ``AffineGaussian``):
    the elements keep their own columns, so a rule that pairs neighbouring positions of an
    event (a random walk's increments) reads only those positions' covariances."""
    if isinstance(x, AffineGaussian):
        shape = x.shape
        cut = lambda a: None if a is None else _bcast_cols(a, a.shape[0], shape)[..., start:stop]  # noqa: E731
        return AffineGaussian(
            jnp.broadcast_to(x.mean_value, shape)[..., start:stop],
            tuple(cut(a) for a in x.left),
            tuple(cut(a) for a in x.right),
        )
    return Const(jnp.asarray(x.mean())[..., start:stop])


def covariance(a, b):
    """Elementwise Cov[a_n, b_n] of two moment objects (zero unless both are affine in a
    shared Gaussian block)."""
    if not (isinstance(a, AffineGaussian) and isinstance(b, AffineGaussian)):
        return jnp.zeros(jnp.broadcast_shapes(a.shape, b.shape))
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    total = jnp.zeros(shape, dtype=jnp.result_type(a.mean_value, float))
    for la, rb in zip(a.left, b.right):
        if la is not None and rb is not None:
            cols = la.shape[0]
            total = total + jnp.sum(_bcast_cols(la, cols, shape) * _bcast_cols(rb, cols, shape), axis=0)
    return total


def _bcast_cols(cols_array, cols, shape):
    if cols_array is None:
        return jnp.zeros((cols,) + shape)
    lead = (cols,) + (1,) * (len(shape) - (cols_array.ndim - 1)) + cols_array.shape[1:]
    return jnp.broadcast_to(cols_array.reshape(lead), (cols,) + shape)


def _prod(shape):
    out = 1
    for s in shape:
        out *= int(s)
    return out
