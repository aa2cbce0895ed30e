"""A SentenceTransformer at a batch whose contrastive loss does not fit: the loss in blocks of rows.

The data of ``retrieval.py`` (the standard library's docstrings as an inverse cloze task: a
docstring's first sentence is the query, the docstring its passage, and the docstring of another
object of the same module its hard negative; no download), the model a tiny SentenceTransformer
from a config (BERT, 2 layers of 64, mean pooling) with a word vocabulary counted from the
training passages, passed to ``acc.backward_cached`` as it comes:

    acc.backward_cached([st, st], [st.preprocess(queries), st.preprocess(passages)], mnrl,
                        chunk_size=64, loss_chunk_size=64)

At a batch of 1024 queries against 2048 passages, the score matrix alone is 8 MiB (float32) and
the whole loss's graph keeps several of it: over the example's memory budget (``--budget-mib``,
16 MiB of tensors saved for backward, measured with ``lightning_accum.multitask.
measure_graph_memory`` on the first batch's representations). In blocks of 64 query rows one
block of the scores is alive at a time, and the whole step, encoders included, stays within the
budget (measured in every step). The held-out queries must find their passage among 256.

    pip install -e ".[examples]" && python examples/large_batch_retrieval.py
"""

from __future__ import annotations

import argparse
import collections
import random
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_accum import AccumulationMixin
from lightning_accum.multitask import measure_graph_memory

from _quiet import quiet

try:
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
except ImportError as error:  # pragma: no cover - the message is the point
    raise SystemExit('This example needs sentence-transformers: pip install -e ".[examples]"') from error

from retrieval import pairs  # (the same data)

HELD_OUT, CHUNK, BLOCK, MAX_TOKENS = 256, 32, 64, 32


def sentence_transformer(texts: list[str], folder: Path) -> Any:
    """A tiny SentenceTransformer: a BERT from a config, a vocabulary of the 4000 most frequent words
    of ``texts`` (lower case, punctuation apart, as BERT's tokenizer splits), mean pooling."""
    counts = collections.Counter(w for text in texts for w in re.findall(r"\w+|[^\w\s]", text.lower()))
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [w for w, _ in counts.most_common(4000)]
    (folder / "vocab.txt").write_text("\n".join(words) + "\n")
    config = transformers.BertConfig(
        vocab_size=len(words), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=MAX_TOKENS,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(folder)
    transformers.BertTokenizer(str(folder / "vocab.txt")).save_pretrained(folder)
    module = Transformer(str(folder), max_seq_length=MAX_TOKENS, model_kwargs={"attn_implementation": "eager"})
    return SentenceTransformer(modules=[module, Pooling(module.get_embedding_dimension(), "mean")], device="cpu")


def mnrl(queries: Tensor, passages: Tensor, rows: slice | None = None) -> Tensor:
    """MultipleNegativesRankingLoss (cosine x 20): query i's positive is passage 2i, its hard negative
    2i + 1, every other passage a negative. With ``rows``, the part of those query rows (the parts
    sum to the mean over all queries)."""
    rows = slice(0, len(queries)) if rows is None else rows
    scores = nn.functional.normalize(queries[rows], dim=1) @ nn.functional.normalize(passages, dim=1).T * 20
    labels = torch.arange(rows.start, rows.stop) * 2
    return nn.functional.cross_entropy(scores, labels, reduction="sum") / len(queries)


class BiEncoder(AccumulationMixin, pl.LightningModule):
    def __init__(self, st: Any, held_out: tuple[list[str], list[str]]) -> None:
        super().__init__()
        self.st, self.held_out = st, held_out
        self.peak = 0  # the largest step's graph memory
        self.configure_accumulation(1)  # (one batch a step: the batch itself is the large one)

    def training_step(self, batch: dict[str, list[str]], batch_idx: int) -> None:
        st = self.st
        with self.accumulate(batch) as acc, measure_graph_memory(exclude=st.parameters()) as memory:
            loss = acc.backward_cached(
                [st, st], [st.preprocess(batch["queries"]), st.preprocess(batch["passages"])], mnrl,
                chunk_size=CHUNK, loss_chunk_size=BLOCK,
            )  # fmt: skip
        self.peak = max(self.peak, memory.peak)
        self.log("loss", loss, prog_bar=True)

    @torch.no_grad()
    def accuracy(self) -> float:
        """Top-1: held-out queries whose own passage ranks first among all held-out passages."""
        self.st.eval()
        q, p = (self.st.encode(texts, convert_to_tensor=True, normalize_embeddings=True) for texts in self.held_out)
        self.st.train()
        return float(((q @ p.T).argmax(1) == torch.arange(len(q))).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.st.parameters(), lr=1e-3)


def batches(train: list[tuple[str, str, str]], steps: int, size: int) -> list[dict[str, list[str]]]:
    """``steps`` batches of ``size`` queries, each passage followed by its hard negative."""
    by_module: dict[str, list[str]] = {}
    for module, _, passage in train:
        by_module.setdefault(module, []).append(passage)
    rng, out = random.Random(0), []
    for _ in range(steps):
        chosen = rng.sample(train, min(size, len(train)))
        passages = []
        for module, _, passage in chosen:
            passages += [passage, rng.choice([p for p in by_module[module] if p != passage] or [passage])]
        out.append({"queries": [q for _, q, _ in chosen], "passages": passages})
    return out


def loss_memory(reps: list[Tensor], block: int | None) -> int:
    """Bytes the loss stage saves for backward on these representations (whole, or in blocks of rows)."""
    leaves = [r.clone().requires_grad_() for r in reps]
    with measure_graph_memory() as memory:
        if block is None:
            mnrl(*leaves).backward()
        else:
            for start in range(0, len(leaves[0]), block):
                mnrl(*leaves, rows=slice(start, min(start + block, len(leaves[0])))).backward()
    return memory.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default 2, or 20 with --full)")
    parser.add_argument("--full", action="store_true", help="the full run (several minutes on 2 CPU cores)")
    parser.add_argument("--batch", type=int, default=1024, help="queries a batch (each with 2 passages)")
    parser.add_argument("--budget-mib", type=float, default=16.0, help="memory for tensors saved for backward")
    args = parser.parse_args()
    args.steps = args.steps or (20 if args.full else 2)
    quiet()
    transformers.logging.set_verbosity_error()
    data = pairs()
    random.Random(1).shuffle(data)
    held, train = data[:HELD_OUT], data[HELD_OUT:]
    with tempfile.TemporaryDirectory() as folder:
        st = sentence_transformer([p for _, _, p in train], Path(folder))
    loader = batches(train, args.steps, args.batch)
    budget = args.budget_mib * 2**20
    with torch.no_grad():  # (the first batch's representations: the loss stage's inputs)
        reps = [st.encode(loader[0][c], convert_to_tensor=True, batch_size=CHUNK) for c in ("queries", "passages")]
    whole, blocks = loss_memory(reps, None), loss_memory(reps, BLOCK)
    queries = len(loader[0]["queries"])
    print(f"batch of {queries} queries, {2 * queries} passages; memory budget {args.budget_mib:g} MiB")
    verdict = "does not fit" if whole > budget else "fits"
    print(f"the whole loss's graph: {whole / 2**20:.1f} MiB ({verdict}); "
          f"in blocks of {BLOCK}: {blocks / 2**20:.1f} MiB")  # fmt: skip
    model = BiEncoder(st, ([q for _, q, _ in held], [p for _, _, p in held]))
    before = model.accuracy()
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=sys.stderr.isatty(), enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, DataLoader(loader, batch_size=None))
    within = "within" if model.peak <= budget else "OVER"
    print(f"training: the largest step's graph memory {model.peak / 2**20:.1f} MiB ({within} the budget), "
          f"{args.steps} steps, encoder chunks of {CHUNK}, loss blocks of {BLOCK}")  # fmt: skip
    print(f"held-out top-1 accuracy among {HELD_OUT} passages: {before:.3f} before, {model.accuracy():.3f} after")


if __name__ == "__main__":
    main()
