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

from lightning_accum import AccumulationMixin, AccumulationScheduler
from lightning_accum._core.batchnorm import Moments, WindowBatchNorm
from lightning_accum.fabric import FabricAccumulator

from helpers import ResumableLoader, default_dtype, trainer

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
    windows: list[list[Batch]], lr: float = 0.1, piece: int | None = None, repeat: int = 1, own: int = 0
) -> nn.Module:
    """The plain loop: each window's gradient the mean of its micro-batches', and each BatchNorm layer's update
    one forward of that layer alone over everything the window's micro-batches gave it, as a single batch (the
    buffers put back by hand after the micro-batches' forwards). (A layer after another BatchNorm is given
    activations each micro-batch normalised by its own statistics: the window as one batch through the whole
    model would give it others; the first layer's are the same either way.) ``piece``: each batch runs in pieces
    of that many samples, each weighted by its share; ``repeat``: each piece runs that many forwards (each loss
    weighted ``1 / repeat``), all of which BatchNorm is given; ``own``: the first that many micro-batches update
    the buffers themselves, as under ``"micro-batch"``."""
    net = make_net()
    train_mode(net)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    seen = 0
    for window in windows:
        before: dict[str, Tensor] | None = None
        inputs: dict[str, list[Tensor]] = {"bn2": [], "bn1": []}
        for batch in window:
            if seen >= own and before is None:
                before = buffers(net)
            counted = inputs if seen >= own else None
            seen += 1
            n = len(batch["x"])
            for i in range(0, n, piece or n):
                x, y = batch["x"][i : i + (piece or n)], batch["y"][i : i + (piece or n)]
                for _ in range(repeat):
                    out = forward(net, x, counted)
                    (nn.functional.mse_loss(out, y) * len(x) / n / len(window) / repeat).backward()
        if before is not None:
            with torch.no_grad():
                for name, b in net.named_buffers():
                    b.copy_(before[name])
                for name, given in inputs.items():
                    net[name](torch.cat(given))  # the window as one batch
        opt.step()
        opt.zero_grad()
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
    trainer(callbacks=[AccumulationScheduler(3), SaveAt(4, path)], max_epochs=1).fit(
        Model(), ResumableLoader(DATA, 4)
    )
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
    with pytest.raises(ValueError, match="`batchnorm` must be"):
        MixinModel(2, batchnorm="windows")


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
) -> nn.Module:
    """The loop a user writes; ``stop``: save after that many micro-batches and return; ``fail``: that
    micro-batch's first try raises after its forward (before its backward) and is tried again; ``resave``: save
    right after loading ``resume`` (before any batch) and return."""
    fabric = Fabric(accelerator="cpu", devices=1, precision="64-true")
    net = _Wrapped(make_net())
    train_mode(net.inner)
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    acc = FabricAccumulator(fabric, model, opt, k, batchnorm="window")
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
            if done == fail:
                with pytest.raises(RuntimeError, match="boom"), acc.accumulate(batch, epoch=epoch) as step:
                    model(batch["x"])
                    raise RuntimeError("boom")
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
