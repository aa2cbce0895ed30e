"""``GradientDecay``: decay the gradient at each window's start instead of zeroing it."""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer
from typing_extensions import override

from lightning_accum import _seam
from lightning_accum._core import sync
from lightning_accum._core.decay import ResidualDecay
from lightning_accum._lightning import Callback, pl


class GradientDecay(Callback, ResidualDecay):
    r"""Keep a decaying memory of earlier steps' gradients instead of zeroing them.

    With ``g_t`` the gradient of window ``t`` (normalised, unscaled, averaged over ranks) and
    ``G_t`` the gradient the optimizer steps with:

    * ``mode="sum"``: ``G_t = g_t + f G_{t-1}`` (what ``p.grad *= f`` instead of
      ``zero_grad()`` gives);
    * ``mode="ema"``: ``G_t = (1 - f) g_t + f G_{t-1}``, and with ``bias_correction`` the
      step uses ``G_t / (1 - f^t)``.

    ``factor=0`` is ``zero_grad(set_to_none=False)``, ``factor=1`` (sum) pure accumulation.
    ``factor`` may be a function of the number of optimizer steps done. The residual
    ``G_{t-1}`` is held beside the window's gradient (one extra gradient-sized buffer) and
    combined with it in ``on_before_optimizer_step``: after AMP unscaling and after
    ``AccumulationScheduler``'s normalisation (put this callback after it), before
    clipping. So the residual never mixes loss scales or window normalisers, survives
    Lightning's ``zero_grad`` before validation, and is kept, not decayed, when AMP skips a step
    for inf/nan gradients. It is saved in checkpoints unless ``save_residual=False``.

    Use it as a Trainer callback (automatic optimization, alone or after an
    ``AccumulationScheduler``) or as ``reset=GradientDecay(...)`` of ``AccumulationMixin``.

    Example:

        >>> from lightning_accum import AccumulationScheduler
        >>> decay = GradientDecay(0.9, mode="ema", bias_correction=True)
        >>> trainer = pl.Trainer(callbacks=[AccumulationScheduler(4), decay], logger=False)
    """

    # ------------------------------------------------------------------ lifetime
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sync.refuse_deepspeed(trainer.strategy, "GradientDecay")
        if not pl_module.automatic_optimization:
            raise RuntimeError(
                "In manual optimization give `GradientDecay` to the mixin, `configure_accumulation(reset="
                "GradientDecay(...))`, instead of the Trainer's callbacks."
            )
        if any(isinstance(cb, GradientDecay) and cb is not self for cb in trainer.callbacks):  # type: ignore[attr-defined]
            raise ValueError("Two gradient reset policies are active: keep one `GradientDecay` callback.")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.attach(trainer.optimizers)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.detach()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.settle(_seam.batch_processed(trainer))
        self.detach(restore_residual=False)

    # ------------------------------------------------------------------ one step
    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        self.combine(optimizer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.after_step()

    # ------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        """The residual (unless ``save_residual=False``) and the step count, for checkpoints."""
        return ResidualDecay.state_dict(self)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        ResidualDecay.load_state_dict(self, state_dict)
