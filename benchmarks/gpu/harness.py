"""The GPU figures (issue 43): what the package costs and saves on a real card, every figure a ratio against
a baseline run in the same process (or a count, or an allocator peak). Five parts, each skippable, each
catching its own failure (recorded in the results; the others go on):

1. ``loop``: time per optimizer step of every adapter against its own baseline, GPT-2-small-sized, bf16-mixed,
   sequences of 1024, k = 4 and 16, and against the bare-torch floor (``lm_loops.py``);
2. ``syncs``: host syncs per micro-batch inside a window and per window, the same fits (``lm_loops.py``);
3. ``memory``: the cached backward against sentence-transformers' cached loss, multitask against the joint
   backward, ``microbatch_size="auto"`` on a batch that does not fit (``memory_saved.py``);
4. ``passes``: the passes over a 124M-parameter gradient against ``zero_grad`` and the copy bandwidth
   (``gradient_passes.py``);
5. ``precision``: ``grad_accum_dtype=torch.float32`` against ``None`` under ``bf16-true``, the same GPT-2 at
   k = 8: time per optimizer step and the allocator's peak (``wide_sums.py``).

Run it through ``run.sh`` (it puts ``src`` and ``benchmarks`` on the path). ``--quick`` is the CPU dry run
CI executes: the same functions at tiny sizes (its figures mean nothing); it must not overwrite the
committed results, so CI gives ``--out`` a temporary path. The results file is rewritten after every part,
so that a run cut short keeps what it measured.

    bash benchmarks/gpu/run.sh [--skip loop syncs memory passes precision] [--out PATH]  # about 6 min, H100
    bash benchmarks/gpu/run.sh --quick --out /tmp/GPU_RESULTS.md                # the CPU dry run, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import logging
import platform
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
PARTS = ("loop", "syncs", "memory", "passes", "precision")
# seconds a full run takes on an H100, model builds included (syncs: from the loop's fits; alone about 40)
ESTIMATE_S = {"loop": 200, "syncs": 5, "memory": 110, "passes": 15, "precision": 40}
Row = tuple[str, str, str, str, str]


@dataclass
class Sizes:
    lm: Any  # lm_loops.LMSize
    ks: list[int]
    rounds: int
    per_round: int
    tower: Any  # memory_saved.TowerSize
    multitask_scale: int
    reps: int
    auto_batch: int
    auto_windows: int
    wide_k: int
    wide_rounds: int


def sizes(quick: bool, microbatch: int) -> Sizes:
    from lm_loops import LMSize
    from memory_saved import TowerSize

    if quick:  # the same code paths, tiny
        return Sizes(LMSize(1, 32, 2, 128, 16, 2), [2], 1, 1, TowerSize(1, 32, 2, (16,), 8, 1), 16, 1, 4, 1, 2, 1)
    return Sizes(LMSize(microbatch=microbatch), [4, 16], 5, 2, TowerSize(), 1, 5, 8 * microbatch, 3, 8, 3)


@dataclass
class Results:
    """What the run has so far, written out after every part."""

    out: Path
    header: list[str]
    rows: list[Row] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    timing: list[str] = field(default_factory=list)

    def section(self, part: str, name: str, make: Callable[[], list[Row]]) -> None:
        """One section's rows, or its failure recorded (the run goes on)."""
        try:
            self.rows += make()
        except Exception as error:
            message = f"{type(error).__name__}: {error}".splitlines()[0][:300]
            self.rows.append((part, name, "FAILED", message, "-"))
            self.failures.append(f"### {part}: {name}\n\n```\n{traceback.format_exc()[-4000:]}```\n")
            traceback.print_exc()

    def write(self) -> None:
        lines = [
            *self.header,
            "",
            "| part | what | measured | value | target |",
            "| --- | --- | --- | --- | --- |",
            *(f"| {' | '.join(cell.replace('|', '/') for cell in row)} |" for row in self.rows),
            "",
            "Time per part (estimated for a full run on an H100; measured): " + "; ".join(self.timing) + ".",
            "",
        ]
        if self.failures:
            lines += ["## Failures", "", *self.failures]
        self.out.write_text("\n".join(lines))


def versions() -> str:
    """The libraries' versions as installed (read from their metadata: nothing imported) and the commit."""
    found = [f"Python {platform.python_version()}", f"torch {torch.__version__}"]
    for name in ("lightning", "transformers", "sentence-transformers"):
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"no {name}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE)
    if commit.returncode == 0:
        found.append(f"commit {commit.stdout.strip()}")
    return ", ".join(found)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Lightning's, the package's and transformers' info logs and the known warnings off, the random state
    forked: as they were afterwards (CI runs the dry run inside its test process)."""
    try:
        import transformers
    except ImportError:  # (recorded as the parts that need it fail)
        transformers = None

    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric", "lightning_accum")]
    levels = [logger.level for logger in loggers]
    verbosity = transformers.logging.get_verbosity() if transformers else None
    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
        warnings.filterwarnings("ignore", message=".*(LeafSpec|does not have many workers|GPU available|TF32).*")
        if transformers:
            transformers.logging.set_verbosity_error()
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            if transformers:
                transformers.logging.set_verbosity(verbosity)
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the parts asked for and writes the results; 1 if a part failed (its failure is in the results)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the CPU dry run: tiny sizes, every code path")
    parser.add_argument("--skip", nargs="+", default=[], choices=PARTS, help="parts not to run")
    parser.add_argument("--out", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument("--microbatch", type=int, default=8, help="GPT-2 sequences a micro-batch (full run)")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda, or cpu with --quick")
    parser.add_argument("--inject-failure", choices=PARTS, help="raise inside this part (checks the recording)")
    args = parser.parse_args(argv)
    name = args.device or ("cpu" if args.quick else "cuda")
    if name == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here: the full run needs one (--quick is the CPU dry run)")
    threads = torch.get_num_threads()
    if name == "cpu":  # (tiny ops on 2 threads of a busy machine wait on each other: 20 times slower)
        torch.set_num_threads(1)
    try:
        with quiet():
            return run(args, name, list(sys.argv[1:] if argv is None else argv))
    finally:
        torch.set_num_threads(threads)


def run(args: argparse.Namespace, name: str, argv: list[str]) -> int:
    from device_clock import Device

    device = Device(name)
    todo = [part for part in PARTS if part not in args.skip]
    header = [
        "# GPU benchmark results",
        "",
        f"Written by `bash benchmarks/gpu/run.sh{''.join(' ' + a for a in argv)}` on {device.describe()}, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {versions()}.",
        f"Parts run: {', '.join(todo) or 'none'}" + (f"; skipped: {', '.join(args.skip)}." if args.skip else "."),
        "Every figure is a ratio against a baseline run in the same process, a count, or an allocator peak; the",
        'docstrings of `benchmarks/gpu/*.py` say how each is measured. "(above)" marks a figure past its target.',
    ]
    if args.quick:
        header.append(
            "**A CPU dry run (`--quick`): tiny sizes; the figures mean nothing, it checks that every part runs.**"
        )
    results = Results(args.out, header)
    print("\n".join(header), flush=True)
    if not todo:
        results.write()
        return 0
    size = sizes(args.quick, args.microbatch)

    def part(part: str, sections: list[tuple[str, Callable[[], list[Row]]]]) -> None:
        if part not in todo:
            results.timing.append(f"{part} skipped")
            return
        print(f"== {part}: about {ESTIMATE_S[part]} s on an H100 (full run)", flush=True)
        start = time.perf_counter()
        if args.inject_failure == part:
            results.section(part, "injected", lambda: _raise(part))
        for section, make in sections:
            results.section(part, section, make)
        seconds = time.perf_counter() - start
        results.timing.append(f"{part} ~{ESTIMATE_S[part]} s, {seconds:.0f} s")
        print(f"== {part}: {seconds:.1f} s", flush=True)
        results.write()

    measured: dict[int, Any] = {}
    broken: list[BaseException] = []

    def fits() -> dict[int, Any]:
        """The fits both `loop` and `syncs` read, once: rounds timed for `loop`, syncs counted for `syncs`."""
        from lm_loops import measure_all

        if broken:
            raise broken[0]
        if not measured:
            rounds, counted = (size.rounds if "loop" in todo else 0), (1 if "syncs" in todo else 0)
            try:
                measured.update(measure_all(device, size.lm, size.ks, counted, rounds, size.per_round))
            except Exception as error:
                broken.append(error)
                raise
        return measured

    def loop() -> list[Row]:
        from lm_loops import loop_rows

        return loop_rows(device, size.lm, fits(), size.rounds)

    def syncs() -> list[Row]:
        from lm_loops import sync_rows

        return sync_rows(device, size.lm, fits(), 1)

    def cached() -> list[Row]:
        from memory_saved import cached_rows

        return cached_rows(device, size.tower)

    def multitask() -> list[Row]:
        from memory_saved import multitask_rows

        return multitask_rows(device, size.multitask_scale, size.reps)

    def auto() -> list[Row]:
        from memory_saved import auto_rows

        return auto_rows(device, size.lm, size.auto_batch, size.auto_windows)

    def passes() -> list[Row]:
        from gradient_passes import pass_rows

        return pass_rows(device, size.lm, 4 * size.reps)

    def precision() -> list[Row]:
        from wide_sums import wide_rows

        return wide_rows(device, size.lm, size.wide_k, size.wide_rounds, size.per_round)

    what = size.lm.describe()
    part("loop", [(what, loop)])
    part("syncs", [(what, syncs)])
    part("memory", [("cached backward vs sentence-transformers", cached), ("multitask", multitask),
                    ("microbatch_size='auto'", auto)])  # fmt: skip
    part("passes", [("gradient passes", passes)])
    part("precision", [(f"grad_accum_dtype, {what}, bf16-true", precision)])
    results.write()
    print(args.out.read_text(), flush=True)
    return 1 if results.failures else 0


def _raise(part: str) -> list[Row]:
    raise RuntimeError(f"injected failure in part {part} (--inject-failure)")


if __name__ == "__main__":
    sys.exit(main())
