"""The fuzzer in CI: a fixed-seed sample of combined configurations and the named regression
cases, each against the float64 reference. ``python -m tests.differential --n 5000`` runs more."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .__main__ import main
from .bf16_reference import bounds, round_bf16
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


def test_the_bf16_reference_rounds_once_to_the_nearest_even() -> None:
    """``round_bf16`` is one rounding to nearest, ties to even: torch's own from float32 (where it is one), not torch's
    from float64 (through float32, two: 1 + 2^-8 + 2^-30 is above the tie between 1 and 1 + 2^-7, float32 drops the
    2^-30 and the tie goes to 1). ``bounds`` gives one bf16 number where float32's error cannot reach a tie."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=g) * torch.exp2(torch.randint(-20, 20, (20000,), generator=g).float())
    assert torch.equal(round_bf16(x.double()), x.to(torch.bfloat16).double())
    tie = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)], dtype=torch.float64)
    assert round_bf16(tie).tolist() == [1.0, 1 + 2**-6, -1.0]  # (to the even neighbour)
    above = torch.tensor([1 + 2**-8 + 2**-30], dtype=torch.float64)
    assert round_bf16(above).item() == 1 + 2**-7 and above.to(torch.bfloat16).item() == 1.0
    lo, hi = bounds(torch.tensor([1.3, 1 + 2**-8 + 2**-26]), torch.tensor([1.3, 1.0]), 4)
    assert lo.tolist() == [round_bf16(torch.tensor(1.3)).item(), 1.0] and hi.tolist() == [lo[0].item(), 1 + 2**-7]
