"""Is q's bulk off along some coordinate? What a low relative ESS cannot say in many dimensions.

The relative effective sample size of q's importance weights w = p/q bounds how far any
expectation under q may be from the posterior's: 1/ESS − 1 estimates χ²(p‖q), and
|E_p f − E_q f| ≤ √χ² · sd_q(f) (:data:`blrppl.posterior.diagnostics.ESS_POOR`). But χ² of a
product of many nearly equal marginals grows with the dimension: q and p differing by
χ²_i = c along each of d independent coordinates give 1 + χ² = (1 + c)^d, so a Gaussian q of a
logistic regression's 31 coefficients whose every mean and sd is within 5 % of NUTS' keeps 30 %
of its draws effective, as a q missing a third of one scale's sd does in 10 dimensions. The
bound holds for every f, and the f that reaches it is the weight itself, not a quantity a user
reads.

Where the weights are reliable (PSIS k̂ ≤ :data:`KHAT_BULK`: of finite variance, Vehtari et al.
2024), their self-normalised estimates of each coordinate's posterior mean and sd are too, and
say directly how far q's are. For every scalar of every drawn site (constrained space), with
u = (x − m_q) / s_q (q's own mean and sd of its draws):

    shift = Σ_s w̄_s u_s,      ratio² = Σ_s w̄_s (u_s − shift)²,

with their delta-method standard errors (Var shift ≈ Σ w̄² (u − shift)², Var ratio² ≈
Σ w̄² ((u − shift)² − ratio²)²). A coordinate is *off* when |shift| less :data:`BULK_Z` standard
errors exceeds :data:`BULK_SHIFT`, or |log ratio| less BULK_Z of its standard errors exceeds
log :data:`BULK_RATIO`. A fit whose ESS is low but none of whose coordinates is off has q's
marginals within these bounds: it is not poor for its ESS. The check reads the result's
importance-corrected draws (one compiled call, compiled when a fit first needs it) and runs
only where the ESS alone would call q poor.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

#: k̂ up to which the importance estimates of the coordinates' moments decide (finite variance)
KHAT_BULK = 0.5
#: a coordinate's mean is off when it lies more than this many of q's sds from q's (beyond
#: BULK_Z standard errors of the estimate)
BULK_SHIFT = 0.1
#: a coordinate's sd is off when it is more than this factor from q's (beyond BULK_Z standard
#: errors of the estimate)
BULK_RATIO = 1.2
#: standard errors subtracted before comparing (many coordinates are checked at once: at 3,
#: one in 740 coordinates close to q's comes out off by chance)
BULK_Z = 3.0
#: the most coordinates checked: a fit with more is not decided by the check
MAX_COORDINATES = 1024


class Coordinate(NamedTuple):
    """How far the posterior's mean and sd of one scalar are from q's (importance estimates).

    Attributes:
        site: the site.
        index: the scalar's flat index in the site's value.
        shift: (posterior mean − q's mean) / q's sd.
        shift_se: its Monte Carlo standard error.
        ratio: posterior sd / q's sd.
        ratio_se: its Monte Carlo standard error.
    """

    site: str
    index: int
    shift: float
    shift_se: float
    ratio: float
    ratio_se: float

    def off(self) -> bool:
        """Whether q's mean or sd of this scalar is off beyond the estimate's error."""
        if not (math.isfinite(self.shift) and self.ratio > 0):
            return True
        log_se = self.ratio_se / self.ratio
        return bool(
            abs(self.shift) - BULK_Z * self.shift_se > BULK_SHIFT
            or abs(math.log(self.ratio)) - BULK_Z * log_se > math.log(BULK_RATIO)
        )

    def describe(self) -> str:
        name = self.site if self.index < 0 else f"{self.site}[{self.index}]"
        return f"'{name}' mean {self.shift:+.2g} sd of q's (± {self.shift_se:.1g}), sd {self.ratio:.2g}× q's (± {self.ratio_se:.1g})"


class Bulk(NamedTuple):
    """The bulk check's finding.

    Attributes:
        coordinates: how many scalars it checked.
        off: the :class:`Coordinate` s found off, the farthest first (empty: q's marginals are
            within the check's bounds everywhere).
    """

    coordinates: int
    off: tuple


def coordinates(draws: dict, log_w) -> tuple:
    """The :class:`Coordinate` of every scalar of ``draws`` (site → ``(S, *shape)``) under the
    normalised weights ``exp(log_w)`` (``(S,)``); scalars that do not vary under q are left out.
    Index −1 names a scalar site."""
    log_w = np.asarray(log_w, float)
    w = np.exp(log_w - np.max(log_w))
    w = w / w.sum()
    out = []
    for site, values in draws.items():
        x = np.asarray(values, float).reshape(w.size, -1)
        m, s = x.mean(0), x.std(0)
        scalar = x.shape[1] == 1 and np.ndim(values) == 1
        for j in np.flatnonzero(s > 0):
            u = (x[:, j] - m[j]) / s[j]
            shift = float(np.sum(w * u))
            sq = (u - shift) ** 2
            var = float(np.sum(w * sq))
            shift_se = math.sqrt(float(np.sum(w**2 * sq)))
            ratio = math.sqrt(var)
            ratio_se = ratio * math.sqrt(float(np.sum(w**2 * (sq - var) ** 2))) / (2.0 * var) if var > 0 else math.inf
            out.append(Coordinate(site, -1 if scalar else int(j), shift, shift_se, ratio, ratio_se))
    return tuple(out)


def check(draws: dict, log_w) -> Bulk | None:
    """The :class:`Bulk` of q's weighted draws (see :func:`coordinates`), or None when the
    check cannot decide: more than :data:`MAX_COORDINATES` scalars, or a weight NaN or infinite
    (a weight of zero, log w = −∞, weighs nothing)."""
    log_w = np.asarray(log_w, float)
    if not np.any(np.isfinite(log_w)) or np.any(np.isnan(log_w) | (log_w == np.inf)):
        return None
    size = sum(int(np.prod(np.shape(v)[1:])) for v in draws.values())
    if not size or size > MAX_COORDINATES:
        return None
    found = coordinates(draws, log_w)
    off = sorted((c for c in found if c.off()), key=lambda c: -max(abs(c.shift), abs(math.log(c.ratio)) if c.ratio > 0 else math.inf))
    return Bulk(len(found), tuple(off))
