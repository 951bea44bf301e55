"""Unit tests of ``blrppl.compiler``."""
