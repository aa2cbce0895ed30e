"""What differs between two results: the parameters (relative 1e-10: under bf16, bit for bit), ``global_step``, each
step's LRs, Adam's state, the ``on_window_end`` average, the BatchNorm buffers (running mean, variance, step count),
and under bf16 each step's gradient before clipping, bit for bit."""

from __future__ import annotations

import torch
from torch import Tensor

from .reference import Result

RTOL = 1e-10


def _close(a: Tensor, b: Tensor) -> bool:
    scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
    return a.shape == b.shape and bool(((a - b).abs() <= RTOL * scale).all())


def differences(want: Result, got: Result) -> list[str]:
    out = []
    bad = [i for i, (a, b) in enumerate(zip(got.params, want.params, strict=True)) if not _close(a, b)]
    if bad:
        diff = max(float((got.params[i] - want.params[i]).abs().max()) for i in bad)
        out.append(f"parameters {bad} differ by up to {diff:.3g}")
    if got.global_step != want.global_step:
        out.append(f"global_step {got.global_step} != {want.global_step}")
    if len(got.lrs) != len(want.lrs) or not all(
        _close(torch.tensor(a), torch.tensor(b)) for a, b in zip(got.lrs, want.lrs, strict=True)
    ):
        out.append(f"LRs of the steps differ: {got.lrs} != {want.lrs}")
    if (got.adam is None) != (want.adam is None) or (
        got.adam is not None
        and want.adam is not None
        and (
            len(got.adam) != len(want.adam)
            or not all(
                _close(a[key], b[key]) for a, b in zip(got.adam, want.adam, strict=True) for key in b
            )
        )
    ):
        out.append("Adam's state differs")
    if (got.ema is None) != (want.ema is None) or (
        got.ema is not None and want.ema is not None and not all(map(_close, got.ema, want.ema))
    ):
        out.append("the average of the parameters at window ends (`on_window_end`) differs")
    if (got.buffers is None) != (want.buffers is None) or (
        got.buffers is not None and want.buffers is not None and not all(map(_close, got.buffers, want.buffers))
    ):
        out.append(f"the BatchNorm buffers differ: {got.buffers} != {want.buffers}")
    if want.grads is not None and got.grads is not None:
        out += _gradients(want.grads, got.grads)
    return out


def _gradients(want: list[list[Tensor | None]], got: list[list[Tensor | None]]) -> list[str]:
    """The first step whose gradient (before clipping) differs, bit for bit, and by how much."""
    for s, (a, b) in enumerate(zip(got, want, strict=False)):
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            if (x is None) != (y is None):
                return [f"the gradient of step {s}, parameter {i}: {x} != {y}"]
            if x is None or y is None:
                continue
            x64, y64 = x.double(), y.double().to(x.device)
            bad = x64 != y64
            if x64.shape != y64.shape or bool(bad.any()):
                n = int(bad.sum()) if x64.shape == y64.shape else -1
                worst = float(((x64 - y64).abs() / y64.abs().clamp_min(1e-30))[bad].max()) if n > 0 else float("nan")
                return [f"the gradient of step {s}, parameter {i} differs in {n} of {y64.numel()} elements (up to "
                        f"{worst:.3g} relative): {x64[bad].tolist()} != {y64[bad].tolist()}"]  # fmt: skip
        if len(a) != len(b):
            return [f"the gradient of step {s} has {len(a)} parameters, not {len(b)}"]
    if len(got) != len(want):
        return [f"gradients of {len(got)} steps, not {len(want)}"]
    return []
