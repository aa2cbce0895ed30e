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
