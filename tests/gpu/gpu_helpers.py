"""What the CUDA tests share: a memory cap under which pieces run out of memory for real at known sizes
on any card, and a 16-mixed precision plugin whose GradScaler starts low enough that no window overflows."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

CAP = 4 << 30  # the process's CUDA memory while the out-of-memory tests run


@contextlib.contextmanager
def memory_cap() -> Iterator[None]:
    """Cap this process's CUDA memory at ``CAP`` (PyTorch's allocator raises a real ``OutOfMemoryError`` past
    it): the same pieces run out of memory on any card (``run.sh`` keeps big cached blocks whole)."""
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(CAP / torch.cuda.get_device_properties(0).total_memory)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def per_sample_bytes() -> int:
    """Bytes a piece allocates per sample under ``memory_cap``: pieces of 2 samples fit, of 4 and more run
    out of memory for real."""
    return int(CAP * 0.3)


def precision_plugins(precision: str) -> dict[str, Any]:
    """Trainer arguments for ``precision``. Under ``"16-mixed"`` the GradScaler starts at 2^4, not 2^16:
    at 2^16 float16 activation gradients of these models overflow and the scaler skips their first
    steps (as it should: ``test_default_scaler_as_lightnings_own`` checks that against Lightning's own
    accumulation), which a float64 reference does not model."""
    if precision != "16-mixed":
        return {"precision": precision}
    from lightning.pytorch.plugins.precision import MixedPrecision

    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**4)
    return {"precision": None, "plugins": [MixedPrecision("16-mixed", "cuda", scaler=scaler)]}
