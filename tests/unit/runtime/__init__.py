"""Unit tests of ``blrppl.runtime``."""
