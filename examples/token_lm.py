"""Token-weighted accumulation for a character language model on the standard library's docstrings.

Lines of Python's own docstrings (no download) have very different lengths, so micro-batches
hold very different numbers of tokens. Averaging each micro-batch's mean loss (a mean of
means) over-weights the tokens of short micro-batches; ``normalize="items"`` divides the
window's summed loss by its real token count, which is exactly the gradient of one big batch.
The script first shows that on one window, then trains the model both ways.

    pip install -e ".[examples]" && python examples/token_lm.py
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import pathlib
import string
import sys
import typing

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_accum import AccumulationScheduler

from _quiet import quiet

VOCAB = string.printable
PAD = len(VOCAB)


def docstring_lines() -> list[str]:
    lines = []
    for module in (collections, inspect, json, pathlib, string, typing, argparse):
        for _, obj in inspect.getmembers(module):
            for line in (inspect.getdoc(obj) or "").splitlines():
                line = line.strip()
                if 8 <= len(line) <= 80 and all(c in VOCAB for c in line):
                    lines.append(line)
    return sorted(set(lines))


def collate(lines: list[str]) -> dict[str, Tensor]:
    """Characters as ids, right-padded; predict each next character of each line."""
    width = max(len(line) for line in lines)
    ids = torch.full((len(lines), width), PAD)
    for i, line in enumerate(lines):
        ids[i, : len(line)] = torch.tensor([VOCAB.index(c) for c in line])
    return {"inputs": ids[:, :-1], "targets": ids[:, 1:], "mask": (ids[:, 1:] != PAD).float()}


def count_tokens(batch: dict[str, Tensor]) -> Tensor:
    return batch["mask"].sum()


class CharLM(pl.LightningModule):
    def __init__(self, reduction: str) -> None:
        super().__init__()
        self.reduction = reduction
        self.embed = nn.Embedding(PAD + 1, 32)
        self.rnn = nn.GRU(32, 96, batch_first=True)
        self.out = nn.Linear(96, PAD + 1)

    def token_loss_sum(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self.out(self.rnn(self.embed(batch["inputs"]))[0])
        per_token = nn.functional.cross_entropy(logits.transpose(1, 2), batch["targets"], reduction="none")
        return (per_token * batch["mask"]).sum()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        total = self.token_loss_sum(batch)
        return total if self.reduction == "sum" else total / count_tokens(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def flat_grad(model: nn.Module, loss: Tensor) -> Tensor:
    model.zero_grad()
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def one_window(lines: list[str], k: int, size: int) -> None:
    torch.manual_seed(0)
    model = CharLM("sum")
    batches = [collate(lines[i * size : (i + 1) * size]) for i in range(k)]
    tokens = [count_tokens(b) for b in batches]
    big = flat_grad(model, sum(model.token_loss_sum(b) for b in batches) / sum(tokens))
    items = flat_grad(model, sum(model.token_loss_sum(b) / sum(tokens) for b in batches))
    means = flat_grad(model, sum(model.token_loss_sum(b) / n / k for b, n in zip(batches, tokens, strict=True)))
    print(f"one window of {k} micro-batches with {[int(n) for n in tokens]} tokens:")
    print(f"  normalize='items' vs one big batch: relative error {float((items - big).norm() / big.norm()):.1e}")
    print(f"  mean of means     vs one big batch: relative error {float((means - big).norm() / big.norm()):.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=None, help="default 1, or 2 with --full")
    parser.add_argument("--full", action="store_true", help="the full run (several minutes on 2 CPU cores)")
    parser.add_argument("--lines", type=int, default=None, help="train on the first N lines only (a quick run)")
    args = parser.parse_args()
    args.epochs = args.epochs or (2 if args.full else 1)
    args.lines = args.lines or (None if args.full else 256)
    quiet()

    lines = docstring_lines()
    print(f"{len(lines)} docstring lines, {sum(map(len, lines))} characters")
    by_length = sorted(lines, key=len)  # micro-batches of short and of long lines: the worst case
    one_window([*by_length[:8], *by_length[-8:], *by_length[len(lines) // 2 : len(lines) // 2 + 16]], k=4, size=8)

    held_out = collate(lines[::10])
    train = [line for i, line in enumerate(lines) if i % 10][: args.lines]
    for name, normalize, reduction in (("token-weighted", "items", "sum"), ("mean of means", "mean", "mean")):
        pl.seed_everything(0, verbose=False)
        model = CharLM(reduction)
        sums = {"reduction": "sum"} if normalize == "items" else {}  # (a loss over items: only "items" asks)
        accumulation = AccumulationScheduler(4, normalize=normalize, count=count_tokens, **sums)  # type: ignore[arg-type]
        trainer = pl.Trainer(
            max_epochs=args.epochs,
            accelerator="cpu",
            callbacks=[accumulation],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=sys.stderr.isatty(),
            enable_model_summary=False,
        )
        data = DataLoader(
            train, batch_size=8, shuffle=True, collate_fn=collate, generator=torch.Generator().manual_seed(0)
        )
        trainer.fit(model, data)
        with torch.no_grad():
            loss = float(model.token_loss_sum(held_out) / count_tokens(held_out))
        print(f"{name:<15} held-out loss per token {loss:.4f} after {accumulation.progress.step} steps")


if __name__ == "__main__":
    main()
