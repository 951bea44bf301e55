"""Candidate families: exponential families in natural parameters."""

from blrppl.families.base import Family

__all__ = ["Family"]
