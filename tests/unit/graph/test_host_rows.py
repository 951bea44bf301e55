"""HostRows (:mod:`blrppl.graph.host_rows`): rows of a memmap read at given indices, once
per minibatch, read ahead on the host, and refused where the model needs all its values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blrppl import HostRows, HostRowsError


@pytest.fixture
def on_disk(tmp_path):
    X = np.random.default_rng(0).normal(size=(1000, 3))
    path = tmp_path / "X.npy"
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.float64, shape=X.shape)
    mm[:] = X
    mm.flush()
    del mm
    return X, np.load(path, mmap_mode="r")


def test_rows_at_indices_in_any_order(on_disk):
    X, mm = on_disk
    rows = HostRows(mm)
    idx = np.array([[7, 3], [999, 0]])
    np.testing.assert_array_equal(rows.read(idx), X[idx])
    assert rows.shape == (1000, 3) and rows.ndim == 2 and len(rows) == 1000
    assert rows.dtype == np.float64  # (the tests run with x64)


def test_inside_jit_rows_read_on_the_host(on_disk):
    X, mm = on_disk
    rows = HostRows(mm)
    idx = jnp.asarray([5, 2, 800])
    out = jax.jit(lambda i: rows[i] @ jnp.ones(3))(idx)
    np.testing.assert_allclose(out, X[np.asarray(idx)].sum(axis=1), rtol=1e-14)
    col = jax.jit(lambda i: rows[i, 1])(idx)
    np.testing.assert_array_equal(col, X[np.asarray(idx), 1])


def test_one_read_per_minibatch_and_read_ahead(on_disk):
    X, mm = on_disk
    rows = HostRows(mm)
    idx = np.arange(10, 20)
    rows.read(idx)
    rows.read(idx)  # (the step's other evaluations of the model: the same rows)
    assert rows.reads == 10
    rows.read_ahead(np.arange(20, 30))
    np.testing.assert_array_equal(rows.read(np.arange(20, 30)), X[20:30])
    assert rows.reads == 20 and rows.read_ahead_used == 1


def test_the_source_is_not_modified_nor_held_mapped(on_disk):
    X, mm = on_disk
    before = np.array(mm)
    rows = HostRows(mm)
    rows.read(np.arange(0, 1000, 7))
    np.testing.assert_array_equal(np.asarray(mm), before)


def test_float32_rows_without_x64(on_disk):
    _, mm = on_disk
    assert HostRows(mm, dtype=np.float32).read(np.arange(3)).dtype == np.float32


def test_uses_needing_all_values_are_refused(on_disk):
    _, mm = on_disk
    rows = HostRows(mm)
    with pytest.raises(HostRowsError, match="X\\[idx\\]"):
        jnp.asarray(rows)
    with pytest.raises(HostRowsError, match="slice"):
        rows[:10]
    with pytest.raises(HostRowsError, match="outside"):
        rows.read(np.array([1000]))
    with pytest.raises(HostRowsError, match="rows"):
        HostRows(3.0)


def test_a_memmap_is_read_a_window_at_a_time(on_disk, monkeypatch):
    from blrppl.graph import host_rows

    X, mm = on_disk
    monkeypatch.setattr(host_rows, "WINDOW_BYTES", 24 * 10)  # (10 rows of 3 float64 per window)
    idx = np.random.default_rng(1).choice(1000, size=(40, 3), replace=False)
    np.testing.assert_array_equal(HostRows(mm).read(idx), X[idx])
    view = mm[100:200]  # (a view of part of the mapping: read through it)
    np.testing.assert_array_equal(HostRows(view).read(np.array([0, 99, 5])), X[[100, 199, 105]])
