"""Hidden Markov chains: chains of categorical latents as one forward–backward block.

References written here: a scaled forward–backward (Rabiner 1989) for known parameters,
and the structured variational Bayes updates of an HMM with Dirichlet transition rows and
Beta emissions (MacKay 1997; Beal 2003, ch. 3) iterated to their fixed point. Known
parameters make the model conjugate to the chain: one step is the exact posterior, so the
marginals and the ELBO (= log evidence at the exact posterior) must agree to rounding.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.contrib.control_flow import scan
from numpyro.distributions import constraints
from numpyro.infer import Predictive
from numpyro.ops.indexing import Vindex
from scipy.special import digamma, logsumexp

from blrppl.model.program import ModelProgram
from blrppl import BLRError, blr_fit
from blrppl.errors import UnsupportedFactorError

K = 3
TRANS = np.array([[0.8, 0.1, 0.1], [0.1, 0.8, 0.1], [0.2, 0.2, 0.6]])
LOCS = np.array([-2.0, 0.0, 2.0])


def simulate(rng, length, start=0):
    z = [start]
    for _ in range(length - 1):
        z.append(rng.choice(K, p=TRANS[z[-1]]))
    z = np.array(z)
    return z, LOCS[z] + rng.normal(size=length)


def forward_backward(log_init, log_trans, log_lik):
    """Marginals ``(T, K)``, pair marginals ``(T − 1, K, K)`` and log p(y) of one chain."""
    length = len(log_lik)
    alpha = np.zeros_like(log_lik)
    beta = np.zeros_like(log_lik)
    alpha[0] = log_init + log_lik[0]
    for t in range(1, length):
        alpha[t] = log_lik[t] + logsumexp(alpha[t - 1][:, None] + log_trans, axis=0)
    for t in range(length - 2, -1, -1):
        beta[t] = logsumexp(log_trans + (log_lik[t + 1] + beta[t + 1])[None, :], axis=1)
    log_z = logsumexp(alpha[-1])
    marg = np.exp(alpha + beta - log_z)
    pair = np.exp(alpha[:-1, :, None] + log_trans[None] + (log_lik[1:] + beta[1:])[:, None, :] - log_z)
    return marg, pair, log_z


def normal_log_lik(y):
    return -0.5 * (y[:, None] - LOCS[None, :]) ** 2 - 0.5 * np.log(2 * np.pi)


# -- known parameters: exact in one step ----------------------------------------------------


def scan_hmm(ys, lengths):
    """Several sequences of different lengths, padded and masked, as numpyro's HMM examples
    write them (scan over time, a plate of sequences inside)."""
    num = ys.shape[1]

    def step(carry, y):
        prev, t = carry
        with numpyro.plate("sequences", num):
            with numpyro.handlers.mask(mask=t < lengths):
                x = numpyro.sample("x", dist.Categorical(jnp.asarray(TRANS)[prev]))
                numpyro.sample("y", dist.Normal(jnp.asarray(LOCS)[x], 1.0), obs=y)
        return (x, t + 1), None

    scan(step, (jnp.zeros(num, dtype=int), 0), ys)


def scan_data():
    rng = np.random.default_rng(0)
    length, lengths = 60, np.array([60, 45, 23])
    ys = np.stack([simulate(rng, length)[1] for _ in lengths], 1)
    ys[ys.shape[0] - 5 :, 1] = 1e3  # (padding past a sequence's end: masked, never read)
    return ys, lengths


@pytest.fixture(scope="module")
def scan_case():
    ys, lengths = scan_data()
    fit = blr_fit(scan_hmm, (jnp.asarray(ys), jnp.asarray(lengths)), rng_key=random.PRNGKey(0), progress_bar=False)
    return ys, lengths, fit


def test_a_refit_with_other_lengths_is_exact_too(scan_case):
    """The same shapes, other sequence lengths (masks): not the first fit's readings."""
    ys, _, _ = scan_case
    lengths = np.array([30, 60, 41])
    fit = blr_fit(scan_hmm, (jnp.asarray(ys), jnp.asarray(lengths)), rng_key=random.PRNGKey(0), progress_bar=False)
    probs = np.asarray(fit.posterior["x"].probs)
    for n, length in enumerate(lengths):
        marg, _, _ = forward_backward(np.log(TRANS[0]), np.log(TRANS), normal_log_lik(ys[:length, n]))
        np.testing.assert_allclose(probs[:length, n], marg, atol=1e-8)


def test_scan_hmm_with_masked_sequences_equals_forward_backward(scan_case):
    ys, lengths, fit = scan_case
    assert "categorical-chain (3 × 60 states" in fit.plan.describe()
    assert fit.converged and fit.num_steps == 1
    probs = np.asarray(fit.posterior["x"].probs)  # (T, N, K)
    evidence = 0.0
    for n, length in enumerate(lengths):
        marg, _, log_z = forward_backward(np.log(TRANS[0]), np.log(TRANS), normal_log_lik(ys[:length, n]))
        np.testing.assert_allclose(probs[:length, n], marg, atol=1e-8)
        evidence += log_z
    # the exact posterior's ELBO is the log evidence; as in numpyro, a masked state has a flat
    # density: summed over its K values it contributes log K
    evidence += np.sum(ys.shape[0] - lengths) * np.log(K)
    assert abs(float(fit.elbo[-1]) - evidence) < 1e-8 * abs(evidence)


def test_joint_draws_follow_the_pair_marginals(scan_case):
    ys, lengths, fit = scan_case
    draws = np.asarray(fit.sample(random.PRNGKey(1), 4000)["x"])  # (S, T, N)
    _, pair, _ = forward_backward(np.log(TRANS[0]), np.log(TRANS), normal_log_lik(ys[: lengths[0], 0]))
    t = int(np.argmax(pair.max((1, 2)) < 0.9))  # a step with an uncertain transition
    freq = np.zeros((K, K))
    np.add.at(freq, (draws[:, t, 0], draws[:, t + 1, 0]), 1.0 / len(draws))
    # binomial standard error ≤ 0.5/sqrt(4000) ≈ 0.008: 0.035 is over 4 of them
    np.testing.assert_allclose(freq, pair[t], atol=0.035)
    # the guide draws whole chains too (Predictive runs the model on them)
    pred = Predictive(scan_hmm, guide=fit.guide, params=fit.params, num_samples=3)(
        random.PRNGKey(2), jnp.asarray(ys), jnp.asarray(lengths)
    )
    assert pred["y"].shape == (3,) + ys.shape


def loop_hmm(y):
    """One site per step (a Python loop), as in numpyro's enumeration tutorials."""
    prev = 0
    for t in range(len(y)):
        x = numpyro.sample(f"x_{t}", dist.Categorical(jnp.asarray(TRANS)[prev]))
        numpyro.sample(f"y_{t}", dist.Normal(jnp.asarray(LOCS)[x], 1.0), obs=y[t])
        prev = x


def test_one_site_per_step_is_one_chain():
    y = simulate(np.random.default_rng(1), 20)[1]
    fit = blr_fit(loop_hmm, (y,), rng_key=random.PRNGKey(0), progress_bar=False)
    assert "categorical-chain (1 × 20 states" in fit.plan.describe()
    marg, _, log_z = forward_backward(np.log(TRANS[0]), np.log(TRANS), normal_log_lik(y))
    probs = np.stack([np.asarray(fit.posterior[f"x_{t}"].probs) for t in range(20)])
    np.testing.assert_allclose(probs, marg, atol=1e-8)
    assert abs(float(fit.elbo[-1]) - log_z) < 1e-8 * abs(log_z)


# -- known tables with ties: what each element reads is still found ---------------------------
#
# A known transition table often has equal entries (a sticky chain's off-diagonal), or is
# symmetric: moving a state to another value then leaves the density at the value unchanged,
# every time for a two-state symmetric table whose two states both move. Each case: known
# parameters, so one step is the exact posterior (the reference forward–backward).

STICKY5 = jnp.full((5, 5), 0.05 / 4) + (0.95 - 0.05 / 4) * jnp.eye(5)  # a module-level jnp table
SYMMETRIC2 = np.array([[0.9, 0.1], [0.1, 0.9]])
CASINO_TRANS = np.array([[0.95, 0.05], [0.1, 0.9]])
CASINO_ROLLS = np.array([[1 / 6] * 6, [0.1] * 5 + [0.5]])  # a fair die: six equal entries


def sticky_scan_hmm(y):
    locs = jnp.linspace(-4.0, 4.0, 5)

    def step(prev, y_t):
        x = numpyro.sample("x", dist.Categorical(STICKY5[prev]))
        numpyro.sample("y", dist.Normal(locs[x], 1.0), obs=y_t)
        return x, None

    scan(step, 0, y)


def symmetric_scan_hmm(y):
    def step(prev, y_t):
        x = numpyro.sample("x", dist.Categorical(jnp.asarray(SYMMETRIC2)[prev]))
        numpyro.sample("y", dist.Normal(jnp.array([-1.0, 1.0])[x], 1.0), obs=y_t)
        return x, None

    scan(step, 0, y)


def casino_loop_hmm(rolls):
    """The occasionally dishonest casino, one site per roll."""
    prev = 0
    for t in range(len(rolls)):
        x = numpyro.sample(f"x_{t}", dist.Categorical(jnp.asarray(CASINO_TRANS)[prev]))
        numpyro.sample(f"roll_{t}", dist.Categorical(jnp.asarray(CASINO_ROLLS)[x]), obs=rolls[t])
        prev = x


def tied_factor_hmm(y, table):
    """The transitions as one ``numpyro.factor`` over slices of a vector site (no
    distribution to read but the factor's value)."""
    k = table.shape[0]
    with numpyro.plate("time", y.shape[0]):
        x = numpyro.sample("x", dist.Categorical(jnp.ones(k) / k))
        numpyro.sample("y", dist.Normal(jnp.linspace(-1.0, 1.0, k)[x], 1.0), obs=y)
    numpyro.factor("transitions", jnp.log(table)[x[:-1], x[1:]])


def _tied_case(name):
    rng = np.random.default_rng(11)
    if name.endswith("factor"):
        table = SYMMETRIC2 if name.startswith("symmetric") else np.asarray(STICKY5)
        k = table.shape[0]
        y = rng.normal(size=80)
        log_lik = -0.5 * (y[:, None] - np.linspace(-1.0, 1.0, k)[None]) ** 2 - 0.5 * np.log(2 * np.pi)

        def model(y):
            tied_factor_hmm(y, jnp.asarray(table))

        # (a uniform prior on every state: the reference's initial distribution, the
        # transitions' other 1/K factors constant)
        return model, y, table, log_lik, lambda fit: np.asarray(fit.posterior["x"].probs), np.full(k, 1.0 / k)
    if name == "sticky-5 scan":
        y = rng.normal(size=200) * 4.0
        log_lik = -0.5 * (y[:, None] - np.linspace(-4.0, 4.0, 5)[None]) ** 2 - 0.5 * np.log(2 * np.pi)
        return sticky_scan_hmm, y, np.asarray(STICKY5), log_lik, lambda fit: np.asarray(fit.posterior["x"].probs), None
    if name == "symmetric-2 scan":
        y = rng.normal(size=60)
        log_lik = -0.5 * (y[:, None] - np.array([-1.0, 1.0])[None]) ** 2 - 0.5 * np.log(2 * np.pi)
        return symmetric_scan_hmm, y, SYMMETRIC2, log_lik, lambda fit: np.asarray(fit.posterior["x"].probs), None
    rolls = rng.integers(0, 6, size=20)
    log_lik = np.log(CASINO_ROLLS.T[rolls])

    def probs(fit):
        return np.stack([np.asarray(fit.posterior[f"x_{t}"].probs) for t in range(len(rolls))])

    return casino_loop_hmm, rolls, CASINO_TRANS, log_lik, probs, None


@pytest.mark.parametrize(
    "name", ["sticky-5 scan", "symmetric-2 scan", "casino loop", "symmetric-2 factor", "sticky-5 factor"]
)
def test_known_tables_with_ties_are_exact_chains(name):
    model, y, trans, log_lik, probs, init = _tied_case(name)
    fit = blr_fit(model, (y,), rng_key=random.PRNGKey(0), progress_bar=False)
    assert "categorical-chain" in fit.plan.describe()
    marg, _, log_z = forward_backward(np.log(trans[0] if init is None else init), np.log(trans), log_lik)
    np.testing.assert_allclose(probs(fit), marg, atol=1e-8)
    if init is None:  # (the factor form's ELBO holds the other states' constant 1/K factors)
        assert abs(float(fit.elbo[-1]) - log_z) < 1e-8 * abs(log_z)


def sliced_hmm(y):
    """The chain as one vector site and its transitions as an element-wise factor over
    slices (x[:-1] → x[1:])."""
    t = y.shape[0]
    with numpyro.plate("time", t):
        x = numpyro.sample("x", dist.Categorical(jnp.ones(K) / K))
        numpyro.sample("y", dist.Normal(jnp.asarray(LOCS)[x], 1.0), obs=y)
    numpyro.factor("transitions", jnp.log(jnp.asarray(TRANS))[x[:-1], x[1:]])


def test_transitions_over_slices_are_a_chain():
    y = simulate(np.random.default_rng(2), 50)[1]
    fit = blr_fit(sliced_hmm, (y,), rng_key=random.PRNGKey(0), progress_bar=False)
    marg, _, _ = forward_backward(np.full(K, -np.log(K)), np.log(TRANS), normal_log_lik(y))
    np.testing.assert_allclose(np.asarray(fit.posterior["x"].probs), marg, atol=1e-8)


def test_a_latent_read_through_an_index_array_is_exact():
    """``y[i]`` reads ``z[perm[i]]``: not the aligned element (the enumeration's old
    assumption would pair y[i] with z[i], silently wrong)."""
    rng = np.random.default_rng(3)
    n = 40
    perm = rng.permutation(n)
    y = rng.normal(LOCS[:2][rng.integers(0, 2, n)][perm], 1.0)

    def model(y, perm):
        with numpyro.plate("n", n):
            z = numpyro.sample("z", dist.Bernoulli(0.3))
            numpyro.sample("y", dist.Normal(jnp.asarray(LOCS)[z[perm]], 1.0), obs=y)

    lik = np.exp(normal_log_lik(y)[:, :2]) * np.array([0.7, 0.3])
    # (the second fit has data of the same shapes, another index array: it must read it)
    for perm in (perm, rng.permutation(n)):
        fit = blr_fit(model, (y, perm), rng_key=random.PRNGKey(0), progress_bar=False)
        exact = np.empty(n)
        exact[perm] = lik[:, 1] / lik.sum(1)
        np.testing.assert_allclose(np.asarray(fit.posterior["z"].probs)[:, 1], exact, atol=1e-10)


def test_a_second_order_chain_is_a_clear_error():
    y = simulate(np.random.default_rng(4), 20)[1]

    def model(y):
        def step(carry, yt):
            a, b = carry  # the last two states
            probs = 0.5 * jnp.asarray(TRANS)[a] + 0.5 * jnp.asarray(TRANS)[::-1][b]
            x = numpyro.sample("x", dist.Categorical(probs))
            numpyro.sample("y", dist.Normal(jnp.asarray(LOCS)[x], 1.0), obs=yt)
            return (x, a), None

        scan(step, (0, 0), y)

    with pytest.raises(UnsupportedFactorError, match="'x'.*second-order") as err:
        blr_fit(model, (y,), progress_bar=False)
    assert isinstance(err.value, BLRError)


def test_a_factorial_chain_says_its_latents_are_one_chain_together():
    """Two hidden chains w, x with their own transitions, read together by the observations
    (NumPyro's factorial HMM): one chain of their states in turn, which the transition of
    w reads two places apart. The error named 'w' as reading 'the discrete latents w, x'
    (it reads only w): it now says which factor reads them together."""
    y = simulate(np.random.default_rng(4), 20)[1]

    def model(y):
        def step(carry, yt):
            w_prev, x_prev = carry
            w = numpyro.sample("w", dist.Categorical(jnp.asarray(TRANS)[w_prev]))
            x = numpyro.sample("x", dist.Categorical(jnp.asarray(TRANS)[::-1][x_prev]))
            numpyro.sample("y", dist.Normal(jnp.asarray(LOCS)[w] - jnp.asarray(LOCS)[x], 1.0), obs=yt)
            return (w, x), None

        scan(step, (0, 0), y)

    with pytest.raises(UnsupportedFactorError, match=r"w, x form one chain together \(read at once by 'y'\), and factor '[wx]'"):
        blr_fit(model, (y,), progress_bar=False)


def em_hmm(y):
    """Transition probabilities as a ``numpyro.param``: EM, i.e. Baum–Welch."""
    trans = numpyro.param("trans", jnp.full((K, K), 1.0 / K), constraint=constraints.simplex)

    def step(prev, y_t):
        x = numpyro.sample("x", dist.Categorical(trans[prev]))
        numpyro.sample("y", dist.Normal(jnp.asarray(LOCS)[x], 1.0), obs=y_t)
        return x, None

    scan(step, 0, y)


def test_transition_param_is_baum_welch():
    y = simulate(np.random.default_rng(7), 120)[1]
    fit = blr_fit(em_hmm, (jnp.asarray(y),), rng_key=random.PRNGKey(0), tol=1e-30, num_steps=150, progress_bar=False)
    trans = np.full((K, K), 1.0 / K)
    for _ in range(1000):  # Baum–Welch from the same start, to its fixed point
        gamma, xi, _ = forward_backward(np.log(trans[0]), np.log(trans), normal_log_lik(y))
        counts = xi.sum(0)
        counts[0] += gamma[0]
        trans, old = counts / counts.sum(1, keepdims=True), trans
        if np.max(np.abs(trans - old)) < 1e-14:
            break
    np.testing.assert_allclose(np.asarray(fit.posterior["trans"].mean), trans, atol=1e-8)


# -- Dirichlet rows and Beta emissions: structured VMP (variational Bayes for HMMs) -----------

HIDDEN, TONES = 2, 4
ALPHA0 = 0.9 * np.eye(HIDDEN) + 0.1
BETA0 = (0.1, 0.9)


def tones_hmm(sequences, lengths):
    """numpyro's ``examples/hmm_enum.py`` model_1, as written there (scan over time, padded
    sequences masked by their lengths, a plate of tones)."""
    num_sequences, max_length, data_dim = sequences.shape
    probs_x = numpyro.sample("probs_x", dist.Dirichlet(0.9 * jnp.eye(HIDDEN) + 0.1).to_event(1))
    probs_y = numpyro.sample("probs_y", dist.Beta(0.1, 0.9).expand([HIDDEN, data_dim]).to_event(2))

    def transition_fn(carry, y):
        x_prev, t = carry
        with numpyro.plate("sequences", num_sequences, dim=-2):
            with numpyro.handlers.mask(mask=(t < lengths)[..., None]):
                x = numpyro.sample("x", dist.Categorical(probs_x[x_prev]))
                with numpyro.plate("tones", data_dim, dim=-1):
                    numpyro.sample("y", dist.Bernoulli(probs_y[x.squeeze(-1)]), obs=y)
        return (x, t + 1), None

    x_init = jnp.zeros((num_sequences, 1), dtype=int)
    scan(transition_fn, (x_init, 0), jnp.swapaxes(sequences, 0, 1))


def tones_data(seed=5):
    rng = np.random.default_rng(seed)
    trans = np.array([[0.9, 0.1], [0.2, 0.8]])
    emit = np.array([[0.9, 0.8, 0.1, 0.1], [0.1, 0.2, 0.9, 0.7]])
    num, length = 6, 30
    lengths = rng.integers(18, length + 1, size=num)
    seqs = np.zeros((num, length, TONES))
    for n in range(num):
        z = 0
        for t in range(lengths[n]):
            z = rng.choice(HIDDEN, p=trans[z])
            seqs[n, t] = rng.random(TONES) < emit[z]
    return seqs, lengths


def structured_vb(seqs, lengths, resp, iterations=300):
    """Coordinate ascent for q(A) q(B) q(x) (the chain exact given the parameters), from
    state responsibilities ``resp`` ``(N, T, K)``, until the responsibilities stop moving;
    returns q(A)'s and q(B)'s parameters and the marginals."""
    num = len(lengths)
    gamma = [resp[n, : lengths[n]] for n in range(num)]
    xi = [np.einsum("tj,tk->tjk", g[:-1], g[1:]) for g in gamma]
    for _ in range(iterations):
        alpha = ALPHA0.copy()
        a = np.full((HIDDEN, TONES), BETA0[0])
        b = np.full((HIDDEN, TONES), BETA0[1])
        for n in range(num):
            y = seqs[n, : lengths[n]]
            alpha[0] += gamma[n][0]
            alpha += xi[n].sum(0)
            a += gamma[n].T @ y
            b += gamma[n].T @ (1 - y)
        log_trans = digamma(alpha) - digamma(alpha.sum(1, keepdims=True))
        log_on, log_off = digamma(a) - digamma(a + b), digamma(b) - digamma(a + b)
        old = np.concatenate([g.ravel() for g in gamma])
        for n in range(num):
            y = seqs[n, : lengths[n]]
            lik = y @ log_on.T + (1 - y) @ log_off.T
            gamma[n], xi[n], _ = forward_backward(log_trans[0], log_trans, lik)
        if np.max(np.abs(np.concatenate([g.ravel() for g in gamma]) - old)) < 1e-12:
            break
    return alpha, a, b, gamma


def test_dirichlet_rows_equal_structured_variational_bayes():
    seqs, lengths = tones_data()
    fit = blr_fit(
        tones_hmm, (jnp.asarray(seqs), jnp.asarray(lengths)), rng_key=random.PRNGKey(0), tol=1e-30,
        num_steps=1500, progress_bar=False,
    )
    # (run to the step cap: variational message passing converges linearly, and the ELBO is
    # flat at its optimum, so a relative ELBO change of 1e-14 still leaves 1e-7 in the counts)
    probs = np.swapaxes(np.asarray(fit.posterior["x"].probs)[:, :, 0], 0, 1)  # (N, T, K)
    # the reference starts from the fit's responsibilities moved halfway to uniform: it
    # must come back to the same fixed point (up to the arbitrary labels of the states)
    alpha, a, b, gamma = structured_vb(seqs, lengths, 0.5 * probs + 0.25)
    post_alpha = np.asarray(fit.posterior["probs_x"].base_dist.concentration)
    np.testing.assert_allclose(post_alpha, alpha, rtol=1e-8)
    np.testing.assert_allclose(np.asarray(fit.posterior["probs_y"].base_dist.concentration1), a, rtol=1e-8)
    np.testing.assert_allclose(np.asarray(fit.posterior["probs_y"].base_dist.concentration0), b, rtol=1e-8)
    for n, length in enumerate(lengths):
        np.testing.assert_allclose(probs[n, :length], gamma[n], atol=1e-8)


FLOAT32 = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
assert not jax.config.jax_enable_x64
sys.path.insert(0, "TESTS")
from test_hmm import scan_hmm
from blrppl import blr_fit
ys = np.asarray(json.loads(sys.stdin.read()), dtype=np.float32)
fit = blr_fit(scan_hmm, (jnp.asarray(ys), jnp.asarray([ys.shape[0]])), rng_key=jax.random.PRNGKey(0), progress_bar=False)
probs = fit.posterior["x"].probs
print(json.dumps({"probs": np.asarray(probs)[:, 0].tolist(), "dtype": str(probs.dtype)}))
"""


def test_float32_chain_equals_forward_backward():
    """A 400-step chain in float32 (the forward–backward normalises every step: accurate)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    ys = simulate(np.random.default_rng(6), 400)[1][:, None]
    here = Path(__file__).resolve().parent
    code = FLOAT32.replace("TESTS", str(here))
    env = {k: v for k, v in __import__("os").environ.items() if k != "JAX_ENABLE_X64"}
    out = subprocess.run(
        [sys.executable, "-c", code], input=json.dumps(ys.tolist()), capture_output=True, text=True, env=env,
        cwd=here.parents[2], timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["dtype"] == "float32"
    marg, _, _ = forward_backward(np.log(TRANS[0]), np.log(TRANS), normal_log_lik(ys[:, 0]))
    np.testing.assert_allclose(np.asarray(result["probs"]), marg, atol=1e-4)


def test_a_chain_in_a_subsampled_plate_warns_it_is_mean_field():
    """One site per step inside a subsampled plate of sequences: no chain block there (the
    steps are fitted mean-field), and the fit says so."""
    rng = np.random.default_rng(8)
    ys = np.stack([simulate(rng, 6)[1] for _ in range(12)], 1)

    def model(ys):
        with numpyro.plate("sequences", ys.shape[1], subsample_size=4) as idx:
            prev = 0
            for t in range(ys.shape[0]):
                x = numpyro.sample(f"x_{t}", dist.Categorical(jnp.asarray(TRANS)[prev]))
                numpyro.sample(f"y_{t}", dist.Normal(jnp.asarray(LOCS)[x], 1.0), obs=ys[t, idx])
                prev = x

    with pytest.warns(UserWarning, match="x_0 … x_5 form a chain inside a subsampled plate.*mean-field"):
        blr_fit(model, (ys,), rng_key=random.PRNGKey(0), num_steps=5, progress_bar=False)


def test_an_initial_state_of_another_dtype_is_a_clear_error():
    """numpyro's scan refuses a carry whose dtype changes (int32 in, int64 out of a
    Categorical under x64): the error says which dtype to give, not to check the data."""
    y = simulate(np.random.default_rng(9), 10)[1]

    def model(y):
        def step(prev, y_t):
            x = numpyro.sample("x", dist.Categorical(jnp.asarray(TRANS)[prev]))
            numpyro.sample("y", dist.Normal(jnp.asarray(LOCS)[x], 1.0), obs=y_t)
            return x, None

        scan(step, jnp.zeros((), dtype=jnp.int32), y)

    with pytest.raises(BLRError, match="(?s)dtype differs from its initial state's.*dtype=int"):
        blr_fit(model, (y,), progress_bar=False)


def test_numpy_chain_parameters_take_the_host_loop_or_the_compiled_scan_alike(monkeypatch):
    """A chain's view of numpy parameters (the discrete start's E-step under the prior) runs
    a host loop for short chains and the compiled scan for long ones; both equal the
    forward–backward written here, in numpy."""
    from blrppl.families import categorical_chain as cc

    rng = np.random.default_rng(4)
    chains, length = 2, 7
    unary = rng.normal(size=(chains, length, K))
    log_trans = rng.normal(size=(chains, K, K))
    pair = np.repeat(log_trans[:, None], length - 1, axis=1)
    family = cc.CategoricalChain(length, K)
    for limit in (10**9, 0):
        monkeypatch.setattr(cc, "HOST_LOOP_STATES", limit)
        view = family.view(cc.ChainNat(unary, pair))
        assert isinstance(view.probs, np.ndarray) and isinstance(view.pair_probs, np.ndarray)
        for c in range(chains):
            marg, pairs, _ = forward_backward(np.zeros(K), log_trans[c], unary[c])
            np.testing.assert_allclose(view.probs[c], marg, rtol=1e-10, atol=1e-14)
            np.testing.assert_allclose(view.pair_probs[c], pairs, rtol=1e-10, atol=1e-14)


def _far_apart(scale):
    """Two states, three steps: z_0 = 1 costs ``scale``, z_1 = 0 twice that, and leaving a
    state 0.8 · ``scale``: the mass moves between states whose potentials differ beyond the
    exponential's range (the only paths are 0 → 1 → ·, at −0.8 · scale, and 1 → 1 → ·)."""
    unary = np.array([[[0.0, -scale], [-2.0 * scale, 0.0], [0.0, 0.0]]])
    log_trans = np.array([[[0.0, -0.8 * scale], [-0.8 * scale, 0.0]]])
    return unary, log_trans


CHAIN_VIEW_CASES = {
    # name: (unary (C, L, K), time-homogeneous log transitions (C, K, K)), whether the
    # scaled recursion holds it in float64 and in float32
    "random": (
        np.random.default_rng(8).normal(size=(2, 9, K)) * 3.0,
        np.random.default_rng(9).normal(size=(2, K, K)),
        (True, True),
    ),
    "far apart in float32": (*_far_apart(100.0), (True, False)),
    "far apart in float64": (*_far_apart(1000.0), (False, False)),
    "one state per chain": (np.random.default_rng(10).normal(size=(2, 1, K)), np.zeros((2, K, K)), (True, True)),
}


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", list(CHAIN_VIEW_CASES))
def test_chain_view_equals_forward_backward(name, dtype):
    """The compiled view of a chain (the scaled forward–backward, with the log-space one
    when the scaled one leaves the dtype's range) equals the log-space forward–backward
    written here: marginals, pair marginals and entropy (log Z − ⟨λ, μ⟩)."""
    from blrppl.families import categorical_chain as cc

    unary, log_trans, scaled_holds = CHAIN_VIEW_CASES[name]
    chains, length, k = unary.shape
    pair = np.repeat(log_trans[:, None], length - 1, axis=1)
    family = cc.CategoricalChain(length, k)
    nat = cc.ChainNat(jnp.asarray(unary, dtype=dtype), jnp.asarray(pair, dtype=dtype))
    assert bool(cc._scaled_view(nat)[2]) == scaled_holds[dtype == "float32"]
    view, entropy = jax.jit(family.rule_view_and_entropy)(nat)
    tol = {"float64": 1e-10, "float32": 2e-5}[dtype]
    for c in range(chains):
        marg, pairs, log_z = forward_backward(np.zeros(k), log_trans[c], unary[c])
        np.testing.assert_allclose(np.asarray(view.probs[c], float), marg, atol=tol)
        np.testing.assert_allclose(np.asarray(view.pair_probs[c], float), pairs, atol=tol)
        inner = np.sum(marg * unary[c]) + np.sum(pairs * pair[c])
        np.testing.assert_allclose(float(entropy[c]), log_z - inner, rtol=tol, atol=tol * abs(log_z))


def test_chain_log_prob_and_draws_are_the_distribution():
    """A chain posterior's log q(z) (the potentials read at the states) sums to one over all
    3³ configurations of each of two short chains, and 20,000 joint draws (forward
    filtering, backward sampling from the conditionals' precomputed CDFs) hit every
    configuration at its probability (3 binomial sds of 20,000 draws: < 0.011)."""
    import itertools

    from blrppl.families import categorical_chain as cc

    rng = np.random.default_rng(13)
    unary, pair = rng.normal(size=(2, 3, 3)), 2.0 * rng.normal(size=(2, 2, 3, 3))
    family = cc.CategoricalChain(3, 3)
    nat = cc.ChainNat(jnp.asarray(unary), jnp.asarray(pair))
    configs = np.array(list(itertools.product(range(3), repeat=3)))  # (27, L)
    log_q = np.asarray(family.log_prob(nat, jnp.asarray(np.repeat(configs[:, None, :], 2, axis=1))))  # (27, C)
    np.testing.assert_allclose(np.exp(log_q).sum(0), 1.0, rtol=1e-12)
    draws = np.asarray(family.sample(nat, random.PRNGKey(0), (20_000,)))  # (20000, C, L)
    for c in range(2):
        codes = draws[:, c] @ np.array([9, 3, 1])
        freq = np.bincount(codes, minlength=27) / len(codes)
        np.testing.assert_allclose(freq, np.exp(log_q[:, c]), atol=0.011)


@pytest.mark.parametrize("k", [1, 2, 3, 5, 6])
def test_de_bruijn_sequence_holds_every_pair_once(k):
    from blrppl.graph.chain_table import de_bruijn

    seq = de_bruijn(k)
    pairs = {(int(a), int(b)) for a, b in zip(seq, np.roll(seq, -1))}
    assert len(seq) == k * k and pairs == {(a, b) for a in range(k) for b in range(k)}


@pytest.mark.parametrize("length, width, k, covered", [(3, 1, 3, False), (10, 1, 3, True), (6, 4, 2, True), (17, 2, 4, True)])
def test_table_runs_show_every_pair_of_values(length, width, k, covered):
    """The K runs' layouts: every pair of values read by some element reading two states
    (or no table, for a chain too short to show them all), and every value of each element
    reading one state in some run."""
    from blrppl.graph.chain_table import ChainTable
    from blrppl.graph.markov import Reads

    positions = np.arange(length * width)
    lo = positions.reshape(length, width)  # element (t, c) reads step t − 1 and t of chain c
    lo = np.where(lo >= width, lo - width, lo)
    hi = np.where(positions.reshape(length, width) >= width, positions.reshape(length, width), -1)
    table = ChainTable.build(Reads(lo, hi), k, length, width)
    assert (table is not None) == covered
    if table is None:
        return
    lo, hi = lo.ravel(), hi.ravel()
    for code in range(k * k):
        r, e = table.pair_run[code], table.pair_element[code]
        assert hi[e] >= 0 and table.states[r, lo[e]] * k + table.states[r, hi[e]] == code
    for e in np.flatnonzero(hi < 0):
        assert [table.states[table.single_run[e, v], lo[e]] for v in range(k)] == list(range(k))


COVARIATE = np.random.default_rng(11).normal(size=40)


def input_driven_hmm(y, u):
    """Transitions driven by a covariate (an input–output HMM): the rows differ by step."""
    w = jnp.asarray(np.log(TRANS))

    def step(prev, inputs):
        y_t, u_t = inputs
        x = numpyro.sample("x", dist.Categorical(logits=w[prev] + u_t * jnp.arange(K)))
        numpyro.sample("y", dist.Normal(jnp.asarray(LOCS)[x], 1.0), obs=y_t)
        return x, None

    scan(step, 0, (y, u))


def pair_emission_hmm(y):
    """An observation of each step that reads both of its states."""

    def step(prev, y_t):
        x = numpyro.sample("x", dist.Categorical(jnp.asarray(TRANS)[prev]))
        numpyro.sample("y", dist.Normal(jnp.asarray(LOCS)[x] - 0.5 * jnp.asarray(LOCS)[prev], 1.0), obs=y_t)
        return x, None

    scan(step, 0, y)


def test_transitions_are_read_as_one_table_only_where_every_step_shares_it():
    """The transition factor of a hidden Markov chain runs the model K times, not K², when
    every step reads the same table (the chain's elements at the same pair of states have
    the same arguments and value): the plans of the models this file checks against its
    references hold it where they should (their exactness tests cover the table), and not
    for a covariate-driven transition or an observation reading two states (both exact
    here against a forward–backward with per-step transitions)."""
    from blrppl.api import plan_of

    def tabled(plan):
        return sorted(f.name for f in plan.factors if f.enumeration is not None and f.enumeration.table is not None)

    seqs, lengths = tones_data()
    assert tabled(plan_of(tones_hmm, (jnp.asarray(seqs), jnp.asarray(lengths)))) == ["x"]
    ys, lens = scan_data()
    assert tabled(plan_of(scan_hmm, (jnp.asarray(ys), jnp.asarray(lens)))) == ["x"]
    assert "exact (one 3 × 3 table)" in plan_of(scan_hmm, (jnp.asarray(ys), jnp.asarray(lens))).describe()

    z, y = simulate(np.random.default_rng(12), 40)
    fit = blr_fit(input_driven_hmm, (jnp.asarray(y), jnp.asarray(COVARIATE)), progress_bar=False)
    assert tabled(fit.plan) == []
    log_trans = np.log(TRANS)[None] + COVARIATE[1:, None, None] * np.arange(K)[None, None, :]
    log_trans = log_trans - logsumexp(log_trans, axis=-1, keepdims=True)
    log_init = np.log(TRANS[0]) + COVARIATE[0] * np.arange(K)
    marg = _time_varying_forward_backward(log_init - logsumexp(log_init), log_trans, normal_log_lik(y))
    np.testing.assert_allclose(np.asarray(fit.posterior["x"].probs), marg, atol=1e-8)

    fit = blr_fit(pair_emission_hmm, (jnp.asarray(y),), progress_bar=False)
    assert tabled(fit.plan) == ["x"]
    lik = -0.5 * (y[1:, None, None] - (LOCS[None, None, :] - 0.5 * LOCS[None, :, None])) ** 2 - 0.5 * np.log(2 * np.pi)
    log_trans = np.log(TRANS)[None] + lik  # (T − 1, K, K): the step's transition and observation
    first = np.log(TRANS[0]) + (-0.5 * (y[0] - (LOCS - 0.5 * LOCS[0])) ** 2 - 0.5 * np.log(2 * np.pi))
    marg = _time_varying_forward_backward(first, log_trans, np.zeros((len(y), K)))
    np.testing.assert_allclose(np.asarray(fit.posterior["x"].probs), marg, atol=1e-8)


def _time_varying_forward_backward(log_init, log_trans, log_lik):
    """Marginals of one chain with per-step transitions ``log_trans`` ``(T − 1, K, K)``."""
    length = len(log_lik)
    alpha, beta = np.zeros_like(log_lik), np.zeros_like(log_lik)
    alpha[0] = log_init + log_lik[0]
    for t in range(1, length):
        alpha[t] = log_lik[t] + logsumexp(alpha[t - 1][:, None] + log_trans[t - 1], axis=0)
    for t in range(length - 2, -1, -1):
        beta[t] = logsumexp(log_trans[t] + (log_lik[t + 1] + beta[t + 1])[None, :], axis=1)
    return np.exp(alpha + beta - logsumexp(alpha[-1]))


def test_enumerated_states_run_in_chunks_alike(monkeypatch):
    """A long chain's K² enumerated states run in a sequential map over chunks (the
    intermediates of all of them at once outgrow the caches): forced here on the tones
    model (the transition's 4 states of 180 elements in chunks of 2, the emission's 2 states
    of 720 elements one at a time), the run equals the one of all states at once."""
    from blrppl.estimators import enumeration

    seqs, lengths = tones_data()
    monkeypatch.setenv("BLRPPL_COMPILATION_CACHE", "0")
    fits = []
    for limit in (enumeration.CHUNK_STATE_ELEMENTS, 500):
        monkeypatch.setattr(enumeration, "CHUNK_STATE_ELEMENTS", limit)
        fits.append(blr_fit(
            lambda *a: tones_hmm(*a), (jnp.asarray(seqs), jnp.asarray(lengths)), rng_key=random.PRNGKey(0),
            tol=1e-30, num_steps=20, progress_bar=False,
        ))
    whole, chunked = fits
    np.testing.assert_allclose(chunked.elbo, whole.elbo, rtol=1e-12)
    for a, b in zip(jax.tree.leaves(chunked.nat), jax.tree.leaves(whole.nat)):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


def test_an_aligned_mixture_is_read_aligned_from_its_program(monkeypatch):
    """A mixture's labels are read aligned (``y[i]`` reads ``z[i]``, and z's own prior reads
    each label alone): the program's element reads say so, and z stays a categorical block
    enumerated element by element (no chain)."""
    from blrppl.graph import markov
    from blrppl.model.trace import trace_model
    from blrppl.compiler.pipeline import compile_model

    verdicts = []
    aligned = markov.is_aligned

    def recording(members, factor, reads):
        verdicts.append((factor.name, aligned(members, factor, reads), reads.lo.copy(), reads.hi.copy()))
        return verdicts[-1][1]

    monkeypatch.setattr(markov, "is_aligned", recording)
    y = np.random.default_rng(5).normal(size=300)

    def mixture(y):
        with numpyro.plate("n", y.shape[0]):
            z = numpyro.sample("z", dist.Bernoulli(0.3))
            numpyro.sample("y", dist.Normal(jnp.asarray(LOCS)[z], 1.0), obs=y)

    records, spec, dyn, _ = trace_model(mixture, (jnp.asarray(y),), {}, random.PRNGKey(0))
    plan = compile_model(ModelProgram(mixture), records, spec, dyn, rng_key=random.PRNGKey(1))[0]
    assert sorted(v[0] for v in verdicts) == ["y", "z"] and all(v[1] for v in verdicts)
    for _, _, lo, hi in verdicts:
        np.testing.assert_array_equal(lo, np.arange(300))
        assert np.all(hi == -1)
    (z,) = [b for b in plan.blocks if b.name == "z"]
    assert not z.chain


@pytest.mark.parametrize(
    "index", [np.array([0, 0, 1, 2, 3, 4, 5]), np.array([[6, 5], [0, 0]]), np.array([3, 1, 4]), np.zeros(6, int)]
)
def test_rows_by_a_static_index_have_a_gather_gradient(index):
    """The chain weights' rows read by the factors' static positions: value and gradient
    equal the plain gather's; with each row read at most 4 times the gradient holds no
    scatter (XLA's CPU backend loops over a scatter's elements one by one), beyond that it
    is the plain gather's."""
    from blrppl.graph.chain_table import MAX_READERS, static_rows

    table = jnp.asarray(np.random.default_rng(0).normal(size=(7, 3)))

    def loss(read):
        return lambda t: jnp.sum(jnp.sin(read(t)) * jnp.arange(1.0, 4.0))

    fast, plain = loss(lambda t: static_rows(t, index)), loss(lambda t: t[index])
    np.testing.assert_allclose(fast(table), plain(table), rtol=1e-14)
    np.testing.assert_allclose(jax.grad(fast)(table), jax.grad(plain)(table), rtol=1e-14, atol=1e-15)
    text = jax.jit(jax.grad(fast)).lower(table).as_text()
    assert ("scatter" in text) == (np.bincount(index.ravel()).max() > MAX_READERS)


def test_exchangeable_emission_means_start_from_the_observations():
    """A two-state Gaussian HMM whose states the priors cannot tell apart (both means
    Normal(0, 3), as users write it with ``expand``): the E-step under the prior leaves the
    states tied, and the chain now starts from k-means++ on its emissions per step. From
    random responsibilities it stopped at the symmetric point (both means −0.19, σ 1.21, ELBO
    −333.5 against −286.3; two of four starts did)."""
    rng = np.random.default_rng(0)
    states = [0]
    for _ in range(199):
        states.append(states[-1] if rng.random() < 0.9 else 1 - states[-1])
    states = np.array(states)
    y = np.array([-1.0, 1.0])[states] + 0.7 * rng.normal(size=200)

    def model(y):
        trans = numpyro.sample("trans", dist.Dirichlet(jnp.ones((2, 2))).to_event(1))
        mu = numpyro.sample("mu", dist.Normal(0.0, 3.0).expand([2]).to_event(1))
        sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
        z0 = numpyro.sample("z0", dist.Categorical(jnp.ones(2) / 2))

        def step(prev, y_t):
            z = numpyro.sample("z", dist.Categorical(Vindex(trans)[prev]))
            numpyro.sample("y", dist.Normal(mu[z], sigma), obs=y_t)
            return z, None

        scan(step, z0, y)

    result = blr_fit(model, (y,), rng_key=random.PRNGKey(0), progress_bar=False)
    means = np.sort(np.asarray(result.posterior["mu"].mean))
    assert np.all(np.abs(means - np.array([-1.0, 1.0])) < 0.15), means
    decoded = np.asarray(result.sample(random.PRNGKey(1), 1)["z"])[0]
    agree = np.mean(decoded == states)
    assert max(agree, 1.0 - agree) > 0.85, agree


def tempered_hmm(y):
    """A latent transition table whose rows are read shifted from step 3 on: the same pair of
    states, another row of the table at early and late steps."""
    probs_x = numpyro.sample("probs_x", dist.Dirichlet(jnp.ones((K, K))).to_event(1))

    def step(carry, y_t):
        prev, t = carry
        x = numpyro.sample("x", dist.Categorical(jnp.where(t < 3, probs_x[prev], probs_x[(prev + 1) % K])))
        numpyro.sample("y", dist.Normal(jnp.asarray(LOCS)[x], 1.0), obs=y_t)
        return (x, t + 1), None

    scan(step, (0, 0), y)


def shared_table_hmm(y):
    """The same model reading its latent table alike at every step."""
    probs_x = numpyro.sample("probs_x", dist.Dirichlet(jnp.ones((K, K))).to_event(1))

    def step(prev, y_t):
        x = numpyro.sample("x", dist.Categorical(probs_x[prev]))
        numpyro.sample("y", dist.Normal(jnp.asarray(LOCS)[x], 1.0), obs=y_t)
        return x, None

    scan(step, 0, y)


def test_a_latent_table_read_differently_at_some_steps_is_not_one_table():
    """Whether every step reads the table alike is read off the program as functions of the
    latent table (value numbers), not at a point: rows read shifted from step 3 on split the
    steps, the same model without the shift is one table."""
    from blrppl.api import plan_of

    _, y = simulate(np.random.default_rng(3), 30)
    plans = {m.__name__: plan_of(m, (jnp.asarray(y),)) for m in (tempered_hmm, shared_table_hmm)}
    # (both transitions in closed form: the table is the only difference)
    assert all({f.name: f.estimator for f in p.factors}["x"] == "exact" for p in plans.values())
    tables = {n: [f.name for f in p.factors if f.enumeration is not None and f.enumeration.table is not None] for n, p in plans.items()}
    assert tables == {"tempered_hmm": [], "shared_table_hmm": ["x"]}, {n: p.describe() for n, p in plans.items()}
