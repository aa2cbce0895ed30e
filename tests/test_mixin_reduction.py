"""``configure_accumulation(reduction=)``: a mean loss over a micro-batch's items, weighted by ``count(batch)``
(counted once per micro-batch, however many passes), on every backward path of the mixin, against the float64
token-weighted reference; and its misuse table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from test_resume import checkpoint_at
from torch import Tensor

from lightning_accum import AccumulationMixin, Constant, Piecewise, Ramp

from helpers import (
    Batch,
    ManualTokenModel,
    Reference,
    ResumableLoader,
    TokenData,
    count_tokens,
    loader,
    max_diff,
    params_of,
    rank_batches,
    token_losses,
    trainer,
)

TOL = 1e-12
SCHEDULE = Piecewise({0: 3, 2: 2}, unit="step")  # two windows of 3, then 2s: a short one at each epoch's end
DATA = TokenData(40, seed=3)  # 10 batches of 4
DATA.mask[12:16] = 0.0  # its fourth batch holds no token: a mean over nothing (NaN), weighted 0
TOKENS = int(DATA.mask.sum())


def int_tokens(batch: Batch) -> int:
    return int(batch["mask"].sum())


class Paths(ManualTokenModel):
    """The token mean through the backward paths ``ManualTokenModel`` has not: ``backward_microbatches`` (parts
    of 3 samples, each part's mean over its own tokens) and ``backward_cached`` (the net as one tower, chunks
    of 3, the loss in blocks of 2 rows: each block's part of the batch's token mean)."""

    def training_step(self, batch: Batch, batch_idx: int) -> None:
        with self.accumulate(batch) as acc:
            if self.mode == "microbatches":
                acc.backward_microbatches(lambda part: _token_mean(self.net(part["x"]), part), size=3)
                return
            tokens = batch["mask"].sum()

            def block(out: Tensor, rows: slice) -> Tensor:
                err = (out[rows] - batch["y"][rows]).squeeze(-1) ** 2 * batch["mask"][rows]
                return err.sum() / tokens

            items = tokens if self.mode == "cached_items" else None
            acc.backward_cached([self.net], [batch["x"]], block, chunk_size=3, loss_chunk_size=2, items=items)


def _token_mean(out: Tensor, batch: Batch) -> Tensor:
    err = (out - batch["y"]).squeeze(-1) ** 2 * batch["mask"]
    return err.sum() / batch["mask"].sum()


def fit(mode: str, count: Any = count_tokens, epochs: int = 2, **kwargs: Any) -> ManualTokenModel:
    cls = Paths if mode in ("microbatches", "cached", "cached_items") else ManualTokenModel
    reduction = "sum" if mode == "cached_items" else "mean"  # (the former's one call declares its `items=`)
    model = cls(mode=mode, reduction=reduction, schedule=SCHEDULE, normalize="items", count=count, **kwargs)
    assert model._accumulation.windows.config.reduction == reduction
    trainer(max_epochs=epochs).fit(model, loader(DATA, 4))
    return model


@pytest.mark.parametrize("count", [count_tokens, int_tokens], ids=["tensor count", "int count"])
@pytest.mark.parametrize("mode", ["backward", "each", "heads", "microbatches", "cached", "cached_items"])
def test_a_mean_loss_is_weighted_by_its_count(mode: str, count: Any) -> None:
    """``acc.backward(mean)`` and every other path: the token-weighted windows to 1e-12, the batch without tokens
    adding nothing (its NaN kept out), and each micro-batch's tokens counted once (``each``, ``heads`` and the
    cached blocks make several passes; the parts of ``backward_microbatches`` count their own). ``cached_items``:
    one ``backward_cached(items=)`` of several loss blocks declares its items once (they were added to
    ``count(batch)`` before issue 35, where ``count`` was given too)."""
    model = fit(mode, count)
    expected, sizes = Reference(SCHEDULE, normalize="items").run([rank_batches(DATA, 4)] * 2)
    assert max_diff(params_of(model), expected) <= TOL
    assert model.accumulation_progress.items == 2 * TOKENS  # not twice that for two passes
    assert model.accumulation_progress.step == len(sizes)


def test_the_same_as_items_per_pass_and_as_the_callback_s_sum() -> None:
    """``reduction="mean"`` is ``items=count(batch)`` on each pass, and ``reduction="sum"`` of the summed loss."""
    mean = fit("backward")
    declared = ManualTokenModel(mode="items_arg", schedule=SCHEDULE, normalize="items")  # (no `count`: `items=`)
    trainer(max_epochs=2).fit(declared, loader(DATA, 4))
    summed = ManualTokenModel(reduction="sum", schedule=SCHEDULE, normalize="items", count=count_tokens)
    trainer(max_epochs=2).fit(summed, loader(DATA, 4))
    assert max_diff(params_of(mean), params_of(declared)) <= TOL
    assert max_diff(params_of(mean), params_of(summed)) <= TOL


class Mixed(ManualTokenModel):
    """Under ``reduction="mean"``: an LM pass (a mean over the batch's tokens, weighted by ``count(batch)``) and an
    auxiliary pass with ``items=`` of its own (the mean error on the first token of each sample): the window holds
    ``count(batch) + n_aux`` items."""

    def training_step(self, batch: Batch, batch_idx: int) -> None:
        with self.accumulate(batch) as acc:
            total, tokens = token_losses(self.net, batch)
            acc.backward(total / tokens)
            first = (self.net(batch["x"][:, 0]) - batch["y"][:, 0]).squeeze(-1) ** 2
            acc.backward(first.mean(), items=len(first))


class AllDeclared(Mixed):
    """``Mixed`` with the LM pass declaring its ``items=`` too: no pass leaves its items to ``count(batch)``, which is
    then added by none (the window holds the same ``count(batch) + n_aux`` items)."""

    def training_step(self, batch: Batch, batch_idx: int) -> None:
        with self.accumulate(batch) as acc:
            total, tokens = token_losses(self.net, batch)
            acc.backward(total / tokens, items=tokens)
            first = (self.net(batch["x"][:, 0]) - batch["y"][:, 0]).squeeze(-1) ** 2
            acc.backward(first.mean(), items=len(first))


@pytest.mark.parametrize("model_type", [Mixed, AllDeclared])
def test_a_pass_with_items_adds_its_own_beside_the_count(model_type: type[Mixed]) -> None:
    model = model_type(schedule=Constant(2), normalize="items", count=count_tokens, reduction="mean")
    data = TokenData(16)
    trainer(max_epochs=1).fit(model, loader(data, 4))
    assert model.accumulation_progress.items == int(data.mask.sum()) + 16
    # the float64 reference: each window's (token errors + first-token errors) over (tokens + samples)
    net = Mixed(schedule=1).net
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    batches = rank_batches(data, 4)[0]
    for window in (batches[:2], batches[2:]):
        n = sum(float(b["mask"].sum()) + len(b["x"]) for b in window)
        loss = sum(
            token_losses(net, b)[0] + ((net(b["x"][:, 0]) - b["y"][:, 0]) ** 2).sum() for b in window
        ) / n  # fmt: skip
        opt.zero_grad()
        loss.backward()  # type: ignore[union-attr]
        opt.step()
    assert max_diff(params_of(model), [p.detach() for p in net.parameters()]) <= TOL


@pytest.mark.parametrize("stop", [3, "epoch_end"])
def test_resume_equals_uninterrupted(tmp_path: Path, stop: int | str) -> None:
    """Nothing of ``reduction`` is saved: a resumed run configures it again, and goes on exactly."""
    schedule = Ramp(1, 5, over=160, unit="items")

    def run(ckpt: Path | None = None, resume: Path | None = None) -> ManualTokenModel:
        options = {"normalize": "items", "count": count_tokens}
        model = ManualTokenModel(mode="each", reduction="mean", schedule=schedule, **options)
        every = [ModelCheckpoint(dirpath=ckpt, every_n_train_steps=1, save_top_k=-1, filename="{epoch}-{step}")]
        t = trainer(callbacks=every if ckpt else [], max_epochs=2, enable_checkpointing=ckpt is not None)
        t.fit(model, ResumableLoader(DATA, 4), ckpt_path=resume)
        return model

    full = run(ckpt=tmp_path)
    resumed = run(resume=checkpoint_at(tmp_path, stop))
    assert max_diff(params_of(resumed), params_of(full)) <= TOL
    assert resumed.accumulation_progress == full.accumulation_progress


# ---------------------------------------------------------------------------- misuse


class Configured(AccumulationMixin):
    def __init__(self) -> None:
        super().__init__()
        self.configure_accumulation(2, normalize="items", count=count_tokens, reduction="sum")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"reduction": "Mean"}, ValueError, r"`reduction` must be 'sum' or 'mean' .* got 'Mean' \(lower case"),
        ({"reduction": " sum"}, ValueError, r"got ' sum' \(lower case, no spaces: 'sum'\)"),
        ({"reduction": "avg"}, ValueError, r"got 'avg' \(did you mean 'mean'\?\).*give 'mean' for a mean"),
        ({"reduction": "none"}, ValueError, r"`reduction='none'` in torch, is not taken: reduce it"),
        ({"reduction": ""}, ValueError, r"`reduction` must be 'sum' or 'mean'"),
        ({"reduction": 0}, TypeError, r"`reduction` must be the string 'sum' or 'mean' .* got 0 \(a int\)"),
        ({"reduction": 1.0}, TypeError, r"`reduction` must be the string .* got 1.0 \(a float\)"),
        ({"reduction": float("nan")}, TypeError, r"`reduction` must be the string .* got nan"),
        ({"reduction": True}, TypeError, r"got True \(a bool\)"),
        ({"reduction": ["mean"]}, TypeError, r"got \['mean'\] \(a list\)"),
        ({"reduction": None}, ValueError, r"`normalize='items'` needs `reduction`: what `acc.backward\(loss\)` gets"),
        ({"reduction": "mean", "normalize": "mean"}, ValueError, r"only `normalize='items'` .* leave `reduction` out"),
        ({"reduction": "sum", "normalize": "mean", "count": None}, ValueError, r"only `normalize='items'`"),
        ({"reduction": "mean", "count": None}, ValueError, r"`reduction='mean'` .* no `count` was given: give `count="),
        ({"reduction": "sum", "count": None}, ValueError, r"no `count` .*`acc.backward\(mean_loss, items=n\)`"),
        ({"count": 3}, TypeError, r"`count` must be a function"),
    ],
)  # fmt: skip
def test_bad_reductions_are_refused_and_the_config_kept(kwargs: dict[str, Any], error: type, match: str) -> None:
    model = Configured()
    options = {"normalize": "items", "count": count_tokens, **kwargs}
    with pytest.raises(error, match=match):
        model.configure_accumulation(2, **options)
    config = model._accumulation.windows.config
    assert (config.normalize, config.count, config.reduction) == ("items", count_tokens, "sum")  # as it was


def test_what_needs_no_reduction() -> None:
    """``normalize="mean"`` (with or without ``count``) and ``"items"`` whose passes all give ``items=``."""
    model = Configured()
    for options in ({}, {"count": count_tokens}, {"normalize": "items"}):
        model.configure_accumulation(2, **options)
        assert model._accumulation.windows.config.reduction is None


class BadCount(ManualTokenModel):
    """``count(batch)`` (or ``count(part)``, with ``parts``) gives ``value`` from the second batch on."""

    def __init__(self, value: Any, parts: bool) -> None:
        self.value, self.parts, self.seen = value, parts, 0
        super().__init__(schedule=3, normalize="items", count=self._count, reduction="mean")
        self.before: list[Tensor] = []

    def _count(self, batch: Batch) -> Any:
        return self.value if self.seen >= 1 else batch["mask"].sum()

    def training_step(self, batch: Batch, batch_idx: int) -> None:
        self.before = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in self.net.parameters()]
        with self.accumulate(batch) as acc:
            self.seen += 1
            if self.parts:
                acc.backward_microbatches(lambda part: _token_mean(self.net(part["x"]), part), size=2)
            else:
                total, tokens = token_losses(self.net, batch)
                acc.backward(total / tokens)


@pytest.mark.parametrize("parts", [False, True], ids=["count(batch)", "count(part)"])
@pytest.mark.parametrize(
    ("value", "match"),
    [
        (-1, r"item count \(from `count.*`\) was -1"),
        (2.5, r"item count \(from `count.*`\) was 2.5"),
        (True, r"item count \(from `count.*`\) was True"),
        ("3", r"item count \(from `count.*`\) was '3'"),
        (torch.ones(2), r"`count.*` returned a tensor of shape \(2,\)"),
    ],
)
def test_a_bad_count_is_refused_before_it_weighs_a_gradient(parts: bool, value: Any, match: str) -> None:
    model = BadCount(value, parts)
    with pytest.raises(ValueError, match=match):
        trainer(max_epochs=1).fit(model, loader(TokenData(12), 4))
    after = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.net.parameters()]
    assert max_diff(after, model.before) == 0  # the window's gradient holds the first batch only
