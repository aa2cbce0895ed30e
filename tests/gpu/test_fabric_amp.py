"""``FabricAccumulator`` under CUDA mixed precision: ``"16-mixed"`` (a real GradScaler) and
``"bf16-mixed"``, bit for bit against Fabric's own hand-written accumulation loop (full windows of a
constant k), and a window whose scaled gradient overflows skipped by the scaler rather than refused
(clipping by norm refuses a non-finite window only where no scaler owns it).

Skipped without CUDA. Run on a GPU machine with ``bash tests/gpu/run.sh``."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric
from torch import Tensor

from lightning_accum.fabric import FabricAccumulator

from helpers import TokenData, default_dtype, max_diff, rank_batches

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _loop(precision: str, accumulator: bool, clip: float | None = None, inf_at: int | None = None) -> list[Tensor]:
    fabric = Fabric(accelerator="cuda", devices=1, precision=precision)  # type: ignore[arg-type]
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    acc = FabricAccumulator(fabric, model, optimizer, 3, gradient_clip_val=clip, log=False) if accumulator else None
    with default_dtype(torch.float32):
        batches = [{k: v.float().cuda() for k, v in b.items()} for b in rank_batches(TokenData(48), 4)[0]]
    for i, batch in enumerate(batches):
        err = ((model(batch["x"]) - batch["y"]).squeeze(-1) ** 2 * batch["mask"]).sum() / batch["mask"].sum()
        if i == inf_at:
            err = err * float("inf")
        if acc is not None:
            with acc.accumulate(batch) as step:
                step.backward(err)
            continue
        accumulating = (i + 1) % 3 != 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            fabric.backward(err / 3)
        if not accumulating:
            if clip is not None:
                fabric.clip_gradients(model, optimizer, max_norm=clip, error_if_nonfinite=False)
            optimizer.step()
            optimizer.zero_grad()
    return [p.detach().double().cpu() for p in net.parameters()]


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_bit_identical_to_fabrics_own_loop(precision: str) -> None:
    assert max_diff(_loop(precision, True), _loop(precision, False)) == 0.0


def test_an_overflowing_window_is_skipped_by_the_grad_scaler() -> None:
    """Under ``"16-mixed"`` with clipping by norm, an infinite window gradient is the scaler's business: it
    skips the step and lowers its scale, as in Fabric's loop with ``error_if_nonfinite=False``."""
    assert max_diff(_loop("16-mixed", True, clip=1.0, inf_at=4), _loop("16-mixed", False, clip=1.0, inf_at=4)) == 0.0
