"""The iterator bench (:mod:`blrppl.bench.minibatches`) on a small data set: its four fits
run, and its table has a row per minibatch size with a positive time for each."""

from __future__ import annotations

from blrppl.bench import minibatches


def test_the_bench_times_its_four_fits(capsys):
    minibatches.main(["--rows", "400", "--dim", "2", "--sizes", "100", "--steps", "6", "--repeats", "1",
                      "--sleep", "0.001"])
    lines = capsys.readouterr().out.strip().splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == ["M", "in-memory fit", "iterator", "iterator, slow read", "slow read, no read-ahead"]
    row = [c.strip() for c in lines[-1].strip("|").split("|")]
    assert row[0] == "100" and all(float(v) > 0 for v in row[1:])
