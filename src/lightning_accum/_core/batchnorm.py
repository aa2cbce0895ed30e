"""``batchnorm="window"``: BatchNorm running statistics that advance once per window, with its pooled statistics.

Each micro-batch's forward is untouched: BatchNorm normalises it by its own statistics. What changes is the
update of the running buffers: while a layer in training mode runs its forward, its running buffers are
swapped for zeroed ones of the same shape (its ``num_batches_tracked`` for ``None``) and its momentum set to 1,
so that BatchNorm's own kernel writes the micro-batch's mean and unbiased variance into them
(``1 * stat + 0 * 0``: exactly the statistics it normalised with, with no pass over the activations of ours).
The forward hook reads them, pools them and puts the layer's own buffers back: those are never written
during a forward (autograd keeps the tensors BatchNorm was given, so they must not change in place before
the backward), and between forwards they hold the last closed window's statistics, which is what a
validation inside a window, a checkpoint and an exception see.

Pooling is Chan et al.'s parallel combination of (count, mean, sum of squared deviations), exact in exact
arithmetic and free of the cancellation of raw moments; it runs in float64 (where the device has it) on
O(channels) tensors, so that the only rounding in the buffers' dtype is the one cast of the final update
(``running = (1 - m) * running + m * stat``, ``stat`` the window's mean and unbiased variance). A
micro-batch's statistics are first pooled into the micro-batch under way and join the window only when
its backward pass finished (``accept``): a micro-batch that failed, or one trained again after a resume,
adds nothing. Nothing is read on the host: counts are shapes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.hooks import RemovableHandle

BatchNormMode = Literal["micro-batch", "window"]
"""How BatchNorm's running statistics follow accumulation: ``"micro-batch"`` (once per micro-batch, as
Lightning and PyTorch) or ``"window"`` (once per window, with the window's pooled statistics)."""
BATCHNORM_MODES = ("micro-batch", "window")


def check_batchnorm(value: object) -> BatchNormMode:
    """Refuse a ``batchnorm`` that is not ``"micro-batch"`` or ``"window"``, naming the argument."""
    if not isinstance(value, str) or value not in BATCHNORM_MODES:
        spelled = value.strip().lower().replace("_", "-").replace(" ", "-") if isinstance(value, str) else None
        near = f" (did you mean {spelled!r}?)" if spelled in BATCHNORM_MODES else ""
        raise ValueError(f"`batchnorm` must be 'micro-batch' or 'window'{near}; got {value!r}.")
    return value  # type: ignore[return-value]


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
    def of(cls, count: int, mean: Tensor, unbiased_var: Tensor) -> Moments:
        """A group of ``count`` samples from its mean and unbiased variance (copied, in float64 where possible)."""
        dtype = _pool_dtype(mean)
        return cls(count, mean.to(dtype, copy=True), unbiased_var.to(dtype) * (count - 1))

    def add(self, count: int, mean: Tensor, spread: Tensor, *, m2: bool = False) -> None:
        """Pool in another group of ``count`` samples: its ``mean`` and its unbiased variance (``m2=False``) or
        its sum of squared deviations (``m2=True``)."""
        dtype = self.mean.dtype
        total = self.count + count
        delta = mean.to(dtype) - self.mean
        self.mean.add_(delta, alpha=count / total)
        self.m2.add_(spread.to(dtype), alpha=1.0 if m2 else count - 1)
        self.m2.addcmul_(delta, delta, value=self.count * count / total)
        self.count = total

    def merge(self, other: Moments) -> None:
        """Pool ``other`` in."""
        self.add(other.count, other.mean, other.m2, m2=True)

    def variance(self) -> Tensor:
        """The unbiased variance of everything pooled."""
        return self.m2 / (self.count - 1)

    def to(self, device: torch.device) -> Moments:
        return Moments(self.count, self.mean.to(device), self.m2.to(device))


def _pool_dtype(t: Tensor) -> torch.dtype:
    return t.dtype if t.device.type == "mps" else torch.float64  # (MPS has no float64)


class WindowBatchNorm:
    """The BatchNorm layers of one model, their running statistics advanced once per window.

    ``attach(model)`` hooks every ``_BatchNorm`` (1d/2d/3d, ``SyncBatchNorm``, lazy ones); a layer in eval
    mode or with ``track_running_stats=False`` is left alone. ``accept`` after a micro-batch's backward,
    ``commit`` once its window stepped, ``discard`` where it did not, ``drop_pending`` at a batch's end.

    Example:

        >>> model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
        >>> stats = WindowBatchNorm()
        >>> stats.attach(model)
        >>> for x in torch.randn(2, 4, 3):  # a window of two micro-batches of 4
        ...     _ = model(x); stats.accept()
        >>> int(model[1].num_batches_tracked)  # the buffers still hold the last window's
        0
        >>> stats.commit(); int(model[1].num_batches_tracked)
        1
    """

    def __init__(self) -> None:
        self._names: dict[_BatchNorm, str] = {}  # the attached layers
        self._layers: dict[str, _BatchNorm] = {}
        self._handles: list[RemovableHandle] = []
        self._window: dict[str, Moments] = {}  # pooled over the window's accepted micro-batches
        self._pending: dict[str, Moments] = {}  # pooled over the micro-batch under way
        #: layers inside their forward: their own running buffers, ``num_batches_tracked`` and momentum
        self._inflight: dict[str, tuple[Tensor, Tensor, Tensor | None, float | None]] = {}
        self._loaded: dict[str, Moments] = {}  # a checkpoint's window, till its layers are attached
        self.paused = False  # forwards that must not count (a replayed forward): buffers kept, nothing pooled
        self.enabled = True  # False: the layers update their statistics themselves (SWA's BatchNorm epoch)

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self, model: nn.Module) -> None:
        """Hook every BatchNorm layer of ``model`` (again: the hooks of an earlier ``attach`` are removed)."""
        self.detach()
        for name, layer in model.named_modules():
            if isinstance(layer, _BatchNorm):
                self._names[layer], self._layers[name] = name, layer
                self._handles.append(layer.register_forward_pre_hook(self._before_forward))
                self._handles.append(layer.register_forward_hook(self._after_forward))
        self._adopt(self._loaded)
        self._loaded = {}

    def detach(self) -> None:
        """Remove the hooks (the pooled window is kept, for a fit that goes on)."""
        self.recover()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._loaded.update(self._window)
        self._window = {}
        self._names, self._layers = {}, {}

    # ------------------------------------------------------------------ the hooks
    def _before_forward(self, layer: _BatchNorm, args: Any) -> None:
        if not (self.enabled and layer.training and layer.track_running_stats) or layer.running_mean is None:
            return
        mean, var = layer.running_mean, layer.running_var
        assert var is not None
        self._inflight[self._names[layer]] = (mean, var, layer.num_batches_tracked, layer.momentum)
        # BatchNorm's kernel writes this micro-batch's mean and unbiased variance into zeroed buffers
        # (straight into the module's dicts: `nn.Module.__setattr__` costs more than the rest of the hook)
        held = layer._buffers
        held["running_mean"], held["running_var"] = torch.zeros_like(mean), torch.zeros_like(var)
        held["num_batches_tracked"] = None
        layer.__dict__["momentum"] = 1.0

    def _after_forward(self, layer: _BatchNorm, args: Any, output: Any) -> None:
        name = self._names[layer]
        if name not in self._inflight:
            return
        mean, var = layer.running_mean, layer.running_var
        assert mean is not None and var is not None
        self._put_back(layer, self._inflight.pop(name))
        if not self.paused:
            x = args[0]
            count = x.numel() // x.shape[1]
            pending = self._pending.get(name)
            if pending is None:
                self._pending[name] = Moments.of(count, mean, var)
            else:
                pending.add(count, mean, var)

    @staticmethod
    def _put_back(layer: _BatchNorm, own: tuple[Tensor, Tensor, Tensor | None, float | None]) -> None:
        held = layer._buffers
        held["running_mean"], held["running_var"], held["num_batches_tracked"], layer.__dict__["momentum"] = own

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
        """The micro-batch under way is in the window (its backward finished): its statistics join it."""
        for name, moments in self._pending.items():
            pooled = self._window.get(name)
            if pooled is None:
                self._window[name] = moments
            else:
                pooled.merge(moments)
        self._pending = {}

    def drop_pending(self) -> None:
        """Forget the statistics of forwards whose micro-batch is not in the window (it failed, or a batch
        trained again after a resume ran them)."""
        self._pending = {}

    def commit(self) -> None:
        """The window stepped: one BatchNorm update of each layer it reached, with its pooled statistics."""
        self.recover()
        self.drop_pending()
        for name, pooled in self._window.items():
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
                factor = nbt.to(pooled.mean.dtype).reciprocal()
            else:
                factor = float(layer.momentum)
            mean.copy_(pooled.mean * factor + mean.to(pooled.mean.dtype) * (1 - factor))
            var.copy_(pooled.variance() * factor + var.to(pooled.mean.dtype) * (1 - factor))
        self._window = {}

    def discard(self) -> None:
        """The window was not stepped: its statistics are forgotten, the buffers hold the last window's."""
        self.recover()
        self._window, self._pending, self._loaded = {}, {}, {}

    def recover(self) -> None:
        """After an exception inside a layer's forward: its momentum and buffers put back."""
        for name, own in self._inflight.items():
            layer = self._layers.get(name)
            if layer is not None:
                self._put_back(layer, own)
        self._inflight = {}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The open window's pooled statistics, by layer name."""
        held = {**self._loaded, **self._window}
        return {name: {"count": m.count, "mean": m.mean.clone(), "m2": m.m2.clone()} for name, m in held.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.discard()
        loaded = {name: Moments(int(s["count"]), s["mean"].clone(), s["m2"].clone()) for name, s in dict(state).items()}
        if self._layers:
            self._adopt(loaded)
        else:
            self._loaded = loaded

    def _adopt(self, loaded: Mapping[str, Moments]) -> None:
        """A checkpoint's window statistics into the attached layers' window, on their devices."""
        unknown = sorted(set(loaded) - set(self._layers))
        if unknown:
            raise ValueError(
                f"The checkpoint holds the window's BatchNorm statistics of layers {unknown} that this model does "
                "not have: resume with the model the checkpoint was written with."
            )
        for name, moments in loaded.items():
            self._window[name] = moments.to(self._layers[name].running_mean.device)  # type: ignore[union-attr]
