"""What the rank agreement check on k costs per optimizer step, on 2 gloo ranks (CPU).

Schedules that guarantee the same k on every rank (``Constant``, ``Piecewise``, ``Ramp``,
``NoiseScale``) are not checked: zero cost. ``Lambda`` and subclasses of ``Schedule`` are checked
with one all-reduce of two int64 at each window's start. Measured in place: the check's own time
per call, against the window's count all-reduce (three int64) that every step already makes, in
the same processes; the medians of ``--calls`` calls after a warm-up.

    python benchmarks/rank_check.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_accum import Lambda
from lightning_accum._core import collectives


class GlooStrategy:
    """The part of a Lightning strategy the collectives use."""

    world_size = 2
    root_device = torch.device("cpu")

    def reduce(self, tensor: torch.Tensor, reduce_op: str = "sum") -> torch.Tensor:
        dist.all_reduce(tensor)
        return tensor


def worker(rank: int, calls: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    strategy, schedule = GlooStrategy(), Lambda(lambda p: 4)
    times: dict[str, list[float]] = {"check": [], "counts": []}
    for i in range(calls + 100):
        dist.barrier()
        start = time.perf_counter()
        collectives.check_same_k(strategy, 4, schedule)
        middle = time.perf_counter()
        collectives.sum_over_ranks(strategy, [4, 32, 32])
        end = time.perf_counter()
        if i >= 100:
            times["check"].append(middle - start)
            times["counts"].append(end - middle)
    if rank == 0:
        Path(out).write_text(json.dumps({k: statistics.median(v) * 1e6 for k, v in times.items()}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json", type=Path, default=Path(__file__).with_name("rank_check.json"))
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        mp.spawn(worker, args=(args.calls, f"file://{tmp}/store", out), nprocs=2)
        result: dict[str, Any] = json.loads(Path(out).read_text())
    print(f"rank agreement check (Lambda, custom schedules): {result['check']:.1f} us per optimizer step")
    print(f"the window's count all-reduce every step makes:   {result['counts']:.1f} us per optimizer step")
    print(f"ratio: {result['check'] / result['counts']:.2f}; built-in schedules: not checked (0 us)")
    result.update(benchmark="rank_check", calls=args.calls, backend="gloo, 2 CPU ranks")
    args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
