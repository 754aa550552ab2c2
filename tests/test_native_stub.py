"""The hand-written stub of the native module (python/guided/_native.pyi) says
what the built module has: every class, method, parameter name, default and
kind, checked by mypy's stubtest against the import."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_stub_matches_the_built_module():
    pytest.importorskip("mypy")
    run = subprocess.run([sys.executable, "-m", "mypy.stubtest", "guided._native", "--concise",
                          "--mypy-config-file", str(ROOT / "pyproject.toml")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
