"""``StepProgressBar`` on 2 gloo ranks: the totals (the epoch's and the fit's) from a schedule keyed on the samples
of both ranks are the windows the fit runs."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.strategies import DDPStrategy

from lightning_accum import AccumulationScheduler, Ramp
from lightning_accum.progress import RichStepProgressBar, StepProgressBar

from helpers import TokenData, TokenModel, loader, trainer

pytestmark = pytest.mark.slow


class Report(pl.Callback):
    """Rank 0's bar (the one drawn): its total at each epoch's start and its counter and total at the end, and the
    fit's steps (done, total), beside the windows the fit announced."""

    def __init__(self, bar: Any, out: Path) -> None:
        self.bar, self.out, self.epochs = bar, out, []  # type: ignore[var-annotated]

    def drawn(self) -> list[Any]:
        """[counter, total, fit's done, fit's total] as rank 0 draws them (TQDM's postfix, Rich's overall bar)."""
        if isinstance(self.bar, StepProgressBar):
            tq = self.bar.train_progress_bar
            done, total = tq.postfix.split(",")[0].removeprefix("step=").split("/")
            return [tq.n, tq.total, int(done), int(total)]
        task, fit = self.bar.train_progress_bar, self.bar.fit_progress_bar
        return [task.completed, task.total, fit.completed, fit.total]

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if trainer.is_global_zero:
            total = self.bar.train_progress_bar.total
            self.epochs.append({"first": total, "steps": 0})

    def on_window_end(self, trainer: pl.Trainer, pl_module: Any, window: Any) -> None:
        if trainer.is_global_zero:
            self.epochs[-1]["steps"] += 1

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if trainer.is_global_zero:
            self.epochs[-1]["last"] = self.drawn()
            (self.out / "rank0.json").write_text(json.dumps(self.epochs))


@pytest.mark.parametrize("kind", ["tqdm", "rich"])
def test_two_ranks(tmp_path: Path, kind: str) -> None:
    strategy = DDPStrategy(start_method="fork", process_group_backend="gloo")
    bar: Any = StepProgressBar() if kind == "tqdm" else RichStepProgressBar(console_kwargs={"file": io.StringIO()})
    callbacks = [AccumulationScheduler(Ramp(1, 4, over=100, unit="samples")), bar, Report(bar, tmp_path)]
    t = trainer(
        callbacks=callbacks, max_epochs=2, devices=2, strategy=strategy, enable_progress_bar=True,
        use_distributed_sampler=False,
    )  # fmt: skip
    t.fit(TokenModel(), loader(TokenData(62), 4, sharded=True))  # 31 samples per rank: the last batch holds 3
    epochs = json.loads((tmp_path / "rank0.json").read_text())
    steps = [e["steps"] for e in epochs]
    # 8 samples a batch over both ranks (6 in the last): k = 1 for the batches at 0..32 samples, 2 from 40 (two
    # windows, the second cut by the epoch's end), then 2, 3, 3 from 62 samples on
    assert steps == [7, 3]
    assert [e["first"] for e in epochs] == steps
    # the epoch's counter and total, and the fit's steps: its total walked at the start with both ranks' samples
    assert [e["last"] for e in epochs] == [[7, 7, 7, 10], [3, 3, 10, 10]]


# ---------------------------------------------------------------------- the postfix on 2 ranks, under a budget
class Postfix(pl.Callback):
    """Rank 0's bar after each window (listed after the bar, so that it has counted the window): the numbers of its
    postfix, the postfix drawn, the epoch's counter and total; each epoch's counter and total at its end."""

    def __init__(self, bar: StepProgressBar, out: Path) -> None:
        self.bar, self.out = bar, out
        self.windows: list[dict[str, Any]] = []
        self.epochs: list[list[float]] = []

    def on_window_end(self, trainer: pl.Trainer, pl_module: Any, window: Any) -> None:
        if trainer.is_global_zero:
            shown = {key: self.bar.get_metrics(trainer, pl_module)[key] for key in ("k", "batch", "tokens", "loss")}
            tq = self.bar.train_progress_bar
            self.windows.append({**shown, "drawn": str(tq.postfix), "n": tq.n, "total": tq.total})

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if trainer.is_global_zero:
            self.epochs.append([self.bar.train_progress_bar.n, self.bar.train_progress_bar.total])
            report = {"windows": self.windows, "epochs": self.epochs}
            (self.out / "rank0.json").write_text(json.dumps(report))


@pytest.mark.parametrize("adapter", ["callback", "mixin"])
def test_the_postfix_on_two_ranks_under_a_budget_is_the_windows_over_both(tmp_path: Path, adapter: str) -> None:
    """Rank 0's bar under `Budget(50, unit="items")` on 2 ranks whose micro-batches hold different token counts:
    each window's `k` (the micro-batches each rank took), `batch` and `tokens` (over both ranks) and `loss` (the
    window's over both ranks, normalised as its gradient) are the float64 reference's windows over both ranks' batches
    (`test_budget.reference`); the epoch's counter never passes its total and meets it at the epoch's end."""
    from test_budget import reference

    from lightning_accum import Budget

    from helpers import ManualTokenModel, count_tokens, rank_batches

    bar = StepProgressBar()
    budget = Budget(50, unit="items")
    if adapter == "callback":
        model: pl.LightningModule = TokenModel(reduction="sum")
        own = [AccumulationScheduler(budget, normalize="items", count=count_tokens, reduction="sum")]
    else:
        model, own = ManualTokenModel(reduction="sum", schedule=budget, normalize="items", count=count_tokens), []
    strategy = DDPStrategy(start_method="fork", process_group_backend="gloo")
    t = trainer(
        callbacks=[*own, bar, Postfix(bar, tmp_path)], max_epochs=2, devices=2, strategy=strategy,
        enable_progress_bar=True, use_distributed_sampler=False,
    )  # fmt: skip
    t.fit(model, loader(TokenData(64), 4, sharded=True))
    seen = json.loads((tmp_path / "rank0.json").read_text())
    ranks = rank_batches(TokenData(64), 4, world=2)
    _, sizes, losses = reference([ranks] * 2, lambda p: 50)
    expected, start = [], 0
    for m in sizes:  # (each epoch's batches from its first: the windows of an epoch end at its end)
        window = [b for r in ranks for b in r[start : start + m]]
        expected.append({"k": m, "batch": sum(len(b["x"]) for b in window),
                         "tokens": sum(int(b["mask"].sum()) for b in window)})  # fmt: skip
        start = (start + m) % len(ranks[0])
    assert len(set(sizes)) > 1 and len(seen["windows"]) == len(sizes)
    for got, want, loss in zip(seen["windows"], expected, losses, strict=True):
        assert {key: int(got[key]) for key in ("k", "batch", "tokens")} == want  # (the counts as tqdm draws them: text)
        assert abs(got["loss"] - loss) <= 1e-12
        assert f"k={want['k']}, batch={want['batch']}, tokens={want['tokens']}" in got["drawn"]
        assert got["n"] <= got["total"]
    assert all(n == total for n, total in seen["epochs"])  # (met at each epoch's end)
    assert sum(n for n, _ in seen["epochs"]) == len(sizes)
