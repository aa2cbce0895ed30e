"""The one place that leans on Lightning's loop internals.

Lightning 2.x (read off 2.6) steps the optimizer after the batch where
``(batch_idx + 1) % trainer.accumulate_grad_batches == 0`` (or the epoch's last batch), zeroes
gradients before the backward of the batch where ``batch_idx % trainer.accumulate_grad_batches
== 0`` and divides every loss by ``trainer.accumulate_grad_batches``. Setting that attribute
at a window's first batch, to ``lightning_accum._core.window.lightning_divisor``, makes the loop
close the window exactly where the schedule says. Lightning reads the divisor of the loss as
``training_step`` returns (``_AutomaticOptimization._training_step``: ``from_training_step_output``) and
nothing of it again before the loss's backward, so the callback sets the window's k there and puts the
stepping value back in ``on_before_backward``. It also reads the loop's batch progress
(which part of a batch had run when an exception came) and holds its step and epoch-end counters for
a window's end (``LoopCounters``), calls the loop's zero-grad path and writes the metrics its logger
connector keeps (progress bar, callbacks', logged). Around the
batches it accumulates the loop enters ``strategy.block_backward_sync()``, which calls
``strategy.model.no_sync()`` on any model that has one (a runtime protocol check,
``lightning.pytorch.utilities.types.DistributedDataParallel``): FSDP (1) roots included.
It also has the autograd engine call back at the end of a loss's backward pass (``at_pass_end``: private torch).
``tests/test_lightning_seam.py`` fails if Lightning (or torch) changes any of these.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch.autograd import Variable
from torch.optim import Optimizer

from lightning_accum._lightning import pl


def loop_skips_sync(strategy: Any) -> bool:
    """Whether Lightning's automatic loop skips the gradient sync of the batches it accumulates under
    ``strategy`` (``ParallelStrategy.block_backward_sync``: the wrapped model's ``no_sync()``, DDP's and FSDP's)."""
    protocol = pl.utilities.types.DistributedDataParallel
    return isinstance(strategy, pl.strategies.ParallelStrategy) and isinstance(strategy.model, protocol)


def set_divisor(trainer: Any, value: int) -> None:
    """Make Lightning's automatic loop step after ``value``-aligned batches and divide by ``value``."""
    trainer.accumulate_grad_batches = value


def zero_grad_like_lightning(trainer: Any, batch_idx: int, optimizer: Optimizer) -> None:
    """Zero gradients through Lightning's own zeroing path: the ``on_before_zero_grad`` hooks, the
    module's ``optimizer_zero_grad`` (user overrides and ``GradientDecay`` still apply) and the
    loop's zero-grad progress counters."""
    loop = trainer.fit_loop.epoch_loop.automatic_optimization
    loop._on_before_zero_grad(optimizer)
    loop._optimizer_zero_grad(batch_idx, optimizer)


def zeroes_after_training_step(trainer: Any, batch_idx: int) -> bool:
    """Whether Lightning's automatic loop zeroes the gradients after this batch's ``training_step``
    (and before its backward): where ``batch_idx % accumulate_grad_batches == 0``, unless it skips
    backward (``_AutomaticOptimization._make_zero_grad_fn``; the closure runs the step, then zero_grad)."""
    return not backward_skipped(trainer) and batch_idx % trainer.accumulate_grad_batches == 0


def route_training_step(module: Any, step: Callable[..., Any]) -> Callable[[], None]:
    """Make Lightning call ``step(original, *args, **kwargs)`` where it calls ``module.training_step``;
    call what this returns to undo it. Lightning looks the method up on the instance each batch
    (``Strategy.training_step``, and ``_ForwardRedirection`` through a DDP wrapper's forward), and
    reads which arguments to pass from its signature through ``__wrapped__`` (``_build_kwargs``,
    ``is_param_in_hook_signature``), so the original's signature still decides them."""
    mine = vars(module)
    had, before = "training_step" in mine, mine.get("training_step")
    original = module.training_step

    @functools.wraps(original)
    def training_step(*args: Any, **kwargs: Any) -> Any:
        return step(original, *args, **kwargs)

    mine["training_step"] = training_step

    def restore() -> None:
        if mine.get("training_step") is training_step:
            if had:
                mine["training_step"] = before
            else:
                del mine["training_step"]

    return restore


def ddp_comm_hook(strategy: Any) -> Any:
    """The communication hook Lightning's ``DDPStrategy(ddp_comm_hook=...)`` registers (``None`` if none)."""
    return getattr(strategy, "_ddp_comm_hook", None)


def attached(module: Any) -> bool:
    """Whether a Trainer is attached to ``module`` (``LightningModule.trainer`` raises when none is;
    Lightning keeps it in ``_trainer``)."""
    return getattr(module, "_trainer", None) is not None


def batch_index(trainer: Any) -> int:
    """The index, within its epoch, of the batch being trained: in manual optimization no hook is
    handed it where the mixin's block runs (``_TrainingEpochLoop.batch_idx``)."""
    return int(trainer.fit_loop.epoch_loop.batch_idx)


def epoch_ends_after_this_batch(trainer: Any) -> bool:
    """Whether the batch being trained is the epoch's last (data exhausted or the batch limit).

    ``trainer.is_last_batch`` comes from the prefetching data fetcher; the batch index, which
    only the epoch loop holds, covers ``limit_train_batches``.
    """
    batch_idx = trainer.fit_loop.epoch_loop.batch_idx
    return bool(trainer.is_last_batch) or batch_idx + 1 >= trainer.num_training_batches


def batch_processed(trainer: Any) -> bool:
    """Whether the batch being trained got past its optimization (Lightning's ``processed``
    counter): after an exception from here on (``on_train_batch_end``), a resumed run does not
    train this batch again; before it, the batch is trained again from its start."""
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    return bool(progress.processed > progress.completed)


def show_in_progress_bar(trainer: Any, name: str, value: float) -> None:
    """Put ``value`` in the progress bar's metrics now, without ``self.log`` (~0.3 ms a call):
    the bar reads the logger connector's dict, which ``self.log(prog_bar=True)`` also fills."""
    trainer._logger_connector._progress_bar_metrics[name] = value


def put_callback_metrics(trainer: Any, metrics: dict[str, Any]) -> None:
    """Put ``metrics`` where monitors read them (``trainer.callback_metrics``: ``EarlyStopping``,
    ``ModelCheckpoint(monitor=)``, ``ReduceLROnPlateau``) without ``self.log``, whose result
    collection Lightning reprocesses every batch: the property returns the logger connector's own
    dict, which only a metric of the same name logged later overwrites."""
    trainer._logger_connector._callback_metrics.update(metrics)


def write_to_loggers(trainer: Any, metrics: dict[str, float], kept: dict[str, Any]) -> None:
    """Write ``metrics`` to every logger at the step Lightning writes this batch's logged metrics
    (``_TrainingEpochLoop._batches_that_stepped``, as ``LearningRateMonitor`` does), and keep ``kept``
    (the same values as tensors, as Lightning keeps what it logs) in ``trainer.logged_metrics``."""
    step = trainer.fit_loop.epoch_loop._batches_that_stepped
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)
    trainer._logger_connector._logged_metrics.update(kept)


@contextlib.contextmanager
def steps_counted(trainer: Any) -> Iterator[None]:
    """Count the optimizer steps taken inside in ``trainer.global_step`` outside ``training_step`` (the mixin's
    window left open at an epoch's end, stepped in ``on_train_batch_end``): manual optimization counts a step
    only while its loop runs, through hooks it puts on the ``LightningOptimizer`` s for that time
    (``_ManualOptimization.on_run_start`` / ``on_run_end``, ``_on_before_step`` / ``_on_after_step``)."""
    loop = trainer.fit_loop.epoch_loop.manual_optimization
    optimizers = trainer.strategy._lightning_optimizers
    saved = [(o._on_before_step, o._on_after_step) for o in optimizers]
    for optimizer in optimizers:
        optimizer._on_before_step, optimizer._on_after_step = loop._on_before_step, loop._on_after_step
    try:
        yield
    finally:
        for optimizer, (before, after) in zip(optimizers, saved, strict=True):
            optimizer._on_before_step, optimizer._on_after_step = before, after


def at_pass_end(mark: Callable[[], None]) -> Callable[[Any], None]:
    """A pre-hook for a loss's ``grad_fn`` (``Node.register_prehook``: public) that has ``mark`` called once the
    backward pass from that loss ran to its end: after its last gradient was accumulated into ``.grad``, before
    ``backward()`` returns, so before Lightning's ``on_after_backward`` hooks whatever the callbacks' order (and
    before a ``LightningModule.backward`` override returns); a pass that raises never calls it. Private torch: the
    autograd engine's final callbacks of the graph task running now (``Variable._execution_engine.queue_callback``,
    callable only inside a backward pass), as DDP (``torch/nn/parallel/distributed.py``, ``_DDPSink.backward``) and
    FSDP (``torch/distributed/fsdp/_runtime_utils.py``, ``_register_post_backward_final_callback``; FSDP2's
    ``_fsdp_state.py``) use them. Not Lightning's, but leant on as its internals are: here, under
    ``tests/test_lightning_seam.py``. The hook builds nothing per pass (``mark`` should not either)."""
    queue = Variable._execution_engine.queue_callback

    def hook(grad_outputs: Any) -> None:
        queue(mark)

    return hook


def backward_skipped(trainer: Any) -> bool:
    """Whether Lightning skips backward and the optimizer step for this epoch's batches (what
    ``StochasticWeightAveraging`` does for its BatchNorm-update epoch)."""
    return bool(getattr(trainer.fit_loop, "_skip_backward", False))


class SchedulerFrequencies:
    """Lightning steps a step-interval LR scheduler when ``(batch_idx + 1) % frequency == 0``:
    counted in batches, reset each epoch (``_TrainingEpochLoop._update_learning_rates``). Set per
    optimizer step, this makes ``frequency`` count optimizer steps, and skips a window that did
    not step; ``restore`` gives the configs back as the user made them."""

    def __init__(self, trainer: Any = None) -> None:
        configs = [] if trainer is None else trainer.lr_scheduler_configs
        self.saved = [(c, c.frequency) for c in configs if c.interval == "step"]

    def before_step(self, step: int, batch_idx: int, stepped: bool = True) -> None:
        """Optimizer step ``step`` is taken after batch ``batch_idx`` (or, if not ``stepped``, no step is)."""
        for config, frequency in self.saved:
            config.frequency = 1 if stepped and step % frequency == 0 else batch_idx + 2

    def restore(self) -> None:
        for config, frequency in self.saved:
            config.frequency = frequency
        self.saved = []


class LoopCounters:
    """Lightning's loop counters that a window's end reads, held from train start: plain attributes (a
    checkpoint loads them in place), read without the property chains behind ``trainer.global_step``,
    ``max_steps``, ``is_last_batch`` and ``num_training_batches``.

    ``steps.completed`` is ``trainer.global_step`` under automatic optimization
    (``_TrainingEpochLoop.global_step`` is ``automatic_optimization.optim_progress.optimizer_steps``, that is
    ``optimizer.step.total.completed``); ``trainer.max_steps`` is the epoch loop's ``max_steps``,
    ``trainer.is_last_batch`` its batch progress's ``is_last_batch`` and ``trainer.num_training_batches`` the
    fit loop's ``max_batches``."""

    def __init__(self, trainer: Any) -> None:
        fit_loop = trainer.fit_loop
        self._fit_loop, self._epoch_loop = fit_loop, fit_loop.epoch_loop
        self._batches = fit_loop.epoch_loop.batch_progress
        self.steps = fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total

    def last_window(self, step: int, batch_idx: int) -> bool:
        """Whether the window that makes optimizer step ``step`` after batch ``batch_idx`` is the fit's last
        (``max_steps``) or its epoch's (data exhausted or the batch limit: ``epoch_ends_after_this_batch``)."""
        return bool(
            step == self._epoch_loop.max_steps
            or self._batches.is_last_batch
            or batch_idx + 1 >= self._fit_loop.max_batches
        )


def uncount_step(trainer: Any) -> None:
    """Take back the optimizer step Lightning's automatic loop counted for a window that moved
    nothing, so that ``trainer.global_step`` (and ``max_steps``, ``every_n_train_steps``) counts
    optimizer steps (``_OptimizationProgress.optimizer_steps`` is ``optimizer.step.total.completed``)."""
    step = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step
    for tracker in (step.total, step.current):
        tracker.ready -= 1
        tracker.completed -= 1


def suspend_clipping(trainer: Any) -> Any:
    """Turn off the Trainer's gradient clipping until the returned function is called (a window
    that moved nothing has no gradient, and clipping none fails inside torch).
    ``Precision._clip_gradients`` reads ``trainer.gradient_clip_val`` at each step."""
    value = trainer.gradient_clip_val
    trainer.gradient_clip_val = None

    def restore() -> None:
        trainer.gradient_clip_val = value

    return restore


#: the keys of a scheduler config that Lightning drops in manual optimization (and warns are ignored)
DROPPED_SCHEDULER_KEYS = ("monitor", "strict", "reduce_on_plateau")
#: the keys a scheduler config may have (``LRSchedulerConfig``'s fields)
SCHEDULER_KEYS = ("scheduler", "name", "interval", "frequency", "reduce_on_plateau", "monitor", "strict")


def keep_scheduler_keys(
    module: Any, found: dict[int, tuple[str | None, bool, bool | None]], honoured: Callable[[], bool]
) -> None:
    """In manual optimization Lightning drops an LR scheduler config's ``monitor``, ``strict`` and
    ``reduce_on_plateau`` and warns that they are ignored (``core/optimizer.py``,
    ``_configure_schedulers_manual_opt``): catch them as ``configure_optimizers`` returns (the instance's
    next call only, for the strategy's ``setup_optimizers`` after the ``setup`` hooks), and where the
    mixin honours them (``honoured()``, asked then: it steps the schedulers) hand Lightning the configs
    without them (copies: the user's dicts are left as they are). ``found`` maps ``id(scheduler)`` to
    ``(monitor, strict, reduce_on_plateau or None)``."""
    original = module.configure_optimizers

    def configure_optimizers() -> Any:
        vars(module).pop("configure_optimizers", None)  # the class's method again
        conf = original()
        kept = _scheduler_keys(conf, None, found)
        return kept if honoured() else conf

    module.configure_optimizers = configure_optimizers


def _scheduler_keys(conf: Any, monitor: str | None, found: dict[int, tuple[str | None, bool, bool | None]]) -> Any:
    """``conf`` with each scheduler config's dropped keys taken out into ``found``."""
    if isinstance(conf, dict):
        if "scheduler" in conf:
            unknown = sorted(set(conf) - set(SCHEDULER_KEYS))
            if unknown:  # (Lightning's manual optimization fails on them with a bare TypeError)
                raise ValueError(
                    f"Found unsupported keys in the lr scheduler dict: {unknown}: remove them from the output of "
                    f"`configure_optimizers` (the keys are {list(SCHEDULER_KEYS)})."
                )
            plateau = conf.get("reduce_on_plateau")
            found[id(conf["scheduler"])] = (
                conf.get("monitor", monitor),
                bool(conf.get("strict", True)),
                None if plateau is None else bool(plateau),
            )
            return {key: value for key, value in conf.items() if key not in DROPPED_SCHEDULER_KEYS}
        monitor = conf.get("monitor", monitor)
        inner = conf.get("lr_scheduler")
        if inner is not None and not isinstance(inner, dict):
            found[id(inner)] = monitor, True, None
            return conf
        kept = _scheduler_keys(inner, monitor, found)
        return conf if kept is inner else {**conf, "lr_scheduler": kept}
    if isinstance(conf, list | tuple):
        parts = [_scheduler_keys(part, monitor, found) for part in conf]
        if all(a is b for a, b in zip(parts, conf, strict=True)):
            return conf
        return tuple(parts) if isinstance(conf, tuple) else parts
    return conf


def after_module_hook(module: Any, name: str, then: Callable[[], None]) -> Callable[[], None]:
    """Run ``then`` right after the LightningModule's hook ``name`` the next time Lightning calls it (and
    not if it raises). Lightning calls a module's hook as ``getattr(pl_module, name)(...)``
    (``trainer/call.py``, ``_call_lightning_module_hook``), after the callbacks' but, for
    ``on_train_epoch_end``, before the monitoring callbacks' and the loop's own plateau step
    (``_FitLoop.on_advance_end``): the instance's next call runs the class's hook, then ``then``.
    Returns a function that takes this back if the hook was not called."""
    original = getattr(module, name)

    def hook(*args: Any, **kwargs: Any) -> Any:
        vars(module).pop(name, None)  # the class's hook again
        out = original(*args, **kwargs)
        then()
        return out

    setattr(module, name, hook)

    def undo() -> None:
        if vars(module).get(name) is hook:
            del vars(module)[name]

    return undo


def at_plateau_point(trainer: Any, then: Callable[[], None]) -> Callable[[], None]:
    """Run ``then`` where Lightning's automatic loop steps its step-interval ``ReduceLROnPlateau`` schedulers: in
    ``_TrainingEpochLoop.on_advance_end``, after the batch's ``on_train_batch_end`` hooks and its validation (if
    one runs), ``update_lr_schedulers("step", update_plateau_schedulers=True)`` ("update plateau LR scheduler
    after metrics are logged"); in manual optimization it steps nothing there. The loop calls the method on
    itself each batch: the instance's attribute runs Lightning's, then ``then``. Returns a function that
    takes this back."""
    loop = trainer.fit_loop.epoch_loop
    original = loop.update_lr_schedulers

    def update_lr_schedulers(interval: str, update_plateau_schedulers: bool) -> None:
        original(interval, update_plateau_schedulers)
        if interval == "step" and update_plateau_schedulers:
            then()

    vars(loop)["update_lr_schedulers"] = update_lr_schedulers

    def undo() -> None:
        if vars(loop).get("update_lr_schedulers") is update_lr_schedulers:
            del vars(loop)["update_lr_schedulers"]

    return undo


def guard_zero_grad(optimizers: Sequence[Any], check: Callable[[], None]) -> Callable[[], None]:
    """Call ``check`` before every ``zero_grad()`` of ``optimizers`` (Lightning's wrappers, as
    ``self.optimizers()`` gives them) and of the optimizers they wrap, until the returned function is called.
    torch has no hook on ``zero_grad``, and a ``LightningOptimizer`` imitates its optimizer's class, so its
    ``zero_grad`` is torch's method run on the wrapper, not forwarded to the wrapped optimizer
    (``LightningOptimizer.__getattr__`` only sees what the class lacks): each gets an instance attribute
    (one the user set is wrapped, and put back after)."""
    missing = object()
    patched: list[tuple[Any, Any, Any]] = []
    targets: list[Any] = []
    for wrapper in optimizers:
        for target in (wrapper, getattr(wrapper, "optimizer", wrapper)):
            if all(target is not t for t in targets):
                targets.append(target)
    for target in targets:
        before, original = vars(target).get("zero_grad", missing), target.zero_grad

        def zero_grad(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            check()
            return _original(*args, **kwargs)

        vars(target)["zero_grad"] = zero_grad
        patched.append((target, zero_grad, before))

    def undo() -> None:
        for target, mine, before in patched:
            if vars(target).get("zero_grad") is mine:
                if before is missing:
                    del vars(target)["zero_grad"]
                else:
                    vars(target)["zero_grad"] = before

    return undo


def keep_progress_consistent(trainer: Any) -> None:
    """Called at a fit's first training batch: Lightning's loop counters as an uninterrupted run has them.

    A second resume reads the ``total`` counters to tell where the checkpoint was written
    (``_TrainingEpochLoop.update_restart_stage``, ``_FitLoop.update_restart_stage``), but the first
    resume left them off: it resets the epoch's ``current`` batch counters to the last completed
    batch and not the ``total`` ones (``_Progress.reset_on_restart``), so a batch trained again is
    counted twice; and a resume from a checkpoint written at an epoch's last batch does not count
    the next epoch as started. Misled, the loop trains a batch, or a whole epoch, again, though
    the checkpoint holds it. So: every batch total = current + the earlier epochs' batches, and
    during epoch e, e + 1 epochs ready and started, e processed and completed.
    """
    epochs = trainer.fit_loop.epoch_progress
    e = epochs.current.completed  # (what `trainer.current_epoch` reads)
    for tracker in (epochs.current, epochs.total):
        tracker.ready = tracker.started = e + 1
        tracker.processed = tracker.completed = e
    progress = trainer.fit_loop.epoch_loop.batch_progress
    total, current = progress.total, progress.current
    offset = total.completed - current.completed
    total.ready, total.started, total.processed = (
        current.ready + offset,
        current.started + offset,
        current.processed + offset,
    )


def batches_ran_out(trainer: Any) -> bool:
    """Whether the epoch under way trained all its batches (not cut short by ``max_steps``): Lightning
    steps epoch-interval LR schedulers only then (``_TrainingEpochLoop._num_ready_batches_reached``)."""
    return bool(trainer.fit_loop.epoch_loop._num_ready_batches_reached())


def step_plateau_after_resume(trainer: Any) -> None:
    """At the end of an epoch this fit trained batches of: let Lightning step its epoch-interval
    ``ReduceLROnPlateau`` schedulers even if the fit resumed inside the epoch. ``_FitLoop.on_advance_end``
    skips them while the loop is ``restarting`` (the monitored metric is not in a checkpoint), and
    the flag stays up until the resumed epoch's end, though its metrics are fresh by then."""
    trainer.fit_loop._restarting = False


def resume_after_finished_epoch(trainer: Any) -> None:
    """Called at train start: a checkpoint written after an epoch's end hooks (SIGTERM is raised at
    the end of ``_FitLoop.on_advance_end``) holds the finished epoch as completed but its batch
    counters as they were, so a resumed fit continues the next epoch at batch index ``len`` and
    ends it after one batch. Start that epoch's batches at 0, as an uninterrupted run does."""
    loop = trainer.fit_loop
    batches, epochs = loop.epoch_loop.batch_progress, loop.epoch_progress.current
    finished = epochs.processed == epochs.completed == epochs.ready  # (an epoch under way has ready = completed + 1)
    if loop.restarting and finished and batches.current.completed >= trainer.num_training_batches:
        batches.reset_on_run()


def set_up_training_loader(trainer: Any) -> Callable[[], None]:
    """Set up the training loader now (``_FitLoop.setup_data``), for ``num_training_batches`` and the
    loader from ``configure_optimizers``; call what this returns when done. When a checkpoint is
    restored next, the loader is then set up afresh after it, so that its restored state (where a
    resumed epoch continues) is still applied: Lightning's own ``estimated_stepping_batches``
    leaves the first loader in place, and a resumed epoch starts over."""
    loop = trainer.fit_loop
    if loop._combined_loader is not None:
        return lambda: None
    loop.setup_data()

    def release() -> None:
        if trainer.ckpt_path is not None:
            loop._combined_loader = None

    return release


ENDED = object()
"""What ``Upcoming`` gives for a batch past the end of the epoch's data."""


class Upcoming:
    """The training batches after the one being trained, read ahead from the loop's data fetcher without changing
    what the loop trains or saves (a ``Budget``'s counts, summed over ranks before their batches start).

    Lightning's training fetcher (``_PrefetchDataFetcher``) takes each batch with ``next(fetcher.iterator)``, the
    training ``CombinedLoader``'s iterator of ``(batch, batch_idx, dataloader_idx)``, and keeps the batches it took
    ahead itself in ``fetcher.batches`` (one, for a loader without a length; none otherwise). ``fetcher.iterator`` is
    replaced by a reader that takes batches from it ahead of the fetcher and hands them over in order. A stateful
    loader's state is what a checkpoint saves of the loader (``CombinedLoader._state_dicts``): for a loader whose
    state moves as batches are taken from it (``torchdata``'s ``StatefulDataLoader``), while the reader holds batches
    the fetcher has not taken, it gives the state as it was before the first of them, so that a resumed fit starts
    where Lightning's own reading had come to; a loader whose state does not move as a batch is taken (one that reads
    the loop's progress) gives its own. Set up again for each epoch's iterator (``batch``)."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer
        self._reader: _Reader | None = None
        self._restore: Callable[[], None] = lambda: None

    def usable(self) -> bool:
        """Whether the loop's batches can be read ahead (not a ``training_step`` that takes the ``dataloader_iter``)."""
        fetcher = self._trainer.fit_loop._data_fetcher
        return type(fetcher).__name__ == "_PrefetchDataFetcher" and hasattr(fetcher, "batches")

    def batch(self, ahead: int) -> Any:
        """The ``ahead``-th training batch after the one being trained (``ahead >= 1``), as the loader gives it (before
        ``on_before_batch_transfer`` and the move to the device); ``ENDED`` past the epoch's data."""
        fetcher = self._trainer.fit_loop._data_fetcher
        if self._reader is None or fetcher.iterator is not self._reader:
            self._attach(fetcher)
        taken = fetcher.batches  # (the fetcher's own, taken ahead before the reader's)
        if ahead <= len(taken):
            return taken[ahead - 1][0]
        item = self._reader.peek(ahead - len(taken) - 1)  # type: ignore[union-attr]
        return ENDED if item is ENDED else item[0]

    def _attach(self, fetcher: Any) -> None:
        combined = self._trainer.fit_loop._combined_loader
        self._reader = reader = _Reader(fetcher.iterator, combined._state_dicts if combined._state_dicts() else None)
        fetcher.iterator = reader
        if "_state_dicts" in vars(combined):
            return
        own, loop, before = combined._state_dicts, self._trainer.fit_loop, self._restore

        def states() -> list[dict[str, Any]]:
            held, current = self._reader, loop._data_fetcher
            now = own()
            if held is not None and current is not None and current.iterator is held:
                return held.state_before(now)
            return now  # type: ignore[no-any-return]

        combined._state_dicts = states

        def restore() -> None:
            vars(combined).pop("_state_dicts", None)
            before()

        self._restore = restore

    def detach(self) -> None:
        """Leave the loader's state as Lightning reads it (the fit ends); the reader hands over what it holds."""
        self._restore()
        self._restore, self._reader = lambda: None, None


class _Reader:
    """An iterator over ``inner`` that can take items ahead (``peek``) and hands them over in order; with ``states``
    (the loaders' state), the state before each item taken ahead is kept with it."""

    def __init__(self, inner: Any, states: Callable[[], Any] | None) -> None:
        self.inner, self.states = inner, states
        self.held: list[tuple[Any, Any]] = []
        self.ended = False
        self.moved: list[bool] = [False] * (0 if states is None else len(states()))

    def __iter__(self) -> _Reader:
        return self

    def __next__(self) -> Any:
        if self.held:
            return self.held.pop(0)[0]
        if self.ended:
            raise StopIteration
        return next(self.inner)

    def peek(self, index: int) -> Any:
        """The ``index``-th item not handed over yet (0: the next), taken from ``inner`` if need be; ``ENDED`` past
        its end."""
        while len(self.held) <= index and not self.ended:
            state = None if self.states is None else self.states()
            try:
                item = next(self.inner)
            except StopIteration:
                self.ended = True
                break
            if state is not None:  # (which loaders' state moved as the batch was taken)
                after = self.states()  # type: ignore[misc]
                self.moved = [moved or _differ(a, b) for moved, a, b in zip(self.moved, state, after, strict=True)]
            self.held.append((item, state))
        return self.held[index][0] if index < len(self.held) else ENDED

    def state_before(self, now: list[Any]) -> list[Any]:
        """The loaders' state to save (``now``: as they give it): where batches are held, each loader whose state
        moves as a batch is taken as it was before the first of them."""
        if not self.held or self.held[0][1] is None:
            return now
        before = self.held[0][1]
        return [b if moved else n for b, n, moved in zip(before, now, self.moved, strict=True)]


def _differ(a: Any, b: Any) -> bool:
    """Whether two loader states differ (one that cannot be compared, as a state holding tensors: taken to)."""
    try:
        return bool(a != b)
    except Exception:
        return True
