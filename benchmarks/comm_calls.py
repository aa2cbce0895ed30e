"""Gradient collectives per optimizer step with k = 4, on 2 ranks: DDP and FSDP2 on CPU (gloo), in the
Trainer and in Fabric loops (LitGPT's hand-written accumulation against ``FabricAccumulator``), and FSDP on
CUDA where there is one (world size = the number of GPUs, at most 2).

Each configuration trains one epoch of 16 micro-batches per rank (4 optimizer steps) and counts,
on rank 0: the gradient collectives (DDP's reducer through a communication hook; FSDP's
reduce-scatters or all-reduces issued during backward; the mixin's explicit all-reduce) and the
package's own count all-reduce (one small integer tensor per window). A *round* is one
collective per gradient bucket (DDP: 1 here) or per sharded module (FSDP2 here: 2 Linear
layers); the target is 1 round per optimizer step wherever sync is skipped.

    python benchmarks/comm_calls.py
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationMixin, AccumulationScheduler
from lightning_accum._core import collectives, sync

K, MICROBATCHES, BATCH = 4, 16, 8
GRADIENT_COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single")
COUNTS = {"gradient": 0, "package_counts": 0}
IN_BACKWARD = [False]
DEPTH = [0]


# ---------------------------------------------------------------------- models
class Net(pl.LightningModule):
    def __init__(self, shard: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
        self.shard = shard

    def configure_model(self) -> None:
        if self.shard:
            from torch.distributed.fsdp import fully_shard

            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class ManualNet(AccumulationMixin, Net):
    def __init__(self, shard: bool = False, sync: str = "auto") -> None:
        super().__init__(shard)
        self.configure_accumulation(K, sync=sync, log=False)  # type: ignore[arg-type]

    def training_step(self, batch: Any, batch_idx: int) -> None:  # type: ignore[override]
        with self.accumulate(batch) as acc:
            acc.backward(self.loss(batch))


# ---------------------------------------------------------------------- counting
class Counter(pl.Callback):
    def __init__(self, out: Path, ddp_hook: bool) -> None:
        self.out, self.ddp_hook = out, ddp_hook

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.ddp_hook:  # DDP's reducer all-reduces in C++: route it through Python (Lightning does on CUDA only)
            trainer.strategy.model.register_comm_hook(None, _counting_ddp_hook)  # type: ignore[union-attr]

    def on_before_backward(self, *args: Any) -> None:
        IN_BACKWARD[0] = True

    def on_after_backward(self, *args: Any) -> None:
        IN_BACKWARD[0] = False

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # collectives per round: one per FSDP2 module with parameters of its own; DDP puts this
        # small model in one bucket, FSDP (1) wraps it in one unit
        shards = [m for m in sync.fsdp2_modules(pl_module) if any(True for _ in m.parameters(recurse=False))]
        report = {**COUNTS, "steps": trainer.global_step, "world": trainer.world_size, "per_round": len(shards) or 1}
        if trainer.global_rank == 0:
            self.out.write_text(json.dumps(report))


def _counting_ddp_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations; none here
    return default_hooks.allreduce_hook(state, bucket)  # its `dist.all_reduce` is counted with the others


def _install_counters() -> None:
    """Wrap the collectives FSDP looks up on `torch.distributed`, the mixin's explicit all-reduce
    and the package's count all-reduce (installed before the fork: the ranks inherit them)."""
    for name in GRADIENT_COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counting(*args: Any, __original: Any = original, **kwargs: Any) -> Any:
            if IN_BACKWARD[0] and not DEPTH[0]:  # outermost only: gloo builds some collectives from others
                COUNTS["gradient"] += 1
            DEPTH[0] += 1
            try:
                return __original(*args, **kwargs)
            finally:
                DEPTH[0] -= 1

        setattr(dist, name, counting)
    explicit, counts = collectives._all_reduce_sum, collectives.sum_over_ranks

    def counting_explicit(flat: torch.Tensor) -> None:
        COUNTS["gradient"] += 1
        DEPTH[0] += 1  # (its `dist.all_reduce` is this one)
        try:
            explicit(flat)
        finally:
            DEPTH[0] -= 1

    def counting_counts(strategy: Any, values: Any, local: Any = ()) -> Any:
        if collectives.world_size(strategy) > 1:
            COUNTS["package_counts"] += 1
        DEPTH[0] += 1
        try:
            return counts(strategy, values, local)
        finally:
            DEPTH[0] -= 1

    collectives._all_reduce_sum = counting_explicit  # type: ignore[assignment]
    collectives.sum_over_ranks = counting_counts  # type: ignore[assignment]


class _ForkLauncher(_MultiProcessingLauncher):
    def _recover_results_in_main_process(self, worker_output: Any, trainer: Any) -> None:
        pass  # rank 0 reports through a file; sharded weights need not come back


class ForkedModelParallel(ModelParallelStrategy):
    """Plain FSDP2 over 2 ranks (a 1-D data-parallel mesh), launched by fork."""

    def __init__(self) -> None:
        super().__init__(data_parallel_size=2, tensor_parallel_size=1)

    def _configure_launcher(self) -> None:
        self._launcher = _ForkLauncher(self, start_method="fork")


# ---------------------------------------------------------------------- runs
def run(name: str, accelerator: str, devices: int) -> dict[str, Any]:
    strategy_name, mode = name.split(": ")
    shard = strategy_name == "FSDP2"
    manual = mode.startswith("mixin")
    sync_mode = mode.split("sync=")[1] if "sync=" in mode else "auto"
    if strategy_name == "DDP":
        strategy: Any = DDPStrategy(start_method="fork", process_group_backend="gloo" if accelerator == "cpu" else None)
    elif strategy_name == "FSDP2":
        strategy = ForkedModelParallel()
    else:
        from lightning.pytorch.strategies import FSDPStrategy

        strategy = FSDPStrategy()
    model: pl.LightningModule = ManualNet(shard, sync_mode) if manual else Net(shard)
    callbacks: list[pl.Callback] = []
    accumulate = 1
    if mode.startswith("callback"):
        callbacks.append(AccumulationScheduler(K, sync=sync_mode, log=False))  # type: ignore[arg-type]
    elif mode.startswith("built-in"):
        accumulate = K
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        trainer = pl.Trainer(
            accelerator=accelerator,
            devices=devices,
            strategy=strategy,
            max_epochs=1,
            accumulate_grad_batches=accumulate,
            callbacks=[*callbacks, Counter(out, ddp_hook=strategy_name == "DDP" and accelerator == "cpu")],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
        )
        torch.manual_seed(0)
        data = TensorDataset(torch.randn(MICROBATCHES * BATCH, 32), torch.randn(MICROBATCHES * BATCH, 1))
        trainer.fit(model, DataLoader(data, batch_size=BATCH))
        report = json.loads(out.read_text())
    steps = report["steps"]
    return {
        "run": name,
        "device": accelerator,
        "world": report["world"],
        "steps": steps,
        "gradient_per_step": report["gradient"] / steps,
        "rounds_per_step": report["gradient"] / steps / report["per_round"],
        "counts_per_step": report["package_counts"] / steps,
    }


# ---------------------------------------------------------------------- Fabric loops
def run_fabric(name: str) -> dict[str, Any]:
    """A Fabric loop on 2 CPU ranks: LitGPT's hand-written accumulation, or ``FabricAccumulator``."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy as FabricDDP
    from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel
    from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher as FabricLauncher

    strategy_name, mode = name.split(": ")
    shard = strategy_name == "Fabric FSDP2"

    class ForkedFabricFSDP2(FabricModelParallel):
        def __init__(self) -> None:
            super().__init__(parallelize_fn=_fully_shard, data_parallel_size=2, tensor_parallel_size=1)

        def _configure_launcher(self) -> None:
            self._launcher = FabricLauncher(self, start_method="fork")

    strategy: Any = ForkedFabricFSDP2() if shard else FabricDDP(start_method="fork", process_group_backend="gloo")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        Fabric(accelerator="cpu", devices=2, strategy=strategy).launch(_fabric_loop, mode, shard, out)
        report = json.loads(out.read_text())
    return {
        "run": name,
        "device": "cpu",
        "world": 2,
        "steps": report["steps"],
        "gradient_per_step": report["gradient"] / report["steps"],
        "rounds_per_step": report["gradient"] / report["steps"] / report["per_round"],
        "counts_per_step": report["package_counts"] / report["steps"],
    }


def _fully_shard(module: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in module:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(module, mesh=mesh["data_parallel"])
    return module


def _fabric_loop(fabric: Any, mode: str, shard: bool, out: Path) -> None:
    from lightning_accum.fabric import FabricAccumulator

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
    if shard:
        model = fabric.setup_module(net)
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.01))
    else:
        model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
        model._forward_module.register_comm_hook(None, _counting_ddp_hook)  # (DDP's reducer, through Python)
    data = [(torch.randn(BATCH, 32), torch.randn(BATCH, 1)) for _ in range(MICROBATCHES)]
    acc = None
    if mode.startswith("FabricAccumulator"):
        acc = FabricAccumulator(fabric, model, optimizer, K, sync="every" if "every" in mode else "auto", log=False)
    IN_BACKWARD[0] = True  # (every gradient collective of the loop counts; the package's counts apart)
    steps = 0
    for i, (x, y) in enumerate(data):
        if acc is not None:
            with acc.accumulate((x, y), last=i == len(data) - 1) as step:
                step.backward(nn.functional.mse_loss(model(x), y))
            steps = acc.progress.step
            continue
        accumulating = (i + 1) % K != 0  # LitGPT's `fit()`
        with fabric.no_backward_sync(model, enabled=accumulating):
            fabric.backward(nn.functional.mse_loss(model(x), y) / K)
        if not accumulating:
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    IN_BACKWARD[0] = False
    shards = [m for m in sync.fsdp2_modules(net) if any(True for _ in m.parameters(recurse=False))]
    if fabric.global_rank == 0:
        out.write_text(json.dumps({**COUNTS, "steps": steps, "per_round": len(shards) or 1}))


CPU_RUNS = [
    "DDP: built-in accumulate_grad_batches",
    "DDP: callback",
    "DDP: mixin",
    "FSDP2: built-in accumulate_grad_batches",
    "FSDP2: callback sync=auto",
    "FSDP2: callback sync=every",
    "FSDP2: mixin sync=auto",
]
FABRIC_RUNS = [
    "Fabric DDP: hand-written (LitGPT)",
    "Fabric DDP: FabricAccumulator",
    "Fabric FSDP2: hand-written (LitGPT)",
    "Fabric FSDP2: FabricAccumulator last=",
    "Fabric FSDP2: FabricAccumulator sync=every",
]
CUDA_RUNS = [
    "FSDP: built-in accumulate_grad_batches",
    "FSDP: callback sync=auto",
    "FSDP: callback sync=skip",
    "FSDP: mixin sync=auto",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=Path(__file__).with_name("comm_calls.json"))
    args = parser.parse_args()
    _install_counters()
    rows = [run(name, "cpu", 2) for name in CPU_RUNS] + [run_fabric(name) for name in FABRIC_RUNS]
    if torch.cuda.is_available():
        rows += [run(name, "gpu", min(2, torch.cuda.device_count())) for name in CUDA_RUNS]
    print(f"k = {K}, {MICROBATCHES} micro-batches per rank: gradient collectives per optimizer step", file=sys.stderr)
    print("| run | device | ranks | gradient collectives / step | rounds / step | count all-reduces / step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['run']} | {r['device']} | {r['world']} | {r['gradient_per_step']:g} | {r['rounds_per_step']:g} "
            f"| {r['counts_per_step']:g} |"
        )
    args.json.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
