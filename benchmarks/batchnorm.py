"""Cost of ``batchnorm="window"`` against BatchNorm's own per-micro-batch update.

A small ResNet-style CPU model (a stem and four residual blocks, 9 BatchNorm2d layers, 16-32 channels,
16x16 images): one window is k micro-batches of forward and backward, then the optimizer step. Under
``"window"`` the package's ``WindowBatchNorm`` hooks every layer (the buffers swapped for each forward,
each micro-batch's statistics pooled at its backward's end, one update per window); the baseline is the
same loop with BatchNorm left to itself. Rounds are interleaved; the figures are the median of the rounds'
ratios (each round times both loops, one after the other) and the ratio of the best round times (target
<= 1.03). On a shared machine these move by a few per cent from run to run, so the package's own work is
also measured in place: the CPU time spent inside ``WindowBatchNorm``'s ``arm``, hooks, ``accept`` and ``commit``
per window, and its share of the window (a figure that load barely moves).

    python benchmarks/batchnorm.py

``--against FILE``: another version of ``_core/batchnorm.py`` (``git show REV:src/lightning_accum/_core/batchnorm.py
> FILE``) timed in place beside this one, in the same process, rounds interleaved: each one's hooks per window
(thread CPU time), its share of the window and its window against ``"micro-batch"``, the medians of the rounds.

    python benchmarks/batchnorm.py --against /tmp/batchnorm_before.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from lightning_accum._core.batchnorm import WindowBatchNorm


class Block(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.skip = nn.Identity() if stride == 1 and c_in == c_out else nn.Conv2d(c_in, c_out, 1, stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.skip(x))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        Block(16, 16, 1), Block(16, 32, 2), Block(32, 32, 1), Block(32, 32, 1),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )  # fmt: skip


class TimedWindowBatchNorm(WindowBatchNorm):
    """``WindowBatchNorm`` whose own work (``arm``, the two hooks, ``accept``, ``commit``) is timed in CPU seconds."""

    def __init__(self) -> None:
        super().__init__()
        self.spent = 0.0

    @override
    def _before_forward(self, layer: nn.Module, args: Any) -> None:  # type: ignore[override]
        start = time.process_time()
        super()._before_forward(layer, args)  # type: ignore[arg-type]
        self.spent += time.process_time() - start

    @override
    def _after_forward(self, layer: nn.Module, args: Any, output: Any) -> None:  # type: ignore[override]
        start = time.process_time()
        super()._after_forward(layer, args, output)  # type: ignore[arg-type]
        self.spent += time.process_time() - start

    @override
    def arm(self) -> None:
        start = time.process_time()
        super().arm()
        self.spent += time.process_time() - start

    @override
    def accept(self) -> None:
        start = time.process_time()
        super().accept()
        self.spent += time.process_time() - start

    @override
    def commit(self) -> None:
        start = time.process_time()
        super().commit()
        self.spent += time.process_time() - start


def timed_class(base: type[WindowBatchNorm]) -> type[WindowBatchNorm]:
    """``base`` with its own work (``arm``, the two hooks, ``accept``, ``commit``) timed in thread CPU seconds, into
    the class's ``spent``."""

    class Timed(base):  # type: ignore[valid-type,misc]
        spent = 0.0

        def _timed(self, name: str, *args: Any) -> None:
            start = time.thread_time()
            getattr(super(), name)(*args)
            Timed.spent += time.thread_time() - start

        def _before_forward(self, *args: Any) -> None:
            self._timed("_before_forward", *args)

        def _after_forward(self, *args: Any) -> None:
            self._timed("_after_forward", *args)

        def arm(self) -> None:
            self._timed("arm")

        def accept(self) -> None:
            self._timed("accept")

        def commit(self) -> None:
            self._timed("commit")

    return Timed


def against(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """This version's ``WindowBatchNorm`` and the one in ``path``, in place, rounds interleaved (see the docstring)."""
    spec = importlib.util.spec_from_file_location("other_batchnorm", path)
    assert spec is not None and spec.loader is not None
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    classes = {"other": timed_class(other.WindowBatchNorm), "this": timed_class(WindowBatchNorm)}
    loops = {name: window_loop("window", args.k, args.batch, cls()) for name, cls in classes.items()}
    loops["micro-batch"] = window_loop("micro-batch", args.k, args.batch)
    for loop in loops.values():
        loop()
    took: dict[str, list[float]] = {name: [] for name in loops}
    hooks: dict[str, list[float]] = {name: [] for name in classes}
    for _ in range(max(1, args.rounds)):
        for name, loop in loops.items():
            if name in classes:
                classes[name].spent = 0.0  # type: ignore[attr-defined]
            start = time.thread_time()
            for _ in range(args.windows):
                loop()
            took[name].append((time.thread_time() - start) / args.windows)
            if name in classes:
                hooks[name].append(classes[name].spent / args.windows)  # type: ignore[attr-defined]
    out: dict[str, Any] = {"against": str(path)}
    for name in classes:
        out[name] = {
            "hooks_us_per_window": statistics.median(hooks[name]) * 1e6,
            "hooks_share": statistics.median(h / t for h, t in zip(hooks[name], took[name], strict=True)),
            "ratio_median": statistics.median(t / m for t, m in zip(took[name], took["micro-batch"], strict=True)),
        }
    return out


def window_loop(mode: str, k: int, batch: int, stats: WindowBatchNorm | None = None) -> Callable[[], None]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    if mode == "window" and stats is None:
        stats = WindowBatchNorm()
    if stats is not None:
        stats.attach(model)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(batch, 3, 16, 16, generator=g) for _ in range(k)]
    ys = [torch.randint(0, 10, (batch,), generator=g) for _ in range(k)]

    def window() -> None:
        for x, y in zip(xs, ys, strict=True):
            if stats is not None:  # (a micro-batch: its forwards pooled till `accept`)
                stats.arm()
            (nn.functional.cross_entropy(model(x), y) / k).backward()
            if stats is not None:
                stats.accept()
        opt.step()
        opt.zero_grad()
        if stats is not None:
            stats.commit()

    return window


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--json", type=Path, default=Path(__file__).with_name("batchnorm.json"))
    parser.add_argument("--against", type=Path, default=None, help="another _core/batchnorm.py, timed beside this")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.against is not None:
        print(json.dumps(against(args.against, args), indent=2))
        return
    loops = {mode: window_loop(mode, args.k, args.batch) for mode in ("micro-batch", "window")}
    for loop in loops.values():
        loop()  # (warm-up)
    best = dict.fromkeys(loops, float("inf"))
    ratios = []
    for _ in range(max(1, args.rounds)):
        took = {}
        for mode, loop in loops.items():
            start = time.process_time()
            for _ in range(args.windows):
                loop()
            took[mode] = (time.process_time() - start) / args.windows
            best[mode] = min(best[mode], took[mode])
        ratios.append(took["window"] / took["micro-batch"])
    # in place: the package's own work inside windows of the "window" loop
    timed = TimedWindowBatchNorm()
    loop = window_loop("window", args.k, args.batch, timed)
    loop()
    shares, spent = [], []
    for _ in range(max(1, args.rounds)):
        timed.spent = 0.0
        start = time.process_time()
        for _ in range(args.windows):
            loop()
        total = time.process_time() - start
        spent.append(timed.spent / args.windows)
        shares.append(timed.spent / total)
    result = {
        "k": args.k,
        "batch": args.batch,
        "ms_per_window_micro_batch": best["micro-batch"] * 1e3,
        "ms_per_window_window": best["window"] * 1e3,
        "ratio_best": best["window"] / best["micro-batch"],
        "ratio_median": statistics.median(ratios),
        "hooks_us_per_window": statistics.median(spent) * 1e6,
        "hooks_share": statistics.median(shares),
        "target": 1.03,
    }
    print(json.dumps(result, indent=2))
    if str(args.json) not in ("", "."):
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
