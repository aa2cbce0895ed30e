"""Cached backward (GradCache): the gradient of a loss that couples the whole batch, one chunk's
graph at a time, against the whole batch's backward in float64; then through the mixin, in
windows of k cached batches, against a plain PyTorch loop."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_accum import AccumulationMixin, Piecewise, Schedule
from lightning_accum._core import cached as _cached
from lightning_accum._core.cached import backward_cached
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
    from lightning_accum._core.microbatch import split

    outs = [encoder(**part) if isinstance(part, dict) else encoder(part) for part in split(x, size)]
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

    def encode(x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:  # (a dict input comes as keyword arguments)
        r = net(x * w[:, None])
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
            lambda m, acc, b: acc.backward_cached([m.q_net] * 2, [b["q"], b["d"]], info_nce, chunk_size=[2, 2, 2]),
            "`chunk_size` has 3 entries for 2 encoders",
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


# ---------------------------------------------------------------------------- retrieval as it is run
NEGATIVES = 2  # hard negatives per query: the passage tower holds B x (1 + n) samples


def info_nce_hard(q: Tensor, d: Tensor) -> Tensor:
    """Query i's positive is passage i * (1 + n); its n hard negatives follow it, and every other
    query's passages are negatives too (DPR's loss)."""
    q, d = nn.functional.normalize(q, dim=1), nn.functional.normalize(d, dim=1)
    group = len(d) // len(q)
    return nn.functional.cross_entropy(q @ d.T / 0.5, torch.arange(len(q), device=q.device) * group)


@pytest.mark.parametrize("chunk", [4, [2, 5], [6, 18]])
def test_towers_of_different_sizes_with_dropout(chunk: int | list[int]) -> None:
    q_net, d_net = tower(dropout=0.3), tower(dropout=0.3, seed=1)
    q, _ = data(6)
    d, _ = data(6 * (1 + NEGATIVES), seed=2)
    sizes = chunk if isinstance(chunk, list) else [chunk, chunk]
    torch.manual_seed(5)
    loss = info_nce_hard(chunked(q_net, q, sizes[0]), chunked(d_net, d, sizes[1]))
    loss.backward()
    expected, rng_after = grads(q_net, d_net), torch.get_rng_state()
    q_net.zero_grad(), d_net.zero_grad()  # type: ignore[func-returns-value]
    torch.manual_seed(5)
    got_loss = backward_cached([q_net, d_net], [q, d], info_nce_hard, chunk, plain_backward, reps_backward)
    assert got_loss == loss.detach()
    assert max((a - b).abs().max().item() for a, b in zip(grads(q_net, d_net), expected, strict=True)) <= 1e-13
    assert torch.equal(torch.get_rng_state(), rng_after)


class Output:
    """An encoder's output object (as a transformers ``BaseModelOutput``)."""

    def __init__(self, hidden: Tensor) -> None:
        self.last_hidden_state = hidden


def test_keyword_inputs_and_get_rep() -> None:
    """A Mapping input goes in as keyword arguments; ``get_rep`` picks the representation (the
    first token's state) from the output object."""
    net = tower(dropout=0.2)

    def encoder(input_ids: Tensor, attention_mask: Tensor) -> Output:
        return Output(net(input_ids) * attention_mask[..., None])  # (batch, tokens, REP)

    def first_token(out: Output) -> Tensor:
        return out.last_hidden_state[:, 0]

    g = torch.Generator().manual_seed(4)
    ids = torch.randn(15, 3, DIM, generator=g, dtype=torch.float64)  # (token "ids" as vectors: a toy embedding)
    queries = {"input_ids": ids[:5], "attention_mask": torch.ones(5, 3)}
    passages = {"input_ids": ids[5:], "attention_mask": torch.ones(10, 3)}

    def encode(**batch: Tensor) -> Tensor:
        return first_token(encoder(**batch))

    torch.manual_seed(9)
    info_nce_hard(chunked(encode, queries, 2), chunked(encode, passages, 3)).backward()
    expected = grads(net)
    net.zero_grad()
    torch.manual_seed(9)
    backward_cached(
        [encoder, encoder], [queries, passages], info_nce_hard, [2, 3], plain_backward, reps_backward,
        get_rep=first_token,
    )  # fmt: skip
    assert max((a - b).abs().max().item() for a, b in zip(grads(net), expected, strict=True)) <= 1e-13
    with pytest.raises(ValueError, match="give `get_rep=`"):
        backward_cached([encoder], [queries], lambda r: r.sum(), 2, plain_backward, reps_backward)


def test_a_transformers_encoder_drops_in() -> None:
    """A ``BertModel`` from a config (no download), its tokenizer's ``BatchEncoding``-like dict as
    input, the CLS vector as the representation, attention and hidden dropout on."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    bert = transformers.BertModel(config).double().train()
    g = torch.Generator().manual_seed(1)
    queries = transformers.BatchEncoding(
        {"input_ids": torch.randint(0, 50, (4, 6), generator=g), "attention_mask": torch.ones(4, 6, dtype=torch.long)}
    )
    mask = torch.ones(12, 8, dtype=torch.long)
    mask[::3, 5:] = 0  # padded passages
    passages = {"input_ids": torch.randint(0, 50, (12, 8), generator=g), "attention_mask": mask}

    def cls(out: Any) -> Tensor:
        return out.last_hidden_state[:, 0]

    torch.manual_seed(2)

    def encode(**batch: Tensor) -> Tensor:
        return cls(bert(**batch))

    info_nce_hard(chunked(encode, dict(queries), 3), chunked(encode, passages, 5)).backward()
    expected = grads(bert)
    bert.zero_grad()
    torch.manual_seed(2)
    inputs = [queries, passages]
    backward_cached([bert, bert], inputs, info_nce_hard, [3, 5], plain_backward, reps_backward, get_rep=cls)
    assert max((a - b).abs().max().item() for a, b in zip(grads(bert), expected, strict=True)) <= 1e-12


def test_the_rng_ends_where_the_whole_batch_forward_and_loss_leave_it() -> None:
    """A loss that draws random numbers (noise on the logits): after the call the generator stands
    past the loss's draws, so the next random numbers are new ones, as after the whole batch."""
    net = tower(dropout=0.3)
    q, d = data(8)

    def noisy(q: Tensor, d: Tensor) -> Tensor:
        return info_nce(q + 0.01 * torch.randn_like(q), d)

    torch.manual_seed(11)
    noisy(chunked(net, q, 3), chunked(net, d, 3)).backward()
    expected, after = grads(net), torch.get_rng_state()
    net.zero_grad()
    torch.manual_seed(11)
    backward_cached([net, net], [q, d], noisy, 3, plain_backward, reps_backward)
    assert max((a - b).abs().max().item() for a, b in zip(grads(net), expected, strict=True)) <= 1e-13
    assert torch.equal(torch.get_rng_state(), after)


class Tally(nn.Module):
    """A module whose forward writes buffers in training mode, in place and by reassignment (a
    running count and mean of its inputs), beside a linear map."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, REP).double()
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("mean", torch.zeros(DIM, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            n = self.seen + len(x)
            self.mean = self.mean + (x.detach().sum(0) - len(x) * self.mean) / n  # reassigned
            self.seen += len(x)  # in place
        return self.linear(x)


def test_buffers_a_forward_writes_move_once_per_sample() -> None:
    net, reference = Tally(), Tally()
    reference.load_state_dict(net.state_dict())
    q, d = data(10)
    info_nce(chunked(reference, q, 4), chunked(reference, d, 4)).backward()
    backward_cached([net, net], [q, d], info_nce, 4, plain_backward, reps_backward, modules=[net])
    assert int(net.seen) == int(reference.seen) == 20
    assert torch.equal(net.mean, reference.mean)
    assert max((a - b).abs().max().item() for a, b in zip(grads(net), grads(reference), strict=True)) <= 1e-13


def test_spectral_norm_is_iterated_once_per_forward() -> None:
    """``spectral_norm`` runs a power iteration in each training forward: with the graph-free pass's
    undone, one chunk of the whole batch equals the whole batch's forward exactly (it was 2.3e-6 off)."""
    torch.manual_seed(0)
    net = nn.utils.parametrizations.spectral_norm(nn.Linear(DIM, REP).double())
    reference = nn.utils.parametrizations.spectral_norm(nn.Linear(DIM, REP).double())
    reference.load_state_dict(net.state_dict())
    q, d = data(12)
    whole = torch.cat([q, d])
    out = reference(whole)
    info_nce(out[:12], out[12:]).backward()
    backward_cached(
        [net], [whole], lambda r: info_nce(r[:12], r[12:]), 24, plain_backward, reps_backward, modules=[net]
    )
    assert max((a - b).abs().max().item() for a, b in zip(grads(net), grads(reference), strict=True)) <= 1e-13
    assert all(torch.equal(a, b) for a, b in zip(net.buffers(), reference.buffers(), strict=True))


def test_the_first_pass_outputs_are_released_before_the_loss_backward() -> None:
    """What the graph-free pass returned is dead by the time the loss runs (one copy of the
    representations, the loss's leaves, is kept), and the leaves are dead in the second pass."""
    import weakref

    net = tower()
    first_pass: list[weakref.ref[Tensor]] = []
    leaves: list[weakref.ref[Tensor]] = []

    def encoder(x: Tensor) -> Tensor:
        out = net(x)
        if not torch.is_grad_enabled():
            first_pass.append(weakref.ref(out))
        else:
            assert all(ref() is None for ref in leaves), "the loss's leaves are alive in the second pass"
        return out

    def loss_fn(q: Tensor, d: Tensor) -> Tensor:
        assert first_pass and all(ref() is None for ref in first_pass), "the first pass's outputs are alive"
        leaves.extend([weakref.ref(q), weakref.ref(d)])
        return info_nce(q, d)

    q, d = data(12)
    backward_cached([encoder, encoder], [q, d], loss_fn, 5, plain_backward, reps_backward)


# ------------------------------------------------------------------- the loss stage in blocks of rows
def info_nce_rows(q: Tensor, d: Tensor, rows: slice | None = None, temperature: Tensor | float = 0.5) -> Tensor:
    """``info_nce_hard``'s part from the query rows ``rows`` (all of them without): the parts sum to it."""
    rows = slice(0, len(q)) if rows is None else rows
    qn, dn = nn.functional.normalize(q[rows], dim=1), nn.functional.normalize(d, dim=1)
    labels = torch.arange(rows.start, rows.stop, device=q.device) * (len(d) // len(q))
    return nn.functional.cross_entropy(qn @ dn.T / temperature, labels, reduction="sum") / len(q)


@pytest.mark.parametrize("block", [1, 4, 6, 50])
def test_the_loss_in_blocks_equals_the_whole_loss_with_dropout(block: int) -> None:
    """Towers of different sizes, dropout on, a learned temperature: the blocks' parts, each
    back-propagated before the next, give the whole batch's gradient and loss."""
    q_net, d_net = tower(dropout=0.3), tower(dropout=0.3, seed=1)
    temperature = nn.Parameter(torch.tensor(0.6, dtype=torch.float64))
    q, _ = data(14)
    d, _ = data(14 * (1 + NEGATIVES), seed=2)
    torch.manual_seed(5)
    loss = info_nce_rows(chunked(q_net, q, 4), chunked(d_net, d, 9), temperature=temperature)
    loss.backward()
    expected, rng_after = [*grads(q_net, d_net), temperature.grad.clone()], torch.get_rng_state()  # type: ignore[union-attr]
    q_net.zero_grad(), d_net.zero_grad(), temperature.grad.zero_()  # type: ignore[func-returns-value,union-attr]
    seen: list[tuple[int, int, tuple[int, ...]]] = []

    def loss_fn(q: Tensor, d: Tensor, rows: slice) -> Tensor:
        seen.append((rows.start, rows.stop, tuple((q[rows] @ d.T).shape)))
        return info_nce_rows(q, d, rows, temperature)

    torch.manual_seed(5)
    got_loss = backward_cached(
        [q_net, d_net], [q, d], loss_fn, [4, 9], plain_backward, reps_backward, loss_chunk_size=block
    )
    got = [*grads(q_net, d_net), temperature.grad]
    assert max((a - b).abs().max().item() for a, b in zip(got, expected, strict=True)) <= 1e-12  # type: ignore[operator]
    assert abs(got_loss.item() - loss.item()) <= 1e-14
    assert torch.equal(torch.get_rng_state(), rng_after)
    starts = list(range(0, 14, block))
    assert seen == [(s, min(s + block, 14), (min(s + block, 14) - s, 42)) for s in starts]  # (m x B(1 + n) at a time)


def test_the_loss_graph_is_one_block() -> None:
    """The score matrix and its graph: one block of rows alive, not the whole B x B."""
    net = nn.Identity()
    q, d = torch.randn(512, 4, dtype=torch.float64), torch.randn(512, 4, dtype=torch.float64)
    peaks = {}
    for block in (None, 32):
        with measure_graph_memory() as memory:
            backward_cached([net, net], [q, d], info_nce_rows, 512, plain_backward, lambda r, g: None,
                            loss_chunk_size=block)  # fmt: skip
        peaks[block] = memory.peak
    ratio = peaks[32] / peaks[None]
    print(f"loss graph memory, blocks of 32 rows / the whole 512 x 512: {ratio:.3f}")
    assert ratio < 2 * 32 / 512


def test_a_loss_without_rows_is_refused_before_anything_runs() -> None:
    net = tower(dropout=0.3)
    q, d = data(6)
    calls: list[int] = []

    def encoder(x: Tensor) -> Tensor:
        calls.append(1)
        return net(x)

    state = torch.get_rng_state()
    with pytest.raises(TypeError, match=r"`loss_chunk_size` calls `loss_fn\(\*reps, rows=slice\(i, i \+ m\)\)`"):
        backward_cached([encoder, encoder], [q, d], info_nce, 2, plain_backward, reps_backward, loss_chunk_size=2)
    assert not calls and torch.equal(torch.get_rng_state(), state) and all(p.grad is None for p in net.parameters())


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(loss_chunk_size=0), ValueError, r"`loss_chunk_size` must be an int >= 1 \(rows of the first input"),
        (dict(loss_chunk_size=-2), ValueError, "`loss_chunk_size` must be an int >= 1"),
        (dict(loss_chunk_size=2.0), ValueError, "`loss_chunk_size` must be an int >= 1"),
        (dict(loss_chunk_size=math.nan), ValueError, "`loss_chunk_size` must be an int >= 1"),
        (dict(loss_chunk_size=True), ValueError, "`loss_chunk_size` must be an int >= 1"),
        (dict(loss_chunk_size="2"), ValueError, "`loss_chunk_size` must be an int >= 1"),
        (dict(chunk_tokens=0), ValueError, r"`chunk_tokens` must be an int >= 1 \(tokens per chunk\)"),
        (dict(chunk_tokens=[4, 4, 4]), ValueError, "`chunk_tokens` has 3 entries for 2 encoders"),
        (dict(chunk_tokens=4), ValueError, r"`chunk_tokens` counts the tokens of `inputs\[0\]` by its `attention_m"),
        (dict(chunk_size=None), ValueError, r"Give `chunk_size` \(samples per chunk\) or `chunk_tokens`"),
        (dict(chunk_size=[2, None]), ValueError, r"Give `chunk_size` .* for encoder 1"),
        (dict(no_grad="yes"), TypeError, r"`no_grad` must be True or False, or one per encoder"),
        (dict(no_grad=[True]), ValueError, "`no_grad` has 1 entries for 2 encoders"),
        (dict(chunk_size=np.float64(2)), ValueError, r"`chunk_size` must be an int >= 1"),
    ],
)  # fmt: skip
def test_misuse_is_named_with_the_fix_and_changes_nothing(kwargs: dict[str, Any], error: type, match: str) -> None:
    net = tower(dropout=0.3)
    q, d = data(6)
    calls: list[int] = []

    def encoder(x: Tensor) -> Tensor:
        calls.append(1)
        return net(x)

    state = torch.get_rng_state()
    args: dict[str, Any] = {"chunk_size": 2, **kwargs}
    chunk = args.pop("chunk_size")
    with pytest.raises(error, match=match):
        backward_cached([encoder, encoder], [q, d], info_nce_rows, chunk, plain_backward, reps_backward, **args)
    assert not calls and torch.equal(torch.get_rng_state(), state) and all(p.grad is None for p in net.parameters())


def test_numpy_integers_are_counts() -> None:
    """``chunk_size=np.int64(2)`` (and the other counts) as schedules take them: any integer."""
    net = tower()
    q, d = data(6)
    info_nce(net(q), net(d)).backward()
    expected = grads(net)
    net.zero_grad()
    backward_cached([net, net], [q, d], info_nce_rows, np.int64(2), plain_backward, reps_backward,
                    loss_chunk_size=np.int32(4))  # fmt: skip
    assert max((a - b).abs().max().item() for a, b in zip(grads(net), expected, strict=True)) <= 1e-13


# ------------------------------------------------------------------------ how an encoder is called
def test_an_encoder_taking_the_dict_whole_gets_it_and_non_tensors_pass_through() -> None:
    """An encoder whose one argument is the features dict (a SentenceTransformer's, or one written
    before keyword arguments came) gets each chunk's dict, a fresh one each call; entries without a
    tensor go to every chunk unchanged; an output mapping's ``sentence_embedding`` is the default."""
    net = tower(dropout=0.2)
    seen: list[dict[str, Any]] = []

    def encoder(features: dict[str, Any]) -> dict[str, Any]:
        seen.append(dict(features))
        features["token_embeddings"] = net(features["x"])  # (written into the dict, as a SentenceTransformer does)
        features["sentence_embedding"] = features["token_embeddings"] * features["w"][:, None]
        return features

    q, d = data(9)
    w = torch.rand(9, dtype=torch.float64)
    inputs = [{"x": q, "w": w, "modality": "text"}, {"x": d, "w": w, "modality": "text", "prompt": None}]

    def reference(features: dict[str, Any]) -> Tensor:
        return net(features["x"]) * features["w"][:, None]

    torch.manual_seed(1)
    from lightning_accum._core.microbatch import split

    ref = [torch.cat([reference(p) for p in split({"x": x["x"], "w": x["w"]}, 4)]) for x in inputs]
    info_nce_rows(*ref).backward()
    expected = grads(net)
    net.zero_grad()
    torch.manual_seed(1)
    backward_cached([encoder, encoder], inputs, info_nce_rows, 4, plain_backward, reps_backward, loss_chunk_size=3)
    assert max((a - b).abs().max().item() for a, b in zip(grads(net), expected, strict=True)) <= 1e-13
    assert len(seen) == 12 and all(set(s) <= {"x", "w", "modality", "prompt"} for s in seen)  # (2 passes x 6 chunks)
    assert all(s["modality"] == "text" for s in seen) and [len(s["x"]) for s in seen[:3]] == [4, 4, 1]


def test_an_encoder_fitting_neither_call_is_told_both() -> None:
    def encoder(features: dict[str, Tensor], extra: Tensor) -> Tensor:
        return features["x"]

    q, _ = data(4)
    with pytest.raises(TypeError, match=r"fits neither way a Mapping input goes .* as keyword arguments .* or whole"):
        backward_cached([encoder], [{"x": q}], lambda r: r.sum(), 2, plain_backward, reps_backward)


def test_representations_must_be_a_row_per_sample() -> None:
    net = tower()
    q, _ = data(6)
    with pytest.raises(ValueError, match=r"returned \[4\] rows for a chunk of 2 samples; it must return one row"):
        backward_cached([lambda x: net(torch.cat([x, x]))], [q], lambda r: r.sum(), 2, plain_backward, reps_backward)


# ------------------------------------------------------------------------------ token-budget chunks
LENGTHS = [3, 5, 2, 6, 1, 4, 6, 2]  # 8 passages padded to 7: 8 tokens a chunk packs (0, 2), (2, 4), (4, 6), (6, 8)


def bert(dropout: float = 0.0) -> Any:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, attn_implementation="eager", hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.BertModel(config, add_pooling_layer=False).double().train()


def padded(lengths: list[int], width: int, seed: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": torch.randint(1, 50, (len(lengths), width), generator=g) * mask, "attention_mask": mask}


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_token_budget_chunks_trim_their_padding(dropout: float) -> None:
    """Passages packed up to 8 tokens by their attention mask, each chunk's trailing padding columns
    trimmed: against the whole batch at once (dropout off), and against the same trimmed chunks run
    by hand with a graph (dropout on: the masks are drawn at the trimmed width, replayed alike)."""
    net = bert(dropout)
    widths: list[tuple[int, int]] = []

    def encode(input_ids: Tensor, attention_mask: Tensor) -> Tensor:  # the masked mean of the last states
        widths.append(tuple(input_ids.shape))  # type: ignore[arg-type]
        states = net(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return (states * attention_mask[..., None]).sum(1) / attention_mask.sum(1, keepdim=True)

    queries, passages = padded([4, 2, 3, 4], 5, seed=1), padded(LENGTHS, 7, seed=2)
    torch.manual_seed(3)
    q = torch.cat([encode(**{k: v[a:b] for k, v in queries.items()}) for a, b in ((0, 2), (2, 4))])
    if dropout:  # the token chunks, trimmed, by hand
        chunks = [((0, 2), 5), ((2, 4), 6), ((4, 6), 4), ((6, 8), 6)]
        d = torch.cat([encode(**{k: v[a:b, :w] for k, v in passages.items()}) for (a, b), w in chunks])
    else:
        d = encode(**passages)
    loss = info_nce_rows(q, d)
    loss.backward()
    expected, after = grads(net), torch.get_rng_state()
    net.zero_grad()
    widths.clear()
    torch.manual_seed(3)
    got = backward_cached([encode, encode], [queries, passages], info_nce_rows, [2, None], plain_backward,
                          reps_backward, chunk_tokens=[None, 8], loss_chunk_size=3)  # fmt: skip
    assert max((a - b).abs().max().item() for a, b in zip(grads(net), expected, strict=True)) <= 1e-12
    assert abs(got.item() - loss.item()) <= 1e-13 and torch.equal(torch.get_rng_state(), after)
    passes = [(2, 5), (2, 5), (2, 5), (2, 6), (2, 4), (2, 6)]  # queries (2 chunks), then passages, each pass
    assert widths == passages_twice(passes)


def passages_twice(one_pass: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The encoder's calls: the first pass, then the replay, each the queries' 2 chunks then the passages' 4."""
    return one_pass + one_pass


def test_token_budget_with_a_row_cap_and_a_long_sample_alone() -> None:
    from lightning_accum._core.cached import plan

    passages = padded([9, 1, 1, 1, 1, 2], 10, seed=0)
    towers = plan([bert()], [passages], info_nce_rows, 3, chunk_tokens=4)
    assert towers[0].chunks == [(0, 1), (1, 4), (4, 6)]  # 9 > 4 alone; then at most 3 rows; then 3 tokens
    assert [tuple(towers[0].part(j)["input_ids"].shape) for j in range(3)] == [(1, 9), (3, 1), (2, 2)]


def test_per_token_outputs_with_trimmed_chunks_are_refused_with_the_fix() -> None:
    net = bert()
    passages = padded(LENGTHS, 7, seed=2)
    with pytest.raises(ValueError, match=r"differ in shape from chunk to chunk .* pool it to a row per sample"):
        backward_cached([net], [passages], lambda r: r.sum(), None, plain_backward, reps_backward, chunk_tokens=8,
                        get_rep=lambda out: out.last_hidden_state)  # fmt: skip


# --------------------------------------------------------------------------- towers without a gradient
def guided(q: Tensor, d: Tensor, gq: Tensor, gd: Tensor, rows: slice | None = None) -> Tensor:
    """GISTEmbed-style: the guide's similarities mask the in-batch negatives it scores above the
    positive (likely false negatives); the rest is ``info_nce_rows``."""
    rows = slice(0, len(q)) if rows is None else rows
    guide = nn.functional.normalize(gq[rows], dim=1) @ nn.functional.normalize(gd, dim=1).T
    labels = torch.arange(rows.start, rows.stop)
    positive = guide[torch.arange(len(labels)), labels][:, None]
    scores = nn.functional.normalize(q[rows], dim=1) @ nn.functional.normalize(d, dim=1).T / 0.5
    scores = scores.masked_fill((guide > positive) & (labels[:, None] != torch.arange(len(d))), -torch.inf)
    return nn.functional.cross_entropy(scores, labels, reduction="sum") / len(q)


@pytest.mark.parametrize("how", ["frozen", "no_grad"])
def test_a_guide_tower_runs_once(how: str) -> None:
    """A frozen guide (GISTEmbed) forwarded once per chunk, not replayed, its dropout draws where the
    whole batch's forward makes them; BatchNorm statistics of both move once per sample."""
    q_net, d_net = tower(dropout=0.3, norm=True), tower(dropout=0.3, seed=1)
    guide = tower(dropout=0.3, norm=True, seed=2)
    if how == "frozen":
        guide.requires_grad_(False)
    ref_q, ref_guide = tower(dropout=0.3, norm=True), tower(dropout=0.3, norm=True, seed=2)
    ref_guide.requires_grad_(False)
    q, d = data(12)
    calls: list[bool] = []
    guide.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))  # type: ignore[func-returns-value]

    def guide_encoder(x: Tensor) -> Tensor:
        return guide(x)

    torch.manual_seed(4)
    reps = [chunked(ref_q, q, 5), chunked(d_net, d, 5), chunked(ref_guide, q, 5), chunked(ref_guide, d, 5)]
    guided(*reps).backward()
    expected, after = grads(ref_q, d_net), torch.get_rng_state()
    d_net.zero_grad()
    encoder = guide if how == "frozen" else guide_encoder
    torch.manual_seed(4)
    backward_cached(
        [q_net, d_net, encoder, encoder], [q, d, q, d], guided, 5, plain_backward, reps_backward,
        modules=[q_net, guide], loss_chunk_size=4, no_grad=[False, False, how == "no_grad", how == "no_grad"],
    )  # fmt: skip
    assert max((a - b).abs().max().item() for a, b in zip(grads(q_net, d_net), expected, strict=True)) <= 1e-13
    assert torch.equal(torch.get_rng_state(), after)
    for got_net, want_net in ((q_net, ref_q), (guide, ref_guide)):
        assert all(torch.equal(a, b) for a, b in zip(got_net.buffers(), want_net.buffers(), strict=True))
    assert calls == [False] * 6  # (3 chunks of each input, once, without a graph)
    assert all(p.grad is None for p in guide.parameters())


# ------------------------------------------------------------------- a SentenceTransformer as it comes
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(40)]


def sentence_transformer(path: Any, dropout: float = 0.0) -> Any:
    """A tiny SentenceTransformer (BERT + mean pooling) from a config and a vocabulary written here:
    nothing is downloaded."""
    st = pytest.importorskip("sentence_transformers")
    transformers = pytest.importorskip("transformers")
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    config = transformers.BertConfig(
        vocab_size=len(WORDS), hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(path)
    transformers.BertTokenizer(str(path / "vocab.txt")).save_pretrained(path)
    transformers.logging.set_verbosity_error()
    module = Transformer(str(path), model_kwargs={"attn_implementation": "eager"})
    pooling = Pooling(module.get_embedding_dimension(), "mean")
    return st.SentenceTransformer(modules=[module, pooling], device="cpu").double().train()


def texts(n: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 9, (n,), generator=g).tolist()
    return [" ".join(f"w{int(w)}" for w in torch.randint(0, 40, (k,), generator=g)) for k in lengths]


def mnrl(anchors: Tensor, *candidates: Tensor, rows: slice | None = None, scale: float = 20.0) -> Tensor:
    """sentence-transformers' MultipleNegativesRankingLoss (cosine x 20, anchor i's positive is
    candidate i of the first column), the part of the anchors ``rows``."""
    rows = slice(0, len(anchors)) if rows is None else rows
    a = nn.functional.normalize(anchors[rows], dim=1)
    scores = torch.cat([a @ nn.functional.normalize(c, dim=1).T for c in candidates], dim=1) * scale
    labels = torch.arange(rows.start, rows.stop, device=anchors.device)
    return nn.functional.cross_entropy(scores, labels, reduction="sum") / len(anchors)


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def st_grads(model: Any) -> list[Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("columns", [2, 3])
def test_a_sentence_transformer_drops_in(tmp_path: Any, offline: None, columns: int) -> None:
    """``backward_cached([model] * c, [model.tokenize(t) for t in columns], ...)`` with the model as it
    comes (its forward takes the features dict, which carries ``"modality": "text"``), dropout on,
    pairs and triplets, the loss in blocks: the whole batch's gradient, to 1e-12."""
    model = sentence_transformer(tmp_path, dropout=0.1)
    features = [model.tokenize(texts(10, seed=c)) for c in range(columns)]
    assert features[0]["modality"] == "text" and not (features[0]["input_ids"] == WORDS.index("[UNK]")).any()

    def embed(feature: dict[str, Any]) -> Tensor:  # the whole batch's forward, on the same chunks of 4
        parts = [{k: v[a : a + 4] if isinstance(v, Tensor) else v for k, v in feature.items()} for a in (0, 4, 8)]
        return torch.cat([model(part)["sentence_embedding"] for part in parts])

    torch.manual_seed(6)
    loss = mnrl(*[embed(f) for f in features])
    loss.backward()
    expected, after = st_grads(model), torch.get_rng_state()
    model.zero_grad()
    torch.manual_seed(6)
    got = backward_cached([model] * columns, features, mnrl, 4, plain_backward, reps_backward, loss_chunk_size=3,
                          get_rep=lambda out: out["sentence_embedding"])  # fmt: skip
    assert max((a - b).abs().max().item() for a, b in zip(st_grads(model), expected, strict=True)) <= 1e-12
    assert abs(got.item() - loss.item()) <= 1e-13 and torch.equal(torch.get_rng_state(), after)


def test_as_sentence_transformers_own_cached_loss(tmp_path: Any, offline: None) -> None:
    """Against ``CachedMultipleNegativesRankingLoss`` (dropout off: its chunks trim their padding, which
    moves dropout masks), triplets, its ``sentence_embedding`` taken by default; and the uncached loss."""
    pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    model = sentence_transformer(tmp_path)
    features = [model.tokenize(texts(12, seed=c)) for c in range(3)]
    theirs = CachedMultipleNegativesRankingLoss(model, mini_batch_size=5)
    their_loss = theirs(features, None)
    their_loss.backward()
    expected = st_grads(model)
    model.zero_grad()
    mnrl(*[model(dict(f))["sentence_embedding"] for f in features]).backward()
    uncached = st_grads(model)
    model.zero_grad()
    got = backward_cached([model] * 3, features, mnrl, 5, plain_backward, reps_backward, loss_chunk_size=5)
    for want in (expected, uncached):
        assert max((a - b).abs().max().item() for a, b in zip(st_grads(model), want, strict=True)) <= 1e-12
    assert abs(got.item() - their_loss.item()) <= 1e-13


class Sentences(Dataset[dict[str, str]]):
    def __init__(self, n: int) -> None:
        self.q, self.p = texts(n, seed=10), texts(n, seed=11)

    def __len__(self) -> int:
        return len(self.q)

    def __getitem__(self, i: int) -> dict[str, str]:
        return {"q": self.q[i], "p": self.p[i]}


class BiEncoder(AccumulationMixin, pl.LightningModule):
    """A SentenceTransformer trained with the mixin: ``backward_cached`` as the issue writes it, or the
    whole batch's uncached loss."""

    def __init__(self, path: Any, cached: bool) -> None:
        super().__init__()
        self.model, self.cached = sentence_transformer(path), cached
        self.configure_accumulation(2)

    def training_step(self, batch: dict[str, list[str]], batch_idx: int) -> None:
        model = self.model
        with self.accumulate(batch) as acc:
            if self.cached:
                acc.backward_cached([model, model], [model.tokenize(batch["q"]), model.tokenize(batch["p"])], mnrl,
                                    chunk_size=3, get_rep=lambda out: out["sentence_embedding"],
                                    loss_chunk_size=2)  # fmt: skip
            else:
                acc.backward(mnrl(*[model(model.tokenize(batch[c]))["sentence_embedding"] for c in ("q", "p")]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def test_a_sentence_transformer_trains_with_the_mixin(tmp_path: Any, offline: None) -> None:
    runs = []
    for cached in (False, True):
        model = BiEncoder(tmp_path / str(cached), cached)
        trainer(max_epochs=1).fit(model, DataLoader(Sentences(40), batch_size=8))
        runs.append([p.detach().clone() for p in model.parameters()])
    start = [p.detach() for p in BiEncoder(tmp_path / "start", True).parameters()]
    assert max((a - b).abs().max().item() for a, b in zip(runs[1], start, strict=True)) > 1e-3  # (it trained)
    assert max((a - b).abs().max().item() for a, b in zip(*runs, strict=True)) <= 1e-12


class Counted(TwoTower):
    """``normalize="items"``: each cached batch weighs by its query count; batch ``empty`` declares no
    items and its loss is NaN (a mean over nothing), which must add nothing."""

    def __init__(self, empty: int, as_tensor: bool, block: int | None) -> None:
        super().__init__(3, chunk=2, normalize="items")
        self.empty, self.as_tensor, self.block = empty, as_tensor, block

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        n = 0 if batch_idx == self.empty else len(batch["q"])

        def loss(q: Tensor, d: Tensor, rows: slice | None = None) -> Tensor:
            part = info_nce_rows(q, d, rows)
            return part * math.nan if n == 0 else part

        with self.accumulate(batch) as acc:
            acc.backward_cached([self.q_net, self.d_net], [batch["q"], batch["d"]], loss, chunk_size=2,
                                items=torch.tensor(n) if self.as_tensor else n, loss_chunk_size=self.block)  # fmt: skip


@pytest.mark.parametrize("as_tensor", [False, True])
@pytest.mark.parametrize("block", [None, 2])
def test_a_cached_batch_of_no_items_adds_nothing(as_tensor: bool, block: int | None) -> None:
    """Windows of 3 batches of 4, 5 and 3 queries (by ``items``), the middle one of the first window
    without items: its NaN adds nothing, the window is the other two batches' count-weighted mean."""
    model = Counted(1, as_tensor, block)
    data = Pairs(12)
    batches = [[0, 1, 2, 3], [4, 5, 6, 7, 8], [9, 10, 11]]
    trainer(max_epochs=1).fit(model, DataLoader(data, batch_sampler=batches))  # type: ignore[arg-type]
    q_net, d_net = tower(), tower(seed=1)
    opt = torch.optim.SGD([*q_net.parameters(), *d_net.parameters()], lr=0.5)
    for rows in (batches[0], batches[2]):
        (info_nce_rows(q_net(data.q[rows]), d_net(data.d[rows])) * len(rows) / 7).backward()
    opt.step()
    got = [p.detach() for p in model.parameters()]
    expected = [p.detach() for p in [*q_net.parameters(), *d_net.parameters()]]
    assert max((a - b).abs().max().item() for a, b in zip(got, expected, strict=True)) <= 1e-12


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda m, acc, b: acc.backward_cached([m.q_net, m.d_net], [b["q"], b["d"]], info_nce_rows, chunk_size=2,
                                               loss_chunk_size=0), ValueError, "`loss_chunk_size` must be an int >= 1"),
        (lambda m, acc, b: acc.backward_cached([m.q_net, m.d_net], [b["q"], b["d"]], info_nce, chunk_size=2,
                                               loss_chunk_size=2), TypeError, "Add a `rows` argument"),
        (lambda m, acc, b: acc.backward_cached([m.q_net, m.d_net], [b["q"], b["d"]], info_nce_rows, chunk_tokens=8),
         ValueError, "`chunk_tokens` counts the tokens of `inputs\\[0\\]` by its `attention_mask`"),
        (lambda m, acc, b: acc.backward_cached([m.q_net, m.d_net], [b["q"], b["d"]], info_nce_rows),
         ValueError, "Give `chunk_size` \\(samples per chunk\\) or `chunk_tokens`"),
        (lambda m, acc, b: acc.backward_cached([m.q_net, m.d_net], [b["q"], b["d"]], info_nce_rows, chunk_size=2,
                                               no_grad=1), TypeError, "`no_grad` must be True or False"),
        (lambda m, acc, b: acc.backward_cached([m.q_net, m.d_net], [b["q"], b["d"]], info_nce_rows, chunk_size=2,
                                               items=6), ValueError, "needs `normalize='items'`"),
        (lambda m, acc, b: acc.backward_cached([m.q_net, m.d_net], [b["q"], b["d"]], info_nce_rows, chunk_size=2,
                                               no_grad=True), ValueError, "does not require grad"),
    ],
)  # fmt: skip
def test_the_new_arguments_are_refused_through_the_mixin_before_anything_changes(
    call: Any, error: type, match: str
) -> None:
    model = Refused(lambda acc, batch: call(model, acc, batch))
    start = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(error, match=match):
        trainer(max_epochs=1).fit(model, DataLoader(Pairs(12), batch_size=6))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), start, strict=True))
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


# ------------------------------------------------------------------- the rules, one function at a time


def mask_of(rows: list[list[int]]) -> dict[str, Tensor]:
    mask = torch.tensor(rows, dtype=torch.long).reshape(len(rows), -1)
    return {"input_ids": torch.arange(mask.numel()).reshape(mask.shape), "attention_mask": mask}


def lengths_mask(lengths: list[int], width: int) -> dict[str, Tensor]:
    return mask_of([[1] * n + [0] * (width - n) for n in lengths])


@pytest.mark.parametrize(
    ("x", "budget", "size", "chunks", "widths"),
    [
        # 8 tokens: 3 + 5 = 8 fits exactly, 8 + 2 does not; widths the chunk's longest row, 7 is the full width
        (lengths_mask(LENGTHS, 7), 8, None, [(0, 2), (2, 4), (4, 6), (6, 8)], [5, 6, 4, 6]),
        (lengths_mask(LENGTHS, 7), 7, None, [(0, 1), (1, 3), (3, 5), (5, 6), (6, 7), (7, 8)], [3, 5, 6, 4, 6, 2]),
        # rows of 2 tokens, 6 a chunk: 3 rows; at most 2 rows: 2 rows, then the last alone
        (lengths_mask([2] * 5, 4), 6, None, [(0, 3), (3, 5)], [2, 2]),
        (lengths_mask([2] * 5, 4), 6, 2, [(0, 2), (2, 4), (4, 5)], [2, 2, 2]),
        (lengths_mask([2] * 5, 4), 100, 1, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)], [2, 2, 2, 2, 2]),
        (lengths_mask([2] * 5, 4), 100, 5, [(0, 5)], [2]),
        # a row longer than the budget alone, then at most 3 rows
        (lengths_mask([9, 1, 1, 1, 1, 2], 10), 4, 3, [(0, 1), (1, 4), (4, 6)], [9, 1, 2]),
        # a chunk that reaches the full width keeps it (None: nothing to trim)
        (lengths_mask([4, 1], 4), 10, None, [(0, 2)], [None]),
        (lengths_mask([1, 4], 4), 1, None, [(0, 1), (1, 2)], [1, None]),
        # a chunk of padding only keeps its width; it costs no token
        (lengths_mask([0, 0, 3], 3), 2, None, [(0, 2), (2, 3)], [None, None]),
        # tokens are counted (holes too), the width runs to the last one; any non-zero mask value is a token
        (mask_of([[1, 0, 1, 0, 0], [2, 2, 0, 0, 0]]), 3, None, [(0, 1), (1, 2)], [3, 2]),
        (mask_of([[1, 0, 1, 0, 0], [2, 2, 0, 0, 0]]), 4, None, [(0, 2)], [3]),
        (mask_of([[0, 0, 0, 0, 1], [1, 0, 0, 0, 0]]), 2, None, [(0, 2)], [None]),
        # no columns at all
        (mask_of([[], [], []]), 1, None, [(0, 3)], [None]),
    ],
)  # fmt: skip
def test_token_packing_table(
    x: dict[str, Tensor], budget: int, size: int | None, chunks: list[tuple[int, int]], widths: list[int | None]
) -> None:
    assert _cached._pack(x, 0, budget, size) == (chunks, widths)


@pytest.mark.parametrize(
    "x",
    [torch.ones(3, 4), {"input_ids": torch.ones(3, 4)}, {"attention_mask": torch.ones(3)},
     {"attention_mask": torch.ones(3, 4, 2)}, {"attention_mask": [[1, 1], [1, 0]]}],
)  # fmt: skip
def test_token_packing_needs_a_2d_attention_mask(x: Any) -> None:
    with pytest.raises(ValueError, match=r"counts the tokens of `inputs\[3\]` by its `attention_mask` \(a 2-d tensor"):
        _cached._pack(x, 3, 4, None)


@pytest.mark.parametrize(
    ("rows", "size", "chunks"),
    [
        (10, 4, [(0, 4), (4, 8), (8, 10)]),
        (10, 5, [(0, 5), (5, 10)]),
        (10, 9, [(0, 9), (9, 10)]),
        (10, 10, [(0, 10)]),
        (10, 11, [(0, 10)]),
        (3, 1, [(0, 1), (1, 2), (2, 3)]),
        (1, 1, [(0, 1)]),
    ],
)
def test_row_chunks_table(rows: int, size: int | None, chunks: list[tuple[int, int]]) -> None:
    def encode(x: Tensor) -> Tensor:
        return x

    towers = _cached.plan([encode, encode], [torch.zeros(rows, 2), torch.zeros(2, 2)], info_nce, [size, 1])
    first, second = towers
    assert (first.index, first.rows, first.chunks, first.widths) == (0, rows, chunks, [None] * len(chunks))
    assert (second.index, second.rows, second.chunks, second.widths) == (1, 2, [(0, 1), (1, 2)], [None, None])
    assert first.style == second.style == "positional" and not first.frozen and not first.trimmed
    assert first.encoder is encode and first.get_rep is None


def test_a_tower_by_tokens_is_trimmed_and_cut_when_it_runs() -> None:
    def encode(input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return input_ids

    x = lengths_mask([1, 2, 4, 1], 4)
    (tower_,) = _cached.plan([encode], [x], info_nce, None, chunk_tokens=3)
    assert tower_.chunks == [(0, 2), (2, 3), (3, 4)] and tower_.widths == [2, None, 1] and tower_.trimmed
    assert tower_.style == "keywords"
    assert torch.equal(tower_.part(0)["input_ids"], x["input_ids"][0:2, :2])
    assert torch.equal(tower_.part(1)["attention_mask"], x["attention_mask"][2:3])
    assert torch.equal(tower_.part(2)["input_ids"], x["input_ids"][3:4, :1])


@pytest.mark.parametrize(
    ("name", "value", "result"),
    [
        ("chunk_size", 1, 1), ("chunk_size", 7, 7), ("chunk_size", np.int64(3), 3), ("chunk_tokens", np.uint8(2), 2),
        ("chunk_size", None, None), ("loss_chunk_size", 1, 1),
    ],
)  # fmt: skip
def test_counts_table(name: str, value: object, result: int | None) -> None:
    got = _cached._count(name, value, value, "things")
    assert got == result and type(got) is type(result)


@pytest.mark.parametrize("value", [0, -1, -5, True, False, 2.0, 1.5, math.nan, "2", np.float32(2)])
@pytest.mark.parametrize("name", ["chunk_size", "loss_chunk_size"])
def test_counts_refused_table(name: str, value: object) -> None:
    per = "" if name == "loss_chunk_size" else ", or one per encoder"
    message = f"`{name}` must be an int >= 1 (things){per}; got [[4]]."
    with pytest.raises(ValueError) as error:
        _cached._count(name, value, [[4]], "things")
    assert str(error.value) == message


def test_per_tower_values() -> None:
    assert _cached._per_tower("x", [1, None], 2) == [1, None]
    assert _cached._per_tower("x", (3,), 1) == [3]
    assert _cached._per_tower("x", 5, 3) == [5, 5, 5]
    assert _cached._per_tower("x", None, 2) == [None, None]
    assert _cached._per_tower("x", "ab", 2) == ["ab", "ab"]
    for wrong in ([1], (1, 2, 3), []):
        with pytest.raises(ValueError, match=rf"^`x` has {len(wrong)} entries for 2 encoders; give one, or one per"):
            _cached._per_tower("x", wrong, 2)


@pytest.mark.parametrize(
    ("encoders", "inputs", "error", "match"),
    [
        (nn.Linear(2, 2), [torch.ones(2)], TypeError, r"`encoders` must be a list, .* got Linear\."),
        ([nn.Linear(2, 2)], torch.ones(2, 2), TypeError, r"`inputs` must be a list, .* got Tensor\."),
        ([info_nce], "ab", TypeError, r"`inputs` must be a list, .* got str\."),
        ([info_nce], {"x": torch.ones(2)}, TypeError, r"`inputs` must be a list, .* got dict\."),
        (info_nce, [torch.ones(2)], TypeError, r"`encoders` must be a list, .* got function\."),
        ({info_nce}, [torch.ones(2)], TypeError, r"`encoders` must be a list, .* got set\."),
        ([], [], ValueError, r"`encoders` has 0 entries and `inputs` 0; give one encoder per input"),
        ([info_nce], [], ValueError, r"`encoders` has 1 entries and `inputs` 0"),
        ([info_nce], [torch.ones(2), torch.ones(2)], ValueError, r"`encoders` has 1 entries and `inputs` 2"),
    ],
)  # fmt: skip
def test_towers_table(encoders: Any, inputs: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        _cached._check_towers(encoders, inputs)


def test_towers_accepted() -> None:
    for encoders, inputs in (([info_nce], [torch.ones(2)]), ((info_nce, info_nce), (1, 2)), ([1, 2], [3, 4])):
        assert _cached._check_towers(encoders, inputs) is None


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(get_rep=3), TypeError, r"`get_rep` must be a callable on an encoder's output .* got 3\."),
        (dict(get_rep=[None, "x"]), TypeError, r"`get_rep` must be a callable .* got \[None, 'x'\]\."),
        (dict(get_rep=[None]), ValueError, "`get_rep` has 1 entries for 2 encoders"),
        (dict(no_grad=[True, 1]), TypeError, r"`no_grad` must be True or False, or one per encoder; got \[True, 1\]"),
        (dict(no_grad=None), TypeError, "`no_grad` must be True or False"),
        (dict(encoders=[info_nce, 3]), TypeError, r"`encoders\[1\]` is a int; each encoder must be callable"),
        (dict(chunk_size=[None, 2]), ValueError, r"or `chunk_tokens` \(tokens per chunk\) for encoder 0: one for"),
        (dict(chunk_size=[2, None], chunk_tokens=[None, 0]), ValueError, r"`chunk_tokens` must be an int >= 1"),
        (dict(inputs=[torch.ones(2, 1), torch.ones(0, 1)]), ValueError, r"`inputs\[1\]` holds no samples \(dim 0"),
        (dict(inputs=[torch.ones(2, 1), {"a": torch.ones(2), "b": torch.ones(3)}]), ValueError,
         r"^`inputs\[1\]`: The batch's tensors differ in size"),
        (dict(inputs=[torch.ones(2, 1), {"a": "text"}]), ValueError, r"^`inputs\[1\]`: The batch holds no tensor"),
        (dict(loss_chunk_size=2), TypeError, r"Add a `rows` argument"),
        (dict(loss_chunk_size=0, loss_fn=info_nce_rows), ValueError, r"^`loss_chunk_size` must be an int >= 1 \(rows "
         r"of the first input per block of the loss\); got 0\.$"),
    ],
)  # fmt: skip
def test_plan_refusals_table(kwargs: dict[str, Any], error: type, match: str) -> None:
    args: dict[str, Any] = {"encoders": [info_nce, info_nce], "inputs": [torch.ones(2, 1), torch.ones(2, 1)],
                            "loss_fn": info_nce, "chunk_size": 2, **kwargs}  # fmt: skip
    with pytest.raises(error, match=match):
        _cached.plan(args.pop("encoders"), args.pop("inputs"), args.pop("loss_fn"), args.pop("chunk_size"), **args)


def test_plan_per_tower_pickers_flags_and_loss_signatures() -> None:
    def pick(out: Any) -> Tensor:
        return out

    def loss_kw(*reps: Tensor, **kwargs: Any) -> Tensor:
        return reps[0].sum()

    frozen = nn.Linear(1, 1).requires_grad_(False)
    towers = _cached.plan([info_nce, frozen, info_nce], [torch.ones(2, 1)] * 3, loss_kw, 2,
                          get_rep=[pick, None, pick], no_grad=[False, False, True], loss_chunk_size=1)  # fmt: skip
    assert [t.get_rep for t in towers] == [pick, None, pick]
    assert [t.frozen for t in towers] == [False, True, True]
    for loss_fn in (info_nce_rows, max, loss_kw):  # `rows`, no signature to read, `**kwargs`
        assert len(_cached.plan([info_nce], [torch.ones(2, 1)], loss_fn, 2, loss_chunk_size=3)) == 1


@dataclasses.dataclass
class Pair:
    a: Any
    b: Any


@pytest.mark.parametrize(
    ("value", "holds"),
    [
        (torch.ones(()), True), ("text", False), (None, False), (3, False), ([], False), ({}, False),
        ({"a": "x", "b": torch.ones(1)}, True), ({"a": {"b": [1, (2, torch.ones(1))]}}, True), ({"a": [1, "x"]}, False),
        ((1, 2), False), ([1, torch.ones(1)], True), (Pair(1, "x"), False), (Pair(1, [torch.ones(1)]), True),
        (Pair, False),
    ],
)  # fmt: skip
def test_holds_a_tensor_table(value: Any, holds: bool) -> None:
    assert _cached._holds_tensor(value) is holds


class Encoding(dict):  # type: ignore[type-arg]
    """A Mapping type of its own (as transformers' ``BatchEncoding``), which a cut must keep."""


def test_a_mapping_chunk_is_cut_and_trimmed() -> None:
    x = Encoding(
        ids=torch.arange(20).reshape(4, 5), mask=torch.ones(4, 5), cube=torch.arange(40).reshape(4, 5, 2),
        pos=torch.arange(12).reshape(4, 3), w=torch.arange(4), nested=[torch.arange(4), "tag"], modality="text",
    )  # fmt: skip
    got = _cached._take(x, 1, 3, 2, 5)
    assert type(got) is Encoding and list(got) == list(x)
    assert torch.equal(got["ids"], torch.tensor([[5, 6], [10, 11]]))
    assert torch.equal(got["mask"], torch.ones(2, 2))
    assert torch.equal(got["cube"], x["cube"][1:3, :2])
    assert torch.equal(got["pos"], x["pos"][1:3])  # (another width: not a token column)
    assert torch.equal(got["w"], torch.tensor([1, 2]))
    assert torch.equal(got["nested"][0], torch.tensor([1, 2])) and got["nested"][1] == "tag"
    assert got["modality"] == "text"
    whole = _cached._take(x, 0, 4, None, 5)
    assert all(torch.equal(whole[k], x[k]) for k in ("ids", "mask", "cube", "pos", "w"))
    assert torch.equal(_cached._take(torch.arange(6), 2, 5, None, 0), torch.tensor([2, 3, 4]))
    assert [t.tolist() for t in _cached._take((torch.arange(3), torch.arange(3) * 2), 1, 2, None, 0)] == [[1], [2]]


class Forward(nn.Module):
    def forward(self, features: dict[str, Tensor]) -> Tensor:
        return features["x"]


class Compiled:
    """What ``torch.compile`` returns: a wrapper taking anything, the module in ``_orig_mod``."""

    def __init__(self, module: nn.Module) -> None:
        self._orig_mod = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._orig_mod(*args, **kwargs)


def by_keywords(input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    return input_ids


def whole(features: dict[str, Tensor]) -> Tensor:
    return features["input_ids"]


def anything(*args: Any, **kwargs: Any) -> Tensor:
    return args[0] if args else kwargs["input_ids"]


@pytest.mark.parametrize(
    ("encoder", "part", "style"),
    [
        (whole, torch.ones(2), "positional"), (by_keywords, [torch.ones(2)], "positional"),
        (by_keywords, {"input_ids": 1}, "keywords"), (by_keywords, {"input_ids": 1, "attention_mask": 1}, "keywords"),
        (whole, {"input_ids": 1, "attention_mask": 1}, "whole"), (whole, {"features": 1}, "keywords"),
        (anything, {"input_ids": 1}, "keywords"), (anything, {0: 1}, "whole"), (whole, {0: 1}, "whole"),
        (Forward(), {"x": 1, "y": 1}, "whole"), (nn.Identity(), {"input": 1}, "keywords"),
        (Compiled(Forward()), {"x": 1, "y": 1}, "whole"), (Compiled(nn.Identity()), {"input": 1}, "keywords"),
        (max, {"input_ids": 1}, "keywords"),
    ],
)  # fmt: skip
def test_call_style_table(encoder: Any, part: Any, style: str) -> None:
    assert _cached._call_style(encoder, part, 0) == style


def test_an_encoder_that_binds_neither_way_is_named() -> None:
    def two(a: Tensor, b: Tensor) -> Tensor:
        return a

    with pytest.raises(TypeError, match=r"^encoder 2 takes \(a: 'Tensor', b: 'Tensor'\) -> 'Tensor', which fits nei"):
        _cached._call_style(two, {"a": 1}, 2)


@pytest.mark.parametrize(
    ("encoder", "frozen"),
    [
        (info_nce, False), (nn.ReLU(), False), (nn.Linear(1, 1), False), (nn.Linear(1, 1).requires_grad_(False), True),
        (nn.Sequential(nn.Linear(1, 1).requires_grad_(False), nn.Linear(1, 1)), False),
        (nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)).requires_grad_(False), True),
        (Compiled(nn.Linear(1, 1).requires_grad_(False)), True), (Compiled(nn.Linear(1, 1)), False),
        (Compiled(nn.ReLU()), False),
    ],
)  # fmt: skip
def test_frozen_table(encoder: Any, frozen: bool) -> None:
    assert _cached._frozen(encoder) is frozen


@pytest.mark.parametrize(
    ("reps", "match"),
    [
        (torch.tensor(1.0), "returned a 0-d tensor"), ((torch.ones(2), torch.tensor(1.0)), "returned a 0-d tensor"),
        ([torch.ones(2)], "returned list; it must return a tensor or a tuple"), ((), "returned tuple"),
        ((torch.ones(2), 3), "returned tuple"), (None, "returned NoneType"), ({"a": torch.ones(2)}, "returned dict"),
    ],
)  # fmt: skip
def test_representations_refused_table(reps: Any, match: str) -> None:
    with pytest.raises(ValueError, match=rf"^encoder 5 {match}"):
        _cached._parts(reps, "encoder 5")


def test_representations_accepted() -> None:
    a, b = torch.ones(2, 3), torch.zeros(2)
    assert _cached._parts(a, "x")[0] is a and len(_cached._parts(a, "x")) == 1
    got = _cached._parts((a, b), "x")
    assert got[0] is a and got[1] is b and len(got) == 2


def planned(rows: int, size: int, widths: list[int | None] | None = None) -> Any:
    (tower_,) = _cached.plan([info_nce], [torch.zeros(rows, 1)], info_nce, size)
    tower_.index = 3
    if widths is not None:
        tower_.widths = widths
    return tower_


def test_the_chunks_join() -> None:
    tower_ = planned(5, 2)  # chunks of 2, 2, 1
    outs = [(torch.full((n, 3), float(j)), torch.full((n,), -float(j))) for j, n in enumerate((2, 2, 1))]
    a, b = _cached._join(outs, tower_)
    assert torch.equal(a, torch.tensor([[0.0] * 3] * 2 + [[1.0] * 3] * 2 + [[2.0] * 3]))
    assert torch.equal(b, torch.tensor([0.0, 0, -1, -1, -2]))


@pytest.mark.parametrize(
    ("outs", "widths", "match"),
    [
        ([(torch.ones(2),), (torch.ones(2), torch.ones(2)), (torch.ones(1),)], None,
         r"^encoder 3 returned different numbers of tensors for different chunks"),
        ([(torch.ones(2),), (torch.ones(3),), (torch.ones(1),)], None,
         r"^encoder 3 returned \[3\] rows for a chunk of 2 samples"),
        ([(torch.ones(2), torch.ones(2)), (torch.ones(2), torch.ones(2)), (torch.ones(1), torch.ones(2))], None,
         r"^encoder 3 returned \[1, 2\] rows for a chunk of 1 samples"),
        ([(torch.ones(2, 3),), (torch.ones(2, 3),), (torch.ones(1, 4),)], None,
         r"^encoder 3's representations differ in shape from chunk to chunk \(\[\(3,\), \(4,\)\]\)\.$"),
        ([(torch.ones(2, 3),), (torch.ones(2, 3),), (torch.ones(1, 4),)], [None, 2, None], r"\)\. `chunk_tokens` trim"),
        ([(torch.ones(2, 3),), (torch.ones(2, 3),), (torch.ones(1, 4),)], [None, None, None], r"\(4,\)\]\)\.$"),
    ],
)  # fmt: skip
def test_chunks_that_do_not_join_are_named(outs: Any, widths: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _cached._join(outs, planned(5, 2, widths))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_a_leaf_is_a_new_float_tensor_of_at_least_32_bits(dtype: torch.dtype) -> None:
    rep = torch.tensor([1.5, -2.0], dtype=dtype)
    leaf = _cached._leaf(rep)
    assert leaf.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert leaf.requires_grad and leaf.is_leaf and not rep.requires_grad  # (the encoder's output untouched)
    assert leaf.tolist() == [1.5, -2.0]
    frozen = _cached._leaf(rep, grad=False)
    assert not frozen.requires_grad and frozen.dtype == leaf.dtype and frozen.tolist() == [1.5, -2.0]


def test_an_integer_representation_is_passed_as_it_is() -> None:
    rep = torch.tensor([1, 2])
    assert _cached._leaf(rep) is rep and not rep.requires_grad


class Written(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.BatchNorm1d(2)
        self.register_buffer("count", torch.tensor(3))
        self.register_buffer("mean", torch.tensor([1.0, 2.0]))


def test_buffers_are_put_back_whole() -> None:
    module = Written()
    count, mean, running = module.count, module.mean, module.inner.running_mean
    saved = _cached._Buffers([module])
    module.count += 5  # in place
    module.mean = torch.tensor([7.0, 7.0])  # reassigned
    module.inner.running_mean.fill_(4.0)  # a child's
    saved.restore()
    assert module.count is count and module.mean is mean and module.inner.running_mean is running
    assert module.count.item() == 3 and module.mean.tolist() == [1.0, 2.0] and running.tolist() == [0.0, 0.0]
    module.count += 1  # written after: a second restore puts nothing back
    saved.restore()
    assert module.count.item() == 4


def test_an_rng_state_replays_and_the_generator_goes_on() -> None:
    torch.manual_seed(0)
    state = _cached._RNG()
    first = torch.rand(3)
    after = torch.get_rng_state()
    with state.replay():
        again = torch.rand(5)  # (more draws than before it)
    assert torch.equal(again[:3], first) and torch.equal(torch.get_rng_state(), after)  # (the replay leaves no trace)
    state.restore()
    assert torch.equal(torch.rand(3), first)


def test_the_blocks_of_the_loss() -> None:
    """Blocks of ``size`` rows from ``start``, the last shorter; each part back-propagated times the factor, in
    order; the sum of the parts (not times the factor) returned."""
    seen: list[tuple[int, int]] = []
    backed: list[float] = []

    def loss_fn(a: Tensor, b: Tensor, rows: slice) -> Tensor:
        assert a == 1 and b == 2
        seen.append((rows.start, rows.stop))
        return torch.tensor([float(rows.stop - rows.start) * 10 + rows.start])

    for factor in (1, 3):
        seen.clear(), backed.clear()  # type: ignore[func-returns-value]
        total = _cached._loss_in_blocks(loss_fn, [1, 2], lambda t: backed.append(t.item()), 3, 5, 2, factor)
        assert seen == [(3, 5), (5, 7), (7, 8)]
        assert backed == [factor * 23.0, factor * 25.0, factor * 17.0]
        assert total.shape == () and total.item() == 65.0
    one: list[tuple[int, int]] = []
    _cached._loss_in_blocks(lambda rows: one.append((rows.start, rows.stop)) or torch.ones(()), [], lambda t: None,
                            0, 4, 4, 1)  # fmt: skip
    assert one == [(0, 4)]


def test_under_gather_the_cached_gradient_is_this_ranks_rows() -> None:
    towers = [planned(2, 2), planned(3, 1)]
    towers[1].index = 1
    towers[0].index = 0
    g0, g1 = torch.arange(12.0).reshape(6, 2), torch.arange(9.0)
    grads: list[list[Tensor | None]] = [[g0], [None, g1]]
    offsets = [2, 3]
    _cached._own_rows(towers, grads, offsets)
    assert offsets == [0, 0]
    assert grads[0][0].tolist() == [[4.0, 5.0], [6.0, 7.0]] and grads[1][0] is None  # type: ignore[union-attr]
    assert grads[1][1].tolist() == [3.0, 4.0, 5.0]  # type: ignore[union-attr]
    g0.zero_(), g1.zero_()  # type: ignore[func-returns-value]
    assert grads[0][0].sum().item() == 22.0 and grads[1][1].sum().item() == 12.0  # type: ignore[union-attr]  # (copies)


@pytest.mark.parametrize("block", [None, 3])
@pytest.mark.parametrize("rank", [0, 1])
def test_gathered_representations_one_rank_of_two(rank: int, block: int | None) -> None:
    """Rank ``rank`` of 2, the other rank's representations and its part of the sums given by a stand-in
    ``gather`` and ``reduce`` (what the other rank sends, computed here with autograd): this rank's gradient is
    ``world`` times the gathered loss's gradient through its own rows, so that the mean over ranks is the
    gathered loss's; a learned temperature gets the whole loss's gradient (``world`` times its own rows' part
    in blocks); the loss returned is the gathered loss. The passage tower's second output, unused by the loss,
    gets no gradient on either rank."""
    world, rows = 2, 4
    q_net, d_net = tower(), tower(seed=1)
    temperature = nn.Parameter(torch.tensor(0.6, dtype=torch.float64))
    (q0, d0), (q1, d1) = data(rows, seed=3), data(rows, seed=4)
    own, other = [q0, d0], [q_net(q1).detach(), d_net(d1).detach()]

    def order(mine: Tensor, theirs: Tensor) -> Tensor:
        return torch.cat([mine, theirs] if rank == 0 else [theirs, mine])

    def loss_fn(q: Tensor, d: tuple[Tensor, Tensor], rows: slice | None = None) -> Tensor:
        return info_nce_rows(q, d[0], rows, temperature)

    # the reference: the gathered loss, the other rank's representations as constants
    reps = [order(q_net(q0), other[0]), order(d_net(d0), other[1])]
    loss = loss_fn(reps[0], (reps[1], reps[1][:, :1]))
    (world * loss).backward(inputs=[*q_net.parameters(), *d_net.parameters()], retain_graph=True)
    expected = grads(q_net, d_net)
    if block is None:
        loss.backward(inputs=[temperature])
    else:  # this rank's rows' part, times world
        mine = slice(rank * rows, (rank + 1) * rows)
        (world * loss_fn(reps[0].detach(), (reps[1].detach(),) * 2, mine)).backward(inputs=[temperature])
    expected.append(temperature.grad.clone())  # type: ignore[union-attr]
    for p in (*q_net.parameters(), *d_net.parameters(), temperature):
        p.grad = None

    def gather(tensors: Any) -> tuple[list[Tensor], int]:
        i = len(offsets)
        offsets.append(rank * rows)
        assert len(tensors) == 2 - (i == 0) and all(len(t) == rows for t in tensors)
        return [order(tensors[0], other[i]), *[order(t, t) for t in tensors[1:]]], rank * rows

    def reduce(tensors: Any) -> list[Tensor]:
        """The other rank's gradients of the gathered leaves (its rows' parts, times world), its flags, its loss."""
        q, d = reps[0].detach().requires_grad_(), reps[1].detach().requires_grad_()
        theirs = slice((1 - rank) * rows, (2 - rank) * rows)
        part = loss_fn(q, (d, d[:, :1]), theirs)
        q_grad, d_grad = torch.autograd.grad(world * part, [q, d])  # (the temperature's is the other rank's own)
        assert [tuple(t.shape) for t in tensors] == [(2 * rows, REP), (2 * rows, REP), (2 * rows, 1), (4,)]
        assert tensors[2].abs().sum() == 0 and tensors[3][:3].tolist() == [1.0, 1.0, 0.0]
        return [tensors[0] + q_grad, tensors[1] + d_grad, tensors[2], tensors[3] + torch.stack([*torch.tensor(
            [1.0, 1.0, 0.0], dtype=torch.float64), part.detach()])]  # fmt: skip

    offsets: list[int] = []

    def encode_d(x: Tensor) -> tuple[Tensor, Tensor]:
        r = d_net(x)
        return r, r[:, :1]

    def replay_backward(reps: Any, grads_: Any) -> None:  # (the other rank's rows were let go before the replay)
        assert all(g.untyped_storage().nbytes() <= rows * g.shape[1] * g.element_size() for g in grads_)
        reps_backward(reps, grads_)

    got_loss = backward_cached([q_net, encode_d], own, loss_fn, 3, plain_backward, replay_backward, gather=gather,
                               reduce=reduce if block else None, world=world, loss_chunk_size=block)  # fmt: skip
    got = [*grads(q_net, d_net), temperature.grad]
    assert max((a - b).abs().max().item() for a, b in zip(got, expected, strict=True)) <= 1e-13  # type: ignore[operator]
    assert abs(got_loss.item() - loss.item()) <= 1e-14 and offsets == [rank * rows] * 2


def test_the_loss_in_blocks_with_gather_needs_a_sum_over_ranks() -> None:
    with pytest.raises(ValueError, match=r"^`loss_chunk_size` with `gather` needs `reduce` \(a sum over ranks\)\.$"):
        _cached.run([], info_nce_rows, plain_backward, reps_backward, gather=lambda t: (list(t), 0), loss_chunk_size=2)


def test_only_the_graph_free_pass_of_a_replayed_tower_is_uncounted() -> None:
    """``uncounted()`` wraps each chunk of a replayed tower's graph-free pass, not a frozen tower's (its one
    pass counts) nor the replay; the chunks of each pass in order."""
    net, guide = tower(), tower(seed=2).requires_grad_(False)
    state = {"uncounted": False}
    calls: list[tuple[str, int, bool, bool]] = []

    @contextlib.contextmanager
    def uncounted() -> Any:
        assert not state["uncounted"]
        state["uncounted"] = True
        yield
        state["uncounted"] = False

    def encoder(name: str, module: nn.Module) -> Callable[[Tensor], Tensor]:
        def encode(x: Tensor) -> Tensor:
            calls.append((name, len(x), state["uncounted"], torch.is_grad_enabled()))
            return module(x)

        return encode

    q, d = data(5)
    towers = _cached.plan([encoder("q", net), guide, encoder("g", guide)], [q, d, q], lambda a, b, c: info_nce(a, b), 3)
    assert [t.frozen for t in towers] == [False, True, False]
    towers[2].frozen = True  # (as `no_grad=` plans it)
    _cached.run(towers, lambda a, b, c: info_nce(a, b), plain_backward, reps_backward, uncounted=uncounted)
    assert calls == [("q", 3, True, False), ("q", 2, True, False), ("g", 3, False, False), ("g", 2, False, False),
                     ("q", 3, False, True), ("q", 2, False, True)]  # fmt: skip
    assert all(p.grad is not None for p in net.parameters()) and all(p.grad is None for p in guide.parameters())


@pytest.mark.parametrize("order", ["guide first", "guide between"])
def test_buffers_move_once_per_sample_whatever_the_towers_order(order: str) -> None:
    """A frozen tower's one pass writes its BatchNorm statistics (kept), a replayed tower's graph-free pass
    writes none (its replay does): each module's statistics as one forward of each chunk, in order."""
    net, guide = tower(norm=True), tower(norm=True, seed=2).requires_grad_(False)
    ref_net, ref_guide = tower(norm=True), tower(norm=True, seed=2)
    q, d = data(6)
    if order == "guide first":
        encoders, inputs = [guide, net, guide], [q, d, d]
        chunked(ref_guide, q, 4), chunked(ref_guide, d, 4), chunked(ref_net, d, 4)
    else:
        encoders, inputs = [net, guide, net], [q, d, d]
        chunked(ref_guide, d, 4), chunked(ref_net, q, 4), chunked(ref_net, d, 4)
    backward_cached(encoders, inputs, lambda a, b, c: info_nce(a + b, c), 4, plain_backward, reps_backward,
                    modules=[net, guide])  # fmt: skip
    for got, want in ((net, ref_net), (guide, ref_guide)):
        assert all(torch.equal(a, b) for a, b in zip(got.buffers(), want.buffers(), strict=True))


@pytest.mark.parametrize(
    ("output", "get_rep", "rows"),
    [
        (torch.ones(2, 3), None, [[1.0] * 3] * 2),
        ({"sentence_embedding": torch.zeros(2, 1), "token_embeddings": torch.ones(2, 3)}, None, [[0.0]] * 2),
        ({"sentence_embedding": torch.zeros(2, 1), "cls": torch.ones(2, 1)}, lambda out: out["cls"], [[1.0]] * 2),
        (Output(torch.full((2, 1), 5.0)), lambda out: out.last_hidden_state, [[5.0]] * 2),
    ],
)  # fmt: skip
def test_the_representation_picked_from_an_output(output: Any, get_rep: Any, rows: list[list[float]]) -> None:
    (tower_,) = _cached.plan([lambda x: output], [torch.zeros(2, 1)], info_nce, 2, get_rep=get_rep)
    (rep,) = tower_.encode(tower_.part(0))
    assert rep.tolist() == rows


def test_an_output_mapping_without_a_sentence_embedding_is_named() -> None:
    (tower_,) = _cached.plan([lambda x: {"cls": x}], [torch.zeros(2, 1)], info_nce, 2)
    with pytest.raises(ValueError, match=r"^encoder 0 returned dict; it must return a tensor or a tuple of tensors"):
        tower_.encode(tower_.part(0))


@pytest.mark.parametrize("other", ["none", "some"])
def test_the_sum_over_ranks_of_the_cached_gradients(other: str) -> None:
    """Each gradient (zeros where this rank has none) and, last, which ranks have each and the losses, in the
    widest of their dtypes (the float64 loss's, here); a gradient no rank has stays None; the loss returned is the
    ranks' sum, in the loss's dtype. The other rank here sends ``theirs``."""
    a, b = torch.ones(2, 1).requires_grad_(), torch.ones(3, 2).requires_grad_()
    c = torch.ones(3)  # (no gradient: not sent)
    grads: list[list[Tensor | None]] = [[torch.tensor([[1.0], [2.0]])], [None, None]]
    total = torch.tensor(0.25, dtype=torch.float64)
    theirs = [torch.tensor([[10.0], [20.0]]), torch.full((3, 2), 3.0) if other == "some" else torch.zeros(3, 2)]
    flags = [1.0, 1.0 if other == "some" else 0.0, 0.5]
    sent: list[list[Tensor]] = []

    def reduce(tensors: Any) -> list[Tensor]:
        sent.append([t.clone() for t in tensors])
        return [t + u for t, u in zip(tensors, [*theirs, torch.tensor(flags)], strict=True)]

    got = _cached._sum_over_ranks([(a,), (b, c)], grads, total, reduce)
    mine = sent[0]
    assert [t.tolist() for t in mine] == [[[1.0], [2.0]], [[0.0, 0.0]] * 3, [1.0, 0.0, 0.25]]
    assert mine[2].dtype == torch.float64
    assert got.dtype == torch.float64 and got.item() == 0.75
    assert grads[0][0].tolist() == [[11.0], [22.0]]  # type: ignore[union-attr]
    assert grads[1][1] is None
    assert grads[1][0] is None if other == "none" else grads[1][0].tolist() == [[3.0, 3.0]] * 3  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("grad", "loss", "sent"),
    [
        (torch.bfloat16, torch.float32, torch.float32),  # (bf16-mixed: the loss's bits kept, in a second collective)
        (torch.float32, torch.bfloat16, torch.float32),  # (with the gradients: one collective)
        (torch.bfloat16, torch.bfloat16, torch.bfloat16),
        (torch.float64, torch.float32, torch.float64),
    ],
)
def test_the_loss_summed_over_ranks_keeps_every_bit_of_its_dtype(
    grad: torch.dtype, loss: torch.dtype, sent: torch.dtype
) -> None:
    leaf = torch.ones(2, dtype=grad).requires_grad_()
    grads: list[list[Tensor | None]] = [[torch.tensor([1.0, 2.0], dtype=grad)]]
    total = torch.tensor(2.3456, dtype=loss)  # (2.34375 in bfloat16)
    seen: list[torch.dtype] = []

    def reduce(tensors: Any) -> list[Tensor]:
        seen.extend(t.dtype for t in tensors)
        return [t * 2 for t in tensors]

    got = _cached._sum_over_ranks([(leaf,)], grads, total, reduce)
    assert seen == [grad, sent] and got.dtype == loss and got.item() == (total.double() * 2).item()


def test_the_sum_over_ranks_of_one_gradient() -> None:
    leaf = torch.ones(2, dtype=torch.float64).requires_grad_()
    grads: list[list[Tensor | None]] = [[torch.tensor([1.0, 2.0], dtype=torch.float64)]]
    got = _cached._sum_over_ranks([(leaf,)], grads, torch.tensor(3.0), lambda ts: [t * 2 for t in ts])
    assert got.dtype == torch.float32 and got.item() == 6.0 and grads[0][0].tolist() == [2.0, 4.0]  # type: ignore[union-attr]


def test_the_replay_backpropagates_only_what_has_a_gradient_and_a_graph() -> None:
    """Each chunk's ``reps_backward`` gets the outputs that need a gradient (not one computed from the input
    alone, not a tower without parameters), each with its rows of the loss's gradient in the output's dtype."""
    net = tower()
    q, d = data(5)
    d = d[:, :REP]

    def encode(x: Tensor) -> tuple[Tensor, Tensor]:
        return net(x).to(torch.bfloat16), x[:, :REP].to(torch.bfloat16)  # (the second: no graph)

    def loss_fn(a: tuple[Tensor, Tensor], b: Tensor) -> Tensor:
        return info_nce((a[0] + a[1]).double(), b)

    leaves = [encode(q)[0].detach().float().requires_grad_(), encode(q)[1].float().requires_grad_()]  # (as cached)
    loss_fn((leaves[0], leaves[1]), d).backward()  # (the whole loss's gradient of the representations)
    calls: list[tuple[list[tuple[int, ...]], list[Tensor]]] = []

    def record(reps: Any, grads_: Any) -> None:
        calls.append(([tuple(r.shape) for r in reps], list(grads_)))
        assert all(r.requires_grad for r in reps)

    backward_cached([encode, nn.Identity()], [q, d], loss_fn, 3, plain_backward, record)
    assert [shapes for shapes, _ in calls] == [[(3, REP)], [(2, REP)]]
    assert all(g.dtype == torch.bfloat16 for _, gs in calls for g in gs)
    got = torch.cat([gs[0] for _, gs in calls])
    assert torch.equal(got, leaves[0].grad.to(torch.bfloat16))  # type: ignore[union-attr]
