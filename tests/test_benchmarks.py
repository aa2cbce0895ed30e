"""Every benchmark runs (``run_all.py --quick``: tiny budgets, its figures not asserted; speed is
never a test's business), so that a change of the package's internals cannot leave one broken
until the next full run (two were, once)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.slow
def test_every_benchmark_runs(tmp_path: Path) -> None:
    out = tmp_path / "RESULTS.md"
    command = [sys.executable, str(BENCHMARKS / "run_all.py"), "--quick", "--jobs", "2", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    table = out.read_text()
    rows = ("overhead:", "multitask:", "decay:", "noise scale", "comm,", "cached backward vs GradCache", "rank check",
            "microbatches:", "cached backward vs sentence-transformers", "2 gloo ranks, rank-local", "realistic:",
            "window host work", "progress bar refresh")
    for row in rows:
        assert row in table, row
    # one script again, the others' rows from the JSON files the run above left beside the table
    again = subprocess.run([*command, "--only", "comm_calls.py"], capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    table = out.read_text()
    assert "--only comm_calls.py" in table and "from an earlier run" in table
    for row in rows:
        assert row in table, row
