"""Value numbers (:mod:`blrppl.model.values`): which elements of a program's outputs are the
same function of the same inputs, read off the jaxpr. Each case is a small function written
as models write their arguments, with the expected equalities worked by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from blrppl.model import values as vn

K, N, D = 3, 6, 2
X = np.arange(N * D, dtype=np.float64).reshape(N, D) % 4  # rows 0 and 2, 1 and 3 equal
STATES = np.array([0, 1, 0, 1, 2, 2, 0])


def numbers(fn, symbols: dict, known: dict, data=None):
    """fn's outputs' numbers with ``symbols`` (name → shape: one symbol per scalar) and
    ``known`` (name → value)."""
    numbering = vn.Numbering()
    avals = {n: jax.ShapeDtypeStruct(s, jnp.float64) for n, s in symbols.items()}
    avals.update({n: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) for n, v in known.items()})
    traced = vn.trace(fn, avals, data if data is not None else {})
    assert traced is not None
    inputs = {n: vn.scalar_symbols(numbering, n, s) for n, s in symbols.items()}
    return traced.numbers({**inputs, **known}, numbering)


def classes(out) -> list:
    """The elements of a (N, …) output grouped by equal numbers along the leading axis."""
    rows = [tuple(r) for r in np.asarray(out.numbers).reshape(out.numbers.shape[0], -1).tolist()]
    first: dict = {}
    return [first.setdefault(r, len(first)) for r in rows]  # (numbered by first appearance)


def test_a_table_read_at_known_states_is_one_function_per_state():
    """trans[s[:-1]]: the elements with the same previous state read the same row."""
    out = numbers(lambda v, d: jnp.log(v["trans"][v["s"][:-1]]), {"trans": (K, K)}, {"s": STATES})
    assert classes(out) == [0, 1, 0, 1, 2, 2]


def test_pieces_of_different_computations_differ_at_the_same_state():
    """Steps 0–2 read log trans, steps 3–5 twice it: the same state, different functions."""

    def fn(v, d):
        rows = jnp.log(v["trans"][v["s"][:-1]])
        return jnp.concatenate([rows[:3], 2.0 * rows[3:]])

    out = numbers(fn, {"trans": (K, K)}, {"s": STATES})
    assert classes(out) == [0, 1, 0, 2, 3, 3]


def test_data_read_per_element_distinguishes_elements_with_different_values_only():
    out = numbers(lambda v, d: d["x"] @ v["w"], {"w": (D,)}, {}, {"x": X})
    assert classes(out) == [0, 1, 0, 1, 0, 1]  # rows of X repeat with period 2


def test_a_per_step_covariate_or_position_makes_every_element_its_own():
    out = numbers(lambda v, d: v["trans"][v["s"][:-1]] + jnp.arange(N)[:, None], {"trans": (K, K)}, {"s": STATES})
    assert classes(out) == list(range(N))


def test_a_scan_over_the_states_is_read_step_by_step():
    """The HMM written with lax.scan: each step's row of the table, as the vectorised form."""

    def fn(v, d):
        def step(prev, s):
            return s, v["trans"][prev]

        _, rows = lax.scan(step, v["s"][0], v["s"][1:])
        return rows

    out = numbers(fn, {"trans": (K, K)}, {"s": STATES})
    assert classes(out) == [0, 1, 0, 1, 2, 2]


def test_symbolic_labels_compare_two_traces_of_the_same_code():
    """A mixture's mu[z] traced with N labels and with one: equal after broadcasting, with
    the label one symbol for every element; an arange of the labels' length differs."""
    numbering = vn.Numbering()
    mu = vn.scalar_symbols(numbering, "mu", (K, D))
    label = vn.Symbols(np.asarray(numbering.of(("state", "z"))))

    def fn_of(n):
        def fn(v, d):
            z = jnp.full((n,), v["z"])
            return {"loc": v["mu"][z] + 0.0 * d["x"], "pos": v["mu"][z, 0] + jnp.arange(z.shape[0]),
                    "onehot": jax.nn.one_hot(z, K) @ v["mu"]}

        avals = {"mu": jax.ShapeDtypeStruct((K, D), jnp.float64), "z": jax.ShapeDtypeStruct((), jnp.int32)}
        return vn.trace(fn, avals, {"x": X}).numbers({"mu": mu, "z": label}, numbering)

    full, small = fn_of(N), fn_of(1)
    assert vn.same(full["loc"], small["loc"]) and vn.same(full["onehot"], small["onehot"])
    assert not vn.same(full["pos"], small["pos"])


def test_equal_values_of_different_expressions_are_not_claimed_equal():
    """x + x and 2x: the reading is conservative (a missed optimisation, never a wrong one)."""
    out = numbers(lambda v, d: jnp.stack([v["x"] + v["x"], 2.0 * v["x"]]), {"x": ()}, {})
    assert out.numbers[0] != out.numbers[1]


def test_reductions_and_contractions_number_what_they_combine():
    def fn(v, d):
        a = v["a"]
        return {"sum": jnp.sum(a, 1), "cum": jnp.cumsum(a, 1), "dot": a @ v["b"], "sorted": jnp.sort(a, 1)}

    out = numbers(fn, {"a": (2, 3), "b": (3,)}, {})
    assert len(set(out["sum"].numbers.tolist())) == 2
    cum = out["cum"].numbers
    assert len(set(cum.ravel().tolist())) == 6 and cum[0, 0] != cum[1, 0]
    assert out["dot"].numbers[0] != out["dot"].numbers[1]
    # an unknown primitive (sort): every element its own
    assert len(set(out["sorted"].numbers.ravel().tolist())) == 6


def test_values_of_the_data_alone_are_numbered_by_their_expression():
    """x * 2 of the data: numbered by the data's bits and the expression, never evaluated
    (no program compiled for it); equal data rows give equal numbers."""
    out = numbers(lambda v, d: {"k": d["x"] * 2.0, "s": v["w"] * d["x"]}, {"w": ()}, {}, {"x": X})
    assert isinstance(out["k"], vn.Symbols) and isinstance(out["s"], vn.Symbols)
    assert classes(out["k"]) == [0, 1, 0, 1, 0, 1]
    assert not vn.same(out["k"], out["s"])


def test_a_gather_at_data_indices_moves_the_numbers():
    idx = np.array([2, 0, 2, 1])
    out = numbers(lambda v, d: v["a"][d["idx"]], {"a": (3,)}, {}, {"idx": idx})
    assert out.numbers[0] == out.numbers[2] and len(set(out.numbers.tolist())) == 3


@pytest.mark.parametrize("n", [N, 1])
def test_a_function_that_refuses_the_shapes_is_not_traced(n):
    def fn(v, d):
        return v["a"].reshape(N)

    avals = {"a": jax.ShapeDtypeStruct((n,), jnp.float64)}
    assert (vn.trace(fn, avals, {}) is None) == (n != N)


def test_a_window_at_a_symbolic_start_keeps_its_places_apart():
    """a[z : z + 2]: both elements choose among the same candidates at the same start, but
    they are a[z] and a[z + 1]."""
    numbering = vn.Numbering()
    avals = {"a": jax.ShapeDtypeStruct((4,), jnp.float64), "z": jax.ShapeDtypeStruct((), jnp.int32)}
    traced = vn.trace(lambda v, d: lax.dynamic_slice(v["a"], (v["z"],), (2,)), avals, {})
    out = traced.numbers({"a": vn.scalar_symbols(numbering, "a", (4,)),
                          "z": vn.Symbols(np.asarray(numbering.of(("state", "z"))))}, numbering)
    assert out.numbers[0] != out.numbers[1]
