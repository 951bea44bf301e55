"""Each family owns what it is: no code outside ``blrppl/families/`` branches on a family's
(or an argument's) kind by comparing it with a string literal, and pseudo-factors are told
by their :attr:`~blrppl.graph.plan.Factor.role`, not by their names."""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

import pytest

import blrppl
import blrppl.estimators
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


def _offences(text: str, patterns=None) -> list:
    """(line number, line) of each line of ``text`` whose code (comments left out) matches one
    of ``patterns`` (the literal kind tests by default)."""
    patterns = FORBIDDEN if patterns is None else patterns
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        code = line.split("#", 1)[0]
        if any(p.search(code) for p in patterns):
            out.append((number, line.strip()))
    return out


def _package_offences(owner: str, patterns=None) -> list:
    """The offences in every module of the package outside ``blrppl/<owner>/``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if PACKAGE / owner in path.parents:
            continue
        found += [f"{path.relative_to(PACKAGE)}:{n}: {line}" for n, line in _offences(path.read_text(), patterns)]
    return found


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
    found = _package_offences("families")
    assert not found, "kind tests that belong to the families (flags and methods):\n" + "\n".join(found)


# -- estimators are told apart by their attributes, not by their names ---------------------------
# (blrppl/estimators/ defines them: the objects of blrppl.estimators.registry, one per name)

#: an ``estimator`` compared with, or looked up in, string literals; whatever is compared with,
#: or looked up in, a registered estimator's name
_ESTIMATOR_NAMES = "|".join(re.escape(n) for n in blrppl.estimators.ESTIMATORS)
ESTIMATOR_TESTS = [
    re.compile(r"""\bestimators?\b\s*(==|!=)\s*f?["']"""),
    re.compile(r"""["']\s*(==|!=)\s*[\w.]*\bestimators?\b"""),
    re.compile(r"""\bestimators?\b\s+(not\s+)?in\s*[(\[{]\s*["']"""),
    re.compile(rf"""(==|!=)\s*["']({_ESTIMATOR_NAMES})["']"""),
    re.compile(rf"""["']({_ESTIMATOR_NAMES})["']\s*(==|!=)"""),
    re.compile(rf"""\bin\s*[(\[{{]\s*(["'][\w-]*["']\s*,\s*)*["']({_ESTIMATOR_NAMES})["']"""),
]


def _estimator_offences(text: str) -> list:
    return _offences(text, ESTIMATOR_TESTS)


@pytest.mark.parametrize(
    "line",
    [
        'if f.estimator == "exact":',
        "draws = any(f.estimator == 'monte_carlo' for f in plan.factors)",
        'if f.estimator != "exact" or b.value_moments:',
        'if f.estimator not in ("exact", "quadrature"):',
        'if estimator in ("exact", "delta"):',
        'elif "quadrature" == factor.estimator:',
        'sampled = [f for f in group if kind == "monte_carlo"]',
        'if name in ("delta", "exact"):',
    ],
)
def test_the_scan_finds_estimator_name_tests(line):
    assert _estimator_offences(line)


@pytest.mark.parametrize(
    "line",
    [
        "if estimator_of(f).closed_form:",
        'estimator, links = ESTIMATORS["exact"], ()',
        "estimator=(QUADRATURE if elementwise else MONTE_CARLO).name,",
        "if new.estimator != old.estimator:",
    ],
)
def test_estimators_may_be_looked_up_and_compared_with_each_other(line):
    assert not _estimator_offences(line)


def test_no_estimator_name_tests_outside_the_estimators():
    found = _package_offences("estimators", ESTIMATOR_TESTS)
    assert not found, "estimator name tests that belong to the estimators' attributes:\n" + "\n".join(found)


def test_each_estimator_is_an_object_of_its_own_module():
    for name, obj in blrppl.estimators.ESTIMATORS.items():
        module = importlib.import_module(f"blrppl.estimators.{name}")
        assert getattr(module, name.upper()) is obj
        assert blrppl.estimators.estimator_of(name) is obj and obj.describe() == name


# -- the package's shape: no import cycle, no module over 800 lines, no function over 120 ----------
# (blrppl/bench is a benchmark suite, not the package: it is left out of the size limits)

MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 120


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: pathlib.Path, modules: dict) -> set:
    """The blrppl modules ``name`` imports, at module level or inside functions."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            candidates = [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in modules:
                candidate = candidate.rpartition(".")[0]
            # a package's __init__ re-exports; importing it from inside the package is not an edge
            if candidate and candidate != name and modules[candidate].name != "__init__.py":
                found.add(candidate)
    return found


def _cycles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles (function-level imports included):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def _sizes():
    for name, path in _modules().items():
        if name.startswith("blrppl.bench"):
            continue
        text = path.read_text()
        yield name, text.count("\n"), [
            (node.name, node.end_lineno - node.lineno + 1)
            for node in ast.walk(ast.parse(text))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        ]


def test_no_module_over_800_lines_and_no_function_over_120():
    big_modules, big_functions = [], []
    for name, lines, functions in _sizes():
        if lines > MAX_MODULE_LINES:
            big_modules.append(f"{name}: {lines} lines")
        big_functions += [f"{name}.{f}: {n} lines" for f, n in functions if n > MAX_FUNCTION_LINES]
    assert not big_modules and not big_functions, "\n".join(big_modules + big_functions)


def test_the_posterior_never_imports_the_engine():
    modules = _modules()
    offending = [
        f"{name} imports {target}"
        for name, path in modules.items()
        if name.startswith("blrppl.posterior")
        for target in _imports(name, path, modules)
        if target.startswith("blrppl.engine")
    ]
    assert not offending, "\n".join(offending)


def _reached(start: str, graph: dict) -> set:
    """The modules ``start`` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for other in graph.get(todo.pop(), ()):
            if other not in seen:
                seen.add(other)
                todo.append(other)
    return seen


#: the engine's layers (issue 52): the kernel (its pure ``init``, the step, the state) below
#: the loop around it, and the loop below the compiled-fit cache, the advice, the restarts
#: and the fit's preparation and run; each module may not reach (import, directly or through
#: others) the modules of the layers above it
_ABOVE_THE_LOOP = {
    "blrppl.engine." + n for n in ("cache", "advice", "restarts", "prepare", "build", "run", "refine", "grid", "start")
}
ENGINE_LAYERS = {
    "blrppl.engine.kernel": _ABOVE_THE_LOOP | {"blrppl.engine.loop"},
    "blrppl.engine.state": _ABOVE_THE_LOOP | {"blrppl.engine.loop", "blrppl.engine.kernel"},
    "blrppl.engine.step": _ABOVE_THE_LOOP | {"blrppl.engine.loop", "blrppl.engine.kernel"},
    "blrppl.engine.loop": _ABOVE_THE_LOOP,
}


def test_the_layer_scan_follows_imports_through_other_modules():
    assert _reached("a", {"a": {"b"}, "b": {"c"}, "c": set()}) == {"b", "c"}


def test_the_kernel_is_below_the_loop_and_the_loop_below_the_fit():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    offending = [
        f"{name} reaches {target}"
        for name, above in ENGINE_LAYERS.items()
        for target in sorted(_reached(name, graph) & above)
    ]
    assert not offending, "\n".join(offending)


#: the only modules that hold the user's model callable (a parameter ``model`` or an attribute
#: ``.model``): the entry points and the tracing code; everything after them sees the model's
#: traced program (:class:`blrppl.model.program.ModelProgram`) and the plan
MODEL_HOLDERS = {"blrppl.api", "blrppl.svi", "blrppl.model.trace", "blrppl.model.program"}


def _holds_the_model(tree) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            if any(a.arg == "model" for a in params):
                return True
        if isinstance(node, ast.Attribute) and node.attr == "model":
            return True
    return False


def test_the_holder_scan_finds_a_model_parameter():
    assert _holds_the_model(ast.parse("def f(x, model):\n    pass"))
    assert _holds_the_model(ast.parse("y = self.model"))
    assert not _holds_the_model(ast.parse("def f(program):\n    return program.identity"))


def test_only_the_entry_points_and_the_tracing_code_hold_the_model():
    holders = {
        name
        for name, path in _modules().items()
        if not name.startswith("blrppl.bench") and _holds_the_model(ast.parse(path.read_text()))
    }
    assert holders <= MODEL_HOLDERS, f"modules holding the user's model beyond the entry points: {holders - MODEL_HOLDERS}"
