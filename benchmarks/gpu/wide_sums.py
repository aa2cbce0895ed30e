"""Part 5 of the GPU harness: what ``grad_accum_dtype=torch.float32`` costs under ``precision="bf16-true"``
(issue 51), against ``grad_accum_dtype=None`` in the same process.

The GPT-2 of part 1 (12 layers of 768, the GPT-2 vocabulary: about 124M parameters; random tokens) converted to
bf16 before the fits (so that every parameter and its ``.grad`` is bf16 and ``bf16-true`` converts nothing),
micro-batches of 8 x 1024 tokens, k = 8, AdamW. ``AccumulationScheduler(k)`` and ``AccumulationScheduler(k,
grad_accum_dtype=torch.float32)`` each train a copy of the same weights on the same batches, two fits each in the
order None, option, option, None; each fit as part 1 times it (``lm_loops.Plan``: a warm-up window, ``rounds``
x ``per_round`` timed windows with ``torch.cuda.synchronize`` at each round's edges only, a tail window).

* time per optimizer step: the median over both fits' rounds, the option's against None's (target <= 1.02);
* the allocator's peak over a fit (``torch.cuda.max_memory_allocated``, reset before it; the first fit of each),
  and what is allocated as a micro-batch starts inside a window (not its first; after the warm-up window:
  ``torch.cuda.memory_allocated``, no sync), each against None's, in bytes per bf16 parameter: 4 bytes of
  float32 sum stand for 2 of bf16 ``.grad`` between micro-batches (+2 expected), and the sums and the rounded
  ``.grad`` are side by side at the step.
"""

from __future__ import annotations

import copy
import statistics
from typing import Any

import torch
from device_clock import Device
from lm_loops import LM, LMSize, Plan, Row, causal_lm, fit, token_batches
from torch import Tensor, nn

from lightning_accum import AccumulationScheduler

NONE = "AccumulationScheduler(k)"
WIDE = "AccumulationScheduler(k, grad_accum_dtype=torch.float32)"
PRECISION = "bf16-true"


class WatchedLM(LM):
    """The LM noting what the allocator holds as each micro-batch's ``training_step`` starts inside a window (not
    its first), after the first window: the window's state between micro-batches. (On the module's step, not in an
    ``on_train_batch_start``: see ``lm_loops.Probe``.)"""

    def __init__(self, model: nn.Module, k: int, device: Device) -> None:
        super().__init__(model, k)
        self.allocator = device
        self.between: list[int] = []

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        if batch_idx >= self.k and batch_idx % self.k:
            self.between.append(self.allocator.allocated())
        return super().training_step(batch, batch_idx)


def one_fit(
    device: Device, base: torch.nn.Module, size: LMSize, name: str, k: int, rounds: int, per_round: int
) -> dict[str, Any]:
    """One fit of a copy of ``base``: its timed rounds, the allocator's peak over it (all of it: the weights and
    their copy included, the same in every fit) and the median allocated between micro-batches."""
    plan = Plan(device, k, 0, rounds, per_round)
    batches = token_batches(size, device, plan.batches)
    callback = AccumulationScheduler(k, grad_accum_dtype=torch.float32 if name == WIDE else None)
    module = WatchedLM(copy.deepcopy(base), k, device)
    device.clean()
    device.reset_peak()
    probe = fit(device, module, batches, plan, [callback], precision=PRECISION)
    peak = device.peak_above(0)
    if probe.steps != plan.windows:
        raise RuntimeError(f"{name}: {probe.steps} optimizer steps, {plan.windows} expected")
    between = statistics.median(module.between) if device.cuda else float("nan")
    del module, batches
    device.clean()
    return {"times": plan.times, "peak": peak, "between": between}


def wide_rows(device: Device, size: LMSize, k: int, rounds: int, per_round: int) -> list[Row]:
    base = causal_lm(size, device).to(torch.bfloat16)
    params = sum(p.numel() for p in base.parameters() if p.requires_grad)
    runs: dict[str, list[dict[str, Any]]] = {NONE: [], WIDE: []}
    for name in (NONE, WIDE, WIDE, NONE):
        runs[name].append(one_fit(device, base, size, name, k, rounds, per_round))
        print(f"  k={k} {name}: {[f'{t * 1e3:.1f}' for t in runs[name][-1]['times']]} ms", flush=True)
    del base
    device.clean()
    seconds = {name: statistics.median(t for run in got for t in run["times"]) for name, got in runs.items()}
    ratio = seconds[WIDE] / seconds[NONE]
    what = f"k={k}: {WIDE}, {PRECISION}, {params / 1e6:.1f}M bf16 parameters"
    ms = f"{seconds[WIDE] * 1e3:.1f} vs {seconds[NONE] * 1e3:.1f} ms"
    rows: list[Row] = [
        ("precision", what, f"time per optimizer step vs {NONE} (median of {2 * rounds}; {ms})",
         f"{ratio:.4f}" + (" (above)" if ratio > 1.02 else ""), "<= 1.02"),
    ]  # fmt: skip
    first = {name: got[0] for name, got in runs.items()}
    for key, measured, target in (
        ("peak", "allocator peak over the fit", "(reported: +2 to +4)"),
        ("between", "allocated as a micro-batch starts inside a window", "+2 (4 of float32 for 2 of bf16)"),
    ):
        none, wide = first[NONE][key], first[WIDE][key]
        mib = f"{wide / 2**20:.0f} vs {none / 2**20:.0f} MiB"
        value = f"{(wide - none) / params:+.2f}"
        rows.append(("precision", what, f"{measured}, vs {NONE} ({mib}): bytes per bf16 parameter added", value,
                     target))  # fmt: skip
    return rows
