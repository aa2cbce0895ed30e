"""The fuzzer's data and model, shared by the reference and the package runner (plain torch)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .configs import Config

T, D = 4, 3  # tokens per sample, features per token


class Data(torch.utils.data.Dataset[dict[str, Tensor]]):
    """Sequences of ``T`` tokens with per-token targets and a mask of 1 to ``T`` real tokens; the
    samples of ``config.empty_batches`` hold none."""

    def __init__(self, c: Config) -> None:
        g = torch.Generator().manual_seed(c.seed)
        self.x = torch.randn(c.n, T, D, generator=g, dtype=torch.float64)
        self.y = torch.randn(c.n, T, 1, generator=g, dtype=torch.float64)
        lengths = torch.randint(1, T + 1, (c.n,), generator=g)
        self.mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)
        for b in c.empty_batches:
            self.mask[b * c.batch_size : (b + 1) * c.batch_size] = 0.0
        self.batch_size = c.batch_size

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"x": self.x[i], "y": self.y[i], "mask": self.mask[i]}

    def batch(self, j: int) -> dict[str, Tensor]:
        s = slice(j * self.batch_size, (j + 1) * self.batch_size)
        return {"x": self.x[s], "y": self.y[s], "mask": self.mask[s]}


def make_net(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def errors(out: Tensor, batch: dict[str, Tensor]) -> Tensor:
    """Masked squared error per token."""
    return (out - batch["y"]).squeeze(-1) ** 2 * batch["mask"]


def micro_loss(net: nn.Module, batch: dict[str, Tensor], guide: nn.Module | None = None) -> tuple[Tensor, float, int]:
    """(sum of masked squared errors, each times the guide's weight where there is one, number of items,
    number of token positions)."""
    err = errors(net(batch["x"]), batch)
    if guide is not None:
        err = err * guide_weights(guide(batch["x"]))
    return err.sum(), float(batch["mask"].sum()), batch["x"].shape[0] * T


def guide_weights(out: Tensor) -> Tensor:
    """A guide tower's output as a weight per token, in (0, 1), without a gradient."""
    return torch.sigmoid(out.detach()).squeeze(-1)


def count_tokens(batch: dict[str, Tensor]) -> Tensor:
    return batch["mask"].sum()


def probe_loss(net: nn.Module, data: Data) -> float:
    """What the monitors watch at each epoch's end: the unmasked error on the first samples, rounded to
    float32 (as Lightning may store a logged value)."""
    with torch.no_grad():
        value = ((net(data.x[:4]) - data.y[:4]) ** 2).mean()
    return float(value.float())


def batch_probe(net: nn.Module, batch: dict[str, Tensor]) -> float:
    """What a step-interval plateau watches: the batch's unmasked error at the weights after its step, logged in
    ``on_train_batch_end`` (rounded to float32, as ``probe_loss``)."""
    with torch.no_grad():
        value = ((net(batch["x"]) - batch["y"]) ** 2).mean()
    return float(value.float())
