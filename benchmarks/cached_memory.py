"""Cached backward against the whole batch's backward and against GradCache: memory and time.

A two-tower InfoNCE on a batch of 1024 pairs, one shared MLP tower (8 layers of 512, GELU,
with and without dropout 0.1: on a CPU, drawing the masks again in the replayed forward costs
about as much as the layers). The whole batch's backward keeps every layer's activations of 2 x 1024 samples
alive at once; the cached backward keeps one chunk's plus the representations and the loss's own
graph (the 1024 x 1024 logits). Graph memory is the peak of tensors saved for backward
(``measure_graph_memory``, parameters excluded), the representations' leaves added for the cached
run; time is the best of several rounds, interleaved.

Beside it, GradCache's published algorithm (Gao et al. 2021, the baseline; re-implemented below
from the paper, as GradCache is not on PyPI): the graph-free pass's chunk outputs concatenated,
the loss on their detached copy, then each chunk again under its RNG state with the surrogate
``dot(reps, cached grad)`` back-propagated. Against it the peak of the process's heap (glibc's
``mallinfo2``, sampled after every operator, above its level before the call: the allocator's
view, outputs and temporaries included) and the time, at the same chunk size.

    python benchmarks/cached_memory.py
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_accum._core.cached import backward_cached
from lightning_accum.multitask import measure_graph_memory

HERE = Path(__file__).resolve().parent
WIDTH, DEPTH, REP = 512, 8, 128


def info_nce(q: Tensor, d: Tensor) -> Tensor:
    logits = nn.functional.normalize(q, dim=1) @ nn.functional.normalize(d, dim=1).T / 0.05
    return nn.functional.cross_entropy(logits, torch.arange(len(q)))


def tower(dropout: float) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Dropout(dropout)]
    return nn.Sequential(*layers, nn.Linear(WIDTH, REP))


def whole(net: nn.Module, q: Tensor, d: Tensor) -> None:
    info_nce(net(q), net(d)).backward()


def plain(net: nn.Module, q: Tensor, d: Tensor, chunk: int) -> None:
    """Plain accumulation at the same chunk size (each chunk's own negatives: another objective)."""
    for qc, dc in zip(q.split(chunk), d.split(chunk), strict=True):
        (info_nce(net(qc), net(dc)) * len(qc) / len(q)).backward()


def cached(net: nn.Module, q: Tensor, d: Tensor, chunk: int) -> None:
    backward_cached([net, net], [q, d], info_nce, chunk, Tensor.backward, torch.autograd.backward)


def gradcache(net: nn.Module, q: Tensor, d: Tensor, chunk: int) -> None:
    """GradCache's algorithm as published: no-grad chunks with their RNG states, the cached gradient
    of the loss on the concatenated representations, a surrogate dot product back-propagated per chunk."""
    states: list[list[Tensor]] = []
    reps = []
    with torch.no_grad():
        for x in (q, d):
            outs = []
            for part in x.split(chunk):
                states.append([torch.get_rng_state()])
                outs.append(net(part))
            reps.append(torch.cat(outs))
    leaves = [r.detach().requires_grad_() for r in reps]
    info_nce(*leaves).backward()
    cache = [leaf.grad for leaf in leaves]
    i = 0
    for x, grad in zip((q, d), cache, strict=True):
        for part, g in zip(x.split(chunk), grad.split(chunk), strict=True):  # type: ignore[union-attr]
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(states[i][0])
                y = net(part)
            torch.dot(y.flatten(), g.flatten()).backward()
            i += 1


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]  # fmt: skip


@functools.cache
def _mallinfo2() -> Any:
    """glibc's ``mallinfo2``, loaded once (``None`` where glibc has none)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None
    return libc.mallinfo2


def _heap_bytes() -> int:
    """Bytes the C heap holds now (allocated chunks and mapped blocks); 0 where glibc has no mallinfo2."""
    mallinfo2 = _mallinfo2()
    if mallinfo2 is None:
        return 0
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)


class _HeapPeak(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.start = _heap_bytes()
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, _heap_bytes() - self.start)
        return out


@contextlib.contextmanager
def heap_peak() -> Iterator[_HeapPeak]:
    """The heap's peak above its level at entry, sampled after every operator (forward and backward)."""
    with _HeapPeak() as peak:
        yield peak


def versus_gradcache(dropout: float, batch: int, rounds: int) -> list[dict[str, Any]]:
    """Peak heap and time of the package's cached backward against GradCache's, at each chunk size."""
    torch.manual_seed(0)
    net = tower(dropout)
    q, d = torch.randn(batch, WIDTH), torch.randn(batch, WIDTH)
    rows = []
    for chunk in (32, 128):
        runs = {
            "gradcache": lambda chunk=chunk: gradcache(net, q, d, chunk),  # type: ignore[misc]
            "package": lambda chunk=chunk: cached(net, q, d, chunk),  # type: ignore[misc]
        }
        peaks, best = {}, dict.fromkeys(runs, float("inf"))
        for name, run in runs.items():
            run()  # (warm: the allocator's arenas reach their size)
            net.zero_grad(set_to_none=False)
            with heap_peak() as peak:
                run()
            peaks[name] = peak.peak
            net.zero_grad(set_to_none=False)
        for _ in range(rounds):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - start)
                net.zero_grad(set_to_none=False)
        rows.append(
            {
                "chunk": chunk,
                "dropout": dropout,
                "peak_bytes_gradcache": peaks["gradcache"],
                "peak_bytes_package": peaks["package"],
                "peak_ratio": peaks["package"] / peaks["gradcache"],
                "time_ratio": best["package"] / best["gradcache"],
            }
        )
    return rows


def measure(dropout: float, batch: int, rounds: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    net = tower(dropout)
    q, d = torch.randn(batch, WIDTH), torch.randn(batch, WIDTH)
    runs = {"whole": lambda: whole(net, q, d)}
    for chunk in (32, 64, 128, 256):
        runs[f"chunks of {chunk}"] = lambda chunk=chunk: cached(net, q, d, chunk)  # type: ignore[misc]
        runs[f"plain {chunk}"] = lambda chunk=chunk: plain(net, q, d, chunk)  # type: ignore[misc]
    memory, best = {}, dict.fromkeys(runs, float("inf"))
    for name, run in runs.items():
        with measure_graph_memory(exclude=net.parameters()) as graph:
            run()
        memory[name] = graph.peak
        net.zero_grad()
    leaves = [torch.randn(batch, REP, requires_grad=True) for _ in range(2)]
    with measure_graph_memory() as loss_graph:
        info_nce(*leaves).backward()
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
            net.zero_grad()
    reps = 2 * batch * REP * 4  # the cached run's leaves (float32)
    rows = []
    for name in [n for n in runs if not n.startswith("plain")]:
        chunk = None if name == "whole" else int(name.split()[-1])
        held = memory[name] + (reps if chunk else 0)
        # one chunk's share of the whole graph, plus the representations and the loss's own graph
        target = None if chunk is None else chunk / batch + (reps + loss_graph.peak) / memory["whole"]
        rows.append(
            {
                "run": name,
                "dropout": dropout,
                "graph_bytes": held,
                "graph_ratio": held / memory["whole"],
                "target": target,
                "time_s": best[name],
                "time_ratio": best[name] / best["whole"],
                "vs_plain": None if chunk is None else best[name] / best[f"plain {chunk}"],
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dropouts", default="0,0.1", help="the towers' dropout rates, comma-separated")
    parser.add_argument("--json", type=Path, default=HERE / "cached_memory.json")
    args = parser.parse_args()
    dropouts = [float(rate) for rate in args.dropouts.split(",")]
    rows = [row for rate in dropouts for row in measure(rate, args.batch, args.rounds)]
    head = f"{'run':<16}{'dropout':>8}{'graph MiB':>10}{'vs whole':>10}{'target':>9}{'time s':>9}{'vs whole':>10}"
    print(head + f"{'vs plain':>10}")
    for row in rows:
        shown = "" if row["target"] is None else f"{row['target']:.3f}"
        print(
            f"{row['run']:<16}{row['dropout']:>8}{row['graph_bytes'] / 2**20:>10.1f}{row['graph_ratio']:>10.3f}"
            f"{shown:>9}{row['time_s']:>9.3f}{row['time_ratio']:>10.3f}"
            + ("" if row["vs_plain"] is None else f"{row['vs_plain']:>10.3f}")
        )
    print("targets: graph ratio <= the target column; time ratio <= 1.5 ('vs plain': plain accumulation")
    print("at the same chunk size, which pays the same small-matmul cost on a CPU but trains another objective)")
    versus = [row for rate in dropouts for row in versus_gradcache(rate, args.batch, args.rounds)]
    print(f"{'vs GradCache':<16}{'dropout':>8}{'heap MiB':>10}{'GradCache':>11}{'ratio':>8}{'time ratio':>12}")
    for row in versus:
        print(
            f"{'chunks of ' + str(row['chunk']):<16}{row['dropout']:>8}{row['peak_bytes_package'] / 2**20:>10.2f}"
            f"{row['peak_bytes_gradcache'] / 2**20:>11.2f}{row['peak_ratio']:>8.3f}{row['time_ratio']:>12.3f}"
        )
    print("targets: heap peak and time at most GradCache's (ratios <= 1)")
    result = {"benchmark": "cached_memory", "batch": args.batch, "rows": rows, "versus_gradcache": versus}
    args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
