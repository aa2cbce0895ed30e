"""Strategy integration: which ranks take part, and window counts made global.

Every rank must normalise its window by the same global counts, so the local counts are
summed over ranks once per window, in a single all-reduce of one small integer tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def world_size(strategy: Any) -> int:
    """Ranks that average gradients (1 on a single device)."""
    return int(getattr(strategy, "world_size", 1) or 1)


def sum_over_ranks(strategy: Any, values: Sequence[int]) -> list[int]:
    """``values`` summed element-wise over all ranks; one collective, none on a single device."""
    if world_size(strategy) == 1:
        return [int(v) for v in values]
    tensor = torch.tensor(list(values), dtype=torch.int64, device=strategy.root_device)
    return [int(v) for v in strategy.reduce(tensor, reduce_op="sum").tolist()]


def is_deepspeed(strategy: Any) -> bool:
    """Whether the strategy owns gradient accumulation itself (DeepSpeed does)."""
    return bool(getattr(strategy, "handles_gradient_accumulation", False))
