"""The window gradient's error against k under ``precision="bf16-true"`` (issue 51): summed in bf16 ``.grad``,
or in float32 with ``grad_accum_dtype=torch.float32`` and rounded once.

A tiny GPT-2 (``transformers.GPT2Config``: 2 layers of width 64, 4 heads, a vocabulary of 256, no dropout;
random tokens, nothing downloaded; ``--model mlp``: the issue's 16-64-1 MLP on regression data), bf16
parameters, micro-batches of 4 sequences of 32 tokens, SGD with a learning rate of 0 (the parameters never
move, so that every window is measured at the same point). For each k (1, 2, 4, ..., 256) and each of
``--windows`` windows (different micro-batches), the window's gradient is taken as the optimizer gets it
(``on_before_optimizer_step``, or after the hand-written loop's last backward) from:

* **bf16 `.grad` by hand**: ``(loss / k).backward()`` k times into the bf16 ``.grad`` (what a plain loop does);
* **built-in**: ``Trainer(accumulate_grad_batches=k, precision="bf16-true")``;
* **callback, no option**: ``AccumulationScheduler(k)`` (bf16 ``.grad``, as the built-in);
* **grad_accum_dtype=float32**: ``AccumulationScheduler(k, grad_accum_dtype=torch.float32)``;
* **one rounding (floor)**: the exact value rounded to bf16 once, the best any bf16 ``.grad`` can hold.

The exact value is the float64 mean of the same k micro-batch gradients, each computed alone in bf16 (the
undivided loss's; ``k`` is a power of 2, so dividing a loss by it rounds nothing). The error is
``|g - exact| / |exact|`` over all parameters at once (Euclidean norms); the table gives the median over the
windows. Every path runs its forward under Lightning's bf16-true forward context, so that at k = 1 every row
is 0 (checked: a forward that differed would show there).

    python benchmarks/precision.py [--windows 4] [--model gpt] [--png docs/images/precision_error.png]  # ~2 min
    python benchmarks/precision.py --replot --png PATH  # the table and plot again from the last run's JSON
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.precision.half import HalfPrecision
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_accum import AccumulationScheduler

KS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
HAND = "bf16 .grad by hand"
BUILTIN = "built-in"
CALLBACK = "AccumulationScheduler(k)"
WIDE = "grad_accum_dtype=float32"
FLOOR = "one rounding (floor)"
COLUMNS = (HAND, BUILTIN, CALLBACK, WIDE, FLOOR)
LABELS = {"gpt": "a tiny GPT-2", "mlp": "a 16-64-1 MLP"}


def make_model(kind: str) -> nn.Module:
    """The model, seeded (float32: bf16-true converts it, the hand-written paths convert a copy)."""
    torch.manual_seed(1)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def make_batches(kind: str, count: int, seed: int) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    if kind == "mlp":
        return [(torch.randn(4, 16, generator=g), torch.randn(4, 1, generator=g)) for _ in range(count)]
    return [torch.randint(0, 256, (4, 32), generator=g) for _ in range(count)]


def loss_of(model: nn.Module, batch: Any) -> Tensor:
    if isinstance(batch, (tuple, list)):
        x, y = batch
        return nn.functional.mse_loss(model(x), y)
    return model(input_ids=batch, labels=batch).loss  # type: ignore[no-any-return]


class Module(pl.LightningModule):
    """The model under Lightning; keeps each window's gradient (float64 copies) as the optimizer gets it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.seen: list[list[Tensor]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return loss_of(self.model, batch)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.seen.append([p.grad.double() for p in self.model.parameters()])  # type: ignore[union-attr]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def lightning_windows(kind: str, batches: list[Any], k: int, how: str) -> list[Tensor]:
    """The window gradients of one fit over ``batches`` (``len(batches) / k`` windows), each as one flat float64
    vector."""
    module = Module(make_model(kind))
    if how == BUILTIN:
        callbacks, accumulate = [], k
    else:
        callbacks, accumulate = [AccumulationScheduler(k, grad_accum_dtype=torch.float32 if how == WIDE else None)], 1
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, precision="bf16-true", max_epochs=1, accumulate_grad_batches=accumulate,
        callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, DataLoader(batches, batch_size=None))
    if len(module.seen) != len(batches) // k:
        raise RuntimeError(f"{how}: {len(module.seen)} optimizer steps, {len(batches) // k} expected")
    return [torch.cat([g.flatten() for g in seen]) for seen in module.seen]


def hand_windows(kind: str, batches: list[Any], k: int) -> tuple[list[Tensor], list[Tensor]]:
    """Per window: the bf16 ``.grad`` a plain loop accumulates (``(loss / k).backward()`` k times), and the exact
    value (the float64 mean of the k micro-batch gradients, each computed alone in bf16); flat float64 vectors."""
    precision = HalfPrecision("bf16-true")
    model = precision.convert_module(make_model(kind))
    params = list(model.parameters())

    def backward(batch: Any, divisor: int) -> None:
        with precision.forward_context():
            loss = loss_of(model, precision.convert_input(batch))
        (loss / divisor).backward()

    def flat() -> Tensor:
        return torch.cat([p.grad.double().flatten() for p in params])  # type: ignore[union-attr]

    hand, exact = [], []
    for start in range(0, len(batches), k):
        window = batches[start : start + k]
        model.zero_grad(set_to_none=True)
        for batch in window:
            backward(batch, k)
        hand.append(flat())
        total = torch.zeros_like(hand[-1])
        for batch in window:
            model.zero_grad(set_to_none=True)
            backward(batch, 1)
            total += flat()
        exact.append(total / k)
    return hand, exact


def relative_error(g: Tensor, exact: Tensor) -> float:
    return float((g - exact).norm() / exact.norm())


def measure(kind: str, k: int, windows: int) -> dict[str, list[float]]:
    """Each column's error in each of ``windows`` windows of k micro-batches."""
    batches = make_batches(kind, k * windows, seed=k)
    hand, exact = hand_windows(kind, batches, k)
    got: dict[str, list[Tensor]] = {HAND: hand, FLOOR: [e.to(torch.bfloat16).double() for e in exact]}
    for how in (BUILTIN, CALLBACK, WIDE):
        got[how] = lightning_windows(kind, batches, k, how)
    return {how: [relative_error(g, e) for g, e in zip(got[how], exact, strict=True)] for how in COLUMNS}


def table(rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = [
        f"| k | {' | '.join(COLUMNS)} | option / floor | built-in / floor |",
        "| --- " * (len(COLUMNS) + 3) + "|",
    ]
    for row in rows:
        errors = [f"{row[c]:.2e}" if row[c] else "0" for c in COLUMNS]
        ratios = [f"{row[WIDE] / row[FLOOR]:.3f}", f"{row[BUILTIN] / row[FLOOR]:.2f}"] if row[FLOOR] else ["-", "-"]
        lines.append(f"| {row['k']} | {' | '.join(errors)} | {' | '.join(ratios)} |")
    return lines


def plot(rows: Sequence[dict[str, Any]], path: Path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles: dict[str, dict[str, Any]] = {
        HAND: {"marker": "o", "color": "tab:red"},
        BUILTIN: {"marker": "s", "color": "tab:orange", "ls": "--"},
        CALLBACK: {"marker": "x", "color": "tab:purple", "ls": ":"},
        WIDE: {"marker": "^", "color": "tab:blue", "lw": 2},
        FLOOR: {"color": "k", "ls": "--", "lw": 1},
    }
    labels = {
        HAND: "bf16 .grad, summed by hand",
        BUILTIN: "Trainer(accumulate_grad_batches=k)",
        CALLBACK: "AccumulationScheduler(k)",
        WIDE: "AccumulationScheduler(k, grad_accum_dtype=torch.float32)",
        FLOOR: "the exact gradient rounded to bf16 once",
    }
    rows = [row for row in rows if row["k"] > 1]  # (k = 1: every error is 0, off a log scale)
    fig, ax = plt.subplots(figsize=(7.5, 4.5), constrained_layout=True)
    ks = [row["k"] for row in rows]
    for column in COLUMNS:
        ax.plot(ks, [row[column] for row in rows], label=labels[column], **styles[column])
    title = f"The window gradient's error under bf16-true, {model}"
    ax.set(xscale="log", yscale="log", xlabel="micro-batches per window (k)", title=title,
           ylabel="|window gradient - exact| / |exact|")  # fmt: skip
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=4, help="windows per k (the median is reported)")
    parser.add_argument("--ks", type=int, nargs="+", default=list(KS), help="powers of 2")
    parser.add_argument("--model", choices=("gpt", "mlp"), default="gpt")
    parser.add_argument("--json", type=Path, default=Path(__file__).with_name("precision.json"))
    parser.add_argument("--png", default="", help="write the plot here (needs matplotlib); '' for none")
    parser.add_argument("--replot", action="store_true", help="measure nothing: the table and plot from --json")
    args = parser.parse_args(argv)
    what = "tiny GPT-2 (2 x 64, vocab 256), 4 x 32 tokens" if args.model == "gpt" else "16-64-1 MLP, batches of 4"
    if args.replot:
        saved = json.loads(args.json.read_text())
        print("\n".join(table(saved["rows"])))
        if args.png:
            plot(saved["rows"], Path(args.png), LABELS[saved.get("model", args.model)])
        return
    if any(k < 1 or k & (k - 1) for k in args.ks):
        parser.error("--ks: powers of 2 only (dividing a bf16 loss by k must round nothing)")
    torch.set_num_threads(1)
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_accum"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*(does not have many workers|LeafSpec).*")
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    for k in args.ks:
        errors = measure(args.model, k, args.windows)
        row: dict[str, Any] = {"k": k, **{c: statistics.median(errors[c]) for c in COLUMNS}}
        row["all"] = errors
        rows.append(row)
        print(f"k={k}: " + ", ".join(f"{c} {row[c]:.2e}" for c in COLUMNS), flush=True)
    seconds = time.perf_counter() - start
    print(f"\n{what} a micro-batch, bf16-true; median of {args.windows} windows; {seconds:.0f} s\n")
    lines = table(rows)
    print("\n".join(lines))
    worst = max((row[WIDE] / row[FLOOR] for row in rows if row[FLOOR]), default=float("nan"))
    print(f"\nworst option / floor: {worst:.3f} (target <= 1.1)")
    result = {
        "benchmark": "precision",
        "what": f"{what}, bf16-true, median over {args.windows} windows",
        "model": args.model,
        "columns": list(COLUMNS),
        "rows": rows,
        "worst_option_over_floor": worst,
        "target": 1.1,
        "seconds": seconds,
        "machine": f"{platform.machine()} torch {torch.__version__} lightning {pl.__version__}",
    }
    args.json.write_text(json.dumps(result, indent=2))
    if args.png:
        plot(rows, Path(args.png), LABELS[args.model])


if __name__ == "__main__":
    main()
