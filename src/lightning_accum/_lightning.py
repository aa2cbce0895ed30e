"""Which PyTorch Lightning: the ``lightning`` package (``lightning.pytorch``) or the standalone
``pytorch_lightning``. Lightning calls callback hooks by name, so the same classes serve a
Trainer of either namespace; this module only decides what to import from.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

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


def builtin_callbacks(name: str) -> tuple[type, ...]:
    """Lightning's built-in callback class ``name`` from the namespaces already imported (as above)."""
    modules = (sys.modules.get(n) for n in ("lightning.pytorch.callbacks", "pytorch_lightning.callbacks"))
    return tuple(getattr(m, name) for m in modules if m is not None and hasattr(m, name))


def grad_scaler(trainer: Any) -> Any:
    """The precision plugin's AMP GradScaler (``16-mixed``), ``None`` without one."""
    return getattr(trainer.precision_plugin, "scaler", None)


def loss_scale(trainer: Any) -> float:
    """The AMP GradScaler's current scale (1 without one); a host sync, so once per window."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return 1.0 if scaler is None else float(scaler.get_scale())


Callback = pl.Callback
LightningModule = pl.LightningModule
Trainer = pl.Trainer
rank_zero_warn = pl.utilities.rank_zero_warn
if TYPE_CHECKING:
    from lightning.fabric.utilities.warnings import PossibleUserWarning
else:  # (the namespace's own: a filter on Lightning's category, from either namespace, catches ours)
    PossibleUserWarning = pl.utilities.warnings.PossibleUserWarning
extract_batch_size = pl.utilities.data.extract_batch_size

__all__ = [
    "Callback",
    "LightningModule",
    "PossibleUserWarning",
    "Trainer",
    "builtin_callbacks",
    "extract_batch_size",
    "grad_scaler",
    "gradient_accumulation_schedulers",
    "loss_scale",
    "pl",
    "rank_zero_warn",
]
