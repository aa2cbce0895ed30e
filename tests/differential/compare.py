"""One configuration through the package and the reference, and what differs."""

from __future__ import annotations

import dataclasses
import traceback
import warnings

from . import fabric_runner, package, ranks, reference
from .configs import Config
from .differences import differences


def check(c: Config) -> list[str]:
    """What differs between the package and the reference on ``c`` (an error is a difference; where the package
    must refuse ``c``, anything but that refusal)."""
    if c.world > 1:
        return ranks.check_all([c])[0]
    refusal = c.refusal()
    if refusal is not None:  # a scheduler the model steps while the mixin steps it too: a double step, refused (where
        try:  # the model's code did step it: else the mixin's steps alone, as the reference's); a `zero_grad()`
            got = package.run(c)
        except RuntimeError as error:
            if refusal in str(error):
                return []
            return ["raised: " + traceback.format_exc(limit=-3).strip().replace("\n", " | ")]
        by = "package" if c.schedulers_by == "both" else c.schedulers_by
        alone = dataclasses.replace(c, schedulers_by=by, zero_grad=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = reference.run(alone)
        return [f"not refused, and not as the mixin's steps alone: {d}" for d in differences(want, got)]
    try:
        got = fabric_runner.run(c) if c.adapter == "fabric" else package.run(c)
    except Exception:
        return ["raised: " + traceback.format_exc(limit=-3).strip().replace("\n", " | ")]
    with warnings.catch_warnings():  # (torch's, on a scheduler stepped in an epoch whose windows held nothing)
        warnings.simplefilter("ignore")
        want = reference.run(c, got)  # (under bf16 with `grad_accum_dtype`: float32's ties settled as the package did)
    return differences(want, got)
