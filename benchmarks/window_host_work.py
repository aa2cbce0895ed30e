"""Where each window's host work goes: ``AccumulationScheduler``'s window end, part by part, in place.

One short fit of a tiny MLP (16-32-1, batches of 8, k = 4, one CPU thread) runs as ``overhead.py``'s does,
with one of these readers of the windows' numbers (``lightning_accum._trainer.reporting.Readers``: the
callback computes only what someone reads, the guide's "Window metrics" says what each is given):

* ``window hook``: an ``on_window_end`` hook: the whole report every window, the gradient's norm measured and
  read, every key published (the most work a window does);
* ``batch hook``: a user's callback with its own ``on_train_batch_end``, taken to read any key of
  ``callback_metrics``: the loss read and every key published every window (the norm at the loggers' steps);
* ``monitor``: a callback monitoring ``accum/loss`` (as ``EarlyStopping`` or ``ModelCheckpoint`` does): the
  loss read and that key published every window;
* ``bar + logger``: the Trainer's defaults, a progress bar (drawing nothing here) and a logger, at a window
  that is not the logger's step: the loss read, ``k`` and the loss shown in the bar;
* ``nobody``: no logger, bar, monitor or hook: nothing kept, read or published but the epoch's last window;
* ``log=False``.

At the end of a window in the middle of its epoch, with the fit's real trainer,
module, optimizer, gradients, batches and losses, the callback's work is replayed and timed outside
Lightning's loop, thousands of times, each repetition starting from the state the fit had (the window's
micro-batches replayed through the callback's own hooks before each timed call):

* ``close``: the window's close as the callback makes it (``WindowEngine.close`` with the window's
  gradients: the counts, the losses and the gradient norm in its one host read);
* ``grad_norm``: within ``close`` where the norm is read, the gradient's norm (``gradients.norms``, not read);
* ``report``: building the ``WindowReport`` (``lightning_accum._trainer.reporting.report``);
* ``publish``: putting it in ``trainer.callback_metrics`` and the progress bar
  (``reporting.Reported.publish``; the loggers are written every ``log_every_n_steps`` steps, not here);
* ``window_end``: the whole of ``on_before_optimizer_step`` and the window's last ``on_train_batch_end``:
  the callback's host work per window (the parts above, and the rest); target <= 20 us with ``log=True``;
* ``microbatch_hooks``: the four hooks of a micro-batch in the middle of its window, for scale.

Where nothing is published (the bar alone, nobody, ``log=False``) the callback neither reports nor publishes:
those parts are left out. The numbers that change every window (the loss, the samples, the norm) are made new
before each replay, as the training loop makes them (a replay repeats its window's own). The fit's timing is
the callback's own hooks, wrapped on the instance to see what they were given (a callback of this tool's with
batch hooks of its own would be a reader). Each time is the best (minimum) over rounds of a round's mean, with
the median of the rounds beside it: a busy machine only adds time. Python's garbage collector stays on, as in
training. The calls are replayed back to back, their code and data hot in the caches: in the training loop,
between the model's kernels and Lightning's own work, the same calls take longer (``overhead.py`` times the
hooks there). Each part is also counted once, which no noise moves: its host reads, its tensor operations and
the containers (tuples, lists, dicts, closures, strings) the package's own code builds.

    python benchmarks/window_host_work.py [--reps 300] [--rounds 15]
"""

from __future__ import annotations

import argparse
import dis
import json
import logging
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from common import timed_epoch
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.loggers import CSVLogger
from overhead import TinyMLP
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader, TensorDataset

import lightning_accum
from lightning_accum import AccumulationScheduler
from lightning_accum._core import gradients
from lightning_accum._trainer import reporting

K = 4
AT = 4 * K - 1  # the window end measured at: the fourth window's last batch (the fit has six windows)
PARTS = ("close", "grad_norm", "report", "publish", "window_end", "microbatch_hooks")
HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
         "on_train_batch_end")  # fmt: skip


class BatchReader(pl.Callback):
    """A user's callback with its own ``on_train_batch_end``: taken to read any number every window."""

    def on_train_batch_end(self, *args: Any) -> None: ...


class WindowHook(pl.Callback):
    """An ``on_window_end`` hook: handed every window's whole report, the gradient's norm included."""

    def on_window_end(self, *args: Any) -> None: ...


class Monitor(pl.Callback):
    """A monitor of ``key`` (as ``EarlyStopping`` or ``ModelCheckpoint`` is one; no hook of its own)."""

    def __init__(self, key: str) -> None:
        self.monitor = key


def bar_and_logger() -> dict[str, Any]:
    """The Trainer's defaults: a progress bar (one that draws nothing) and a logger (the window measured is not
    one of its steps)."""
    return {"callbacks": [ProgressBar()], "enable_progress_bar": True, "logger": CSVLogger(tempfile.mkdtemp())}


# (label, log, the readers' callbacks, the Trainer's options)
READERS: tuple[tuple[str, bool, Callable[[], list[pl.Callback]], Callable[[], dict[str, Any]]], ...] = (
    ("window hook", True, lambda: [WindowHook()], dict),
    ("batch hook", True, lambda: [BatchReader()], dict),
    ("monitor", True, lambda: [Monitor("accum/loss")], dict),
    ("bar + logger", True, list, bar_and_logger),
    ("nobody", True, list, dict),
    ("log=False", False, lambda: [BatchReader()], dict),
)
CHANGING = ("accum/loss", "accum/grad_norm", "accum/samples", "accum/items")  # new numbers in every window


class Internals:
    """The only place this tool reaches past the callback's hooks into its private state (its window engine):
    change it here when the package's internals change."""

    @staticmethod
    def engine(callback: AccumulationScheduler) -> Any:
        return callback._engine

    @staticmethod
    def wants(callback: AccumulationScheduler) -> reporting.Wants:
        """What the fit's readers ask of a window in the middle of its epoch (as the callback finds it)."""
        return callback._readers.wants(Internals.engine(callback).progress.step + 1)

    @staticmethod
    def close(callback: AccumulationScheduler, trainer: pl.Trainer, optimizer: Any) -> Any:
        """The window's close, as ``on_before_optimizer_step`` makes it (single device)."""
        wants, grads = Internals.wants(callback), gradients.optimizer_grads(optimizer)
        return Internals.engine(callback).close(trainer.strategy, grads=grads, losses=wants.losses, norm=wants.norm)

    @staticmethod
    def grad_norm(optimizer: Any) -> Any:
        """The gradient's norm as the close measures it with ``log=True`` (device scalars, not read)."""
        return gradients.norms(gradients.optimizer_grads(optimizer))

    @staticmethod
    def forget(callback: AccumulationScheduler) -> None:
        """Drop the open (or closed, not stepped) window: the next replay opens it again (the callback's short path
        off, as the callback turns it off where it drops a window itself)."""
        Internals.engine(callback).discard()
        callback._lean = False

    @staticmethod
    def advance(callback: AccumulationScheduler, epoch: int) -> Any:
        """After the step: the closed window into the progress (as ``on_train_batch_end`` does, its short path off
        with it); its closing."""
        callback._lean = False
        return Internals.engine(callback).advance(epoch)

    @staticmethod
    def report(callback: AccumulationScheduler, trainer: pl.Trainer, closing: Any) -> reporting.WindowReport:
        return reporting.report(trainer.optimizers, Internals.engine(callback), closing)

    @staticmethod
    def progress(callback: AccumulationScheduler) -> Any:
        return callback.progress

    @staticmethod
    def reported(callback: AccumulationScheduler) -> reporting.Reported:
        return callback._reported

    @staticmethod
    def changed(reported: reporting.Reported) -> None:
        """Make the numbers that change every window new to ``reported`` (a replayed window repeats its own: the
        tensors ``callback_metrics`` holds would be kept, where the training loop makes new ones)."""
        for key in CHANGING:
            reported._numbers.pop(key, None)

    @staticmethod
    def set_progress(callback: AccumulationScheduler, progress: Any) -> None:
        """Give the progress back (each replayed window end counts a step the fit did not take)."""
        Internals.engine(callback).progress = progress


class Capture:
    """Wraps the callback's hooks on the instance (Lightning calls them by name) to keep what the fit gave them
    for each batch; at batch ``AT``'s end, after the callback's own hook, hands a ``Replay`` of its window to
    ``measure``. The replays call the hooks as they were (``hooks``)."""

    def __init__(self, callback: AccumulationScheduler, measure: Callable[[Replay], None]) -> None:
        self.callback, self.measure = callback, measure
        self.batches: dict[int, Any] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, Any] = {}
        self.optimizer: Any = None
        self.trainer: pl.Trainer | None = None
        self._idx = 0
        self.hooks = {name: getattr(callback, name) for name in HOOKS}
        for name in HOOKS:
            setattr(callback, name, getattr(self, name))

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.batches[idx], self._idx = batch, idx
        self.hooks["on_train_batch_start"](trainer, module, batch, idx)

    def on_before_backward(self, trainer: pl.Trainer, module: pl.LightningModule, loss: torch.Tensor) -> None:
        self.losses[self._idx] = loss
        self.hooks["on_before_backward"](trainer, module, loss)

    def on_after_backward(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.hooks["on_after_backward"](trainer, module)

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.hooks["on_before_optimizer_step"](trainer, module, optimizer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        self.hooks["on_train_batch_end"](trainer, module, outputs, batch, idx)
        self.outputs[idx] = outputs
        if idx == AT:
            self.trainer = trainer
            self.measure(Replay(self, trainer, module))


class Replay:
    """The window that ended at batch ``AT``, replayed through the callback's own hooks with what the fit gave them."""

    def __init__(self, capture: Capture, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.c, self.trainer, self.module, self.hooks = capture, trainer, module, capture.hooks
        self.first = AT - K + 1

    def microbatch(self, i: int) -> None:
        """The hooks of the window's ``i``-th micro-batch, its ``on_train_batch_end`` but for the last."""
        idx, c, hooks, t, m = self.first + i, self.c, self.hooks, self.trainer, self.module
        hooks["on_train_batch_start"](t, m, c.batches[idx], idx)
        hooks["on_before_backward"](t, m, c.losses[idx])
        hooks["on_after_backward"](t, m)
        if i < K - 1:
            hooks["on_train_batch_end"](t, m, c.outputs[idx], c.batches[idx], idx)

    def window_end(self) -> None:
        c, hooks, t, m = self.c, self.hooks, self.trainer, self.module
        hooks["on_before_optimizer_step"](t, m, c.optimizer)
        hooks["on_train_batch_end"](t, m, c.outputs[AT], c.batches[AT], AT)

    def fill(self) -> None:
        """The window's micro-batches (all but the window end's work)."""
        for i in range(K):
            self.microbatch(i)


@dataclass
class Part:
    """One part of the work: ``call`` is timed (and counted), after ``setup`` and before ``teardown``."""

    setup: Callable[[], object]
    call: Callable[[], object]
    teardown: Callable[[], object]


def nothing() -> None:
    return None


def timed(part: Part, rounds: int, reps: int) -> tuple[float, float]:
    """Microseconds per call: the best and the median over ``rounds`` of the mean of ``reps`` calls."""
    means = []
    for _ in range(rounds):
        total = 0.0
        for _ in range(reps):
            part.setup()
            start = time.perf_counter()
            part.call()
            total += time.perf_counter() - start
            part.teardown()
        means.append(total / reps * 1e6)
    return min(means), statistics.median(means)


class Work(TorchFunctionMode):
    """Counts, while entered: host reads, tensor operations (attribute reads such as ``.grad`` left out), and
    the bytecodes of the package's own code that build a container, a closure or a string."""

    BUILDS = frozenset({
        "BUILD_TUPLE", "BUILD_LIST", "BUILD_SET", "BUILD_MAP", "BUILD_CONST_KEY_MAP", "BUILD_STRING", "BUILD_SLICE",
        "LIST_APPEND", "SET_ADD", "MAP_ADD", "LIST_EXTEND", "SET_UPDATE", "DICT_UPDATE", "DICT_MERGE",
        "MAKE_FUNCTION", "FORMAT_VALUE", "CALL_FUNCTION_EX",
    })  # fmt: skip
    READS = frozenset({torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
                       torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.numpy})  # fmt: skip
    PACKAGE = str(Path(lightning_accum.__file__).resolve().parent)
    _opnames: dict[Any, dict[int, str]] = {}

    def __init__(self) -> None:
        super().__init__()
        self.reads = self.tensor_ops = self.builds = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in self.READS:
            self.reads += 1
        elif getattr(func, "__name__", "") != "__get__":
            self.tensor_ops += 1
        return func(*args, **(kwargs or {}))

    def _local(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            names = self._opnames.get(frame.f_code)
            if names is None:
                names = self._opnames[frame.f_code] = {i.offset: i.opname for i in dis.get_instructions(frame.f_code)}
            self.builds += names.get(frame.f_lasti, "") in self.BUILDS
        return self._local

    def _call(self, frame: Any, event: str, arg: Any) -> Any:
        if not frame.f_code.co_filename.startswith(self.PACKAGE):
            return None
        frame.f_trace_opcodes = True
        return self._local

    def __enter__(self) -> Work:
        self._previous = sys.gettrace()
        sys.settrace(self._call)
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        sys.settrace(self._previous)


def counted(part: Part) -> dict[str, int]:
    part.setup()
    with Work() as work:
        part.call()
    part.teardown()
    return {"host_reads": work.reads, "tensor_ops": work.tensor_ops, "builds": work.builds}


def measure(replay: Replay, reps: int, rounds: int, out: dict[str, Any]) -> None:
    cb, trainer, module, optimizer = replay.c.callback, replay.trainer, replay.module, replay.c.optimizer
    hooks = replay.hooks
    saved = Internals.progress(cb)
    wants = Internals.wants(cb)

    def forget() -> None:
        Internals.forget(cb)

    def fill_anew() -> None:
        replay.fill()
        Internals.changed(Internals.reported(cb))

    def rest_of_window() -> None:
        for i in range(2, K):
            replay.microbatch(i)
        forget()

    parts = {
        "microbatch_hooks": Part(lambda: replay.microbatch(0), lambda: replay.microbatch(1), rest_of_window),
        "close": Part(replay.fill, lambda: Internals.close(cb, trainer, optimizer), forget),
        "window_end": Part(fill_anew, replay.window_end, lambda: Internals.set_progress(cb, saved)),
    }
    if wants.norm:
        parts["grad_norm"] = Part(nothing, lambda: Internals.grad_norm(optimizer), nothing)
    if wants.publish:  # a stepped window, as the callback reports it: its hooks up to the step, the progress advanced
        replay.fill()
        hooks["on_before_optimizer_step"](trainer, module, optimizer)
        closing = Internals.advance(cb, trainer.current_epoch)
        window = Internals.report(cb, trainer, closing)
        reported = reporting.Reported()
        parts["report"] = Part(nothing, lambda: Internals.report(cb, trainer, closing), nothing)
        parts["publish"] = Part(
            lambda: Internals.changed(reported), lambda: reported.publish(trainer, window, wants=wants), nothing
        )
    for name, part in parts.items():
        out[name] = (*timed(part, rounds, reps), counted(part))
    if wants.publish:
        hooks["on_train_batch_end"](trainer, module, replay.c.outputs[AT], replay.c.batches[AT], AT)
        Internals.set_progress(cb, saved)
    # leave the fit as it was at this batch's end: the window replayed and stepped once more, the progress given back
    replay.fill()
    replay.window_end()
    Internals.set_progress(cb, saved)


def run(log: bool, readers: list[pl.Callback], reps: int, rounds: int, **options: Any) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    batches = 6 * K
    x, y = torch.randn(batches * 8, 16, generator=g), torch.randn(batches * 8, 1, generator=g)
    data = DataLoader(TensorDataset(x, y), batch_size=8)
    callback = AccumulationScheduler(K, log=log)
    parts: dict[str, Any] = {}
    capture = Capture(callback, lambda replay: measure(replay, reps, rounds, parts))
    callbacks = [callback, *readers, *options.pop("callbacks", [])]
    timed_epoch(TinyMLP(), data, callbacks, **options)
    trainer = capture.trainer
    if trainer is None or callback.progress.step != trainer.global_step or trainer.global_step != batches // K:
        raise RuntimeError("the replays left the fit's progress changed (or nothing was measured)")
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=300, help="timed calls per round")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", type=Path, default=Path(__file__).with_name("window_host_work.json"))
    args = parser.parse_args()
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*(LeafSpec|does not have many workers|GPU available).*")
    torch.set_num_threads(1)
    rows = []
    totals = {}
    header = f"{'readers':<14}{'part':<18}{'best us':>9}{'median us':>11}{'host reads':>12}{'tensor ops':>12}"
    print(f"{header}{'builds':>8}")
    for label, log, readers, options in READERS:
        parts = run(log, readers(), args.reps, args.rounds, **options())
        for part in PARTS:
            if part not in parts:
                continue
            best, median, counts = parts[part]
            rows.append({"readers": label, "log": log, "part": part, "us": best, "us_median": median, **counts})
            print(
                f"{label:<14}{part:<18}{best:>9.1f}{median:>11.1f}{counts['host_reads']:>12}"
                f"{counts['tensor_ops']:>12}{counts['builds']:>8}"
            )
        named = sum(parts[p][0] for p in ("close", "report", "publish") if p in parts)
        other = parts["window_end"][0] - named
        totals[f"window_end_us_{label}"] = parts["window_end"][0]
        totals[f"other_us_{label}"] = other
        print(f"{label:<14}{'(rest of the end)':<18}{other:>9.1f}")
    result = {
        "benchmark": "window_host_work",
        "what": f"us per window in place, tiny MLP, k={K}, best of {args.rounds} rounds of {args.reps} calls",
        "rows": rows,
        **totals,
        "target_us": 20,
        "machine": f"{platform.machine()} torch {torch.__version__} lightning {pl.__version__}",
    }
    print(f"target: window_end (log=True) <= {result['target_us']} us")
    args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
