"""Which parameters ``grad_accum_dtype`` sums in float32 follows the optimizer through the fit: a layer unfrozen and
added as a param group mid-fit (Lightning's ``BaseFinetuning``, at an epoch's start) is summed in float32 from the
window that opens next, in every adapter, its window gradient within 1.1x one rounding of the float64 value formed
by hand (2.8x where it is left in `.grad`). Each epoch is one window of the same data (the parameters do not move)."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import BaseFinetuning
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationMixin, AccumulationScheduler
from lightning_accum.fabric import FabricAccumulator

from helpers import windows_over

K, WINDOWS, UNFREEZE_AT = 8, 2, 1  # the first layer joins the optimizer at the second epoch (window)


def data() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(K * 4, 16, generator=g), torch.randn(K * 4, 1, generator=g)


def net() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))


class Unfreeze(BaseFinetuning):
    """The first layer frozen at the start, unfrozen and added as a param group of its own at an epoch's start."""

    def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
        self.freeze(pl_module.net[0])

    def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == UNFREEZE_AT:
            self.unfreeze_and_add_param_group(pl_module.net[0], optimizer, lr=0.0, train_bn=False)


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = net()
        self.seen: list[Tensor] = []  # the first layer's weight gradient, where it has one

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grad = self.net[0].weight.grad
        if grad is not None:
            self.seen.append(grad.detach().double().clone())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.0)


class MixinModel(AccumulationMixin, Model):
    def __init__(self, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.configure_accumulation(K, grad_accum_dtype=dtype, log=False)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> None:  # type: ignore[override]
        with self.accumulate(batch) as acc:
            acc.backward(nn.functional.mse_loss(self.net(batch[0]), batch[1]))


def fit_trainer(adapter: str, dtype: torch.dtype | None) -> list[Tensor]:
    x, y = data()
    model = Model() if adapter == "callback" else MixinModel(dtype)
    callbacks: list[pl.Callback] = [Unfreeze()]
    if adapter == "callback":
        callbacks.insert(0, AccumulationScheduler(K, grad_accum_dtype=dtype, log=False))
    trainer = pl.Trainer(
        max_epochs=WINDOWS, callbacks=callbacks, precision="bf16-true", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=4))
    return model.seen


def fit_fabric(dtype: torch.dtype | None) -> list[Tensor]:
    x, y = data()
    fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-true")
    module = net()
    module[0].requires_grad_(False)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module[2].parameters(), lr=0.0))
    acc = FabricAccumulator(fabric, model, optimizer, K, grad_accum_dtype=dtype, log=False)
    seen: list[Tensor] = []

    def record(*_: object) -> None:
        if module[0].weight.grad is not None:
            seen.append(module[0].weight.grad.detach().double().clone())

    optimizer.optimizer.register_step_pre_hook(record)
    for epoch in range(WINDOWS):
        if epoch == UNFREEZE_AT:
            module[0].requires_grad_(True)
            optimizer.optimizer.add_param_group({"params": list(module[0].parameters()), "lr": 0.0})
        for j in range(K):
            with acc.accumulate(None) as step:
                step.backward(nn.functional.mse_loss(model(x[4 * j : 4 * j + 4]), y[4 * j : 4 * j + 4]))
    return seen


def exact(fabric: bool) -> list[Tensor]:
    """The first layer's weight gradient of each window from the unfreezing on, in float64, from the bf16 model (its
    output and loss in float32 as Fabric's precision gives them, in bf16 as the Trainer's)."""
    x, y = data()
    reference = net().to(torch.bfloat16)
    out = []
    for _ in range(UNFREEZE_AT, WINDOWS):
        total = torch.zeros(64, 16, dtype=torch.float64)
        for j in range(K):
            reference.zero_grad()
            output, target = reference(x[4 * j : 4 * j + 4].bfloat16()), y[4 * j : 4 * j + 4]
            loss = nn.functional.mse_loss(output.float(), target) if fabric else nn.functional.mse_loss(
                output, target.bfloat16()
            )  # fmt: skip
            loss.backward()
            total += reference[0].weight.grad.double()  # type: ignore[union-attr]
        out.append(total / K)
    return out


def relative(got: Tensor, want: Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("adapter", ["callback", "mixin", "fabric"])
def test_a_param_group_added_mid_fit_is_summed_in_float32(adapter: str) -> None:
    want = exact(adapter == "fabric")
    once = [relative(w.to(torch.bfloat16).double(), w) for w in want]
    got = fit_fabric(torch.float32) if adapter == "fabric" else fit_trainer(adapter, torch.float32)
    assert len(got) == len(want)
    assert all(relative(g, w) <= 1.1 * o for g, w, o in zip(got, want, once, strict=True)), [
        relative(g, w) / o for g, w, o in zip(got, want, once, strict=True)
    ]


class TwoOptimizers(AccumulationMixin, pl.LightningModule):
    """A window per optimizer, each optimizer's pass run with the other's parameters frozen by ``toggle_optimizer``
    (Lightning's way for a GAN's two optimizers)."""

    def __init__(self, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = net()
        self.seen: list[list[Tensor]] = [[], []]  # each optimizer's window gradients, as it steps
        self.configure_accumulation(K, grad_accum_dtype=dtype, log=False)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> None:
        for i, optimizer in enumerate(self.optimizers()):  # type: ignore[arg-type]
            self.toggle_optimizer(optimizer)
            with self.accumulate(batch, optimizer=i) as acc:
                acc.backward(nn.functional.mse_loss(self.net(batch[0]), batch[1]))
            self.untoggle_optimizer(optimizer)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        opts = [torch.optim.SGD(self.net[i].parameters(), lr=0.0) for i in (0, 2)]
        for i, opt in enumerate(opts):
            opt.register_step_post_hook(lambda o, *_, i=i: self.seen[i].append(self._grads(o)))  # (SGD at lr 0)
        return opts

    @staticmethod
    def _grads(optimizer: torch.optim.Optimizer) -> Tensor:
        return torch.cat([p.grad.detach().double().flatten() for p in optimizer.param_groups[0]["params"]])


def test_parameters_toggled_off_between_their_passes_stay_summed_in_float32() -> None:
    """Each optimizer's window (mixin, ``toggle_optimizer`` around each pass) has its gradient within 1.1x one rounding
    of the float64 value formed by hand: the parameters frozen for the other optimizer's passes stay in the float32
    sums (they were left to bf16 ``.grad`` from the second micro-batch of a window on)."""
    x, y = data()
    model = TwoOptimizers(torch.float32)
    trainer = pl.Trainer(
        max_epochs=1, precision="bf16-true", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=4))
    reference = net().to(torch.bfloat16)
    total = [torch.zeros(64 * 17, dtype=torch.float64), torch.zeros(65, dtype=torch.float64)]
    for j in range(K):
        reference.zero_grad()
        nn.functional.mse_loss(reference(x[4 * j : 4 * j + 4].bfloat16()), y[4 * j : 4 * j + 4].bfloat16()).backward()
        for i, layer in enumerate((reference[0], reference[2])):
            total[i] += torch.cat([p.grad.double().flatten() for p in layer.parameters()])  # type: ignore[union-attr]
    for i in (0, 1):
        want = total[i] / K
        (got,) = model.seen[i]
        once = relative(want.to(torch.bfloat16).double(), want)
        assert relative(got, want) <= 1.1 * once, (i, relative(got, want) / once)


def test_wide_sums_keep_a_held_sum_when_a_parameter_joins_and_a_slot_lands() -> None:
    """``WideSums`` directly: a narrow parameter joining mid-window keeps the sums held so far (they land), and a
    sum no gradient reached that a collective was handed (``slot``, zeros) lands too, as what the collective put
    there."""
    from lightning_accum._core.wide import WideSums

    a = nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    b = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    sums = WideSums(torch.float32)
    sums.attach([a])
    (a * 0.5).sum().backward()  # a's sum: 0.5 each
    sums.attach([a, b])  # b joins the window under way
    assert [s.tolist() for s in sums.sums()] == [[0.5, 0.5]]
    sums.slot(b).add_(2.0)  # (what an all-reduce of the other ranks' sums would put in b's zeroed sum)
    landed = sums.land(2.0)
    assert [g.tolist() for g in landed] == [[1.0, 1.0], [4.0, 4.0, 4.0]]
    assert a.grad is not None and b.grad is not None and b.grad.dtype == torch.bfloat16


# ---------------------------------------------------------------- a parameter unfrozen in its optimizer (the mixin)
STEPS = 4  # the window size of the mixin models below (a power of two: each loss is divided exactly before backward)
SIZES = 2 * STEPS  # the batches there are (a window of as many, for the staggered model)


def _pairs() -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g)) for _ in range(SIZES)]


def _linear() -> nn.Linear:
    torch.manual_seed(5)
    return nn.Linear(8, 4)


def _round_bf16(x: Tensor) -> Tensor:
    """``x`` (float64) rounded to the nearest bf16 number once, ties to even."""
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(torch.round(mantissa * 256.0) / 256.0, exponent)


class Unfrozen(AccumulationMixin, pl.LightningModule):
    """``a``'s weight frozen from the start, though in the optimizer, and unfrozen (``requires_grad_(True)``) at batch
    ``at`` (before its block); each batch's end records whether the weight has a ``.grad`` and whether the float32
    sums hold it, and each step of ``a``'s optimizer its weight's window gradient. ``staggered``: a second optimizer
    over ``b`` whose windows open a batch after ``a``'s (its blocks from batch 1 on), so that each opens while ``a``'s
    holds a sum. ``k``: the windows' size."""

    def __init__(self, at: int, staggered: bool, k: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a, self.b = _linear(), _linear()
        self.a.weight.requires_grad_(False)
        self.at, self.staggered = at, staggered
        self.between: list[tuple[int, bool, bool]] = []  # (batch, `.grad` is None, in the float32 sums)
        self.stepped: list[Tensor | None] = []  # (None: the weight had no gradient)
        self.configure_accumulation(k, grad_accum_dtype=torch.float32, log=False)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> None:
        x, y = batch
        if batch_idx == self.at:
            self.a.weight.requires_grad_(True)
        with self.accumulate(batch, optimizer=0) as acc:
            acc.backward(nn.functional.mse_loss(self.a(x), y))
        if self.staggered and batch_idx >= 1:
            with self.accumulate(batch, optimizer=1) as acc:
                acc.backward(nn.functional.mse_loss(self.b(x), y))
        wide = self._accumulation.windows.wide
        assert wide is not None
        self.between.append((batch_idx, self.a.weight.grad is None, wide.holds(self.a.weight)))

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        first = torch.optim.SGD(self.a.parameters(), lr=0.0)  # (the frozen weight in it all along)
        first.register_step_post_hook(lambda *_: self.stepped.append(self._weight_grad()))  # (SGD at lr 0)
        return [first, torch.optim.SGD(self.b.parameters(), lr=0.0)] if self.staggered else [first]

    def _weight_grad(self) -> Tensor | None:
        grad = self.a.weight.grad
        return None if grad is None else grad.detach().clone()


def _fit_pairs(model: pl.LightningModule) -> None:
    """One epoch over ``_pairs()`` in bf16-true."""
    trainer = pl.Trainer(
        max_epochs=1, precision="bf16-true", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu",
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(_pairs(), batch_size=None))


def _fit_unfrozen(at: int, staggered: bool, k: int) -> Unfrozen:
    model = Unfrozen(at, staggered, k)
    _fit_pairs(model)
    return model


@pytest.mark.parametrize("staggered", [False, True], ids=["alone", "staggered"])
def test_a_parameter_unfrozen_between_windows_is_summed_in_float32_from_the_next_window(staggered: bool) -> None:
    """Mixin: a parameter of the optimizer unfrozen between two windows (no param group added) is taken into the
    float32 sums as the next window opens (``MixinWindows.rewiden``): ``.grad`` ``None`` between its micro-batches,
    and its window gradient the float64 mean of its micro-batch gradients (of the bf16 model) rounded to bf16 once.
    ``staggered``: also while another optimizer's window holds sums as it opens (one always does)."""
    model = _fit_unfrozen(at=STEPS, staggered=staggered, k=STEPS)
    assert model.between[:STEPS] == [(b, True, False) for b in range(STEPS)]  # (frozen: no gradient, not summed)
    assert model.between[STEPS:-1] == [(b, True, True) for b in range(STEPS, 2 * STEPS - 1)]
    reference = _linear().to(torch.bfloat16)
    exact = torch.zeros(4, 8, dtype=torch.float64)
    for x, y in _pairs()[STEPS:]:
        reference.zero_grad()
        nn.functional.mse_loss(reference(x.bfloat16()), y.bfloat16()).backward()
        exact += reference.weight.grad.double()  # type: ignore[union-attr]
    assert len(model.stepped) == 2 and model.stepped[0] is None  # (frozen through the first window)
    got = model.stepped[1]
    assert got is not None and got.dtype == torch.bfloat16 and torch.equal(got.double(), _round_bf16(exact / STEPS))
    # (what a bf16 running sum in `.grad` gives instead: not the value above, so the check can tell them apart)
    running = torch.zeros(4, 8, dtype=torch.bfloat16)
    for x, y in _pairs()[STEPS:]:
        reference.zero_grad()
        (nn.functional.mse_loss(reference(x.bfloat16()), y.bfloat16()) / STEPS).backward()
        running += reference.weight.grad  # type: ignore[operator]
    assert not torch.equal(running.double(), _round_bf16(exact / STEPS))


def test_a_parameter_unfrozen_inside_an_open_window_is_not_taken_into_the_sums_it_holds() -> None:
    """Mixin, two optimizers whose windows are staggered: ``a``'s weight unfrozen at the second micro-batch of ``a``'s
    window; ``b``'s window opening next, while ``a``'s holds sums, does not take the weight into them: as documented
    (docs/guide/precision.md), a parameter that joins after its window opened is summed in its ``.grad`` until that
    window ends, normalised all the same: its window gradient (a window of 8) is the bf16 running sum of its
    micro-batch gradients (each loss divided by the window's 8 before backward), formed by hand."""
    model = _fit_unfrozen(at=1, staggered=True, k=SIZES)
    assert model.between == [(0, True, False)] + [(b, False, False) for b in range(1, SIZES)]
    reference = _linear().to(torch.bfloat16)
    for x, y in _pairs()[1:]:
        (nn.functional.mse_loss(reference(x.bfloat16()), y.bfloat16()) / SIZES).backward()
    (got,) = model.stepped
    assert got is not None and got.dtype == torch.bfloat16 and torch.equal(got, reference.weight.grad)


# ------------------------------------------------ MixinWindows.rewiden's rule: when a joining parameter is taken in
def _two_groups(others: torch.dtype) -> tuple[Any, nn.Parameter, nn.Parameter]:
    """Windows of two optimizers: ``[a, c]`` (``a`` bf16, frozen) and ``[b]``, ``b`` and ``c`` of dtype ``others``
    (float32: nothing narrow is trained, the sums are off)."""
    a = nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    b, c = nn.Parameter(torch.ones(2, dtype=others)), nn.Parameter(torch.ones(2, dtype=others))
    a.requires_grad_(False)
    first = torch.optim.SGD([{"params": [a]}, {"params": [c]}], lr=0.0)
    second = torch.optim.SGD([b], lr=0.0)
    windows = windows_over(first, second, schedule=4, grad_accum_dtype=torch.float32)
    windows.engine((0,)), windows.engine((1,))
    windows.widen()
    return windows, a, c


@pytest.mark.parametrize(
    ("others", "open_", "removed", "taken"),
    [
        (torch.bfloat16, (), False, True),  # no window holds a sum
        (torch.bfloat16, (1,), False, True),  # another optimizer's window does: `a` joins outside it
        (torch.bfloat16, (0,), False, False),  # `a`'s own window is open: it stays in `.grad` till that ends
        (torch.bfloat16, (0, 1), False, False),
        (torch.float32, (1,), False, False),  # the sums were off (nothing narrow): not switched on inside a window
        (torch.float32, (), False, True),
        (torch.bfloat16, (1,), True, False),  # `c` left with its param group: not retaken inside a window
        (torch.bfloat16, (), True, True),
    ],
)
def test_a_joining_parameter_is_taken_in_unless_a_window_holding_it_or_the_switch_is_open(
    others: torch.dtype, open_: tuple[int, ...], removed: bool, taken: bool
) -> None:
    from types import SimpleNamespace

    windows, a, c = _two_groups(others)
    assert windows.wide is not None and not windows.wide.holds(a)
    assert windows.wide.holds(c) is (others == torch.bfloat16)
    a.requires_grad_(True)
    if removed:
        windows.optimizers()[0].optimizer.param_groups.pop()  # (`c`'s group)
    for key in open_:
        windows.engines[(key,)].window = SimpleNamespace(microbatches=1)  # (a stand-in: a window holding a sum)
    windows.rewiden()
    assert windows.wide.holds(a) is taken


class Joined(AccumulationMixin, pl.LightningModule):
    """``c`` frozen and out of the optimizer, its output in the loss; at batch ``at``, before the block, unfrozen and
    added to the optimizer as a param group (inside the window of batches 4-7). Each step records ``c``'s weight's
    window gradient."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a, self.c = _linear(), _linear()
        self.c.requires_grad_(False)
        self.at = at
        self.stepped: list[Tensor | None] = []
        self.configure_accumulation(STEPS, grad_accum_dtype=torch.float32, log=False)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> None:
        x, y = batch
        if batch_idx == self.at:
            self.c.requires_grad_(True)
            self.optimizers().optimizer.add_param_group({"params": list(self.c.parameters())})  # type: ignore[union-attr]
        with self.accumulate(batch) as acc:
            acc.backward(nn.functional.mse_loss(self.a(x) + self.c(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(self.a.parameters(), lr=0.0)
        optimizer.register_step_post_hook(lambda *_: self.stepped.append(self._weight_grad()))
        return optimizer

    def _weight_grad(self) -> Tensor | None:
        grad = self.c.weight.grad
        return None if grad is None else grad.detach().clone()


def test_a_param_group_added_inside_a_mixin_window_is_summed_in_float32_from_its_block() -> None:
    """Mixin: a param group added inside a window (its parameters new to the optimizer, holding none of the window's
    gradient) is summed in float32 from the block it joins at (``MixinWindows.widen_joined``): its window gradient
    is the float64 sum of its micro-batch gradients since (of the bf16 model), over the window's k, rounded once."""
    model = Joined(at=STEPS + 1)
    _fit_pairs(model)
    a, c = _linear().to(torch.bfloat16), _linear().to(torch.bfloat16)
    exact = torch.zeros(4, 8, dtype=torch.float64)
    running = torch.zeros(4, 8, dtype=torch.bfloat16)
    for x, y in _pairs()[STEPS + 1 :]:
        c.zero_grad()
        nn.functional.mse_loss(a(x.bfloat16()) + c(x.bfloat16()), y.bfloat16()).backward()
        exact += c.weight.grad.double()  # type: ignore[union-attr]
        running += c.weight.grad / STEPS  # type: ignore[operator]
    assert len(model.stepped) == 2 and model.stepped[0] is None
    got = model.stepped[1]
    assert got is not None and torch.equal(got.double(), _round_bf16(exact / STEPS))
    assert not torch.equal(running.double(), _round_bf16(exact / STEPS))  # (a bf16 sum in `.grad`: told apart)
