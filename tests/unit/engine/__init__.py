"""Unit tests of ``blrppl.engine``."""
