"""AccumulationScheduler and AccumulationMixin under DDP: 2 CPU processes (gloo) against the
single-process reference.

Each run counts the gradient all-reduces with a DDP communication hook and writes, per rank,
the final parameters, the window sizes and the hook count to a JSON file.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_accum import AccumulationScheduler, GradientDecay, NoiseScale, Piecewise, Ramp, Schedule
from lightning_accum._core import collectives

from helpers import (
    KRecorder,
    ManualTokenModel,
    Reference,
    TokenData,
    TokenModel,
    count_tokens,
    loader,
    max_diff,
    rank_batches,
    trainer,
)

pytestmark = pytest.mark.slow

WORLD = 2
ALLREDUCES = [0]  # per process: DDP's own gradient all-reduces (comm hook calls)
EXPLICIT = [0]  # per process: the mixin's explicit gradient all-reduces


def counting_allreduce(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations; none here
    ALLREDUCES[0] += 1
    return default_hooks.allreduce_hook(state, bucket)


class Report(pl.Callback):
    def __init__(self, out: Path, recorder: KRecorder) -> None:
        self.out, self.recorder = out, recorder

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning registers `ddp_comm_hook` on CUDA only; on CPU (gloo) register it here
        trainer.strategy.model.register_comm_hook(None, counting_allreduce)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        accum = next((cb for cb in trainer.callbacks if isinstance(cb, AccumulationScheduler)), None)
        progress = pl_module.accumulation_progress if accum is None else accum.progress  # type: ignore[attr-defined]
        report = {
            "params": [p.detach().tolist() for p in pl_module.parameters()],
            "windows": self.recorder.windows,
            "allreduces": ALLREDUCES[0],
            "explicit": EXPLICIT[0],
            "progress": progress.__dict__,
            "steps": trainer.global_step,
            "auto_size": getattr(getattr(getattr(pl_module, "_accumulation", None), "auto", None), "size", None),
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


def fit_ddp(
    tmp_path: Path,
    model: pl.LightningModule,
    callbacks: Sequence[pl.Callback] = (),
    epochs: int = 2,
    batch_size: int = 4,
    data: TokenData | None = None,
    precision: str | None = "64-true",
    plugins: Sequence[Any] = (),
    **strategy_kwargs: Any,
) -> list[dict[str, Any]]:
    """Fit on 2 forked gloo ranks, each taking every other sample of ``data`` (TokenData(64)); the ranks' reports."""
    recorder = KRecorder()
    strategy = DDPStrategy(start_method="fork", process_group_backend="gloo", **strategy_kwargs)
    t = trainer(
        callbacks=[*callbacks, recorder, Report(tmp_path, recorder)],
        max_epochs=epochs,
        devices=WORLD,
        strategy=strategy,
        use_distributed_sampler=False,
        precision=precision,
        plugins=list(plugins),
    )
    t.fit(model, loader(TokenData(64) if data is None else data, batch_size, sharded=True))
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


def run_ddp(
    tmp_path: Path,
    schedule: Schedule,
    normalize: str,
    epochs: int = 2,
    decay: GradientDecay | None = None,
    reduction: str = "sum",
) -> list[dict[str, Any]]:
    """``reduction="mean"``: ``training_step`` returns token means, which the callback weights."""
    accumulation = AccumulationScheduler(
        schedule, normalize=normalize, count=count_tokens, reduction=reduction if normalize == "items" else None
    )
    callbacks = [accumulation, *([decay] if decay else [])]
    model = TokenModel(reduction="sum" if (normalize, reduction) == ("items", "sum") else "mean")
    return fit_ddp(tmp_path, model, callbacks, epochs=epochs)


@pytest.mark.parametrize(
    ("schedule", "normalize", "reduction"),
    [
        (Piecewise({0: 3, 3: 2}, unit="step"), "mean", "sum"),  # mid-epoch change, short last windows
        (Ramp(1, 4, over=600, unit="items"), "items", "sum"),  # token-weighted, different token counts per rank
        (Ramp(1, 4, over=600, unit="items"), "items", "mean"),  # the same from token means
    ],
)
def test_ddp_matches_single_process_reference(
    tmp_path: Path, schedule: Schedule, normalize: str, reduction: str
) -> None:
    reports = run_ddp(tmp_path, schedule, normalize, reduction=reduction)
    data = TokenData(64)
    expected, sizes = Reference(schedule, normalize=normalize).run([rank_batches(data, 4, world=WORLD)] * 2)
    for report in reports:
        params = [torch.tensor(p, dtype=torch.float64) for p in report["params"]]
        assert max_diff(params, expected) <= 1e-12
        assert report["windows"] == sizes
        # one gradient all-reduce (one bucket for this small model) per optimizer step
        assert report["allreduces"] == report["steps"] == len(sizes)
        assert report["progress"]["samples"] == 2 * len(data)  # summed over ranks
    assert reports[0]["progress"] == reports[1]["progress"]
    if normalize == "items":
        per_rank = [sum(int(b["mask"].sum()) for b in rank) for rank in rank_batches(data, 4, world=WORLD)]
        assert per_rank[0] != per_rank[1]  # the ranks really differ in token count
        assert reports[0]["progress"]["items"] == 2 * sum(per_rank)


def test_ddp_gradient_decay_keeps_ranks_identical(tmp_path: Path) -> None:
    """The residual is the all-reduced gradient: identical on every rank, equal to the reference."""
    schedule = Piecewise({0: 3, 3: 2}, unit="step")
    reports = run_ddp(tmp_path, schedule, "mean", decay=GradientDecay(0.8, mode="ema"))
    reference = Reference(schedule, decay=(0.8, "ema", False))
    expected, _ = reference.run([rank_batches(TokenData(64), 4, world=WORLD)] * 2)
    for report in reports:
        params = [torch.tensor(p, dtype=torch.float64) for p in report["params"]]
        assert max_diff(params, expected) <= 1e-12
    assert reports[0]["params"] == reports[1]["params"]


def counting_explicit(flat: torch.Tensor, original: Any = collectives._all_reduce_sum) -> None:
    EXPLICIT[0] += 1
    original(flat)


def run_ddp_mixin(
    tmp_path: Path,
    schedule: Schedule,
    normalize: str,
    mode: str,
    monkeypatch: pytest.MonkeyPatch,
    reduction: str | None = None,
) -> list[dict[str, Any]]:
    """``reduction``: what the loss is over a micro-batch's tokens (and the mixin's, with ``"items"``)."""
    monkeypatch.setattr(collectives, "_all_reduce_sum", counting_explicit)  # before the fork: the ranks inherit it
    reduction = reduction or ("sum" if normalize == "items" else "mean")
    model = ManualTokenModel(mode=mode, reduction=reduction, schedule=schedule, normalize=normalize, count=count_tokens)
    return fit_ddp(tmp_path, model, find_unused_parameters=False)


@pytest.mark.parametrize(
    ("mode", "normalize", "reduction"),
    [
        ("backward", "mean", None),  # one pass per micro-batch
        ("each", "items", None),  # two passes, overlapping parameters
        ("heads", "mean", None),  # head passes reach the last layer only, then the trunk pass
        ("heads", "items", "mean"),  # token means weighted by count(batch), the ranks' token counts differing
    ],
)
def test_ddp_mixin_one_allreduce_per_step(
    tmp_path: Path, mode: str, normalize: str, reduction: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    schedule = Piecewise({0: 3, 3: 2}, unit="step")
    reports = run_ddp_mixin(tmp_path, schedule, normalize, mode, monkeypatch, reduction)
    expected, sizes = Reference(schedule, normalize=normalize).run([rank_batches(TokenData(64), 4, world=WORLD)] * 2)
    for report in reports:
        params = [torch.tensor(p, dtype=torch.float64) for p in report["params"]]
        assert max_diff(params, expected) <= 1e-12
        assert report["allreduces"] == 0  # DDP's reducer never synced: every pass ran under no_sync
        assert report["explicit"] == report["steps"] == len(sizes)  # one gradient all-reduce per step
    assert reports[0]["progress"] == reports[1]["progress"]


def test_ddp_backward_each_disjoint_tasks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two tasks with disjoint parameters, one window: each pass leaves the other task's
    parameters untouched, which DDP's reducer (find_unused_parameters=False) cannot sync."""
    from test_mixin import TwoNets, reference_net

    monkeypatch.setattr(collectives, "_all_reduce_sum", counting_explicit)
    schedule = Piecewise({0: 3, 3: 2}, unit="step")
    reports = fit_ddp(tmp_path, TwoNets(shared=True, schedule=schedule), find_unused_parameters=False)
    epochs = [rank_batches(TokenData(64), 4, world=WORLD)] * 2
    expected = reference_net(1, schedule, epochs, lr=0.1) + reference_net(2, schedule, epochs, lr=0.05)
    for report in reports:
        params = [torch.tensor(p, dtype=torch.float64) for p in report["params"]]
        assert max_diff(params, expected) <= 1e-12
        assert report["allreduces"] == 0
        assert report["explicit"] == report["steps"] // 2  # two optimizers step per window, one all-reduce


def test_ddp_noise_scale_k_identical_on_every_rank(tmp_path: Path) -> None:
    """k from all-reduced statistics: every rank opens the same windows."""
    schedule = NoiseScale(2, 6, every=1, warmup=2, hysteresis=0.0, beta=0.5)
    reports = run_ddp(tmp_path, schedule, "mean", epochs=3)
    assert reports[0]["windows"] == reports[1]["windows"]
    assert len(set(reports[0]["windows"])) > 1  # k really adapted
    assert reports[0]["params"] == reports[1]["params"]


def test_ddp_oom_back_off_agrees_on_the_size(tmp_path: Path) -> None:
    """Only rank 0 runs out of memory; after the window both ranks use its smaller size."""
    from test_microbatch import OOM_ERRORS, Splitting

    class RankZeroIsSmall(Splitting):
        def loss_fn(self, part: Any) -> torch.Tensor:
            if self.global_rank == 0 and len(part["x"]) > 2:
                raise OOM_ERRORS[0]("CUDA out of memory (injected)")
            return super().loss_fn(part)

    schedule = Piecewise({0: 3, 3: 2}, unit="step")
    model = RankZeroIsSmall("auto", reduction="sum", schedule=schedule, normalize="items", count=count_tokens)
    reports = fit_ddp(tmp_path, model, batch_size=8)
    expected, _ = Reference(schedule, normalize="items").run([rank_batches(TokenData(64), 8, world=WORLD)] * 2)
    for report in reports:
        assert report["auto_size"] == 2
        params = [torch.tensor(p, dtype=torch.float64) for p in report["params"]]
        assert max_diff(params, expected) <= 1e-12
