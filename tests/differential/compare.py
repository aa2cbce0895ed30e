"""One configuration through the package and the reference, and what differs."""

from __future__ import annotations

import dataclasses
import traceback
import warnings

import torch
from torch import Tensor

from . import fabric_runner, package, reference
from .configs import Config

RTOL = 1e-10


def _close(a: Tensor, b: Tensor) -> bool:
    scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
    return a.shape == b.shape and bool(((a - b).abs() <= RTOL * scale).all())


def differences(want: reference.Result, got: reference.Result) -> list[str]:
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
    return out


def check(c: Config) -> list[str]:
    """What differs between the package and the reference on ``c`` (an error is a difference; where the package
    must refuse ``c``, anything but that refusal)."""
    if c.refused():  # a scheduler the model steps while the mixin steps it too: a double step, refused (where the
        try:  # model's code did step it: else the mixin's steps alone, as the reference's)
            got = package.run(c)
        except RuntimeError as error:
            if "was stepped by the model" in str(error):
                return []
            return ["raised: " + traceback.format_exc(limit=-3).strip().replace("\n", " | ")]
        alone = dataclasses.replace(c, schedulers_by="package")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = reference.run(alone)
        return [f"not refused, and not as the mixin's steps alone: {d}" for d in differences(want, got)]
    with warnings.catch_warnings():  # (torch's, on a scheduler stepped in an epoch whose windows held nothing)
        warnings.simplefilter("ignore")
        want = reference.run(c)
    try:
        got = fabric_runner.run(c) if c.adapter == "fabric" else package.run(c)
    except Exception:
        return ["raised: " + traceback.format_exc(limit=-3).strip().replace("\n", " | ")]
    return differences(want, got)
