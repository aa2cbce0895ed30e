"""Lightning callbacks for automatic optimization."""

from lightning_accum.callbacks.accumulation import AccumulationScheduler

__all__ = ["AccumulationScheduler"]
