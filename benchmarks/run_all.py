"""Run every benchmark and write ``benchmarks/RESULTS.md``: what was measured, ratio, target, machine.

python benchmarks/run_all.py            # all of them (about 30 minutes on 2 CPU cores)
python benchmarks/run_all.py --quick    # tiny budgets: checks that every benchmark runs
python benchmarks/run_all.py --only overhead.py realistic.py  # these again; the others' last JSON as it is
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
QUICK = {
    "overhead.py": ["--repeats", "1", "--batches", "40"],
    "multitask_memory.py": ["--repeats", "1", "--scale", "16", "--tasks", "2"],
    "decay.py": ["--rounds", "1", "--steps", "2"],
    "noise_scale.py": ["--rounds", "0", "--batches", "24"],
    "comm_calls.py": [],
    "rank_check.py": ["--calls", "200"],
    "noise_study.py": ["--seeds", "1", "--png", ""],
    "cached_memory.py": ["--batch", "64", "--rounds", "1", "--dropouts", "0.1"],
    "microbatches.py": ["--repeats", "1", "--batches", "8"],
    "cached_sentence_transformers.py": ["--batches", "64", "--ranks-batch", "64", "--rounds", "1"],
    "realistic.py": ["--rounds", "1", "--warmup", "0", "--batches", "8", "--mlp-batches", "8", "--seq", "16"],
    "window_host_work.py": ["--reps", "20", "--rounds", "2"],
    "progress_bar.py": ["--reps", "20", "--rounds", "1", "--epochs", "1"],
    "batchnorm.py": ["--windows", "1", "--rounds", "1", "--batch", "4"],
    "budget.py": ["--batches", "16", "--rounds", "1", "--rank-batches", "8", "--rank-rounds", "1"],
    "scale.py": ["--ranks", "2", "--windows", "4", "--rounds", "1", "--mean-ms", "2", "--modes", "fixed", "budget",
                 "ahead", "--sim-windows", "10", "--latency-ranks", "2"],
    "precision.py": ["--ks", "1", "4", "--windows", "1"],
    "precision_cost.py": ["--rounds", "1", "--warmup", "0", "--windows", "1", "--k", "2", "--layers", "1", "--width",
                          "64", "--vocab", "1024", "--seq", "32", "--microbatch", "2"],
}


def script_env(environ: Mapping[str, str]) -> dict[str, str]:
    """A script's environment: this process's without ``MASTER_PORT``. A fork-launched DDP run leaves its port in
    the launching process's environment (Lightning's ``_MultiProcessingLauncher``), so scripts started after one (a
    test suite's in-process DDP tests, say) would all inherit the same port, and two run at once (``--jobs 2``) would
    each start their ranks' store on it: each script finds a free port of its own instead."""
    return {name: value for name, value in environ.items() if name != "MASTER_PORT"}


def run(script: str, extra: list[str], out: Path) -> dict:  # type: ignore[type-arg]
    path = out / script.replace(".py", ".json")
    done = subprocess.run([sys.executable, str(HERE / script), "--json", str(path), *extra], capture_output=True,
                          text=True, env=script_env(os.environ))  # fmt: skip
    if done.returncode != 0:  # (the script's own error, not only its exit status)
        raise RuntimeError(f"{script} {' '.join(extra)} exited with {done.returncode}:\n{done.stderr[-4000:]}")
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def realistic_rows(results: dict[str, dict]) -> list[tuple[str, str, str, str]]:  # type: ignore[type-arg]
    """The rows of ``realistic.py`` (each adapter against its own baseline) and ``window_host_work.py``."""
    table = []
    for row in results["realistic.py"]["rows"]:
        what = f"realistic: {row['run']}"
        measured = f"CPU time vs {row['baseline']} (best; {row['baseline_ms_per_window']:.1f} ms/window)"
        table.append((what, measured, f"{row['ratio_best']:.3f}", "<= 1.01"))
    host = results["window_host_work.py"]
    for row in host["rows"]:
        what = f"window host work, readers: {row['readers']}: {row['part']}"
        if row["part"] == "window_end":  # (issue 34: log=True, no monitor; a hook reads the norm every window)
            target = "(reported: the norm every window)" if row["readers"] == "window hook" else "<= 20"
        elif row["part"] == "microbatch_hooks":
            what += " (per micro-batch, hot)"
            target = "(reported)"
        elif row["part"] == "grad_norm":
            target = "(part of close)"
        else:
            target = "(part of window_end)"
        counts = f"{row['host_reads']} host read(s), {row['tensor_ops']} tensor ops, {row['builds']} builds"
        table.append((what, f"us, in place (best); {counts}", f"{row['us']:.1f}", target))
    for label in dict.fromkeys(row["readers"] for row in host["rows"]):
        table.append((f"window host work, readers: {label}: the rest of window_end", "us, in place (best)",
                      f"{host[f'other_us_{label}']:.1f}", "(part of window_end)"))  # fmt: skip
    return table


def overhead_rows(results: dict[str, dict]) -> list[tuple[str, str, str, str]]:  # type: ignore[type-arg]
    """The rows of ``overhead.py`` (the callback against the built-in on a tiny MLP, its hooks in place)."""
    table = []
    for row in results["overhead.py"]["rows"]:
        target = "(floor)" if "empty" in row["run"] else f"<= {results['overhead.py']['target']}"
        table.append((f"overhead: {row['run']}", "CPU time vs built-in (best)", f"{row['ratio_best']:.3f}", target))
    overhead = results["overhead.py"]
    for key, name in (("log_False", "log=False"), ("log_True", "log=True"), ("log_True_monitor", "log=True, monitor")):
        us = overhead[f"callback_hooks_us_per_batch_{key}"]
        table.append((f"overhead: AccumulationScheduler's own hooks, {name}", "us per micro-batch, in place",
                      f"{us:.1f}", "<= 12"))  # fmt: skip
    table.append(("overhead: Lightning's logging work added by log=True, monitor", "us per micro-batch, in place",
                  f"{overhead['logging_us_per_batch_added']:+.1f}", "<= 10"))  # fmt: skip
    return table


def budget_rows(results: dict[str, dict]) -> list[tuple[str, str, str, str]]:  # type: ignore[type-arg]
    """The rows of ``budget.py``: a ``Budget`` against a fixed k closing the same windows."""
    one, ranks = results["budget.py"]["one_process"], results["budget.py"]["two_ranks"]
    what = f"budget: Budget(n, unit='items') vs k={one['k']} closing the same windows"
    return [
        (f"{what}, 1 process", f"CPU time per window vs fixed k (median of rounds; {one['ms_per_window_fixed']:.1f} "
         "ms/window)", f"{one['ratio_median']:.3f}", "(reported; noisy)"),
        (f"{what}, 1 process", "CPU time per window vs fixed k (best)", f"{one['ratio_best']:.3f}", "(reported)"),
        (f"{what}, 1 process", "us per micro-batch in `closes_after`, in place",
         f"{one['closes_after_us_per_microbatch']:.1f}", "(reported)"),
        (f"{what}, 2 gloo ranks", "collectives added per micro-batch (rank 0; none waited for as it goes out)",
         f"{ranks['added_per_microbatch']:.3f}", "<= 0.5"),
        (f"{what}, 2 gloo ranks", "gradient all-reduces / step", f"{ranks['gradient_per_step_budget']:g}", "1"),
        (f"{what}, 2 gloo ranks", "us waited per count all-reduce read (rank 0, wall, in place)",
         f"{ranks['host_sum_us']:.0f}", "(reported)"),
        (f"{what}, 2 gloo ranks", f"rank 0's CPU time per window vs fixed k (median of rounds; "
         f"{ranks['ms_per_window_fixed']:.1f} ms/window)", f"{ranks['cpu_ratio_median']:.3f}", "(reported; noisy)"),
    ]  # fmt: skip


def scale_rows(results: dict[str, dict]) -> list[tuple[str, str, str, str]]:  # type: ignore[type-arg]
    """The rows of ``scale.py``: a ``Budget`` against a fixed k on N ranks of random micro-batch times (issue 52)."""
    scale, table = results["scale.py"], []
    for world, measured in scale["measured"].items():
        what = f"scale: Budget vs k={scale['k']}, {world} gloo ranks, cv {scale['cv']}, {scale['mean_ms']} ms"
        for adapter, row in measured["adapters"].items():
            for mode in ("budget", "ahead"):
                if mode not in row:
                    continue
                budget = row[mode]
                # (the callback's `budget` reads ahead; the mixin's and Fabric's overlap, their `ahead` opts in)
                label = "read ahead" if adapter == "callback" or mode == "ahead" else "overlap"
                target = "<= 1.05" if int(world) >= 16 and label == "read ahead" else "(reported)"
                table.append((f"{what}: {adapter} ({label})", "step time vs fixed k (median of rounds)",
                              f"{budget['ratio_median']:.3f}", target))  # fmt: skip
                table.append((f"{what}: {adapter} ({label})", "collectives waited on per micro-batch inside a window",
                              f"{budget['waited_per_microbatch']:g}", "0"))  # fmt: skip
    for row in scale["simulated"]["rows"]:
        if row["ranks"] == 1024 and row["cv"] == 0.3:
            what = f"scale: Budget vs k={scale['k']}, 1024 ranks (simulated), cv 0.3"
            table.append((f"{what}: callback; mixin, Fabric with read_ahead (read ahead)", "step time vs fixed k",
                          f"{row['ahead']:.3f}", "<= 1.05"))  # fmt: skip
            table.append((f"{what}: mixin, Fabric without read_ahead (overlap)", "step time vs fixed k",
                          f"{row['overlap']:.3f}", "(reported)"))  # fmt: skip
    return table


def precision_rows(results: dict[str, dict]) -> list[tuple[str, str, str, str]]:  # type: ignore[type-arg]
    """The rows of ``precision.py`` (the window gradient's error against k) and ``precision_cost.py`` (its cost)."""
    errors = results["precision.py"]
    table = []
    for row in errors["rows"]:
        if row["k"] > 1:
            floor, option, builtin = row["one rounding (floor)"], row["grad_accum_dtype=float32"], row["built-in"]
            what = f"precision: bf16-true, k={row['k']}, window gradient error vs one rounding ({floor:.2e})"
            table.append((f"{what}, grad_accum_dtype=float32", "error / one rounding's", f"{option / floor:.3f}",
                          "<= 1.1"))  # fmt: skip
            table.append((f"{what}, built-in", "error / one rounding's", f"{builtin / floor:.2f}", "(reported)"))
    cost = results["precision_cost.py"]
    what = f"precision cost: grad_accum_dtype=float32 vs None, {cost['what'].split(', micro')[0]}, k={cost['k']}"
    table.append((what, "CPU time per window (median of the rounds' ratios)", f"{cost['ratio_median_pair']:.3f}",
                  f"<= {cost['target']}"))  # fmt: skip
    table.append((what, f"its own work in place, implied ({cost['in_place_ms_per_window']:.1f} ms/window)",
                  f"{cost['ratio_implied']:.3f}", "(reported; an upper bound)"))  # fmt: skip
    memory = (("between", "between micro-batches", "+2"), ("peak", "at the fit's peak", "(reported)"))
    for key, measured, target in memory:
        if f"{key}_bytes_per_param_added" in cost:
            table.append((what, f"CPU allocator bytes per bf16 parameter added, {measured}",
                          f"{cost[f'{key}_bytes_per_param_added']:+.2f}", target))  # fmt: skip
    return table


def rows(results: dict[str, dict]) -> list[tuple[str, str, str, str]]:  # type: ignore[type-arg]
    table = overhead_rows(results)
    for row in results["multitask_memory.py"]["rows"]:
        what = f"multitask: {row['setup']}, T={row['tasks']}"
        table.append((what, "graph memory vs joint", f"{row['graph_ratio']:.3f}", f"<= {row['target']:.3f}"))
        table.append((what, "allocator peak vs joint", f"{row['alloc_ratio']:.3f}", "(reported)"))
        table.append((what, "time vs joint", f"{row['time_ratio']:.3f}", "<= 1.05"))
    bn = results["batchnorm.py"]
    what = f"batchnorm='window', small ResNet, k={bn['k']}"
    if "ratio_median" in bn:
        table.append((what, "CPU time per window vs 'micro-batch' (median of rounds)", f"{bn['ratio_median']:.3f}",
                      f"<= {bn['target']}"))  # fmt: skip
    table.append((what, "CPU time per window vs 'micro-batch' (best)", f"{bn['ratio_best']:.3f}", f"<= {bn['target']}"))
    if "hooks_share" in bn:
        table.append((what, f"its hooks' CPU time, in place ({bn['hooks_us_per_window']:.0f} us/window): share",
                      f"{bn['hooks_share']:.3f}", "(reported)"))  # fmt: skip
    table.extend(budget_rows(results))
    table.extend(scale_rows(results))
    for row in results["decay.py"]["rows"]:
        table.append(
            (f"decay: {row['model']}, {row['policy']}", "step vs zero_grad", f"{row['step_ratio']:.3f}", "<= 1.1")
        )
    for row in results["noise_scale.py"]["rows"]:
        table.append(
            (f"noise scale, k={row['k']}", "probe / window fwd+bwd", f"{row['probe_fraction']:.4f}", "<= 0.03")
        )
        table.append((f"noise scale, k={row['k']}", "loop time vs constant k", f"{row['ratio']:.3f}", "(noisy)"))
    for row in results["comm_calls.py"]["rows"]:
        what = f"comm, k=4, {row['world']} {row['device']} ranks: {row['run']}"
        baseline = "built-in" in row["run"] or "every" in row["run"] or "hand-written" in row["run"]
        target = "(baseline: k)" if baseline else "1 (sync skipped)"
        if "DDP" in row["run"]:
            target = "1"
        if "hand-written" in row["run"]:
            target = "(baseline)"
        table.append((what, "gradient collective rounds / step", f"{row['rounds_per_step']:g}", target))
    for row in results["cached_memory.py"]["rows"]:
        if row["run"] != "whole":
            what = f"cached backward, {row['run']}, dropout {row['dropout']}"
            table.append((what, "graph memory vs whole batch", f"{row['graph_ratio']:.3f}", f"<= {row['target']:.3f}"))
            table.append((what, "time vs whole batch", f"{row['time_ratio']:.3f}", "<= 1.5"))
    for row in results["cached_memory.py"].get("versus_gradcache", []):
        what = f"cached backward vs GradCache, chunks of {row['chunk']}, dropout {row['dropout']}"
        table.append((what, "heap peak vs GradCache's", f"{row['peak_ratio']:.3f}", "<= 1"))
        table.append((what, "time vs GradCache's", f"{row['time_ratio']:.3f}", "<= 1 (noisy)"))
    versus_st = results["cached_sentence_transformers.py"]
    for row in versus_st["rows"]:
        what = f"cached backward vs sentence-transformers' cached loss, batch {row['batch']}, chunks of {row['chunk']}"
        table.append((what, "heap peak vs theirs", f"{row['peak_ratio']:.3f}", "<= 1"))
        table.append((what, "CPU time vs theirs", f"{row['time_ratio']:.3f}", "<= 1.05 (noisy)"))
        table.append((what, "gradient vs the uncached loss, float64", f"{row['grad_vs_uncached']:.1e}", "<= 1e-12"))
    ranks = versus_st["two_ranks"]
    theirs = ranks["sentence-transformers"]
    for name in ("rank-local", "whole gathered loss"):
        what = f"cached backward on 2 gloo ranks, {name}, global batch {versus_st['ranks_batch']}"
        rows_target = f"{versus_st['ranks_batch'] // 2} (its own)" if name == "rank-local" else "(all)"
        table.append((what, "anchor rows one rank's loss scored", str(ranks[name]["rows_scored"]), rows_target))
        peak, time_s = ranks[name]["peak_bytes"] / theirs["peak_bytes"], ranks[name]["time_s"] / theirs["time_s"]
        table.append((what, "heap peak vs sentence-transformers'", f"{peak:.3f}",
                      "<= 1" if name == "rank-local" else "(reported)"))  # fmt: skip
        table.append((what, "time vs sentence-transformers'", f"{time_s:.3f}", "(noisy)"))
        table.append((what, "gradient vs one process", f"{ranks[name]['grad_vs_one_process']:.1e}", "<= 1e-12"))
    study = results["noise_study.py"]
    ks = ", ".join(str(row["k"]) for row in study["rows"])
    table.append(
        ("noise study: NoiseScale defaults, true k = 16", "seeds with final k within 25 %",
         f"{study['within_25']}/{len(study['rows'])} (k = {ks})", "all")
    )  # fmt: skip
    pieces = results["microbatches.py"]
    for row in pieces["rows"]:
        if row["run"] != "plain callback":
            target = "<= 1.02" if row["run"].endswith("(one piece)") else "(reported)"
            what = f"microbatches: {row['run']}"
            table.append((what, "time per sample vs without (best)", f"{row['ratio']:.3f}", target))
    for name, key in (("one piece", "one_piece"), ("'auto', one piece", "auto_one_piece"), ("4 pieces", "four_pieces")):
        table.append((f"microbatches: the package's own work, {name} a batch", "us per piece, in place",
                      f"{pieces[key]['own_us_per_piece']:.0f}", "(reported)"))  # fmt: skip
    table.append(("microbatches: Lightning's backward of the batch's loss value ('auto')", "us per batch, in place",
                  f"{pieces['auto_one_piece']['lightning_backward_us_per_batch']:.0f}", "(reported)"))  # fmt: skip
    check = results["rank_check.py"]
    table.append(
        ("rank check on k (Lambda), 2 gloo ranks", "us / step vs the count all-reduce", f"{check['check']:.0f} us, "
         f"{check['check'] / check['counts']:.2f}", "(reported; 0 for built-in schedules)")
    )  # fmt: skip
    table.extend(realistic_rows(results))
    table.extend(precision_rows(results))
    bars = results["progress_bar.py"]
    for row in bars["rows"]:
        target = "(baseline)" if row["run"].endswith("lightning") else "(reported)"
        table.append((f"progress bar refresh: {row['run']}",
                      f"us, in place (best): {row['us']:.1f}; vs Lightning's (median of rounds)",
                      f"{row['ratio']:.3f}", target))  # fmt: skip
    if "fit_start" in bars:  # (the one walk of the fit's windows, at its start)
        start = bars["fit_start"]
        table.append((f"progress bar: the fit's total at its start ({start['windows']} windows walked)",
                      f"us per window walked (best; {start['us'] / 1000:.1f} ms per fit)",
                      f"{start['us_per_window']:.2f}", "(reported)"))  # fmt: skip
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument("--jobs", type=int, default=1, help="scripts run at once (--quick: their figures unread)")
    parser.add_argument("--only", nargs="+", choices=list(QUICK), help="run these; read the others' last JSON")
    args = parser.parse_args()
    json_dir = args.out.parent
    again = QUICK if args.only is None else {s: QUICK[s] for s in args.only}
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        done = {s: pool.submit(run, s, QUICK[s] if args.quick else [], json_dir) for s in again}
        results = {script: future.result() for script, future in done.items()}
    for script in QUICK.keys() - again.keys():  # (as the last run wrote it)
        results[script] = json.loads((json_dir / script.replace(".py", ".json")).read_text())
    machine = f"{platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}"
    command = "python benchmarks/run_all.py" + (" --quick" if args.quick else "")
    command += f" --only {' '.join(args.only)}" if args.only else ""
    kept = " The other scripts' rows are their JSON files' from an earlier run." if args.only else ""
    lines = [
        "# Benchmark results",
        "",
        f"Written by `{command}` on {machine}.{kept}",
        "Ratios are against the baseline run in the same process; see each script's docstring. On a shared",
        "2-core machine, repeated runs of the same configuration differ by up to about 15 %: read small",
        "deviations from 1 as noise (the empty-callback and decay rows move the most).",
        "",
        "| what | measured | ratio | target |",
        "| --- | --- | --- | --- |",
        *(f"| {what} | {measured} | {ratio} | {target} |" for what, measured, ratio, target in rows(results)),
        "",
    ]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
