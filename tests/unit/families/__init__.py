"""Unit tests of ``blrppl.families``."""
