"""The fuzzer's multi-process part: Fabric loops on 2 CPU processes (gloo), DDP or FSDP2
(``ModelParallelStrategy`` with ``fully_shard``), rank r taking the data's batches ``j * 2 + r``,
against the float64 reference on the union of the data (``Config.world``). The ranks are launched once
(spawned) for a list of configurations; each writes what it got. A checkpoint written inside a window
on the 2 ranks must then be refused on one process (``check_world``)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy
from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import fully_shard

from lightning_accum.fabric import FabricAccumulator

from . import fabric_runner
from .configs import Config
from .differences import differences
from .model import make_net
from .package import wide
from .reference import Result
from .reference import run as reference_run


def shard(module: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    for layer in module:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(module, mesh=mesh["data_parallel"])
    return module


class _SpawnLauncher(_MultiProcessingLauncher):
    """Spawned ranks that leave as a forked child does, without finalising their interpreter: a gloo
    worker thread still dropping a finished collective's tensors then aborts the rank after its work
    is done (SIGABRT, "terminate called without an active exception"; about 1 run in 8 here)."""

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy, start_method="spawn")

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)  # (rank 0 has handed its result back by now)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


class SpawnedDDP(DDPStrategy):
    """DDP on gloo, 2 spawned ranks."""

    def __init__(self) -> None:
        super().__init__(process_group_backend="gloo")

    def _configure_launcher(self) -> None:
        self._launcher = _SpawnLauncher(self)


class SpawnedFSDP2(ModelParallelStrategy):
    """FSDP2 over a 1-D data-parallel mesh of 2, spawned (Fabric launches it by re-running the script)."""

    def __init__(self) -> None:
        super().__init__(parallelize_fn=shard, data_parallel_size=2, tensor_parallel_size=1)

    def _configure_launcher(self) -> None:
        self._launcher = _SpawnLauncher(self)


def _encode(result: Result) -> dict[str, Any]:
    adam = None if result.adam is None else [{k: v.tolist() for k, v in s.items()} for s in result.adam]
    grads = None if result.grads is None else [[None if g is None else g.tolist() for g in step] for step in
                                                 result.grads]  # fmt: skip
    return {"params": [p.tolist() for p in result.params], "step": result.global_step, "lrs": result.lrs,
            "adam": adam, "grads": grads}  # fmt: skip


def _decode(report: dict[str, Any]) -> Result:
    params = [torch.tensor(p, dtype=torch.float64) for p in report["params"]]
    adam = report["adam"]
    if adam is not None:
        adam = [{k: torch.tensor(v, dtype=torch.float64) for k, v in s.items()} for s in adam]
    grads = report.get("grads")
    if grads is not None:  # (bf16 numbers: exact in float64)
        grads = [[None if g is None else torch.tensor(g, dtype=torch.float64) for g in step] for step in grads]
    return Result(params, report["step"], report["lrs"], adam, None, None, grads)


def _rank(fabric: Fabric, configs: list[str], out: str) -> None:
    """On each rank: every configuration's loop (an error is the configuration's result)."""
    warnings.simplefilter("ignore")
    reports = []
    for line in configs:
        c = Config.from_json(line)
        torch.set_default_dtype(fabric_runner.default_dtype(c))
        saved: list[Path] = []
        try:
            tmp = Path(fabric.broadcast(tempfile.mkdtemp(dir=out) if fabric.global_rank == 0 else None))
            result = fabric_runner.loop(c, lambda: fabric, tmp, saved)
            reports.append({**_encode(result), "saved": [str(p) for p in saved]})
        except Exception:
            reports.append({"raised": traceback.format_exc(limit=-3).strip().replace("\n", " | ")})
        fabric.barrier()
    (Path(out) / f"rank{fabric.global_rank}.json").write_text(json.dumps(reports))


def check_all(configs: list[Config]) -> list[list[str]]:
    """Each configuration's differences from the reference on both ranks (all of one strategy launched once)."""
    out: list[list[str]] = [[] for _ in configs]
    for strategy, precision in (("ddp", "64-true"), ("fsdp2", "32-true"), ("ddp", "bf16-true"), ("fsdp2", "bf16-true")):
        # (FSDP2 refuses "64-true": float64 anyway)
        chosen = [i for i, c in enumerate(configs) if c.strategy == strategy and c.bf16 == (precision == "bf16-true")]
        if not chosen:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            launched: Any = SpawnedFSDP2() if strategy == "fsdp2" else SpawnedDDP()
            fabric = Fabric(accelerator="cpu", devices=2, strategy=launched, precision=precision)  # type: ignore[arg-type]
            fabric.launch(_rank, [configs[i].to_json() for i in chosen], tmp)
            reports = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(2)]
            for position, i in enumerate(chosen):
                out[i] = _check(configs[i], [reports[r][position] for r in range(2)])
    return out


def _check(c: Config, reports: list[dict[str, Any]]) -> list[str]:
    refusal = c.refusal()
    if refusal is not None:  # (`grad_accum_dtype` under FSDP2: refused, naming what does the job there)
        bad = [r for r, report in enumerate(reports) if refusal not in report.get("raised", "")]
        return [f"rank {r} did not refuse it: {reports[r].get('raised', 'it ran')}" for r in bad]
    for r, report in enumerate(reports):
        if "raised" in report:
            return [f"rank {r} raised: {report['raised']}"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = reference_run(c, _decode(reports[0]))
    diffs = []
    for r, report in enumerate(reports):
        diffs += [f"rank {r}: {d}" for d in differences(want, _decode(report))]
    for path in reports[0]["saved"]:
        diffs += _refused_on_one_process(c, Path(path))
    return diffs


def _refused_on_one_process(c: Config, path: Path) -> list[str]:
    """A checkpoint the 2 ranks wrote inside a window, loaded on one process: must be refused."""
    fabric = Fabric(accelerator="cpu", devices=1, precision=c.precision)  # type: ignore[arg-type]
    net = make_net(c.seed)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    acc = FabricAccumulator(fabric, model, optimizer, **wide(c))
    state = torch.load(path, weights_only=False)
    if state["accumulation"]["window"] is None:  # (a block that did not step closed an empty window: no step)
        return []
    try:
        with warnings.catch_warnings():  # (its `lr_schedule` state, where the run had one: this one has none)
            warnings.simplefilter("ignore")
            acc.load_state_dict(state["accumulation"])
    except ValueError as error:
        if "cannot resume on 1" in str(error):
            return []
    return [f"the checkpoint {path.name}, written inside a window on 2 ranks, was not refused on one process"]


__all__ = ["check_all"]
