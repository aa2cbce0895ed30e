"""The types of the public API's arguments, by name, for annotations in your own code.

Example:

    >>> from typing import get_args
    >>> from lightning_accum.types import Normalize, Reduction
    >>> get_args(Normalize), get_args(Reduction)
    (('mean', 'items'), ('sum', 'mean'))
"""

from lightning_accum._core.cached import GetRep, Reps
from lightning_accum._core.decay import Factor
from lightning_accum._core.microbatch import Split
from lightning_accum._core.options import Count, LRScaling, MicrobatchSize, Reduction, Reset
from lightning_accum._core.sync import SyncMode
from lightning_accum._core.window import Normalize
from lightning_accum.schedules import Unit

__all__ = [
    "Count",
    "Factor",
    "GetRep",
    "LRScaling",
    "MicrobatchSize",
    "Normalize",
    "Reduction",
    "Reps",
    "Reset",
    "Split",
    "SyncMode",
    "Unit",
]
