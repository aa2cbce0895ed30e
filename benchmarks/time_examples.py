"""Time each example's default run (``python examples/NAME.py``, no arguments) and write the table into
``docs/getting-started.md`` (between its ``examples-timing`` marks): user CPU time and wall time of the
whole process (Python's start and Lightning's import included), with the machine's load average before
and after, so that a table measured on a busy machine says so. Not a test: a time is never asserted.

python benchmarks/time_examples.py                      # every example, one after the other; the docs table
python benchmarks/time_examples.py --only quickstart    # these again (the others' rows stay as they were)
python benchmarks/time_examples.py --no-write           # print the table only
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
DOC = ROOT / "docs" / "getting-started.md"
START, END = "<!-- examples-timing:start -->", "<!-- examples-timing:end -->"
#: the examples with an ``--out`` folder get a temporary one (their default writes beside the script)
WRITES = {"adaptive", "gradient_decay", "contrastive", "retrieval", "batchnorm_window"}


def examples() -> list[str]:
    return sorted(p.stem for p in EXAMPLES.glob("*.py") if not p.stem.startswith("_"))


def measure(name: str, timeout: float) -> dict[str, object]:
    """One default run in a process of its own: its user and system CPU seconds, wall seconds, exit status."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, str(EXAMPLES / f"{name}.py"), *(["--out", out] if name in WRITES else [])]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        try:
            done = subprocess.run(command, cwd=out, env=env, capture_output=True, text=True, timeout=timeout)
            status = "ok" if done.returncode == 0 else f"failed ({done.returncode}): {done.stderr.strip()[-300:]}"
        except subprocess.TimeoutExpired:
            status = f"stopped after {timeout:.0f} s"
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "name": name,
        "user": after.ru_utime - before.ru_utime,
        "sys": after.ru_stime - before.ru_stime,
        "wall": wall,
        "status": status,
    }


def table(rows: list[dict[str, object]], load: tuple[tuple[float, ...], tuple[float, ...]], when: str) -> str:
    cores = os.cpu_count()
    (b1, b5, _), (a1, a5, _) = load
    lines = [
        f"Measured by `python benchmarks/time_examples.py` on {when} ({platform.machine()}, {cores} CPU cores, "
        f"Python {platform.python_version()}); load average (1 min, 5 min) {b1:.1f}, {b5:.1f} before and {a1:.1f}, "
        f"{a5:.1f} after: "
        + ("a busy machine: these times are pessimistic." if max(b1, a1) > 0.5 * (cores or 1) else "a quiet machine.")
        + " Each is the whole process, Python's start and Lightning's import included.",
        "",
        "| example (default run) | user CPU (s) | wall (s) | |",
        "| --- | ---: | ---: | --- |",
    ]
    for row in rows:
        lines.append(
            f"| `{row['name']}.py` | {float(row['user']):.1f} | {float(row['wall']):.1f} | "  # type: ignore[arg-type]
            f"{row['status']} |"
        )
    return "\n".join(lines)


def earlier_rows(text: str) -> dict[str, str]:
    """The rows of the table in the docs now, by example."""
    block = text.split(START)[1].split(END)[0] if START in text else ""
    return {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)\.py` \|.*$", block, flags=re.M)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", default=None, help="these examples (names without .py)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before a run is stopped")
    parser.add_argument("--no-write", action="store_true", help="print the table, leave the docs as they are")
    args = parser.parse_args()
    names = args.only or examples()
    before = os.getloadavg()
    rows = []
    for name in names:
        print(f"{name} ...", end=" ", flush=True)  # (the progress, one example at a time)
        row = measure(name, args.timeout)
        print(f"user {row['user']:.1f} s, wall {row['wall']:.1f} s, {row['status']}", flush=True)
        rows.append(row)
    after = os.getloadavg()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = table(rows, (before, after), when)
    print(text)
    if args.no_write:
        return
    doc = DOC.read_text()
    if args.only:  # the other examples' rows as they were
        kept = earlier_rows(doc)
        fresh = {str(row["name"]) for row in rows}
        extra = [line for name, line in sorted(kept.items()) if name not in fresh]
        text = text + ("\n" + "\n".join(extra) if extra else "")
        text += "\n\n(" + ", ".join(f"`{n}.py`" for n in sorted(fresh)) + " measured then; the others earlier.)"
    assert START in doc and END in doc, f"{DOC} has no {START} ... {END} block"
    head, rest = doc.split(START)
    DOC.write_text(f"{head}{START}\n{text}\n{END}{rest.split(END)[1]}")
    print(f"wrote the table into {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
