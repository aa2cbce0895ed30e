"""Exact, scheduled gradient accumulation for PyTorch Lightning.

Three entry points, one window engine under them (which one: https://lightning-accum.github.io/lightning-accum/which/):

- ``AccumulationScheduler(schedule)``: a callback for Lightning's automatic optimization (add it to the Trainer).
- ``AccumulationMixin``: manual optimization, ``class Model(AccumulationMixin, LightningModule)`` with
  ``with self.accumulate(batch) as acc: acc.backward(loss)`` in ``training_step``.
- ``FabricAccumulator(fabric, model, optimizer, schedule)``: a hand-written Lightning Fabric loop.

The schedules (``Constant``, ``Piecewise``, ``Ramp``, ``NoiseScale``, ...) say how many micro-batches each
optimizer step's window holds. Documentation: https://lightning-accum.github.io/lightning-accum/

Example:

    >>> import lightning_accum as la
    >>> la.Ramp(1, 8, over=10_000)(la.Progress(samples=5_000))
    4
"""

from lightning_accum import lr
from lightning_accum._core.errors import NonFiniteWindowError
from lightning_accum._trainer.reporting import WindowReport
from lightning_accum._trainer.steps import SchedulerHorizonWarning, estimated_stepping_batches
from lightning_accum.callbacks import AccumulationScheduler, GradientDecay
from lightning_accum.fabric import FabricAccumulator
from lightning_accum.mixin import AccumulationMixin, Accumulator
from lightning_accum.noise import NoiseScale, NoiseScaleEstimator
from lightning_accum.schedules import Budget, Constant, Lambda, Piecewise, Progress, Ramp, Schedule

__version__ = "0.2.0.dev0"

__all__ = [
    "AccumulationMixin",
    "AccumulationScheduler",
    "Accumulator",
    "Budget",
    "Constant",
    "FabricAccumulator",
    "GradientDecay",
    "Lambda",
    "NoiseScale",
    "NoiseScaleEstimator",
    "NonFiniteWindowError",
    "Piecewise",
    "Progress",
    "Ramp",
    "Schedule",
    "SchedulerHorizonWarning",
    "WindowReport",
    "__version__",
    "estimated_stepping_batches",
    "lr",
]
