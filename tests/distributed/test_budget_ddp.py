"""``Budget`` under DDP: 2 forked gloo ranks whose micro-batches hold different token counts close the same
windows, equal to the float64 reference over both ranks and to one process on the union of their micro-batches,
and no rank waits on a collective of the budget inside a window (issue 52): the callback sums the counts read
ahead from the loader, ``CHUNK`` batches per all-reduce, a chunk ahead; the mixin and ``FabricAccumulator`` issue
each micro-batch's count as it opens and read it after its backward pass, or, opted in
(``configure_accumulation(read_ahead=True)``, ``acc.read_ahead(loader)``), read ahead as the callback does; ranks
whose loaders (without a length) end at different batches are refused on the opt-in, where they hung before."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.pytorch.strategies import DDPStrategy
from test_budget import reference
from test_fabric_fsdp2 import DATA as FSDP2_DATA
from test_fabric_fsdp2 import SCATTERS, SHARDED_LAYERS, ForkedModelParallel
from test_fabric_fsdp2 import train as fsdp2_train

from lightning_accum import AccumulationScheduler, Budget, FabricAccumulator
from lightning_accum._core import ahead as core_ahead
from lightning_accum._core.ahead import CHUNK
from lightning_accum._trainer import fit_checks

from helpers import (
    KRecorder,
    ManualTokenModel,
    TokenData,
    TokenModel,
    count_tokens,
    default_dtype,
    loader,
    make_net,
    max_diff,
    rank_batches,
    token_losses,
)
from helpers import trainer as make_trainer

pytestmark = pytest.mark.slow

WORLD = 2
#: per process, what the package's collectives made this rank wait for: "waited", a collective the package
#: waits on (blocking, or a non-blocking one read) before the backward pass of the micro-batch it went out in, in a
#: micro-batch that does not open its window (a window opens where its ranks have just met, at the last one's end);
#: "counts", the budget's count all-reduces (one int64 on the host each, or a chunk of them); "blocking", those
#: waited on as they went out
WAITS = {"waited": 0, "counts": 0, "blocking": 0, "microbatches": 0}
NOW = {"microbatch": 0, "opens": True, "backward": False}  # the micro-batch under way


def _from_the_package() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if f"{os.sep}lightning_accum{os.sep}" in frame.f_code.co_filename:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _from(name: str) -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == name:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


class _Work:
    """A non-blocking collective's handle that notes where it is waited for."""

    def __init__(self, work: Any) -> None:
        self.work, self.microbatch = work, NOW["microbatch"]

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        if self.microbatch == NOW["microbatch"] and not NOW["backward"] and not NOW["opens"]:
            WAITS["waited"] += 1  # (issued in this micro-batch, read before its backward: nothing overlapped it)
        return self.work.wait(*args, **kwargs)


def watch_collectives() -> None:
    """In this forked rank only: ``torch.distributed.all_reduce`` and autograd's backward noted (``WAITS``)."""
    all_reduce, backward = dist.all_reduce, torch.autograd.backward

    def noting_all_reduce(tensor: torch.Tensor, *args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        ours = _from_the_package()
        if ours and (_from("ask") or _from("_issue") or _from("host_sum")):  # (the budget's count)
            assert tensor.device.type == "cpu" and tensor.dtype == torch.int64
            WAITS["counts"] += 1
            WAITS["blocking"] += not async_op
        if ours and not async_op and not NOW["backward"] and not NOW["opens"]:
            WAITS["waited"] += 1
        work = all_reduce(tensor, *args, async_op=async_op, **kwargs)
        return _Work(work) if ours and async_op else work

    def noting_backward(*args: Any, **kwargs: Any) -> Any:
        out = backward(*args, **kwargs)
        NOW["backward"] = True
        return out

    dist.all_reduce, torch.autograd.backward = noting_all_reduce, noting_backward  # type: ignore[assignment]


def microbatch_starts(opens: bool) -> None:
    NOW.update(microbatch=NOW["microbatch"] + 1, opens=opens, backward=False)
    WAITS["microbatches"] += 1


class Report(pl.Callback):
    """Listed first: marks each micro-batch's start before the package's hooks run."""

    def __init__(self, out: Path, recorder: KRecorder) -> None:
        self.out, self.recorder = out, recorder

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        watch_collectives()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        accum = next((cb for cb in trainer.callbacks if isinstance(cb, AccumulationScheduler)), None)  # type: ignore[attr-defined]
        engines = [accum._engine] if accum is not None else pl_module._accumulation.windows.engines.values()  # type: ignore[union-attr]
        microbatch_starts(opens=all(engine.window is None for engine in engines))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        accum = next((cb for cb in trainer.callbacks if isinstance(cb, AccumulationScheduler)), None)  # type: ignore[attr-defined]
        progress = pl_module.accumulation_progress if accum is None else accum.progress  # type: ignore[attr-defined]
        report = {
            "params": [p.detach().tolist() for p in pl_module.parameters()],
            "windows": self.recorder.windows,
            "waits": WAITS,
            "progress": progress.__dict__,
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


def fit_ddp(tmp_path: Path, model: pl.LightningModule, callbacks: list[pl.Callback]) -> list[dict[str, Any]]:
    recorder = KRecorder()
    t = make_trainer(
        callbacks=[Report(tmp_path, recorder), *callbacks, recorder],
        devices=WORLD,
        strategy=DDPStrategy(start_method="fork", process_group_backend="gloo"),
        use_distributed_sampler=False,
    )
    t.fit(model, loader(TokenData(64), 4, sharded=True))
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


def expected(n: int) -> tuple[list[torch.Tensor], list[int]]:
    ranks = rank_batches(TokenData(64), 4, world=WORLD)
    per_rank = [sum(int(b["mask"].sum()) for b in r) for r in ranks]
    assert per_rank[0] != per_rank[1]  # the ranks really differ in token count
    params, sizes, _ = reference([ranks] * 2, lambda p: n)
    # one process whose micro-batch i is the union of the ranks' i-th: the same windows and gradient
    union = [{key: torch.cat([a[key], b[key]]) for key in a} for a, b in zip(*ranks, strict=True)]
    one, one_sizes, _ = reference([[union]] * 2, lambda p: n)
    assert one_sizes == sizes and max_diff(one, params) <= 1e-12
    return params, sizes


@pytest.mark.parametrize("adapter", ["callback", "callback+pieces", "mixin", "mixin+read_ahead"])
def test_ranks_close_the_same_windows_as_one_process_on_the_union(tmp_path: Path, adapter: str) -> None:
    budget = Budget(50, unit="items")
    if adapter.startswith("callback"):
        size = 3 if adapter == "callback+pieces" else None  # (each loader batch of 4 in pieces of 3 and 1)
        callback = AccumulationScheduler(
            budget, normalize="items", count=count_tokens, reduction="sum", microbatch_size=size
        )
        reports = fit_ddp(tmp_path, TokenModel(reduction="sum"), [callback])
    else:
        model = ManualTokenModel(reduction="sum", schedule=budget, normalize="items", count=count_tokens,
                                 read_ahead=adapter == "mixin+read_ahead")  # fmt: skip
        reports = fit_ddp(tmp_path, model, [])
    params, sizes = expected(50)
    assert len(set(sizes)) > 1  # (windows of different sizes)
    microbatches = sum(sizes)
    for report in reports:
        assert max_diff([torch.tensor(p, dtype=torch.float64) for p in report["params"]], params) <= 1e-12
        if adapter == "callback":
            assert report["windows"] == sizes
        waits = report["waits"]
        assert waits["microbatches"] == microbatches
        assert waits["waited"] == 0  # none inside a window (before: 10, all but windows' first)
        if adapter == "mixin":  # each micro-batch's count goes out as its block opens, read after its backward
            assert waits["counts"] == microbatches and waits["blocking"] == 0
        else:  # CHUNK batches' counts per all-reduce, read ahead (two chunks out at each epoch's start)
            assert waits["counts"] == 2 * (-(-microbatches // 2 // CHUNK) + 1)
            assert waits["blocking"] == 0
    assert reports[0]["progress"] == reports[1]["progress"]
    assert reports[0]["progress"]["step"] == len(sizes)


def fsdp2_ranks(fabric: Fabric, out: Path) -> None:
    torch.set_default_dtype(torch.float64)
    options = {"normalize": "items", "reduction": "sum", "count": count_tokens}
    params, scatters, steps = fsdp2_train(fabric, Budget(60, unit="items"), options, last=True)
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps([params, scatters, steps]))


def test_fsdp2_in_a_fabric_loop_equals_the_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The window's last micro-batch is known before its backward (its count over ranks): one reduce-scatter round
    per window, as under a schedule of k."""
    original = dist.reduce_scatter_single

    def counting(*args: Any, **kwargs: Any) -> Any:
        SCATTERS[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(dist, "reduce_scatter_single", counting)  # before the fork: the ranks inherit it
    strategy = ForkedModelParallel()
    Fabric(accelerator="cpu", devices=WORLD, strategy=strategy, precision="32-true").launch(fsdp2_ranks, tmp_path)
    with default_dtype(torch.float64):  # (the ranks' model was made under float64 defaults)
        expected, sizes, _ = reference(
            [rank_batches(FSDP2_DATA, 4, world=WORLD)] * 2, lambda p: 60, optimizer="plain-sgd"
        )
    assert len(set(sizes)) > 1
    for rank in range(WORLD):
        params, scatters, steps = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert max_diff([torch.tensor(p, dtype=torch.float64) for p in params], expected) <= 1e-12
        assert steps == len(sizes)
        assert scatters == SHARDED_LAYERS * len(sizes)


def fabric_ranks(fabric: Fabric, out: Path, read_ahead: bool = False) -> None:
    """Two epochs of a user's loop under Fabric's DDP, each micro-batch's start marked (``microbatch_starts``);
    ``read_ahead``: through ``acc.read_ahead``."""
    torch.set_default_dtype(torch.float64)
    watch_collectives()
    net = make_net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    options: dict[str, Any] = {"normalize": "items", "reduction": "sum", "count": count_tokens}
    acc = FabricAccumulator(fabric, model, optimizer, Budget(50, unit="items"), **options)
    batches = rank_batches(TokenData(64), 4, world=WORLD)[fabric.global_rank]
    for epoch in range(2):
        for batch in acc.read_ahead(batches) if read_ahead else batches:
            microbatch_starts(opens=acc._engine.window is None)
            with acc.accumulate(batch, epoch=epoch) as step:
                total, _ = token_losses(model, batch)
                step.backward(total)
        acc.flush()
    report = {"params": [p.detach().tolist() for p in model.parameters()], "waits": WAITS, "steps": acc.progress.step}
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(report))


@pytest.mark.parametrize("read_ahead", [False, True])
def test_fabric_waits_on_no_collective_inside_a_window(tmp_path: Path, read_ahead: bool) -> None:
    """``FabricAccumulator`` under DDP: each block's count goes out as it opens and is read after its backward pass,
    where the step is decided; or, in an ``acc.read_ahead`` loop, the counts are read ahead, ``CHUNK`` per
    all-reduce; the windows are the reference's."""
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy="ddp_fork", precision="64-true")
    fabric.launch(fabric_ranks, tmp_path, read_ahead)
    with default_dtype(torch.float64):  # (the ranks' model was made under float64 defaults)
        data = [rank_batches(TokenData(64), 4, world=WORLD)] * 2
        params, sizes, _ = reference(data, lambda p: 50, optimizer="plain-sgd")
    assert len(set(sizes)) > 1
    for rank in range(WORLD):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert max_diff([torch.tensor(p, dtype=torch.float64) for p in report["params"]], params) <= 1e-12
        assert report["steps"] == len(sizes)
        waits = report["waits"]
        assert waits["microbatches"] == sum(sizes)
        assert waits["waited"] == 0  # (before: 10)
        assert waits["blocking"] == 0
        if read_ahead:  # (per epoch of 8 batches: two chunks at its first, one at its fifth, one as its end is checked)
            assert waits["counts"] == 2 * (-(-sum(sizes) // 2 // CHUNK) + 2)
        else:
            assert waits["counts"] == sum(sizes)


# ------------------------------------------------------------------ a rank whose data runs out first
def recording(out: Path) -> Any:
    """``refuse_uneven_budget_data`` that writes, on each rank, what it raised and the steps taken (a rank runs in a
    child process, where Lightning's launcher calls no ``on_exception``)."""
    check = fit_checks.refuse_uneven_budget_data

    def wrapped(trainer: pl.Trainer, schedule: object, owner: str) -> None:
        try:
            check(trainer, schedule, owner)
        except RuntimeError as error:
            report = {"error": str(error), "step": trainer.global_step}
            (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))
            raise

    return wrapped


@pytest.mark.parametrize("adapter", ["callback", "mixin"])
def test_a_rank_whose_loader_runs_out_first_is_refused_on_every_rank_at_the_start(
    tmp_path: Path, adapter: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """33 samples over 2 ranks in batches of 4: rank 0's loader holds 5 batches, rank 1's 4. Under a budget every
    micro-batch's count is summed over the ranks, so rank 1's epoch would end while rank 0 waits in the count of its
    fifth (rank 1 ended the fit as if nothing were wrong, and rank 0 failed on a closed connection, or waited for the
    process group's timeout). Every rank raises at the fit's start, before any step, naming the lengths and the fix.
    (The process group's timeout is short here, so that a rank left waiting fails the test rather than holds it.)"""
    monkeypatch.setattr(fit_checks, "refuse_uneven_budget_data", recording(tmp_path))  # (before the fork)
    budget = Budget(16, unit="samples")
    if adapter == "callback":
        model: pl.LightningModule = TokenModel()
        callbacks: list[pl.Callback] = [AccumulationScheduler(budget)]
    else:
        model, callbacks = ManualTokenModel(schedule=budget), []
    t = make_trainer(
        callbacks=callbacks, devices=WORLD, use_distributed_sampler=False,
        strategy=DDPStrategy(start_method="fork", process_group_backend="gloo", timeout=timedelta(seconds=30)),
    )  # fmt: skip
    with pytest.raises(Exception, match=r"training loaders hold \[5, 4\] batches"):
        t.fit(model, loader(TokenData(33), 4, sharded=True))
    owner = "AccumulationScheduler" if adapter == "callback" else "configure_accumulation"
    for rank in range(WORLD):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["step"] == 0
        assert report["error"].startswith(f"`{owner}(Budget(16, unit='samples'))` needs every rank to run the same")
        assert "limit_train_batches=4" in report["error"]


class Uneven(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """A loader without a length whose rank 0 holds 5 batches of 4 and rank 1 4 (33 samples, rank-strided)."""

    def __iter__(self) -> Any:
        rank, data = dist.get_rank(), TokenData(33)
        index = list(range(rank, len(data), WORLD))
        return iter([data.batch(index[i : i + 4]) for i in range(0, len(index), 4)])


def noting_uneven(out: Path) -> Any:
    """``_core.ahead._uneven`` that writes, on each rank that refuses, the refusal (a rank runs in a child process)."""
    message = core_ahead._uneven

    def wrapped(position: int, present: int, strategy: Any) -> str:
        text = message(position, present, strategy)
        (out / f"rank{dist.get_rank()}.txt").write_text(text)
        return text

    return wrapped


def uneven_fabric_ranks(fabric: Fabric) -> None:
    torch.set_default_dtype(torch.float64)
    net = make_net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    acc = FabricAccumulator(fabric, model, optimizer, Budget(16, unit="samples"))
    for batch in acc.read_ahead(torch.utils.data.DataLoader(Uneven(), batch_size=None)):
        with acc.accumulate(batch) as step:
            step.backward(token_losses(model, batch)[0])
    acc.flush()


@pytest.mark.parametrize("adapter", ["callback", "mixin+read_ahead", "fabric+read_ahead"])
def test_ranks_whose_loaders_without_a_length_end_apart_are_refused_not_left_waiting(
    tmp_path: Path, adapter: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0's loader (without a length) holds 5 batches, rank 1's 4: the fit-start check cannot see it, and a rank
    waited in a budget's count that the other never sent (till the process group's timeout). Reading ahead, every
    chunk sums how many ranks have each batch: rank 0 refuses its fifth batch (in the Fabric loop rank 1 too, as its
    loop ends there), naming the fix; the error surfaces at once (the process group's timeout is long here: a rank
    left waiting would hold the test, not fail it quickly, so the test's own end proves none was)."""
    monkeypatch.setattr(core_ahead, "_uneven", noting_uneven(tmp_path))  # (before the fork)
    budget = Budget(16, unit="samples")
    ranks = [0] if adapter != "fabric+read_ahead" else [0, 1]
    with pytest.raises(Exception, match=r"ended at different batches|ProcessRaisedException|exited"):
        if adapter == "fabric+read_ahead":
            Fabric(accelerator="cpu", devices=WORLD, strategy="ddp_fork", precision="64-true").launch(
                uneven_fabric_ranks
            )
        else:
            if adapter == "callback":
                model: pl.LightningModule = TokenModel()
                callbacks: list[pl.Callback] = [AccumulationScheduler(budget)]
            else:
                model, callbacks = ManualTokenModel(schedule=budget, read_ahead=True), []
            t = make_trainer(
                callbacks=callbacks, devices=WORLD, use_distributed_sampler=False, max_epochs=1,
                strategy=DDPStrategy(start_method="fork", process_group_backend="gloo", timeout=timedelta(seconds=60)),
            )  # fmt: skip
            t.fit(model, torch.utils.data.DataLoader(Uneven(), batch_size=None))
    for rank in ranks:
        error = (tmp_path / f"rank{rank}.txt").read_text()
        assert error.startswith("The ranks' data ended at different batches: batch 4 of the epoch is on 1 of 2 ranks")
        assert "`DistributedSampler(drop_last=True)`" in error
