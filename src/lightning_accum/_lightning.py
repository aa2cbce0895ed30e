"""Which PyTorch Lightning: the ``lightning`` package (``lightning.pytorch``) or the standalone
``pytorch_lightning``. Lightning calls callback hooks by name, so the same classes serve a
Trainer of either namespace; this module only decides what to import from.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from lightning_accum import _seam

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
    """Lightning's own ``GradientAccumulationScheduler`` classes, from the namespaces already
    imported: importing one the user did not import (``pytorch_lightning``) would re-route
    Lightning's rank-zero logger, and a callback of a namespace not imported cannot be in use."""
    modules = (sys.modules.get(name) for name in ("lightning.pytorch.callbacks", "pytorch_lightning.callbacks"))
    return tuple(m.GradientAccumulationScheduler for m in modules if m is not None)


def loss_scale(trainer: Any) -> float:
    """The AMP GradScaler's current scale (1 without one); a host sync, so once per window."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return 1.0 if scaler is None else float(scaler.get_scale())


def log_window(
    module: Any, prefix: str, every: int, closing: Any, progress: Any, noise_scale: float | None, metrics: Any = None
) -> None:
    """Log a closed window's ``accum/*`` metrics. ``self.log`` costs ~0.3 ms a call, so only at
    the cadence the loggers are written at (every ``every`` optimizer steps) and at the first
    step. The progress bar's k is written directly at every step (a dict entry; logged with
    ``prog_bar=True`` it would show the k of the last logged step until the next one)."""
    step = progress.step
    _seam.show_in_progress_bar(module.trainer, f"{prefix}k", float(closing.k))
    if step % every and step != 1:
        return
    module.log(f"{prefix}k", float(closing.k), on_step=True, on_epoch=False, batch_size=1)
    for name, value in (metrics or {}).items():  # the window's loss, its tasks' losses, its gradient norm
        module.log(f"{prefix}{name}", value, prog_bar=name == "loss", on_step=True, on_epoch=False, batch_size=1)
    values = {"effective_batch": closing.samples, "samples": progress.samples, "items": progress.items}
    if noise_scale is not None:
        values["noise_scale"] = noise_scale
    for name, value in values.items():
        module.log(f"{prefix}{name}", float(value), on_step=True, on_epoch=False, batch_size=1)


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
    "log_window",
    "loss_scale",
    "pl",
    "rank_zero_warn",
]
