"""Each family owns what it is: no code outside ``blrppl/families/`` branches on a family's
(or an argument's) kind by comparing it with a string literal, and pseudo-factors are told
by their :attr:`~blrppl.graph.plan.Factor.role`, not by their names."""

from __future__ import annotations

import pathlib
import re

import pytest

import blrppl
import blrppl.families

PACKAGE = pathlib.Path(blrppl.__file__).parent

#: a ``kind`` (or a ``kinds[...]`` entry) compared with, or looked up in, string literals;
#: the name tests that once told pseudo-factors apart
FORBIDDEN = [
    re.compile(r"""\bkinds?\b(\[[^\]]*\])?\s*(==|!=)\s*f?["']"""),
    re.compile(r"""["']\s*(==|!=)\s*[\w.]*\bkinds?\b"""),
    re.compile(r"""\bkinds?\b(\[[^\]]*\])?\s+(not\s+)?in\s*[(\[{]\s*["']"""),
    re.compile(r"""\.endswith\(\s*f?["'][^"']*:"""),
    re.compile(r"""name\s*(==|!=)\s*f?["'][^"']*:(jacobian|previous)"""),
]
#: whatever is compared with, or looked up in, a family's name (a probe "group", a site's "space")
_NAMES = "|".join(re.escape(n) for n in blrppl.families.FAMILIES)
FORBIDDEN += [
    re.compile(rf"""(==|!=)\s*["']({_NAMES})["']"""),
    re.compile(rf"""["']({_NAMES})["']\s*(==|!=)"""),
    re.compile(rf"""\bin\s*[(\[{{]\s*(["'][\w-]*["']\s*,\s*)*["']({_NAMES})["']"""),
]


def _offences(text: str) -> list:
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        code = line.split("#", 1)[0]
        if any(p.search(code) for p in FORBIDDEN):
            out.append((number, line.strip()))
    return out


@pytest.mark.parametrize(
    "line",
    [
        'if block.kind == "gaussian":',
        "if b.kind in ('gamma', 'beta'):",
        'if kinds["scale"] != "const":',
        'elif "dirichlet" == block.kind:',
        'if f.name.endswith(":jacobian"):',
        'jacobian = any(f.name == f"{name}:jacobian" for f in factors)',
        'elif group == "gamma":',
        'if space in ("exp", "beta", "dirichlet") and form.power == 1.0:',
    ],
)
def test_the_scan_finds_literal_kind_tests(line):
    assert _offences(line)


def test_block_kinds_may_be_compared_with_each_other():
    assert not _offences("if new.kind != old.kind:")


def test_no_literal_kind_tests_outside_the_families():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if PACKAGE / "families" in path.parents:
            continue
        found += [f"{path.relative_to(PACKAGE)}:{n}: {line}" for n, line in _offences(path.read_text())]
    assert not found, "kind tests that belong to the families (flags and methods):\n" + "\n".join(found)
