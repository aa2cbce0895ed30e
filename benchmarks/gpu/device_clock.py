"""How the GPU harness measures, the same calls on CUDA and (for ``--quick``) on the CPU: the device,
its clock (``torch.cuda.synchronize`` around every timed region), its allocator peak, and the host
syncs a region makes.

Syncs are counted on CUDA with ``torch.cuda.set_sync_debug_mode("warn")``: every operation that makes
the host wait for the stream warns, and the warnings are caught and counted. The CPU has no stream to
wait on; there the counter counts the reads of a tensor's value into Python (``.item()``, ``bool(t)``,
...: each a sync on a GPU) with a ``TorchFunctionMode``, so that the CPU dry run takes the same path.
"""

from __future__ import annotations

import gc
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

HOST_READS = {  # what reads a tensor's value into Python: a device sync on a GPU
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.numpy,
}
SYNC_WARNING = "synchroniz"  # (CUDA's "called a synchronizing CUDA operation")


class Device:
    """The device a run measures on: ``cuda`` (the real run) or ``cpu`` (the dry run)."""

    def __init__(self, name: str) -> None:
        self.type = name
        self.cuda = name == "cuda"
        self.torch = torch.device(name)

    def describe(self) -> str:
        if self.cuda:
            props = torch.cuda.get_device_properties(0)
            return f"{props.name} ({props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda})"
        return "CPU (dry run: no GPU figures)"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def now(self) -> float:
        """Seconds, after everything queued so far has run."""
        self.sync()
        return time.perf_counter()

    def clean(self) -> None:
        """Frees what the last run left on the card (a no-op on the CPU: a full collection there took 0.26 s a
        call, most of the dry run, for nothing measured)."""
        if self.cuda:
            gc.collect()
            torch.cuda.empty_cache()

    def allocated(self) -> int:
        return torch.cuda.memory_allocated() if self.cuda else 0

    def reset_peak(self) -> int:
        """Start a peak measurement; returns the bytes allocated now (what the peak is counted above)."""
        self.sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        return self.allocated()

    def peak_above(self, base: int) -> float:
        """The allocator's peak since ``reset_peak`` above ``base``, in bytes (NaN on the CPU: no allocator)."""
        self.sync()
        return float(torch.cuda.max_memory_allocated() - base) if self.cuda else float("nan")

    def total_memory(self) -> int:
        return torch.cuda.get_device_properties(0).total_memory if self.cuda else 0


def median_seconds(device: Device, run: Callable[[], Any], reps: int, warmup: int = 1) -> float:
    """The median seconds of ``run`` over ``reps`` calls after ``warmup`` untimed ones, each synchronised."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(reps):
        start = device.now()
        run()
        times.append(device.now() - start)
    return statistics.median(times)


class _Reads(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += func in HOST_READS
        return func(*args, **(kwargs or {}))


class SyncCounter:
    """Counts host syncs between ``start()`` and ``stop()`` (which may be called from different hooks);
    ``count`` reads the running total."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self._caught: list[warnings.WarningMessage] | None = None
        self._catcher: Any = None
        self._reads: _Reads | None = None
        self.final = 0

    @property
    def count(self) -> int:
        if self._caught is not None:
            return sum(SYNC_WARNING in str(w.message) for w in self._caught)
        return self._reads.count if self._reads is not None else self.final

    def start(self) -> None:
        if self.device.cuda:
            self._catcher = warnings.catch_warnings(record=True)
            self._caught = self._catcher.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        else:
            self._reads = _Reads()
            self._reads.__enter__()

    def stop(self) -> int:
        self.final = self.count
        if self.device.cuda:
            torch.cuda.set_sync_debug_mode("default")
            self._catcher.__exit__(None, None, None)
            self._caught = self._catcher = None
        elif self._reads is not None:
            self._reads.__exit__(None, None, None)
            self._reads = None
        return self.final
