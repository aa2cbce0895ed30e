"""``FabricAccumulator``'s misuse, refused where it happens: when it is made, the Fabric, model and
optimizer it is given and the strategies it is proved on (one device, DDP, FSDP2 over a data-parallel
mesh; any other is refused, naming it and the reason, before anything runs); inside an ``accumulate``
block, the calls that would go around the window."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from lightning_accum.sync import SyncMode, SyncPlan, fsdp2_modules, plan_for


def _classes(obj: Any) -> set[str]:
    return {cls.__name__ for cls in type(obj).__mro__}


def check_set_up(fabric: Any, model: Any, optimizer: Any) -> None:
    """``fabric`` a Fabric, ``model`` and ``optimizer`` what its ``setup`` returned (of either namespace,
    ``lightning.fabric`` or ``lightning_fabric``; a compiled module too), or an error naming the argument."""
    if "Fabric" not in _classes(fabric):
        raise TypeError(
            f"`fabric` must be the `lightning.fabric.Fabric` that set up `model` and `optimizer`; got {fabric!r}."
        )

    def kind(obj: Any) -> str:
        names = _classes(getattr(obj, "_orig_mod", obj)) | _classes(obj)  # (`torch.compile` wraps the module)
        return "module" if "_FabricModule" in names else "optimizer" if "_FabricOptimizer" in names else "plain"

    if kind(model) == "optimizer" and kind(optimizer) == "module":
        raise TypeError(
            "`model` and `optimizer` are swapped: give `FabricAccumulator(fabric, model, optimizer, ...)`, in the "
            "order `fabric.setup(model, optimizer)` returns them."
        )
    for name, obj, want in (("model", model, "module"), ("optimizer", optimizer, "optimizer")):
        if kind(obj) != want:
            raise TypeError(
                f"`{name}` must be the {want} `fabric.setup(...)` returned (got a plain {type(obj).__name__}): "
                "the accumulator skips its gradient sync and steps it through Fabric."
            )


def sync_plan(fabric: Any, model: Any, mode: SyncMode) -> SyncPlan:
    """How the windows make the gradient global under ``fabric.strategy``; a strategy the adapter is not
    proved on is refused, naming it and the reason."""
    strategy = fabric.strategy
    names = _classes(strategy)
    name = type(strategy).__name__
    if "DeepSpeedStrategy" in names:
        raise ValueError(
            f"`FabricAccumulator` cannot run under `{name}`: DeepSpeed accumulates and steps by itself (its "
            "`gradient_accumulation_steps`) and keeps the gradient in its own buffers. Use DDP or FSDP2 "
            "(`ModelParallelStrategy`), or DeepSpeed's own accumulation."
        )
    if any("XLA" in n for n in names):
        raise ValueError(f"`FabricAccumulator` is not proved on `{name}` (XLA): use a CUDA or CPU strategy.")
    if "ModelParallelStrategy" in names:
        tensor_parallel = strategy.device_mesh["tensor_parallel"].size()
        if tensor_parallel != 1:
            raise ValueError(
                f"`FabricAccumulator` under `{name}` is proved for FSDP2 over a data-parallel mesh only, but this one "
                f"has tensor_parallel_size={tensor_parallel}: its ranks would count the same samples. Give "
                "`ModelParallelStrategy(parallelize_fn, data_parallel_size=N, tensor_parallel_size=1)`."
            )
        if not fsdp2_modules(getattr(getattr(model, "_orig_mod", model), "module", model)):
            raise ValueError(
                f"`FabricAccumulator` under `{name}` needs the model sharded with FSDP2 (`fully_shard` in the "
                "strategy's `parallelize_fn`): without it the ranks' gradients are never made global."
            )
        return plan_for("fsdp2", mode)
    if "DDPStrategy" in names:
        return plan_for("ddp", mode)
    if "SingleDeviceStrategy" in names:
        return plan_for("single", mode)
    raise ValueError(
        f"`FabricAccumulator` is not proved on `{name}`, so it refuses to run there rather than risk a wrong "
        "gradient. It runs on one device, DDP and FSDP2 (`ModelParallelStrategy`); FSDP (1) needs CUDA, on which "
        "it is not tested yet: use FSDP2 instead."
    )


_MISSING = object()


@contextlib.contextmanager
def guarded_block(fabric: Any, optimizer: Any) -> Iterator[None]:
    """While a block is open, ``fabric.backward`` and the optimizer's ``step`` and ``zero_grad`` refuse: each
    would go around the window (an unweighted gradient, a step or a reset in the middle of a window). The
    instances' own attributes are set for the block and taken back after it (a few microseconds a block)."""
    refusals = (
        (fabric, "backward", "`fabric.backward(loss)`", "call `step.backward(loss)`, which weights the loss"),
        (optimizer, "step", "`optimizer.step()`", "the accumulator steps when the window's last block exits"),
        (optimizer, "zero_grad", "`optimizer.zero_grad()`", "the accumulator resets after each step"),
    )
    saved = [(obj, name, vars(obj).get(name, _MISSING)) for obj, name, _, _ in refusals]
    for obj, name, what, fix in refusals:
        setattr(obj, name, _refusal(what, fix))
    try:
        yield
    finally:
        for obj, name, before in saved:
            if before is _MISSING:
                vars(obj).pop(name, None)
            else:
                setattr(obj, name, before)


def _refusal(what: str, fix: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{what} was called inside an `acc.accumulate(batch)` block, around the window: {fix}.")

    return refuse
