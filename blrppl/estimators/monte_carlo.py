"""Monte Carlo and quadrature estimators for factors without a closed form.

For a factor f whose neighbours are Gaussian blocks (the family policy moves every other
continuous latent of such a factor to a Gaussian on its unconstrained space, unless the
user asked for its native family: then Gamma, Beta and Dirichlet draws use implicit
reparameterisation gradients and the family's Fisher solve),

    L = E_q[log f] ≈ (1/S) Σ_s log f(x_s),     x_s = m + chol(Σ) ε_s,

with fresh ε_s at every step. The gradient of this average with respect to (m, Σ)
(reparameterisation through the Cholesky factor) is an unbiased estimate of
(E[∇ log f], ½ E[∇² log f]) (Bonnet's and Price's theorems), which the Gaussian family turns
into the natural-parameter message λ̃ = (g − H m, ½ H). ``numpyro.factor`` terms and any
other density are handled this way.

The log|det J| term of a block on an unconstrained space is a sum of per-element functions
of u for elementwise bijections (exp, sigmoid, affine): its expectation is computed by
Gauss–Hermite quadrature over each element's marginal N(m_i, v_i), deterministic and nearly
exact; other bijections (stick-breaking, ordered, Cholesky) use the samples.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

#: default number of Monte Carlo samples per factor group and step
NUM_SAMPLES = 16
#: Gauss–Hermite nodes for one-dimensional expectations
NUM_NODES = 20


def gauss_hermite(num_nodes: int = NUM_NODES):
    """Nodes t and weights w with E_{N(0,1)}[h(z)] ≈ Σ_k w_k h(t_k)."""
    t, w = np.polynomial.hermite_e.hermegauss(num_nodes)
    return t, w / w.sum()


def sample_block(block, view, key, num_samples: int):
    """Reparameterised draws of a Gaussian block in its site layout (block space); a point
    (delta-method) block is its mean."""
    if block.point:
        mean = view.mean if block.kind == "gaussian-diag" else block.to_site(view.mean)
        return jnp.broadcast_to(mean, (num_samples,) + mean.shape)
    if block.kind not in ("gaussian", "gaussian-diag"):
        # Gamma, Beta, Dirichlet: implicit reparameterisation (jax.random.gamma is
        # differentiable in its shape); the family's Fisher solve turns ∇_view into ∇_μ
        return block.family.sample(block.family.nat_from_view(view), key, (num_samples,))
    if block.kind == "gaussian-diag":
        eps = jax.random.normal(key, (num_samples,) + view.mean.shape, view.mean.dtype)
        return view.mean + jnp.sqrt(view.var) * eps
    chol = jnp.linalg.cholesky(view.cov)
    eps = jax.random.normal(key, (num_samples,) + view.mean.shape, view.mean.dtype)
    x = view.mean + jnp.einsum("...ij,s...j->s...i", chol, eps)
    return jax.vmap(block.to_site)(x)


def marginal_moments(block, view):
    """Per-element mean and variance of a Gaussian block in its site layout."""
    if block.kind == "gaussian-diag":
        return view.mean, view.var
    var = jnp.diagonal(view.cov, axis1=-2, axis2=-1)
    return block.to_site(view.mean), block.to_site(var)


def monte_carlo_elementwise(fns, factors, blocks, views, discrete_values, data, key, num_samples=NUM_SAMPLES):
    """Per-factor sample means of log f (batch shape of each site), and their scales."""
    cont = []
    for f in factors:
        cont += [n for n in f.neighbours if n not in f.discrete and n not in cont]
    keys = jax.random.split(key, max(len(cont), 1))
    draws = {n: sample_block(blocks[n], views[n], k, num_samples) for n, k in zip(cont, keys)}
    names = tuple(f.name for f in factors)

    def one(x):
        out = fns.log_probs(names, {**discrete_values, **x}, data)
        return {n: lp for n, (lp, _) in out.items()}

    per_sample = jax.vmap(one)(draws)
    scales = {n: sc for n, (_, sc) in fns.log_probs(names, {**discrete_values, **{n: d[0] for n, d in draws.items()}}, data).items()}
    return {n: v.mean(0) for n, v in per_sample.items()}, scales


def expected_log_jacobian(block, view, key, num_samples=NUM_SAMPLES):
    """E_q[log|det J|] of a block's bijection(s), summed over elements (and members of a
    joint block, each from its marginal)."""
    if block.members:
        keys = jax.random.split(key, len(block.members))
        return sum(
            expected_log_jacobian(m, v, k, num_samples)
            for (m, v), k in zip(block.member_views(view), keys)
            if m.transform is not None
        )
    t = block.transform
    if t.domain.event_dim == 0:
        mean, var = marginal_moments(block, view)
        nodes, weights = gauss_hermite()
        u = mean[..., None] + jnp.sqrt(var)[..., None] * jnp.asarray(nodes, mean.dtype)
        ladj = t.log_abs_det_jacobian(u, t(u))
        return jnp.sum(ladj * jnp.asarray(weights, mean.dtype))
    u = sample_block(block, view, key, num_samples)
    ladj = jax.vmap(lambda x: jnp.sum(t.log_abs_det_jacobian(x, t(x))))(u)
    return ladj.mean()
