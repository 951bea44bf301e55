"""Issue 51's reference models: NumPyro's examples as their docs write them (the partially pooled
baseball models, the Dawid-Skene annotation model) and a change point on the coal-mining
disasters, with their fixed published data, the equivalent models their NUTS references sample,
and what those runs need (initial values, a relabelling of symmetric modes).
``tests/reference_models.py`` adds them to its registries and documents them with the others.
This module does not enable x64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist


#: hits of the 18 players of Efron & Morris (1975, J. Amer. Statist. Assoc. 70: 311-319, Table 1)
#: in their first 45 at-bats of the 1970 season (Clemente, F. Robinson, F. Howard, Johnstone,
#: Berry, Spencer, Kessinger, Alvarado, Santo, Swoboda, Unser, Williams, Scott, Petrocelli,
#: Rodriguez, Campaneris, Munson, Alvis)
BASEBALL_HITS = np.array([18, 17, 16, 15, 14, 14, 13, 12, 11, 11, 10, 10, 10, 10, 10, 9, 8, 7])
BASEBALL_AT_BATS = 45


def baseball_pooled_model(at_bats, hits=None):
    """NumPyro's ``partially_pooled`` (examples/baseball.py): each player's batting average
    ``phi`` ~ Beta(m κ, (1 − m) κ) around a common mean ``m`` ~ Uniform(0, 1) with a
    concentration ``kappa`` ~ Pareto(1, 1.5)."""
    m = numpyro.sample("m", dist.Uniform(0, 1))
    kappa = numpyro.sample("kappa", dist.Pareto(1, 1.5))
    num_players = at_bats.shape[0]
    with numpyro.plate("num_players", num_players):
        phi = numpyro.sample("phi", dist.Beta(m * kappa, (1 - m) * kappa))
        return numpyro.sample("obs", dist.Binomial(at_bats, probs=phi), obs=hits)


def baseball_pooled_nuts_model(at_bats, hits=None):
    """:func:`baseball_pooled_model`'s posterior over (m, kappa, phi) in the form the reference
    NUTS run samples: the centred Beta diverges (a funnel in kappa). Each phi is non-centred
    around its conditional posterior Beta(a, b), a = m κ + hits, b = (1 − m) κ + misses, on the
    logit scale: logit phi = E[logit phi] + sd[logit phi] z (digamma(a) − digamma(b) and
    √(trigamma(a) + trigamma(b))), with the log density of the model as written at phi plus
    log |d phi / d z| = log phi (1 − phi) + log sd; z's Normal(0, 1) prior is cancelled in the
    same factor (it only gives NUTS a proper site)."""
    from jax.scipy.special import digamma, polygamma

    m = numpyro.sample("m", dist.Uniform(0, 1))
    kappa = numpyro.sample("kappa", dist.Pareto(1, 1.5))
    a, b = m * kappa + hits, (1 - m) * kappa + at_bats - hits
    loc, scale = digamma(a) - digamma(b), jnp.sqrt(polygamma(1, a) + polygamma(1, b))
    with numpyro.plate("num_players", at_bats.shape[0]):
        z = numpyro.sample("phi_raw", dist.Normal(0.0, 1.0))
        eta = loc + scale * z
        phi = numpyro.deterministic("phi", jax.nn.sigmoid(eta))
        log_phi, log_1m_phi = jax.nn.log_sigmoid(eta), jax.nn.log_sigmoid(-eta)
        log_prior = (m * kappa - 1) * log_phi + ((1 - m) * kappa - 1) * log_1m_phi - (
            jax.scipy.special.betaln(m * kappa, (1 - m) * kappa)
        )
        log_lik = dist.Binomial(at_bats, probs=phi).log_prob(hits)
        jacobian = log_phi + log_1m_phi + jnp.log(scale)
        numpyro.factor("obs", log_prior + log_lik + jacobian - dist.Normal(0.0, 1.0).log_prob(z))


def baseball_logit_model(at_bats, hits=None):
    """NumPyro's ``partially_pooled_with_logit`` (examples/baseball.py): the players' logits
    ``alpha`` ~ Normal(``loc``, ``scale``) (centred), ``loc`` ~ Normal(−1, 1), ``scale`` ~
    HalfCauchy(1)."""
    loc = numpyro.sample("loc", dist.Normal(-1, 1))
    scale = numpyro.sample("scale", dist.HalfCauchy(1))
    num_players = at_bats.shape[0]
    with numpyro.plate("num_players", num_players):
        alpha = numpyro.sample("alpha", dist.Normal(loc, scale))
        return numpyro.sample("obs", dist.Binomial(at_bats, logits=alpha), obs=hits)


def baseball_logit_noncentred_model(at_bats, hits=None):
    """:func:`baseball_logit_model` with alpha = loc + scale * alpha_raw (the same posterior
    over loc, scale, alpha): what NUTS samples for the reference (the centred funnel diverges)."""
    loc = numpyro.sample("loc", dist.Normal(-1, 1))
    scale = numpyro.sample("scale", dist.HalfCauchy(1))
    with numpyro.plate("num_players", at_bats.shape[0]):
        alpha_raw = numpyro.sample("alpha_raw", dist.Normal(0.0, 1.0))
        alpha = numpyro.deterministic("alpha", loc + scale * alpha_raw)
        numpyro.sample("obs", dist.Binomial(at_bats, logits=alpha), obs=hits)


def baseball_data():
    return {"at_bats": np.full(BASEBALL_HITS.shape, float(BASEBALL_AT_BATS)), "hits": BASEBALL_HITS.astype(float)}


#: Dawid & Skene (1979, Appl. Statist. 28: 20-28, Table 1): 45 patients, each rated on a
#: 4-point scale (1-4) at 7 positions: the first of 5 clinicians rated every patient 3 times,
#: the others once each. Rows: patients; columns: positions.
DAWID_SKENE_POSITIONS = np.array([1, 1, 1, 2, 3, 4, 5])
DAWID_SKENE_RATINGS = np.array(
    [
        [1, 1, 1, 1, 1, 1, 1], [3, 3, 3, 4, 3, 3, 4], [1, 1, 2, 2, 1, 2, 2], [2, 2, 2, 3, 1, 2, 1],
        [2, 2, 2, 3, 2, 2, 2], [2, 2, 2, 3, 3, 2, 2], [1, 2, 2, 2, 1, 1, 1], [3, 3, 3, 3, 4, 3, 3],
        [2, 2, 2, 2, 2, 2, 3], [2, 3, 2, 2, 2, 2, 3], [4, 4, 4, 4, 4, 4, 4], [2, 2, 2, 3, 3, 4, 3],
        [1, 1, 1, 1, 1, 1, 1], [2, 2, 2, 3, 2, 1, 2], [1, 2, 1, 1, 1, 1, 1], [1, 1, 1, 2, 1, 1, 1],
        [1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1], [2, 2, 2, 2, 2, 2, 1], [2, 2, 2, 1, 3, 2, 2],
        [2, 2, 2, 2, 2, 2, 2], [2, 2, 2, 2, 2, 2, 1], [2, 2, 2, 3, 2, 2, 2], [2, 2, 1, 2, 2, 2, 2],
        [1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1], [2, 3, 2, 2, 2, 2, 2], [1, 1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 1, 1], [1, 1, 2, 1, 1, 2, 1], [1, 1, 1, 1, 1, 1, 1], [3, 3, 3, 3, 2, 3, 3],
        [1, 1, 1, 1, 1, 1, 1], [2, 2, 2, 2, 2, 2, 2], [2, 2, 2, 3, 2, 3, 2], [4, 3, 3, 4, 3, 4, 3],
        [2, 2, 1, 2, 2, 3, 2], [2, 3, 2, 3, 2, 3, 3], [3, 3, 3, 3, 4, 3, 2], [1, 1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 1, 1], [1, 2, 1, 2, 1, 1, 1], [2, 3, 2, 2, 2, 2, 2], [1, 2, 1, 1, 1, 1, 1],
        [2, 2, 2, 2, 2, 2, 2],
    ]
)


def dawid_skene_model(positions, annotations):
    """NumPyro's ``dawid_skene`` (examples/annotation.py): per annotator and true class a row
    ``beta`` ~ Dirichlet(1) of label probabilities, the classes' prevalence ``pi`` ~
    Dirichlet(1), each item's true class ``c`` ~ Categorical(pi) (enumerated), and each label
    ~ Categorical(beta[annotator, c])."""
    from numpyro.ops.indexing import Vindex

    num_annotators = int(np.max(positions)) + 1
    num_classes = int(np.max(annotations)) + 1
    num_items, num_positions = annotations.shape
    with numpyro.plate("annotator", num_annotators, dim=-2):
        with numpyro.plate("class", num_classes):
            beta = numpyro.sample("beta", dist.Dirichlet(jnp.ones(num_classes)))
    pi = numpyro.sample("pi", dist.Dirichlet(jnp.ones(num_classes)))
    with numpyro.plate("item", num_items, dim=-2):
        c = numpyro.sample("c", dist.Categorical(pi))
        with numpyro.plate("position", num_positions):
            numpyro.sample("y", dist.Categorical(Vindex(beta)[positions, c, :]), obs=annotations)


def dawid_skene_marginal_model(positions, annotations):
    """:func:`dawid_skene_model` with each item's class summed out by hand: the same posterior
    over beta and pi."""
    num_annotators = int(np.max(positions)) + 1
    num_classes = int(np.max(annotations)) + 1
    with numpyro.plate("annotator", num_annotators, dim=-2):
        with numpyro.plate("class", num_classes):
            beta = numpyro.sample("beta", dist.Dirichlet(jnp.ones(num_classes)))
    pi = numpyro.sample("pi", dist.Dirichlet(jnp.ones(num_classes)))
    # log p(labels of item i | c = k) = Σ_j log beta[positions[j], k, annotations[i, j]]: (items, classes)
    log_beta = jnp.log(beta)[positions]  # (positions, classes, labels)
    per_class = log_beta[jnp.arange(positions.shape[0]), :, annotations].sum(-2)
    with numpyro.plate("item", annotations.shape[0]):
        numpyro.factor("y", jax.nn.logsumexp(jnp.log(pi) + per_class, axis=-1))


def dawid_skene_nuts_init():
    """Where the reference chains start: every annotator right with probability 0.7 (wrong
    labels 0.1 each), classes equally likely. The posterior is symmetric under the 4! relabellings
    of the true classes (c, the rows of beta and pi permuted together); the reference is the
    mode whose classes are the labels (the annotators mostly right), where each chain stays."""
    num_annotators, num_classes = int(DAWID_SKENE_POSITIONS.max()), int(DAWID_SKENE_RATINGS.max())
    rows = 0.1 + 0.6 * np.eye(num_classes)
    beta = np.broadcast_to(rows, (num_annotators, num_classes, num_classes)).copy()
    return {"beta": beta, "pi": np.full(num_classes, 1.0 / num_classes)}


def dawid_skene_relabel(draws: dict) -> dict:
    """Draws of ``beta`` (..., annotators, classes, labels) and ``pi`` (..., classes) with each
    draw's true classes relabelled so that class k is the one the annotators most often call
    k: the permutation σ of the 4! maximising Σ_a Σ_k log beta[a, σ(k), k] (an identifying
    constraint in the manner of Stephens 2000, J. R. Statist. Soc. B 62: 795-809). The
    posterior is symmetric under relabelling and NUTS hops between the relabelled modes (the
    two rare classes, 3 and 4, within a few hundred draws), so the reference is the posterior
    restricted to this region; fitted draws are relabelled the same way to be compared."""
    import itertools

    beta, pi = np.asarray(draws["beta"]), np.asarray(draws["pi"])
    num_classes = pi.shape[-1]
    perms = np.array(list(itertools.permutations(range(num_classes))))  # (P, classes)
    labels = np.arange(num_classes)
    # score[..., p] = Σ_a Σ_k log beta[..., a, perms[p, k], k]
    log_beta = np.log(beta)
    score = np.stack([log_beta[..., :, perm, labels].sum((-2, -1)) for perm in perms], axis=-1)
    best = perms[np.argmax(score, axis=-1)]  # (..., classes)
    new_pi = np.take_along_axis(pi, best, axis=-1)
    new_beta = np.take_along_axis(beta, best[..., None, :, None], axis=-2)
    return dict(draws, beta=new_beta, pi=new_pi)


def dawid_skene_data():
    return {"positions": DAWID_SKENE_POSITIONS - 1, "annotations": DAWID_SKENE_RATINGS - 1}


#: coal-mining disasters in Great Britain (explosions killing ten or more), yearly counts of
#: the 191 of 15 March 1851 to 22 March 1962 (Jarrett 1979, Biometrika 66: 191-193), as the
#: change-point literature tabulates them: 111 years from 1851
COAL_DISASTERS = np.array(
    [
        4, 5, 4, 0, 1, 4, 3, 4, 0, 6, 3, 3, 4, 0, 2, 6, 3, 3, 5, 4, 5, 3, 1, 4, 4, 1, 5, 5, 3, 4,
        2, 5, 2, 2, 3, 4, 2, 1, 3, 2, 2, 1, 1, 1, 1, 3, 0, 0, 1, 0, 1, 1, 0, 0, 3, 1, 0, 3, 2, 2,
        0, 1, 1, 1, 0, 1, 0, 1, 0, 0, 0, 2, 1, 0, 0, 0, 1, 1, 0, 2, 3, 3, 1, 1, 2, 1, 1, 1, 1, 2,
        4, 2, 0, 0, 1, 4, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 1, 0, 1,
    ]
)
COAL_RATE_PRIOR = 1.0  # the rates' Exponential prior's rate


def change_point_model(disasters):
    """A Poisson change point on the coal-mining disasters: ``early_rate`` and ``late_rate``
    ~ Exponential(1), the year ``switchpoint`` ~ uniform over the years (the first year of the
    late rate), disasters ~ Poisson(early before the switch, late from it on).

    The switch point is discrete and enumerated (``Categorical`` with equal logits), not a
    continuous time with ``jnp.where``: the likelihood is a step function of a continuous
    switch time, flat between years, so its gradient is zero almost everywhere and only a
    year's resolution is in the data; summing over the 111 years is exact."""
    num_years = disasters.shape[0]
    early_rate = numpyro.sample("early_rate", dist.Exponential(COAL_RATE_PRIOR))
    late_rate = numpyro.sample("late_rate", dist.Exponential(COAL_RATE_PRIOR))
    switchpoint = numpyro.sample("switchpoint", dist.Categorical(logits=jnp.zeros(num_years)))
    rate = jnp.where(jnp.arange(num_years) < switchpoint, early_rate, late_rate)
    with numpyro.plate("years", num_years):
        numpyro.sample("disasters", dist.Poisson(rate), obs=disasters)


def change_point_marginal_model(disasters):
    """:func:`change_point_model` with the switch year summed out by hand: the same posterior
    over the two rates."""
    num_years = disasters.shape[0]
    early_rate = numpyro.sample("early_rate", dist.Exponential(COAL_RATE_PRIOR))
    late_rate = numpyro.sample("late_rate", dist.Exponential(COAL_RATE_PRIOR))
    early = dist.Poisson(early_rate).log_prob(disasters)
    late = dist.Poisson(late_rate).log_prob(disasters)
    # switch at s: years < s early, years ≥ s late; s = 0 … T−1
    before = jnp.concatenate([jnp.zeros(1), jnp.cumsum(early)[:-1]])
    after = jnp.cumsum(late[::-1])[::-1]
    numpyro.factor("disasters", jax.nn.logsumexp(before + after) - jnp.log(num_years))


def change_point_data():
    return {"disasters": COAL_DISASTERS.astype(float)}


#: issue 51's models, in the registries below
EXAMPLE_MODELS = {
    "baseball_pooled": (baseball_pooled_model, baseball_data),
    "baseball_logit": (baseball_logit_model, baseball_data),
}
EXAMPLE_DIAGNOSTIC_MODELS = {
    "dawid_skene": (dawid_skene_model, dawid_skene_data),
    "change_point": (change_point_model, change_point_data),
}
EXAMPLE_NUTS_MODELS = {
    "baseball_pooled": baseball_pooled_nuts_model,
    "baseball_logit": baseball_logit_noncentred_model,
    "dawid_skene": dawid_skene_marginal_model,
    "change_point": change_point_marginal_model,
}
#: name → initial values of the reference NUTS chains, where the posterior has symmetric modes
NUTS_INITS = {"dawid_skene": dawid_skene_nuts_init}
#: name → the map applied to the draws (site → array with leading draw axes) of a posterior with
#: symmetric modes, before its moments are taken (references and fits alike)
RELABEL = {"dawid_skene": dawid_skene_relabel}
