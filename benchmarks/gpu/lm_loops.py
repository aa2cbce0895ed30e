"""Parts 1 and 2 of the GPU harness: the loop's cost at real size and the host syncs it makes.

A GPT-2-small-sized causal LM from a ``transformers`` config (12 layers of 768, 12 heads, the GPT-2
vocabulary: about 124M parameters; random tokens, nothing downloaded), bf16-mixed, sequences of 1024,
AdamW, k = 4 and 16. Each configuration is one fit (or one Fabric / bare loop) on the same weights and the
same token batches, already on the device: one warm-up window, ``counted`` windows with the sync counter on
(part 2: syncs per micro-batch inside a window and per window), ``rounds`` x ``per_round`` timed windows
(part 1: the median over the rounds of the time per optimizer step, ``torch.cuda.synchronize`` at each
round's edges only, so that a sync the loop makes is paid inside the timed region), and one tail window,
so that the epoch's end is not timed. Each is compared with its own baseline in the same process:

* the callback (``log=True``, ``log=False``, ``normalize="items"`` with ``count.causal_lm_tokens``,
  ``microbatch_size`` at the loader batch) against ``Trainer(accumulate_grad_batches=k)``;
* the mixin against Lightning's manual accumulation written by hand;
* ``FabricAccumulator`` against a hand-written Fabric loop in LitGPT's style;
* under a ``Budget`` closing the same windows of k (issue 52): the callback counting tokens with
  ``count.causal_lm_tokens`` (a count on the device, which the budget reads on the host as each micro-batch
  starts: one sync per micro-batch, warned) against the built-in, and ``FabricAccumulator`` counting samples (a
  host count: none) against the hand-written Fabric loop. On one device no count is summed over ranks (no
  collective); ``benchmarks/scale.py`` counts those on ranks;
* and every run against the physical floor: the bare model's k forward and backward passes and one
  AdamW step under ``torch.autocast``, no Lightning at all.
"""

from __future__ import annotations

import copy
import statistics
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from device_clock import Device, SyncCounter
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader

from lightning_accum import AccumulationMixin, AccumulationScheduler, Budget
from lightning_accum.count import causal_lm_tokens
from lightning_accum.fabric import FabricAccumulator

BUILTIN = "Trainer(accumulate_grad_batches=k)"
MANUAL = "hand-written manual accumulation"
FABRIC = "hand-written Fabric loop (LitGPT's)"
FLOOR = "bare torch floor (no Lightning)"
BUDGET_CALLBACK = "AccumulationScheduler(Budget(k x tokens), normalize='items', count=causal_lm_tokens)"
BUDGET_FABRIC = "FabricAccumulator(fabric, model, optimizer, Budget(k x samples, unit='samples'))"
PRECISION = "bf16-mixed"
Row = tuple[str, str, str, str, str]  # part, what, measured, value, target


@dataclass
class LMSize:
    """The causal LM and its batches."""

    layers: int = 12
    width: int = 768
    heads: int = 12
    vocab: int = 50257
    seq: int = 1024
    microbatch: int = 8

    def describe(self) -> str:
        model = f"GPT-2 {self.layers} x {self.width}, {self.heads} heads, vocab {self.vocab}"
        return f"{model}, micro-batches of {self.microbatch} x {self.seq} tokens"


def causal_lm(size: LMSize, device: Device) -> nn.Module:
    """The LM from a config (seeded, float32 weights: bf16-mixed casts inside autocast)."""
    import transformers

    config = transformers.GPT2Config(
        vocab_size=size.vocab, n_positions=size.seq, n_embd=size.width, n_layer=size.layers, n_head=size.heads
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).to(device.torch)


def token_batches(size: LMSize, device: Device, count: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator(device=device.torch).manual_seed(0)
    batches = []
    for _ in range(count):
        tokens = torch.randint(0, size.vocab, (size.microbatch, size.seq), device=device.torch, generator=g)
        batches.append({"input_ids": tokens, "labels": tokens})
    return batches


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss  # type: ignore[no-any-return]


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-5)


@dataclass
class Plan:
    """Where one run's windows fall, and what was measured in them: 1 warm-up window, ``counted`` windows
    with the sync counter on, ``rounds`` x ``per_round`` timed windows, 1 tail window."""

    device: Device
    k: int
    counted: int
    rounds: int
    per_round: int
    marks: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.counter = SyncCounter(self.device)
        self.counting = False
        self.mark = self.start = 0.0
        self.last = -1
        self.first_window = float("nan")  # seconds of window 0 (the warm-up)

    @property
    def windows(self) -> int:
        return 2 + self.counted + self.rounds * self.per_round

    @property
    def batches(self) -> int:
        return self.k * self.windows

    def at_batch(self, i: int) -> None:
        """Called as micro-batch ``i`` (from 0) starts (again for its pieces or a redo: ignored)."""
        if i <= self.last:
            return
        self.last = i
        if i == 0:
            self.start = self.device.now()
        if self.counting:
            self.marks.append(self.counter.count)
        window, offset = divmod(i, self.k)
        if offset:
            return
        timed_from = 1 + self.counted
        if window == 1:
            self.first_window = self.device.now() - self.start
        if window == 1 and self.counted:
            self.marks = [0]
            self.counting = True
            self.counter.start()
        if window == timed_from:
            if self.counting:
                self.counter.stop()
                self.counting = False
            self.mark = self.device.now()
        elif window > timed_from and (window - timed_from) % self.per_round == 0 and len(self.times) < self.rounds:
            now = self.device.now()
            self.times.append((now - self.mark) / self.per_round)
            self.mark = now

    def seconds_per_step(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")

    def syncs(self) -> tuple[float, float]:
        """Host syncs per micro-batch inside a window (not the window's last) and per window."""
        per_batch = [b - a for a, b in zip(self.marks[:-1], self.marks[1:], strict=True)]
        inner = [n for j, n in enumerate(per_batch) if j % self.k != self.k - 1]
        if not per_batch:
            return float("nan"), float("nan")
        return (sum(inner) / len(inner) if inner else 0.0), sum(per_batch) / self.counted


class Probe(pl.Callback):
    """Keeps the fit's optimizer steps and its ``callback_metrics`` at its end. (No ``on_train_batch_start`` or
    ``on_train_batch_end`` here or on the module: the package takes such a hook for a reader of every window's
    numbers, which no baseline pays for; the module's ``training_step`` marks each micro-batch instead, so
    that a sync in a hook before it counts to the micro-batch before.)"""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.steps = trainer.global_step
        self.metrics = {key: float(value) for key, value in trainer.callback_metrics.items()}


class LM(pl.LightningModule):
    def __init__(self, model: nn.Module, k: int) -> None:
        super().__init__()
        self.model, self.k = model, k
        self.plan: Plan | None = None

    def mark(self, batch_idx: int) -> None:
        if self.plan is not None:
            self.plan.at_batch(batch_idx)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.mark(batch_idx)
        return lm_loss(self.model, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return adamw(self.model)


class HandWrittenManual(LM):
    """Lightning's manual accumulation as its docs write it."""

    def __init__(self, model: nn.Module, k: int) -> None:
        super().__init__(model, k)
        self.automatic_optimization = False

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:  # type: ignore[override]
        self.mark(batch_idx)
        optimizer = self.optimizers()
        self.manual_backward(lm_loss(self.model, batch) / self.k)
        if (batch_idx + 1) % self.k == 0:
            optimizer.step()  # type: ignore[union-attr]
            optimizer.zero_grad()  # type: ignore[union-attr]


class Mixin(AccumulationMixin, LM):
    def __init__(self, model: nn.Module, k: int) -> None:
        super().__init__(model, k)
        self.configure_accumulation(k)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:  # type: ignore[override]
        self.mark(batch_idx)
        with self.accumulate(batch) as acc:
            acc.backward(lm_loss(self.model, batch))


def fit(
    device: Device,
    module: LM,
    batches: list[Any],
    plan: Plan,
    callbacks: list[Any],
    precision: str = PRECISION,
    **kw: Any,
) -> Probe:
    module.plan = plan
    probe = Probe()
    trainer = pl.Trainer(
        accelerator="gpu" if device.cuda else "cpu", devices=1, precision=precision, max_epochs=1, logger=False,
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        callbacks=[*callbacks, probe], **kw,
    )  # fmt: skip
    trainer.fit(module, DataLoader(batches, batch_size=None))
    return probe


def fabric_loop(
    device: Device, model: nn.Module, batches: list[Any], plan: Plan, ours: bool, budget: bool = False
) -> int:
    fabric = Fabric(accelerator="gpu" if device.cuda else "cpu", devices=1, precision=PRECISION)
    model, optimizer = fabric.setup(model, adamw(model))
    k, steps = plan.k, 0
    if ours:  # (`budget`: the same windows of k, closed by their samples)
        schedule = Budget(k * len(batches[0]["input_ids"]), unit="samples") if budget else k
        acc = FabricAccumulator(fabric, model, optimizer, schedule)
        for i, batch in enumerate(batches):
            plan.at_batch(i)
            with acc.accumulate(batch) as step:
                step.backward(lm_loss(model, batch))
        acc.flush()
        return acc.progress.step
    for i, batch in enumerate(batches):
        plan.at_batch(i)
        accumulating = (i + 1) % k != 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            fabric.backward(lm_loss(model, batch) / k)
        if not accumulating:
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    return steps


def bare_loop(device: Device, model: nn.Module, batches: list[Any], plan: Plan) -> int:
    optimizer, k, steps = adamw(model), plan.k, 0
    for i, batch in enumerate(batches):
        plan.at_batch(i)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = lm_loss(model, batch)
        (loss / k).backward()
        if (i + 1) % k == 0:
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    return steps


# a run: (name, its baseline, the train function on a fresh copy of the weights)
Train = Callable[[nn.Module, list[Any], Plan], int]


def runs(device: Device, size: LMSize) -> list[tuple[str, str, Train]]:
    def callback(**options: Any) -> Train:
        return lambda m, b, p: fit(device, LM(m, p.k), b, p, [AccumulationScheduler(p.k, **options)]).steps

    items = {"normalize": "items", "count": causal_lm_tokens, "reduction": "mean"}

    def budget_callback(m: nn.Module, b: list[Any], p: Plan) -> int:  # (windows of k: each batch's tokens alike)
        schedule = Budget(p.k * int(causal_lm_tokens(b[0])), unit="items")
        return fit(device, LM(m, p.k), b, p, [AccumulationScheduler(schedule, **items)]).steps  # type: ignore[arg-type]

    return [
        (FLOOR, FLOOR, lambda m, b, p: bare_loop(device, m, b, p)),
        (BUILTIN, BUILTIN, lambda m, b, p: fit(device, LM(m, p.k), b, p, [], accumulate_grad_batches=p.k).steps),
        ("AccumulationScheduler(k), log=True", BUILTIN, callback()),
        ("AccumulationScheduler(k), log=False", BUILTIN, callback(log=False)),
        ("AccumulationScheduler(k, normalize='items', count=causal_lm_tokens)", BUILTIN, callback(**items)),
        (f"AccumulationScheduler(k, microbatch_size={size.microbatch}) (the loader batch)", BUILTIN,
         callback(microbatch_size=size.microbatch)),
        (MANUAL, MANUAL, lambda m, b, p: fit(device, HandWrittenManual(m, p.k), b, p, []).steps),
        ("AccumulationMixin, configure_accumulation(k)", MANUAL,
         lambda m, b, p: fit(device, Mixin(m, p.k), b, p, []).steps),
        (FABRIC, FABRIC, lambda m, b, p: fabric_loop(device, m, b, p, ours=False)),
        ("FabricAccumulator(fabric, model, optimizer, k)", FABRIC, lambda m, b, p: fabric_loop(device, m, b, p, True)),
        (BUDGET_CALLBACK, BUILTIN, budget_callback),
        (BUDGET_FABRIC, FABRIC, lambda m, b, p: fabric_loop(device, m, b, p, True, budget=True)),
    ]  # fmt: skip


@dataclass
class Measured:
    seconds: float = float("nan")
    inner: float = float("nan")
    window: float = float("nan")
    error: str = ""


def measure_all(
    device: Device, size: LMSize, ks: list[int], counted: int, rounds: int, per_round: int
) -> dict[int, dict[str, Measured]]:
    """Every run at every k, each failure caught and kept (the others go on)."""
    base = causal_lm(size, device)
    out: dict[int, dict[str, Measured]] = {}
    for k in ks:
        out[k] = {}
        for name, _, train in runs(device, size):
            plan = Plan(device, k, counted, rounds, per_round)
            batches = token_batches(size, device, plan.batches)
            try:
                steps = train(copy.deepcopy(base), batches, plan)
                if steps != plan.windows:
                    raise RuntimeError(f"{steps} optimizer steps, {plan.windows} expected")
                inner, window = plan.syncs()
                out[k][name] = Measured(plan.seconds_per_step(), inner, window)
            except Exception as error:
                if plan.counting:
                    plan.counter.stop()
                out[k][name] = Measured(error=f"{type(error).__name__}: {error}".splitlines()[0][:300])
                traceback.print_exc()
            print(f"  k={k} {name}: {out[k][name]}", flush=True)
            del batches
            device.clean()
    return out


def _failed(m: Measured, baseline: Measured) -> str:
    if m.error:
        return f"FAILED: {m.error}"
    return f"FAILED (baseline): {baseline.error}" if baseline.error else ""


def loop_rows(device: Device, size: LMSize, measured: dict[int, dict[str, Measured]], rounds: int) -> list[Row]:
    rows: list[Row] = []
    for k, by_name in measured.items():
        floor = by_name[FLOOR]
        for name, baseline, _ in runs(device, size):
            m, b = by_name[name], by_name[baseline]
            what = f"k={k}: {name}"
            if name != baseline:
                ratio = m.seconds / b.seconds
                ms = f"{m.seconds * 1e3:.1f} vs {b.seconds * 1e3:.1f} ms"
                value = _failed(m, b) or f"{ratio:.4f}" + (" (above)" if ratio > 1.01 else "")
                measured_as = f"time per optimizer step vs {baseline} (median of {rounds}; {ms})"
                rows.append(("loop", what, measured_as, value, "<= 1.01"))
            if name == FLOOR:
                value = _failed(m, m) or f"{m.seconds * 1e3:.1f}"
                rows.append(("loop", what, "ms per optimizer step (k micro-batches, one AdamW step)", value, "(floor)"))
            else:
                value = _failed(m, floor) or f"{floor.seconds / m.seconds:.3f}"
                rows.append(("loop", what, "fraction of the floor's speed (floor ms / ms)", value, "(reported)"))
    return rows


def sync_rows(device: Device, size: LMSize, measured: dict[int, dict[str, Measured]], counted: int) -> list[Row]:
    rows: list[Row] = []
    unit = "host syncs" if device.cuda else "host reads (CPU dry run)"
    for k, by_name in measured.items():
        for name, baseline, _ in runs(device, size):
            m, b = by_name[name], by_name[baseline]
            what = f"k={k}: {name}"
            if name == baseline:
                measured_as = f"{unit} per micro-batch inside a window / per window ({counted} windows)"
                rows.append(
                    ("syncs", what, measured_as, _failed(m, m) or f"{m.inner:.2f} / {m.window:.2f}", "(baseline)")
                )
                continue
            quiet = "log=False" in name
            target = "+0 / +0" if quiet else "+0 / <= +1"
            inner = 1 if name == BUDGET_CALLBACK else 0  # (a count on the device, read on the host per micro-batch)
            window = k * inner + (0 if quiet else 1)  # (and the window's end: its k micro-batches' reads beside)
            if inner:
                target = f"+1 / <= +{window} (the device count read as each micro-batch starts; no collective on one "
                target += "device)"
            elif "Budget" in name:
                target += " (no collective on one device)"
            added_inner, added_window = m.inner - b.inner, m.window - b.window
            above = added_inner > inner or added_window > window
            value = f"{m.inner:.2f} / {m.window:.2f} (added {added_inner:+.2f} / {added_window:+.2f})"
            measured_as = f"{unit} per micro-batch inside a window / per window, vs {baseline}"
            rows.append(("syncs", what, measured_as, _failed(m, b) or value + (" (above)" if above else ""), target))
    return rows
