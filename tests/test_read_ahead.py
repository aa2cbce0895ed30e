"""The opt-in reading ahead of a ``Budget``'s counts for the mixin (``configure_accumulation(read_ahead=True)``) and
the Fabric helper (``FabricAccumulator.read_ahead(loader)``), issue 52: on one process with the test switch
(``_core.ahead.ON_ONE_PROCESS``, where nothing is summed but every count goes through ``CountsAhead``), the windows
against the float64 reference of ``test_budget.py`` (with ``last=True``, ``flush()``, ``epoch=``, a loop broken out
of, a resume inside a window); the contracts and their refusals. The same on 2 gloo ranks:
``tests/distributed/test_budget_ddp.py``."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from test_budget import BATCH, DATA, epochs_of, reference, tokens_of

from lightning_accum import Budget, FabricAccumulator

from helpers import (
    Batch,
    ManualTokenModel,
    count_tokens,
    default_dtype,
    loader,
    make_net,
    max_diff,
    params_of,
    token_losses,
    trainer,
)


def batches_of(epoch: int = 0) -> list[Batch]:
    return epochs_of(epoch + 1)[epoch][0]


# ---------------------------------------------------------------------- the mixin
@pytest.mark.parametrize(("mode", "n", "unit"), [("backward", 25, "items"), ("items_arg", 25, "items"),
                                                 ("backward", 9, "samples")])  # fmt: skip
def test_mixin_reading_ahead_equals_the_reference(reads_ahead: list[int], mode: str, n: int, unit: str) -> None:
    model = ManualTokenModel(mode=mode, schedule=Budget(n, unit=unit), normalize="items", count=count_tokens,  # type: ignore[arg-type]
                             read_ahead=True)  # fmt: skip
    trainer().fit(model, loader(DATA, BATCH))
    expected, sizes, _ = reference(epochs_of(2), lambda p: n, unit)
    assert max_diff(params_of(model), expected) < 1e-12
    assert model.accumulation_progress.step == len(sizes)
    assert reads_ahead == [0, 4, 8, 12] * 2  # (each epoch's chunks: 11 batches, read ahead 4 at a time)


# (inside the budget's windows of 25 tokens over `test_faults.DATA`, [0-1] [2-4] [5-6] ...)
@pytest.mark.parametrize(
    "fault",
    [("after_block", (0, 2)), ("after_block", (0, 3)), ("before_block", (0, 3)), ("on_train_batch_end", (0, 3)),
     ("validation", (0, 4)), ("sigterm", (0, 3)), ("on_train_batch_start", (0, 6))],
)  # fmt: skip
def test_mixin_reading_ahead_resumes_inside_a_window_bit_identically(
    reads_ahead: list[int], tmp_path: Path, fault: tuple[str, tuple[int, int]]
) -> None:
    from test_faults import Fault, fail_and_resume

    where, at = fault
    injected = Fault(where, at) if where.startswith("on_") or where in ("validation", "sigterm") else fault
    assert fail_and_resume("mixin+budget+ahead", tmp_path, injected, "exception") == []
    assert reads_ahead


class TwoBlocks(ManualTokenModel):
    def training_step(self, batch: Batch, batch_idx: int) -> None:
        for half in (slice(0, 2), slice(2, 4)):
            with self.accumulate({k: v[half] for k, v in batch.items()}) as acc:
                acc.backward(token_losses(self.net, {k: v[half] for k, v in batch.items()})[0])


class OtherBatch(ManualTokenModel):
    """A block on a batch other than the step's (its first sample dropped)."""

    def training_step(self, batch: Batch, batch_idx: int) -> None:
        part = {k: v[1:] for k, v in batch.items()}
        with self.accumulate(part) as acc:
            acc.backward(token_losses(self.net, part)[0])


def mixin(model_class: type = ManualTokenModel, **options: Any) -> ManualTokenModel:
    options = {"schedule": Budget(25), "normalize": "items", "count": count_tokens, "reduction": "sum", **options}
    return model_class(**options)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: mixin(read_ahead="yes"), TypeError, r"`read_ahead` must be True or False; got 'yes'"),
        (lambda: mixin(read_ahead=None), TypeError, r"`read_ahead` must be True or False; got None"),
        (lambda: mixin(read_ahead=1), TypeError, r"`read_ahead` must be True or False; got 1"),
        (lambda: mixin(read_ahead=0), TypeError, r"`read_ahead` must be True or False; got 0"),
        (lambda: mixin(read_ahead=-1), TypeError, r"`read_ahead` must be True or False; got -1"),
        (lambda: mixin(read_ahead=math.nan), TypeError, r"`read_ahead` must be True or False; got nan"),
        (lambda: mixin(read_ahead="True"), TypeError, r"`read_ahead` must be True or False; got 'True'"),
    ],
)
def test_mixin_read_ahead_misuse_is_refused_naming_the_argument(
    make: Callable[[], Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        make()


def test_mixin_a_second_block_in_one_training_step_is_refused_naming_the_option(reads_ahead: list[int]) -> None:
    with pytest.raises(RuntimeError, match=r"second `self.accumulate\(...\)` block in one `training_step` under "
                                           r"`configure_accumulation\(read_ahead=True\)`"):  # fmt: skip
        trainer().fit(mixin(TwoBlocks, read_ahead=True), loader(DATA, BATCH))
    trainer(max_epochs=1).fit(mixin(TwoBlocks), loader(DATA, BATCH))  # (without the option: as before)


def test_mixin_a_second_block_is_refused_without_a_budget_and_on_one_process_too() -> None:
    with pytest.raises(RuntimeError, match=r"read_ahead=True"):
        trainer().fit(mixin(TwoBlocks, schedule=3, read_ahead=True), loader(DATA, BATCH))
    with pytest.raises(RuntimeError, match=r"read_ahead=True"):
        trainer().fit(mixin(TwoBlocks, read_ahead=True), loader(DATA, BATCH))


def test_mixin_a_block_on_another_batch_is_refused_where_its_count_differs(reads_ahead: list[int]) -> None:
    """(Batch 0's count is its own, as its chunk goes out with it; batch 1's was read from the loader's batch.)"""
    match = r"for batch 1 of the epoch, `count\(batch\)` gave \d+ there, but gives \d+ for the batch `training_step`"
    with pytest.raises(ValueError, match=match):
        trainer().fit(mixin(OtherBatch, read_ahead=True), loader(DATA, BATCH))


def test_mixin_without_a_budget_or_on_one_process_reads_nothing_ahead() -> None:
    calls: list[int] = []

    def counting(batch: Batch) -> Any:
        calls.append(1)
        return count_tokens(batch)

    model = mixin(count=counting, read_ahead=True)
    trainer(max_epochs=1).fit(model, loader(DATA, BATCH))  # (one process, no switch)
    assert len(calls) == len(batches_of())  # once per batch, as its block opens
    model = mixin(schedule=3, count=counting, read_ahead=True)
    trainer().fit(model, loader(DATA, BATCH))
    expected, _, _ = reference(epochs_of(2), lambda p: 10**9, max_k=3)  # (windows of 3, as a fixed k)
    assert max_diff(params_of(model), expected) < 1e-12


# ---------------------------------------------------------------------- the Fabric helper
def fabric_acc(schedule: Any = None, **options: Any) -> tuple[FabricAccumulator, Any, torch.nn.Module]:
    with default_dtype(torch.float32):  # (as the reference's: made under float32 defaults, then cast)
        net = make_net()
    fabric = Fabric(accelerator="cpu", devices=1, precision="64-true")
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    options = {"normalize": "items", "count": count_tokens, "reduction": "sum", **options}
    acc = FabricAccumulator(fabric, model, optimizer, Budget(25) if schedule is None else schedule, **options)
    return acc, model, net


def train(acc: FabricAccumulator, model: Any, batch: Batch, **options: Any) -> Any:
    with acc.accumulate(batch, **options) as step:
        step.backward(token_losses(model, batch)[0])
    return step


def plain_sgd(epochs: list[list[list[Batch]]], n: int = 25, **options: Any) -> tuple[list[torch.Tensor], list[int]]:
    params, sizes, _ = reference(epochs, lambda p: n, optimizer="plain-sgd", **options)
    return params, sizes


@pytest.mark.parametrize("form", ["list", "generator", "epoch", "last", "samples", "DataLoader"])
def test_fabric_reading_ahead_equals_the_reference(reads_ahead: list[int], form: str) -> None:
    with default_dtype(torch.float64):
        acc, model, net = fabric_acc(Budget(9, unit="samples") if form == "samples" else None)
        for epoch, ranks in enumerate(epochs_of(2)):
            data = ranks[0]
            source: Any = data
            if form == "generator":
                source = (b for b in data)
            elif form == "DataLoader":
                source = loader(DATA, BATCH)
            for i, batch in enumerate(acc.read_ahead(source)):
                options: dict[str, Any] = {"epoch": epoch} if form == "epoch" else {}
                if form == "last":
                    options["last"] = i == len(data) - 1
                train(acc, model, batch, **options)
            assert acc.flush() is None or form != "last"
    expected, sizes = plain_sgd(epochs_of(2), 9 if form == "samples" else 25, unit="samples" if form == "samples"
                                else "items")  # fmt: skip
    assert max_diff([p.detach() for p in net.parameters()], expected) < 1e-12
    assert acc.progress.step == len(sizes)
    assert reads_ahead == [0, 4, 8, 12] * 2  # (the last chunk: past the data, its end checked there)


def test_fabric_a_loop_broken_out_of_then_a_new_one_each_epoch(reads_ahead: list[int]) -> None:
    with default_dtype(torch.float64):
        acc, model, net = fabric_acc()
        for epoch in range(2):
            for i, batch in enumerate(acc.read_ahead(batches_of(epoch))):
                if i == 6:
                    break
                train(acc, model, batch, epoch=epoch)
            acc.flush()
    expected, sizes = plain_sgd(epochs_of(2, batches=6))
    assert max_diff([p.detach() for p in net.parameters()], expected) < 1e-12
    assert acc.progress.step == len(sizes)


@pytest.mark.parametrize("at", [1, 3, 6])
def test_fabric_resumes_inside_a_window_as_without_reading_ahead(reads_ahead: list[int], at: int) -> None:
    """A checkpoint after batch ``at`` (inside a window), a new accumulator loaded from it reading ahead from the
    next batch: the windows of an uninterrupted run, and the reference's."""
    with default_dtype(torch.float64):
        acc, model, net = fabric_acc()
        data = batches_of()
        for i, batch in enumerate(acc.read_ahead(data)):
            train(acc, model, batch)
            if i == at:
                break
        assert acc._engine.window is not None and acc._engine.window.microbatches  # (inside a window)
        state, weights = acc.state_dict(), {k: v.clone() for k, v in net.state_dict().items()}
        acc, model, _ = fabric_acc()  # (a new process, as it were: the model's weights, then the accumulator's state)
        model.load_state_dict(weights)
        acc.load_state_dict(state)
        for batch in acc.read_ahead(data[at + 1 :]):
            train(acc, model, batch)
        acc.flush()
    expected, sizes = plain_sgd(epochs_of(1))
    assert max_diff([p.detach() for p in model.parameters()], expected) < 1e-12
    assert acc.progress.step == len(sizes)


def test_fabric_without_a_budget_or_on_one_process_only_iterates() -> None:
    calls: list[int] = []

    def counting(batch: Batch) -> Any:
        calls.append(1)
        return count_tokens(batch)

    with default_dtype(torch.float64):
        acc, model, _ = fabric_acc(count=counting)  # (one process, no switch)
        for batch in acc.read_ahead(batches_of()):
            train(acc, model, batch)
        assert len(calls) == len(batches_of())  # (once per block: nothing read ahead)
        acc, model, net = fabric_acc(3)
        for batch in acc.read_ahead(batches_of()):
            train(acc, model, batch)
        acc.flush()
    expected, _ = plain_sgd(epochs_of(1), 10**9, max_k=3)
    assert max_diff([p.detach() for p in net.parameters()], expected) < 1e-12


def test_fabric_a_loader_of_no_batch_yields_nothing(reads_ahead: list[int]) -> None:
    acc, _, _ = fabric_acc()
    assert list(acc.read_ahead([])) == []
    assert list(acc.read_ahead(iter(()))) == []
    assert acc.flush() is None and acc.progress.step == 0


def loop_of(acc: FabricAccumulator, model: Any, misuse: Callable[[Iterator[Batch], Batch], None]) -> None:
    loop = acc.read_ahead(batches_of())
    for batch in loop:
        misuse(loop, batch)


def _another(acc: FabricAccumulator, model: Any) -> None:
    data = batches_of()
    for batch in acc.read_ahead(data):
        train(acc, model, data[5])
        del batch


def _a_copy(acc: FabricAccumulator, model: Any) -> None:
    for batch in acc.read_ahead(batches_of()):
        train(acc, model, dict(batch))


def _twice(acc: FabricAccumulator, model: Any) -> None:
    for batch in acc.read_ahead(batches_of()):
        train(acc, model, batch)
        train(acc, model, batch)


def _after_the_loop(acc: FabricAccumulator, model: Any) -> None:
    for batch in acc.read_ahead(batches_of()):
        train(acc, model, batch)
    train(acc, model, batch)


def _before_the_first(acc: FabricAccumulator, model: Any) -> None:
    loop = acc.read_ahead(batches_of())
    train(acc, model, batches_of()[0])
    next(loop)


def _interleaved(acc: FabricAccumulator, model: Any) -> None:
    first = acc.read_ahead(batches_of())
    train(acc, model, next(first))
    second = acc.read_ahead(batches_of())
    train(acc, model, next(second))
    next(first)


def _moved_on_in_a_block(acc: FabricAccumulator, model: Any) -> None:
    loop = acc.read_ahead(batches_of())
    batch = next(loop)
    with acc.accumulate(batch) as step:
        step.backward(token_losses(model, batch)[0])
        next(loop)


def _read_ahead_in_a_block(acc: FabricAccumulator, model: Any) -> None:
    batch = batches_of()[0]
    with acc.accumulate(batch) as step:
        step.backward(token_losses(model, batch)[0])
        acc.read_ahead(batches_of())


def _changed_before_the_block(acc: FabricAccumulator, model: Any) -> None:
    for batch in acc.read_ahead(batches_of()):
        batch["mask"] = torch.ones_like(batch["mask"])  # (the count read ahead was the loader's batch's)
        train(acc, model, batch)


def _raised_ahead(acc: FabricAccumulator, model: Any) -> None:
    acc, model, _ = fabric_acc(count=lambda b: b["tokens"])
    for batch in acc.read_ahead(batches_of()):
        batch["tokens"] = batch["mask"].sum()  # (the loader's batch has no count: it raised there)
        train(acc, model, batch)


@pytest.mark.parametrize(
    ("misuse", "error", "match"),
    [
        (lambda acc, m: acc.read_ahead(None), TypeError, r"`acc.read_ahead\(loader\)` needs the loader .* got None"),
        (lambda acc, m: acc.read_ahead(3), TypeError, r"got int, which is not iterable"),
        (lambda acc, m: acc.read_ahead("batches"), TypeError, r"needs the loader .* got 'batches'"),
        (lambda acc, m: acc.read_ahead(1.5), TypeError, r"got float, which is not iterable"),
        (lambda acc, m: acc.read_ahead(0), TypeError, r"got int, which is not iterable"),
        (lambda acc, m: acc.read_ahead(-1), TypeError, r"got int, which is not iterable"),
        (lambda acc, m: acc.read_ahead(math.nan), TypeError, r"got float, which is not iterable"),
        (_another, RuntimeError, r"got a batch other than the one it yielded last inside an `acc.read_ahead"),
        (_a_copy, RuntimeError, r"other than the one it yielded last .* \(checked by identity\)"),
        (_twice, RuntimeError, r"ran a second block on one batch of an `acc.read_ahead\(loader\)` loop"),
        (_after_the_loop, RuntimeError, r"second block on the batch the `read_ahead` loop yielded last \(after the"),
        (_before_the_first, RuntimeError, r"got a batch before the loop yielded any"),
        (_interleaved, RuntimeError, r"A `read_ahead` loop went on after another one began"),
        (_moved_on_in_a_block, RuntimeError, r"The `read_ahead` loop was moved on inside an `acc.accumulate"),
        (_read_ahead_in_a_block, RuntimeError, r"`acc.read_ahead\(...\)` was called inside an `acc.accumulate"),
        (
            _changed_before_the_block,
            ValueError,
            r"for batch 1 of the epoch, `count\(batch\)` gave \d+ there, but "
            r"gives \d+ for the batch the `accumulate` block gets",
        ),
        (_raised_ahead, ValueError, r"for batch 1 of the epoch, `count\(batch\)` raised there, but gives \d+"),
    ],
    ids=[
        "None",
        "int",
        "str",
        "float",
        "zero",
        "negative",
        "nan",
        "another batch",
        "a copy",
        "twice",
        "after the loop",
        "before the first",
        "interleaved",
        "moved on in a block",
        "read_ahead in a block",
        "count changed",
        "count raised ahead",
    ],
)
def test_fabric_read_ahead_misuse_is_refused(
    reads_ahead: list[int], misuse: Callable[[FabricAccumulator, Any], None], error: type, match: str
) -> None:
    with default_dtype(torch.float64):
        acc, model, _ = fabric_acc()
        with pytest.raises(error, match=match):
            misuse(acc, model)


@pytest.mark.parametrize("misuse", [_another, _twice, _after_the_loop, _interleaved])
def test_fabric_the_contract_is_checked_without_a_budget_and_on_one_process_too(misuse: Any) -> None:
    with default_dtype(torch.float64):
        acc, model, _ = fabric_acc(3)
        with pytest.raises(RuntimeError, match="read_ahead"):
            misuse(acc, model)


def test_fabric_a_block_that_raised_may_run_again_on_its_batch(reads_ahead: list[int]) -> None:
    with default_dtype(torch.float64):
        acc, model, net = fabric_acc()
        for i, batch in enumerate(acc.read_ahead(batches_of())):
            if i == 3:
                with pytest.raises(RuntimeError, match="hiccup"), acc.accumulate(batch):
                    raise RuntimeError("hiccup")
            train(acc, model, batch)
        acc.flush()
    expected, sizes = plain_sgd(epochs_of(1))
    assert max_diff([p.detach() for p in net.parameters()], expected) < 1e-12
    assert acc.progress.step == len(sizes)


def test_fabric_a_batch_without_a_block_adds_nothing(reads_ahead: list[int]) -> None:
    """A batch the loop yields may run no block (on every rank alike): it is not in any window."""
    data = batches_of()
    with default_dtype(torch.float64):
        acc, model, net = fabric_acc()
        for i, batch in enumerate(acc.read_ahead(data)):
            if i != 4:
                train(acc, model, batch)
        acc.flush()
    kept = [b for i, b in enumerate(data) if i != 4]
    expected, sizes = plain_sgd([[kept]])
    assert max_diff([p.detach() for p in net.parameters()], expected) < 1e-12
    assert acc.progress.step == len(sizes)
    assert sum(tokens_of(b) for b in kept) > 25


def test_mixin_a_count_of_more_than_one_number_is_refused_as_without_reading_ahead(reads_ahead: list[int]) -> None:
    """(Batch 0's count goes out as its chunk does, and is refused there; a later batch's was read ahead: refused
    where its block opens, with the same error.)"""
    third = batches_of()[2]["x"][0, 0, 0]

    def count(batch: Batch) -> Any:
        return batch["mask"].sum(1) if batch["x"][0, 0, 0] == third else batch["mask"].sum()

    with pytest.raises(ValueError, match="one number"):
        trainer().fit(mixin(count=count, read_ahead=True), loader(DATA, BATCH))
    with pytest.raises(ValueError, match="one number"):
        trainer().fit(mixin(count=lambda b: b["mask"].sum(1), read_ahead=True), loader(DATA, BATCH))


# ---------------------------------------------------------------------- found by the adversary (issue 52)
def test_fabric_a_loop_over_one_iterator_broken_out_of_and_read_on_trains_every_batch(reads_ahead: list[int]) -> None:
    """Breaking out of a loop over an iterator that yields each batch once, then a new ``read_ahead`` over the same
    iterator: the batches the first loop held are yielded first (they were silently lost before), and the stop is
    warned, since reading the iterator itself would skip them."""
    with default_dtype(torch.float64):
        acc, model, net = fabric_acc()
        source = iter(batches_of())
        with pytest.warns(UserWarning, match=r"stopped with \d+ batch\(es\) it had read ahead"):
            for i, batch in enumerate(acc.read_ahead(source)):
                train(acc, model, batch)
                if i == 1:
                    break
        for batch in acc.read_ahead(source):
            train(acc, model, batch)
        acc.flush()
    expected, sizes = plain_sgd(epochs_of(1))
    assert max_diff([p.detach() for p in net.parameters()], expected) < 1e-12
    assert acc.progress.step == len(sizes)


def test_fabric_a_loader_error_is_raised_where_the_loop_reaches_it(reads_ahead: list[int]) -> None:
    """A loader that raises at batch 6: batches 0-5 train first, as without reading ahead (the error came out before
    batch 0 was trained)."""
    data, trained = batches_of(), []

    def failing() -> Iterator[Batch]:
        for i, batch in enumerate(data):
            if i == 6:
                raise OSError("the loader failed at batch 6")
            yield batch

    with default_dtype(torch.float64):
        acc, model, _ = fabric_acc()
        with pytest.raises(OSError, match="at batch 6"):
            for i, batch in enumerate(acc.read_ahead(failing())):
                train(acc, model, batch)
                trained.append(i)
    assert trained == [0, 1, 2, 3, 4, 5]


class RetriedBlock(ManualTokenModel):
    """Batch 3's first block raises before its backward; the step runs a block on it again."""

    def training_step(self, batch: Batch, batch_idx: int) -> None:
        if batch_idx == 3 and not getattr(self, "raised", False):
            self.raised = True
            with pytest.raises(KeyError), self.accumulate(batch):
                raise KeyError("hiccup")
        super().training_step(batch, batch_idx)


def test_mixin_a_block_that_raised_may_run_again_in_its_step(reads_ahead: list[int]) -> None:
    """Under ``read_ahead=True`` a block that raised is not the step's one block (refused as a second before)."""
    model = mixin(RetriedBlock, read_ahead=True)
    trainer().fit(model, loader(DATA, BATCH))
    plain = mixin(RetriedBlock)
    trainer().fit(plain, loader(DATA, BATCH))
    assert max_diff(params_of(model), params_of(plain)) == 0
    assert model.accumulation_progress.step == plain.accumulation_progress.step


def test_mixin_a_changed_count_is_refused_naming_the_option(reads_ahead: list[int]) -> None:
    with pytest.raises(ValueError, match=r"Give `self.accumulate` the batch `training_step` got .* or leave "
                                         r"`read_ahead` out"):  # fmt: skip
        trainer().fit(mixin(OtherBatch, read_ahead=True), loader(DATA, BATCH))


class IteratorStep(ManualTokenModel):
    """A ``training_step`` of the ``dataloader_iter`` (Lightning then hands ``on_train_batch_start`` no batch)."""

    def training_step(self, dataloader_iter: Any) -> None:  # type: ignore[override]
        batch, batch_idx, _ = next(dataloader_iter)
        super().training_step(batch, batch_idx)


def test_mixin_a_training_step_of_the_dataloader_iter_with_a_count() -> None:
    """``count`` is not called on the ``None`` Lightning gives ``on_train_batch_start`` there (it raised in the
    user's ``count`` before): each block counts its own batch."""
    model = mixin(IteratorStep, schedule=2)
    trainer(max_epochs=1).fit(model, loader(DATA, BATCH))
    plain = mixin(schedule=2)
    trainer(max_epochs=1).fit(plain, loader(DATA, BATCH))
    assert max_diff(params_of(model), params_of(plain)) == 0
