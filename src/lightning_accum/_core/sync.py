"""Strategy integration: where gradient sync is skipped inside a window, and made global at its end.

One function per strategy family decides how a window's non-final micro-batches skip the
gradient collective; ``skip_sync`` picks it from a ``SyncPlan``:

* DDP: ``strategy.block_backward_sync()`` (DDP's ``no_sync``). Lightning's automatic loop
  already applies it to the batches it accumulates, which ``_seam`` aligns with the windows;
  the mixin runs every pass under it and all-reduces the window once, explicitly, at its end
  (``all_reduce_gradients``): one collective round per optimizer step whatever the number
  of backward passes, and no dependence on ``find_unused_parameters``.
* FSDP (``FSDPStrategy``): the outermost wrapped modules' ``no_sync()``: full unsharded gradients
  are then held until the window's last micro-batch. Lightning's automatic loop enters the root's
  ``no_sync()`` on the batches it accumulates, so the callback skips under every mode but
  ``"every"``, which it refuses there; the mixin reduce-scatters every micro-batch unless
  ``sync="skip"``.
* FSDP2 (``ModelParallelStrategy``, ``fully_shard``): ``set_requires_gradient_sync(False)`` on
  the sharded modules, back to ``True`` for the window's last micro-batch.
* DeepSpeed (``AccumulationScheduler`` only): the engine is built with
  ``gradient_accumulation_steps=1`` and told at each micro-batch whether it ends the window
  (``set_gradient_accumulation_boundary``): it reduces (ZeRO 0/1) and steps only then (ZeRO 0-3). Its
  gradients live in its own buffers, so each micro-batch's share of the window mean is set on
  the loss's gradient before backward (``scale_backward``), not on ``.grad`` after it.
* Single device: nothing to skip.

The collectives that make gradients and counts global at a window's end are in
``lightning_accum._core.collectives``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any, Literal

from torch import Tensor, nn

from lightning_accum._core.collectives import world_size
from lightning_accum._lightning import rank_zero_warn

Family = Literal["single", "ddp", "fsdp", "fsdp2", "deepspeed"]
SyncMode = Literal["auto", "skip", "every"]
"""Gradient sync inside a window on sharded strategies: ``"auto"`` (FSDP2: once per window; FSDP: as
Lightning's own loop, once per window in the callback and every micro-batch in the mixin), ``"skip"``
(once per window) or ``"every"``."""
SYNC_MODES = ("auto", "skip", "every")


def is_deepspeed(strategy: Any) -> bool:
    """Whether the strategy owns gradient accumulation itself (DeepSpeed does)."""
    return bool(getattr(strategy, "handles_gradient_accumulation", False))


def refuse_deepspeed(strategy: Any, who: str, what: str = "") -> None:
    """Raise, before any step, if ``strategy`` is DeepSpeed and ``who`` (with ``what``) needs the
    window's gradient after backward, which DeepSpeed keeps in its own buffers."""
    if not is_deepspeed(strategy):
        return
    raise RuntimeError(
        f"`{who}`{what} cannot run under `{type(strategy).__name__}`: DeepSpeed keeps the gradient in its own "
        "buffers (under ZeRO-2/3 `.grad` is not the gradient), so a window's gradient cannot be normalised, "
        "decayed or measured after backward. Under DeepSpeed use `AccumulationScheduler` with "
        "`normalize='mean'` (it weights each micro-batch before backward), or DDP, FSDP or FSDP2."
    )


def check_sync_mode(sync: Any) -> None:
    """Clear error for a ``sync=`` argument that is not one of ``SYNC_MODES``."""
    if sync not in SYNC_MODES:
        raise ValueError(
            f"`sync` must be 'auto', 'skip' or 'every'; got {sync!r}. 'skip' reduces gradients once per window "
            "(sharded strategies then hold unsharded gradients until its end), 'every' reduce-scatters sharded "
            "gradients after every micro-batch."
        )


# ---------------------------------------------------------------------- which family
def _fsdp_type() -> type[nn.Module] | None:
    """FSDP (1)'s wrapper class, ``None`` where torch has no distributed package."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return None
    return FullyShardedDataParallel


def fsdp_roots(module: nn.Module) -> list[nn.Module]:
    """The outermost FSDP (1) instances in ``module``: the ones whose ``no_sync()`` may be called."""
    fsdp = _fsdp_type()
    if fsdp is None:
        return []
    roots: list[nn.Module] = []
    inner: set[int] = set()
    for m in module.modules():
        if isinstance(m, fsdp) and id(m) not in inner:
            roots.append(m)
            inner.update(id(d) for d in m.modules() if d is not m)
    return roots


def fsdp2_modules(module: nn.Module) -> list[nn.Module]:
    """The modules ``fully_shard`` was applied to (FSDP2): they have ``set_requires_gradient_sync``."""
    return [m for m in module.modules() if callable(getattr(type(m), "set_requires_gradient_sync", None))]


def refuse_unsharded(module: nn.Module, who: str) -> None:
    """Under FSDP2 every trained parameter must be sharded by ``fully_shard``: FSDP2 reduces only those, so the
    gradient of any other would never be made global and the ranks' copies would drift apart."""
    trained = [(name, hasattr(p, "placements")) for name, p in module.named_parameters() if p.requires_grad]
    plain = [name for name, sharded in trained if not sharded]
    if plain and len(plain) < len(trained):  # (none sharded: not FSDP2's parameters at all)
        listed = ", ".join(plain[:5]) + (", ..." if len(plain) > 5 else "")
        raise ValueError(
            f"{who}: the parameters {listed} are not sharded by `fully_shard`, so FSDP2 never reduces their "
            "gradient and each rank's copy would drift. Apply `fully_shard` to the modules holding them (or to the "
            "root module last, which takes the rest)."
        )


def family(strategy: Any) -> Family:
    """The strategy family, read off the wrapped model (``strategy.model``) after setup."""
    if is_deepspeed(strategy):
        return "deepspeed"
    model = getattr(strategy, "model", None)
    if isinstance(model, nn.Module):
        if fsdp2_modules(model):
            return "fsdp2"
        if fsdp_roots(model):
            return "fsdp"
        if isinstance(model, nn.parallel.DistributedDataParallel):
            return "ddp"
    return "single"


@dataclasses.dataclass(frozen=True)
class SyncPlan:
    """How a run makes gradients global: the strategy family, and whether a window's micro-batches
    before its last skip the gradient collective."""

    family: Family = "single"
    skip: bool = False

    @property
    def sharded(self) -> bool:
        """Whether the strategy reduces gradients itself into shards (FSDP, FSDP2)."""
        return self.family in ("fsdp", "fsdp2")

    @property
    def buffers_partial_window(self) -> bool:
        """Whether a window's partial gradient lives where a checkpoint cannot reach it (FSDP's
        or DeepSpeed's own buffers, or sharded)."""
        return self.sharded or self.family == "deepspeed"


def plan(strategy: Any, mode: SyncMode = "auto") -> SyncPlan:
    """The ``SyncPlan`` for ``strategy`` (after setup) under ``sync=mode``.

    ``"auto"`` skips on DDP and FSDP2 and not on FSDP (but see ``loop_plan``);
    ``"skip"`` skips wherever the strategy can; ``"every"`` reduce-scatters sharded gradients after
    every micro-batch. DDP's gradients are whole on every rank, so DDP syncs once per window in all modes.
    """
    kind = family(strategy)
    if kind == "fsdp2":
        refuse_unsharded(strategy.model, "Accumulation under FSDP2")
    return plan_for(kind, mode)


def loop_plan(strategy: Any, mode: SyncMode, loop_skips: bool) -> SyncPlan:
    """The ``SyncPlan`` of the callback, whose micro-batches run in Lightning's automatic loop: where the loop
    itself skips FSDP's sync (``loop_skips``, ``_seam.loop_skips_sync``), ``"auto"`` is that skip and
    ``"every"`` cannot be kept."""
    sync_plan = plan(strategy, mode)
    if sync_plan.family != "fsdp" or not loop_skips:
        return sync_plan
    if mode == "every":
        raise ValueError(
            "`AccumulationScheduler(sync='every')` cannot hold under `FSDPStrategy`: Lightning's own loop enters "
            "FSDP's `no_sync()` on every batch it accumulates (`strategy.block_backward_sync()`), so the gradient "
            "is reduced once per window whatever `sync` says. Use `sync='auto'` (once per window, as Lightning's "
            "`accumulate_grad_batches`), or FSDP2 (`ModelParallelStrategy`) for a reduce-scatter per micro-batch."
        )
    return SyncPlan("fsdp", skip=True)


def plan_for(kind: Family, mode: SyncMode = "auto") -> SyncPlan:
    """The ``SyncPlan`` of a strategy family under ``sync=mode`` (see ``plan``)."""
    check_sync_mode(mode)
    skip = {"ddp": True, "fsdp": mode == "skip", "fsdp2": mode != "every", "deepspeed": True}.get(kind, False)
    return SyncPlan(kind, skip)


def partial_window_lost(sync_plan: SyncPlan, window: Any) -> bool:
    """Whether a checkpoint saved now must leave out the open ``window``: under FSDP, FSDP2 and
    DeepSpeed its partial gradient is sharded or in the strategy's buffers, which the package
    cannot save. Warns;
    the resumed run then opens a new window at its first batch."""
    if window is None or not window.microbatches or not sync_plan.buffers_partial_window:
        return False
    rank_zero_warn(
        f"A checkpoint was saved inside an accumulation window under {sync_plan.family.upper()}: the window's "
        f"{window.microbatches} micro-batch(es) so far are not in it, and a run resumed from it opens a new window. "
        "Save at window boundaries (e.g. `ModelCheckpoint(every_n_train_steps=...)`) to resume exactly."
    )
    return True


def check_window_synced(sync_plan: SyncPlan, window: Any) -> None:
    """Under FSDP/FSDP2 with sync skipped, only a backward pass of the window's last micro-batch
    reduces the gradients held so far: a window whose last micro-batch back-propagated nothing
    would step on a partial gradient."""
    if sync_plan.sharded and sync_plan.skip and window.microbatches and not window.synced:
        raise RuntimeError(
            f"The accumulation window's last micro-batch ran no backward pass, so under {sync_plan.family.upper()} "
            "with the gradient sync skipped inside windows the window's gradient was never reduced. Back-propagate "
            "(a zero loss will do) on every micro-batch, or pass `sync='every'`."
        )


def refuse_fsdp_root(sync_plan: SyncPlan, model: Any) -> None:
    """What the mixin cannot do when ``FSDPStrategy`` wraps the whole LightningModule: Lightning runs
    ``training_step`` inside the root's forward, where FSDP refuses ``no_sync()`` and cannot run a backward
    pass over parameters the root holds itself (Lightning issue #19685, manual optimization alone)."""
    if sync_plan.family != "fsdp" or model is None or fsdp_roots(model) != [model]:
        return
    if sync_plan.skip:
        raise ValueError(
            "`sync='skip'` cannot work with the mixin when `FSDPStrategy` wraps the whole LightningModule: "
            "Lightning runs `training_step` inside FSDP's forward, where FSDP refuses `no_sync()`. Use "
            "`sync='auto'` (reduce-scatter every micro-batch), wrap submodules in `configure_model`, or use "
            "FSDP2 (`ModelParallelStrategy`)."
        )
    nested = [m for m in model.modules() if m is not model and isinstance(m, type(model))]
    inner = {id(p) for m in nested for p in m.parameters()}
    if any(id(p) not in inner for p in model.parameters()):
        raise ValueError(
            "The mixin cannot run under `FSDPStrategy` when the FSDP root (the whole LightningModule) holds "
            "parameters itself: Lightning runs `training_step` inside the root's forward, where FSDP cannot run "
            "a backward pass over them (Lightning issue #19685; manual optimization fails the same way without "
            "this package). Wrap every module that has parameters (e.g. `FSDPStrategy(auto_wrap_policy={nn.Linear})`) "
            "or use FSDP2 (`ModelParallelStrategy` with `fully_shard` in `configure_model`)."
        )


# ---------------------------------------------------------------------- one function per family
@contextlib.contextmanager
def ddp_no_sync(strategy: Any) -> Iterator[None]:
    """Backward passes inside skip DDP's gradient all-reduce (nothing to skip on one device)."""
    block = getattr(strategy, "block_backward_sync", None)
    if block is None or world_size(strategy) == 1:
        yield
        return
    with block():
        yield


@contextlib.contextmanager
def fsdp_no_sync(module: nn.Module) -> Iterator[None]:
    """Backward passes inside keep FSDP's unsharded gradients instead of reduce-scattering them."""
    with contextlib.ExitStack() as stack:
        for root in fsdp_roots(module):
            stack.enter_context(root.no_sync())  # type: ignore[operator]
        yield


@contextlib.contextmanager
def fsdp2_no_sync(module: nn.Module) -> Iterator[None]:
    """Backward passes inside accumulate FSDP2's unsharded gradients; sync is back on after."""
    shards = fsdp2_modules(module)
    for m in shards:
        m.set_requires_gradient_sync(False, recurse=False)  # type: ignore[operator]
    try:
        yield
    finally:
        for m in shards:
            m.set_requires_gradient_sync(True, recurse=False)  # type: ignore[operator]


def deepspeed_boundary(strategy: Any, final: bool) -> None:
    """Tell DeepSpeed's engine whether the coming micro-batch ends the window: it reduces the
    gradients (ZeRO 0/1) and steps the optimizer only then, whatever its accumulation steps."""
    strategy.model.set_gradient_accumulation_boundary(final)


def deepspeed_window_length(batches: float, start: int, k: int) -> int:
    """Micro-batches the window opening at ``start`` will hold under DeepSpeed: ``k``, or fewer at
    the epoch's end (``batches`` per epoch, which must be known: each is weighted before backward)."""
    if math.isinf(batches):
        raise RuntimeError(
            "Under DeepSpeed, `AccumulationScheduler` weights each micro-batch before backward, so it must know "
            "when the epoch ends: give the Trainer a dataloader with a length, or set `limit_train_batches`."
        )
    return min(k, int(batches) - start)


def scale_backward(loss: Tensor, factor: float | Tensor) -> None:
    """Multiply the gradient that ``loss``'s backward pass produces by ``factor`` (a number or a
    0-d tensor, not read on the host), before it reaches any parameter (a hook on the loss: loss
    scaling and DeepSpeed's own division apply around it unchanged). The gradient keeps its dtype (a
    float64 count on a float32 loss)."""
    if loss.requires_grad and (isinstance(factor, Tensor) or factor != 1.0):
        loss.register_hook(lambda grad: (grad * factor).to(grad.dtype))  # type: ignore[no-untyped-call]


def skip_sync(sync_plan: SyncPlan, strategy: Any, final: bool) -> AbstractContextManager[None]:
    """The context for the backward passes of one micro-batch: the gradient collective is skipped
    unless ``final`` (the window's last micro-batch) or the plan does not skip."""
    if final or not sync_plan.skip:
        return contextlib.nullcontext()
    if sync_plan.family == "ddp":
        return ddp_no_sync(strategy)
    if sync_plan.family == "fsdp":
        return fsdp_no_sync(strategy.model)
    if sync_plan.family == "fsdp2":
        return fsdp2_no_sync(strategy.model)
    return contextlib.nullcontext()
