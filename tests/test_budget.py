"""``Budget``: windows closed by their count (samples or items over all ranks), against a plain float64 loop
that forms the windows from the counts by hand (it shares no code with the package but ``Progress``)."""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

from lightning_accum import (
    AccumulationScheduler,
    Budget,
    FabricAccumulator,
    GradientDecay,
    Lambda,
    NoiseScale,
    Progress,
    Ramp,
    estimated_stepping_batches,
)

from helpers import (
    Batch,
    KRecorder,
    ManualTokenModel,
    ResumableLoader,
    TokenData,
    TokenModel,
    count_tokens,
    default_dtype,
    loader,
    make_net,
    make_optimizer,
    max_diff,
    params_of,
    token_losses,
    trainer,
)


def tokens_of(batch: Batch) -> int:
    return int(batch["mask"].sum())


def reference(
    epochs: list[list[list[Batch]]],
    n: Callable[[Progress], int],
    unit: str = "items",
    normalize: str = "items",
    max_k: int | None = None,
    max_steps: int = -1,
    lr: float = 0.1,
    lr_scaling: str | None = None,
    decay: float | None = None,
    optimizer: str = "sgd",
) -> tuple[list[torch.Tensor], list[int], list[float]]:
    """Final parameters, each window's micro-batches (per rank) and each window's loss. ``epochs[e][r]``: rank r's
    batches of epoch e. Each window takes micro-batches (one from every rank at a time) until the count over ranks
    reaches the budget read as it opened, ``max_k`` of them, or the epoch's end."""
    net = make_net()
    opt = make_optimizer(optimizer, net.parameters(), lr)
    progress, sizes, losses, first_n = Progress(), [], [], None
    residual: list[torch.Tensor] | None = None
    for epoch, ranks in enumerate(epochs):
        i, length = 0, len(ranks[0])
        while i < length and progress.step != max_steps:
            budget = n(dataclasses.replace(progress, epoch=epoch))
            first_n = first_n or budget
            seen, m = 0, 0
            while i + m < length:
                seen += sum(len(r[i + m]["x"]) if unit == "samples" else tokens_of(r[i + m]) for r in ranks)
                m += 1
                if seen >= budget or (max_k is not None and m >= max_k):
                    break
            window = [r[i : i + m] for r in ranks]
            tokens = sum(tokens_of(b) for r in window for b in r)
            samples = sum(len(b["x"]) for r in window for b in r)
            loss = torch.zeros((), dtype=torch.float64)
            for r in window:
                for b in r:
                    total, tok = token_losses(net, b)
                    loss = loss + (total / tokens if normalize == "items" else total / tok / (m * len(ranks)))
            opt.zero_grad()
            loss.backward()
            if decay is not None:
                grads = [p.grad.clone() for p in net.parameters()]
                if residual is not None:
                    for p, res in zip(net.parameters(), residual, strict=True):
                        p.grad = p.grad + decay * res
                residual = [p.grad.clone() for p in net.parameters()]
                del grads
            saved = [g["lr"] for g in opt.param_groups]
            if lr_scaling is not None:
                ratio = (samples if unit == "samples" else tokens) / first_n
                for g in opt.param_groups:
                    g["lr"] *= ratio if lr_scaling == "linear" else math.sqrt(ratio)
            opt.step()
            for g, rate in zip(opt.param_groups, saved, strict=True):
                g["lr"] = rate
            sizes.append(m)
            losses.append(float(loss.detach()))
            progress = Progress(
                epoch=epoch,
                step=progress.step + 1,
                samples=progress.samples + samples,
                items=progress.items + tokens,
                microbatches=progress.microbatches + m,
            )
            i += m
    return [p.detach().clone() for p in net.parameters()], sizes, losses


DATA = TokenData(44, seed=3)
BATCH = 4


def epochs_of(count: int, batches: int | None = None) -> list[list[list[Batch]]]:
    index = list(range(len(DATA)))
    one = [DATA.batch(index[i : i + BATCH]) for i in range(0, len(index), BATCH)][:batches]
    return [[one] for _ in range(count)]


def fit_callback(budget: Budget, normalize: str = "items", **kwargs: Any) -> tuple[TokenModel, KRecorder, Any]:
    fit_kwargs = {k: kwargs.pop(k) for k in ("max_steps", "limit_train_batches", "max_epochs") if k in kwargs}
    model = TokenModel(reduction="sum" if normalize == "items" else "mean")
    recorder = KRecorder()
    extra = dict(count=count_tokens, reduction="sum") if normalize == "items" else dict(count=count_tokens)
    callback = AccumulationScheduler(budget, normalize=normalize, **extra, **kwargs)  # type: ignore[arg-type]
    trainer(callbacks=[callback, recorder], **fit_kwargs).fit(model, loader(DATA, BATCH))
    return model, recorder, callback


@pytest.mark.parametrize(
    ("n", "unit", "normalize", "max_k"),
    [
        (25, "items", "items", None),
        (9, "samples", "mean", None),
        (40, "items", "items", 3),
        (1, "items", "items", None),
    ],
)
def test_callback_windows_equal_the_reference(n: int, unit: str, normalize: str, max_k: int | None) -> None:
    model, recorder, callback = fit_callback(Budget(n, unit=unit, max_k=max_k), normalize)  # type: ignore[arg-type]
    expected, sizes, _ = reference(epochs_of(2), lambda p: n, unit, normalize, max_k)
    assert recorder.windows == sizes
    assert max_diff(params_of(model), expected) < 1e-12
    assert callback.progress.step == len(sizes)


def test_a_budget_that_ramps_is_read_as_each_window_opens() -> None:
    ramp = Ramp(10, 60, over=300, unit="items")
    model, recorder, _ = fit_callback(Budget(ramp, unit="items"))
    expected, sizes, _ = reference(epochs_of(2), ramp)
    assert recorder.windows == sizes and len(set(sizes)) > 2  # (windows that grow)
    assert max_diff(params_of(model), expected) < 1e-12


@pytest.mark.parametrize(
    "fit_kwargs", [{"max_steps": 5}, {"limit_train_batches": 7}], ids=["max_steps", "limit_train_batches"]
)
def test_max_steps_and_limit_train_batches(fit_kwargs: dict[str, int]) -> None:
    model, recorder, _ = fit_callback(Budget(25), **fit_kwargs)
    epochs = epochs_of(2, fit_kwargs.get("limit_train_batches"))
    expected, sizes, _ = reference(epochs, lambda p: 25, max_steps=fit_kwargs.get("max_steps", -1))
    assert recorder.windows == sizes
    assert max_diff(params_of(model), expected) < 1e-12


@pytest.mark.parametrize("scaling", ["linear", "sqrt"])
def test_lr_scaling_follows_the_windows_real_size_relative_to_the_first_budget(scaling: str) -> None:
    model, _, _ = fit_callback(Budget(25), lr_scaling=scaling)
    expected, _, _ = reference(epochs_of(2), lambda p: 25, lr_scaling=scaling)
    assert max_diff(params_of(model), expected) < 1e-12


def test_microbatch_size_pieces_still_count_the_loader_batch() -> None:
    model, recorder, _ = fit_callback(Budget(25), microbatch_size=3)
    expected, sizes, _ = reference(epochs_of(2), lambda p: 25)
    assert recorder.windows == sizes
    assert max_diff(params_of(model), expected) < 1e-12


def test_gradient_decay() -> None:
    model = TokenModel(reduction="sum")
    callbacks = [AccumulationScheduler(Budget(25), normalize="items", count=count_tokens, reduction="sum")]
    trainer(callbacks=[*callbacks, GradientDecay(0.5)]).fit(model, loader(DATA, BATCH))
    expected, _, _ = reference(epochs_of(2), lambda p: 25, decay=0.5)
    assert max_diff(params_of(model), expected) < 1e-12


def test_logged_loss_and_k_are_the_windows() -> None:
    seen: list[tuple[int, float]] = []

    class Watch(pl.Callback):
        def on_window_end(self, trainer: Any, pl_module: Any, window: Any) -> None:
            seen.append((window.k, window.loss))

    model = TokenModel(reduction="sum")
    callback = AccumulationScheduler(Budget(25), normalize="items", count=count_tokens, reduction="sum")
    trainer(callbacks=[callback, Watch()]).fit(model, loader(DATA, BATCH))
    _, sizes, losses = reference(epochs_of(2), lambda p: 25)
    assert [k for k, _ in seen] == sizes
    assert max(abs(a - b) for (_, a), b in zip(seen, losses, strict=True)) < 1e-12


class SaveAt(pl.Callback):
    def __init__(self, at: tuple[int, int], path: Path) -> None:
        self.at, self.path = at, path

    @staticmethod
    def _key(trainer: pl.Trainer, batch_idx: int) -> tuple[int, int]:
        return trainer.current_epoch, batch_idx

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._key(trainer, args[-1]) == self.at:
            trainer.save_checkpoint(self.path)


# (batch 1 is inside the first window of batches 0-2; batch 6 of epoch 0 inside the window of 5-7)
@pytest.mark.parametrize("at", [(0, 1), (0, 6)])
def test_resume_inside_a_window_is_bit_identical(tmp_path: Path, at: tuple[int, int]) -> None:
    path = tmp_path / "inside.ckpt"

    def callback() -> AccumulationScheduler:
        return AccumulationScheduler(Budget(25), normalize="items", count=count_tokens, reduction="sum")

    full, resumed = TokenModel(reduction="sum"), TokenModel(reduction="sum")
    trainer(callbacks=[callback(), SaveAt(at, path)]).fit(full, ResumableLoader(DATA, BATCH))
    state = torch.load(path, weights_only=False)
    held = next(v for k, v in state["callbacks"].items() if "AccumulationScheduler" in k)["window"]
    assert held is not None and held["seen"] > 0 and not held["ends"]  # (inside the window)
    trainer(callbacks=[callback()]).fit(resumed, ResumableLoader(DATA, BATCH), ckpt_path=path)
    assert max_diff(params_of(resumed), params_of(full)) == 0.0
    other = AccumulationScheduler(3, normalize="items", count=count_tokens, reduction="sum")
    with pytest.raises(ValueError, match="closed by a `Budget`"):
        trainer(callbacks=[other]).fit(TokenModel(reduction="sum"), ResumableLoader(DATA, BATCH), ckpt_path=path)


class SkipsBatch(TokenModel):
    """``training_step`` returns ``None`` (no backward) at the batch indices ``skip``."""

    def __init__(self, skip: tuple[int, ...], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.skip = skip

    def training_step(self, batch: Batch, batch_idx: int) -> Any:
        return None if batch_idx in self.skip else super().training_step(batch, batch_idx)


class StepsAfter(pl.Callback):
    """(epoch, batch index) of each batch after which the optimizer stepped."""

    def __init__(self) -> None:
        self.after: list[tuple[int, int]] = []
        self._batch = (0, 0)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._batch = (trainer.current_epoch, batch_idx)

    def on_before_optimizer_step(self, *args: Any) -> None:
        self.after.append(self._batch)


@pytest.mark.parametrize("at", [(0, 1), (0, 4)])
def test_max_k_counts_a_batch_without_backward_across_a_resume(tmp_path: Path, at: tuple[int, int]) -> None:
    """Under ``max_k`` a window takes ``max_k`` loader batches, whether their ``training_step`` returned a loss or
    ``None``; a checkpoint written right after such a batch resumes the window with it counted. By hand: 11 batches
    an epoch, a budget never reached, ``max_k=3``: steps after batches 2, 5, 8 and 10 (the epoch's end)."""
    path = tmp_path / "inside.ckpt"

    def run(ckpt: Path | None, callbacks: list[pl.Callback]) -> tuple[TokenModel, StepsAfter]:
        model, steps = SkipsBatch((1, 4), reduction="sum"), StepsAfter()
        budget = Budget(10_000, max_k=3)  # (44 samples of at most 5 tokens: never reached)
        callback = AccumulationScheduler(budget, normalize="items", count=count_tokens, reduction="sum")
        trainer(callbacks=[callback, steps, *callbacks]).fit(model, ResumableLoader(DATA, BATCH), ckpt_path=ckpt)
        return model, steps

    full, steps = run(None, [SaveAt(at, path)])
    by_hand = [(e, i) for e in (0, 1) for i in (2, 5, 8, 10)]
    assert steps.after == by_hand
    resumed, steps = run(path, [])
    assert steps.after == [s for s in by_hand if s > at]
    assert max_diff(params_of(resumed), params_of(full)) == 0.0


def test_a_window_resumed_under_a_budget_of_another_unit_is_refused_before_anything_changes(tmp_path: Path) -> None:
    path = tmp_path / "inside.ckpt"  # (batch 6 of epoch 0: inside the window of 5-7, 15 items seen of 25)
    first = AccumulationScheduler(Budget(25), normalize="items", count=count_tokens, reduction="sum")
    trainer(callbacks=[first, SaveAt((0, 6), path)]).fit(TokenModel(reduction="sum"), ResumableLoader(DATA, BATCH))
    other = AccumulationScheduler(Budget(9, unit="samples"), normalize="items", count=count_tokens, reduction="sum")
    recorder = KRecorder()
    with pytest.raises(ValueError, match=r"closed by a `Budget` in items.*counts samples.*unit='items'"):
        trainer(callbacks=[other, recorder]).fit(
            TokenModel(reduction="sum"), ResumableLoader(DATA, BATCH), ckpt_path=path
        )
    assert recorder.windows == [] and other.progress == Progress()  # (refused before anything changed)
    # (another n keeps the saved window's budget, as documented: it closes where the first run's did, after batch 7)
    same_unit, recorder = (
        AccumulationScheduler(Budget(100), normalize="items", count=count_tokens, reduction="sum"),
        KRecorder(),
    )
    trainer(callbacks=[same_unit, recorder]).fit(
        TokenModel(reduction="sum"), ResumableLoader(DATA, BATCH), ckpt_path=path
    )
    _, sizes, _ = reference(epochs_of(2), lambda p: 25)
    assert sizes[:3] == [3, 2, 3] and recorder.windows[0] == 1  # (the window of batches 5-7 has batch 7 left)


@pytest.mark.parametrize("mode", ["backward", "items_arg"])
def test_mixin_equals_the_reference(mode: str) -> None:
    model = ManualTokenModel(mode=mode, schedule=Budget(25), normalize="items", count=count_tokens)
    trainer().fit(model, loader(DATA, BATCH))
    expected, _, _ = reference(epochs_of(2), lambda p: 25)
    assert max_diff(params_of(model), expected) < 1e-12
    assert model.accumulation_progress.step == len(reference(epochs_of(2), lambda p: 25)[1])


@pytest.mark.parametrize(("n", "unit", "normalize"), [(25, "items", "items"), (9, "samples", "mean")])
def test_fabric_equals_the_reference(n: int, unit: str, normalize: str) -> None:
    net = make_net()  # (as the reference's: made under float32 defaults, then cast)
    with default_dtype(torch.float64):  # (Fabric's "64-true" casts outputs to the default dtype)
        fabric = Fabric(accelerator="cpu", devices=1, precision="64-true")
        model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        items = normalize == "items"
        acc = FabricAccumulator(
            fabric, model, optimizer, Budget(n, unit=unit), normalize=normalize,  # type: ignore[arg-type]
            count=count_tokens if items else None, reduction="sum" if items else None,
        )  # fmt: skip
        for epoch, ranks in enumerate(epochs_of(2)):
            for batch in ranks[0]:
                with acc.accumulate(batch, epoch=epoch) as step:
                    total, tokens = token_losses(model, batch)
                    step.backward(total if items else total / tokens)
            acc.flush()
    expected, sizes, _ = reference(epochs_of(2), lambda p: n, unit, normalize, optimizer="plain-sgd")
    assert max_diff([p.detach() for p in net.parameters()], expected) < 1e-12
    assert acc.progress.step == len(sizes)


def test_one_process_reads_no_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *a, **k: calls.append(a))
    fit_callback(Budget(25), max_epochs=1)
    assert calls == []


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: Budget(0), ValueError, "`n` of `Budget` must be an int >= 1"),
        (lambda: Budget(-3), ValueError, "`n` of `Budget` must be an int >= 1"),
        (lambda: Budget(float("nan")), ValueError, "`n` of `Budget` must be an int >= 1"),
        (lambda: Budget(2.5), ValueError, "`n` of `Budget` must be an int >= 1"),
        (lambda: Budget(True), TypeError, "`n` of `Budget` must be an int >= 1, a Schedule"),
        (lambda: Budget("100"), TypeError, "`n` of `Budget` must be an int >= 1, a Schedule"),
        (lambda: Budget(100, max_k=0), ValueError, "`max_k` must be an int >= 1"),
        (lambda: Budget(float("inf")), ValueError, "`n` of `Budget` must be an int >= 1"),
        (lambda: Budget(100, max_k=-1), ValueError, "`max_k` must be an int >= 1"),
        (lambda: Budget(100, max_k=float("nan")), ValueError, "`max_k` must be an int >= 1"),
        (lambda: Budget(100, max_k=2.5), ValueError, "`max_k` must be an int >= 1"),  # type: ignore[arg-type]
        (lambda: Budget(100, max_k=True), ValueError, "`max_k` must be an int >= 1"),
        (lambda: Budget(100, max_k="3"), ValueError, "`max_k` must be an int >= 1"),  # type: ignore[arg-type]
        (lambda: Budget(100, unit=None), ValueError, "`unit` must be one of 'samples', 'items'"),  # type: ignore[arg-type]
        (lambda: Budget(100, unit="itmes"), ValueError, "Did you mean 'items'"),  # type: ignore[arg-type]
        (lambda: Budget(100, unit="step"), ValueError, "`unit` must be one of 'samples', 'items'"),  # type: ignore[arg-type]
        (lambda: Budget(NoiseScale(2, 16)), ValueError, "measures the gradient noise in windows of a fixed k"),
        (lambda: Budget(Budget(3)), ValueError, "a budget is not a number"),
        (lambda: AccumulationScheduler(Budget(100)), ValueError, "counts items, so `count` is needed"),
        (
            lambda: AccumulationScheduler(Budget(Ramp(10, 50, over=500, unit="items"), unit="samples")),
            ValueError,
            r"The budget's n Ramp\(10, 50, over=500, unit='items'.* counts items, so `count` is needed",
        ),
        (
            lambda: AccumulationScheduler(Budget(100, unit="samples"), lr_scaling="adascale"),
            ValueError,
            "`lr_scaling='adascale'` measures the gradient noise at fixed micro-batch counts",
        ),
    ],
)
def test_misuse_is_refused_naming_the_argument(make: Callable[[], Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        make()


def test_a_budget_read_from_a_bad_function_is_refused_before_the_first_step() -> None:
    model = TokenModel(reduction="sum")
    callback = AccumulationScheduler(Budget(lambda p: 0), normalize="items", count=count_tokens, reduction="sum")
    with pytest.raises(ValueError, match="gave a budget n=0"):
        trainer(callbacks=[callback]).fit(model, loader(DATA, BATCH))
    assert max_diff(params_of(model), [p.detach() for p in make_net().parameters()]) == 0.0


def test_a_per_sample_count_is_refused() -> None:
    callback = AccumulationScheduler(Budget(25), normalize="items", count=lambda b: b["mask"].sum(1), reduction="sum")
    with pytest.raises(ValueError, match="one number"):
        trainer(callbacks=[callback]).fit(TokenModel(reduction="sum"), loader(DATA, BATCH))


class DropsTokens(TokenModel):
    def training_step(self, batch: Batch, batch_idx: int) -> Any:
        return super().training_step({k: v for k, v in batch.items() if k != "tokens"}, batch_idx)


def test_samples_are_counted_along_the_first_tensor_that_has_a_dim_0() -> None:
    # (a 0-dim tensor first, as a collate that puts the batch's token count first gives: it has no dim 0, it is
    # skipped as a Python number is; the samples are x's rows)
    batches = [{"tokens": b["mask"].sum(), **b} for b in epochs_of(1)[0][0]]
    model, recorder = DropsTokens(reduction="mean"), KRecorder()
    callback = AccumulationScheduler(Budget(9, unit="samples"), normalize="mean")
    trainer(callbacks=[callback, recorder]).fit(model, DataLoader(batches, batch_size=None))
    expected, sizes, _ = reference(epochs_of(2), lambda p: 9, "samples", "mean")
    assert recorder.windows == sizes == [3, 3, 3, 2, 3, 3, 3, 2]
    assert callback.progress.samples == 2 * len(DATA)
    assert max_diff(params_of(model), expected) < 1e-12
    only_scalars = [{"tokens": b["mask"].sum()} for b in epochs_of(1)[0][0]]  # (nothing has a dim 0: refused)
    callback = AccumulationScheduler(Budget(9, unit="samples"), normalize="mean")
    with pytest.raises(ValueError, match=r"Budget\(9, unit='samples'\) needs .* holds only 0-dim tensors"):
        trainer(callbacks=[callback]).fit(DropsTokens(reduction="mean"), DataLoader(only_scalars, batch_size=None))


# ------------------------------------------------------------------ step counts and progress bars
class Estimating(TokenModel):
    def configure_optimizers(self) -> Any:
        self.estimated = estimated_stepping_batches(self.trainer)
        return super().configure_optimizers()


@pytest.mark.parametrize(
    ("budget", "fit_kwargs"),
    [
        (Budget(9, unit="samples"), {}),
        (Budget(Ramp(4, 20, over=60, unit="samples"), unit="samples", max_k=4), {}),
        (Budget(9, unit="samples"), {"max_steps": 5}),
        (Budget(9, unit="samples"), {"limit_train_batches": 7}),
    ],
)
def test_estimated_stepping_batches_is_exact_for_samples(budget: Budget, fit_kwargs: dict[str, int]) -> None:
    model, recorder = Estimating(), KRecorder()
    data = TokenData(42, seed=3)  # (a short last batch of 2)
    callback = AccumulationScheduler(budget)
    trainer(callbacks=[callback, recorder], **fit_kwargs).fit(model, loader(data, BATCH))
    assert model.estimated == len(recorder.windows) == callback.progress.step


@pytest.mark.parametrize(
    ("budget", "by_hand"),
    [
        # 42 samples in batches of 4 (the last of 2): 11 batches an epoch, 2 epochs
        (Budget(8, unit="samples"), 2 * 6),  # reached exactly by 2 batches: windows of 2, the last of 1
        (Budget(12, unit="samples"), 2 * 4),  # by 3: 3, 3, 3, 2
        (Budget(16, unit="samples", max_k=3), 2 * 4),  # by 4, but capped at 3
        (Budget(4, unit="samples"), 2 * 11),  # by each batch
    ],
)
def test_estimated_stepping_batches_when_a_window_reaches_its_budget_exactly(budget: Budget, by_hand: int) -> None:
    """A window closes at the batch whose count reaches the budget, equal included: the estimate walks the same
    windows as the fit (both counted by hand here)."""
    model, recorder = Estimating(), KRecorder()
    callback = AccumulationScheduler(budget)
    trainer(callbacks=[callback, recorder]).fit(model, loader(TokenData(42, seed=3), BATCH))
    assert model.estimated == len(recorder.windows) == callback.progress.step == by_hand


class SizedByLightning(TokenModel):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        total = int(self.trainer.estimated_stepping_batches)  # (22: the batches of 2 epochs, not the windows)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@pytest.mark.parametrize(
    ("schedule", "advice"),
    [
        (Budget(25), r"lr_schedule=lightning_accum.lr.WarmupCosine\(warmup, total, unit='items'\).*unit='samples'"),
        (Ramp(1, 4, over=200, unit="items"), r"depends on the items .*lr_schedule=.*unit='items'"),
    ],
    ids=["budget", "ramp"],
)
def test_a_scheduler_whose_length_cannot_be_checked_is_warned_about_at_the_fit_start(
    schedule: Any, advice: str
) -> None:
    callback = AccumulationScheduler(schedule, normalize="items", count=count_tokens, reduction="sum")
    started: list[int] = []

    class Start(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            started.append(len(caught))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(callbacks=[callback, Start()]).fit(SizedByLightning(reduction="sum"), loader(DATA, BATCH))
    ours = [str(w.message) for w in caught if "OneCycleLR (total_steps=22)" in str(w.message)]
    assert len(ours) == 1 and callback.progress.step != 22  # (once; the fit does not take the 22 steps)
    assert re.search(
        rf"cannot be checked against the accumulation schedule.*{re.escape(repr(schedule))}.*{advice}", ours[0]
    )
    assert [str(w.message) for w in caught[: started[0]]].count(ours[0]) == 1  # (at the fit's start)


# (a budget of samples whose n follows the items: the walk, which takes the items to grow as the samples do, gave
# 7 steps for a fit of 5)
@pytest.mark.parametrize(
    ("budget", "whose"),
    [(Budget(25), ""), (Budget(Ramp(10, 60, over=300, unit="items"), unit="samples"), r" \(its `n` follows them\)")],
    ids=["items", "samples-n-on-items"],
)
def test_estimated_stepping_batches_refuses_a_budget_of_items(budget: Budget, whose: str) -> None:
    callback = AccumulationScheduler(budget, normalize="items", count=count_tokens, reduction="sum")
    named = re.escape(repr(budget))
    with pytest.raises(ValueError, match=rf"under {named} depends on the items \(tokens\) each batch will hold{whose}"):
        trainer(callbacks=[callback]).fit(Estimating(reduction="sum"), loader(DATA, BATCH))


@pytest.mark.parametrize("kind, unit", [("tqdm", "steps"), ("rich", "batches")])
def test_progress_bars_exact_for_samples_and_never_passed_for_items(kind: str, unit: str) -> None:
    from test_progress import BARS, expected, fit

    seen = fit(BARS[kind](unit), Budget(5, unit="samples"))
    realised = expected(seen, unit)
    assert [e["first_total"] for e in seen.epochs] == realised  # known from the epoch's start
    assert [e["last"] for e in seen.epochs] == [(n, n) for n in realised]
    assert seen.fit[-1] == (sum(e["steps"] for e in seen.epochs),) * 2
    seen = fit(BARS[kind](unit), Budget(12, unit="items"), count=count_tokens)
    realised = expected(seen, unit)
    assert [e["last"] for e in seen.epochs] == [(n, n) for n in realised]  # met at the epoch's end
    assert all(not e["passed"] for e in seen.epochs)  # never passed


# (batches 3 and 4 of epoch 0: inside the window of batches 2-4 and at its last, 25 tokens)
@pytest.mark.parametrize("at", [(0, 3), (0, 4)])
@pytest.mark.parametrize(
    "hook",
    # (`on_after_backward:before`: a callback listed before the package's, its batch's gradient in: trained again, it
    # adds nothing, and its count stays in the budget's)
    [
        "on_train_batch_start",
        "on_before_backward",
        "on_after_backward",
        "on_after_backward:before",
        "on_train_batch_end",
        "sigterm",
    ],
)
def test_an_exception_inside_a_window_resumes_bit_identically(tmp_path: Path, hook: str, at: tuple[int, int]) -> None:
    """The batch an exception cut short (before its backward) is trained again, and its count with it: the count
    the budget took of it as it started is taken back."""
    from test_faults import Fault, fail_and_resume

    fail_and_resume("budget", tmp_path, Fault(hook, at), "exception")


class OnDevice(torch.Tensor):
    """A CPU tensor that says it lives on a GPU (what the engine reads to tell a device count)."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


def test_a_count_on_the_device_is_read_with_one_warning_and_a_host_count_without() -> None:
    from lightning_accum._core.engine import WindowEngine

    engine = WindowEngine(Budget(10))
    engine.open(epoch=0, start=0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert not engine.closes_after(4, 4, None)  # (a Python int: nothing to warn about)
        assert not engine.closes_after(4, torch.tensor(3), None)  # (a CPU tensor neither)
        assert not seen
        count = torch.Tensor._make_subclass(OnDevice, torch.tensor(2))
        assert not engine.closes_after(4, count, None)  # 4 + 3 + 2 = 9 items
        assert engine.closes_after(4, count, None)  # 11 >= 10: the window closes after this one
    messages = [str(w.message) for w in seen]
    assert len(messages) == 1 and "one synchronisation per micro-batch" in messages[0]


def test_a_fabric_block_that_raised_before_its_backward_counts_once_when_retried() -> None:
    net = make_net()
    with default_dtype(torch.float64):
        fabric = Fabric(accelerator="cpu", devices=1, precision="64-true")
        model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        acc = FabricAccumulator(fabric, model, optimizer, Budget(25), normalize="items", count=count_tokens,
                                reduction="sum")  # fmt: skip
        for epoch, ranks in enumerate(epochs_of(2)):
            for i, batch in enumerate(ranks[0]):
                if (epoch, i) == (0, 3):  # (the first of the window of batches 3-4: raised, caught, retried)
                    with (
                        pytest.raises(RuntimeError, match="the data loader hiccuped"),
                        acc.accumulate(batch, epoch=epoch),
                    ):
                        raise RuntimeError("the data loader hiccuped")
                with acc.accumulate(batch, epoch=epoch) as step:
                    step.backward(token_losses(model, batch)[0])
            acc.flush()
    expected, sizes, _ = reference(epochs_of(2), lambda p: 25, optimizer="plain-sgd")
    assert max_diff([p.detach() for p in net.parameters()], expected) < 1e-12
    assert acc.progress.step == len(sizes)


# ---------------------------------------------------------------------- a window of count 0 (issue 53)
def zero_token_data() -> TokenData:
    """16 samples, 4 batches of 4: batches 1 and 2 hold no token (their masks zero)."""
    data = TokenData(16, seed=5)
    data.mask[4:12] = 0.0
    return data


def position_mean(net: Any, batch: Batch) -> torch.Tensor:
    """A micro-batch's loss: the mean squared error over every position, tokens or not (``normalize="mean"``)."""
    return ((net(batch["x"]) - batch["y"]) ** 2).mean()


def zero_count_reference(data: TokenData, scaling: str) -> list[torch.Tensor]:
    """``Budget(6, unit="items", max_k=2)`` under ``normalize="mean"`` by hand: batch 0 (its tokens reach 6), then
    batches 1 and 2 (0 tokens, closed by ``max_k``), then batch 3; each window steps with the LR times its tokens
    over the first window's n, 6 (the square root for ``"sqrt"``): 0 for the window of no token, which moves nothing.
    Two epochs."""
    net = make_net()
    opt = make_optimizer("plain-sgd", net.parameters(), 0.1)
    every = [data.batch(slice(i, i + 4)) for i in range(0, 16, 4)]
    for _ in range(2):
        for window in ([every[0]], every[1:3], [every[3]]):
            opt.zero_grad()
            sum(position_mean(net, b) / len(window) for b in window).backward()  # type: ignore[union-attr]
            ratio = sum(tokens_of(b) for b in window) / 6
            opt.param_groups[0]["lr"] = 0.1 * (ratio if scaling == "linear" else math.sqrt(ratio))
            opt.step()
    return [p.detach().clone() for p in net.parameters()]


class PositionMean(TokenModel):
    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        return position_mean(self.net, batch)


class ManualPositionMean(ManualTokenModel):
    def training_step(self, batch: Batch, batch_idx: int) -> None:
        with self.accumulate(batch) as acc:
            acc.backward(position_mean(self.net, batch))


@pytest.mark.parametrize("scaling", ["linear", "sqrt"])
@pytest.mark.parametrize("adapter", ["callback", "mixin", "fabric"])
def test_a_window_of_count_zero_steps_with_the_guides_factor_zero(adapter: str, scaling: str) -> None:
    """The guide's factor is the window's count over the first window's n: a window whose count is 0 (closed by
    ``max_k``, under ``normalize="mean"``, so stepped) gets 0, not 1.0 (a larger LR than a window of 1 to n-1 items,
    before issue 53), in every adapter."""
    data = zero_token_data()
    budget = Budget(6, unit="items", max_k=2)
    options: dict[str, Any] = dict(normalize="mean", count=count_tokens, lr_scaling=scaling)
    if adapter == "callback":
        model = PositionMean(optimizer="plain-sgd")
        trainer(callbacks=[AccumulationScheduler(budget, **options)]).fit(model, loader(data, 4))
        params = params_of(model)
    elif adapter == "mixin":
        manual = ManualPositionMean(optimizer="plain-sgd", schedule=budget, **options)
        trainer().fit(manual, loader(data, 4))
        params = params_of(manual)
    else:
        net = make_net()
        with default_dtype(torch.float64):
            fabric = Fabric(accelerator="cpu", devices=1, precision="64-true")
            wrapped, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
            acc = FabricAccumulator(fabric, wrapped, optimizer, budget, **options)
            for epoch in range(2):
                for i in range(0, 16, 4):
                    batch = data.batch(slice(i, i + 4))
                    with acc.accumulate(batch, epoch=epoch, last=i == 12) as step:
                        step.backward(position_mean(wrapped, batch))
        params = [p.detach().clone() for p in net.parameters()]
    assert max_diff(params, zero_count_reference(data, scaling)) < 1e-12


# (issue 53: a `Budget` of samples whose `n` is a function reading `Progress.items` was walked with the items growing
# as the samples do; with a `count` they do not, and the walk gave 9 steps for a fit of 8)
def by_items(progress: Progress) -> int:
    """A budget of samples that doubles once 60 items went in (the samples, or the tokens with a `count`)."""
    return 6 if progress.items < 60 else 12


def by_samples(progress: Progress) -> int:
    return 6 if progress.samples < 60 else 12


@pytest.mark.parametrize("counted", [False, True])
@pytest.mark.parametrize("kind", ["budget", "k"])
def test_a_function_reading_the_items_is_walked_where_they_are_the_samples_else_refused(
    kind: str, counted: bool
) -> None:
    """Without a `count` the items are the samples: the walk is exact. With one, the walk cannot know them: a
    function that reads them is refused (naming `Progress.items` and the fix), one that does not is walked exactly.
    The same for a `Lambda` giving k (it was walked on the same guess, with a warning)."""
    options: dict[str, Any] = {"normalize": "items", "count": count_tokens, "reduction": "sum"} if counted else {}
    for n, refused in [(by_items, counted), (by_samples, False)]:
        model, recorder = Estimating(reduction="sum" if counted else "mean"), KRecorder()
        schedule = Budget(n, unit="samples") if kind == "budget" else Lambda(lambda p, n=n: n(p) // 3)
        callback = AccumulationScheduler(schedule, **options)
        fit = trainer(callbacks=[callback, recorder])
        if refused:
            fix = r"lr_schedule=lightning_accum.lr.WarmupCosine\(warmup, total, unit='items'\)"
            with pytest.raises(ValueError, match=rf"{re.escape(repr(schedule))}.* reads `Progress.items`.*{fix}"):
                fit.fit(model, loader(DATA, BATCH))
            continue
        fit.fit(model, loader(DATA, BATCH))
        assert model.estimated == len(recorder.windows) == callback.progress.step
        assert len(set(recorder.windows)) > 1  # (the budget changed during the fit)


@pytest.mark.parametrize("kind, unit", [("tqdm", "steps"), ("rich", "batches")])
def test_progress_bars_under_a_budgets_function_reading_the_tokens(kind: str, unit: str) -> None:
    """The bars' walk refused (as above): the epoch's total worked out at each window's end, never passed, met at
    the epoch's end; the fit's total unknown. Without a `count` (the items are the samples) exact from the start."""
    from test_progress import BARS, expected, fit

    seen = fit(BARS[kind](unit), Budget(by_items, unit="samples"), count=count_tokens)
    realised = expected(seen, unit)
    assert [e["last"] for e in seen.epochs] == [(n, n) for n in realised]
    assert all(not e["passed"] for e in seen.epochs)
    assert math.isinf(seen.fit[0][1])  # (the fit's total: `?`)
    seen = fit(BARS[kind](unit), Budget(by_items, unit="samples"))
    realised = expected(seen, unit)
    assert [e["first_total"] for e in seen.epochs] == realised  # known from the epoch's start
    assert seen.fit[-1] == (sum(e["steps"] for e in seen.epochs),) * 2
