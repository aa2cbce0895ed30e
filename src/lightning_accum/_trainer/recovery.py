"""What an exception leaves: the state a checkpoint written then (``OnExceptionCheckpoint``, after
the package's ``on_exception``) must hold for a resumed run to continue exactly.

Lightning trains the batch under way again after a resume when the exception came before the
batch was *processed* (before ``on_train_batch_end``), and not when it came later. So the batch's
counts are taken back if its gradient is not in the window yet; if it is, the batch is marked
``redo`` (trained again, it adds nothing); a partial gradient (an exception inside a backward
pass, in the mixin's block after a pass, or after the window was rescaled for its step) cannot be
kept: the window is left out, with a warning that names the checkpoint to resume from instead.
"""

from __future__ import annotations

import warnings
from typing import Any

from lightning_accum import _seam
from lightning_accum._core.engine import WindowEngine
from lightning_accum._lightning import Callback as _Callback


def where(trainer: Any, exception: BaseException) -> tuple[bool, bool]:
    """Whether the batch under way was processed (Lightning will not train it again), and whether
    ``exception`` came from inside a backward pass."""
    return _seam.batch_processed(trainer), raised_in_backward(exception)


def settle(
    engine: WindowEngine,
    batch: tuple[int, int],
    *,
    processed: bool,
    in_backward: bool,
    open_pass: bool = False,
    rescaled: bool = True,
) -> None:
    """Leave ``engine`` as a checkpoint written now must hold it (``WindowEngine.settle``), and
    warn if that checkpoint cannot hold the window."""
    lost = engine.settle(batch, processed=processed, in_backward=in_backward, open_pass=open_pass, rescaled=rescaled)
    if lost is not None:
        warnings.warn(
            f"An exception came while {lost}, so a run resumed from a checkpoint written now does not continue "
            "exactly. Resume from the last checkpoint saved at an optimizer step to continue exactly.",
            stacklevel=3,
        )


def abandon(engine: WindowEngine, what: str) -> None:
    """Leave out ``engine``'s window, which an exception cut short while ``what``, and warn (as ``settle``)."""
    lost = 0 if engine.window is None else engine.window.microbatches
    engine.discard()
    if lost:
        warnings.warn(
            f"An exception came while {what}: a checkpoint written now leaves its {lost} micro-batch(es) out, so a "
            "run resumed from it does not continue exactly. Resume from the last checkpoint saved at an optimizer "
            "step to continue exactly.",
            stacklevel=3,
        )


def pass_end_may_raise(trainer: Any, callback: Any) -> bool:
    """Whether anything can raise between the end of a loss's backward pass and ``callback``'s
    ``on_after_backward``, leaving the batch's whole gradient in ``.grad`` with no hook of the callback's told (so
    that autograd must mark the pass's end, ``_seam.at_pass_end``): a callback Lightning calls before it with its
    own ``on_after_backward``, a ``LightningModule.backward`` of the user's (code after ``loss.backward()``), or a
    strategy or precision plugin whose backward is not Lightning's own plain one."""
    module = trainer.lightning_module
    return (
        before_with_own(trainer.callbacks, callback, "on_after_backward")
        or not _lightnings(type(module).backward)
        or not _lightnings(type(trainer.precision_plugin).backward, type(trainer.precision_plugin).post_backward)
        or not _lightnings(type(trainer.strategy).backward, type(trainer.strategy).post_backward)
        or "deepspeed" in type(trainer.strategy).__name__.lower()
    )


def before_with_own(callbacks: list[Any], callback: Any, hook: str) -> bool:
    """Whether a callback listed before ``callback`` has its own ``hook`` (Lightning calls it first)."""
    for other in callbacks:
        if other is callback:
            return False
        if getattr(type(other), hook, None) is not getattr(_Callback, hook):
            return True
    return False


def _lightnings(*methods: Any) -> bool:
    """Whether every one of ``methods`` is defined by Lightning itself."""
    return all(getattr(m, "__module__", "").startswith(("lightning.pytorch.", "pytorch_lightning.")) for m in methods)


def raised_in_backward(error: BaseException) -> bool:
    """Whether ``error`` came from inside an autograd backward pass (it may have left a partial gradient)."""
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name in ("_engine_run_backward", "run_backward") or (
            code.co_name == "backward" and "autograd" in code.co_filename
        ):
            return True
        tb = tb.tb_next
    return False
