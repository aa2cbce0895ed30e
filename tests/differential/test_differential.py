"""The fuzzer in CI: a fixed-seed sample of combined configurations and the named regression
cases, each against the float64 reference. ``python -m tests.differential --n 5000`` runs more."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from .__main__ import main
from .cases import CASES, case
from .compare import check
from .configs import generate

SEED, SAMPLE, CHUNK = 2026, 400, 100  # (the long run: `python -m tests.differential --n 5000`)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", range(SAMPLE // CHUNK))
def test_sample_agrees_with_the_reference(chunk: int) -> None:
    rng = random.Random(SEED)
    configs = [generate(rng) for _ in range(SAMPLE)][chunk * CHUNK : (chunk + 1) * CHUNK]
    diverged = [json.dumps({"config": json.loads(c.to_json()), "differences": d}) for c in configs if (d := check(c))]
    assert not diverged, "\n".join(diverged)


@pytest.mark.parametrize("name", sorted(CASES))
def test_regression_case(name: str) -> None:
    assert check(case(name)) == []


def test_the_reference_shares_no_code_with_the_package() -> None:
    code = (
        "import sys; import tests.differential.reference; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'lightning_accum', 'pytorch_lightning')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_a_divergence_is_printed_as_one_json_line_and_replays(capsys: pytest.CaptureFixture[str]) -> None:
    line = case("two_failures_callback").to_json()
    assert main(["--replay", line]) == 0
    assert "1 configurations, 1 agreed, 0 diverged" in capsys.readouterr().out
