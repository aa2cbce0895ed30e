"""Checkpoint and resume: a run stopped at any optimizer step continues as if uninterrupted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_accum import AccumulationScheduler, Ramp

from helpers import (
    KRecorder,
    Reference,
    ResumableLoader,
    TokenData,
    TokenModel,
    count_tokens,
    max_diff,
    params_of,
    rank_batches,
    trainer,
)

SCHEDULE = Ramp(1, 5, over=160, unit="items")


def scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.8)


def run(ckpt_dir: Path | None = None, resume: Path | None = None) -> TokenModel:
    model = TokenModel(reduction="sum", scheduler=scheduler, optimizer="adam", lr=0.01)
    callbacks = [
        AccumulationScheduler(SCHEDULE, normalize="items", reduction="sum", count=count_tokens, lr_scaling="sqrt")
    ]
    if ckpt_dir is not None:
        callbacks.append(
            ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=-1, filename="{epoch}-{step}")
        )
    t = trainer(callbacks=callbacks, max_epochs=3, enable_checkpointing=ckpt_dir is not None)
    t.fit(model, ResumableLoader(TokenData(50), 4), ckpt_path=resume)
    return model


def checkpoint_at(directory: Path, stop: int | str) -> Path:
    """The checkpoint after optimizer step ``stop``, or after the last step of epoch 0."""
    steps = {int(p.stem.split("step=")[1]): p for p in directory.glob("*.ckpt")}
    if stop == "epoch_end":
        stop = max(int(p.stem.split("step=")[1]) for p in directory.glob("epoch=0-*.ckpt"))
    return steps[int(stop)]


# inside the ramp; mid-epoch; in the second epoch; at an epoch's end
@pytest.mark.parametrize("stop", [2, 5, 9, "epoch_end"])
def test_resume_equals_uninterrupted(tmp_path: Path, stop: int | str) -> None:
    full = run(ckpt_dir=tmp_path)
    path = checkpoint_at(tmp_path, stop)
    resumed = run(resume=path)
    assert max_diff(params_of(resumed), params_of(full)) <= 1e-12
    expected, _ = Reference(
        SCHEDULE, normalize="items", scheduler=scheduler, optimizer="adam", lr=0.01, lr_scaling="sqrt"
    ).run([rank_batches(TokenData(50), 4)] * 3)
    assert max_diff(params_of(full), expected) <= 1e-12
    state = torch.load(path, weights_only=False)["callbacks"]["AccumulationScheduler"]
    assert state["progress"]["step"] == int(path.stem.split("step=")[1])


class Skipping(TokenModel):
    """Returns no loss at the batches of `skip` (Lightning then runs no backward pass), and ends the epoch at
    `cut` (`on_train_batch_start` returning -1)."""

    def __init__(self, skip: set[tuple[int, int]] = set(), cut: tuple[int, int] | None = None) -> None:  # noqa: B006
        super().__init__()
        self.skip, self.cut = skip, cut

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return None if (self.current_epoch, batch_idx) in self.skip else super().training_step(batch, batch_idx)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        return -1 if (self.current_epoch, batch_idx) == self.cut else None


class SaveAt(pl.Callback):
    def __init__(self, at: tuple[int, int], path: Path) -> None:
        self.at, self.path = at, path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if (trainer.current_epoch, args[-1]) == self.at:
            trainer.save_checkpoint(self.path)


# (saved at batch 4 of the window of batches 3-5, k = 3; the window's batches after it run no backward pass, or
# the epoch is cut short at batch 5 and the window discarded: the resumed gradient is put back where the window
# steps, or dropped with it, never into the next window)
@pytest.mark.parametrize(
    "skip, cut", [({(0, 5)}, None), ({(0, 4), (0, 5)}, None), (set(), (0, 5))], ids=["last", "both", "cut"]
)
def test_resume_inside_a_window_whose_batches_after_it_run_no_backward(
    tmp_path: Path, skip: set[tuple[int, int]], cut: tuple[int, int] | None
) -> None:
    at = (0, 3) if (0, 4) in skip else (0, 4)
    path = tmp_path / "inside.ckpt"
    full, resumed = Skipping(skip, cut), Skipping(skip, cut)
    t = trainer(callbacks=[AccumulationScheduler(3), SaveAt(at, path)], max_epochs=2)
    t.fit(full, ResumableLoader(TokenData(40), 4))
    t = trainer(callbacks=[AccumulationScheduler(3)], max_epochs=2)
    t.fit(resumed, ResumableLoader(TokenData(40), 4), ckpt_path=path)
    assert max_diff(params_of(resumed), params_of(full)) <= 1e-12


def test_a_window_resumed_under_other_normalize_or_reduction_is_refused(tmp_path: Path) -> None:
    """Its partial gradient was summed under the options it was saved with (mean: 0.013 off, silently, before);
    another schedule is taken up at the next window (the open one keeps its k)."""
    path = tmp_path / "inside.ckpt"
    data = TokenData(48, ragged=False)
    full = TokenModel(optimizer="plain-sgd")
    saving = [AccumulationScheduler(3), SaveAt((0, 4), path)]
    trainer(callbacks=saving, max_epochs=1).fit(full, ResumableLoader(data, 4))
    items = AccumulationScheduler(3, normalize="items", count=lambda b: 5 * len(b["x"]), reduction="mean")
    refused = r"normalize='mean', reduction=None; this run has normalize='items', reduction='mean'"
    with pytest.raises(ValueError, match=refused):
        trainer(callbacks=[items], max_epochs=1).fit(TokenModel(), ResumableLoader(data, 4), ckpt_path=path)
    resumed = TokenModel(optimizer="plain-sgd")
    trainer(callbacks=[AccumulationScheduler(3)], max_epochs=1).fit(resumed, ResumableLoader(data, 4), ckpt_path=path)
    assert max_diff(params_of(resumed), params_of(full)) == 0.0
    other, recorder = AccumulationScheduler(2), KRecorder()
    trainer(callbacks=[other, recorder], max_epochs=1).fit(TokenModel(), ResumableLoader(data, 4), ckpt_path=path)
    assert recorder.windows == [1, 2, 2, 2]  # the open window (k = 3) ends at batch 5, then k = 2


class _TwoSameRanks:
    """Two ranks, the other one's gather the same as this one's."""

    world_size = 2
    root_device = torch.device("cpu")

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.stack([tensor, tensor])


@pytest.mark.parametrize("widened", [False, True])
def test_a_checkpoint_inside_a_window_on_two_ranks_keeps_each_ranks_partial_in_its_accumulation_dtype(
    widened: bool,
) -> None:
    """On several ranks every rank's partial gradient is gathered into the checkpoint, in the dtype the window
    keeps it in: ``grad_accum_dtype``'s float32 sum of a bfloat16 parameter stays float32 (1 + 2^-10 is no
    bfloat16), the others their own dtype; against the sums by hand."""
    from lightning_accum._core.checkpoint import save_partial
    from lightning_accum._core.wide import WideSums

    narrow = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    plain = torch.nn.Parameter(torch.zeros(2))
    sums = WideSums(torch.float32) if widened else None
    if sums is not None:
        sums.attach([narrow, plain])
    passes = [torch.tensor([1.0, 2.0**-10]), torch.tensor([2.0**-10, 3.0])]
    for weight in passes:
        ((narrow * weight.bfloat16()).sum() + (plain * weight).sum()).backward()
    state = save_partial(_TwoSameRanks(), [4.0, 2.0], [narrow, plain], wide=sums)
    expected_narrow = sum(w.bfloat16().float() for w in passes) if widened else sum(w.bfloat16() for w in passes)
    assert state["world_size"] == 2 and len(state["ranks"]) == 2
    for numbers, (g_narrow, g_plain) in state["ranks"]:
        assert numbers == [4.0, 2.0]
        assert g_narrow.dtype == (torch.float32 if widened else torch.bfloat16)
        assert torch.equal(g_narrow, expected_narrow) and torch.equal(g_plain, passes[0] + passes[1])


def test_a_partial_gradient_restored_into_more_parameters_leaves_the_new_ones_without() -> None:
    """A param group added since the checkpoint (``BaseFinetuning``'s, at the batch the fit resumed at) comes after
    the saved parameters: they get their saved gradients back, exactly, and the new ones none."""
    from lightning_accum._core.checkpoint import restore_partial

    params = [
        torch.nn.Parameter(torch.zeros(2)),
        torch.nn.Parameter(torch.zeros(3)),
        torch.nn.Parameter(torch.zeros(1)),
    ]
    saved = [torch.tensor([1.0, -2.0])]
    restore_partial(params, saved)
    assert torch.equal(params[0].grad, saved[0]) and params[0].grad is not saved[0]
    assert params[1].grad is None and params[2].grad is None


def test_a_forgotten_partial_window_leaves_nothing_waiting() -> None:
    """``pending`` (read before every backward pass: the hooks' short path needs it ``False``) is ``False`` before any
    partial gradient was loaded, once it is put back, and once the window it waited for is forgotten."""
    from lightning_accum._core.checkpoint import PartialWindow

    param = torch.nn.Parameter(torch.zeros(2))
    assert PartialWindow().pending is False
    for put_back in (True, False):
        partial = PartialWindow()
        partial.load({"grads": [torch.tensor([1.0, 2.0])], "world_size": 1})
        assert partial.numbers(strategy=None, rank=0) is None and partial.pending
        if put_back:
            assert partial.put_back([param]) is not None
        else:
            partial.forget()
            assert partial.put_back([param]) is None
        assert not partial.pending
    # a checkpoint loaded over one still waiting, with or without a partial gradient of its own: nothing waits till
    # train start reads it
    for state in ({"window": None}, {"grads": [torch.tensor([1.0, 2.0])], "world_size": 1}):
        partial = PartialWindow()
        partial.load({"grads": [torch.tensor([3.0, 4.0])], "world_size": 1})
        partial.numbers(strategy=None, rank=0)
        partial.load(state)
        assert not partial.pending
        assert partial.numbers(strategy=None, rank=0) is None and partial.pending is ("grads" in state)
