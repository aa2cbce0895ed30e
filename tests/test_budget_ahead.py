"""A ``Budget``'s counts summed over ranks ahead of their micro-batches (issue 52): ``CountsAhead``'s schedule of
all-reduces against a table, with a second rank simulated; and the callback's reading ahead from the loader, turned
on on one process (``_core.ahead.ON_ONE_PROCESS``, where it sums nothing), against the same float64 reference as
``test_budget.py`` (windows, parameters, resumes inside a window, exceptions), with its refusals. The same on 2 gloo
ranks: ``tests/distributed/test_budget_ddp.py``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import test_budget
import torch
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from test_budget import BATCH, DATA, epochs_of, reference

from lightning_accum import AccumulationScheduler, Budget, _seam
from lightning_accum._core import ahead as core_ahead
from lightning_accum._core.ahead import CountsAhead

from helpers import Batch, KRecorder, ResumableLoader, TokenModel, count_tokens, loader, max_diff, params_of, trainer


class Ranks:
    """Two ranks' sums where this process is one: the other rank's counts come from ``other(position)`` (``None``:
    its data ended); every all-reduce issued and every one read, by position, are noted."""

    world_size = 2

    def __init__(self, other: Callable[[int], int | None]) -> None:
        self.other = other
        self.issued: list[tuple[int, int]] = []  # (the position asked when it went out, its chunk's first position)
        self.read: list[tuple[int, int]] = []  # (the position asked when it was read, its chunk's first position)
        self.asking = -1
        self.counted: list[int] = []  # the positions this rank's counts were read for, in turn

    def sum_of(self, strategy: Any, values: Sequence[int]) -> Any:
        ranks, chunk = self, len(values) // 2
        start = self.counted[-chunk]  # (the chunk's counts were read just before it goes out)
        self.issued.append((self.asking, start))
        others = [self.other(start + i) for i in range(chunk)]
        sums = [v + (o or 0) for v, o in zip(values[:chunk], others, strict=True)]
        present = [v + (o is not None) for v, o in zip(values[chunk:], others, strict=True)]

        class Sum:
            def result(self) -> list[int]:
                ranks.read.append((ranks.asking, start))
                return sums + present

        return Sum()


def ask(counts: CountsAhead, ranks: Ranks, positions: Sequence[int], mine: Callable[[int], int | None]) -> list[int]:
    def noted(p: int) -> int | None:
        ranks.counted.append(p)
        return mine(p)

    out = []
    for p in positions:
        ranks.asking = p
        out.append(counts.total(p, ranks, noted))
    return out


@pytest.fixture
def ranks(monkeypatch: pytest.MonkeyPatch) -> Callable[[Callable[[int], int | None]], Ranks]:
    def make(other: Callable[[int], int | None]) -> Ranks:
        made = Ranks(other)
        monkeypatch.setattr(core_ahead, "HostSum", made.sum_of)
        return made

    return make


def test_each_chunk_goes_out_a_chunk_ahead_and_is_read_where_needed(ranks: Any) -> None:
    two = ranks(lambda p: 100 * p)
    asked: list[int] = []

    def mine(p: int) -> int:
        asked.append(p)
        return p

    counts = CountsAhead(chunk=4)
    assert ask(counts, two, range(13), mine) == [101 * p for p in range(13)]
    assert asked == list(range(20))  # each position's count read once, in order, up to two chunks ahead
    # (asked at, first position): the epoch's first two chunks at its first micro-batch, then one as each chunk is
    # entered: the chunk read there went out a chunk (4 micro-batches) before
    assert two.issued == [(0, 0), (0, 4), (4, 8), (8, 12), (12, 16)]
    assert [(at, start) for at, start in two.read if at == start] == [(0, 0), (4, 4), (8, 8), (12, 12)]
    assert all(start - at >= 4 for at, start in two.issued[2:])
    assert all(counts.mine(p) == p for p in (12, 15))


def test_a_jump_starts_again_and_a_batch_past_another_ranks_data_is_refused(ranks: Any) -> None:
    two = ranks(lambda p: 1 if p < 6 else None)  # (the other rank's data: 6 batches)
    counts = CountsAhead(chunk=4)
    assert ask(counts, two, [0, 1, 5], lambda p: 2) == [3, 3, 3]
    with pytest.raises(RuntimeError, match=r"ended at different batches: batch 6 of the epoch is on 1 of 2 ranks"):
        ask(counts, two, [6], lambda p: 2)
    counts.forget()
    two.issued.clear()
    assert ask(counts, two, [2], lambda p: 5) == [6]
    assert two.issued == [(2, 2), (2, 6)]  # (a new epoch, a resume: the chunks start where it is)


def test_one_process_reads_its_own_counts_as_they_are() -> None:
    assert [CountsAhead(chunk=3).total(p, None, lambda q: q * q) for p in range(1)] == [0]
    counts = CountsAhead(chunk=3)
    assert [counts.total(p, None, lambda q: q * q) for p in range(7)] == [p * p for p in range(7)]


class Loop:
    """A stand-in trainer: each epoch's batch counts, the epoch, and ``at``, the batch being trained (one process)."""

    strategy = None

    def __init__(self, epochs: Sequence[Sequence[int]]) -> None:
        self.epochs, self.current_epoch, self.at = epochs, 0, 0


class Upcoming:
    """A stand-in for ``_seam.Upcoming``: the loop's batches after the one being trained, as ``{"n": count}``."""

    def __init__(self, trainer: Loop) -> None:
        self.trainer = trainer

    def usable(self) -> bool:
        return True

    def batch(self, ahead: int) -> Any:
        loop = self.trainer
        counts, n = loop.epochs[loop.current_epoch], loop.at + ahead
        return {"n": counts[n], "at": (loop.current_epoch, n)} if n < len(counts) else _seam.ENDED

    def detach(self) -> None:
        pass


@pytest.mark.parametrize(
    ("lengths", "issued"),
    [
        ((3, 3), [0, 4, 0, 4]),
        ((2, 4), [0, 4, 0, 4]),
        ((4, 2), [0, 4, 0, 4]),
        ((6, 6), [0, 4, 8, 0, 4, 8]),
    ],
)
def test_the_counts_read_ahead_are_kept_through_an_epoch_and_read_anew_at_the_next(
    reads_ahead: list[int], monkeypatch: pytest.MonkeyPatch, lengths: tuple[int, int], issued: list[int]
) -> None:
    """``BudgetAhead.total`` over two epochs whose batches differ (epoch 0: counts 1, 2, ...; epoch 1: 10, 20, ...):
    each position's total is its own epoch's count (one process: the count itself). Within an epoch what was read
    ahead is kept: each batch's count is read once, the epoch's first as ``current()``, every other one ahead from
    the loader; at the new epoch it is all dropped and read anew, chunks from position 0 again (an epoch shorter
    than two chunks leaves the next epoch's first positions among those held: they must not be taken from it)."""
    from lightning_accum._trainer.ahead import BudgetAhead

    monkeypatch.setattr(_seam, "Upcoming", Upcoming)
    loop = Loop([[(i + 1) * 10**epoch for i in range(n)] for epoch, n in enumerate(lengths)])
    currents: list[tuple[int, int]] = []
    counted: list[tuple[int, int]] = []

    def count_of(batch: dict[str, Any]) -> int:
        counted.append(batch["at"])
        return int(batch["n"])

    def current() -> int:
        currents.append((loop.current_epoch, loop.at))
        return loop.epochs[loop.current_epoch][loop.at]

    budget = BudgetAhead()
    budget.start(loop)
    assert budget.reading
    totals = []
    for epoch, n in enumerate(lengths):
        loop.current_epoch = epoch
        for position in range(n):
            loop.at = position
            totals.append(budget.total(loop, position, current, count_of))
    budget.stop()
    assert totals == [c for counts in loop.epochs for c in counts]
    assert currents == [(0, 0), (1, 0)]
    assert counted == [(epoch, i) for epoch, n in enumerate(lengths) for i in range(1, n)]
    assert reads_ahead == issued


# ------------------------------------------------------------------ the callback, reading ahead on one process
fails_and_resumes = test_budget.test_an_exception_inside_a_window_resumes_bit_identically


@pytest.mark.parametrize(
    "test",
    [
        lambda tmp: test_budget.test_callback_windows_equal_the_reference(25, "items", "items", None),
        lambda tmp: test_budget.test_callback_windows_equal_the_reference(9, "samples", "mean", None),
        lambda tmp: test_budget.test_callback_windows_equal_the_reference(40, "items", "items", 3),
        lambda tmp: test_budget.test_a_budget_that_ramps_is_read_as_each_window_opens(),
        lambda tmp: test_budget.test_max_steps_and_limit_train_batches({"limit_train_batches": 7}),
        lambda tmp: test_budget.test_max_steps_and_limit_train_batches({"max_steps": 5}),
        lambda tmp: test_budget.test_microbatch_size_pieces_still_count_the_loader_batch(),
        lambda tmp: test_budget.test_resume_inside_a_window_is_bit_identical(tmp, (0, 1)),
        lambda tmp: test_budget.test_resume_inside_a_window_is_bit_identical(tmp, (0, 6)),
        lambda tmp: fails_and_resumes(tmp, "on_before_backward", (0, 3)),
        lambda tmp: fails_and_resumes(tmp, "on_train_batch_start", (0, 4)),
        lambda tmp: fails_and_resumes(tmp, "on_after_backward", (0, 4)),
    ],
    ids=[
        "items", "samples", "max_k", "ramp", "limit_train_batches", "max_steps", "pieces", "resume (0, 1)",
        "resume (0, 6)", "exception before backward", "exception at batch start", "exception after backward",
    ],
)  # fmt: skip
def test_the_budget_tests_hold_when_the_callback_reads_ahead(
    reads_ahead: list[int], tmp_path: Path, test: Callable[[Path], None]
) -> None:
    test(tmp_path)
    assert reads_ahead  # (the counts were read ahead)


def test_the_count_is_read_ahead_once_per_batch_and_each_chunk_out_a_chunk_ahead(reads_ahead: list[int]) -> None:
    seen: list[int] = []

    def counting(batch: Batch) -> Any:
        seen.append(int(batch["mask"].sum()))
        return count_tokens(batch)

    model, recorder = TokenModel(reduction="sum"), KRecorder()
    callback = AccumulationScheduler(Budget(25), normalize="items", count=counting, reduction="sum")
    trainer(callbacks=[callback, recorder], max_epochs=1).fit(model, loader(DATA, BATCH))
    tokens = [int(b["mask"].sum()) for b in epochs_of(1)[0][0]]  # (11 batches)
    # each batch counted as it starts and once ahead (the epoch's first as it starts only), and nothing past the data
    assert sorted(seen) == sorted(tokens + tokens[1:])
    assert reads_ahead == [0, 4, 8, 12]  # (the last: past the data, on both ranks alike)
    expected, sizes, _ = reference(epochs_of(1), lambda p: 25)
    assert recorder.windows == sizes and max_diff(params_of(model), expected) < 1e-12


class DropsAToken(TokenModel):
    """A batch transfer hook that changes what ``count`` counts."""

    def on_before_batch_transfer(self, batch: Batch, dataloader_idx: int) -> Batch:
        mask = batch["mask"].clone()
        mask[0, 0] = 0.0
        return {**batch, "mask": mask}


def test_a_count_that_differs_from_the_loaders_batch_is_refused(reads_ahead: list[int]) -> None:
    callback = AccumulationScheduler(Budget(25), normalize="items", count=count_tokens, reduction="sum")
    recorder = KRecorder()
    with pytest.raises(ValueError, match=r"for batch 1 of the epoch, `count\(batch\)` gave \d+ there, but gives \d+"):
        trainer(callbacks=[callback, recorder]).fit(DropsAToken(reduction="sum"), loader(DATA, BATCH))
    assert recorder.windows == []


class CountsAfterTheHook(TokenModel):
    def on_before_batch_transfer(self, batch: Batch, dataloader_idx: int) -> Batch:
        return {**batch, "tokens": batch["mask"].sum()}


def test_a_count_that_raises_on_the_loaders_batch_only_is_refused_where_the_batch_starts(
    reads_ahead: list[int],
) -> None:
    callback = AccumulationScheduler(Budget(25), normalize="items", count=lambda b: b["tokens"], reduction="sum")
    recorder = KRecorder()
    with pytest.raises(ValueError, match=r"for batch 1 of the epoch, `count\(batch\)` raised there"):
        trainer(callbacks=[callback, recorder]).fit(CountsAfterTheHook(reduction="sum"), loader(DATA, BATCH))
    assert recorder.windows == []


def test_a_count_refused_is_refused_where_its_batch_starts_as_without_reading_ahead(reads_ahead: list[int]) -> None:
    """(A batch's count, read ahead, raised two batches before: the batch is refused as it starts, as it is refused
    when nothing reads ahead; the windows before it are stepped.)"""
    third = epochs_of(1)[0][0][2]["x"][0, 0, 0]

    def count(batch: Batch) -> Any:
        return batch["mask"].sum(1) if batch["x"][0, 0, 0] == third else batch["mask"].sum()

    seen: list[int] = []

    class Batches(KRecorder):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            seen.append(batch_idx)

    callback = AccumulationScheduler(Budget(9), normalize="items", count=count, reduction="sum")
    with pytest.raises(ValueError, match="one number"):
        trainer(callbacks=[Batches(), callback]).fit(TokenModel(reduction="sum"), loader(DATA, BATCH))
    assert seen == [0, 1, 2] and reads_ahead == [0, 4]


def test_one_process_does_not_read_ahead_by_default() -> None:
    calls: list[Any] = []
    callback = AccumulationScheduler(Budget(25), normalize="items", count=lambda b: calls.append(1) or count_tokens(b),
                                     reduction="sum")  # fmt: skip
    trainer(callbacks=[callback], max_epochs=1).fit(TokenModel(reduction="sum"), loader(DATA, BATCH))
    assert len(calls) == len(epochs_of(1)[0][0])  # (once per batch, as it starts)
    assert torch.distributed.is_available()


class FailsAt(pl.Callback):
    def __init__(self, at: tuple[int, int]) -> None:
        self.at, self.fired = at, False

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if not self.fired and (trainer.current_epoch, args[-1]) == self.at:
            self.fired = True
            raise RuntimeError("injected")


def test_a_checkpoint_written_on_an_exception_saves_the_loader_as_without_reading_ahead(
    reads_ahead: list[int], tmp_path: Path
) -> None:
    """A loader whose state moves as batches are taken (``ResumableLoader``): the checkpoint Lightning writes on an
    exception (after the package's ``on_exception``) holds the batches the loop took, not those read ahead; the
    resumed fit ends as an uninterrupted one."""

    def callback() -> AccumulationScheduler:
        return AccumulationScheduler(Budget(25), normalize="items", count=count_tokens, reduction="sum")

    full = TokenModel(reduction="sum")
    trainer(callbacks=[callback()]).fit(full, ResumableLoader(DATA, BATCH))
    failed = TokenModel(reduction="sum")
    with pytest.raises(RuntimeError, match="injected"):
        trainer(
            callbacks=[callback(), FailsAt((0, 5)), OnExceptionCheckpoint(tmp_path)], enable_checkpointing=True
        ).fit(failed, ResumableLoader(DATA, BATCH))
    path = tmp_path / "on_exception.ckpt"
    assert torch.load(path, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [
        {"consumed": 6}
    ]
    resumed = TokenModel(reduction="sum")
    trainer(callbacks=[callback()]).fit(resumed, ResumableLoader(DATA, BATCH), ckpt_path=path)
    assert max_diff(params_of(resumed), params_of(full)) == 0.0


# (inside the budget's windows of 25 tokens over `test_faults.DATA`, [0-1] [2-4] [5-6] ...: batches 2 and 3 of the
# second, neither its last)
@pytest.mark.parametrize("at", [(0, 2), (0, 3)])
def test_the_mixins_count_goes_into_the_window_before_its_micro_batch(tmp_path: Path, at: tuple[int, int]) -> None:
    """The mixin reads a block's count over ranks at the block's end, and adds it to the window before the block's
    micro-batch is counted: an exception after the block (the batch trained again on resume, adding nothing) keeps
    the count, and the resumed fit closes the windows of an uninterrupted one."""
    from test_faults import fail_and_resume

    assert fail_and_resume("mixin+budget", tmp_path, ("after_block", at), "exception") == []
