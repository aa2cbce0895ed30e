"""What a stepped window reports, and where it is seen.

After every optimizer step the window's numbers (``accum/k``, ``accum/loss``, ...) are put in
``trainer.callback_metrics``, where ``EarlyStopping``, ``ModelCheckpoint(monitor=)`` and
``ReduceLROnPlateau`` read them, and in the progress bar; the loggers get them every
``Trainer(log_every_n_steps)`` optimizer steps (and ``trainer.logged_metrics`` holds them then, as
tensors, as Lightning keeps what it logs). None of this goes through ``self.log``: Lightning
reprocesses every key logged that way on every batch. Then every callback that defines
``on_window_end(trainer, pl_module, window)`` is called with a ``WindowReport``, and after them the
LightningModule's ``on_window_end(window)`` if it has one: Lightning has no hook after an
accumulated optimizer step (Lightning issue #11688).
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lightning_accum import _seam
from lightning_accum._core.engine import Closing, WindowEngine
from lightning_accum.schedules import Progress

_EMPTY: Mapping[str, Any] = MappingProxyType({})


def empty() -> Mapping[str, Any]:
    """An empty read-only mapping: ``WindowReport``'s default ``task_losses`` and ``lr``."""
    return _EMPTY


@dataclass(frozen=True)
class WindowReport:
    """A window whose optimizer step has just been taken, as callbacks' ``on_window_end`` get it.

    Attributes:
        step: the window group's optimizer steps so far, this one included (``Progress.step``):
            ``trainer.global_step`` with the callback; with the mixin, one per window of its group (a window
            shared by several optimizers counts once, where ``trainer.global_step`` counts each one's step).
        epoch: the epoch the step was taken in.
        k: micro-batches the schedule gave the window (an epoch's last window may hold fewer).
        microbatches: the micro-batches that went in, over all ranks.
        samples: the samples that went in, over all ranks.
        items: the items (``count``'s, e.g. tokens) that went in, over all ranks; the samples without ``count``.
        loss: the window's loss over all ranks, normalised as its gradient was (``None`` with ``log=False``).
        task_losses: each task's window loss (the mixin's ``backward_each``/``backward_heads``), keyed as logged
            without ``accum/``: ``"loss/<name>"`` (``task_losses["loss/reg"]`` for ``names=["cls", "reg"]``;
            ``"loss/task0"``, ... without ``names``).
        grad_norm: the norm of the window's normalised gradient before clipping (``None`` where it is not
            measured: ``log=False``, sharded strategies, DeepSpeed); a float, or a device scalar where the
            gradient is made global after the counts (the mixin and Fabric loops under DDP).
        lr: the learning rate each optimizer's group stepped with (``lr_scaling`` and ``lr_schedule``
            included), keyed as logged: ``"lr"`` for one optimizer of one group, else
            ``LearningRateMonitor``'s names (``"lr-Adam"``, ``"lr-Adam-1/pg2"``).
        noise_scale: the ``NoiseScale`` schedule's estimate (``None`` for other schedules).
        progress: ``Progress`` after this window.
        optimizers: the indices, in ``trainer.optimizers``, of the optimizers that stepped.
        microbatch_size: the samples per piece the window's last loader batch was cut into
            (``AccumulationScheduler(microbatch_size=...)``; ``None`` without).
        seconds: the host time from the previous stepped window's end (the fit's start for the first) to this
            one's, validation between them included (``None`` where not timed): the throughput's denominator.

    Example:

        >>> import lightning.pytorch as pl
        >>> class EveryWindow(pl.Callback):
        ...     def on_window_end(self, trainer, pl_module, window):
        ...         print(window.step, window.k, window.loss)
    """

    step: int
    epoch: int
    k: int
    microbatches: int
    samples: int
    items: int
    loss: float | None
    progress: Progress
    task_losses: Mapping[str, float] = field(default_factory=empty)
    grad_norm: float | Tensor | None = None
    lr: Mapping[str, Any] = field(default_factory=empty)
    noise_scale: float | None = None
    optimizers: tuple[int, ...] = (0,)
    microbatch_size: int | None = None
    seconds: float | None = None


def report(
    optimizers: Sequence[Any],
    engine: WindowEngine,
    closing: Closing,
    group: tuple[int, ...] = (0,),
    *,
    microbatch_size: int | None = None,
    schedulers: Sequence[Any] = (),
) -> WindowReport:
    """The report of the window ``engine`` has just advanced past (``closing``, stepped); ``optimizers`` and
    ``schedulers``: the fit's (``trainer.optimizers``, ``trainer.lr_scheduler_configs``), which name the
    learning rates."""
    losses = closing.losses or _EMPTY
    loss = losses.get("loss")
    tasks = {name: value for name, value in losses.items() if name != "loss"}
    if closing.norm_sq is not None:
        grad_norm: float | Tensor | None = math.sqrt(closing.norm_sq)
    else:
        grad_norm = engine.metrics.grad_norm_on_device()
    progress = engine.progress
    lrs = MappingProxyType(lr_names(optimizers, engine.used_lrs, schedulers))
    return WindowReport(
        progress.step, progress.epoch, closing.k, closing.microbatches, closing.samples, closing.items, loss,
        progress, MappingProxyType(tasks) if tasks else _EMPTY, grad_norm, lrs, engine.noise_scale, group,
        microbatch_size, engine.seconds,
    )  # fmt: skip


def lr_names(
    optimizers: Sequence[Any], used: Sequence[tuple[Any, list[Any]]], schedulers: Sequence[Any] = ()
) -> dict[str, Any]:
    """The learning rates ``used`` (optimizer, each group's rate), named as ``LearningRateMonitor`` names them
    among the fit's ``optimizers`` and LR ``schedulers`` (``trainer.lr_scheduler_configs``: a config's ``name``,
    else ``lr-<Optimizer>`` with ``-1``, ``-2`` for more of a type, the optimizers with schedulers first; a
    group's ``name``, or ``pg<i>`` among several) ("lr" alone for one optimizer of one group)."""
    if len(optimizers) == 1 and len(used) == 1 and len(used[0][1]) == 1:
        return {"lr": used[0][1][0]}
    raw = [getattr(o, "optimizer", o) for o in optimizers]
    counted: dict[type, int] = {}  # optimizers of each type named `lr-<type>` so far
    names: dict[int, str] = {}
    for optimizer, name, scheduled in [
        *((c.scheduler.optimizer, getattr(c, "name", None), True) for c in schedulers),
        *((o, None, False) for o in raw),
    ]:
        if not scheduled and id(optimizer) in names:
            continue  # (an optimizer with a scheduler: named already)
        kind = type(optimizer)
        if name is None:
            counted[kind] = counted.get(kind, 0) + 1
        base = name or f"lr-{kind.__name__}"
        count = counted.get(kind, 0)
        names.setdefault(id(optimizer), f"{base}-{count - 1}" if count > 1 else base)
    out = {}
    for optimizer, lrs in used:
        inner = getattr(optimizer, "optimizer", optimizer)
        base = names.get(id(inner), f"lr-{type(inner).__name__}")
        groups = inner.param_groups
        for i, (group, lr) in enumerate(zip(groups, lrs, strict=True)):
            label = group.get("name", f"pg{i + 1}" if len(groups) > 1 else None)
            out[base if label is None else f"{base}/{label}"] = lr
    return out


def metric_values(window: WindowReport) -> dict[str, Any]:
    """The window's numbers by metric name (unprefixed: ``k``, ``loss``, ``loss/<task>``, ``grad_norm``,
    the learning rates, ``effective_batch``, ``samples``, ``items``, ``noise_scale``, ``microbatch_size``,
    ``samples_per_second``, ``tokens_per_second``), what is logged of it."""
    values: dict[str, Any] = {"k": window.k}
    if window.loss is not None:
        values["loss"] = window.loss
    values.update(window.task_losses)
    if window.grad_norm is not None:
        values["grad_norm"] = window.grad_norm
    values.update(window.lr)
    values.update(effective_batch=window.samples, samples=window.progress.samples, items=window.progress.items)
    if window.noise_scale is not None:
        values["noise_scale"] = window.noise_scale
    if window.microbatch_size is not None:
        values["microbatch_size"] = window.microbatch_size
    if window.seconds:  # (items: the tokens with a `count`, else the samples again, as `accum/items`)
        values.update(
            samples_per_second=window.samples / window.seconds, tokens_per_second=window.items / window.seconds
        )
    return values


class Wants(NamedTuple):
    """What one window must compute, and where it goes (``Readers.wants``)."""

    publish: bool  # its numbers go to `trainer.callback_metrics` and the progress bar
    logs: bool  # ... and to the loggers (this step is theirs)
    losses: bool  # its loss is read
    norm: bool  # its gradient's norm is measured
    hooks: bool  # the `on_window_end` hooks are handed its report
    bar: bool = False  # its `k` and loss go to the progress bar (where they are not published)
    keys: frozenset[str] | None = None  # the `callback_metrics` keys it is published under (None: all)


NOTHING = Wants(False, False, False, False, False)


class Readers:
    """Who reads a fit's window numbers, found when it starts, so that no window computes a number nobody
    reads. The readers, and what each is given:

    * the loggers: every ``accum/*`` key at the steps they write (every ``Trainer(log_every_n_steps)``
      optimizer steps), also into ``trainer.logged_metrics``;
    * the ``on_window_end`` hooks: the whole ``WindowReport``, every window (and every number in
      ``callback_metrics``, where a hook may look);
    * a monitor, a callback with a ``monitor`` attribute (``EarlyStopping``, ``ModelCheckpoint``, ...) or an
      LR scheduler config's ``monitor`` naming an ``accum/`` key (or a ``ModelCheckpoint`` filename naming one):
      those keys in ``callback_metrics``, every window;
    * the progress bar: ``accum/k`` and ``accum/loss``, every window;
    * a callback or a LightningModule with its own ``on_train_batch_start`` or ``on_train_batch_end`` (one
      from neither Lightning nor this package): it may read ``callback_metrics`` at any batch, so it is
      given every number every window (the gradient's norm as below).

    Where a hook or a batch reader is there, every window's numbers go to ``callback_metrics``; otherwise
    every number goes there at the loggers' steps and in each epoch's and the fit's last window (so that
    ``callback_metrics`` holds the latest numbers when the epoch or the fit ends), and between them only what
    a monitor names, the progress bar being given every window's ``k`` and loss. The gradient's norm
    (``accum/grad_norm``), a pass over the whole gradient, is measured only where it is asked for: the
    loggers' steps, the hooks, a monitor naming it (between, ``callback_metrics`` keeps the last measured; a
    batch hook that wants every window's norm reads ``on_window_end``'s).

    Example:

        >>> readers = Readers(log=True, loggers=True, every=50, bar=True, hooks=[], watched={"accum/loss"})
        >>> readers.wants(step=3).norm, readers.wants(step=50).logs
        (False, True)
        >>> readers = Readers(log=True, loggers=True, every=50, bar=True, hooks=[], watched=())
        >>> readers.wants(step=3).publish, readers.wants(step=3).bar, readers.wants(step=50).publish
        (False, True, True)
    """

    def __init__(
        self,
        *,
        log: bool,
        loggers: bool,
        every: int,
        bar: bool,
        hooks: Sequence[Any],
        watched: Collection[str],
        unknown: bool = False,
    ) -> None:
        self.log, self.hooks = log, hooks
        # the hooks that read more than a window's counts and loss (a progress bar's reads those alone: for it
        # no gradient norm is measured, nor is every number published)
        full = [hook for hook in hooks if not getattr(hook, COUNTS_ONLY, False)]
        self.loggers, self.every = log and loggers, every
        watched = frozenset(key for key in watched if key.startswith("accum/")) if log else frozenset()
        unknown = log and unknown
        #: whether anyone reads a window's numbers at all (its losses are then kept as it fills; a counts-only hook
        #: alone does not: it shows the loss where it is read anyway)
        self.any = bool(self.loggers or (log and bar) or watched or full or unknown)
        #: whether someone may read any `callback_metrics` key after any window (a hook, a batch reader); else
        #: every number is published at the loggers' steps and in each epoch's and the fit's last window only
        self.any_key = bool(full) or unknown
        #: whether a window must know if it is an epoch's or the fit's last (then it publishes every number)
        self.asks_last = log and not self.any_key
        self.bar = log and bar
        self._watched = watched
        self._norm_watched = any(key.endswith("grad_norm") for key in watched)
        self._full = bool(full)
        self._between = self._wants(logs=False, last=False)  # a window neither the loggers' nor the last

    @classmethod
    def of(
        cls, trainer: Any, log: bool, hooks: Sequence[Any], watched: Collection[str] = (), own: object = None
    ) -> Readers:
        """The readers of ``trainer``'s fit (``watched``: keys the adapter knows are monitored besides;
        ``own``: the adapter's own callback, no reader)."""
        keys = set(watched)
        for config in (*trainer.callbacks, *trainer.lr_scheduler_configs):
            monitor, filename = getattr(config, "monitor", None), getattr(config, "filename", None)
            if isinstance(monitor, str):
                keys.add(monitor)
            if isinstance(filename, str):  # (`ModelCheckpoint(filename="{epoch}-{accum/loss:.2f}")`)
                keys.update(re.findall(r"{([^{}:]+)", filename))
        bar = trainer.progress_bar_callback is not None
        others = [callback for callback in trainer.callbacks if callback is not own]
        unknown = any(map(_reads_batches, [*others, trainer.lightning_module]))
        return cls(log=log, loggers=bool(trainer.loggers), every=trainer.log_every_n_steps, bar=bar, hooks=hooks,
                   watched=keys, unknown=unknown)  # fmt: skip

    @classmethod
    def of_nobody(cls) -> Readers:
        """No reader (before a fit starts)."""
        return cls(log=False, loggers=False, every=0, bar=False, hooks=(), watched=())

    def wants(self, step: int, last: bool = False) -> Wants:
        """What the window that makes optimizer step ``step`` must compute (``last``: the epoch's or the fit's
        last window), and where it goes."""
        logs = self.loggers and bool(self.every) and step % self.every == 0
        if logs or last:
            return self._wants(logs, last)
        return self._between

    def _wants(self, logs: bool, last: bool) -> Wants:
        hooks = bool(self.hooks)
        keys = None if logs or last or self.any_key else self._watched  # (None: every key)
        publish = self.log and (keys is None or bool(keys))
        if not (publish or hooks or self.bar):
            return NOTHING
        norm = logs or self._full or self._norm_watched
        return Wants(publish, logs, True, norm, hooks, self.bar and (not publish or keys is not None), keys)


COUNTS_ONLY = "_window_end_reads_counts_only"


def reads_counts_only(hook: Callable[..., None]) -> Callable[..., None]:
    """Mark an ``on_window_end`` that reads only the report's counts, ``k`` and loss (``StepProgressBar``'s): a
    fit with no other reader measures no gradient norm for it, nor publishes every number each window."""
    setattr(hook, COUNTS_ONLY, True)
    return hook


_KNOWN = ("lightning.", "pytorch_lightning.", "lightning_accum.")  # whose reads of `callback_metrics` are known


def _reads_batches(obj: Any, names: tuple[str, ...] = ("on_train_batch_start", "on_train_batch_end")) -> bool:
    """A callback or LightningModule with its own ``on_train_batch_start`` or ``on_train_batch_end`` (of
    ``names``), where it may read ``callback_metrics`` (one from neither Lightning nor this package, or one set
    on the instance: a ``LambdaCallback``'s)."""
    for name in names:
        if name in getattr(obj, "__dict__", {}):
            return True
        owner = next((base for base in type(obj).__mro__ if name in vars(base)), None)
        if owner is not None and not owner.__module__.startswith(_KNOWN):
            return True
    return False


def readers_before(trainer: Any, own: object) -> list[str]:
    """The callbacks listed before ``own`` in ``trainer.callbacks`` with an ``on_train_batch_end`` of their own:
    Lightning calls them first, so that at a window's last batch they find the window before it in
    ``callback_metrics``."""
    names: list[str] = []
    for callback in trainer.callbacks:
        if callback is own:
            return names
        if _reads_batches(callback, ("on_train_batch_end",)):
            names.append(type(callback).__name__)
    return []


def show(trainer: Any, k: int, loss: float | None, prefix: str = "accum/") -> None:
    """Put a window's ``k`` and loss in the progress bar (as floats: the bar formats them)."""
    _seam.show_in_progress_bar(trainer, f"{prefix}k", float(k))
    if loss is not None:
        _seam.show_in_progress_bar(trainer, f"{prefix}loss", loss)


class Reported:
    """Puts each stepped window's numbers where they are read, and keeps the last: ``trainer.callback_metrics``
    and the progress bar after the window, and, every ``Trainer(log_every_n_steps)`` optimizer steps (or where
    ``Wants.logs`` says so), the loggers. ``callback_metrics`` holds tensors, as Lightning keeps what is logged
    (in the default dtype): a number equal to the one already there keeps its tensor (``accum/k`` and the
    learning rate rarely change), so that a window makes a tensor only for what changed. The last numbers are
    kept in checkpoints: Lightning keeps no logged value across a resume, so without them a monitor checked
    before the resumed fit's first window ends (an epoch's end after a checkpoint inside its last window) would
    see nothing where the uninterrupted run saw the last window.

    Example:

        >>> reported = Reported()
        >>> reported.load_state_dict({"metrics": {"accum/loss": 0.5}})
        >>> reported.state_dict()
        {'metrics': {'accum/loss': 0.5}}
    """

    def __init__(self) -> None:
        self._metrics: dict[str, Tensor] = {}  # what was put in `callback_metrics`, by key
        self._numbers: dict[str, float] = {}  # ... and the host numbers they were made from

    def publish(self, trainer: Any, window: WindowReport, prefix: str = "accum/", wants: Wants | None = None) -> None:
        """Put the window's numbers in ``trainer.callback_metrics`` and the progress bar and, at the loggers'
        steps, write them to the loggers (a device gradient norm or learning rate read with the rest, once)."""
        values = metric_values(window)
        self._keep(values, prefix, None if wants is None else wants.keys)
        _seam.put_callback_metrics(trainer, self._metrics)
        if wants is None or wants.keys is None or wants.bar:
            show(trainer, window.k, window.loss, prefix)
        every = trainer.log_every_n_steps
        if (wants.logs if wants is not None else every and window.step % every == 0) and trainer.loggers:
            self._write(trainer, values, prefix)

    def _keep(self, values: Mapping[str, Any], prefix: str, keys: frozenset[str] | None) -> None:
        """The window's numbers (those of ``keys`` alone, a monitor's, where given) as the tensors ``callback_metrics``
        holds: a device tensor as it is; a number equal to the one kept keeps its tensor, equal numbers share one."""
        metrics, numbers = self._metrics, self._numbers
        made: dict[float, Tensor] = {}
        for name, value in values.items():
            key = prefix + name
            if keys is not None and key not in keys:  # (a monitor's keys alone)
                continue
            if isinstance(value, Tensor):
                metrics[key] = value
                numbers.pop(key, None)
            elif numbers.get(key) != value or not value:  # (kept where equal; not 0, whose tensor may hold -0.0)
                tensor = made.get(value) if value else None  # (one tensor for equal numbers: samples and items)
                if tensor is None:
                    tensor = made[value] = torch.scalar_tensor(value)  # (in the default dtype, as Lightning logs)
                metrics[key], numbers[key] = tensor, value

    def _write(self, trainer: Any, values: Mapping[str, Any], prefix: str) -> None:
        """The window's numbers to the loggers: the device ones read in one host read."""
        devices = [v.detach().reshape(()).to(torch.float64) for v in values.values() if isinstance(v, Tensor)]
        read = iter(torch.stack(devices).tolist() if devices else [])  # one host read for all of them
        scalars = {prefix + n: next(read) if isinstance(v, Tensor) else float(v) for n, v in values.items()}
        _seam.write_to_loggers(trainer, scalars, {key: self._metrics[key] for key in scalars})

    def restore(self, trainer: Any) -> None:
        """At a fit's train start: put back what a checkpoint held (nothing in a fresh fit)."""
        if self._metrics:
            _seam.put_callback_metrics(trainer, dict(self._metrics))

    def clear(self) -> None:
        """Forget the numbers kept (a fit not resumed from a checkpoint: an earlier fit's are not its own)."""
        self._metrics, self._numbers = {}, {}

    def state_dict(self) -> dict[str, Any]:
        return {"metrics": {name: float(value) for name, value in self._metrics.items()}}  # (a checkpoint's read)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        dtype = torch.get_default_dtype()
        self._metrics = {name: torch.tensor(value, dtype=dtype) for name, value in state.get("metrics", {}).items()}
        self._numbers = {}


def listeners(trainer: Any) -> list[Callable[[Any, Any, WindowReport], None]]:
    """The ``on_window_end`` hooks to call after each step (read once a fit): the Trainer's callbacks', in
    ``trainer.callbacks`` order, then the LightningModule's, as Lightning orders its hooks. A module's hook
    takes the report alone (``on_window_end(self, window)``), as Lightning's module hooks take no trainer."""
    hooks: list[Callable[[Any, Any, WindowReport], None]] = []
    for callback in trainer.callbacks:
        hook = getattr(callback, "on_window_end", None)
        if callable(hook):
            _check_hook(hook, callback, module=False)
            hooks.append(hook)
    own = getattr(trainer.lightning_module, "on_window_end", None)
    if callable(own):
        _check_hook(own, trainer.lightning_module, module=True)
        hooks.append(lambda trainer, module, window: own(window))
    return hooks


def _check_hook(hook: Callable[..., Any], owner: Any, module: bool) -> None:
    """Refuse, at the fit's start, an ``on_window_end`` that cannot take what it is handed: the report alone on
    a LightningModule, ``(trainer, pl_module, window)`` on a callback (as Lightning hands its hooks)."""
    try:
        inspect.signature(hook).bind(*([None] if module else [None] * 3))
    except TypeError:
        mine, other = (
            ("the window's report alone, `def on_window_end(self, window):` (a LightningModule's hooks are not "
             "handed the trainer or the module;", "a callback's `on_window_end(self, trainer, pl_module, window)` is)"),
            ("`(trainer, pl_module, window)`, `def on_window_end(self, trainer, pl_module, window):` (as a "
             "callback's Lightning hooks are;", "a LightningModule's `on_window_end(self, window)` takes the window "
             "alone)"),
        )[not module]  # fmt: skip
        raise TypeError(f"`{type(owner).__name__}.on_window_end` must take {mine} {other}.") from None
    except ValueError:  # (no signature to read: a builtin)
        return


def announce(
    hooks: Sequence[Callable[[Any, Any, WindowReport], None]], trainer: Any, module: Any, window: WindowReport
) -> None:
    """Call each of ``hooks`` (``listeners``) with the window."""
    for hook in hooks:
        hook(trainer, module, window)
