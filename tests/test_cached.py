"""Cached backward (GradCache): the gradient of a loss that couples the whole batch, one chunk's
graph at a time, against the whole batch's backward in float64; then through the mixin, in
windows of k cached batches, against a plain PyTorch loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_accum import AccumulationMixin, Piecewise, Schedule
from lightning_accum.cached import backward_cached
from lightning_accum.multitask import measure_graph_memory

from helpers import trainer

DIM, REP = 6, 4


def tower(dropout: float = 0.0, norm: bool = False, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(DIM, 8)]
    layers += [nn.BatchNorm1d(8)] if norm else []
    layers += [nn.Tanh(), nn.Dropout(dropout), nn.Linear(8, REP)]
    return nn.Sequential(*layers).double()


def info_nce(q: Tensor, d: Tensor, temperature: Tensor | float = 0.5) -> Tensor:
    """In-batch negatives: query i's positive is document i, every other document is a negative."""
    q, d = nn.functional.normalize(q, dim=1), nn.functional.normalize(d, dim=1)
    logits = q @ d.T / temperature
    return nn.functional.cross_entropy(logits, torch.arange(len(q), device=q.device))


def data(n: int, seed: int = 1) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, DIM, generator=g, dtype=torch.float64)
    return q, q + 0.3 * torch.randn(n, DIM, generator=g, dtype=torch.float64)


def chunked(encoder: Callable[[Any], Any], x: Any, size: int) -> Any:
    """The reference forward: the encoder on the same chunks in the same order, with a graph."""
    from lightning_accum.microbatch import split

    outs = [encoder(part) for part in split(x, size)]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(column) for column in zip(*outs, strict=True))
    return torch.cat(outs)


def grads(*modules: nn.Module) -> list[Tensor]:
    return [p.grad.clone() for m in modules for p in m.parameters() if p.grad is not None]  # type: ignore[union-attr]


def plain_backward(loss: Tensor) -> None:
    loss.backward()


def reps_backward(reps: Any, grad: Any) -> None:
    torch.autograd.backward(reps, grad)


@pytest.mark.parametrize("chunk", [1, 5, 24])
@pytest.mark.parametrize("towers", ["shared", "two"])
def test_equals_the_whole_batch_backward_with_dropout(chunk: int, towers: str) -> None:
    q_net = tower(dropout=0.3)
    d_net = q_net if towers == "shared" else tower(dropout=0.3, seed=1)
    q, d = data(24)
    torch.manual_seed(7)
    loss = info_nce(chunked(q_net, q, chunk), chunked(d_net, d, chunk))
    loss.backward()
    expected, rng_after = grads(q_net, d_net) if towers == "two" else grads(q_net), torch.get_rng_state()
    for net in {q_net, d_net}:
        net.zero_grad()
    torch.manual_seed(7)
    got_loss = backward_cached([q_net, d_net], [q, d], info_nce, chunk, plain_backward, reps_backward)
    got = grads(q_net, d_net) if towers == "two" else grads(q_net)
    assert got_loss == loss.detach()
    assert max((a - b).abs().max().item() for a, b in zip(got, expected, strict=True)) <= 1e-13
    assert torch.equal(torch.get_rng_state(), rng_after)  # training continues as after the whole batch's forward


def test_dict_inputs_tuple_reps_and_a_learned_temperature() -> None:
    net = tower(dropout=0.2)
    head = nn.Linear(REP, 2).double()
    temperature = nn.Parameter(torch.tensor(0.7, dtype=torch.float64))

    def encode(batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        r = net(batch["x"] * batch["w"][:, None])
        return r, head(r)

    def loss_fn(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor]) -> Tensor:
        return info_nce(a[0], b[0], temperature) + 0.1 * info_nce(a[1], b[1])

    q, d = data(12)
    w = torch.rand(12, dtype=torch.float64)
    inputs = [{"x": q, "w": w}, {"x": d, "w": w}]
    torch.manual_seed(3)
    loss_fn(chunked(encode, inputs[0], 5), chunked(encode, inputs[1], 5)).backward()
    expected = [*grads(net, head), temperature.grad.clone()]  # type: ignore[union-attr]
    net.zero_grad(), head.zero_grad(), temperature.grad.zero_()  # type: ignore[func-returns-value,union-attr]
    torch.manual_seed(3)
    backward_cached([encode, encode], inputs, loss_fn, 5, plain_backward, reps_backward)
    got = [*grads(net, head), temperature.grad]
    assert max((a - b).abs().max().item() for a, b in zip(got, expected, strict=True)) <= 1e-13  # type: ignore[operator]


def test_plain_accumulation_of_the_same_loss_is_not_equal() -> None:
    """Each chunk's loss with only its own negatives trains another objective: the test can fail."""
    net = tower()
    q, d = data(24)
    info_nce(net(q), net(d)).backward()
    whole = grads(net)
    net.zero_grad()
    for part in range(0, 24, 6):
        (info_nce(net(q[part : part + 6]), net(d[part : part + 6])) / 4).backward()
    plain = grads(net)
    gap = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(plain, whole, strict=True))
    assert gap > 0.05


def test_batch_norm_statistics_move_once_per_sample() -> None:
    net = tower(norm=True)
    q, d = data(16)
    reference = tower(norm=True)
    chunked(reference, q, 4), chunked(reference, d, 4)  # one forward of each chunk, with a graph
    backward_cached([net, net], [q, d], info_nce, 4, plain_backward, reps_backward, modules=[net])
    for got, want in zip(net.buffers(), reference.buffers(), strict=True):
        assert torch.equal(got, want)


def test_graph_memory_is_one_chunk() -> None:
    net = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)], nn.Linear(64, REP))
    x = torch.randn(256, 64)
    with measure_graph_memory(exclude=net.parameters()) as whole:
        info_nce(net(x), net(x + 0.1)).backward()
    with measure_graph_memory(exclude=net.parameters()) as cached:
        backward_cached([net, net], [x, x + 0.1], info_nce, 32, plain_backward, reps_backward)
    ratio = cached.peak / whole.peak
    print(f"graph memory, cached (chunks of 32) / whole batch of 256: {ratio:.3f}")
    assert ratio < 2 * 32 / 256


# ---------------------------------------------------------------------- through the mixin


class Pairs(Dataset[dict[str, Tensor]]):
    def __init__(self, n: int) -> None:
        self.q, self.d = data(n, seed=2)

    def __len__(self) -> int:
        return len(self.q)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"q": self.q[i], "d": self.d[i]}


class TwoTower(AccumulationMixin, pl.LightningModule):
    def __init__(self, schedule: Schedule | int, chunk: int | None, dropout: float = 0.0, **kwargs: Any) -> None:
        super().__init__()
        self.q_net, self.d_net = tower(dropout), tower(dropout, seed=1)
        self.chunk = chunk
        self.configure_accumulation(schedule, **kwargs)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        with self.accumulate(batch) as acc:
            if self.chunk is None:  # the whole batch's backward (same chunked forward, for dropout)
                acc.backward(info_nce(chunked(self.q_net, batch["q"], 3), chunked(self.d_net, batch["d"], 3)))
            else:
                acc.backward_cached([self.q_net, self.d_net], [batch["q"], batch["d"]], info_nce, chunk_size=self.chunk)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def reference(schedule: list[int], batches: list[dict[str, Tensor]]) -> list[Tensor]:
    """Plain loop: each window's gradient is the mean of its batches' whole-batch loss gradients."""
    q_net, d_net = tower(), tower(seed=1)
    opt = torch.optim.SGD([*q_net.parameters(), *d_net.parameters()], lr=0.5)
    i = 0
    for k in schedule:
        for batch in batches[i : i + k]:
            (info_nce(q_net(batch["q"]), d_net(batch["d"])) / k).backward()
        opt.step()
        opt.zero_grad()
        i += k
    return [p.detach() for p in [*q_net.parameters(), *d_net.parameters()]]


def test_mixin_windows_of_cached_batches_match_a_plain_loop() -> None:
    schedule = Piecewise({0: 2, 2: 3}, unit="step")  # windows 2, 2, 3, 3, then a short one of 1 (11 batches)
    model = TwoTower(schedule, chunk=3)
    trainer(max_epochs=1).fit(model, DataLoader(Pairs(88), batch_size=8))
    batches = [{"q": b["q"], "d": b["d"]} for b in DataLoader(Pairs(88), batch_size=8)]
    expected = reference([2, 2, 3, 3, 1], batches)
    got = [p.detach() for p in model.parameters()]
    assert max((a - b).abs().max().item() for a, b in zip(got, expected, strict=True)) <= 1e-12


def test_mixin_with_dropout_equals_the_whole_batch_backward() -> None:
    runs = []
    for chunk in (None, 3):
        torch.manual_seed(0)
        model = TwoTower(2, chunk=chunk, dropout=0.25)
        trainer(max_epochs=2).fit(model, DataLoader(Pairs(48), batch_size=6))
        runs.append([p.detach() for p in model.parameters()])
    assert max((a - b).abs().max().item() for a, b in zip(*runs, strict=True)) <= 1e-12


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_mixed_precision_matches_the_whole_batch_backward(precision: str) -> None:
    runs = []
    for chunk in (None, 3):
        model = TwoTower(2, chunk=chunk).float()
        if precision == "16-mixed":
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10**6)
            kwargs: dict[str, Any] = dict(precision=None, plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
        else:
            kwargs = dict(precision="bf16-mixed")
        data32 = Pairs(48)
        data32.q, data32.d = data32.q.float(), data32.d.float()
        trainer(max_epochs=1, **kwargs).fit(model, DataLoader(data32, batch_size=6))
        runs.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    start = torch.cat([p.detach().flatten() for p in TwoTower(2, chunk=3).float().parameters()])
    moved = (runs[0] - start).norm()
    gap = ((runs[1] - runs[0]).norm() / moved).item()
    print(f"{precision}: cached vs whole-batch parameters, relative to the distance moved: {gap:.2e}")
    assert moved > 0 and gap < 2e-2


class Refused(TwoTower):
    def __init__(self, call: Callable[[Any, dict[str, Tensor]], Any]) -> None:
        super().__init__(2, chunk=3)
        self.call = call

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        with self.accumulate(batch) as acc:
            self.call(acc, batch)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda m, acc, b: acc.backward_cached([m.q_net], [b["q"]], info_nce, chunk_size=0), "`chunk_size`"),
        (lambda m, acc, b: acc.backward_cached([m.q_net], [b["q"]], info_nce, chunk_size=2.0), "`chunk_size`"),
        (lambda m, acc, b: acc.backward_cached([m.q_net], [b["q"], b["d"]], info_nce, chunk_size=2), "per input"),
        (
            lambda m, acc, b: acc.backward_cached([m.q_net] * 2, [b["q"], b["d"][:2]], info_nce, chunk_size=2),
            "differ in size",
        ),
        (
            lambda m, acc, b: acc.backward_cached(
                [m.q_net] * 2, [b["q"], b["d"]], lambda q, d: (q * d).sum(1), chunk_size=2
            ),
            "scalar",
        ),
        (
            lambda m, acc, b: acc.backward_cached(
                [lambda x: [m.q_net(x)], m.d_net], [b["q"], b["d"]], info_nce, chunk_size=2
            ),
            "tensor or a tuple of tensors",
        ),
    ],
)
def test_refusals_name_the_argument(call: Any, match: str) -> None:
    model = Refused(lambda acc, batch: call(model, acc, batch))
    with pytest.raises(ValueError, match=match):
        trainer(max_epochs=1).fit(model, DataLoader(Pairs(12), batch_size=6))
