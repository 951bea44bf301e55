"""Unit tests of ``blrppl.estimators``."""
