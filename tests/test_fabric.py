"""``FabricAccumulator``: a Lightning Fabric loop's windows against the float64 reference loop
(helpers.Reference, which forms the same windows by hand), on one process and on 2 CPU ranks
(DDP, gloo, forked): constant k, a token ramp, items with micro-batches of no items, short last
windows, resume at a step and inside a window; one gradient collective round per step; refusals."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric

from lightning_accum import Constant, NonFiniteWindowError, Piecewise, Ramp, Schedule
from lightning_accum._core import collectives
from lightning_accum.fabric import FabricAccumulator

from helpers import (
    Batch,
    Reference,
    TokenData,
    count_tokens,
    default_dtype,
    make_net,
    max_diff,
    rank_batches,
    token_losses,
)


@pytest.fixture(autouse=True)
def float64_outputs() -> Iterator[None]:
    """Fabric's "64-true" casts a module's outputs to the default dtype: float64 here, to compare at 1e-12."""
    with default_dtype(torch.float64):
        yield


DATA = TokenData(50)  # 13 batches of 4 per epoch: short last windows
BATCHES = rank_batches(DATA, 4)[0]
EMPTY = TokenData(48, seed=5)
EMPTY.mask[8:12] = 0.0  # the third batch of 4 holds no token


def fit(
    fabric: Fabric,
    schedule: Schedule,
    epochs: list[list[Batch]],
    *,
    normalize: str = "mean",
    reduction: str | None = None,
    stop: int | None = None,
    save: Path | None = None,
    resume: Path | None = None,
    **kwargs: Any,
) -> list[torch.Tensor]:
    """The loop a user writes; ``stop``: save after that many micro-batches and return."""
    net = make_net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    items = normalize == "items"
    acc = FabricAccumulator(
        fabric, model, optimizer, schedule, normalize=normalize, count=count_tokens if items else None,
        reduction=reduction, **kwargs,
    )  # fmt: skip
    state = {"model": model, "optimizer": optimizer, "accumulation": acc}
    done = 0
    if resume is not None:
        fabric.load(resume, state)
        done = int(json.loads(resume.with_suffix(".json").read_text())["done"])
    seen = 0
    for epoch, batches in enumerate(epochs):
        for batch in batches:
            seen += 1
            if seen <= done:
                continue
            with acc.accumulate(batch, epoch=epoch) as step:
                total, tokens = token_losses(model, batch)
                step.backward(total if reduction == "sum" else total / tokens)
            if seen == stop:
                assert save is not None
                fabric.save(save, state)
                save.with_suffix(".json").write_text(json.dumps({"done": seen}))
                fabric.barrier()  # (rank 0 writes the checkpoint; every rank reads it)
                return []
        if seen >= done:  # (an epoch that ended before the checkpoint was flushed before it)
            acc.flush()
    return [p.detach().clone() for p in net.parameters()]


def single() -> Fabric:
    return Fabric(accelerator="cpu", devices=1, precision="64-true")


CASES: dict[str, tuple[Schedule, dict[str, Any], TokenData]] = {
    "constant": (Constant(3), {}, DATA),
    "token ramp": (Ramp(1, 4, over=150, unit="items"), {"normalize": "items", "reduction": "sum"}, DATA),
    "steps, items, a mean": (Piecewise({0: 2, 3: 3}, unit="step"), {"normalize": "items", "reduction": "mean"}, DATA),
    "no items, sum": (Constant(2), {"normalize": "items", "reduction": "sum"}, EMPTY),
    "no items, mean": (Constant(3), {"normalize": "items", "reduction": "mean"}, EMPTY),
}


@pytest.mark.parametrize("name", list(CASES))
def test_one_process_matches_the_reference(name: str) -> None:
    schedule, options, data = CASES[name]
    got = fit(single(), schedule, [rank_batches(data, 4)[0]] * 2, **options)
    expected, _ = Reference(schedule, normalize=options.get("normalize", "mean"), optimizer="plain-sgd").run(
        [rank_batches(data, 4)] * 2
    )
    assert max_diff(got, expected) <= 1e-12


# inside a window; at a step; at an epoch's last batch (flushed after the resume); inside the second epoch
@pytest.mark.parametrize("stop", [6, 7, 13, 14])
def test_resume_at_a_step_and_inside_a_window(tmp_path: Path, stop: int) -> None:
    schedule, options = Ramp(1, 4, over=150, unit="items"), {"normalize": "items", "reduction": "mean"}
    epochs = [rank_batches(DATA, 4)[0]] * 2
    full = fit(single(), schedule, epochs, **options)
    fit(single(), schedule, epochs, stop=stop, save=tmp_path / "ckpt.pt", **options)
    resumed = fit(single(), schedule, epochs, resume=tmp_path / "ckpt.pt", **options)
    assert max_diff(resumed, full) == 0.0


def test_lr_schedule_and_clipping_act_on_the_window() -> None:
    """``lr_scaling`` multiplies the step's LR by k / first k, clipping the normalised gradient."""
    schedule = Piecewise({0: 2, 2: 4}, unit="step")
    got = fit(single(), schedule, [rank_batches(DATA, 4)[0]], lr_scaling="linear", gradient_clip_val=0.05)
    reference = Reference(schedule, optimizer="plain-sgd", lr_scaling="linear", clip=0.05)
    expected, _ = reference.run([rank_batches(DATA, 4)])
    assert max_diff(got, expected) <= 1e-12


def ranks(tmp_path: Path, run: Callable[[Fabric, Path], None]) -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp_fork", precision="64-true")
    fabric.launch(run, tmp_path)


def _two_ranks(fabric: Fabric, out: Path) -> None:
    torch.set_default_dtype(torch.float64)
    calls = []
    original = collectives._all_reduce_sum
    collectives._all_reduce_sum = lambda flat: (calls.append(1), original(flat))  # type: ignore[assignment,func-returns-value]
    try:
        schedule = Ramp(1, 3, over=60, unit="items")
        data = TokenData(48)
        got = fit(fabric, schedule, [rank_batches(data, 4, world=2)[fabric.global_rank]] * 2, normalize="items",
                  reduction="sum")  # fmt: skip
    finally:
        collectives._all_reduce_sum = original  # type: ignore[assignment]
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps({"params": [p.tolist() for p in got],
                                                                     "rounds": len(calls)}))  # fmt: skip


@pytest.mark.slow
def test_two_ranks_match_the_reference_with_one_gradient_round_per_step(tmp_path: Path) -> None:
    ranks(tmp_path, _two_ranks)
    data = TokenData(48)
    schedule = Ramp(1, 3, over=60, unit="items")
    expected, sizes = Reference(schedule, normalize="items", optimizer="plain-sgd").run(
        [rank_batches(data, 4, world=2)] * 2
    )
    for r in range(2):
        result = json.loads((tmp_path / f"rank{r}.json").read_text())
        got = [torch.tensor(p, dtype=torch.float64) for p in result["params"]]
        assert max_diff(got, expected) <= 1e-12
        assert result["rounds"] == len(sizes)  # one bucketed gradient all-reduce per optimizer step


def test_a_block_without_step_backward_is_refused() -> None:
    """(The rest of the misuse table is in ``tests/test_fabric_misuse.py``.)"""
    fabric = single()
    net = make_net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    acc = FabricAccumulator(fabric, model, optimizer, 2)
    with pytest.raises(RuntimeError, match=r"made no `step.backward\(loss\)`"), acc.accumulate(BATCHES[0]):
        pass
    assert acc.progress.step == 0 and all(p.grad is None for p in net.parameters())


def test_noise_scale_measures_and_moves_k() -> None:
    """``NoiseScale`` and AdaScale measure in a Fabric loop as in the Trainer's: the probe's prefixes
    after the window's first micro-batches, the whole window at its end."""
    from lightning_accum import NoiseScale

    fabric = single()
    net = make_net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    schedule = NoiseScale(2, 16, warmup=2, every=1)
    acc = FabricAccumulator(fabric, model, optimizer, schedule, lr_scaling="adascale")
    ks = []
    for epoch, batches in enumerate([rank_batches(TokenData(96), 2)[0]] * 3):
        for batch in batches:
            with acc.accumulate(batch, epoch=epoch) as step:
                total, tokens = token_losses(model, batch)
                step.backward(total / tokens)
            if step.stepped:
                ks.append(step.window.k)  # type: ignore[union-attr]
        acc.flush()
    assert schedule.estimator.updates > 2 and len(set(ks)) > 1
    assert acc.progress.scaled_steps != acc.progress.step  # AdaScale's gain moved the LR


def _two_ranks_resume(fabric: Fabric, out: Path) -> None:
    torch.set_default_dtype(torch.float64)
    schedule, options = Ramp(1, 4, over=80, unit="items"), {"normalize": "items", "reduction": "mean"}
    epochs = [rank_batches(TokenData(48), 4, world=2)[fabric.global_rank]] * 2
    full = fit(fabric, schedule, epochs, **options)
    fit(fabric, schedule, epochs, stop=5, save=out / "ckpt.pt", **options)  # inside a window: each rank's part
    resumed = fit(fabric, schedule, epochs, resume=out / "ckpt.pt", **options)
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps({"gap": max_diff(resumed, full)}))


@pytest.mark.slow
def test_two_ranks_resume_inside_a_window_bit_identically(tmp_path: Path) -> None:
    ranks(tmp_path, _two_ranks_resume)
    for r in range(2):
        assert json.loads((tmp_path / f"rank{r}.json").read_text())["gap"] == 0.0


# ---------------------------------------------------------------------- issue 30: behaviour the misuse found
def made(schedule: Schedule, **kwargs: Any) -> tuple[Any, FabricAccumulator]:
    fabric = single()
    net = make_net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    return net, FabricAccumulator(fabric, model, optimizer, schedule, **kwargs)


def passes(acc: FabricAccumulator, epochs: list[list[Batch]], split: str, last: bool = False) -> None:
    """The loop with each micro-batch's loss in two backward passes (the masked error on each half of the
    tokens: an LM loss and an auxiliary loss over the same tokens), ``split``: "mean" (each pass a mean over
    the micro-batch's tokens, weighted by ``count(batch)``), or "items" (each a mean over its own half's
    tokens, ``items=`` per pass)."""
    for epoch, batches in enumerate(epochs):
        for i, batch in enumerate(batches):
            with acc.accumulate(batch, epoch=epoch, last=last and i == len(batches) - 1) as step:
                err = (acc.model(batch["x"]) - batch["y"]).squeeze(-1) ** 2 * batch["mask"]
                halves = [err[:, :2], err[:, 2:]]
                if split == "mean":
                    for j, half in enumerate(halves):
                        step.backward(half.sum() / batch["mask"].sum(), retain_graph=j == 0)
                else:
                    masks = [batch["mask"][:, :2], batch["mask"][:, 2:]]
                    for j, (half, mask) in enumerate(zip(halves, masks, strict=True)):
                        step.backward(half.sum() / mask.sum(), items=mask.sum(), retain_graph=j == 0)
        acc.flush()


@pytest.mark.parametrize("split", ["mean", "items"])
def test_two_backward_passes_per_micro_batch_count_its_items_once(split: str) -> None:
    """Two passes of one micro-batch equal one pass of their sum: the micro-batch's items are counted once
    (``reduction="mean"`` weights each pass by ``count(batch)``), or each pass adds its own ``items=``."""
    schedule = Ramp(1, 4, over=150, unit="items")
    net, acc = made(schedule, normalize="items", count=count_tokens, reduction="mean")
    passes(acc, [BATCHES] * 2, split)
    expected, sizes = Reference(schedule, normalize="items", optimizer="plain-sgd").run([[BATCHES]] * 2)
    assert max_diff(list(net.parameters()), expected) <= 1e-12
    assert acc.progress.items == 2 * int(DATA.mask.sum())  # not twice that: items-keyed schedules keep pace
    assert acc.progress.step == len(sizes)


def test_last_closes_the_window_with_its_micro_batch() -> None:
    """``last=True`` steps the window at that block (no ``flush`` needed): the same windows as ``flush``."""
    schedule = Constant(3)
    net, acc = made(schedule, normalize="items", count=count_tokens, reduction="mean")
    passes(acc, [BATCHES] * 2, "mean", last=True)
    expected, _ = Reference(schedule, normalize="items", optimizer="plain-sgd").run([[BATCHES]] * 2)
    assert max_diff(list(net.parameters()), expected) <= 1e-12


def test_a_python_int_count_of_zero_adds_nothing() -> None:
    """``count(batch)`` giving a Python 0 (or ``items=0``) with a mean loss: the micro-batch adds nothing, as a
    tensor 0 does (it used to raise "element 0 of tensors does not require grad")."""
    schedule = Constant(3)

    def int_count(batch: Batch) -> int:
        return int(batch["mask"].sum())

    net, acc = made(schedule, normalize="items", count=int_count, reduction="mean")
    epochs = [rank_batches(EMPTY, 4)[0]] * 2
    for epoch, batches in enumerate(epochs):
        for batch in batches:
            with acc.accumulate(batch, epoch=epoch) as step:
                total, tokens = token_losses(acc.model, batch)
                step.backward(total / tokens)  # NaN for the batch without tokens
        acc.flush()
    expected, _ = Reference(schedule, normalize="items", optimizer="plain-sgd").run([rank_batches(EMPTY, 4)] * 2)
    assert max_diff(list(net.parameters()), expected) <= 1e-12


def test_a_window_of_no_items_is_neither_stepped_nor_counted() -> None:
    net, acc = made(Constant(2), normalize="items", count=count_tokens, reduction="sum")
    empty = rank_batches(EMPTY, 4)[0][2]  # no token
    with pytest.warns(UserWarning, match="global item count is 0"):
        with acc.accumulate(empty) as step:
            step.backward(token_losses(acc.model, empty)[0])
        assert acc.flush() is None
    assert acc.progress.step == 0 and acc.progress.samples == 4 and all(p.grad is None for p in net.parameters())
    with acc.accumulate(empty) as step:
        step.backward(token_losses(acc.model, empty)[0])
    with acc.accumulate(empty) as step:
        step.backward(token_losses(acc.model, empty)[0])
    assert not step.stepped and step.window is None and acc.progress.step == 0


def test_a_non_finite_window_is_refused_when_clipping_by_norm() -> None:
    """As ``fabric.clip_gradients`` (its ``error_if_nonfinite=True`` default): a NaN window gradient raises
    rather than making every parameter NaN; the window is left out and the next starts clean."""
    net, acc = made(Constant(2), gradient_clip_val=1.0)
    before = [p.detach().clone() for p in net.parameters()]
    with acc.accumulate(BATCHES[0]) as step:
        step.backward(token_losses(acc.model, BATCHES[0])[0])
    nan = r"not finite .* so it was not stepped: `gradient_clip_val`"
    caught: list[BaseException] = []
    try:  # (code written against Fabric: `fabric.clip_gradients` raises a RuntimeError)
        with acc.accumulate(BATCHES[1]) as step:
            step.backward(token_losses(acc.model, BATCHES[1])[0] * float("nan"))
    except RuntimeError as error:
        caught.append(error)
    assert len(caught) == 1 and re.search(nan, str(caught[0]))
    assert isinstance(caught[0], NonFiniteWindowError) and isinstance(caught[0], FloatingPointError)
    assert max_diff(list(net.parameters()), before) == 0.0
    assert all(p.grad is None for p in net.parameters()) and acc.progress.step == 0
    for batch in BATCHES[2:4]:  # the next window: clean
        with acc.accumulate(batch) as step:
            step.backward(token_losses(acc.model, batch)[0])
    assert step.stepped and all(bool(torch.isfinite(p).all()) for p in net.parameters())


def test_an_exception_inside_a_block_leaves_out_only_what_it_cut() -> None:
    """Raised before any ``step.backward``: the window goes on as it was. Raised after one: the micro-batch is
    partly in the window, so the window is left out (warned) and its gradient cleared; a loop that goes on
    starts a clean window."""
    net, acc = made(Constant(3))
    reference_net, reference = made(Constant(3))

    def block(a: FabricAccumulator, batch: Batch) -> None:
        with a.accumulate(batch) as step:
            step.backward(token_losses(a.model, batch)[0])

    block(acc, BATCHES[0]), block(reference, BATCHES[0])
    with pytest.raises(KeyError), acc.accumulate(BATCHES[1]):
        raise KeyError("before any backward")
    block(acc, BATCHES[1]), block(reference, BATCHES[1])
    assert max_diff([p.grad for p in net.parameters()], [p.grad for p in reference_net.parameters()]) == 0.0
    cut = r"after its `step.backward`: .* the window \(2 earlier micro-batch\(es\) and this one\) was left out"
    with pytest.warns(UserWarning, match=cut), pytest.raises(KeyError), acc.accumulate(BATCHES[2]) as step:
        step.backward(token_losses(acc.model, BATCHES[2])[0])
        raise KeyError("after a backward")
    assert acc._engine.window is None and all(p.grad is None for p in net.parameters())
    assert acc.progress.step == 0


def test_state_dict_right_after_a_load_keeps_the_partial_window(tmp_path: Path) -> None:
    """A checkpoint saved again before the next block (a loop saving at the top of each iteration) holds the
    partial gradient the first one held: a run resumed from it is bit-identical."""
    schedule, options = Ramp(1, 4, over=150, unit="items"), {"normalize": "items", "reduction": "mean"}
    epochs = [BATCHES] * 2
    full = fit(single(), schedule, epochs, **options)
    fit(single(), schedule, epochs, stop=8, save=tmp_path / "first.pt", **options)  # inside a window
    net = make_net()
    fabric = single()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    acc = FabricAccumulator(fabric, model, optimizer, schedule, count=count_tokens, **options)  # type: ignore[arg-type]
    fabric.load(tmp_path / "first.pt", {"model": model, "optimizer": optimizer, "accumulation": acc})
    fabric.save(tmp_path / "second.pt", {"model": model, "optimizer": optimizer, "accumulation": acc})
    (tmp_path / "second.json").write_text((tmp_path / "first.json").read_text())
    resumed = fit(single(), schedule, epochs, resume=tmp_path / "second.pt", **options)
    assert max_diff(resumed, full) == 0.0


@pytest.mark.slow
def test_a_window_saved_on_one_process_is_refused_on_two_and_back(tmp_path: Path) -> None:
    """One direction here (2 ranks' checkpoint into one process); the other in ``_world_sizes``."""
    schedule = Constant(3)
    fit(single(), schedule, [BATCHES], stop=2, save=tmp_path / "one.pt")  # inside a window
    ranks(tmp_path, _world_sizes)
    assert json.loads((tmp_path / "rank1.json").read_text())["refused"].startswith("The checkpoint was saved inside")
    net = make_net()
    fabric = single()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    acc = FabricAccumulator(fabric, model, optimizer, schedule)
    with pytest.raises(ValueError, match=r"saved inside an accumulation window on 2 rank\(s\).*cannot resume on 1"):
        fabric.load(tmp_path / "two.pt", {"model": model, "optimizer": optimizer, "accumulation": acc})
    assert acc._engine.window is None and acc.progress.step == 0  # (the accumulator refused before changing)


def _world_sizes(fabric: Fabric, out: Path) -> None:
    torch.set_default_dtype(torch.float64)
    schedule, rank = Constant(3), fabric.global_rank
    fit(fabric, schedule, [rank_batches(TokenData(48), 4, world=2)[rank]], stop=2, save=out / "two.pt")
    net = make_net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    acc = FabricAccumulator(fabric, model, optimizer, schedule)
    try:
        fabric.load(out / "one.pt", {"model": model, "optimizer": optimizer, "accumulation": acc})
        refused = ""
    except ValueError as error:
        refused = str(error)
    (out / f"rank{rank}.json").write_text(json.dumps({"refused": refused}))


def _hand_written(fabric: Fabric, batches: list[Batch], k: int, accumulator: bool) -> list[torch.Tensor]:
    """Fabric's documented accumulation loop (LitGPT's), or the same windows through the accumulator."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    acc = FabricAccumulator(fabric, model, optimizer, k, log=False) if accumulator else None
    for i, batch in enumerate(batches):
        x, y, mask = (batch[key].float() for key in ("x", "y", "mask"))
        err = ((model(x) - y).squeeze(-1) ** 2 * mask).sum() / mask.sum()
        if acc is not None:
            with acc.accumulate(batch) as step:
                step.backward(err)
            continue
        accumulating = (i + 1) % k != 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            fabric.backward(err / k)
        if not accumulating:
            optimizer.step()
            optimizer.zero_grad()
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "32-true"])
def test_bit_identical_to_fabrics_own_loop_under_each_cpu_precision(precision: str) -> None:
    """Full windows of a constant k: the accumulator's step equals Fabric's hand-written loop bit for bit
    (the same division by k, no rescale, the same step), under each precision plugin a CPU has."""
    with default_dtype(torch.float32):
        batches = [{k: v.float() for k, v in b.items()} for b in rank_batches(TokenData(48), 4)[0]]  # 12: k | 12
        got = _hand_written(Fabric(accelerator="cpu", devices=1, precision=precision), batches, 3, True)  # type: ignore[arg-type]
        want = _hand_written(Fabric(accelerator="cpu", devices=1, precision=precision), batches, 3, False)  # type: ignore[arg-type]
    assert max_diff(got, want) == 0.0


def mean_loss(model: Any, batch: Batch) -> torch.Tensor:
    total, tokens = token_losses(model, batch)
    return total / tokens


def test_a_rollback_to_a_step_checkpoint_inside_a_window_drops_the_window(tmp_path: Path) -> None:
    """Loading a checkpoint saved at a step while a window is open (rolling back after a loss spike) gives up the
    open window for the checkpoint's state: its gradient does not leak into the next window."""
    net, acc = made(Constant(2))
    state = {"accumulation": acc, "model": acc.model, "optimizer": acc.optimizer}
    acc.fabric.save(tmp_path / "step.pt", state)  # at a step (none yet)
    with acc.accumulate(BATCHES[5]) as step:
        step.backward(mean_loss(acc.model, BATCHES[5]))
    acc.fabric.load(tmp_path / "step.pt", state)
    for batch in BATCHES[:4]:
        with acc.accumulate(batch) as step:
            step.backward(mean_loss(acc.model, batch))
    expected, _ = Reference(Constant(2), optimizer="plain-sgd").run([[BATCHES[:4]]])
    assert max_diff(list(net.parameters()), expected) <= 1e-12


def test_a_block_that_backpropagates_around_step_backward_drops_the_window() -> None:
    """`loss.backward()` in a block cannot be seen, but a block without `step.backward` is refused, and what it may
    have added leaves the window (warned): the next window is clean."""
    net, acc = made(Constant(2))
    with acc.accumulate(BATCHES[0]) as step:
        step.backward(mean_loss(acc.model, BATCHES[0]))
    went_around = r"no `step.backward`: .* the window \(1 earlier micro-batch\(es\) and this one\) was left out"
    refused = pytest.raises(RuntimeError, match=r"made no `step.backward")
    with pytest.warns(UserWarning, match=went_around), refused, acc.accumulate(BATCHES[1]):
        token_losses(acc.model, BATCHES[1])[0].backward()  # (the automatic-optimization habit)
    assert all(p.grad is None for p in net.parameters()) and acc._engine.window is None
    for batch in BATCHES[2:4]:
        with acc.accumulate(batch) as step:
            step.backward(mean_loss(acc.model, batch))
    expected, _ = Reference(Constant(2), optimizer="plain-sgd").run([[BATCHES[2:4]]])
    assert max_diff(list(net.parameters()), expected) <= 1e-12


def test_a_count_the_batch_holds_is_taken_as_it_was_when_the_block_opened() -> None:
    """A tensor count read at the window's end is a copy: changed in the block (or refilled by the loader for the
    next micro-batch), it counts as it was."""
    net, acc = made(Constant(2), normalize="items", count=lambda batch: batch["n"], reduction="sum")
    for batch in BATCHES[:4]:
        batch = {**batch, "n": batch["mask"].sum()}
        with acc.accumulate(batch) as step:
            step.backward(token_losses(acc.model, batch)[0])
            batch["n"] += 100
    expected, _ = Reference(Constant(2), normalize="items", optimizer="plain-sgd").run([[BATCHES[:4]]])
    assert max_diff(list(net.parameters()), expected) <= 1e-12
    assert acc.progress.items == int(sum(b["mask"].sum() for b in BATCHES[:4]))


def test_a_tensor_count_found_bad_at_the_windows_end_says_so() -> None:
    """A tensor's value is read with the window's counts: found negative then, the error names it and the warning
    says the window was left out (its gradient cleared: a loop that goes on starts clean)."""
    counts = iter([torch.tensor(3.0), torch.tensor(-1.0)])
    net, acc = made(Constant(2), normalize="items", count=lambda batch: next(counts), reduction="sum")
    with acc.accumulate(BATCHES[0]) as step:
        step.backward(token_losses(acc.model, BATCHES[0])[0])
    bad = r"the window's tensor count 1, from `count\(batch\)` or `items=`\) was -1"
    left_out = pytest.warns(UserWarning, match=r"step failed \(ValueError\).*2 micro-batch")
    with left_out, pytest.raises(ValueError, match=bad), acc.accumulate(BATCHES[1]) as step:
        step.backward(token_losses(acc.model, BATCHES[1])[0])
    assert all(p.grad is None for p in net.parameters()) and acc.progress.step == 0
