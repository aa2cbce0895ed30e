"""``python -m tests.differential --n 5000``: fuzz, print each divergence as one JSON line.

``--replay '<json>'`` (or ``--replay-file F``, one configuration a line) runs given configurations; ``--bf16`` keeps
only the ``precision="bf16-true"`` draws (issue 51), ``--budget`` only the ``Budget`` draws (issue 52). The summary
counts the outcomes by adapter, with the bf16 draws and those with ``grad_accum_dtype`` among them, and how many
float32 ties the bf16 criterion met (``bf16_reference``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from . import bf16_reference
from .compare import check
from .configs import Config, generate, ranks_config
from .ranks import check_all


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.differential")
    parser.add_argument("--n", type=int, default=200, help="configurations to run")
    parser.add_argument("--seed", type=int, default=0, help="the generator's seed")
    parser.add_argument("--replay", help="one configuration as JSON, as a divergence printed it")
    parser.add_argument("--replay-file", help="a file of configurations, one JSON line each")
    parser.add_argument("--shard", default="0/1", help="i/m: run every m-th configuration from the i-th")
    parser.add_argument("--ranks", type=int, default=None,
                        help="Fabric loops on 2 processes (DDP, FSDP2) to run besides (default: n / 50)")  # fmt: skip
    parser.add_argument("--bf16", action="store_true",
                        help="keep only the draws with precision='bf16-true' (n of them, drawn as usual)")  # fmt: skip
    parser.add_argument("--budget", action="store_true",
                        help="keep only the draws with a `Budget` schedule (n of them, drawn as usual)")  # fmt: skip
    args = parser.parse_args(argv)
    replayed = bool(args.replay or args.replay_file)
    if replayed:
        lines = [args.replay] if args.replay else Path(args.replay_file).read_text().splitlines()
        configs = [Config.from_json(line) for line in lines if line.strip()]
    else:
        rng = random.Random(args.seed)
        configs = _draw(lambda: generate(rng), args.n, args.bf16, args.budget)
        rng = random.Random(args.seed + 1)
        ranks = args.n // 50 if args.ranks is None else args.ranks
        configs += _draw(lambda: ranks_config(rng), ranks, args.bf16, args.budget)
    shard, shards = map(int, args.shard.split("/"))
    configs = configs[shard::shards]
    start, failed = time.time(), 0
    tally: dict[str, Counter[str]] = {}
    on_ranks = [c for c in configs if c.world > 1]  # (the multi-process part: the ranks launched once for all)
    for c, diffs in zip(on_ranks, check_all(on_ranks) if on_ranks else [], strict=True):
        _count(tally, c, bool(diffs))
        if diffs:
            failed += 1
            print(json.dumps({"config": json.loads(c.to_json()), "differences": diffs}), flush=True)
    for i, c in enumerate(c for c in configs if c.world == 1):
        diffs = check(c)
        _count(tally, c, bool(diffs))
        if diffs:
            failed += 1
            print(json.dumps({"config": json.loads(c.to_json()), "differences": diffs}), flush=True)
        if (i + 1) % 100 == 0:
            minutes = (time.time() - start) / 60
            print(f"# {i + 1} run, {failed} diverged, {minutes:.1f} min", file=sys.stderr, flush=True)
    minutes = (time.time() - start) / 60
    print(f"# {len(configs)} configurations, {len(configs) - failed} agreed, {failed} diverged, {minutes:.1f} min")
    for name in sorted(tally):
        n = tally[name]
        print(f"# {name}: {n['all']} ({n['agreed']} agreed, {n['diverged']} diverged); bf16-true {n['bf16']} "
              f"({n['bf16 agreed']} agreed), grad_accum_dtype {n['option']} ({n['option agreed']} agreed)")
    ties = bf16_reference.TIES
    print(f"# grad_accum_dtype's float32 ties: of {ties['landed']} elements of window gradients, {ties['elements']} "
          f"(in {ties['windows']} windows) could round either way; the package took the other side in {ties['taken']}")
    return 1 if failed else 0


def _draw(draw: Callable[[], Config], n: int, bf16: bool, budget: bool = False) -> list[Config]:
    """``n`` configurations drawn in turn (with ``bf16``, the first ``n`` of those with ``precision="bf16-true"``;
    with ``budget``, of those with a ``Budget``)."""
    out: list[Config] = []
    while len(out) < n:
        c = draw()
        if (c.bf16 or not bf16) and (c.schedule["family"] == "budget" or not budget):
            out.append(c)
    return out


def _count(tally: dict[str, Counter[str]], c: Config, diverged: bool) -> None:
    """A configuration's outcome, by adapter (and strategy, on ranks) and precision."""
    name = c.adapter if c.world == 1 else f"{c.adapter} on {c.world} ranks ({c.strategy})"
    n = tally.setdefault(name, Counter())
    n["all"] += 1
    n["diverged" if diverged else "agreed"] += 1
    if c.bf16:
        n["bf16"] += 1
        n["bf16 agreed"] += not diverged
    if c.grad_accum_dtype is not None:
        n["option"] += 1
        n["option agreed"] += not diverged


if __name__ == "__main__":
    sys.exit(main())
