"""Long-NUTS reference posteriors for the models of ``tests/reference_models.py``.

    .venv/bin/python tests/data/make_references.py [model ...]

For each model: NUTS, 4 chains × 5000 draws after 2000 warm-up steps (float64, fixed seeds,
chains in parallel on 4 host devices), then the mean and sd of every element of every latent
site, named ``site[i]`` (0-based flat index; scalar sites keep their name), their covariance
matrix (``cov``: names and matrix, for derived quantities), the data and NUTS seeds, and the
convergence diagnostics (largest split R-hat, smallest effective sample size) are written to ``tests/data/<model>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpyro

numpyro.set_host_device_count(4)
numpyro.enable_x64()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from numpyro.diagnostics import effective_sample_size, split_gelman_rubin  # noqa: E402
from numpyro.infer import MCMC, NUTS  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import reference_models as rm  # noqa: E402

NUM_CHAINS = 4
NUM_WARMUP = 2000
NUM_SAMPLES = 5000
NUTS_SEEDS = {"logistic": 101, "poisson": 102, "student_t": 103, "student_t_vague": 106, "factor": 104, "simplex": 105}


def reference(name: str) -> dict:
    model, data = rm.get(name)
    t0 = time.perf_counter()
    mcmc = MCMC(
        NUTS(model, target_accept_prob=0.9),
        num_warmup=NUM_WARMUP,
        num_samples=NUM_SAMPLES,
        num_chains=NUM_CHAINS,
        chain_method="parallel",
        progress_bar=False,
    )
    mcmc.run(jax.random.key(NUTS_SEEDS[name]), **data)
    seconds = time.perf_counter() - t0
    by_chain = mcmc.get_samples(group_by_chain=True)
    latent = {k: np.asarray(v) for k, v in by_chain.items()}
    params, rhat, ess = {}, [], []
    for site, x in latent.items():  # x: (chains, draws, *shape)
        flat = x.reshape(x.shape[0], x.shape[1], -1)
        for i in range(flat.shape[2]):
            key = site if x.ndim == 2 else f"{site}[{i}]"
            chain_draws = flat[:, :, i]
            params[key] = {"mean": float(chain_draws.mean()), "sd": float(chain_draws.std())}
            rhat.append(float(split_gelman_rubin(chain_draws[..., None])[0]))
            ess.append(float(effective_sample_size(chain_draws[..., None])[0]))
    names = list(params)
    pooled = np.concatenate([x.reshape(x.shape[0] * x.shape[1], -1) for x in latent.values()], axis=1)
    cov = np.cov(pooled, rowvar=False).reshape(len(names), len(names))
    divergences = int(np.asarray(mcmc.get_extra_fields()["diverging"]).sum())
    return {
        "model": name,
        "params": params,
        "cov": {"names": names, "matrix": cov.tolist()},
        "seeds": {"data": rm.DATA_SEEDS[name], "nuts": NUTS_SEEDS[name]},
        "nuts": {
            "num_chains": NUM_CHAINS,
            "num_warmup": NUM_WARMUP,
            "num_samples": NUM_SAMPLES,
            "target_accept_prob": 0.9,
            "max_rhat": max(rhat),
            "min_ess": min(ess),
            "divergences": divergences,
            "seconds": seconds,
        },
        "versions": {"numpyro": numpyro.__version__, "jax": jax.__version__},
    }


def main(names):
    for name in names or list(rm.MODELS):
        out = reference(name)
        path = os.path.join(HERE, f"{name}.json")
        with open(path, "w") as fh:
            json.dump(out, fh, indent=1)
        n = out["nuts"]
        print(
            f"{name}: {len(out['params'])} parameters, max R-hat {n['max_rhat']:.4f}, "
            f"min ESS {n['min_ess']:.0f}, divergences {n['divergences']}, {n['seconds']:.1f}s -> {path}",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
