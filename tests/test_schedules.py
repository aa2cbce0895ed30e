"""Schedules: validation, round-trips, and properties over random inputs."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lightning.pytorch.callbacks import GradientAccumulationScheduler

from lightning_accum import Constant, Lambda, Piecewise, Progress, Ramp, Schedule
from lightning_accum.schedules import UNITS, as_schedule

progress_st = st.builds(
    Progress,
    epoch=st.integers(0, 10**3),
    step=st.integers(0, 10**6),
    samples=st.integers(0, 10**9),
    items=st.integers(0, 10**11),
    microbatches=st.integers(0, 10**7),
)
milestones_st = st.dictionaries(st.integers(0, 200), st.integers(1, 64), min_size=1, max_size=8)
ramp_st = st.builds(
    Ramp,
    start=st.integers(1, 64),
    end=st.sampled_from([2, 4, 8, 16, 32, 64, 128]),
    over=st.integers(1, 10**6),
    unit=st.sampled_from(UNITS),
    shape=st.sampled_from(["linear", "exponential"]),
    multiple_of=st.sampled_from([1, 2]),
)
schedule_st = st.one_of(
    st.builds(Constant, st.integers(1, 512)),
    st.builds(Piecewise, milestones_st, unit=st.sampled_from(UNITS)),
    ramp_st,
)


@given(schedule_st, progress_st)
def test_k_is_a_positive_int(schedule: Schedule, progress: Progress) -> None:
    k = schedule(progress)
    assert isinstance(k, int) and k >= 1


@given(ramp_st, progress_st, st.integers(0, 10**6))
def test_ramp_is_monotone_and_bounded(ramp: Ramp, progress: Progress, more: int) -> None:
    later = Progress(**{**progress.__dict__, ramp.unit: progress.value(ramp.unit) + more})
    a, b = ramp(progress), ramp(later)
    assert min(ramp.start, ramp.end) <= a <= max(ramp.start, ramp.end)
    assert (a <= b) if ramp.end >= ramp.start else (a >= b)
    assert ramp(Progress(**{**progress.__dict__, ramp.unit: ramp.over})) == ramp.end


@given(milestones_st, st.sampled_from(UNITS), progress_st, st.integers(0, 10**6))
def test_piecewise_is_monotone_when_its_table_is(table: dict[int, int], unit: str, p: Progress, more: int) -> None:
    ordered = dict(zip(sorted(table), sorted(table.values()), strict=True))
    schedule = Piecewise(ordered, unit=unit)  # type: ignore[arg-type]
    later = Progress(**{**p.__dict__, unit: p.value(unit) + more})
    assert schedule(p) <= schedule(later)


@given(milestones_st, st.integers(0, 300))
def test_piecewise_epoch_reproduces_lightning(table: dict[int, int], epoch: int) -> None:
    lightning = GradientAccumulationScheduler(dict(table))
    assert Piecewise(table)(Progress(epoch=epoch)) == lightning.get_accumulate_grad_batches(epoch)


@given(schedule_st)
def test_repr_round_trips(schedule: Schedule) -> None:
    assert eval(repr(schedule)) == schedule


def test_examples() -> None:
    assert Ramp(1, 8, over=8, unit="step", shape="exponential")(Progress(step=4)) == 2
    assert [Ramp(2, 16, over=7, unit="step", multiple_of=4)(Progress(step=s)) for s in range(8)] == [
        2,
        4,
        4,
        8,
        8,
        12,
        12,
        16,
    ]
    assert Ramp(8, 2, over=3, unit="epoch")(Progress(epoch=1)) == 6  # a decreasing ramp
    assert Piecewise([(10, 2), (0, 4)], unit="step")(Progress(step=9)) == 4
    assert as_schedule(3) == Constant(3)
    assert as_schedule({2: 4}) == Piecewise({2: 4})


def test_does_not_change_the_users_dict() -> None:
    table = {4: 2}
    Piecewise(table)
    assert table == {4: 2}


def test_stateless_state_dict() -> None:
    schedule = Ramp(1, 4, over=10)
    schedule.load_state_dict(schedule.state_dict())
    assert schedule.state_dict() == {}


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: Constant(0), "`k` must be an int >= 1"),
        (lambda: Constant(True), "`k` must be an int >= 1"),
        (lambda: Constant(2.0), "`k` must be an int >= 1"),
        (lambda: Piecewise({}), "`milestones` is empty"),
        (lambda: Piecewise({-1: 2}), "milestones key"),
        (lambda: Piecewise({0: 0}), r"milestones\[0\]"),
        (lambda: Piecewise([(1, 2), (1, 3)]), "repeats milestone 1"),
        (lambda: Piecewise([(1, 2, 3)]), "pairs"),
        (lambda: Piecewise({0: 2}, unit="tokenz"), r"`unit` must be one of .*\('tokens' is another name for 'items'"),
        (lambda: Ramp(0, 4, over=10), "`start`"),
        (lambda: Ramp(1, 4, over=0), "`over`"),
        (lambda: Ramp(1, 4, over=10, shape="cosine"), "`shape`"),
        (lambda: Ramp(1, 6, over=10, multiple_of=4), "not a multiple of `multiple_of`"),
        (lambda: Lambda(3), "`fn` must be callable"),
        (lambda: as_schedule("4"), "must be a Schedule"),
    ],
)
def test_invalid_arguments(make: Any, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        make()


@pytest.mark.parametrize("bad", [0, -2, 1.5, None, True])
def test_invalid_result_is_named(bad: Any) -> None:
    with pytest.raises(ValueError, match="a schedule must return an int >= 1"):
        Lambda(lambda p: bad)(Progress())


SPELLINGS = [("epochs", "epoch"), ("steps", "step"), ("sample", "samples"), ("item", "items"), ("tokens", "items"),
             ("token", "items")]  # fmt: skip


@pytest.mark.parametrize(("given", "canonical"), SPELLINGS)
def test_a_unit_in_either_number_is_the_same_unit(given: str, canonical: str) -> None:
    from lightning_accum.lr import WarmupCosine

    assert Piecewise({0: 1, 3: 2}, unit=given) == Piecewise({0: 1, 3: 2}, unit=canonical)  # type: ignore[arg-type]
    assert Ramp(1, 4, over=10, unit=given).unit == canonical  # type: ignore[arg-type]
    assert WarmupCosine(1, 10, unit=given).unit == canonical


NEAR_MISSES = [("tokns", "items"), ("Tokens", "items"), ("smaples", "samples"), ("Steps", "step"), ("epcoh", "epoch"),
               ("scaled", "scaled_steps")]  # fmt: skip


@pytest.mark.parametrize(("given", "hint"), NEAR_MISSES)
def test_a_near_miss_unit_names_the_unit_meant(given: str, hint: str) -> None:
    with pytest.raises(ValueError, match=rf"got {given!r}\. Did you mean {hint!r}\?"):
        Ramp(1, 4, over=10, unit=given)  # type: ignore[arg-type]


def floor_power(start: int, end: int, t: Fraction) -> int:
    """``floor(start * (end / start) ** t)`` in integers: the largest k with ``k ** q <= start ** q * (end /
    start) ** p`` for ``t = p / q`` (no float: an exact power is exact)."""
    p, q = t.numerator, t.denominator
    num, den = start ** (q - p) * end**p, 1  # start ** q * (end / start) ** p = start ** (q - p) * end ** p
    k = 0
    while (k + 1) ** q * den <= num:
        k += 1
    return k


@pytest.mark.parametrize("over", [1, 2, 3, 5, 6])
@pytest.mark.parametrize(("start", "end"), [(1, 8), (1, 16), (3, 24), (2, 64), (8, 1), (48, 3)])
def test_exponential_ramp_lands_on_its_exact_powers(start: int, end: int, over: int) -> None:
    """``shape="exponential"`` at each step against exact integer arithmetic: where ``k`` is an exact power
    (``Ramp(1, 8, over=3)`` at step 2 is 4, which float ``8 ** (2 / 3)`` gives as 3.9999999999999996) it is that
    power, not the one below."""
    ramp = Ramp(start, end, over=over, unit="step", shape="exponential")
    got = [ramp(Progress(step=s)) for s in range(over + 2)]
    want = [floor_power(start, end, Fraction(min(s, over), over)) for s in range(over + 2)]
    assert got == want


def _k(p: Progress) -> int:
    return 2


@pytest.mark.parametrize(
    ("unit", "shown"),
    [(None, ""), ("samples", ", unit='samples'"), ("tokens", ", unit='items'"), ("epoch", ", unit='epoch'")],
)
def test_a_lambdas_repr_names_its_function_and_its_unit_where_given(unit: Any, shown: str) -> None:
    assert repr(Lambda(_k, unit=unit)) == f"Lambda({_k!r}{shown})"
