"""``batchnorm="window"``: BatchNorm running statistics that advance once per window, with its pooled statistics.

Each micro-batch's forward is untouched: BatchNorm normalises it by its own statistics. What changes is the
update of the running buffers: while a layer in training mode runs its forward, its running buffers are
swapped for zeroed ones of the same shape (its ``num_batches_tracked`` for ``None``) and its momentum set to 1,
so that BatchNorm's own kernel writes the micro-batch's mean and unbiased variance into them
(``1 * stat + 0 * 0``: exactly the statistics it normalised with, with no pass over the activations of ours).
The zeroed buffers of each layer's first forward in a micro-batch are rows of one block made as the micro-batch
is armed (one allocation for all the layers, one conversion when pooled; a second forward of a layer gets a
block of its own): the hooks run between a forward's kernels, where the CPU's caches are cold and each tensor
operation costs several times what it does elsewhere. The forward hook reads them, pools them and puts the
layer's own buffers back: those are never written
during a forward (autograd keeps the tensors BatchNorm was given, so they must not change in place before
the backward), and between forwards they hold the last closed window's statistics, which is what a
validation inside a window, a checkpoint and an exception see.

Pooling is Chan et al.'s parallel combination of (count, mean, sum of squared deviations), exact in exact
arithmetic and free of the cancellation of raw moments; it runs in float64 (where the device has it) on
O(channels) tensors, so that the only rounding in the buffers' dtype is the one cast of the final update
(``running = (1 - m) * running + m * stat``, ``stat`` the window's mean and unbiased variance). A
micro-batch's forwards' statistics are kept as the kernel wrote them and pooled into the window only when
its backward pass finished (``accept``): a micro-batch that failed, or one trained again after a resume,
adds nothing. Nothing is read on the host: counts are shapes.

``SyncBatchNorm`` on several ranks normalises each forward with the statistics of all ranks' samples, and
its kernel writes those (the mean and the variance unbiased over the global count) into the buffers. Each
rank pools them weighted by its own count, with ``count * variance`` as the forward's sum of squared
deviations (``RankMoments``), and keeps the sum of the forwards' variances. At the window's end one
all-gather per process group (every synchronised layer's count, mean and ``m2`` in one flat tensor) pools
the ranks: their ``m2`` summed with the spread of their means, less that sum of variances once (the
``-1`` each forward's unbiased variance owes over the global count, not per rank), which is the window's
``m2`` over the union exactly, whatever each rank's micro-batch sizes.
"""

from __future__ import annotations

import contextlib
import difflib
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

BatchNormMode = Literal["micro-batch", "window"]
"""How BatchNorm's running statistics follow accumulation: ``"micro-batch"`` (once per micro-batch, as
Lightning and PyTorch) or ``"window"`` (once per window, with the window's pooled statistics)."""
BATCHNORM_MODES = ("micro-batch", "window")


def check_batchnorm(value: object) -> BatchNormMode:
    """Refuse a ``batchnorm`` that is not ``"micro-batch"`` or ``"window"``, naming the argument."""
    if not isinstance(value, str) or value not in BATCHNORM_MODES:
        near = ""
        if isinstance(value, str):  # a near miss: another case, `_` or a space for `-`, a letter off ("windows")
            spelled = value.strip().lower().replace("_", "-").replace(" ", "-")
            close = difflib.get_close_matches(spelled, BATCHNORM_MODES, n=1, cutoff=0.75)
            near = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"`batchnorm` must be 'micro-batch' or 'window'{near}; got {value!r}.")
    return value  # type: ignore[return-value]


#: which ``WindowBatchNorm`` hooks each BatchNorm layer now: an ``attach`` takes a layer over from an earlier owner
#: (whose hooks on it are removed), so that two owners never nest their buffer swaps on one layer (both held
#: weakly: an owner holds its layers, so a strong value would keep the model alive for good)
_OWNERS: weakref.WeakKeyDictionary[_BatchNorm, weakref.ref[WindowBatchNorm]] = weakref.WeakKeyDictionary()


class _Hook:
    """A forward (pre-)hook of a ``WindowBatchNorm``, holding it weakly: a deep copy of the model (``AveragedModel``,
    an EMA) keeps this same hook, which finds the copy's layers unknown to its owner and does nothing; a pickled
    model's hooks come back as hooks of no owner (nothing)."""

    __slots__ = ("after", "owner")

    def __init__(self, owner: WindowBatchNorm | None, after: bool) -> None:
        self.owner = None if owner is None else weakref.ref(owner)
        self.after = after

    def __call__(self, layer: _BatchNorm, args: Any, output: Any = None) -> None:
        owner = None if self.owner is None else self.owner()
        if owner is None:
            return
        if self.after:
            owner._after_forward(layer, args, output)
        else:
            owner._before_forward(layer, args)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Hook:
        return self

    @override
    def __reduce__(self) -> tuple[Any, tuple[None, bool]]:
        return (_Hook, (None, self.after))


class Moments:
    """A group's count, per-channel mean and sum of squared deviations (``m2``), combined exactly.

    Example:

        >>> a, b = torch.tensor([[1.0], [2.0]], dtype=torch.float64), torch.tensor([[4.0]], dtype=torch.float64)
        >>> m = Moments.of(2, a.mean(0), a.var(0))
        >>> m.add(1, b.mean(0), torch.zeros(1, dtype=torch.float64), m2=True)
        >>> m.mean.tolist(), m.variance().tolist()
        ([2.3333333333333335], [2.333333333333333])
    """

    __slots__ = ("count", "m2", "mean")

    def __init__(self, count: int, mean: Tensor, m2: Tensor) -> None:
        self.count, self.mean, self.m2 = count, mean, m2

    @classmethod
    def of(cls, count: int, mean: Tensor, unbiased_var: Tensor, *, fresh: bool = False) -> Moments:
        """A group of ``count`` samples from its mean and unbiased variance (copied, in float64 where possible;
        ``fresh``: ``mean`` is a tensor of the caller's own, in that dtype, which is kept)."""
        dtype = _pool_dtype(mean)
        return cls(count, mean if fresh else mean.to(dtype, copy=True), unbiased_var.to(dtype) * (count - 1))

    def add(self, count: int, mean: Tensor, spread: Tensor, *, m2: bool = False) -> None:
        """Pool in another group of ``count`` samples: its ``mean`` and its unbiased variance (``m2=False``) or
        its sum of squared deviations (``m2=True``)."""
        dtype = self.mean.dtype
        total = self.count + count
        delta = (mean if mean.dtype == dtype else mean.to(dtype)) - self.mean  # (no call where the dtype is right)
        self.mean.add_(delta, alpha=count / total)
        self.m2.add_(spread if spread.dtype == dtype else spread.to(dtype), alpha=1.0 if m2 else count - 1)
        self.m2.addcmul_(delta, delta, value=self.count * count / total)
        self.count = total

    def variance(self) -> Tensor:
        """The unbiased variance of everything pooled."""
        return self.m2 / (self.count - 1)

    def to(self, device: torch.device) -> Moments:
        return Moments(self.count, self.mean.to(device), self.m2.to(device))


class RankMoments(Moments):
    """One rank's part of a ``SyncBatchNorm`` layer's window: each forward's statistics are those of all ranks'
    samples, weighted by this rank's count (``m2`` takes ``count * variance``), and ``once`` sums the forwards'
    unbiased variances, subtracted once when the ranks are pooled (``union``).

    Example:

        >>> a = RankMoments.of(3, torch.tensor([1.0]), torch.tensor([2.0]))  # 3 of this rank's samples
        >>> a.m2.tolist(), a.once.tolist()
        ([6.0], [2.0])
    """

    __slots__ = ("once",)

    def __init__(self, count: int, mean: Tensor, m2: Tensor, once: Tensor) -> None:
        super().__init__(count, mean, m2)
        self.once = once

    @classmethod
    @override
    def of(cls, count: int, mean: Tensor, unbiased_var: Tensor, *, fresh: bool = False) -> RankMoments:
        dtype = _pool_dtype(mean)
        var = unbiased_var if fresh else unbiased_var.to(dtype, copy=True)
        return cls(count, mean if fresh else mean.to(dtype, copy=True), var * count, var)

    @override
    def add(self, count: int, mean: Tensor, spread: Tensor, *, m2: bool = False) -> None:
        if m2:
            raise TypeError("RankMoments pool forwards: a mean and an unbiased variance each")
        var = spread.to(self.mean.dtype)
        super().add(count, mean, var * count, m2=True)
        self.once.add_(var)

    @override
    def to(self, device: torch.device) -> RankMoments:
        return RankMoments(self.count, self.mean.to(device), self.m2.to(device), self.once.to(device))


def union(parts: Tensor, once: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The ranks' parts of one ``SyncBatchNorm`` layer's window (``parts``: a row per rank, ``[count, mean...,
    m2...]``) pooled: the global count, mean and sum of squared deviations, on the device (no host read).
    ``once``: the sum of the window's forwards' variances (the same on every rank).

    Example:

        >>> x = torch.tensor([[1.0], [2.0], [4.0], [7.0]], dtype=torch.float64)  # rank 0: 1 sample, rank 1: 3
        >>> var = x.var(0)  # what SyncBatchNorm's kernel wrote on both ranks (one forward)
        >>> rows = torch.stack([torch.cat([torch.tensor([n], dtype=torch.float64), var.new_tensor(x[s].mean(0)),
        ...                                n * var]) for n, s in ((1, slice(0, 1)), (3, slice(1, 4)))])
        >>> rows[:, 1] = x.mean()  # (a SyncBatchNorm forward gives every rank the union's mean)
        >>> count, mean, m2 = union(rows, var)
        >>> int(count), mean.tolist() == x.mean(0).tolist(), bool(torch.allclose(m2 / 3, var))
        (4, True, True)
    """
    width = (parts.shape[1] - 1) // 2
    counts, means, m2s = parts[:, :1], parts[:, 1 : 1 + width], parts[:, 1 + width :]
    total = counts.sum()
    mean = (counts * means).sum(0) / total
    m2 = m2s.sum(0) + (counts * (means - mean) ** 2).sum(0) - once
    return total, mean, m2


def _pool_dtype(t: Tensor) -> torch.dtype:
    return t.dtype if t.device.type == "mps" else torch.float64  # (MPS has no float64)


class _Rows:
    """The zeroed buffers of one micro-batch's first training forward of each layer that shares the first layer's
    device and dtype (``plan``: their names, each one's width twice, their running means): one allocation for all of
    them (each layer's mean then its variance, each contiguous: one ``split`` gives them all), and one conversion to
    the pooling dtype when their statistics are pooled. The hooks
    run between a forward's kernels, with the CPU's caches cold: a tensor operation there costs several times what
    it does here, where the micro-batch is armed.

    Example:

        >>> rows = _Rows(torch.zeros(2), (["a", "b"], [2, 2, 3, 3], []))
        >>> {name: (m.tolist(), v.tolist()) for name, (m, v, _) in rows.free().items()}
        {'a': ([0.0, 0.0], [0.0, 0.0]), 'b': ([0.0, 0.0, 0.0], [0.0, 0.0, 0.0])}
    """

    __slots__ = ("_split", "data", "plan")

    def __init__(self, like: Tensor, plan: tuple[list[str], list[int], list[Tensor]]) -> None:
        self.plan = plan
        self.data = like.new_zeros(sum(plan[1]))
        self._split: dict[str, tuple[Tensor, Tensor]] | None = None  # (by layer, in the pooling dtype)

    def free(self) -> dict[str, tuple[Tensor, Tensor, _Rows]]:
        """Each layer's mean and variance rows (views of ``data``)."""
        rows = self.data.split_with_sizes(self.plan[1])
        return {name: (mean, var, self) for name, mean, var in zip(self.plan[0], rows[::2], rows[1::2], strict=True)}

    def pooled(self, name: str) -> tuple[Tensor, Tensor]:
        """``name``'s mean and variance as its forward wrote them, in the pooling dtype: every layer's converted at
        the first ask, in one copy of ours (the rows are not written again; the window's ``Moments`` of a layer keep
        and update its mean in place)."""
        if self._split is None:
            rows = self.data.to(_pool_dtype(self.data), copy=True).split_with_sizes(self.plan[1])
            self._split = dict(zip(self.plan[0], zip(rows[::2], rows[1::2], strict=True), strict=True))
        return self._split[name]


class WindowBatchNorm:
    """The BatchNorm layers of one model, their running statistics advanced once per window.

    ``attach(model)`` hooks every ``_BatchNorm`` (1d/2d/3d, ``SyncBatchNorm``, lazy ones); a layer in eval
    mode or with ``track_running_stats=False`` is left alone. The hooks act inside a micro-batch only, from
    ``arm`` to ``accept`` (its backward finished: its statistics join the window) or ``drop_pending`` (it did not
    go in); a forward outside (a probe in a batch-end hook, a loop after the fit, ``update_bn``) is BatchNorm's
    own update. ``commit`` once the window stepped, ``discard`` where it did not.

    Example:

        >>> model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
        >>> stats = WindowBatchNorm()
        >>> stats.attach(model)
        >>> for x in torch.randn(2, 4, 3):  # a window of two micro-batches of 4
        ...     stats.arm(); _ = model(x); stats.accept()
        >>> int(model[1].num_batches_tracked)  # the buffers still hold the last window's
        0
        >>> stats.commit(); int(model[1].num_batches_tracked)
        1
    """

    def __init__(self) -> None:
        self._names: dict[_BatchNorm, str] = {}  # the attached layers (a deep copy's are not among them)
        self._layers: dict[str, _BatchNorm] = {}
        self._handles: dict[str, tuple[RemovableHandle, RemovableHandle]] = {}
        self._window: dict[str, Moments] = {}  # pooled over the window's accepted micro-batches
        #: the forwards of the micro-batch under way, by layer: (count, [mean; unbiased variance]) as the kernel
        #: wrote them, pooled into the window at the micro-batch's end (``accept``)
        self._pending: dict[str, list[tuple[int, Tensor | _Rows]]] = {}
        #: the forwards of finished parts of the micro-batch under way (``hold``: pieces whose backward finished),
        #: which a micro-batch cut short after them keeps (``accept_held``)
        self._held: dict[str, list[tuple[int, Tensor | _Rows]]] = {}
        #: layers inside their forward: their own running buffers, ``num_batches_tracked`` and momentum, and the
        #: block the kernel writes this forward's statistics into (a ``_Rows`` shared by the layers, or its own)
        self._inflight: dict[str, tuple[Tensor, Tensor, Tensor | None, float | None, Tensor | _Rows]] = {}
        #: the zeroed rows of the micro-batch under way not yet written, by layer (``_Rows``, made as it is armed)
        self._free: dict[str, tuple[Tensor, Tensor, _Rows]] = {}
        #: the layers one ``_Rows`` serves (their running means: a buffer replaced, ``model.to(...)``, plans again)
        self._plan: tuple[list[str], list[int], list[Tensor]] | None = None
        self._loaded: dict[str, Moments] = {}  # a checkpoint's window, till its layers are attached
        #: `SyncBatchNorm` layers that synchronise (several ranks in their group): their process group
        self._groups: dict[str, Any] = {}
        self._scratch: dict[str, Tensor] = {}  # a `SyncBatchNorm`'s `num_batches_tracked` inside its forward
        self.paused = False  # forwards that must not count (a replayed forward): buffers kept, nothing pooled
        self._suspended = False  # the layers update their statistics themselves (SWA's BatchNorm epoch)
        self._armed = False  # inside a micro-batch: the hooks swap and pool (else a forward is BatchNorm's own)

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self, model: nn.Module) -> None:
        """Hook every BatchNorm layer of ``model`` (again: the hooks of an earlier ``attach`` are removed; a layer
        another ``WindowBatchNorm`` hooks is taken over from it)."""
        self.detach()
        for name, layer in model.named_modules():
            if isinstance(layer, _BatchNorm):
                owner = _OWNERS.get(layer)
                previous = None if owner is None else owner()
                if previous is not None and previous is not self:
                    previous._give_up(layer, taken_over=True)
                _OWNERS[layer] = weakref.ref(self)
                self._names[layer], self._layers[name] = name, layer
                if isinstance(layer, nn.SyncBatchNorm):  # (it refuses a `num_batches_tracked` of None)
                    self._scratch[name] = torch.zeros((), dtype=torch.long, device=layer.num_batches_tracked.device)  # type: ignore[union-attr]
                    group = layer.process_group or (dist.group.WORLD if dist.is_initialized() else None)
                    if group is not None and dist.get_world_size(group) > 1:
                        self._groups[name] = group
                self._handles[name] = (
                    layer.register_forward_pre_hook(_Hook(self, after=False)),
                    layer.register_forward_hook(_Hook(self, after=True)),
                )
        self._adopt(self._loaded)
        self._loaded = {}
        self._plan, self._free = None, {}

    def detach(self) -> None:
        """Remove every hook (the pooled window is kept, for a fit that goes on)."""
        self.disarm()
        for name in list(self._handles):
            self._give_up(self._layers[name], taken_over=False)
        self._loaded.update(self._window)
        self._window = {}
        self._names, self._layers, self._groups, self._scratch, self._handles = {}, {}, {}, {}, {}
        self._plan, self._free = None, {}

    def _give_up(self, layer: _BatchNorm, *, taken_over: bool) -> None:
        """Unhook ``layer`` (its own buffers back if a forward of it failed): detached, or taken over by another
        owner (this one's window then holds nothing of it)."""
        name = self._names.pop(layer, None)
        if name is None:
            return
        inflight = self._inflight.pop(name, None)
        if inflight is not None:
            self._put_back(layer, inflight)
        for handle in self._handles.pop(name, ()):
            handle.remove()
        owner = _OWNERS.get(layer)
        if owner is not None and owner() is self:
            del _OWNERS[layer]
        if taken_over:  # (this owner goes on with its other layers, if any)
            self._plan, self._free = None, {}
            del self._layers[name]
            for kept in (self._window, self._pending, self._held, self._groups, self._scratch):
                kept.pop(name, None)

    # ------------------------------------------------------------------ the hooks
    def arm(self) -> None:
        """A micro-batch begins: till ``accept`` or ``drop_pending``, the layers' training forwards are pooled (the
        rows their first forwards write made now, where a row was taken since: one allocation)."""
        self._armed = True
        plan = self._plan
        layers = self._layers
        if plan is None or not all(
            layers[name]._buffers.get("running_mean") is mean for name, mean in zip(plan[0], plan[2], strict=True)
        ):  # (a buffer replaced since: `model.to(...)`, `.double()`)
            plan = self._plan = self._new_plan()
            self._free = {}
        if len(self._free) != len(plan[0]):
            self._free = _Rows(plan[2][0], plan).free() if plan[0] else {}

    def _new_plan(self) -> tuple[list[str], list[int], list[Tensor]]:
        """The layers one ``_Rows`` serves (their names, each one's width twice, their running means): those whose
        running buffers are on the first such layer's device, in its dtype (a lazy layer not yet initialised waits
        for a later plan)."""
        names: list[str] = []
        widths: list[int] = []
        means: list[Tensor] = []
        for name, layer in self._layers.items():
            mean, var = layer._buffers.get("running_mean"), layer._buffers.get("running_var")
            if not isinstance(mean, Tensor) or not isinstance(var, Tensor):
                continue
            if isinstance(mean, nn.parameter.UninitializedBuffer) or isinstance(var, nn.parameter.UninitializedBuffer):
                continue  # (a lazy layer before its first forward)
            if mean.dim() != 1 or mean.numel() == 0 or var.shape != mean.shape or var.dtype != mean.dtype:
                continue
            if means and (mean.device != means[0].device or mean.dtype != means[0].dtype):
                continue
            names.append(name)
            widths += [mean.numel()] * 2  # (its mean's row, then its variance's)
            means.append(mean)
        return names, widths, means

    def disarm(self) -> None:
        """Outside a micro-batch: a forward is BatchNorm's own update (a layer whose forward failed put back)."""
        self._armed = False
        if self._inflight:
            self.recover()

    def suspend(self) -> None:
        """Till ``resume``: the layers update their statistics themselves, every forward (a loop of forwards with
        no backward, such as Stochastic Weight Averaging's BatchNorm epoch)."""
        self._suspended = True

    def resume(self) -> None:
        """The window's statistics again (after ``suspend``)."""
        self._suspended = False

    @contextlib.contextmanager
    def one_update(self) -> Iterator[None]:
        """The training forwards inside make one BatchNorm update together, with their pooled statistics, as one
        forward of all their samples would (a loader batch's pieces in Stochastic Weight Averaging's BatchNorm
        epoch, which runs no backward: ``update_bn`` over the loader's batches, not over the pieces). Suspended or
        not, and whatever window is open (kept aside); a forward that raised adds nothing."""
        window, self._window = self._window, {}
        suspended, self._suspended = self._suspended, False
        self.drop_pending()
        self.arm()
        try:
            yield
            self.accept()
            self.commit()
        finally:
            self.drop_pending()  # (after an exception: nothing of it pooled, a layer whose forward raised put back)
            self._window, self._suspended = window, suspended

    def _before_forward(self, layer: _BatchNorm, args: Any) -> None:
        name = self._names.get(layer)
        if name is None:  # (a deep copy's layer, or one taken over)
            return
        stale = self._inflight.pop(name, None)
        if stale is not None:  # its last forward raised inside (a caught error): its own buffers back first
            self._put_back(layer, stale)
        if not (self._armed and not self._suspended and layer.training and layer.track_running_stats):
            return
        held = layer._buffers
        mean, var = held.get("running_mean"), held.get("running_var")
        if mean is None or var is None:
            return
        # BatchNorm's kernel writes this micro-batch's mean and unbiased variance into zeroed buffers: the rows
        # `arm` made for the layer's first forward, else (a second forward of it, or a layer the rows do not serve)
        # the two rows of a block of its own (straight into the module's dicts: `nn.Module.__setattr__` costs more
        # than the rest of the hook)
        free = self._free.pop(name, None)
        block: Tensor | _Rows
        if free is None:
            block = mean.new_zeros((2, *mean.shape))
            row_mean, row_var = block.unbind(0)
        else:
            row_mean, row_var, block = free
        self._inflight[name] = (mean, var, held.get("num_batches_tracked"), layer.momentum, block)
        held["running_mean"], held["running_var"] = row_mean, row_var
        held["num_batches_tracked"] = self._scratch.get(name)
        layer.__dict__["momentum"] = 1.0

    def _after_forward(self, layer: _BatchNorm, args: Any, output: Any) -> None:
        name = self._names.get(layer)
        if name is None or name not in self._inflight:
            return
        block = self._put_back(layer, self._inflight.pop(name))
        if not self.paused:
            x = args[0]
            forward = (x.numel() // x.shape[1], block)
            pending = self._pending.get(name)
            if pending is None:
                self._pending[name] = [forward]
            else:
                pending.append(forward)

    @staticmethod
    def _put_back(
        layer: _BatchNorm, inflight: tuple[Tensor, Tensor, Tensor | None, float | None, Tensor | _Rows]
    ) -> Tensor | _Rows:
        """The layer's own buffers and momentum back; returns the block its forward wrote."""
        held = layer._buffers
        held["running_mean"], held["running_var"], held["num_batches_tracked"], layer.__dict__["momentum"], block = (
            inflight
        )
        return block

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Forwards inside add nothing and leave the buffers as they are (the graph-free pass of the cached
        backward, whose replay is the one that counts)."""
        paused, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = paused

    # ------------------------------------------------------------------ the window
    def accept(self) -> None:
        """The micro-batch under way is in the window (its backward finished): its statistics join it, and the
        hooks rest till the next micro-batch (``arm``)."""
        self.disarm()
        if self._held:
            self.accept_held()
        self._pool(self._pending)
        self._pending = {}

    def hold(self) -> None:
        """A finished part of the micro-batch under way (a piece whose backward finished): its forwards are kept
        with it, also if the micro-batch is cut short after it (``accept_held``)."""
        for name, forwards in self._pending.items():
            self._held.setdefault(name, []).extend(forwards)
        self._pending = {}

    def accept_held(self) -> None:
        """The finished parts of a micro-batch cut short are in the window (a checkpoint keeps their gradient):
        their statistics join it; the rest of the micro-batch's forwards are left for ``drop_pending``."""
        self._pool(self._held)
        self._held = {}

    def _pool(self, forwards_by_layer: Mapping[str, list[tuple[int, Tensor | _Rows]]]) -> None:
        for name, forwards in forwards_by_layer.items():
            pooled = self._window.get(name)
            for count, block in forwards:
                if isinstance(block, _Rows):
                    mean, var = block.pooled(name)  # (all its layers converted at once, a copy of ours)
                else:
                    mean, var = block.to(_pool_dtype(block)).unbind(0)  # (a block of ours: no copy kept of it)
                if pooled is None:
                    kind = RankMoments if name in self._groups else Moments
                    pooled = self._window[name] = kind.of(count, mean, var, fresh=True)
                else:
                    pooled.add(count, mean, var)

    def drop_pending(self) -> None:
        """Forget the statistics of forwards whose micro-batch is not in the window (it failed, or a batch
        trained again after a resume ran them); a layer whose forward failed gets its own buffers back, and the
        hooks rest till the next micro-batch."""
        self.disarm()
        self._pending, self._held = {}, {}

    def commit(self) -> None:
        """The window stepped: one BatchNorm update of each layer it reached, with its pooled statistics (those
        of all ranks for a synchronising ``SyncBatchNorm``: one all-gather per process group)."""
        self.recover()
        self.drop_pending()
        stats = {
            name: (pooled.mean, pooled.variance()) for name, pooled in self._window.items() if name not in self._groups
        }
        stats.update({name: (mean, m2 / (count - 1)) for name, (count, mean, m2) in self._union().items()})
        for name, (stat_mean, stat_var) in stats.items():
            layer = self._layers.get(name)
            if layer is None:  # (detached: kept for a fit that goes on)
                continue
            mean, var, nbt = layer.running_mean, layer.running_var, layer.num_batches_tracked
            assert mean is not None and var is not None
            factor: float | Tensor
            if nbt is not None:
                nbt.add_(1)
            if layer.momentum is None:  # the cumulative average, over windows (read on the device)
                assert nbt is not None
                factor = nbt.to(stat_mean.dtype).reciprocal()
                mean.copy_(stat_mean * factor + mean.to(stat_mean.dtype) * (1 - factor))
                var.copy_(stat_var * factor + var.to(stat_mean.dtype) * (1 - factor))
            else:  # (the same arithmetic, `(1 - factor) * old` as `add`'s alpha: one operation fewer)
                factor = float(layer.momentum)
                mean.copy_(torch.add(stat_mean * factor, mean.to(stat_mean.dtype), alpha=1 - factor))
                var.copy_(torch.add(stat_var * factor, var.to(stat_mean.dtype), alpha=1 - factor))
        self._window = {}

    def _union(self) -> dict[str, tuple[Tensor, Tensor, Tensor]]:
        """The synchronising ``SyncBatchNorm`` layers' window over all ranks (its count, mean and ``m2``): every
        such layer of a process group in one flat tensor (zeros for a layer this window did not reach), one
        all-gather."""
        out: dict[str, tuple[Tensor, Tensor, Tensor]] = {}
        by_group: dict[int, list[str]] = {}
        for name in sorted(self._groups):
            by_group.setdefault(id(self._groups[name]), []).append(name)
        for names in by_group.values():
            group = self._groups[names[0]]
            rows, once = [], {}
            for name in names:
                layer, pooled = self._layers[name], self._window.get(name)
                width = layer.num_features
                device = layer.running_mean.device  # type: ignore[union-attr]
                if isinstance(pooled, RankMoments):
                    count = torch.tensor([pooled.count], dtype=pooled.mean.dtype, device=device)
                    rows.append(torch.cat([count, pooled.mean, pooled.m2]))
                    once[name] = pooled.once
                else:
                    rows.append(torch.zeros(1 + 2 * width, dtype=_pool_dtype(layer.running_mean), device=device))  # type: ignore[arg-type]
            flat = torch.cat(rows)
            gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
            dist.all_gather(gathered, flat, group=group)
            table = torch.stack(gathered)
            offset = 0
            for name, row in zip(names, rows, strict=True):
                if name in once:
                    out[name] = union(table[:, offset : offset + len(row)], once[name])
                offset += len(row)
        return out

    def discard(self) -> None:
        """The window was not stepped: its statistics are forgotten, the buffers hold the last window's."""
        self.recover()
        self._window, self._pending, self._held, self._loaded = {}, {}, {}, {}

    def recover(self) -> None:
        """After an exception inside a layer's forward: its momentum and buffers put back."""
        for name, own in self._inflight.items():
            layer = self._layers.get(name)
            if layer is not None:
                self._put_back(layer, own)
        self._inflight = {}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The open window's pooled statistics, by layer name. A synchronising ``SyncBatchNorm``'s are those of
        all ranks (one all-gather: every rank must ask, as Lightning's and Fabric's checkpoints do), so that the
        checkpoint rank 0 writes holds the whole window's, on any world size it is resumed on."""
        held = {**self._loaded, **self._window}
        out = {name: {"count": m.count, "mean": m.mean.clone(), "m2": m.m2.clone()} for name, m in held.items()}
        for name, (count, mean, m2) in self._union().items():
            out[name] = {"count": round(float(count)), "mean": mean, "m2": m2}
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.discard()
        loaded = {name: Moments(int(s["count"]), s["mean"].clone(), s["m2"].clone()) for name, s in dict(state).items()}
        if self._layers:
            self._adopt(loaded)
        else:
            self._loaded = loaded

    def _adopt(self, loaded: Mapping[str, Moments]) -> None:
        """A checkpoint's window statistics into the attached layers' window, on their devices. A synchronising
        ``SyncBatchNorm`` layer's (the whole window's, over the ranks that wrote it) go to the first rank of its
        group only, as its part before this run's forwards (no variance owed: ``once`` zero)."""
        unknown = sorted(set(loaded) - set(self._layers))
        if unknown:
            raise ValueError(
                f"The checkpoint holds the window's BatchNorm statistics of layers {unknown} that this model does "
                "not have: resume with the model the checkpoint was written with."
            )
        for name, moments in loaded.items():
            device = self._layers[name].running_mean.device  # type: ignore[union-attr]
            group = self._groups.get(name)
            if group is None:
                self._window[name] = moments.to(device)
            elif dist.get_rank(group) == 0:
                m = moments.to(device)
                self._window[name] = RankMoments(m.count, m.mean, m.m2, torch.zeros_like(m.mean))
