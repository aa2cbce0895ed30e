"""``python -m tests.differential --n 5000``: fuzz, print each divergence as one JSON line.

``--replay '<json>'`` (or ``--replay-file F``, one configuration a line) runs given configurations.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

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
    args = parser.parse_args(argv)
    replayed = bool(args.replay or args.replay_file)
    if replayed:
        lines = [args.replay] if args.replay else Path(args.replay_file).read_text().splitlines()
        configs = [Config.from_json(line) for line in lines if line.strip()]
    else:
        rng = random.Random(args.seed)
        configs = [generate(rng) for _ in range(args.n)]
        rng = random.Random(args.seed + 1)
        configs += [ranks_config(rng) for _ in range(args.n // 50 if args.ranks is None else args.ranks)]
    shard, shards = map(int, args.shard.split("/"))
    configs = configs[shard::shards]
    start, failed = time.time(), 0
    on_ranks = [c for c in configs if c.world > 1]  # (the multi-process part: the ranks launched once for all)
    for c, diffs in zip(on_ranks, check_all(on_ranks) if on_ranks else [], strict=True):
        if diffs:
            failed += 1
            print(json.dumps({"config": json.loads(c.to_json()), "differences": diffs}), flush=True)
    for i, c in enumerate(c for c in configs if c.world == 1):
        diffs = check(c)
        if diffs:
            failed += 1
            print(json.dumps({"config": json.loads(c.to_json()), "differences": diffs}), flush=True)
        if (i + 1) % 100 == 0:
            minutes = (time.time() - start) / 60
            print(f"# {i + 1} run, {failed} diverged, {minutes:.1f} min", file=sys.stderr, flush=True)
    minutes = (time.time() - start) / 60
    print(f"# {len(configs)} configurations, {len(configs) - failed} agreed, {failed} diverged, {minutes:.1f} min")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
