"""Bad arguments get a message that names the argument and the fix, before anything trains
(the inputs that got a bare `TypeError`, a message blaming something else, or were accepted
silently)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from lightning_accum import AccumulationScheduler, Constant, NoiseScale, Piecewise, Ramp
from lightning_accum._core.options import AccumulationConfig
from lightning_accum.lr import WarmupCosine

from helpers import ManualTokenModel, TokenData, count_tokens, loader, token_losses, trainer

ITEMS_LR = WarmupCosine(10, 100, unit="items")


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: AccumulationScheduler(2, lr_schedule=ITEMS_LR), ValueError, r"lr_schedule WarmupCosine.*`count`"),
        (lambda: AccumulationConfig(Constant(2), lr_schedule=ITEMS_LR), ValueError, r"`configure_accumulation` needs"),
        (lambda: AccumulationScheduler(2, lr_schedule=WarmupCosine), TypeError, r"an instance, `WarmupCosine\(...\)`"),
        (lambda: AccumulationScheduler(2, lr_schedule=lambda p: math.nan), ValueError, r"returned nan .*finite"),
        (lambda: AccumulationScheduler(2, lr_schedule=lambda p: 1e6), ValueError, r"above 1000 is surely a mistake"),
        (lambda: AccumulationScheduler(1, lr_scaling="adascale"), ValueError, r"gives k = 1 throughout"),
        (lambda: AccumulationScheduler(Piecewise({0: 1, 5: 1}), lr_scaling="adascale"), ValueError, "k = 1 throughout"),
        (lambda: AccumulationScheduler(2, log="yes"), TypeError, r"`log` must be True or False; got 'yes'"),
        (lambda: AccumulationConfig(Constant(2), log="yes"), TypeError, r"`log` must be True or False"),
        (lambda: NoiseScale(2, 8, hysteresis="0.1"), ValueError, r"`hysteresis` must be a number in \[0, 1\)"),
        (lambda: NoiseScale(2, 8, max_ratio="2"), ValueError, r"`max_ratio` .* must be a number > 1"),
        (lambda: NoiseScale(2, 8, beta="0.9"), ValueError, r"`beta` .* must be a number in \[0, 1\)"),
        (lambda: Ramp(1, 4, over=10, unit="stepz"), ValueError, r"got 'stepz'. Did you mean 'step'\?"),
        (lambda: Piecewise({0: 2}, unit="epoc"), ValueError, r"Did you mean 'epoch'\?"),
        (lambda: AccumulationScheduler(2, normalize="items", count=len), ValueError,
         r"`normalize='items'` needs `reduction`: .* Give `reduction='mean'` for a mean"),
    ],
)  # fmt: skip
def test_arguments_are_named_with_the_fix(make: Callable[[], Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        make()


class Blocks(ManualTokenModel):
    """One `accumulate` block doing ``what``."""

    def __init__(self, what: Callable[[Any, Any, Any], Any]) -> None:
        super().__init__(schedule=2)
        self.what = what

    def training_step(self, batch: Any, batch_idx: int) -> None:
        with self.accumulate(batch) as acc:
            self.what(self, acc, batch)


def _loss(model: Any, batch: Any) -> torch.Tensor:
    return token_losses(model.net, batch)[0]


def _encode(model: Any) -> Callable[[Any], torch.Tensor]:
    return lambda b: model.net(b["x"]).sum(-1)


@pytest.mark.parametrize(
    ("what", "error", "match"),
    [
        (lambda m, acc, b: acc.backward_each([lambda: _loss(m, b)], weights=["a"]), ValueError, "finite numbers"),
        (lambda m, acc, b: acc.backward_each([lambda: _loss(m, b)], weights=[math.nan]), ValueError, "finite numbers"),
        (lambda m, acc, b: acc.backward_each([lambda: _loss(m, b)] * 3, names="abc"), TypeError,
         r"`names` must be a list of strings"),
        (lambda m, acc, b: acc.backward_heads(m.net[:2](b["x"]), []), ValueError, r"`heads` is empty"),
        (lambda m, acc, b: acc.backward_cached([_encode(m)], [b], lambda r: r.sum(), chunk_size=2, gather="yes"),
         TypeError, r"`gather` must be True or False"),
        (lambda m, acc, b: acc.backward_cached(m.net, [b], lambda r: r.sum(), chunk_size=2), TypeError,
         r"`encoders` must be a list, one entry per tower"),
        (lambda m, acc, b: acc.backward_cached([_encode(m)], [{k: v[:0] for k, v in b.items()}],
                                               lambda r: r.sum(), chunk_size=2),
         ValueError, r"`inputs\[0\]` holds no samples"),
        (lambda m, acc, b: acc.backward_cached([_encode(m)], [b], lambda r: r.sum(), chunk_size=2, get_rep=5),
         TypeError, r"`get_rep` must be a callable on an encoder's output"),
        (lambda m, acc, b: acc.backward_cached([_encode(m)] * 2, [b, b], lambda r: r.sum(), chunk_size=[2, 0]),
         ValueError, r"`chunk_size` must be an int >= 1 \(samples per chunk\), or one per encoder"),
        (lambda m, acc, b: acc.backward_cached([lambda x, **_: m.net(x).sum()], [b], lambda r: r.sum(), chunk_size=2),
         ValueError, r"returned a 0-d tensor; it must return one row per sample"),
        (lambda m, acc, b: acc.backward(_loss(m, b), items=3), ValueError,
         r"`acc.backward\(loss, items=n\)` weights the loss .* needs `normalize='items'`"),
    ],
)  # fmt: skip
def test_mixin_arguments_are_named_with_the_fix(what: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        trainer(max_epochs=1).fit(Blocks(what), loader(TokenData(8), 4))


def test_a_stateful_lr_schedule_is_not_called_at_construction() -> None:
    """(Its calls would change the state a checkpoint keeps.)"""

    class Counting(WarmupCosine):
        calls = 0

        def multiplier(self, progress: Any) -> float:
            self.calls += 1
            return super().multiplier(progress)

        def state_dict(self) -> dict[str, Any]:
            return {"calls": self.calls}

    schedule = Counting(1, 10)
    AccumulationScheduler(2, lr_schedule=schedule, count=count_tokens)
    assert schedule.calls == 0


def test_a_config_made_without_arguments_has_configure_accumulations_defaults() -> None:
    """A mixin model that never calls ``configure_accumulation`` runs on ``AccumulationConfig``'s defaults (k=1):
    each is the one ``configure_accumulation`` documents in its signature (logging on, for one)."""
    import dataclasses
    import inspect

    from lightning_accum import AccumulationMixin
    from lightning_accum.schedules import as_schedule

    config = AccumulationConfig(schedule=as_schedule(1))
    documented = inspect.signature(AccumulationMixin.configure_accumulation).parameters
    fields = [f.name for f in dataclasses.fields(AccumulationConfig) if f.name != "schedule"]
    assert sorted(fields) == sorted(name for name in documented if name not in ("self", "schedule"))
    assert {name: getattr(config, name) for name in fields} == {name: documented[name].default for name in fields}


@pytest.mark.parametrize(
    ("value", "hint"),
    [(1e-3, None), (0.5, None), (1, None), (0, "0 would zero every gradient"), (-1, None), (-0.5, None)],
)
def test_a_clip_value_is_taken_above_zero_and_zero_is_told_how_to_turn_clipping_off(
    value: float, hint: str | None
) -> None:
    """Any finite ``gradient_clip_val`` > 0 is taken, under 1 too; 0 is refused with the way to turn clipping off
    (``None``), which no other refused value is told."""
    from lightning_accum._core.options import check_clip

    if value > 0:
        check_clip(value, "norm")
        return
    with pytest.raises(ValueError, match="`gradient_clip_val` must be a finite number > 0") as error:
        check_clip(value, "norm")
    assert ("give None to turn clipping off" in str(error.value)) == (hint is not None)
