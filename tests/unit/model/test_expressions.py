"""Classification of distribution arguments by autodiff probes (blrppl.model.probes)."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

from blrppl import families as fam
from blrppl.model.probes import ArgumentProbe, probe_argument, run_probes
from blrppl.graph.plan import Block

N = 6


def make_blocks():
    return {
        # dense Gaussian, no plate
        "w": Block("w", fam.GaussianDense(3), "gaussian", (3,)),
        "b": Block("b", fam.GaussianDense(1), "gaussian", ()),
        # Gaussian with one independent element per group (plate axis 0)
        "a": Block("a", fam.GaussianDense(1), "gaussian", (4,), (0,)),
        # plated Gaussian with a 2-d event: value (4, 2), plate axis 0
        "v": Block("v", fam.GaussianDense(2), "gaussian", (4, 2), (0,)),
        # plate axis not leading: value (2, 4), plate axis 1
        "u": Block("u", fam.GaussianDense(2), "gaussian", (2, 4), (1,)),
        "tau": Block("tau", fam.Gamma(), "gamma", (4,)),
        "s": Block("s", fam.Gamma(), "gamma", ()),
        "p": Block("p", fam.Beta(), "beta", (3,)),
        "pi": Block("pi", fam.Dirichlet(3), "dirichlet", (3,)),
        "rows": Block("rows", fam.Dirichlet(3), "dirichlet", (2, 3)),
        "z": Block("z", fam.Categorical(4), "categorical", (N,), (), (0, 1, 2, 3)),
    }


def make_data():
    rng = np.random.default_rng(0)
    return (
        jnp.asarray(rng.normal(size=(N, 3))),  # X
        jnp.asarray(np.arange(N) % 4),  # group, into 4
        jnp.asarray(np.array([2, 0, 1, 1, 2, 0])),  # idx, into 3
        jnp.asarray(rng.uniform(0.5, 2.0, size=N)),  # positive constants
        jnp.asarray(np.array([1, 0, 1, 1, 0, 0])),  # row index, into 2
    )


# (name, function of (values, data), structural dependencies, expected kind, expected blocks,
#  expected full)
CASES = [
    # constants
    ("data only", lambda v, d: d[0].sum(1), (), "const", (), ()),
    ("discrete only", lambda v, d: jnp.asarray([0.0, 1.0, 2.0, 3.0])[v["z"]], ("z",), "const", (), ()),
    # affine in Gaussian blocks
    ("X @ w + b", lambda v, d: d[0] @ v["w"] + v["b"], ("w", "b"), "affine_gaussian", ("w", "b"), ()),
    ("a[group]", lambda v, d: v["a"][d[1]], ("a",), "affine_gaussian", ("a",), ()),
    ("a[group] * x - w0", lambda v, d: v["a"][d[1]] * d[3] - v["w"][0], ("a", "w"), "affine_gaussian", ("a", "w"), ()),
    ("a.sum()", lambda v, d: v["a"].sum(), ("a",), "affine_gaussian", ("a",), ("a",)),
    ("cumsum(a)", lambda v, d: jnp.cumsum(v["a"]), ("a",), "affine_gaussian", ("a",), ("a",)),
    ("v[group] @ c", lambda v, d: v["v"][d[1]] @ jnp.array([1.0, -2.0]), ("v",), "affine_gaussian", ("v",), ()),
    ("u[:, group].T", lambda v, d: v["u"][:, d[1]].T, ("u",), "affine_gaussian", ("u",), ()),
    ("u.sum(1)", lambda v, d: v["u"].sum(1), ("u",), "affine_gaussian", ("u",), ("u",)),
    ("where(data, w, -w)", lambda v, d: jnp.where(d[0] > 0, v["w"], -v["w"]), ("w",), "affine_gaussian", ("w",), ()),
    ("a[z]", lambda v, d: v["a"][v["z"]], ("a", "z"), "affine_gaussian", ("a",), ()),
    # not affine
    ("w**2", lambda v, d: v["w"] ** 2, ("w",), "opaque", ("w",), ()),
    ("exp(w)", lambda v, d: jnp.exp(v["w"]), ("w",), "opaque", ("w",), ()),
    # piecewise linear: zero second derivative almost everywhere, caught by the secant test
    ("abs(w)", lambda v, d: jnp.abs(v["w"]), ("w",), "opaque", ("w",), ()),
    ("relu(w)", lambda v, d: jax.nn.relu(v["w"]), ("w",), "opaque", ("w",), ()),
    ("w0 * w1", lambda v, d: v["w"][0] * v["w"][1], ("w",), "opaque", ("w",), ()),
    ("a[group] * b", lambda v, d: v["a"][d[1]] * v["b"], ("a", "b"), "opaque", ("a", "b"), ()),
    # powers of a Gamma block
    ("1/sqrt(tau)", lambda v, d: 1 / jnp.sqrt(v["tau"]), ("tau",), "power_gamma", ("tau",), ()),
    ("tau[group]", lambda v, d: v["tau"][d[1]], ("tau",), "power_gamma", ("tau",), ()),
    ("2*tau**3", lambda v, d: 2 * v["tau"] ** 3, ("tau",), "power_gamma", ("tau",), ()),
    ("x / tau[group]", lambda v, d: d[3] / v["tau"][d[1]], ("tau",), "power_gamma", ("tau",), ()),
    ("broadcast scalar s", lambda v, d: jnp.full(N, 1.0) / v["s"], ("s",), "power_gamma", ("s",), ()),
    ("tau + 1", lambda v, d: v["tau"] + 1, ("tau",), "opaque", ("tau",), ()),
    ("-tau", lambda v, d: -v["tau"], ("tau",), "opaque", ("tau",), ()),
    ("exp(tau)", lambda v, d: jnp.exp(v["tau"]), ("tau",), "opaque", ("tau",), ()),
    ("maximum(tau, 1)", lambda v, d: jnp.maximum(v["tau"], 1.0), ("tau",), "opaque", ("tau",), ()),
    ("tau * tau[::-1]", lambda v, d: v["tau"] * v["tau"][::-1], ("tau",), "opaque", ("tau",), ()),
    # Beta block itself
    ("p", lambda v, d: v["p"], ("p",), "beta", ("p",), ()),
    ("p[idx]", lambda v, d: v["p"][d[2]], ("p",), "beta", ("p",), ()),
    ("1 - p", lambda v, d: 1 - v["p"], ("p",), "opaque", ("p",), ()),
    ("p**2", lambda v, d: v["p"] ** 2, ("p",), "opaque", ("p",), ()),
    ("0.5 * p", lambda v, d: 0.5 * v["p"], ("p",), "opaque", ("p",), ()),
    ("p.mean()", lambda v, d: v["p"].mean(), ("p",), "opaque", ("p",), ()),
    # Dirichlet block itself
    ("pi", lambda v, d: v["pi"], ("pi",), "dirichlet", ("pi",), ()),
    ("rows[row]", lambda v, d: v["rows"][d[4]], ("rows",), "dirichlet", ("rows",), ()),
    ("pi**2", lambda v, d: v["pi"] ** 2, ("pi",), "opaque", ("pi",), ()),
    ("rows.mean(0)", lambda v, d: v["rows"].mean(0), ("rows",), "opaque", ("rows",), ()),
    # mixed families
    ("w0 / tau", lambda v, d: v["w"][0] / v["tau"], ("w", "tau"), "opaque", ("w", "tau"), ()),
    ("p * pi", lambda v, d: v["p"] * v["pi"], ("p", "pi"), "opaque", ("p", "pi"), ()),
]


def _classify(fn, deps, seed=0):
    blocks = make_blocks()
    probe = probe_argument(fn, frozenset(deps), blocks, np.random.default_rng(seed))
    assert isinstance(probe, ArgumentProbe)
    return run_probes({"arg": probe}, make_data())["arg"]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_classify_table(case):
    _, fn, deps, kind, blocks, full = case
    cls = _classify(fn, deps)
    assert cls.kind == kind, cls.reason
    assert set(cls.blocks) == set(blocks)
    assert tuple(cls.full) == full
    if kind == "opaque":
        assert cls.reason
    else:
        assert cls.reason == ""


def test_run_probes_many_at_once():
    # all arguments of a model are probed in one compiled call; each gets its own class
    blocks = make_blocks()
    rng = np.random.default_rng(1)
    probes = {c[0]: probe_argument(c[1], frozenset(c[2]), blocks, rng) for c in CASES}
    classes = run_probes(probes, make_data())
    assert set(classes) == set(probes)
    for name, _, _, kind, _, full in CASES:
        assert classes[name].kind == kind, name
        assert tuple(classes[name].full) == full, name


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_classification_does_not_depend_on_seed(seed):
    for name in ("X @ w + b", "a.sum()", "1/sqrt(tau)", "tau + 1", "p[idx]", "rows[row]"):
        _, fn, deps, kind, _, full = next(c for c in CASES if c[0] == name)
        cls = _classify(fn, deps, seed)
        assert cls.kind == kind and tuple(cls.full) == full, name


def test_const_probe_has_nothing_to_compute():
    probe = probe_argument(lambda v, d: d[0], frozenset(), make_blocks(), np.random.default_rng(0))
    assert probe.compute is None
    # with no active probe run_probes compiles nothing and still classifies
    assert run_probes({"c": probe}, make_data())["c"].kind == "const"


def test_several_non_gaussian_blocks_are_opaque_without_running():
    probe = probe_argument(
        lambda v, d: v["tau"][:3] * v["p"], frozenset({"tau", "p"}), make_blocks(), np.random.default_rng(0)
    )
    assert probe.compute is None
    cls = run_probes({"x": probe}, make_data())["x"]
    assert cls.kind == "opaque" and set(cls.blocks) == {"tau", "p"}


def test_probe_points_respect_supports():
    # probes evaluate fn at random points inside each block's support
    seen = {}

    def spy(name):
        def fn(v, d):
            jax.debug.callback(lambda x: seen.setdefault(name, []).append(np.asarray(x)), v[name])
            return v[name] if name != "z" else v["a"][v["z"]]

        return fn

    blocks = make_blocks()
    rng = np.random.default_rng(0)
    probes = {
        "tau": probe_argument(spy("tau"), frozenset({"tau"}), blocks, rng),
        "p": probe_argument(spy("p"), frozenset({"p"}), blocks, rng),
        "rows": probe_argument(spy("rows"), frozenset({"rows"}), blocks, rng),
        "z": probe_argument(spy("z"), frozenset({"a", "z"}), blocks, rng),
    }
    classes = run_probes(probes, make_data())
    assert classes["tau"].kind == "power_gamma"
    assert classes["p"].kind == "beta"
    assert classes["rows"].kind == "dirichlet"
    assert classes["z"].kind == "affine_gaussian"
    assert all(seen.get(k) for k in ("tau", "p", "rows", "z"))
    for x in seen["tau"]:
        assert np.all(x > 0)
    for x in seen["p"]:
        assert np.all((x > 0) & (x < 1))
    for x in seen["rows"]:
        assert np.all(x > 0)
        np.testing.assert_allclose(x.sum(-1), 1.0)
    for x in seen["z"]:
        assert set(np.unique(x)) <= {0, 1, 2, 3}


@pytest.mark.parametrize(
    "make, read",
    [
        # canonical leaves: _chi2 (concentration, df, rate), df, loc, scale; the Chi2 is kept
        # for sampling only
        (lambda: dist.StudentT(jnp.full(3, 4.0), 0.0, jnp.ones(3)), {3, 4, 5}),
        # concentration, df, rate: the density is the Gamma's
        (lambda: dist.Chi2(jnp.full(3, 4.0)), {0, 2}),
        (lambda: dist.Normal(0.0, jnp.ones(3)), {0, 1}),
    ],
)
def test_log_prob_reads_only_the_leaves_the_density_uses(make, read):
    from blrppl.model.functions import canonical_leaves, log_prob_reads

    d = make()
    leaves, tree = canonical_leaves(d)
    assert log_prob_reads(d, leaves, tree, jnp.ones(3)) == frozenset(read)


def _log_link_model(y):
    h = numpyro.sample("h", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
    numpyro.sample("y", dist.Poisson(jnp.exp(h)).to_event(1), obs=y)
    numpyro.sample("w", dist.Poisson(2.0 * jnp.exp(h)).to_event(1), obs=y)


@pytest.mark.parametrize(
    "site, expected",
    [
        # the rate is exp(h): its log is read from the program, exact where exp(h) overflows
        ("y", [800.0, 0.0, -1.0]),
        # 2 exp(h) is not an exponential's result: log of the value (inf at the overflow)
        ("w", [np.inf, np.log(2.0), np.log(2.0) - 1.0]),
    ],
)
def test_log_normal_arguments_are_read_on_log_space(site, expected):
    from blrppl.model.functions import ModelFunctions
    from blrppl.model.program import ModelProgram
    from blrppl.graph.data import DataSpec

    spec, dyn = DataSpec.split((np.array([1.0, 2.0, 3.0]),), {})
    inputs = {}
    sites = ModelProgram(_log_link_model).sites(
        ("y", "w"), {"h": jnp.array([800.0, 0.0, -1.0])}, dyn, {}, spec, exp_inputs=inputs
    )
    logged = ModelFunctions.rule_args(sites[site], ("rate",), {"rate"}, inputs)
    np.testing.assert_allclose(logged["rate"], expected, rtol=1e-15)
    plain = ModelFunctions.rule_args(sites[site], ("rate",))
    np.testing.assert_allclose(plain["rate"], np.exp(expected))
