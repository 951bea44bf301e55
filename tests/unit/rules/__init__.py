"""Unit tests of ``blrppl.rules``."""
