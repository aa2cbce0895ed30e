"""``FabricAccumulator`` under FSDP2 (Fabric's ``ModelParallelStrategy`` with ``fully_shard``) on 2 CPU
processes (gloo), against the single-process float64 reference on the union of the data: the gradient
sync skipped before each window's last micro-batch (``last=True`` names the data's last), or
reduce-scattered after every micro-batch (``sync="every"``, ``flush`` then closes a short window);
clipping through Fabric on the sharded gradient; FSDP2's reduce-scatters counted on each rank. A
``flush`` that FSDP2 cannot serve is refused with the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_accum import Constant, Ramp, Schedule
from lightning_accum.fabric import FabricAccumulator

from helpers import Reference, TokenData, count_tokens, default_dtype, make_net, max_diff, rank_batches, token_losses

pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs torch.distributed")
if not hasattr(torch.distributed.fsdp, "fully_shard"):  # torch < 2.6
    pytest.skip("FSDP2 (`fully_shard`) needs torch >= 2.6", allow_module_level=True)

from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from torch.distributed.fsdp import fully_shard

pytestmark = pytest.mark.slow

WORLD = 2
DATA = TokenData(56)  # 7 batches of 4 per rank and epoch: short last windows
SHARDED_LAYERS = 2  # one reduce-scatter per sharded Linear (the Sequential holds no parameter of its own)
SCATTERS = [0]
CASES: dict[str, tuple[Schedule, dict[str, Any]]] = {
    "auto, items, clipped": (
        Ramp(1, 3, over=60, unit="items"),
        {"normalize": "items", "reduction": "sum", "count": count_tokens, "gradient_clip_val": 0.05},
    ),
    "every, mean, lr_scaling": (Ramp(1, 4, over=40, unit="samples"), {"sync": "every", "lr_scaling": "linear"}),
}


def shard(module: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """Every Linear and the root; a module marked ``first_only``: its first layer alone (a mistake)."""
    if getattr(module, "first_only", False):
        fully_shard(module[0], mesh=mesh["data_parallel"])
        return module
    for layer in module:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(module, mesh=mesh["data_parallel"])
    return module


class ForkedModelParallel(ModelParallelStrategy):
    """FSDP2 over a 1-D data-parallel mesh; forked (Fabric launches this strategy by re-running the script)."""

    def __init__(self) -> None:
        super().__init__(parallelize_fn=shard, data_parallel_size=WORLD, tensor_parallel_size=1)

    def _configure_launcher(self) -> None:
        self._launcher = _MultiProcessingLauncher(self, start_method="fork")


def train(fabric: Fabric, schedule: Schedule, options: dict[str, Any], last: bool) -> tuple[list[Any], int, int]:
    """Two epochs of the user's loop; the parameters (whole), FSDP2's reduce-scatters and the steps."""
    net = make_net()
    model = fabric.setup_module(net)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    acc = FabricAccumulator(fabric, model, optimizer, schedule, **options)
    batches = rank_batches(DATA, 4, world=WORLD)[fabric.global_rank]
    SCATTERS[0] = 0
    for epoch in range(2):
        for i, batch in enumerate(batches):
            with acc.accumulate(batch, epoch=epoch, last=last and i == len(batches) - 1) as step:
                total, tokens = token_losses(model, batch)
                step.backward(total if options.get("normalize") == "items" else total / tokens)
        acc.flush()
    params = [p.full_tensor().tolist() for p in model.parameters()]  # type: ignore[operator]
    return params, SCATTERS[0], acc.progress.step


def ranks(fabric: Fabric, out: Path) -> None:
    torch.set_default_dtype(torch.float64)
    report: dict[str, Any] = {}
    for name, (schedule, options) in CASES.items():
        report[name] = train(fabric, schedule, options, last=options.get("sync") != "every")
    try:  # the sync skipped, but the data's last micro-batch not named: `flush` cannot reduce the window
        train(fabric, Constant(3), {}, last=False)
        report["refused"] = ""
    except RuntimeError as error:
        report["refused"] = str(error)
    net = make_net()  # only the first layer sharded: the second's gradient would never be reduced
    net.first_only = True
    model = fabric.setup_module(net)
    try:
        FabricAccumulator(fabric, model, fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1)))
        report["partly sharded"] = ""
    except ValueError as error:
        report["partly sharded"] = str(error)
    model = fabric.setup_module(make_net())  # FSDP2 holds a window's unsharded gradient itself: refused, naming
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))  # what does the job there
    try:
        FabricAccumulator(fabric, model, optimizer, grad_accum_dtype="float32")
        report["grad_accum_dtype"] = ""
    except ValueError as error:
        report["grad_accum_dtype"] = str(error)
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(report))


def test_fsdp2_in_a_fabric_loop_matches_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = dist.reduce_scatter_single

    def counting(*args: Any, **kwargs: Any) -> Any:
        SCATTERS[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(dist, "reduce_scatter_single", counting)  # before the fork: the ranks inherit it
    # "32-true": the strategy refuses "64-true", and leaves the float64 model and data as they are
    Fabric(accelerator="cpu", devices=WORLD, strategy=ForkedModelParallel(), precision="32-true").launch(
        ranks, tmp_path
    )
    for rank in range(WORLD):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name, (schedule, options) in CASES.items():
            params, scatters, steps = report[name]
            reference = Reference(
                schedule, normalize=options.get("normalize", "mean"), optimizer="plain-sgd",
                clip=options.get("gradient_clip_val"), lr_scaling=options.get("lr_scaling"),
            )  # fmt: skip
            with default_dtype(torch.float64):
                expected, sizes = reference.run([rank_batches(DATA, 4, world=WORLD)] * 2)
            got = [torch.tensor(p, dtype=torch.float64) for p in params]
            assert max_diff(got, expected) <= 1e-12, name
            assert steps == len(sizes), name
            rounds = sum(sizes) if options.get("sync") == "every" else len(sizes)  # per micro-batch, or per step
            assert scatters == SHARDED_LAYERS * rounds, name
        assert "its last micro-batch skipped the gradient sync" in report["refused"]
        assert "Give `last=True`" in report["refused"]
        assert "the parameters 2.weight, 2.bias are not sharded by `fully_shard`" in report["partly sharded"]
        assert "`grad_accum_dtype='float32'` cannot work here. FSDP2" in report["grad_accum_dtype"]
        assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)" in (
            report["grad_accum_dtype"]
        )
