"""A posterior with two modes, fitted by one Gaussian and by a mixture of Gaussians.

The model: θ ~ Normal(0, 2) and y ~ Normal(θ², 1), with y observed. A positive y says θ² is near
y, not the sign of θ, so the posterior has two modes, at about ±√y. One Gaussian q cannot hold
both: it sits in one mode, or spreads over both and the valley between them. A mixture of K
Gaussians (``families={"theta": ("gaussian-mixture", K)}``) fitted by the learning rule holds
each mode in its own components.

The example computes the exact posterior on a fine grid of θ (one dimension: the normalising
constant is a sum), and prints, for the single Gaussian and for the mixture, the total-variation
distance ½ ∫ |q(θ) − p(θ | y)| dθ and the mass q gives each mode (θ < 0 and θ > 0; exactly ½
each by symmetry). With matplotlib installed it saves a plot of the exact density against
both fits.

Run with ``python examples/mixture_posterior.py``.
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import random

from blrppl import blr_fit


def model(y=None):
    theta = numpyro.sample("theta", dist.Normal(0.0, 2.0))
    numpyro.sample("y", dist.Normal(theta**2, 1.0), obs=y)


def exact_posterior(y, grid):
    """The posterior density of θ on an evenly spaced ``grid``, normalised by the grid's sum."""
    log_p = dist.Normal(0.0, 2.0).log_prob(grid) + dist.Normal(grid**2, 1.0).log_prob(y)
    p = np.exp(np.asarray(log_p - jnp.max(log_p), dtype=float))
    return p / (p.sum() * (grid[1] - grid[0]))


def summary(posterior, exact, grid) -> dict:
    """Total-variation distance to the exact density and each mode's mass, on the grid."""
    dx = float(grid[1] - grid[0])
    q = np.exp(np.asarray(posterior.log_prob(grid), dtype=float))
    return {
        "tv": 0.5 * float(np.sum(np.abs(q - exact)) * dx),
        "mass below 0": float(np.sum(q[grid < 0]) * dx),
        "mass above 0": float(np.sum(q[grid > 0]) * dx),
        "density": q,
    }


def plot(grid, exact, fits: dict, path) -> str:
    """Save the exact density against the fits to ``path`` (PNG); say where, or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot saved"
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(grid, exact, "k-", lw=2, label="exact posterior")
    for (name, s), style in zip(fits.items(), ("--", "-.")):
        ax.plot(grid, s["density"], style, label=f"{name} (TV {s['tv']:.3f})")
    ax.set_xlabel("θ")
    ax.set_ylabel("density")
    ax.legend(frameon=False, loc="upper left", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot saved to {path}"


def main(y=4.0, num_components=8, num_steps=1000, plot_path="mixture_posterior.png"):
    """Fit the model by one Gaussian and by the mixture; print and return their summaries.

    Returns:
        ``(summaries, note)``: fit name → :func:`summary`, and what became of the plot.
    """
    grid = np.linspace(-6.0, 6.0, 4001)
    exact = exact_posterior(y, grid)
    fits = {}
    for name, families in (
        ("one Gaussian", {"theta": "gaussian"}),
        (f"mixture of {num_components}", {"theta": ("gaussian-mixture", num_components)}),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the single Gaussian's poor-q warning: shown below by its TV)
            result = blr_fit(
                model, {"y": y}, families=families, num_steps=num_steps, refine=False,
                rng_key=random.PRNGKey(0), progress_bar=False,
            )
        fits[name] = summary(result.posterior["theta"], exact, grid)
        fits[name]["khat"] = float(result.diagnostics.khat)
    print(f"y = {y}: the exact posterior has two modes, near θ = ±{np.sqrt(y):.2f}, each of mass 0.5")
    for name, s in fits.items():
        print(
            f"{name:>14}: total-variation distance to the exact posterior {s['tv']:.3f}; "
            f"mass of θ < 0 {s['mass below 0']:.3f}, of θ > 0 {s['mass above 0']:.3f}; PSIS k-hat {s['khat']:.2f}"
        )
    note = plot(grid, exact, fits, plot_path) if plot_path else "no plot asked"
    print(note)
    return fits, note


if __name__ == "__main__":
    main()
