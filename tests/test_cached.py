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
