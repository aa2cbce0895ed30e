"""Cached backward against the whole batch's backward: graph memory and time.

A two-tower InfoNCE on a batch of 1024 pairs, one shared MLP tower (8 layers of 512, GELU,
with and without dropout 0.1: on a CPU, drawing the masks again in the replayed forward costs
about as much as the layers). The whole batch's backward keeps every layer's activations of 2 x 1024 samples
alive at once; the cached backward keeps one chunk's plus the representations and the loss's own
graph (the 1024 x 1024 logits). Graph memory is the peak of tensors saved for backward
(``measure_graph_memory``, parameters excluded), the representations' leaves added for the cached
run; time is the best of several rounds, interleaved.

    python benchmarks/cached_memory.py
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_accum.cached import backward_cached
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
    parser.add_argument("--json", type=Path, default=HERE / "cached_memory.json")
    args = parser.parse_args()
    rows = measure(0.0, args.batch, args.rounds) + measure(0.1, args.batch, args.rounds)
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
    args.json.write_text(json.dumps({"benchmark": "cached_memory", "batch": args.batch, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
