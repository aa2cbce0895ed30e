"""``batchnorm="window"``: BatchNorm's running statistics advance once per window, with the statistics of the
window's samples pooled, against a plain float64 loop that takes each window's gradient micro-batch by
micro-batch and its running statistics from one forward of the whole window as a single batch. Through the
callback, the mixin and the Fabric helper; 1d and 2d layers, both momentum kinds (a number, and ``None``: the
cumulative average), short windows, a checkpoint inside a window, a failed window, layers left alone."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from torch import Tensor, nn
from torch.utils.data import Dataset

from lightning_accum import AccumulationMixin, AccumulationScheduler, Budget
from lightning_accum._core.batchnorm import Moments, RankMoments, WindowBatchNorm, _Rows, check_batchnorm, union
from lightning_accum.fabric import FabricAccumulator

from helpers import ResumableLoader, default_dtype, trainer, windows_over

Batch = dict[str, Tensor]


class Images(Dataset[Batch]):
    """Small 2-channel images with a scalar target (float64)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 2, 4, 4, generator=g, dtype=torch.float64) * 2 + 1
        self.y = torch.randn(n, 1, generator=g, dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Batch:
        return {"x": self.x[i], "y": self.y[i]}


def make_net(seed: int = 0) -> nn.Module:
    """A conv layer into a BatchNorm2d (momentum 0.1), then a BatchNorm1d with ``momentum=None`` (the cumulative
    average), a frozen BatchNorm1d in eval mode and one that tracks nothing."""
    torch.manual_seed(seed)
    net = nn.ModuleDict(
        {
            "conv": nn.Conv2d(2, 3, 3, padding=1),
            "bn2": nn.BatchNorm2d(3, momentum=0.1),
            "lin": nn.Linear(3, 4),
            "bn1": nn.BatchNorm1d(4, momentum=None),
            "frozen": nn.BatchNorm1d(4),
            "untracked": nn.BatchNorm1d(4, track_running_stats=False),
            "head": nn.Linear(4, 1),
        }
    ).double()
    with torch.no_grad():
        net["frozen"].running_mean.uniform_(-1, 1)
    return net


def forward(net: nn.Module, x: Tensor, inputs: dict[str, list[Tensor]] | None = None) -> Tensor:
    """The model; ``inputs``: where the reference keeps what each tracked BatchNorm layer was given."""
    return head_of(net, trunk(net, x, inputs))


def trunk(net: nn.Module, x: Tensor, inputs: dict[str, list[Tensor]] | None = None) -> Tensor:
    """The model's tracked BatchNorm layers, into features."""
    h = net["conv"](x)
    if inputs is not None:
        inputs["bn2"].append(h.detach())
    h = net["lin"](torch.relu(net["bn2"](h)).mean(dim=(2, 3)))
    if inputs is not None:
        inputs["bn1"].append(h.detach())
    return torch.relu(net["bn1"](h))


def head_of(net: nn.Module, features: Tensor) -> Tensor:
    """The rest: a frozen BatchNorm layer, one that tracks nothing, a linear head."""
    out: Tensor = net["head"](net["untracked"](net["frozen"](features)))
    return out


def loss_of(net: nn.Module, batch: Batch) -> Tensor:
    return nn.functional.mse_loss(forward(net, batch["x"]), batch["y"])


def train_mode(net: nn.Module) -> None:
    net.train()
    net["frozen"].eval()  # a frozen layer: left alone


def buffers(net: nn.Module) -> dict[str, Tensor]:
    return {name: b.detach().clone() for name, b in net.named_buffers()}


def state(net: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in net.parameters()] + list(buffers(net).values())


def max_diff(a: list[Tensor], b: list[Tensor]) -> float:
    assert len(a) == len(b)
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b, strict=True))


def reference(
    windows: list[list[Batch]],
    lr: float = 0.1,
    piece: int | None = None,
    repeat: int = 1,
    own: int = 0,
    failed_outside: str | None = None,
    forward_only: list[Batch] = (),  # type: ignore[assignment]
) -> nn.Module:
    """The plain loop: each window's gradient the mean of its micro-batches', and each BatchNorm layer's update
    one forward of that layer alone over everything the window's micro-batches gave it, as a single batch (the
    buffers put back by hand after the micro-batches' forwards). (A layer after another BatchNorm is given
    activations each micro-batch normalised by its own statistics: the window as one batch through the whole
    model would give it others; the first layer's are the same either way.) ``piece``: each batch runs in pieces
    of that many samples, each weighted by its share; ``repeat``: each piece runs that many forwards (each loss
    weighted ``1 / repeat``), all of which BatchNorm is given; ``own``: the first that many micro-batches update
    the buffers themselves, as under ``"micro-batch"``; ``failed_outside="outside"``: a training forward outside any
    micro-batch raised inside ``bn2``, which (as PyTorch's BatchNorm does) counted it in ``num_batches_tracked``
    first; ``forward_only``: batches (the same objects as in ``windows``) that run their forward but no backward (a
    ``training_step`` returning ``None``, a block making no pass; with ``piece``, the first piece's forward only),
    which count in their window's statistics and not in its gradient, the mean of the others'."""
    net = make_net()
    train_mode(net)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    seen = 0
    for window in windows:
        before: dict[str, Tensor] | None = None
        inputs: dict[str, list[Tensor]] = {"bn2": [], "bn1": []}
        trained = [b for b in window if not any(b is f for f in forward_only)]
        for batch in window:
            if seen >= own and before is None:
                before = buffers(net)
            counted = inputs if seen >= own else None
            seen += 1
            n, skipped = len(batch["x"]), not any(batch is b for b in trained)
            for i in range(0, n, piece or n):
                x, y = batch["x"][i : i + (piece or n)], batch["y"][i : i + (piece or n)]
                if skipped:  # (its forward, no backward: Lightning's skip of the batch)
                    try:
                        forward(net, x, counted)
                    except ValueError:  # (`bn1` refused one sample: what it was given counts nowhere, `bn2`'s does)
                        if counted is not None:
                            counted["bn1"].pop()
                    break
                for _ in range(repeat):
                    out = forward(net, x, counted)
                    (nn.functional.mse_loss(out, y) * len(x) / n / len(trained) / repeat).backward()
        if before is not None:
            with torch.no_grad():
                for name, b in net.named_buffers():
                    b.copy_(before[name])
                for name, given in inputs.items():
                    net[name](torch.cat(given))  # the window as one batch
        if trained:  # (a window that took no backward pass is not stepped)
            opt.step()
        opt.zero_grad()
    if failed_outside == "outside":  # a forward outside the window that `bn2` refused: PyTorch counted it
        net["bn2"].num_batches_tracked += 1
    return net


DATA = Images(44)  # 11 batches of 4 an epoch: windows of 3, 3, 3 and a short one of 2


def batches(data: Images = DATA, size: int = 4) -> list[Batch]:
    return [{"x": data.x[i : i + size], "y": data.y[i : i + size]} for i in range(0, len(data), size)]


def windows_of(k: int, epochs: int = 2) -> list[list[Batch]]:
    each = batches()
    return [each[i : i + k] for _ in range(epochs) for i in range(0, len(each), k)]


# ---------------------------------------------------------------------- the pooling itself
def test_moments_pool_exactly_as_one_batch() -> None:
    g = torch.Generator().manual_seed(1)
    parts = [torch.randn(n, 3, generator=g, dtype=torch.float64) * 5 + 1e3 for n in (2, 7, 3)]
    pooled = Moments.of(len(parts[0]), parts[0].mean(0), parts[0].var(0))
    for p in parts[1:]:
        pooled.add(len(p), p.mean(0), p.var(0))
    whole = torch.cat(parts)
    assert pooled.count == 12
    assert float((pooled.mean - whole.mean(0)).abs().max()) <= 1e-12
    assert float((pooled.variance() - whole.var(0)).abs().max()) <= 1e-9  # (values near 1e3: relative 1e-15)


# ---------------------------------------------------------------------- the callback
class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()
        self.seen: list[Tensor] = []  # what validation saw

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.net["frozen"].eval()  # (Lightning puts the module back in training mode after validation)

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        return loss_of(self.net, batch)

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self.seen.append(self.net["bn2"].running_mean.clone())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_callback_window_statistics_equal_the_whole_window_as_one_batch() -> None:
    """Windows of 3, 3, 3, 2: the parameters are the default run's (the forward is untouched),
    every buffer is the reference's; a validation inside the second window sees the first window's."""
    model = Model()
    t = trainer(callbacks=[AccumulationScheduler(3, batchnorm="window")], max_epochs=1, val_check_interval=5,
                limit_val_batches=1, num_sanity_val_steps=0)  # fmt: skip
    t.fit(model, ResumableLoader(DATA, 4), ResumableLoader(Images(4, seed=3), 4))
    ref = reference(windows_of(3, epochs=1))
    assert max_diff(state(model.net), state(ref)) <= 1e-12
    assert int(model.net["bn2"].num_batches_tracked) == 4 and model.net["bn1"].momentum is None
    # (validation after batch 4, inside the window of batches 3-5: the statistics of the window of batches 0-2)
    first = reference(windows_of(3)[:1])
    assert float((model.seen[0] - first["bn2"].running_mean).abs().max()) <= 1e-12


class SaveAt(pl.Callback):
    def __init__(self, at: int, path: Path) -> None:
        self.at, self.path = at, path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if args[-1] == self.at and trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)


def test_callback_resumed_inside_a_window_is_bit_identical(tmp_path: Path) -> None:
    path = tmp_path / "inside.ckpt"
    full = Model()
    trainer(callbacks=[AccumulationScheduler(3, batchnorm="window"), SaveAt(4, path)], max_epochs=1).fit(
        full, ResumableLoader(DATA, 4)
    )
    resumed = Model()
    trainer(callbacks=[AccumulationScheduler(3, batchnorm="window")], max_epochs=1).fit(
        resumed, ResumableLoader(DATA, 4), ckpt_path=path
    )
    assert max_diff(state(resumed.net), state(full.net)) == 0.0
    saved = torch.load(path, weights_only=False)["callbacks"]
    (held,) = [v["batchnorm"] for v in saved.values() if "batchnorm" in v]
    assert {n: s["count"] for n, s in held.items()} == {"net.bn2": 2 * 4 * 16, "net.bn1": 2 * 4}
    with pytest.warns(UserWarning, match="batchnorm='window'; this run has batchnorm='micro-batch'"):
        trainer(callbacks=[AccumulationScheduler(3)], max_epochs=1, limit_train_batches=6).fit(
            Model(), ResumableLoader(DATA, 4), ckpt_path=path
        )


def test_callback_checkpoint_of_the_other_mode_resumed(tmp_path: Path) -> None:
    """Written inside a window under one mode, resumed under the other (documented, warned): under
    ``"micro-batch"`` from a ``"window"`` checkpoint the window's partial statistics are dropped and each later
    micro-batch updates the buffers; under ``"window"`` from a ``"micro-batch"`` checkpoint the window's earlier
    micro-batches have updated the buffers already, and the window pools the later ones only."""
    path = tmp_path / "micro.ckpt"  # after batch 4: batches 3 and 4 of the window 3-5 ran
    trainer(callbacks=[AccumulationScheduler(3), SaveAt(4, path)], max_epochs=1).fit(Model(), ResumableLoader(DATA, 4))
    saved = torch.load(path, weights_only=False)["state_dict"]
    assert int(saved["net.bn2.num_batches_tracked"]) == 5  # one update per micro-batch
    resumed = Model()
    with pytest.warns(UserWarning, match="batchnorm='micro-batch'; this run has batchnorm='window'"):
        trainer(callbacks=[AccumulationScheduler(3, batchnorm="window")], max_epochs=1).fit(
            resumed, ResumableLoader(DATA, 4), ckpt_path=path
        )
    assert int(resumed.net["bn2"].num_batches_tracked) == 5 + 3  # the windows 3-5 (batch 5 only), 6-8, 9-10
    assert max_diff(state(resumed.net), state(reference(windows_of(3, epochs=1), own=5))) <= 1e-12


class Failing(Model):
    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        if batch_idx == 4:
            forward(self.net, batch["x"])  # its BatchNorm forwards ran
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def test_callback_failed_window_leaves_the_statistics_as_before_it() -> None:
    model = Failing()
    with pytest.raises(RuntimeError, match="boom"):
        trainer(callbacks=[AccumulationScheduler(3, batchnorm="window")], max_epochs=1).fit(
            model, ResumableLoader(DATA, 4)
        )
    ref = reference(windows_of(3)[:1])  # the first window stepped; the second failed at its second batch
    assert max_diff(list(buffers(model.net).values()), list(buffers(ref).values())) <= 1e-12
    assert model.net["bn2"].momentum == 0.1 and model.net["bn1"].momentum is None


def test_callback_pieces_pool_with_their_loader_batch() -> None:
    """``microbatch_size=2``: each loader batch of 4 runs as two pieces, whose statistics join its window."""
    model = Model()
    trainer(callbacks=[AccumulationScheduler(3, batchnorm="window", microbatch_size=2)], max_epochs=1).fit(
        model, ResumableLoader(DATA, 4)
    )
    assert max_diff(state(model.net), state(reference(windows_of(3, epochs=1), piece=2))) <= 1e-12


def test_window_option_refused_where_it_cannot_be_exact() -> None:
    for bad in ("window ", "Window", "micro_batch", None, 1, float("nan"), "batch"):
        with pytest.raises(ValueError, match="`batchnorm` must be 'micro-batch' or 'window'"):
            AccumulationScheduler(2, batchnorm=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="did you mean 'micro-batch'"):
        AccumulationScheduler(2, batchnorm="micro_batch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="microbatch_size='auto'"):
        AccumulationScheduler(2, batchnorm="window", microbatch_size="auto")
    with pytest.raises(ValueError, match=r"`batchnorm` must be .* \(did you mean 'window'\?\); got 'windows'"):
        MixinModel(2, batchnorm="windows")
    with pytest.raises(ValueError, match="did you mean 'window'"):
        AccumulationScheduler(2, batchnorm="Windows")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- the mixin
class MixinModel(AccumulationMixin, pl.LightningModule):
    """``way``: how each micro-batch back-propagates (``acc.backward``, or one of the mixin's several-pass ways)."""

    def __init__(self, k: int, batchnorm: Any = "window", way: str = "backward") -> None:
        super().__init__()
        self.net = make_net()
        self.way = way
        self.configure_accumulation(k, batchnorm=batchnorm)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.net["frozen"].eval()  # (Lightning puts the module back in training mode after validation)

    def training_step(self, batch: Batch, batch_idx: int) -> None:
        x, y = batch["x"], batch["y"]

        def mse(rows: slice) -> Any:
            return lambda: nn.functional.mse_loss(forward(self.net, x[rows]), y[rows])

        with self.accumulate(batch) as acc:
            if self.way == "cached":  # chunks of 2: a graph-free pass, then each chunk replayed (the one that counts)
                acc.backward_cached(
                    encoders=[lambda x: forward(self.net, x)],
                    inputs=[x],
                    loss_fn=lambda out: nn.functional.mse_loss(out, y),
                    chunk_size=2,
                )
            elif self.way == "parts":  # parts of 2, each weighted by its share
                acc.backward_microbatches(lambda part: loss_of(self.net, part), size=2)
            elif self.way == "heads":  # the trunk once, two heads of half weight each
                heads = [lambda f: nn.functional.mse_loss(head_of(self.net, f), y)] * 2
                acc.backward_heads(trunk(self.net, x), heads, weights=[0.5, 0.5])
            elif self.way == "each-halves":  # two closures, each running half of the samples
                acc.backward_each([mse(slice(0, 2)), mse(slice(2, 4))], weights=[0.5, 0.5])
            elif self.way == "each-same":  # two closures running the same samples: each forward counts
                acc.backward_each([mse(slice(None)), mse(slice(None))], weights=[0.5, 0.5])
            else:
                acc.backward(loss_of(self.net, batch))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_mixin_window_statistics_equal_the_whole_window_as_one_batch() -> None:
    model = MixinModel(3)
    trainer(max_epochs=1).fit(model, ResumableLoader(DATA, 4))
    assert max_diff(state(model.net), state(reference(windows_of(3, epochs=1)))) <= 1e-12


@pytest.mark.parametrize(
    ("way", "piece", "repeat"),
    [("cached", 2, 1), ("parts", 2, 1), ("heads", None, 1), ("each-halves", 2, 1), ("each-same", None, 2)],
)
def test_mixin_passes_count_each_forward_once(way: str, piece: int | None, repeat: int) -> None:
    """``backward_cached``'s graph-free pass adds nothing (its replay counts); ``backward_microbatches``' parts and
    ``backward_each``'s closures over different rows pool into their micro-batch; ``backward_heads`` runs the trunk
    once; ``backward_each``'s closures over the same rows each count (as the documented loop that runs them)."""
    model = MixinModel(3, way=way)
    trainer(max_epochs=1).fit(model, ResumableLoader(DATA, 4))
    assert max_diff(state(model.net), state(reference(windows_of(3, epochs=1), piece=piece, repeat=repeat))) <= 1e-12


# ---------------------------------------------------------------------- Fabric
@pytest.fixture
def float64_outputs() -> Iterator[None]:
    with default_dtype(torch.float64):
        yield


class _Wrapped(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.inner = net

    def forward(self, x: Tensor) -> Tensor:
        return forward(self.inner, x)


def fabric_run(
    k: int,
    stop: int | None = None,
    save: Path | None = None,
    resume: Path | None = None,
    fail: int | None = None,
    resave: Path | None = None,
    how: str = "after",
    twice: bool = False,
) -> nn.Module:
    """The loop a user writes; ``stop``: save after that many micro-batches and return; ``fail``: that
    micro-batch's first try raises (``how``: after its forward, before its backward; ``"inside"``: inside a
    BatchNorm layer's forward in the block; ``"outside"``: a forward before the block raises inside a layer) and
    is tried again; ``resave``: save right after loading ``resume`` (before any batch) and return; ``twice``: a
    first accumulator is made on the model, and the loop uses a second one."""
    fabric = Fabric(accelerator="cpu", devices=1, precision="64-true")
    net = _Wrapped(make_net())
    train_mode(net.inner)
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    first = FabricAccumulator(fabric, model, opt, k, batchnorm="window") if twice else None
    acc = FabricAccumulator(fabric, model, opt, k, batchnorm="window")
    assert first is None or first.progress.step == 0
    each, start = batches(), 0
    if resume is not None:
        loaded = fabric.load(resume, {"accumulation": acc, "model": model, "optimizer": opt})
        start = loaded["done"]
        if resave is not None:
            fabric.save(resave, {"accumulation": acc, "model": model, "optimizer": opt, "done": start})
            return net.inner
    done = 0
    for epoch in range(2):
        for i, batch in enumerate(each):
            if done < start:
                done += 1
                continue
            if done == fail and how == "after":
                with pytest.raises(RuntimeError, match="boom"), acc.accumulate(batch, epoch=epoch) as step:
                    model(batch["x"])
                    raise RuntimeError("boom")
            if done == fail and how == "inside":  # (one sample: `bn1` refuses it, after `bn2` ran)
                with pytest.raises(ValueError, match="more than 1 value"), acc.accumulate(batch, epoch=epoch) as step:
                    model(poison(batch))
                layer = net.inner["bn1"]  # its own state back as the block ended, before any other forward
                assert layer.momentum is None and layer.num_batches_tracked is not None
            if done == fail and how == "outside":  # (one sample of 1x1: `bn2` refuses it)
                with pytest.raises(ValueError, match="more than 1 value"):
                    model(batch["x"][:1, :, :1, :1])
            with acc.accumulate(batch, epoch=epoch, last=i == len(each) - 1) as step:
                step.backward(nn.functional.mse_loss(model(batch["x"]), batch["y"]))
            done += 1
            if done == stop:
                assert save is not None
                fabric.save(save, {"accumulation": acc, "model": model, "optimizer": opt, "done": done})
                return net.inner
    return net.inner


@pytest.mark.usefixtures("float64_outputs")
def test_fabric_window_statistics_and_resume_inside_a_window(tmp_path: Path) -> None:
    full = fabric_run(3, fail=4)  # (a micro-batch's forward that failed adds nothing)
    assert max_diff(state(full), state(reference(windows_of(3)))) <= 1e-12
    path = tmp_path / "inside.ckpt"
    fabric_run(3, stop=5, save=path)
    assert max_diff(state(fabric_run(3, resume=path)), state(full)) == 0.0
    again = tmp_path / "again.ckpt"  # saved right after the load, before any batch: the window's statistics kept
    fabric_run(3, resume=path, resave=again)
    assert max_diff(state(fabric_run(3, resume=again)), state(full)) == 0.0


# ---------------------------------------------------------------------- the object alone
def test_layers_left_alone_and_an_exception_inside_a_forward() -> None:
    net = make_net()
    train_mode(net)
    stats = WindowBatchNorm()
    stats.attach(net)
    frozen, untracked = buffers(net["frozen"]), net["untracked"].running_mean
    x = DATA.x[:4]
    stats.arm()
    forward(net, x)
    stats.accept()
    stats.commit()
    assert all(torch.equal(a, b) for a, b in zip(buffers(net["frozen"]).values(), frozen.values(), strict=True))
    assert untracked is None
    before = buffers(net)
    stats.arm()
    with pytest.raises(RuntimeError):
        net["bn1"](x[:, :3, 0, 0])  # (3 channels into a layer of 4: raises inside the forward)
    stats.discard()
    assert net["bn1"].momentum is None
    assert all(torch.equal(a, b) for a, b in zip(buffers(net).values(), before.values(), strict=True))
    stats.detach()
    net2 = copy.deepcopy(net)
    forward(net, x)  # detached: BatchNorm's own update per forward again
    forward(net2, x)
    assert all(torch.equal(a, b) for a, b in zip(buffers(net).values(), buffers(net2).values(), strict=True))


def test_sync_batchnorm_on_one_process_and_suspended_statistics() -> None:
    """A ``SyncBatchNorm`` on one process (it normalises as ``BatchNorm``; it refuses a ``num_batches_tracked`` of
    None inside its forward) pools its window; ``suspend`` hands the updates back to the layers till ``resume``."""
    net = nn.Sequential(nn.Linear(2, 3), nn.SyncBatchNorm(3, momentum=None)).double()
    ref = copy.deepcopy(net)
    stats = WindowBatchNorm()
    stats.attach(net)
    x = DATA.x[:12, :, 0, 0]
    for part in x.split(4):
        stats.arm()
        net(part)
        stats.accept()
    stats.commit()
    with torch.no_grad():
        ref(x)  # the window as one batch
    assert max_diff(list(buffers(net).values()), list(buffers(ref).values())) <= 1e-12
    stats.arm()
    stats.suspend()  # (Stochastic Weight Averaging's BatchNorm epoch: every forward its own update)
    net(x[:4])
    with torch.no_grad():
        ref(x[:4])
    stats.resume()
    net(x[4:])
    stats.accept()
    stats.commit()
    with torch.no_grad():
        ref(x[4:])
    assert int(net[1].num_batches_tracked) == 3
    assert max_diff(list(buffers(net).values()), list(buffers(ref).values())) <= 1e-12


# ---------------------------------------------------------------------- a caught failure inside a forward (issue 44)
def poison(batch: Batch) -> Tensor:
    """One sample of the batch: BatchNorm1d (``bn1``) refuses it in training mode ("Expected more than 1 value per
    channel"), after ``bn2`` (16 values per channel) ran: a forward that raises inside a layer, after another."""
    return batch["x"][:1]


class CatchesInStep(Model):
    """Batch 4's ``training_step`` runs a forward that raises inside ``bn1``, catches it and returns None (the batch
    is skipped)."""

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor | None:
        if batch_idx == 4:
            with pytest.raises(ValueError, match="more than 1 value per channel"):
                forward(self.net, poison(batch))
            return None
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        layer = self.net["bn1"]  # its own state back at the batch's end, before any other forward
        assert layer.momentum is None and layer.num_batches_tracked is not None and layer.running_var.all()


def test_callback_failed_forward_caught_in_training_step() -> None:
    """The layer's own buffers and momentum come back; the skipped batch's gradient is out of its window (batches 3
    and 5), and of its forward only what ran through counts (issue 53): ``bn2``'s statistics take the poison sample,
    ``bn1``, which refused it, nothing; training goes on equal to the reference."""
    model = CatchesInStep()
    trainer(callbacks=[AccumulationScheduler(3, batchnorm="window")], max_epochs=1).fit(model, ResumableLoader(DATA, 4))
    assert model.net["bn1"].momentum is None and model.net["bn2"].momentum == 0.1
    windows = windows_of(3, epochs=1)
    poisoned = {"x": poison(windows[1][1]), "y": windows[1][1]["y"][:1]}
    windows[1][1] = poisoned
    assert max_diff(state(model.net), state(reference(windows, forward_only=[poisoned]))) <= 1e-12


class CatchesAroundBlock(MixinModel):
    """Batch 4: a block whose forward raises inside ``bn1`` (``"inside"``), or a forward before any block that
    raises inside ``bn2`` (``"outside"``), caught around it; then the batch's block as usual."""

    def __init__(self, where: str) -> None:
        super().__init__(3)
        self.where = where

    def training_step(self, batch: Batch, batch_idx: int) -> None:
        if batch_idx == 4 and self.where == "inside":
            with pytest.raises(ValueError, match="more than 1 value per channel"), self.accumulate(batch):
                forward(self.net, poison(batch))
        if batch_idx == 4 and self.where == "outside":  # (1 sample of 1x1: `bn2` refuses it)
            with pytest.raises(ValueError, match="more than 1 value per channel"):
                forward(self.net, batch["x"][:1, :, :1, :1])
        super().training_step(batch, batch_idx)


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_mixin_failed_forward_caught_around_the_block(where: str) -> None:
    model = CatchesAroundBlock(where)
    trainer(max_epochs=1).fit(model, ResumableLoader(DATA, 4))
    assert model.net["bn1"].momentum is None and model.net["bn2"].momentum == 0.1
    assert max_diff(state(model.net), state(reference(windows_of(3, epochs=1), failed_outside=where))) <= 1e-12


@pytest.mark.usefixtures("float64_outputs")
@pytest.mark.parametrize("where", ["inside", "outside"])
def test_fabric_failed_forward_caught_around_the_block(where: str) -> None:
    """Micro-batch 4 first fails (a forward that raises inside a layer, inside the block or before it), caught by
    the loop, then runs again: equal to the reference in which it ran once."""
    net = fabric_run(3, fail=4, how=where)
    assert net["bn1"].momentum is None and net["bn2"].momentum == 0.1
    assert max_diff(state(net), state(reference(windows_of(3), failed_outside=where))) <= 1e-12


# ---------------------------------------------------------------------- forwards without a backward (issue 53)
class SkipsAfterForward(Model):
    """Batches 4, 9 and 10 (or ``skips``) run their forward in training mode and return None (Lightning skips their
    backward); with ``microbatch_size`` their first piece does, which skips the batch."""

    def __init__(self, skips: tuple[int, ...] = (4, 9, 10)) -> None:
        super().__init__()
        self.skips = skips

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor | None:
        if batch_idx in self.skips:
            forward(self.net, batch["x"])
            return None
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("size", [None, 2])
def test_callback_a_batch_returning_none_counts_its_forward_once(size: int | None) -> None:
    """Every training forward counts once: batch 4's samples join its window's statistics (batches 3-5; its gradient
    is batches 3 and 5's), and the window of batches 9 and 10, which took no backward, is not stepped but advances
    the statistics with their samples, as the documented window of no items does. (Before issue 53 both were left
    out: the run with those batches deleted.)"""
    model = SkipsAfterForward()
    callback = AccumulationScheduler(3, batchnorm="window", microbatch_size=size)
    trainer(callbacks=[callback], max_epochs=1).fit(model, ResumableLoader(DATA, 4))
    windows = windows_of(3, epochs=1)
    skipped = [windows[1][1], *windows[3]]
    assert max_diff(state(model.net), state(reference(windows, piece=size, forward_only=skipped))) <= 1e-12
    assert int(model.net["bn2"].num_batches_tracked) == 4 and callback.progress.step == 3


class FailsOnce(pl.Callback):
    """Raises once in ``on_before_optimizer_step`` of batch 5 (its forward ran, its window steps after it)."""

    def __init__(self) -> None:
        self.armed = True

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.armed and trainer.fit_loop.batch_idx == 5:
            self.armed = False
            raise RuntimeError("boom")


@pytest.mark.parametrize("schedule", [3, Budget(12, unit="samples")], ids=["k", "budget"])
def test_callback_a_batch_returning_none_trained_again_counts_once(tmp_path: Path, schedule: Any) -> None:
    """Batch 5 returns None at the end of the window of batches 3-5, and a callback before the package's raises as the
    window steps: the batch's statistics are in the window the exception's checkpoint holds, so the resumed run,
    which trains the batch again, adds nothing of it (it is marked as trained, as a batch whose gradient is in; a
    budget keeps its count, which closed the window)."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint
    from test_faults import Bind, ProcessedLoader

    data = ProcessedLoader(DATA, 4)
    callbacks = [FailsOnce(), AccumulationScheduler(schedule, batchnorm="window"), Bind(data)]
    with pytest.raises(RuntimeError, match="boom"):
        trainer(callbacks=[*callbacks, OnExceptionCheckpoint(tmp_path, "failed")], max_epochs=1,
                enable_checkpointing=True).fit(SkipsAfterForward(skips=(5,)), data)  # fmt: skip
    resumed, data = SkipsAfterForward(skips=(5,)), ProcessedLoader(DATA, 4)
    trainer(callbacks=[AccumulationScheduler(schedule, batchnorm="window"), Bind(data)], max_epochs=1).fit(
        resumed, data, ckpt_path=tmp_path / "failed.ckpt"
    )
    windows = windows_of(3, epochs=1)
    assert max_diff(state(resumed.net), state(reference(windows, forward_only=[windows[1][2]]))) <= 1e-12


class BlocksWithoutPass(MixinModel):
    """Batches 4, 9 and 10 (``skips``) run a block whose forward ran and that makes no backward pass: it does not count
    among the window's k micro-batches (batch 9's, the window's k-th, closes it); batch 10's is alone in a window that
    the epoch's end closes, with nothing to step."""

    skips: tuple[int, ...] = (4, 9, 10)

    def training_step(self, batch: Batch, batch_idx: int) -> None:
        if batch_idx not in self.skips:
            return super().training_step(batch, batch_idx)
        with self.accumulate(batch):
            forward(self.net, batch["x"])
        return None


def test_mixin_a_block_without_a_pass_counts_its_forward_once() -> None:
    model = BlocksWithoutPass(3)
    trainer(max_epochs=1).fit(model, ResumableLoader(DATA, 4))
    each = batches()
    windows = [each[0:3], each[3:7], each[7:10], each[10:11]]
    ref = reference(windows, forward_only=[each[4], each[9], each[10]])
    assert max_diff(state(model.net), state(ref)) <= 1e-12
    assert int(model.net["bn2"].num_batches_tracked) == 4 and model.accumulation_progress.step == 3


class RaisesAfterPass(pl.Callback):
    """Raises once in ``on_after_backward`` of batch 4: inside the mixin's block, after its pass (part of a window the
    block did not finish)."""

    def __init__(self) -> None:
        self.armed = True

    def on_after_backward(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.armed and trainer.fit_loop.batch_idx == 4:
            self.armed = False
            raise RuntimeError("boom")


def test_mixin_a_block_without_a_pass_kept_when_the_next_block_fails(tmp_path: Path) -> None:
    """Batch 3 runs a block without a pass (the window's only block so far), batch 4's block raises after its pass:
    no gradient of the window went in before, so the window goes on as it was, batch 3's statistics kept in it (the
    checkpoint holds them), and the resumed run, which trains batch 4 again, equals the uninterrupted one (before,
    the window was dropped with batch 3's statistics, silently: nothing was said to be lost)."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint
    from test_faults import Bind, ProcessedLoader

    class SkipsThree(BlocksWithoutPass):
        skips = (3,)

    data = ProcessedLoader(DATA, 4)
    with pytest.raises(RuntimeError, match="boom"):
        trainer(callbacks=[RaisesAfterPass(), Bind(data), OnExceptionCheckpoint(tmp_path, "failed")], max_epochs=1,
                enable_checkpointing=True).fit(SkipsThree(3), data)  # fmt: skip
    resumed, data = SkipsThree(3), ProcessedLoader(DATA, 4)
    trainer(callbacks=[Bind(data)], max_epochs=1).fit(resumed, data, ckpt_path=tmp_path / "failed.ckpt")
    each = batches()
    ref = reference([each[0:3], each[3:7], each[7:10], each[10:11]], forward_only=[each[3]])
    assert max_diff(state(resumed.net), state(ref)) <= 1e-12


@pytest.mark.usefixtures("float64_outputs")
def test_fabric_block_without_a_backward_is_refused_and_its_window_left_out_with_its_statistics() -> None:
    """A Fabric block must make a ``step.backward`` (a backward around it cannot be seen): one that makes none is
    refused and its window left out, its statistics with its gradient (the documented exception to the count-once
    rule); the loop that goes on starts a clean window."""
    fabric = Fabric(accelerator="cpu", devices=1, precision="64-true")
    net = _Wrapped(make_net())
    train_mode(net.inner)
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    acc = FabricAccumulator(fabric, model, opt, 3, batchnorm="window")
    each = batches()
    for batch in each[:4]:
        with acc.accumulate(batch) as step:
            step.backward(nn.functional.mse_loss(model(batch["x"]), batch["y"]))
    stepped = buffers(net.inner)
    refused = pytest.raises(RuntimeError, match=r"made no `step\.backward")
    with pytest.warns(UserWarning, match="was left out"), refused, acc.accumulate(each[4]):
        model(each[4]["x"])
    assert max_diff(list(buffers(net.inner).values()), list(stepped.values())) == 0.0
    for batch in each[5:8]:
        with acc.accumulate(batch) as step:
            step.backward(nn.functional.mse_loss(model(batch["x"]), batch["y"]))
    ref = reference([each[0:3], each[5:8]])  # (the window of batches 3 and 4 left out: no step, no statistics)
    assert max_diff(state(net.inner), state(ref)) <= 1e-12


class SWAModel(Model):
    """``Model`` for Lightning's ``StochasticWeightAveraging`` (whose last epoch runs every batch forward only), without
    the layer that tracks nothing (which SWA's reset of the statistics refuses)."""

    def __init__(self) -> None:
        super().__init__()
        self.net["untracked"] = nn.Identity()


def test_swa_batchnorm_epoch_in_pieces_pools_each_loader_batch() -> None:
    """SWA's BatchNorm epoch under ``microbatch_size=2`` and ``"window"``: one BatchNorm update per loader batch of 4,
    with its pieces' statistics pooled, as ``torch.optim.swa_utils.update_bn`` over the loader's batches gives (the
    first layer; the second is given activations each piece normalised by its own statistics: ``update_bn`` of it
    over what it was given, per loader batch). Before issue 53 each piece updated the buffers itself (a variance
    averaged over pieces of 2 samples)."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    model = SWAModel()
    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2)
    callback = AccumulationScheduler(3, batchnorm="window", microbatch_size=2)
    trainer(callbacks=[callback, swa], max_epochs=2).fit(model, ResumableLoader(DATA, 4))
    ref = copy.deepcopy(model.net)
    train_mode(ref)
    loader = [(b["x"],) for b in batches()]
    torch.optim.swa_utils.update_bn(loader, nn.Sequential(ref["conv"], ref["bn2"]))
    given: dict[str, list[Tensor]] = {"bn2": [], "bn1": []}
    with torch.no_grad():
        for (x,) in loader:
            for part in x.split(2):
                trunk(copy.deepcopy(ref), part, given)  # (a copy: its buffers are not the reference's)
    pairs = [(torch.cat(given["bn1"][i : i + 2]),) for i in range(0, len(given["bn1"]), 2)]
    torch.optim.swa_utils.update_bn(pairs, ref["bn1"])
    for name in ("bn2", "bn1"):
        assert max_diff(list(buffers(model.net[name]).values()), list(buffers(ref[name]).values())) <= 1e-12, name
    assert int(model.net["bn2"].num_batches_tracked) == len(loader)


# ---------------------------------------------------------------------- hooks that outlive their owner (issue 44)
def plain_loop_updates_as_pytorch(net: nn.Module) -> None:
    """Forwards in training mode after the fit (a plain loop), then ``update_bn``: BatchNorm's own updates, as on a
    fresh copy of the same state that no package ever hooked."""
    fresh = make_net()
    fresh.load_state_dict(net.state_dict())
    for m in (net, fresh):
        train_mode(m)
        with torch.no_grad():
            for batch in batches()[:3]:
                forward(m, batch["x"])
    assert max_diff(list(buffers(net).values()), list(buffers(fresh).values())) == 0.0
    assert int(net["bn2"].num_batches_tracked) == int(fresh["bn2"].num_batches_tracked)
    loader = [(b["x"],) for b in batches()[:2]]
    for m in (net, fresh):
        torch.optim.swa_utils.update_bn(loader, _Wrapped(m))
    assert max_diff(list(buffers(net).values()), list(buffers(fresh).values())) == 0.0


def test_hooks_do_nothing_after_a_fit_ends_or_fails() -> None:
    model = Model()  # a fit that ends
    trainer(callbacks=[AccumulationScheduler(3, batchnorm="window")], max_epochs=1).fit(model, ResumableLoader(DATA, 4))
    plain_loop_updates_as_pytorch(model.net)
    counted = int(model.net["bn2"].num_batches_tracked)
    trainer(max_epochs=1).fit(model, ResumableLoader(DATA, 4))  # a later fit under "micro-batch": every forward
    assert int(model.net["bn2"].num_batches_tracked) == counted + 11
    failed = Failing()  # a fit an exception ends
    with pytest.raises(RuntimeError, match="boom"):
        trainer(callbacks=[AccumulationScheduler(3, batchnorm="window")], max_epochs=1).fit(
            failed, ResumableLoader(DATA, 4)
        )
    plain_loop_updates_as_pytorch(failed.net)
    mixin = MixinModel(3)
    trainer(max_epochs=1).fit(mixin, ResumableLoader(DATA, 4))
    plain_loop_updates_as_pytorch(mixin.net)


@pytest.mark.usefixtures("float64_outputs")
def test_fabric_hooks_do_nothing_after_the_loop_and_a_second_accumulator_takes_over() -> None:
    """A loop's ``FabricAccumulator`` stays alive after it: its hooks act inside its blocks only. A second one made
    on the same model takes the layers over: the two never nest their hooks (equal to the reference)."""
    net = fabric_run(3, twice=True)
    assert max_diff(state(net), state(reference(windows_of(3)))) <= 1e-12
    plain_loop_updates_as_pytorch(net)


def test_an_earlier_owner_left_attached_is_taken_over() -> None:
    """An owner whose hooks are still on the model (never detached) and a fit with a new callback: the new owner
    takes the layers over, and the fit equals the reference."""
    model = Model()
    WindowBatchNorm().attach(model.net)
    trainer(callbacks=[AccumulationScheduler(3, batchnorm="window")], max_epochs=1).fit(model, ResumableLoader(DATA, 4))
    assert max_diff(state(model.net), state(reference(windows_of(3, epochs=1)))) <= 1e-12


class Teacher(Model):
    """From batch 2, a deep copy of the net (as ``AveragedModel``, an EMA teacher, weight-averaging callbacks make
    them) runs in training mode inside every ``training_step``, beside a fresh net of the same state that no package
    ever hooked; after the fit, both run a plain loop and ``update_bn``."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: tuple[nn.Module, nn.Module] | None = None

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        if batch_idx == 2:
            copied, fresh = copy.deepcopy(self.net), make_net()
            fresh.load_state_dict(copied.state_dict())
            train_mode(fresh)
            self.copies = (copied, fresh)
        if self.copies is not None:
            with torch.no_grad():
                for m in self.copies:
                    forward(m, batch["x"])
        return super().training_step(batch, batch_idx)


def test_a_deep_copy_during_the_fit_is_plain_batchnorm() -> None:
    """The copy's BatchNorm updates as a fresh model's, and the original's window statistics are unaffected."""
    model = Teacher()
    trainer(callbacks=[AccumulationScheduler(3, batchnorm="window")], max_epochs=1).fit(model, ResumableLoader(DATA, 4))
    assert max_diff(state(model.net), state(reference(windows_of(3, epochs=1)))) <= 1e-12
    assert model.copies is not None
    copied, fresh = model.copies
    assert max_diff(list(buffers(copied).values()), list(buffers(fresh).values())) == 0.0
    assert int(copied["bn2"].num_batches_tracked) == 9 + 0  # (the original's 0 windows at batch 2, 9 forwards)
    plain_loop_updates_as_pytorch(copied)


# ---------------------------------------------------------------------- a forward outside any micro-batch (issue 44)
class Probes(Model):
    """After every batch (its backward, and at a window's last its step, done), a training-mode forward of a probe
    batch: outside the window, BatchNorm's own update."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            forward(self.net, PROBE)


PROBE = Images(6, seed=5).x


def probed_reference(windows: list[list[Batch]], lr: float = 0.1) -> nn.Module:
    """The reference with the probe: the buffers the package leaves between micro-batches (``own``) take the probe's
    update after each micro-batch; a window's update starts from them."""
    net = make_net()
    train_mode(net)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    for window in windows:
        own = buffers(net)
        inputs: dict[str, list[Tensor]] = {"bn2": [], "bn1": []}
        for j, batch in enumerate(window):
            out = forward(net, batch["x"], inputs)
            (nn.functional.mse_loss(out, batch["y"]) / len(window)).backward()
            with torch.no_grad():
                for name, b in net.named_buffers():
                    b.copy_(own[name])
                if j == len(window) - 1:
                    for name, given in inputs.items():
                        net[name](torch.cat(given))
                    opt.step()
                    opt.zero_grad()
                forward(net, PROBE)
            own = buffers(net)
    return net


def test_a_forward_outside_the_micro_batch_is_batchnorms_own_update() -> None:
    model = Probes()
    trainer(callbacks=[AccumulationScheduler(3, batchnorm="window")], max_epochs=1).fit(model, ResumableLoader(DATA, 4))
    assert max_diff(state(model.net), state(probed_reference(windows_of(3, epochs=1)))) <= 1e-12


# ---------------------------------------------------------------------- the mixin's window groups (issue 44)
class TwoWindows(AccumulationMixin, pl.LightningModule):
    """Two optimizers, a window each (refused under ``batchnorm="window"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()
        self.configure_accumulation(1, batchnorm="window")

    def training_step(self, batch: Batch, batch_idx: int) -> None:
        for i in (0, 1):
            with self.accumulate(batch, optimizer=i) as acc:
                acc.backward(loss_of(self.net, batch))

    def configure_optimizers(self) -> Any:
        params = list(self.net.parameters())
        return torch.optim.SGD(params[:2], lr=0.1), torch.optim.SGD(params[2:], lr=0.1)


def test_mixin_window_of_some_optimizers_refused_before_anything_changes() -> None:
    model = TwoWindows()
    before = state(model.net)
    with pytest.raises(ValueError, match=r"batchnorm='window'.*one window of every optimizer.*optimizers \[0\]"):
        trainer(max_epochs=1).fit(model, ResumableLoader(DATA, 4))
    assert max_diff(state(model.net), before) == 0.0
    assert all(p.grad is None or not p.grad.any() for p in model.net.parameters())


def test_a_layer_whose_forward_raised_is_put_back_at_its_next_forward() -> None:
    """Inside one micro-batch, a forward that raises inside the layer (caught) and then one that runs: the layer's
    own buffers come back before the second swaps them, which alone goes in (one BatchNorm update of its batch)."""
    layer = nn.BatchNorm1d(4, momentum=None).double()
    ref = copy.deepcopy(layer)
    stats = WindowBatchNorm()
    stats.attach(layer)
    x = DATA.x[:6, :, :2, 0].reshape(6, 4)
    stats.arm()
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        layer(x[:1])
    layer(x)
    stats.accept()
    stats.commit()
    with torch.no_grad():
        ref(x)
    assert layer.momentum is None
    assert max_diff(list(buffers(layer).values()), list(buffers(ref).values())) <= 1e-12


def test_two_owners_armed_together_never_nest() -> None:
    """Two owners attached to one model, both in a micro-batch (two accumulators driven side by side): the second
    took the layers over, so one window update lands, the second's; the first's commit changes nothing."""
    net = make_net()
    train_mode(net)
    ref = copy.deepcopy(net)
    first, second = WindowBatchNorm(), WindowBatchNorm()
    first.attach(net)
    second.attach(net)
    for x in DATA.x[:12].split(4):
        first.arm()
        second.arm()
        forward(net, x)
        first.accept()
        second.accept()
    second.commit()
    first.commit()
    with torch.no_grad():
        trunk(ref, DATA.x[:12])  # (the first layer's window as one batch; the second's input differs: not compared)
    assert max_diff(list(buffers(net["bn2"]).values()), list(buffers(ref["bn2"]).values())) <= 1e-12
    assert int(net["bn1"].num_batches_tracked) == 1


def test_an_attached_model_pickles_and_is_freed_with_its_owner() -> None:
    """A model pickled while hooked comes back with inert hooks (plain BatchNorm); once its owner is dropped (a
    ``FabricAccumulator`` garbage-collected), nothing of the package keeps the model alive."""
    import gc
    import pickle
    import weakref

    net = make_net()
    train_mode(net)
    stats = WindowBatchNorm()
    stats.attach(net)
    plain_loop_updates_as_pytorch(pickle.loads(pickle.dumps(net)))
    layer = weakref.ref(net["bn2"])
    del stats, net
    gc.collect()
    assert layer() is None


@pytest.mark.parametrize(
    ("dtype", "offset", "bound"),
    [(torch.bfloat16, 0.0, 1e-2), (torch.float16, 0.0, 1e-3), (torch.float32, 0.0, 1e-6), (torch.float32, 3e3, 1e-4)],
)
def test_low_precision_buffers_within_the_documented_figures(dtype: torch.dtype, offset: float, bound: float) -> None:
    """The guide's limits: each micro-batch's statistics are written in the layer's dtype before the float64 pooling.
    A window of 8 micro-batches of 16 samples, 32 channels: the variance's relative error against the window's float64
    variance (measured 4.7e-3 bf16, 4.7e-4 float16, 7.7e-8 float32, 2.6e-5 float32 with a mean offset of 3000)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, 32, generator=g, dtype=torch.float64) * 2 + offset
    layer = nn.BatchNorm1d(32, momentum=None).to(dtype)
    stats = WindowBatchNorm()
    stats.attach(layer)
    for part in x:
        stats.arm()
        layer(part.to(dtype))
        stats.accept()
    stats.commit()
    want = x.reshape(-1, 32).var(0)
    assert layer.running_var is not None
    assert float(((layer.running_var.double() - want).abs() / want).max()) <= bound


def test_rows_shared_by_the_layers_and_the_forwards_they_do_not_serve() -> None:
    """Each layer's first forward of a micro-batch writes into the rows ``arm`` made for all the layers (one
    allocation); a second forward of a layer, a lazy layer before its first forward and a layer in another dtype get
    blocks of their own; a model whose buffers were replaced (``.double()``) is planned again. Each layer's window is
    every sample it saw in the window, as one batch (``momentum=None`` after one window: the buffers are it)."""
    g = torch.Generator().manual_seed(5)
    net = nn.ModuleDict({
        "a": nn.BatchNorm1d(3, momentum=None), "lazy": nn.LazyBatchNorm1d(momentum=None),
        "wide": nn.BatchNorm1d(3, momentum=None).double(),
    })  # fmt: skip
    stats = WindowBatchNorm()
    stats.attach(net)
    for dtype, bound in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        seen: dict[str, list[Tensor]] = {"a": [], "lazy": [], "wide": []}
        for _ in range(3):  # a window of three micro-batches
            stats.arm()
            for name, n in (("a", 4), ("a", 6), ("lazy", 5), ("wide", 3)):  # (layer `a` twice)
                x = torch.randn(n, 3, generator=g, dtype=torch.float64) * 3 + 2
                x = x if name == "wide" else x.to(dtype)
                net[name](x)
                seen[name].append(x.double())
            blocks = {name: [block for _, block in forwards] for name, forwards in stats._pending.items()}
            shared = blocks["a"][0]  # (the rows `arm` made: layer `a`'s first forward, not its second)
            assert isinstance(shared, _Rows) and all(isinstance(b, Tensor) for b in blocks["a"][1:])
            # (in float32, `wide` is float64 and `lazy` had no buffers when the rows were planned: blocks of their own;
            # after `.double()`, every layer's first forward writes into the one block)
            assert [isinstance(blocks[name][0], _Rows) for name in ("lazy", "wide")] == [dtype == torch.float64] * 2
            assert shared.plan[0] == (["a", "lazy", "wide"] if dtype == torch.float64 else ["a"])
            stats.accept()
        stats.commit()
        for name, xs in seen.items():
            whole = torch.cat(xs)
            layer = net[name]
            assert float((layer.running_mean.double() - whole.mean(0)).abs().max()) <= bound, (name, dtype)
            assert float((layer.running_var.double() - whole.var(0)).abs().max()) <= 10 * bound, (name, dtype)
            layer.reset_running_stats()
        net.double()  # (the next window: every buffer replaced, in float64)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_sync_batchnorm_window_resumed_on_two_ranks_gathers_one_row_length_from_each(
    monkeypatch: pytest.MonkeyPatch, rank: int
) -> None:
    """Resumed inside a window, a synchronising ``SyncBatchNorm``'s statistics go to rank 0 only; a checkpoint
    saved before the next forward gathers every rank's row for the layer, of one length (count, mean, m2: 1 + 2 x 3
    numbers; the all-gather needs one size on every rank), and rank 0's holds the loaded window exactly (2 ranks
    faked: the other rank sends its row)."""
    import torch.distributed as dist

    width = 3
    mean, m2 = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64), torch.tensor([3.0, 0.25, 1.0], dtype=torch.float64)
    loaded = torch.cat([torch.tensor([4.0], dtype=torch.float64), mean, m2])
    other = torch.zeros(1 + 2 * width, dtype=torch.float64) if rank == 0 else loaded
    rows: list[int] = []

    def all_gather(out: list[Tensor], flat: Tensor, group: Any = None) -> None:
        rows.append(flat.numel())
        assert flat.shape == other.shape, "every rank must give the all-gather one size"
        out[rank].copy_(flat)
        out[1 - rank].copy_(other)

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    stats = WindowBatchNorm()
    stats.attach(nn.Sequential(nn.SyncBatchNorm(width)).double())
    stats._groups["0"] = "the group"  # (what `attach` finds under a process group of 2 ranks)
    stats.load_state_dict({"0": {"count": 4, "mean": mean, "m2": m2}})
    saved = stats.state_dict()
    assert rows == [1 + 2 * width]
    if rank == 0:
        assert saved["0"]["count"] == 4
        assert torch.allclose(saved["0"]["mean"], mean, rtol=0, atol=1e-15)
        assert torch.allclose(saved["0"]["m2"], m2, rtol=0, atol=1e-15)
    else:
        assert saved == {}


# ---------------------------------------------------------------------- the module's rules, one by one (issue 53)
@pytest.mark.parametrize(
    ("value", "hint"),
    [
        ("Window", "window"), ("windows", "window"), (" WINDOW ", "window"), ("wind", "window"),
        ("micro_batch", "micro-batch"), ("Micro Batch", "micro-batch"), ("microbatch", "micro-batch"),
        ("batch", None), ("win", None), ("", None), ("per-window", "window"),
        (None, None), (1, None), (float("nan"), None), (b"window", None), (["window"], None),
    ],
)  # fmt: skip
def test_check_batchnorm_names_the_argument_and_the_nearest_mode(value: object, hint: str | None) -> None:
    """Every mode passes as given; anything else is refused with the argument named, the value, and the nearest mode
    where a string is a near miss (its case, ``_`` or a space for ``-``, a letter off), none where it is not."""
    for mode in ("micro-batch", "window"):
        assert check_batchnorm(mode) == mode
    near = "" if hint is None else f" (did you mean {hint!r}?)"
    with pytest.raises(ValueError) as info:
        check_batchnorm(value)
    assert str(info.value) == f"`batchnorm` must be 'micro-batch' or 'window'{near}; got {value!r}."


def f64(*values: float) -> Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_moments_by_hand() -> None:
    """Two samples [1, 2] (mean 1.5, variance 0.5, m2 0.5), then one of 4 as an m2 of 0, then [0, 2] as a variance
    of 2: counts 2, 3, 5; means 1.5, 7/3, 9/5; m2 by hand (sum of squared deviations of all the samples)."""
    given = torch.tensor([1.5, -2.0])  # (float32: the moments keep a float64 copy of theirs)
    m = Moments.of(2, given, torch.tensor([0.5, 8.0]))
    given.fill_(100.0)
    assert m.count == 2 and m.mean.dtype == m.m2.dtype == torch.float64
    assert m.mean.tolist() == [1.5, -2.0] and m.m2.tolist() == [0.5, 8.0]
    m.add(1, torch.tensor([4.0, -2.0]), f64(0.0, 0.0), m2=True)
    assert m.count == 3
    assert torch.allclose(m.mean, f64(7 / 3, -2.0), rtol=0, atol=1e-15)
    samples = f64(1, 2, 4)
    assert torch.allclose(m.m2, f64(float(((samples - samples.mean()) ** 2).sum()), 8.0), rtol=0, atol=1e-14)
    m.add(2, f64(1.0, -2.0), f64(2.0, 0.0))  # [0, 2]: its unbiased variance, 2 (m2 2 x (2 - 1))
    samples = f64(1, 2, 4, 0, 2)
    assert m.count == 5
    assert torch.allclose(m.mean, f64(9 / 5, -2.0), rtol=0, atol=1e-15)
    assert torch.allclose(m.variance(), f64(float(samples.var()), 8.0 / 4), rtol=0, atol=1e-14)
    moved = m.to(torch.device("cpu"))
    assert moved.count == 5 and torch.equal(moved.mean, m.mean) and torch.equal(moved.m2, m.m2)
    fresh = torch.tensor([3.0], dtype=torch.float64)
    assert Moments.of(4, fresh, f64(2.0), fresh=True).mean is fresh  # (a tensor of the caller's own: kept)
    assert Moments.of(4, fresh, f64(2.0), fresh=True).m2.tolist() == [6.0]


@pytest.mark.parametrize("m2", [False, True])
def test_moments_pool_groups_of_any_size_as_one_batch(m2: bool) -> None:
    """Groups of 1 to 9 samples (a group of one: variance 0), pooled one by one in either spread, against the float64
    statistics of all of them at once."""
    g = torch.Generator().manual_seed(7)
    parts = [torch.randn(n, 2, generator=g, dtype=torch.float64) * 3 - 5 for n in (3, 1, 9, 2, 1, 5)]
    pooled = Moments.of(3, parts[0].mean(0), parts[0].var(0))
    for p in parts[1:]:
        var = p.var(0) if len(p) > 1 else torch.zeros(2, dtype=torch.float64)
        pooled.add(len(p), p.mean(0), var * (len(p) - 1) if m2 else var, m2=m2)
    whole = torch.cat(parts)
    assert pooled.count == len(whole) == 21
    assert torch.allclose(pooled.mean, whole.mean(0), rtol=0, atol=1e-13)
    assert torch.allclose(pooled.m2, ((whole - whole.mean(0)) ** 2).sum(0), rtol=0, atol=1e-11)
    assert torch.allclose(pooled.variance(), whole.var(0), rtol=0, atol=1e-12)


def test_rank_moments_and_their_union_are_the_windows_over_all_ranks() -> None:
    """Two ranks, a window of three ``SyncBatchNorm`` forwards of uneven sizes on each: each forward's statistics
    those of both ranks' samples (what the kernel writes on both), each rank's ``RankMoments`` weighted by its own
    count; ``union`` of their rows is the window's count, mean and m2 over everything, against float64 by hand."""
    g = torch.Generator().manual_seed(3)
    sizes = ((2, 5), (4, 1), (3, 3))  # (rank 0's, rank 1's) of each forward
    xs = [[torch.randn(n, 2, generator=g, dtype=torch.float64) * 2 + 1 for n in forward] for forward in sizes]
    parts: list[RankMoments] = []
    for rank in (0, 1):
        part = None
        for forward in xs:
            both = torch.cat(forward)
            count = len(forward[rank])
            if part is None:
                part = RankMoments.of(count, both.mean(0).float(), both.var(0).float())
                assert part.mean.dtype == torch.float64 and part.once.dtype == torch.float64
                assert torch.equal(part.m2, part.once * count)
            else:
                part.add(count, both.mean(0), both.var(0))
        assert part is not None and part.count == sum(len(forward[rank]) for forward in xs)
        assert torch.allclose(part.once, sum(torch.cat(f).var(0) for f in xs), rtol=0, atol=1e-6)  # type: ignore[arg-type]
        moved = part.to(torch.device("cpu"))
        assert isinstance(moved, RankMoments) and torch.equal(moved.once, part.once) and moved.count == part.count
        parts.append(part)
    with pytest.raises(TypeError, match="a mean and an unbiased variance each"):
        parts[0].add(1, f64(0.0, 0.0), f64(0.0, 0.0), m2=True)
    rows = torch.stack([torch.cat([f64(p.count), p.mean, p.m2]) for p in parts])
    count, mean, m2 = union(rows, parts[0].once)
    whole = torch.cat([x for forward in xs for x in forward])
    assert int(count) == len(whole) == 18
    assert torch.allclose(mean, whole.mean(0), rtol=0, atol=1e-6)
    assert torch.allclose(m2 / (count - 1), whole.var(0), rtol=0, atol=1e-5)  # (the forwards' statistics in float32)


def test_union_by_hand() -> None:
    """Rank 0: 1 sample; rank 1: 3, of one forward over [1, 2, 4, 7] (mean 3.5, m2 21, variance 7): each rank's row
    ``[count, mean, count x variance]`` from the union's statistics; the union is the count 4, the mean 3.5 and the
    m2 21 (1 x 7 + 3 x 7 - 7 once) in each of two channels (the second the first doubled: m2 84)."""
    rows = f64(1, 3.5, 7.0, 7, 28).reshape(1, 5).repeat(2, 1)
    rows[1, 0], rows[1, 3:] = 3, f64(21, 84)
    count, mean, m2 = union(rows, f64(7, 28))
    assert float(count) == 4.0 and mean.tolist() == [3.5, 7.0] and m2.tolist() == [21.0, 84.0]
    rows[:, 1:3] = f64(3.0, 4.0, 6.0, 7.0).reshape(2, 2)  # (means that differ: 3 and 6 weighted 1 and 3)
    count, mean, m2 = union(rows, f64(7, 28))
    assert mean.tolist() == [5.25, 6.25]
    assert torch.allclose(m2, f64(21 + 1 * 2.25**2 + 3 * 0.75**2, 84 + 1 * 2.25**2 + 3 * 0.75**2), rtol=0, atol=1e-12)


def test_rows_are_one_block_of_zeros_split_by_layer_and_pooled_as_one_copy() -> None:
    rows = _Rows(torch.zeros(1, dtype=torch.float32), (["a", "b"], [2, 2, 3, 3], []))
    assert rows.data.shape == (10,) and rows.data.dtype == torch.float32 and not rows.data.any()
    free = rows.free()
    assert list(free) == ["a", "b"]
    for name, value in (("a", 1.0), ("b", 2.0)):
        mean, var, owner = free[name]
        assert owner is rows
        mean.fill_(value)
        var.fill_(-value)
    assert rows.data.tolist() == [1, 1, -1, -1, 2, 2, 2, -2, -2, -2]  # (views of the one block, in the plan's order)
    mean_b, var_b = rows.pooled("b")
    assert mean_b.dtype == torch.float64 and mean_b.tolist() == [2, 2, 2] and var_b.tolist() == [-2, -2, -2]
    rows.data.zero_()  # (a copy of ours: the block may change after)
    assert rows.pooled("a")[0].tolist() == [1, 1] and rows.pooled("a")[1].tolist() == [-1, -1]
    assert rows.pooled("b")[0] is mean_b  # (converted once, at the first ask)


def window_net() -> nn.ModuleDict:
    return nn.ModuleDict({"m": nn.BatchNorm1d(2, momentum=0.25), "cum": nn.BatchNorm1d(2, momentum=None)}).double()


def run_window(stats: WindowBatchNorm, net: nn.Module, parts: list[Tensor]) -> None:
    for part in parts:
        stats.arm()
        for layer in net.children():
            layer(part)
        stats.accept()


def test_commit_updates_once_per_window_with_its_momentum_or_the_cumulative_average() -> None:
    """Three windows: a layer of momentum 0.25 (``(1 - m) old + m stat``) and one of ``None`` (the mean of the
    windows' statistics so far), each window's statistics those of all its samples, against float64 by hand;
    ``num_batches_tracked`` counts windows; a discarded window changes nothing and adds to no later window."""
    g = torch.Generator().manual_seed(11)
    net = window_net()
    stats = WindowBatchNorm()
    stats.attach(net)
    assert stats.attached
    mean, var = torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    cum_mean, cum_var = torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    for window in range(3):
        x = torch.randn(9, 2, generator=g, dtype=torch.float64) * (window + 1) + window
        run_window(stats, net, list(x.split([4, 2, 3])))
        if window == 1:
            stats.discard()
            continue
        for name in ("m", "cum"):  # (nothing changes before the window steps)
            assert int(net[name].num_batches_tracked) == min(window, 1)
        stats.commit()
        mean, var = 0.75 * mean + 0.25 * x.mean(0), 0.75 * var + 0.25 * x.var(0)
        n = min(window, 1) + 1
        cum_mean, cum_var = cum_mean + (x.mean(0) - cum_mean) / n, cum_var + (x.var(0) - cum_var) / n
        for name, (want_mean, want_var) in (("m", (mean, var)), ("cum", (cum_mean, cum_var))):
            layer = net[name]
            assert int(layer.num_batches_tracked) == n
            assert torch.allclose(layer.running_mean, want_mean, rtol=0, atol=1e-13), (name, window)
            assert torch.allclose(layer.running_var, want_var, rtol=0, atol=1e-12), (name, window)
    assert net["m"].momentum == 0.25 and net["cum"].momentum is None
    stats.commit()  # (an empty window: nothing)
    assert int(net["m"].num_batches_tracked) == 2


def _window_of_one(x: Tensor) -> tuple[nn.BatchNorm1d, nn.BatchNorm1d, WindowBatchNorm]:
    """A float64 layer (``momentum=None``), a fresh copy of it, and its window statistics holding ``x`` accepted."""
    layer = nn.BatchNorm1d(2, momentum=None).double()
    ref = copy.deepcopy(layer)
    stats = WindowBatchNorm()
    stats.attach(layer)
    stats.arm()
    layer(x)
    stats.accept()
    return layer, ref, stats


def test_what_joins_the_window_accepted_held_dropped_uncounted_and_one_update() -> None:
    """Micro-batches accepted join the window; dropped ones do not; finished parts ``hold`` keeps join it when the
    micro-batch is cut short (``accept_held``) or accepted; forwards ``uncounted`` add nothing; ``one_update`` is one
    update of its forwards alone with the window kept aside. Against one forward of the samples that count, on a
    fresh copy of the layer (``momentum=None``: after one update, the buffers are those samples' statistics)."""
    g = torch.Generator().manual_seed(2)
    xs = list(torch.randn(8, 3, 2, generator=g, dtype=torch.float64) * 2 + 1)
    layer, ref, stats = _window_of_one(xs[0])  # in
    stats.arm()
    layer(xs[1])
    stats.drop_pending()  # out
    stats.arm()
    layer(xs[2])
    stats.hold()  # a finished piece: in
    layer(xs[3])
    stats.accept()  # in, with the piece held
    stats.arm()
    layer(xs[4])
    stats.hold()  # in (the micro-batch cut short after it)
    layer(xs[5])  # out
    stats.accept_held()
    stats.drop_pending()
    stats.arm()
    with stats.uncounted():
        layer(xs[6])  # out (and the buffers untouched)
    stats.accept()
    with stats.one_update():
        layer(xs[7])  # an update of its own
    with torch.no_grad():
        ref(xs[7])
    assert torch.allclose(layer.running_mean, ref.running_mean, rtol=0, atol=1e-14)
    assert torch.allclose(layer.running_var, ref.running_var, rtol=0, atol=1e-13)
    assert int(layer.num_batches_tracked) == 1
    stats.commit()
    with torch.no_grad():
        ref(torch.cat([xs[i] for i in (0, 2, 3, 4)]))
    assert int(layer.num_batches_tracked) == 2
    assert torch.allclose(layer.running_mean, ref.running_mean, rtol=0, atol=1e-13)
    assert torch.allclose(layer.running_var, ref.running_var, rtol=0, atol=1e-13)


def test_a_forward_outside_a_micro_batch_or_suspended_is_batchnorms_own() -> None:
    """Before ``arm``, after ``accept``, after ``disarm`` and while suspended, each training forward updates the
    layer as plain BatchNorm does (an unhooked copy given the same forwards); in a micro-batch, nothing changes
    before ``commit``."""
    g = torch.Generator().manual_seed(4)
    xs = list(torch.randn(6, 5, 2, generator=g, dtype=torch.float64))
    layer = nn.BatchNorm1d(2).double()
    ref = copy.deepcopy(layer)
    stats = WindowBatchNorm()
    stats.attach(layer)
    layer(xs[0])  # (never armed)
    stats.arm()
    stats.suspend()
    layer(xs[1])
    stats.resume()
    before = buffers(layer)
    layer(xs[2])  # (armed: the window's)
    assert all(torch.equal(a, b) for a, b in zip(buffers(layer).values(), before.values(), strict=True))
    assert layer.momentum == 0.1
    stats.accept()
    layer(xs[3])  # (accepted: the hooks rest)
    stats.arm()
    stats.disarm()
    layer(xs[4])
    with torch.no_grad():
        for i in (0, 1, 3, 4):
            ref(xs[i])
    assert max_diff(list(buffers(layer).values()), list(buffers(ref).values())) == 0.0
    stats.commit()
    with torch.no_grad():
        ref(xs[2])
    assert max_diff(list(buffers(layer).values()), list(buffers(ref).values())) <= 1e-14


def test_the_windows_statistics_through_a_checkpoint_and_a_detach() -> None:
    """``state_dict`` holds the open window's count, mean and m2 by layer; loaded into a fresh owner before its
    ``attach`` or after, or kept over a ``detach`` and an ``attach`` again, the window goes on where it was (the
    buffers as one forward of all its samples); a checkpoint naming a layer the model lacks is refused, naming it."""
    g = torch.Generator().manual_seed(9)
    xs = list(torch.randn(4, 3, 2, generator=g, dtype=torch.float64) * 3)
    layer = nn.BatchNorm1d(2, momentum=None).double()
    stats = WindowBatchNorm()
    stats.attach(nn.Sequential(layer))
    run_window(stats, nn.Sequential(layer), xs[:2])
    saved = stats.state_dict()
    whole = torch.cat(xs[:2])
    assert list(saved) == ["0"] and saved["0"]["count"] == 6
    assert torch.allclose(saved["0"]["mean"], whole.mean(0), rtol=0, atol=1e-14)
    assert torch.allclose(saved["0"]["m2"], whole.var(0) * 5, rtol=0, atol=1e-12)
    everything = torch.cat(xs)
    for way in ("before", "after", "detach"):
        other = nn.Sequential(nn.BatchNorm1d(2, momentum=None).double())
        owner = WindowBatchNorm()
        if way == "before":
            owner.load_state_dict(saved)
            owner.attach(other)
        elif way == "after":
            owner.attach(other)
            owner.load_state_dict(saved)
        else:
            owner, other = stats, nn.Sequential(layer)
            owner.detach()
            assert not owner.attached
            layer(xs[0])  # (detached: plain BatchNorm's update)
            assert int(layer.num_batches_tracked) == 1
            layer.reset_running_stats()
            owner.attach(other)
        run_window(owner, other, xs[2:])
        assert owner.state_dict()["0"]["count"] == 12
        owner.commit()
        assert torch.allclose(other[0].running_mean, everything.mean(0), rtol=0, atol=1e-13), way
        assert torch.allclose(other[0].running_var, everything.var(0), rtol=0, atol=1e-12), way
        assert int(other[0].num_batches_tracked) == 1
    with pytest.raises(ValueError, match=r"BatchNorm statistics of layers \['1', 'gone'\] that this model does not"):
        owner = WindowBatchNorm()
        owner.attach(nn.Sequential(nn.BatchNorm1d(2).double()))
        owner.load_state_dict({**saved, "gone": saved["0"], "1": saved["0"]})


class KernelSync(nn.SyncBatchNorm):
    """A ``SyncBatchNorm`` whose forward does what its kernel does on several ranks: it normalises with the
    statistics of ``union`` (every rank's samples of this forward, set by the test) and writes those (the mean, the
    variance unbiased over the global count) into its running buffers by its momentum."""

    union: Tensor

    def forward(self, x: Tensor) -> Tensor:
        mean, var = self.union.mean(0), self.union.var(0)
        if self.training and self.track_running_stats:
            assert self.num_batches_tracked is not None and self.running_mean is not None
            assert self.running_var is not None
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.mul_(1 - m).add_(mean * m)
                self.running_var.mul_(1 - m).add_(var * m)
        return (x - mean) / torch.sqrt(self.union.var(0, unbiased=False) + self.eps)


def test_sync_batchnorm_windows_pooled_over_two_faked_ranks_and_resumed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks (faked: each rank's owner in one process, the all-gather handing each the rows the other sent),
    uneven micro-batch sizes. A layer synchronising over group ``g`` (2 ranks) ends the window with the statistics of
    every sample of both ranks; a second one of ``g`` the window did not reach is left as it was; a ``SyncBatchNorm``
    of a group of one rank (``h``) pools its own rank's. The checkpoint rank 0 writes inside the window holds the
    whole window's; resumed on two ranks, the window goes on to the same buffers. Against float64 by hand."""
    import torch.distributed as dist

    worlds = {"g": 2, "h": 1}
    rank = [0]
    sent: dict[int, Tensor] = {}

    def all_gather(out: list[Tensor], flat: Tensor, group: Any = None) -> None:
        assert group == "g" and len(out) == 2
        sent[rank[0]] = flat.clone()
        for r in (0, 1):
            out[r].copy_(sent.get(r, torch.zeros_like(flat)))

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: worlds[group])
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank[0])
    monkeypatch.setattr(dist, "all_gather", all_gather)

    def net() -> nn.ModuleDict:
        return nn.ModuleDict({
            "a": KernelSync(2, momentum=None, process_group="g"), "b": KernelSync(3, momentum=None, process_group="g"),
            "c": nn.SyncBatchNorm(2, momentum=None, process_group="h"),
        }).double()  # fmt: skip

    g = torch.Generator().manual_seed(6)
    sizes = ((2, 5), (4, 2), (3, 3), (2, 3))  # (rank 0's, rank 1's) of each micro-batch
    xs = [[torch.randn(n, 2, generator=g, dtype=torch.float64) * 2 - 1 for n in pair] for pair in sizes]

    def run(owners: list[WindowBatchNorm], nets: list[nn.ModuleDict], micro_batches: list[list[Tensor]]) -> None:
        for pair in micro_batches:
            for r in (0, 1):
                owners[r].arm()
                nets[r]["a"].union = torch.cat(pair)
                nets[r]["a"](pair[r])
                nets[r]["c"](pair[r])
                owners[r].accept()

    def gather(owners: list[WindowBatchNorm], call: str) -> list[Any]:
        sent.clear()
        for r in (0, 1):  # (each rank's rows first: what the all-gather carries)
            rank[0] = r
            owners[r].state_dict()
        results = []
        for r in (0, 1):
            rank[0] = r
            results.append(getattr(owners[r], call)())
        return results

    nets = [net(), net()]
    owners = [WindowBatchNorm(), WindowBatchNorm()]
    for r in (0, 1):
        owners[r].attach(nets[r])
        assert sorted(owners[r]._groups) == ["a", "b"]  # (`c`'s group is one rank: nothing to pool over ranks)
    run(owners, nets, xs[:2])
    saved, _ = gather(owners, "state_dict")
    first = torch.cat([x for pair in xs[:2] for x in pair])
    assert saved["a"]["count"] == len(first) == 13 and "b" not in saved
    assert torch.allclose(saved["a"]["mean"], first.mean(0), rtol=0, atol=1e-14)
    assert torch.allclose(saved["a"]["m2"], first.var(0) * 12, rtol=0, atol=1e-12)
    assert saved["c"]["count"] == 2 + 4  # (rank 0's own)
    for resumed in (False, True):  # (the window goes on; or it is resumed from the checkpoint)
        if resumed:
            nets, owners = [net(), net()], [WindowBatchNorm(), WindowBatchNorm()]
            for r in (0, 1):
                rank[0] = r
                owners[r].attach(nets[r])
                owners[r].load_state_dict(saved if r == 0 else {})
        run(owners, nets, xs[2:])
        gather(owners, "commit")
        whole = torch.cat([x for pair in xs for x in pair])
        for r in (0, 1):
            a, b, c = nets[r]["a"], nets[r]["b"], nets[r]["c"]
            assert int(a.num_batches_tracked) == 1 and int(b.num_batches_tracked) == 0
            assert torch.allclose(a.running_mean, whole.mean(0), rtol=0, atol=1e-13), (resumed, r)
            assert torch.allclose(a.running_var, whole.var(0), rtol=0, atol=1e-12), (resumed, r)
            assert b.running_mean.tolist() == [0, 0, 0] and b.running_var.tolist() == [1, 1, 1]
            # (`c` pools its rank's own samples; the checkpoint holds rank 0's: rank 1 resumed has those after it)
            own = torch.cat([pair[r] for pair in (xs[2:] if resumed and r == 1 else xs)])
            assert torch.allclose(c.running_mean, own.mean(0), rtol=0, atol=1e-13), (resumed, r)
            assert torch.allclose(c.running_var, own.var(0), rtol=0, atol=1e-12), (resumed, r)


def test_one_update_pools_its_forwards_suspended_or_not_and_keeps_the_window_aside() -> None:
    """Suspended (SWA's BatchNorm epoch), ``one_update``'s two forwards make one update with the statistics of both
    (not two of BatchNorm's own); one that raises adds nothing; the window open before it goes on after it, and the
    suspension too. Against fresh float64 layers given the same samples in one forward."""
    g = torch.Generator().manual_seed(8)
    xs = list(torch.randn(6, 4, 2, generator=g, dtype=torch.float64) + 3)
    layer, ref, stats = _window_of_one(xs[0])  # the window: xs[0]
    stats.suspend()
    with stats.one_update():
        layer(xs[1])
        layer(xs[2][:3])
    with pytest.raises(KeyError), stats.one_update():
        layer(xs[3])
        raise KeyError("after a forward")
    with torch.no_grad():
        ref(torch.cat([xs[1], xs[2][:3]]))
    assert int(layer.num_batches_tracked) == 1
    assert max_diff(list(buffers(layer).values()), list(buffers(ref).values())) <= 1e-14
    layer(xs[4])  # (still suspended: BatchNorm's own)
    stats.resume()
    stats.commit()  # (the window kept aside: xs[0])
    with torch.no_grad():
        ref(xs[4])
        ref(xs[0])
    assert int(layer.num_batches_tracked) == 3
    assert max_diff(list(buffers(layer).values()), list(buffers(ref).values())) <= 1e-14


def test_a_layer_taken_over_or_tracking_nothing_is_left_to_its_owner() -> None:
    """A window of the first owner open when a second takes its layer over: the first's commit and checkpoint hold
    nothing of it, the second's window is its own. A layer told ``track_running_stats = False`` after it was built
    (its buffers kept, never written by BatchNorm) is left alone."""
    g = torch.Generator().manual_seed(12)
    xs = list(torch.randn(3, 5, 2, generator=g, dtype=torch.float64))
    layer = nn.BatchNorm1d(2, momentum=None).double()
    untracked = nn.BatchNorm1d(2).double()
    untracked.track_running_stats = False
    net = nn.Sequential(layer, untracked)
    ref = copy.deepcopy(layer)
    first, second = WindowBatchNorm(), WindowBatchNorm()
    first.attach(net)
    run_window(first, net, xs[:2])
    second.attach(nn.Sequential(layer))  # (the first keeps `untracked`)
    assert list(first.state_dict()) == [] and first.attached
    first.commit()
    assert int(layer.num_batches_tracked) == 0
    run_window(second, nn.Sequential(layer), xs[2:])
    second.commit()
    with torch.no_grad():
        ref(xs[2])
    assert max_diff(list(buffers(layer).values()), list(buffers(ref).values())) <= 1e-14
    assert untracked.running_mean.tolist() == [0, 0] and untracked.running_var.tolist() == [1, 1]
    assert int(untracked.num_batches_tracked) == 0


# ------------------------------------------------------- the mixin's one window of every optimizer, refused otherwise
def _windows_of(keys: list[tuple[int, ...]]) -> Any:
    """A mixin's windows over two optimizers with ``keys``' engines made (as an earlier fit, or a checkpoint, left
    them), then set to ``batchnorm="window"``."""
    from lightning_accum._core.options import AccumulationConfig
    from lightning_accum.schedules import as_schedule

    windows = windows_over(*(torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1) for _ in range(2)), schedule=2)
    for key in keys:
        windows.engine(key)
    windows.configure(AccumulationConfig(schedule=as_schedule(2), batchnorm="window"))
    return windows


@pytest.mark.parametrize(
    ("made", "key", "named"),
    [
        ([], (0, 1), None),
        ([(0, 1)], (0, 1), None),
        ([], (0,), "optimizers [0] ("),
        ([], (1,), "optimizers [1] ("),
        ([(0,)], (0, 1), "optimizers [0, 1] beside the window of [0] ("),  # (a fit before, a window per optimizer)
        ([(0,), (1,)], (0,), "optimizers [0] beside the window of [1] ("),
        ([(0,), (1,)], (1,), "optimizers [1] beside the window of [0] ("),
        ([(0, 1)], (0,), "optimizers [0] beside the window of [0, 1] ("),
    ],
)
def test_a_window_of_some_optimizers_is_refused_naming_it_and_the_other(
    made: list[tuple[int, ...]], key: tuple[int, ...], named: str | None
) -> None:
    windows = _windows_of(made)
    if named is None:
        windows.refuse_window_of_some(key)
        return
    with pytest.raises(ValueError) as refused:
        windows.refuse_window_of_some(key)
    assert f"but this model opens a window of {named}" in str(refused.value)


def test_a_second_window_made_under_batchnorm_window_is_refused_as_it_is_made() -> None:
    """As a checkpoint of two windows (one per optimizer) loads into a model set to ``batchnorm="window"``: the
    second group's engine is refused where it would be made, and not made."""
    windows = _windows_of([(0,)])
    with pytest.raises(ValueError, match=r"opens a window of optimizers \[1\] beside the window of \[0\]"):
        windows.engine((1,))
    assert list(windows.engines) == [(0,)]
