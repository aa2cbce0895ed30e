"""One configuration through the package and the reference, and what differs."""

from __future__ import annotations

import traceback
import warnings

from . import fabric_runner, package, ranks, reference
from .configs import Config
from .differences import differences


def check(c: Config) -> list[str]:
    """What differs between the package and the reference on ``c`` (an error is a difference)."""
    if c.world > 1:
        return ranks.check_all([c])[0]
    with warnings.catch_warnings():  # (torch's, on a scheduler stepped in an epoch whose windows held nothing)
        warnings.simplefilter("ignore")
        want = reference.run(c)
    try:
        got = fabric_runner.run(c) if c.adapter == "fabric" else package.run(c)
    except Exception:
        return ["raised: " + traceback.format_exc(limit=-3).strip().replace("\n", " | ")]
    return differences(want, got)
