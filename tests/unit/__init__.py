"""Unit tests, one folder per subpackage of blrppl; the entry points and the package's shape here."""
