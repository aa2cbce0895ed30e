"""The README's Python blocks run exactly as written, each alone (each after the examples' install, which
brings ``transformers`` too), in a fresh folder that they leave as they found it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def run(code: str, where: Path) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=where)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not list(where.iterdir()), f"the snippet left {sorted(p.name for p in where.iterdir())} behind"
    return done.stdout


def test_the_first_snippet_runs_as_written(tmp_path: Path) -> None:
    out = run(blocks()[0], tmp_path)
    assert "Progress(" in out and "step=40" in out


def test_the_hugging_face_snippet_runs_alone(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    run(blocks()[1], tmp_path)
