"""Which element of a latent each element of an expression reads (blrppl.model.elements), as a
table of the expressions users write and the ids worked out by hand.

The latent ``x`` has five scalars, each its own granule 0..4 (``W`` a 4 × 3 matrix, one
granule per row). An entry is the granule an output element reads, NONE (-1) where it reads
none, MANY (-2) where it reads several, ONE (-3) where it reads one at an index only an
enumerated latent knows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blrppl.model.elements import AT_MOST_ONE, MANY, NONE, ONE, SEVERAL, element_reads, granules, reduce_union, single, union

X = jnp.linspace(-1.0, 1.0, 5)
W = jnp.ones((4, 3))
GROUP = np.array([0, 2, 2, 4, 1, -1])  # (a negative index: numpy's from the end)
DESIGN = np.arange(15.0).reshape(3, 5)
MASK = np.array([True, False, True, False, True])
SEGMENTS = np.array([0, 1, 1, 2, 2])
M, N = MANY, NONE


def _running_total(x):
    def step(total, x_t):
        return total + x_t, total * 2.0

    return jax.lax.scan(step, 0.0, x)


def _lagged(x):
    def step(prev, x_t):
        return x_t, x_t - 0.5 * prev

    return jax.lax.scan(step, 0.0, x)[1]


# (name, function of (x, *data), data, expected ids of each output)
TABLE = [
    ("affine", lambda x: 2.0 * x + 1.0, (), [[0, 1, 2, 3, 4]]),
    ("indexed by data", lambda x, g: x[g], (GROUP,), [[0, 2, 2, 4, 1, 4]]),
    ("lagged pair", lambda x: (x[1:], x[:-1]), (), [[1, 2, 3, 4], [0, 1, 2, 3]]),
    ("reversed, squared", lambda x: jnp.square(x[::-1]), (), [[4, 3, 2, 1, 0]]),
    ("softplus (a custom derivative)", lambda x: jax.nn.softplus(x), (), [[0, 1, 2, 3, 4]]),
    ("sum beside each element", lambda x: jnp.sum(x) + x, (), [[M, M, M, M, M]]),
    ("cumulative sum", lambda x: jnp.cumsum(x), (), [[0, M, M, M, M]]),
    ("design matrix", lambda x, d: d @ x, (DESIGN,), [[M, M, M]]),
    ("masked", lambda x, m: jnp.where(m, x, 0.0), (MASK,), [[0, N, 2, N, 4]]),
    ("concatenated with zeros", lambda x: jnp.concatenate([x[:2], jnp.zeros(2), x[3:]]), (), [[0, 1, N, N, 3, 4]]),
    ("padded", lambda x: jnp.pad(x, (2, 1)), (), [[N, N, 0, 1, 2, 3, 4, N]]),
    ("stacked", lambda x: jnp.stack([x[:2], x[3:]], axis=-1), (), [[[0, 3], [1, 4]]]),
    ("scattered", lambda x: jnp.zeros(7).at[jnp.array([1, 3, 5])].set(x[:3]), (), [[N, 0, N, 1, N, 2, N]]),
    ("dynamic slice", lambda x, i: jax.lax.dynamic_slice(x, (i,), (2,)), (np.int32(2),), [[2, 3]]),
    ("scan carry and outputs", _running_total, (), [M, [N, 0, M, M, M]]),
    ("scan over a lag", _lagged, (), [[0, M, M, M, M]]),
    # (segment sums are read conservatively: a scatter-add)
    ("segment sum", lambda x, s: jax.ops.segment_sum(x, s, 3), (SEGMENTS,), [[M, M, M]]),
]


def _reads(fn, x, data, plate_dims):
    closed = jax.make_jaxpr(fn)(x, *data)
    ids = [{"x": granules(np.shape(x), plate_dims)}] + [{}] * len(data)
    return element_reads(closed.jaxpr, closed.consts, ids, [None] + [np.asarray(d) for d in data])


@pytest.mark.parametrize("name, fn, data, expected", TABLE, ids=[t[0] for t in TABLE])
def test_element_reads_of_expression(name, fn, data, expected):
    outs = _reads(fn, X, data, 1)
    assert len(outs) == len(expected)
    for out, want in zip(outs, expected):
        np.testing.assert_array_equal(single(out["x"]), np.asarray(want))


def test_rows_of_a_plated_matrix_contracted_over_their_event_axis():
    """``F @ W.T`` reads one row of W (a plate element) per output element: with rows as
    granules it does not mix, with scalars as granules it does."""
    F = np.ones((6, 3))
    by_row = single(_reads(lambda w, f: f @ w.T, W, (F,), 1)[0]["x"])
    np.testing.assert_array_equal(by_row, np.broadcast_to(np.arange(4), (6, 4)))
    by_scalar = _reads(lambda w, f: f @ w.T, W, (F,), 2)[0]["x"]
    assert np.all(by_scalar.count == SEVERAL)
    # each row's three scalars: granules 3r .. 3r + 2
    np.testing.assert_array_equal(by_scalar.lo[0], 3 * np.arange(4))
    np.testing.assert_array_equal(by_scalar.hi[0], 3 * np.arange(4) + 2)


def test_an_index_only_an_enumerated_latent_knows_reads_one_element():
    """``mu[z]`` with z enumerated: each element reads one component, which one unknown."""
    closed = jax.make_jaxpr(lambda x, z: x[z])(X, jnp.array([0, 1, 1]))
    (out,) = element_reads(closed.jaxpr, closed.consts, [{"x": granules((5,), 1)}, {}], [None, None])
    np.testing.assert_array_equal(single(out["x"]), [ONE, ONE, ONE])
    np.testing.assert_array_equal(out["x"].count, [AT_MOST_ONE] * 3)


def test_two_latents_keep_their_own_ids():
    closed = jax.make_jaxpr(lambda a, b: a[:3] * b)(X, jnp.ones(3))
    ids = [{"a": granules((5,), 1)}, {"b": granules((3,), 1)}]
    (out,) = element_reads(closed.jaxpr, closed.consts, ids, [None, None])
    np.testing.assert_array_equal(single(out["a"]), [0, 1, 2])
    np.testing.assert_array_equal(single(out["b"]), [0, 1, 2])


def test_a_branch_chosen_by_data_takes_that_branch_only():
    def fn(x, flag):
        return jax.lax.cond(flag, lambda v: v[::-1], lambda v: jnp.cumsum(v), x)

    np.testing.assert_array_equal(single(_reads(fn, X, (np.bool_(True),), 1)[0]["x"]), [4, 3, 2, 1, 0])
    np.testing.assert_array_equal(single(_reads(fn, X, (np.bool_(False),), 1)[0]["x"]), [0, M, M, M, M])


def _channels(lo, hi, count):
    return np.stack([np.array(lo), np.array(hi), np.array(count)], -1)


@pytest.mark.parametrize(
    "a, b, expected",
    [
        # (lo, hi, count) per element: none ∪ one; one ∪ the same; one ∪ another (a pair)
        (([N, 3, 3], [N, 3, 3], [0, 1, 1]), ([2, 3, 5], [2, 3, 5], [1, 1, 1]), ([2, 3, 3], [2, 3, 5], [1, 1, 2])),
        # a pair ∪ one of it; a pair ∪ a third; at most one ∪ one
        (([1, 1, 0], [2, 2, 4], [2, 2, -1]), ([2, 7, 3], [2, 7, 3], [1, 1, 1]), ([1, 1, 0], [2, 7, 4], [2, 3, 3])),
    ],
)
def test_union_table(a, b, expected):
    np.testing.assert_array_equal(union(_channels(*a), _channels(*b)), _channels(*expected))


@pytest.mark.parametrize(
    "lo, hi, count, expected",
    [
        ([N, N], [N, N], [0, 0], (N, N, 0)),
        ([N, 3, 3], [N, 3, 3], [0, 1, 1], (3, 3, 1)),
        ([3, 4], [3, 4], [1, 1], (3, 4, 2)),
        ([3, 3, 4], [4, 3, 4], [2, 1, 1], (3, 4, 2)),
        ([3, 5], [4, 5], [2, 1], (3, 5, SEVERAL)),
        ([N, 0], [N, 4], [0, AT_MOST_ONE], (0, 4, AT_MOST_ONE)),
        ([2, 0], [2, 4], [1, AT_MOST_ONE], (0, 4, SEVERAL)),
    ],
)
def test_reduce_union_table(lo, hi, count, expected):
    np.testing.assert_array_equal(reduce_union(_channels(lo, hi, count), (0,)), expected)


def test_a_transition_reads_two_states():
    """``scan`` over a chain's states: step t's distribution reads state t − 1 and its value
    state t: the pair, exactly."""
    closed = jax.make_jaxpr(_lagged)(X)
    (out,) = element_reads(closed.jaxpr, closed.consts, [{"x": granules((5,), 1)}], [None])
    np.testing.assert_array_equal(out["x"].count, [1, 2, 2, 2, 2])
    np.testing.assert_array_equal(out["x"].lo, [0, 0, 1, 2, 3])
    np.testing.assert_array_equal(out["x"].hi, [0, 1, 2, 3, 4])


def test_a_table_row_chosen_by_a_discrete_state():
    """``trans[z[:-1]]`` with z a chain: each row reads the previous state (the index's own
    reads), and ``log(row[z[1:]])`` the pair."""
    trans = np.full((3, 3), 1.0 / 3.0)

    def fn(z, table):
        return jnp.log(table[z[:-1], z[1:]])

    closed = jax.make_jaxpr(fn)(jnp.zeros(5, jnp.int32), trans)
    (out,) = element_reads(closed.jaxpr, closed.consts, [{"z": granules((5,), 1)}, {}], [None, trans])
    np.testing.assert_array_equal(out["z"].count, [2, 2, 2, 2])
    np.testing.assert_array_equal(out["z"].lo, [0, 1, 2, 3])
    np.testing.assert_array_equal(out["z"].hi, [1, 2, 3, 4])
