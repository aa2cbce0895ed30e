"""A ``Budget``'s counts over ranks, read ahead from Lightning's training loader (the callback; the mixin opted in).

Lightning's automatic loop decides whether a batch steps before its ``training_step``, so the callback must know
whether the batch closes a budget's window as it starts, which takes the batch's count over all ranks. Asking for it
then made every batch a meeting of all ranks. ``BudgetAhead`` reads the counts of the batches to come from the loader
(``_seam.Upcoming``) and sums them over ranks a chunk at a time, ahead (``_core.ahead.CountsAhead``), so that a rank
waits on no collective inside a window unless it runs more than a chunk of batches ahead of the slowest rank. The
mixin decides its windows at its blocks' end, where the count of one all-reduce issued as the block opened serves;
under ``configure_accumulation(read_ahead=True)`` (one block per ``training_step``, on its batch) it reads ahead too,
through the same object, its block's position the loop's batch index.

``count`` (or the samples, for ``unit="samples"``) is then also called on each batch as the loader gives it, a few
batches before it is trained (before ``on_before_batch_transfer`` and the move to the device): it must give the same
number for that batch as for the one ``training_step`` gets. Where that can be checked without a read of the
device (a Python number, a CPU tensor), a batch whose counts differ is refused as it starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from lightning_accum import _seam
from lightning_accum._core import ahead, collectives
from lightning_accum._core.ahead import ReadAhead
from lightning_accum._lightning import rank_zero_warn

_FIX = (
    "Count what the loader yields (e.g. in the collate function), or change the batch in the collate function rather "
    "than in the batch transfer hooks."
)


class BudgetAhead:
    """A fit's budget counts over ranks, read ahead from Lightning's training loader (several ranks only; one process
    needs no sum), positions being the loop's batch indices: the callback's, and the mixin's under
    ``configure_accumulation(read_ahead=True)``.

    ``owner``: who reads ahead, for the warning where the loop cannot be read ahead; ``fix``: what to do about a
    count that differs from the one read ahead."""

    def __init__(self, owner: str = "A `Budget`", fix: str = _FIX) -> None:
        self._owner = owner
        self._ahead = ReadAhead(
            "the training loader yields it (before `on_before_batch_transfer` and the move to the device)", fix
        )
        self._upcoming: _seam.Upcoming | None = None
        self._epoch: int | None = None

    @property
    def reading(self) -> bool:
        """Whether the counts are read ahead (``start`` found a loop that can be read, on several ranks)."""
        return self._upcoming is not None

    def start(self, trainer: Any) -> None:
        """At train start: read ahead where the loop allows it (several ranks, a loop that fetches the batches
        itself); else each batch's count is summed as it starts (warned)."""
        self.stop()
        if collectives.world_size(trainer.strategy) == 1 and not ahead.ON_ONE_PROCESS:
            return
        upcoming = _seam.Upcoming(trainer)
        if upcoming.usable():
            self._upcoming = upcoming
            return
        rank_zero_warn(
            f"{self._owner} reads each batch's count ahead from the training loader, to sum it over the ranks before "
            "the batch starts without the ranks waiting for each other; with a `training_step` that takes the "
            "`dataloader_iter` it cannot, so every batch waits for one all-reduce of its count over the ranks."
        )

    def stop(self) -> None:
        """At the fit's end: the loader's state as Lightning reads it, nothing read ahead kept."""
        if self._upcoming is not None:
            self._upcoming.detach()
        self._upcoming = None
        self.forget()

    def forget(self) -> None:
        """The counts read ahead dropped (after an exception: a checkpoint written then still saves the loader as
        without the reading ahead; the next fit's start lets it go)."""
        self._epoch = None
        self._ahead.forget()

    def total(
        self, trainer: Any, position: int, current: Callable[[], int], count_of: Callable[[Any], int]
    ) -> int | None:
        """The count over ranks of the batch at ``position`` (its index in the epoch), whose own count is ``current()``
        (asked where its chunk goes out with it: an epoch's first batch, the first after a resume);
        ``count_of(batch)``: a batch's count in the budget's unit, as the loader gives it. ``None``: not read ahead
        (one process, or a loop that cannot be read ahead)."""
        if self._upcoming is None:
            return None
        if trainer.current_epoch != self._epoch:
            self._ahead.forget()
            self._epoch = trainer.current_epoch
        upcoming = self._upcoming

        def batch(n: int) -> Any:
            found = upcoming.batch(n)
            return ahead.ENDED if found is _seam.ENDED else found

        return self._ahead.total(position, trainer.strategy, current, batch, count_of)

    def check(self, position: int, samples: int, items: int | Tensor, in_samples: bool) -> None:
        """Refuse a batch whose count, as ``training_step`` gets it (``samples``, ``items``), differs from the one read
        ahead from the loader; not checked for a count on a device (its read would wait for the device)."""
        if self._upcoming is not None:
            self._ahead.check(position, samples, items, in_samples, "`training_step`")
