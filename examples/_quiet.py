"""Lightning's start-up banners, tips and advisories, silenced for these example scripts only
(imported by them; nothing in ``lightning_accum`` changes logging or warnings for your code)."""

from __future__ import annotations

import logging
import warnings

ADVISORIES = (
    ".*LeafSpec.*",  # a pytree deprecation inside Lightning
    ".*does not have many workers.*",  # the examples' data is in memory
    ".*GPU available but not used.*",
)


def quiet() -> None:
    """Drop INFO banners ("GPU available", "TPU available", the litlogger tip) and the
    advisories above; keep every other warning (the package's own included)."""
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for message in ADVISORIES:
        warnings.filterwarnings("ignore", message=message)
