"""Shared test fixtures: a tiny float64 token model, its data, and a plain-PyTorch reference.

The reference forms the accumulation windows by hand, from the schedule and the batch
sequence, and takes one joint backward of the window's normalised loss: nothing in it
shares code with the package except the schedule objects (which have their own tests).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import multiprocessing
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.strategies.launchers.multiprocessing import _disable_module_memory_sharing
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader, Dataset

from lightning_accum import AccumulationMixin, Progress, Schedule

Batch = dict[str, Tensor]


HOST_READS = {  # the Tensor methods that read a value to the host (a device sync on a GPU)
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.numpy,
}


class HostReads(TorchFunctionMode):
    """Counts the reads of tensor values into Python (``HOST_READS``) while entered."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += func in HOST_READS
        return func(*args, **(kwargs or {}))


class TokenData(Dataset[Batch]):
    """Variable-length sequences of ``d``-dim tokens with per-token targets, padded to ``T``."""

    def __init__(self, n: int, d: int = 3, T: int = 5, seed: int = 0, ragged: bool = True) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, T, d, generator=g, dtype=torch.float64)
        self.y = torch.randn(n, T, 1, generator=g, dtype=torch.float64)
        lengths = torch.randint(1, T + 1, (n,), generator=g) if ragged else torch.full((n,), T)
        self.mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Batch:
        return {"x": self.x[i], "y": self.y[i], "mask": self.mask[i]}

    def batch(self, index: Sequence[int] | slice) -> Batch:
        return {"x": self.x[index], "y": self.y[index], "mask": self.mask[index]}


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Torch's default dtype set to ``dtype`` inside (Lightning's logged values and Fabric's "64-true"
    outputs take the default dtype: float64 lets tests compare them at 1e-12)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def count_tokens(batch: Batch) -> Tensor:
    return batch["mask"].sum()


def make_net(d: int = 3, hidden: int = 8, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, hidden), nn.Tanh(), nn.Linear(hidden, 1)).double()


def token_losses(net: nn.Module, batch: Batch) -> tuple[Tensor, Tensor]:
    """(sum of masked squared errors, number of tokens) of one micro-batch."""
    err = (net(batch["x"]) - batch["y"]).squeeze(-1) ** 2
    return (err * batch["mask"]).sum(), batch["mask"].sum()


class TokenModel(pl.LightningModule):
    """``reduction="mean"``: per-micro-batch token mean; ``"sum"``: token sum (for ``normalize="items"``)."""

    def __init__(
        self,
        reduction: str = "mean",
        lr: float = 0.1,
        optimizer: str = "sgd",
        scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
        scheduler_frequency: int = 1,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.net = make_net(seed=seed)
        self.reduction = reduction
        self.lr = lr
        self.optimizer_name = optimizer
        self.scheduler = scheduler
        self.scheduler_frequency = scheduler_frequency

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        total, tokens = token_losses(self.net, batch)
        return total if self.reduction == "sum" else total / tokens

    def configure_optimizers(self) -> Any:
        return optimizer_config(self)


def optimizer_config(module: Any) -> Any:
    """The optimizer (and step-interval scheduler) a test model asked for."""
    opt = make_optimizer(module.optimizer_name, module.net.parameters(), module.lr)
    if module.scheduler is None:
        return opt
    config = {"scheduler": module.scheduler(opt), "interval": "step", "frequency": module.scheduler_frequency}
    return {"optimizer": opt, "lr_scheduler": config}


def make_optimizer(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "plain-sgd":
        return torch.optim.SGD(params, lr=lr)
    return torch.optim.Adam(params, lr=lr)


def loader(data: TokenData, batch_size: int, sharded: bool = False) -> DataLoader[Batch]:
    """In order; ``sharded``: each rank takes every world-th sample from its rank on (Lightning's
    own distributed sampler always shuffles training data, so tests shard by hand)."""
    sampler = RankStrided(len(data)) if sharded else None
    return DataLoader(data, batch_size=batch_size, shuffle=False, sampler=sampler)


class RankStrided(torch.utils.data.Sampler[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def _rank_world(self) -> tuple[int, int]:
        dist = torch.distributed
        return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)

    def __iter__(self):  # type: ignore[no-untyped-def]
        rank, world = self._rank_world()
        return iter(range(rank, self.n, world))

    def __len__(self) -> int:
        rank, world = self._rank_world()
        return len(range(rank, self.n, world))


def trainer(**kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_epochs=2,
        precision="64-true",
    )
    defaults.update(kwargs)
    return pl.Trainer(**defaults)


def rank_batches(data: TokenData, batch_size: int, world: int = 1) -> list[list[Batch]]:
    """Per rank, the batches Lightning's DistributedSampler(shuffle=False) gives (len(data) % world == 0)."""
    assert len(data) % world == 0
    out = []
    for r in range(world):
        index = list(range(r, len(data), world))
        out.append([data.batch(index[i : i + batch_size]) for i in range(0, len(index), batch_size)])
    return out


@dataclasses.dataclass
class Reference:
    """A plain float64 loop over hand-made windows; returns final parameters and window sizes."""

    schedule: Schedule
    normalize: str = "mean"
    lr: float = 0.1
    optimizer: str = "sgd"
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    scheduler_frequency: int = 1
    clip: float | None = None
    lr_scaling: str | None = None
    seed: int = 0
    short_window: str = "own"  # "own": divide by its real size; "full": by k, as Lightning's built-in
    decay: tuple[float, str, bool] | None = None  # (factor, "sum" | "ema", bias_correction)
    skipped: tuple[int, ...] = ()  # windows (0-based, over the run) whose step AMP skips (inf/nan): no update
    after_step: Callable[[nn.Module], None] | None = None  # called after each window's step (and schedulers')
    # filled by `run`: each window's normalised loss and the norm of its gradient before decay and clipping
    losses: list[float] = dataclasses.field(default_factory=list)
    grad_norms: list[float] = dataclasses.field(default_factory=list)

    def run(self, epochs: list[list[list[Batch]]]) -> tuple[list[Tensor], list[int]]:
        net = make_net(seed=self.seed)
        opt = make_optimizer(self.optimizer, net.parameters(), self.lr)
        sched = self.scheduler(opt) if self.scheduler else None
        progress, sizes, first_k = Progress(), [], None
        residual: list[Tensor] | None = None
        for epoch, ranks in enumerate(epochs):
            n, world, i = len(ranks[0]), len(ranks), 0
            while i < n:
                k = self.schedule(dataclasses.replace(progress, epoch=epoch))
                first_k = first_k or k
                window = [rank[i : i + k] for rank in ranks]
                m = len(window[0])
                sizes.append(m)
                tokens = sum(float(b["mask"].sum()) for rank in window for b in rank)
                loss = torch.zeros((), dtype=torch.float64)
                for rank in window:
                    for b in rank:
                        total, tok = token_losses(net, b)
                        if self.normalize == "items":
                            loss = loss + total / tokens
                        else:
                            loss = loss + total / tok / ((m if self.short_window == "own" else k) * world)
                opt.zero_grad()
                loss.backward()
                self.losses.append(float(loss.detach()))
                self.grad_norms.append(float(torch.cat([p.grad.flatten() for p in net.parameters()]).norm()))
                if self.decay is not None:
                    f, mode, bias = self.decay
                    for j, p in enumerate(net.parameters()):
                        g = p.grad if mode == "sum" else (1 - f) * p.grad
                        p.grad = g if residual is None else g + f * residual[j]
                        if bias:
                            p.grad = p.grad / (1 - f ** (progress.step + 1))
                if self.clip is not None:
                    nn.utils.clip_grad_norm_(net.parameters(), self.clip)
                saved = [g["lr"] for g in opt.param_groups]
                if self.lr_scaling is not None:
                    ratio = k / first_k
                    for g in opt.param_groups:
                        g["lr"] *= ratio if self.lr_scaling == "linear" else math.sqrt(ratio)
                if progress.step not in self.skipped:
                    opt.step()
                if self.decay is not None and progress.step not in self.skipped:
                    f, _, bias = self.decay
                    correction = 1 - f ** (progress.step + 1) if bias else 1.0
                    residual = [p.grad.clone() * correction for p in net.parameters()]
                for g, lr in zip(opt.param_groups, saved, strict=True):
                    g["lr"] = lr
                progress = Progress(
                    epoch=epoch,
                    step=progress.step + 1,
                    samples=progress.samples + sum(len(b["x"]) for rank in window for b in rank),
                    items=progress.items + int(tokens),
                    microbatches=progress.microbatches + m,
                )
                if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
                    sched.step(self.losses[-1])  # (watching the window's loss)
                elif sched is not None and progress.step % self.scheduler_frequency == 0:
                    sched.step()
                if self.after_step is not None:
                    self.after_step(net)
                i += m
        return [p.detach().clone() for p in net.parameters()], sizes


def params_of(module: pl.LightningModule) -> list[Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def max_diff(a: Sequence[Tensor], b: Sequence[Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


class KRecorder(pl.Callback):
    """Records the number of micro-batches between optimizer steps, as Lightning ran them."""

    def __init__(self) -> None:
        self.windows: list[int] = []
        self._n = 0

    def on_before_backward(self, *args: Any) -> None:
        self._n += 1

    def on_before_optimizer_step(self, *args: Any) -> None:
        self.windows.append(self._n)
        self._n = 0


class ResumableLoader(DataLoader[Batch]):
    """A DataLoader that resumes mid-epoch (Lightning saves and restores its state), for
    exact-resume tests: on resume it skips the batches the interrupted epoch had yielded."""

    def __init__(self, data: TokenData, batch_size: int) -> None:
        super().__init__(data, batch_size=batch_size, shuffle=False)
        self._yielded, self._skip = 0, 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        skip, self._skip = self._skip, 0
        self._yielded = skip
        for i, batch in enumerate(super().__iter__()):
            if i >= skip:
                self._yielded += 1
                yield batch

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self._yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._skip = state["consumed"] if state["consumed"] < len(self) else 0  # a finished epoch starts anew


class ManualTokenModel(AccumulationMixin, pl.LightningModule):
    """TokenModel's loss, back-propagated through the mixin in one of several equivalent ways.

    ``mode``: ``"backward"`` (one pass), ``"items_arg"`` (a token-mean loss with ``items=``),
    ``"each"`` (the tokens split in two tasks, each with its own forward), ``"heads"`` (the
    net's first layers as a shared trunk, the last layer applied by two heads on the split).
    Every mode yields the same gradient as ``"backward"``. ``reduction`` is what the loss is over a
    micro-batch's tokens, and with ``normalize="items"`` and ``count`` also the mixin's ``reduction``.
    """

    def __init__(
        self,
        mode: str = "backward",
        reduction: str = "mean",
        lr: float = 0.1,
        optimizer: str = "sgd",
        scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
        scheduler_frequency: int = 1,
        **accumulation: Any,
    ) -> None:
        super().__init__()
        self.net = make_net()
        self.mode, self.reduction = mode, reduction
        self.lr, self.optimizer_name = lr, optimizer
        self.scheduler, self.scheduler_frequency = scheduler, scheduler_frequency
        if accumulation.get("normalize") == "items" and accumulation.get("count") is not None:
            accumulation["reduction"] = reduction
        self.configure_accumulation(**accumulation)

    def _split_losses(self, out: Tensor, batch: Batch) -> list[Tensor]:
        err = (out - batch["y"]).squeeze(-1) ** 2 * batch["mask"]
        norm = 1.0 if self.reduction == "sum" else batch["mask"].sum()
        return [err[:, :2].sum() / norm, err[:, 2:].sum() / norm]

    def training_step(self, batch: Batch, batch_idx: int) -> None:
        with self.accumulate(batch) as acc:
            if self.mode == "backward":
                total, tokens = token_losses(self.net, batch)
                acc.backward(total if self.reduction == "sum" else total / tokens)
            elif self.mode == "items_arg":
                total, tokens = token_losses(self.net, batch)
                acc.backward(total / tokens, items=tokens)
            elif self.mode == "each":
                acc.backward_each([lambda i=i: self._split_losses(self.net(batch["x"]), batch)[i] for i in (0, 1)])
            else:
                trunk, last = self.net[:2], self.net[2]
                heads = [lambda f, i=i: self._split_losses(last(f), batch)[i] for i in (0, 1)]
                acc.backward_heads(trunk(batch["x"]), heads)

    def configure_optimizers(self) -> Any:
        return optimizer_config(self)


class Float32TokenModel(TokenModel):
    """TokenModel in float32 (for mixed precision); ``inf_at=(epoch, batch_idx)`` makes that
    micro-batch's loss infinite, so that a GradScaler skips its window's step."""

    def __init__(self, inf_at: tuple[int, int] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.net.float()
        self.inf_at = inf_at

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss = super().training_step({k: v.float() for k, v in batch.items()}, batch_idx)
        return loss * float("inf") if (self.current_epoch, batch_idx) == self.inf_at else loss


class Float32ManualTokenModel(ManualTokenModel):
    """ManualTokenModel in float32, with ``inf_at`` as in :class:`Float32TokenModel`."""

    def __init__(self, inf_at: tuple[int, int] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.net.float()
        self.inf_at = inf_at

    def training_step(self, batch: Batch, batch_idx: int) -> None:
        batch = {k: v.float() for k, v in batch.items()}
        if (self.current_epoch, batch_idx) == self.inf_at:
            batch["y"] = batch["y"] * float("inf")
        super().training_step(batch, batch_idx)


class ChildLauncher(_MultiProcessingLauncher):
    """Fork the ranks (or start them from the fork server, or spawn them): strategies that Lightning
    launches by re-running the script would re-run pytest. The ranks report through files; nothing
    is loaded back here. A module's tensors pickled to a fork-server rank are copied out of the shared
    memory torch puts them in, as Lightning does for spawned ranks only (else every rank steps the same
    parameters: ZeRO stage 0 ended 0.05 off the reference). Each rank leaves as a forked child does,
    without finalising its interpreter: otherwise a gloo or DeepSpeed thread still holding a finished
    collective's tensors can abort it after its work is done (SIGABRT, "terminate called without an
    active exception")."""

    def _recover_results_in_main_process(self, worker_output: Any, trainer: Any) -> None:
        pass

    def _wrapping_function(self, idx: int, trainer: Any, function: Any, args: Any, kwargs: Any, *rest: Any) -> None:
        if self._start_method == "forkserver":  # (pickled as for "spawn", where Lightning unshares them)
            args, kwargs = _disable_module_memory_sharing((args, kwargs))
        super()._wrapping_function(idx, trainer, function, args, kwargs, *rest)  # (rank 0's result is handed back)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def warm_processes() -> Any:
    """The fork-server context: fresh processes forked from one server that imported what the tests' children
    need and ran nothing (a session has one server, whichever test starts it: so one preload list)."""
    multiprocessing.set_forkserver_preload(["helpers", "deepspeed", "lightning.pytorch"])
    return multiprocessing.get_context("forkserver")


class CPUDeepSpeed(DeepSpeedStrategy):
    """Lightning's DeepSpeed strategy with its CUDA-only checks lifted (test-only: private
    overrides), so that DeepSpeed's engine runs on its CPU accelerator with gloo. The ranks are
    fresh processes: forked DeepSpeed ranks hang in their first parallel kernel once the parent has
    used its OpenMP pool, and DeepSpeed keeps process-wide state that a second run in one process
    cannot re-initialise. They are forked from a fork server that imported DeepSpeed and Lightning
    once and ran nothing (about 1.3 s a fit against 7 s spawned)."""

    def _configure_launcher(self) -> None:
        warm_processes()
        self._launcher = ChildLauncher(self, start_method="forkserver")

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # skips DeepSpeedStrategy's "CUDA only" check

    def setup_distributed(self) -> None:
        import deepspeed.comm.torch

        # DeepSpeed would JIT-compile a shared-memory all-reduce for CPUs; plain gloo is enough here
        deepspeed.comm.torch.build_shm_op = lambda: None
        reset_seed()  # as DeepSpeedStrategy, without its CUDA device-index validation
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu", self.local_rank)  # DeepSpeed wants a device index


def deepspeed_config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,  # the test models' torch SGD
        "gradient_clipping": 0.0,
    }


class FileReport(pl.Callback):
    """For runs in forked ranks: each rank writes its parameters, the accumulation progress and
    the DeepSpeed engine's step count to ``out/rank{r}.json``; ``out/started`` marks a first batch."""

    def __init__(self, out: Any, accumulation: Any = None) -> None:
        self.out, self.accumulation = out, accumulation

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        (self.out / "started").touch()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        report = {
            "params": [p.detach().double().tolist() for p in pl_module.parameters()],
            "progress": None if self.accumulation is None else dataclasses.asdict(self.accumulation.progress),
            "engine_steps": getattr(trainer.strategy.model, "global_steps", None),
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))

    def read(self, world: int = 1) -> list[dict[str, Any]]:
        reports = [json.loads((self.out / f"rank{r}.json").read_text()) for r in range(world)]
        for report in reports:
            report["params"] = [torch.tensor(p, dtype=torch.float64) for p in report["params"]]
        return reports


def windows_over(*optimizers: torch.optim.Optimizer, **config: Any) -> Any:
    """The mixin's window groups over ``optimizers`` (Lightning's wrappers stood in for, no module or Trainer),
    configured with ``AccumulationConfig(**config)`` (``schedule``: an int or a schedule, 1 unless given)."""
    from types import SimpleNamespace

    from lightning_accum._core.options import AccumulationConfig
    from lightning_accum._trainer.windows import MixinWindows
    from lightning_accum.schedules import as_schedule

    wrapped = [SimpleNamespace(optimizer=o) for o in optimizers]
    windows = MixinWindows(SimpleNamespace(optimizers=lambda: wrapped))
    windows.configure(AccumulationConfig(schedule=as_schedule(config.pop("schedule", 1)), **config))
    return windows
