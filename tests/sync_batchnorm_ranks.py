"""``torch.nn.SyncBatchNorm`` itself under ``batchnorm="window"`` on 2 ranks: what the GPU suite runs on CUDA
(``tests/gpu/test_sync_batchnorm.py``) and ``tests/distributed/test_sync_batchnorm_cpu.py`` runs on CPU, one
script for both.

``python sync_batchnorm_ranks.py OUT DEVICE`` is one rank (``NODE_RANK`` set by ``launch``): a Lightning fit with
``Trainer(devices=1, num_nodes=2)`` over gloo (two processes on one machine, on one GPU for ``cuda``: gloo carries
CUDA tensors where NCCL refuses two ranks on one device), a net whose ``SyncBatchNorm`` normalises each micro-batch
with the statistics of both ranks' and is given a ``Linear``'s output (so that its backward synchronises too), and
``AccumulationScheduler(K, batchnorm="window")``. Each rank writes ``OUT/rank{r}.json``: its parameters and the
layer's buffers.

On CPU, torch's ``SyncBatchNorm`` refuses to synchronise (its forward takes CUDA, XPU, HPU inputs only) and its
kernels (``torch.batch_norm_stats``, ``batch_norm_gather_stats_with_counts``, ``batch_norm_elemt``,
``batch_norm_backward_reduce``, ``batch_norm_backward_elemt``) have no CPU implementation. ``cpu_kernels``
stands in for exactly those: the layer is a plain ``nn.SyncBatchNorm`` running torch's own forward and its autograd
function (``torch.nn.modules._functions.SyncBatchNorm``: the all-gather of every rank's count, mean and inverse
standard deviation, the running buffers written in place by the gather kernel, the backward's all-reduce), the
kernels written out in float64 from their CUDA definitions, and the device check told that the CPU is the
accelerator for the length of the layer's forward. What the package hooks (the buffers the gather kernel writes,
its momentum, ``num_batches_tracked``) is what torch's own code touches, as on a GPU.

``reference`` is the float64 loop of one process on the union: micro-batch i normalised over both ranks' i-th,
each rank's loss its own rows' mean squared error, the gradient their mean over ranks and the window's micro-batches
(DDP's average, ``normalize="mean"``), and the buffers updated once per window with the statistics of everything
the layer was given in it by both ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

WORLD, K, LR = 2, 3, 0.1
SIZES = ([4, 4, 4, 4, 4, 2], [3, 3, 3, 3, 3, 3])  # each rank's micro-batch sizes: two windows of 3, unequal
TIMEOUT = 300  # seconds a launch may take before it is killed (a hang fails the test instead of CI)


def data() -> tuple[list[list[Tensor]], list[list[Tensor]]]:
    """Per rank, its micro-batches' inputs and targets (float64)."""
    g = torch.Generator().manual_seed(0)
    xs = [[torch.randn(n, 2, generator=g, dtype=torch.float64) * 2 + 1 for n in sizes] for sizes in SIZES]
    ys = [[torch.randn(n, 1, generator=g, dtype=torch.float64) for n in sizes] for sizes in SIZES]
    return xs, ys


def make_net(norm: type[nn.Module] = nn.SyncBatchNorm) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 3), norm(3), nn.Tanh(), nn.Linear(3, 1)).double()  # type: ignore[call-arg]


def state(net: nn.Module) -> dict[str, list[Any]]:
    layer = net[1]
    buffers = [layer.running_mean, layer.running_var, layer.num_batches_tracked.double().view(1)]
    return {"params": [p.detach().cpu().tolist() for p in net.parameters()],
            "buffers": torch.cat([b.detach().cpu().double() for b in buffers]).tolist()}  # fmt: skip


def reference() -> dict[str, list[Any]]:
    """The float64 loop on the union of the ranks' micro-batches (see the module's docstring)."""
    xs, ys = data()
    net = make_net(nn.BatchNorm1d)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    lin, norm, rest = net[0], net[1], net[2:]
    for start in range(0, len(SIZES[0]), K):
        window = range(start, min(start + K, len(SIZES[0])))
        opt.zero_grad()
        given = []
        for i in window:
            h = lin(torch.cat([xs[r][i] for r in range(WORLD)]))
            given.append(h.detach())
            out = rest(nn.functional.batch_norm(h, None, None, norm.weight, norm.bias, training=True))
            rows = torch.split(out, [len(xs[r][i]) for r in range(WORLD)])
            loss = sum(nn.functional.mse_loss(rows[r], ys[r][i]) for r in range(WORLD)) / WORLD
            (loss / len(window)).backward()
        opt.step()
        with torch.no_grad():
            norm(torch.cat(given))  # (the window's one update: everything it was given, as one batch)
    return state(net)


# ---------------------------------------------------------------------- torch's CUDA kernels, on the CPU
def _channels(x: Tensor) -> Tensor:
    """(channels, everything else): what the kernels reduce over."""
    return x.transpose(0, 1).reshape(x.shape[1], -1)


def _shaped(v: Tensor, like: Tensor) -> Tensor:
    return v.view(1, -1, *([1] * (like.dim() - 2)))


def batch_norm_stats(input: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    v = _channels(input)
    return v.mean(1), torch.rsqrt(v.var(1, unbiased=False) + eps)


def batch_norm_gather_stats_with_counts(
    input: Tensor, mean_all: Tensor, invstd_all: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
    momentum: float, eps: float, counts: Tensor,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Every rank's (count, mean, inverse std) combined; the running buffers updated in place with the mean and
    the variance unbiased over the total count, as the CUDA kernel does."""
    n = counts.to(mean_all.dtype).view(-1, 1)
    total = n.sum()
    mean = (n * mean_all).sum(0) / total
    var = (n * (invstd_all.pow(-2) - eps + (mean_all - mean) ** 2)).sum(0) / total
    with torch.no_grad():
        if running_mean is not None:
            running_mean.copy_(momentum * mean + (1 - momentum) * running_mean)
        if running_var is not None:
            running_var.copy_(momentum * var * total / (total - 1) + (1 - momentum) * running_var)
    return mean, torch.rsqrt(var + eps)


def batch_norm_elemt(
    input: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, invstd: Tensor, eps: float
) -> Tensor:
    out = (input - _shaped(mean, input)) * _shaped(invstd, input)
    if weight is not None:
        out = out * _shaped(weight, input)
    return out if bias is None else out + _shaped(bias, input)


def batch_norm_backward_reduce(
    grad_output: Tensor, input: Tensor, mean: Tensor, invstd: Tensor, weight: Tensor | None,
    input_g: bool, weight_g: bool, bias_g: bool,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:  # fmt: skip
    dy, xmu = _channels(grad_output), _channels(input) - mean[:, None]
    sum_dy, sum_dy_xmu = dy.sum(1), (dy * xmu).sum(1)
    return sum_dy, sum_dy_xmu, sum_dy_xmu * invstd if weight_g else None, sum_dy if bias_g else None


def batch_norm_backward_elemt(
    grad_output: Tensor, input: Tensor, mean: Tensor, invstd: Tensor, weight: Tensor | None, sum_dy: Tensor,
    sum_dy_xmu: Tensor, count: Tensor,
) -> Tensor:  # fmt: skip
    """The input's gradient from the all-reduced sums (``count``: every rank's count)."""
    n = count.sum().to(input.dtype)
    scale = invstd if weight is None else invstd * weight
    centred = (input - _shaped(mean, input)) * _shaped(invstd**2 * sum_dy_xmu / n, input)
    return (grad_output - _shaped(sum_dy / n, input) - centred) * _shaped(scale, input)


KERNELS = (batch_norm_stats, batch_norm_gather_stats_with_counts, batch_norm_elemt, batch_norm_backward_reduce,
           batch_norm_backward_elemt)  # fmt: skip


@contextlib.contextmanager
def _cpu_counts_as_accelerator() -> Iterator[None]:
    """``SyncBatchNorm.forward`` synchronises inputs of the CUDA, XPU and HPU devices and of the private-use one:
    for the length of the forward the CPU is named that one."""
    named = torch._C._get_privateuse1_backend_name
    torch._C._get_privateuse1_backend_name = lambda: "cpu"
    try:
        yield
    finally:
        torch._C._get_privateuse1_backend_name = named


def cpu_kernels() -> None:
    """In this process (a rank): torch's SyncBatchNorm kernels on the CPU, and its forward's device check passed."""
    for kernel in KERNELS:
        setattr(torch, kernel.__name__, kernel)
    forward = nn.SyncBatchNorm.forward

    def synchronising(self: nn.SyncBatchNorm, input: Tensor) -> Tensor:
        with _cpu_counts_as_accelerator():
            return forward(self, input)

    nn.SyncBatchNorm.forward = synchronising  # type: ignore[method-assign]
    # (DDP refuses a SyncBatchNorm in a CPU module, which it could not run)
    nn.parallel.DistributedDataParallel._passing_sync_batchnorm_handle = lambda *a: None  # type: ignore[method-assign]


# ---------------------------------------------------------------------- one rank
def fit(out: Path, device: str) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_accum import AccumulationScheduler

    if device == "cpu":
        cpu_kernels()
    rank = int(os.environ["NODE_RANK"])
    xs, ys = data()

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net()

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=LR)

    model = Model()
    trainer = pl.Trainer(
        accelerator=device, devices=1, num_nodes=WORLD, strategy=DDPStrategy(process_group_backend="gloo"),
        callbacks=[AccumulationScheduler(K, batchnorm="window")], max_epochs=1, precision="64-true",
        use_distributed_sampler=False, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    batches = list(zip(xs[rank], ys[rank], strict=True))  # (each rank its own micro-batches, as they are)
    trainer.fit(model, torch.utils.data.DataLoader(batches, batch_size=None))
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(state(model.net)))


# ---------------------------------------------------------------------- the launch
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(out: Path, device: str) -> list[dict[str, list[Any]]]:
    """Both ranks, each its own process (as a node of one), started fresh (CUDA does not survive a fork); each
    must end with status 0 within ``TIMEOUT`` (killed otherwise). Returns their reports."""
    here = Path(__file__).parent
    keep = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in keep and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    import lightning_accum

    paths = [str(Path(lightning_accum.__file__).parents[1]), str(here), env.get("PYTHONPATH", "")]
    env.update(PYTHONPATH=os.pathsep.join(p for p in paths if p), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), LOCAL_RANK="0")  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, str(Path(__file__)), str(out), device], env={**env, "NODE_RANK": str(rank)},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )
        for rank in range(WORLD)
    ]  # fmt: skip
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
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def difference(report: dict[str, list[Any]], expected: dict[str, list[Any]]) -> float:
    """The largest difference of a rank's parameters and buffers from the reference's."""
    pairs = [(torch.tensor(a), torch.tensor(b)) for key in ("params", "buffers")
             for a, b in zip(report[key], expected[key], strict=True)]  # fmt: skip
    return max(float((a.double() - b.double()).abs().max()) for a, b in pairs)


if __name__ == "__main__":
    fit(Path(sys.argv[1]), sys.argv[2])
