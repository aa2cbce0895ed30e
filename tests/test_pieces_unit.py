"""``Pieces`` (``microbatch_size``'s split of a loader batch) driven directly, without a Trainer: a tiny float64
linear model, a precision plugin that runs ``loss.backward()``, and the calls the callback makes (``begin``,
``step``, ``restore_aside``), each batch's gradient and returned loss checked against the whole batch's, taken by
hand in one float64 backward pass. Fast table tests of the module's rules (its pieces' bounds, weights, Lightning's
division, the callback's factor, the zeroing, the out-of-memory back-off, resuming, its small helpers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_accum._core import sync
from lightning_accum._trainer import pieces as pieces_module
from lightning_accum._trainer.pieces import Fit, Pieces

OOM = torch.OutOfMemoryError
N = 8  # samples of a loader batch


def make_batch(seed: int = 0, n: int = N) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(n, 3, generator=g, dtype=torch.float64),
        "y": torch.randn(n, generator=g, dtype=torch.float64),
        "w": torch.randint(0, 4, (n,), generator=g).to(torch.float64),  # each sample's items (tokens)
    }


def count(batch: Any) -> int:
    return int(batch["w"].sum())


class Precision:
    """Lightning's precision plugin, as far as the pieces use it."""

    def __init__(self) -> None:
        self.calls = 0

    def backward(self, loss: Tensor, module: Any, optimizer: Any) -> None:
        self.calls += 1
        loss.backward()


class Strategy:
    root_device = torch.device("cpu")

    def __init__(self) -> None:
        self.blocked = 0

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        self.blocked += 1
        yield
        self.blocked -= 1


@dataclasses.dataclass
class Step:
    """A ``training_step``: ``returns`` "mean" (a sample mean), "sum" (an item sum) or "items" (an item mean); it
    records each piece's samples, and runs out of memory (injected) in the forward or the backward of a piece of more
    than ``fits`` samples."""

    net: torch.nn.Linear
    returns: str
    fits: int | None = None
    where: str = "forward"
    calls: list[int] = dataclasses.field(default_factory=list)
    dict_out: bool = False
    at: int | None = None  # only in this batch (its batch_idx)

    def __call__(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
        n = len(batch["x"])
        oom = self.fits is not None and n > self.fits and self.at in (None, batch_idx)
        if oom and self.where == "forward":
            raise OOM("CUDA out of memory (injected)")
        self.calls.append(n)
        loss = whole_loss(self.net, batch, self.returns, hook=oom)
        return {"loss": loss, "n": n} if self.dict_out else loss


def whole_loss(net: torch.nn.Linear, batch: dict[str, Tensor], returns: str, hook: bool = False) -> Tensor:
    out = net(batch["x"]).squeeze(-1)
    if hook:  # from inside the backward, after part of the gradient is in
        out.register_hook(lambda grad: (_ for _ in ()).throw(OOM("CUDA out of memory (injected)")))
    err = (out - batch["y"]) ** 2
    if returns == "mean":
        return err.mean()
    total = (err * batch["w"]).sum()
    return total if returns == "sum" else total / batch["w"].sum()


MODES = {  # returns: (normalize, mean_items)
    "mean": ("mean", False),
    "sum": ("items", False),
    "items": ("items", True),
}


def make_net() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1).double()


def attach(pieces: Pieces, net: torch.nn.Linear, returns: str, family: str = "single", **kwargs: Any) -> Fit:
    normalize, mean_items = MODES[returns]
    parts: dict[str, Any] = {"scaler": None, "put_back": lambda: None, **kwargs}
    fit = Fit(
        module=net,
        precision=Precision(),
        strategy=Strategy(),
        plan=sync.SyncPlan(family),  # type: ignore[arg-type]
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        normalize=normalize,
        mean_items=mean_items,
        count=count,
        **parts,
    )
    pieces.attach(fit)
    return fit


def begin(
    pieces: Pieces,
    batch: Any,
    where: tuple[int, int] = (0, 0),
    final: bool = True,
    zeroes_after: bool = False,
    redoing: bool = False,
    divisor: int = 1,
    factor: float = 1.0,
) -> None:
    pieces.begin(
        where,
        count(batch),
        final=final,
        zeroes_after=zeroes_after,
        redoing=redoing,
        divisor=divisor,
        factor=factor,
    )


def grads(net: torch.nn.Module) -> list[Tensor]:
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in net.parameters()]


def reference(batches: list[dict[str, Tensor]], returns: str, weight: float = 1.0) -> list[Tensor]:
    """Each whole batch's gradient, weighted as the callback weighs it (an item mean by its items), summed, times
    ``weight``: one float64 backward pass of a fresh copy of the net."""
    net = make_net()
    total = sum(whole_loss(net, b, returns) * (count(b) if returns == "items" else 1.0) for b in batches)
    (total * weight).backward()  # type: ignore[union-attr]
    return grads(net)


def close(a: list[Tensor], b: list[Tensor]) -> bool:
    return all(torch.allclose(x, y, rtol=1e-12, atol=1e-12) for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------------------- one loader batch
@pytest.mark.parametrize("returns", ["mean", "sum", "items"])
@pytest.mark.parametrize("size", [1, 3, 5, 7])
def test_pieces_add_up_to_the_whole_batch(returns: str, size: int) -> None:
    """Each piece weighted by its share: a sample mean by its samples over the batch's, an item sum by 1, an item
    mean by its items (as the callback weighs a whole batch by its items); the returned loss is the whole batch's."""
    net, batch = make_net(), make_batch()
    pieces = Pieces(size)
    fit = attach(pieces, net, returns)
    step = Step(net, returns)
    begin(pieces, batch)
    out = pieces.step(step, batch, 0)
    assert close(grads(net), reference([batch], returns))
    assert step.calls == [min(size, N - s) for s in range(0, N, size)]
    assert fit.precision.calls == len(step.calls)  # one backward pass a piece
    with torch.no_grad():
        want = whole_loss(make_net(), batch, returns)
    assert torch.allclose(out, want, rtol=1e-12, atol=0)
    assert out.is_leaf and out.requires_grad and out.grad_fn is None  # a leaf of its own: reaches no parameter
    assert pieces.used == size and not pieces.whole


@pytest.mark.parametrize("returns", ["mean", "sum", "items"])
@pytest.mark.parametrize(("divisor", "factor"), [(1, 1.0), (2, 1.0), (1, 0.25), (3, 0.5)])
def test_lightnings_division_and_the_callbacks_factor(returns: str, divisor: int, factor: float) -> None:
    """Each piece's backward is divided by ``accumulate_grad_batches`` and scaled by the callback's factor, as
    Lightning and the callback treat a whole batch; the returned loss is not (Lightning divides it)."""
    net, batch = make_net(), make_batch(1)
    pieces = Pieces(3)
    attach(pieces, net, returns)
    begin(pieces, batch, divisor=divisor, factor=factor)
    out = pieces.step(Step(net, returns), batch, 0)
    assert close(grads(net), reference([batch], returns, factor / divisor))
    with torch.no_grad():
        assert torch.allclose(out, whole_loss(make_net(), batch, returns), rtol=1e-12, atol=0)


@pytest.mark.parametrize("returns", ["mean", "sum", "items"])
def test_a_batch_of_one_piece_is_not_touched(returns: str) -> None:
    """An int size that the batch fits: ``training_step`` runs once on the batch itself and its own loss is returned
    (Lightning's backward is its backward: the pieces run none)."""
    net = make_net()
    for n in (N - 1, N):
        batch = make_batch(2, n)
        pieces = Pieces(N)
        fit = attach(pieces, net, returns)
        seen: list[Any] = []

        def step(b: Any, batch_idx: int, seen: list[Any] = seen) -> Tensor:
            seen.append(b)
            return whole_loss(net, b, returns)

        begin(pieces, batch)
        out = pieces.step(step, batch, 0)
        assert seen == [batch] and seen[0] is batch  # the batch itself, not a copy
        assert out.grad_fn is not None  # its own loss
        assert pieces.whole and pieces.used == n and fit.precision.calls == 0
        assert all(p.grad is None for p in net.parameters())
    batch = make_batch(2, N + 1)  # one sample over: two pieces
    pieces = Pieces(N)
    attach(pieces, net, returns)
    begin(pieces, batch)
    step = Step(net, returns)
    pieces.step(step, batch, 0)
    assert step.calls == [N, 1] and not pieces.whole and pieces.used == N


def test_auto_without_out_of_memory_runs_the_batch_as_one_piece_copy() -> None:
    """``"auto"`` starts at the loader batch: one piece, a copy of the batch's containers (a redo needs it intact),
    the pieces' own backward; the size used is the batch's."""
    net, batch = make_net(), make_batch(3)
    pieces = Pieces("auto")
    fit = attach(pieces, net, "mean")
    seen: list[Any] = []

    def step(b: Any, batch_idx: int) -> Tensor:
        seen.append(b)
        b.pop("y")  # a `training_step` that changes its batch
        return whole_loss(net, {**b, "y": batch["y"]}, "mean")

    begin(pieces, batch)
    out = pieces.step(step, batch, 0)
    assert len(seen) == 1 and seen[0] is not batch and "y" in batch
    assert not pieces.whole and pieces.used == N and fit.precision.calls == 1 and pieces.found is None
    assert close(grads(net), reference([batch], "mean"))
    assert out.grad_fn is None


def test_returned_dict_keeps_the_last_pieces_entries() -> None:
    net, batch = make_net(), make_batch(4)
    pieces = Pieces(3)
    attach(pieces, net, "sum")
    begin(pieces, batch)
    out = pieces.step(Step(net, "sum", dict_out=True), batch, 0)
    assert set(out) == {"loss", "n"} and out["n"] == 2  # the last piece's (8 = 3 + 3 + 2)
    with torch.no_grad():
        assert torch.allclose(out["loss"], whole_loss(make_net(), batch, "sum"), rtol=1e-12, atol=0)


def test_a_piece_without_items_adds_nothing() -> None:
    """An item mean over no items is NaN: that piece adds nothing (its NaN kept out of the gradient), the others
    their share; a batch without items adds nothing at all."""
    net, batch = make_net(), make_batch(5)
    batch["w"][:3] = 0.0  # the first piece of 3
    pieces = Pieces(3)
    attach(pieces, net, "items")
    begin(pieces, batch)
    pieces.step(Step(net, "items"), batch, 0)
    want = reference([{k: v[3:] for k, v in batch.items()}], "items")
    assert close(grads(net), want)
    empty = make_batch(6)
    empty["w"][:] = 0.0
    net = make_net()
    attach(pieces, net, "items")
    begin(pieces, empty)
    pieces.step(Step(net, "items"), empty, 0)
    assert all(p.grad is None or not p.grad.any() for p in net.parameters())


def test_a_tensor_count_of_no_items_adds_nothing() -> None:
    """``count`` returning tensors: the pieces' "no items" is decided on the device."""
    net, batch = make_net(), make_batch(5)
    batch["w"][3:6] = 0.0  # the second piece of 3
    pieces = Pieces(3)
    fit = attach(pieces, net, "items")
    pieces.attach(dataclasses.replace(fit, count=lambda b: b["w"].sum().long()))
    pieces.begin((0, 0), batch["w"].sum().long(), final=True, zeroes_after=False, redoing=False, divisor=1, factor=1.0)
    out = pieces.step(Step(net, "items"), batch, 0)
    rest = {k: torch.cat([v[:3], v[6:]]) for k, v in batch.items()}
    assert close(grads(net), reference([rest], "items"))
    with torch.no_grad():
        assert torch.allclose(out, whole_loss(make_net(), batch, "items"), rtol=1e-12, atol=0)


@pytest.mark.parametrize("returns", ["mean", "sum", "items"])
def test_a_batch_being_redone_adds_nothing(returns: str) -> None:
    """``redoing``: the batch's gradient is in the window already: its pieces run, add nothing, and its loss is
    returned."""
    net, batch = make_net(), make_batch(7)
    pieces = Pieces(3)
    attach(pieces, net, returns)
    begin(pieces, batch, redoing=True)
    out = pieces.step(Step(net, returns), batch, 0)
    assert all(p.grad is None or not p.grad.any() for p in net.parameters())
    with torch.no_grad():
        assert torch.allclose(out, whole_loss(make_net(), batch, returns), rtol=1e-12, atol=0)


@pytest.mark.parametrize("size", [3, "auto"])
def test_the_gradient_is_set_aside_across_lightnings_zeroing(size: Any) -> None:
    """A window's first batch (Lightning zeroes after its ``training_step``): the pieces start from no gradient,
    and theirs is set aside (by reference) till ``restore_aside``; otherwise they add to the gradient there."""
    net, batch = make_net(), make_batch(8)
    pieces = Pieces(size)
    attach(pieces, net, "sum")
    for p in net.parameters():
        p.grad = torch.full_like(p, 100.0)  # an earlier window's
    begin(pieces, batch, zeroes_after=True)
    pieces.step(Step(net, "sum"), batch, 0)
    assert all(p.grad is None for p in net.parameters())  # Lightning would zero them now
    pieces.restore_aside()
    assert close(grads(net), reference([batch], "sum"))
    pieces.restore_aside()  # once only: nothing is set aside any more
    assert close(grads(net), reference([batch], "sum"))
    second = make_batch(9)
    begin(pieces, second, where=(0, 1))
    pieces.step(Step(net, "sum"), second, 1)
    assert close(grads(net), reference([batch, second], "sum"))


def test_ddp_holds_the_sync_off_till_release() -> None:
    net, batch = make_net(), make_batch(10)
    pieces = Pieces(3)
    fit = attach(pieces, net, "mean", family="ddp")
    begin(pieces, batch)
    pieces.step(Step(net, "mean"), batch, 0)
    assert fit.strategy.blocked == 1
    begin(pieces, batch, where=(0, 1))
    pieces.step(Step(net, "mean"), batch, 1)
    assert fit.strategy.blocked == 1  # (released before it is held again)
    pieces.release()
    assert fit.strategy.blocked == 0
    pieces.release()
    assert fit.strategy.blocked == 0
    single = Pieces(3)
    fit = attach(single, make_net(), "mean")
    begin(single, batch)
    single.step(Step(fit.module, "mean"), batch, 0)
    assert fit.strategy.blocked == 0


def test_piece_done_after_each_pieces_backward() -> None:
    net, batch = make_net(), make_batch(11)
    pieces = Pieces(3)
    done: list[int] = []
    step = Step(net, "mean")
    attach(pieces, net, "mean", piece_done=lambda: done.append(len(step.calls)))
    begin(pieces, batch)
    pieces.step(step, batch, 0)
    assert done == [1, 2, 3]


@pytest.mark.parametrize("returns", ["mean", "sum", "items"])
@pytest.mark.parametrize("forward_only", [True, False])
def test_a_batch_without_backward(returns: str, forward_only: bool) -> None:
    """SWA's BatchNorm epoch (``begin_forward_only``), or a batch the callback was not told of: the pieces' forwards
    only, and the whole batch's loss (no leaf for a backward); under ``one_update`` when forward only."""
    net, batch = make_net(), make_batch(12)
    pieces = Pieces(3)
    entered: list[bool] = []

    @contextlib.contextmanager
    def one_update() -> Iterator[None]:
        entered.append(True)
        yield

    fit = attach(pieces, net, returns, one_update=one_update)
    if forward_only:
        pieces.begin_forward_only()
    step = Step(net, returns)
    out = pieces.step(step, batch, 0)
    assert step.calls == [3, 3, 2] and fit.precision.calls == 0 and entered == [True] * forward_only
    assert all(p.grad is None for p in net.parameters())
    with torch.no_grad():
        assert torch.allclose(out, whole_loss(make_net(), batch, returns), rtol=1e-12, atol=0)
    assert not out.requires_grad


def test_none_skips_the_batch_only_from_its_first_piece() -> None:
    net, batch = make_net(), make_batch(13)
    pieces = Pieces(3)
    attach(pieces, net, "mean")
    begin(pieces, batch)
    assert pieces.step(lambda b, i: None, batch, 0) is None
    calls: list[int] = []

    def late(b: Any, i: int) -> Tensor | None:
        calls.append(len(b["x"]))
        return None if len(calls) == 2 else whole_loss(net, b, "mean")

    begin(pieces, batch)
    with pytest.raises(RuntimeError, match=r"returned None for samples 3:6 of a loader batch"):
        pieces.step(late, batch, 0)


# ---------------------------------------------------------------------------- "auto": the out-of-memory back-off
@pytest.mark.parametrize("returns", ["mean", "sum", "items"])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_auto_halves_till_a_piece_fits_and_stays_exact(returns: str, where: str) -> None:
    net, batch = make_net(), make_batch(14)
    pieces = Pieces("auto")
    attach(pieces, net, returns)
    step = Step(net, returns, fits=2, where=where)
    begin(pieces, batch)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = pieces.step(step, batch, 0)
    messages = [str(w.message) for w in seen]
    redone = ", the accumulation window redone from its start." if where == "backward" else "."
    assert messages == [
        f"`microbatch_size='auto'`: out of memory in a {where} pass of a micro-batch of 8 samples; "
        f"continuing with micro-batches of 4 samples{redone}",
        f"`microbatch_size='auto'`: out of memory in a {where} pass of a micro-batch of 4 samples; "
        f"continuing with micro-batches of 2 samples{redone}",
    ]
    assert pieces.found == 2 and pieces.used == 2
    assert step.calls == ([8, 4] if where == "backward" else []) + [2, 2, 2, 2]
    assert close(grads(net), reference([batch], returns))
    with torch.no_grad():
        assert torch.allclose(out, whole_loss(make_net(), batch, returns), rtol=1e-12, atol=0)
    assert pieces.state_dict() == {"found": 2, "resume": None}
    again = make_batch(15)  # the next batch starts at the size found
    begin(pieces, again, where=(0, 1))
    step.calls.clear()
    pieces.step(step, again, 1)
    assert step.calls == [2, 2, 2, 2]


def test_auto_odd_sizes_halve_down() -> None:
    """7 samples that fit 3: 7, then 3 (7 // 2), never 4."""
    net, batch = make_net(), make_batch(16, 7)
    pieces = Pieces("auto")
    attach(pieces, net, "sum")
    step = Step(net, "sum", fits=3)
    begin(pieces, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pieces.step(step, batch, 0)
    assert step.calls == [3, 3, 1] and pieces.found == 3
    assert close(grads(net), reference([batch], "sum"))


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_auto_never_below_one_sample(where: str) -> None:
    net, batch = make_net(), make_batch(17)
    pieces = Pieces("auto")
    attach(pieces, net, "mean")
    begin(pieces, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match=rf"out of memory in a {where} pass .* \(sizes tried: 8, 4, 2, 1\)"):
            pieces.step(Step(net, "mean", fits=0, where=where), batch, 0)
    batch = make_batch(17, 1)  # a batch of one sample: no size was tried before it
    pieces = Pieces("auto")
    attach(pieces, make_net(), "mean")
    begin(pieces, batch)
    with pytest.raises(RuntimeError, match=r"\(sizes tried: 1\)") as error:
        pieces.step(Step(net, "mean", fits=0, where=where), batch, 0)
    assert isinstance(error.value.__cause__, OOM)


def test_an_int_size_does_not_back_off() -> None:
    net, batch = make_net(), make_batch(18)
    pieces = Pieces(4)
    attach(pieces, net, "mean")
    begin(pieces, batch)
    with pytest.raises(OOM):
        pieces.step(Step(net, "mean", fits=2), batch, 0)
    assert pieces.found is None


def test_auto_other_errors_are_raised() -> None:
    net, batch = make_net(), make_batch(18)
    pieces = Pieces("auto")
    attach(pieces, net, "mean")
    begin(pieces, batch)

    def broken(b: Any, i: int) -> Tensor:
        raise KeyError("not an OOM")

    with pytest.raises(KeyError):
        pieces.step(broken, batch, 0)


@pytest.mark.parametrize("returns", ["mean", "sum", "items"])
def test_auto_redoes_the_window_after_an_out_of_memory_backward(returns: str) -> None:
    """A window of 3 batches: the first two ran whole (8), the third runs out of memory in a backward pass of 8:
    the window's gradient is cleared, its earlier batches run again as they ran (8 each), and all go on at 4. Each
    batch added exactly once; the window's first batch's gradient set aside across Lightning's zeroing."""
    net = make_net()
    batches = [make_batch(20 + i) for i in range(3)]
    pieces = Pieces("auto")
    attach(pieces, net, returns)
    step = Step(net, returns)
    outs = []
    for i, batch in enumerate(batches):
        begin(pieces, batch, where=(0, i), final=i == 2, zeroes_after=i == 0)
        if i == 2:
            step.fits, step.where, step.at = 7, "backward", 2
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            outs.append(pieces.step(step, batch, i))
        if i == 0:
            pieces.restore_aside()
    assert [str(w.message).endswith("redone from its start.") for w in seen] == [True]
    assert step.calls == [8, 8, 8, 8, 8, 4, 4]  # batches 0, 1; 2 fails; 0, 1 replayed as they ran; 2 at 4
    assert close(grads(net), reference(batches, returns))
    with torch.no_grad():
        for out, batch in zip(outs, batches, strict=True):
            assert torch.allclose(out, whole_loss(make_net(), batch, returns), rtol=1e-12, atol=0)
    pieces.forget_window()  # the window stepped: a later one redoes nothing of it
    for p in net.parameters():
        p.grad = None
    begin(pieces, batches[0], where=(0, 3), zeroes_after=True)
    step.fits, step.at = 3, 3
    step.calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pieces.step(step, batches[0], 3)
    pieces.restore_aside()
    assert step.calls == [4, 2, 2, 2, 2]
    assert close(grads(net), reference(batches[:1], returns))


def test_auto_replay_that_no_longer_fits_goes_at_the_size_in_force() -> None:
    """Batch 0 ran at 8; batch 1 runs out of memory in a backward of 8 (-> 4); the replay of batch 0 as it ran (8)
    then runs out too: the window again, every batch at the size in force (4)."""
    net = make_net()
    batches = [make_batch(30), make_batch(31)]
    pieces = Pieces("auto")
    attach(pieces, net, "items")
    step = Step(net, "items")
    for i, batch in enumerate(batches):
        begin(pieces, batch, where=(0, i), final=i == 1)
        if i == 1:
            step.fits, step.where = 4, "backward"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pieces.step(step, batch, i)
    assert step.calls == [8, 8, 8, 4, 4, 4, 4]  # 0; 1 fails; 0 replayed at 8 fails; 0 at 4, 1 at 4
    assert pieces.found == 4
    assert close(grads(net), reference(batches, "items"))


def test_auto_replays_each_batch_from_its_generators_state() -> None:
    """A ``training_step`` that draws random numbers (dropout): a redone window's batches draw what they drew."""
    net = make_net()
    batches = [make_batch(40), make_batch(41)]
    pieces = Pieces("auto")
    attach(pieces, net, "sum")
    drawn: list[Tensor] = []

    def step(b: Any, i: int) -> Tensor:
        noise = torch.rand(len(b["x"]), dtype=torch.float64)
        drawn.append(noise)
        out = net(b["x"]).squeeze(-1)
        if i == 1 and len(b["x"]) > 4:
            out.register_hook(lambda grad: (_ for _ in ()).throw(OOM("CUDA out of memory (injected)")))
        return (((out - b["y"]) ** 2) * b["w"] * noise).sum()

    torch.manual_seed(5)
    for i, batch in enumerate(batches):
        begin(pieces, batch, where=(0, i), final=i == 1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pieces.step(step, batch, i)
    assert [len(d) for d in drawn] == [8, 8, 8, 4, 4]
    assert torch.equal(drawn[0], drawn[2])  # batch 0 replayed from its generators' state
    assert torch.equal(drawn[1][:4], drawn[3]) and torch.equal(drawn[1][4:], drawn[4])  # batch 1 from its own
    net_ref = make_net()
    total = sum(
        (((net_ref(b["x"]).squeeze(-1) - b["y"]) ** 2) * b["w"] * d).sum()
        for b, d in zip(batches, [drawn[2], drawn[1]], strict=True)
    )
    total.backward()  # type: ignore[union-attr]
    assert close(grads(net), grads(net_ref))


def test_auto_forward_out_of_memory_redraws_from_the_pieces_generators_state() -> None:
    """A piece whose forward ran out of memory after its random draws: the batch goes on from that piece at the
    smaller size, drawing again from the state the piece began with."""
    net, batch = make_net(), make_batch(42)
    pieces = Pieces("auto")
    attach(pieces, net, "sum")
    drawn: list[Tensor] = []

    def step(b: Any, i: int) -> Tensor:
        noise = torch.rand(len(b["x"]), dtype=torch.float64)
        drawn.append(noise)
        if len(b["x"]) > 4:
            raise OOM("CUDA out of memory (injected)")
        return (((net(b["x"]).squeeze(-1) - b["y"]) ** 2) * noise).sum()

    torch.manual_seed(6)
    begin(pieces, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pieces.step(step, batch, 0)
    assert [len(d) for d in drawn] == [8, 4, 4]
    assert torch.equal(drawn[0][:4], drawn[1])  # the piece at 4 drew what the piece of 8 began to draw


# ---------------------------------------------------------------------------- cut short, resumed
def failing_at(n: int, net: nn.Module, normalize: str) -> Callable[[Any, int], Tensor]:
    """A ``training_step`` over ``net`` that raises at its ``n``-th call (a piece)."""
    calls: list[int] = []

    def step(b: Any, i: int) -> Tensor:
        calls.append(len(b["x"]))
        if len(calls) == n:
            raise KeyError("interrupted")
        return whole_loss(net, b, normalize)

    return step


def resumed_from(state: dict[str, Any], part: list[Tensor], normalize: str) -> tuple[Pieces, nn.Module]:
    """A fresh run resumed from ``state`` (a checkpoint's), its gradient holding ``part``."""
    resumed = Pieces(3)
    resumed.load_state_dict(state)
    net = make_net()
    for p, g in zip(net.parameters(), part, strict=True):
        p.grad = g.clone()
    attach(resumed, net, normalize)
    return resumed, net


def the_rest_trained(resumed: Pieces, net: nn.Module, batch: Any, where: tuple[int, int], normalize: str) -> list[int]:
    """The resumed run trains the rest of ``batch``: the whole batch's gradient and loss, by hand; the pieces' sizes."""
    begin(resumed, batch, where=where)
    step = Step(net, normalize)
    out = resumed.step(step, batch, where[1])
    assert close(grads(net), reference([batch], normalize))
    with torch.no_grad():
        assert torch.allclose(out, whole_loss(make_net(), batch, normalize), rtol=1e-12, atol=0)
    return step.calls


def test_cut_short_between_pieces_keeps_the_part_done_on_one_process() -> None:
    """An exception after the first piece's backward: on one process the part is kept (``resume``), several
    processes must leave the window out; a resumed run trains the rest of the batch and returns its whole loss."""
    net, batch = make_net(), make_batch(50)
    pieces = Pieces(3)
    attach(pieces, net, "mean")
    begin(pieces, batch, where=(1, 4))
    with pytest.raises(KeyError):
        pieces.step(failing_at(2, net, "mean"), batch, 4)
    part = grads(net)
    assert close(part, reference([{k: v[:3] for k, v in batch.items()}], "mean", 3 / 8))
    kept = pieces.batch
    assert not pieces.cut_short((1, 4), single=True)
    assert pieces.batch is None
    assert pieces.resume is not None and pieces.resume[:3] == (1, 4, 3)
    with torch.no_grad():
        first = whole_loss(make_net(), {k: v[:3] for k, v in batch.items()}, "mean") * 3 / 8
    assert torch.allclose(torch.as_tensor(pieces.resume[3]), first, rtol=1e-12, atol=0)
    pieces.batch = kept
    assert pieces.cut_short((1, 4), single=False)  # several processes: the window is left out
    # resumed (a checkpoint's state), in a fresh run whose gradient holds the part
    resumed, net2 = resumed_from(pieces.state_dict(), part, "mean")
    assert the_rest_trained(resumed, net2, batch, (1, 4), "mean") == [3, 2] and resumed.resume is None


def test_cut_short_items_mean_resumes_with_its_summed_loss() -> None:
    net, batch = make_net(), make_batch(51)
    pieces = Pieces(3)
    attach(pieces, net, "items")
    begin(pieces, batch, where=(0, 2))
    with pytest.raises(KeyError):
        pieces.step(failing_at(3, net, "items"), batch, 2)
    assert not pieces.cut_short((0, 2), single=True)
    assert pieces.resume is not None and pieces.resume[2] == 6
    resumed, net2 = resumed_from(pieces.state_dict(), grads(net), "items")
    assert the_rest_trained(resumed, net2, batch, (0, 2), "items") == [2]


def test_cut_short_with_nothing_in_the_gradient_keeps_nothing() -> None:
    net, batch = make_net(), make_batch(52)
    pieces = Pieces(3)
    attach(pieces, net, "mean")
    assert not pieces.cut_short((0, 0), single=False)  # no batch under way
    begin(pieces, batch)

    def failing(b: Any, i: int) -> Tensor:
        raise KeyError("interrupted")

    with pytest.raises(KeyError):
        pieces.step(failing, batch, 0)
    assert not pieces.cut_short((0, 0), single=False) and pieces.resume is None  # no piece was back-propagated
    begin(pieces, batch)

    def in_backward(b: Any, i: int) -> Tensor:
        out = net(b["x"]).sum()
        out.register_hook(lambda grad: (_ for _ in ()).throw(KeyError("in the backward")))
        return out

    with pytest.raises(KeyError):
        pieces.step(in_backward, batch, 0)
    assert pieces.in_backward
    assert not pieces.cut_short((0, 0), single=False) and pieces.resume is None  # the window is redone by the caller


def test_a_batch_cut_short_that_ran_whole_resumes_with_its_loss() -> None:
    """A batch cut short after its one piece (``"auto"``, every sample in): the resumed run runs no piece and
    returns the kept loss."""
    net, batch = make_net(), make_batch(53)
    pieces = Pieces("auto")
    attach(pieces, net, "sum")
    begin(pieces, batch, where=(0, 5))
    pieces.step(Step(net, "sum"), batch, 5)
    assert not pieces.cut_short((0, 5), single=True)
    assert pieces.resume is not None and pieces.resume[2] == 8
    resumed = Pieces("auto")
    resumed.load_state_dict(pieces.state_dict())
    attach(resumed, make_net(), "sum")
    begin(resumed, batch, where=(0, 5))
    step = Step(net, "sum")
    out = resumed.step(step, batch, 5)
    assert step.calls == []
    with torch.no_grad():
        assert torch.allclose(out, whole_loss(make_net(), batch, "sum"), rtol=1e-12, atol=0)


def test_a_resume_at_another_batch_is_warned_about_and_dropped() -> None:
    net, batch = make_net(), make_batch(54)
    pieces = Pieces(3)
    pieces.resume = (0, 2, 3, 0.5, 0.0)
    attach(pieces, net, "mean")
    for where in [(0, 3), (1, 2)]:
        pieces.resume = (0, 2, 3, 0.5, 0.0)
        for p in net.parameters():
            p.grad = None
        begin(pieces, batch, where=where)
        step = Step(net, "mean")
        with pytest.warns(UserWarning, match=rf"first 3 samples of batch 2 of epoch 0 .* trains batch {where[1]} "):
            pieces.step(step, batch, where[1])
        assert step.calls == [3, 3, 2] and pieces.resume is None
        assert close(grads(net), reference([batch], "mean"))


def test_fresh_fit_forgets_a_resume() -> None:
    pieces = Pieces(3)
    pieces.resume = (0, 2, 3, 0.5, 0.0)
    pieces.fresh_fit()
    assert pieces.resume is None


# ---------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize(
    ("state", "found", "resume"),
    [
        ({}, None, None),
        ({"found": None, "resume": None}, None, None),
        ({"found": 4.0}, 4, None),
        ({"found": "6", "resume": ["1", 2.0, 3, 0.5, 0.25]}, 6, (1, 2, 3, 0.5, 0.25)),
        ({"found": 1, "resume": [0, 0, 0, 1.5, 2.5, "ignored"]}, 1, (0, 0, 0, 1.5, 2.5)),
    ],
)
def test_load_state_dict(state: dict[str, Any], found: int | None, resume: tuple[Any, ...] | None) -> None:
    pieces = Pieces("auto")
    pieces.found, pieces.resume = 9, (9, 9, 9, 9.0, 9.0)
    pieces.load_state_dict(state)
    assert pieces.found == found and pieces.resume == resume
    assert all(type(v) is int for v in (pieces.resume or ())[:3])
    assert type(pieces.found) is (int if found is not None else type(None))
    assert pieces.state_dict() == {"found": found, "resume": None if resume is None else list(resume)}


# ---------------------------------------------------------------------------- the helpers
@pytest.mark.parametrize(
    ("done", "samples", "size", "want"),
    [
        (0, 8, 3, [(0, 3), (3, 6), (6, 8)]),
        (0, 8, 4, [(0, 4), (4, 8)]),
        (0, 8, 8, [(0, 8)]),
        (0, 8, 9, [(0, 8)]),
        (0, 8, 1, [(i, i + 1) for i in range(8)]),
        (3, 8, 3, [(3, 6), (6, 8)]),
        (7, 8, 2, [(7, 8)]),
        (8, 8, 2, []),
        (0, 1, 1, [(0, 1)]),
    ],
)
def test_bounds(done: int, samples: int, size: int, want: list[tuple[int, int]]) -> None:
    assert pieces_module._bounds(done, samples, size) == want


@dataclasses.dataclass
class Pair:
    a: Tensor
    b: Any = None


@pytest.mark.parametrize(
    ("batch", "length"),
    [
        (torch.zeros(5, 2), 5),
        ({"x": torch.zeros(4, 2), "y": torch.zeros(4), "z": None}, 4),
        ([torch.zeros(3), (torch.zeros(3, 1), None)], 3),
        (Pair(torch.zeros(6), {"c": torch.zeros(6, 2)}), 6),
        (torch.zeros(0, 3), 0),
    ],
)
def test_length(batch: Any, length: int) -> None:
    assert pieces_module._length(batch) == length
    assert Pieces(2).length(batch) == length


@pytest.mark.parametrize(
    "batch",
    [
        {"x": torch.zeros(4), "y": torch.zeros(5)},  # two lengths
        {"x": torch.zeros(4), "n": 3},  # a leaf that is no tensor
        torch.tensor(1.0),  # 0-d
        {"x": torch.zeros(4), "s": torch.tensor(2.0)},
        "text",
        Pair,  # a dataclass type, not an instance
        None,  # nothing to cut
    ],
)
def test_length_refused(batch: Any) -> None:
    with pytest.raises(ValueError, match=r"`AccumulationScheduler\(microbatch_size=...\)` cuts each loader batch"):
        pieces_module._length(batch)


def test_lengths_fast_path() -> None:
    """``_lengths``: each tensor's dim 0 in ``sizes``, ``False`` at anything that cannot be cut."""
    sizes: set[int] = set()
    assert pieces_module._lengths({"a": torch.zeros(2), "b": [torch.zeros(3), None], "c": Pair(torch.zeros(4))}, sizes)
    assert sizes == {2, 3, 4}
    for bad in (torch.tensor(1.0), 3, "x", Pair, {"a": [torch.zeros(2), 1]}, (torch.zeros(1), Pair(torch.zeros(1), 2))):
        assert not pieces_module._lengths(bad, set())
    assert pieces_module._lengths(None, set()) and pieces_module._lengths([], set())


def test_loss_of_and_with_loss() -> None:
    loss = torch.tensor(1.0)
    assert pieces_module._loss_of(None) is None
    assert pieces_module._loss_of(loss) is loss
    assert pieces_module._loss_of({"loss": loss, "x": 1}) is loss
    for bad, name in [({"loss": 1.0}, "dict"), ({"x": loss}, "dict"), (1.0, "float"), ((loss,), "tuple")]:
        with pytest.raises(TypeError, match=rf"`training_step` returned {name}; with `microbatch_size`"):
            pieces_module._loss_of(bad)
    other = torch.tensor(2.0)
    assert pieces_module._with_loss(loss, other) is other
    assert pieces_module._with_loss({"loss": loss, "x": 1}, other) == {"loss": other, "x": 1}


def test_count_of_a_piece_is_checked() -> None:
    assert pieces_module._count(lambda b: 3, None) == 3
    with pytest.raises(ValueError, match=r"`count\(piece\)` of a micro-batch cut by `microbatch_size`"):
        pieces_module._count(lambda b: -1, None)
    with pytest.raises(AssertionError):
        pieces_module._count(None, None)


def test_no_autocast() -> None:
    loss = torch.tensor(1.0)
    assert isinstance(pieces_module._no_autocast(loss), contextlib.nullcontext)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pieces_module._no_autocast(loss):
            assert not torch.is_autocast_enabled("cpu")
        assert torch.is_autocast_enabled("cpu")


def test_rng_restores_the_generators() -> None:
    torch.manual_seed(3)
    state = pieces_module._RNG()
    first = torch.rand(4)
    state.restore()
    assert torch.equal(torch.rand(4), first)


# ---------------------------------------------------------------------------- Lightning's parts the backward meets
class Scaler:
    """AMP's GradScaler, as far as the pieces use it: the loss times a scale."""

    def scale(self, loss: Tensor) -> Tensor:
        return loss * 4.0


@pytest.mark.parametrize("returns", ["mean", "sum", "items"])
def test_each_pieces_backward_is_scaled_as_amp_scales_the_batchs(returns: str) -> None:
    net, batch = make_net(), make_batch(60)
    pieces = Pieces(3)
    attach(pieces, net, returns, scaler=Scaler())
    begin(pieces, batch, divisor=2)
    out = pieces.step(Step(net, returns), batch, 0)
    assert close(grads(net), reference([batch], returns, 4.0 / 2))
    with torch.no_grad():
        assert torch.allclose(out, whole_loss(make_net(), batch, returns), rtol=1e-12, atol=0)  # not scaled


@pytest.mark.parametrize("final", [True, False])
@pytest.mark.parametrize("family", ["fsdp2", "fsdp", "ddp", "single"])
def test_a_sharded_strategy_syncs_at_the_windows_last_piece_only(
    monkeypatch: pytest.MonkeyPatch, final: bool, family: str
) -> None:
    net, batch = make_net(), make_batch(61)
    pieces = Pieces(3)
    fit = attach(pieces, net, "mean", family=family)
    seen: list[bool] = []

    def skip_sync(plan: Any, strategy: Any, last: bool) -> contextlib.AbstractContextManager[None]:
        assert plan is fit.plan and strategy is fit.strategy
        seen.append(last)
        return contextlib.nullcontext()

    monkeypatch.setattr(pieces_module.sync, "skip_sync", skip_sync)
    begin(pieces, batch, final=final)
    pieces.step(Step(net, "mean"), batch, 0)
    sharded = family in ("fsdp", "fsdp2")
    assert seen == ([False, False, final] if sharded else [])
    assert close(grads(net), reference([batch], "mean"))


@pytest.mark.parametrize("returns", ["mean", "sum", "items"])
@pytest.mark.parametrize("size", [3, "auto"])
def test_grad_accum_dtype_sums_take_each_pieces_weight(returns: str, size: Any) -> None:
    """``grad_accum_dtype``: a narrow (float32) net's gradients summed in float64, each piece's weight taken on its
    gradient (not its loss); cleared with ``.grad`` where the window starts, and on a redo."""
    from lightning_accum._core.wide import WideSums

    net, batch = make_net().float(), make_batch(62)
    narrow = {k: v.float() for k, v in batch.items()}
    sums = WideSums(torch.float64)
    sums.attach(list(net.parameters()))
    pieces = Pieces(size)
    attach(pieces, net, returns)
    pieces.rewiden(sums)
    (net.weight.sum() * 1000).backward()  # an earlier window's, in the sums: cleared where Lightning zeroes
    begin(pieces, narrow, zeroes_after=True, factor=0.5)
    step = Step(net, returns, fits=4 if size == "auto" else None, where="backward")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pieces.step(step, narrow, 0)
    pieces.restore_aside()
    want = reference([batch], returns, 0.5)
    for got, w in zip(sums.views, want, strict=True):
        assert torch.allclose(got.view_as(w), w, rtol=1e-5, atol=1e-6)


def test_auto_redo_starts_from_a_resumed_windows_partial_gradient() -> None:
    """A window resumed with a partial gradient (``put_back``, once): an out-of-memory backward redoes the window
    from that gradient, not from none."""
    net, batch = make_net(), make_batch(63)
    base = [torch.full_like(p, 0.5) for p in net.parameters()]
    handed: list[Any] = [base]

    def put_back() -> Any:
        out = handed.pop() if handed else None
        if out is not None:
            for p, g in zip(net.parameters(), out, strict=True):
                p.grad = g.clone()
        return out

    pieces = Pieces("auto")
    attach(pieces, net, "sum", put_back=put_back)
    begin(pieces, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pieces.step(Step(net, "sum", fits=4, where="backward"), batch, 0)
    want = [w + b for w, b in zip(reference([batch], "sum"), base, strict=True)]
    assert close(grads(net), want)


def test_detach_ends_the_fit() -> None:
    net, batch = make_net(), make_batch(64)
    pieces = Pieces(3)
    fit = attach(pieces, net, "mean", family="ddp")
    begin(pieces, batch)
    pieces.step(Step(net, "mean"), batch, 0)
    pieces.detach()
    assert fit.strategy.blocked == 0 and pieces.batch is None
    pieces.rewiden(None)  # nothing attached: nothing to do
    with pytest.raises(AssertionError, match="attaches the pieces at train start"):
        pieces.step(Step(net, "mean"), batch, 0)


def test_a_resume_with_every_sample_in_returns_the_kept_loss_as_a_tensor() -> None:
    net, batch = make_net(), make_batch(65)
    pieces = Pieces(3)
    pieces.load_state_dict({"resume": [0, 1, N, 0.75, 0.0]})
    attach(pieces, net, "mean")
    begin(pieces, batch, where=(0, 1))
    step = Step(net, "mean")
    out = pieces.step(step, batch, 1)
    assert step.calls == [] and isinstance(out, Tensor) and float(out.detach()) == 0.75
    assert all(p.grad is None for p in net.parameters())


@pytest.mark.parametrize("returns", ["mean", "sum", "items"])
def test_auto_forward_out_of_memory_inside_a_window_redoes_nothing(returns: str) -> None:
    """An out-of-memory error in a forward pass left no gradient: the batch goes on from that piece at the smaller
    size; the window's earlier batches are not run again (their gradient is in once)."""
    net = make_net()
    batches = [make_batch(70), make_batch(71)]
    pieces = Pieces("auto")
    attach(pieces, net, returns)
    step = Step(net, returns, fits=3, where="forward", at=1)
    for i, batch in enumerate(batches):
        begin(pieces, batch, where=(0, i), final=i == 1)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            pieces.step(step, batch, i)
    assert [str(w.message).split("; ")[1] for w in seen] == [
        "continuing with micro-batches of 4 samples.",
        "continuing with micro-batches of 2 samples.",
    ]
    assert step.calls == [8, 2, 2, 2, 2]
    assert close(grads(net), reference(batches, returns))


def test_auto_out_of_memory_at_a_later_piece_halves_that_pieces_size() -> None:
    """The second piece of 4 (samples 4:8) runs out of memory: the size halves from its 4 samples, and the batch goes
    on from sample 4."""
    net, batch = make_net(), make_batch(72)
    pieces = Pieces("auto")
    pieces.found = 4
    attach(pieces, net, "sum")
    calls: list[tuple[int, int]] = []

    def step(b: Any, i: int) -> Tensor:
        calls.append((len(b["x"]), len(calls)))
        if len(calls) == 2:
            raise OOM("CUDA out of memory (injected)")
        return whole_loss(net, b, "sum")

    begin(pieces, batch)
    with pytest.warns(UserWarning, match="micro-batch of 4 samples; continuing with micro-batches of 2 samples"):
        pieces.step(step, batch, 0)
    assert [n for n, _ in calls] == [4, 4, 2, 2] and pieces.found == 2
    assert close(grads(net), reference([batch], "sum"))


@pytest.mark.parametrize("cuda", [True, False])
def test_auto_out_of_memory_empties_the_cuda_cache_where_there_is_cuda(
    monkeypatch: pytest.MonkeyPatch, cuda: bool
) -> None:
    emptied: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    net, batch = make_net(), make_batch(73)
    pieces = Pieces("auto")
    attach(pieces, net, "sum")

    def step(b: Any, i: int) -> Tensor:
        if len(b["x"]) > 2:
            raise OOM("CUDA out of memory (injected)")
        return whole_loss(net, b, "sum")

    begin(pieces, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pieces.step(step, batch, 0)
    assert pieces.found == 2 and emptied == ([1, 1] if cuda else [])  # (8 -> 4 -> 2: once per back-off)
    assert close(grads(net), reference([batch], "sum"))
