"""Each adapter against its own baseline on a realistic model: the training loop's CPU time.

A tiny GPT-2 (``transformers.GPT2Config``: 2 layers, width 128, 4 heads, a vocabulary of 1024 so that
the output layer does not dwarf the blocks; random tokens, no download), sequences of 128 tokens,
micro-batches of 8, k = 4, AdamW, one CPU thread. Each row is a pair, the ratio against its own
baseline, the same model, data and windows:

* ``AccumulationScheduler(4)`` (``log=True`` and ``log=False``) against ``Trainer(accumulate_grad_batches=4)``;
* ``AccumulationMixin`` (``configure_accumulation(4)``, ``with self.accumulate(batch) as acc:
  acc.backward(loss)``) against Lightning's manual accumulation written by hand
  (``self.manual_backward(loss / 4)``, ``step`` and ``zero_grad`` every 4th batch);
* ``FabricAccumulator(fabric, model, optimizer, 4)`` against a hand-written Fabric loop in LitGPT's
  style (``no_backward_sync(model, enabled=is_accumulating)``, ``fabric.backward(loss / 4)``);
* the callback measuring the gradient noise (``NoiseScale(2, 8, start=4)``, held at k = 4 for the run by
  its warm-up, so that its windows are the built-in's: what is timed is the measuring) and with
  ``lr_scaling="adascale"`` (k = 4), against the built-in with k = 4;
* and the callback against the built-in on a 4 x 512 MLP (0.79M parameters, micro-batches of 64, SGD),
  where the per-window cost that grows with the model shows most.

Only the training loop is timed (``Trainer(enable_progress_bar=False, enable_model_summary=False,
logger=False, enable_checkpointing=False)``, setup excluded; the Fabric loops from their first batch to
their last step). Runs alternate in one process, a warm-up round first, the order reversed every other
round; a shared 2-core machine adds +-15 % to single runs, and noise only adds time, so the headline is
the ratio of the best (minimum) CPU times over the rounds, with the median of the per-round ratios
beside it. Every run's optimizer steps are checked to be its baseline's. Target: each <= 1.01.

The loop's ratio moves by a few per cent between runs on a shared machine; what the callback itself adds
is measured apart, reliably: for each callback run, its own hooks timed in place in one more fit
(``overhead.py``'s ``TimedAccumulationScheduler``, the timing's own cost, measured around an empty
callback's hooks, taken off; best of three), in microseconds per window, and the ratio that work alone
makes on the baseline's window (``hooks us/window``, ``implied``).

    python benchmarks/realistic.py [--batches 32] [--mlp-batches 400] [--rounds 7] [--seq 128]  # about 8 minutes
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from common import timed_epoch
from lightning.fabric import Fabric
from overhead import TimedAccumulationScheduler, TimedEmptyCallback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationMixin, AccumulationScheduler, NoiseScale
from lightning_accum.fabric import FabricAccumulator

K = 4
BUILTIN = "built-in accumulate_grad_batches"
MANUAL = "hand-written manual accumulation"
FABRIC = "hand-written Fabric loop (LitGPT's)"
MLP_BUILTIN = "4 x 512 MLP: built-in accumulate_grad_batches"


def gpt(seq: int, vocab: int) -> nn.Module:
    """The tiny GPT-2, the same weights for every run."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        vocab_size=vocab, n_positions=seq, n_embd=128, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def lm_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    tokens = batch[0] if isinstance(batch, (list, tuple)) else batch
    return model(input_ids=tokens, labels=tokens).loss  # type: ignore[no-any-return]


class GPTModule(pl.LightningModule):
    def __init__(self, seq: int, vocab: int) -> None:
        super().__init__()
        self.model = gpt(seq, vocab)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return lm_loss(self.model, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class HandWrittenManual(GPTModule):
    """Lightning's manual accumulation as its docs write it."""

    def __init__(self, seq: int, vocab: int) -> None:
        super().__init__(seq, vocab)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        self.manual_backward(lm_loss(self.model, batch) / K)
        if (batch_idx + 1) % K == 0:
            optimizer.step()  # type: ignore[union-attr]
            optimizer.zero_grad()  # type: ignore[union-attr]


class Mixin(AccumulationMixin, GPTModule):
    def __init__(self, seq: int, vocab: int) -> None:
        super().__init__(seq, vocab)
        self.configure_accumulation(K)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        with self.accumulate(batch) as acc:
            acc.backward(lm_loss(self.model, batch))


class MLP(pl.LightningModule):
    """4 Linear layers of width 512 (512-512-512-512-10) with ReLU."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for i in range(4):
            layers += [nn.Linear(512, 10 if i == 3 else 512)] + ([nn.ReLU()] if i < 3 else [])
        self.net = nn.Sequential(*layers)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@dataclass
class Timing:
    """One fit: the loop's CPU seconds, its optimizer steps, the CPU seconds of each of its windows but the first."""

    seconds: float
    steps: int
    windows: list[float]


class Windows(pl.Callback):
    """CPU seconds of each window: from one optimizer step's ``on_before_optimizer_step`` to the next's (after
    the other callbacks' hooks: it comes last, so that a window holds the step before it, its micro-batches and
    its close); and the optimizer steps the fit took. It has no ``on_train_batch_start`` or
    ``on_train_batch_end`` of its own: such a callback is taken to read ``callback_metrics`` after any batch
    (``lightning_accum._trainer.reporting.Readers``) and would be handed every number every window, which no
    baseline pays for."""

    def on_train_start(self, *args: Any) -> None:
        self.mark, self.windows = time.process_time(), []

    def on_before_optimizer_step(self, *args: Any) -> None:
        now = time.process_time()
        self.windows.append(now - self.mark)
        self.mark = now

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.steps = trainer.global_step


def fit(module: pl.LightningModule, data: DataLoader[Any], callbacks: Iterable[pl.Callback], **kwargs: Any) -> Timing:
    windows = Windows()
    seconds = timed_epoch(module, data, [*callbacks, windows], **kwargs)
    return Timing(seconds, windows.steps, windows.windows[1:])


def fabric_loop(seq: int, vocab: int, data: DataLoader[Any], ours: bool) -> Timing:
    """A Fabric loop over the data: ours (``FabricAccumulator``) or LitGPT's hand-written accumulation."""
    fabric = Fabric(accelerator="cpu", devices=1)
    model = gpt(seq, vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(data)
    acc = FabricAccumulator(fabric, model, optimizer, K) if ours else None
    steps, windows = 0, []
    gc.collect()
    torch.manual_seed(0)
    start = mark = time.process_time()
    if acc is not None:
        for i, batch in enumerate(loader):
            with acc.accumulate(batch) as step:
                step.backward(lm_loss(model, batch))
            if (i + 1) % K == 0:
                now = time.process_time()
                windows.append(now - mark)
                mark = now
        acc.flush()
        steps = acc.progress.step
    else:
        for i, batch in enumerate(loader):
            is_accumulating = (i + 1) % K != 0
            with fabric.no_backward_sync(model, enabled=is_accumulating):
                loss = lm_loss(model, batch)
                fabric.backward(loss / K)
            if not is_accumulating:
                optimizer.step()
                optimizer.zero_grad()
                steps += 1
                now = time.process_time()
                windows.append(now - mark)
                mark = now
    return Timing(time.process_time() - start, steps, windows[1:])


# a run: (name, its baseline's name, the function that trains once)
Run = tuple[str, str, Callable[[], Timing]]


def hooks_in_place(train: Callable[[type[AccumulationScheduler]], Timing], windows: int) -> float:
    """Microseconds per window inside the callback's own hooks, in place (``overhead.py``'s timing, the timing's
    own cost taken off): in one more fit, untimed, with ``TimedAccumulationScheduler`` for the callback."""
    TimedAccumulationScheduler.inside = TimedEmptyCallback.inside = 0.0
    train(TimedAccumulationScheduler)
    return TimedAccumulationScheduler.inside / windows * 1e6


def timing_floor_per_window(windows: int, data: DataLoader[Any], module: Callable[[], pl.LightningModule]) -> float:
    """Microseconds per window that the timing of the hooks adds by itself (around an empty callback's)."""
    TimedEmptyCallback.inside = 0.0
    fit(module(), data, [TimedEmptyCallback()], accumulate_grad_batches=K)
    return TimedEmptyCallback.inside / windows * 1e6


def runs(args: argparse.Namespace) -> tuple[list[Run], dict[str, int], dict[str, Callable[[], float]]]:
    """Every run, the windows each run's fit has, and for the callback's runs the time inside its hooks in
    place (us per window, ``hooks_in_place``)."""
    seq, vocab = args.seq, args.vocab
    g = torch.Generator().manual_seed(0)
    tokens = DataLoader(TensorDataset(torch.randint(0, vocab, (args.batches * 8, seq), generator=g)), batch_size=8)
    x = torch.randn(args.mlp_batches * 64, 512, generator=g)
    y = torch.randint(0, 10, (args.mlp_batches * 64,), generator=g)
    features = DataLoader(TensorDataset(x, y), batch_size=64)

    inside: dict[str, Callable[[], float]] = {}

    def callback(name: str, make: Callable[[type[AccumulationScheduler]], pl.Callback]) -> Run:
        # (made anew for each fit: a callback holds its progress)
        def train(cls: type[AccumulationScheduler]) -> Timing:
            return fit(GPTModule(seq, vocab), tokens, [make(cls)])

        windows = args.batches // K
        floor = lambda: timing_floor_per_window(windows, tokens, lambda: GPTModule(seq, vocab))  # noqa: E731
        inside[name] = lambda: hooks_in_place(train, windows) - floor()
        return name, BUILTIN, lambda: train(AccumulationScheduler)

    def mlp_callback(name: str, log: bool) -> Run:
        def train(cls: type[AccumulationScheduler]) -> Timing:
            return fit(MLP(), features, [cls(K, log=log)])

        windows = args.mlp_batches // K
        inside[name] = lambda: hooks_in_place(train, windows) - timing_floor_per_window(windows, features, MLP)
        return name, MLP_BUILTIN, lambda: train(AccumulationScheduler)

    table: list[Run] = [
        (BUILTIN, BUILTIN, lambda: fit(GPTModule(seq, vocab), tokens, [], accumulate_grad_batches=K)),
        callback("AccumulationScheduler(4), log=True", lambda cls: cls(K)),
        callback("AccumulationScheduler(4), log=False", lambda cls: cls(K, log=False)),
        # the noise measured in every window, k held at 4 by a warm-up longer than the run: the built-in's windows
        callback(
            "AccumulationScheduler(NoiseScale(2, 8)), k held at 4",
            lambda cls: cls(NoiseScale(2, 8, start=K, warmup=10**9)),
        ),
        callback("AccumulationScheduler(4, lr_scaling='adascale')", lambda cls: cls(K, lr_scaling="adascale")),
        (MANUAL, MANUAL, lambda: fit(HandWrittenManual(seq, vocab), tokens, [])),
        ("AccumulationMixin, configure_accumulation(4)", MANUAL, lambda: fit(Mixin(seq, vocab), tokens, [])),
        (FABRIC, FABRIC, lambda: fabric_loop(seq, vocab, tokens, ours=False)),
        ("FabricAccumulator(fabric, model, optimizer, 4)", FABRIC, lambda: fabric_loop(seq, vocab, tokens, ours=True)),
        (MLP_BUILTIN, MLP_BUILTIN, lambda: fit(MLP(), features, [], accumulate_grad_batches=K)),
        mlp_callback("4 x 512 MLP: AccumulationScheduler(4), log=True", True),
        mlp_callback("4 x 512 MLP: AccumulationScheduler(4), log=False", False),
    ]
    windows = {name: (args.mlp_batches if name.startswith("4 x 512") else args.batches) // K for name, _, _ in table}
    return table, windows, inside


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=32, help="GPT-2 micro-batches per fit (a multiple of 4)")
    parser.add_argument("--mlp-batches", type=int, default=400, help="MLP micro-batches per fit (a multiple of 4)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds, after the warm-up round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--json", type=Path, default=Path(__file__).with_name("realistic.json"))
    args = parser.parse_args()
    if args.batches % K or args.mlp_batches % K or args.rounds < 1:
        parser.error(f"--batches and --mlp-batches must be multiples of {K}, --rounds >= 1")
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*(LeafSpec|does not have many workers|GPU available).*")
    torch.set_num_threads(1)

    table, counts, inside = runs(args)
    times: dict[str, list[float]] = {name: [] for name, _, _ in table}
    windows: dict[str, list[float]] = {name: [] for name, _, _ in table}
    steps: dict[str, int] = {}
    for round_ in range(args.warmup + args.rounds):
        order = table if round_ % 2 == 0 else table[::-1]
        for name, _, run in order:
            timing = run()
            steps.setdefault(name, timing.steps)
            if timing.steps != steps[name]:
                raise RuntimeError(f"{name}: {timing.steps} optimizer steps, {steps[name]} before")
            if round_ >= args.warmup:
                times[name].append(timing.seconds)
                windows[name].extend(timing.windows)
    rows = []
    print(
        f"{'run':<56}{'baseline ms/window':>19}{'ms/window':>11}{'ratio of best':>15}{'median pair':>13}"
        f"{'best window':>13}{'median window':>15}{'hooks us/window':>17}{'implied':>9}"
    )
    for name, baseline, _ in table:
        if name == baseline:
            continue
        if steps[name] != steps[baseline]:
            raise RuntimeError(f"{name}: {steps[name]} optimizer steps, its baseline {steps[baseline]}")
        ours, theirs = times[name], times[baseline]
        ours_w, theirs_w = windows[name], windows[baseline]
        row = {
            "run": name,
            "baseline": baseline,
            "ratio_best": min(ours) / min(theirs),
            "ratio_median_pair": statistics.median(a / b for a, b in zip(ours, theirs, strict=True)),
            "ms_per_window": min(ours) / counts[name] * 1e3,
            "baseline_ms_per_window": min(theirs) / counts[name] * 1e3,
            "added_ms_per_window": (min(ours) - min(theirs)) / counts[name] * 1e3,
            "ratio_best_window": min(ours_w) / min(theirs_w),
            "ratio_median_window": statistics.median(ours_w) / statistics.median(theirs_w),
            "best_s": min(ours),
            "baseline_best_s": min(theirs),
            "steps": steps[name],
        }
        if name in inside:  # the callback's own work in place, and the ratio it alone would make
            us = min(inside[name]() for _ in range(3))
            row["hooks_us_per_window"] = us
            row["ratio_implied"] = 1 + us / (row["baseline_ms_per_window"] * 1e3)
        rows.append(row)
        hooks = f"{row['hooks_us_per_window']:>17.1f}{row['ratio_implied']:>9.4f}" if name in inside else ""
        print(
            f"{name:<56}{row['baseline_ms_per_window']:>19.2f}{row['ms_per_window']:>11.2f}"
            f"{row['ratio_best']:>15.4f}{row['ratio_median_pair']:>13.4f}"
            f"{row['ratio_best_window']:>13.4f}{row['ratio_median_window']:>15.4f}{hooks}"
        )
    result = {
        "benchmark": "realistic",
        "what": (
            f"training-loop CPU time, k={K}, one thread: tiny GPT-2 (2 x 128, vocab {args.vocab}), {args.batches} "
            f"micro-batches of 8 x {args.seq} tokens; 4 x 512 MLP, {args.mlp_batches} micro-batches of 64; "
            f"{args.rounds} rounds after {args.warmup} warm-up"
        ),
        "rows": rows,
        "target": 1.01,
        "machine": f"{platform.machine()} torch {torch.__version__} lightning {pl.__version__}",
    }
    print(f"target: ratio <= {result['target']}")
    args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
