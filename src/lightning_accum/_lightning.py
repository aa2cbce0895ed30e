"""Which PyTorch Lightning: the ``lightning`` package (``lightning.pytorch``) or the standalone
``pytorch_lightning``. Lightning calls callback hooks by name, so the same classes serve a
Trainer of either namespace; this module only decides what to import from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import lightning.pytorch as pl
else:
    try:
        import lightning.pytorch as pl
    except ImportError:
        try:
            import pytorch_lightning as pl
        except ImportError as error:
            raise ImportError(
                "lightning-accum needs PyTorch Lightning: `pip install lightning` (or the standalone "
                "`pip install pytorch-lightning`)."
            ) from error


def gradient_accumulation_schedulers() -> tuple[type, ...]:
    """Lightning's own ``GradientAccumulationScheduler`` classes, from every installed namespace."""
    classes: list[type] = []
    for name in ("lightning.pytorch.callbacks", "pytorch_lightning.callbacks"):
        try:
            module = __import__(name, fromlist=["GradientAccumulationScheduler"])
        except ImportError:
            continue
        classes.append(module.GradientAccumulationScheduler)
    return tuple(classes)


Callback = pl.Callback
LightningModule = pl.LightningModule
Trainer = pl.Trainer
rank_zero_warn = pl.utilities.rank_zero_warn
extract_batch_size = pl.utilities.data.extract_batch_size

__all__ = [
    "Callback",
    "LightningModule",
    "Trainer",
    "extract_batch_size",
    "gradient_accumulation_schedulers",
    "pl",
    "rank_zero_warn",
]
