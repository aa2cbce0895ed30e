"""Window accounting and the fused gradient ops, against direct computations."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lightning_accum._core import gradients
from lightning_accum._core.window import Window


@given(
    divisor=st.integers(1, 1000),
    world=st.integers(1, 8),
    micro=st.integers(1, 64),
    items=st.integers(1, 10**9),
)
def test_gradient_scale_is_the_exact_rational(divisor: int, world: int, micro: int, items: int) -> None:
    window = Window(k=micro, divisor=divisor)
    mean = window.gradient_scale("mean", world_size=world, global_microbatches=micro * world)
    assert mean == float(Fraction(divisor * world, micro * world))
    tokens = window.gradient_scale("items", world_size=world, global_items=items)
    assert tokens == float(Fraction(divisor * world, items))


@pytest.mark.parametrize(
    ("normalize", "micro", "global_micro", "global_items", "world", "expected"),
    [
        ("mean", 3, 0, 0, 1, 2 / 3),  # one device: this rank's micro-batches
        ("mean", 3, 0, 0, 2, 2 / 3),  # ... taken as every rank's where the global count is not given
        ("mean", 3, 5, 0, 2, 4 / 5),  # the global count of micro-batches over the ranks
        ("mean", 0, 0, 0, 1, 1.0),  # a window nothing went into: left as it is
        ("items", 3, 0, 8, 2, 4 / 8),
        ("items", 3, 0, 0, 1, 0.0),  # no items anywhere: the gradient (of losses over no item) is zeroed
    ],
)
def test_the_gradient_scale_at_its_edges(
    normalize: str, micro: int, global_micro: int, global_items: int, world: int, expected: float
) -> None:
    window = Window(k=4, divisor=2)
    for _ in range(micro):
        window.add(1, 1)
    scale = window.gradient_scale(
        normalize, world_size=world, global_microbatches=global_micro, global_items=global_items
    )
    assert scale == expected


def test_window_counts_python_and_device_items() -> None:
    window = Window(k=3)
    window.add(4, 10)
    window.add(4, torch.tensor(7))
    window.add(2, torch.tensor(5.0))
    assert (window.microbatches, window.samples, window.local_items(), window.full) == (3, 10, 22, True)
    restored = Window.from_state_dict(window.state_dict())
    assert restored == window


@pytest.mark.parametrize("bad", [-1, 1.5, torch.tensor(-3), torch.tensor(2.5)])
def test_window_rejects_bad_counts(bad: object) -> None:
    window = Window(k=2)
    named = r"from `count\(batch\)`, or `items=`|the window's tensor count 0, from `count\(batch\)` or `items=`"
    with pytest.raises(ValueError, match=rf"item count \(({named})\) was"):
        window.add(1, bad)  # type: ignore[arg-type]
        window.local_items()


def test_unknown_normalize() -> None:
    with pytest.raises(ValueError, match="normalize"):
        Window(k=1).gradient_scale("median")


def make_params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4, dtype=torch.float64))]
    params.append(torch.nn.Parameter(torch.randn(5)))  # no grad
    for p in params[:2]:
        p.grad = torch.randn_like(p)
    return params


def test_scale_and_zero_touch_existing_grads_only() -> None:
    params = make_params()
    before = [p.grad.clone() for p in params[:2]]  # type: ignore[union-attr]
    grads = gradients.grads_of(params)
    gradients.scale_(grads, 0.25)
    for p, b in zip(params[:2], before, strict=True):
        assert torch.equal(p.grad, b * 0.25)  # type: ignore[arg-type]
    assert params[2].grad is None
    gradients.zero_(grads)
    assert all(torch.count_nonzero(g) == 0 for g in grads)
    assert all(p.grad is g for p, g in zip(params[:2], grads, strict=True))  # buffers kept


def test_snapshot_and_restore() -> None:
    params = make_params()
    saved = gradients.snapshot(params)
    expected = [None if g is None else g.clone() for g in saved]
    for p in params:
        p.grad = None
    gradients.restore(params, saved)
    for p, e in zip(params, expected, strict=True):
        assert (p.grad is None and e is None) or torch.equal(p.grad, e)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="same model and optimizer"):
        gradients.restore(params[:2], saved)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scale_of_half_precision_gradients_rounds_once(dtype: torch.dtype) -> None:
    """A bf16 or fp16 gradient times the window's factor (1/7) is the exact product rounded once to its dtype, not
    the product with the factor rounded to bf16 first (``torch._foreach_mul_`` on the CPU: up to 2^-9 relative, all
    in one direction)."""
    torch.manual_seed(0)
    grads = [torch.randn(1000).to(dtype), torch.randn(7, 3).to(dtype)]
    want = [(g.float() * (1 / 7)).to(dtype) for g in grads]  # (in float32, rounded once to the dtype)
    exact = [g.double() * (1 / 7) for g in grads]
    gradients.scale_(grads, 1 / 7)
    for g, w, e in zip(grads, want, exact, strict=True):
        assert torch.equal(g, w)
        ulp = torch.finfo(dtype).eps * e.abs().clamp_min(torch.finfo(dtype).tiny)
        assert bool(((g.double() - e).abs() <= ulp).all())  # (within one rounding: half an ulp, at most one)


@pytest.mark.parametrize(
    ("items", "empty"),
    [(0, True), (3, False), (0.0, True), (2.5, False), (torch.tensor(0), True), (torch.tensor([[0.0]]), True),
     (torch.tensor(3), False), (torch.tensor(1.0), False)],
)  # fmt: skip
def test_no_items_is_a_count_of_zero(items: object, empty: bool) -> None:
    got = gradients.no_items(items)  # type: ignore[arg-type]
    assert (isinstance(got, torch.Tensor) and got.dtype == torch.bool and got.shape == ()) == isinstance(
        items, torch.Tensor
    )
    assert bool(got) is empty


def nan_grads() -> list[torch.Tensor]:
    return [torch.tensor([1.0, float("nan")]), torch.tensor([[2.0]])]


@pytest.mark.parametrize(
    ("empty", "kept"), [(False, True), (True, False), (torch.tensor(False), True), (torch.tensor(True), False)]
)
def test_zero_where_empties_the_gradients_of_a_pass_of_no_items(empty: bool | torch.Tensor, kept: bool) -> None:
    """Nothing where the count is 0, NaN included; the gradients as they are otherwise."""
    got = gradients.zero_where(nan_grads(), empty)
    want = nan_grads() if kept else [torch.zeros(2), torch.zeros(1, 1)]
    assert all(torch.equal(g.nan_to_num(7.0), w.nan_to_num(7.0)) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("empty", [False, True, torch.tensor(False), torch.tensor(True)])
def test_add_nothing_if_a_pass_has_no_items(empty: bool | torch.Tensor) -> None:
    """A mean over no items (``sum / 0``: a NaN gradient) adds nothing to the gradient where the count is 0, on the
    device; elsewhere the pass adds its own gradient; no hook is left on for ``False``."""
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    w.grad = torch.tensor([0.5, 0.5])
    handles = gradients.add_nothing_if([w], empty)
    assert (len(handles) == 0) == (empty is False)
    count = torch.tensor(0.0) if bool(empty) else torch.tensor(2.0)
    ((w * w).sum() / count).backward()
    for handle in handles:
        handle.remove()
    assert torch.equal(w.grad, torch.tensor([0.5, 0.5]) if bool(empty) else torch.tensor([1.5, 2.5]))


def test_squared_norm_of_gradients_of_several_dtypes() -> None:
    grads = [torch.tensor([3.0]), torch.tensor([12.0], dtype=torch.float64), torch.tensor([[0.0, 4.0]])]
    got = gradients.squared_norm(grads)  # (norms exact in float32: 3 and 4)
    assert got.dtype == torch.float64 and float(got) == 9 + 144 + 16
    assert float(gradients.squared_norm([])) == 0.0
    assert float(gradients.squared_norm([torch.tensor([3.0, 4.0])])) == 25.0  # (one group)


def test_norms_count_a_gradient_two_optimizers_share_once() -> None:
    a, b = torch.tensor([3.0, 4.0]), torch.tensor([12.0], dtype=torch.float64)
    assert [float(n) for n in gradients.norms([a, b, a])] == [5.0, 12.0]
    assert [float(n) for n in gradients.norms([a, b])] == [5.0, 12.0]


@pytest.mark.parametrize("factor", [0.0, 0.5, 3.0, 1.0])
def test_scale_multiplies_every_gradient(factor: float) -> None:
    grads = [
        torch.tensor([2.0, -4.0]),
        torch.tensor([8.0], dtype=torch.float64),
        torch.tensor([6.0], dtype=torch.bfloat16),
    ]
    want = [g.double() * factor for g in grads]
    gradients.scale_(grads, factor)
    assert all(torch.equal(g.double(), w) for g, w in zip(grads, want, strict=True))


def test_restored_gradients_are_copies_of_the_checkpoints() -> None:
    """A gradient put back from a checkpoint is the parameter's own: accumulating into it leaves the checkpoint
    (which a second resume, or a checkpoint saved again, reads) as it was."""
    w = torch.nn.Parameter(torch.zeros(2))
    w.grad = torch.tensor([1.0, 2.0])
    saved = gradients.snapshot([w])
    w.grad.add_(10.0)  # (the snapshot is a copy too)
    assert torch.equal(saved[0], torch.tensor([1.0, 2.0]))  # type: ignore[arg-type]
    gradients.restore([w], saved)
    w.grad.add_(1.0)
    assert torch.equal(saved[0], torch.tensor([1.0, 2.0]))  # type: ignore[arg-type]
    assert torch.equal(w.grad, torch.tensor([2.0, 3.0]))


@pytest.mark.parametrize("undo", ["unreach", "remove"])
def test_a_budget_windows_micro_batch_taken_back_leaves_the_window_as_before_it(undo: str) -> None:
    """Under a ``Budget``: a micro-batch ``reach`` counted and then taken back (``unreach``: it never went in;
    ``remove``: its backward never ran) leaves every counter as before it, ``asked`` and ``ends`` included, after
    a first micro-batch and after one that would have closed the window."""
    import copy
    import dataclasses

    window = Window(k=4, budget=10)
    for seen in (3, 8):  # (3: the window goes on; 8: 3 + 8 reaches the budget)
        before = copy.deepcopy(window)
        assert window.reach(seen) == (seen == 8)
        if undo == "remove":
            window.add(seen, seen)
            window.remove(seen, seen)
        else:
            window.unreach()
        assert window.seen_last == 0  # (nothing left to take back)
        assert dataclasses.replace(window, seen_last=before.seen_last) == before
        window.reach(seen)  # (again, and in: the next micro-batch follows it)
        window.add(seen, seen)
        window.keep_reach()


def test_the_wide_divisor_is_the_power_of_two_at_or_above_k() -> None:
    """``wide_divisor(k)`` for k = 1 to 1025, against the smallest power of two >= k found by doubling (the module's
    doctest showed it alone before)."""
    from lightning_accum._core.window import wide_divisor

    for k in range(1, 1026):
        power = 1
        while power < k:
            power *= 2
        assert wide_divisor(k) == power, k


class TwoRanks:
    """A fake 2-rank strategy whose other rank holds twice what this one does: a sum over ranks is 3 times this
    rank's."""

    world_size, root_device, global_rank = 2, "cpu", 0

    def reduce(self, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        assert reduce_op == "sum"
        return tensor * 3


def test_sum_over_ranks_adds_every_ranks_values() -> None:
    from lightning_accum._core import collectives

    values = [1.5, [torch.tensor(2.0), 0.25], torch.tensor([1.0, 2.0])]  # a number, parts, a tensor of parts
    totals, local = collectives.sum_over_ranks(TwoRanks(), values, [torch.tensor(4.0)])
    assert totals == [4.5, 6.75, 9.0] and local == [4.0]  # (3 times 1.5, 2.25 and 3.0; the local one as it is)
    assert collectives.sum_over_ranks(object(), values) == ([1.5, 2.25, 3.0], [])  # one device: no collective


def test_sum_tensors_all_reduces_each_dtypes_flat_concatenation(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_accum._core import collectives

    calls: list[tuple[torch.dtype, int]] = []

    def twice(flat: torch.Tensor) -> None:  # (a second rank holding the same)
        calls.append((flat.dtype, flat.numel()))
        flat.mul_(2)

    monkeypatch.setattr(collectives, "_all_reduce_sum", twice)
    tensors = [
        torch.arange(6.0, dtype=torch.float64).view(2, 3),
        torch.ones(4),
        torch.tensor([0.5], dtype=torch.float64),
    ]
    out = collectives.sum_tensors(tensors)
    assert calls == [(torch.float64, 7), (torch.float32, 4)]
    for summed, t in zip(out, tensors, strict=True):
        assert summed.dtype == t.dtype and torch.equal(summed, 2 * t)
    assert torch.equal(tensors[1], torch.ones(4))  # (new tensors: the inputs are left as they were)


class TwoSameRanks(TwoRanks):
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:  # (the other rank holds what this one does)
        return torch.stack([tensor, tensor])


def test_gather_partial_gives_every_ranks_numbers_and_gradients() -> None:
    from lightning_accum._core import collectives

    params = [torch.zeros(2, 3), torch.zeros(4, dtype=torch.float64), torch.zeros(2, dtype=torch.float16)]
    grads = [torch.arange(6.0).view(2, 3), None, torch.tensor([0.5, -1.5], dtype=torch.float16)]
    ranks = collectives.gather_partial(TwoSameRanks(), [3.0, 0.25], params, grads)
    assert len(ranks) == 2
    for numbers, got in ranks:
        assert numbers == [3.0, 0.25] and got[1] is None
        for g, want in ((got[0], grads[0]), (got[2], grads[2])):
            assert g is not None and want is not None and g.dtype == want.dtype and torch.equal(g, want)
    wide = collectives.gather_partial(TwoSameRanks(), [], params, grads, [torch.float64] * 3)[1][1]
    assert [None if g is None else g.dtype for g in wide] == [torch.float64, None, torch.float64]


@pytest.mark.parametrize("reset", ["zero", "none"])
def test_a_dropped_window_clears_its_gradient_as_reset_says(reset: str) -> None:
    """A window dropped unstepped (its loop stopped inside it): forgotten, and its gradient zeroed in the buffers it
    had (``reset="zero"``) or set to ``None`` (``"none"``, as ``zero_grad(set_to_none=True)``)."""
    from types import SimpleNamespace

    from lightning_accum._core.options import AccumulationConfig
    from lightning_accum._trainer.window_step import drop
    from lightning_accum.schedules import as_schedule

    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(2)]
    buffers = []
    for p in params:
        p.grad = torch.full((2,), 5.0)
        buffers.append(p.grad)
    discarded: list[int] = []
    engine = SimpleNamespace(discard=lambda: discarded.append(1))
    drop(engine, params, AccumulationConfig(schedule=as_schedule(2), reset=reset))  # type: ignore[arg-type]
    assert discarded == [1]
    if reset == "zero":
        assert all(p.grad is b and b.tolist() == [0.0, 0.0] for p, b in zip(params, buffers, strict=True))
    else:
        assert all(p.grad is None for p in params)
