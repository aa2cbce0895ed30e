"""``Budget``: windows closed by their count (samples or items over all ranks), against a plain float64 loop
that forms the windows from the counts by hand (it shares no code with the package but ``Progress``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from lightning_accum import AccumulationScheduler, Budget, Constant, GradientDecay, Progress, Ramp
from tests.helpers import (
    Batch,
    KRecorder,
    ManualTokenModel,
    TokenData,
    TokenModel,
    count_tokens,
    loader,
    make_net,
    make_optimizer,
    max_diff,
    params_of,
    token_losses,
    trainer,
)


def tokens_of(batch: Batch) -> int:
    return int(batch["mask"].sum())


def reference(
    epochs: list[list[list[Batch]]],
    n: Callable[[Progress], int],
    unit: str = "items",
    normalize: str = "items",
    max_k: int | None = None,
    max_steps: int = -1,
    lr: float = 0.1,
    lr_scaling: str | None = None,
    decay: float | None = None,
) -> tuple[list[torch.Tensor], list[int], list[float]]:
    """Final parameters, each window's micro-batches (per rank) and each window's loss. ``epochs[e][r]``: rank r's
    batches of epoch e. Each window takes micro-batches (one from every rank at a time) until the count over ranks
    reaches the budget read as it opened, ``max_k`` of them, or the epoch's end."""
    net = make_net()
    opt = make_optimizer("sgd", net.parameters(), lr)
    progress, sizes, losses, first_n = Progress(), [], [], None
    residual: list[torch.Tensor] | None = None
    for epoch, ranks in enumerate(epochs):
        i, length = 0, len(ranks[0])
        while i < length and progress.step != max_steps:
            budget = n(dataclasses.replace(progress, epoch=epoch))
            first_n = first_n or budget
            seen, m = 0, 0
            while i + m < length:
                seen += sum(len(r[i + m]["x"]) if unit == "samples" else tokens_of(r[i + m]) for r in ranks)
                m += 1
                if seen >= budget or (max_k is not None and m >= max_k):
                    break
            window = [r[i : i + m] for r in ranks]
            tokens = sum(tokens_of(b) for r in window for b in r)
            samples = sum(len(b["x"]) for r in window for b in r)
            loss = torch.zeros((), dtype=torch.float64)
            for r in window:
                for b in r:
                    total, tok = token_losses(net, b)
                    loss = loss + (total / tokens if normalize == "items" else total / tok / (m * len(ranks)))
            opt.zero_grad()
            loss.backward()
            if decay is not None:
                grads = [p.grad.clone() for p in net.parameters()]
                if residual is not None:
                    for p, res in zip(net.parameters(), residual, strict=True):
                        p.grad = p.grad + decay * res
                residual = [p.grad.clone() for p in net.parameters()]
                del grads
            saved = [g["lr"] for g in opt.param_groups]
            if lr_scaling is not None:
                ratio = (samples if unit == "samples" else tokens) / first_n
                for g in opt.param_groups:
                    g["lr"] *= ratio if lr_scaling == "linear" else math.sqrt(ratio)
            opt.step()
            for g, rate in zip(opt.param_groups, saved, strict=True):
                g["lr"] = rate
            sizes.append(m)
            losses.append(float(loss.detach()))
            progress = Progress(
                epoch=epoch,
                step=progress.step + 1,
                samples=progress.samples + samples,
                items=progress.items + tokens,
                microbatches=progress.microbatches + m,
            )
            i += m
    return [p.detach().clone() for p in net.parameters()], sizes, losses


DATA = TokenData(44, seed=3)
BATCH = 4


def epochs_of(count: int, batches: int | None = None) -> list[list[list[Batch]]]:
    index = list(range(len(DATA)))
    one = [DATA.batch(index[i : i + BATCH]) for i in range(0, len(index), BATCH)][:batches]
    return [[one] for _ in range(count)]


def fit_callback(budget: Budget, normalize: str = "items", **kwargs: Any) -> tuple[TokenModel, KRecorder, Any]:
    fit_kwargs = {k: kwargs.pop(k) for k in ("max_steps", "limit_train_batches", "max_epochs") if k in kwargs}
    model = TokenModel(reduction="sum" if normalize == "items" else "mean")
    recorder = KRecorder()
    extra = dict(count=count_tokens, reduction="sum") if normalize == "items" else dict(count=count_tokens)
    callback = AccumulationScheduler(budget, normalize=normalize, **extra, **kwargs)  # type: ignore[arg-type]
    trainer(callbacks=[callback, recorder], **fit_kwargs).fit(model, loader(DATA, BATCH))
    return model, recorder, callback


@pytest.mark.parametrize(
    ("n", "unit", "normalize", "max_k"),
    [(20, "items", "items", None), (9, "samples", "mean", None), (40, "items", "items", 3), (1, "items", "items", None)],
)
def test_callback_windows_equal_the_reference(n: int, unit: str, normalize: str, max_k: int | None) -> None:
    model, recorder, callback = fit_callback(Budget(n, unit=unit, max_k=max_k), normalize)  # type: ignore[arg-type]
    expected, sizes, _ = reference(epochs_of(2), lambda p: n, unit, normalize, max_k)
    assert recorder.windows == sizes
    assert max_diff(params_of(model), expected) < 1e-12
    assert callback.progress.step == len(sizes)
