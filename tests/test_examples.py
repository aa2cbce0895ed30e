"""Smoke tests: every example runs to the end on its bundled data with a tiny budget."""

from __future__ import annotations

import os
import runpy
import sys
import tempfile
from pathlib import Path

import pytest

from helpers import warm_processes

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


BANNERS = ("GPU available", "TPU available", "litlogger", "LeafSpec", "does not have many workers")


def _as_main(script: str, args: tuple[str, ...], out: str) -> None:
    """In a fresh process: the script as ``python script args`` runs it, its output (both streams) into ``out``."""
    with open(out, "w") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        sys.argv = [script, *args]
        sys.path.insert(0, str(Path(script).parent))
        try:
            runpy.run_path(script, run_name="__main__")
        finally:
            sys.stdout.flush()
            sys.stderr.flush()


def run(script: str, *args: str) -> str:
    """The script's output; it must not carry Lightning's start-up banners, tips and advisories. Each runs in a
    process of its own, forked from a server that imported Lightning once and ran nothing (a spawned
    interpreter would spend about 5 of its 6-8 seconds importing Lightning again)."""
    context = warm_processes()
    handle, name = tempfile.mkstemp(suffix=".out")
    os.close(handle)
    out = Path(name)
    process = context.Process(target=_as_main, args=(str(EXAMPLES / script), args, str(out)))
    process.start()
    process.join()
    text = out.read_text()
    out.unlink()
    assert process.exitcode == 0, f"{script} failed:\n{text[-3000:]}"
    for banner in BANNERS:
        assert banner not in text, f"{script} prints {banner!r}"
    return text


@pytest.mark.slow
def test_quickstart() -> None:
    out = run("quickstart.py", "--epochs", "1")
    lines = [line for line in out.splitlines() if line.startswith("epoch 0")]
    assert lines[0].split()[5] == "1" and "effective batch   16" in lines[0]
    assert "done:" in out and "validation accuracy" in out


@pytest.mark.slow
def test_multitask() -> None:
    out = run("multitask.py", "--epochs", "1")
    assert "optimizer steps" in out
    joint, heads = (float(part.split(" MiB")[0].split()[-1]) for part in out.split("joint backward")[1].split(","))
    assert heads < joint


@pytest.mark.slow
def test_hf_causal_lm() -> None:
    pytest.importorskip("transformers")
    out = run("hf_causal_lm.py", "--epochs", "1")
    losses = [float(line.split("loss ")[1].split()[0]) for line in out.splitlines() if line.startswith("step")]
    assert len(losses) >= 2 and losses[-1] < losses[0]
    assert "final k 8" in out


@pytest.mark.slow
def test_bf16_window(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = run("bf16_window.py", "--steps", "3", "--probes", "2", "--out", str(tmp_path))
    windows = [line for line in out.splitlines() if line.startswith("  step") and ":  32-true " in line]
    for name in ("32-true", "bf16-true", "bf16-true + float32 sum"):
        first, last = (float(line.split(f"  {name} ")[1].split()[0]) for line in (windows[0], windows[-1]))
        assert last < first - 0.1, (name, first, last)
    probes = [line for line in out.splitlines() if "32-true vs float64" in line]
    assert len(probes) == 2
    for line in probes:
        assert float(line.split("32-true vs float64 ")[1].split(";")[0]) < 1e-5
        plain, wide = line.split("; bf16-true: ")[1].split("; bf16-true + float32 sum: ")
        error, once = (float(wide.split(key)[1].split()[0].rstrip("),")) for key in ("sum ", "(once "))
        assert error <= 1.1 * once, line  # the option: within one rounding of the window's exact mean
        error, once = (float(plain.split(key)[1].split()[0].rstrip("),")) for key in ("sum ", "(once "))
        assert error > 1.5 * once, line  # bf16 `.grad`: rounded at every add (k >= 16)
    assert "the two bf16 runs' parameters differ by" in out
    assert (tmp_path / "bf16_window.png").stat().st_size > 10_000


@pytest.mark.slow
def test_gradient_decay(tmp_path: Path) -> None:
    out = run("gradient_decay.py", "--epochs", "1", "--out", str(tmp_path))
    assert out.count("mean loss over the last epoch") == 4
    assert (tmp_path / "gradient_decay.png").stat().st_size > 10_000


@pytest.mark.slow
def test_batchnorm_window(tmp_path: Path) -> None:
    out = run("batchnorm_window.py", "--epochs", "1", "--out", str(tmp_path))
    assert "micro-batch vs window runs: parameters differ by 0.0e+00" in out
    distances = {}
    for line in out.splitlines():
        if "relative distance" in line:
            name = line.split()[0]
            distances[name] = float(line.split("running_var ")[1])
    assert distances["batchnorm='window'"] < distances["batchnorm='micro-batch'"]
    gap = float(out.split("running statistics differ by ")[1].split()[0])
    assert gap < 1e-12
    assert (tmp_path / "batchnorm_window.png").stat().st_size > 10_000


@pytest.mark.slow
def test_token_budget(tmp_path: Path) -> None:
    out = run("token_budget.py", "--epochs", "2", "--sequences", "768", "--out", str(tmp_path))
    n = int(out.split("budget n = ")[1].split(":")[0])
    assert f"budget n = {n}: every step >= n: True; at most one micro-batch more: True" in out
    assert "the windows the loader's counts give by hand: True" in out
    ratios = {}
    for line in out.splitlines():
        if "max/min" in line:
            name = "budget" if line.startswith("Budget(") else "fixed"
            ratios[name] = float(line.split("max/min ")[1].split(",")[0])
            assert int(line.split(" min ")[1].split(",")[0]) >= n or name == "fixed"
    assert ratios["budget"] < ratios["fixed"]
    assert (tmp_path / "token_budget.png").stat().st_size > 10_000


@pytest.mark.slow
def test_adaptive(tmp_path: Path) -> None:
    out = run("adaptive.py", "--epochs", "2", "--out", str(tmp_path))
    assert "done:" in out and "noise scale" in out and "adascale gain" in out and "scaled steps" in out
    assert "short windows at epoch ends" in out
    assert (tmp_path / "adaptive.png").stat().st_size > 10_000


@pytest.mark.slow
def test_token_lm() -> None:
    out = run("token_lm.py", "--epochs", "1", "--lines", "256")
    items = float(out.split("normalize='items' vs one big batch: relative error ")[1].split()[0])
    means = float(out.split("mean of means     vs one big batch: relative error ")[1].split()[0])
    assert items < 1e-6 < 1e-2 < means
    assert out.count("held-out loss per token") == 2


@pytest.mark.slow
def test_contrastive(tmp_path: Path) -> None:
    out = run("contrastive.py", "--epochs", "2", "--out", str(tmp_path))
    assert "1-NN accuracy" in out and (tmp_path / "contrastive.png").stat().st_size > 10_000
    gap = float(out.split("cached vs full batch: max parameter difference ")[1].split()[0])
    assert gap < 1e-4


@pytest.mark.slow
def test_retrieval(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = run("retrieval.py", "--steps", "3", "--out", str(tmp_path))
    curves = {line.split(":")[0].strip(): line.split()[-1] for line in out.splitlines() if "top-1" in line}
    assert set(curves) == {"whole", "plain", "cached"} and (tmp_path / "retrieval.png").exists()


@pytest.mark.slow
def test_fabric_pretraining() -> None:
    pytest.importorskip("transformers")
    out = run("fabric_pretraining.py", "--epochs", "1")
    assert "done:" in out and "window loss" in out


@pytest.mark.slow
def test_microbatches() -> None:
    out = run("microbatches.py", "--epochs", "1")
    assert "no micro-batches: out of memory" in out
    assert "continuing with micro-batches of 32" in out and "continuing with micro-batches of 16" in out
    assert "'auto' on the small device: micro-batches of 16 samples" in out
    gap = float(out.split("small device vs enough memory: ")[1].split()[0])
    assert gap < 1e-12
def test_large_batch_retrieval() -> None:
    pytest.importorskip("sentence_transformers")
    out = run("large_batch_retrieval.py", "--steps", "1", "--batch", "768", "--budget-mib", "8")
    assert "(does not fit); in blocks of 64" in out and "(within the budget)" in out and "held-out top-1" in out
