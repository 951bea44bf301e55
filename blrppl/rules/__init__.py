"""Closed-form expected log-densities, one module per numpyro distribution."""

from blrppl.rules.registry import Rule, find_rule, register_rule, registered_rules

__all__ = ["Rule", "find_rule", "register_rule", "registered_rules"]
