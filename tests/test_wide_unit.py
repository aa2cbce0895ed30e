"""``_core/wide.py`` as table tests, no Trainer: the dtype rule, which parameters are narrow, the sums kept against a
float64 reference of the bf16 gradients, weighting, landing, clearing, checkpoints and the refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_accum._core import wide
from lightning_accum._core.errors import NonFiniteWindowError
from lightning_accum._core.wide import WideSums, check_grad_accum_dtype, dtype_name, narrow

BF = torch.bfloat16


def bf(*values: float) -> nn.Parameter:
    return nn.Parameter(torch.tensor(values, dtype=BF))


def grad_of(c: float) -> float:
    """The bf16 gradient of ``(w * c).sum()``: ``c`` rounded to bf16, as a float64."""
    return float(torch.tensor(c, dtype=BF).double())


# ------------------------------------------------------------------ check_grad_accum_dtype, dtype_name
@pytest.mark.parametrize(
    ("value", "want"),
    [
        (None, None),
        ("float32", torch.float32),
        ("fp32", torch.float32),
        (" FP32 ", torch.float32),
        ("torch.float32", torch.float32),
        ("Float64", torch.float64),
        ("fp64", torch.float64),
        ("torch.float64", torch.float64),
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
    ],
)
def test_check_grad_accum_dtype_accepts(value: object, want: torch.dtype | None) -> None:
    assert check_grad_accum_dtype(value) is want


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("bf16", ValueError, r"`grad_accum_dtype` must be torch.float32.*got 'bf16'"),
        ("float16", ValueError, "got 'float16'"),
        ("", ValueError, "got ''"),
        (32, TypeError, r"must be a torch dtype.*got int 32"),
        (1.0, TypeError, "got float"),
        (torch.bfloat16, ValueError, r"grad_accum_dtype=torch.bfloat16` is no wider than bf16/fp16"),
        (torch.float16, ValueError, "is no wider than bf16/fp16"),
        (torch.int32, ValueError, "is not a floating dtype"),
        (torch.complex64, ValueError, "is not a floating dtype"),
        (torch.complex128, ValueError, "is not a floating dtype"),
    ],
)
def test_check_grad_accum_dtype_refuses(value: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        check_grad_accum_dtype(value)


def test_dtype_name() -> None:
    assert [dtype_name(d) for d in (None, torch.float32, torch.float64, torch.bfloat16)] == [
        None,
        "float32",
        "float64",
        "bfloat16",
    ]


# ------------------------------------------------------------------ narrow
def test_narrow_picks_the_trainable_narrower_floating_parameters_once_in_order() -> None:
    a, b = bf(1.0), nn.Parameter(torch.ones(1, dtype=torch.float16))
    frozen = nn.Parameter(torch.ones(1, dtype=BF), requires_grad=False)
    wide32 = nn.Parameter(torch.ones(1))
    ints = torch.ones(1, dtype=torch.int64)
    got = narrow([b, a, frozen, wide32, ints, b, a], torch.float32)
    assert [id(p) for p in got] == [id(b), id(a)]
    # frozen for now but attached before (`kept`): still narrow; an int tensor never is, kept or not
    got = narrow([frozen, a, ints], torch.float32, kept={id(frozen), id(ints)})
    assert [id(p) for p in got] == [id(frozen), id(a)]
    # under float64, float32 parameters are narrower
    assert [id(p) for p in narrow([wide32, a], torch.float64)] == [id(wide32), id(a)]
    assert narrow([wide32], torch.float32) == []


def test_narrow_refuses_a_trained_parameter_wider_than_the_dtype_but_not_a_frozen_one() -> None:
    p = nn.Parameter(torch.ones(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"trained parameter of dtype torch.float64 \(shape \(2, 3\)\)"):
        narrow([p], torch.float32)
    p.requires_grad_(False)
    assert narrow([p], torch.float32) == []


# ------------------------------------------------------------------ the sums
def test_sums_allocation_views_and_flat_buffer() -> None:
    a = nn.Parameter(torch.ones(2, 3, dtype=BF))
    b = bf(1.0, 2.0)
    w = nn.Parameter(torch.ones(4))  # as wide as the dtype: not held
    sums = WideSums(torch.float32)
    assert not sums.active
    sums.attach([a, w, b])
    assert sums.active and sums.holds(a) and sums.holds(b) and not sums.holds(w)
    assert [tuple(v.shape) for v in sums.views] == [(2, 3), (2,)]
    assert len(sums.flats) == 1 and sums.flats[0].numel() == 8 and sums.flats[0].dtype == torch.float32
    assert all(v.dtype == torch.float32 for v in sums.views)
    # the views are disjoint slices of the flat buffer, in order
    sums.flats[0].copy_(torch.arange(8.0))
    assert sums.views[0].flatten().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert sums.views[1].tolist() == [6.0, 7.0]
    assert sums.filled == [False, False] and sums.landed == [False, False]
    assert sums.dtype_of(a) == torch.float32 and sums.dtype_of(w) == torch.float32 and sums.dtype_of(b) == torch.float32
    assert WideSums(torch.float64).dtype_of(a) == BF


def test_sums_match_a_float64_sum_of_the_bf16_gradients_and_land_once() -> None:
    a, b = bf(1.0, 1.0), bf(1.0)
    sums = WideSums(torch.float32)
    sums.attach([a, b])
    cs = [0.1, 0.3, 0.7, 0.01]
    for c in cs:
        (a * c).sum().backward()
        assert a.grad is None  # taken and freed at once
    assert sums.filled == [True, False]
    want = sum(grad_of(c) for c in cs)
    assert sums.views[0].tolist() == pytest.approx([want, want], rel=1e-7)
    assert [s.tolist() for s in sums.sums()] == [sums.views[0].tolist()]
    assert sums.sums([b]) == [] and len(sums.sums([a])) == 1
    landed = sums.land(0.25)
    assert len(landed) == 1 and landed[0] is a.grad and a.grad is not None and a.grad.dtype == BF
    assert a.grad.tolist() == [float(torch.tensor(want * 0.25, dtype=torch.float32).to(BF))] * 2
    assert b.grad is None
    assert sums.filled == [False, False] and sums.landed == [True, False]
    normalised = sums.normalised(a)
    assert normalised is not None and normalised.tolist() == pytest.approx([want * 0.25] * 2, rel=1e-7)
    assert sums.normalised(b) is None and sums.normalised(nn.Parameter(torch.ones(1))) is None
    assert sums.land(0.5) == []  # nothing held any more
    # the next window's first gradient starts the sum afresh (not added to the landed one)
    a.grad = None
    (a * 2.0).sum().backward()
    assert sums.views[0].tolist() == [2.0, 2.0] and sums.landed == [False, False] and sums.filled[0]


def test_land_with_scale_one_and_a_subset() -> None:
    a, b = bf(1.0), bf(1.0)
    sums = WideSums(torch.float32)
    sums.attach([a, b])
    (a * 3.0 + b * 5.0).sum().backward()
    (a * 3.0 + b * 5.0).sum().backward()
    assert [g.tolist() for g in sums.land(1.0, [b])] == [[10.0]]
    assert sums.filled == [True, False] and sums.landed == [False, True] and a.grad is None
    assert [g.tolist() for g in sums.land(1.0)] == [[6.0]]


def test_clear_forgets_the_chosen_sums_only() -> None:
    a, b = bf(1.0), bf(1.0)
    sums = WideSums(torch.float32)
    sums.attach([a, b])
    (a + b).sum().backward()
    sums.clear([a])
    assert sums.filled == [False, True]
    sums.land(1.0)
    assert sums.landed == [False, True]
    sums.clear()
    assert sums.filled == [False, False] and sums.landed == [False, False]
    assert sums.normalised(b) is None
    (a * 4.0).sum().backward()  # a cleared sum starts afresh
    assert sums.views[0].tolist() == [4.0]


def test_weighting_multiplies_each_gradient_in_the_wide_dtype() -> None:
    a = bf(1.0, 1.0)
    w = nn.Parameter(torch.ones(2, dtype=torch.float32))  # as wide as the dtype: weighed in its own dtype
    sums = WideSums(torch.float32)
    sums.attach([a, w])
    passes = [(0.1, 3.0), (0.3, 1.0), (0.7, 2.5), (0.01, torch.tensor(7.0))]
    for c, weight in passes:
        with sums.weighting(weight):
            (a * c + w * c).sum().backward()
        assert sums.weight == 1.0
    want = sum(grad_of(c) * float(wt) for c, wt in passes)
    want_wide = sum(float(torch.tensor(c, dtype=torch.float32)) * float(wt) for c, wt in passes)
    assert sums.views[0].tolist() == pytest.approx([want] * 2, rel=1e-6)
    assert w.grad is not None and w.grad.tolist() == pytest.approx([want_wide] * 2, rel=1e-6)
    # a tensor weight on the first pass of a window too
    b = bf(1.0)
    other = WideSums(torch.float32)
    other.attach([b])
    with other.weighting(torch.tensor(3.0)):
        (b * 0.5).sum().backward()
    with other.weighting(2.0):
        (b * 0.5).sum().backward()
    assert other.views[0].tolist() == [2.5]


def test_weighting_restores_the_previous_weight_after_an_error() -> None:
    sums = WideSums(torch.float32)
    with pytest.raises(RuntimeError), sums.weighting(2.0):
        assert sums.weight == 2.0
        with sums.weighting(3.0):
            assert sums.weight == 3.0
        assert sums.weight == 2.0
        raise RuntimeError
    assert sums.weight == 1.0


def test_wide_parameters_alone_are_not_weighed() -> None:
    """No narrow parameter: nothing is hooked, the option is inert (the weight is the loss's job)."""
    w = nn.Parameter(torch.ones(2))
    sums = WideSums(torch.float32)
    sums.attach([w])
    with sums.weighting(3.0):
        (w * 1.0).sum().backward()
    assert w.grad is not None and w.grad.tolist() == [1.0, 1.0]


@pytest.mark.parametrize(("weight", "want"), [(1.0, False), (1, False), (2.0, True), (0.0, True), (-1.0, True)])
def test_weighted(weight: float, want: bool) -> None:
    assert wide._weighted(weight) is want
    assert wide._weighted(torch.tensor(1.0)) is True


def test_detach_stops_taking_and_keeps_the_sums() -> None:
    a = bf(1.0)
    sums = WideSums(torch.float32)
    sums.attach([a])
    (a * 2.0).sum().backward()
    sums.detach()
    (a * 3.0).sum().backward()
    assert a.grad is not None and a.grad.tolist() == [3.0]
    assert sums.views[0].tolist() == [2.0] and sums.filled == [True]
    a.grad = None
    sums.attach([a])  # attached again after `detach`: hooked again, the sum still held
    (a * 3.0).sum().backward()
    assert a.grad is None and sums.views[0].tolist() == [5.0]


def test_a_second_owner_takes_the_parameter_over() -> None:
    a = bf(1.0)
    first, second = WideSums(torch.float32), WideSums(torch.float32)
    first.attach([a])
    second.attach([a])
    (a * 2.0).sum().backward()
    assert second.views[0].tolist() == [2.0] and first.filled == [False]
    first.attach([a])  # attaching again takes it back
    (a * 3.0).sum().backward()
    assert first.views[0].tolist() == [3.0] and second.views[0].tolist() == [2.0]


def test_attach_again_keeps_held_sums_and_rehooks_nothing_twice() -> None:
    a, b = bf(1.0), bf(1.0, 1.0)
    sums = WideSums(torch.float32)
    sums.attach([a])
    (a * 2.0).sum().backward()
    flat = sums.flats[0]
    sums.attach([a])  # the same parameters: no new buffer, one hook
    assert sums.flats[0] is flat
    (a * 2.0).sum().backward()
    assert sums.views[0].tolist() == [4.0]
    assert sums.stale([a, b]) and not sums.stale([a])
    sums.attach([b, a])
    assert [id(p) for p in sums.params] == [id(b), id(a)] and not sums.stale([b, a])
    assert sums.filled == [False, True] and sums.views[1].tolist() == [4.0]
    (b * 1.0).sum().backward()
    assert [g.tolist() for g in sums.land(0.5)] == [[0.5, 0.5], [2.0]]
    # a parameter dropped (no longer trainable nor attached) is hooked no more
    sums.attach([b])
    a.grad = None
    (a * 5.0).sum().backward()
    assert a.grad is not None and a.grad.tolist() == [5.0]


def test_slot_and_slot_of() -> None:
    a, b = bf(1.0), bf(1.0)
    w = nn.Parameter(torch.ones(2))
    sums = WideSums(torch.float32)
    sums.attach([a, b, w])
    (a * 3.0).sum().backward()
    sums.views[1].fill_(9.0)  # stale contents of a sum no gradient reached
    assert sums.slot(a).tolist() == [3.0]  # held: untouched
    assert sums.slot(b).tolist() == [0.0] and sums.filled == [True, True]
    assert sums.slot_of(a) is sums.views[0]
    made = sums.slot_of(w)
    assert made is w.grad and made.tolist() == [0.0, 0.0]
    w.grad = torch.full((2,), 5.0)
    assert sums.slot_of(w).tolist() == [5.0, 5.0]


def test_current_and_restore_round_trip() -> None:
    a, b = bf(1.0), bf(1.0, 1.0)
    w = nn.Parameter(torch.ones(1))
    sums = WideSums(torch.float32)
    sums.attach([a, b, w])
    (a * 0.1 + w * 2.0).sum().backward()
    cur = sums.current([a, b, w])
    assert cur[0] is not None and cur[0].tolist() == [grad_of(0.1)]
    assert cur[1] is None and cur[2] is w.grad
    saved = [torch.tensor([0.125]), torch.tensor([1.5, 2.5], dtype=torch.float64), None]
    rest = sums.restore([a, b, w], saved)
    assert rest == [w]
    assert sums.views[0].tolist() == [0.125] and sums.views[1].tolist() == [1.5, 2.5]
    assert sums.filled == [True, True] and sums.landed == [False, False]
    sums.land(1.0)
    assert sums.restore([a, b], [None, torch.tensor([3.0, 4.0])]) == []
    assert sums.filled == [False, True] and sums.landed == [False, False]
    with pytest.raises(ValueError):
        sums.restore([a, b], [None])


def test_add_in_pieces_is_bit_for_bit_the_plain_add() -> None:
    n = wide._CPU_PIECE + 7
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=gen).to(BF)
    total = torch.randn(n, generator=gen)
    want = total.double() + grad.double()
    got = total.clone()
    wide._add(got, grad)
    assert torch.equal(got, (total + grad.float()))
    assert torch.allclose(got.double(), want, rtol=1e-6)
    small = torch.ones(3)
    wide._add(small, torch.tensor([1.0, 2.0, 3.0], dtype=BF))
    assert small.tolist() == [2.0, 3.0, 4.0]


def test_a_large_gradient_is_summed_through_the_hook() -> None:
    n = wide._CPU_PIECE + 3
    p = nn.Parameter(torch.ones(n, dtype=BF))
    sums = WideSums(torch.float32)
    sums.attach([p])
    for c in (0.1, 0.3):
        (p * c).sum().backward()
    want = grad_of(0.1) + grad_of(0.3)
    assert sums.views[0][0].item() == pytest.approx(want, rel=1e-7)
    assert sums.views[0][-1].item() == pytest.approx(want, rel=1e-7)


def test_float16_overflow_is_refused_but_not_an_infinite_sum_nor_bf16() -> None:
    h = nn.Parameter(torch.ones(1, dtype=torch.float16))
    sums = WideSums(torch.float32)
    sums.attach([h])
    (h * 60000.0).sum().backward()
    (h * 60000.0).sum().backward()
    with pytest.raises(NonFiniteWindowError, match="exceeds float16's range"):
        sums.land(1.0)
    h.grad = None
    (h * 60000.0).sum().backward()
    (h * 60000.0).sum().backward()
    assert [g.tolist() for g in sums.land(0.5)] == [[60000.0]]
    sums.slot(h).fill_(float("inf"))  # a non-finite window is the engine's to skip, not this refusal
    assert sums.land(1.0)[0].isinf().all()
    b = bf(1.0)
    other = WideSums(torch.float32)
    other.attach([b])
    (b * 60000.0).sum().backward()
    (b * 60000.0).sum().backward()
    assert other.land(1.0)[0].isfinite().all()


def test_refuse_overflow_reads_every_pair() -> None:
    fine = (torch.ones(1, dtype=torch.float16), torch.ones(1))
    over = (torch.tensor([float("inf")], dtype=torch.float16), torch.tensor([1e6]))
    wide._refuse_overflow([])
    wide._refuse_overflow([fine, fine])
    with pytest.raises(NonFiniteWindowError):
        wide._refuse_overflow([fine, over])


@pytest.mark.parametrize(("family", "names"), [("deepspeed", "DeepSpeed"), ("fsdp", "FSDP (1)"), ("fsdp2", "FSDP2")])
def test_refuse_under(family: str, names: str) -> None:
    wide.refuse_under(family, None, "X")
    with pytest.raises(ValueError, match=r"^Who: `grad_accum_dtype='float32'` cannot work here\. ") as caught:
        wide.refuse_under(family, torch.float32, "Who")
    assert names in str(caught.value)
    wide.refuse_under("ddp", torch.float32, "X")
    wide.refuse_under("single", torch.float32, "X")


def test_inert_note_names_the_dtype() -> None:
    note = wide.inert_note(torch.float64)
    assert note.startswith("`grad_accum_dtype='float64'` changes nothing") and "narrower than float64" in note


def test_a_parameter_widened_between_attaches_is_weighed_instead_of_taken() -> None:
    """``module.float()`` keeps the parameter objects: re-attached, a formerly narrow one loses its taking hook and is
    weighed in its own dtype like any wide one."""
    a, b = bf(1.0), bf(1.0, 1.0)
    sums = WideSums(torch.float32)
    sums.attach([a, b])
    b.data = b.data.float()
    sums.attach([a, b])
    assert not sums.holds(b) and sums.holds(a)
    with sums.weighting(2.0):
        ((a * 0.5).sum() + (b * 0.75).sum()).backward()
    assert b.grad is not None and b.grad.dtype == torch.float32 and b.grad.tolist() == [1.5, 1.5]
    assert a.grad is None and sums.views[0].tolist() == [1.0]
    b.data = b.data.to(BF)  # narrow again: taken again
    b.grad = None
    sums.attach([a, b])
    (b * 0.75).sum().backward()
    assert b.grad is None and sums.views[1].tolist() == [0.75, 0.75]


def test_a_tensor_weight_is_moved_once_per_weighting_to_each_other_device() -> None:
    """(``meta`` stands in for an accelerator: a second device on a CPU-only machine.)"""
    sums = WideSums(torch.float32)
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert sums._weight_on(meta) == 1.0
    two = torch.tensor(2.0)
    with sums.weighting(two):
        assert sums._weight_on(cpu) is two
        moved = sums._weight_on(meta)
        assert isinstance(moved, torch.Tensor) and moved.device == meta
        assert sums._weight_on(meta) is moved  # moved once
    assert sums._weight_on(meta) == 1.0
    with sums.weighting(torch.tensor(3.0)):
        again = sums._weight_on(meta)
        assert isinstance(again, torch.Tensor) and again is not moved  # a new weighting moves its own weight


def test_a_large_non_contiguous_gradient_is_summed() -> None:
    """A transposed parameter's gradient keeps its strides: added whole, not split through ``view(-1)``."""
    p = nn.Parameter(torch.ones(520, 520, dtype=BF).t())
    sums = WideSums(torch.float32)
    sums.attach([p])
    for c in (0.1, 0.3):
        (p * c).sum().backward()
    assert sums.views[0][0, 0].item() == pytest.approx(grad_of(0.1) + grad_of(0.3), rel=1e-7)
