"""``AccumulationScheduler`` under DeepSpeed on 2 CPU processes (gloo): ZeRO stages 0 and
2 against the single-process float64 reference, at float32 rounding (1e-6); ranks forked from the fork server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationScheduler, Piecewise

from helpers import (
    CPUDeepSpeed,
    FileReport,
    Float32TokenModel,
    RankStrided,
    Reference,
    TokenData,
    deepspeed_config,
    loader,
    max_diff,
    rank_batches,
    trainer,
)

pytest.importorskip("deepspeed")

from test_deepspeed import BatchNormModel

pytestmark = pytest.mark.slow

SCHEDULE = Piecewise({0: 3, 3: 2}, unit="step")  # mid-epoch change, short last windows


@pytest.mark.parametrize("stage", [0, 2])
def test_deepspeed_ranks_match_reference(tmp_path: Path, stage: int) -> None:
    strategy = CPUDeepSpeed(config=deepspeed_config(stage), process_group_backend="gloo")
    accumulation = AccumulationScheduler(SCHEDULE)
    report = FileReport(tmp_path, accumulation)
    callbacks = [accumulation, report]
    t = trainer(strategy=strategy, devices=2, precision="32-true", use_distributed_sampler=False, callbacks=callbacks)
    t.fit(Float32TokenModel(optimizer="plain-sgd"), loader(TokenData(64), 4, sharded=True))
    expected, sizes = Reference(SCHEDULE, optimizer="plain-sgd").run([rank_batches(TokenData(64), 4, world=2)] * 2)
    results = report.read(world=2)
    for result in results:
        assert max_diff(result["params"], expected) < 1e-6
        assert result["engine_steps"] == result["progress"]["step"] == len(sizes)  # one engine step per window
        assert result["progress"]["samples"] == 2 * 64
    assert max_diff(results[0]["params"], results[1]["params"]) == 0.0


def test_deepspeed_ranks_keep_their_own_window_batchnorm_statistics(tmp_path: Path) -> None:
    """DeepSpeed broadcasts no buffer after its start: under ``batchnorm="window"`` each rank's BatchNorm holds
    the statistics of its own windows (each as one batch), as DDP with ``broadcast_buffers=False``."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(56, 3, generator=g) * 2 + 1, torch.randn(56, 1, generator=g)
    strategy = CPUDeepSpeed(config=deepspeed_config(2), process_group_backend="gloo")
    callbacks = [AccumulationScheduler(3, batchnorm="window")]
    options: dict[str, Any] = {"precision": "32-true", "use_distributed_sampler": False, "max_epochs": 1}
    t = trainer(strategy=strategy, devices=2, callbacks=callbacks, **options)
    t.fit(BatchNormModel(tmp_path), DataLoader(TensorDataset(x, y), batch_size=4, sampler=RankStrided(len(x))))
    for rank in range(2):
        mean, var, tracked = json.loads((tmp_path / f"bn{rank}.json").read_text())
        ref = torch.nn.BatchNorm1d(3).double()
        with torch.no_grad():
            for window in x[rank::2].double().split(12):
                ref(window)
        assert tracked == 3
        expected = [*ref.running_mean.tolist(), *ref.running_var.tolist()]
        assert max(abs(a - b) for a, b in zip(mean + var, expected, strict=True)) < 1e-6
