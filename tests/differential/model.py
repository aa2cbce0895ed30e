"""The fuzzer's data and model, shared by the reference and the package runner (plain torch)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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


class TokenNorm(nn.Module):
    """``BatchNorm1d`` over the features of every token (a micro-batch's statistics over its samples and tokens)."""

    def __init__(self, width: int, momentum: float | None) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(width, momentum=momentum)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.norm(x.transpose(1, 2)).transpose(1, 2)
        return out


def make_net(seed: int, c: Config | None = None) -> nn.Sequential:
    """The fuzzer's net; with ``c.batchnorm`` drawn, a BatchNorm layer after the first (``c.bn_momentum``: a float,
    or ``None`` for the cumulative average). ``net[0]`` and ``net[2]`` are the two linear layers either way."""
    torch.manual_seed(seed)
    if c is None or c.batchnorm is None:
        return nn.Sequential(nn.Linear(D, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    middle = nn.Sequential(TokenNorm(4, c.bn_momentum), nn.Tanh())  # (no bias before it: BatchNorm removes it, its
    # gradient would be rounding noise, which Adam turns into steps of a full learning rate)
    return nn.Sequential(nn.Linear(D, 4, bias=False), middle, nn.Linear(4, 1)).double()


def forward(net: nn.Module, x: Tensor, piece: int | None = None) -> Tensor:
    """``net(x)``, or with ``piece`` one forward per slice of ``piece`` samples (as the package cuts a batch in
    pieces: with a BatchNorm layer each is normalised by its own statistics)."""
    if piece is None:
        out: Tensor = net(x)
        return out
    return torch.cat([net(x[i : i + piece]) for i in range(0, len(x), piece)])


@contextlib.contextmanager
def evaluating(net: nn.Module) -> Iterator[None]:
    """The net in eval mode (a probe: BatchNorm normalises by its running statistics and leaves them be)."""
    was = net.training
    net.eval()
    try:
        yield
    finally:
        net.train(was)


def errors(out: Tensor, batch: dict[str, Tensor]) -> Tensor:
    """Masked squared error per token."""
    return (out - batch["y"]).squeeze(-1) ** 2 * batch["mask"]


def micro_loss(
    net: nn.Module, batch: dict[str, Tensor], guide: nn.Module | None = None, piece: int | None = None
) -> tuple[Tensor, float, int]:
    """(sum of masked squared errors, each times the guide's weight where there is one, number of items,
    number of token positions); ``piece``: the net run on slices of that many samples (``forward``)."""
    err = errors(forward(net, batch["x"], piece), batch)
    if guide is not None:
        err = err * guide_weights(guide(batch["x"]))
    return err.sum(), float(batch["mask"].sum()), batch["x"].shape[0] * T


def guide_weights(out: Tensor) -> Tensor:
    """A guide tower's output as a weight per token, in (0, 1), without a gradient."""
    return torch.sigmoid(out.detach()).squeeze(-1)


def count_tokens(batch: dict[str, Tensor]) -> Tensor:
    return batch["mask"].sum()


def dtype_of(net: nn.Module) -> torch.dtype:
    """The net's parameters' dtype (float64, or bf16 under ``precision="bf16-true"``)."""
    return next(net.parameters()).dtype


def probe_loss(net: nn.Module, data: Data) -> float:
    """What the monitors watch at each epoch's end: the unmasked error on the first samples, in the net's dtype,
    rounded to float32 (as Lightning may store a logged value); in eval mode (a BatchNorm layer's statistics left as
    they are)."""
    dtype = dtype_of(net)
    with torch.no_grad(), evaluating(net):
        value = ((net(data.x[:4].to(dtype)) - data.y[:4].to(dtype)) ** 2).mean()
    return float(value.float())


def batch_probe(net: nn.Module, batch: dict[str, Tensor]) -> float:
    """What a step-interval plateau watches: the batch's unmasked error at the weights after its step, logged in
    ``on_train_batch_end``, in the net's dtype (the batch as the precision converted it), rounded to float32."""
    dtype = dtype_of(net)
    with torch.no_grad(), evaluating(net):
        value = ((net(batch["x"].to(dtype)) - batch["y"].to(dtype)) ** 2).mean()
    return float(value.float())
