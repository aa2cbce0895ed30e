"""A Fabric loop that ends with a window still open: the window's micro-batches were back-propagated but never
stepped (``acc.flush()`` not called after the loop, or no ``last=True`` on the data's last block). Nothing
raises there, so ``UnflushedWatch`` warns once, when the accumulator is garbage-collected or the process
ends, whichever comes first.

It stays quiet where nothing is lost: no window open, or one that holds no micro-batch; a window a checkpoint
holds as it is (``state_dict()`` after its last micro-batch, or loaded from one); a process that ends with an
unhandled exception (the traceback says what happened); anything after Python's exit handlers have run
(``weakref.finalize`` calls nothing then). It reads the engine's window only, never the Fabric or the model,
which may be gone by then, and a warning that cannot be shown (a filter set to raise) is dropped.
"""

from __future__ import annotations

import atexit
import sys
import warnings
import weakref
from typing import Any

from lightning_accum._core.engine import WindowEngine

#: every live watch, for the exit handler (a watch lives as long as its accumulator)
_LIVE: weakref.WeakSet[UnflushedWatch] = weakref.WeakSet()


class UnflushedWatch:
    """Warns once if ``owner`` is garbage-collected, or the process ends, with an unstepped window.

    Example:

        >>> from lightning_accum.schedules import Constant
        >>> class Owner: ...
        >>> owner = Owner()
        >>> watch = UnflushedWatch(owner, WindowEngine(Constant(2), "mean"), rank=0)
        >>> del owner  # no window open: nothing to say
        >>> watch.done
        True
    """

    def __init__(self, owner: Any, engine: WindowEngine, rank: int, made_at: tuple[str, int] = ("", 0)) -> None:
        self._engine, self._rank = engine, rank
        self._made_at = made_at  # (file, line) where the owner was made: where the warning points
        self._kept: tuple[Any, int] | None = None  # (progress, micro-batches) of a window a checkpoint holds
        # (the finalizer holds the watch, never the owner; Python's exit is `at_exit`'s, as the process's state
        # then decides whether to warn)
        self._finalizer = weakref.finalize(owner, self.check, "garbage-collected")
        self._finalizer.atexit = False
        _LIVE.add(self)

    @property
    def done(self) -> bool:
        """Whether the watch has had its one look (its owner is gone, or the process ended)."""
        return not self._finalizer.alive

    def kept(self) -> None:
        """A checkpoint holds the open window as it is now (``state_dict``, ``load_state_dict``): losing it
        when the process ends loses nothing of it."""
        window = self._engine.window
        self._kept = None if window is None else (self._engine.progress, window.microbatches)

    def held(self) -> int:
        """Micro-batches in the open window that would be lost unstepped (0 if none, or a checkpoint holds them)."""
        window = self._engine.window
        held = 0 if window is None else window.microbatches
        return 0 if self._kept == (self._engine.progress, held) else held

    def check(self, when: str) -> None:
        """Warn (rank 0) if the open window holds micro-batches no step and no checkpoint took."""
        try:
            held = self.held()
            if not held or self._rank != 0:
                return
            warnings.warn_explicit(
                f"A `FabricAccumulator` was {when} with its last window open: {held} micro-batch(es) were "
                "back-propagated but never stepped. Call `acc.flush()` after the loop (and at each epoch's end), or "
                "give `last=True` to the data's last `acc.accumulate(batch, ...)`, so that a short last window "
                "steps, divided by its own size.",
                UserWarning,
                *self._made_at,
            )
        except Exception:  # (a filter that turns warnings into errors, or a half torn-down process: say nothing)
            pass

    def at_exit(self) -> None:
        """The process ends with the owner alive: one look, unless an unhandled exception ends it."""
        if self._finalizer.detach() is not None and getattr(sys, "last_value", None) is None:
            self.check("still alive when the process ended")


@atexit.register
def _at_exit() -> None:
    for watch in list(_LIVE):
        watch.at_exit()
