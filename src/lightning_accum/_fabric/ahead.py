"""``FabricAccumulator.read_ahead``: a Fabric loop's batches, their ``Budget`` counts read ahead (issue 52).

Without it, each ``accumulate`` block's count is summed over ranks in one all-reduce issued as the block opens and
read at its end: a rank waits there for any rank that had not begun the block. A loop that runs one block per loader
batch, in order, can have its counts read ahead instead: ``acc.read_ahead(loader)`` iterates the loader, holding up to
``2 * CHUNK - 1`` batches beyond the one yielded last, and the block of the batch at position ``p`` (its index in the
loop) takes its count over ranks from ``_core.ahead.ReadAhead``, the protocol the Trainer's adapters read ahead with:
``CHUNK`` batches per all-reduce, each issued a chunk before it is read. ``ReaderLoop`` is the loop and its contract
(the block gets the batch yielded last, once); ``FabricAhead`` is what the accumulator keeps of its loops.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

from lightning_accum._core.ahead import ENDED, ReadAhead

_FIX = (
    "Give `acc.accumulate` the batch `acc.read_ahead(loader)` yielded, as it yielded it (change a batch in the "
    "loader, e.g. its collate function, rather than before the block), or leave `read_ahead` out."
)
_NOTHING = object()  # (no batch yielded yet)
_USE = (
    "Run one block per batch the loop yields, on that batch: `for batch in acc.read_ahead(loader): with "
    "acc.accumulate(batch) as step: ...`; or iterate the loader itself (each block's count is then summed as it opens)."
)


def check_loader(loader: object) -> Iterator[Any]:
    """The iterator over ``loader`` (refused, naming the argument, if it is ``None`` or not iterable)."""
    if loader is None or isinstance(loader, (str, bytes)):
        raise TypeError(
            f"`acc.read_ahead(loader)` needs the loader of the training batches (an iterable: a `DataLoader`, a "
            f"list, a generator); got {loader!r}."
        )
    try:
        return iter(loader)  # type: ignore[call-overload,no-any-return]
    except TypeError:
        raise TypeError(
            f"`acc.read_ahead(loader)` needs the loader of the training batches (an iterable: a `DataLoader`, a "
            f"list, a generator); got {type(loader).__name__}, which is not iterable."
        ) from None


class ReaderLoop:
    """One ``read_ahead`` loop: the loader's batches, those after the one yielded last held (``peek``), and which
    batch the next block must run on. An error the loader raises while read ahead is raised where the loop reaches
    it, as without reading ahead. ``held_over``: a loop over the same iterator that stopped before its end, whose
    held batches this one yields first."""

    def __init__(self, batches: Iterator[Any], held_over: ReaderLoop | None = None) -> None:
        self.batches = batches
        self.held: list[Any] = []  # batches read ahead, not yielded yet
        self._ended = False  # the loader has no more batches
        self._error: Exception | None = None  # what the loader raised where it ended, raised when reached
        if held_over is not None:
            self.held, self._ended, self._error = held_over.held, held_over._ended, held_over._error
            held_over.held = []
        self.position = -1  # the index of the batch yielded last
        self.current: Any = _NOTHING  # the batch yielded last
        self.used = False  # whether a block ran on it
        self.finished = False  # the loop ran out (or was closed, or another began)

    def peek(self, ahead: int) -> Any:
        """The ``ahead``-th batch after the one yielded last (``ahead >= 1``); ``ENDED`` past the loader's end."""
        while len(self.held) < ahead and not self._ended:
            try:
                self.held.append(next(self.batches))
            except StopIteration:
                self._ended = True
            except Exception as error:  # (raised where the loop reaches it: `take`)
                self._ended, self._error = True, error
        return self.held[ahead - 1] if ahead <= len(self.held) else ENDED

    def take(self) -> Any:
        """The next batch (``ENDED`` past the loader's end; the loader's error, where it raised one there)."""
        batch = self.peek(1)
        if batch is not ENDED:
            self.held.pop(0)
        elif self._error is not None:
            error, self._error = self._error, None
            raise error
        return batch

    def one_shot(self) -> bool:
        """Whether the loop reads an iterator that yields each batch once (a generator, ``iter(...)``), so that
        batches it read ahead and did not yield are gone from it."""
        return iter(self.batches) is self.batches


class FabricAhead:
    """What a ``FabricAccumulator`` keeps of its ``read_ahead`` loops: the one under way (a new one ends it), the
    counts read ahead, and the batch the last loop yielded last (a second block on it, after the loop, is refused).

    ``sums()``: whether the counts are summed over ranks ahead (a ``Budget``, several ranks or
    ``_core.ahead.ON_ONE_PROCESS``); else the loop only iterates (its contract checked all the same)."""

    def __init__(self, sums: Callable[[], bool]) -> None:
        self._sums = sums
        self.counts = ReadAhead("`acc.read_ahead(loader)`'s loader yields it", _FIX)
        self.loop: ReaderLoop | None = None  # the loop under way, or the last one

    def start(self, loader: object, strategy: Any, in_block: Callable[[], bool]) -> Iterator[Any]:
        """A new loop over ``loader`` (the one before it, if any, ends: its next batch is refused)."""
        batches, before = check_loader(loader), self.loop
        same = before is not None and before.batches is batches and before.one_shot()
        loop = ReaderLoop(batches, held_over=before if same else None)
        if before is not None:
            before.finished = True
        self.loop = loop
        self.counts.forget()
        return self._run(loop, strategy, in_block)

    def _run(self, loop: ReaderLoop, strategy: Any, in_block: Callable[[], bool]) -> Iterator[Any]:
        try:
            while True:
                if loop is not self.loop:
                    raise RuntimeError(
                        "A `read_ahead` loop went on after another one began: `acc.read_ahead(loader)` ends the loop "
                        "before it (an epoch's loop, then the next), so two loops cannot be interleaved. Finish (or "
                        "break out of) one loop before the next begins."
                    )
                if in_block():
                    raise RuntimeError(
                        "The `read_ahead` loop was moved on inside an `acc.accumulate(...)` block: the block is the "
                        f"micro-batch of the batch the loop yielded last. {_USE}"
                    )
                batch = loop.take()
                if batch is ENDED:
                    loop.finished = True
                    if self._sums():  # (every rank's data ends here, or the ranks that have more are refused)
                        self.counts.end(loop.position + 1, strategy)
                    return
                loop.position, loop.current, loop.used = loop.position + 1, batch, False
                yield batch
        finally:
            loop.finished = True
            if loop.held and loop.one_shot():
                warnings.warn(
                    f"A `read_ahead` loop stopped with {len(loop.held)} batch(es) it had read ahead from its iterator "
                    "and not yielded: a new `acc.read_ahead(it)` over the same iterator yields them first, but reading "
                    "the iterator itself skips them. Go on through `acc.read_ahead(it)`, or give `read_ahead` a "
                    "loader that can be iterated again (a `DataLoader`, a list).",
                    stacklevel=2,
                )

    def position(self, batch: Any) -> int | None:
        """Where the block on ``batch`` stands in the loop under way (its position; marked used), or ``None`` where
        no loop is under way; refuses a block the loop's contract does not allow."""
        loop = self.loop
        if loop is None:
            return None
        if loop.finished:
            if loop.used and batch is loop.current:
                raise RuntimeError(
                    "`acc.accumulate(batch)` ran a second block on the batch the `read_ahead` loop yielded last (after "
                    f"the loop): each batch the loop yields is one micro-batch, counted once. {_USE}"
                )
            return None
        if loop.current is _NOTHING or batch is not loop.current:
            first = loop.current is _NOTHING
            what = "a batch before the loop yielded any" if first else "a batch other than the one it yielded last"
            raise RuntimeError(
                f"`acc.accumulate(batch)` got {what} inside an `acc.read_ahead(loader)` loop: reading ahead takes the "
                f"count of each batch the loop yields as that batch's block's (checked by identity). {_USE}"
            )
        if loop.used:
            raise RuntimeError(
                "`acc.accumulate(batch)` ran a second block on one batch of an `acc.read_ahead(loader)` loop: each "
                f"batch the loop yields is one micro-batch, counted once. {_USE}"
            )
        loop.used = True
        return loop.position

    def total(self, position: int, strategy: Any, current: Callable[[], int], count_of: Callable[[Any], int]) -> int:
        """The count over ranks of the batch at ``position`` in the loop under way (``ReadAhead.total``, the batches
        after it read from the loop), whose own count is ``current()``; ``count_of(batch)``: a batch's count."""
        assert self.loop is not None
        return self.counts.total(position, strategy, current, self.loop.peek, count_of)

    def give_back(self, batch: Any) -> None:
        """The block on ``batch`` raised before its micro-batch was counted: a block may run on it again."""
        loop = self.loop
        if loop is not None and batch is loop.current:
            loop.used = False

    def sums(self) -> bool:
        """Whether the counts are summed ahead (else the loop only iterates)."""
        return self._sums()
