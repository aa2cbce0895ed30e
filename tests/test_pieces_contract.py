"""``microbatch_size`` where it meets ordinary Lightning code (issue 42): a param group added during the fit, a
``training_step`` that changes its batch, and the refusals that must come before any gradient changes. Each
run is checked against a plain float64 loop written here, which forms the same windows of whole loader
batches by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from torch import Tensor

from lightning_accum import AccumulationMixin, AccumulationScheduler, Constant, GradientDecay
from lightning_accum.fabric import FabricAccumulator

from helpers import (
    Reference,
    TokenData,
    TokenModel,
    count_tokens,
    default_dtype,
    loader,
    make_net,
    rank_batches,
    token_losses,
    trainer,
)

K, BATCH, EPOCHS = 3, 8, 2  # 48 samples: 6 loader batches an epoch, 2 windows of 3


class Unfreezing(TokenModel):
    """The head is trained from the start; the first layer (frozen) joins the optimizer as a param group of its
    own at ``at`` = (epoch, batch_idx), as ``BaseFinetuning`` unfreezes a backbone."""

    def __init__(self, at: tuple[int, int] = (1, 0), **kwargs: Any) -> None:
        super().__init__(optimizer="plain-sgd", **kwargs)
        self.at = at
        self.net[0].requires_grad_(False)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.net[2].parameters(), lr=0.1)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if (self.current_epoch, batch_idx) == self.at:
            self.net[0].requires_grad_(True)
            self.optimizers().optimizer.add_param_group({"params": list(self.net[0].parameters()), "lr": 0.05})


def unfreezing_reference(
    data: TokenData, at: tuple[int, int], k: int = K, decay: float | None = None, items: bool = False
) -> list[Tensor]:
    """Windows of ``k`` whole loader batches (an epoch's last may be short), each the mean of its batches' token
    means (``items``: the window's token mean); the first layer joins at ``at`` (the window it joins in takes
    its gradient from its batches only);
    ``decay``: each window's gradient plus ``decay`` times the last's (``GradientDecay(decay)``)."""
    net = make_net()
    net[0].requires_grad_(False)
    opt = torch.optim.SGD(net[2].parameters(), lr=0.1)
    batches = rank_batches(data, BATCH)[0]
    residual: dict[Tensor, Tensor] = {}
    for epoch in range(EPOCHS):
        for start in range(0, len(batches), k):
            window = range(start, min(start + k, len(batches)))
            opt.zero_grad(set_to_none=True)
            window_tokens = sum(batches[i]["mask"].sum() for i in window)
            for i in window:
                if (epoch, i) == at:
                    net[0].requires_grad_(True)
                    opt.add_param_group({"params": list(net[0].parameters()), "lr": 0.05})
                total, tokens = token_losses(net, batches[i])
                (total / window_tokens if items else total / tokens / len(window)).backward()
            if decay is not None:
                for group in opt.param_groups:
                    for p in group["params"]:
                        if p.grad is not None and p in residual:
                            p.grad = p.grad + decay * residual[p]
                        if p.grad is not None:
                            residual[p] = p.grad.clone()
            opt.step()
    return [p.detach().clone() for p in net.parameters()]


def diff(model: pl.LightningModule, want: list[Tensor]) -> float:
    return max(float((p.detach() - w).abs().max()) for p, w in zip(model.parameters(), want, strict=True))


@pytest.mark.parametrize(("k", "at"), [(3, (1, 0)), (3, (0, 4)), (1, (1, 0))])
def test_a_param_group_added_during_the_fit_takes_every_piece(k: int, at: tuple[int, int]) -> None:
    """Added at an epoch's start (a window's first batch: the pieces' gradient set aside across Lightning's zeroing
    must hold the new parameters too), or inside a window (k=3, batch 4: the window's earlier batches gave the new
    parameters nothing, as in the reference); k=1: every batch is a window's first."""
    data = TokenData(48, ragged=False)
    model = Unfreezing(at)
    cb = AccumulationScheduler(Constant(k), microbatch_size=3)
    trainer(callbacks=[cb], max_epochs=EPOCHS).fit(model, loader(data, BATCH))
    want = unfreezing_reference(data, at, k)
    assert diff(model, want) <= 1e-12
    assert not torch.equal(model.net[0].weight, make_net()[0].weight)  # (the first layer moved)


def test_gradient_decay_takes_a_param_group_added_during_the_fit() -> None:
    """The residual covers the parameters it was taken from; a group added later starts without one (it used to
    fail with a `zip` length error at the first step after the group joined)."""
    data = TokenData(48, ragged=False)
    model = Unfreezing((1, 0))
    cb = AccumulationScheduler(Constant(K), microbatch_size=3)
    trainer(callbacks=[cb, GradientDecay(0.5)], max_epochs=EPOCHS).fit(model, loader(data, BATCH))
    assert diff(model, unfreezing_reference(data, (1, 0), decay=0.5)) <= 1e-12


class Popping(TokenModel):
    """``training_step`` takes the mask out of its batch (``labels = batch.pop("labels")``), as HF code does."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        mask = batch.pop("mask")
        total = ((self.net(batch["x"]) - batch["y"]).squeeze(-1) ** 2 * mask).sum()
        return total / mask.sum()


def count_or_positions(batch: Any) -> Tensor:
    """The mask's tokens, or (as ``causal_lm_tokens`` falls back to the attention mask) every position."""
    if "mask" in batch:
        return batch["mask"].sum()
    return torch.tensor(batch["x"].shape[0] * batch["x"].shape[1], dtype=torch.float64)


def test_each_piece_is_counted_before_training_step_changes_it() -> None:
    data = TokenData(48)
    model = Popping()
    cb = AccumulationScheduler(
        Constant(K), normalize="items", reduction="mean", count=count_or_positions, microbatch_size=3
    )
    trainer(callbacks=[cb], max_epochs=EPOCHS).fit(model, loader(data, BATCH))
    want, _ = Reference(Constant(K), normalize="items", optimizer="sgd").run([rank_batches(data, BATCH)] * EPOCHS)
    assert diff(model, want) <= 1e-12


# ---------------------------------------------------------------------------- refusals before any change
class Recording(TokenModel):
    """Records whether any backward pass ran (a hook on every parameter)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.backward_passes = 0
        for p in self.parameters():
            p.register_hook(self._seen)

    def _seen(self, grad: Tensor) -> None:
        self.backward_passes += 1


def refused_before_any_change(cb: AccumulationScheduler, data: Any, match: str, error: type = ValueError) -> None:
    model = Recording(reduction="mean")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(error, match=match):
        trainer(callbacks=[cb], max_epochs=1).fit(model, data)
    assert model.backward_passes == 0
    assert all(torch.equal(p, b) and p.grad is None for p, b in zip(model.parameters(), before, strict=True))


COUNTS: list[tuple[Callable[[Any], Any], str]] = [
    (lambda b: -1, r"count\(batch\)`\) was -1"),
    (lambda b: 2.5, r"count\(batch\)`\) was 2.5"),
    (lambda b: b["mask"].sum() > 0, r"count\(batch\)` returned a torch.bool tensor"),
    (lambda b: b["mask"].sum(1), r"count\(batch\)` returned a tensor of shape \(8,\).*rather than `.sum\(1\)`"),
]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(("count", "match"), COUNTS)
def test_a_wrong_count_is_refused_before_any_piece(reduction: str, count: Any, match: str) -> None:
    cb = AccumulationScheduler(2, normalize="items", reduction=reduction, count=count, microbatch_size=3)
    refused_before_any_change(cb, loader(TokenData(16), BATCH), match)


def test_a_wrong_count_of_a_later_piece_is_refused_before_the_first_piece() -> None:
    """``count(piece)``: the batch's count is fine, the second piece's is negative."""

    def count(batch: Any) -> Any:
        return batch["mask"].sum() if len(batch["x"]) != 3 or batch["x"][0, 0, 0] != first else -1

    data = TokenData(16)
    first = data.x[3, 0, 0]  # (the second piece of 3 of the first batch starts at sample 3)
    cb = AccumulationScheduler(2, normalize="items", reduction="mean", count=count, microbatch_size=3)
    refused_before_any_change(cb, loader(data, BATCH), r"count\(piece\)` of a micro-batch cut by `microbatch_size`")


# ---------------------------------------------------------------------------- the other adapters, the same group
class UnfreezingManual(AccumulationMixin, pl.LightningModule):
    """The mixin's ``backward_microbatches`` (pieces of 3) with the same param group joining at ``at``."""

    def __init__(self, at: tuple[int, int]) -> None:
        super().__init__()
        self.net, self.at = make_net(), at
        self.net[0].requires_grad_(False)
        self.configure_accumulation(schedule=Constant(K), normalize="items", count=count_tokens, reduction="mean")

    def training_step(self, batch: Any, batch_idx: int) -> None:
        if (self.current_epoch, batch_idx) == self.at:
            self.net[0].requires_grad_(True)
            self.optimizers().optimizer.add_param_group({"params": list(self.net[0].parameters()), "lr": 0.05})
        with self.accumulate(batch) as acc:
            acc.backward_microbatches(lambda part: token_losses(self.net, part)[0] / token_losses(self.net, part)[1], 3)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.net[2].parameters(), lr=0.1)


@pytest.mark.parametrize("at", [(1, 0), (0, 4)])
def test_the_mixin_takes_a_param_group_added_during_the_fit(at: tuple[int, int]) -> None:
    """A token-weighted window (scaled at its end, where a cached parameter set would miss the new group)."""
    data = TokenData(48)
    model = UnfreezingManual(at)
    trainer(max_epochs=EPOCHS).fit(model, loader(data, BATCH))
    assert diff(model, unfreezing_reference(data, at, items=True)) <= 1e-12


@pytest.mark.parametrize("at", [(1, 0), (0, 4)])
def test_the_fabric_helper_takes_a_param_group_added_during_the_loop(at: tuple[int, int]) -> None:
    fabric = Fabric(accelerator="cpu", devices=1, precision="64-true")
    net = make_net()
    net[0].requires_grad_(False)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net[2].parameters(), lr=0.1))
    acc = FabricAccumulator(
        fabric, model, optimizer, Constant(K), normalize="items", count=count_tokens, reduction="sum"
    )
    data = TokenData(48)
    with default_dtype(torch.float64):
        for epoch in range(EPOCHS):
            for i, batch in enumerate(rank_batches(data, BATCH)[0]):
                if (epoch, i) == at:
                    net[0].requires_grad_(True)
                    optimizer.add_param_group({"params": list(net[0].parameters()), "lr": 0.05})
                with acc.accumulate(batch, epoch=epoch) as step:
                    step.backward(token_losses(model, batch)[0])
            acc.flush()
    want = unfreezing_reference(data, at, items=True)
    assert max(float((p.detach() - w).abs().max()) for p, w in zip(net.parameters(), want, strict=True)) <= 1e-12


# ---------------------------------------------------------------------------- split=: what is cut, what is whole
W = torch.linspace(0.5, 1.5, 5, dtype=torch.float64)  # a per-position weight: its dim 0 (5) is the batch size's


def with_weight(samples: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    batch = torch.utils.data.default_collate(samples)
    return {**batch, "w": W}


def weighted_loader(data: TokenData) -> torch.utils.data.DataLoader[Any]:
    return torch.utils.data.DataLoader(data, batch_size=5, collate_fn=with_weight)  # 48 samples: 9 of 5, then 3


class Weighted(TokenModel):
    """A sample mean of the position-weighted squared error (full masks)."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        err = (self.net(batch["x"]) - batch["y"]).squeeze(-1) ** 2
        return (err * batch["w"]).sum() / err.numel()


def keep_w(path: tuple[Any, ...], leaf: Any) -> bool:
    return path != ("w",)


def weighted_reference(data: TokenData) -> list[Tensor]:
    """Windows of 2 whole loader batches of 5 (the weight whole in each), the mean of their sample means."""
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    batches = [with_weight([data[i] for i in range(s, min(s + 5, 48))]) for s in range(0, 48, 5)]
    for start in range(0, len(batches), 2):
        window = batches[start : start + 2]
        opt.zero_grad()
        for b in window:
            err = (net(b["x"]) - b["y"]).squeeze(-1) ** 2
            ((err * b["w"]).sum() / err.numel() / len(window)).backward()
        opt.step()
    return [p.detach() for p in net.parameters()]


def test_split_gives_a_leaf_whole_to_every_piece() -> None:
    data = TokenData(48, ragged=False)
    model = Weighted()
    cb = AccumulationScheduler(Constant(2), microbatch_size=2, split=keep_w)
    trainer(callbacks=[cb], max_epochs=1).fit(model, weighted_loader(data))
    assert diff(model, weighted_reference(data)) <= 1e-12
    assert cb.progress.samples == 48  # (the rows of what is cut; not the weight's 5 at the short batch)


class WeightedManual(AccumulationMixin, pl.LightningModule):
    def __init__(self, split: Any = keep_w) -> None:
        super().__init__()
        self.net, self.rule = make_net(), split
        self.configure_accumulation(schedule=Constant(2))

    def _loss(self, part: Any) -> Tensor:
        err = (self.net(part["x"]) - part["y"]).squeeze(-1) ** 2
        return (err * part["w"]).sum() / err.numel()

    def training_step(self, batch: Any, batch_idx: int) -> None:
        with self.accumulate(batch) as acc:
            acc.backward_microbatches(self._loss, 2, split=self.rule)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.net.parameters(), lr=0.1, momentum=0.9)


def test_backward_microbatches_takes_split() -> None:
    data = TokenData(48, ragged=False)
    model = WeightedManual()
    trainer(max_epochs=1).fit(model, weighted_loader(data))
    assert diff(model, weighted_reference(data)) <= 1e-12
    bad = WeightedManual(split="w")
    before = [p.detach().clone() for p in bad.parameters()]
    with pytest.raises(TypeError, match=r"`split` of `backward_microbatches` must be None"):
        trainer(max_epochs=1).fit(bad, weighted_loader(data))
    assert all(torch.equal(p, b) and p.grad is None for p, b in zip(bad.parameters(), before, strict=True))


def test_a_tensor_matching_the_batch_by_chance_is_cut_and_refused_where_it_stops_matching() -> None:
    """The default rule: every tensor is one row per sample; the weight is cut at every full batch and refused at
    the short last one, before any piece of it, with the fix (`split=`)."""
    seen: list[int] = []

    class Ignoring(TokenModel):
        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            seen.append(len(batch["w"]))
            return super().training_step(batch, batch_idx)

    cb = AccumulationScheduler(Constant(2), microbatch_size=2)
    with pytest.raises(ValueError, match=r"batch\['w'\]: 5.*give `split=lambda path, leaf: ...` returning False"):
        trainer(callbacks=[cb], max_epochs=1).fit(Ignoring(), weighted_loader(TokenData(48, ragged=False)))
    assert seen == [2, 2, 1] * 9  # (cut: a per-sample tensor as far as its shape tells)


SPLIT_MISUSE: list[tuple[Any, type, str]] = [
    ("w", TypeError, r"`split` of `AccumulationScheduler` must be None .* or a function"),
    (1, TypeError, r"`split` of `AccumulationScheduler` must be None"),
    (True, TypeError, r"`split` of `AccumulationScheduler` must be None"),
    (dict, TypeError, r"`split` of `AccumulationScheduler` must be None"),  # a type, not a rule
]


@pytest.mark.parametrize(("split", "error", "match"), SPLIT_MISUSE)
def test_split_refused_at_construction(split: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        AccumulationScheduler(2, microbatch_size=2, split=split)


def test_split_without_microbatch_size_is_refused() -> None:
    with pytest.raises(ValueError, match=r"`split` says how `microbatch_size` cuts .* give `microbatch_size` too"):
        AccumulationScheduler(2, split=keep_w)


SPLIT_AT_THE_FIRST_BATCH: list[tuple[Any, type, str]] = [
    (lambda path, leaf: None, TypeError, r"`split` returned None for `batch\['x'\]`; it must return True"),
    (lambda path, leaf: 1, TypeError, r"`split` returned 1 for"),
    (lambda path, leaf: torch.tensor(True), TypeError, r"`split` returned tensor\(True\)"),
    (lambda path, leaf: True, ValueError, r"differ in size along dim 0.*batch\['w'\]: 5"),  # (the last batch)
    (lambda path, leaf: False, ValueError, r"`split` returned False for every leaf"),
]


@pytest.mark.parametrize(("split", "error", "match"), SPLIT_AT_THE_FIRST_BATCH)
def test_split_misuse_refused_before_any_change(split: Any, error: type, match: str) -> None:
    data = TokenData(48, ragged=False)
    if "batch\\['w'\\]: 5" in match:  # a weight of 5 beside batches of 4: refused at the first
        data_loader = torch.utils.data.DataLoader(data, batch_size=4, collate_fn=with_weight)
    else:
        data_loader = weighted_loader(data)
    cb = AccumulationScheduler(2, microbatch_size=2, split=split)
    refused_before_any_change(cb, data_loader, match, error)


def test_split_true_for_a_leaf_that_cannot_be_cut_is_refused() -> None:
    def collate(samples: list[dict[str, Tensor]]) -> dict[str, Any]:
        return {**torch.utils.data.default_collate(samples), "task": "lm", "scale": torch.tensor(2.0)}

    data = torch.utils.data.DataLoader(TokenData(16), batch_size=8, collate_fn=collate)
    for name, what in (("task", "a str"), ("scale", "a 0-d tensor")):
        cb = AccumulationScheduler(
            2, microbatch_size=2, split=lambda path, leaf, name=name: path == (name,) or path[0] in "xym"
        )
        refused_before_any_change(cb, data, rf"`split` returned True for `batch\['{name}'\]`, {what}", TypeError)


def test_the_mixin_takes_split_on_both_calls() -> None:
    model = UnfreezingManual((9, 9))
    batch = with_weight([TokenData(5)[i] for i in range(5)])
    parts = model.microbatches(batch, 2, split=keep_w)
    assert [len(p["x"]) for p in parts] == [2, 2, 1] and all(p["w"] is W for p in parts)
    with pytest.raises(TypeError, match=r"`split` of `microbatches` must be None"):
        model.microbatches(batch, 2, split="w")
    with pytest.raises(ValueError, match=r"differ in size along dim 0.*give `split="):
        model.microbatches({**batch, "w": W[:4]}, 2)
