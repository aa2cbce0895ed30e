"""Smoke tests: every example runs to the end on its bundled data with a tiny budget."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.slow
def test_quickstart() -> None:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py"), "--epochs", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    lines = [line for line in out.splitlines() if line.startswith("epoch 0")]
    assert lines[0].split()[5] == "1" and "effective batch   16" in lines[0]
    assert "done:" in out and "validation accuracy" in out
