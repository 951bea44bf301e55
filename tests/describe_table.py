"""Parsing of ``Plan.describe()`` tables, shared by the tests that check them."""

import re


def factor_rows(describe: str) -> dict:
    """Factor name → {column: cell} parsed from the factor table of ``plan.describe()``."""
    lines = describe.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == ["factor"])
    header = re.split(r"\s{2,}", lines[start].strip())
    rows = {}
    for line in lines[start + 2 :]:
        if not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0]] = dict(zip(header, cells))
    return rows
