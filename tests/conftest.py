# Layout: unit/<subpackage>/ (one folder per subpackage of blrppl), integration/ (whole
# models fitted end to end), plans/ (the golden plan tables). Each folder is a package
# (``__init__.py``; tests/ itself is not), so pytest imports a test file as
# ``unit.engine.test_grid`` with tests/ on sys.path: test files of one name may live in two
# folders, a test module imports another by its dotted name (``from integration import
# test_nonconjugate``), and the shared helpers at tests/ (checks, reference_models,
# describe_table) by their plain names (pyproject's ``pythonpath`` puts tests/ there too).

import atexit
import os
import shutil
import tempfile

# The tests' eager computations (numpyro's samplers, NUTS references, reference
# algorithms written in jax) compile with XLA's backend optimisations and CPU fusion
# emitters off, as blrppl compiles its own programs on small data
# (``blrppl.runtime.compile.compiler_options``): a Dirichlet sampler's program compiled in
# 0.3 s instead of 1.5 s, and the suite ran in 706 s instead of 873 s. The options change
# how fast code runs, not what it computes (speed is measured by the bench, which runs
# without them). Set before JAX creates its CPU client; inherited by the subprocesses
# some tests start.
_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FAST_COMPILE).strip()

# blrppl's cache (its program store) in a directory of this test session, removed at its
# end: the tests neither read nor write the user's ~/.cache/blrppl. blrppl reads the
# variable when it stores or loads a program, so the order of imports does not matter;
# inherited by the subprocesses some tests start (those that test the cache give theirs).
_CACHE = tempfile.mkdtemp(prefix="blrppl-tests-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ["BLRPPL_CACHE_DIR"] = _CACHE

import numpyro  # noqa: E402

# Exactness tests run in float64.
numpyro.enable_x64()
