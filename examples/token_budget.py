"""A batch in tokens: windows closed by a token budget against a fixed k, on unpacked variable-length sequences.

Synthetic sequences (generated here, no download) of very different lengths, batched the way fine-tuning
recipes batch unpacked data to save padding: sequences of similar length grouped into micro-batches of 8
(Hugging Face's ``group_by_length``), the micro-batches shuffled each epoch. A micro-batch of short sequences
then carries a few dozen tokens and one of long sequences several thousand, so with a fixed k the tokens per
optimizer step swing several-fold from step to step, even though ``normalize="items"`` makes each step's
gradient the exact token mean of what went in.

A small causal language model (an embedding, a causal convolution and a linear head) is trained twice from the
same seed on the same micro-batches in the same order: once with a fixed ``k``, once with
``Budget(n, unit="items")``, ``n`` chosen (from the loader's counts, before training) so that both runs take
about the same mean tokens per step. Each optimizer step's tokens are read from the ``WindowReport`` that
``on_window_end`` receives; the script prints, for each run, the steps, the mean, the smallest and largest step,
their ratio and the coefficient of variation (standard deviation over mean), and writes ``token_budget.png``
into ``--out``. Each epoch's last window is cut short by the epoch's end, as under any schedule: it is counted
apart, not in the figures.

    pip install -e ".[examples]" && python examples/token_budget.py            # about 10 s
    python examples/token_budget.py --full                                       # more data, more epochs
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Sampler
from typing_extensions import override

from lightning_accum import AccumulationScheduler, Budget
from lightning_accum.schedules import Schedule

from _quiet import quiet

VOCAB, PAD = 16, 16  # token ids 0..15; 16 pads
PER_BATCH, K = 8, 16  # sequences per micro-batch; the fixed run's micro-batches per step


def make_sequences(count: int, seed: int) -> list[Tensor]:
    """``count`` sequences from one random Markov chain over the vocabulary (something to learn), lengths drawn
    log-normally (median 40, from 4 to 400 tokens): a long tail, as instruction and chat data have."""
    g = torch.Generator().manual_seed(seed)
    transitions = torch.softmax(3.0 * torch.randn(VOCAB, VOCAB, generator=g), dim=1)
    lengths = torch.exp(torch.randn(count, generator=g) * 0.9 + 3.7).round().clamp(4, 400).long()
    sequences = []
    for length in lengths.tolist():
        tokens = [int(torch.randint(VOCAB, (1,), generator=g))]
        draws = torch.multinomial(transitions, length, replacement=True, generator=g)  # (each state's next draws)
        for i in range(1, length):
            tokens.append(int(draws[tokens[-1], i]))
        sequences.append(torch.tensor(tokens))
    return sequences


class LengthGrouped(Sampler[list[int]]):
    """Micro-batches of sequences of similar length (sorted by length, cut into groups), the groups' order
    shuffled each epoch (``set_epoch``), the same for every run of the same seed."""

    def __init__(self, lengths: list[int], batch_size: int, seed: int) -> None:
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        self.groups = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
        self.seed, self.epoch = seed, 0
        self.sampler = self  # (Lightning calls `set_epoch` on a batch sampler's `sampler` at each epoch's start)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @override
    def __iter__(self) -> Iterator[list[int]]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter([self.groups[i] for i in torch.randperm(len(self.groups), generator=g).tolist()])

    def __len__(self) -> int:
        return len(self.groups)


def collate(sequences: list[Tensor]) -> dict[str, Any]:
    """Right-padded inputs and next-token targets; ``tokens``: the predicted tokens, a Python int (a count on the
    host: the budget reads it before each micro-batch's ``training_step`` with no device synchronisation)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), PAD)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = s
    targets = ids[:, 1:]
    return {"inputs": ids[:, :-1], "targets": targets, "tokens": int((targets != PAD).sum())}


def count_tokens(batch: dict[str, Any]) -> int:
    return int(batch["tokens"])


class TinyCausalLM(pl.LightningModule):
    """Embedding, a causal convolution over the 4 previous tokens, a linear head: predicts each next token."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB + 1, 32, padding_idx=PAD)
        self.conv = nn.Conv1d(32, 64, kernel_size=4)
        self.head = nn.Linear(64, VOCAB)

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        h = nn.functional.pad(self.embed(batch["inputs"]).transpose(1, 2), (3, 0))  # (left: causal)
        logits = self.head(torch.relu(self.conv(h)).transpose(1, 2))
        # the sum over the micro-batch's predicted tokens: `normalize="items"` divides the window's sum by its count
        return nn.functional.cross_entropy(logits.transpose(1, 2), batch["targets"], ignore_index=PAD, reduction="sum")

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=3e-3)


class TokensPerStep(pl.Callback):
    """Each optimizer step's tokens over all ranks and its epoch, from the window the package reports."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int]] = []

    def on_window_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, window: Any) -> None:
        self.steps.append((window.epoch, window.items))


def train(schedule: int | Schedule, sequences: list[Tensor], epochs: int) -> list[tuple[int, int]]:
    """One fit from the same seed, on a loader of its own (the same micro-batches in the same order each time)."""
    pl.seed_everything(0, verbose=False)
    sampler = LengthGrouped([len(s) for s in sequences], PER_BATCH, seed=0)
    loader = DataLoader(sequences, batch_sampler=sampler, collate_fn=collate)  # type: ignore[arg-type]
    accumulation = AccumulationScheduler(schedule, normalize="items", count=count_tokens, reduction="sum")
    recorder = TokensPerStep()
    trainer = pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        callbacks=[accumulation, recorder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=sys.stderr.isatty(),
        enable_model_summary=False,
    )
    trainer.fit(TinyCausalLM(), loader)
    return recorder.steps


def budget_windows(counts: list[list[int]], n: int) -> list[int]:
    """The tokens of each window a budget of ``n`` closes, epoch by epoch (an epoch's last window apart)."""
    sizes = []
    for epoch in counts:
        seen = 0
        for c in epoch:
            seen += c
            if seen >= n:
                sizes.append(seen)
                seen = 0
    return sizes


def figures(steps: list[tuple[int, int]]) -> tuple[list[int], int]:
    """The tokens of every step but each epoch's last window (cut short by the epoch's end), and how many of
    those last windows there were."""
    last = {i for i in range(len(steps)) if i + 1 == len(steps) or steps[i + 1][0] != steps[i][0]}
    return [tokens for i, (_, tokens) in enumerate(steps) if i not in last], len(last)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=None, help="default 2, or 4 with --full")
    parser.add_argument("--sequences", type=int, default=None, help="default 3,072, or 12,288 with --full")
    parser.add_argument("--full", action="store_true", help="the full run (about a minute on 2 CPU cores)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "images")
    args = parser.parse_args()
    args.epochs = args.epochs or (4 if args.full else 2)
    args.sequences = args.sequences or (12288 if args.full else 3072)
    quiet()
    torch.set_num_threads(1)  # (a model this small mostly waits on a second thread)

    sequences = make_sequences(args.sequences, seed=0)
    sampler = LengthGrouped([len(s) for s in sequences], PER_BATCH, seed=0)
    counts = []  # each epoch's micro-batch token counts, in the order the fits will see them
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        counts.append([sum(len(sequences[i]) - 1 for i in group) for group in sampler])
    per_batch = [c for epoch in counts for c in epoch]
    print(f"{len(sequences)} sequences of {min(len(s) for s in sequences)}-{max(len(s) for s in sequences)} tokens, "
          f"{len(per_batch) // args.epochs} micro-batches of {PER_BATCH} per epoch: {min(per_batch)}-"
          f"{max(per_batch)} predicted tokens per micro-batch")  # fmt: skip

    # the budget: the n whose windows hold, on the loader's own counts, the mean tokens per step of k = K
    fixed_mean = K * statistics.fmean(per_batch)
    n = min(range(1, int(2 * fixed_mean)), key=lambda b: abs(statistics.fmean(budget_windows(counts, b)) - fixed_mean))

    runs = {f"k = {K}": train(K, sequences, args.epochs), f"Budget({n}, unit='items')": train(
        Budget(n, unit="items"), sequences, args.epochs
    )}  # fmt: skip
    results = {}
    for name, steps in runs.items():
        tokens, short = figures(steps)
        mean = statistics.fmean(tokens)
        cv = statistics.pstdev(tokens) / mean
        results[name] = tokens
        print(f"{name:<26} {len(steps)} optimizer steps; tokens per step (each epoch's last window apart, {short} of "
              f"them): mean {mean:.0f}, min {min(tokens)}, max {max(tokens)}, max/min {max(tokens) / min(tokens):.2f}, "
              f"coefficient of variation {cv:.3f}")  # fmt: skip
    budget_tokens = results[f"Budget({n}, unit='items')"]
    print(f"budget n = {n}: every step >= n: {min(budget_tokens) >= n}; at most one micro-batch more: "
          f"{max(budget_tokens) - n < max(per_batch)}; the windows the loader's counts give by hand: "
          f"{budget_tokens == budget_windows(counts, n)}")  # fmt: skip

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [2, 1]})
    for name, tokens in results.items():
        axes[0].plot(range(1, len(tokens) + 1), tokens, marker=".", linewidth=0.8, label=name)
    axes[0].axhline(n, color="gray", linestyle="--", linewidth=0.8, label=f"n = {n}")
    axes[0].set(xlabel="optimizer step (each epoch's last window apart)", ylabel="tokens per optimizer step",
                yscale="log", title="tokens per optimizer step")  # fmt: skip
    axes[0].legend()
    high = max(max(t) for t in results.values())
    bins = [high * i / 40 for i in range(41)]
    for name, tokens in results.items():
        axes[1].hist(tokens, bins=bins, alpha=0.6, label=name)
    axes[1].set(xlabel="tokens per optimizer step", ylabel="steps", title="their distribution")
    fig.suptitle(f"Length-grouped micro-batches of {PER_BATCH} sequences: a fixed k against a token budget")
    fig.tight_layout()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "token_budget.png"
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
