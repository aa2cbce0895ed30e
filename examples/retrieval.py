"""Dense retrieval with hard negatives: a BERT bi-encoder trained with the cached backward.

Data: the docstrings of Python's standard library (bundled with Python, no download), as an
inverse cloze task (Lee et al., 2019, in the variant that keeps the sentence in its passage): a
docstring's first sentence is the query, the docstring the passage. Each query comes with one
hard negative: the docstring of another object of the same module, which shares its vocabulary.
A tiny BERT from a config (byte-level ids, no download) encodes queries and passages; the mean of
its last hidden states is the representation (``get_rep``; the [CLS] vector of so small a BERT
trained from scratch collapses to one point in this budget). Three runs from the same initial
model, on the same batches of 64 queries (64 positives and 64 hard negatives):

- whole batch: one backward of the loss over all 64 queries and 128 passages;
- plain accumulation: 8 micro-batches of 8 queries, each contrasted with its own 16 passages only;
- cached backward: ``acc.backward_cached`` in chunks of 8 queries and 16 passages: the whole
  batch's gradient with one chunk's graph alive.

Why the negatives matter here: at evaluation a held-out query must find its passage among all
256 held-out passages, most of them from other modules. A micro-batch of 8 offers 15 negatives,
a batch of 64 offers 127, and the loss learns only the distinctions its negatives ask for. The
plot (``--out``) shows the top-1 accuracy on the held-out pairs every 10 steps: the cached run
follows the whole batch's (the same gradient; its dropout masks are drawn per chunk, so the two
curves differ by that alone), plain accumulation trains another objective and stays below both.

    pip install -e ".[examples]" && python examples/retrieval.py --out .
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import random
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_accum import AccumulationMixin

from _quiet import quiet

try:
    import transformers
except ImportError as error:  # pragma: no cover - the message is the point
    raise SystemExit('This example needs transformers: pip install -e ".[examples]"') from error

MODULES = (
    "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "codecs", "collections", "concurrent.futures",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "dis", "email",
    "enum", "fnmatch", "fractions", "ftplib", "functools", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac",
    "html.parser", "http.client", "imaplib", "importlib", "inspect", "io", "ipaddress", "itertools", "json",
    "locale", "logging", "lzma", "mailbox", "mimetypes", "multiprocessing", "netrc", "numbers", "operator", "os",
    "pathlib", "pickle", "pkgutil", "platform", "plistlib", "poplib", "pprint", "queue", "random", "re", "reprlib",
    "sched", "secrets", "selectors", "shelve", "shlex", "shutil", "smtplib", "socket", "sqlite3", "ssl",
    "statistics", "string", "struct", "subprocess", "sysconfig", "tarfile", "tempfile", "textwrap", "threading",
    "timeit", "tokenize", "traceback", "turtle", "typing", "unittest", "urllib.parse", "uuid", "warnings", "wave",
    "weakref", "xml.dom.minidom", "zipfile", "zoneinfo",
)
BATCH, MICRO, HELD_OUT = 64, 8, 256
Q_LEN, P_LEN = 24, 64  # bytes per query and per passage


def pairs() -> list[tuple[str, str, str]]:
    """(module, query, passage) for every documented function, class and method with a passage."""
    out, seen = [], set()
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # (a platform without it)
            continue
        objects = [obj for _, obj in inspect.getmembers(module) if inspect.isfunction(obj) or inspect.isclass(obj)]
        methods = [inspect.getmembers(cls, inspect.isfunction) for cls in objects if inspect.isclass(cls)]
        objects += [method for members in methods for _, method in members]
        for obj in objects:
            doc = inspect.getdoc(obj) or ""
            first, _, rest = " ".join(doc.split()).partition(". ")
            if len(first) > 15 and len(rest) > 40 and rest not in seen:
                seen.add(rest)
                out.append((name, first, f"{first}. {rest}"))
    return out


def ids(texts: list[str], length: int) -> dict[str, Tensor]:
    """Byte-level ids after a [CLS] (1), padded with 0, and the attention mask."""
    rows = torch.zeros(len(texts), length, dtype=torch.long)
    for i, text in enumerate(texts):
        data = [1] + [b + 3 for b in text.encode()[: length - 1]]
        rows[i, : len(data)] = torch.tensor(data)
    return {"input_ids": rows, "attention_mask": (rows != 0).long()}


def mean_state(output: Any) -> Tensor:
    """The representation: the mean of the last hidden states (the ``get_rep`` of the cached run)."""
    return output.last_hidden_state.mean(dim=1)


def info_nce_hard(q: Tensor, p: Tensor) -> Tensor:
    """Query i's positive is passage 2i, its hard negative 2i + 1; every other passage is a negative."""
    logits = nn.functional.normalize(q, dim=1) @ nn.functional.normalize(p, dim=1).T / 0.05
    return nn.functional.cross_entropy(logits, torch.arange(len(q)) * 2)


class BiEncoder(AccumulationMixin, pl.LightningModule):
    def __init__(self, mode: str, held_out: dict[str, dict[str, Tensor]], every: int) -> None:
        super().__init__()
        config = transformers.BertConfig(
            vocab_size=259, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
            max_position_embeddings=P_LEN, attn_implementation="eager",
        )  # fmt: skip
        torch.manual_seed(0)  # the same initial model for every run
        self.bert = transformers.BertModel(config, add_pooling_layer=False)
        self.mode, self.held_out, self.every = mode, held_out, every
        self.curve: list[tuple[int, float]] = []
        self.configure_accumulation(BATCH // MICRO if mode == "plain" else 1)

    def training_step(self, batch: dict[str, dict[str, Tensor]], batch_idx: int) -> None:
        queries, passages = batch["queries"], batch["passages"]
        with self.accumulate(batch) as acc:
            if self.mode == "cached":
                acc.backward_cached(
                    [self.bert, self.bert], [queries, passages], info_nce_hard, chunk_size=[MICRO, 2 * MICRO],
                    get_rep=mean_state,
                )  # fmt: skip
            else:  # the whole batch, or (plain) one micro-batch of it
                acc.backward(info_nce_hard(mean_state(self.bert(**queries)), mean_state(self.bert(**passages))))
        step = self.accumulation_progress.step
        if step and step % self.every == 0 and step not in dict(self.curve):
            self.curve.append((step, self.accuracy()))

    @torch.no_grad()
    def accuracy(self) -> float:
        """Top-1: how many held-out queries rank their own passage first among all held-out passages."""
        self.bert.eval()
        q = nn.functional.normalize(mean_state(self.bert(**self.held_out["queries"])), dim=1)
        p = nn.functional.normalize(mean_state(self.bert(**self.held_out["passages"])), dim=1)
        self.bert.train()
        return float(((q @ p.T).argmax(1) == torch.arange(len(q))).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.bert.parameters(), lr=1e-3)


def batches(train: list[tuple[str, str, str]], by_module: dict[str, list[str]], steps: int, size: int) -> list[Any]:
    """``steps`` batches of ``BATCH`` queries (the same for every run), in micro-batches of ``size``:
    each query's passage, then its hard negative, interleaved."""
    rng = random.Random(0)
    out = []
    for _ in range(steps):
        chosen = rng.sample(train, BATCH)
        negatives = [rng.choice([p for p in by_module[m] if p != passage] or [passage]) for m, _, passage in chosen]
        for start in range(0, BATCH, size):
            part, hard = chosen[start : start + size], negatives[start : start + size]
            interleaved = [text for (_, _, p), n in zip(part, hard, strict=True) for text in (p, n)]
            out.append({"queries": ids([q for _, q, _ in part], Q_LEN), "passages": ids(interleaved, P_LEN)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default 10, or 100 with --full)")
    parser.add_argument("--full", action="store_true", help="the full run (several minutes on 2 CPU cores)")
    parser.add_argument("--out", type=Path, default=None, help="a folder for retrieval.png")
    args = parser.parse_args()
    args.steps = args.steps or (100 if args.full else 10)
    quiet()
    transformers.logging.set_verbosity_error()
    data = pairs()
    random.Random(1).shuffle(data)
    held, train = data[:HELD_OUT], data[HELD_OUT:]
    by_module: dict[str, list[str]] = {}
    for module, _, passage in train:
        by_module.setdefault(module, []).append(passage)
    held_out = {"queries": ids([q for _, q, _ in held], Q_LEN), "passages": ids([p for _, _, p in held], P_LEN)}
    every = max(1, args.steps // 10)
    print(f"{len(train)} training pairs from {len(by_module)} modules, {len(held)} held out")
    curves = {}
    for mode in ("whole", "plain", "cached"):
        model = BiEncoder(mode, held_out, every)
        size = MICRO if mode == "plain" else BATCH
        trainer = pl.Trainer(
            accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=sys.stderr.isatty(), enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(model, DataLoader(batches(train, by_module, args.steps, size), batch_size=None))
        curves[mode] = [(0, BiEncoder(mode, held_out, every).accuracy()), *model.curve]
        print(f"{mode:>7}: held-out top-1 accuracy " + " ".join(f"{a:.3f}" for _, a in curves[mode]))
    if args.out is not None:
        plot(curves, args.out / "retrieval.png")


def plot(curves: dict[str, list[tuple[int, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {
        "whole": f"whole batch ({BATCH} queries, {2 * BATCH} passages)",
        "cached": f"cached backward, chunks of {MICRO}: the whole batch's gradient",
        "plain": f"plain accumulation, {BATCH // MICRO} x {MICRO} queries (own negatives only)",
    }
    styles = {"whole": ("black", "-"), "cached": ("tab:orange", "--"), "plain": ("tab:blue", "-")}
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, curve in curves.items():
        color, line = styles[mode]
        ax.plot([s for s, _ in curve], [a for _, a in curve], line, color=color, label=labels[mode])
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"held-out top-1 accuracy among {HELD_OUT} passages")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
