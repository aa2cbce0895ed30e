"""The cached backward against sentence-transformers' own cached loss, side by side in one process.

``CachedMultipleNegativesRankingLoss`` (sentence-transformers 6) embeds every column in
mini-batches without a graph, computes the loss m anchor rows at a time, and replays each
mini-batch with its cached gradient. The package does the same with
``backward_cached([model] * 3, features, mnrl, chunk_size=m, loss_chunk_size=m)`` on the same
SentenceTransformer as it comes (its forward takes the features dict; the representation is its
``sentence_embedding``). A tiny one here, from a config (BERT, 2 layers of 32, mean pooling,
float64, dropout 0.1; nothing downloaded), on triplets (anchor, positive, hard negative) of
random words (8 to 24 a text): B anchors against 2B candidates.

Measured at batch 128, 512 and 2048 with chunks of 64 in both stages: the process's heap peak
(glibc's ``mallinfo2`` sampled after every operator, above its level before the call, as in
``cached_memory.py``), the CPU time on one thread (best of ``--rounds``, the two interleaved), and the gradient
against the uncached loss (one backward of the whole batch, dropout off for that check). Then on
2 gloo ranks (CPU), each with half of a batch, every rank's embeddings in the loss: the package's
rank-local loss (``gather=True`` with ``loss_chunk_size``: each rank scores its own anchor rows
against every rank's candidates) against sentence-transformers' ``gather_across_devices=True``
(which does the same) and against the package's whole gathered loss (every rank all rows): the
rows each rank's loss scored, the heap peak and the time per rank, and the gradient averaged over
ranks against one process.

    python benchmarks/cached_sentence_transformers.py [--batches 128 512 2048] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from cached_memory import heap_peak
from torch import Tensor, nn

from lightning_accum._core import cached, collectives

HERE = Path(__file__).resolve().parent
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(1000)]
CHUNK = 64


def sentence_transformer(path: Path, dropout: float) -> Any:
    """A tiny SentenceTransformer from a config and a vocabulary written here (no download)."""
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    transformers.logging.set_verbosity_error()
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    config = transformers.BertConfig(
        vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(path)
    transformers.BertTokenizer(str(path / "vocab.txt")).save_pretrained(path)
    module = Transformer(str(path), model_kwargs={"attn_implementation": "eager"})
    return SentenceTransformer(modules=[module, Pooling(module.get_embedding_dimension(), "mean")], device="cpu")


def columns(model: Any, batch: int, seed: int) -> list[dict[str, Any]]:
    """Anchors, positives, hard negatives: ``batch`` texts of 8 to 24 random words each, tokenized."""
    rng = random.Random(seed)
    return [
        model.preprocess([" ".join(f"w{rng.randrange(1000)}" for _ in range(rng.randint(8, 24))) for _ in range(batch)])
        for _ in range(3)
    ]


def mnrl(anchors: Tensor, *candidates: Tensor, rows: slice | None = None, scale: float = 20.0) -> Tensor:
    """MultipleNegativesRankingLoss (cosine x 20, anchor i's positive is candidate i): the part of the
    anchors ``rows`` (all of them without), the parts summing to the mean over the anchors."""
    rows = slice(0, len(anchors)) if rows is None else rows
    a = nn.functional.normalize(anchors[rows], dim=1)
    scores = torch.cat([a @ nn.functional.normalize(c, dim=1).T for c in candidates], dim=1) * scale
    labels = torch.arange(rows.start, rows.stop, device=anchors.device)
    return nn.functional.cross_entropy(scores, labels, reduction="sum") / len(anchors)


def package(model: Any, features: list[dict[str, Any]], **kwargs: Any) -> Callable[[], None]:
    def run() -> None:
        cached.backward_cached([model] * len(features), features, mnrl, CHUNK, Tensor.backward,
                               torch.autograd.backward, loss_chunk_size=CHUNK, **kwargs)  # fmt: skip

    return run


def theirs(model: Any, features: list[dict[str, Any]], **kwargs: Any) -> Callable[[], None]:
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    loss = CachedMultipleNegativesRankingLoss(model, mini_batch_size=CHUNK, **kwargs)

    def run() -> None:
        loss(features, None).backward()

    return run


def grads(model: Any) -> list[Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def gap(a: list[Tensor], b: list[Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def measure(runs: dict[str, Callable[[], None]], model: Any, rounds: int) -> tuple[dict[str, int], dict[str, float]]:
    """Each run's heap peak (once, after a warm-up run) and best time over ``rounds`` interleaved rounds."""
    peaks, best = {}, dict.fromkeys(runs, float("inf"))
    for name, run in runs.items():
        run()  # (warm: the allocator's arenas reach their size)
        model.zero_grad(set_to_none=True)
        with heap_peak() as peak:
            run()
        peaks[name] = peak.peak
        model.zero_grad(set_to_none=True)
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.process_time()  # (one thread: the CPU time it used, which other processes move less)
            run()
            best[name] = min(best[name], time.process_time() - start)
            model.zero_grad(set_to_none=True)
    return peaks, best


def one_process(path: Path, batches: list[int], rounds: int) -> list[dict[str, Any]]:
    rows = []
    for batch in batches:
        model = sentence_transformer(path, dropout=0.0).double().train()
        features = columns(model, batch, seed=batch)
        mnrl(*[model(dict(f))["sentence_embedding"] for f in features]).backward()  # the uncached loss
        whole = grads(model)
        model.zero_grad(set_to_none=True)
        package(model, features)()
        mine = grads(model)
        model.zero_grad(set_to_none=True)
        theirs(model, features)()
        their = grads(model)
        model.zero_grad(set_to_none=True)
        model = sentence_transformer(path, dropout=0.1).double().train()
        runs = {"sentence-transformers": theirs(model, features), "package": package(model, features)}
        peaks, best = measure(runs, model, rounds)
        rows.append(
            {
                "batch": batch,
                "chunk": CHUNK,
                "peak_bytes_theirs": peaks["sentence-transformers"],
                "peak_bytes_package": peaks["package"],
                "peak_ratio": peaks["package"] / peaks["sentence-transformers"],
                "time_theirs_s": best["sentence-transformers"],
                "time_package_s": best["package"],
                "time_ratio": best["package"] / best["sentence-transformers"],
                "grad_vs_uncached": gap(mine, whole),
                "theirs_vs_uncached": gap(their, whole),
            }
        )
    return rows


class GlooStrategy:
    """The part of a Lightning strategy ``collectives`` uses, over a plain gloo process group."""

    world_size = 2
    root_device = torch.device("cpu")

    def __init__(self, rank: int) -> None:
        self.global_rank = rank

    def all_gather(self, tensor: Tensor) -> Tensor:
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor)
        return torch.stack(out)

    def reduce(self, tensor: Tensor, reduce_op: str = "sum") -> Tensor:
        dist.all_reduce(tensor)
        return tensor


def worker(rank: int, path: str, batch: int, rounds: int, out: str) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)
    model = sentence_transformer(Path(path) / f"model{rank}", dropout=0.0).double().train()  # (transformers saves
    dist.init_process_group("gloo", init_method=f"file://{path}/store", rank=rank, world_size=2)  # on rank 0 only)
    strategy = GlooStrategy(rank)
    features = columns(model, batch, seed=batch)  # (the same on both ranks; each takes its half)
    half = [{k: v[rank * batch // 2 : (rank + 1) * batch // 2] if isinstance(v, Tensor) else v for k, v in f.items()}
            for f in features]  # fmt: skip
    scored: list[int] = []

    def counted(*reps: Tensor, rows: slice | None = None) -> Tensor:
        scored.append(len(reps[0]) if rows is None else rows.stop - rows.start)
        return mnrl(*reps, rows=rows)

    def gathered(block: int | None) -> Callable[[], None]:
        def run() -> None:
            cached.backward_cached(
                [model] * 3, half, counted, CHUNK, Tensor.backward, torch.autograd.backward,
                gather=lambda reps: collectives.gather_rows(strategy, reps), reduce=collectives.sum_tensors, world=2,
                loss_chunk_size=block,
            )  # fmt: skip

        return run

    def similarity(a: Tensor, b: Tensor) -> Tensor:  # (sentence-transformers' cos_sim, its rows counted)
        scored.append(len(a))
        return nn.functional.normalize(a, dim=1) @ nn.functional.normalize(b, dim=1).T

    runs = {
        "sentence-transformers": theirs(model, half, gather_across_devices=True, similarity_fct=similarity),
        "rank-local": gathered(CHUNK),
        "whole gathered loss": gathered(None),
    }
    result: dict[str, Any] = {"rows": {}}
    for name, run in runs.items():  # the gradient, averaged over ranks (what DDP steps with)
        model.zero_grad(set_to_none=True)
        scored.clear()
        run()
        result["rows"][name] = sum(scored)
        mean = [g.clone() for g in grads(model)]
        for g in mean:
            dist.all_reduce(g)
            g /= 2
        result[f"grad {name}"] = mean
    model.zero_grad(set_to_none=True)
    mnrl(*[model(dict(f))["sentence_embedding"] for f in features]).backward()  # one process, whole batch
    whole = grads(model)
    model.zero_grad(set_to_none=True)
    peaks, best = {}, dict.fromkeys(runs, float("inf"))
    for name, run in runs.items():
        dist.barrier()
        with heap_peak() as peak:
            run()
        peaks[name] = peak.peak
        model.zero_grad(set_to_none=True)
    for _ in range(rounds):
        for name, run in runs.items():
            dist.barrier()
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    summary = {
        name: {
            "rows_scored": result["rows"][name],
            "peak_bytes": peaks[name],
            "time_s": best[name],
            "grad_vs_one_process": gap(result[f"grad {name}"], whole),
        }
        for name in runs
    }
    if rank == 0:
        Path(out).write_text(json.dumps(summary))
    dist.destroy_process_group()


def two_ranks(batch: int, rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        mp.spawn(worker, args=(tmp, batch, rounds, out), nprocs=2)
        return json.loads(Path(out).read_text())  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--ranks-batch", type=int, default=512, help="the global batch of the 2-rank run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=HERE / "cached_sentence_transformers.json")
    args = parser.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)  # (the ranks share the cores: one thread each, and the same for one process)
    with tempfile.TemporaryDirectory() as tmp:
        rows = one_process(Path(tmp), args.batches, args.rounds)
    print(f"{'batch':>6}{'chunk':>6}{'heap MiB':>10}{'theirs':>9}{'ratio':>8}{'time s':>9}{'theirs':>9}{'ratio':>8}"
          f"{'grad gap':>10}{'theirs':>10}")  # fmt: skip
    for r in rows:
        print(
            f"{r['batch']:>6}{r['chunk']:>6}{r['peak_bytes_package'] / 2**20:>10.2f}"
            f"{r['peak_bytes_theirs'] / 2**20:>9.2f}"
            f"{r['peak_ratio']:>8.3f}{r['time_package_s']:>9.3f}{r['time_theirs_s']:>9.3f}{r['time_ratio']:>8.3f}"
            f"{r['grad_vs_uncached']:>10.1e}{r['theirs_vs_uncached']:>10.1e}"
        )
    print("targets: heap peak ratio <= 1, time ratio <= 1.05, gradient gap to the uncached loss <= 1e-12")
    ranks = two_ranks(args.ranks_batch, args.rounds)
    print(f"2 gloo ranks, global batch {args.ranks_batch} ({args.ranks_batch // 2} anchors a rank):")
    print(f"{'':<24}{'rows scored':>12}{'heap MiB':>10}{'time s':>9}{'grad gap':>10}")
    for name, r in ranks.items():
        print(f"{name:<24}{r['rows_scored']:>12}{r['peak_bytes'] / 2**20:>10.2f}{r['time_s']:>9.3f}"
              f"{r['grad_vs_one_process']:>10.1e}")  # fmt: skip
    result = {"benchmark": "cached_sentence_transformers", "rows": rows, "two_ranks": ranks,
              "ranks_batch": args.ranks_batch}  # fmt: skip
    args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
