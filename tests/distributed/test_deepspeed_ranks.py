"""``AccumulationScheduler`` under DeepSpeed on 2 CPU processes (gloo): ZeRO stages 0 and
2 against the single-process float64 reference, at float32 rounding (1e-6); ranks forked from the fork server."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_accum import AccumulationScheduler, Piecewise

from helpers import (
    CPUDeepSpeed,
    FileReport,
    Float32TokenModel,
    Reference,
    TokenData,
    deepspeed_config,
    loader,
    max_diff,
    rank_batches,
    trainer,
)

pytest.importorskip("deepspeed")


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
