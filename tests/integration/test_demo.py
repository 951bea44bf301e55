"""``make demo`` fits its models without a warning: a warning there would tell a new user
that the main job's own example is a poor fit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_demo_runs_without_warnings():
    env = dict(os.environ)
    out = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", str(ROOT / "examples" / "demo.py")],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Gaussian mixture" in out.stdout
    assert "Warning" not in out.stderr, out.stderr[-3000:]
