"""Unit tests of ``blrppl.moments``."""
