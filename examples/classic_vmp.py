"""Two classic variational-message-passing models, written as NumPyro users write them and
fitted in closed form by ``blr_fit``:

- probabilistic PCA with ARD on the loadings (``X @ C.T``: each row of X and C a Gaussian
  with a full covariance, the ARD and noise precisions Gamma), with missing entries masked;
- a Gaussian mixture with full precision matrices (``MultivariateNormal(mu[z],
  precision_matrix=Lam[z])``: Wishart precisions, Gaussian means, Dirichlet weights, the
  labels enumerated).

Every update is a closed-form coordinate step, so the ELBO never falls and no step size is
tuned. Run with ``python examples/classic_vmp.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist

numpyro.enable_x64()  # VMP's last digits of convergence; float32 works too

from blrppl import blr_fit  # noqa: E402


def ppca(Y, latent_dim=4):
    n, m = Y.shape
    seen = ~jnp.isnan(Y)
    alpha = numpyro.sample("alpha", dist.Gamma(1e-3, 1e-3).expand([latent_dim]).to_event(1))
    with numpyro.plate("columns", m):
        C = numpyro.sample("C", dist.Normal(0.0, 1 / jnp.sqrt(alpha)).to_event(1))
    with numpyro.plate("rows", n):
        X = numpyro.sample("X", dist.Normal(0.0, 1.0).expand([latent_dim]).to_event(1))
    tau = numpyro.sample("tau", dist.Gamma(1e-3, 1e-3))
    with numpyro.plate("n", n, dim=-2), numpyro.plate("m", m, dim=-1):
        numpyro.sample("Y", dist.Normal(X @ C.T, 1 / jnp.sqrt(tau)).mask(seen), obs=jnp.nan_to_num(Y))


def mixture(X, num_components=3):
    d = X.shape[1]
    pi = numpyro.sample("pi", dist.Dirichlet(jnp.ones(num_components)))
    with numpyro.plate("components", num_components):
        mu = numpyro.sample("mu", dist.MultivariateNormal(jnp.zeros(d), 100.0 * jnp.eye(d)))
        Lam = numpyro.sample("Lam", dist.Wishart(d + 1.0, scale_matrix=jnp.eye(d)))
    with numpyro.plate("data", X.shape[0]):
        z = numpyro.sample("z", dist.Categorical(pi))
        numpyro.sample("x", dist.MultivariateNormal(mu[z], precision_matrix=Lam[z]), obs=X)


def pca_data(n=100, m=15, rank=2, noise=0.3, missing=0.1, seed=0):
    rng = np.random.default_rng(seed)
    Y = rng.normal(size=(n, rank)) @ rng.normal(size=(rank, m)) + noise * rng.normal(size=(n, m))
    Y[rng.random((n, m)) < missing] = np.nan
    return Y


COVARIANCES = (np.array([[1.0, 0.8], [0.8, 1.0]]), np.array([[0.3, 0.0], [0.0, 0.1]]), np.array([[0.5, -0.3], [-0.3, 0.5]]))
CENTRES = ((0.0, 0.0), (4.0, 0.0), (0.0, 4.0))


def mixture_data(per_component=100, seed=0):
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.multivariate_normal(c, s, size=per_component) for c, s in zip(CENTRES, COVARIANCES)])


def _monotone(elbo):
    elbo = np.asarray(elbo)
    return bool(np.all(np.diff(elbo) >= -1e-9 * np.abs(elbo[1:])))


def main():
    Y = pca_data()
    # (ARD keeps raising the precisions of pruned dimensions: the ELBO creeps up for ever, tol=1e-5
    # stops when the kept ones have settled)
    pca = blr_fit(ppca, (Y,), tol=1e-5, rng_key=jax.random.key(0), progress_bar=False)
    ard = np.asarray(pca.posterior["alpha"].mean)
    noise_sd = float(1 / np.sqrt(pca.posterior["tau"].mean))
    print("PPCA:", pca.message)
    print(f"  ARD precisions of the 4 latent dimensions: {np.round(np.sort(ard), 2)} (rank 2: two are pruned)")
    print(f"  noise sd: {noise_sd:.3f} (simulated with 0.3); ELBO never decreasing: {_monotone(pca.elbo)}")

    X = mixture_data()
    gmm = blr_fit(mixture, (X,), rng_key=jax.random.key(0), progress_bar=False)
    covariances = np.linalg.inv(np.asarray(gmm.posterior["Lam"].mean))
    order = np.argsort(np.asarray(gmm.posterior["mu"].mean)[:, 0] + 10 * np.asarray(gmm.posterior["mu"].mean)[:, 1])
    print("Gaussian mixture with Wishart precisions:", gmm.message)
    for k in order:
        print(f"  component at {np.round(np.asarray(gmm.posterior['mu'].mean)[k], 2)}: covariance (inverse of E[Λ]) "
              f"{np.round(covariances[k], 2).tolist()}")
    print(f"  ELBO never decreasing: {_monotone(gmm.elbo)}")
    return pca, gmm


if __name__ == "__main__":
    main()
