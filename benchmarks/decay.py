"""Per-step cost of the GradientDecay reset against ``zero_grad``.

One training step is forward, backward, optimizer step and the reset policy. Two models:
many small parameters (200 layers of 64x64) and few large ones (4 layers of 2048x2048), a
batch of 8 so that the gradient work is a large part of the step. Each policy's steps are
timed in interleaved rounds; the figures are ratios of the best round times against
``zero_grad(set_to_none=False)``.

    python benchmarks/decay.py
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from lightning_accum import GradientDecay


def make_model(kind: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if kind == "many small":
        layers = [nn.Linear(64, 64) for _ in range(200)]
        return nn.Sequential(*layers), torch.randn(8, 64)
    return nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)]), torch.randn(8, 2048)


def policy(name: str, model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    decay = GradientDecay(0.9, mode="ema") if name.startswith("decay") else None
    if decay is not None:
        decay.attach([opt])

    def reset() -> None:
        if decay is None:
            opt.zero_grad(set_to_none=name == "zero_grad(set_to_none=True)")
        else:
            decay.after_step()

    def step() -> None:
        model(x).square().mean().backward()
        if decay is not None:
            decay.combine(opt)
        opt.step()
        reset()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", type=Path, default=Path(__file__).with_name("decay.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = ["zero_grad(set_to_none=False)", "zero_grad(set_to_none=True)", "decay (GradientDecay ema)"]
    rows = []
    print(f"{'model':<12}{'policy':<32}{'step ms':>9}{'step ratio':>12}")
    for kind in ("many small", "few large"):
        model, x = make_model(kind)
        steps = {name: policy(name, model, x) for name in names}
        best = dict.fromkeys(names, float("inf"))
        for _ in range(args.rounds):
            for name in names:
                model.zero_grad(set_to_none=True)
                steps[name]()  # warm: buffers in the state the policy keeps
                start = time.perf_counter()
                for _ in range(args.steps):
                    steps[name]()
                best[name] = min(best[name], (time.perf_counter() - start) / args.steps)
        base = best[names[0]]
        for name in names:
            row = {"model": kind, "policy": name, "step_ms": best[name] * 1e3, "step_ratio": best[name] / base}
            rows.append(row)
            print(f"{kind:<12}{name:<32}{row['step_ms']:>9.3f}{row['step_ratio']:>12.3f}")
    print("target: decay step <= 1.1x the zero_grad step")
    args.json.write_text(json.dumps({"benchmark": "decay", "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
