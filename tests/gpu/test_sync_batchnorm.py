"""``nn.SyncBatchNorm`` under ``batchnorm="window"`` on CUDA: 2 ranks (2 processes on the one GPU, over gloo, which
carries CUDA tensors where NCCL refuses two ranks on one device), each normalising with both ranks' statistics by
torch's CUDA kernels; the fit equals one float64 process on the union of the ranks' micro-batches, its parameters
and the layer's running statistics (``tests/sync_batchnorm_ranks.py``; ``tests/distributed/test_sync_batchnorm_cpu.py``
runs the same script on the CPU with the kernels stood in for). Skipped without CUDA; run with
``bash tests/gpu/run.sh``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sync_batchnorm_ranks import difference, launch, reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_sync_batchnorm_on_cuda_under_window_equals_one_process_on_the_union(tmp_path: Path) -> None:
    expected = reference()
    for report in launch(tmp_path, "cuda"):
        # (float64 on the device; the CUDA kernels sum in their own order, and Welford's combination of the ranks'
        # mean and inverse standard deviation rounds differently from the union's one-pass statistics)
        assert difference(report, expected) <= 1e-10
