"""``AccumulationScheduler(microbatch_size=...)`` under DDP: 2 CPU processes (gloo) against the
single-process float64 reference. Every backward runs without DDP's sync (its reducer never
all-reduces: counted with a DDP communication hook) and the window's gradient is all-reduced once
per optimizer step by the package (counted); the ranks may cut their batches into different pieces,
"auto" backing off on one rank only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from test_ddp import WORLD, counting_explicit, fit_ddp

from lightning_accum import AccumulationScheduler, Piecewise
from lightning_accum._core import collectives

from helpers import Reference, TokenData, TokenModel, count_tokens, max_diff, rank_batches

pytestmark = pytest.mark.slow

SCHEDULE = Piecewise({0: 3, 3: 2}, unit="step")  # mid-epoch change, short last windows


class RankPieces(TokenModel):
    """Runs out of memory (injected) in a piece of more than ``fits[rank]`` samples: in its forward, or
    inside its backward (after the last layer's gradient is in)."""

    def __init__(self, fits: tuple[int, int] | None = None, where: str = "forward", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fits, self.where = fits, where

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        over = self.fits is not None and len(batch["x"]) > self.fits[self.global_rank]
        if over and self.where == "forward":
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        hidden = self.net[0](batch["x"])
        if over:
            hidden.register_hook(lambda grad: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory")))
        err = (self.net[2](self.net[1](hidden)) - batch["y"]).squeeze(-1) ** 2
        total, tokens = (err * batch["mask"]).sum(), batch["mask"].sum()
        return total if self.reduction == "sum" else total / tokens


class Sizes(pl.Callback):
    """Each rank's size left by out-of-memory errors, and what it reported."""

    def __init__(self, out: Path, accumulation: AccumulationScheduler) -> None:
        self.out, self.accumulation = out, accumulation

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        split = self.accumulation._split
        assert split is not None
        report = {"found": split.found, "reported": float(trainer.callback_metrics["accum/microbatch_size"])}
        (self.out / f"sizes{trainer.global_rank}.json").write_text(json.dumps(report))


@pytest.mark.parametrize(
    ("size", "normalize", "fits", "where"),
    [
        (3, "mean", None, "forward"),  # pieces 3 + 1 of batches of 4, sample-weighted
        (4, "mean", None, "forward"),  # one piece a batch: Lightning's own backward, DDP's sync still off
        (3, "items", None, "forward"),  # token-weighted, different token counts per rank
        ("auto", "items", (1, 2), "forward"),  # each rank backs off to its own size: 1 and 2
        ("auto", "mean", (2, 4), "backward"),  # only rank 0 runs out of memory, inside a backward
    ],
)
def test_ddp_pieces_match_the_reference(
    tmp_path: Path, size: Any, normalize: str, fits: tuple[int, int] | None, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(collectives, "_all_reduce_sum", counting_explicit)  # before the fork: the ranks inherit it
    accumulation = AccumulationScheduler(
        SCHEDULE, normalize=normalize, count=count_tokens, reduction="sum" if normalize == "items" else None,  # type: ignore[arg-type]
        microbatch_size=size,
    )  # fmt: skip
    model = RankPieces(fits, where, reduction="sum" if normalize == "items" else "mean")
    data = TokenData(64, ragged=normalize == "items")
    reports = fit_ddp(tmp_path, model, [accumulation, Sizes(tmp_path, accumulation)], data=data)
    expected, sizes = Reference(SCHEDULE, normalize=normalize).run([rank_batches(data, 4, world=WORLD)] * 2)
    for rank, report in enumerate(reports):
        params = [torch.tensor(p, dtype=torch.float64) for p in report["params"]]
        assert max_diff(params, expected) <= 1e-12
        assert report["windows"] == sizes  # one backward per loader batch, as other callbacks see it
        assert report["allreduces"] == 0  # DDP's reducer never synced
        assert report["explicit"] == report["steps"] == len(sizes)  # one gradient all-reduce per step
        assert report["progress"]["samples"] == 128
        found = json.loads((tmp_path / f"sizes{rank}.json").read_text())
        if fits is not None:
            assert found["found"] == (fits[rank] if fits[rank] < 4 else None)
            assert found["reported"] == min(fits[rank], 4)
        else:
            assert found["reported"] == size
    assert reports[0]["progress"] == reports[1]["progress"]


class Float32RankPieces(RankPieces):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.net.float()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step({k: v.float() for k, v in batch.items()}, batch_idx)


def test_ddp_pieces_under_bf16_mixed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 autocast in every piece's forward on 2 ranks, rank 0 backing off inside a backward: within bf16
    rounding of the float64 reference, one gradient all-reduce per step."""
    monkeypatch.setattr(collectives, "_all_reduce_sum", counting_explicit)
    accumulation = AccumulationScheduler(SCHEDULE, normalize="items", count=count_tokens, reduction="mean",
                                         microbatch_size="auto")  # fmt: skip
    model = Float32RankPieces((2, 4), "backward", reduction="mean")
    data = TokenData(64)
    reports = fit_ddp(tmp_path, model, [accumulation], data=data, precision="bf16-mixed")
    expected, _ = Reference(SCHEDULE, normalize="items").run([rank_batches(data, 4, world=WORLD)] * 2)
    moved = max_diff([p.detach() for p in TokenModel().parameters()], expected)
    for report in reports:
        params = [torch.tensor(p, dtype=torch.float64) for p in report["params"]]
        assert max_diff(params, expected) < 2e-3 < 0.1 * moved
        assert report["explicit"] == report["steps"] and report["allreduces"] == 0


class InfOnRankZero(Float32RankPieces):
    """Rank 0's loss is infinite in the second piece of batch 4 (epoch 0): the GradScaler must skip the
    window's step on both ranks."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        here = (self.current_epoch, batch_idx, self.global_rank, len(batch["x"]))
        return loss * float("inf") if here == (0, 4, 0, 1) else loss


def test_ddp_pieces_under_16_mixed_skip_together(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """16-mixed with a GradScaler (on CPU): the window's gradient is all-reduced before the scaler unscales
    it, so an inf in one rank's piece makes every rank skip that step (and halve its scale) alike."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    monkeypatch.setattr(collectives, "_all_reduce_sum", counting_explicit)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    accumulation = AccumulationScheduler(SCHEDULE, normalize="items", count=count_tokens, reduction="mean",
                                         microbatch_size=3)  # fmt: skip
    data = TokenData(64)

    class Scale(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            (tmp_path / f"scale{trainer.global_rank}").write_text(str(scaler.get_scale()))

    plugin = MixedPrecision("16-mixed", "cpu", scaler)
    reports = fit_ddp(tmp_path, InfOnRankZero(reduction="mean"), [accumulation, Scale()], data=data, precision=None,
                      plugins=[plugin])  # fmt: skip
    expected, _ = Reference(SCHEDULE, normalize="items", skipped=(1,)).run([rank_batches(data, 4, world=WORLD)] * 2)
    not_skipped, _ = Reference(SCHEDULE, normalize="items").run([rank_batches(data, 4, world=WORLD)] * 2)
    for rank, report in enumerate(reports):
        params = [torch.tensor(p, dtype=torch.float64) for p in report["params"]]
        error = max_diff(params, expected)
        assert error < 1e-2 and error < 0.25 * max_diff(not_skipped, expected)
        assert float((tmp_path / f"scale{rank}").read_text()) == 2.0**7  # the one skip, on both ranks
    assert reports[0]["params"] == reports[1]["params"]
