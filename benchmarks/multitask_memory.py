"""Peak memory of sequential multi-task backward against the joint ``sum(losses).backward()``.

Two measurements per configuration:

* graph memory: bytes of the tensors autograd saved for backward (parameters excluded) that
  are alive at once, tracked exactly with ``torch.autograd.graph.saved_tensors_hooks``;
* allocator peak: the process's peak resident memory above its level before the step, in a
  fresh process per configuration, with glibc's mmap threshold pinned so that freed
  activations go back to the OS (``MALLOC_MMAP_THRESHOLD_``).

Plus the wall time of one step, as the median ratio over interleaved repeats.

    python benchmarks/multitask_memory.py
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from lightning_accum.multitask import backward_each, backward_heads, measure_graph_memory

B, D = 1024, 256


def mlp(*widths: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.GELU()]
    return nn.Sequential(*layers[:-1])


def build(kind: str, tasks: int, scale: int = 1) -> tuple[list[nn.Module], Callable[[str], None]]:
    """Modules and a step function for ``method`` in ``joint`` / ``sequential`` (``scale``: every size
    divided by it, for a run that only checks the benchmark works)."""
    torch.manual_seed(0)
    x = torch.randn(B // scale, D)
    if kind == "independent":
        nets = [mlp(D, 1024 // scale, 1024 // scale, 1024 // scale, 1) for _ in range(tasks)]

        def step(method: str) -> None:
            closures = [lambda n=n: n(x).square().mean() for n in nets]
            if method == "joint":
                torch.stack([c() for c in closures]).sum().backward()
            else:
                backward_each(lambda loss: loss.backward(), closures)

        return nets, step
    wide = 2048 // scale
    trunk = mlp(D, wide, wide, wide)
    heads = [mlp(wide, 512 // scale, 1) for _ in range(tasks)]

    def step(method: str) -> None:
        features = trunk(x)
        losses = [lambda f, h=h: h(f).square().mean() for h in heads]
        if method == "joint":
            torch.stack([loss(features) for loss in losses]).sum().backward()
        else:
            backward_heads(lambda loss: loss.backward(), features, losses)

    return [trunk, *heads], step


def graph_peak(kind: str, tasks: int, method: str, scale: int) -> int:
    modules, step = build(kind, tasks, scale)
    with measure_graph_memory(exclude=params_of(modules)) as memory:
        step(method)
    return memory.peak


def part_sizes(tasks: int, scale: int) -> tuple[int, int]:
    """Graph bytes of the trunk alone and of one head alone (for the shared-trunk target)."""
    modules, _ = build("trunk", tasks, scale)
    trunk, head = modules[0], modules[1]
    sizes, b = [], B // scale
    for run in (lambda: trunk(torch.randn(b, D)).sum().backward(),
                lambda: head(torch.randn(b, 2048 // scale)).sum().backward()):  # fmt: skip
        with measure_graph_memory(exclude=params_of(modules)) as memory:
            run()
        sizes.append(memory.peak)
    return sizes[0], sizes[1]


def params_of(modules: list[nn.Module]) -> list[Tensor]:
    return [p for m in modules for p in m.parameters()]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def hwm_bytes() -> int:
    """Peak resident memory of this process image (VmHWM; unlike ``ru_maxrss`` it is not
    inherited from the parent across fork and exec)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def child(kind: str, tasks: int, method: str, scale: int) -> None:
    """In a fresh process: resident-memory peak of one step above the level before it."""
    modules, step = build(kind, tasks, scale)
    for m in modules:
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
    before = rss_bytes()
    step(method)
    peak = hwm_bytes()
    print(json.dumps({"rss_peak_above_start": max(peak - before, 0)}))


def allocator_peak(kind: str, tasks: int, method: str, scale: int) -> int:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    cmd = [sys.executable, __file__, "--child", kind, str(tasks), method, "--scale", str(scale)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return int(json.loads(out.strip().splitlines()[-1])["rss_peak_above_start"])


def time_ratio(kind: str, tasks: int, repeats: int, scale: int) -> float:
    modules, step = build(kind, tasks, scale)
    ratios = []
    for _ in range(repeats + 1):
        times = {}
        for method in ("joint", "sequential"):
            for m in modules:
                m.zero_grad(set_to_none=False)
            start = time.perf_counter()
            step(method)
            times[method] = time.perf_counter() - start
        ratios.append(times["sequential"] / times["joint"])
    return statistics.median(ratios[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=3, metavar=("KIND", "T", "METHOD"), help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--scale", type=int, default=1, help="divide every size by this (a quick check that it runs)")
    parser.add_argument("--tasks", default="2,4,8", help="the numbers of tasks, comma-separated")
    parser.add_argument("--json", type=Path, default=Path(__file__).with_name("multitask_memory.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.child:
        child(args.child[0], int(args.child[1]), args.child[2], args.scale)
        return

    rows = []
    header = f"{'setup':<22}{'T':>3}{'graph ratio':>13}{'target':>8}{'alloc ratio':>13}{'time ratio':>12}"
    print(header)
    for kind in ("independent", "trunk"):
        for tasks in map(int, args.tasks.split(",")):
            joint, seq = graph_peak(kind, tasks, "joint", args.scale), graph_peak(kind, tasks, "sequential", args.scale)
            if kind == "independent":
                target = 1 / tasks + 0.05
            else:
                trunk, head = part_sizes(tasks, args.scale)
                target = (trunk + head) / (trunk + tasks * head) + 0.05
            alloc_joint = allocator_peak(kind, tasks, "joint", args.scale)
            alloc_seq = allocator_peak(kind, tasks, "sequential", args.scale)
            row = {
                "setup": "independent tasks" if kind == "independent" else "shared trunk + heads",
                "tasks": tasks,
                "graph_bytes_joint": joint,
                "graph_bytes_sequential": seq,
                "graph_ratio": seq / joint,
                "target": target,
                "alloc_bytes_joint": alloc_joint,
                "alloc_bytes_sequential": alloc_seq,
                "alloc_ratio": alloc_seq / alloc_joint if alloc_joint else float("nan"),
                "time_ratio": time_ratio(kind, tasks, args.repeats, args.scale),
            }
            rows.append(row)
            print(
                f"{row['setup']:<22}{tasks:>3}{row['graph_ratio']:>13.3f}{target:>8.3f}"
                f"{row['alloc_ratio']:>13.3f}{row['time_ratio']:>12.3f}"
            )
    print("targets: graph ratio <= target; time ratio <= 1.05")
    args.json.write_text(json.dumps({"benchmark": "multitask_memory", "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
