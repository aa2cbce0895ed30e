"""``FabricAccumulator``'s misuse, refused where it happens: when it is made, the Fabric, model and
optimizer it is given and the strategies it is proved on (one device, DDP, FSDP2 over a data-parallel
mesh; any other is refused, naming it and the reason, before anything runs); while a window is open,
the calls that would go around it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from lightning_accum._core.sync import SyncMode, SyncPlan, fsdp2_modules, plan_for, refuse_unsharded


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


def check_same_owner(fabric: Any, model: Any, optimizer: Any) -> None:
    """``model`` and ``optimizer`` set up by ``fabric``, and the optimizer over the model's parameters."""
    for name, obj in (("model", getattr(model, "_orig_mod", model)), ("optimizer", optimizer)):
        strategy = getattr(obj, "_strategy", None)  # (what Fabric's wrappers step and sync through)
        if strategy is not None and strategy is not fabric.strategy:
            raise ValueError(
                f"`{name}` was set up by another Fabric than `fabric`: give the Fabric whose `setup` returned it."
            )
    owned = {id(p) for p in model.parameters()}
    foreign = [i for i, group in enumerate(optimizer.param_groups) for p in group["params"] if id(p) not in owned]
    if foreign:
        raise ValueError(
            f"`optimizer` holds parameters that are not `model`'s (in param group(s) {sorted(set(foreign))}): the "
            "windows would step another model while this one's gradient is never reset. Give the optimizer set up "
            "with this model, `fabric.setup(model, optimizer)`."
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
        module = getattr(getattr(model, "_orig_mod", model), "module", model)
        if not fsdp2_modules(module):
            raise ValueError(
                f"`FabricAccumulator` under `{name}` needs the model sharded with FSDP2 (`fully_shard` in the "
                "strategy's `parallelize_fn`): without it the ranks' gradients are never made global."
            )
        refuse_unsharded(module, f"`FabricAccumulator` under `{name}`")
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


class WindowGuard:
    """While a window holds micro-batches (from its first block until it is stepped, flushed or left out), the
    calls that would reset or step it midway refuse at once: ``optimizer.step()`` (the wrapped optimizer's, or
    the one inside it), ``optimizer.zero_grad()`` and ``model.zero_grad()``; inside a block (``block()``),
    ``fabric.backward`` too (an unweighted gradient). The instances' own attributes are set while armed and
    taken back after (a few microseconds a window). A backward pass made around ``step.backward`` between
    blocks (``loss.backward()``) cannot be seen.

    Example:

        >>> import torch
        >>> class Fabric: backward = staticmethod(lambda loss: None)
        >>> optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> guard = WindowGuard(Fabric(), torch.nn.Linear(1, 1), optimizer, optimizer)
        >>> guard.arm(); guard.armed
        True
        >>> guard.disarm(); guard.armed
        False
    """

    def __init__(self, fabric: Any, model: Any, optimizer: Any, raw_optimizer: Any) -> None:
        self._window = (
            (optimizer, "step", "`optimizer.step()`", _STEP_FIX),
            (optimizer, "zero_grad", "`optimizer.zero_grad()`", "the accumulator resets the gradient after a step"),
            (model, "zero_grad", "`model.zero_grad()`", "the accumulator resets the gradient after a step"),
        )
        self._block = ((fabric, "backward", "`fabric.backward(loss)`", "call `step.backward(loss)`, which weights it"),)
        self._raw = raw_optimizer
        self._saved: list[tuple[Any, str, Any]] = []
        self._hook: Any = None

    @property
    def armed(self) -> bool:
        return bool(self._saved)

    def arm(self) -> None:
        """Refuse the calls that would step or reset the open window (idempotent)."""
        if not self._saved:
            self._saved = _patch(self._window)
            self._hook = self._raw.register_step_pre_hook(lambda *_: _refusal("`optimizer.step()`", _STEP_FIX)())

    def disarm(self) -> None:
        """Give the calls back (idempotent)."""
        _unpatch(self._saved)
        self._saved = []
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    @contextlib.contextmanager
    def block(self) -> Iterator[None]:
        """Inside a block, ``fabric.backward`` refuses too (given back when the block exits)."""
        saved = _patch(self._block)
        try:
            yield
        finally:
            _unpatch(saved)


def _patch(targets: Any) -> list[tuple[Any, str, Any]]:
    saved = []
    for obj, name, what, fix in targets:
        saved.append((obj, name, vars(obj).get(name, _MISSING)))
        object.__setattr__(obj, name, _refusal(what, fix))  # (past `_FabricModule.__setattr__`'s forwarding)
    return saved


def _unpatch(saved: list[tuple[Any, str, Any]]) -> None:
    for obj, name, before in reversed(saved):
        if before is _MISSING:
            vars(obj).pop(name, None)
        else:
            object.__setattr__(obj, name, before)


_STEP_FIX = "the accumulator steps when the window's last block exits"


def _refusal(what: str, fix: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"{what} was called while an accumulation window is open, where it goes around the window: {fix}. "
            "(To end a window early, call `acc.flush()`, or give `last=True` to its last `accumulate`.)"
        )

    return refuse
