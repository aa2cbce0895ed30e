"""``FabricAccumulator``'s misuse table: every argument fed 0, a negative, NaN, the wrong type and a
near miss; every way around the window (``fabric.backward``, ``optimizer.step()``/``zero_grad()`` and
``flush()`` inside a block, ``step.backward`` after it, a block inside a block); checkpoints that
cannot be resumed. Each is refused before anything changes, with a message naming the argument and
the fix: the test checks the parameters, the gradients and the progress after each refusal."""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric

from lightning_accum import Constant, Piecewise
from lightning_accum.fabric import FabricAccumulator
from lightning_accum.lr import WarmupLinear

from helpers import TokenData, count_tokens, default_dtype, make_net, rank_batches, token_losses


@pytest.fixture(autouse=True)
def float64_outputs() -> Iterator[None]:
    with default_dtype(torch.float64):
        yield


BATCHES = rank_batches(TokenData(16), 4)[0]


def setup() -> tuple[Fabric, Any, Any]:
    fabric = Fabric(accelerator="cpu", devices=1, precision="64-true")
    net = make_net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    return fabric, model, optimizer


def made(**kwargs: Any) -> FabricAccumulator:
    fabric, model, optimizer = setup()
    return FabricAccumulator(fabric, model, optimizer, **kwargs)


def state(acc: FabricAccumulator) -> tuple[Any, ...]:
    """What must not change when a call is refused."""
    window = acc._engine.window
    counts = None if window is None else (window.microbatches, window.samples, window.items)
    grads = [None if p.grad is None else p.grad.clone() for p in acc.params]
    return [p.detach().clone() for p in acc.params], grads, acc.progress, counts, acc._epoch, acc._batch


def same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    def eq(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)
        if isinstance(x, list | tuple):
            return isinstance(y, list | tuple) and len(x) == len(y) and all(map(eq, x, y))
        return bool(x == y)

    return eq(a, b)


def one_block(acc: FabricAccumulator, batch: Any = None, **kwargs: Any) -> None:
    batch = BATCHES[0] if batch is None else batch
    with acc.accumulate(batch, **kwargs) as step:
        total, tokens = token_losses(acc.model, batch)
        step.backward(total / tokens)


# ---------------------------------------------------------------------- the constructor
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"gradient_clip_val": 0}, ValueError, r"`gradient_clip_val` must be a finite number > 0.*give None"),
        ({"gradient_clip_val": 0.0}, ValueError, r"`gradient_clip_val` must be a finite number > 0"),
        ({"gradient_clip_val": -1.0}, ValueError, r"`gradient_clip_val` must be .* got -1.0"),
        ({"gradient_clip_val": math.nan}, ValueError, r"`gradient_clip_val` must be .* got nan"),
        ({"gradient_clip_val": math.inf}, ValueError, r"`gradient_clip_val` must be .* got inf"),
        ({"gradient_clip_val": "1.0"}, ValueError, r"`gradient_clip_val` must be .* got '1.0'"),
        ({"gradient_clip_val": True}, ValueError, r"`gradient_clip_val` must be .* got True"),
        ({"gradient_clip_algorithm": "value"}, ValueError, r"'value'` was given without `gradient_clip_val`"),
        ({"gradient_clip_val": 1.0, "gradient_clip_algorithm": "nrom"}, ValueError, r"'norm' or 'value'; got 'nrom'"),
        ({"log": "no"}, TypeError, r"`log` must be True or False; got 'no'"),
        ({"log": None}, TypeError, r"`log` must be True or False; got None"),
        ({"sync": "never"}, ValueError, r"`sync` must be 'auto', 'skip' or 'every'"),
        ({"normalize": "token"}, ValueError, r"`normalize` must be 'mean' or 'items'"),
        ({"reduction": "sum"}, ValueError, r"`reduction='sum'` says what the loss is over .* leave `reduction` out"),
        ({"reduction": "mean"}, ValueError, r"`reduction='mean'` says what the loss is over"),
        ({"normalize": "items", "count": count_tokens}, ValueError, r"needs `reduction`"),
        ({"normalize": "items", "reduction": "sum"}, ValueError, r"`normalize='items'` needs `count`"),
        ({"normalize": "items", "count": count_tokens, "reduction": "avg"}, ValueError, r"'sum' or 'mean'"),
        ({"count": 3}, TypeError, r"`count` must be a function"),
        ({"schedule": 0}, ValueError, r"int >= 1"),
        ({"schedule": -2}, ValueError, r"int >= 1"),
        ({"schedule": 1.5}, TypeError, r"schedule"),
        ({"lr_scaling": "linaer"}, ValueError, r"`lr_scaling` must be None, 'linear'"),
        ({"lr_schedule": WarmupLinear}, TypeError, r"an instance, `WarmupLinear\(...\)`"),
    ],
)
def test_constructor_arguments(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        made(**kwargs)


def test_the_fabric_model_and_optimizer_are_checked() -> None:
    fabric, model, optimizer = setup()
    with pytest.raises(TypeError, match=r"`fabric` must be the `lightning.fabric.Fabric`.*got None"):
        FabricAccumulator(None, model, optimizer)
    with pytest.raises(TypeError, match=r"`model` and `optimizer` are swapped"):
        FabricAccumulator(fabric, optimizer, model)
    with pytest.raises(TypeError, match=r"`optimizer` must be the optimizer `fabric.setup\(...\)` returned"):
        FabricAccumulator(fabric, model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"`model` must be the module `fabric.setup\(...\)` returned \(got a plain"):
        FabricAccumulator(fabric, make_net(), optimizer)
    FabricAccumulator(fabric, torch.compile(model), optimizer)  # a compiled Fabric module is one


class _Strategy:
    """Stand-ins named as Fabric's strategies (the check reads the class names, of either namespace)."""


def _named(name: str) -> Any:
    return type(name, (_Strategy,), {})()


@pytest.mark.parametrize(
    ("strategy", "match"),
    [
        ("DeepSpeedStrategy", r"DeepSpeed accumulates and steps by itself"),
        ("FSDPStrategy", r"not proved on `FSDPStrategy`.*use FSDP2"),
        ("DataParallelStrategy", r"not proved on `DataParallelStrategy`"),
        ("XLAStrategy", r"not proved on `XLAStrategy` \(XLA\)"),
    ],
)
def test_strategies_not_proved_are_refused(strategy: str, match: str) -> None:
    _, model, optimizer = setup()
    stand_in = type("Fabric", (), {"strategy": _named(strategy), "world_size": 1, "backward": None})()
    with pytest.raises(ValueError, match=match):
        FabricAccumulator(stand_in, model, optimizer)


def test_model_parallel_without_fsdp2_or_with_tensor_parallelism_is_refused() -> None:
    _, model, optimizer = setup()
    mesh = {"tensor_parallel": types.SimpleNamespace(size=lambda: 2)}
    strategy = type("ModelParallelStrategy", (_Strategy,), {"device_mesh": mesh})()
    stand_in = type("Fabric", (), {"strategy": strategy, "world_size": 2, "backward": None})()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2.*tensor_parallel_size=1"):
        FabricAccumulator(stand_in, model, optimizer)
    mesh["tensor_parallel"] = types.SimpleNamespace(size=lambda: 1)
    with pytest.raises(ValueError, match=r"needs the model sharded with FSDP2 \(`fully_shard`"):
        FabricAccumulator(stand_in, model, optimizer)


# ---------------------------------------------------------------------- accumulate, step.backward, flush
def _call_refused(acc: FabricAccumulator, call: Callable[[], Any], error: type[Exception], match: str) -> None:
    before = state(acc)
    with pytest.raises(error, match=match):
        call()
    assert same(state(acc), before), "a refused call changed the accumulator, the parameters or the gradients"


@pytest.mark.parametrize(
    ("epoch", "error", "match"),
    [
        (-1, ValueError, r"`epoch` must be an int >= 0.*got -1"),
        ("0", ValueError, r"`epoch` must be an int >= 0.*got '0'"),
        (1.5, ValueError, r"`epoch` must be an int >= 0.*got 1.5"),
        (True, ValueError, r"`epoch` must be an int >= 0.*got True"),
        (math.nan, ValueError, r"`epoch` must be an int >= 0.*got nan"),
    ],
)
def test_epoch_arguments(epoch: Any, error: type[Exception], match: str) -> None:
    acc = made(schedule=2)
    one_block(acc)  # inside a window: a refusal must leave it as it is

    def call() -> None:
        with acc.accumulate(BATCHES[1], epoch=epoch):
            pass

    _call_refused(acc, call, error, match)


def test_epochs_going_backwards_or_an_epoch_inside_a_window_are_refused() -> None:
    acc = made(schedule=3)
    one_block(acc, epoch=2)
    for epoch, match in ((1, r"`epoch=1` goes back from epoch 2"), (3, r"Epoch 3 began inside a window of epoch 2")):
        _call_refused(acc, lambda e=epoch: one_block(acc, BATCHES[1], epoch=e), Exception, match)


@pytest.mark.parametrize(
    ("schedule", "lr_schedule", "match"),
    [
        (Piecewise({0: 2}, unit="epoch"), None, r"The schedule Piecewise.* is keyed on epochs"),
        (Constant(2), WarmupLinear(warmup=1, total=3, unit="epoch"), r"The lr_schedule WarmupLinear.* keyed on epochs"),
    ],
)
def test_epoch_keyed_schedules_need_epoch(schedule: Any, lr_schedule: Any, match: str) -> None:
    acc = made(schedule=schedule, lr_schedule=lr_schedule)
    _call_refused(acc, lambda: one_block(acc), ValueError, match + r".*`acc.accumulate\(batch, epoch=e\)`")
    one_block(acc, epoch=0)  # with it, fine


def test_last_must_be_a_bool() -> None:
    acc = made(schedule=2)
    _call_refused(acc, lambda: one_block(acc, last="yes"), TypeError, r"`last` must be True or False; got 'yes'")


def _counting(value: Any) -> Callable[[Any], Any]:
    return lambda batch: value


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (-1, r"item count \(from `count\(batch\)`\) was -1"),
        (2.5, r"item count \(from `count\(batch\)`\) was 2.5"),
        (True, r"item count \(from `count\(batch\)`\) was True"),
        (math.nan, r"item count \(from `count\(batch\)`\) was nan"),
        ("3", r"item count \(from `count\(batch\)`\) was '3'"),
        (torch.ones(4), r"`count\(batch\)` returned a tensor of shape \(4,\).*rather than `.sum\(1\)`"),
        (torch.tensor(True), r"`count\(batch\)` returned a torch.bool tensor"),
    ],
)
def test_a_bad_count_is_refused_before_the_backward(value: Any, match: str) -> None:
    acc = made(schedule=3, normalize="items", count=count_tokens, reduction="mean")
    one_block(acc)  # a good micro-batch first: the window holds it
    acc.count = _counting(value)
    _call_refused(acc, lambda: one_block(acc, BATCHES[1]), ValueError, match)


@pytest.mark.parametrize(
    ("items", "match"),
    [
        (-3, r"item count \(from `items=`\) was -3"),
        (2.5, r"item count \(from `items=`\) was 2.5"),
        (True, r"item count \(from `items=`\) was True"),
        (torch.ones(2), r"`items=` returned a tensor of shape \(2,\)"),
    ],
)
def test_bad_items_are_refused_before_the_backward(items: Any, match: str) -> None:
    acc = made(schedule=3, normalize="items", count=count_tokens, reduction="sum")
    before = state(acc)
    with pytest.raises(ValueError, match=match), acc.accumulate(BATCHES[0]) as step:
        step.backward(token_losses(acc.model, BATCHES[0])[0], items=items)
    params, grads, *_ = state(acc)
    assert same((params, grads), before[:2])  # nothing went into the gradient


def test_items_under_mean_normalisation_is_refused() -> None:
    acc = made(schedule=2)
    with pytest.raises(ValueError, match=r"needs `normalize='items'`.*leave `items` out"), acc.accumulate(
        BATCHES[0]
    ) as step:
        step.backward(token_losses(acc.model, BATCHES[0])[0], items=4)
    assert all(p.grad is None for p in acc.params)


@pytest.mark.parametrize(
    ("make_loss", "match"),
    [
        (lambda model, batch: token_losses(model, batch)[0].detach(), r"does not require grad"),
        (lambda model, batch: (model(batch["x"]) - batch["y"]).square().sum(-1).flatten(), r"is a tensor of shape"),
        (lambda model, batch: 1.0, r"is float; it must be a scalar loss tensor"),
    ],
)
def test_a_loss_that_is_not_a_scalar_with_a_graph_is_refused(make_loss: Callable[..., Any], match: str) -> None:
    acc = made(schedule=2)
    with pytest.raises(ValueError, match=r"the loss passed to `step.backward` " + match), acc.accumulate(
        BATCHES[0]
    ) as step:
        step.backward(make_loss(acc.model, BATCHES[0]))
    assert all(p.grad is None for p in acc.params)


def test_going_around_the_window_inside_a_block_is_refused() -> None:
    acc = made(schedule=100)
    one_block(acc)
    for call, match in (
        (lambda: acc.fabric.backward(token_losses(acc.model, BATCHES[1])[0]), r"`fabric.backward\(loss\)` was called"),
        (lambda: acc.optimizer.step(), r"`optimizer.step\(\)` was called while an accumulation window is open"),
        (lambda: acc.optimizer.optimizer.step(), r"`optimizer.step\(\)` was called while"),
        (lambda: acc.optimizer.zero_grad(), r"`optimizer.zero_grad\(\)` was called while"),
        (lambda: acc.model.zero_grad(), r"`model.zero_grad\(\)` was called while"),
        (lambda: acc.flush(), r"`acc.flush\(\)` was called inside"),
        (lambda: acc.state_dict(), r"`acc.state_dict\(\)` was called inside"),
        (lambda: acc.load_state_dict({}), r"`acc.load_state_dict\(...\)` was called inside"),
        (lambda: one_block(acc), r"`acc.accumulate\(...\)` was called inside"),
    ):
        with acc.accumulate(BATCHES[1]) as step:
            before = state(acc)
            with pytest.raises(RuntimeError, match=match):
                call()
            assert same(state(acc), before)
            step.backward(token_losses(acc.model, BATCHES[1])[0])
    # between blocks, a reset or a step of the open window is refused too
    calls = ((acc.optimizer.zero_grad, "zero_grad"), (acc.optimizer.step, "step"), (acc.model.zero_grad, "zero_grad"))
    for call, match in calls:
        _call_refused(acc, call, RuntimeError, rf"`(optimizer|model).{match}\(\)` was called while .* `acc.flush\(\)`")
    acc.flush()  # the window closed: everything is back (Fabric's own backward, step and zero_grad)
    assert "backward" not in vars(acc.fabric) and not {"step", "zero_grad"} & set(vars(acc.optimizer))
    assert "zero_grad" not in vars(acc.model)
    acc.optimizer.zero_grad()


def test_step_backward_after_its_block_is_refused() -> None:
    acc = made(schedule=3)
    with acc.accumulate(BATCHES[0]) as step:
        step.backward(token_losses(acc.model, BATCHES[0])[0])
    _call_refused(
        acc,
        lambda: step.backward(token_losses(acc.model, BATCHES[0])[0]),
        RuntimeError,
        r"`step.backward` was called after its `accumulate` block exited",
    )


@pytest.mark.parametrize(
    ("state_dict", "match"),
    [({}, r"without 'progress' and 'window'"), (None, r"got NoneType"), ([1, 2], r"got list")],
)
def test_load_state_dict_of_something_else_is_refused(state_dict: Any, match: str) -> None:
    acc = made(schedule=2)
    one_block(acc)
    _call_refused(acc, lambda: acc.load_state_dict(state_dict), ValueError, r"needs what .*state_dict\(\)` returned")
    with pytest.raises(ValueError, match=match):
        acc.load_state_dict(state_dict)


def test_an_lr_schedule_gone_negative_is_refused_before_the_window_takes_a_batch() -> None:
    acc = made(schedule=2, lr_schedule=lambda progress: 1.0 - progress.step)  # negative from step 2
    for batch in BATCHES[:4]:
        one_block(acc, batch)
    assert acc.progress.step == 2
    _call_refused(acc, lambda: one_block(acc, BATCHES[0]), ValueError, r"returned -1.0 at Progress\(.*must return")


def test_an_optimizer_of_another_model_or_another_fabric_is_refused() -> None:
    fabric, model, optimizer = setup()
    other_fabric, other_model, other_optimizer = setup()
    with pytest.raises(ValueError, match=r"`optimizer` holds parameters that are not `model`'s"):
        FabricAccumulator(fabric, model, fabric.setup_optimizers(torch.optim.SGD(make_net().parameters(), lr=0.1)))
    with pytest.raises(ValueError, match=r"`model` was set up by another Fabric than `fabric`"):
        FabricAccumulator(fabric, other_model, optimizer)
    with pytest.raises(ValueError, match=r"`optimizer` was set up by another Fabric"):
        FabricAccumulator(other_fabric, other_model, optimizer)
    del other_optimizer


# ---------------------------------------------------------------------- a loop that never flushes (issue 47)
UNFLUSHED = r"A `FabricAccumulator` was garbage-collected with its last window open: 1 micro-batch.* `acc.flush\(\)`"


def dropped(held: list[FabricAccumulator]) -> list[str]:
    """The warnings of dropping the accumulator ``held`` has, its last reference (it holds no reference cycle:
    it is collected then, not at some later garbage collection)."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        held.clear()
    return [str(w.message) for w in seen if "FabricAccumulator" in str(w.message)]


def test_an_accumulator_dropped_with_an_unstepped_window_warns_once_naming_flush() -> None:
    """Warned where the window is lost, once; never on the flushed path, a window stepped at its k-th micro-batch,
    or a window a checkpoint holds as it is (``state_dict()`` after its last micro-batch)."""
    import re

    from lightning_accum._fabric import unflushed

    held = [made(schedule=Constant(3))]
    one_block(held[0])
    watch = held[0]._unflushed
    warned = dropped(held)
    assert len(warned) == 1 and re.search(UNFLUSHED, warned[0]), warned
    assert watch.done  # (so the process's end says nothing more)
    unflushed._at_exit()

    flushed, stepped, saved, went_on = ([made(schedule=Constant(3))] for _ in range(4))
    for acc in (flushed[0], saved[0], went_on[0]):
        one_block(acc)
    del acc
    flushed[0].flush()
    for _ in range(3):
        one_block(stepped[0])
    saved[0].state_dict()
    went_on[0].state_dict()
    one_block(went_on[0])  # a micro-batch after the checkpoint: the checkpoint no longer holds the window
    assert dropped(flushed) == dropped(stepped) == dropped(saved) == []
    assert len(dropped(went_on)) == 1


def test_the_process_ending_with_an_unstepped_window_warns_unless_an_exception_ends_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The exit handler warns once for an accumulator still alive with an open window; after an unhandled exception
    (which sets ``sys.last_value`` before Python's exit handlers run) it says nothing: the traceback does."""
    import sys
    import warnings

    from lightning_accum._fabric import unflushed

    open_, clean = made(schedule=Constant(3)), made(schedule=Constant(3))
    one_block(open_)
    with pytest.warns(UserWarning, match=r"was still alive when the process ended with its last window open: 1 micro"):
        unflushed._at_exit()
    assert open_._unflushed.done and clean._unflushed.done
    with warnings.catch_warnings(record=True) as seen:  # (not "error": the watch drops what it cannot show)
        warnings.simplefilter("always")
        unflushed._at_exit()  # once: nothing more at a second exit, nor when they are collected
        del open_, clean
        crashed = made(schedule=Constant(3))
        one_block(crashed)
        monkeypatch.setattr(sys, "last_value", RuntimeError("the loop failed"), raising=False)
        unflushed._at_exit()
    assert crashed._unflushed.done and not [w for w in seen if "FabricAccumulator" in str(w.message)]


def _exits_with_an_open_window(out: str) -> None:
    """In a process of its own: a loop that never flushes, then Python's exit handlers, as the process ends."""
    import atexit
    import os

    with open(out, "w") as sink:
        os.dup2(sink.fileno(), 2)
        torch.set_default_dtype(torch.float64)
        acc = made(schedule=Constant(3))
        one_block(acc)
        atexit._run_exitfuncs()


@pytest.mark.slow
def test_the_exit_handler_is_registered(tmp_path: Any) -> None:
    """Python's exit handlers, run as the process ends, include the warning's (one line, seen once)."""
    from helpers import warm_processes

    out = tmp_path / "stderr"
    process = warm_processes().Process(target=_exits_with_an_open_window, args=(str(out),))
    process.start()
    process.join()
    assert process.exitcode == 0 and out.read_text().count("still alive when the process ended") == 1, out.read_text()
