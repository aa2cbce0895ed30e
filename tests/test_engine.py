"""The window engine on its own: no Trainer, fake strategies, hand-computed expectations."""

from __future__ import annotations

import ast
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from lightning_accum import Constant, Lambda, Piecewise, Progress
from lightning_accum._core import sync
from lightning_accum._core.engine import WindowEngine, window_id
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
