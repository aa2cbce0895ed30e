"""FSDP (``FSDPStrategy``), FSDP2 (``ModelParallelStrategy`` + ``fully_shard``) and DeepSpeed on
one GPU: world size 1 still runs FSDP's wrappers, its no-sync switches and its collectives.

The callback and the mixin are checked against the float64 reference at float32 rounding
(1e-5: a float32 model with well-scaled gradients over two epochs stays near 1e-6), with the
gradient collectives FSDP issues counted per optimizer step; DeepSpeed (ZeRO 1 and 2) against
the same reference. Skipped without CUDA; run with ``bash tests/gpu/run.sh``.
"""

from __future__ import annotations

import traceback
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist

from lightning_accum import AccumulationScheduler, GradientDecay, Piecewise

from helpers import (
    Float32ManualTokenModel,
    Float32TokenModel,
    KRecorder,
    Reference,
    TokenData,
    deepspeed_config,
    loader,
    max_diff,
    rank_batches,
    trainer,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SCHEDULE = Piecewise({0: 3, 4: 2}, unit="step")
DATA = TokenData(50)  # 13 batches of 4: short last windows
ONE_RANK = {"use_distributed_sampler": False}  # Lightning's sampler would shuffle; the reference takes batches in order
COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base")


class Collectives(pl.Callback):
    """Names of the collectives called during backward passes (Lightning's own, e.g. for its
    loop decisions, happen outside them); FSDP looks its collectives up on `torch.distributed`.
    First in ``callbacks``: its ``on_after_backward`` runs before the accumulation callback's, whose
    window-end count and loss reductions are not the gradient's."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.in_backward = False
        self.stack = ""  # where the first was called from

    def on_before_backward(self, *args: Any) -> None:
        self.in_backward = True

    def on_after_backward(self, *args: Any) -> None:
        self.in_backward = False


@pytest.fixture
def collectives(monkeypatch: pytest.MonkeyPatch) -> Collectives:
    counter = Collectives()
    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counting(*args: Any, __name: str = name, __original: Any = original, **kwargs: Any) -> Any:
            if counter.in_backward:
                counter.calls.append(__name)
                counter.stack = counter.stack or "".join(traceback.format_stack(limit=14))
            return __original(*args, **kwargs)

        monkeypatch.setattr(dist, name, counting)
    return counter


def full_params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().double().cpu() for p in model.net.parameters()
    ]


def check(model: torch.nn.Module, recorder: KRecorder | None = None, decay: Any = None) -> list[int]:
    expected, sizes = Reference(SCHEDULE, decay=decay).run([rank_batches(DATA, 4)] * 2)
    assert max_diff(full_params(model), expected) < 1e-5
    if recorder is not None:
        assert recorder.windows == sizes
    return sizes


def per_step(collectives: Collectives, steps: int, microbatches: int, skip: bool) -> None:
    """With sync skipped, the gradient collectives come in one round per optimizer step; with it
    on, in one round per micro-batch (world size 1 may issue none at all: then nothing to count)."""
    calls = collectives.calls
    print(f"{len(calls)} gradient collectives in backward, {steps} steps, {microbatches} micro-batches: {set(calls)}")
    if not calls:
        return
    rounds = steps if skip else microbatches
    assert len(calls) % rounds == 0, (len(calls), rounds, collectives.stack)


# ---------------------------------------------------------------------- trainers and models
def fsdp_trainer(auto_wrap_policy: Any = None, **kwargs: Any) -> Any:
    from lightning.pytorch.strategies import FSDPStrategy

    strategy = FSDPStrategy(auto_wrap_policy=auto_wrap_policy)
    return trainer(accelerator="gpu", devices=1, strategy=strategy, precision="32-true", **ONE_RANK, **kwargs)


def fsdp2_trainer(**kwargs: Any) -> Any:
    if not hasattr(pytest.importorskip("torch.distributed.fsdp"), "fully_shard"):
        pytest.skip("FSDP2 (`fully_shard`) needs torch >= 2.6")
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    return trainer(accelerator="gpu", devices=1, strategy=strategy, precision="32-true", **ONE_RANK, **kwargs)


class Sharded(Float32TokenModel):
    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])
        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])


class ShardedManual(Float32ManualTokenModel):
    configure_model = Sharded.configure_model


# ---------------------------------------------------------------------- the callback
@pytest.mark.parametrize(
    ("family", "sync", "skipped"),
    [("fsdp", "auto", True), ("fsdp", "skip", True), ("fsdp2", "auto", True), ("fsdp2", "every", False)],
)
def test_callback(family: str, sync: str, skipped: bool, collectives: Collectives) -> None:
    model, recorder = (Float32TokenModel() if family == "fsdp" else Sharded()), KRecorder()
    callbacks = [collectives, AccumulationScheduler(SCHEDULE, sync=sync), recorder]  # type: ignore[arg-type]
    (fsdp_trainer if family == "fsdp" else fsdp2_trainer)(callbacks=callbacks).fit(model, loader(DATA, 4))
    sizes = check(model, recorder)
    per_step(collectives, len(sizes), sum(sizes), skip=skipped)


def test_callback_refuses_every_under_fsdp() -> None:
    """Lightning's own loop enters the FSDP root's ``no_sync()`` on the batches it accumulates: a
    reduce-scatter per micro-batch cannot be kept, and is refused before training."""
    model = Float32TokenModel()
    with pytest.raises(ValueError, match="sync='every'\\)` cannot hold under `FSDPStrategy`"):
        fsdp_trainer(callbacks=[AccumulationScheduler(SCHEDULE, sync="every")]).fit(model, loader(DATA, 4))
    expected, _ = Reference(SCHEDULE).run([])
    assert max_diff(full_params(model), expected) < 1e-6


@pytest.mark.parametrize("sync", ["auto", "skip"])
def test_fsdp_gradient_decay(sync: str) -> None:
    """The residual is moved off the (orig-param views of the) flat gradient after each step."""
    model = Float32TokenModel()
    callbacks = [AccumulationScheduler(SCHEDULE, sync=sync), GradientDecay(0.8, mode="ema")]  # type: ignore[arg-type]
    fsdp_trainer(callbacks=callbacks).fit(model, loader(DATA, 4))
    check(model, decay=(0.8, "ema", False))


# ---------------------------------------------------------------------- the mixin
def test_fsdp_mixin(collectives: Collectives) -> None:
    """Every module with parameters wrapped: the root holds none, so backward passes inside its forward
    (where Lightning runs ``training_step``) are FSDP's children's."""
    model = Float32ManualTokenModel(schedule=SCHEDULE)
    fsdp_trainer(callbacks=[collectives], auto_wrap_policy={torch.nn.Linear}).fit(model, loader(DATA, 4))
    sizes = check(model)
    per_step(collectives, len(sizes), sum(sizes), skip=False)


def test_fsdp_mixin_refuses_a_root_with_parameters() -> None:
    """Lightning issue #19685: a backward pass inside the FSDP root's forward fails on the root's own
    parameters (FSDP's assertion ``Expects BACKWARD_PRE or BACKWARD_POST state``); refused before training."""
    model = Float32ManualTokenModel(schedule=SCHEDULE)
    with pytest.raises(ValueError, match="holds parameters itself"):
        fsdp_trainer().fit(model, loader(DATA, 4))
    expected, _ = Reference(SCHEDULE).run([])
    assert max_diff(full_params(model), expected) < 1e-6


def test_fsdp_mixin_refuses_skip_before_any_step() -> None:
    """Lightning wraps the whole module: `training_step` runs inside FSDP's forward (no `no_sync()`)."""
    model = Float32ManualTokenModel(schedule=SCHEDULE, sync="skip")
    with pytest.raises(ValueError, match="`sync='skip'` cannot work with the mixin"):
        fsdp_trainer().fit(model, loader(DATA, 4))
    expected, _ = Reference(SCHEDULE).run([])
    assert max_diff(full_params(model), expected) < 1e-6  # the initial parameters: no step was taken


@pytest.mark.parametrize(("sync", "mode"), [("auto", "backward"), ("every", "heads")])
def test_fsdp2_mixin(sync: str, mode: str) -> None:
    model = ShardedManual(schedule=SCHEDULE, sync=sync, mode=mode)
    fsdp2_trainer().fit(model, loader(DATA, 4))
    check(model)


# ---------------------------------------------------------------------- DeepSpeed
@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed(stage: int) -> None:
    """Windows by the engine's boundary, each micro-batch weighted before backward (CPU twin:
    tests/test_deepspeed.py)."""
    pytest.importorskip("deepspeed")
    from lightning.pytorch.strategies import DeepSpeedStrategy

    model = Float32TokenModel(optimizer="plain-sgd")
    callback = AccumulationScheduler(SCHEDULE)
    strategy = DeepSpeedStrategy(config=deepspeed_config(stage))
    t = trainer(accelerator="gpu", devices=1, strategy=strategy, precision="32-true", callbacks=[callback], **ONE_RANK)
    t.fit(model, loader(DATA, 4))
    expected, sizes = Reference(SCHEDULE, optimizer="plain-sgd").run([rank_batches(DATA, 4)] * 2)
    assert max_diff(full_params(model), expected) < 1e-5
    assert callback.progress.step == t.strategy.model.global_steps == len(sizes)
