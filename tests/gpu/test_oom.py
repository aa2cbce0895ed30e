"""A real CUDA out-of-memory: backward_microbatches(size="auto") backs off and stays exact.

Each part of n samples briefly allocates n * 0.3 of a 4 GiB cap on the process's CUDA memory: parts of 8 and
4 run out of memory for real, parts of 2 fit. The result must equal the float64 reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from gpu_helpers import memory_cap, per_sample_bytes
from test_microbatch import Splitting

from lightning_accum import Piecewise

from helpers import Reference, TokenData, count_tokens, loader, max_diff, params_of, rank_batches, token_losses, trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(autouse=True)
def _capped() -> Iterator[None]:
    with memory_cap():
        yield


class Hungry(Splitting):
    def loss_fn(self, part: Any) -> torch.Tensor:
        n = len(part["x"])
        block = torch.empty(n * per_sample_bytes(), dtype=torch.uint8, device="cuda")  # OOM for n >= 4
        del block
        self.seen.append(n)
        total, _ = token_losses(self.net, part)
        return total


def test_real_oom_back_off() -> None:
    schedule = Piecewise({0: 3, 4: 2}, unit="step")
    data = TokenData(48)
    model = Hungry("auto", reduction="sum", schedule=schedule, normalize="items", count=count_tokens)
    trainer(accelerator="gpu", devices=1, max_epochs=2).fit(model, loader(data, 8))
    expected, _ = Reference(schedule, normalize="items").run([rank_batches(data, 8)] * 2)
    assert max_diff([p.double().cpu() for p in params_of(model)], expected) <= 1e-10
    assert model._accumulation.auto.size == 2 and max(model.seen) == 2
