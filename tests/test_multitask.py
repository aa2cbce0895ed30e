"""Sequential backward against the joint backward, in float64, without Lightning."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_accum.multitask import backward_each, backward_heads, measure_graph_memory


def nets() -> tuple[nn.Module, list[nn.Module], torch.Tensor]:
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh()).double()
    heads = [nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 1)).double() for _ in range(3)]
    return trunk, heads, torch.randn(7, 5, dtype=torch.float64)


def grads(modules: list[nn.Module]) -> list[torch.Tensor]:
    return [p.grad.clone() for m in modules for p in m.parameters()]  # type: ignore[union-attr]


def clear(modules: list[nn.Module]) -> None:
    for m in modules:
        m.zero_grad(set_to_none=True)


WEIGHTS = [1.0, 0.5, 2.5]


def head_loss(head: nn.Module, f: torch.Tensor, i: int) -> torch.Tensor:
    return (head(f) - i).square().mean()


def test_backward_heads_equals_joint_backward() -> None:
    trunk, heads, x = nets()
    features = trunk(x)
    sum(w * head_loss(h, features, i) for i, (h, w) in enumerate(zip(heads, WEIGHTS, strict=True))).backward()
    expected = grads([trunk, *heads])
    clear([trunk, *heads])
    losses = backward_heads(
        lambda loss: loss.backward(),
        trunk(x),
        [lambda f, h=h, i=i: head_loss(h, f, i) for i, h in enumerate(heads)],
        WEIGHTS,
    )
    for got, want in zip(grads([trunk, *heads]), expected, strict=True):
        assert torch.allclose(got, want, rtol=0, atol=1e-12)
    assert losses.shape == (3,) and not losses.requires_grad


def test_backward_each_equals_joint_backward_and_reports_norms() -> None:
    trunk, heads, x = nets()
    modules = [trunk, *heads]
    tasks = [lambda h=h, i=i: head_loss(h, trunk(x), i) for i, h in enumerate(heads)]  # overlapping: the trunk
    sum(w * t() for t, w in zip(tasks, WEIGHTS, strict=True)).backward()
    expected = grads(modules)
    clear(modules)
    params = [p for m in modules for p in m.parameters()]
    losses, norms = backward_each(lambda loss: loss.backward(), tasks, WEIGHTS, grad_norms_of=params)
    for got, want in zip(grads(modules), expected, strict=True):
        assert torch.allclose(got, want, rtol=0, atol=1e-12)
    for i, (task, w) in enumerate(zip(tasks, WEIGHTS, strict=True)):  # each task's norm, computed alone
        clear(modules)
        (w * task()).backward()
        alone = torch.sqrt(sum(p.grad.square().sum() for p in params if p.grad is not None))  # type: ignore[misc]
        assert torch.isclose(norms[i], alone.cpu(), rtol=1e-12)  # type: ignore[index]
    assert torch.allclose(losses, torch.stack([t().detach() for t in tasks]))


def test_one_graph_alive_at_a_time() -> None:
    trunk, heads, x = nets()
    modules = [trunk, *heads]
    params = [p for m in modules for p in m.parameters()]
    tasks = [lambda h=h, i=i: head_loss(h, trunk(x), i) for i, h in enumerate(heads)]
    with measure_graph_memory(exclude=params) as one:
        tasks[0]().backward()
    with measure_graph_memory(exclude=params) as joint:
        sum(t() for t in tasks).backward()
    with measure_graph_memory(exclude=params) as sequential:
        backward_each(lambda loss: loss.backward(), tasks)
    assert sequential.peak == one.peak
    assert joint.peak == 3 * one.peak
    assert sequential.alive == joint.alive == 0
    mib = one.peak / 2**20
    assert repr(one) == f"GraphMemory(peak={mib:.2f} MiB, alive=0.00 MiB)"


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: backward_each(lambda loss: None, [lambda: torch.ones(2, requires_grad=True)]),
            "closure 0 is a tensor",
        ),
        (lambda: backward_each(lambda loss: None, [lambda: 1.0]), "closure 0 is float"),
        (lambda: backward_each(lambda loss: None, [lambda: torch.ones(())]), "does not require grad"),
        (lambda: backward_each(lambda loss: None, [], weights=[1.0]), "`closures` is empty"),
        (lambda: backward_each(lambda loss: None, [lambda: torch.ones(())], weights=["a"]), "finite numbers"),
        (lambda: backward_each(lambda loss: None, [lambda: torch.ones(())], weights=[math.nan]), "finite numbers"),
        (lambda: backward_heads(lambda loss: None, torch.ones(3, requires_grad=True), []), "`heads` is empty"),
        (lambda: backward_heads(lambda loss: None, torch.ones(3), []), "`features` must be the trunk's output"),
        (  # (a frozen trunk's output: no graph either, the fix named)
            lambda: backward_heads(lambda loss: None, torch.nn.Linear(3, 2).requires_grad_(False)(torch.ones(3)), []),
            r"nothing to train .* `acc.backward\(sum\(...\)\)`",
        ),
    ],
)
def test_errors(call: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()  # type: ignore[operator]


def test_graph_memory_frees_a_branch_the_backward_never_runs() -> None:
    """The saved tensors of a branch the loss does not use (a BERT's pooler under a mean-pooled loss) are
    freed with it, while measuring too (they were kept alive in a cycle: 3 more after every step), and
    the gradient is the same as without measuring."""
    torch.manual_seed(0)
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    x = torch.randn(3, 4)
    torch.tanh(first(x)).sum().backward()
    expected = [p.grad.clone() for p in first.parameters()]  # type: ignore[union-attr]
    first.zero_grad()
    with measure_graph_memory() as memory:
        for _ in range(3):
            h = torch.tanh(first(x))
            unused = torch.tanh(second(h))
            h.sum().backward()
            del h, unused
    assert memory.alive == 0 and memory.peak > 0
    assert all(torch.equal(p.grad, 3 * e) for p, e in zip(first.parameters(), expected, strict=True))
