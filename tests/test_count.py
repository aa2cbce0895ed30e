"""Item-count helpers for Hugging Face batches."""

from __future__ import annotations

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
