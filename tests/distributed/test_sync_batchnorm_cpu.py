"""torch's own ``nn.SyncBatchNorm`` under ``batchnorm="window"`` on 2 gloo ranks, its CUDA kernels stood in for on the
CPU (``sync_batchnorm_ranks.py``; the GPU suite runs the same script on CUDA): the fit equals one float64 process on
the union of the ranks' micro-batches, its parameters and the layer's running statistics.

``test_batchnorm_ddp.py`` runs the package's hooks with a layer that re-implements the forward; here the forward, the
autograd function and the buffers its gather kernel writes in place are torch's own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sync_batchnorm_ranks import WORLD, data, difference, launch, reference

pytestmark = pytest.mark.slow


def test_torchs_sync_batchnorm_under_window_equals_one_process_on_the_union(tmp_path: Path) -> None:
    expected = reference()
    reports = launch(tmp_path, "cpu")
    for report in reports:
        assert difference(report, expected) <= 1e-12
    # (the union's statistics are not one rank's: a window of rank 0's micro-batches alone gives others)
    xs, _ = data()
    one_rank = torch.cat(xs[0][:3]).var(0)
    assert float((one_rank - torch.cat([x for r in range(WORLD) for x in xs[r][:3]]).var(0)).abs().max()) > 0.1
