"""A Lightning Fabric pretraining loop (in the style of LitGPT's) with ``FabricAccumulator``.

A tiny ``transformers`` GPT-2 from a config (no download) on the same byte-level paragraphs of
the standard library's docstrings as ``hf_causal_lm.py``. The loop is Fabric's own; the
accumulator gives it a token ramp (k from 1 to 8 micro-batches over the first 60 % of the tokens),
the token mean over each window (``reduction="mean"`` with ``causal_lm_tokens``: what each
micro-batch's ``outputs.loss`` averages over), a learning rate keyed on tokens (warm-up and
cosine), clipping of the normalised gradient, and, with ``--checkpoint PATH``, a checkpoint after each
epoch that a second run with the same path resumes from (exactly: at a step, or inside a window).
Prints every tenth step: k, the tokens seen, the window's loss per token and the LR it used.

    pip install -e ".[examples]" && python examples/fabric_pretraining.py
    python examples/fabric_pretraining.py --epochs 1 --checkpoint state.ckpt  # then again, with --epochs 2
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
from hf_causal_lm import PAD, collate, texts, transformers
from lightning.fabric import Fabric

from lightning_accum import FabricAccumulator, Ramp
from lightning_accum.count import causal_lm_tokens
from lightning_accum.lr import WarmupCosine

from _quiet import quiet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=None, help="default 1, or 2 with --full")
    parser.add_argument("--full", action="store_true", help="the full run (several minutes on 2 CPU cores)")
    parser.add_argument("--checkpoint", type=Path, help="save after each epoch; resume from it if it exists")
    args = parser.parse_args()
    args.epochs = args.epochs or (2 if args.full else 1)
    quiet()
    transformers.logging.set_verbosity_error()
    data = texts()
    tokens = sum(len(t) - 1 for t in data) * args.epochs  # predicted tokens in the whole run

    fabric = Fabric(accelerator="cpu", devices=1)
    config = transformers.GPT2Config(
        vocab_size=PAD + 1, bos_token_id=PAD, eos_token_id=PAD, n_positions=128, n_embd=64, n_layer=2, n_head=4
    )
    with fabric.init_module():
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=2e-3))
    accumulation = FabricAccumulator(
        fabric, model, optimizer,
        Ramp(1, 8, over=int(0.6 * tokens), unit="items"),
        normalize="items", count=causal_lm_tokens, reduction="mean",
        lr_schedule=WarmupCosine(warmup=int(0.1 * tokens), total=tokens, unit="items"),
        gradient_clip_val=1.0,
    )  # fmt: skip
    # (the accumulator first: Fabric loads in this order, and a checkpoint it refuses then changes nothing)
    state = {"accumulation": accumulation, "model": model, "optimizer": optimizer}
    start = 0
    if args.checkpoint is not None and args.checkpoint.exists():
        start = fabric.load(args.checkpoint, state)["epochs_done"]
        print(f"resumed from {args.checkpoint} after epoch {start}: {accumulation.progress.step} steps so far")

    rng = random.Random(1)
    for epoch in range(args.epochs):
        order = list(range(0, len(data), 8))
        rng.shuffle(order)  # (drawn for the epochs done too, so that a resumed run sees the same order)
        if epoch < start:
            continue
        for n, i in enumerate(order):
            batch = fabric.to_device(collate(data[i : i + 8]))
            # the epoch's last micro-batch closes its window: a short last window, divided by its own size
            with accumulation.accumulate(batch, epoch=epoch, last=n == len(order) - 1) as step:
                step.backward(model(**batch).loss)  # a mean over the micro-batch's predicted tokens
            if step.stepped and step.window is not None and step.window.step % 10 == 0:
                w = step.window
                print(
                    f"step {w.step:>4}: k {w.k}, {w.progress.items:>6} tokens seen, window loss {w.loss:.3f} per "
                    f"token, lr {w.lr['lr']:.2e}"
                )
        if args.checkpoint is not None:
            fabric.save(args.checkpoint, {**state, "epochs_done": epoch + 1})
            print(f"saved {args.checkpoint} after epoch {epoch}")
    progress = accumulation.progress
    print(f"done: {progress.step} optimizer steps, {progress.items} tokens, final k {accumulation.schedule(progress)}")


if __name__ == "__main__":
    main()
