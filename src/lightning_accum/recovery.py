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
from lightning_accum.engine import WindowEngine


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
    """Leave ``engine`` as a checkpoint written now must hold it. ``batch``: (epoch, index) of the
    batch under way; ``open_pass``: a backward pass ran in a block that did not finish (the
    mixin); ``rescaled``: a closing window's gradient was changed in place for its step."""
    if engine.closing is not None and not rescaled and not processed:
        engine.closing = None  # the step had not touched the gradient: the window is as it was
    window, inflight = engine.window, engine.inflight
    engine.inflight = None
    if processed:
        if engine.closing is not None:
            engine.advance(batch[0])
        engine.redo = None
        return
    if inflight is None and not (in_backward or open_pass):
        return  # nothing of this batch reached the window
    if window is None:
        what = "this batch's accumulation window was stepped already, and the batch will be trained again"
    elif engine.closing is None and not (in_backward or open_pass):
        if engine.backward_finished:
            engine.redo = batch
        else:
            window.remove(*inflight)  # type: ignore[misc]
        return
    else:
        stepping = engine.closing is not None
        lost = window.microbatches
        engine.discard()
        if not (lost or stepping):
            return  # the window's first micro-batch, trained again from its start: nothing is lost
        what = "the accumulation window was being stepped" if stepping else (
            "a backward pass into the accumulation window was cut short"
        )  # fmt: skip
        what += f": a checkpoint written now leaves its {lost} micro-batch(es) out"
    warnings.warn(
        f"An exception came while {what}, so a run resumed from a checkpoint written now does not continue "
        "exactly. Resume from the last checkpoint saved at an optimizer step to continue exactly.",
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
