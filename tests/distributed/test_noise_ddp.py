"""The noise probe on 2 gloo ranks: each rank fits its own prefixes (local gradients until the
window's last micro-batch, whose gradient is the window's over both ranks); the fits are averaged
in one all-reduce per window, and no collective runs per micro-batch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from test_noise import ManualRegressor, Regressor, probed, regression, weighted_fit
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationScheduler, NoiseScale, NoiseScaleEstimator

from helpers import KRecorder, RankStrided, trainer

pytestmark = pytest.mark.slow

WORLD, B, N = 2, 4, 1600
CALLS = {"all_reduce": 0}
_all_reduce = torch.distributed.all_reduce


def counting_all_reduce(*args: Any, **kwargs: Any) -> Any:
    CALLS["all_reduce"] += 1
    return _all_reduce(*args, **kwargs)


class Report(pl.Callback):
    def __init__(self, out: Path, recorder: KRecorder, schedule: NoiseScale) -> None:
        self.out, self.recorder, self.schedule = out, recorder, schedule
        self.per_step: list[int] = []

    def on_train_batch_start(self, *args: Any) -> None:
        CALLS["all_reduce"] = 0

    def on_train_batch_end(self, *args: Any) -> None:
        self.per_step.append(CALLS["all_reduce"])  # collectives run during this batch

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        est = self.schedule.estimator
        report = {"grad_sq": est.grad_sq, "trace": est.trace, "updates": est.updates}
        report.update(windows=self.recorder.windows, per_batch=self.per_step)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


def reference(
    x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, windows: list[int], beta: float
) -> NoiseScaleEstimator:
    """Per rank: its own prefix means (after micro-batches 1, 4, ...), then the window's mean over both ranks; the
    ranks' fits averaged, weighted by the window's micro-batches over both ranks."""
    est = NoiseScaleEstimator(beta=beta)
    per_sample = x * (x @ w - y)[:, None]
    ranks = [per_sample[r::WORLD].view(-1, B, per_sample.shape[1]).mean(1) for r in range(WORLD)]
    i = 0
    for k in windows:
        if k > 1:
            whole = torch.cat([g[i : i + k] for g in ranks]).mean(0).square().sum().item()
            fits = []
            for g in ranks:
                prefixes = g[i : i + k - 1].cumsum(0) / torch.arange(1, k, dtype=torch.float64)[:, None]
                local = probed(k)[:-1]
                norms = [*prefixes.square().sum(1)[[j - 1 for j in local]].tolist(), whole]
                fits.append(weighted_fit([float(B * j) for j in local] + [float(WORLD * k * B)], norms))
            est.add(*(sum(f[c] for f in fits) / WORLD for c in range(2)), weight=WORLD * k)
        i += k
    return est


@pytest.mark.parametrize("manual", [False, True])
def test_each_rank_fits_its_prefixes_and_the_window_reduces_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, manual: bool
) -> None:
    monkeypatch.setattr(torch.distributed, "all_reduce", counting_all_reduce)
    x, y, w = regression(N, seed=5)
    schedule = NoiseScale(2, 20, every=3, warmup=3, beta=0.9)
    recorder = KRecorder()
    callbacks: list[Any] = [recorder, Report(tmp_path, recorder, schedule)]
    if manual:
        model: Regressor = ManualRegressor(w, schedule)
    else:
        model = Regressor(w)
        callbacks.insert(0, AccumulationScheduler(schedule, log=False))
    strategy = DDPStrategy(start_method="fork", process_group_backend="gloo")
    t = trainer(callbacks=callbacks, max_epochs=1, devices=WORLD, strategy=strategy, use_distributed_sampler=False)
    t.fit(model, DataLoader(TensorDataset(x, y), batch_size=B, sampler=RankStrided(N)))
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert reports[0] == reports[1]  # the same statistics and k on both ranks
    windows = reports[0]["windows"]
    assert len(set(windows)) > 2 and max(windows) > 4 and sum(windows) == N // WORLD // B  # (prefix 4 measured)
    expected = reference(x, y, w, windows, beta=0.9)
    assert reports[0]["updates"] == expected.updates
    assert reports[0]["grad_sq"] == pytest.approx(expected.grad_sq, rel=1e-10)
    assert reports[0]["trace"] == pytest.approx(expected.trace, rel=1e-10)
    # collectives per batch: none inside a window; at its end the counts, the probe (k >= 2) and, in
    # the mixin, its explicit gradient all-reduce (DDP's own runs in its reducer, uncounted here)
    ends = [sum(windows[: j + 1]) - 1 for j in range(len(windows))]
    per_batch = reports[0]["per_batch"]
    inside = [n for b, n in enumerate(per_batch) if b not in ends]
    print("collectives per window-end batch:", sorted({per_batch[e] for e in ends}), "inside:", set(inside))
    assert set(inside) <= {0}
    assert all(per_batch[e] == 1 + (k > 1) + int(manual) for e, k in zip(ends, windows, strict=True))
