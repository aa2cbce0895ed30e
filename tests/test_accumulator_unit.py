"""``_trainer/accumulator.py`` on its own: the ``Accumulator`` over a stand-in block whose backward is a plain
``loss.backward()``; every gradient and weight checked against a hand computation (no Trainer)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_accum._core.microbatch import AutoSize
from lightning_accum._trainer.accumulator import Accumulator, _check_items
from lightning_accum._trainer.block import Block


class StandIn:
    """The block: one parameter ``w``; ``backward`` records ``(loss, nothing)`` and back-propagates where it adds."""

    weight = Block.weight
    part_weight = Block.part_weight

    def __init__(
        self, normalize: str = "items", mean: bool = False, counted: Any = None, divisor: float = 2.0, index: int = 0
    ) -> None:
        self.w = torch.zeros((), requires_grad=True)
        count = (lambda part: len(part)) if mean else None
        self.windows = SimpleNamespace(
            config=SimpleNamespace(normalize=normalize, mean_items=mean, count=count),
            wide_sums=lambda: None,
            params=lambda key=None: [self.w],
        )
        self.window = SimpleNamespace(k=4, microbatches=index, divisor=divisor)
        self.key = (0,)
        self.passes, self.redoing = 0, False
        self._counted, self._items, self._implicit = counted, None, False
        self.losses: list[tuple[str, float]] = []
        self.calls: list[tuple[float, Any]] = []
        self.engine = SimpleNamespace(wide=None, batchnorm=None, metrics=SimpleNamespace(clear=self._clear))
        self.cleared = 0

    def _clear(self) -> None:
        self.cleared += 1

    def params(self) -> list[torch.Tensor]:
        return [self.w]

    def record_loss(self, loss: torch.Tensor, name: str = "loss") -> None:
        self.losses.append((name, float(loss.detach())))

    def backward(self, loss: torch.Tensor, *, nothing: Any = False) -> None:
        self.passes += 1
        self.calls.append((float(loss.detach()), nothing))
        if nothing is not True:
            loss.backward()


def _acc(block: StandIn, batch: Any = None, auto: AutoSize | None = None) -> Accumulator:
    return Accumulator(block, batch, auto or AutoSize())  # type: ignore[arg-type]


@pytest.mark.parametrize("items", [0, 5, torch.tensor(3), torch.tensor([3]), torch.tensor([[0.0]])])
def test_items_accepted(items: Any) -> None:
    _check_items(items)


@pytest.mark.parametrize(
    ("items", "what"),
    [(-1, "-1"), (True, "True"), (False, "False"), (2.5, "2.5"), ("3", "'3'"), (None, "None"),
     (torch.tensor([1, 2]), r"a tensor of shape \(2,\)"), (torch.zeros(0), r"a tensor of shape \(0,\)")],
)  # fmt: skip
def test_items_refused_naming_what_was_given(items: Any, what: str) -> None:
    with pytest.raises(ValueError, match=rf"got {what}; `items` must be"):
        _check_items(items)


def test_items_are_refused_under_mean_and_checked_under_items() -> None:
    acc = _acc(StandIn(normalize="mean"))
    with pytest.raises(ValueError, match="needs `normalize='items'`"):
        acc.backward(torch.tensor(1.0, requires_grad=True), items=3)
    acc._check_declared(None, "x")  # (no items: nothing to refuse)
    with pytest.raises(ValueError, match="got -1"):
        _acc(StandIn()).backward(torch.tensor(1.0, requires_grad=True), items=-1)
    assert (k := _acc(StandIn(index=2))).k == 4 and k.index == 2


@pytest.mark.parametrize(
    ("microbatches", "passes", "remembered", "auto_calls", "auto_ok", "other_ok"),
    [(0, 0, 0, 0, True, True), (1, 0, 0, 0, False, True), (0, 1, 0, 0, False, True), (0, 3, 0, 0, False, True),
     (1, 1, 2, 0, True, False), (0, 1, 0, 1, True, False), (2, 0, 2, 0, True, False), (2, 1, 2, 0, False, False),
     (1, 0, 1, 0, True, False), (3, 1, 2, 1, False, False)],
)  # fmt: skip
def test_auto_size_shares_no_window_with_other_passes(
    microbatches: int, passes: int, remembered: int, auto_calls: int, auto_ok: bool, other_ok: bool
) -> None:
    block = StandIn(index=microbatches)
    block.passes = passes
    auto = AutoSize()
    for _ in range(remembered):
        auto.remember(block.key, None, None)
    acc = _acc(block, auto=auto)
    acc._auto = auto_calls
    for flag, ok in ((True, auto_ok), (False, other_ok)):
        if ok:
            acc._check_open(auto=flag)
        else:
            with pytest.raises(ValueError, match="cannot share a window"):
                acc._check_open(auto=flag)


def test_no_pass_after_the_block() -> None:
    acc = _acc(StandIn())
    acc._close()
    for call in (lambda: acc.backward(torch.tensor(1.0)), lambda: acc.backward_each([]), lambda: acc._check_open(True)):
        with pytest.raises(RuntimeError, match=r"outside its `with self\.accumulate"):
            call()


@pytest.mark.parametrize(
    ("mean", "counted", "items", "grad", "recorded", "nothing"),
    [(False, None, None, 1.5, 3.0, False), (False, None, 4, 6.0, 12.0, False), (True, 5, None, 7.5, 15.0, False),
     (True, 5, 2, 3.0, 6.0, False), (False, None, 0, 0.0, 0.0, True)],
)  # fmt: skip
def test_backward_weighs_by_the_items_and_divides_by_the_divisor(
    mean: bool, counted: Any, items: Any, grad: float, recorded: float, nothing: bool
) -> None:
    block = StandIn(mean=mean, counted=counted, divisor=2.0)
    _acc(block).backward(block.w * 0 + 3.0 * block.w + 3.0, items=items)  # loss 3 at w = 0, d/dw 3
    assert block.w.grad is None if nothing else float(block.w.grad) == grad  # type: ignore[arg-type]
    assert block.losses == [("loss", recorded)] and block.calls[0][1] is nothing and block.passes == 1


def test_a_tensor_count_of_zero_adds_nothing_decided_on_the_device() -> None:
    block = StandIn()
    _acc(block).backward(torch.tensor(2.0, requires_grad=True), items=torch.tensor(0))
    flag = block.calls[0][1]
    assert isinstance(flag, torch.Tensor) and bool(flag) and block.losses == [("loss", 0.0)]


@pytest.mark.parametrize(
    ("names", "error", "match"),
    [("ab", TypeError, "list of strings"), ([1, 2], TypeError, "list of strings"), (["a", 2], TypeError, "strings"),
     (["a"], ValueError, "1 entries for 2 tasks"), (["a", "b", "c"], ValueError, "3 entries for 2 tasks")],
)  # fmt: skip
def test_task_names_are_checked(names: Any, error: type, match: str) -> None:
    block = StandIn()
    with pytest.raises(error, match=match):
        _acc(block)._record_tasks(torch.tensor([1.0, 2.0]), names)
    assert not block.losses


def test_task_losses_are_recorded_under_their_names() -> None:
    block = StandIn()
    _acc(block)._record_tasks(torch.tensor([1.0, 2.0]), None)
    _acc(block)._record_tasks(torch.tensor([3.0, 4.0]), ["lm", "cls"])
    assert block.losses == [("loss/task0", 1.0), ("loss/task1", 2.0), ("loss/lm", 3.0), ("loss/cls", 4.0)]


def test_backward_each_and_heads_weigh_each_task_by_the_count() -> None:
    block = StandIn(mean=True, counted=4, divisor=2.0)
    w = block.w
    losses = _acc(block).backward_each([lambda: 2.0 * w + 1.0, lambda: 5.0 * w + 2.0], [1.0, 0.5])
    assert losses.tolist() == [1.0, 2.0]
    assert float(w.grad) == (2.0 * 1.0 + 5.0 * 0.5) * 4 / 2  # type: ignore[arg-type]

    block = StandIn(mean=True, counted=0, divisor=2.0)  # (no items: nothing added, not even NaN)
    _acc(block).backward_each([lambda: block.w * float("nan")])
    assert block.w.grad is None and block.calls[0][1] is True


def test_backward_heads_sends_the_summed_feature_gradient_once() -> None:
    block = StandIn(mean=False, divisor=2.0)
    sent: list[torch.Tensor] = []
    block.trunk_backward = lambda features, grad: sent.append(grad)  # type: ignore[attr-defined]
    features = torch.ones(2, requires_grad=True) * 1.0
    losses = _acc(block).backward_heads(features, [lambda f: f.sum(), lambda f: 3.0 * f.sum()], [1.0, 2.0])
    assert losses.tolist() == [2.0, 6.0] and len(sent) == 1 and sent[0].tolist() == [3.5, 3.5]  # (1 + 2 * 3) / 2
    assert block.losses[-2:] == [("loss/task0", 2.0), ("loss/task1", 6.0)]


@pytest.mark.parametrize("size", [0, -1, True, 2.5, "2", None])
def test_microbatch_size_is_an_int_of_at_least_one_or_auto(size: Any) -> None:
    block = StandIn()
    with pytest.raises(ValueError, match="`size` must be an int >= 1"):
        _acc(block, torch.ones(3)).backward_microbatches(lambda part: part.sum(), size)
    assert not block.calls


@pytest.mark.parametrize("size", [1, 2, 4, 5, 9, "auto"])
def test_microbatches_of_a_mean_loss_weigh_each_part_by_its_share(size: Any) -> None:
    block = StandIn(normalize="mean", divisor=1.0)
    batch = torch.arange(1.0, 6.0)  # 5 samples: the whole batch's mean loss is mean(x) * w, d/dw = 3
    losses = _acc(block, batch).backward_microbatches(lambda part: (part * block.w).mean() + part.mean(), size)
    parts = -(-5 // size) if size != "auto" and size < 5 else 1
    assert len(losses) == parts and float(block.w.grad) == pytest.approx(3.0, abs=1e-6)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [1, 2, 5])
def test_microbatches_of_a_sum_and_of_counted_means(size: int) -> None:
    block = StandIn(divisor=1.0)  # items, a sum: each part's sum as it is
    batch = torch.arange(1.0, 6.0)
    _acc(block, batch).backward_microbatches(lambda part: (part * block.w).sum(), size)
    assert float(block.w.grad) == 15.0  # type: ignore[arg-type]
    block = StandIn(mean=True, counted=5, divisor=1.0)  # items, each part's mean weighted by count(part)
    _acc(block, batch).backward_microbatches(lambda part: (part * block.w).mean(), size)
    assert float(block.w.grad) == pytest.approx(15.0)  # type: ignore[arg-type]


def test_auto_halves_on_out_of_memory_and_redoes_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    block = StandIn(normalize="mean", divisor=1.0)
    auto = AutoSize()
    seen: list[int] = []

    def loss_fn(part: torch.Tensor) -> torch.Tensor:
        seen.append(len(part))
        if len(part) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return (part * block.w).mean()

    acc = _acc(block, torch.arange(1.0, 6.0), auto)
    block.w.grad = torch.tensor(100.0)  # (a window's gradient before the error: freed)
    losses = acc.backward_microbatches(loss_fn, "auto")
    assert seen == [5, 2, 2, 1] and len(losses) == 3 and block.cleared == 1
    assert float(block.w.grad) == pytest.approx(3.0)  # type: ignore[arg-type]
    assert auto.passes(block.key) == 1 and acc._auto == 1

    def never(part: torch.Tensor) -> torch.Tensor:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(RuntimeError, match="single sample"):
        _acc(StandIn(normalize="mean"), torch.ones(1)).backward_microbatches(never, "auto")
    with pytest.raises(KeyError):
        _acc(StandIn(normalize="mean"), torch.ones(2)).backward_microbatches(lambda p: {}["x"], "auto")


class Wide:
    """``grad_accum_dtype``'s sums: the weights the passes inside ``weighting`` get."""

    def __init__(self) -> None:
        self.active: list[Any] = []
        self.cleared: list[list[torch.Tensor]] = []

    @contextlib.contextmanager
    def weighting(self, weight: Any) -> Iterator[None]:
        self.active.append(weight)
        try:
            yield
        finally:
            self.active.append("end")

    def clear(self, params: list[torch.Tensor]) -> None:
        self.cleared.append(params)


def _wide(block: StandIn) -> Wide:
    wide = Wide()
    block.windows.wide_sums = lambda: wide
    block.engine.wide = wide
    return wide


@pytest.mark.parametrize(("mean", "items", "weights"), [(False, None, []), (False, 4, [4]), (True, None, [5])])
def test_under_wide_sums_the_weight_goes_on_the_gradients_not_the_loss(mean: bool, items: Any, weights: list) -> None:
    block = StandIn(mean=mean, counted=5, divisor=2.0)
    wide = _wide(block)
    _acc(block).backward(3.0 * block.w + 3.0, items=items)
    assert wide.active == [x for w in weights for x in (w, "end")]
    assert float(block.w.grad) == 1.5 and block.calls[0][0] == 1.5  # type: ignore[arg-type]  # (3 / 2, unweighted)
    assert block.losses == [("loss", 3.0 * (weights[0] if weights else 1))]


@pytest.mark.parametrize(
    ("mean", "task_weights", "expected"),
    [(False, [1.0, 2.0], [2.0]), (True, [1.0, 2.0], [5, 10.0]), (False, [1.0, 1.0], []), (True, [1.0, 0.5], [5, 2.5])],
)
def test_backward_each_under_wide_sums_weighs_each_task_with_the_count(
    mean: bool, task_weights: list[float], expected: list[Any]
) -> None:
    block = StandIn(mean=mean, counted=5, divisor=2.0)
    wide = _wide(block)
    _acc(block).backward_each([lambda: 2.0 * block.w, lambda: 4.0 * block.w], task_weights)
    assert [w for w in wide.active if w != "end"] == expected
    assert float(block.w.grad) == 3.0  # type: ignore[arg-type]  # (2 + 4) / 2: each task's weight is wide's


def test_out_of_memory_clears_the_wide_sums_and_batchnorm_statistics() -> None:
    block = StandIn(normalize="mean", divisor=1.0)
    wide = _wide(block)
    discarded: list[int] = []
    block.engine.batchnorm = SimpleNamespace(discard=lambda: discarded.append(1))
    first = [True]

    def loss_fn(part: torch.Tensor) -> torch.Tensor:
        if first.pop() if first else False:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return (part * block.w).mean()

    _acc(block, torch.arange(1.0, 5.0)).backward_microbatches(loss_fn, "auto")
    assert wide.cleared == [[block.w]] and discarded == [1] and block.cleared == 1


@pytest.mark.parametrize("cuda", [True, False])
def test_out_of_memory_empties_the_cuda_cache_where_there_is_cuda(monkeypatch: pytest.MonkeyPatch, cuda: bool) -> None:
    emptied: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    block = StandIn(normalize="mean", divisor=1.0)

    def loss_fn(part: torch.Tensor) -> torch.Tensor:
        if len(part) > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return (part * block.w).mean()

    _acc(block, torch.arange(1.0, 5.0)).backward_microbatches(loss_fn, "auto")  # 4, 2, then pieces of 1
    assert emptied == ([1, 1] if cuda else [])  # (once per back-off, before the window is redone)
