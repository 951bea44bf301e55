"""What importing blrppl sets up: XLA's concurrent CPU scheduler turned off (compiled fits
can hang with it), or a warning when JAX has computed already and it is too late."""

from __future__ import annotations

import os

import pytest
from jax._src import xla_bridge

import blrppl

FLAG = "xla_cpu_enable_concurrency_optimized_scheduler"


def test_the_scheduler_flag_is_added_before_jax_computes(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    blrppl._turn_off_concurrent_scheduler()
    assert os.environ["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=1 --{FLAG}=false"


def test_a_users_own_setting_is_kept(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", f"--{FLAG}=true")
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    blrppl._turn_off_concurrent_scheduler()
    assert os.environ["XLA_FLAGS"] == f"--{FLAG}=true"


def test_too_late_is_a_warning_naming_the_fix(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    with pytest.warns(UserWarning, match=f"XLA_FLAGS=--{FLAG}=false"):
        blrppl._turn_off_concurrent_scheduler()
    assert "XLA_FLAGS" not in os.environ
