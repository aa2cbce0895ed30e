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
