"""Unit tests of ``blrppl.model``."""
