"""The callback, the mixin and the Fabric helper under the launchers users start ranks with: ``torchrun
--nproc_per_node 2`` (Lightning's ``TorchElasticEnvironment``), SLURM's environment variables as ``srun``
sets them for 2 tasks (``SLURMEnvironment``), and ``num_nodes=2``: 2 "nodes" x 2 processes on localhost,
each node's script started with ``NODE_RANK`` and ``MASTER_ADDR`` set and starting its second rank itself
(``LightningEnvironment``, 4 gloo ranks).

Each launch is one process start per rank running ``launched_ranks.py``: every adapter's fit over the union of
the data equals the float64 single-process reference (``helpers.Reference``) to 1e-12, the fit resumed from
the checkpoint it saved inside a window equals it bit for bit (the callback on 4 ranks to 1e-12: DDP's reducer,
see ``check``), only global rank 0 wrote checkpoint files (each
node saves to its own directory: node 1's stays empty), and every rank of every node resumed from that file.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_accum

from helpers import Reference, max_diff, rank_batches

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
SCRIPT = HERE / "launched_ranks.py"
TIMEOUT = 300  # seconds a launch may take before it is killed (a hang fails the test instead of CI)
ADAPTERS = ("callback", "mixin", "fabric")
# what a launcher sets: a rank must see only what its launcher gave it (pytest may itself run under SLURM or torchrun)
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_in(low: int, high: int) -> int:
    for port in range(low + os.getpid() % 1000, high):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{low}, {high})")


def clean_environment(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCHER_VARIABLES and not k.startswith(("SLURM_", "TORCHELASTIC_", "PL_"))
    }
    paths = [str(Path(lightning_accum.__file__).parents[1]), str(HERE.parent), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["OMP_NUM_THREADS"] = "1"
    return {**env, **extra}


def launch(commands: Sequence[tuple[Sequence[str], dict[str, str]]]) -> None:
    """Start every command (each in its own process group, with what it starts), wait for all; each must end
    with status 0 within ``TIMEOUT`` (killed otherwise)."""
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        for cmd, env in commands
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=TIMEOUT)[0].decode(errors="replace"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output[-6000:]


def check(out: Path, world: int, nodes: int, environment: str) -> None:
    from launched_ranks import BATCH, DATA, EPOCHS, SCHEDULE

    expected, _ = Reference(SCHEDULE, normalize="items").run([rank_batches(DATA, BATCH, world=world)] * EPOCHS)
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    for rank, report in enumerate(reports):
        assert report["ranks"] == [rank, rank % 2, rank // 2, world]  # (global, local, node, world size)
        assert report["trainer_environment"] == report["fabric_environment"] == environment
        # rank 0 alone wrote: node 0's directory holds every checkpoint, any other node's none
        assert report["saved"] == {f"node{n}": [] if n else ["callback.ckpt", "fabric.ckpt", "mixin.ckpt"]
                                   for n in range(nodes)}  # fmt: skip
        for adapter in ADAPTERS:
            full = [torch.tensor(p, dtype=torch.float64) for p in report[adapter]]
            resumed = [torch.tensor(p, dtype=torch.float64) for p in report[f"{adapter} resumed"]]
            assert max_diff(full, expected) <= 1e-12, (rank, adapter)
            if adapter == "callback" and world > 2:
                # DDP's reducer sums the callback's gradients: a freshly wrapped model's first synced step fills its
                # bucket in another order, and gloo adds more than 2 ranks' values in an order that follows the
                # position (plain Lightning without the package, resumed at a step on these 4 ranks: 1.1e-15 off)
                assert max_diff(resumed, full) <= 1e-12, (rank, adapter)
            else:  # 2 ranks (a + b is b + a), or the package's own all-reduce over a fixed order: to the bit
                assert all(torch.equal(a, b) for a, b in zip(resumed, full, strict=True)), (rank, adapter)


def test_torchrun(tmp_path: Path) -> None:
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1"]
    run += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    launch([([*run, str(SCRIPT), str(tmp_path), "1"], clean_environment())])
    check(tmp_path, world=2, nodes=1, environment="TorchElasticEnvironment")


def test_slurm_two_tasks(tmp_path: Path) -> None:
    """What ``srun --ntasks-per-node=2 python launched_ranks.py`` sets in each task (one node). Lightning takes
    the main port from the job id (its last 4 digits + 15000) when ``MASTER_PORT`` is unset: the job id here
    makes that a free port, and the main address comes from the node list."""
    port = free_port_in(15000, 25000)
    common: dict[str, Any] = dict(
        SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="1", SLURM_NODEID="0", SLURM_JOB_NAME="launched",
        SLURM_JOB_ID=f"9{port - 15000:04d}", SLURM_NODELIST="127.0.0.1",
    )  # fmt: skip
    tasks = [clean_environment(SLURM_PROCID=str(r), SLURM_LOCALID=str(r), **common) for r in range(2)]
    launch([([sys.executable, str(SCRIPT), str(tmp_path), "1"], env) for env in tasks])
    check(tmp_path, world=2, nodes=1, environment="SLURMEnvironment")


def test_two_nodes_of_two_processes(tmp_path: Path) -> None:
    """``Trainer(num_nodes=2, devices=2)`` / ``Fabric(num_nodes=2, devices=2)``: the script started once per node,
    as on a cluster without a manager; Lightning starts each node's second rank."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    commands = [
        ([sys.executable, str(SCRIPT), str(tmp_path), "2"], clean_environment(NODE_RANK=str(n), **env))
        for n in range(2)
    ]
    launch(commands)
    check(tmp_path, world=4, nodes=2, environment="LightningEnvironment")
