"""What ``grad_accum_dtype=torch.float32`` costs under ``precision="bf16-true"`` (issue 51): time per window and
memory, against ``grad_accum_dtype=None`` in the same process.

A small GPT-2 (``transformers.GPT2Config``: 4 layers of width 256, 4 heads, the GPT-2 vocabulary of 50257 whose
embedding is tied to the output layer; random tokens, nothing downloaded): 16.1M parameters, all bf16 under
``bf16-true``, micro-batches of 4 sequences of 128 tokens, k = 8, AdamW, one CPU thread.

**Time.** ``AccumulationScheduler(8)`` and ``AccumulationScheduler(8, grad_accum_dtype=torch.float32)`` (with
``--builtin``, ``Trainer(accumulate_grad_batches=8)`` too, for reference) train the same weights on the same
batches, one fit each per round, alternating, the order reversed every other round, one warm-up round first.
Each fit has ``--windows`` windows after a first, untimed one; a window's CPU time runs from one optimizer step's
``on_before_optimizer_step`` to the next's (its step, its k micro-batches, its close). Per fit, the median
window; per round, the option's over ``None``'s; the headline is the median of those ratios over the rounds,
with the ratio of the best windows beside it. What the option itself does (``WideSums._take``, the
per-parameter hook that moves each micro-batch's bf16 ``.grad`` into the float32 sum, and ``WideSums.land``,
the normalisation and the one rounding at the close) is also timed in place in one more fit, per window: the
ratio that work alone would make on ``None``'s window is an upper bound of the option's cost (``None``'s own
bf16 ``.grad += g`` is not taken off), and is steady on a loaded machine where the loop's ratio is not. So the
adds are also timed alone, on the model's parameter shapes, the option's (``WideSums._take``) against ``None``'s
(bf16 ``.grad += g``), interleaved: k times the difference plus ``land`` estimates the option's net work a
window (``net ratio``).

**Memory.** One more fit each, under ``torch.profiler`` with ``profile_memory=True``: torch's CPU allocator
reports every allocation and free to it with its running total of the bytes alive among those allocated while
profiling (a block allocated before is in no total; what an earlier session left counted is taken off). The
module is built in float32 before the fit; ``bf16-true`` converts it inside, so the bf16 parameters, the
gradients, the float32 sums, AdamW's state and every activation are counted (memory a library allocates
outside torch's allocator is not: the same in both runs). Reported: the peak over the fit (the CPU analogue of
``torch.cuda.max_memory_allocated``) and the bytes alive as each micro-batch starts inside a window (not its
first: the window's state between micro-batches), and their differences per bf16 parameter: expected
+2 bytes between micro-batches (4 of float32 sum in place of 2 of bf16 ``.grad``) and up to +4 at the step
(the sums and the rounded ``.grad`` side by side).

Shared 2-core machines add +-15 % to single runs (CPU time measures this process only, but memory bandwidth
and caches are shared): read the in-place figure first.

    python benchmarks/precision_cost.py [--rounds 5] [--windows 3] [--k 8] [--builtin] [--layers 4] [--width 256]

(about 5 minutes of CPU time; several times that in wall time on a loaded machine). ``--whole-adds`` adds each CPU
gradient into its sum whole, as before ``wide._add``'s pieces, to compare.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import copy
import gc
import json
import logging
import platform
import statistics
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_accum import AccumulationScheduler
from lightning_accum._core import wide

NONE = "AccumulationScheduler(k)"
WIDE = "AccumulationScheduler(k, grad_accum_dtype=torch.float32)"
BUILTIN = "Trainer(accumulate_grad_batches=k)"


@dataclass
class Size:
    layers: int = 4
    width: int = 256
    heads: int = 4
    vocab: int = 50257
    seq: int = 128
    microbatch: int = 4

    def describe(self) -> str:
        return (
            f"GPT-2 {self.layers} x {self.width}, {self.heads} heads, vocab {self.vocab}, micro-batches of "
            f"{self.microbatch} x {self.seq} tokens"
        )


def gpt(size: Size) -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        vocab_size=size.vocab, n_positions=size.seq, n_embd=size.width, n_layer=size.layers, n_head=size.heads,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


class LM(pl.LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self.model(input_ids=batch, labels=batch).loss  # type: ignore[no-any-return]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class Windows(pl.Callback):
    """CPU seconds of each window, from one ``on_before_optimizer_step`` to the next (it comes last among the
    callbacks); and the optimizer steps taken."""

    def on_train_start(self, *args: Any) -> None:
        self.mark, self.windows = time.process_time(), []

    def on_before_optimizer_step(self, *args: Any) -> None:
        now = time.process_time()
        self.windows.append(now - self.mark)
        self.mark = now

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.steps = trainer.global_step


class Marks(pl.Callback):
    """A profiler mark as each micro-batch starts (``record_function``: an event with its time)."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        with torch.profiler.record_function(f"micro-batch {batch_idx}"):
            pass


def callbacks_for(name: str, k: int) -> tuple[list[pl.Callback], int]:
    """The run's callbacks and the Trainer's ``accumulate_grad_batches``."""
    if name == BUILTIN:
        return [], k
    return [AccumulationScheduler(k, grad_accum_dtype=torch.float32 if name == WIDE else None)], 1


def fit(base: nn.Module, batches: list[Tensor], name: str, k: int, extra: Sequence[pl.Callback] = ()) -> Windows:
    """One fit of a copy of ``base`` (float32; ``bf16-true`` converts it) over ``batches``."""
    callbacks, accumulate = callbacks_for(name, k)
    windows = Windows()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, precision="bf16-true", max_epochs=1, accumulate_grad_batches=accumulate,
        callbacks=[*callbacks, *extra, windows], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    torch.manual_seed(0)
    trainer.fit(LM(copy.deepcopy(base)), DataLoader(batches, batch_size=None))
    if windows.steps != len(batches) // k:
        raise RuntimeError(f"{name}: {windows.steps} optimizer steps, {len(batches) // k} expected")
    return windows


@contextlib.contextmanager
def timed_wide_sums() -> Iterator[dict[str, float]]:
    """Adds up the CPU seconds inside ``WideSums._take`` (per parameter, per micro-batch) and ``WideSums.land``
    (per window) while entered."""
    inside = {"take": 0.0, "land": 0.0, "calls": 0.0}
    take, land = wide.WideSums._take, wide.WideSums.land

    def timed_take(self: wide.WideSums, i: int, p: Tensor) -> None:
        start = time.process_time()
        take(self, i, p)
        inside["take"] += time.process_time() - start
        inside["calls"] += 1

    def timed_land(self: wide.WideSums, *args: Any, **kwargs: Any) -> list[Tensor]:
        start = time.process_time()
        try:
            return land(self, *args, **kwargs)
        finally:
            inside["land"] += time.process_time() - start

    wide.WideSums._take, wide.WideSums.land = timed_take, timed_land  # type: ignore[method-assign]
    try:
        yield inside
    finally:
        wide.WideSums._take, wide.WideSums.land = take, land  # type: ignore[method-assign]


def clock_floor(calls: int) -> float:
    """CPU seconds that ``calls`` pairs of ``time.process_time()`` reads and a call through a wrapper take by
    themselves (what the in-place timing adds; taken off)."""

    def nothing(i: int) -> None: ...

    start = time.process_time()
    for i in range(calls):
        a = time.process_time()
        nothing(i)
        _ = time.process_time() - a
    return time.process_time() - start


def take_against_add(model: nn.Module, reps: int) -> tuple[float, float]:
    """CPU seconds of one micro-batch's adds, on ``model``'s parameter shapes, alone (interleaved, the medians of
    ``reps``): the option's (``WideSums._take`` of a fresh bf16 gradient per parameter, into a sum that holds one
    already) and what ``None`` does instead (autograd's bf16 ``.grad += g``). Each fresh gradient is a copy, as
    autograd's is new memory, in both."""
    g = torch.Generator().manual_seed(0)
    shapes = [p.shape for p in model.parameters() if p.requires_grad]
    params = [nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16)) for shape in shapes]
    grads = [torch.randn(shape, generator=g).bfloat16() for shape in shapes]
    held = [torch.zeros_like(grad) for grad in grads]
    sums = wide.WideSums(torch.float32)
    sums.attach(params)

    def option() -> None:
        for i, (p, grad) in enumerate(zip(params, grads, strict=True)):
            p.grad = grad.clone()
            sums._take(i, p)

    def none() -> None:
        for total, grad in zip(held, grads, strict=True):
            total.add_(grad.clone())

    seconds: dict[str, list[float]] = {"option": [], "none": []}
    option()  # (the sums' first gradient: copied; the timed calls add)
    for _ in range(reps):
        for name, run in (("option", option), ("none", none)):
            start = time.process_time()
            run()
            seconds[name].append(time.process_time() - start)
    sums.detach()
    return statistics.median(seconds["option"]), statistics.median(seconds["none"])


def memory_fit(base: nn.Module, batches: list[Tensor], name: str, k: int) -> dict[str, float]:
    """The CPU allocator's bytes alive (among those allocated during the fit): the peak over the fit, and the
    median as a micro-batch starts inside a window (not its first) after the first window."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    gc.collect()  # (the last fit's trainer and module, held in cycles, freed before)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.ones(1)  # (the first allocation: the allocator's total before it is what earlier sessions left counted)
        fit(base, batches, name, k, [Marks()])
    nodes, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children)
    allocations = sorted(
        (n.start_time_ns, n.extra_fields.total_allocated)
        for n in nodes
        if n.tag == _EventType.Allocation and n.extra_fields.device.type == "cpu"
    )
    first = min(
        (n for n in nodes if n.tag == _EventType.Allocation and n.extra_fields.device.type == "cpu"),
        key=lambda n: n.start_time_ns,
    )
    left = first.extra_fields.total_allocated - first.extra_fields.alloc_size
    allocations = [(t, total - left) for t, total in allocations]
    times = [t for t, _ in allocations]
    between = []
    for n in nodes:
        if n.name.startswith("micro-batch "):
            index = int(n.name.split()[-1])
            if index >= k and index % k:  # (after the first window; not a window's first micro-batch)
                before = bisect.bisect_left(times, n.start_time_ns) - 1
                between.append(allocations[before][1] if before >= 0 else 0)
    if not allocations or not between:
        raise RuntimeError("the profiler reported no CPU allocation or no micro-batch mark")
    return {"peak": float(max(total for _, total in allocations)), "between": float(statistics.median(between))}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds, after the warm-up round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--windows", type=int, default=3, help="timed windows a fit (after an untimed first)")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--microbatch", type=int, default=4)
    parser.add_argument("--builtin", action="store_true", help="the built-in's fits too (for reference)")
    parser.add_argument("--no-memory", action="store_true", help="leave out the profiled memory fits")
    parser.add_argument("--reps", type=int, default=15, help="repetitions of the adds timed alone")
    parser.add_argument(
        "--whole-adds", action="store_true", help="no pieces: each CPU gradient added whole (as before, to compare)"
    )
    parser.add_argument("--json", type=Path, default=Path(__file__).with_name("precision_cost.json"))
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.windows < 1:
        parser.error("--rounds and --windows must be >= 1")
    for logger in ("lightning.pytorch", "lightning.fabric", "lightning_accum"):
        logging.getLogger(logger).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*(LeafSpec|does not have many workers|GPU available).*")
    torch.set_num_threads(1)
    if args.whole_adds:
        wide._CPU_PIECE = 2**62

    size = Size(args.layers, args.width, max(1, args.width // 64), args.vocab, args.seq, args.microbatch)
    base = gpt(size)
    params = sum(p.numel() for p in base.parameters() if p.requires_grad)
    k = args.k
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, size.vocab, (size.microbatch, size.seq), generator=g) for _ in range(k)]
    batches = batches * (args.windows + 1)  # (the same k micro-batches every window)
    names = [NONE, WIDE] + ([BUILTIN] if args.builtin else [])
    started = time.perf_counter()

    window_s: dict[str, list[float]] = {name: [] for name in names}  # per fit: its median window
    best_s: dict[str, float] = {name: float("inf") for name in names}
    for round_ in range(args.warmup + args.rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            windows = fit(base, batches, name, k).windows[1:]
            if round_ >= args.warmup:
                window_s[name].append(statistics.median(windows))
                best_s[name] = min(best_s[name], *windows)
        print(f"round {round_}: " + ", ".join(f"{n} {w[-1] * 1e3:.0f} ms" for n, w in window_s.items() if w),
              flush=True)  # fmt: skip
    pairs = [a / b for a, b in zip(window_s[WIDE], window_s[NONE], strict=True)]
    ratio, ratio_best = statistics.median(pairs), best_s[WIDE] / best_s[NONE]
    baseline_ms = statistics.median(window_s[NONE]) * 1e3

    with timed_wide_sums() as inside:
        fit(base, batches, WIDE, k)
    floor = clock_floor(int(inside["calls"]))
    fits_windows = args.windows + 1
    in_place_ms = (inside["take"] + inside["land"] - floor) / fits_windows * 1e3
    take_ms, land_ms = (inside["take"] - floor) / fits_windows * 1e3, inside["land"] / fits_windows * 1e3
    implied = 1 + in_place_ms / baseline_ms
    take_alone, add_alone = take_against_add(base, args.reps)
    net_ms = (k * (take_alone - add_alone)) * 1e3 + land_ms

    result: dict[str, Any] = {
        "benchmark": "precision_cost",
        "what": f"{size.describe()}, {params / 1e6:.1f}M bf16 parameters, bf16-true, k={k}, AdamW, one CPU thread",
        "params": params,
        "k": k,
        "rounds": args.rounds,
        "ms_per_window": {name: statistics.median(w) * 1e3 for name, w in window_s.items()},
        "ratio_median_pair": ratio,
        "ratio_best_window": ratio_best,
        "pairs": pairs,
        "in_place_ms_per_window": in_place_ms,
        "take_ms_per_window": take_ms,
        "land_ms_per_window": land_ms,
        "ratio_implied": implied,
        "take_alone_ms_per_microbatch": take_alone * 1e3,
        "bf16_add_alone_ms_per_microbatch": add_alone * 1e3,
        "net_ms_per_window": net_ms,
        "ratio_net": 1 + net_ms / baseline_ms,
        "target": 1.03,
        "whole_adds": args.whole_adds,
        "machine": f"{platform.machine()} torch {torch.__version__} lightning {pl.__version__}",
    }
    if BUILTIN in window_s:
        result["builtin_ratio_median_pair"] = statistics.median(
            a / b for a, b in zip(window_s[BUILTIN], window_s[NONE], strict=True)
        )
    print(f"\n{result['what']}; {args.rounds} rounds of {args.windows} windows")
    print(f"{'run':<60}{'ms/window (median)':>20}{'vs None (median pair)':>23}")
    for name in names:
        versus = {NONE: "1", WIDE: f"{ratio:.4f}", BUILTIN: f"{result.get('builtin_ratio_median_pair', 0):.4f}"}
        print(f"{name:<60}{result['ms_per_window'][name]:>20.1f}{versus[name]:>23}")
    print(f"option vs None: median pair {ratio:.4f}, best windows {ratio_best:.4f} (target <= 1.03)")
    print(
        f"in place: WideSums._take {take_ms:.1f} ms + land {land_ms:.1f} ms a window = {in_place_ms:.1f} ms of a "
        f"{baseline_ms:.0f} ms window: implied ratio <= {implied:.4f}"
    )
    print(
        f"alone, one micro-batch's adds on these shapes: the option's {take_alone * 1e3:.1f} ms, None's bf16 "
        f".grad += g {add_alone * 1e3:.1f} ms; k x the difference + land = {net_ms:+.1f} ms a window: "
        f"net ratio {result['ratio_net']:.4f}"
    )
    if not args.no_memory:
        memory = {name: memory_fit(base, batches, name, k) for name in (NONE, WIDE)}
        result["memory"] = memory
        for key, what in (("between", "alive as a micro-batch starts inside a window"), ("peak", "peak over the fit")):
            none, option = memory[NONE][key], memory[WIDE][key]
            result[f"{key}_bytes_per_param_added"] = added = (option - none) / params
            print(
                f"memory, {what}: {none / 2**20:.1f} MiB with None, {option / 2**20:.1f} MiB with the option "
                f"({added:+.2f} bytes per bf16 parameter)"
            )
    result["seconds"] = time.perf_counter() - started
    args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
