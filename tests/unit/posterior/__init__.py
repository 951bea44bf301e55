"""Unit tests of ``blrppl.posterior``."""
