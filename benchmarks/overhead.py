"""Per-batch overhead of AccumulationScheduler against Lightning's built-in accumulation.

Worst case for overhead: a tiny MLP and many small batches, so that the Trainer's own
per-batch work dominates. Runs alternate (built-in, callback without and with logging, ...)
in one process. Shared 2-core machines add +-15 % noise to single runs, and noise only
adds time, so the headline figure is the ratio of the best (minimum) CPU times over the
rounds, as ``timeit`` advises; the median of the per-round ratios is printed beside it.
Only the training loop is timed (setup excluded). Lightning's ``self.log``
has a per-batch cost for every logged key, hence the two callback rows; and Lightning's
dispatch of callback hooks has a cost of its own, measured by the empty-callback row.
With no logger, no progress bar and no monitor nobody reads the window numbers, and ``log=True`` computes
none of them (``lightning_accum._trainer.reporting.Readers``); the ``monitor`` rows add a callback monitoring
``accum/loss`` (as ``EarlyStopping`` or ``ModelCheckpoint`` does, or the progress bar reads), so that every
window's loss is read and published, as in most training runs.

    python benchmarks/overhead.py [--batches 600] [--repeats 30] [--k 4]

``--against DIR``: another version's package (``git archive REV src/lightning_accum | tar -x -C /tmp/REV``, then
``--against /tmp/REV/src/lightning_accum``), imported under another name and timed beside this one in the same
process, in interleaved rounds: the time inside each version's hooks per micro-batch (the timing floor taken off),
and each version's loop against the built-in, the medians and the best of the rounds; with the load average.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from common import timed_epoch
from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationScheduler


class TinyMLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class EmptyCallback(pl.Callback):
    """Overrides the hooks AccumulationScheduler uses and does nothing: the floor cost that
    Lightning's per-hook dispatch puts on any callback."""

    def on_train_batch_start(self, *args: Any) -> None: ...

    def on_before_backward(self, *args: Any) -> None: ...

    def on_after_backward(self, *args: Any) -> None: ...

    def on_before_optimizer_step(self, *args: Any) -> None: ...

    def on_train_batch_end(self, *args: Any) -> None: ...


class Monitor(pl.Callback):
    """A monitor of ``accum/loss`` (as ``EarlyStopping`` or ``ModelCheckpoint`` is one; no hook of its own): a
    reader of every window's numbers."""

    monitor = "accum/loss"


class TimedHooks:
    """Adds up, in the class's ``inside``, the wall time spent inside the hooks of the class it is mixed into
    (the callback's logic, in place)."""

    inside = 0.0
    by_hook: dict[str, float] = {}

    def _timed(self, hook: Any, *args: Any) -> Any:
        start = time.perf_counter()
        hook(*args)
        took = time.perf_counter() - start
        cls = type(self)
        cls.inside += took
        cls.by_hook[hook.__name__] = cls.by_hook.get(hook.__name__, 0.0) + took

    def on_train_batch_start(self, *args: Any) -> None:
        self._timed(super().on_train_batch_start, *args)  # type: ignore[misc]

    def on_before_backward(self, *args: Any) -> None:
        self._timed(super().on_before_backward, *args)  # type: ignore[misc]

    def on_after_backward(self, *args: Any) -> None:
        self._timed(super().on_after_backward, *args)  # type: ignore[misc]

    def on_before_optimizer_step(self, *args: Any) -> None:
        self._timed(super().on_before_optimizer_step, *args)  # type: ignore[misc]

    def on_train_batch_end(self, *args: Any) -> None:
        self._timed(super().on_train_batch_end, *args)  # type: ignore[misc]


class TimedAccumulationScheduler(TimedHooks, AccumulationScheduler):
    """``AccumulationScheduler`` with the time inside its hooks added up."""

    inside = 0.0
    by_hook: dict[str, float] = {}


class TimedEmptyCallback(TimedHooks, EmptyCallback):
    """``EmptyCallback`` with the same timing around its hooks: what the timing itself adds in place (the call
    through ``super()``, two clock reads), taken off the callback's figure."""

    inside = 0.0


class ConnectorTimer:
    """Adds up the wall time spent inside Lightning's logger connector's per-batch work (where every
    key logged with ``self.log`` is processed again on every batch), while entered."""

    METHODS = ("on_batch_start", "on_batch_end", "update_train_step_metrics")

    def __init__(self) -> None:
        self.inside = 0.0
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> ConnectorTimer:
        for name in self.METHODS:
            original = self._saved[name] = getattr(_LoggerConnector, name)

            def timed(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.inside += time.perf_counter() - start

            setattr(_LoggerConnector, name, timed)
        return self

    def __exit__(self, *args: Any) -> None:
        for name, original in self._saved.items():
            setattr(_LoggerConnector, name, original)


def timed_fit(
    data: DataLoader[Any],
    k: int,
    ours: bool,
    log: bool = False,
    empty: bool = False,
    timed: bool = False,
    monitor: bool = False,
) -> float:
    callbacks: list[pl.Callback] = [Monitor()] if monitor else []
    if ours:
        callbacks.insert(0, AccumulationScheduler(k, log=log))
    elif empty:
        callbacks.insert(0, EmptyCallback())
    elif timed:
        callbacks.insert(0, TimedAccumulationScheduler(k, log=log))
    return timed_epoch(TinyMLP(), data, callbacks, accumulate_grad_batches=1 if ours or timed else k)


def in_place(
    data: DataLoader[Any], k: int, batches: int, log: bool, monitor: bool = False, rounds: int = 5
) -> tuple[float, float]:
    """Microseconds per micro-batch inside the callback's hooks, and inside Lightning's logger
    connector: the best of ``rounds`` fits."""
    hooks, connector = [], []
    for _ in range(rounds):
        TimedAccumulationScheduler.inside = 0.0
        with ConnectorTimer() as timer:
            timed_fit(data, k, ours=False, timed=True, log=log, monitor=monitor)
        hooks.append(TimedAccumulationScheduler.inside / batches * 1e6)
        connector.append(timer.inside / batches * 1e6)
    return min(hooks), min(connector)


def timing_floor(data: DataLoader[Any], k: int, batches: int, rounds: int = 5) -> float:
    """Microseconds per micro-batch that the timing of the hooks adds by itself (``TimedEmptyCallback``, beside
    the built-in): the best of ``rounds`` fits."""
    inside = []
    for _ in range(rounds):
        TimedEmptyCallback.inside = 0.0
        timed_epoch(TinyMLP(), data, [TimedEmptyCallback()], accumulate_grad_batches=k)
        inside.append(TimedEmptyCallback.inside / batches * 1e6)
    return min(inside)


def load_against(path: Path) -> Any:
    """Another version of the package (its ``lightning_accum`` directory), copied under the name
    ``lightning_accum_against`` with its own imports renamed, and imported."""
    import importlib
    import shutil
    import sys
    import tempfile

    root = Path(tempfile.mkdtemp())
    target = root / "lightning_accum_against"
    shutil.copytree(path, target)
    for file in target.rglob("*.py"):
        file.write_text(file.read_text().replace("lightning_accum", "lightning_accum_against"))
    sys.path.insert(0, str(root))
    return importlib.import_module("lightning_accum_against")


def against(path: Path, args: argparse.Namespace, data: DataLoader[Any]) -> dict[str, Any]:
    """This version and the one at ``path`` in place, interleaved: microseconds inside the hooks per micro-batch,
    and each loop's time over the built-in's (and the empty callback's), ``log=True``, nobody reading."""
    import os

    other = load_against(path)

    class TimedOther(TimedHooks, other.AccumulationScheduler):  # type: ignore[misc, name-defined]
        inside = 0.0
        by_hook: dict[str, float] = {}

    timed: dict[str, Any] = {"this": TimedAccumulationScheduler, "against": TimedOther}
    plain: dict[str, Any] = {"this": AccumulationScheduler, "against": other.AccumulationScheduler}
    hooks: dict[str, list[float]] = {"this": [], "against": [], "floor": []}
    each: dict[str, dict[str, list[float]]] = {"this": {}, "against": {}}  # by hook
    loops: dict[str, list[float]] = {"built-in": [], "empty": [], "this": [], "against": []}
    load = os.getloadavg()
    for repeat in range(args.repeats + 1):  # (the first round a warm-up)
        order = ["this", "against"] if repeat % 2 else ["against", "this"]
        round_loops = {"built-in": timed_epoch(TinyMLP(), data, [], accumulate_grad_batches=args.k)}
        round_loops["empty"] = timed_epoch(TinyMLP(), data, [EmptyCallback()], accumulate_grad_batches=args.k)
        TimedEmptyCallback.inside = 0.0
        timed_epoch(TinyMLP(), data, [TimedEmptyCallback()], accumulate_grad_batches=args.k)
        floor = TimedEmptyCallback.inside / args.batches * 1e6
        round_hooks = {"floor": floor}
        for name in order:
            timed[name].inside, timed[name].by_hook = 0.0, {}
            timed_epoch(TinyMLP(), data, [timed[name](args.k, log=True)], accumulate_grad_batches=1)
            round_hooks[name] = timed[name].inside / args.batches * 1e6 - floor
            if repeat:
                for hook, seconds in timed[name].by_hook.items():
                    each[name].setdefault(hook, []).append(seconds / args.batches * 1e6)
            round_loops[name] = timed_epoch(TinyMLP(), data, [plain[name](args.k, log=True)], accumulate_grad_batches=1)
        if repeat:
            for name, value in round_hooks.items():
                hooks[name].append(value)
            for name, value in round_loops.items():
                loops[name].append(value)
    out: dict[str, Any] = {
        "against": str(path),
        "rounds": args.repeats,
        "load_before": load,
        "load_after": os.getloadavg(),
    }
    for name in ("this", "against"):
        out[f"hooks_us_{name}_median"] = statistics.median(hooks[name])
        out[f"hooks_us_{name}_best"] = min(hooks[name])
    out["hooks_ratio_this_over_against_median"] = statistics.median(
        t / a for t, a in zip(hooks["this"], hooks["against"], strict=True)
    )
    out["timing_floor_us_median"] = statistics.median(hooks["floor"])
    for name in ("this", "against"):  # (each hook's, the timing floor's share not taken off)
        out[f"by_hook_us_{name}_median"] = {hook: statistics.median(v) for hook, v in each[name].items()}
    for name in ("empty", "this", "against"):
        ratios = [v / b for v, b in zip(loops[name], loops["built-in"], strict=True)]
        out[f"loop_{name}_over_builtin_median"] = statistics.median(ratios)
        out[f"loop_{name}_over_builtin_best"] = min(loops[name]) / min(loops["built-in"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--json", type=Path, default=Path(__file__).with_name("overhead.json"))
    parser.add_argument("--against", type=Path, default=None, help="another version's src/lightning_accum")
    args = parser.parse_args()

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(args.batches * 8, 16, generator=g), torch.randn(args.batches * 8, 1, generator=g)
    data = DataLoader(TensorDataset(x, y), batch_size=8)
    if args.against is not None:
        print(json.dumps(against(args.against, args, data), indent=2))
        return

    variants: dict[str, dict[str, bool]] = {
        "built-in accumulate_grad_batches": {"ours": False},
        "built-in + empty callback (floor)": {"ours": False, "empty": True},
        "AccumulationScheduler, log=False": {"ours": True, "log": False},
        "AccumulationScheduler, log=True": {"ours": True, "log": True},
        "AccumulationScheduler, log=True, monitor": {"ours": True, "log": True, "monitor": True},
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(args.repeats + 1):  # the first round is a warm-up
        for name, kwargs in variants.items():
            seconds = timed_fit(data, args.k, **kwargs)
            if repeat:
                times[name].append(seconds)
    baseline = times["built-in accumulate_grad_batches"]
    rows = []
    print(f"{'run':<36}{'best s':>8}{'ratio of best':>15}{'median pair ratio':>19}{'us/batch':>10}")
    for name, values in times.items():
        row = {
            "run": name,
            "best_s": min(values),
            "ratio_best": min(values) / min(baseline),
            "ratio_median_pair": statistics.median(v / b for v, b in zip(values, baseline, strict=True)),
            "us_per_batch_added": (min(values) - min(baseline)) / args.batches * 1e6,
        }
        rows.append(row)
        print(
            f"{name:<36}{row['best_s']:>8.3f}{row['ratio_best']:>15.4f}{row['ratio_median_pair']:>19.4f}"
            f"{row['us_per_batch_added']:>+10.1f}"
        )
    result = {
        "benchmark": "overhead",
        "what": f"training-loop CPU time, {args.batches} batches, k={args.k}, tiny MLP, {args.repeats} rounds",
        "baseline": "Trainer(accumulate_grad_batches=k)",
        "rows": rows,
        "target": 1.03,  # (issue 34: as close to the empty callback's floor, 1.01-1.04 here, as can be)
        "machine": f"{platform.machine()} torch {torch.__version__} lightning {pl.__version__}",
    }
    best_us = min(baseline) / args.batches * 1e6
    timed_fit(data, args.k, ours=False, timed=True)  # (warm-up)
    floor = result["timing_floor_us_per_batch"] = timing_floor(data, args.k, args.batches)
    print(f"the timing of the hooks adds {floor:.1f} us/micro-batch by itself (around empty hooks); taken off below")
    for log, monitor in ((False, False), (True, False), (True, True)):
        hooks_us, connector_us = in_place(data, args.k, args.batches, log, monitor)
        hooks_us -= floor
        key = f"log_{log}" + ("_monitor" if monitor else "")
        result[f"callback_hooks_us_per_batch_{key}"] = hooks_us
        result[f"logger_connector_us_per_batch_{key}"] = connector_us
        print(
            f"log={log}{', monitor' if monitor else ''}: inside the callback's hooks {hooks_us:.1f} us/micro-batch "
            f"({100 * hooks_us / best_us:.2f} % "
            f"of a {best_us:.0f} us batch; target 12); inside Lightning's logger connector {connector_us:.1f} "
            "us/micro-batch"
        )
    connector = result["logger_connector_us_per_batch_log_True_monitor"]
    added = connector - result["logger_connector_us_per_batch_log_False"]
    result["logging_us_per_batch_added"] = added
    print(f"Lightning's logging work added by log=True (a monitor reading every window): {added:+.1f} us/micro-batch")
    print(f"target: ratio <= {result['target']}")
    args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
