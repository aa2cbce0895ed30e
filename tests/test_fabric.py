"""``FabricAccumulator``: a Lightning Fabric loop's windows against the float64 reference loop
(helpers.Reference, which forms the same windows by hand), on one process and on 2 CPU ranks
(DDP, gloo, forked): constant k, a token ramp, items with micro-batches of no items, short last
windows, resume at a step and inside a window; one gradient collective round per step; refusals."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric

from lightning_accum import Constant, Piecewise, Ramp, Schedule, collectives
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


# at a step; inside a window; at an epoch's last batch (flushed after the resume); inside the second epoch
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


def test_refusals_name_the_argument_and_the_fix() -> None:
    fabric = single()
    net = make_net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"`optimizer` must be the one `fabric.setup"):
        FabricAccumulator(fabric, model, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"needs `reduction`"):
        FabricAccumulator(fabric, model, optimizer, 2, normalize="items", count=count_tokens)
    acc = FabricAccumulator(fabric, model, optimizer, Piecewise({0: 2}, unit="epoch"))
    batch = rank_batches(DATA, 4)[0][0]
    epochs = r"keyed on epochs: give `acc.accumulate\(batch, epoch=e\)`"
    with pytest.raises(ValueError, match=epochs), acc.accumulate(batch):
        pass
    acc = FabricAccumulator(fabric, model, optimizer, 2)
    with pytest.raises(RuntimeError, match=r"made no `step.backward\(loss\)`"), acc.accumulate(batch):
        total, _ = token_losses(model, batch)
        fabric.backward(total)  # (bypasses the window's weighting)
    acc = FabricAccumulator(fabric, model, optimizer, 3)
    with acc.accumulate(batch, epoch=0) as step:
        step.backward(token_losses(model, batch)[0])
    flush = r"call `acc.flush\(\)` at each epoch's end"
    with pytest.raises(RuntimeError, match=flush), acc.accumulate(batch, epoch=1):
        pass


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
