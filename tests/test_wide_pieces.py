"""``grad_accum_dtype``'s sums of large CPU gradients, added a piece at a time (``wide._add``: torch would first copy
the whole narrow gradient to float32), are the float32 sums of the gradients as autograd produced them, bit for bit."""

from __future__ import annotations

import pytest
import torch

from lightning_accum._core import wide


def float32_sum(grads: list[torch.Tensor]) -> torch.Tensor:
    """The reference: each gradient converted to float32 (exactly) and added in order, in float32."""
    total = grads[0].float()
    for g in grads[1:]:
        total = total + g.float()
    return total


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pieces_sum_bit_for_bit(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """Through the hooks, with pieces of 7 elements (a parameter of 55: 7 full pieces and one of 6): after several
    backward passes each sum is the float32 reference exactly, and the narrow ``.grad`` is freed."""
    monkeypatch.setattr(wide, "_CPU_PIECE", 7)
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5, 11, generator=g).to(dtype))
    small = torch.nn.Parameter(torch.randn(3, generator=g).to(dtype))  # (fewer elements than a piece)
    sums = wide.WideSums(torch.float32)
    sums.attach([w, small])
    seen: list[list[torch.Tensor]] = [[], []]
    for _ in range(6):
        scale = torch.randn(5, 11, generator=g).to(dtype) * 10 ** torch.randint(-3, 3, (5, 11), generator=g)
        for p, kept in zip((w, small), seen, strict=True):  # each micro-batch's gradient, as autograd makes it
            kept.append(torch.autograd.grad((p * scale.flatten()[: p.numel()].view(p.shape)).sum(), p)[0])
        ((w * scale).sum() + (small * scale.flatten()[:3]).sum()).backward()
        assert w.grad is None and small.grad is None
    for view, kept in zip(sums.views, seen, strict=True):
        assert view.dtype == torch.float32
        assert torch.equal(view, float32_sum(kept))


def test_pieces_at_the_real_size() -> None:
    """``_add`` at its own piece size (a gradient of 2 pieces and 3 elements, large and small values mixed): the
    float32 reference exactly."""
    n = 2 * wide._CPU_PIECE + 3
    g = torch.Generator().manual_seed(1)
    grads = [(torch.randn(n, generator=g) * 10 ** torch.randint(-4, 4, (n,), generator=g)).bfloat16() for _ in range(4)]
    total = grads[0].float()
    for grad in grads[1:]:
        wide._add(total, grad)
    assert torch.equal(total, float32_sum(grads))


def test_non_contiguous_gradient_added_whole() -> None:
    """A gradient whose layout is not the sum's (transposed) is added as a whole: the reference exactly."""
    g = torch.Generator().manual_seed(2)
    total = torch.randn(600, 500, generator=g)
    grad = torch.randn(500, 600, generator=g).bfloat16().t()
    expected = total + grad.float()
    wide._add(total, grad)
    assert torch.equal(total, expected)
