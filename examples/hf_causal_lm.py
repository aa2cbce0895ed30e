"""A Hugging Face causal LM with a token ramp, token-weighted windows and an LR keyed on tokens.

A ``transformers`` GPT-2 built from a config (no download), trained on a byte-level encoding of
the docstrings of Python's standard library (no download either). ``outputs.loss`` is a mean
over the predicted tokens, so the callback takes it with ``reduction="mean"`` and weights each
micro-batch by ``causal_lm_tokens``: the shifted labels that are not -100, the tokens that loss
really averages over. k ramps from 1 to 8 micro-batches over the first 60 % of the tokens, the
learning rate warms up and decays over tokens too (a schedule in steps would end at the wrong
point under a ramp), and ``accum/loss`` is the loss of each effective batch.

    pip install -e ".[examples]" && python examples/hf_causal_lm.py
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import pathlib
import sys
import typing
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_accum import AccumulationScheduler, Ramp
from lightning_accum.count import causal_lm_tokens
from lightning_accum.lr import WarmupCosine

from _quiet import quiet

try:
    import transformers
except ImportError as error:  # pragma: no cover - the message is the point
    raise SystemExit('This example needs transformers: pip install -e ".[examples]"') from error

PAD = 256  # bytes are 0-255


def texts() -> list[bytes]:
    """Paragraphs of the standard library's docstrings, as bytes."""
    out = set()
    for module in (collections, inspect, json, pathlib, typing, argparse):
        for _, obj in inspect.getmembers(module):
            for paragraph in (inspect.getdoc(obj) or "").split("\n\n"):
                data = " ".join(paragraph.split()).encode()
                if 16 <= len(data) <= 128:
                    out.add(data)
    return sorted(out)


def collate(rows: list[bytes]) -> dict[str, Tensor]:
    """Byte ids, right-padded; padding is masked out of attention and labels (-100)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(list(row))
    mask = (ids != PAD).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class CausalLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        config = transformers.GPT2Config(
            vocab_size=PAD + 1, bos_token_id=PAD, eos_token_id=PAD, n_positions=128, n_embd=64, n_layer=2, n_head=4
        )
        torch.manual_seed(0)
        self.model = transformers.GPT2LMHeadModel(config)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.model(**batch).loss  # a mean over the batch's predicted tokens

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=2e-3)


class History(pl.Callback):
    """Every 10th optimizer step: k, the tokens seen and the effective batch's loss per token."""

    def __init__(self, accumulation: AccumulationScheduler) -> None:
        self.accumulation, self.rows = accumulation, []  # type: ignore[var-annotated]

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        step, metrics = trainer.global_step, trainer.callback_metrics
        if step % 10 == 0 and "accum/loss" in metrics and (not self.rows or self.rows[-1][0] != step):
            self.rows.append(
                (step, int(metrics["accum/k"]), self.accumulation.progress.items, float(metrics["accum/loss"]))
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=None, help="default 1, or 3 with --full")
    parser.add_argument("--full", action="store_true", help="the full run (several minutes on 2 CPU cores)")
    args = parser.parse_args()
    args.epochs = args.epochs or (3 if args.full else 1)
    quiet()
    transformers.logging.set_verbosity_error()  # its config notices
    data = texts()
    tokens = sum(len(t) - 1 for t in data) * args.epochs  # predicted tokens in the whole fit
    accumulation = AccumulationScheduler(
        Ramp(1, 8, over=int(0.6 * tokens), unit="items"),
        normalize="items",
        count=causal_lm_tokens,
        reduction="mean",
        lr_schedule=WarmupCosine(warmup=int(0.1 * tokens), total=tokens, unit="items"),
    )
    history = History(accumulation)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=args.epochs,
        callbacks=[accumulation, history],
        log_every_n_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=sys.stderr.isatty(),
        enable_model_summary=False,
    )
    torch.manual_seed(1)
    trainer.fit(CausalLM(), DataLoader(data, batch_size=8, shuffle=True, collate_fn=collate))  # type: ignore[arg-type]
    print(f"{len(data)} paragraphs, {tokens} predicted tokens over {args.epochs} epochs")
    for step, k, seen, loss in history.rows:
        print(f"step {step:>4}: k {k}, {seen:>6} tokens seen, effective batch's loss {loss:.3f} per token")
    progress = accumulation.progress
    print(f"done: {progress.step} optimizer steps, {progress.items} tokens, final k {accumulation.schedule(progress)}")


if __name__ == "__main__":
    main()
