"""A ``Budget`` at scale: step time against a fixed k closing the same windows, on N ranks whose micro-batches take
a random time (issue 52).

(a) Measured. N gloo ranks on the CPU (forked; N up to 16), each micro-batch a sleep of log-normal length (mean
``--mean-ms``, coefficient of variation ``--cv``, drawn per rank and micro-batch from a seed: the runs compared sleep
alike), so that ranks need no cores. Every batch holds ``BATCH`` samples, so ``Budget(K * BATCH * N, unit="samples")``
closes every window after exactly ``K`` micro-batches, as ``K`` does (checked). For each adapter
(``AccumulationScheduler``, ``AccumulationMixin``, ``FabricAccumulator``) the fits are: ``fixed`` (``K``), ``budget``
(the package's protocol by default: the callback reads ahead, the mixin and the Fabric helper overlap), ``ahead`` (the
mixin with ``configure_accumulation(read_ahead=True)``, the Fabric loop over ``acc.read_ahead(loader)``: the callback's
protocol; not a fit of the callback, whose ``budget`` it is) and ``barrier`` (the protocol before issue 52, forced: each
micro-batch's count summed over ranks in one blocking all-reduce as it opens); the step time is rank 0's wall time per
window after the first ``WARMUP`` windows, its ratio the budget's over the fixed k's (median over ``--rounds``, each
round running every fit once). Each fit also counts, on every rank, the collectives of the package the rank waits on
before the backward pass of the micro-batch they went out in, in micro-batches that do not open their window
(``waited``: the meetings of all ranks inside a window; the window's own collectives, at its end, are ``per_window``),
and the budget's count all-reduces it issues (``counts``) without waiting for them.

(b) Simulated. The same protocols for N up to 1024 ranks (``simulate``): each rank's micro-batches take log-normal
times; a window's end is where its slowest rank ends (the gradient's all-reduce); an all-reduce ends ``latency`` after
the last rank issued it. ``fixed``: no meeting inside a window. ``barrier``: every micro-batch starts after the previous
one's all-reduce. ``overlap`` (the mixin, the Fabric helper by default): each micro-batch's count goes out as it opens
and is read at its end. ``ahead`` (the callback; the mixin and the Fabric helper opted in): the counts of ``CHUNK``
micro-batches per all-reduce, each issued as the chunk before it is entered, read as its first micro-batch opens.
Calibrated on the runs: first, at each N measured, with that run's latency of one host all-reduce of a few integers
(measured inside the fits) and its time per micro-batch besides the sleep (the fixed k's step time over the slowest
rank's sleeps, over K), printed beside the measured ratios; then, to 1024 ranks, with the latency of ranks that do
nothing else (``--latency-ranks``: the fastest of 50 on each rank, the machine's other load taken out as far as it can
be; extended as ``a + b log2 N``) and no time besides the micro-batch's own work (the most a meeting can cost).

On a shared 2-core machine 16 forked ranks contend for the CPU: read the ratios as medians, never as assertions.
Run it under ``nice``:

    nice python benchmarks/scale.py --ranks 16 --cv 0.3 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader

from lightning_accum import AccumulationMixin, AccumulationScheduler, Budget
from lightning_accum._core import collectives
from lightning_accum._core.ahead import CHUNK
from lightning_accum._core.engine import WindowEngine
from lightning_accum._trainer import ahead

K, BATCH, WIDTH, WARMUP = 8, 4, 8, 2  # micro-batches per window, samples per micro-batch, features, windows unread
ADAPTERS = ("callback", "mixin", "fabric")
MODES = ("fixed", "budget", "ahead", "barrier")
WAITS: dict[str, int] = {}
NOW = {"microbatch": 0, "opens": 1, "backward": 0}  # the micro-batch under way


# ---------------------------------------------------------------------- the ranks' sleeps
def sleeps(rank: int, count: int, mean_s: float, cv: float, seed: int) -> list[float]:
    """Rank ``rank``'s micro-batch times: log-normal, mean ``mean_s``, coefficient of variation ``cv``."""
    sigma = math.sqrt(math.log(1 + cv * cv))
    rng = random.Random(f"{seed}/{rank}")
    return [mean_s * rng.lognormvariate(-sigma * sigma / 2, sigma) for _ in range(count)]


def ideal_step_s(world: int, windows: int, mean_s: float, cv: float, seed: int) -> float:
    """The windows' mean time if a rank did nothing but sleep and ranks met once per window: the slowest rank's
    sleeps, window by window (the windows read as the runs read them)."""
    times = [sleeps(r, windows * K, mean_s, cv, seed) for r in range(world)]
    per_window = [max(sum(t[w * K : (w + 1) * K]) for t in times) for w in range(windows)]
    return statistics.fmean(per_window[WARMUP:])


# ---------------------------------------------------------------------- what a rank waits on
def _ours() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if f"{os.sep}lightning_accum{os.sep}" in frame.f_code.co_filename:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _called_from(names: set[str]) -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in names:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


class _Work:
    def __init__(self, work: Any) -> None:
        self.work, self.microbatch = work, NOW["microbatch"]

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        if self.microbatch == NOW["microbatch"] and not NOW["backward"] and not NOW["opens"]:
            WAITS["waited"] += 1
        return self.work.wait(*args, **kwargs)


def watch() -> None:
    """In this rank: the package's all-reduces and autograd's backward passes noted (``WAITS``)."""
    WAITS.update(waited=0, per_window=0, counts=0, microbatches=0)
    all_reduce, backward = dist.all_reduce, torch.autograd.backward

    def noting(tensor: torch.Tensor, *args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        ours = _ours()
        if ours and _called_from({"ask", "_issue", "host_sum"}):
            WAITS["counts"] += 1
        if ours and not async_op:
            WAITS["waited" if not NOW["backward"] and not NOW["opens"] else "per_window"] += 1
        work = all_reduce(tensor, *args, async_op=async_op, **kwargs)
        return _Work(work) if ours and async_op else work

    def noting_backward(*args: Any, **kwargs: Any) -> Any:
        out = backward(*args, **kwargs)
        NOW["backward"] = 1
        return out

    dist.all_reduce, torch.autograd.backward = noting, noting_backward  # type: ignore[assignment]


def microbatch_starts(opens: bool) -> None:
    NOW.update(microbatch=NOW["microbatch"] + 1, opens=int(opens), backward=0)
    WAITS["microbatches"] += 1


class _Counted:
    def __init__(self, value: int) -> None:
        self.value = value

    def result(self) -> list[int]:
        return [self.value]


def as_before() -> None:
    """The protocol before issue 52, in this rank: each micro-batch's count summed over ranks in one blocking
    all-reduce as it opens (the callback reads nothing ahead; the mixin and the Fabric helper wait at once)."""
    ahead.BudgetAhead.start = lambda self, trainer: None  # type: ignore[method-assign]

    def ask(self: WindowEngine, samples: int, items: Any, strategy: Any) -> None:
        if self.budgeted:
            self._asked = _Counted(collectives.host_sum(strategy, self.budget_count(samples, items)))  # type: ignore[assignment]

    WindowEngine.ask = ask  # type: ignore[method-assign]


def host_latency_s(strategy: Any, repeats: int = 30, fastest: bool = False) -> float:
    """The median (``fastest``: the least) wall time of one blocking host all-reduce of ``2 * CHUNK`` integers, every
    rank arriving together (a barrier before each)."""
    took = []
    for _ in range(repeats):
        dist.barrier(group=collectives.host_group())
        start = time.perf_counter()
        collectives.HostSum(strategy, [1] * (2 * CHUNK)).result()
        took.append(time.perf_counter() - start)
    return min(took) if fastest else statistics.median(took)


# ---------------------------------------------------------------------- one fit on the ranks
def batches(count: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(BATCH, WIDTH, generator=g), "y": torch.randn(BATCH, 1, generator=g)}
            for _ in range(count)]  # fmt: skip


def schedule(mode: str, world: int) -> Any:
    return K if mode == "fixed" else Budget(K * BATCH * world, unit="samples")


class Sleeper(pl.LightningModule):
    """A micro-batch is a sleep (the rank's drawn time) and a tiny regression's forward and backward."""

    def __init__(self, times: Sequence[float]) -> None:
        super().__init__()
        self.net, self.times, self.done = nn.Linear(WIDTH, 1), list(times), 0

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        time.sleep(self.times[self.done])
        self.done += 1
        return nn.functional.mse_loss(self.net(batch["x"]), batch["y"])

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class ManualSleeper(AccumulationMixin, Sleeper):
    def __init__(self, times: Sequence[float], accumulation: Any, read_ahead: bool = False) -> None:
        super().__init__(times)
        self.configure_accumulation(accumulation, log=False, read_ahead=read_ahead)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:  # type: ignore[override]
        with self.accumulate(batch) as acc:
            acc.backward(self.loss(batch))


class Clock(pl.Callback):
    """Listed first: marks each micro-batch's start; rank 0's wall time at each window's end; the report."""

    def __init__(self, out: Path, options: dict[str, Any]) -> None:
        self.out, self.options, self.ends, self.latency = out, options, [], 0.0  # type: ignore[var-annotated]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.latency = host_latency_s(trainer.strategy)
        watch()
        self.steps = trainer.global_step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        accum = next((cb for cb in trainer.callbacks if isinstance(cb, AccumulationScheduler)), None)  # type: ignore[attr-defined]
        engines = [accum._engine] if accum is not None else pl_module._accumulation.windows.engines.values()
        microbatch_starts(opens=all(engine.window is None for engine in engines))

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step != self.steps:
            self.steps = trainer.global_step
            self.ends.append(time.perf_counter())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        report(self.out, trainer.global_rank, self.ends, self.latency)


def report(out: Path, rank: int, ends: list[float], latency: float) -> None:
    gaps = [b - a for a, b in zip(ends[WARMUP:-1], ends[WARMUP + 1 :], strict=True)]
    (out / f"rank{rank}.json").write_text(json.dumps({"step_s": statistics.fmean(gaps), "waits": WAITS,
                                                      "windows": len(ends), "latency_s": latency}))  # fmt: skip


def trainer_fit(adapter: str, mode: str, options: dict[str, Any], out: Path) -> None:
    world, windows = options["ranks"], options["windows"]
    times = [sleeps(r, windows * K, options["mean_s"], options["cv"], options["seed"]) for r in range(world)]

    class PerRank(pl.Callback):  # (each forked rank takes its own sleeps as it starts)
        def setup(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
            pl_module.times = times[trainer.global_rank]
            if mode == "barrier":
                as_before()

    callbacks: list[pl.Callback] = [Clock(out, options), PerRank()]
    if adapter == "callback":
        callbacks.append(AccumulationScheduler(schedule(mode, world), log=False))
        model: pl.LightningModule = Sleeper(times[0])
    else:
        model = ManualSleeper(times[0], schedule(mode, world), read_ahead=mode == "ahead")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=DDPStrategy(start_method="fork", process_group_backend="gloo"),
        max_epochs=1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(model, DataLoader(batches(windows * K), batch_size=None))


def fabric_ranks(fabric: Any, mode: str, options: dict[str, Any], out: Path) -> None:
    from lightning_accum import FabricAccumulator

    rank, world = fabric.global_rank, fabric.world_size
    if mode == "barrier":
        as_before()
    latency = host_latency_s(collectives_strategy(fabric))
    watch()
    module = Sleeper(sleeps(rank, options["windows"] * K, options["mean_s"], options["cv"], options["seed"]))
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=1e-3))
    acc = FabricAccumulator(fabric, model, optimizer, schedule(mode, world), log=False)
    ends = []
    data = batches(options["windows"] * K)
    for batch in acc.read_ahead(data) if mode == "ahead" else data:
        microbatch_starts(opens=acc._engine.window is None)
        with acc.accumulate(batch) as step:
            step.backward(module.loss(batch))
        if step.stepped:
            ends.append(time.perf_counter())
    report(out, rank, ends, latency)


def collectives_strategy(fabric: Any) -> Any:
    class Ranks:
        world_size = fabric.world_size

    return Ranks()


def latency_rank(fabric: Any, out: Path) -> None:
    latency = host_latency_s(collectives_strategy(fabric), 50, fastest=True)
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(latency))


def latency_on(world: int) -> float:
    """The host all-reduce's latency on ``world`` forked ranks that do nothing else (seconds: the ranks' median of
    each one's fastest of 50, the machine's other load taken out as far as it can be)."""
    from lightning.fabric import Fabric

    with tempfile.TemporaryDirectory() as name:
        Fabric(accelerator="cpu", devices=world, strategy="ddp_fork").launch(latency_rank, Path(name))
        return statistics.median(json.loads((Path(name) / f"rank{r}.json").read_text()) for r in range(world))


def fit(adapter: str, mode: str, options: dict[str, Any]) -> dict[str, Any]:
    """One fit on the ranks: rank 0's step time, every rank's waits, the host all-reduce's latency."""
    with tempfile.TemporaryDirectory() as name:
        out = Path(name)
        if adapter == "fabric":
            from lightning.fabric import Fabric

            Fabric(accelerator="cpu", devices=options["ranks"], strategy="ddp_fork").launch(
                fabric_ranks, mode, options, out
            )
        else:
            trainer_fit(adapter, mode, options, out)
        reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(options["ranks"])]
    assert len({r["windows"] for r in reports}) == 1 and reports[0]["windows"] == options["windows"], reports
    return {
        "step_s": reports[0]["step_s"],
        "latency_s": statistics.median(r["latency_s"] for r in reports),
        "waited_per_microbatch": max(r["waits"]["waited"] / r["waits"]["microbatches"] for r in reports),
        "per_window": max(r["waits"]["per_window"] for r in reports) / options["windows"],
        "counts_per_microbatch": max(r["waits"]["counts"] for r in reports) / (options["windows"] * K),
    }


def measure(options: dict[str, Any]) -> dict[str, Any]:
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {
        a: {m: [] for m in options["modes"]} for a in options["adapters"]
    }
    for _ in range(options["rounds"]):
        for adapter in options["adapters"]:
            for mode in options["modes"]:
                if adapter == "callback" and mode == "ahead":  # (the callback's `budget` reads ahead)
                    continue
                rows[adapter][mode].append(fit(adapter, mode, options))
                print(f"# {adapter} {mode}: {rows[adapter][mode][-1]}", file=sys.stderr, flush=True)
    ideal = ideal_step_s(options["ranks"], options["windows"], options["mean_s"], options["cv"], options["seed"])
    out: dict[str, Any] = {"ideal_step_ms": ideal * 1e3, "adapters": {}}
    for adapter, modes in rows.items():
        fixed = [r["step_s"] for r in modes["fixed"]]
        row: dict[str, Any] = {"fixed_step_ms": statistics.median(fixed) * 1e3}
        for mode in (m for m in modes if m != "fixed" and modes[m]):
            ratios = [r["step_s"] / f for r, f in zip(modes[mode], fixed, strict=True)]
            row[mode] = {
                "ratio_median": statistics.median(ratios),
                "ratios": ratios,
                "waited_per_microbatch": max(r["waited_per_microbatch"] for r in modes[mode]),
                "per_window": max(r["per_window"] for r in modes[mode]),
                "counts_per_microbatch": max(r["counts_per_microbatch"] for r in modes[mode]),
            }
        row["fixed"] = {k: max(r[k] for r in modes["fixed"]) for k in ("waited_per_microbatch", "per_window")}
        out["adapters"][adapter] = row
    everything = [r for modes in rows.values() for runs in modes.values() for r in runs]
    out["latency_ms"] = statistics.median(r["latency_s"] for r in everything) * 1e3
    # each micro-batch's time besides its sleep (the loop's work, the window's end and step spread over its K)
    out["microbatch_overhead_ms"] = statistics.median(
        (statistics.median(r["step_s"] for r in modes["fixed"]) * 1e3 - out["ideal_step_ms"]) / K
        for modes in rows.values()
    )
    return out


# ---------------------------------------------------------------------- (b) the protocols simulated
def simulate(
    world: int, cv: float, protocol: str, *, k: int = K, latency: float = 0.0, overhead: float = 0.0,
    windows: int = 60, chunk: int = CHUNK, seed: int = 0,
) -> float:  # fmt: skip
    """Mean step time (micro-batch mean = 1) of ``protocol`` on ``world`` ranks: ``"fixed"``, ``"barrier"``,
    ``"overlap"`` or ``"ahead"``; ``latency``: an all-reduce's, after its last rank issued it; ``overhead``: each
    micro-batch's time besides its own work (the loop's, alike on every rank)."""
    g = torch.Generator().manual_seed(seed)
    sigma = math.sqrt(math.log(1 + cv * cv))
    clock = torch.zeros(world, dtype=torch.float64)
    ready: dict[int, float] = {}  # ("ahead") a chunk's first position: when its all-reduce ends
    for w in range(windows):
        times = torch.exp(torch.randn(k, world, generator=g, dtype=torch.float64) * sigma - sigma * sigma / 2)
        times += overhead
        start = torch.full_like(clock, float(clock.max()))
        for i in range(k):
            p = w * k + i
            if protocol == "barrier":
                start = torch.full_like(start, float(start.max()) + latency)
            elif protocol == "ahead":
                if p == 0:  # (the epoch's first chunk, and the next, go out at its first micro-batch)
                    ready[0] = float(start.max()) + latency
                    ready[chunk] = ready[0]
                elif p % chunk == 0:  # (the chunk is entered: the one after it goes out)
                    ready[p + chunk] = float(start.max()) + latency
                start = torch.clamp(start, min=ready[p - p % chunk])
            end = start + times[i]
            if protocol == "overlap":
                end = torch.clamp(end, min=float(start.max()) + latency)
            start = end
        clock = start
    return float(clock.max()) / windows


def fit_latency(measured: dict[int, float]) -> Callable[[int], float]:
    """``latency(N) = a + b log2 N`` through the ranks measured (one: constant)."""
    points = sorted(measured.items())
    if len(points) == 1:
        return lambda n: points[0][1]
    xs, ys = [math.log2(n) for n, _ in points], [v for _, v in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs))
    a = my - b * mx
    return lambda n: max(0.0, a + b * math.log2(n))


def simulated(latency_ms: Callable[[int], float], overhead_ms: float, mean_ms: float, worlds: Sequence[int],
              cvs: Sequence[float], windows: int) -> list[dict[str, Any]]:  # fmt: skip
    rows = []
    for world in worlds:
        for cv in cvs:
            options = {"latency": latency_ms(world) / mean_ms, "overhead": overhead_ms / mean_ms, "windows": windows}
            fixed = simulate(world, cv, "fixed", **options)  # type: ignore[arg-type]
            row = {"ranks": world, "cv": cv, "latency_ms": latency_ms(world)}
            for protocol in ("ahead", "overlap", "barrier"):
                row[protocol] = simulate(world, cv, protocol, **options) / fixed  # type: ignore[arg-type]
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[16], help="rank counts measured (up to 16)")
    parser.add_argument("--cv", type=float, default=0.3, help="the micro-batch time's coefficient of variation")
    parser.add_argument("--mean-ms", type=float, default=50.0, help="the micro-batch time's mean")
    parser.add_argument("--windows", type=int, default=14, help="windows per fit (the first 2 not read)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs every fit once")
    parser.add_argument("--adapters", nargs="+", default=list(ADAPTERS), choices=ADAPTERS)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sim-windows", type=int, default=200, help="windows per simulated run (1024 ranks: a fifth)")
    parser.add_argument("--latency-ranks", type=int, nargs="*", default=[2, 4, 8, 16],
                        help="rank counts whose host all-reduce latency (ranks doing nothing else) calibrates the "
                             "simulation's, extended as a + b log2 N")  # fmt: skip
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    assert "fixed" in args.modes, "the ratios are against the fixed k"
    results: dict[str, Any] = {"k": K, "cv": args.cv, "mean_ms": args.mean_ms, "measured": {}}
    for world in args.ranks:
        options = {"ranks": world, "cv": args.cv, "mean_s": args.mean_ms / 1e3, "windows": args.windows,
                   "rounds": args.rounds, "adapters": args.adapters, "modes": args.modes,
                   "seed": args.seed}  # fmt: skip
        results["measured"][world] = measured = measure(options)
        print(f"{world} ranks, cv {args.cv}, k={K}, mean {args.mean_ms} ms: fixed k's step "
              f"{measured['adapters'][args.adapters[0]]['fixed_step_ms']:.1f} ms (its sleeps alone: "
              f"{measured['ideal_step_ms']:.1f} ms), host all-reduce {measured['latency_ms']:.2f} ms")  # fmt: skip
        for adapter, row in measured["adapters"].items():
            for mode in (m for m in args.modes if m != "fixed" and m in row):
                r = row[mode]
                label = {"budget": "overlap", "ahead": "read_ahead"}.get(mode, mode)
                label = "ahead" if adapter == "callback" and mode == "budget" else label
                print(f"  {adapter:8s} {label:10s}: step vs fixed k {r['ratio_median']:.3f} (rounds "
                      f"{', '.join(f'{x:.3f}' for x in r['ratios'])}); collectives waited on per micro-batch "
                      f"{r['waited_per_microbatch']:.3f}, per window {r['per_window']:.2f}; count all-reduces per "
                      f"micro-batch {r['counts_per_microbatch']:.3f}")  # fmt: skip
    alone = {w: latency_on(w) * 1e3 for w in args.latency_ranks}
    results["latency_ms_alone"] = alone
    listed = ", ".join(f"{w}: {v:.2f} ms" for w, v in alone.items())
    print(f"host all-reduce latency, ranks doing nothing else (fastest of 50): {listed}")
    cvs = sorted({0.05, 0.1, 0.3, args.cv})
    # the model against the runs: each run's own latency (inside the fits) and per-micro-batch overhead
    checks = []
    for world, m in results["measured"].items():
        row = simulated(lambda n, m=m: m["latency_ms"], m["microbatch_overhead_ms"], args.mean_ms, [world], [args.cv],
                        args.sim_windows)[0]  # fmt: skip
        checks.append(row)
        measured = {a: {p: round(r[p]["ratio_median"], 3) for p in r if p in ("budget", "ahead", "barrier")}
                    for a, r in m["adapters"].items()}  # fmt: skip
        print(f"simulated as measured ({world} ranks, latency {m['latency_ms']:.2f} ms, each micro-batch's overhead "
              f"{m['microbatch_overhead_ms']:.2f} ms): ahead {row['ahead']:.3f}, overlap {row['overlap']:.3f}, barrier "
              f"{row['barrier']:.3f}; measured {measured}")  # fmt: skip
    # extended: the latency fitted through the ranks alone, and no overhead (each micro-batch's time all its own
    # work, the most a protocol's meetings can cost)
    latency = fit_latency(alone or {w: m["latency_ms"] for w, m in results["measured"].items()})
    worlds = sorted({*args.ranks, 8, 16, 64, 1024})
    rows = []
    for world in worlds:
        windows = args.sim_windows if world < 1024 else max(20, args.sim_windows // 5)
        rows += simulated(latency, 0.0, args.mean_ms, [world], cvs, windows)
    results["simulated"] = {"as_measured": checks, "rows": rows}
    print(f"simulated (k={K}, micro-batches of mean {args.mean_ms} ms; an all-reduce's latency "
          f"{', '.join(f'{w}: {latency(w):.2f} ms' for w in worlds)}): budget's step time / fixed k's")  # fmt: skip
    print("  ranks  cv    ahead (callback; mixin, Fabric with read_ahead)  overlap (mixin, Fabric without)  barrier "
          "(before)")  # fmt: skip
    for row in rows:
        print(f"  {row['ranks']:5d}  {row['cv']:.2f}  {row['ahead']:.3f}{' ' * 45}{row['overlap']:.3f}{' ' * 28}"
              f"{row['barrier']:.3f}")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
