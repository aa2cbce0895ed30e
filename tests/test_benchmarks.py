"""Every benchmark runs (``run_all.py --quick``: tiny budgets, its figures not asserted; speed is
never a test's business), so that a change of the package's internals cannot leave one broken
until the next full run (two were, once). That run (``-m bench``, about 80 s on 2 quiet cores, a
fifth of the whole) is not in the default ``python -m pytest -q``: CI runs it as a step of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
_SESSION_PORT = os.environ.get("MASTER_PORT")  # (as the session began: none, unless the user set one)


@pytest.mark.bench  # (not in the default run: `.ci/run` runs `python -m pytest -q -m bench`)
def test_every_benchmark_runs(tmp_path: Path) -> None:
    out = tmp_path / "RESULTS.md"
    command = [sys.executable, str(BENCHMARKS / "run_all.py"), "--quick", "--jobs", "2", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    table = out.read_text()
    rows = ("overhead:", "multitask:", "decay:", "noise scale", "comm,", "cached backward vs GradCache", "rank check",
            "microbatches:", "cached backward vs sentence-transformers", "2 gloo ranks, rank-local", "realistic:",
            "window host work", "progress bar refresh", "budget: Budget(n, unit='items')",
            "precision: bf16-true, k=4, window gradient error", "precision cost: grad_accum_dtype=float32 vs None",
            "scale: Budget vs k=8, 2 gloo ranks")
    for row in rows:
        assert row in table, row
    # one script again, the others' rows from the JSON files the run above left beside the table
    again = subprocess.run([*command, "--only", "comm_calls.py"], capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    table = out.read_text()
    assert "--only comm_calls.py" in table and "from an earlier run" in table
    for row in rows:
        assert row in table, row


def test_each_script_finds_a_port_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fork-launched DDP run leaves its port in the launching process's environment; ``run_all`` starts its
    scripts without it, or two scripts run at once would start their ranks' stores on one port (a CI run failed
    so: ``scale.py`` beside another script with ranks, after the suite's in-process DDP tests)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import run_all

    env = run_all.script_env({"MASTER_PORT": "29500", "MASTER_ADDR": "127.0.0.1", "PATH": "/bin"})
    assert env == {"MASTER_ADDR": "127.0.0.1", "PATH": "/bin"}
    assert run_all.script_env({"PATH": "/bin"}) == {"PATH": "/bin"}


def test_a_test_leaves_the_port_as_it_found_it() -> None:
    """``conftest._no_port_left_behind``: the port a fork-launched DDP test set (Lightning's launcher, in this
    process) is gone once the test ends: the next test here checks it."""
    assert "MASTER_PORT" not in os.environ or os.environ["MASTER_PORT"] == _SESSION_PORT
    os.environ["MASTER_PORT"] = "1"  # (as Lightning's launcher leaves it)


def test_a_test_leaves_the_port_as_it_found_it_checked() -> None:
    assert os.environ.get("MASTER_PORT") == _SESSION_PORT


GPU = BENCHMARKS / "gpu"
GPU_PARTS = ("loop", "syncs", "memory", "passes", "precision")


@pytest.fixture
def gpu_harness(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``benchmarks/gpu/harness.py`` imported here, as ``run.sh`` puts it on the path (in this process: the
    libraries it needs are imported already, which keeps the dry run within its time budget)."""
    for path in (BENCHMARKS, GPU):
        monkeypatch.syspath_prepend(str(path))
    import harness

    return harness


def test_gpu_harness_dry_run(tmp_path: Path, gpu_harness: Any) -> None:
    """``run.sh --quick``: every part of the GPU harness, every configuration and code path at tiny sizes on
    the CPU (the out-of-memory back-off of ``microbatch_size="auto"`` included), none failing, into the
    path given: the committed results stay as they are."""
    committed = (GPU / "RESULTS.md").read_bytes()
    out = tmp_path / "RESULTS.md"
    assert gpu_harness.main(["--quick", "--out", str(out)]) == 0
    table = out.read_text()
    assert "FAILED" not in table and "## Failures" not in table, table
    assert "CPU dry run" in table and "Parts run: loop, syncs, memory, passes, precision." in table
    for part in GPU_PARTS:
        assert f"| {part} |" in table, part
    for row in (
        "| loop | k=2: bare torch floor (no Lightning) | ms per optimizer step",
        "| loop | k=2: AccumulationScheduler(k), log=True | time per optimizer step vs Trainer(accumulate_grad_batches",
        "| loop | k=2: AccumulationScheduler(k), log=False | time per",
        "| loop | k=2: AccumulationScheduler(k, normalize='items', count=causal_lm_tokens) | time per",
        "| loop | k=2: AccumulationScheduler(k, microbatch_size=2) (the loader batch) | time per",
        "| loop | k=2: AccumulationMixin, configure_accumulation(k) | time per optimizer step vs hand-written manual",
        "| loop | k=2: FabricAccumulator(fabric, model, optimizer, k) | time per optimizer step vs hand-written Fabric",
        "| syncs | k=2: FabricAccumulator(fabric, model, optimizer, k) | host reads (CPU dry run) per micro-batch",
        "| memory | cached backward vs sentence-transformers' cached MNRL, batch 16, chunks of 8 | allocator peak",
        "| memory | multitask, T=4: independent tasks (backward_each) | allocator peak",
        "| memory | multitask, T=4: shared trunk (backward_heads) | time vs joint",
        # the loader batch of 4 backed off twice (pieces over 1 refused), 2 refused when picked by hand
        "(back-offs: halvings from the loader batch) | 1 (2) |",
        "best hand-picked size, 1 (2: out of memory, 1: ",
        ": GradientDecay(0.9, mode='ema'): combine and reset | ",
        ": the window's normalisation (g *= scale) | ",
        "| precision | k=2: AccumulationScheduler(k, grad_accum_dtype=torch.float32), bf16-true, ",
        "| time per optimizer step vs AccumulationScheduler(k) (median of 2; ",
        "allocated as a micro-batch starts inside a window, vs AccumulationScheduler(k) (",
    ):
        assert row in table, row
    # the syncs: the baselines' counts beside each adapter's, nothing added inside a window
    assert table.count("(added +0.00 / ") == 7, table  # (the Fabric helper under a budget of samples: +0 too)
    # under a budget, the callback's count on the device read on the host as each micro-batch starts (issue 52)
    assert "count=causal_lm_tokens) | host reads (CPU dry run) per micro-batch inside a window / per window, vs " \
        "Trainer(accumulate_grad_batches=k) | 1.00 / 19.00 (added +1.00 / +3.00) | +1 / <= +3" in table, table
    assert (GPU / "RESULTS.md").read_bytes() == committed


def test_gpu_harness_records_a_failure_and_skips(tmp_path: Path, gpu_harness: Any) -> None:
    """A part that fails is recorded in the results (its traceback below the table), the parts after it run,
    the exit status says so; skipped parts are named; ``run.sh`` runs the harness with the interpreter
    ``PYTHON`` names and writes where ``--out`` says."""
    out = tmp_path / "RESULTS.md"
    skip = ["loop", "syncs", "memory", "precision"]
    args = ["--quick", "--skip", *skip, "--inject-failure", "passes", "--out", str(out)]
    assert gpu_harness.main(args) == 1
    table = out.read_text()
    assert "| passes | injected | FAILED | RuntimeError: injected failure in part passes (--inject-failure) |" in table
    assert "fraction of copy bandwidth" in table  # the part's sections after it ran
    assert "## Failures" in table and "Traceback" in table
    assert "skipped: loop, syncs, memory, precision." in table and "| loop |" not in table and "| memory |" not in table
    committed = (GPU / "RESULTS.md").read_bytes()
    env = {**os.environ, "PYTHON": sys.executable}
    command = ["bash", str(GPU / "run.sh"), "--quick", "--skip", *GPU_PARTS, "--out", str(tmp_path / "none.md")]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Parts run: none; skipped: loop, syncs, memory, passes, precision." in (tmp_path / "none.md").read_text()
    assert (GPU / "RESULTS.md").read_bytes() == committed


def test_gpu_harness_counts_syncs_per_micro_batch_and_window(gpu_harness: Any) -> None:
    """The plan of a run counts host syncs (on the CPU: reads of tensor values) only in its counted windows,
    each micro-batch's to that micro-batch (a redone micro-batch's to the same), and times its rounds."""
    from device_clock import Device
    from lm_loops import Plan

    plan = Plan(Device("cpu"), k=3, counted=2, rounds=2, per_round=1)
    assert plan.batches == 3 * (2 + 2 + 2)
    t = torch.ones(())
    for i in range(plan.batches):
        plan.at_batch(i)
        reads = {0: 2, 1: 0, 2: 1}[i % 3] + (5 if i < 3 or i >= 9 else 0)  # 5 more outside the counted windows
        for _ in range(reads):
            t.item()
        plan.at_batch(i)  # (a piece or a redo of the same micro-batch)
        bool(t)
    # each micro-batch: its reads and one bool; inside a window (the first two): (3 + 1) / 2; a window: 3 + 1 + 2
    assert plan.syncs() == (2.0, 6.0)
    assert len(plan.times) == 2 and all(s >= 0 for s in plan.times)
    assert not plan.counting
