"""``grad_accum_dtype``'s unhappy paths (issue 51), in one process: the misuse table on all three surfaces, a dtype
narrower than the parameters, the option where it does nothing (``bf16-mixed``), the strategies that refuse it,
checkpoints written with and resumed without it (and the reverse), resuming inside a window, and the ways around a
window (a ``zero_grad``/``step`` of the user's, a fit after a failed fit, a second fit or accumulator).

Each refusal names ``grad_accum_dtype`` and the fix and comes before anything changes; each run that must not change
is compared bit for bit (``torch.equal``) with a run that cannot have been touched by the fault: the uninterrupted
run, the run without the option, or a fresh run.

Strings: the check strips surrounding whitespace, ignores case and a ``torch.`` prefix (``"Float32 "``,
``"torch.float32"``, ``"FP32"``); each of those names one dtype and nothing else, which is what a config file's
author meant. Near misses that name something else, or nothing certain, are refused: a narrow dtype (``"fp16"``,
``"bf16"``), ``"float"`` (float32 in torch, float64 in Python and NumPy), ``"f32"``, ``"float32x"``, ``""``.
"""

from __future__ import annotations

import copy
import math
import re
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import SingleDeviceStrategy as FabricSingleDevice
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import Tensor, nn

from lightning_accum import AccumulationScheduler, Constant, Progress
from lightning_accum._core import sync
from lightning_accum._core.wide import refuse_under
from lightning_accum.fabric import FabricAccumulator

from helpers import (
    ManualTokenModel,
    Reference,
    ResumableLoader,
    TokenData,
    TokenModel,
    default_dtype,
    loader,
    make_net,
    max_diff,
    params_of,
    rank_batches,
    token_losses,
    trainer,
)

DATA, VAL = TokenData(50), TokenData(8, seed=1)  # 13 batches of 4 an epoch (the last of 2): windows of 3
K = 3  # windows [0-2] [3-5] [6-8] [9-11] [12] each epoch
MID, LAST = (0, 4), (0, 5)  # the second micro-batch of the window [3-5], and its last
F32, F64 = torch.float32, torch.float64

# ---------------------------------------------------------------------- the misuse table
BAD: list[tuple[Any, type[Exception], str]] = [  # (value, error, what the message echoes)
    (0, TypeError, "int 0"),
    (-1, TypeError, "int -1"),
    (32, TypeError, "int 32"),  # (the bits)
    (1.5, TypeError, "float 1.5"),
    (math.nan, TypeError, "float nan"),
    (True, TypeError, "bool True"),
    (["float32"], TypeError, "list ['float32']"),
    (np.float32, TypeError, "got type <class 'numpy.float32'>"),  # NumPy's, not torch's
    (torch.int32, ValueError, "torch.int32` is not a floating dtype"),
    (torch.complex64, ValueError, "torch.complex64` is not a floating dtype"),
    (torch.float16, ValueError, "torch.float16` is no wider than bf16/fp16"),
    (torch.bfloat16, ValueError, "torch.bfloat16` is no wider than bf16/fp16"),
    ("fp16", ValueError, "got 'fp16'"),  # the parameters' dtype, not the sums'
    ("bf16", ValueError, "got 'bf16'"),
    ("float", ValueError, "got 'float'"),  # float32 in torch, float64 in Python and NumPy
    ("torch.float", ValueError, "got 'torch.float'"),
    ("f32", ValueError, "got 'f32'"),
    ("float32x", ValueError, "got 'float32x'"),
    ("float 32", ValueError, "got 'float 32'"),
    ("torch.bfloat16", ValueError, "got 'torch.bfloat16'"),
    ("", ValueError, "got ''"),
]
ACCEPTED: list[tuple[Any, torch.dtype | None]] = [
    ("float32", F32),
    ("fp32", F32),
    (F32, F32),
    ("float64", F64),
    ("fp64", F64),
    (F64, F64),
    (None, None),
    ("Float32 ", F32),  # (surrounding whitespace and case: one dtype still)
    ("FP32", F32),
    ("torch.float32", F32),  # what `str(torch.float32)` gives, and a YAML config's natural spelling
    (" torch.float64\n", F64),
]
IDS = [repr(v) for v, *_ in BAD]
NAMES_WHAT_IT_TAKES = r"`grad_accum_dtype[`=].*torch\.float32"


def refused(error: type[Exception], echo: str) -> Any:
    """``pytest.raises`` for a refusal naming the argument, what it takes, and the value given."""
    return pytest.raises(error, match=rf"(?s)(?=.*{NAMES_WHAT_IT_TAKES})(?=.*{re.escape(echo)})")


@pytest.mark.parametrize(("value", "error", "echo"), BAD, ids=IDS)
def test_the_callback_refuses_at_construction(value: Any, error: type[Exception], echo: str) -> None:
    with refused(error, echo):
        AccumulationScheduler(K, grad_accum_dtype=value)


@pytest.mark.parametrize(("value", "error", "echo"), BAD, ids=IDS)
def test_configure_accumulation_refuses_and_keeps_the_configuration(
    value: Any, error: type[Exception], echo: str
) -> None:
    with refused(error, echo):
        ManualTokenModel(schedule=K, grad_accum_dtype=value)
    model = ManualTokenModel(schedule=K, grad_accum_dtype="fp32")
    before = model._accumulation.config
    with refused(error, echo):
        model.configure_accumulation(2, grad_accum_dtype=value)
    assert model._accumulation.config is before and model._accumulation.windows.config is before


def bf16_setup(precision: str = "bf16-true") -> tuple[Fabric, Any, Any]:
    fabric = Fabric(accelerator="cpu", devices=1, precision=precision)
    net = make_net()
    if precision == "bf16-mixed":
        net = net.float()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    return fabric, model, optimizer


def untouched(fabric: Fabric, model: Any, optimizer: Any) -> None:
    """Nothing of a refused accumulator is left: no attribute set on Fabric's objects, no hook on a parameter (a
    backward pass puts its gradient in ``.grad``)."""
    assert "backward" not in vars(fabric) and not {"step", "zero_grad"} & set(vars(optimizer))
    assert "zero_grad" not in vars(model)
    x = torch.randn(2, 3, dtype=torch.bfloat16)
    model(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters()), "a refused accumulator left a hook on a parameter"
    optimizer.zero_grad()


@pytest.mark.parametrize(("value", "error", "echo"), BAD, ids=IDS)
def test_the_fabric_accumulator_refuses_at_construction(value: Any, error: type[Exception], echo: str) -> None:
    fabric, model, optimizer = bf16_setup()
    with refused(error, echo):
        FabricAccumulator(fabric, model, optimizer, schedule=K, grad_accum_dtype=value)
    untouched(fabric, model, optimizer)


def test_a_fabric_constructor_refused_for_another_argument_leaves_no_hook() -> None:
    """With a valid ``grad_accum_dtype`` and an argument refused later in the constructor (``batchnorm``), the
    parameters are left as they were (before the fix, the sums' hooks were attached already and stayed: every
    narrow gradient went into a buffer nobody read, and a later accumulator on the model got none)."""
    fabric, model, optimizer = bf16_setup()
    with pytest.raises(ValueError, match=r"`batchnorm` must be 'micro-batch' or 'window'"):
        FabricAccumulator(fabric, model, optimizer, grad_accum_dtype="float32", batchnorm="windows")  # type: ignore[arg-type]
    untouched(fabric, model, optimizer)


@pytest.mark.parametrize(("value", "dtype"), ACCEPTED, ids=[repr(v) for v, _ in ACCEPTED])
def test_accepted_spellings_name_their_dtype_on_every_surface(value: Any, dtype: torch.dtype | None) -> None:
    assert AccumulationScheduler(K, grad_accum_dtype=value).grad_accum_dtype == dtype
    assert ManualTokenModel(schedule=K, grad_accum_dtype=value)._accumulation.config.grad_accum_dtype == dtype
    fabric, model, optimizer = bf16_setup()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (float64 sums of bf16 parameters: fine, and quiet)
        assert FabricAccumulator(fabric, model, optimizer, grad_accum_dtype=value).grad_accum_dtype == dtype


# ---------------------------------------------------------------------- runs
class Recorded(TokenModel):
    """Keeps each step's gradient as the optimizer gets it (the module's hook runs after every callback's)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seen: list[list[Tensor]] = []

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.seen.append([p.grad.clone() for p in self.parameters()])  # type: ignore[union-attr]

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        batch = {k: v.to(self.net[0].weight.dtype) for k, v in batch.items()}
        self.log("val", token_losses(self.net, batch)[0], batch_size=4)


class ManualRecorded(ManualTokenModel):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seen: list[list[Tensor]] = []

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.seen.append([p.grad.clone() for p in self.parameters()])  # type: ignore[union-attr]

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        batch = {k: v.to(self.net[0].weight.dtype) for k, v in batch.items()}
        self.log("val", token_losses(self.net, batch)[0], batch_size=4)


class Float32Recorded(Recorded):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.net.float()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return super().training_step({k: v.float() for k, v in batch.items()}, batch_idx)


class Float32ManualRecorded(ManualRecorded):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.net.float()

    def training_step(self, batch: Any, batch_idx: int) -> None:
        super().training_step({k: v.float() for k, v in batch.items()}, batch_idx)


class ProcessedLoader(ResumableLoader):
    """Saves as consumed the batches Lightning processed (as ``tests/test_faults.py``): a checkpoint written at any
    hook resumes at the batch Lightning trains next."""

    trainer: pl.Trainer | None = None

    def state_dict(self) -> dict[str, int]:
        assert self.trainer is not None
        return {"consumed": self.trainer.fit_loop.epoch_loop.batch_progress.current.processed}


class Bind(pl.Callback):
    def __init__(self, data: ProcessedLoader) -> None:
        self.data = data

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.data.trainer = trainer


class Injected(RuntimeError):
    pass


class At(pl.Callback):
    """At ``hook`` of batch ``at`` (epoch, index), once: ``trainer.save_checkpoint(path)`` if a path is given, else
    raise ``Injected``; ``"in_backward"`` raises from inside the batch's backward pass; ``hook="on_train_start"``
    saves at the fit's start (right after a checkpoint was loaded)."""

    def __init__(self, hook: str, at: tuple[int, int] | None = None, path: Path | None = None) -> None:
        self.hook, self.at, self.path, self.done = hook, at, path, False

    def _here(self, trainer: pl.Trainer, hook: str, loss: Tensor | None = None) -> None:
        where = (trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx)
        if self.done or hook != self.hook or (self.at is not None and where != self.at):
            return
        self.done = True
        if self.path is not None:
            trainer.save_checkpoint(self.path)
        elif hook == "in_backward":
            assert loss is not None
            loss.register_hook(lambda grad: (_ for _ in ()).throw(Injected("in backward")))
        else:
            raise Injected(hook)

    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._here(trainer, "on_train_start")

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._here(trainer, "on_train_batch_start")

    def on_before_backward(self, trainer: pl.Trainer, pl_module: Any, loss: Tensor) -> None:
        self._here(trainer, "on_before_backward")
        self._here(trainer, "in_backward", loss)

    def on_after_backward(self, trainer: pl.Trainer, *args: Any) -> None:
        self._here(trainer, "on_after_backward")

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
        self._here(trainer, "on_before_optimizer_step")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._here(trainer, "on_train_batch_end")

    def on_validation_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._here(trainer, "validation")


def fit(
    adapter: str,
    option: Any = "float32",
    *,
    precision: str = "bf16-true",
    extra: list[pl.Callback] | None = None,
    resume: Path | None = None,
    model: pl.LightningModule | None = None,
    callback: AccumulationScheduler | None = None,
    epochs: int = 1,
    **trainer_kwargs: Any,
) -> pl.LightningModule:
    """A fit of the callback (``"callback"``) or the mixin (``"mixin"``) with ``grad_accum_dtype=option``; ``extra``
    callbacks after the package's; validation after every 5th batch (inside the window [3-5])."""
    if model is None:  # (under bf16-mixed the parameters are float32)
        mixed = precision == "bf16-mixed"
        if adapter == "callback":
            model = Float32Recorded() if mixed else Recorded()
        else:
            model = (Float32ManualRecorded if mixed else ManualRecorded)(schedule=K, grad_accum_dtype=option)
    callbacks: list[pl.Callback] = []
    if adapter == "callback":
        callbacks.append(callback if callback is not None else AccumulationScheduler(K, grad_accum_dtype=option))
    data = ProcessedLoader(DATA, 4)
    callbacks += [*(extra or []), Bind(data)]
    saves = any(isinstance(c, Checkpoint) for c in callbacks)
    kwargs: dict[str, Any] = dict(val_check_interval=5, limit_val_batches=1, enable_checkpointing=saves)
    kwargs.update(trainer_kwargs)
    t = trainer(callbacks=callbacks, max_epochs=epochs, precision=precision, **kwargs)
    t.fit(model, data, ResumableLoader(VAL, 4), ckpt_path=resume)
    return model


def equal(a: list[Tensor], b: list[Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def same_run(got: pl.LightningModule, want: pl.LightningModule) -> None:
    """Bit for bit: the parameters, and the gradient of every step ``got`` took (its last ones)."""
    assert equal(params_of(got), params_of(want))
    seen, full = got.seen, want.seen  # type: ignore[attr-defined]
    assert seen and all(equal(a, b) for a, b in zip(seen, full[len(full) - len(seen) :], strict=True))


ADAPTERS = ["callback", "mixin"]


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_a_spelling_trains_as_its_dtype(adapter: str) -> None:
    """'fp32' and 'Float32 ' train as torch.float32, bit for bit, and not as None (the option acts)."""
    want = fit(adapter, F32)
    for spelling in ("fp32", "Float32 "):
        same_run(fit(adapter, spelling), want)
    assert not equal(params_of(fit(adapter, None)), params_of(want))


# ---------------------------------------------------------------------- Fabric loops
BATCHES = rank_batches(DATA, 4)[0]  # 13 micro-batches


def fabric_run(
    option: Any,
    batches: range,
    *,
    precision: str = "bf16-true",
    state: dict[str, Any] | None = None,
    flush: bool = True,
) -> tuple[FabricAccumulator, Any, Any, list[list[Tensor]]]:
    """A Fabric loop over ``BATCHES[batches]`` with windows of ``K`` (``state``: model, optimizer and accumulator
    states to start from); returns the accumulator, the model, the optimizer and each step's gradient."""
    fabric, model, optimizer = bf16_setup(precision)
    acc = FabricAccumulator(fabric, model, optimizer, schedule=K, grad_accum_dtype=option)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        acc.load_state_dict(state["accumulation"])
    seen: list[list[Tensor]] = []
    optimizer.optimizer.register_step_pre_hook(lambda *_: seen.append([p.grad.clone() for p in acc.params]))
    dtype = next(model.parameters()).dtype
    for i in batches:
        batch = {k: v.to(dtype) for k, v in BATCHES[i].items()}
        with acc.accumulate(batch) as step:
            total, tokens = token_losses(model, batch)
            step.backward(total / tokens)
    if flush:
        acc.flush()
    return acc, model, optimizer, seen


def snapshot(acc: FabricAccumulator, model: Any, optimizer: Any) -> dict[str, Any]:
    return copy.deepcopy(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "accumulation": acc.state_dict()}
    )


def test_fabric_spellings_train_as_their_dtype() -> None:
    full = {dtype: fabric_run(dtype, range(6)) for dtype in (F32, F64, None)}
    for value, dtype in ACCEPTED:
        _, model, _, seen = fabric_run(value, range(6))
        _, want_model, _, want_seen = full[dtype]
        assert equal(params_of(model), params_of(want_model)) and all(map(equal, seen, want_seen)), value
    assert not equal(params_of(full[F32][1]), params_of(full[None][1]))


# ---------------------------------------------------------------------- a dtype narrower than the parameters
NARROWER = r"`grad_accum_dtype=torch.float32` is narrower than a trained parameter of dtype torch.float64.*" + (
    r"Give `grad_accum_dtype=torch.float64`, or None"
)


class Counting(pl.Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_start(self, *args: Any) -> None:
        self.batches += 1


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("option", [F32, "fp32"])
def test_sums_narrower_than_the_parameters_are_refused_at_the_fit_start(adapter: str, option: Any) -> None:
    """float64 parameters (``64-true``): refused before any batch, naming the argument and the fix; nothing is left
    behind: the same model then trains as the float64 reference does."""
    counting = Counting()
    model: Any = TokenModel(optimizer="plain-sgd")
    if adapter == "mixin":
        model = ManualTokenModel(schedule=K, grad_accum_dtype=option, optimizer="plain-sgd")
    before = params_of(model)
    callback = AccumulationScheduler(K, grad_accum_dtype=option)
    callbacks = [callback, counting] if adapter == "callback" else [counting]
    t = trainer(callbacks=callbacks, precision="64-true", max_epochs=1)
    with pytest.raises(ValueError, match=NARROWER):
        t.fit(model, loader(DATA, 4))
    assert counting.batches == 0 and equal(params_of(model), before)
    assert t.accumulate_grad_batches == 1 and "training_step" not in vars(model)
    if adapter == "callback":
        trainer(callbacks=[AccumulationScheduler(K)], precision="64-true", max_epochs=1).fit(model, loader(DATA, 4))
    else:
        model.configure_accumulation(K)
        trainer(precision="64-true", max_epochs=1).fit(model, loader(DATA, 4))
    expected, _ = Reference(Constant(K), optimizer="plain-sgd").run([rank_batches(DATA, 4)])
    assert max_diff(params_of(model), expected) <= 1e-12


def test_fabric_sums_narrower_than_the_parameters_are_refused_at_construction() -> None:
    with default_dtype(F64):
        fabric = Fabric(accelerator="cpu", devices=1, precision="64-true")
        net = make_net()
        model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        with pytest.raises(ValueError, match=NARROWER):
            FabricAccumulator(fabric, model, optimizer, grad_accum_dtype="fp32")
        assert "backward" not in vars(fabric) and not {"step", "zero_grad"} & set(vars(optimizer))
        model(torch.randn(2, 3, dtype=F64)).sum().backward()
        assert all(p.grad is not None for p in model.parameters())


# ---------------------------------------------------------------------- where it does nothing
INERT = r"`grad_accum_dtype='float32'` changes nothing in this fit: no trained parameter is narrower than float32"


def inert_warnings(run: Callable[[], Any]) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = run()
    return out, [str(w.message) for w in seen if "grad_accum_dtype" in str(w.message)]


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_under_bf16_mixed_the_option_warns_once_and_changes_nothing(adapter: str) -> None:
    """float32 parameters: one warning, and the run is the run without the option, bit for bit (every step's
    gradient too)."""
    without = fit(adapter, None, precision="bf16-mixed")
    with_it, said = inert_warnings(lambda: fit(adapter, "float32", precision="bf16-mixed"))
    assert len(said) == 1 and re.search(INERT, said[0]) and "float32 already" in said[0], said
    same_run(with_it, without)
    assert len(with_it.seen) == 5  # ([0-2] [3-5] [6-8] [9-11] [12])


def test_fabric_under_bf16_mixed_the_option_warns_once_and_changes_nothing() -> None:
    _, model, _, seen = fabric_run(None, range(13), precision="bf16-mixed")
    (_, with_model, _, with_seen), said = inert_warnings(lambda: fabric_run("fp32", range(13), precision="bf16-mixed"))
    assert len(said) == 1 and re.search(INERT, said[0]), said
    assert equal(params_of(with_model), params_of(model)) and len(seen) == 5 and all(map(equal, with_seen, seen))


# ---------------------------------------------------------------------- strategies that hold the gradient themselves
ELSEWHERE = {
    "deepspeed": r"DeepSpeed sums .* set `\"data_types\": \{\"grad_accum_dtype\": \"fp32\"\}` in "
    r"`DeepSpeedStrategy\(config=...\)` and leave `grad_accum_dtype=None` here",
    "fsdp2": r"FSDP2 .*MixedPrecisionPolicy\(param_dtype=torch.bfloat16, reduce_dtype=torch.float32\).* use that, "
    r"with `grad_accum_dtype=None`",
    "fsdp": r"FSDP \(1\) .*MixedPrecision\(param_dtype=torch.bfloat16, reduce_dtype=torch.float32\)`.*"
    r"`grad_accum_dtype=None`, or FSDP2",
}


@pytest.mark.parametrize("family", sorted(ELSEWHERE))
def test_refuse_under_names_what_does_the_job_there(family: str) -> None:
    with pytest.raises(ValueError, match=r"(?s)^Who: `grad_accum_dtype='float32'` cannot work here\. .*"):
        refuse_under(family, F32, "Who")
    with pytest.raises(ValueError, match=rf"(?s){ELSEWHERE[family]}"):
        refuse_under(family, F64, "Who")
    refuse_under(family, None, "Who")  # (nothing to refuse)
    for other in ("single", "ddp"):
        refuse_under(other, F32, "Who")


class LooksLikeDeepSpeed(SingleDeviceStrategy):
    """A stand-in: DeepSpeed is told apart by ``handles_gradient_accumulation`` (``sync.is_deepspeed``). Lightning's
    DeepSpeed runs on CPU in forked ranks only (``tests/test_deepspeed.py``, where the real one is refused too)."""

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True


class LooksLikeFSDP2(nn.Module):
    """A stand-in for a module ``fully_shard`` made (FSDP2 is told apart by ``set_requires_gradient_sync``). FSDP2 runs
    on CPU in forked ranks only (``tests/distributed/``)."""

    def set_requires_gradient_sync(self, requires: bool, recurse: bool = True) -> None:
        pass

    def forward(self, x: Tensor) -> Tensor:
        return x


class LooksLikeFSDP(nn.Module):
    """A stand-in for FSDP (1)'s wrapper class (which needs a process group to be made), put where ``sync`` looks
    for that class; FSDP (1) is not run on CPU by this project."""


def _with_part(model: pl.LightningModule, part: nn.Module) -> pl.LightningModule:
    model.part = part  # (a submodule without parameters: only its class is read)
    return model


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("family", ["deepspeed", "fsdp2", "fsdp"])
def test_the_trainer_adapters_refuse_where_the_strategy_holds_the_gradient(
    adapter: str, family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The adapters' call sites with stand-ins of each strategy family, one process (see the stand-ins). The mixin
    never runs under DeepSpeed: refused whole, naming what does."""
    counting = Counting()
    model: pl.LightningModule = TokenModel() if adapter == "callback" else ManualTokenModel(
        schedule=K, grad_accum_dtype="float32"
    )  # fmt: skip
    strategy: Any = "auto"
    if family == "deepspeed":
        strategy = LooksLikeDeepSpeed(device=torch.device("cpu"))
    elif family == "fsdp2":
        _with_part(model, LooksLikeFSDP2())
    else:
        monkeypatch.setattr(sync, "_fsdp_type", lambda: LooksLikeFSDP)
        _with_part(model, LooksLikeFSDP())
    callbacks: list[pl.Callback] = [counting]
    if adapter == "callback":
        callbacks.insert(0, AccumulationScheduler(K, grad_accum_dtype="float32"))
    who = "AccumulationScheduler" if adapter == "callback" else "AccumulationMixin"
    error, match = ValueError, rf"(?s)^{who}: `grad_accum_dtype='float32'` cannot work here\. {ELSEWHERE[family]}"
    if adapter == "mixin" and family == "deepspeed":
        error, match = RuntimeError, r"`AccumulationMixin` cannot run under `LooksLikeDeepSpeed`"
    t = trainer(callbacks=callbacks, precision="bf16-true", strategy=strategy)
    assert sync.family(types.SimpleNamespace(model=model, handles_gradient_accumulation=family == "deepspeed")) == (
        family
    )
    with pytest.raises(error, match=match):
        t.fit(model, loader(DATA, 4))
    assert counting.batches == 0


class ModelParallelStrategy(FabricSingleDevice):
    """A stand-in named as Fabric's FSDP2 strategy (``_fabric.guards.sync_plan`` reads the class names), over a
    model with a module ``fully_shard`` would have made."""

    device_mesh = {"tensor_parallel": types.SimpleNamespace(size=lambda: 1)}


def test_the_fabric_accumulator_refuses_under_fsdp2_before_anything_changes() -> None:
    fabric = Fabric(strategy=ModelParallelStrategy(device=torch.device("cpu")), precision="bf16-true")
    net = nn.Sequential(make_net(), LooksLikeFSDP2())
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    match = rf"(?s)^FabricAccumulator: `grad_accum_dtype='float32'` cannot work here\. {ELSEWHERE['fsdp2']}"
    with pytest.raises(ValueError, match=match):
        FabricAccumulator(fabric, model, optimizer, grad_accum_dtype="float32")
    untouched(fabric, model, optimizer)
    FabricAccumulator(fabric, model, optimizer)  # (without the option it runs there)


# ---------------------------------------------------------------------- checkpoints across the option
def saved_state(path: Path, adapter: str) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(path, weights_only=False)["callbacks"]
    return state["AccumulationScheduler" if adapter == "callback" else "AccumulationMixin"]


def saved_window(path: Path, adapter: str) -> dict[str, Any]:
    """The engine's state a checkpoint holds (the mixin's: its one window group's)."""
    state = saved_state(path, adapter)
    return state if adapter == "callback" else next(iter(state["groups"].values()))


def state_of(model: pl.LightningModule, callback: AccumulationScheduler | None) -> tuple[Any, ...]:
    """What a refused resume must leave as it was: the package's progress and open window."""
    engines = [callback._engine] if callback is not None else list(model._accumulation.windows.engines.values())  # type: ignore[attr-defined]
    states = [(e.progress, None if e.window is None else e.window.state_dict()) for e in engines]
    return tuple(s for s in states if s != (Progress(), None))  # (a group's engine made, and left as made, is none)


CHECKPOINTS: dict[tuple[str, Any], tuple[pl.LightningModule, Path, Path]] = {}


def checkpoints(adapter: str, option: Any, directory: Path) -> tuple[pl.LightningModule, Path, Path]:
    """The uninterrupted run with ``option``, and its checkpoints inside the window [3-5] (after batch 4) and at the
    step after batch 5 (once per session)."""
    if (adapter, option) not in CHECKPOINTS:
        directory.mkdir(parents=True, exist_ok=True)
        inside, at_step = directory / f"{adapter}-{option}-inside.ckpt", directory / f"{adapter}-{option}-step.ckpt"
        saves = [At("on_train_batch_end", MID, inside), At("on_train_batch_end", LAST, at_step)]
        CHECKPOINTS[(adapter, option)] = (fit(adapter, option, extra=saves), inside, at_step)
    return CHECKPOINTS[(adapter, option)]


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("grad_accum_dtype")


def fresh(adapter: str, option: Any) -> tuple[pl.LightningModule, AccumulationScheduler | None]:
    if adapter == "callback":
        return Recorded(), AccumulationScheduler(K, grad_accum_dtype=option)
    return ManualRecorded(schedule=K, grad_accum_dtype=option), None


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize(("saved", "resumed"), [("float32", None), (None, "float32"), ("float32", "float64")])
def test_a_window_resumed_under_another_option_is_refused(
    adapter: str, saved: Any, resumed: Any, ckpt_dir: Path
) -> None:
    """A checkpoint written inside a window, resumed with another ``grad_accum_dtype``: refused before the package's
    state changes, naming the argument and the fix; resumed with the saved one, the run is the uninterrupted one."""
    full, inside, _ = checkpoints(adapter, saved, ckpt_dir)
    assert saved_window(inside, adapter)["window_options"].get("grad_accum_dtype") == saved
    model, callback = fresh(adapter, resumed)
    before = state_of(model, callback)
    fix = rf"this run has `grad_accum_dtype={resumed!r}`.*Resume with `grad_accum_dtype={saved!r}`"
    with pytest.raises(ValueError, match=rf"(?s)`grad_accum_dtype={saved!r}`\); {fix}"):
        fit(adapter, resumed, resume=inside, model=model, callback=callback)
    assert state_of(model, callback) == before
    model, callback = fresh(adapter, saved)
    same_run(fit(adapter, saved, resume=inside, model=model, callback=callback), full)


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize(("saved", "resumed"), [("float32", None), (None, "float32")])
def test_a_checkpoint_at_a_step_is_resumed_under_either(adapter: str, saved: Any, resumed: Any, ckpt_dir: Path) -> None:
    full, _, at_step = checkpoints(adapter, saved, ckpt_dir)
    assert saved_window(at_step, adapter)["window"] is None and "window_options" not in saved_window(at_step, adapter)
    model, callback = fresh(adapter, resumed)
    resumed_run = fit(adapter, resumed, resume=at_step, model=model, callback=callback)
    assert len(resumed_run.seen) == len(full.seen) - 2  # (the windows [0-2] [3-5] were stepped before it)


# ---------------------------------------------------------------------- resume inside a window: bit for bit
def assert_float32_sums(grads: list[Tensor | None], summed: bool = True) -> None:
    """The partial gradient a checkpoint holds under the option: float32 sums, not rounded to bf16 (``summed``: of
    several micro-batches, so that some value is not a bf16 number)."""
    held = [g for g in grads if g is not None]
    assert held and all(g.dtype == F32 for g in held), [None if g is None else g.dtype for g in grads]
    assert not summed or any(not torch.equal(g, g.bfloat16().float()) for g in held)


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_resume_inside_a_window_is_bit_identical(adapter: str, ckpt_dir: Path, tmp_path: Path) -> None:
    """The window's float32 sums saved as they are and put back exactly; a checkpoint saved right after the load,
    before anything was put back, holds the same and resumes as exactly."""
    full, inside, _ = checkpoints(adapter, "float32", ckpt_dir)
    assert_float32_sums(saved_state(inside, adapter)["grads"])
    again = tmp_path / "again.ckpt"
    model, callback = fresh(adapter, "float32")
    hook = "on_train_start" if adapter == "mixin" else "on_train_batch_start"  # (each before its put back)
    resumed = fit(adapter, resume=inside, model=model, callback=callback, extra=[At(hook, None, again)])
    same_run(resumed, full)
    assert equal(saved_state(again, adapter)["grads"], saved_state(inside, adapter)["grads"])
    model, callback = fresh(adapter, "float32")
    same_run(fit(adapter, resume=again, model=model, callback=callback), full)


def test_resume_from_a_validation_checkpoint_inside_a_window(tmp_path: Path, ckpt_dir: Path) -> None:
    """``ModelCheckpoint`` after each validation (batches 4 and 9: inside the windows [3-5] and [9-11])."""
    full, *_ = checkpoints("callback", "float32", ckpt_dir)
    saving = ModelCheckpoint(tmp_path, "{epoch}-{step}", save_top_k=-1)
    fit("callback", extra=[saving])
    paths = [tmp_path / "epoch=0-step=1.ckpt", tmp_path / "epoch=0-step=3.ckpt"]
    for path, held in zip(paths, (2, 1), strict=True):
        assert saved_state(path, "callback")["window"]["microbatches"] == held
        assert_float32_sums(saved_state(path, "callback")["grads"], summed=held > 1)
        same_run(fit("callback", resume=path), full)


def fail_and_resume(full: pl.LightningModule, tmp_path: Path, fault: At, source: str) -> list[str]:
    """A callback fit with the option that fails at ``fault``, resumed from Lightning's on-exception checkpoint (or
    from the last one at a step), against the uninterrupted run ``full``; the warnings about the window."""
    saving = [
        ModelCheckpoint(tmp_path, "{step}", every_n_train_steps=1, save_top_k=-1),
        OnExceptionCheckpoint(tmp_path),
    ]
    with warnings.catch_warnings(record=True) as seen, pytest.raises(Injected):
        warnings.simplefilter("always")
        fit("callback", extra=[fault, *saving])
    path = tmp_path / "on_exception.ckpt"
    if source == "step":
        path = max(tmp_path.glob("step=*.ckpt"), key=lambda p: int(p.stem.split("=")[1]))
    same_run(fit("callback", resume=path), full)
    return [str(w.message) for w in seen if "accumulation window" in str(w.message)]


@pytest.mark.parametrize(
    ("hook", "at", "source", "warns"),
    [
        ("on_train_batch_start", MID, "exception", False),
        ("on_after_backward", MID, "exception", False),  # the batch's sum is in: trained again, it adds nothing
        ("on_train_batch_end", MID, "exception", False),
        ("validation", MID, "exception", False),
        ("on_before_optimizer_step", LAST, "step", True),  # after the sums were landed: left out, with a warning
        ("in_backward", MID, "step", True),  # part of a pass in the sums: left out, with a warning
    ],
)
def test_an_exception_inside_a_window_resumes_from_the_on_exception_checkpoint(
    tmp_path: Path, ckpt_dir: Path, hook: str, at: tuple[int, int], source: str, warns: bool
) -> None:
    full = checkpoints("callback", "float32", ckpt_dir)[0]
    seen = fail_and_resume(full, tmp_path, At(hook, at), source)
    assert bool(seen) == warns, seen


def test_fabric_resume_inside_a_window_is_bit_identical() -> None:
    """``acc.state_dict()`` after batch 4 (inside [3-5]) holds float32 sums; a state saved right after loading it,
    before a block put it back, holds the same; each resumes as the uninterrupted loop, bit for bit."""
    _, full_model, _, full_seen = fabric_run("float32", range(13))
    acc, model, optimizer, _ = fabric_run("float32", range(5), flush=False)
    state = snapshot(acc, model, optimizer)
    assert_float32_sums(state["accumulation"]["grads"])
    acc, model, optimizer, _ = fabric_run("float32", range(0), state=state, flush=False)
    again = snapshot(acc, model, optimizer)
    assert equal(again["accumulation"]["grads"], state["accumulation"]["grads"])
    for start in (state, again):
        _, resumed, _, seen = fabric_run("float32", range(5, 13), state=start)
        assert equal(params_of(resumed), params_of(full_model))
        assert len(seen) == 4 and all(map(equal, seen, full_seen[-4:]))  # ([3-5] [6-8] [9-11] [12])


@pytest.mark.parametrize(("saved", "loaded"), [("float32", None), (None, "float32")])
def test_fabric_refuses_a_window_of_another_option_before_anything_changes(saved: Any, loaded: Any) -> None:
    """Refused with the accumulator's own window open (one block in): it stays as it was, and goes on."""
    acc, model, optimizer, _ = fabric_run(saved, range(5), flush=False)
    state = snapshot(acc, model, optimizer)["accumulation"]
    acc, model, optimizer, _ = fabric_run(loaded, range(1), flush=False)
    before = (acc.progress, acc._engine.window.state_dict(), acc._guard.armed, acc._epoch, acc._batch)
    sums = [None if g is None else g.clone() for g in acc._engine.wide.current(acc.params)] if loaded else None
    grads = [None if p.grad is None else p.grad.clone() for p in acc.params]
    refusal = rf"`grad_accum_dtype={saved!r}`\); this run has `grad_accum_dtype={loaded!r}`"
    with pytest.raises(ValueError, match=refusal):
        acc.load_state_dict(state)
    assert (acc.progress, acc._engine.window.state_dict(), acc._guard.armed, acc._epoch, acc._batch) == before
    assert same_or_none(grads, [p.grad for p in acc.params])
    assert sums is None or same_or_none(sums, acc._engine.wide.current(acc.params))
    fabric_blocks(acc, range(1, 3))  # (the window goes on and steps)
    assert acc.progress.step == 1


def same_or_none(a: list[Tensor | None], b: list[Tensor | None]) -> bool:
    pairs = zip(a, b, strict=True)
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y)) for x, y in pairs)


# ---------------------------------------------------------------------- ways around the window
class ZeroesInside(ManualTokenModel):
    """``how`` in batch 4's ``training_step``, after its block (inside the window [3-5])."""

    how = "zero_grad"

    def training_step(self, batch: Any, batch_idx: int) -> None:
        super().training_step(batch, batch_idx)
        if batch_idx == 4:
            if self.how == "zero_grad":
                self.optimizers().zero_grad()  # type: ignore[union-attr]
            elif self.how == "self.zero_grad":
                self.zero_grad()
            else:
                self.optimizers().step()  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("how", "match"),
    [
        ("zero_grad", r"`zero_grad\(\)` was called during training"),
        ("self.zero_grad", r"`zero_grad\(\)` was called during training"),
        ("step", r"`optimizer.step\(\)` was called inside `training_step`"),
    ],
)
def test_the_mixin_refuses_a_reset_or_step_inside_a_window_with_the_option(how: str, match: str) -> None:
    """Between passes a narrow parameter's ``.grad`` is None (its sum is in the buffer): the guards still refuse, and
    the window's sums are left as they were (for the on-exception checkpoint)."""
    model = ZeroesInside(schedule=K, grad_accum_dtype="float32")
    model.how = how
    with pytest.raises(RuntimeError, match=match):
        trainer(precision="bf16-true", max_epochs=1).fit(model, loader(DATA, 4))
    (engine,) = model._accumulation.windows.engines.values()
    assert engine.progress.step == 1 and engine.window is not None and engine.window.microbatches == 2
    assert all(p.grad is None for p in model.parameters())  # (bf16: every parameter narrow, its sum held)
    assert len(model._accumulation.windows.wide.sums()) == 4


def fabric_blocks(acc: FabricAccumulator, batches: range, fail_at: int | None = None) -> None:
    for i in batches:
        batch = {k: v.bfloat16() for k, v in BATCHES[i].items()}
        with acc.accumulate(batch) as step:
            total, tokens = token_losses(acc.model, batch)
            step.backward(total / tokens)
            if i == fail_at:
                raise Injected("after step.backward")


def test_fabric_refuses_going_around_the_window_with_the_option() -> None:
    """Inside a block and between blocks: refused, with the sums as they were and ``.grad`` None."""
    fabric, model, optimizer = bf16_setup()
    acc = FabricAccumulator(fabric, model, optimizer, schedule=100, grad_accum_dtype="float32")
    fabric_blocks(acc, range(1))
    batch = {k: v.bfloat16() for k, v in BATCHES[1].items()}
    inside = (
        (lambda: optimizer.step(), r"`optimizer.step\(\)` was called while an accumulation window is open"),
        (lambda: optimizer.optimizer.step(), r"`optimizer.step\(\)` was called while"),
        (lambda: optimizer.zero_grad(), r"`optimizer.zero_grad\(\)` was called while"),
        (lambda: model.zero_grad(), r"`model.zero_grad\(\)` was called while"),
        (lambda: acc.fabric.backward(token_losses(model, batch)[0]), r"`fabric.backward\(loss\)` was called"),
    )
    for call, match in inside:
        sums = [g.clone() for g in acc._engine.wide.sums()]
        with acc.accumulate(batch) as step:
            with pytest.raises(RuntimeError, match=match):
                call()
            assert equal(acc._engine.wide.sums(), sums) and all(p.grad is None for p in acc.params)
            step.backward(token_losses(model, batch)[0])
    sums = [g.clone() for g in acc._engine.wide.sums()]
    for between in (optimizer.step, optimizer.zero_grad, model.zero_grad):
        with pytest.raises(RuntimeError, match=r"was called while an accumulation window is open"):
            between()
    assert equal(acc._engine.wide.sums(), sums) and all(p.grad is None for p in acc.params)
    assert acc._engine.window.microbatches == 6
    acc.flush()


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_a_fit_after_a_failed_fit_starts_clean(adapter: str) -> None:
    """A fit that failed inside a window (its sums held, for an on-exception checkpoint), then a fit of the same
    objects without a checkpoint: its windows hold nothing of the failed one (a fresh run from the same
    parameters, bit for bit)."""
    model, callback = fresh(adapter, "float32")
    with pytest.raises(Injected):
        fit(adapter, model=model, callback=callback, extra=[At("on_train_batch_end", MID)])
    wide = callback._engine.wide if callback is not None else model._accumulation.windows.wide  # type: ignore[union-attr]
    assert len(wide.sums()) == 4  # (held: the failed window's)
    start, model.seen = copy.deepcopy(model.state_dict()), []
    again = fit(adapter, model=model, callback=callback)
    model2, callback2 = fresh(adapter, "float32")
    model2.load_state_dict(start)
    same_run(again, fit(adapter, model=model2, callback=callback2))


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_a_failed_fit_resumed_from_a_step_checkpoint_by_the_same_objects(
    adapter: str, tmp_path: Path, ckpt_dir: Path
) -> None:
    """The failed fit's objects resumed from its last checkpoint at a step: the uninterrupted run, bit for bit (the
    failed window's sums are no part of the resumed run's windows)."""
    full = checkpoints(adapter, "float32", ckpt_dir)[0]
    model, callback = fresh(adapter, "float32")
    saving = ModelCheckpoint(tmp_path, "{step}", every_n_train_steps=1, save_top_k=-1)
    with pytest.raises(Injected):
        fit(adapter, model=model, callback=callback, extra=[At("on_train_batch_end", MID), saving])
    model.seen = []
    same_run(fit(adapter, model=model, callback=callback, resume=tmp_path / "step=1.ckpt"), full)


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_a_refused_resume_changes_nothing_and_a_fresh_fit_then_starts_clean(adapter: str, ckpt_dir: Path) -> None:
    """Objects that trained an epoch, then failed inside a window; a resume from a checkpoint of another option is
    refused and leaves their state (progress, open window) as it was; a fit without a checkpoint then holds nothing of
    the failed window (a fresh run from the same parameters, bit for bit)."""
    _, inside, _ = checkpoints(adapter, None, ckpt_dir)
    model, callback = fresh(adapter, "float32")
    fit(adapter, model=model, callback=callback)
    with pytest.raises(Injected):
        fit(adapter, model=model, callback=callback, extra=[At("on_train_batch_end", MID)])
    before = state_of(model, callback)
    with pytest.raises(ValueError, match=r"`grad_accum_dtype=None`\); this run has `grad_accum_dtype='float32'`"):
        fit(adapter, model=model, callback=callback, resume=inside)
    assert state_of(model, callback) == before
    start, model.seen = copy.deepcopy(model.state_dict()), []
    again = fit(adapter, model=model, callback=callback)
    model2, callback2 = fresh(adapter, "float32")
    model2.load_state_dict(start)
    same_run(again, fit(adapter, model=model2, callback=callback2))


def test_two_fits_in_a_row_with_the_same_callback() -> None:
    """A second fit of the same callback, of another model and of the same one again: as with a fresh callback,
    bit for bit; the first model keeps no hook (its gradients go to ``.grad`` after the fit)."""
    callback = AccumulationScheduler(K, grad_accum_dtype="float32")
    first = fit("callback", callback=callback)
    first.net(torch.randn(2, 3, dtype=torch.bfloat16)).sum().backward()
    assert all(p.grad is not None for p in first.parameters())
    first.zero_grad()
    second = fit("callback", callback=callback, model=Recorded(seed=1))
    same_run(second, fit("callback", model=Recorded(seed=1)))
    start, second.seen = copy.deepcopy(second.state_dict()), []
    third = fit("callback", callback=callback, model=second)
    model = Recorded(seed=1)
    model.load_state_dict(start)
    same_run(third, fit("callback", model=model))


def fabric_fresh(state: dict[str, Any], schedule: int, batches: range) -> tuple[Any, list[list[Tensor]]]:
    """A fresh model and optimizer from ``state``, a fresh accumulator over ``batches`` (flushed)."""
    fabric, model, optimizer = bf16_setup()
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    acc = FabricAccumulator(fabric, model, optimizer, schedule=schedule, grad_accum_dtype="float32")
    seen: list[list[Tensor]] = []
    optimizer.optimizer.register_step_pre_hook(lambda *_: seen.append([p.grad.clone() for p in acc.params]))
    fabric_blocks(acc, batches)
    acc.flush()
    return model, seen


def test_a_fabric_loop_after_an_exception_inside_a_block_starts_clean() -> None:
    """An exception inside a block after its ``step.backward`` (the window [3-5] holds batches 3 and 4 and part of
    5): the window is left out, warned; the loop goes on with a clean window, as a fresh loop would, bit for bit."""
    fabric, model, optimizer = bf16_setup()
    acc = FabricAccumulator(fabric, model, optimizer, schedule=K, grad_accum_dtype="float32")
    fabric_blocks(acc, range(5))
    state = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    left_out = r"the window \(2 earlier micro-batch\(es\) and this one\) was left out"
    with pytest.warns(UserWarning, match=left_out), pytest.raises(Injected):
        fabric_blocks(acc, range(5, 6), fail_at=5)
    seen: list[list[Tensor]] = []
    optimizer.optimizer.register_step_pre_hook(lambda *_: seen.append([p.grad.clone() for p in acc.params]))
    fabric_blocks(acc, range(6, 13))
    acc.flush()
    want, want_seen = fabric_fresh(state, K, range(6, 13))
    assert equal(params_of(model), params_of(want)) and len(seen) == 3 and all(map(equal, seen, want_seen))


def test_a_second_fabric_accumulator_takes_the_model_over() -> None:
    """A second accumulator on the model (another phase: windows of 2), after the first one's last window stepped:
    its windows are a fresh accumulator's, bit for bit. Before the fix the first one's hooks, alive with it, took
    every bf16 gradient into its own sums: the second one's steps saw none and moved nothing."""
    fabric, model, optimizer = bf16_setup()
    first = FabricAccumulator(fabric, model, optimizer, schedule=K, grad_accum_dtype="float32")
    fabric_blocks(first, range(6))
    state = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    second = FabricAccumulator(fabric, model, optimizer, schedule=2, grad_accum_dtype="float32")
    seen: list[list[Tensor]] = []
    optimizer.optimizer.register_step_pre_hook(lambda *_: seen.append([p.grad.clone() for p in second.params]))
    fabric_blocks(second, range(6, 13))
    second.flush()
    want, want_seen = fabric_fresh(state, 2, range(6, 13))
    assert len(seen) == 4 and all(map(equal, seen, want_seen)) and equal(params_of(model), params_of(want))
