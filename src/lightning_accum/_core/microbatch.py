"""Split a batch into micro-batches along dim 0, and recognise out-of-memory errors.

A batch is any nesting of tensors in dicts, lists, tuples (named too) and dataclasses. By default every
tensor leaf is per-sample: it is cut along its first dimension, which must be the same for all of them
(a tensor whose dim 0 matches the batch's only by chance, a per-class weight of shape (4,) beside batches
of 4, cannot be told apart from a per-sample one and is cut too). ``None`` leaves are carried along
unchanged; any other leaf (a string, a number) cannot be split and is refused with an error that names
where it is. A ``split(path, leaf) -> bool`` rule (``Split``) says which leaves are cut: ``True`` for a
per-sample tensor, ``False`` for a leaf every piece gets whole (any type); ``path`` is the tuple of keys,
indices and field names that leads to the leaf.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

Split = Callable[[tuple[Any, ...], Any], bool]
"""``split(path, leaf) -> bool``: whether a leaf of a batch is cut along dim 0 into the micro-batches
(``True``: one row per sample) or handed whole to each of them (``False``: a per-class weight, a shared prompt,
a task name). ``path`` leads to the leaf: ``("class_weight",)``, ``("inputs", "mask")``, ``(0,)``."""

OOM_ERRORS: tuple[type[BaseException], ...] = tuple(
    {getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError), torch.cuda.OutOfMemoryError}
)


def check_split(value: object, where: str) -> Split | None:
    """``split=``: ``None`` or a callable ``split(path, leaf) -> bool``, or a ``TypeError`` naming it (``where``)."""
    if value is None or (callable(value) and not isinstance(value, type)):
        return value  # type: ignore[return-value]
    raise TypeError(
        f"`split` of {where} must be None (every tensor is cut along dim 0) or a function `split(path, leaf) -> "
        f"bool` (True: cut the leaf along dim 0; False: give it whole to every piece), e.g. "
        f"`split=lambda path, leaf: path != ('class_weight',)`; got {value!r}."
    )


def _cuts(rule: Split | None, path: tuple[Any, ...], leaf: Any) -> bool:
    """Whether ``leaf`` is cut: the rule's answer (checked), or by default whether it is a tensor."""
    if rule is None:
        return isinstance(leaf, Tensor)
    answer = rule(path, leaf)
    if not isinstance(answer, bool):
        raise TypeError(
            f"`split` returned {answer!r} for `{_name(path)}`; it must return True (cut the leaf along dim 0) or "
            "False (give it whole to every piece)."
        )
    if answer and not (isinstance(leaf, Tensor) and leaf.ndim):
        what = "a 0-d tensor" if isinstance(leaf, Tensor) else f"a {type(leaf).__name__}"
        raise TypeError(
            f"`split` returned True for `{_name(path)}`, {what}, which has no dim 0 to cut: return False for it (every "
            "piece gets it whole), or give it as a tensor with one row per sample."
        )
    return answer


def _name(path: tuple[Any, ...]) -> str:
    return "batch" + "".join(f"[{key!r}]" for key in path)


def batch_length(batch: Any, rule: Split | None = None) -> int:
    """The common size of dim 0 of every tensor in ``batch`` that is cut (all of them without ``rule``)."""
    sizes: dict[str, int] = {}
    _collect(batch, (), sizes, rule)
    if not sizes:
        if rule is not None:
            raise ValueError("`split` returned False for every leaf of the batch: nothing is left to cut into pieces.")
        raise ValueError("The batch holds no tensor with a batch dimension to split along.")
    if len(set(sizes.values())) > 1:
        listing = ", ".join(f"{path}: {n}" for path, n in sizes.items())
        fix = (
            " A tensor that is not one row per sample (a per-class weight, a shared prompt) must be given whole to "
            "every piece: give `split=lambda path, leaf: ...` returning False for it."
        )
        raise ValueError(
            f"The batch's tensors differ in size along dim 0 ({listing}); they must agree to be split.{fix}"
        )
    return next(iter(sizes.values()))


def _collect(obj: Any, path: tuple[Any, ...], sizes: dict[str, int], rule: Split | None) -> None:
    if obj is None:
        return
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            _collect(value, (*path, key), sizes, rule)
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            _collect(value, (*path, i), sizes, rule)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _collect(getattr(obj, f.name), (*path, f.name), sizes, rule)
    elif _cuts(rule, path, obj):
        if obj.ndim == 0:
            raise ValueError(f"`{_name(path)}` is a 0-d tensor: it has no batch dimension to split.")
        sizes[_name(path)] = obj.shape[0]
    elif rule is None:
        raise ValueError(
            f"`{_name(path)}` is a {type(obj).__name__}, which cannot be split into micro-batches; keep only tensors "
            "(and dicts, lists, tuples or dataclasses of them) in a batch that is split, or give `split=` a function "
            "that returns False for it (every piece then gets it whole)."
        )


def _slice(obj: Any, start: int, stop: int, rule: Split | None = None, path: tuple[Any, ...] = ()) -> Any:
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return type(obj)({key: _slice(value, start, stop, rule, (*path, key)) for key, value in obj.items()})  # type: ignore[call-arg]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(_slice(value, start, stop, rule, (*path, i)) for i, value in enumerate(obj)))
    if isinstance(obj, list | tuple):
        return type(obj)(_slice(value, start, stop, rule, (*path, i)) for i, value in enumerate(obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {
            f.name: _slice(getattr(obj, f.name), start, stop, rule, (*path, f.name)) for f in dataclasses.fields(obj)
        }
        return dataclasses.replace(obj, **fields)
    return obj[start:stop] if _cuts(rule, path, obj) else obj


def split(batch: Any, size: int, rule: Split | None = None) -> list[Any]:
    """``batch`` cut into consecutive micro-batches of ``size`` samples (the last may be shorter); ``rule``:
    which leaves are cut (``Split``; by default every tensor).

    Example:

        >>> parts = split({"x": torch.zeros(5, 2), "y": torch.arange(5)}, 2)
        >>> [len(p["y"]) for p in parts]
        [2, 2, 1]
        >>> weighted = {"x": torch.zeros(4, 2), "w": torch.ones(3)}
        >>> [p["w"].shape[0] for p in split(weighted, 2, lambda path, leaf: path != ("w",))]
        [3, 3]
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"`size` must be an int >= 1 (samples per micro-batch); got {size!r}.")
    n = batch_length(batch, rule)
    return [_slice(batch, start, min(start + size, n), rule) for start in range(0, n, size)]


def cut(batch: Any, start: int, stop: int, rule: Split | None = None) -> Any:
    """Samples ``start:stop`` of ``batch`` (every tensor leaf that is cut sliced along dim 0; views, no copy).

    Example:

        >>> cut({"x": torch.arange(5)}, 1, 3)["x"]
        tensor([1, 2])
    """
    return _slice(batch, start, stop, rule)


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

    def size_for(self, batch: Any, rule: Split | None = None) -> int:
        """The size to split ``batch`` with: the size found, or the whole batch (``rule``: what is cut)."""
        return self.size or batch_length(batch, rule)

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
