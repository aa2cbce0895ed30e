"""Hugging Face models: a ``transformers`` GPT-2 built from a config (float64), its mean
``outputs.loss`` taken by the callback with ``reduction="mean"`` and ``causal_lm_tokens``, against
one big batch's token-mean loss; counting the attention mask instead trains another objective.
Skipped where ``transformers`` is not installed (``.ci/run`` installs it)."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_accum import AccumulationMixin, AccumulationScheduler, Piecewise
from lightning_accum.count import causal_lm_tokens

from helpers import trainer

transformers = pytest.importorskip("transformers")

SCHEDULE = Piecewise({0: 3, 2: 2}, unit="step")  # 3, 3, then 2s; 9 batches: 3, 3, 2, 1


def gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=50, n_positions=32, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
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
    """``loss="hf"``: the model's ``outputs.loss`` (a token mean, computed in float32 by
    ``transformers``); ``"mean"``/``"sum"``: the same loss by hand in float64."""

    def __init__(self, loss: str = "hf") -> None:
        super().__init__()
        self.model, self.loss = gpt2(), loss

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        if self.loss == "hf":
            return self.model(**batch).loss
        total = token_sum(self.model, batch)
        return total / causal_lm_tokens(batch) if self.loss == "mean" else total

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


def fit(count: Any, loss: str = "hf") -> list[Tensor]:
    model = LM(loss)
    reduction = "sum" if loss == "sum" else "mean"
    callback = AccumulationScheduler(SCHEDULE, normalize="items", count=count, reduction=reduction)
    trainer(max_epochs=1, callbacks=[callback]).fit(model, DataLoader(batches(), batch_size=None))
    return [p.detach() for p in model.parameters()]


def gap(got: list[Tensor], expected: list[Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize("loss", ["mean", "sum"])
def test_token_weighted_windows_equal_one_big_batch_per_window(loss: str) -> None:
    """A float64 token mean per micro-batch, weighted by ``causal_lm_tokens``: exact."""
    assert gap(fit(causal_lm_tokens, loss), reference(batches(), [3, 3, 2, 1])) <= 1e-12


def test_hf_loss_with_causal_lm_tokens_and_the_attention_mask_trap() -> None:
    """``outputs.loss`` as it comes (float32 inside ``transformers``): float32 rounding from the
    reference; counting the attention mask (position 0 is never predicted) is far off."""
    expected = reference(batches(), [3, 3, 2, 1])
    assert gap(fit(causal_lm_tokens), expected) <= 1e-7
    wrong = gap(fit(lambda batch: batch["attention_mask"].sum()), expected)
    print(f"counting the attention mask instead: parameters off by {wrong:.1e}")
    assert wrong > 1e-3


class MixinLM(AccumulationMixin, pl.LightningModule):
    """``by="items"``: the count given to each pass; ``"reduction"``: ``reduction="mean"`` with ``count``."""

    def __init__(self, by: str = "items") -> None:
        super().__init__()
        self.model = gpt2()
        self.by = by
        if by == "items":
            self.configure_accumulation(SCHEDULE, normalize="items")
        else:
            self.configure_accumulation(SCHEDULE, normalize="items", count=causal_lm_tokens, reduction="mean")

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        with self.accumulate(batch) as acc:
            if self.by == "items":
                acc.backward(self.model(**batch).loss, items=causal_lm_tokens(batch))
            else:
                acc.backward(self.model(**batch).loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


@pytest.mark.parametrize("by", ["items", "reduction"])
def test_mixin_takes_the_hf_mean_loss_with_its_count(by: str) -> None:
    model = MixinLM(by)
    trainer(max_epochs=1).fit(model, DataLoader(batches(), batch_size=None))
    assert gap([p.detach() for p in model.parameters()], reference(batches(), [3, 3, 2, 1])) <= 1e-7


def test_a_micro_batch_without_tokens_adds_nothing() -> None:
    """``transformers`` returns ``nan`` for a mean over no tokens: weighted by 0, it adds nothing
    to the window's gradient or to its logged loss (callback and mixin)."""
    data = batches()
    data[4] = {**data[4], "labels": torch.full_like(data[4]["labels"], -100)}
    kept = data[:4] + data[5:]  # the reference: window 2 of 3 batches holds only 2 with tokens

    losses: list[float] = []

    class Losses(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if "accum/loss" in trainer.callback_metrics:
                losses.append(float(trainer.callback_metrics["accum/loss"]))

    model = LM()
    callback = AccumulationScheduler(SCHEDULE, normalize="items", count=causal_lm_tokens, reduction="mean")
    trainer(max_epochs=1, callbacks=[callback, Losses()], log_every_n_steps=1).fit(
        model, DataLoader(data, batch_size=None)
    )
    expected = reference(kept, [3, 2, 2, 1])
    assert gap([p.detach() for p in model.parameters()], expected) <= 1e-7
    assert losses and all(math.isfinite(x) for x in losses)
    mixin = MixinLM()
    trainer(max_epochs=1).fit(mixin, DataLoader(data, batch_size=None))
    assert gap([p.detach() for p in mixin.parameters()], expected) <= 1e-7
