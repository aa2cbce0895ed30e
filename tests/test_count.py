"""Item-count helpers for Hugging Face batches."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_accum.count import causal_lm_tokens, masked_lm_tokens, seq2seq_tokens


def test_count_helpers() -> None:
    labels = torch.tensor([[5, 6, 7, -100], [8, 9, -100, -100]])
    assert int(causal_lm_tokens({"labels": labels})) == 3
    assert int(causal_lm_tokens({"attention_mask": (labels != -100).long()})) == 3
    assert int(masked_lm_tokens({"labels": labels})) == 5
    assert int(seq2seq_tokens({"labels": labels})) == 5
    for helper in (causal_lm_tokens, masked_lm_tokens, seq2seq_tokens):
        with pytest.raises(ValueError, match="needs"):
            helper({})



@pytest.mark.parametrize(
    ("helper", "key"),
    [(causal_lm_tokens, "labels"), (causal_lm_tokens, "attention_mask"), (masked_lm_tokens, "labels"),
     (seq2seq_tokens, "labels")],
)  # fmt: skip
def test_a_batch_not_collated_into_tensors_is_named(helper: Any, key: str) -> None:
    named = rf"`{helper.__name__}` .*`batch\['{key}'\]`, which must be a tensor.*got a list"
    with pytest.raises(TypeError, match=named):
        helper({key: [[1, 2, 3]]})


def test_the_counts_are_the_targets_cross_entropy_averages_over() -> None:
    """Against PyTorch's own loss: a mean ``cross_entropy`` over the targets (shifted for a causal LM), times the
    count, is the summed loss; the ignored label is PyTorch's ``ignore_index`` (``IGNORE_INDEX``, each helper's
    default). A causal LM without labels counts the attention mask's positions after the first."""
    import inspect

    from lightning_accum.count import IGNORE_INDEX

    assert torch.nn.CrossEntropyLoss().ignore_index == IGNORE_INDEX
    for helper in (causal_lm_tokens, masked_lm_tokens, seq2seq_tokens):
        assert inspect.signature(helper).parameters["ignore_index"].default == IGNORE_INDEX
    g = torch.Generator().manual_seed(0)
    labels = torch.tensor([[5, 6, 7, 1, 2, -100], [8, 9, 3, -100, -100, -100], [4, 4, 4, 4, 4, 4]])
    logits = torch.randn(3, 6, 10, generator=g, dtype=torch.float64)
    for count, scores, targets in (
        (causal_lm_tokens, logits[:, :-1], labels[:, 1:]),
        (masked_lm_tokens, logits, labels),
        (seq2seq_tokens, logits, labels),
    ):
        flat, flat_targets = scores.reshape(-1, 10), targets.reshape(-1)
        mean = torch.nn.functional.cross_entropy(flat, flat_targets)
        summed = torch.nn.functional.cross_entropy(flat, flat_targets, reduction="sum")
        assert torch.allclose(mean * count({"labels": labels}), summed, rtol=1e-12, atol=0)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    assert int(causal_lm_tokens({"attention_mask": mask})) == 5 + 2 + 0
    assert int(masked_lm_tokens({"labels": labels}, ignore_index=4)) == 18 - 6  # (another ignored label: -100 counts)
