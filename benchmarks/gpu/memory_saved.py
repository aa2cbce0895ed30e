"""Part 3 of the GPU harness: the memory the package exists to save, from the CUDA allocator's peak
(``torch.cuda.max_memory_allocated`` above what was allocated before the step).

* The cached backward (``backward_cached`` with ``loss_chunk_size``, as ``cached_sentence_transformers.py``
  calls it) against sentence-transformers' ``CachedMultipleNegativesRankingLoss`` on a BERT-base-sized tower
  from a config (12 layers of 768, 12 heads, dropout 0.1, mean pooling; a vocabulary of 1005 words, nothing
  downloaded), triplets of 8 to 24 random words, batch 4096 and 16384, mini-batches of ``chunk`` in both:
  peak and median time (TF32 matmuls for both, so that the run fits its budget).
* Multitask (``multitask_memory.py``'s models, T = 4): one task graph at a time (``backward_each``,
  ``backward_heads``) against the joint ``sum(losses).backward()``, the gradients already allocated.
* ``microbatch_size="auto"`` on a loader batch that does not fit: the GPT-2 of part 1 under a memory cap
  set from its measured bytes per sequence so that the whole batch and its half do not fit; the back-offs
  (halvings), the size it settles on, the first window's extra time, and the throughput against the best
  hand-picked ``microbatch_size`` under the same cap. (The CPU dry run has no memory to run out of: its
  model raises ``torch.OutOfMemoryError`` itself for pieces over a quarter of the batch.)
"""

from __future__ import annotations

import copy
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from device_clock import Device, median_seconds
from lm_loops import LM, LMSize, Plan, Row, causal_lm, fit, lm_loss, token_batches
from torch import Tensor, nn

from lightning_accum import AccumulationScheduler


@dataclass
class TowerSize:
    layers: int = 12
    width: int = 768
    heads: int = 12
    batches: tuple[int, ...] = (4096, 16384)
    chunk: int = 256
    rounds: int = 2


def sentence_tower(path: Path, size: TowerSize, device: Device) -> Any:
    """A SentenceTransformer from a BERT config and a word vocabulary written here (no download)."""
    import transformers
    from cached_sentence_transformers import WORDS
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    (path / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    config = transformers.BertConfig(
        vocab_size=len(WORDS), hidden_size=size.width, num_hidden_layers=size.layers, num_attention_heads=size.heads,
        intermediate_size=4 * size.width, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(path)
    transformers.BertTokenizer(str(path / "vocab.txt")).save_pretrained(path)
    module = Transformer(str(path), model_kwargs={"attn_implementation": "sdpa"})
    return SentenceTransformer(modules=[module, Pooling(module.get_embedding_dimension(), "mean")], device=device.type)


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.0f}"


def on(device: Device, column: dict[str, Any]) -> dict[str, Any]:
    """A tokenized column's tensors on the device."""
    return {key: value.to(device.torch) if isinstance(value, Tensor) else value for key, value in column.items()}


def cached_rows(device: Device, size: TowerSize) -> list[Row]:
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = sentence_tower(Path(tmp), size, device)
            return [row for batch in size.batches for row in cached_batch(device, model, batch, size)]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def cached_batch(device: Device, model: Any, batch: int, size: TowerSize) -> list[Row]:
    from cached_sentence_transformers import columns, mnrl
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    from lightning_accum._core import cached

    features = [on(device, column) for column in columns(model, batch, seed=batch)]
    theirs_loss = CachedMultipleNegativesRankingLoss(model, mini_batch_size=size.chunk)

    def ours() -> None:
        cached.backward_cached([model] * 3, features, mnrl, size.chunk, Tensor.backward, torch.autograd.backward,
                               loss_chunk_size=size.chunk)  # fmt: skip

    def theirs() -> None:
        theirs_loss(features, None).backward()

    runs = {"ours": ours, "theirs": theirs}
    peak, grads, times = {}, {}, {name: [] for name in runs}
    for name, run in runs.items():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        run()  # (the warm-up; its gradient compared below)
        grads[name] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        model.zero_grad(set_to_none=True)
        base = device.reset_peak()
        run()
        peak[name] = device.peak_above(base)
    for _ in range(size.rounds):
        for name, run in runs.items():
            model.zero_grad(set_to_none=True)
            times[name].append(median_seconds(device, run, reps=1, warmup=0))
    model.zero_grad(set_to_none=True)
    gap = max(float((a - b).abs().max()) for a, b in zip(grads["ours"], grads["theirs"], strict=True))
    scale = max(float(b.abs().max()) for b in grads["theirs"])
    what = f"cached backward vs sentence-transformers' cached MNRL, batch {batch}, chunks of {size.chunk}"
    t_ours, t_theirs = statistics.median(times["ours"]), statistics.median(times["theirs"])
    return [
        ("memory", what, f"allocator peak vs theirs ({mib(peak['ours'])} vs {mib(peak['theirs'])} MiB)",
         f"{peak['ours'] / peak['theirs']:.3f}", "<= 1.0"),
        ("memory", what, f"time vs theirs (median of {size.rounds}; {t_ours:.2f} vs {t_theirs:.2f} s)",
         f"{t_ours / t_theirs:.3f}", "<= 1.05"),
        ("memory", what, "gradient vs theirs, max abs difference / max abs (dropout replayed by each)",
         f"{gap / scale:.1e}", "(reported)"),
    ]  # fmt: skip


def multitask_rows(device: Device, scale: int, reps: int) -> list[Row]:
    setups = (("independent", "independent tasks (backward_each)"), ("trunk", "shared trunk (backward_heads)"))
    return [row for kind, label in setups for row in multitask_setup(device, kind, label, scale, reps)]


def multitask_setup(device: Device, kind: str, label: str, scale: int, reps: int) -> list[Row]:
    from multitask_memory import build

    with torch.device(device.torch):
        modules, step = build(kind, 4, scale)
    step("joint")  # the gradients allocated: what is measured is the graphs and backward's temporaries
    peak, seconds = {}, {}
    for method in ("joint", "sequential"):
        for module in modules:
            module.zero_grad(set_to_none=False)
        base = device.reset_peak()
        step(method)
        peak[method] = device.peak_above(base)
        seconds[method] = median_seconds(device, lambda m=method: step(m), reps)
    what = f"multitask, T=4: {label}"
    graph = "0.25" if kind == "independent" else "0.55"
    return [
        ("memory", what, f"allocator peak vs joint backward ({mib(peak['joint'])} MiB)",
         f"{peak['sequential'] / peak['joint']:.3f}", f"(reported; graph memory on CPU: {graph})"),
        ("memory", what, f"time vs joint backward (median of {reps})",
         f"{seconds['sequential'] / seconds['joint']:.3f}", "<= 1.05"),
    ]  # fmt: skip


class PiecedLM(LM):
    """The LM whose pieces over ``fake_limit`` sequences raise out-of-memory themselves (the CPU dry run)."""

    def __init__(self, model: nn.Module, k: int, fake_limit: int | None) -> None:
        super().__init__(model, k)
        self.fake_limit = fake_limit

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.mark(batch_idx)
        if self.fake_limit is not None and len(batch["input_ids"]) > self.fake_limit:
            raise torch.OutOfMemoryError("CUDA out of memory (dry run: a piece over the fake limit)")
        return lm_loss(self.model, batch)


@dataclass
class AutoRun:
    steps_per_s: float
    first_window_s: float
    settled: int


def bytes_per_sequence(device: Device, base: nn.Module, size: LMSize) -> float:
    model = copy.deepcopy(base)
    batch = token_batches(size, device, 1)[0]
    before = device.reset_peak()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = lm_loss(model, batch)
    loss.backward()
    per = device.peak_above(before) / size.microbatch
    del model, batch, loss
    device.clean()
    return per


def auto_rows(device: Device, size: LMSize, loader_batch: int, windows: int) -> list[Row]:
    base = causal_lm(size, device)
    big = LMSize(size.layers, size.width, size.heads, size.vocab, size.seq, loader_batch)
    fake_limit = None if device.cuda else loader_batch // 4
    cap = 0.0
    if device.cuda:  # the whole batch and its half do not fit; a quarter does, with room
        params = sum(p.numel() * p.element_size() for p in base.parameters())
        cap = device.allocated() + 4 * params + 0.35 * loader_batch * bytes_per_sequence(device, base, size) + 2**29
        device.clean()
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / device.total_memory()))

    def run(microbatch_size: int | str) -> AutoRun:
        plan = Plan(device, 1, 0, windows, 1)
        batches = token_batches(big, device, plan.batches)
        module = PiecedLM(copy.deepcopy(base), 1, fake_limit)
        callback = AccumulationScheduler(1, microbatch_size=microbatch_size)  # type: ignore[arg-type]
        probe = fit(device, module, batches, plan, [callback])
        if probe.steps != plan.windows:
            raise RuntimeError(f"{probe.steps} optimizer steps, {plan.windows} expected")
        settled = int(probe.metrics.get("accum/microbatch_size", -1))
        return AutoRun(1 / plan.seconds_per_step(), plan.first_window, settled)

    try:
        auto = run("auto")
        device.clean()
        hand: dict[int, AutoRun | str] = {}
        size_ = loader_batch // 2
        while size_ >= 1 and len(hand) < 4:
            try:
                hand[size_] = run(size_)
            except Exception as error:
                if "out of memory" not in str(error).lower():
                    raise
                hand[size_] = "out of memory"
            device.clean()
            size_ //= 2
    finally:
        if device.cuda:
            torch.cuda.set_per_process_memory_fraction(1.0)
        device.clean()
    fitted = {s: r for s, r in hand.items() if isinstance(r, AutoRun)}
    best = max(fitted, key=lambda s: fitted[s].steps_per_s)
    tokens = loader_batch * size.seq
    limit = f"memory capped at {cap / 2**30:.1f} GiB" if device.cuda else "pieces over a quarter refused (dry run)"
    what = f"microbatch_size='auto', loader batch {loader_batch} x {size.seq}, {limit}"
    backoffs = (loader_batch // auto.settled).bit_length() - 1 if auto.settled > 0 else -1
    steady = 1 / auto.steps_per_s
    tried = ", ".join(
        f"{s}: {r if isinstance(r, str) else f'{r.steps_per_s * tokens:.0f} tok/s'}" for s, r in hand.items()
    )
    first = f"{auto.first_window_s:.2f} vs {steady:.2f} s"
    return [
        ("memory", what, "size it settled on (back-offs: halvings from the loader batch)",
         f"{auto.settled} ({backoffs})", "(reported)"),
        ("memory", what, f"time the back-offs cost: first window vs a settled one ({first})",
         f"{auto.first_window_s / steady:.2f}", "(reported)"),
        ("memory", what, f"throughput vs the best hand-picked size, {best} ({tried})",
         f"{auto.steps_per_s / fitted[best].steps_per_s:.3f}", ">= 0.99"),
    ]  # fmt: skip
