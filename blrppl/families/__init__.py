"""Candidate families: exponential families in natural parameters."""

from blrppl.families.base import Family
from blrppl.families.beta import Beta, BetaNat, BetaRuleView, BetaView
from blrppl.families.categorical import Bernoulli, BernoulliNat, Categorical, CategoricalNat, CategoricalView
from blrppl.families.categorical_chain import CategoricalChain, ChainNat, ChainView, MarkovChainPosterior
from blrppl.families.dirichlet import Dirichlet, DirichletNat, DirichletRuleView, DirichletView
from blrppl.families.gamma import Gamma, GammaNat, GammaRuleView, GammaView
from blrppl.families.gaussian import (
    DiagGaussianNat,
    DiagGaussianView,
    GaussianDense,
    GaussianDiag,
    GaussianNat,
    GaussianView,
)
from blrppl.families.gaussian_arrowhead import (
    ArrowheadGaussianNat,
    ArrowheadGaussianView,
    ArrowheadPrecisionNormal,
    GaussianArrowhead,
)
from blrppl.families.gaussian_banded import (
    BandedGaussianNat,
    BandedGaussianView,
    BandedPrecisionNormal,
    GaussianBanded,
)
from blrppl.families.gaussian_ivon import GaussianIVON, IVONNat
from blrppl.families.gaussian_mixture import GaussianMixture, MixtureNat, MixtureView
from blrppl.families.gaussian_tied import GaussianTied
from blrppl.families.wishart import Wishart, WishartNat, WishartRuleView, WishartView

from blrppl.families.registry import (
    FAMILIES,
    register_family,
    seal_builtin_families,
    unregister_family,
    user_families,
)

#: family name → family class (``GaussianDense``, ``Dirichlet`` and ``Categorical`` take
#: the event dimension as their one argument, the others none; ``Family.for_value`` builds
#: one for a block). A latent's default family is the first native one that fits its
#: support: the more specific before the more general (Bernoulli before Categorical).
#: A user's families join it through :func:`register_family`.
FAMILIES.update(
    (family.name, family)
    for family in (GaussianDense, GaussianDiag, GaussianIVON, Gamma, Beta, Dirichlet, Wishart, Bernoulli, Categorical)
)
seal_builtin_families()

__all__ = [
    "FAMILIES",
    "ArrowheadGaussianNat",
    "ArrowheadGaussianView",
    "ArrowheadPrecisionNormal",
    "BandedGaussianNat",
    "BandedGaussianView",
    "BandedPrecisionNormal",
    "Bernoulli",
    "BernoulliNat",
    "Beta",
    "BetaNat",
    "BetaRuleView",
    "BetaView",
    "Categorical",
    "CategoricalNat",
    "CategoricalView",
    "CategoricalChain",
    "ChainNat",
    "ChainView",
    "DiagGaussianNat",
    "DiagGaussianView",
    "Dirichlet",
    "DirichletNat",
    "DirichletRuleView",
    "DirichletView",
    "Family",
    "Gamma",
    "GammaNat",
    "GammaRuleView",
    "GammaView",
    "GaussianArrowhead",
    "GaussianBanded",
    "GaussianDense",
    "GaussianDiag",
    "GaussianIVON",
    "IVONNat",
    "GaussianMixture",
    "MixtureNat",
    "MixtureView",
    "GaussianNat",
    "GaussianTied",
    "GaussianView",
    "MarkovChainPosterior",
    "Wishart",
    "WishartNat",
    "WishartRuleView",
    "WishartView",
    "register_family",
    "unregister_family",
    "user_families",
]
