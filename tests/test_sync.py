"""``sync.py`` against fakes of each strategy's module interface: which family is detected,
what each ``sync=`` mode plans, and, inside Lightning's real loop on one CPU, that the gradient
sync is off during the backward of every non-final micro-batch and on for the window's last."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel

from lightning_accum import AccumulationScheduler, NoiseScale, Piecewise
from lightning_accum._core import sync
from lightning_accum._core.window import Window

from helpers import ManualTokenModel, Reference, TokenData, TokenModel, loader, max_diff, params_of, trainer

SCHEDULE = Piecewise({0: 3, 3: 2}, unit="step")  # windows 3, 3, 3, 2, 2, 2, 2 (short), per epoch of 16


class FakeFSDP(nn.Module):
    """FSDP (1)'s module interface as the package uses it: ``no_sync()`` on the outermost instance."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.events: list[Any] = []
        self.syncing = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.events.append("enter")
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True
            self.events.append("exit")


@pytest.fixture(autouse=True)
def fake_fsdp_type(monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP's real wrapper needs a process group and an accelerator: detect the fake instead."""
    assert sync._fsdp_type() is FullyShardedDataParallel  # what the fake stands for
    monkeypatch.setattr(sync, "_fsdp_type", lambda: FakeFSDP)


class FakeFSDP2(nn.Sequential):
    """FSDP2's module interface as the package uses it: ``set_requires_gradient_sync``."""

    def __init__(self, *layers: nn.Module) -> None:
        super().__init__(*layers)
        self.events: list[Any] = []
        self.syncing = True

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        self.events.append(requires_gradient_sync)
        self.syncing = requires_gradient_sync


class FakeDDP(nn.parallel.DistributedDataParallel):
    def __init__(self, module: nn.Module) -> None:
        nn.Module.__init__(self)
        self.module = module


class Strategy:
    def __init__(self, model: nn.Module | None = None, **attrs: Any) -> None:
        self.model = model
        self.__dict__.update(attrs)


def record_sync_in_backward(wrapper: Any) -> list[bool]:
    """The wrapper's sync flag as seen by each backward pass (where FSDP reads it)."""
    seen: list[bool] = []
    first = next(wrapper.parameters())
    first.register_hook(lambda grad: seen.append(wrapper.syncing))
    return seen


# ---------------------------------------------------------------------- family and plan
def test_family_is_read_off_the_wrapped_model() -> None:
    net = nn.Linear(2, 2)
    assert sync.family(Strategy(net)) == "single"
    assert sync.family(Strategy(FakeDDP(net))) == "ddp"
    assert sync.family(Strategy(nn.Sequential(FakeFSDP(net)))) == "fsdp"
    assert sync.family(Strategy(nn.Sequential(FakeFSDP2(net)))) == "fsdp2"
    assert sync.family(Strategy(FakeDDP(net), handles_gradient_accumulation=True)) == "deepspeed"


@pytest.mark.parametrize(
    ("family_model", "expected"),
    [
        # family: auto, skip, every
        (lambda: nn.Linear(2, 2), (False, False, False)),
        (lambda: FakeDDP(nn.Linear(2, 2)), (True, True, True)),  # DDP's gradients are whole: always once per window
        (lambda: FakeFSDP(nn.Linear(2, 2)), (False, True, False)),  # FSDP: opt-in, Lightning's behaviour by default
        (lambda: FakeFSDP2(nn.Linear(2, 2)), (True, True, False)),  # FSDP2: skipped unless "every"
    ],
)
def test_plan_per_mode(family_model: Any, expected: tuple[bool, bool, bool]) -> None:
    strategy = Strategy(family_model())
    assert tuple(sync.plan(strategy, mode).skip for mode in ("auto", "skip", "every")) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("loop_skips", [False, True])
def test_callback_plan_where_lightnings_loop_skips_fsdps_sync(loop_skips: bool) -> None:
    """``loop_plan``: where Lightning's loop enters FSDP's ``no_sync()`` itself, ``"auto"`` and ``"skip"`` are that
    skip and ``"every"`` is refused; where it does not, the plan is ``plan``'s (auto, skip, every: no, yes, no)."""
    strategy = Strategy(FakeFSDP(nn.Linear(2, 2)))
    skips = {mode: sync.loop_plan(strategy, mode, loop_skips) for mode in ("auto", "skip")}  # type: ignore[arg-type]
    assert skips == {"auto": sync.SyncPlan("fsdp", loop_skips), "skip": sync.SyncPlan("fsdp", True)}
    if loop_skips:
        with pytest.raises(ValueError, match=r"sync='every'\)` cannot hold under `FSDPStrategy`"):
            sync.loop_plan(strategy, "every", loop_skips)
    else:
        assert sync.loop_plan(strategy, "every", loop_skips) == sync.SyncPlan("fsdp", False)
    ddp = Strategy(FakeDDP(nn.Linear(2, 2)))  # not FSDP: the loop's skip changes nothing
    assert sync.loop_plan(ddp, "every", loop_skips) == sync.SyncPlan("ddp", True)


def test_bad_sync_mode_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="`sync` must be 'auto', 'skip' or 'every'; got 'never'"):
        AccumulationScheduler(2, sync="never")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`sync` must be"):
        ManualTokenModel(schedule=2, sync="off")


def test_fsdp_no_sync_enters_only_the_outermost_instances() -> None:
    inner_a, inner_b = FakeFSDP(nn.Linear(2, 2)), FakeFSDP(nn.Linear(2, 2))
    outer = FakeFSDP(nn.Sequential(inner_a, inner_b))
    sibling = FakeFSDP(nn.Linear(2, 2))
    model = nn.ModuleList([outer, sibling])
    assert sync.fsdp_roots(model) == [outer, sibling]
    with sync.fsdp_no_sync(model):
        assert (outer.syncing, sibling.syncing) == (False, False)
    assert outer.events == sibling.events == ["enter", "exit"]
    assert inner_a.events == inner_b.events == []  # FSDP refuses no_sync() on inner instances


def test_fsdp2_no_sync_sets_every_sharded_module_and_restores_on_error() -> None:
    a, b = FakeFSDP2(nn.Linear(2, 2)), FakeFSDP2(nn.Linear(2, 2))
    model = nn.Sequential(a, b)
    with pytest.raises(KeyError), sync.fsdp2_no_sync(model):
        assert (a.syncing, b.syncing) == (False, False)
        raise KeyError("boom")
    assert a.events == b.events == [False, True]


def test_skip_sync_is_a_no_op_for_the_final_micro_batch_and_when_not_planned() -> None:
    shard = FakeFSDP2(nn.Linear(2, 2))
    strategy = Strategy(shard)
    with sync.skip_sync(sync.SyncPlan("fsdp2", skip=True), strategy, final=True):
        pass
    with sync.skip_sync(sync.SyncPlan("fsdp2", skip=False), strategy, final=False):
        pass
    assert shard.events == []
    with sync.skip_sync(sync.SyncPlan("fsdp2", skip=True), strategy, final=False):
        assert shard.events == [False]
    assert shard.events == [False, True]


def test_ddp_no_sync_uses_the_strategys_block() -> None:
    events: list[str] = []

    @contextlib.contextmanager
    def block() -> Iterator[None]:
        events.append("block")
        yield

    with sync.skip_sync(sync.SyncPlan("ddp", True), Strategy(world_size=2, block_backward_sync=block), final=False):
        pass
    with sync.skip_sync(sync.SyncPlan("ddp", True), Strategy(world_size=1, block_backward_sync=block), final=False):
        pass  # one process: nothing to skip
    assert events == ["block"]


def test_deepspeed_error_names_the_reason_and_the_alternatives() -> None:
    with pytest.raises(RuntimeError, match=r"DeepSpeed keeps the gradient in its own buffers.*normalize='mean'"):
        sync.refuse_deepspeed(Strategy(handles_gradient_accumulation=True), "GradientDecay")
    sync.refuse_deepspeed(Strategy(), "GradientDecay")  # anything else passes


def test_partial_window_under_fsdp_is_left_out_of_checkpoints_with_a_warning() -> None:
    window = Window(k=3, start=0, divisor=3)
    window.add(4, 4)
    assert not sync.partial_window_lost(sync.SyncPlan("ddp", True), window)
    assert not sync.partial_window_lost(sync.SyncPlan("fsdp", False), Window(k=3, start=0, divisor=3))
    with pytest.warns(UserWarning, match="saved inside an accumulation window under FSDP2"):
        assert sync.partial_window_lost(sync.SyncPlan("fsdp2", True), window)


# ---------------------------------------------------------------------- inside Lightning's loop
class WrappedTokenModel(TokenModel):
    def __init__(self, wrap: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.net = wrap(self.net)


def expected_flags(sizes: list[int]) -> list[bool]:
    """Sync off for every micro-batch of a window but its last."""
    return [i == size - 1 for size in sizes for i in range(size)]


@pytest.mark.parametrize(
    ("wrap", "mode"),
    [(FakeFSDP, "skip"), (lambda net: FakeFSDP2(*net), "auto")],
)
def test_callback_skips_sync_on_non_final_micro_batches(wrap: Any, mode: str) -> None:
    model = WrappedTokenModel(wrap)
    wrapper = model.net
    seen = record_sync_in_backward(wrapper)
    data = TokenData(32)
    trainer(callbacks=[AccumulationScheduler(SCHEDULE, sync=mode)]).fit(model, loader(data, 4))  # type: ignore[arg-type]
    expected, sizes = Reference(SCHEDULE).run([[[data.batch(slice(i, i + 4)) for i in range(0, 32, 4)]]] * 2)
    assert seen == expected_flags(sizes)
    assert wrapper.syncing  # left on after fit
    assert max_diff(params_of(model), expected) <= 1e-12  # the fakes change no maths


class SkipsLastBackward(WrappedTokenModel):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx == 2 else loss  # batch 2 closes the first window (k = 3)


def test_window_whose_last_micro_batch_skips_backward_is_refused_under_skipped_sync() -> None:
    """Its gradient would stay in FSDP's unsharded buffers: stepping on it would be silently wrong."""
    with pytest.raises(RuntimeError, match="last micro-batch ran no backward pass"):
        trainer(callbacks=[AccumulationScheduler(SCHEDULE)]).fit(
            SkipsLastBackward(lambda net: FakeFSDP2(*net)), loader(TokenData(32), 4)
        )
    model = SkipsLastBackward(lambda net: FakeFSDP2(*net))  # reducing every micro-batch: fine
    trainer(callbacks=[AccumulationScheduler(SCHEDULE, sync="every")]).fit(model, loader(TokenData(32), 4))


class ManualSkipsLastBackward(ManualTokenModel):
    def training_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 2:
            with self.accumulate(batch):
                return
        super().training_step(batch, batch_idx)


def test_mixin_window_whose_last_micro_batch_skips_backward_is_refused_under_skipped_sync() -> None:
    model = ManualSkipsLastBackward(schedule=SCHEDULE)
    model.net = FakeFSDP2(*model.net)
    with pytest.raises(RuntimeError, match="last micro-batch ran no backward pass"):
        trainer().fit(model, loader(TokenData(32), 4))


def test_callback_keeps_fsdp_sync_by_default() -> None:
    model = WrappedTokenModel(FakeFSDP)
    trainer(callbacks=[AccumulationScheduler(SCHEDULE)]).fit(model, loader(TokenData(32), 4))
    assert model.net.events == []  # Lightning's per-micro-batch reduce-scatter is kept unless sync="skip"


@pytest.mark.parametrize("mode", ["backward", "each", "heads"])
def test_mixin_skips_sync_before_the_last_micro_batch(mode: str) -> None:
    model = ManualTokenModel(mode=mode, schedule=SCHEDULE)
    model.net = FakeFSDP2(*model.net)
    seen = record_sync_in_backward(model.net)
    data = TokenData(32)
    trainer().fit(model, loader(data, 4))
    expected, sizes = Reference(SCHEDULE).run([[[data.batch(slice(i, i + 4)) for i in range(0, 32, 4)]]] * 2)
    passes = {"backward": 1, "each": 2, "heads": 1}[mode]  # heads: the first layer gets its grad in the trunk pass
    assert seen == [flag for flag in expected_flags(sizes) for _ in range(passes)]
    assert max_diff(params_of(model), expected) <= 1e-12


def test_mixin_refuses_skip_when_fsdp_wraps_the_whole_module() -> None:
    """Lightning runs `training_step` inside the root FSDP's forward, where `no_sync()` raises."""
    model = ManualTokenModel(schedule=SCHEDULE, sync="skip")

    class FakeTrainer:
        callbacks = [model._accumulation]
        strategy = Strategy(FakeFSDP(model.net))
        lr_scheduler_configs: list[Any] = []

    with pytest.raises(ValueError, match="`sync='skip'` cannot work with the mixin when `FSDPStrategy` wraps"):
        model._accumulation.on_fit_start(FakeTrainer(), model)  # type: ignore[arg-type]
    FakeTrainer.strategy = Strategy(nn.Sequential(FakeFSDP(model.net)))  # submodules wrapped: fine
    model._accumulation.on_fit_start(FakeTrainer(), model)  # type: ignore[arg-type]
    assert model._accumulation.plan == sync.SyncPlan("fsdp", skip=True)


def test_fsdp_root_holding_parameters_itself_is_refused_without_skip() -> None:
    """``refuse_fsdp_root`` with the sync kept: a root whose parameters all sit in nested FSDP instances is let
    through; one holding a parameter outside them (the whole net, or one layer of two unwrapped) is refused."""
    kept = sync.SyncPlan("fsdp", skip=False)
    for root in (FakeFSDP(nn.Linear(2, 2)), FakeFSDP(nn.Sequential(FakeFSDP(nn.Linear(2, 2)), nn.Linear(2, 2)))):
        with pytest.raises(ValueError, match="holds parameters itself"):
            sync.refuse_fsdp_root(kept, root)
    wrapped = FakeFSDP(nn.Sequential(FakeFSDP(nn.Linear(2, 2)), nn.ReLU(), FakeFSDP(nn.Linear(2, 2))))
    sync.refuse_fsdp_root(kept, wrapped)  # every parameter in a nested instance: fine
    sync.refuse_fsdp_root(kept, nn.Sequential(FakeFSDP(nn.Linear(2, 2)), nn.Linear(2, 2)))  # the root is not FSDP


def test_noise_scale_is_refused_under_fsdp_before_any_step() -> None:
    model = WrappedTokenModel(lambda net: FakeFSDP2(*net))
    before = params_of(model)
    with pytest.raises(RuntimeError, match="`NoiseScale` cannot measure the gradient noise under FSDP2"):
        trainer(callbacks=[AccumulationScheduler(NoiseScale(2, 8))]).fit(model, loader(TokenData(32), 4))
    assert max_diff(params_of(model), before) == 0.0
    assert torch.is_grad_enabled()
