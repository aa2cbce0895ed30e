"""FSDP2 (Lightning's ``ModelParallelStrategy`` with ``fully_shard``) on 2 CPU processes (gloo)
against the single-process float64 reference: the callback and the mixin, with the gradient
sync skipped inside windows (``sync="auto"``/``"skip"``) and reduce-scattered every micro-batch
(``sync="every"``). Each rank counts FSDP2's gradient reduce-scatters.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist

from lightning_accum import AccumulationScheduler, GradientDecay, Piecewise

from helpers import (
    ChildLauncher,
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

pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs torch.distributed")
if not hasattr(torch.distributed.fsdp, "fully_shard"):  # torch < 2.6
    pytest.skip("FSDP2 (`fully_shard`) needs torch >= 2.6", allow_module_level=True)

from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

pytestmark = pytest.mark.slow

WORLD = 2
SCATTERS = [0]  # per process: FSDP2's gradient reduce-scatters


class ForkedModelParallel(ModelParallelStrategy):
    """Plain FSDP2 over the ranks (a 1-D data-parallel mesh). Lightning launches this strategy by
    re-running the script (which would re-run pytest); fork instead, as the DDP tests do."""

    def __init__(self) -> None:
        super().__init__(data_parallel_size=WORLD, tensor_parallel_size=1)

    def _configure_launcher(self) -> None:
        self._launcher = ChildLauncher(self, start_method="fork")


def shard(net: torch.nn.Module, mesh: Any) -> None:
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)


class ShardedTokenModel(TokenModel):
    def configure_model(self) -> None:
        shard(self.net, self.device_mesh["data_parallel"])


class ShardedManualTokenModel(ManualTokenModel):
    def configure_model(self) -> None:
        shard(self.net, self.device_mesh["data_parallel"])


class Report(pl.Callback):
    def __init__(self, out: Path, recorder: KRecorder) -> None:
        self.out, self.recorder = out, recorder

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in pl_module.parameters()]
        report = {
            "params": [p.detach().tolist() for p in params],
            "windows": self.recorder.windows,
            "scatters": SCATTERS[0],
            "steps": trainer.global_step,
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


def fit_fsdp2(
    tmp_path: Path, model: pl.LightningModule, callbacks: list[pl.Callback], monkeypatch: pytest.MonkeyPatch
) -> list[dict[str, Any]]:
    original = dist.reduce_scatter_single

    def counting(*args: Any, **kwargs: Any) -> Any:
        SCATTERS[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(dist, "reduce_scatter_single", counting)  # before the fork: the ranks inherit it
    recorder = KRecorder()
    t = trainer(
        callbacks=[*callbacks, recorder, Report(tmp_path, recorder)],
        max_epochs=2,
        devices=WORLD,
        strategy=ForkedModelParallel(),
        precision="32-true",  # the strategy refuses "64-true"; the test model is float64 all the same
        use_distributed_sampler=False,
    )
    t.fit(model, loader(TokenData(64), 4, sharded=True))
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


SCHEDULE = Piecewise({0: 3, 3: 2}, unit="step")  # mid-epoch change, short last windows
SHARDED_LAYERS = 2  # the two Linear layers; the outer Sequential has no parameters of its own


def check(reports: list[dict[str, Any]], normalize: str, sync: str, decay: Any = None) -> None:
    expected, sizes = Reference(SCHEDULE, normalize=normalize, decay=decay).run(
        [rank_batches(TokenData(64), 4, world=WORLD)] * 2
    )
    microbatches = sum(sizes)
    for report in reports:
        params = [torch.tensor(p, dtype=torch.float64) for p in report["params"]]
        assert max_diff(params, expected) <= 1e-12
        assert report["windows"] == sizes
        per_round = report["scatters"] / (len(sizes) if sync != "every" else microbatches)
        assert per_round == SHARDED_LAYERS  # one reduce-scatter per sharded layer: one round per step (or batch)


@pytest.mark.parametrize(("sync", "normalize"), [("auto", "items"), ("every", "mean")])
def test_fsdp2_callback_matches_reference(
    tmp_path: Path, sync: str, normalize: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reduction = "sum" if normalize == "items" else None
    callback = AccumulationScheduler(SCHEDULE, normalize=normalize, reduction=reduction, count=count_tokens, sync=sync)  # type: ignore[arg-type]
    model = ShardedTokenModel(reduction="sum" if normalize == "items" else "mean")
    check(fit_fsdp2(tmp_path, model, [callback], monkeypatch), normalize, sync)


@pytest.mark.parametrize(("sync", "mode"), [("skip", "backward"), ("auto", "heads"), ("every", "each")])
def test_fsdp2_mixin_matches_reference(tmp_path: Path, sync: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = ShardedManualTokenModel(mode=mode, schedule=SCHEDULE, count=count_tokens, sync=sync)
    reports = fit_fsdp2(tmp_path, model, [], monkeypatch)
    if mode == "backward":
        check(reports, "mean", sync)
    else:  # several passes per micro-batch: the last micro-batch's passes each reduce-scatter
        expected, _ = Reference(SCHEDULE).run([rank_batches(TokenData(64), 4, world=WORLD)] * 2)
        for report in reports:
            params = [torch.tensor(p, dtype=torch.float64) for p in report["params"]]
            assert max_diff(params, expected) <= 1e-12


def test_fsdp2_gradient_decay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    callbacks = [AccumulationScheduler(SCHEDULE), GradientDecay(0.8, mode="ema")]
    reports = fit_fsdp2(tmp_path, ShardedTokenModel(), callbacks, monkeypatch)
    check(reports, "mean", "auto", decay=(0.8, "ema", False))



def test_fsdp2_callback_with_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``microbatch_size=3`` of batches of 4 (pieces of 3 and 1): every piece's forward all-gathers, only the
    window's last piece reduce-scatters (one round per step), and the result is the reference's."""
    callback = AccumulationScheduler(
        SCHEDULE, normalize="items", reduction="sum", count=count_tokens, microbatch_size=3
    )
    check(fit_fsdp2(tmp_path, ShardedTokenModel(reduction="sum"), [callback], monkeypatch), "items", "auto")


@pytest.mark.parametrize("adapter", ["callback", "mixin"])
def test_grad_accum_dtype_is_refused_before_any_batch(
    tmp_path: Path, adapter: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FSDP2 holds a window's unsharded gradients itself: ``grad_accum_dtype`` is refused at the fit's start, naming
    the ``MixedPrecisionPolicy`` that does the job there (``reduce_dtype=torch.float32``)."""
    if adapter == "callback":
        model: pl.LightningModule = ShardedTokenModel()
        callbacks: list[pl.Callback] = [AccumulationScheduler(SCHEDULE, grad_accum_dtype="float32")]
    else:
        model, callbacks = ShardedManualTokenModel(schedule=SCHEDULE, grad_accum_dtype="float32"), []
    refusal = r"`grad_accum_dtype='float32'` cannot work here\. FSDP2 .*reduce_dtype=torch\.float32"
    with pytest.raises(Exception, match=refusal):  # raised in the forked ranks, re-raised here
        fit_fsdp2(tmp_path, model, callbacks, monkeypatch)
    assert not list(tmp_path.glob("rank*.json"))  # no rank reached the fit's end
