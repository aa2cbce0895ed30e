"""The README's Python blocks run exactly as written: the first after the examples' install, the
Hugging Face one after ``[hf]``'s (with the first's imports, as the README reads)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_first_snippet_runs_as_written() -> None:
    out = run(blocks()[0])
    assert "Progress(" in out and "step=40" in out


def test_the_hugging_face_snippet_runs_after_the_first() -> None:
    pytest.importorskip("transformers")
    first, hf = blocks()[:2]
    run(first.split("class Regressor")[0] + hf)  # (the first block's imports)
