"""Part 4 of the GPU harness: the passes over the whole gradient the package adds, on a gradient of the
GPT-2 of part 1 (about 124M float32 parameters, every parameter's gradient dense), bandwidth-bound.

Each pass is timed as the median of ``reps`` synchronised calls after a warm-up, and reported as effective
GB/s (the bytes it must read and write) against the card's copy bandwidth (``dst.copy_(src)`` of a buffer
of the same bytes, read + write, in the same process):

* ``zero_grad(set_to_none=False)``: the built-in's reset (writes the gradient);
* the window's normalisation (``g *= scale`` per device and dtype group, one ``_foreach_mul_`` each: what
  ``normalize="items"`` and a short window do at the window's end): reads and writes it;
* ``GradientDecay(0.9)``'s combine in ``mode="sum"`` (``g += 0.9 r``) and ``mode="ema"`` (``lerp``): reads the
  gradient and the residual, writes the gradient (its reset, the residual taking over ``.grad``, moves no
  bytes);
* the built-in's loss scaling (Lightning divides each micro-batch's loss by k: k scalar divisions a window),
  for comparison: no pass over the gradient at all.
"""

from __future__ import annotations

import torch
from device_clock import Device, median_seconds
from lm_loops import LMSize, Row, causal_lm
from torch import Tensor

from lightning_accum import GradientDecay
from lightning_accum._core import gradients

ZERO = "zero_grad(set_to_none=False)"
NORMALISE = "the window's normalisation (g *= scale)"


def copy_seconds(device: Device, n: int, reps: int) -> float:
    src = torch.empty(n, device=device.torch)
    dst = torch.empty_like(src)
    return median_seconds(device, lambda: dst.copy_(src), reps)


def decay_seconds(device: Device, mode: str, optimizer: torch.optim.Optimizer, grads: list[Tensor], reps: int) -> float:
    """One window's ``combine`` and reset with a residual kept (the optimizer's learning rate is 0)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    decay = GradientDecay(0.9, mode=mode)  # type: ignore[arg-type]
    decay.attach([optimizer])
    for p in params:  # (the residual its own buffers, not the gradient's: after the step it is these)
        p.grad = p.grad.clone() if p.grad is not None else None
    decay.combine(optimizer)
    optimizer.step()  # (lr 0: the parameters stay) the residual kept from here on
    decay.after_step()

    def combine() -> None:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        decay.combine(optimizer)
        decay.after_step()  # (no step: the residual stays, the gradient leaves `.grad`)

    seconds = median_seconds(device, combine, reps)
    decay.detach(restore_residual=False)
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    return seconds


def pass_rows(device: Device, size: LMSize, reps: int, k: int = 4) -> list[Row]:
    params = list(causal_lm(size, device).parameters())
    n = sum(p.numel() for p in params)
    nbytes = 4 * n
    for p in params:
        p.grad = torch.randn_like(p)
    grads = [p.grad for p in params if p.grad is not None]
    optimizer = torch.optim.SGD(params, lr=0.0)
    copy_gbs = 2 * nbytes / copy_seconds(device, n, reps) / 1e9
    timed = {  # name: (seconds, bytes moved)
        ZERO: (median_seconds(device, lambda: optimizer.zero_grad(set_to_none=False), reps), nbytes),
        NORMALISE: (median_seconds(device, lambda: gradients.scale_(grads, 0.5), reps), 2 * nbytes),
    }
    for mode in ("sum", "ema"):
        name = f"GradientDecay(0.9, mode={mode!r}): combine and reset"
        timed[name] = (decay_seconds(device, mode, optimizer, grads, reps), 3 * nbytes)
    loss = torch.ones((), device=device.torch, requires_grad=True)
    builtin_s = median_seconds(device, lambda: [loss / k for _ in range(k)], reps)
    what = f"gradient of {n / 1e6:.0f}M float32 parameters ({nbytes / 2**20:.0f} MiB)"
    rows: list[Row] = [("passes", what, "copy bandwidth, dst.copy_(src) (GB/s, read + write)", f"{copy_gbs:.0f}", "")]
    for name, (seconds, moved) in timed.items():
        gbs = moved / seconds / 1e9
        measured = f"{seconds * 1e3:.3f} ms, {gbs:.0f} GB/s; fraction of copy bandwidth"
        rows.append(("passes", f"{what}: {name}", measured, f"{gbs / copy_gbs:.2f}", ">= 0.8"))
        if name != ZERO:
            rows.append(
                ("passes", f"{what}: {name}", f"time vs {ZERO}", f"{seconds / timed[ZERO][0]:.2f}", "(reported)")
            )
    rows.append((
        "passes", f"{what}: the built-in's loss scaling, k={k} divisions of a loss (no gradient pass)",
        "time vs the window's normalisation pass", f"{builtin_s / timed[NORMALISE][0]:.3f}", "(reported)",
    ))  # fmt: skip
    return rows
