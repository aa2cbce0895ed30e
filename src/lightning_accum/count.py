"""Item counts for ``count=`` (``normalize="items"``): the tokens a Hugging Face loss averages over.

A token-weighted window needs each micro-batch's number of *predicted* tokens. Counting the
attention mask, or every label that is not ``-100``, counts too many for a causal LM: the
model predicts token ``t + 1`` from position ``t``, so position 0 of every sequence is never a
target, and each sequence adds one token too many. The window's gradient is then weighted
towards short sequences: a silently different objective. Each helper returns a 0-d tensor on
the batch's device (no host sync).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

IGNORE_INDEX = -100
"""The label Hugging Face losses skip (PyTorch's `cross_entropy` default `ignore_index`)."""


def _get(batch: Any, key: str, who: str) -> Tensor | None:
    """``batch[key]`` (or the attribute), ``None`` if absent; refused unless it is a tensor."""
    value = batch.get(key) if isinstance(batch, Mapping) else getattr(batch, key, None)
    if value is not None and not isinstance(value, Tensor):
        raise TypeError(
            f"`{who}` counts the tokens of `batch[{key!r}]`, which must be a tensor (of token ids, batch x sequence) "
            f"as a collator gives it; got a {type(value).__name__}. Collate the batch into tensors first (e.g. "
            f"`torch.tensor(...)`, or a Hugging Face `DataCollator`)."
        )
    return value


def causal_lm_tokens(batch: Any, ignore_index: int = -100) -> Tensor:
    """Tokens a causal LM's loss averages over: ``labels[:, 1:]`` that are not ``ignore_index``
    (the labels are shifted inside the model), or, without labels, ``attention_mask[:, 1:]``.

    Example:

        >>> import torch
        >>> batch = {"labels": torch.tensor([[5, 6, 7, -100], [8, 9, -100, -100]])}
        >>> int(causal_lm_tokens(batch))  # 2 + 1 targets, not 3 + 2
        3
    """
    labels = _get(batch, "labels", "causal_lm_tokens")
    if labels is not None:
        return (labels[..., 1:] != ignore_index).sum()
    mask = _get(batch, "attention_mask", "causal_lm_tokens")
    if mask is None:
        raise ValueError("`causal_lm_tokens` needs `labels` or `attention_mask` in the batch.")
    return (mask[..., 1:] != 0).sum()


def masked_lm_tokens(batch: Any, ignore_index: int = -100) -> Tensor:
    """Tokens a masked LM's (or token classifier's) loss averages over: ``labels`` that are not
    ``ignore_index`` (no shift).

    Example:

        >>> import torch
        >>> int(masked_lm_tokens({"labels": torch.tensor([[-100, 4, -100], [7, -100, -100]])}))
        2
    """
    labels = _get(batch, "labels", "masked_lm_tokens")
    if labels is None:
        raise ValueError("`masked_lm_tokens` needs `labels` in the batch.")
    return (labels != ignore_index).sum()


def seq2seq_tokens(batch: Any, ignore_index: int = -100) -> Tensor:
    """Tokens a sequence-to-sequence model's loss averages over: the decoder ``labels`` that are
    not ``ignore_index`` (the model shifts the decoder's inputs, not the labels).

    Example:

        >>> import torch
        >>> int(seq2seq_tokens({"labels": torch.tensor([[3, 4, 1], [5, 1, -100]])}))
        5
    """
    labels = _get(batch, "labels", "seq2seq_tokens")
    if labels is None:
        raise ValueError("`seq2seq_tokens` needs the decoder `labels` in the batch.")
    return (labels != ignore_index).sum()
