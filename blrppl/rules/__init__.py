"""Closed-form expected log-densities, one module per numpyro distribution.

Importing this package registers every rule (see :mod:`blrppl.rules.registry`).
"""

from blrppl.rules import (  # noqa: F401  (imported for their registrations)
    bernoulli,
    beta,
    binomial,
    categorical,
    dirichlet,
    exponential,
    gamma,
    gaussian_random_walk,
    half_normal,
    improper_uniform,
    multinomial,
    multivariate_normal,
    normal,
    poisson,
    uniform,
    wishart,
)
from blrppl.rules.registry import (
    Rule,
    find_rule,
    register_rule,
    registered_rules,
    seal_builtin_rules,
    unregister_rule,
    user_rules,
)

seal_builtin_rules()

__all__ = ["Rule", "find_rule", "register_rule", "registered_rules", "unregister_rule", "user_rules"]
