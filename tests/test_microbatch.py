"""Splitting batches into micro-batches, and the out-of-memory back-off, with an injected OOM."""

from __future__ import annotations

import dataclasses
from collections import namedtuple
from typing import Any

import pytest
import torch

from lightning_accum import Piecewise
from lightning_accum._core.microbatch import OOM_ERRORS, batch_length, is_oom, split

from helpers import (
    ManualTokenModel,
    Reference,
    TokenData,
    count_tokens,
    loader,
    max_diff,
    params_of,
    rank_batches,
    token_losses,
    trainer,
)

Pair = namedtuple("Pair", ["x", "y"])


@dataclasses.dataclass
class Sample:
    x: torch.Tensor
    extra: Any = None


def test_split_nested_structures() -> None:
    batch = {"a": torch.arange(5), "b": [torch.zeros(5, 2), (torch.ones(5),)], "c": Pair(torch.arange(5), None)}
    batch["d"] = Sample(torch.arange(5) * 2)
    parts = split(batch, 2)
    assert [batch_length(p) for p in parts] == [2, 2, 1]
    assert torch.equal(torch.cat([p["d"].x for p in parts]), batch["d"].x)
    assert isinstance(parts[0]["c"], Pair) and parts[0]["c"].y is None
    assert isinstance(parts[0]["b"][1], tuple)


def test_a_dataclass_batchs_fields_are_measured_and_cut() -> None:
    """A dataclass's fields are walked for their dim 0 like a dict's values: alone (its length is theirs) and
    beside other tensors (a field of another length refused, naming it). (A sampled mutant that walked no field
    survived the nested-structures test, where another tensor gave the length.)"""
    parts = split(Sample(torch.arange(5)), 2)
    assert [len(p.x) for p in parts] == [2, 2, 1] and all(isinstance(p, Sample) for p in parts)
    assert batch_length(Sample(torch.zeros(7, 2))) == 7
    with pytest.raises(ValueError, match=r"differ in size along dim 0 \(batch\['a'\]: 4, batch\['d'\]\['x'\]: 3\)"):
        batch_length({"a": torch.zeros(4), "d": Sample(torch.zeros(3))})


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        (
            {"x": torch.zeros(4), "y": torch.zeros(3)},
            r"differ in size along dim 0 \(batch\['x'\]: 4, batch\['y'\]: 3\)",
        ),
        ({"x": torch.zeros(4), "name": "cat"}, r"`batch\['name'\]` is a str"),
        ({"x": torch.tensor(1.0)}, "0-d tensor"),
        ({"x": None}, "no tensor"),
    ],
)
def test_split_errors(batch: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        split(batch, 2)


def test_split_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="`size` must be an int >= 1"):
        split(torch.zeros(3), 0)


def test_is_oom() -> None:
    assert all(is_oom(e("CUDA out of memory")) for e in OOM_ERRORS)
    assert not is_oom(ValueError("out of memory"))


class Splitting(ManualTokenModel):
    """Back-propagates each batch in parts; parts larger than `fits` raise an injected OOM."""

    def __init__(self, size: int | str, fits: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.size, self.fits = size, fits
        self.seen: list[int] = []  # the sizes of the parts back-propagated successfully
        self.ooms = 0

    def loss_fn(self, part: Any) -> torch.Tensor:
        n = len(part["x"])
        if self.fits is not None and n > self.fits:
            self.ooms += 1
            raise OOM_ERRORS[0]("CUDA out of memory (injected)")
        self.seen.append(n)
        total, tokens = token_losses(self.net, part)
        return total if self.reduction == "sum" else total / tokens

    def training_step(self, batch: Any, batch_idx: int) -> None:
        with self.accumulate(batch) as acc:
            acc.backward_microbatches(self.loss_fn, size=self.size)  # type: ignore[arg-type]


SCHEDULE = Piecewise({0: 3, 4: 2}, unit="step")


@pytest.mark.parametrize(("size", "fits"), [(3, None), ("auto", 3), ("auto", 1)])
def test_items_exact_with_splitting_and_oom(size: int | str, fits: int | None) -> None:
    data = TokenData(48)
    model = Splitting(size, fits, reduction="sum", schedule=SCHEDULE, normalize="items", count=count_tokens)
    trainer(max_epochs=2).fit(model, loader(data, 8))
    expected, _ = Reference(SCHEDULE, normalize="items").run([rank_batches(data, 8)] * 2)
    assert max_diff(params_of(model), expected) <= 1e-12
    assert model.accumulation_progress.samples == 2 * len(data)  # every sample counted exactly once
    if size == "auto":
        assert model.ooms > 0 and model._accumulation.auto.size == (2 if fits == 3 else 1)
        # after the back-off every part fits, and each epoch's samples went through (again where a window was redone)
        assert max(model.seen) <= fits


def test_mean_is_sample_weighted() -> None:
    data = TokenData(48, ragged=False)  # full masks: the token mean of a batch is its sample mean
    model = Splitting(3, None, schedule=SCHEDULE)
    trainer(max_epochs=2).fit(model, loader(data, 8))  # parts of 3, 3, 2: weighted 3/8, 3/8, 2/8
    expected, _ = Reference(SCHEDULE).run([rank_batches(data, 8)] * 2)
    assert max_diff(params_of(model), expected) <= 1e-12


def test_a_sample_that_does_not_fit_is_a_clear_error() -> None:
    model = Splitting("auto", 0, schedule=SCHEDULE)
    with pytest.raises(RuntimeError, match="one sample does not fit"):
        trainer(max_epochs=1).fit(model, loader(TokenData(16), 8))


def test_other_errors_are_not_swallowed() -> None:
    class Broken(Splitting):
        def loss_fn(self, part: Any) -> torch.Tensor:
            raise KeyError("not an OOM")

    with pytest.raises(KeyError, match="not an OOM"):
        trainer(max_epochs=1).fit(Broken("auto", schedule=SCHEDULE), loader(TokenData(16), 8))


def test_microbatches_method() -> None:
    model = ManualTokenModel()
    parts = model.microbatches({"x": torch.zeros(5, 3)}, 4)
    assert [len(p["x"]) for p in parts] == [4, 1]


@dataclasses.dataclass
class Labelled:
    label: int
    x: torch.Tensor


RECURSIVE: list[Any] = [torch.tensor(1.0)]  # (behind a 0-dim tensor: a list that holds itself, searched to a depth)
RECURSIVE.append(RECURSIVE)


@pytest.mark.parametrize(
    ("batch", "samples"),
    [
        ({"x": torch.zeros(5, 3), "y": torch.zeros(2)}, 5),  # the first tensor's dim 0
        ([torch.zeros(4, 2), torch.zeros(9)], 4),
        ((torch.zeros(3),), 3),
        ({"tokens": torch.tensor(7), "x": torch.zeros(6, 2)}, 6),  # a 0-dim tensor is passed over
        ({"queries": {"ids": torch.zeros(2, 8)}, "passages": {"ids": torch.zeros(10, 8)}}, 2),  # depth first
        (["text", b"raw", 3, torch.zeros(8, 1)], 8),  # strings, bytes and numbers hold no dim 0
        ([[], {}, [torch.zeros(())], {"a": [torch.zeros(3, 1)]}], 3),  # empty ones too, and a nested 0-dim one
        (Labelled(1, torch.zeros(11, 2)), 11),  # a dataclass's fields, in order
        ([Labelled(1, torch.zeros(4))], 4),
        (range(3), 0),  # (an iterable without tensors: nothing found, nothing needed it)
        ({"n": torch.tensor(3)}, 0),
        (RECURSIVE, 0),
    ],
)
def test_sample_count_is_dim_0_of_the_first_tensor_that_has_one(batch: Any, samples: int) -> None:
    from lightning_accum._core.samples import sample_count

    assert sample_count(batch, needed_by=None) == samples


@pytest.mark.parametrize(
    ("batch", "held"),
    [
        ({"n": torch.tensor(3), "m": [torch.tensor(1.0)]}, "holds only 0-dim tensors"),
        ([1, "a", {"b": 2.0}], "holds no tensor to read it from"),
        (RECURSIVE, "holds only 0-dim tensors"),
    ],
)
def test_sample_count_where_none_is_found_names_what_needs_it(batch: Any, held: str) -> None:
    from lightning_accum._core.samples import sample_count

    need = r"Ramp\(1\) needs each micro-batch's number of samples \(dim 0 of its first tensor that has one\)"
    with pytest.raises(ValueError, match=rf"{need}, but a batch of type `\w+` {held}"):
        sample_count(batch, needed_by="Ramp(1)")


@pytest.mark.parametrize(
    ("leaf", "answer", "cut"),
    [
        (torch.zeros(3), True, True),
        (torch.zeros(3), False, False),
        (torch.tensor(2.0), False, False),
        (7, False, False),
        (torch.tensor(2.0), True, TypeError),
        (7, True, TypeError),
    ],
)
def test_a_split_rule_may_cut_only_what_has_a_dim_0(leaf: Any, answer: bool, cut: bool | type) -> None:
    """A ``split`` rule's answer is taken for a tensor of at least one dim; for a 0-d tensor or a number only
    ``False`` (every piece gets it whole) is, and ``True`` is refused naming what it is."""
    from lightning_accum._core.microbatch import _cuts

    if cut is TypeError:
        with pytest.raises(TypeError, match=r"`split` returned True for `.*`, a (0-d tensor|int), which has no dim 0"):
            _cuts(lambda path, x: answer, ("w",), leaf)
    else:
        assert _cuts(lambda path, x: answer, ("w",), leaf) is cut


@pytest.mark.parametrize(("mine", "other", "agreed"), [(None, 500, 500), (None, None, None), (200, 300, 200)])
def test_auto_sizes_agree_on_the_smallest_over_ranks_that_found_one(
    mine: int | None, other: int | None, agreed: int | None
) -> None:
    """At a window's close on 2 ranks (faked), the auto-sized micro-batch is the smallest any rank found; a rank that
    found none (no out-of-memory yet) takes the others', and none found stays none (sizes above 124 too)."""
    from types import SimpleNamespace

    from lightning_accum._core.microbatch import AutoSize

    def reduce(size: torch.Tensor, reduce_op: str) -> torch.Tensor:
        assert reduce_op == "min"
        return torch.minimum(size, torch.tensor(2**62 if other is None else other))

    auto = AutoSize()
    auto.size = mine
    auto.remember((0,), {"x": torch.zeros(4)}, None)
    auto.window_closed((0,), SimpleNamespace(root_device=torch.device("cpu"), reduce=reduce), world=2)
    assert auto.size == agreed


@pytest.mark.parametrize("agreed", [3, 2**62], ids=["agreed 3", "none agreed"])
@pytest.mark.parametrize(
    ("auto_sized", "world"),
    [(True, 2), (True, 1), (False, 2), (False, 1)],
    ids=["auto 2 ranks", "auto 1", "not 2", "not 1"],
)
def test_the_ranks_agree_on_a_size_only_after_a_window_that_auto_sized_on_several_ranks(
    auto_sized: bool, world: int, agreed: int
) -> None:
    """``window_closed`` all-reduces (the minimum of) the size only where the window auto-sized (passes to redo were
    held) and there are several ranks: a window that did not, or one process, makes no collective and keeps its size.
    After the all-reduce the size is the ranks' agreed one; the "no size" sentinel agreed (2**62) is no size (None).
    Either way the window's passes are let go (the other window's stay)."""
    from types import SimpleNamespace

    from lightning_accum._core.microbatch import AutoSize

    calls: list[tuple[int, str]] = []

    def reduce(size: torch.Tensor, reduce_op: str) -> torch.Tensor:
        calls.append((int(size), reduce_op))
        return torch.tensor(agreed)

    auto = AutoSize()
    auto.size = 8
    auto.remember((1,), {"x": torch.zeros(4)}, None)  # (another window's pass)
    if auto_sized:
        auto.remember((0,), {"x": torch.zeros(4)}, None)
    auto.window_closed((0,), SimpleNamespace(root_device=torch.device("cpu"), reduce=reduce), world=world)
    if auto_sized and world == 2:
        assert calls == [(8, "min")] and auto.size == (None if agreed == 2**62 else agreed)
    else:
        assert calls == [] and auto.size == 8
    assert auto.passes((0,)) == 0 and auto.passes((1,)) == 1
