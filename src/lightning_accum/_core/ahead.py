"""A budget's counts over ranks, summed ahead of the micro-batches they decide.

A ``Budget`` closes a window after the first micro-batch at which its count over all ranks reaches ``n``, and the
callback must know it before the micro-batch's ``training_step`` (Lightning decides there whether the batch steps).
Summing each micro-batch's count over ranks as it starts made every micro-batch a meeting of all ranks. Here the
counts of the next ``chunk`` micro-batches, read ahead from the data, are summed in one all-reduce that no rank
waits for when it is issued: it is issued a chunk before its first micro-batch is needed, so a rank waits on it only
where it is more than a chunk of micro-batches ahead of the slowest rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from lightning_accum._core.collectives import HostSum, world_size

CHUNK = 4
"""Micro-batches a ``CountsAhead`` all-reduce decides: a rank reads at most ``2 * CHUNK - 1`` of them ahead."""

ON_ONE_PROCESS = False
"""Whether a single process reads ahead too, where nothing is summed and nothing is gained (the tests and the
differential fuzzer set it, to check every adapter's reading ahead against the reference without ranks)."""

ENDED = object()
"""What a source of batches read ahead gives past its data (``ReadAhead.total``'s ``upcoming``)."""


class CountsAhead:
    """The counts over ranks of the micro-batches to come, ``chunk`` of them per all-reduce, each issued one chunk
    ahead of its first micro-batch (the epoch's first chunk, or the first after a jump, is waited for as it goes out).

    Positions are the micro-batches' indices in their epoch, asked in increasing order. Every rank must ask for the
    same positions (it issues the same all-reduces then). Each all-reduce also sums, per micro-batch, how many ranks
    have it: a micro-batch that some rank's data does not reach is refused when asked for.

    Example:

        >>> ahead = CountsAhead(chunk=2)
        >>> [ahead.total(p, None, lambda q: 10 + q) for p in range(3)]
        [10, 11, 12]
    """

    def __init__(self, chunk: int = CHUNK) -> None:
        self.chunk = chunk
        self._sums: list[tuple[int, HostSum]] = []  # (a chunk's first position, its all-reduce), oldest first
        self._end: int | None = None  # the first position no all-reduce covers yet
        self._mine: dict[int, int | None] = {}  # this rank's counts as they went out, by position (None: no data)

    def forget(self) -> None:
        """Drop what was summed ahead (a new epoch, a resume, a fit's end): the next ``total`` starts afresh."""
        self._sums, self._end = [], None
        self._mine.clear()

    def total(self, position: int, strategy: Any, local: Callable[[int], int | None]) -> int:
        """The count over ranks of the micro-batch at ``position``. ``local(p)``: this rank's count of the micro-batch
        at position ``p`` (``None``: this rank's data ends before it), asked as its chunk goes out."""
        total, present = self._sum(position, strategy, local)
        if present != world_size(strategy):
            raise RuntimeError(_uneven(position, present, strategy))
        return total

    def end(self, position: int, strategy: Any, local: Callable[[int], int | None]) -> None:
        """This rank's data ended before ``position`` (the first position it does not have): refused unless every
        rank's ended there too, with ``total``'s error on the ranks that have it (they ask for the same position, so
        every rank issues the same all-reduces and the error reaches each of them, where they would hang before)."""
        _, present = self._sum(position, strategy, local)
        if present:
            raise RuntimeError(_uneven(position, present, strategy))

    def _sum(self, position: int, strategy: Any, local: Callable[[int], int | None]) -> tuple[int, int]:
        if self._end is None or not self._sums or not self._sums[0][0] <= position < self._end:
            self.forget()
            self._issue(position, strategy, local)
        if position >= self._end - self.chunk:  # type: ignore[operator]  # (the last chunk out is entered)
            self._issue(self._end, strategy, local)  # type: ignore[arg-type]
        while self._sums[0][0] + self.chunk <= position:  # (chunks behind: read by every rank, or never needed)
            self._drop(self._sums.pop(0)[0])
        start, sums = self._sums[0]
        values = sums.result()
        return values[position - start], values[self.chunk + position - start]

    def mine(self, position: int) -> int | None:
        """This rank's count of the micro-batch at ``position`` as it went out (``None``: not read, or no data)."""
        return self._mine.get(position)

    def _issue(self, start: int, strategy: Any, local: Callable[[int], int | None]) -> None:
        counts = [local(p) for p in range(start, start + self.chunk)]
        self._mine.update(zip(range(start, start + self.chunk), counts, strict=True))
        values = [c or 0 for c in counts] + [int(c is not None) for c in counts]
        self._sums.append((start, HostSum(strategy, values)))
        self._end = start + self.chunk

    def _drop(self, start: int) -> None:
        for p in range(start, start + self.chunk):
            self._mine.pop(p, None)


def _uneven(position: int, present: int, strategy: Any) -> str:
    return (
        f"The ranks' data ended at different batches: batch {position} of the epoch is on {present} of "
        f"{world_size(strategy)} ranks, and a `Budget` sums every batch's count over all ranks. Every rank "
        "must run the same number of batches per epoch (e.g. `DistributedSampler(drop_last=True)`, loaders "
        "of equal length)."
    )


class ReadAhead:
    """A budget's counts over ranks, read ahead from the batches to come: the protocol every adapter that reads ahead
    shares (the callback and the mixin from Lightning's training loader, ``_trainer.ahead.BudgetAhead``; the Fabric
    helper from the loader ``FabricAccumulator.read_ahead`` iterates). The adapter gives, per micro-batch, its
    position, its own count, the batches after it (``upcoming``) and how to count one; this sums them ``CHUNK`` at a
    time (``CountsAhead``), keeps which counts raised, and refuses a micro-batch whose count as it is trained differs
    from the one read ahead (``check``).

    ``source`` (where the batches were read, for the errors) and ``fix`` (what to do about a count that differs).

    Example:

        >>> ahead = ReadAhead("the loader", "Count what the loader yields.")
        >>> ahead.total(0, None, lambda: 3, lambda n: ENDED if n > 2 else {"n": n}, lambda b: 10 * b["n"])
        3
        >>> ahead.total(1, None, lambda: 10, lambda n: ENDED, len)
        10
    """

    def __init__(self, source: str, fix: str) -> None:
        self.source, self.fix = source, fix
        self._counts = CountsAhead()
        self._failed: set[int] = set()  # positions whose count raised, read ahead (refused if trained: `check`)

    def forget(self) -> None:
        """Drop what was read ahead (a new epoch, a resume, an exception, a fit's end)."""
        self._counts.forget()
        self._failed.clear()

    def total(
        self,
        position: int,
        strategy: Any,
        current: Callable[[], int],
        upcoming: Callable[[int], Any],
        count_of: Callable[[Any], int],
    ) -> int:
        """The count over ranks of the micro-batch at ``position`` (its index in the epoch), whose own count is
        ``current()`` (asked where its chunk goes out with it: an epoch's first micro-batch, the first after a jump);
        ``upcoming(n)``: the ``n``-th batch after it (``ENDED`` past the data); ``count_of(batch)``: a batch's count
        in the budget's unit as ``upcoming`` gives it."""
        return self._counts.total(position, strategy, self._local(position, current, upcoming, count_of))

    def end(self, position: int, strategy: Any) -> None:
        """This rank's data ended before ``position``: refused unless every rank's did (``CountsAhead.end``)."""
        self._counts.end(position, strategy, self._local(position, lambda: 0, lambda n: ENDED, len, here=False))

    def _local(
        self,
        position: int,
        current: Callable[[], int],
        upcoming: Callable[[int], Any],
        count_of: Callable[[Any], int],
        here: bool = True,
    ) -> Callable[[int], int | None]:
        def local(p: int) -> int | None:
            if p == position and here:
                return current()
            batch = upcoming(p - position)
            if batch is ENDED:
                return None
            try:
                return count_of(batch)
            except Exception:  # (refused where the batch is trained, by the count of the batch it gets)
                self._failed.add(p)
                return 0

        return local

    def check(self, position: int, samples: int, items: int | Tensor, in_samples: bool, gets: str) -> None:
        """Refuse a micro-batch whose count as it is trained (``samples``, ``items``; ``gets``: who gets that batch)
        differs from the one read ahead; not checked for a count on a device (its read would wait for the device)."""
        ahead = self._counts.mine(position)
        if in_samples:
            now: int | None = samples
        elif isinstance(items, Tensor):
            now = int(items.item()) if items.device.type == "cpu" else None
        else:
            now = int(items)
        if now is None or (ahead == now and position not in self._failed):
            return
        what = "the samples (dim 0 of its first tensor)" if in_samples else "`count(batch)`"
        read = "raised" if position in self._failed else f"gave {ahead}"
        raise ValueError(
            f"A `Budget` reads each batch's count ahead, from the batch as {self.source}: for batch {position} of "
            f"the epoch, {what} {read} there, but gives {now} for the batch {gets} gets. {self.fix}"
        )
