"""The window engine on its own: no Trainer, fake strategies, hand-computed expectations."""

from __future__ import annotations

import ast
import time
import warnings
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_accum import Budget, Constant, Lambda, NoiseScale, Piecewise, Progress
from lightning_accum._core import sync
from lightning_accum._core.engine import WindowEngine, samples_needed_by, window_id
from lightning_accum._core.wide import WideSums
from lightning_accum._core.window import lightning_divisor

ENGINE = Path(__file__).parents[1] / "src" / "lightning_accum" / "_core" / "engine.py"


class FakeStrategy:
    """``world_size`` ranks; the other ranks contribute ``others`` to every sum (one call counted)."""

    root_device = torch.device("cpu")

    def __init__(self, world_size: int, others: list[int]) -> None:
        self.world_size = world_size
        self.others = torch.tensor(others, dtype=torch.int64)
        self.reduces = 0

    def reduce(self, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        assert reduce_op == "sum"
        self.reduces += 1
        return tensor + self.others[: len(tensor)]


def test_engine_imports_no_lightning() -> None:
    tree = ast.parse(ENGINE.read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    names += [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names]
    assert not [n for n in names if "lightning" in n.replace("lightning_accum", "") or n == "_lightning"], names


def test_full_and_short_windows_single_device() -> None:
    engine = WindowEngine(Constant(4))
    window = engine.open(epoch=0, start=0)
    assert (window.k, window.divisor) == (4, 4)
    for _ in range(4):
        engine.count(samples=3, items=5)
    closing = engine.close(strategy=None)
    assert (closing.microbatches, closing.samples, closing.items, closing.scale) == (4, 12, 20, 1.0)
    assert engine.advance(epoch=0) is closing
    assert engine.progress == Progress(epoch=0, step=1, samples=12, items=20, microbatches=4, scaled_steps=1.0)
    assert engine.window is None and engine.closing is None

    engine.open(epoch=1, start=4)  # the epoch ends after 3 micro-batches: each was divided by 4, mean of 3
    for _ in range(3):
        engine.count(samples=3, items=torch.tensor(2))
    assert engine.close(None).scale == 4 / 3
    engine.advance(epoch=1)
    assert engine.progress == Progress(epoch=1, step=2, samples=21, items=26, microbatches=7, scaled_steps=2.0)


@pytest.mark.parametrize("normalize", ["mean", "items"])
def test_global_counts_in_one_collective(normalize: str) -> None:
    # the other rank: 1 micro-batch, 4 samples, 9 items, its two extras, and the same window's identity
    strategy = FakeStrategy(world_size=2, others=[1, 4, 9, 1, 0, *window_id(0, 0)])
    engine = WindowEngine(Constant(2), normalize=normalize)
    engine.open(0, 0)
    engine.count(samples=4, items=6)
    engine.count(samples=4, items=7)
    closing = engine.close(strategy, extra=[1, 1])
    assert strategy.reduces == 1
    assert (closing.microbatches, closing.samples, closing.items, closing.extra) == (3, 12, 22, (2, 1))
    # each loss was divided by k=2 and DDP averages over 2 ranks: sum(g)/2/2 -> mean over 3 (or over 22 items)
    expected = Fraction(2 * 2, 3) if normalize == "mean" else Fraction(2 * 2, 22)
    assert closing.scale == float(expected)


def test_progress_counts_this_ranks_micro_batches_and_every_ranks_samples_and_items() -> None:
    """``Progress.microbatches`` is one rank's (the loader batches it consumed, as a schedule keyed on them
    reads on every rank alike); ``samples`` and ``items`` are over all ranks. The other rank here ran 3 micro-batches
    of 12 samples and 20 items in each window, this one 2 of 8 and 11 (uneven counts: a rank's short last batch)."""
    engine = WindowEngine(Constant(3))
    for epoch in (0, 1):
        engine.open(epoch, 0)
        engine.count(samples=4, items=6)
        engine.count(samples=4, items=5)
        engine.close(FakeStrategy(world_size=2, others=[3, 12, 20, *window_id(epoch, 0)]))
        engine.advance(epoch)
    assert (engine.progress.microbatches, engine.progress.samples, engine.progress.items) == (4, 40, 62)
    assert engine.progress.step == 2


class TwoRanks(FakeStrategy):
    """Two ranks, the other one's schedule giving ``other_k`` (``check_same_k``'s sums, then its gather)."""

    def __init__(self, other_k: int) -> None:
        super().__init__(world_size=2, others=[other_k, other_k * other_k])
        self.other_k = other_k

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.stack([tensor, torch.tensor(self.other_k)])


def test_ranks_given_different_k_fail_as_the_window_opens() -> None:
    """(The fast check of ``tests/distributed/test_rank_agreement.py``'s rule: without it the ranks step at different
    batches and hang in the next gradient collective.) A schedule that does not promise the same k on every rank is
    compared once as each window opens, with one collective when the ranks agree."""
    engine = WindowEngine(Lambda(lambda progress: 3))
    agree = TwoRanks(3)
    assert engine.open(0, 0, agree).k == 3 and agree.reduces == 1
    engine.discard()
    for other in (1, 2, 4, 9):
        with pytest.raises(
            RuntimeError, match=rf"disagree on the window's size: the schedule Lambda\(.*\) gave k = \[3, {other}\]"
        ):
            engine.open(0, 0, TwoRanks(other))
        assert engine.window is None  # (nothing opened)
    one = FakeStrategy(world_size=1, others=[])
    assert engine.open(0, 0, one).k == 3 and one.reduces == 0  # (one rank: nothing to compare)
    engine.discard()
    consistent = WindowEngine(Constant(3))  # (a schedule keyed on what every rank reads alike: no collective)
    assert consistent.open(0, 0, agree).k == 3 and agree.reduces == 1


def test_ranks_closing_different_windows_fail_together() -> None:
    """(A rank whose data ran out first, or that caught an exception the others did not, would otherwise mix
    another window's gradient into this one.) Both ranks read the same sums, so both raise."""
    engine = WindowEngine(Constant(2))
    engine.open(0, 4)
    engine.count(samples=4, items=4)
    for other in (window_id(0, 6), window_id(1, 4)):  # another first micro-batch; another epoch
        with pytest.raises(RuntimeError, match=r"The ranks closed different accumulation windows"):
            engine.close(FakeStrategy(world_size=2, others=[1, 4, 4, *other]))
    assert engine.close(FakeStrategy(world_size=2, others=[1, 4, 4, *window_id(0, 4)])).microbatches == 2


def test_schedule_is_asked_when_a_window_opens_with_the_progress_so_far() -> None:
    seen: list[Progress] = []

    def k(progress: Progress) -> int:
        seen.append(progress)
        return 1 + progress.step

    engine = WindowEngine(Lambda(k))
    for epoch, start in [(0, 0), (0, 1), (1, 0)]:
        window = engine.open(epoch, start)
        for _ in range(window.k):
            engine.count(2, 2)
        engine.close(None)
        engine.advance(epoch)
    assert [p.step for p in seen] == [0, 1, 2]
    assert [p.epoch for p in seen] == [0, 0, 1]  # the epoch is current when the window opens
    assert [p.samples for p in seen] == [0, 2, 6]


def test_divisor_and_lr_factor() -> None:
    engine = WindowEngine(Piecewise({0: 2, 1: 8}, unit="step"), lr_scaling="linear")
    assert engine.open(0, 3).divisor == 2  # unaligned too: each loss reaches backward divided by k
    assert lightning_divisor(3, 2) == 5  # (Lightning's loop divides by start + k; the callback undoes the rest)
    engine.count(1, 1)
    engine.count(1, 1)
    assert engine.close(None).lr_factor == 1.0
    engine.advance(0)
    engine.open(0, 5)
    engine.count(1, 1)
    closing = engine.close(None)
    assert closing.lr_factor == 4.0 and closing.scale == 8.0  # 8 / 2; divided by 8, one micro-batch
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    engine.scale_lr(optimizer)
    assert optimizer.param_groups[0]["lr"] == 2.0
    engine.restore_lr()
    engine.restore_lr()  # idempotent
    assert optimizer.param_groups[0]["lr"] == 0.5


def test_state_round_trip_and_closing_window_not_saved() -> None:
    engine = WindowEngine(Constant(3))
    engine.open(0, 0)
    engine.count(2, torch.tensor(5))
    state = engine.state_dict()
    assert state["window"]["microbatches"] == 1 and state["window"]["items"] == 5
    twin = WindowEngine(Constant(3))
    twin.load_state_dict(state)
    assert twin.window is not None and twin.window.k == 3 and twin.window.samples == 2
    assert twin.progress == engine.progress and twin.first_k == 3

    engine.count(2, 1)
    engine.count(2, 1)
    engine.close(None)  # stepping: a checkpoint now must not hold the window a second time
    assert engine.state_dict()["window"] is None


def test_sharded_partial_window_is_left_out_with_a_warning() -> None:
    engine = WindowEngine(Constant(3))
    engine.plan = sync.SyncPlan("fsdp2", skip=True)
    engine.open(0, 0)
    assert engine.state_dict()["window"] is not None  # nothing went in yet: nothing lost
    engine.count(1, 1)
    with pytest.warns(UserWarning, match="saved inside an accumulation window under FSDP2"):
        assert engine.state_dict()["window"] is None


def test_discard_and_reconfigure_keep_progress() -> None:
    engine = WindowEngine(Constant(2))
    engine.open(0, 0)
    engine.count(1, 1)
    engine.discard()
    assert engine.window is None and engine.progress == Progress()
    engine.configure(Constant(5), "items", "sqrt")
    assert engine.open(0, 0).k == 5 and engine.normalize == "items" and engine.probe is None


def test_probe_measures_through_the_engine() -> None:
    from lightning_accum import NoiseScale

    schedule = NoiseScale(2, 8, every=1, warmup=1, beta=0.0)
    engine = WindowEngine(schedule)
    assert engine.probe is not None and engine.noise_scale is not None
    engine.open(0, 0)
    engine.count(1, 1)
    # first micro-batch gradient g1 = (2,) over 1 sample, divided by k = 2 before backward
    engine.measure_prefix([torch.tensor([1.0])])
    engine.count(1, 1)
    engine.close(None)
    engine.measure_window(None, [torch.tensor([1.5])])  # window mean of g1 = 2, g2 = 1
    assert schedule.estimator.updates == 1
    # |g_1|^2 = 4 at B=1, |g_2|^2 = 2.25 at B=2: |G|^2 = 0.5, tr = 3.5
    assert schedule.estimator.grad_sq == pytest.approx(0.5) and schedule.estimator.trace == pytest.approx(3.5)


# ---------------------------------------------------------------------- the engine's rules, one table each
# (hand-computed expectations: integers, a ratio of them, a message's words; no Trainer)


@pytest.mark.parametrize(
    ("schedule", "normalize", "lr_scaling", "needed"),
    [
        (Piecewise({0: 2}, unit="samples"), "items", None, "The schedule Piecewise({0: 2}, unit='samples')"),
        (Budget(10, unit="samples"), "items", "linear", "The schedule Budget"),
        (Constant(2), "mean", None, None),
        (Constant(2), "mean", "linear", None),
        (Constant(2), "mean", "sqrt", None),
        (Constant(2), "mean", "adascale", "Measuring the gradient noise in samples (`normalize='mean'`)"),
        (Constant(2), "items", "adascale", None),
        (NoiseScale(2, 8), "mean", None, "Measuring the gradient noise in samples"),
        (NoiseScale(2, 8), "items", None, None),
        (Budget(10, unit="items"), "mean", None, None),
        (Piecewise({0: 2}, unit="items"), "mean", None, None),
    ],
)
def test_what_needs_the_sample_count(schedule: Any, normalize: str, lr_scaling: str | None, needed: str | None) -> None:
    got = samples_needed_by(schedule, normalize, lr_scaling)
    assert got == needed if needed is None else got is not None and got.startswith(needed)
    assert WindowEngine(schedule, normalize, lr_scaling).samples_needed_by == got


def test_window_identity_is_a_small_integer_and_its_square() -> None:
    # (epoch * 1_000_003 + start) mod 65_521, plus 1: by hand, 1_000_003 = 15 * 65_521 + 17_188
    assert window_id(0, 0) == [1, 1]
    assert window_id(0, 5) == [6, 36]
    assert window_id(1, 0) == [17_189, 17_189**2]
    assert window_id(2, 3) == [34_380, 34_380**2]  # 2_000_006 + 3 = 30 * 65_521 + 34_379
    assert window_id(0, 65_520) == [65_521, 65_521**2]  # the largest
    assert window_id(0, 65_521) == [1, 1]  # wraps


def test_open_under_a_budget_and_the_first_windows_size() -> None:
    sizes = iter([10, 30])
    engine = WindowEngine(Budget(lambda progress: next(sizes), max_k=4), lr_scaling="linear")
    window = engine.open(epoch=0, start=0)
    assert (window.k, window.divisor, window.budget, engine.first_k) == (4, 1, 10, 10)
    engine.count(5, 5)
    engine.count(5, 5)
    closing = engine.close(None)
    assert (closing.k, closing.scale, closing.lr_factor) == (2, 0.5, 1.0)  # sum of 2 micro-batches, undivided
    engine.advance(0)
    window = engine.open(epoch=0, start=2)
    assert (window.k, window.budget, engine.first_k) == (4, 30, 10)  # (the first window's budget stays the base)
    for _ in range(3):
        engine.count(5, 5)
    closing = engine.close(None)
    assert (closing.k, closing.items, closing.lr_factor) == (3, 15, 1.5)  # 15 items over the first budget of 10


def test_open_sets_the_epoch_and_forgets_the_last_windows_step() -> None:
    engine = WindowEngine(Constant(1))
    engine.open(0, 0)
    engine.count(1, 1)
    engine.close(None)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    engine.scale_lr(optimizer)
    assert len(engine.used_lrs) == 1
    engine.advance(0)
    assert engine.progress.epoch == 0
    engine.open(3, 0)
    assert engine.progress.epoch == 3 and engine.progress.step == 1 and engine.closing is None
    assert engine.used_lrs == []


@pytest.mark.parametrize(("dtype", "divisor"), [(torch.bfloat16, 4), (torch.float32, 3)])
def test_open_under_grad_accum_dtype_divides_by_a_power_of_two(dtype: torch.dtype, divisor: int) -> None:
    """A narrow parameter's sum is kept wide: each loss divided by 4 (the power of two at or above k = 3), the rest
    at the close; a parameter as wide as the dtype keeps the division by k."""
    engine = WindowEngine(Constant(3), grad_accum_dtype=torch.float32)
    engine.widen([torch.nn.Parameter(torch.zeros(2, dtype=dtype))])
    assert engine.widened == (divisor == 4)
    assert engine.open(0, 0).divisor == divisor
    assert WindowEngine(Constant(3)).open(0, 0).divisor == 3


def test_closes_after_the_kth_micro_batch() -> None:
    engine = WindowEngine(Constant(3))
    engine.open(0, 0)
    table = []
    for _ in range(3):
        table.append((engine.closes_after(1, 1, None), engine.closes_after(1, 1, None, again=True)))
        engine.count(1, 1)
    table.append((engine.closes_after(1, 1, None), engine.closes_after(1, 1, None, again=True)))
    # (about to go in: the (count + 1)-th; trained again: the count-th, already in)
    assert table == [(False, False), (False, False), (True, False), (True, True)]


def test_closes_after_a_budget_reached_over_ranks() -> None:
    engine = WindowEngine(Budget(10, unit="items", max_k=4))
    engine.open(0, 0)
    assert engine.closes_after(99, 6, None) is False  # 6 of 10 (the samples do not count)
    engine.count(99, 6)
    engine.batch_done()
    assert engine.closes_after(0, 0, None, again=True) is False  # (trained again: nothing added)
    assert engine.closes_after(0, 0, None, total=4) is True  # 10 of 10 (a count read ahead)
    assert engine.closes_after(0, 0, None, again=True) is True
    assert engine.window is not None and engine.window.seen == 10

    engine = WindowEngine(Budget(10, unit="items", max_k=4))
    engine.open(0, 0)
    engine.ask(0, 9, None)  # (issued as the micro-batch opens: its count is the one read)
    assert engine.closes_after(0, 1, None) is False and engine.window.seen == 9
    engine.count(0, 9)
    engine.batch_done()
    assert engine.closes_after(0, 1, None) is True and engine.window.seen == 10  # (the ask read once only)


def test_a_budgets_count_of_a_micro_batch() -> None:
    samples = WindowEngine(Budget(10, unit="samples"))
    items = WindowEngine(Budget(10, unit="items"))
    assert samples.budget_count(3, 7) == 3 and samples.budget_count(3, -1) == 3
    assert items.budget_count(3, 7) == 7 and items.budget_count(3, 0) == 0
    assert items.budget_count(3, torch.tensor(7)) == 7 and items.budget_count(3, torch.tensor([0])) == 0
    for bad in (-1, True, 2.5, torch.tensor(-2), torch.tensor(1.5)):
        with pytest.raises(ValueError, match="item count"):
            items.budget_count(3, bad)  # type: ignore[arg-type]
    assert WindowEngine(Constant(2)).budget_count(3, 7) == 7  # (no unit: items)


@pytest.mark.parametrize(
    ("normalize", "counts", "what"),
    [("mean", [], "no micro-batch was back-propagated"), ("items", [(2, 0), (3, 0)], "its global item count is 0")],
)
def test_an_empty_window_is_not_stepped_and_warned_about_once(
    normalize: str, counts: list[tuple[int, int]], what: str
) -> None:
    engine = WindowEngine(Constant(2), normalize, lr_scaling="linear")
    for epoch in (0, 1):
        engine.open(epoch, 0)
        for samples, items in counts:
            engine.count(samples, items)
        if epoch == 0:
            with pytest.warns(UserWarning, match=f"An accumulation window was not stepped: {what} "):
                closing = engine.close(None)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # (once)
                closing = engine.close(None)
        assert closing.empty and closing.gain == 1.0
        engine.advance(epoch)
    n = len(counts)
    assert engine.progress == Progress(epoch=1, step=0, samples=10 if n else 0, items=0, microbatches=2 * n)
    assert engine.first_units is None  # (AdaScale's base: the first window stepped)
    engine.open(2, 0)
    engine.count(4, 3)
    closing = engine.close(None)
    assert not closing.empty and engine.first_units == (4 if normalize == "mean" else 3)
    engine.advance(2)
    assert (engine.progress.step, engine.progress.scaled_steps) == (1, 1.0)


def test_a_window_of_micro_batches_but_no_items_under_mean_is_stepped() -> None:
    engine = WindowEngine(Constant(2))
    engine.open(0, 0)
    engine.count(2, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        closing = engine.close(None)
    assert not closing.empty and closing.scale == 2.0  # one micro-batch of k = 2: divided by 2, a mean over 1


def test_lr_schedule_is_asked_as_the_window_opens_and_multiplies_the_scaling() -> None:
    seen: list[int] = []

    def multiplier(progress: Progress) -> float:
        seen.append(progress.step)
        return 0.5 + progress.step

    engine = WindowEngine(Piecewise({0: 2, 1: 6}, unit="step"), lr_scaling="linear", lr_schedule=multiplier)
    for step in range(2):
        window = engine.open(0, 2 * step)
        for _ in range(window.k):
            engine.count(1, 1)
        closing = engine.close(None)
        assert closing.lr_factor == [0.5, 3 * 1.5][step]  # (k / first k = 1, then 3) * the multiplier at the open
        engine.advance(0)
    assert seen == [0, 1]
    state = engine.state_dict()
    engine.open(0, 8)  # (the open asks once; a window a checkpoint held asks at its close)
    engine.count(1, 1)
    twin = WindowEngine(Piecewise({0: 2, 1: 6}, unit="step"), lr_scaling="linear", lr_schedule=multiplier)
    twin.load_state_dict({**engine.state_dict(), "progress": state["progress"]})
    seen.clear()
    assert twin.close(None).lr_factor == 3 * 2.5 and seen == [2]


def _two_in(k: int = 4, track: bool = False) -> WindowEngine:
    """An engine whose window holds one micro-batch (2 samples, 1 item, loss 3) and counts a second (loss 5),
    whose backward pass has not finished."""
    engine = WindowEngine(Constant(k))
    engine.metrics.tracking = track
    engine.open(0, 0)
    for loss in (3.0, 5.0):
        engine.count(2, 1)
        engine.metrics.add_loss(torch.tensor(loss))
        if loss == 3.0:
            engine.backward_done()
            engine.batch_done()
    return engine


CUT = (
    "a backward pass into the accumulation window was cut short: a checkpoint written now leaves its 2 micro-batch(es)"
)


@pytest.mark.parametrize(
    ("finished", "in_backward", "open_pass", "lost", "microbatches", "redo", "losses"),
    [
        (False, False, False, None, 1, None, [3.0]),  # before its backward: taken back
        (True, False, False, None, 2, (0, 1), [8.0]),  # its backward ran to its end: kept, adds nothing again
        (False, True, False, CUT, None, None, []),  # inside its backward: the window is lost
        (True, True, False, CUT, None, None, []),
        (False, False, True, CUT, None, None, []),  # a block's backward that did not finish (the mixin)
    ],
)
def test_settle_after_an_exception_in_a_micro_batch(
    finished: bool, in_backward: bool, open_pass: bool, lost: str | None, microbatches: int | None,
    redo: tuple[int, int] | None, losses: list[float],
) -> None:  # fmt: skip
    engine = _two_in(track=True)
    if finished:
        engine.pass_ended()
    got = engine.settle((0, 1), processed=False, in_backward=in_backward, open_pass=open_pass, rescaled=False)
    assert got == (None if lost is None else f"{lost} out")
    assert (None if engine.window is None else engine.window.microbatches) == microbatches
    if engine.window is not None:
        assert (engine.window.samples, engine.window.items) == (2 * microbatches, microbatches)  # type: ignore[operator]
    assert engine.redo == redo and engine.inflight is None and engine.closing is None
    assert [float(s) for s in engine.metrics.sums()] == losses


def test_settle_outside_a_micro_batch_and_around_a_step() -> None:
    engine = _two_in()
    engine.backward_done()
    engine.batch_done()
    # between micro-batches: nothing of the batch reached the window
    assert engine.settle((0, 2), processed=False, in_backward=False, open_pass=False, rescaled=False) is None
    assert engine.window is not None and engine.window.microbatches == 2 and engine.redo is None
    # a backward pass cut short before any micro-batch's gradient went in: the window goes on, empty
    fresh = WindowEngine(Constant(4))
    window = fresh.open(0, 0)
    assert fresh.settle((0, 0), processed=False, in_backward=True, open_pass=False, rescaled=False) is None
    assert fresh.window is window

    def closing_of_one() -> WindowEngine:
        one = WindowEngine(Constant(1))
        one.open(0, 0)
        one.count(3, 3)
        one.backward_done()
        one.close(None)
        return one

    one = closing_of_one()  # the step had not touched the gradient: the window is as it was, the batch a redo
    assert one.settle((0, 0), processed=False, in_backward=False, open_pass=False, rescaled=False) is None
    assert one.closing is None and one.window is not None and one.window.microbatches == 1 and one.redo == (0, 0)
    one = closing_of_one()  # the step changed the gradient in place: lost
    got = one.settle((0, 0), processed=False, in_backward=False, open_pass=False, rescaled=True)
    assert got == "the accumulation window was being stepped: a checkpoint written now leaves its 1 micro-batch(es) out"
    assert one.window is None and one.closing is None
    one = closing_of_one()  # the batch is done: so is the step
    assert one.settle((0, 0), processed=True, in_backward=False, open_pass=False, rescaled=True) is None
    assert one.window is None and one.progress.step == 1 and one.progress.samples == 3
    one = closing_of_one()
    one.advance(0)  # stepped already, and the batch is trained again (inflight: batch_done did not run)
    got = one.settle((0, 0), processed=False, in_backward=False, open_pass=False, rescaled=False)
    assert got == "this batch's accumulation window was stepped already, and the batch will be trained again"
    engine = _two_in()  # processed: nothing to take back
    assert engine.settle((0, 1), processed=True, in_backward=False, open_pass=False, rescaled=False) is None
    assert engine.window is not None and engine.window.microbatches == 2 and engine.progress.step == 0


def test_advance_adds_the_window_and_times_stepped_windows() -> None:
    engine = WindowEngine(Constant(2))
    engine.open(0, 0)
    began = time.perf_counter()
    engine.start_fit(sync.SyncPlan(), track=False)
    assert engine.seconds is None
    engine.count(3, 4)
    engine.close(None)
    engine.advance(0)
    first = engine.seconds
    assert first is not None and 0.0 <= first <= time.perf_counter() - began  # (from the fit's start: a bound)
    engine.open(0, 2)
    with pytest.warns(UserWarning, match="not stepped"):
        engine.close(None)
    engine.advance(0)
    assert engine.seconds == first  # (an empty window: no step, no time)
    assert engine.progress == Progress(epoch=0, step=1, samples=3, items=4, microbatches=1, scaled_steps=1.0)
    timeless = WindowEngine(Constant(1))  # (no fit started: not timed)
    timeless.open(0, 0)
    timeless.count(1, 1)
    timeless.close(None)
    timeless.advance(0)
    assert timeless.seconds is None


def test_scale_lr_keeps_what_the_step_used() -> None:
    engine = WindowEngine(Constant(1))
    engine.open(0, 0)
    engine.count(1, 1)
    engine.close(None)
    lr = torch.tensor(0.25)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    engine.scale_lr(optimizer, keep=False)
    assert engine.used_lrs == []
    engine.scale_lr(optimizer)
    lr.mul_(2)  # (a scheduler changes a tensor rate in place after the step)
    assert engine.used_lrs[0][0] is optimizer and float(engine.used_lrs[0][1][0]) == 0.25
    engine.restore_lr()
    assert optimizer.param_groups[0]["lr"] is lr  # (factor 1: nothing was changed)


def test_local_numbers_of_an_open_window() -> None:
    engine = WindowEngine(Constant(3))
    engine.metrics.tracking = True
    engine.open(0, 0)
    engine.count(2, torch.tensor(5))
    engine.metrics.add_loss(torch.tensor(1.5))
    engine.backward_done()
    assert engine.number_count() == 8
    numbers = engine.local_numbers()
    assert numbers == [1, 2, 5, 0.0, 0.0, 0.0, 0.0, 1.5]
    twin = WindowEngine(Constant(3))
    twin.metrics.tracking = True
    twin.open(0, 0)
    twin.metrics.load_sums(["loss"], [0.0])
    twin.load_local_numbers([4, 9, 7, 0.0, 0.0, 0.0, 0.0, 2.5])
    assert twin.window is not None and (twin.window.microbatches, twin.window.samples, twin.window.items) == (4, 9, 7)
    assert [float(s) for s in twin.metrics.sums()] == [2.5]
    assert WindowEngine(Constant(3)).number_count() == 7


class Multiplier:
    """An ``lr_schedule`` with a state (its count of calls)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, progress: Progress) -> float:
        self.calls += 1
        return 1.0

    def state_dict(self) -> dict[str, int]:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.calls = state["calls"]


def test_state_dict_holds_what_the_options_need() -> None:
    plain = WindowEngine(Constant(2))
    plain.open(0, 0)
    state = plain.state_dict()
    assert set(state) == {"progress", "window", "first_k", "first_units", "schedule", "window_options"}
    assert state["window_options"] == {"normalize": "mean", "reduction": None}
    assert state["first_k"] == 2 and state["first_units"] is None
    plain.discard()
    assert set(plain.state_dict()) == {"progress", "window", "first_k", "first_units", "schedule"}  # (no window)

    rich = WindowEngine(
        Budget(8, unit="samples"), "items", "adascale", Multiplier(), reduction="sum", grad_accum_dtype=torch.float64
    )
    rich.metrics.tracking = True
    rich.open(0, 0)
    rich.redo = (0, 4)
    state = rich.state_dict()
    assert {"adascale", "lr_schedule", "budget_unit", "probe", "redo", "losses"} <= set(state)
    assert state["budget_unit"] == "samples" and state["redo"] == [0, 4] and state["losses"] == {}
    assert state["lr_schedule"] == {"calls": 1}
    assert state["window_options"] == {"normalize": "items", "reduction": "sum", "grad_accum_dtype": "float64"}
    assert "adascale" not in WindowEngine(Constant(2), lr_scaling="linear").state_dict()


def _held(schedule: Any, **options: Any) -> dict[str, Any]:
    engine = WindowEngine(schedule, **options)
    engine.open(0, 0)
    engine.closes_after(1, 1, None)  # (a budget's count)
    engine.count(1, 1)
    return engine.state_dict()


@pytest.mark.parametrize(
    ("saved", "here", "match"),
    [
        (
            {"normalize": "mean"},
            {"normalize": "items"},
            r"summed under normalize='mean', reduction=None; this run has "
            r"normalize='items', reduction=None",
        ),
        ({"normalize": "items", "reduction": "sum"}, {"normalize": "items", "reduction": "mean"}, "reduction='sum'"),
        (
            {"grad_accum_dtype": torch.float64},
            {},
            r"summed in float64 \(`grad_accum_dtype='float64'`\); this run has "
            r"`grad_accum_dtype=None`",
        ),
        ({}, {"grad_accum_dtype": torch.float64}, r"summed in the parameters' dtype \(`grad_accum_dtype=None`\)"),
        ({"grad_accum_dtype": torch.float32}, {"grad_accum_dtype": torch.float64}, "summed in float32"),
    ],
)
def test_a_window_held_under_other_options_is_refused(saved: dict[str, Any], here: dict[str, Any], match: str) -> None:
    state = _held(Constant(3), **saved)
    engine = WindowEngine(Constant(3), **here)
    with pytest.raises(ValueError, match=match):
        engine.load_state_dict(state)
    assert engine.window is None  # (nothing changed)
    WindowEngine(Constant(3), **saved).load_state_dict(state)  # the same options: taken
    engine.load_state_dict({**state, "window": None})  # no window held: any options
    old = {key: value for key, value in state.items() if key != "window_options"}  # (written before the check)
    engine.load_state_dict(old)
    assert engine.window is not None and engine.window.microbatches == 1


@pytest.mark.parametrize(
    ("saved", "here", "match"),
    [
        (Budget(8), Constant(3), "closed by a `Budget`; this run's schedule Constant\\(3\\) is a schedule of k"),
        (Constant(3), Budget(8), "closed by a schedule of k; this run's schedule Budget.* is a `Budget`"),
        (
            Budget(8, unit="samples"),
            Budget(8, unit="items"),
            r"closed by a `Budget` in samples; .* counts items, .*"
            r"\(its 1 samples so far would be added to items\)\. Resume with `unit='samples'`",
        ),
    ],
)
def test_a_window_held_under_another_kind_of_schedule_is_refused(saved: Any, here: Any, match: str) -> None:
    state = _held(saved)
    with pytest.raises(ValueError, match=match):
        WindowEngine(here).load_state_dict(state)
    WindowEngine(here).load_state_dict({**state, "window": None})
    if isinstance(here, Budget) and isinstance(saved, Budget):
        WindowEngine(here).load_state_dict({k: v for k, v in state.items() if k != "budget_unit"})  # (not known)


def test_load_puts_back_what_the_checkpoint_holds() -> None:
    engine = WindowEngine(Constant(3), lr_schedule=Multiplier())
    engine.metrics.tracking = True
    engine.open(0, 0)
    engine.count(1, 1)
    engine.metrics.add_loss(torch.tensor(2.0))
    engine.backward_done()
    engine.redo = (0, 7)
    state = engine.state_dict()
    twin = WindowEngine(Constant(3), lr_schedule=Multiplier())
    twin.closing, twin.inflight = engine.close(None), (1, 1)
    twin.load_state_dict({**state, "first_units": 0})  # (a base of 0 items: checkpoints before 0.2)
    assert twin.first_units is None and twin.first_k == 3 and twin.redo == (0, 7)
    assert twin.closing is None and twin.inflight is None
    assert twin.lr_schedule.calls == 1  # type: ignore[union-attr]
    assert twin.metrics.names() == ["loss"] and [float(s) for s in twin.metrics.sums()] == [2.0]
    assert twin.window is not None and twin.window.microbatches == 1
    with pytest.warns(UserWarning, match=r"has no `load_state_dict` to take it: the run goes on without it"):
        WindowEngine(Constant(3), lr_schedule=lambda progress: 1.0).load_state_dict(state)
    blank = WindowEngine(Constant(3))
    blank.load_state_dict({"progress": {"step": 4}})  # (the least a checkpoint holds)
    assert blank.progress.step == 4 and blank.window is None and blank.first_k is None and blank.redo is None


@pytest.mark.parametrize(
    ("track", "norm", "noise", "others", "expected"),
    [
        # |g| = 5 (3, 4), read times the AMP scale 4; this rank's 2 micro-batches of k = 2 alone: scale 1
        (True, True, False, None, 25 / 16),
        (False, True, False, None, None),  # nobody logs it: not measured
        (True, False, False, None, None),  # nobody reads it: not measured
        (False, False, True, None, 25 / 16),  # the noise probe reads it all the same
        # and a second rank with one micro-batch: DDP's mean over 2 ranks of sum / 2 -> a mean over 3 (4 / 3)
        (True, True, False, [1, 4, 4], (4 / 3 / 4) ** 2 * 25),
        (False, True, False, [1, 4, 4], None),
    ],
)
def test_the_windows_gradient_norm_is_measured_where_it_is_read(
    track: bool, norm: bool, noise: bool, others: list[int] | None, expected: float | None
) -> None:
    engine = WindowEngine(NoiseScale(2, 8, every=1, warmup=1) if noise else Constant(2))
    engine.metrics.tracking = track
    engine.open(0, 0)
    engine.count(2, 2)
    engine.count(2, 2)
    strategy = None if others is None else FakeStrategy(world_size=2, others=[*others, *window_id(0, 0)])
    flag = {} if norm else {"norm": False}  # (read unless told not)
    closing = engine.close(strategy, grads=[torch.tensor([3.0, 4.0])], loss_scale=lambda: 4.0, **flag)
    assert closing.norm_sq == (None if expected is None else pytest.approx(expected, rel=1e-12))
    assert engine.close(strategy, loss_scale=lambda: 4.0).norm_sq is None  # (no gradient given: none)


class OnDevice(torch.Tensor):
    """A count that says it is on an accelerator (``budget_count`` only asks its device)."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


def test_a_budgets_device_count_is_warned_about_once() -> None:
    engine = WindowEngine(Budget(10, unit="items"))
    count = torch.tensor(3).as_subclass(OnDevice)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert engine.budget_count(1, count, warn=False) == 3  # (not warned, and still to warn)
    with pytest.warns(UserWarning, match=r"gave a tensor on cuda:0, whose read waits for the device") as caught:
        assert engine.budget_count(1, count) == 3
        assert engine.budget_count(1, count) == 3
    assert len(caught) == 1  # only once
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert WindowEngine(Budget(10, unit="items")).budget_count(1, torch.tensor(3)) == 3  # (on the CPU: no read)


def test_grad_accum_dtype_sums_the_narrow_parameters_and_lands_them_once() -> None:
    """A bf16 parameter's window of 3: each loss divided by 4 (the power of two at or above 3), summed in float32
    (0.375 for a gradient of 0.5 a micro-batch), and the sum times 4 / 3 landed in ``.grad`` once: 0.5."""
    w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    engine = WindowEngine(Constant(3), grad_accum_dtype=torch.float32)
    engine.metrics.tracking = True
    engine.widen([w])
    assert engine.widened and engine.wide is not None and engine.wide_sums is engine.wide
    assert engine.rewiden([w]) is False  # (nothing changed)
    window = engine.open(0, 0)
    for _ in range(3):
        engine.count(1, 1)
        ((w * 0.5).sum() / window.divisor).backward()
    assert w.grad is None and engine.wide.views[0].tolist() == [0.375, 0.375]
    engine.widen([w])  # (a fit's start again, a resume: the sums held are kept)
    assert engine.wide.views[0].tolist() == [0.375, 0.375]
    closing = engine.close(None, grads=[])  # (no wide parameter's `.grad`: the narrow sums are the gradient)
    assert closing.scale == 4 / 3 and closing.norm_sq == pytest.approx(0.5, rel=1e-6)  # |(0.5, 0.5)|^2 (a float32 norm)
    engine.land(closing.scale)
    assert w.grad is not None and w.grad.dtype == torch.bfloat16 and w.grad.tolist() == [0.5, 0.5]
    engine.advance(0)
    v = torch.nn.Parameter(torch.ones(1, dtype=torch.bfloat16))  # (a parameter group added mid-fit)
    assert engine.rewiden([w, v]) is True and engine.wide.params == [w, v]
    engine.unwiden()
    w.grad = None
    (w * 0.5).sum().backward()
    assert w.grad is not None and w.grad.tolist() == [0.5, 0.5]  # (no longer taken into the sums)

    plain = WindowEngine(Constant(3))
    plain.widen([w])
    assert not plain.widened and plain.wide is None and plain.wide_sums is None
    assert plain.rewiden([w, v]) is False
    wide_only = WindowEngine(Constant(3), grad_accum_dtype=torch.float32)
    wide_only.widen([torch.nn.Parameter(torch.ones(2))])  # (float32 already: nothing to keep)
    assert not wide_only.widened and wide_only.wide_sums is None


class Stats:
    """``batchnorm="window"``'s statistics as the engine drives them: each call recorded."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.loaded: dict[str, Any] | None = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda: self.calls.append(name)

    def state_dict(self) -> dict[str, Any]:
        return {"moments": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


def test_batchnorm_statistics_follow_the_micro_batches_into_the_window() -> None:
    stats = Stats()
    engine = WindowEngine(Constant(4))
    engine.pool_batchnorm(stats)  # type: ignore[arg-type]
    engine.open(0, 0)
    engine.batch_start()
    engine.count(1, 1)
    engine.backward_done()  # its backward finished: its statistics join the window
    engine.batch_done()
    assert stats.calls == ["arm", "accept", "drop_pending"]
    stats.calls.clear()
    engine.batch_start()
    engine.backward_done()  # (a batch trained again, uncounted: its statistics are not the window's)
    engine.microbatch_over()
    engine.keep_finished_pieces()
    assert stats.calls == ["arm", "drop_pending", "drop_pending", "accept_held"]
    stats.calls.clear()
    engine.ran_without_backward()  # a micro-batch of no backward pass: its forwards count all the same, once
    assert engine.settle((0, 1), processed=False, in_backward=False, open_pass=False, rescaled=False) is None
    assert engine.redo == (0, 1) and not engine.pooled_alone  # trained again, it adds nothing
    assert stats.calls == ["accept", "recover", "drop_pending"]
    stats.calls.clear()
    engine.ran_without_backward()
    engine.batch_done()
    engine.settle((0, 2), processed=False, in_backward=False, open_pass=False, rescaled=False)
    assert engine.redo is None  # (its batch was over: no redo)
    assert engine.state_dict()["batchnorm"] == {"moments": 1}
    engine.close(None)
    stats.calls.clear()
    engine.advance(0)
    engine.open(0, 3)
    engine.discard()
    assert stats.calls == ["commit", "discard"]


def test_a_window_held_under_the_other_batchnorm_is_warned_about() -> None:
    def held(pooled: bool, count: int = 1) -> dict[str, Any]:
        engine = WindowEngine(Constant(4))
        if pooled:
            engine.pool_batchnorm(Stats())  # type: ignore[arg-type]
        engine.open(0, 0)
        for _ in range(count):
            engine.count(1, 1)
        return engine.state_dict()

    stats = Stats()
    pooled = WindowEngine(Constant(4))
    pooled.pool_batchnorm(stats)  # type: ignore[arg-type]
    pooled.load_state_dict(held(True))
    assert stats.loaded == {"moments": 1}
    pooled.load_state_dict({**held(True), "window": None})  # (no window: nothing of it)
    assert stats.loaded == {}
    with pytest.warns(UserWarning, match=r"under batchnorm='window'; this run has batchnorm='micro-batch', .*dropped"):
        WindowEngine(Constant(4)).load_state_dict(held(True))
    with pytest.warns(UserWarning, match=r"batchnorm='micro-batch'; this run has batchnorm='window', .*not in the wi"):
        pooled.load_state_dict(held(False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pooled.load_state_dict(held(False, count=0))  # (no micro-batch in the window yet: nothing pooled)
        WindowEngine(Constant(4)).load_state_dict(held(False))


@pytest.mark.parametrize(
    ("normalize", "others", "expected"),
    [
        # losses 3 and 5 (as they went into backward) on this rank; "task" 1
        ("mean", None, {"loss": 4.0, "task": 0.5}),  # a mean over 2 micro-batches
        ("items", None, {"loss": 8 / 5, "task": 1 / 5}),  # over 5 items
        # a second rank: 1 micro-batch, 3 samples, 7 items, its losses' sums 4 and 2
        ("mean", [1, 3, 7, 4, 2], {"loss": 4.0, "task": 1.0}),  # (8 + 4) / 3, (1 + 2) / 3
        ("items", [1, 3, 7, 4, 2], {"loss": 1.0, "task": 0.25}),  # 12 / 12, 3 / 12
    ],
)
def test_the_windows_losses_over_what_its_gradient_is_a_mean_of(
    normalize: str, others: list[int] | None, expected: dict[str, float]
) -> None:
    engine = WindowEngine(Constant(2), normalize)
    engine.metrics.tracking = True
    for epoch in (0, 1):
        engine.open(epoch, 0)
        for loss, items in ((3.0, 2), (5.0, 3)):
            engine.count(2, items)
            engine.metrics.add_loss(torch.tensor(loss))
            if loss == 3.0:
                engine.metrics.add_loss(torch.tensor(1.0), name="task")
            engine.backward_done()
        strategy = None
        if others is not None:  # (the counts, the extra, the window's identity, then the losses)
            strategy = FakeStrategy(world_size=2, others=[*others[:3], 0, *window_id(epoch, 0), *others[3:]])
        closing = engine.close(strategy, extra=[0] if others else (), **({} if epoch == 0 else {"losses": False}))
        assert closing.losses == (pytest.approx(expected, rel=1e-12) if epoch == 0 else None)  # (nobody reads them)
        engine.advance(epoch)


def test_a_budgets_count_taken_back_with_a_micro_batch_that_did_not_go_in() -> None:
    engine = WindowEngine(Budget(10, unit="items"))
    window = engine.open(0, 0)
    engine.closes_after(0, 6, None)
    engine.take_back()  # (an exception before it was counted: it comes again)
    assert window.seen == 0
    engine.ask(0, 9, None)
    engine.take_back()  # (the count asked for it is dropped, unread)
    assert engine.closes_after(0, 1, None) is False and window.seen == 1
    engine.batch_done()  # (its count stays, whether it went in or not)
    engine.take_back()
    assert window.seen == 1
    plain = WindowEngine(Constant(2))
    plain.ask(0, 9, None)  # (without a budget: nothing asked)
    plain.open(0, 0)
    assert plain.closes_after(0, 9, None) is False
    plain.batch_done()


def test_close_and_reduce_says_which_parameters_hold_a_gradient() -> None:
    engine = WindowEngine(Constant(2))
    engine.open(0, 0)
    engine.count(1, 1)
    held, empty = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    held.grad = torch.full((2,), 0.5)
    closing = engine.close_and_reduce(None, [held, empty, held])
    assert closing.extra == (1, 0, 1) and closing.scale == 2.0
    assert held.grad.tolist() == [0.5, 0.5]  # (one rank: nothing to reduce; the adapter scales)


@pytest.mark.parametrize("where", ["close", "factor"])
def test_the_probe_takes_the_windows_gradient_measured_at_the_close_or_scaled(where: str) -> None:
    from lightning_accum import NoiseScale

    schedule = NoiseScale(2, 8, every=1, warmup=1, beta=0.0)
    engine = WindowEngine(schedule)
    engine.open(0, 0)
    engine.count(1, 1)
    engine.measure_prefix([torch.tensor([1.0])])  # as in test_probe_measures_through_the_engine
    engine.count(1, 1)
    if where == "close":  # (the window's gradient as it is: g_1 + g_2 over k = 2, 1.5, and its mean is 1.5 too)
        engine.close(None, grads=[torch.tensor([1.5])])
        engine.measure_window(None)
    else:
        engine.close(None)
        engine.measure_window(None, [torch.tensor([0.75])], factor=2.0)
    assert schedule.estimator.grad_sq == pytest.approx(0.5) and schedule.estimator.trace == pytest.approx(3.5)
    engine.advance(0)
    engine.measure_window(None, [torch.tensor([9.0])])  # (no closing window: nothing)
    assert schedule.estimator.updates == 1
    assert WindowEngine(Constant(2)).noise_scale is None


def test_ranks_given_different_budgets_fail_as_the_window_opens() -> None:
    """Under a ``Budget`` the ranks compare the budget (the count that closes the window), not its ``max_k``."""
    engine = WindowEngine(Budget(lambda progress: 10, max_k=3))
    assert engine.open(0, 0, TwoRanks(10)).budget == 10
    engine.discard()
    with pytest.raises(RuntimeError, match=r"k = \[10, 3\]"):
        engine.open(0, 0, TwoRanks(3))


def test_a_noise_scale_schedule_without_lr_scaling_leaves_the_rate() -> None:
    """``NoiseScale`` measures as AdaScale does, but without ``lr_scaling='adascale'`` no gain: a second window of
    another batch (3 samples against 2) would get AdaScale's (3.5 / 2 + 0.5) / (3.5 / 3 + 0.5) = 1.35."""
    for lr_scaling, gain in ((None, 1.0), ("adascale", 1.35)):
        schedule = NoiseScale(2, 8, every=1, warmup=1, beta=0.0)
        engine = WindowEngine(schedule, lr_scaling=lr_scaling)
        estimator = engine.probe.estimator  # type: ignore[union-attr]
        engine.open(0, 0)
        engine.count(1, 1)
        engine.measure_prefix([torch.tensor([1.0])])
        engine.count(1, 1)
        engine.close(None, grads=[torch.tensor([1.5])])
        engine.measure_window(None)
        engine.advance(0)
        assert estimator.grad_sq == pytest.approx(0.5) and estimator.trace == pytest.approx(3.5)
        engine.open(0, 2)
        engine.count(3, 3)
        closing = engine.close(None)
        assert (closing.lr_factor, closing.gain) == (pytest.approx(gain), pytest.approx(gain))
        engine.advance(0)
        assert engine.progress.scaled_steps == pytest.approx(1 + gain)


def test_local_numbers_hold_the_probes_prefixes() -> None:
    engine = WindowEngine(NoiseScale(2, 8, every=1, warmup=1))
    engine.open(0, 0)
    engine.count(2, 2)
    engine.measure_prefix([torch.tensor([1.0])])
    numbers = engine.local_numbers()
    assert len(numbers) == engine.number_count() == 7 and numbers[:3] == [1, 2, 2] and any(numbers[3:7])
    twin = WindowEngine(NoiseScale(2, 8, every=1, warmup=1))
    twin.open(0, 0)
    twin.load_local_numbers(numbers)
    assert twin.local_numbers() == numbers


def test_tensor_counts_and_the_gradient_norm_in_one_read() -> None:
    engine = WindowEngine(Constant(2), "items")
    engine.metrics.tracking = True
    engine.open(0, 0)
    engine.count(1, torch.tensor(3))
    engine.count(1, 5)
    engine.count(1, torch.tensor(2))
    closing = engine.close(None, grads=[torch.tensor([3.0, 4.0]), torch.tensor([12.0])])
    assert closing.items == 10 and closing.scale == 2 / 10
    assert closing.norm_sq == pytest.approx(169 * 0.04, rel=1e-6)  # |(3, 4, 12)| = 13, times 2 / 10


def test_a_resumed_window_drops_the_wide_sums_a_failed_fit_left() -> None:
    w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    engine = WindowEngine(Constant(3), grad_accum_dtype=torch.float32)
    engine.widen([w])
    engine.open(0, 0)
    engine.count(1, 1)
    state = engine.state_dict()
    (w * 0.5).sum().backward()  # (a micro-batch after the checkpoint, in a fit that failed)
    assert engine.wide is not None and engine.wide.views[0].tolist() == [0.5, 0.5]
    engine.load_state_dict(state)
    assert engine.wide.current([w]) == [None]  # (forgotten: the next gradient starts the sum afresh)
    (w * 0.25).sum().backward()
    assert engine.wide.views[0].tolist() == [0.25, 0.25]


def test_engines_sharing_wide_sums_land_and_forget_their_own_parameters() -> None:
    """(The mixin's optimizers, one engine each, share one ``WideSums``.)"""
    w, v = (torch.nn.Parameter(torch.ones(1, dtype=torch.bfloat16)) for _ in range(2))
    shared = WideSums(torch.float32)
    shared.attach([w, v])
    first, second = (WindowEngine(Constant(1), grad_accum_dtype=torch.float32) for _ in range(2))
    first.widen([w], shared)
    second.widen([v], shared)
    assert first.wide is second.wide is shared and first.widened
    for engine in (first, second):
        engine.open(0, 0)
        engine.count(1, 1)
    ((w + v) * 0.5).sum().backward()
    first.land(2.0)  # its own parameter's sum only
    assert w.grad is not None and w.grad.tolist() == [1.0] and v.grad is None
    first.close(None)
    first.advance(0)
    assert shared.current([v])[0] is not None  # (the other engine's sum is held still)
    first.open(0, 1)
    first.discard()
    assert shared.current([v])[0] is not None
    second.discard()
    assert shared.current([v]) == [None]
