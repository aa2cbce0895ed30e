"""What ``AccumulationScheduler(microbatch_size=...)`` costs.

1. Time per sample with ``microbatch_size`` equal to the loader batch (``training_step`` routed
   through the pieces; a batch of one piece keeps Lightning's own backward) against the plain
   callback, the same loop otherwise (target <= 1.02); and with ``"auto"`` where nothing runs out of
   memory (one piece, its backward inside ``training_step``, then Lightning's backward of the batch's
   loss value, a graph of one element).
2. The package's own host work per piece, measured in place (thread CPU time, which a busy machine's
   preemptions do not inflate): the time inside the routed ``training_step`` less the model's forward
   and the piece's backward; and the time of Lightning's backward of the loss value per loader batch.
3. For scale, the time per sample when each batch is cut into 4 pieces (smaller kernels: the cost
   of fitting, reported, not a target).

Model: an MLP 256-1024-1024-10 in float32, loader batches of 64, k = 4, one CPU thread. Runs
alternate in one process; the ratio is of the best (minimum) loop CPU times over the rounds, as
``overhead.py`` does (a shared 2-core machine adds +-15 % to single runs, and noise only adds time).

    python benchmarks/microbatches.py [--batches 96] [--repeats 8]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from common import timed_epoch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationScheduler
from lightning_accum._trainer.pieces import Pieces

BATCH, K = 64, 4


class MLP(pl.LightningModule):
    inside = 0.0  # seconds inside `training_step` (the model's forward and loss), while timed

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        start = time.thread_time()
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        MLP.inside += time.thread_time() - start
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class InPlace:
    """Adds up, while entered, the time inside the routed `training_step` (``Pieces.step``) and inside
    ``LightningModule.backward``, split into the pieces' backward passes and Lightning's own."""

    def __init__(self) -> None:
        self.step = self.piece_backward = self.lightning_backward = 0.0
        self.pieces = self.batches = 0
        self._in_step = False

    def __enter__(self) -> InPlace:
        self._step, self._backward = Pieces.step, pl.LightningModule.backward
        me = self

        def step(pieces: Pieces, *args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            me._in_step = True
            try:
                return me._step(pieces, *args, **kwargs)
            finally:
                me._in_step = False
                me.step += time.thread_time() - start
                me.batches += 1

        def backward(module: pl.LightningModule, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            start = time.thread_time()
            me._backward(module, loss, *args, **kwargs)
            spent = time.thread_time() - start
            if me._in_step:
                me.piece_backward += spent
                me.pieces += 1
            else:
                me.lightning_backward += spent

        Pieces.step, pl.LightningModule.backward = step, backward  # type: ignore[method-assign]
        return self

    def __exit__(self, *args: Any) -> None:
        Pieces.step, pl.LightningModule.backward = self._step, self._backward  # type: ignore[method-assign]


def fit(data: DataLoader[Any], size: int | str | None) -> float:
    return timed_epoch(MLP(), data, [AccumulationScheduler(K, log=False, microbatch_size=size)])


def in_place(data: DataLoader[Any], size: int | str, rounds: int) -> dict[str, float]:
    """Microseconds of the package's own work per piece and of Lightning's backward per batch (best of rounds)."""
    own, lightning = [], []
    for _ in range(rounds):
        MLP.inside = 0.0
        with InPlace() as timer:
            fit(data, size)
        pieces = max(timer.pieces, timer.batches)  # (a batch of one piece: no backward inside `training_step`)
        own.append((timer.step - MLP.inside - timer.piece_backward) / pieces * 1e6)
        lightning.append(timer.lightning_backward / timer.batches * 1e6)
    return {"own_us_per_piece": min(own), "lightning_backward_us_per_batch": min(lightning)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--json", type=Path, default=Path(__file__).with_name("microbatches.json"))
    args = parser.parse_args()

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    n = args.batches * BATCH
    x, y = torch.randn(n, 256, generator=g), torch.randint(0, 10, (n,), generator=g)
    data = DataLoader(TensorDataset(x, y), batch_size=BATCH)
    variants: dict[str, int | str | None] = {
        "plain callback": None,
        f"microbatch_size={BATCH} (one piece)": BATCH,
        "microbatch_size='auto' (no out-of-memory: one piece)": "auto",
        f"microbatch_size={BATCH // 4} (4 pieces)": BATCH // 4,
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(args.repeats + 1):  # the first round is a warm-up
        for name, size in variants.items():
            seconds = fit(data, size)
            if repeat:
                times[name].append(seconds)
    baseline = min(times["plain callback"])
    rows = []
    print(f"{'run':<54}{'best s':>8}{'ratio':>8}{'us/sample':>11}")
    for name, values in times.items():
        row = {"run": name, "best_s": min(values), "ratio": min(values) / baseline,
               "us_per_sample": min(values) / (args.batches * BATCH) * 1e6}  # fmt: skip
        rows.append(row)
        print(f"{name:<54}{row['best_s']:>8.3f}{row['ratio']:>8.3f}{row['us_per_sample']:>11.1f}")
    rounds = max(1, min(3, args.repeats))
    whole, one, four = (in_place(data, size, rounds) for size in (BATCH, "auto", BATCH // 4))
    print(f"in place, one piece a batch: the package's own work {whole['own_us_per_piece']:.1f} us per batch")
    own, lightning = one["own_us_per_piece"], one["lightning_backward_us_per_batch"]
    print(f"in place, 'auto', one piece a batch: the package's own work {own:.1f} us per piece, "
          f"Lightning's backward of the loss value {lightning:.1f} us per batch")  # fmt: skip
    print(f"in place, 4 pieces a batch: the package's own work {four['own_us_per_piece']:.1f} us per piece")
    result = {
        "benchmark": "microbatches",
        "what": f"loop CPU time, {args.batches} batches of {BATCH}, k={K}, MLP 256-1024-1024-10, {args.repeats} "
        "rounds",
        "baseline": "AccumulationScheduler(k) without microbatch_size",
        "rows": rows,
        "target": 1.02,
        "one_piece": whole,
        "auto_one_piece": one,
        "four_pieces": four,
        "batch_us": baseline / args.batches * 1e6,
        "machine": f"{platform.machine()} torch {torch.__version__} lightning {pl.__version__}",
    }
    args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
