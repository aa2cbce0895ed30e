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

from lightning_accum._core.collectives import HostSum, world_size

CHUNK = 4
"""Micro-batches a ``CountsAhead`` all-reduce decides: a rank reads at most ``2 * CHUNK - 1`` of them ahead."""


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
        if self._end is None or not self._sums or not self._sums[0][0] <= position < self._end:
            self.forget()
            self._issue(position, strategy, local)
        if position >= self._end - self.chunk:  # type: ignore[operator]  # (the last chunk out is entered)
            self._issue(self._end, strategy, local)  # type: ignore[arg-type]
        while self._sums[0][0] + self.chunk <= position:  # (chunks behind: read by every rank, or never needed)
            self._drop(self._sums.pop(0)[0])
        start, sums = self._sums[0]
        values = sums.result()
        total, present = values[position - start], values[self.chunk + position - start]
        if present != world_size(strategy):
            raise RuntimeError(
                f"The ranks' data ended at different batches: batch {position} of the epoch is on {present} of "
                f"{world_size(strategy)} ranks, and a `Budget` sums every batch's count over all ranks. Every rank "
                "must run the same number of batches per epoch (e.g. `DistributedSampler(drop_last=True)`, loaders "
                "of equal length)."
            )
        return total

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
