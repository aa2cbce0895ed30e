"""Fit-start checks of ``AccumulationScheduler``: configurations that cannot work, refused before
any batch with a message that names the cause and the fix."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lightning_accum import _seam
from lightning_accum._core import collectives, sync
from lightning_accum._lightning import gradient_accumulation_schedulers
from lightning_accum.schedules import Budget


def refuse_scheduler_misuse(callback: Any, trainer: Any, pl_module: Any, decay_type: type) -> None:
    """A mixin model, manual optimization, ``Trainer(accumulate_grad_batches)``, a second
    accumulation callback beside ``callback`` (an ``AccumulationScheduler``), a ``decay_type``
    callback (``GradientDecay``) before it, or DeepSpeed with what it cannot do."""
    if hasattr(pl_module, "configure_accumulation"):
        raise RuntimeError(
            f"`{type(pl_module).__name__}` uses `AccumulationMixin`, which accumulates by itself in manual "
            "optimization: remove the `AccumulationScheduler` callback and configure the windows with "
            "`self.configure_accumulation(...)`."
        )
    if not pl_module.automatic_optimization:
        raise RuntimeError(
            "`AccumulationScheduler` drives Lightning's automatic optimization, but this module sets "
            "`automatic_optimization = False`. For manual optimization use `lightning_accum.AccumulationMixin` "
            "and `self.configure_accumulation(...)` instead of the callback."
        )
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"`Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches})` and `AccumulationScheduler` "
            "both set the accumulation: remove `accumulate_grad_batches` from the Trainer and give the "
            f"callback the schedule, e.g. `AccumulationScheduler({trainer.accumulate_grad_batches})`."
        )
    others = [
        type(cb).__name__
        for cb in trainer.callbacks  # type: ignore[attr-defined]
        if cb is not callback and isinstance(cb, (type(callback), *gradient_accumulation_schedulers()))
    ]
    if others:
        raise ValueError(
            f"Only one accumulation callback can drive the Trainer; found {', '.join(others)} besides this "
            "`AccumulationScheduler`. Keep one (a dict schedule replaces `GradientAccumulationScheduler`)."
        )
    callbacks = trainer.callbacks  # type: ignore[attr-defined]
    mine = next((i for i, cb in enumerate(callbacks) if cb is callback), len(callbacks))
    if any(isinstance(cb, decay_type) for cb in callbacks[:mine]):
        raise ValueError(
            "`GradientDecay` must come after `AccumulationScheduler` in `callbacks`, so that it adds the "
            "residual to the normalised window gradient: e.g. `callbacks=[AccumulationScheduler(...), "
            "GradientDecay(...)]`."
        )
    if isinstance(callback.schedule, Budget) and sync.is_deepspeed(trainer.strategy):
        raise RuntimeError(
            f"`AccumulationScheduler({callback.schedule!r})` cannot run under `{type(trainer.strategy).__name__}`: "
            "DeepSpeed's engine fixes its `gradient_accumulation_steps` when it is made and steps at its own "
            "boundaries, while a budget closes each window where its count is reached. Use a schedule of k "
            "(`Constant`, `Ramp`, ...) under DeepSpeed, or DDP, FSDP or FSDP2 with the budget."
        )
    if callback.normalize == "items":
        sync.refuse_deepspeed(trainer.strategy, "AccumulationScheduler", "(normalize='items')")
    for name in ("lr_scaling", "lr_schedule"):  # (the LR is scaled for a window's step, which DeepSpeed takes itself)
        if getattr(callback, name) is not None:
            sync.refuse_deepspeed(trainer.strategy, "AccumulationScheduler", f"({name}={getattr(callback, name)!r})")


def refuse_split_misuse(size: object, trainer: Any, pl_module: Any, plan: sync.SyncPlan) -> None:
    """``AccumulationScheduler(microbatch_size=size)`` where its pieces cannot be exact: DeepSpeed, Lightning's
    FSDP, ``"auto"`` where ranks must cut alike (FSDP2, ``SyncBatchNorm``), a DDP communication hook."""
    if size is None:
        return
    name = f"`AccumulationScheduler(microbatch_size={size!r})`"
    if plan.family == "deepspeed":
        raise RuntimeError(
            f"{name} cannot run under DeepSpeed: its engine owns the backward pass (`engine.backward`, its own "
            "loss scaling and gradient buffers), while each piece of a loader batch needs a backward pass of its "
            "own inside `training_step`. Use DDP, FSDP2 (`ModelParallelStrategy`) or a single device, or DeepSpeed's "
            "`train_micro_batch_size_per_gpu` with a smaller loader batch."
        )
    if plan.family == "fsdp":
        raise RuntimeError(
            f"{name} cannot run under Lightning's `FSDPStrategy`: Lightning runs `training_step` inside the FSDP root "
            "module's forward, where a piece's backward pass cannot run. Use FSDP2 (`ModelParallelStrategy` with "
            "`fully_shard` in `configure_model`), which the pieces support."
        )
    world = collectives.world_size(trainer.strategy)
    if size == "auto" and plan.family == "fsdp2":
        raise RuntimeError(
            f"{name} cannot run under FSDP2: each piece's forward all-gathers the parameters with every rank, so "
            "the ranks must cut their batches into the same pieces, and a rank backing off alone would hang "
            "them. Give an int `microbatch_size` that fits every rank."
        )
    if size == "auto" and world > 1 and any(isinstance(m, nn.SyncBatchNorm) for m in pl_module.modules()):
        raise RuntimeError(
            f"{name} cannot run with `SyncBatchNorm` on {world} ranks: its forward synchronises with every rank, so "
            "the ranks must cut their batches into the same pieces, and a rank backing off alone would hang them. "
            "Give an int `microbatch_size`, or use plain BatchNorm."
        )
    if plan.family == "ddp" and _seam.ddp_comm_hook(trainer.strategy) is not None:
        raise RuntimeError(
            f"{name} runs every backward pass without DDP's sync and all-reduces the window's gradient once itself, "
            "so DDP's communication hook (`DDPStrategy(ddp_comm_hook=...)`) would not apply: remove the hook, or "
            "leave `microbatch_size` out."
        )


def refuse_uneven_budget_data(trainer: Any, schedule: object, owner: str) -> None:
    """Under a ``Budget`` on several ranks, at the fit's start: every rank raises where the ranks' training loaders
    hold different numbers of batches. A rank whose data runs out first would end its epoch while the others wait in
    the budget's count of their next micro-batch (till the process group's timeout, or a collective of another kind
    answers it). One all-gather of one integer per fit; loaders without a length are not checked."""
    if not isinstance(schedule, Budget) or collectives.world_size(trainer.strategy) == 1:
        return
    batches = trainer.num_training_batches
    mine = torch.tensor([-1 if math.isinf(batches) else int(batches)], device=trainer.strategy.root_device)
    ranks = [int(n) for n in trainer.strategy.all_gather(mine).reshape(-1).tolist()]
    if len(set(ranks)) == 1 or min(ranks) < 0:
        return
    raise RuntimeError(
        f"`{owner}({schedule!r})` needs every rank to run the same number of micro-batches each epoch, but the ranks' "
        f"training loaders hold {ranks} batches (ranks 0..{len(ranks) - 1}): the budget's count is summed over the "
        "ranks at every micro-batch, and a rank whose data ran out first would leave the others waiting in it. Give "
        "every rank as many batches (e.g. `DistributedSampler(drop_last=True)`, equal shards), or "
        f"`Trainer(limit_train_batches={min(ranks)})`."
    )
