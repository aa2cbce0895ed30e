"""Exact, scheduled gradient accumulation for PyTorch Lightning.

Example:

    >>> import lightning_accum as la
    >>> la.Ramp(1, 8, over=10_000)(la.Progress(samples=5_000))
    4
"""

from lightning_accum import lr
from lightning_accum._core.errors import NonFiniteWindowError
from lightning_accum._trainer.reporting import WindowReport
from lightning_accum._trainer.steps import estimated_stepping_batches
from lightning_accum.callbacks import AccumulationScheduler, GradientDecay
from lightning_accum.mixin import AccumulationMixin, Accumulator
from lightning_accum.noise import NoiseScale, NoiseScaleEstimator
from lightning_accum.schedules import Constant, Lambda, Piecewise, Progress, Ramp, Schedule

__version__ = "0.2.0.dev0"

__all__ = [
    "AccumulationMixin",
    "AccumulationScheduler",
    "Accumulator",
    "Constant",
    "GradientDecay",
    "Lambda",
    "NoiseScale",
    "NoiseScaleEstimator",
    "NonFiniteWindowError",
    "Piecewise",
    "Progress",
    "Ramp",
    "Schedule",
    "WindowReport",
    "__version__",
    "estimated_stepping_batches",
    "lr",
]
