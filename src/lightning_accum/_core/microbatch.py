"""Split a batch into micro-batches along dim 0, and recognise out-of-memory errors.

A batch is any nesting of tensors in dicts, lists, tuples (named too) and dataclasses; every
tensor leaf is split along its first dimension, which must be the same for all of them. ``None``
leaves are carried along unchanged; any other leaf (a string, a number) cannot be split and is
refused with an error that names where it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

OOM_ERRORS: tuple[type[BaseException], ...] = tuple(
    {getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError), torch.cuda.OutOfMemoryError}
)


def batch_length(batch: Any) -> int:
    """The common size of dim 0 of every tensor in ``batch``."""
    sizes: dict[str, int] = {}
    _collect(batch, "batch", sizes)
    if not sizes:
        raise ValueError("The batch holds no tensor with a batch dimension to split along.")
    if len(set(sizes.values())) > 1:
        listing = ", ".join(f"{path}: {n}" for path, n in sizes.items())
        raise ValueError(f"The batch's tensors differ in size along dim 0 ({listing}); they must agree to be split.")
    return next(iter(sizes.values()))


def _collect(obj: Any, path: str, sizes: dict[str, int]) -> None:
    if isinstance(obj, Tensor):
        if obj.ndim == 0:
            raise ValueError(f"`{path}` is a 0-d tensor: it has no batch dimension to split.")
        sizes[path] = obj.shape[0]
    elif obj is None:
        return
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            _collect(value, f"{path}[{key!r}]", sizes)
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            _collect(value, f"{path}[{i}]", sizes)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _collect(getattr(obj, f.name), f"{path}.{f.name}", sizes)
    else:
        raise ValueError(
            f"`{path}` is a {type(obj).__name__}, which cannot be split into micro-batches; keep only tensors "
            "(and dicts, lists, tuples or dataclasses of them) in a batch that is split."
        )


def _slice(obj: Any, start: int, stop: int) -> Any:
    if isinstance(obj, Tensor):
        return obj[start:stop]
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return type(obj)({key: _slice(value, start, stop) for key, value in obj.items()})  # type: ignore[call-arg]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(_slice(value, start, stop) for value in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(_slice(value, start, stop) for value in obj)
    fields = {f.name: _slice(getattr(obj, f.name), start, stop) for f in dataclasses.fields(obj)}
    return dataclasses.replace(obj, **fields)


def split(batch: Any, size: int) -> list[Any]:
    """``batch`` cut into consecutive micro-batches of ``size`` samples (the last may be shorter).

    Example:

        >>> parts = split({"x": torch.zeros(5, 2), "y": torch.arange(5)}, 2)
        >>> [len(p["y"]) for p in parts]
        [2, 2, 1]
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"`size` must be an int >= 1 (samples per micro-batch); got {size!r}.")
    n = batch_length(batch)
    return [_slice(batch, start, min(start + size, n)) for start in range(0, n, size)]


def cut(batch: Any, start: int, stop: int) -> Any:
    """Samples ``start:stop`` of ``batch`` (every tensor leaf sliced along dim 0; views, no copy).

    Example:

        >>> cut({"x": torch.arange(5)}, 1, 3)["x"]
        tensor([1, 2])
    """
    return _slice(batch, start, stop)


def is_oom(error: BaseException) -> bool:
    """Whether ``error`` is a (CUDA) out-of-memory error."""
    return isinstance(error, OOM_ERRORS) or ("out of memory" in str(error).lower() and isinstance(error, RuntimeError))


class AutoSize:
    """``backward_microbatches(size="auto")``: the micro-batch size found on out-of-memory, and each
    window's batches and loss functions, so that the window can be redone from its start at a
    smaller size. All ranks agree on their smallest size at each window's end.

    Example:

        >>> auto = AutoSize()
        >>> auto.remember((0,), {"x": torch.zeros(8)}, lambda part: part["x"].sum())
        >>> auto.size_for({"x": torch.zeros(8)}), len(auto.replay((0,)))
        (8, 1)
        >>> auto.halve(8); auto.size
        4
    """

    def __init__(self) -> None:
        self.size: int | None = None  # samples per micro-batch, once an out-of-memory error set it
        self._replay: dict[tuple[int, ...], list[tuple[Any, Any, Any]]] = {}  # group -> its (batch, loss_fn, weight)

    def size_for(self, batch: Any) -> int:
        """The size to split ``batch`` with: the size found, or the whole batch."""
        return self.size or batch_length(batch)

    def replay(self, key: tuple[int, ...]) -> list[tuple[Any, Any, Any]]:
        """The window's auto-sized passes so far, in order: ``(batch, loss_fn, weight)``."""
        return list(self._replay.get(key, ()))

    def passes(self, key: tuple[int, ...]) -> int:
        """How many auto-sized passes the window holds."""
        return len(self._replay.get(key, ()))

    def remember(self, key: tuple[int, ...], batch: Any, loss_fn: Any, weight: Any = None) -> None:
        """An auto-sized pass, to be redone after out-of-memory (``weight``: what the whole batch's loss is
        weighted by, as its block counted it)."""
        self._replay.setdefault(key, []).append((batch, loss_fn, weight))

    def halve(self, size: int) -> None:
        """After out-of-memory at ``size``."""
        self.size = max(1, size // 2)

    def forget(self, key: tuple[int, ...]) -> None:
        """The window was dropped unstepped: its passes are not redone."""
        self._replay.pop(key, None)

    def window_closed(self, key: tuple[int, ...], strategy: Any, world: int) -> None:
        """Forget the window's passes; if it auto-sized (on every rank), all take the smallest size."""
        if self._replay.pop(key, None) and world > 1:
            unset = 2**62
            size = torch.tensor(self.size or unset, device=strategy.root_device)
            agreed = int(strategy.reduce(size, reduce_op="min"))
            self.size = None if agreed == unset else agreed
