"""blrppl.graph: tracing site records, structural dependencies, block layouts, plan text."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.distributions import constraints

from blrppl.model.program import ModelProgram
from blrppl import families as fam
from blrppl.model.deps import output_dependencies
from blrppl.graph.plan import Block, Factor, Plan
from blrppl.model.records import Plate, unwrap
from blrppl.model.trace import trace_model

# -- trace_model ---------------------------------------------------------------------------


def regression(X, g, mask, y=None):
    n, d = X.shape
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([d]).to_event(1))
    tau = numpyro.sample("tau", dist.Gamma(2.0, 4.0))
    with numpyro.plate("groups", 3):
        a = numpyro.sample("a", dist.Normal(5.0, 1.0))
    with numpyro.plate("data", n):
        numpyro.sample("y", dist.Normal(X @ w + a[g], 1 / jnp.sqrt(tau)).mask(mask), obs=y)


def _regression_data(n=6, d=2):
    rng = np.random.default_rng(0)
    return {
        "X": rng.normal(size=(n, d)),
        "g": np.arange(n) % 3,
        "mask": np.arange(n) % 2 == 0,
        "y": rng.normal(size=n),
    }


def test_trace_records_regression():
    data = _regression_data()
    records, spec, dyn, _ = trace_model(regression, (), data, jax.random.key(0))
    assert list(records) == ["w", "tau", "a", "y"]

    w = records["w"]
    assert not w.observed and not w.is_factor
    assert w.dist_type is dist.Normal and w.dist_name == "Normal"
    assert w.value_shape == (2,)
    assert w.event_ndim == 1 and w.reinterpreted_ndim == 1
    assert w.plates == () and w.plate_axes() == ()
    assert not w.has_mask

    tau = records["tau"]
    assert tau.dist_type is dist.Gamma
    assert tau.value_shape == () and tau.event_ndim == 0 and tau.reinterpreted_ndim == 0
    # init_to_prior_mean: the Gamma(2, 4) prior mean
    np.testing.assert_allclose(tau.init_value, 0.5)

    a = records["a"]
    assert a.value_shape == (3,) and a.event_ndim == 0
    assert a.plates == (Plate("groups", 3, -1, 3),)
    assert a.plate_axes() == (0,)
    np.testing.assert_allclose(a.init_value, np.full(3, 5.0))

    y = records["y"]
    assert y.observed and not y.is_factor
    assert y.has_mask
    assert y.value_shape == (6,)
    assert [(p.name, p.size, p.dim) for p in y.plates] == [("data", 6, -1)]
    np.testing.assert_array_equal(y.init_value, data["y"])

    # every array of the data travels as a dynamic leaf and merges back
    assert len(dyn) == 4
    args, kwargs = spec.merge(dyn)
    assert args == ()
    for k, v in data.items():
        np.testing.assert_array_equal(np.asarray(kwargs[k]), v)


def nested(n=5, d=2):
    with numpyro.plate("rows", 4, dim=-2):
        with numpyro.plate("cols", 3, dim=-1):
            numpyro.sample("z", dist.Normal(0.0, 1.0))
    with numpyro.plate("items", n):
        numpyro.sample("v", dist.Normal(jnp.zeros(d), 1.0).to_event(1))
    numpyro.sample("m", dist.Normal(jnp.zeros((2, 3)), 1.0).to_event(2))
    numpyro.sample("s", dist.Normal(0.0, 1.0).expand([3, 2]).to_event(1).mask(False))
    numpyro.sample("t", dist.Normal(0.0, 1.0).mask(True))
    numpyro.factor("penalty", -1.0)


def test_trace_plates_events_masks():
    records, _, _, _ = trace_model(nested, (), {}, jax.random.key(1))
    z = records["z"]
    assert z.value_shape == (4, 3)
    assert [(p.name, p.size, p.dim) for p in z.plates] == [("rows", 4, -2), ("cols", 3, -1)]
    assert z.plate_axes() == (0, 1)

    v = records["v"]
    assert v.value_shape == (5, 2)
    assert v.event_ndim == 1 and v.reinterpreted_ndim == 1 and v.batch_ndim == 1
    assert [(p.name, p.size, p.dim) for p in v.plates] == [("items", 5, -1)]
    assert v.plate_axes() == (0,)

    m = records["m"]
    assert m.value_shape == (2, 3)
    assert m.event_ndim == 2 and m.reinterpreted_ndim == 2
    assert m.plates == ()

    s = records["s"]
    assert s.has_mask
    assert s.value_shape == (3, 2) and s.event_ndim == 1 and s.reinterpreted_ndim == 1
    assert s.dist_type is dist.Normal

    assert not records["t"].has_mask  # mask(True) is no mask

    pen = records["penalty"]
    assert pen.observed and pen.is_factor


def test_trace_inner_plate_declared_first():
    # plate dims count from the right; plates are recorded outermost first
    def model():
        with numpyro.plate("outer", 4, dim=-1):
            with numpyro.plate("inner", 3, dim=-2):
                numpyro.sample("z", dist.Normal(0.0, 1.0))

    records, _, _, _ = trace_model(model, (), {}, jax.random.key(0))
    z = records["z"]
    assert z.value_shape == (3, 4)
    assert [p.name for p in z.plates] == ["outer", "inner"]
    # outer plate (dim −1) is axis 1 of the value, inner (dim −2) axis 0
    assert z.plate_axes() == (1, 0)


@pytest.mark.parametrize(
    "support, event_shape",
    [(constraints.real, ()), (constraints.positive, ()), (constraints.real_vector, (3,))],
)
def test_improper_uniform_is_not_sampled(support, event_shape):
    def model(y):
        u = numpyro.sample("u", dist.ImproperUniform(support, (), event_shape))
        loc = u if event_shape == () else u.sum()
        numpyro.sample("y", dist.Normal(loc, 1.0), obs=y)

    # sampling the site would raise: tracing must use the init strategy instead
    with pytest.raises(NotImplementedError):
        dist.ImproperUniform(support, (), event_shape).sample(jax.random.key(0))
    records, _, _, _ = trace_model(model, (), {"y": np.array(0.3)}, jax.random.key(2))
    u = records["u"]
    assert not u.observed
    assert u.dist_type is dist.ImproperUniform
    assert u.value_shape == event_shape
    assert np.all(np.isfinite(u.init_value))
    if support is constraints.positive:
        assert np.all(u.init_value > 0)


def test_trace_positional_args_and_static_leaves():
    def model(x, scale):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        numpyro.sample("x", dist.Normal(mu, scale), obs=x)

    x = np.array([1.0, 2.0])
    records, spec, dyn, _ = trace_model(model, (x, 2.0), None, jax.random.key(0))
    assert len(dyn) == 1  # the float stays static
    args, _ = spec.merge(dyn)
    assert args[1] == 2.0
    np.testing.assert_array_equal(records["x"].init_value, x)
    assert records["x"].value_shape == (2,)


def test_unwrap_removes_wrappers():
    base = dist.Normal(jnp.zeros(3), 1.0)
    m1 = jnp.array([True, False])
    d = base.expand([2, 3]).to_event(1).mask(m1)
    inner, nre, mask = unwrap(d)
    assert type(inner) is dist.Normal
    assert inner.batch_shape == (3,)
    assert nre == 1
    np.testing.assert_array_equal(mask, m1)

    # nested Independent wrappers add up; two masks at one level combine with logical and
    ma = jnp.array([True, True, False, True])
    mb = jnp.array([False, True, True, True])
    d2 = base.expand([4, 2, 3]).to_event(1).to_event(1).mask(ma).mask(mb)
    inner, nre, mask = unwrap(d2)
    assert type(inner) is dist.Normal
    assert nre == 2
    np.testing.assert_array_equal(mask, np.logical_and(ma, mb))

    # no wrapper: unchanged
    g = dist.Gamma(2.0, 1.0)
    assert unwrap(g) == (g, 0, None)
    # mask(True) is no mask
    inner, nre, mask = unwrap(g.mask(True))
    assert inner is g and nre == 0 and mask is None
    # a site-level Independent from to_event over an expanded base
    inner, nre, mask = unwrap(dist.Beta(1.0, 1.0).expand([5]).to_event(1))
    assert type(inner) is dist.Beta and nre == 1 and mask is None


# -- output_dependencies ----------------------------------------------------------------------


def _inputs():
    rng = np.random.default_rng(0)
    return {
        "a": jnp.asarray(rng.normal(size=4)),
        "b": jnp.asarray(rng.normal(size=(3, 4))),
        "c": jnp.asarray(rng.normal(size=4)),
        "i": jnp.array([0, 2, 2, 1]),
        "k": jnp.array(1),
    }


def test_output_dependencies_basic():
    def fn(x, data):
        return {
            "lin": data @ x["a"] + 1.0,
            "prod": x["b"] @ jnp.sin(x["c"]),
            "idx": x["a"][x["i"]],
            "data_only": data.sum(0) * 3.0,
            "literal": jnp.zeros(2),
            "where": jnp.where(x["k"] > 0, x["a"], x["c"]),
            "int_only": x["i"] * 2,
            "tuple": (x["a"] * 0.0, jnp.exp(x["c"])),
        }

    data = jnp.ones((2, 4))
    deps = output_dependencies(fn, _inputs(), data)
    assert deps["lin"] == frozenset({"a"})
    assert deps["prod"] == frozenset({"b", "c"})
    assert deps["idx"] == frozenset({"a", "i"})
    assert deps["data_only"] == frozenset()
    assert deps["literal"] == frozenset()
    assert deps["where"] == frozenset({"k", "a", "c"})
    assert deps["int_only"] == frozenset({"i"})
    # structural: a product with zero still depends on its input
    assert deps["tuple"] == (frozenset({"a"}), frozenset({"c"}))


def test_output_dependencies_through_jit():
    @jax.jit
    def split(u, v, w):
        # each output uses only some inputs: the sub-jaxpr must be followed
        return u * 2.0, jnp.tanh(v) + 1.0, w[0]

    @jax.jit
    def outer(u, v):
        return split(u, v, u)[1]

    def fn(x):
        p, q, r = split(x["a"], x["c"], x["b"])
        return [p, q, r, outer(x["a"], x["c"]), jax.nn.softplus(x["c"]), jax.nn.relu(x["a"])]

    deps = output_dependencies(fn, _inputs())
    assert deps == [
        frozenset({"a"}),
        frozenset({"c"}),
        frozenset({"b"}),
        frozenset({"c"}),
        frozenset({"c"}),
        frozenset({"a"}),
    ]


def test_output_dependencies_integer_inputs_and_pytrees():
    inputs = {
        "z": jnp.array([1, 0, 1]),  # a discrete latent
        "mu": jnp.array([-1.0, 2.0]),
        "pair": (jnp.array(3.0), jnp.array([1.0, 2.0])),
    }

    def fn(x):
        mu_z = x["mu"][x["z"]]
        first, second = x["pair"]
        return {
            "mu_z": mu_z,
            "onehot": jax.nn.one_hot(x["z"], 2),
            "second": second * 2,
            "first_plus_mu": first + x["mu"],
            "z_count": jnp.sum(x["z"] == 1),
        }

    deps = output_dependencies(fn, inputs)
    assert deps["mu_z"] == frozenset({"mu", "z"})
    assert deps["onehot"] == frozenset({"z"})
    assert deps["second"] == frozenset({"pair"})
    assert deps["first_plus_mu"] == frozenset({"pair", "mu"})
    assert deps["z_count"] == frozenset({"z"})


def test_output_dependencies_extra_args_not_tracked():
    def fn(x, scale, offset):
        return x["a"] * scale + offset, scale * offset

    deps = output_dependencies(fn, {"a": jnp.ones(2)}, jnp.ones(2), jnp.ones(2))
    assert deps == (frozenset({"a"}), frozenset())


# -- Block layouts -----------------------------------------------------------------------------


def _canonical_by_hand(x, value_shape, plate_axes, lead):
    """Reference: move plate axes first (in order), flatten the rest row-major."""
    other = [a for a in range(len(value_shape)) if a not in plate_axes]
    perm = list(range(lead)) + [lead + a for a in list(plate_axes) + other]
    y = np.transpose(x, perm)
    bshape = tuple(value_shape[a] for a in plate_axes)
    return y.reshape(x.shape[:lead] + bshape + (-1,))


@pytest.mark.parametrize(
    "value_shape, plate_axes",
    [((3, 4, 2), (1,)), ((3, 4, 2), (2, 0)), ((5, 3), (0,)), ((2, 3), ()), ((4,), (0,)), ((), ())],
)
@pytest.mark.parametrize("lead", [(), (7,), (2, 3)])
@pytest.mark.parametrize("backend", ["numpy", "jax"])
def test_block_layout_round_trip(value_shape, plate_axes, lead, backend):
    size = int(np.prod(value_shape))
    bshape = tuple(value_shape[a] for a in plate_axes)
    dim = size // int(np.prod(bshape))
    block = Block("z", fam.GaussianDense(dim), "gaussian", value_shape, plate_axes)
    assert block.batch_shape == bshape
    assert block.size == size
    x_np = np.random.default_rng(0).normal(size=lead + value_shape)
    x = x_np if backend == "numpy" else jnp.asarray(x_np)
    canon = block.to_canonical(x)
    assert isinstance(canon, np.ndarray) == (backend == "numpy")
    assert canon.shape == lead + bshape + (dim,)
    np.testing.assert_array_equal(np.asarray(canon), _canonical_by_hand(x_np, value_shape, plate_axes, len(lead)))
    back = block.to_site(canon)
    assert isinstance(back, np.ndarray) == (backend == "numpy")
    assert back.shape == lead + value_shape
    np.testing.assert_array_equal(np.asarray(back), x_np)


def test_block_layout_explicit_elements():
    # value (3, 4, 2), plate axis 1: canonical (4, 6) with canon[p, 2 i + k] = x[i, p, k]
    block = Block("z", fam.GaussianDense(6), "gaussian", (3, 4, 2), (1,))
    x = np.arange(24.0).reshape(3, 4, 2)
    canon = block.to_canonical(x)
    for i in range(3):
        for p in range(4):
            for k in range(2):
                assert canon[p, 2 * i + k] == x[i, p, k]
    # inside jit, with a leading sample dim
    xs = jnp.stack([jnp.asarray(x), -jnp.asarray(x)])
    out = jax.jit(block.to_canonical)(xs)
    np.testing.assert_array_equal(out[1], -canon)
    np.testing.assert_array_equal(jax.jit(block.to_site)(out), xs)


def test_block_layout_non_gaussian_is_identity():
    x = np.random.default_rng(1).uniform(size=(4, 3))
    for block in (
        Block("tau", fam.Gamma(), "gamma", (4, 3)),
        Block("p", fam.Beta(), "beta", (4, 3)),
        Block("pi", fam.Dirichlet(3), "dirichlet", (4, 3)),
    ):
        np.testing.assert_array_equal(block.to_canonical(x), x)
        np.testing.assert_array_equal(block.to_site(x), x)
    assert Block("pi", fam.Dirichlet(3), "dirichlet", (4, 3)).batch_shape == (4,)
    assert Block("tau", fam.Gamma(), "gamma", (4, 3)).batch_shape == (4, 3)


# -- Plan.describe -----------------------------------------------------------------------------


def test_plan_describe_hand_built():
    blocks = (
        Block("weights", fam.GaussianDense(3), "gaussian", (3,)),
        Block("precision", fam.Gamma(), "gamma", ()),
        Block("mix", fam.Dirichlet(4), "dirichlet", (4,)),
    )
    factors = (
        Factor("weights", "Normal", False, ("weights",), (), "exact", None,
               (("value", "affine_gaussian"), ("loc", "const"), ("scale", "const")),
               (("value", ("weights",)), ("loc", ()), ("scale", ())), (("weights", "gather"),), 1),
        Factor("obs_y", "Normal", True, ("weights", "precision"), (), "quadrature", None,
               (("value", "const"), ("loc", "affine_gaussian"), ("scale", "power_gamma")),
               (("value", ()), ("loc", ("weights",)), ("scale", ("precision",))), (("weights", "gather"),), 0),
    )
    plan = Plan(blocks, factors, order=("weights", "precision", "mix"), conjugate=(("weights", True),))
    text = plan.describe()
    assert str(plan) == text
    for name in ("weights", "precision", "mix", "obs_y"):
        assert name in text
    for word in ("gaussian", "gamma", "dirichlet", "exact", "quadrature", "Normal", "power_gamma"):
        assert word in text
    lines = text.splitlines()
    # the factor table names each factor's estimator on its row
    row = next(line for line in lines if line.startswith("obs_y"))
    assert "quadrature" in row and "precision" in row
    assert plan.block("mix").kind == "dirichlet"
    with pytest.raises(KeyError):
        plan.block("nope")
    assert [f.name for f in plan.factors_of("precision")] == ["obs_y"]


def test_plan_describe_compiled_model():
    from blrppl.compiler.pipeline import compile_model

    data = _regression_data()
    records, spec, dyn, _ = trace_model(regression, (), data, jax.random.key(0))
    plan = compile_model(ModelProgram(regression), records, spec, dyn, rng_key=jax.random.key(3), structure="mean-field")[0]
    text = plan.describe()
    assert {b.name for b in plan.blocks} == {"w", "tau", "a"}
    assert {f.name for f in plan.factors} == {"w", "tau", "a", "y"}
    for name in ("w", "tau", "a", "y"):
        assert any(line.split()[0] == name for line in text.splitlines() if line.strip())
    for f in plan.factors:
        assert f.estimator in text
    assert plan.block("w").kind == "gaussian" and plan.block("tau").kind == "gamma"
    assert set(plan.factors_of("tau")[-1].neighbours) == {"w", "tau", "a"}


def _scale_model(X, y=None):
    beta = numpyro.sample("beta", dist.Normal(0.0, 5.0).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfCauchy(2.5))
    with numpyro.plate("N", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ beta, sigma), obs=y)


@pytest.mark.parametrize("structure", ["mean-field", None])
def test_compile_reads_argument_classes_without_probes(structure):
    """σ starts as a Gamma block and moves to a log-normal one (HalfCauchy has no closed
    form for its prior); every argument's class and every quadrature projection is read off its form in
    the model's jaxpr: nothing is probed numerically."""
    from blrppl.compiler.pipeline import compile_model

    rng = np.random.default_rng(0)
    X = rng.normal(size=(40, 3))
    data = {"X": X, "y": X @ np.array([1.0, -1.0, 0.5]) + 0.3 * rng.normal(size=40)}
    records, spec, dyn, _ = trace_model(_scale_model, (), data, jax.random.key(0))
    plan = compile_model(ModelProgram(_scale_model), records, spec, dyn, rng_key=jax.random.key(1), structure=structure)[0]
    if structure == "mean-field":
        assert {b.kind for b in plan.blocks} == {"gaussian"} and len(plan.blocks) == 2
    else:
        assert len(plan.blocks) == 1 and plan.blocks[0].members
    # mean-field: σ's log-normal block is independent of β, so E[σ⁻²] E[(y − Xβ)²] is the
    # closed form; jointly, the scale and the mean share a block and are integrated together
    assert {f.name: f.estimator for f in plan.factors if f.rule is not None or f.spec.links} == {
        "beta": "exact", "sigma": "quadrature", "y": "exact" if structure == "mean-field" else "quadrature"
    }


@pytest.mark.parametrize(
    "read, columns",
    [(lambda a: jnp.sum(a), "full"), (lambda a: a[jnp.array([2, 0, 2])], "gather"), (lambda a: a[1:] - a[:-1], "full")],
    ids=["sum", "indexed", "differences"],
)
def test_element_reads_tell_the_plates_forms_leave_open(read, columns):
    """Affine arguments of a mean-field block (read off their forms): whether an element
    mixes the block's elements (a sum, differences of neighbours) or reads one element each
    (indexing by data) is read off the program's element ids."""
    from blrppl.compiler.pipeline import compile_model

    def model(y):
        a = numpyro.sample("a", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        numpyro.sample("y", dist.Normal(read(a), 1.0), obs=y)

    y_obs = np.zeros(np.shape(read(jnp.zeros(3))))
    records, spec, dyn, _ = trace_model(model, (), {"y": y_obs}, jax.random.key(0))
    plan = compile_model(ModelProgram(model), records, spec, dyn, rng_key=jax.random.key(1), families={"a": "gaussian-diag"})[0]
    y = next(f for f in plan.factors if f.name == "y")
    assert y.estimator == "exact" and dict(y.columns)["a"] == columns


def test_compiler_options_skip_options_this_jaxlib_lacks(monkeypatch):
    import blrppl.runtime.compile as gd

    monkeypatch.setattr(gd, "_REJECTED", set())
    monkeypatch.setattr(gd, "_FAST_COMPILE", {"xla_no_such_option_here": True})
    small = gd.compiler_options((np.zeros(10),))
    assert small == {"xla_no_such_option_here": True, "xla_backend_optimization_level": 0}
    assert "xla_backend_optimization_level" not in gd.compiler_options((np.zeros(gd.SMALL_DATA),))
    # a program run once per fit (diagnostics, export) on large data: level 1, not XLA's default
    assert gd.compiler_options((np.zeros(gd.SMALL_DATA),), once=True)["xla_backend_optimization_level"] == 1
    assert gd.compiler_options((np.zeros(10),), once=True)["xla_backend_optimization_level"] == 0
    # the unknown option is dropped at the first compilation, the known one kept
    compiled = gd.compile_lowered(jax.jit(lambda x: x * 2).lower(np.zeros(3)), small)
    np.testing.assert_array_equal(compiled(np.ones(3)), 2 * np.ones(3))
    assert gd._REJECTED == {"xla_no_such_option_here"}


def _factor_model(Y, latent_dim):
    n, m = Y.shape
    with numpyro.plate("M", m):
        C = numpyro.sample("C", dist.Normal(0.0, 1.0).expand([latent_dim]).to_event(1))
    with numpyro.plate("N", n):
        X = numpyro.sample("X", dist.Normal(0.0, 1.0).expand([latent_dim]).to_event(1))
    with numpyro.plate("n", n, dim=-2), numpyro.plate("m", m, dim=-1):
        numpyro.sample("Y", dist.Normal(X @ C.T, 0.5), obs=Y)


@pytest.mark.parametrize("n, m, d, level", [(200, 20, 8, 1), (30, 6, 4, 0)])
def test_small_data_with_dense_elements_gets_optimised_code(n, m, d, level):
    """4,000 entries of X @ C.T with D = 8 are 256,000 products a step: compiled at level 1
    (elementwise loops 2–4× faster for little more compiling); 180 entries with D = 4 at 0."""
    import blrppl.runtime.compile as gd
    from blrppl.engine.build import _dense_work, _elementwise_work
    from blrppl.compiler.pipeline import compile_model

    Y = np.random.default_rng(0).normal(size=(n, m))
    records, spec, dyn, _ = trace_model(_factor_model, (Y, d), {}, jax.random.key(0))
    plan = compile_model(ModelProgram(_factor_model), records, spec, dyn, rng_key=jax.random.key(1))[0]
    assert _dense_work(plan, records) >= n * m * d * d
    options = gd.compiler_options(dyn, _elementwise_work(plan, records), _dense_work(plan, records))
    assert options["xla_backend_optimization_level"] == level
