"""Hugging Face models: a ``transformers`` GPT-2 built from a config (float64), its mean
``outputs.loss`` taken by the callback with ``reduction="mean"`` and ``causal_lm_tokens``, against
one big batch's token-mean loss; counting the attention mask instead trains another objective.
Skipped where ``transformers`` is not installed (``.ci/run`` installs it)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import trainer
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_accum import AccumulationScheduler, Piecewise
from lightning_accum.count import causal_lm_tokens

transformers = pytest.importorskip("transformers")

SCHEDULE = Piecewise({0: 3, 2: 2}, unit="step")  # 3, 3, then 2s; 9 batches: 3, 3, 2, 1


def gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50, n_positions=32, n_embd=16, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(config).double()


def batches() -> list[dict[str, Tensor]]:
    """Right-padded sequences of very different lengths (2 to 20 tokens)."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(9):
        lengths = torch.randint(2, 21, (2,), generator=g)
        ids = torch.randint(0, 49, (2, int(lengths.max())), generator=g)
        mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


class LM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = gpt2()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def token_sum(model: Any, batch: dict[str, Tensor]) -> Tensor:
    """The summed next-token loss over the predicted tokens, by hand."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="sum")


def reference(data: list[dict[str, Tensor]], windows: list[int]) -> list[Tensor]:
    """Each window: its summed token loss over its predicted tokens, one SGD step."""
    model = gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    i = 0
    for k in windows:
        window = data[i : i + k]
        tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in window)
        (sum(token_sum(model, b) for b in window) / tokens).backward()  # type: ignore[union-attr]
        opt.step()
        opt.zero_grad()
        i += k
    return [p.detach() for p in model.parameters()]


def fit(count: Any) -> list[Tensor]:
    model = LM()
    callback = AccumulationScheduler(SCHEDULE, normalize="items", count=count, reduction="mean")
    trainer(max_epochs=1, callbacks=[callback]).fit(model, DataLoader(batches(), batch_size=None))
    return [p.detach() for p in model.parameters()]


def test_mean_loss_with_causal_lm_tokens_equals_one_big_batch_per_window() -> None:
    expected = reference(batches(), [3, 3, 2, 1])
    got = fit(causal_lm_tokens)
    assert max((a - b).abs().max().item() for a, b in zip(got, expected, strict=True)) <= 1e-12
    # the attention mask counts position 0 of each sequence, which is never predicted
    wrong = fit(lambda batch: batch["attention_mask"].sum())
    gap = max((a - b).abs().max().item() for a, b in zip(wrong, expected, strict=True))
    print(f"counting the attention mask instead: parameters off by {gap:.1e}")
    assert gap > 1e-6
