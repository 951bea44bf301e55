"""Moments of the factors' arguments under the candidate q.

* :mod:`blrppl.moments.kinds`: the moment objects the closed-form rules read (one class
  per kind of argument), re-exported here;
* :mod:`blrppl.moments.linearised`: building them from one linearisation of the model;
* :mod:`blrppl.moments.products`: second moments of products of two Gaussian blocks, by
  contraction.
"""

from blrppl.moments.kinds import (
    KINDS,
    AffineGaussian,
    BetaIdentity,
    BilinearGaussian,
    Const,
    DirichletIdentity,
    ExpGaussian,
    PowerGamma,
    WishartIdentity,
)

__all__ = [
    "KINDS",
    "AffineGaussian",
    "BetaIdentity",
    "BilinearGaussian",
    "Const",
    "DirichletIdentity",
    "ExpGaussian",
    "PowerGamma",
    "WishartIdentity",
]
