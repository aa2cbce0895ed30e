"""``AccumulationScheduler(microbatch_size=...)``: each loader batch cut into pieces, against the float64
reference that never cuts anything (``helpers.Reference``: the same windows of whole loader batches).

Out-of-memory errors are simulated here (a model raising ``torch.OutOfMemoryError`` in a piece's forward
or from inside its backward, after part of its gradient is in); ``tests/gpu/test_pieces_cuda.py`` runs out
of memory for real.
"""

from __future__ import annotations

import math
import warnings
import weakref
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import StochasticWeightAveraging
from torch import Tensor

from lightning_accum import AccumulationScheduler, Constant, GradientDecay, Piecewise, WindowReport
from lightning_accum._trainer.pieces import Pieces

from helpers import (
    Float32TokenModel,
    KRecorder,
    Reference,
    TokenData,
    TokenModel,
    count_tokens,
    loader,
    max_diff,
    params_of,
    rank_batches,
    token_losses,
    trainer,
)

SCHEDULE = Piecewise({0: 3, 4: 2}, unit="step")  # k changes mid-epoch; 6 batches of 8 a epoch: windows 3, 3 | 3, 2, 1
OOM = torch.OutOfMemoryError


class Pieced(TokenModel):
    """TokenModel that records each `training_step` call (batch_idx, samples) and runs out of memory
    (injected) in the forward, or in the backward, of a piece of more than ``fits`` samples, and once
    more at ``extra_at`` (the n-th call, 0-based, from batch ``extra_from`` of the first epoch on)."""

    def __init__(
        self,
        fits: int | None = None,
        where: str = "forward",
        extra_at: int | None = None,
        extra_from: int = 3,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.fits, self.where, self.extra_at, self.extra_from = fits, where, extra_at, extra_from
        self.dropout = dropout
        self.calls: list[tuple[int, int, int]] = []  # (epoch, batch_idx, samples), a forward that got through
        self.counted = 0  # calls from `extra_from` on

    def _oom_now(self, batch_idx: int, n: int) -> bool:
        if self.fits is not None and n > self.fits:
            return True
        if self.extra_at is None or self.current_epoch or batch_idx < self.extra_from:
            return False
        self.counted += 1
        if self.counted - 1 == self.extra_at:
            self.extra_at = None
            return True
        return False

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        n = len(batch["x"])
        oom = self._oom_now(batch_idx, n)
        if oom and self.where == "forward":
            raise OOM("CUDA out of memory (injected)")
        self.calls.append((self.current_epoch, batch_idx, n))
        hidden = self.net[0](batch["x"])
        if self.dropout:
            hidden = torch.nn.functional.dropout(hidden, self.dropout)
        if oom and self.where == "forward, late":  # after the random draws
            raise OOM("CUDA out of memory (injected)")
        if oom:  # from inside the backward, after the last layer's gradient is in
            hidden.register_hook(lambda grad: (_ for _ in ()).throw(OOM("CUDA out of memory (injected)")))
        with torch.autocast(hidden.device.type, enabled=False):  # (bf16-mixed: a head kept in float32)
            out = self.net[2](self.net[1](hidden).to(self.net[2].weight.dtype))
        err = (out - batch["y"]).squeeze(-1) ** 2
        total, tokens = (err * batch["mask"]).sum(), batch["mask"].sum()
        return total if self.reduction == "sum" else total / tokens


def callback(size: Any, normalize: str = "mean", reduction: str | None = None, schedule: Any = SCHEDULE) -> Any:
    count = count_tokens if normalize == "items" else None
    return AccumulationScheduler(schedule, normalize=normalize, count=count, reduction=reduction, microbatch_size=size)


def fit(
    model: pl.LightningModule, cb: AccumulationScheduler, data: TokenData, batch: int = 8, **kwargs: Any
) -> KRecorder:
    recorder = KRecorder()
    kwargs.setdefault("max_epochs", 2)
    trainer(callbacks=[cb, recorder], **kwargs).fit(model, loader(data, batch))
    return recorder


def expected(data: TokenData, normalize: str = "mean", batch: int = 8, **kwargs: Any) -> tuple[list[Tensor], list[int]]:
    return Reference(SCHEDULE, normalize=normalize, **kwargs).run([rank_batches(data, batch)] * 2)


# ---------------------------------------------------------------------------- exact
CASES = [  # (normalize, reduction, what training_step returns)
    ("mean", None, "mean"),  # a sample mean (full masks: the token mean is the sample mean)
    ("items", "sum", "sum"),  # a token sum
    ("items", "mean", "mean"),  # a token mean, weighted by count(piece)
]


@pytest.mark.parametrize(("normalize", "reduction", "returns"), CASES)
@pytest.mark.parametrize("size", [1, 3, 5])
def test_pieces_add_up_to_the_batch(normalize: str, reduction: str | None, returns: str, size: int) -> None:
    data = TokenData(48, ragged=normalize == "items")
    model = Pieced(reduction=returns)
    cb = callback(size, normalize, reduction)
    recorder = fit(model, cb, data)
    want, sizes = expected(data, normalize)
    assert max_diff(params_of(model), want) <= 1e-12
    # k counts loader batches, and Progress the loader batches' samples and items, once
    assert recorder.windows == sizes  # one backward per loader batch for the other callbacks' hooks
    assert cb.progress.microbatches == 12 and cb.progress.samples == 96
    assert cb.progress.items == (2 * int(data.mask.sum()) if normalize == "items" else 96)
    pieces = [n for _, _, n in model.calls]
    assert max(pieces) == size and sum(pieces) == 96 and len(pieces) == 12 * math.ceil(8 / size)
    first = math.ceil(8 / size)
    assert [i for _, i, _ in model.calls][:first] == [0] * first  # each piece gets the loader's batch_idx


def test_a_piece_without_items_adds_nothing() -> None:
    """A token mean over no tokens is NaN: the piece adds nothing (and its NaN does not reach the gradient)."""
    data = TokenData(48)
    data.mask[8:10] = 0.0  # the first 2 samples of batch 1: a piece of 2 without items
    data.mask[16:24] = 0.0  # batch 2: no items at all
    model = Pieced(reduction="mean")
    fit(model, callback(2, "items", "mean"), data)
    want, _ = expected(data, "items")
    assert max_diff(params_of(model), want) <= 1e-12


class Losses(pl.Callback):
    """Each window's loss (`on_window_end`) and each batch's (Lightning's `outputs`)."""

    def __init__(self) -> None:
        self.windows: list[float | None] = []
        self.batches: list[float] = []

    def on_window_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, window: WindowReport) -> None:
        self.windows.append(window.loss)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        self.batches.append(float(outputs["loss"]))


class BatchLosses(pl.Callback):
    """Each loader batch's loss as Lightning hands it to ``on_train_batch_end`` (``got``), beside the whole batch's
    loss by hand (``want``): its token sum, over its tokens for a mean, with the parameters it started with, divided
    by ``accumulate_grad_batches`` as Lightning divides what ``training_step`` returned (listed after the package's
    callback, which sets that value for the window)."""

    def __init__(self, returns: str) -> None:
        self.returns = returns
        self.want: list[float] = []
        self.got: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            total, tokens = token_losses(pl_module.net, batch)
        loss = total if self.returns == "sum" else total / tokens
        self.want.append(float(loss) / trainer.accumulate_grad_batches)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        self.got.append(float(outputs["loss"]))


@pytest.mark.parametrize(("normalize", "reduction", "returns"), CASES)
def test_the_batch_loss_lightning_gets_is_the_whole_batchs(normalize: str, reduction: str | None, returns: str) -> None:
    """With several pieces a batch, Lightning's ``outputs["loss"]`` (what its bar, ``on_train_batch_end`` and a
    logged ``train_loss`` see) is what ``training_step`` returns for the whole batch: a token mean over the batch's
    tokens (not its samples), a token sum, a sample mean."""
    data = TokenData(48, ragged=normalize == "items")
    losses = BatchLosses(returns)
    trainer(callbacks=[callback(3, normalize, reduction), losses]).fit(Pieced(reduction=returns), loader(data, 8))
    assert len(losses.got) == 12
    assert max(abs(a - b) for a, b in zip(losses.got, losses.want, strict=True)) <= 1e-12


@pytest.mark.parametrize(("normalize", "reduction", "returns"), CASES)
@pytest.mark.parametrize("precision", ["64-true", "bf16-mixed"])  # bf16: its float32 head's backward too
@pytest.mark.parametrize("size", [8, "auto"])  # 8: Lightning's own backward; "auto" (no OOM): the piece's own
def test_a_piece_of_the_whole_batch_is_the_unsplit_run_bit_for_bit(
    normalize: str, reduction: str | None, returns: str, precision: str, size: Any
) -> None:
    data = TokenData(48, ragged=normalize == "items")
    model = Float32Pieced if precision == "bf16-mixed" else Pieced
    whole, split = model(reduction=returns), model(reduction=returns)
    plain, cut = callback(None, normalize, reduction), callback(size, normalize, reduction)
    seen: list[Losses] = []
    for m, cb in ((whole, plain), (split, cut)):
        seen.append(Losses())
        trainer(callbacks=[cb, seen[-1]], max_epochs=2, precision=precision).fit(m, loader(data, 8))
    for a, b in zip(whole.parameters(), split.parameters(), strict=True):
        assert torch.equal(a, b)
    assert seen[0].windows == seen[1].windows and seen[0].batches == seen[1].batches
    got, want = split.trainer.callback_metrics, whole.trainer.callback_metrics
    assert float(got["accum/microbatch_size"]) == 8.0 and "accum/microbatch_size" not in want


def test_one_piece_graph_alive_at_a_time() -> None:
    """The tensors autograd saves for backward, alive at their peak: a piece's, not the batch's."""
    peaks = {}
    for size in (None, 2):
        model = Saving()
        fit(model, callback(size), TokenData(32, ragged=False), max_epochs=1)
        peaks[size] = model.peak
    assert peaks[2] < 0.3 * peaks[None]  # pieces of 2 of 8: a quarter, and the parameters' references


class Saving(TokenModel):
    """Counts the bytes autograd keeps for backward, alive at once (their peak)."""

    live = peak = 0

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        def pack(t: Tensor) -> Any:
            holder = _Holder(t)
            Saving.live += t.numel() * t.element_size()
            self.peak = max(self.peak, Saving.live)
            weakref.finalize(holder, _free, t.numel() * t.element_size())
            return holder

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda holder: holder.t):
            return super().training_step(batch, batch_idx)


class _Holder:
    def __init__(self, t: Tensor) -> None:
        self.t = t


def _free(n: int) -> None:
    Saving.live -= n


def test_one_piece_is_lightnings_own_backward() -> None:
    """A batch that fits one piece of an int size runs as without pieces: Lightning's backward is its backward.
    Cut into pieces, each piece's backward runs inside `training_step`, and Lightning's reaches no parameter."""

    class Where(TokenModel):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[bool] = []  # each backward: whether it reaches a parameter

        def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
            params = list(self.parameters())
            grads = torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True)
            self.seen.append(any(g is not None for g in grads))
            super().backward(loss, *args, **kwargs)

    one, three = Where(), Where()
    fit(one, callback(8), TokenData(16), max_epochs=1)
    fit(three, callback(3), TokenData(16), max_epochs=1)
    assert one.seen == [True] * 2  # Lightning's, once a batch
    assert three.seen == ([True] * 3 + [False]) * 2  # 3 pieces (8 = 3 + 3 + 2), then Lightning's


def test_returned_dict_and_outputs() -> None:
    """A dict's other entries come from the batch's last piece; the loss Lightning back-propagates (and
    hands `on_train_batch_end`) has the batch's value."""

    class WithExtras(TokenModel):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[float, int]] = []
            self.losses: list[float] = []
            self.previous: Any = None  # the previous piece's output tensor, weakly

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            assert self.previous is None or self.previous() is None  # (freed before the next piece's forward)
            preds = self.net(batch["x"])
            self.previous = weakref.ref(preds)
            return {"loss": super().training_step(batch, batch_idx), "n": len(batch["x"]), "preds": preds}

        def on_before_backward(self, loss: Tensor) -> None:
            self.losses.append(float(loss))

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.seen.append((float(outputs["loss"]), outputs["n"]))
            self.previous = None

    data = TokenData(16, ragged=False)
    model = WithExtras()
    fit(model, callback(3, schedule=Constant(1)), data, max_epochs=1)
    assert [n for _, n in model.seen] == [2, 2]  # 8 = 3 + 3 + 2: the last piece's entry
    want = TokenModel().training_step(data.batch(slice(0, 8)), 0).item()  # the first batch, before any step
    assert model.losses[0] == pytest.approx(want, rel=1e-12) and model.seen[0][0] == pytest.approx(want, rel=1e-12)


def test_none_skips_the_batch_only_from_its_first_piece() -> None:
    class Skips(TokenModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if batch_idx == 1:
                return None  # the whole batch 1 is skipped, as Lightning skips it
            return super().training_step(batch, batch_idx)

    data = TokenData(24, ragged=False)
    cb = callback(4, schedule=Constant(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (Lightning's: "`training_step` returned `None`")
        fit(Skips(), cb, data, max_epochs=1)
    assert cb.progress.microbatches == 2 and cb.progress.samples == 16

    class SkipsLater(TokenModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return None if len(batch["x"]) < 4 else super().training_step(batch, batch_idx)

    with pytest.raises(RuntimeError, match="returned None for samples 4:6"):
        fit(SkipsLater(), callback(4), TokenData(12, ragged=False), batch=6, max_epochs=1)


def test_reported_size_and_window_end() -> None:
    class Listener(pl.Callback):
        sizes: list[int | None] = []

        def on_window_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, window: WindowReport) -> None:
            self.sizes.append(window.microbatch_size)

    listener, model = Listener(), TokenModel()
    trainer(callbacks=[callback(3), listener], max_epochs=1).fit(model, loader(TokenData(48), 8))
    assert listener.sizes == [3, 3]
    assert float(model.trainer.callback_metrics["accum/microbatch_size"]) == 3.0


# ---------------------------------------------------------------------------- "auto"
@pytest.mark.parametrize(("normalize", "reduction", "returns"), CASES)
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_auto_backs_off_and_stays_exact(normalize: str, reduction: str | None, returns: str, where: str) -> None:
    data = TokenData(48, ragged=normalize == "items")
    model = Pieced(fits=3, where=where, reduction=returns)
    cb = callback("auto", normalize, reduction)
    with pytest.warns(UserWarning, match="continuing with micro-batches of 4 samples") as seen:
        recorder = fit(model, cb, data)
    want, sizes = expected(data, normalize)
    assert max_diff(params_of(model), want) <= 1e-12
    assert recorder.windows == sizes and cb.progress.samples == 96 and cb.progress.microbatches == 12
    backed = [str(w.message) for w in seen if "continuing with" in str(w.message)]
    assert len(backed) == 2 and "of 2 samples" in backed[1]  # 8 -> 4 -> 2, each warned once
    assert cb._split.found == 2  # type: ignore[union-attr]
    assert all(n == 2 for epoch, _, n in model.calls if epoch == 1)
    assert float(model.trainer.callback_metrics["accum/microbatch_size"]) == 2.0


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("position", range(6))
def test_auto_out_of_memory_at_every_piece_of_a_window(where: str, position: int) -> None:
    """Pieces of 4 (after a first back-off from 8), then one more OOM at each piece position of the window
    of batches 3-5: in a forward the batch goes on from that piece; in a backward (part of the piece's
    gradient is in) the window is redone from batch 3 (its earlier batches cut as they ran). No piece is counted
    twice, none is lost."""
    data = TokenData(48)
    model = Pieced(fits=4, where=where, extra_at=position, extra_from=3, reduction="sum")
    cb = callback("auto", "items", "sum", schedule=Constant(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(model, cb, data)
    want, _ = Reference(Constant(3), normalize="items").run([rank_batches(data, 8)] * 2)
    assert max_diff(params_of(model), want) <= 1e-12
    assert cb._split.found == 2 and model.extra_at is None  # type: ignore[union-attr]
    if where == "backward" and position >= 2:  # the window's earlier batches were trained again, as they ran
        assert model.calls.count((0, 3, 4)) == 4 and (0, 3, 2) not in model.calls


def test_auto_redoing_a_window_replays_its_batches_exactly() -> None:
    """With dropout: out of memory inside the backward of batch 5 (the window of batches 3-5 redone: 3 and 4
    replayed as they ran, from their generators' states), or in its forward after its random draws (the
    piece again from its generators' state), ends bit for bit where the same error at the start of batch 5's
    forward ends (nothing to redo)."""
    runs = []
    for where in ("forward", "forward, late", "backward"):
        torch.manual_seed(0)
        model = Pieced(where=where, extra_at=0, extra_from=5, dropout=0.3, reduction="sum")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fit(model, callback("auto", "items", "sum", schedule=Constant(3)), TokenData(48))
        runs.append(model)
    assert runs[2].calls.count((0, 3, 8)) == 2  # batch 3 replayed whole, as it ran
    for run in runs[1:]:
        for a, b in zip(runs[0].parameters(), run.parameters(), strict=True):
            assert torch.equal(a, b)


def test_auto_replay_that_no_longer_fits_is_cut_at_the_size_in_force() -> None:
    """After the out-of-memory error in batch 5 less memory is left: batch 3, replayed as it ran (8 samples),
    runs out too, and the window is redone once more with every batch at the size in force (4)."""
    data = TokenData(48)
    model = Pieced(where="backward", extra_at=0, extra_from=5, reduction="sum")
    oom_now = model._oom_now

    def tighter(batch_idx: int, n: int) -> bool:
        if model.extra_at is None:
            model.fits = 4
        return oom_now(batch_idx, n)

    model._oom_now = tighter  # type: ignore[method-assign]
    cb = callback("auto", "items", "sum", schedule=Constant(3))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fit(model, cb, data)
    want, _ = Reference(Constant(3), normalize="items").run([rank_batches(data, 8)] * 2)
    assert max_diff(params_of(model), want) <= 1e-12
    assert cb._split.found == 4 and len([w for w in seen if "continuing with" in str(w.message)]) == 1  # type: ignore[union-attr]
    assert model.calls.count((0, 3, 8)) == 2 and model.calls.count((0, 3, 4)) == 2  # ran, replay failed, again at 4


def test_auto_never_below_one_sample() -> None:
    model = Pieced(fits=0)
    with (
        pytest.raises(RuntimeError, match=r"single sample \(sizes tried: 8, 4, 2, 1\)") as error,
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        fit(model, callback("auto"), TokenData(16), max_epochs=1)
    assert isinstance(error.value.__cause__, OOM)


def test_other_errors_are_not_taken_for_out_of_memory() -> None:
    class Broken(TokenModel):
        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            raise KeyError("not an OOM")

    with pytest.raises(KeyError, match="not an OOM"):
        fit(Broken(), callback("auto"), TokenData(16), max_epochs=1)


def test_auto_size_is_kept_in_checkpoints(tmp_path: Any) -> None:
    model = Pieced(fits=3, reduction="mean")
    cb = callback("auto")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = trainer(callbacks=[cb], max_epochs=1)
        t.fit(model, loader(TokenData(48), 8))
    t.save_checkpoint(tmp_path / "a.ckpt")
    resumed, again = callback("auto"), Pieced(fits=3, reduction="mean")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer(callbacks=[resumed], max_epochs=2).fit(again, loader(TokenData(48), 8), ckpt_path=tmp_path / "a.ckpt")
    assert resumed._split.found == 2 and max(n for _, _, n in again.calls) == 2  # type: ignore[union-attr]
    assert not [w for w in seen if "continuing with" in str(w.message)]  # no out-of-memory error again


def test_pieces_state_dict_round_trip() -> None:
    pieces = Pieces("auto")
    pieces.found, pieces.resume = 3, (1, 4, 2, torch.tensor(0.5), 0.0)
    again = Pieces("auto")
    again.load_state_dict(pieces.state_dict())
    assert again.found == 3 and again.resume is not None and again.resume[:3] == (1, 4, 2)


# ---------------------------------------------------------------------------- with the rest of Lightning
def test_gradient_decay_and_clipping() -> None:
    data = TokenData(48, ragged=False)
    model = TokenModel()
    recorder = KRecorder()
    trainer(callbacks=[callback(3), GradientDecay(0.7), recorder], max_epochs=2, gradient_clip_val=0.05).fit(
        model, loader(data, 8)
    )
    want, _ = expected(data, decay=(0.7, "sum", False), clip=0.05)
    assert max_diff(params_of(model), want) <= 1e-12


def test_stochastic_weight_averaging_batchnorm_epoch_runs_piece_by_piece() -> None:
    """SWA's BatchNorm epoch (forward only, statistics averaged over every forward) runs piece by piece:
    with equal pieces its running mean is still the mean over all samples."""

    class Normed(Pieced):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.BatchNorm1d(3).double()
            self.forward_only: list[int] = []

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            x = batch["x"]
            if self.trainer.fit_loop._skip_backward:
                self.forward_only.append(len(x))
            normed = self.norm(x.reshape(-1, x.shape[-1])).reshape(x.shape)
            return super().training_step({**batch, "x": normed}, batch_idx)

    data = TokenData(48)
    model = Normed()
    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2)
    trainer(callbacks=[callback(4), swa], max_epochs=2).fit(model, loader(data, 8))
    assert model.forward_only == [4] * 12  # the BatchNorm epoch: 6 batches of 8, in pieces of 4
    assert torch.allclose(model.norm.running_mean, data.x.reshape(-1, 3).mean(0), rtol=0, atol=1e-12)


@pytest.mark.parametrize("size", [3, "auto"])
def test_bf16_mixed_on_cpu(size: Any) -> None:
    """bf16 autocast in each piece's forward, each backward outside it, as Lightning's own."""
    data = TokenData(48, ragged=False)
    model = Float32Pieced(fits=3 if size == "auto" else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(model, callback(size), data, precision="bf16-mixed")
    want, _ = expected(data)
    error = max_diff([p.double() for p in params_of(model)], want)
    assert error < 2e-3 < 0.1 * max_diff(params_of(TokenModel()), want)  # (far below what training moved)


class Float32Pieced(Pieced):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.net.float()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return super().training_step({k: v.float() for k, v in batch.items()}, batch_idx)


@pytest.mark.parametrize("size", [3, "auto"])
@pytest.mark.parametrize("inf_at", [None, (0, 4)])
def test_16_mixed_with_a_grad_scaler(size: Any, inf_at: tuple[int, int] | None) -> None:
    """Each piece's backward is scaled by the GradScaler (on CPU here, as on CUDA): the window is unscaled
    once, and a window with an inf is skipped as a whole."""
    from test_mixed_precision import DATA, INIT_SCALE, SKIPPED, check, fp16_trainer
    from test_mixed_precision import SCHEDULE as AMP_SCHEDULE

    model = Float32TokenModel(inf_at=inf_at)
    if size == "auto":  # (a forward OOM above 2 samples)
        original = model.training_step

        def step(batch: Any, batch_idx: int) -> Tensor:
            if len(batch["x"]) > 2:
                raise OOM("CUDA out of memory (injected)")
            return original(batch, batch_idx)

        model.training_step = step  # type: ignore[method-assign]
    # (ragged token means: weighted by their tokens, as one batch's token mean is)
    cb = AccumulationScheduler(
        AMP_SCHEDULE, normalize="items", count=count_tokens, reduction="mean", microbatch_size=size
    )
    t, plugin = fp16_trainer(callbacks=[cb])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.fit(model, loader(DATA, 4))
    skipped = SKIPPED if inf_at else ()
    wrong = Reference(AMP_SCHEDULE, skipped=skipped) if not inf_at else Reference(AMP_SCHEDULE, normalize="items")
    check(model, Reference(AMP_SCHEDULE, normalize="items", skipped=skipped), wrong)
    assert plugin.scaler.get_scale() == INIT_SCALE / (2 if inf_at else 1)


def test_compile_recompiles_once_per_piece_size() -> None:
    """A compiled network sees the piece sizes in use (here 3 and the last piece's 2) and no others."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()

    class Compiled(TokenModel):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.compile(self.net, backend="eager", dynamic=False)  # type: ignore[assignment]

    model = Compiled()
    fit(model, callback(3), TokenData(48, ragged=False), max_epochs=1)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # pieces of 3 and of 2 (8 = 3 + 3 + 2)
    torch._dynamo.reset()


# ---------------------------------------------------------------------------- misuse
@pytest.mark.parametrize(
    ("size", "error", "match"),
    [
        (0, ValueError, "at least 1 sample; got 0"),
        (-1, ValueError, "at least 1 sample; got -1"),
        (1.5, TypeError, r"whole number of samples; got 1.5 \(a float\)"),
        (float("nan"), TypeError, r"got nan \(a float\)"),
        (4.0, TypeError, r"got 4.0 \(a float\)"),
        ("Auto", ValueError, r"'Auto' \(lower case: 'auto'\)"),
        ("8", ValueError, "got the string '8'"),
        (True, TypeError, r"got True \(a bool\)"),
        (torch.tensor(4), TypeError, "a Tensor"),
    ],
)
def test_microbatch_size_refused_at_construction(size: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        AccumulationScheduler(2, microbatch_size=size)


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        ({"x": torch.zeros(8, 3), "text": ["a"] * 8}, r"cannot be cut: `batch\['text'\]\[0\]` is a str"),
        ({"x": torch.zeros(8, 3), "y": torch.zeros(6)}, r"differ in size along dim 0 \(batch\['x'\]: 8"),
    ],
)
def test_a_batch_that_cannot_be_cut_is_refused_at_the_first_batch(batch: Any, match: str) -> None:
    model = TokenModel()
    before = params_of(model)
    data = torch.utils.data.DataLoader([batch], batch_size=None)
    with pytest.raises(ValueError, match=match) as error:
        trainer(callbacks=[callback(2)], max_epochs=1).fit(model, data)
    assert "leave `microbatch_size` out" in str(error.value)
    assert max_diff(params_of(model), before) == 0.0 and all(p.grad is None for p in model.parameters())


def test_cut_structures() -> None:
    """Dicts, lists, tuples, named tuples, dataclasses and `None` leaves are cut along dim 0."""
    from test_microbatch import Pair, Sample

    seen = []

    class Nested(TokenModel):
        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            x, (y, pair), sample = batch["x"], batch["rest"], batch["sample"]
            seen.append((len(x), len(y), len(pair.x), pair.y, len(sample.x)))
            return super().training_step({"x": x, "y": y, "mask": sample.x}, batch_idx)

    data = TokenData(8, ragged=False)
    batch = {"x": data.x, "rest": [data.y, Pair(torch.arange(8), None)], "sample": Sample(data.mask)}
    trainer(callbacks=[callback(3)], max_epochs=1).fit(Nested(), torch.utils.data.DataLoader([batch], batch_size=None))
    assert seen == [(3, 3, 3, None, 3), (3, 3, 3, None, 3), (2, 2, 2, None, 2)]


def test_batch_encoding_is_cut() -> None:
    transformers = pytest.importorskip("transformers")
    data = TokenData(8, ragged=False)
    sizes = []

    class Encoded(TokenModel):
        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            assert isinstance(batch, transformers.BatchEncoding)
            sizes.append(len(batch["x"]))
            return super().training_step(dict(batch), batch_idx)

    encoded = transformers.BatchEncoding({"x": data.x, "y": data.y, "mask": data.mask})
    loader_ = torch.utils.data.DataLoader([encoded], batch_size=None, collate_fn=lambda b: b)
    trainer(callbacks=[callback(5)], max_epochs=1).fit(Encoded(), loader_)
    assert sizes == [5, 3]


class _Strategy:
    def __init__(self, **attrs: Any) -> None:
        self.__dict__.update(attrs)


@pytest.mark.parametrize(
    ("family", "size", "match"),
    [
        ("deepspeed", 4, "cannot run under DeepSpeed: its engine owns the backward"),
        ("fsdp", 4, "cannot run under Lightning's `FSDPStrategy`"),
        ("fsdp2", "auto", "cannot run under FSDP2: each piece's forward all-gathers"),
        ("ddp", 4, "DDP's communication hook"),
    ],
)
def test_strategies_refused_at_fit_start(family: str, size: Any, match: str) -> None:
    from lightning_accum._core import sync
    from lightning_accum._trainer import fit_checks

    strategy = _Strategy(world_size=2, _ddp_comm_hook=print)
    trainer_ = _Strategy(strategy=strategy)
    with pytest.raises(RuntimeError, match=match):
        fit_checks.refuse_split_misuse(size, trainer_, TokenModel(), sync.SyncPlan(family, True))  # type: ignore[arg-type]
    fit_checks.refuse_split_misuse(None, trainer_, TokenModel(), sync.SyncPlan(family, True))  # type: ignore[arg-type]


def test_sync_batchnorm_with_auto_on_several_ranks_is_refused() -> None:
    from lightning_accum._core import sync
    from lightning_accum._trainer import fit_checks

    model = TokenModel()
    model.norm = torch.nn.SyncBatchNorm(3)
    trainer_ = _Strategy(strategy=_Strategy(world_size=2))
    with pytest.raises(RuntimeError, match="`SyncBatchNorm` on 2 ranks"):
        fit_checks.refuse_split_misuse("auto", trainer_, model, sync.SyncPlan("ddp", True))
    fit_checks.refuse_split_misuse(4, trainer_, model, sync.SyncPlan("ddp", True))  # ranks cut alike: allowed
    one = _Strategy(strategy=_Strategy(world_size=1))
    fit_checks.refuse_split_misuse("auto", one, model, sync.SyncPlan("ddp", True))  # one rank: nothing to cut alike


def test_manual_optimization_is_refused() -> None:
    class Manual(TokenModel):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(RuntimeError, match="AccumulationMixin"):
        trainer(callbacks=[callback(2)], max_epochs=1).fit(Manual(), loader(TokenData(8), 4))


def test_training_step_is_the_modules_own_again_after_the_fit() -> None:
    model = TokenModel()
    fit(model, callback(3), TokenData(16), max_epochs=1)
    assert "training_step" not in vars(model)

    class Fails(TokenModel):
        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            raise ValueError("boom")

    failing = Fails()
    with pytest.raises(ValueError, match="boom"):
        fit(failing, callback(3), TokenData(16), max_epochs=1)
    assert "training_step" not in vars(failing)


def test_training_step_without_batch_idx() -> None:
    class NoIndex(TokenModel):
        def training_step(self, batch: Any) -> Tensor:  # type: ignore[override]
            return super().training_step(batch, 0)

    data = TokenData(48, ragged=False)
    model = NoIndex()
    fit(model, callback(3), data)
    want, _ = expected(data)
    assert max_diff(params_of(model), want) <= 1e-12

