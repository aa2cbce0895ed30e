"""Lightning callbacks for automatic optimization."""

from lightning_accum.callbacks.accumulation import AccumulationScheduler
from lightning_accum.callbacks.decay import GradientDecay

__all__ = ["AccumulationScheduler", "GradientDecay"]
