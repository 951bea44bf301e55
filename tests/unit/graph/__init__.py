"""Unit tests of ``blrppl.graph``."""
