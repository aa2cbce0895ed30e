"""The package works with the ``lightning`` package and with the standalone ``pytorch_lightning``."""

from __future__ import annotations

import importlib
import subprocess
import sys
from typing import Any

import pytest
import torch

from lightning_accum import AccumulationMixin, AccumulationScheduler, Piecewise

from helpers import Reference, TokenData, loader, make_net, max_diff, rank_batches, token_losses

SCHEDULE = Piecewise({0: 3, 4: 2}, unit="step")


@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])
def test_callback_and_mixin_in_each_namespace(namespace: str) -> None:
    pl = pytest.importorskip(namespace)

    class Auto(pl.LightningModule):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            total, tokens = token_losses(self.net, batch)
            return total / tokens

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.net.parameters(), lr=0.1, momentum=0.9)

    class Manual(AccumulationMixin, Auto):
        def __init__(self) -> None:
            super().__init__()
            self.configure_accumulation(SCHEDULE)

        def training_step(self, batch: Any, batch_idx: int) -> None:  # type: ignore[override]
            with self.accumulate(batch) as acc:
                acc.backward(super().training_step(batch, batch_idx))

    quiet: dict[str, Any] = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    quiet.update(enable_progress_bar=False, enable_model_summary=False, max_epochs=2, precision="64-true")
    data = TokenData(50)
    expected, _ = Reference(SCHEDULE).run([rank_batches(data, 4)] * 2)
    auto, manual = Auto(), Manual()
    pl.Trainer(callbacks=[AccumulationScheduler(SCHEDULE)], **quiet).fit(auto, loader(data, 4))
    pl.Trainer(**quiet).fit(manual, loader(data, 4))
    for model in (auto, manual):
        assert max_diff([p.detach() for p in model.parameters()], expected) <= 1e-12


def test_clear_error_without_lightning() -> None:
    code = (
        "import sys\n"
        "for name in ('lightning', 'lightning.pytorch', 'pytorch_lightning'):\n"
        "    sys.modules[name] = None\n"
        "import lightning_accum\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0
    assert "lightning-accum needs PyTorch Lightning: `pip install lightning`" in result.stderr


def test_compat_module_picks_lightning_first() -> None:
    compat = importlib.import_module("lightning_accum._lightning")
    assert compat.pl.__name__ == "lightning.pytorch"
