"""Candidate families: exponential families in natural parameters."""

from blrppl.families.base import Family
from blrppl.families.beta import Beta, BetaNat, BetaView
from blrppl.families.categorical import Bernoulli, BernoulliNat, Categorical, CategoricalNat, CategoricalView
from blrppl.families.dirichlet import Dirichlet, DirichletNat, DirichletView
from blrppl.families.gamma import Gamma, GammaNat, GammaView
from blrppl.families.gaussian import (
    DiagGaussianNat,
    DiagGaussianView,
    GaussianDense,
    GaussianDiag,
    GaussianNat,
    GaussianView,
)

#: family name → family class (``GaussianDense``, ``Dirichlet`` and ``Categorical`` take
#: the event dimension as their one argument, the others none)
FAMILIES: dict[str, type[Family]] = {
    "gaussian": GaussianDense,
    "gaussian-diag": GaussianDiag,
    "gamma": Gamma,
    "beta": Beta,
    "dirichlet": Dirichlet,
    "categorical": Categorical,
    "bernoulli": Bernoulli,
}

__all__ = [
    "FAMILIES",
    "Bernoulli",
    "BernoulliNat",
    "Beta",
    "BetaNat",
    "BetaView",
    "Categorical",
    "CategoricalNat",
    "CategoricalView",
    "DiagGaussianNat",
    "DiagGaussianView",
    "Dirichlet",
    "DirichletNat",
    "DirichletView",
    "Family",
    "Gamma",
    "GammaNat",
    "GammaView",
    "GaussianDense",
    "GaussianDiag",
    "GaussianNat",
    "GaussianView",
]
