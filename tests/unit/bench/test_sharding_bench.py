"""The sharding bench's reading of a compiled program (:func:`blrppl.bench.sharding.collectives`):
hand-written HLO texts whose collectives, and where they run, are known."""

from __future__ import annotations

import pytest

from blrppl.bench.sharding import _shape_bytes, collectives

# a loop whose body sums a tuple (8 × 4 + 4 doubles) and a scalar over the devices, a
# conditional branch inside the body gathering 100 floats, and one all-reduce in the entry
# computation (run once a program, not once a step)
PROGRAM = """HloModule jit_sharded, entry_computation_layout={(f64[])->f64[]}

%add (a: f64[], b: f64[]) -> f64[] {
  %a = f64[] parameter(0)
  %b = f64[] parameter(1)
  ROOT %s = f64[] add(%a, %b)
}

%gather_branch (p: f32[100]) -> f32[800] {
  %p = f32[100]{0} parameter(0)
  ROOT %all-gather.1 = f32[800]{0} all-gather(%p), channel_id=5, dimensions={0}
}

%plain_branch (p: f32[100]) -> f32[800] {
  %p = f32[100]{0} parameter(0)
  ROOT %b = f32[800]{0} broadcast(%p), dimensions={0}
}

%body.7 (t: (f64[], s32[])) -> (f64[], s32[]) {
  %all-reduce.13 = (f64[8,4]{1,0}, f64[4]{0}) all-reduce(%dot.35, %bitcast.20), channel_id=3, to_apply=%add
  %all-reduce.12 = f64[] all-reduce(%reduce.118), channel_id=4, to_apply=%add
  %c = f32[800]{0} conditional(%i, %x, %x), branch_computations={%gather_branch, %plain_branch}
}

%cond.8 (t: (f64[], s32[])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main.9 (x: f64[]) -> f64[] {
  %all-reduce = f64[] all-reduce(%reduce.4), channel_id=1, to_apply=%add
  %while.36 = (f64[], s32[]) while(%tuple.134), condition=%cond.8, body=%body.7
}
"""


@pytest.mark.parametrize(
    "shape, expected",
    [("f64[]", 8), ("f64[8,4]{1,0}", 256), ("(f64[8,4]{1,0}, f64[4]{0})", 288), ("f32[800]{0}", 3200), ("pred[3]", 3)],
)
def test_shape_bytes(shape, expected):
    assert _shape_bytes(shape) == expected


def test_collectives_inside_the_loop_are_per_step_and_the_entrys_per_chunk():
    found = collectives(PROGRAM)
    # in the body: the tuple (288 bytes), the scalar (8), the gather of its branch (3,200)
    assert found["per_step"] == [3, 288 + 8 + 3200]
    assert found["per_chunk"] == [1, 8]
    assert found["kinds"] == ["all-gather", "all-reduce"]
    assert found["conditional"] == 1  # (the gather: run by the steps that take its branch only)


def test_a_conditional_with_true_and_false_computations_is_conditional():
    program = PROGRAM.replace(
        "branch_computations={%gather_branch, %plain_branch}",
        "true_computation=%gather_branch, false_computation=%plain_branch",
    )
    found = collectives(program)
    assert found["per_step"] == [3, 288 + 8 + 3200] and found["conditional"] == 1


def test_a_program_without_collectives_has_none():
    found = collectives(PROGRAM.replace("all-reduce", "add").replace("all-gather", "broadcast"))
    assert found == {"per_step": [0, 0], "per_chunk": [0, 0], "conditional": 0, "kinds": []}
