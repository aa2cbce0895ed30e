"""``_trainer/block.py`` on its own: a ``Block`` over a real ``WindowEngine`` and stand-ins for the module, the windows
and the guards (no Trainer); what its backward passes put in the window and in the parameters' gradients, against a
plain float64 PyTorch computation."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

import lightning_accum as la
from lightning_accum._core import sync
from lightning_accum._core.engine import WindowEngine
from lightning_accum._trainer.block import Block

X = torch.tensor([1.0, 2.0], dtype=torch.float64)
HEAD = 3.0  # the head's loss: HEAD * sum(features), features = X * w


class Guards:
    """The guards: the passes each finished block reported."""

    def __init__(self) -> None:
        self.made: list[int] = []

    @contextlib.contextmanager
    def own_pass(self) -> Iterator[None]:
        yield

    def passes_made(self, passes: int) -> None:
        self.made.append(passes)


def _block(w: torch.Tensor) -> tuple[Block, WindowEngine, Guards, list[bool]]:
    engine = WindowEngine(la.Constant(2))
    window = engine.open(0, 0)
    ran_without: list[bool] = []
    engine.ran_without_backward = lambda: ran_without.append(True)  # type: ignore[method-assign]
    module = SimpleNamespace(manual_backward=lambda loss: loss.backward(), trainer=SimpleNamespace(strategy=None))
    windows = SimpleNamespace(
        engines={(0,): engine},
        module=module,
        params=lambda key=None: [w],
        config=SimpleNamespace(normalize="mean", mean_items=False, count=None),
    )
    guards = Guards()
    block = Block(
        windows,  # type: ignore[arg-type]
        (0,),
        window,
        last=lambda: False,
        redoing=False,
        counts=(3, None),
        plan=sync.SyncPlan(),
        guards=guards,  # type: ignore[arg-type]
    )
    return block, engine, guards, ran_without


def _trunk_pass(block: Block, w: torch.Tensor) -> None:
    """A head back-propagated by hand into a detached copy of the trunk's features, then only the trunk's pass."""
    features = X * w
    leaf = features.detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(HEAD * leaf.sum(), leaf)
    block.trunk_backward(features, grad)


@pytest.mark.parametrize(
    "passes", [(), ("backward",), ("trunk",), ("trunk", "trunk"), ("backward", "trunk")], ids=lambda p: "+".join(p)
)
def test_a_block_counts_its_trunk_passes_as_backward_passes(passes: tuple[str, ...]) -> None:
    """A block whose only pass is ``trunk_backward`` (cached representations, a shared trunk: the heads taken by
    hand) made a backward pass as much as one of ``backward``: at its end the micro-batch goes into the window (its
    samples counted, the guards told of its passes, no "ran without a backward pass"), and its gradient is the plain
    float64 PyTorch one. Only a block of no pass at all is left out of the window."""
    w = torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True)
    block, engine, guards, ran_without = _block(w)
    for kind in passes:
        if kind == "backward":
            block.backward((X * w).sum())
        else:
            _trunk_pass(block, w)
    block.finish(lambda: 1.0)

    reference = w.detach().clone().requires_grad_(True)
    total = sum(((1.0 if kind == "backward" else HEAD) * (X * reference).sum() for kind in passes), torch.zeros(()))
    if passes:
        total.backward()
    assert engine.window is not None
    if passes:
        assert (engine.window.microbatches, engine.window.samples) == (1, 3)
        assert guards.made == [len(passes)] and not ran_without and engine.backward_finished
        assert w.grad is not None and torch.equal(w.grad, reference.grad)  # type: ignore[arg-type]
    else:
        assert (engine.window.microbatches, engine.window.samples) == (0, 0)
        assert guards.made == [] and ran_without == [True] and w.grad is None
