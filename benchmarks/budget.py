"""What a ``Budget`` costs against a fixed k closing the very same windows.

Each micro-batch carries the same number of tokens (a host int from the batch, as a collate function gives
it), so ``Budget(k * tokens * ranks, unit="items")`` closes every window after exactly ``k`` micro-batches:
both runs train the same windows, with ``normalize="items"``, and differ only in how a window's end is found.

(a) One process: the CPU time per window of ``AccumulationScheduler(Budget(...))`` against
``AccumulationScheduler(k)`` in the same process, rounds interleaved (each round times both fits, one after
the other); the figures are the median of the rounds' ratios and the ratio of the best times. On one process the
budget sends nothing: its work is host arithmetic, measured in place too (the CPU time inside
``WindowEngine.closes_after`` per micro-batch).

(b) 2 gloo ranks (DDP, forked): the collectives rank 0 issues per micro-batch in each run (every
``torch.distributed`` collective called from Python, DDP's gradient all-reduce routed through a counting
communication hook as ``comm_calls.py`` does), their difference (since issue 52: the budget's host all-reduces of
the counts read ahead, ``CHUNK`` micro-batches each, none waited for as it goes out: about ``1 / CHUNK`` per
micro-batch, one more at each epoch's start), the gradient all-reduces per optimizer step (1 in both), the wall
time rank 0 waits on reading such an all-reduce, in place (0 but where a rank runs a chunk ahead of the other), and
rank 0's CPU time per window, budget against fixed k (median of rounds; each round forks both fits).
``benchmarks/scale.py`` measures the step time on up to 16 ranks whose micro-batches take a random time.

On a shared machine the time ratios move by several per cent from run to run: read them as medians, never as
assertions. ``--json`` writes the figures (``run_all.py`` reads them).

    python benchmarks/budget.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from common import LoopTimer
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader

from lightning_accum import AccumulationScheduler, Budget
from lightning_accum._core import collectives
from lightning_accum._core.engine import WindowEngine

K, BATCH, SEQ, WIDTH = 4, 8, 16, 64  # micro-batches per window; sequences per micro-batch, tokens each, features
TOKENS = BATCH * SEQ  # each micro-batch's count
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor",
               "reduce", "gather", "scatter", "barrier", "all_to_all_single")  # fmt: skip
COUNTS: dict[str, float] = {"collectives": 0, "gradient": 0, "host_sum_s": 0.0, "host_sums": 0}  # (sums: read)
DEPTH = [0]


class TokenRegressor(pl.LightningModule):
    """Per-token regression: a two-layer MLP over each token's features; the loss summed over the tokens."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(batch["x"]), batch["y"], reduction="sum")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-4)


def data(batches: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(1)
    return [
        {
            "x": torch.randn(BATCH, SEQ, WIDTH, generator=g),
            "y": torch.randn(BATCH, SEQ, 1, generator=g),
            "tokens": TOKENS,
        }
        for _ in range(batches)
    ]


def tokens(batch: dict[str, Any]) -> int:
    return int(batch["tokens"])


def accumulation(kind: str, ranks: int) -> AccumulationScheduler:
    schedule: Any = K if kind == "fixed" else Budget(K * TOKENS * ranks, unit="items")
    return AccumulationScheduler(schedule, normalize="items", count=tokens, reduction="sum", log=False)


def trainer(callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        max_epochs=1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


# ---------------------------------------------------------------------- (a) one process
class Windows(pl.Callback):
    """Each run's window sizes, to check that both runs closed the same windows."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_window_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, window: Any) -> None:
        self.sizes.append(window.microbatches)


def one_process(batches: int, rounds: int) -> dict[str, Any]:
    loader = DataLoader(data(batches), batch_size=None)
    best = {"fixed": float("inf"), "budget": float("inf")}
    ratios, sizes = [], {}
    for round_ in range(rounds + 1):  # (round 0: warm-up, not counted)
        took = {}
        for kind in ("fixed", "budget"):
            timer, seen = LoopTimer(), Windows()
            torch.manual_seed(0)
            trainer([accumulation(kind, 1), timer, seen], accelerator="cpu", devices=1).fit(TokenRegressor(), loader)
            took[kind] = timer.seconds / len(seen.sizes)
            sizes[kind] = seen.sizes
        if round_:
            ratios.append(took["budget"] / took["fixed"])
            best = {kind: min(best[kind], took[kind]) for kind in best}
    assert sizes["fixed"] == sizes["budget"], "the two runs closed different windows"
    # in place: the budget's own host work per micro-batch (`closes_after`), one more budget fit
    spent = [0.0, 0]
    original = WindowEngine.closes_after

    def timed(self: WindowEngine, *args: Any, **kwargs: Any) -> bool:
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start
            spent[1] += 1

    WindowEngine.closes_after = timed  # type: ignore[method-assign]
    try:
        trainer([accumulation("budget", 1)], accelerator="cpu", devices=1).fit(TokenRegressor(), loader)
    finally:
        WindowEngine.closes_after = original  # type: ignore[method-assign]
    return {
        "k": K,
        "tokens_per_microbatch": TOKENS,
        "windows": len(sizes["fixed"]),
        "ms_per_window_fixed": best["fixed"] * 1e3,
        "ms_per_window_budget": best["budget"] * 1e3,
        "ratio_median": statistics.median(ratios),
        "ratio_best": best["budget"] / best["fixed"],
        "ratios": ratios,
        "closes_after_us_per_microbatch": spent[0] / max(1, spent[1]) * 1e6,
    }


# ---------------------------------------------------------------------- (b) 2 gloo ranks
def _install_counters() -> None:
    """Count every collective called from Python (the outermost: gloo builds some from others), installed before
    the fork so that the ranks inherit it."""
    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counting(*args: Any, __original: Any = original, **kwargs: Any) -> Any:
            if not DEPTH[0]:
                COUNTS["collectives"] += 1
            DEPTH[0] += 1
            try:
                return __original(*args, **kwargs)
            finally:
                DEPTH[0] -= 1

        setattr(dist, name, counting)
    result = collectives.HostSum.result

    def timed_result(self: collectives.HostSum) -> list[int]:  # (the wait, where the sum is read)
        start = time.perf_counter()
        try:
            return result(self)
        finally:
            COUNTS["host_sum_s"] += time.perf_counter() - start
            COUNTS["host_sums"] += 1

    collectives.HostSum.result = timed_result  # type: ignore[method-assign]


def _counting_ddp_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations; none here
    COUNTS["gradient"] += 1
    return default_hooks.allreduce_hook(state, bucket)  # (its `dist.all_reduce` is counted with the others)


class RankZero(pl.Callback):
    """Rank 0's counts inside the training loop (from its first batch to its end) and its loop's CPU time."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.microbatches = 0
        self.steps = 0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.model.register_comm_hook(None, _counting_ddp_hook)  # type: ignore[union-attr]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        COUNTS.update(collectives=0, gradient=0, host_sum_s=0.0, host_sums=0)
        self.start = time.process_time()

    def on_train_batch_end(self, *args: Any) -> None:
        self.microbatches += 1

    def on_window_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, window: Any) -> None:
        self.steps += 1

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        seconds = time.process_time() - self.start
        if trainer.global_rank == 0:
            report = {**COUNTS, "microbatches": self.microbatches, "steps": self.steps, "seconds": seconds}
            self.out.write_text(json.dumps(report))


def two_ranks(kind: str, batches: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        strategy = DDPStrategy(start_method="fork", process_group_backend="gloo")
        fit = trainer([accumulation(kind, 2), RankZero(out)], accelerator="cpu", devices=2, strategy=strategy,
                      use_distributed_sampler=False)  # fmt: skip
        fit.fit(TokenRegressor(), DataLoader(data(batches), batch_size=None))
        return json.loads(out.read_text())  # type: ignore[no-any-return]


def distributed(batches: int, rounds: int) -> dict[str, Any]:
    _install_counters()
    runs: dict[str, list[dict[str, Any]]] = {"fixed": [], "budget": []}
    for _ in range(max(1, rounds)):
        for kind in runs:
            runs[kind].append(two_ranks(kind, batches))
    first = {kind: reports[0] for kind, reports in runs.items()}
    assert first["fixed"]["steps"] == first["budget"]["steps"], "the two runs closed different windows"
    per_microbatch = {kind: r["collectives"] / r["microbatches"] for kind, r in first.items()}
    ratios = [b["seconds"] / b["steps"] / (f["seconds"] / f["steps"]) for f, b in zip(*runs.values(), strict=True)]
    return {
        "ranks": 2,
        "microbatches_per_rank": first["fixed"]["microbatches"],
        "steps": first["fixed"]["steps"],
        "collectives_per_microbatch_fixed": per_microbatch["fixed"],
        "collectives_per_microbatch_budget": per_microbatch["budget"],
        "added_per_microbatch": per_microbatch["budget"] - per_microbatch["fixed"],
        "gradient_per_step_fixed": first["fixed"]["gradient"] / first["fixed"]["steps"],
        "gradient_per_step_budget": first["budget"]["gradient"] / first["budget"]["steps"],
        "host_sum_us": statistics.median(r["host_sum_s"] / max(1, r["host_sums"]) for r in runs["budget"]) * 1e6,
        "cpu_ratio_median": statistics.median(ratios),
        "cpu_ratios": ratios,
        "ms_per_window_fixed": statistics.median(r["seconds"] / r["steps"] for r in runs["fixed"]) * 1e3,
        "ms_per_window_budget": statistics.median(r["seconds"] / r["steps"] for r in runs["budget"]) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=2048, help="micro-batches per fit, one process")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds, one process")
    parser.add_argument("--rank-batches", type=int, default=1024, help="micro-batches per rank, 2 ranks")
    parser.add_argument("--rank-rounds", type=int, default=5, help="rounds of the 2-rank fits")
    parser.add_argument("--json", type=Path, default=Path(__file__).with_name("budget.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {
        "one_process": one_process(args.batches, args.rounds),
        "two_ranks": distributed(args.rank_batches, args.rank_rounds),
    }
    print(json.dumps(result, indent=2))
    if str(args.json) not in ("", "."):
        args.json.write_text(json.dumps(result, indent=2))
    print(f"k = {K}, {TOKENS} tokens per micro-batch: see the JSON above", file=sys.stderr)


if __name__ == "__main__":
    main()
