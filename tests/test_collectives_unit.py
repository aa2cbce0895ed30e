"""``_core/collectives.py`` on its own: a second rank faked by a strategy (or a patched ``dist.all_reduce``) that adds
its own numbers, every expectation computed by hand."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_accum._core import collectives


class OtherRank:
    """Two ranks: the other one's ``reduce`` contribution is ``other`` (a list of floats), its ``all_gather`` parts are
    ``gathered`` (taken in call order); this rank is ``global_rank``."""

    root_device = torch.device("cpu")

    def __init__(
        self,
        other: list[float] | None = None,
        gathered: list[torch.Tensor] | None = None,
        rank: int = 0,
        world: int = 2,
    ) -> None:
        self.world_size, self.global_rank = world, rank
        self.other, self.gathered = other or [], list(gathered or [])
        self.ops: list[str] = []
        self.gathers = 0

    def reduce(self, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        self.ops.append(reduce_op)
        other = torch.tensor(self.other[: len(tensor)], dtype=tensor.dtype)
        return tensor + other if reduce_op == "sum" else (tensor + other) / 2

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        self.gathers += 1
        other = self.gathered.pop(0)
        ranks = [tensor, other] if self.global_rank == 0 else [other, tensor]
        return torch.stack(ranks)


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [(None, 1), (object(), 1), (type("S", (), {"world_size": 0})(), 1), (type("S", (), {"world_size": 3})(), 3)],
)
def test_world_size_table(strategy: Any, expected: int) -> None:
    assert collectives.world_size(strategy) == expected


def test_sum_over_ranks_on_one_device_reads_every_shape_exactly() -> None:
    values = [1.5, torch.tensor(2.0), [torch.tensor(1.0), 2.0], torch.tensor([1.0, 2.0, 3.0]), [1e16, 1.0, -1e16], []]
    local = [torch.tensor(4.0), [1.0, torch.tensor([2.0, 3.0])], torch.tensor([5.0]), 7]
    totals, out = collectives.sum_over_ranks(None, values, local)
    assert totals == [1.5, 2.0, 3.0, 6.0, 1.0, 0.0]  # (1e16 + 1 - 1e16: 1 only when summed exactly)
    assert out == [4.0, [1.0, 2.0, 3.0], [5.0], 7.0]
    assert all(type(t) is float for t in totals)
    assert collectives.sum_over_ranks(None, [3.0]) == ([3.0], [])


def test_sum_over_ranks_on_two_ranks_adds_the_other_ranks_sums_in_one_reduce() -> None:
    strategy = OtherRank(other=[10.0, 20.0, 30.0, 40.0])
    values = [1.0, [2.0, torch.tensor(3.0)], torch.tensor([1.0, 1.0]), []]
    totals, out = collectives.sum_over_ranks(strategy, values, [torch.tensor([1.0, 2.0]), 0.5])
    assert totals == [11.0, 25.0, 32.0, 40.0]
    assert out == [[1.0, 2.0], 0.5]  # the local ones as this rank has them
    assert strategy.ops == ["sum"]


def test_host_sum_and_host_sum_async(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[torch.Tensor, Any, bool]] = []

    class Work:
        waits = 0

        def wait(self) -> None:
            Work.waits += 1

    def all_reduce(tensor: torch.Tensor, op: Any, group: Any = None, async_op: bool = False) -> Any:
        assert op == dist.ReduceOp.SUM and group == "host" and tensor.dtype == torch.int64
        tensor.add_(torch.arange(1, len(tensor) + 1) * 100)  # the other rank's values: 100, 200, ...
        calls.append((tensor, group, async_op))
        return Work() if async_op else None

    monkeypatch.setattr(collectives, "host_group", lambda: "host")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    assert collectives.host_sum(None, 5) == 5 and not calls  # one process: nothing sent
    two = OtherRank()
    total = collectives.host_sum(two, 5)
    assert total == 105 and type(total) is int and len(calls) == 1 and calls[0][2] is False

    one = collectives.HostSum(None, [3.0, 1])  # type: ignore[list-item]
    assert one.result() == [3, 1] and all(type(v) is int for v in one.result()) and len(calls) == 1
    pending = collectives.HostSum(two, [3, 1])
    assert len(calls) == 2 and calls[1][2] is True and Work.waits == 0  # issued when made, not waited for
    assert pending.result() == [103, 201] and pending.result() == [103, 201]
    assert Work.waits == 1  # waited for once
    assert all(type(v) is int for v in pending.result())


def test_host_group_is_the_default_gloo_group_or_one_made_once_per_world(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[str] = []
    backend = ["gloo"]
    fake = SimpleNamespace(
        group=SimpleNamespace(WORLD="world-a"),
        get_backend=lambda group=None: backend[0],
        new_group=lambda backend: made.append(backend) or f"gloo-{len(made)}",
    )
    monkeypatch.setattr(collectives, "dist", fake)
    monkeypatch.setattr(collectives, "_HOST_GROUPS", {})
    assert collectives.host_group() == "world-a" and not made
    backend[0] = "nccl"
    assert collectives.host_group() == "gloo-1" and collectives.host_group() == "gloo-1" and made == ["gloo"]
    fake.group.WORLD = "world-b"  # (a new default group: a new gloo group, the old dropped)
    assert collectives.host_group() == "gloo-2" and made == ["gloo", "gloo"]
    assert list(collectives._HOST_GROUPS.values()) == ["gloo-2"]


def test_host_values_reads_in_order_whatever_the_shapes() -> None:
    assert collectives.host_values([]) == []
    assert collectives.host_values([torch.tensor(1.0), torch.tensor(2.5)]) == [1.0, 2.5]
    assert collectives.host_values([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])]) == [1.0, 2.0, 3.0, 4.0]
    assert collectives.host_values([torch.tensor(1.0), torch.tensor([2.0, 3.0]), torch.ones(2, 1)]) == [
        1.0, 2.0, 3.0, 1.0, 1.0,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("ks", "raises"),
    [([4, 4], False), ([4, 2], True), ([1, 1, 1], False), ([1, 1, 4], True), ([2, 3, 3], True), ([0, 0], False)],
)
def test_check_same_k_table(ks: list[int], raises: bool) -> None:
    strategy = OtherRank(other=[sum(ks[1:]), sum(k * k for k in ks[1:])], world=len(ks))
    strategy.all_gather = lambda t: torch.cat([t.reshape(1), torch.tensor(ks[1:])])  # type: ignore[method-assign]
    if raises:
        with pytest.raises(RuntimeError, match=rf"gave k = \[{', '.join(map(str, ks))}\] on ranks 0..{len(ks) - 1}"):
            collectives.check_same_k(strategy, ks[0], "SCHED")
    else:
        collectives.check_same_k(strategy, ks[0], "SCHED")
    assert strategy.ops == ["sum"]
    collectives.check_same_k(None, 7, "SCHED")  # one device: nothing to compare


@pytest.mark.parametrize(
    ("world", "ids", "raises"),
    [(2, [3, 3], False), (2, [3, 4], True), (1, [5], False), (3, [2, 2, 2], False), (3, [2, 2, 5], True),
     (2, [0, 0], False), (2, [1, 1], False)],
)  # fmt: skip
def test_check_same_window_table(world: int, ids: list[int], raises: bool) -> None:
    strategy = type("S", (), {"world_size": world})()
    total, squares = float(sum(ids)) + 1e-7, float(sum(i * i for i in ids)) - 1e-7  # (float sums: rounded)
    if raises:
        with pytest.raises(RuntimeError, match="different accumulation windows"):
            collectives.check_same_window(strategy, total, squares)
    else:
        collectives.check_same_window(strategy, total, squares)


def test_mean_over_ranks() -> None:
    assert collectives.mean_over_ranks(None, [1, 2.5]) == [1.0, 2.5]
    strategy = OtherRank(other=[3.0, 0.5])
    assert collectives.mean_over_ranks(strategy, [1, 2.5]) == [2.0, 1.5]
    assert strategy.ops == ["mean"]


def _other_rank_adds(monkeypatch: pytest.MonkeyPatch, other: float) -> list[torch.Tensor]:
    """``_all_reduce_sum`` of two ranks where the other's every element is ``other``; the flat buffers seen."""
    seen: list[torch.Tensor] = []

    def all_reduce_sum(flat: torch.Tensor) -> None:
        seen.append(flat.clone())
        flat.add_(other)

    monkeypatch.setattr(collectives, "_all_reduce_sum", all_reduce_sum)
    return seen


def test_all_reduce_gradients_averages_what_is_present_anywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _other_rank_adds(monkeypatch, 10.0)
    params = [torch.zeros(2), torch.zeros(1, 2), torch.zeros(3), torch.zeros(1)]
    params[0].grad, params[3].grad = torch.tensor([1.0, 2.0]), torch.tensor([4.0])
    one = [p.grad for p in params]
    assert collectives.all_reduce_gradients(None, params, [1, 1, 0, 1]) == 0 and [p.grad for p in params] == one
    assert collectives.all_reduce_gradients(OtherRank(), params, [1, 1, 0, 2]) == 1
    assert torch.equal(params[0].grad, torch.tensor([5.5, 6.0]))
    assert params[1].grad is not None and torch.equal(params[1].grad, torch.full((1, 2), 5.0))  # zeros made here
    assert params[2].grad is None  # a gradient nowhere
    assert torch.equal(params[3].grad, torch.tensor([7.0]))
    assert [s.tolist() for s in seen] == [[1.0, 2.0, 0.0, 0.0, 4.0]]  # one flat buffer, in parameter order

    wide = [torch.tensor([2.0], dtype=torch.float64)]
    assert collectives.all_reduce_gradients(OtherRank(), [torch.zeros(1)], [1], slot=lambda p: wide[0]) == 1
    assert wide[0].tolist() == [6.0]


def test_gradient_buckets_are_bounded_by_bytes_and_split_by_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _other_rank_adds(monkeypatch, 0.0)
    monkeypatch.setattr(collectives, "BUCKET_BYTES", 8)  # two float32 elements
    params = [torch.zeros(2), torch.zeros(1), torch.zeros(1, dtype=torch.float64), torch.zeros(1), torch.zeros(3)]
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, float(i + 1))
    assert collectives.all_reduce_gradients(OtherRank(), params, [1] * 5) == 4
    assert [s.tolist() for s in seen] == [[1.0, 1.0], [2.0, 4.0], [5.0, 5.0, 5.0], [3.0]]
    assert [p.grad.tolist() for p in params if p.grad is not None] == [[0.5, 0.5], [1.0], [1.5], [2.0], [2.5] * 3]
    grads = [torch.zeros(3), torch.zeros(1), torch.zeros(1)]  # (an oversized one alone; then the next)
    assert [len(b) for b in collectives._buckets(grads)] == [1, 2]
    assert list(collectives._buckets([])) == []
    monkeypatch.setattr(collectives, "BUCKET_BYTES", 12)  # (sizes add up: three 4-byte ones fill a bucket)
    assert [len(b) for b in collectives._buckets([torch.zeros(1)] * 4)] == [3, 1]


def test_sum_tensors_one_reduce_per_dtype_new_tensors_in_their_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _other_rank_adds(monkeypatch, 1.0)
    tensors = [torch.ones(2, 2), torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), torch.tensor([5.0])]
    out = collectives.sum_tensors(tensors)
    assert len(seen) == 2
    assert [(t.shape, t.dtype) for t in out] == [(t.shape, t.dtype) for t in tensors]
    assert (
        out[0].tolist() == [[2.0, 2.0], [2.0, 2.0]] and out[1].tolist() == [2.0, 3.0, 4.0] and out[2].tolist() == [6.0]
    )
    assert tensors[0].tolist() == [[1.0, 1.0], [1.0, 1.0]]  # the inputs left as they were


def test_gather_partial_every_ranks_numbers_and_gradients() -> None:
    params = [torch.zeros(2), torch.zeros(1, 2, dtype=torch.float16)]
    grads: list[torch.Tensor | None] = [torch.tensor([1.0, 2.0]), None]
    other = [
        torch.tensor([0, 1], dtype=torch.uint8),
        torch.tensor([0.0, 0.0, 5.0, 6.0], dtype=torch.float64),
        torch.tensor([7.0, 8.0], dtype=torch.float64),
    ]
    strategy = OtherRank(gathered=list(other))
    out = collectives.gather_partial(strategy, [3.0, 4.0], params, grads)
    assert strategy.gathers == 3 and len(out) == 2
    (mine, my_grads), (theirs, their_grads) = out
    assert mine == [3.0, 4.0] and theirs == [7.0, 8.0]
    assert my_grads[1] is None and their_grads[0] is None
    assert my_grads[0] is not None and my_grads[0].dtype == torch.float32 and my_grads[0].tolist() == [1.0, 2.0]
    assert their_grads[1] is not None and their_grads[1].dtype == torch.float16
    assert their_grads[1].tolist() == [[5.0, 6.0]]

    third = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64)  # (kept exact in the dtypes asked)
    out = collectives.gather_partial(
        OtherRank(gathered=[*other[:2], torch.zeros(0, dtype=torch.float64)]),
        [],
        params,
        [third, None],
        [torch.float64] * 2,
    )
    assert out[0][1][0] is not None and out[0][1][0].dtype == torch.float64 and torch.equal(out[0][1][0], third)
    assert out[1][1][1] is not None and out[1][1][1].dtype == torch.float64


@pytest.mark.parametrize("rank", [0, 1])
def test_gather_rows_pads_to_the_longest_and_cuts_each_ranks_rows(rank: int) -> None:
    mine, theirs = (torch.tensor([[1.0], [2.0], [3.0]]), torch.tensor([[9.0]]))
    if rank == 1:
        mine, theirs = theirs, mine
    padded = torch.cat([theirs, torch.zeros(3 - len(theirs), 1)])
    strategy = OtherRank(gathered=[torch.tensor([len(theirs)]), padded, padded * 10], rank=rank)
    out, start = collectives.gather_rows(strategy, [mine, mine * 10])
    expected = [[1.0], [2.0], [3.0], [9.0]]  # (rank 0's three rows, then rank 1's one)
    assert out[0].tolist() == expected and out[1].tolist() == [[10 * v[0]] for v in expected]
    assert start == (0 if rank == 0 else 3)
    assert math.isclose(float(out[0].sum()), 15.0)


@pytest.mark.parametrize(("extra", "buckets"), [(0, 1), (1, 2)])
def test_gradient_buckets_hold_at_most_25_mib(extra: int, buckets: int) -> None:
    """docs/benchmarks.md: the gradient goes in buckets of at most 25 MiB (as DDP's default)."""
    grads = [torch.empty(25 * 2**20 // 4 - 1 + extra), torch.empty(1)]  # float32: 25 MiB exactly, or 4 bytes more
    assert [len(b) for b in collectives._buckets(grads)] == ([2] if buckets == 1 else [1, 1])
