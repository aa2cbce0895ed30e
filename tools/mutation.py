"""Mutation testing of the package with Cosmic Ray, one module at a time, against the test files that cover it.

The modules and their test files are in ``tools/mutation.toml``. Each module is mutated in a scratch copy of the
repository (the working tree is never changed, even by an interrupted run), one mutant at a time: Cosmic Ray
writes the mutant, runs ``pytest -x`` on the module's test files and the module's own doctests, and counts the
mutant killed if they fail (or run past ``--timeout``). Sessions are kept in ``--workdir``: a second run goes on
where the first stopped. Run it niced; it uses one core::

    nice -n 19 python tools/mutation.py src/lightning_accum/count.py
    nice -n 19 python tools/mutation.py --smallest 5          # the five smallest modules of the map
    python tools/mutation.py --report                         # the scores of the sessions so far
    python tools/mutation.py --check                          # every mapped path exists
    nice -n 19 python tools/mutation.py --retest MODULE       # its survivors again, against the tests as they are
    nice -n 19 python tools/mutation.py --sample 5 --seed 0   # 5 mutants of each module, drawn at random
    nice -n 19 python tools/mutation.py --collect .mutation/cov          # which tests run each line (the suite, once)
    nice -n 19 python tools/mutation.py --covered .mutation/cov MODULE   # each mutant against the tests that run it

A module's score is killed / (killed + survived); survivors are printed with their diff. With ``--sample N``, all
but N of a module's runnable mutants (a seeded draw) are marked skipped, "Not sampled": an estimate in a fraction of
the time. With ``--covered DIR`` (after ``--collect DIR``: the default suite run once under coverage, recording
which tests ran each line), each mutant runs first the tests of the whole default suite that ran its lines, fastest
first, then the module's mapped files: a kill by any test of the suite is found, and most are found in seconds. See
docs/testing.md.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import random
import re
import shlex
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

try:
    from tomllib import loads as toml_loads
except ModuleNotFoundError:  # (Python 3.10: Cosmic Ray's own dependency reads it)
    from toml import loads as toml_loads


ROOT = Path(__file__).resolve().parent.parent
MAP = ROOT / "tools" / "mutation.toml"
NOT_SAMPLED = "Not sampled"
COPIED = ("src", "tests", "pyproject.toml", "README.md", "docs", "examples", "benchmarks", "mkdocs.yml")


def load_map() -> dict[str, object]:
    return toml_loads(MAP.read_text())  # type: ignore[no-any-return]


def check(mapping: dict[str, list[str]]) -> list[str]:
    """Mapped paths that do not exist."""
    paths = [p.split("::")[0] for module, tests in mapping.items() for p in (module, *tests)]
    return [p for p in paths if not (ROOT / p).exists()]


def scratch_copy(workdir: Path, name: str = "tree") -> Path:
    """A fresh copy of the repository's files the tests need (Cosmic Ray mutates files in place)."""
    tree = workdir / name
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", "site", "*.egg-info")
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, tree / name, ignore=ignore)
        elif source.exists():
            shutil.copy2(source, tree / name)
    return tree


def test_command(module: str, tests: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests, module]


def config_text(module: str, tests: list[str], timeout: float, exclude: list[str]) -> str:
    command = test_command(module, tests)
    lines = [
        "[cosmic-ray]",
        f"module-path = {json.dumps(module)}",
        f"timeout = {float(timeout)}",
        "excluded-modules = []",
        f"test-command = {json.dumps(' '.join(command))}",
        "",
        "[cosmic-ray.distributor]",
        'name = "local"',
        "",
        "[cosmic-ray.filters.operators-filter]",
        f"exclude-operators = {json.dumps(exclude)}",
    ]
    return "\n".join(lines) + "\n"


def session_name(module: str) -> str:
    return module.removeprefix("src/lightning_accum/").replace("/", ".").removesuffix(".py")


def inert_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Where a mutant changes nothing the package promises: annotations (``int | None`` to ``int & None``: every
    module has ``from __future__ import annotations``) and a warning's ``stacklevel=`` (which line it is attributed
    to)."""
    parts: list[ast.expr] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.arg | ast.AnnAssign) and node.annotation is not None:
            parts.append(node.annotation)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is not None:
            parts.append(node.returns)
        if isinstance(node, ast.keyword) and node.arg == "stacklevel":
            parts.append(node.value)
    return [((a.lineno, a.col_offset), (a.end_lineno or a.lineno, a.end_col_offset or 0)) for a in parts]


def skip_inert(db: Path, module: Path) -> None:
    """Mark the mutants inside ``inert_spans`` as skipped (not run, not counted), run or not."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    spans = inert_spans(module.read_text())
    with use_db(str(db), WorkDB.Mode.open) as work_db:
        for item in list(work_db.work_items):
            start = tuple(item.mutations[0].start_pos)
            if any(a <= start < b for a, b in spans):
                skipped = WorkResult(
                    output="Inert: an annotation or a stacklevel", worker_outcome=WorkerOutcome.SKIPPED
                )
                work_db.set_result(item.job_id, skipped)


def sample(keys: list[tuple[object, ...]], n: int, seed: int) -> list[tuple[object, ...]]:
    """The first ``n`` of the keys (sorted, then shuffled by ``seed``): the same draw whatever order they come in,
    and a larger ``n`` with the same seed draws the smaller one's and more.

    >>> sample([(3,), (1,), (2,)], 2, seed=0) == sample([(1,), (2,), (3,)], 2, seed=0)
    True
    """
    order = sorted(keys)  # type: ignore[type-var]
    random.Random(seed).shuffle(order)
    return order[:n]


def mutant_key(item: object) -> tuple[object, ...]:
    """What names a mutant across sessions (Cosmic Ray's job ids are drawn anew at each ``init``)."""
    m = item.mutations[0]  # type: ignore[attr-defined]
    return (str(m.module_path), tuple(m.start_pos), tuple(m.end_pos), m.operator_name, m.occurrence)


def apply_sample(db: Path, n: int, seed: int) -> None:
    """Mark all but ``sample``'s ``n`` of the runnable mutants (those not skipped for another reason) skipped as
    not sampled; one not sampled before and drawn now (a larger ``n``) is pending again. A mutant already run
    stays counted."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    with use_db(str(db), WorkDB.Mode.open) as work_db:
        results = dict(work_db.results)
        runnable = {
            mutant_key(item): item.job_id
            for item in work_db.work_items
            if item.job_id not in results
            or results[item.job_id].worker_outcome != WorkerOutcome.SKIPPED
            or results[item.job_id].output == NOT_SAMPLED
        }
        drawn = {runnable[key] for key in sample(list(runnable), n, seed)}
        left = [job for job in runnable.values() if job not in drawn and job not in results]
        work_db.set_multiple_results(left, WorkResult(output=NOT_SAMPLED, worker_outcome=WorkerOutcome.SKIPPED))
    again = [job for job in drawn if job in results and results[job].output == NOT_SAMPLED]
    with sqlite3.connect(db) as con:  # (Cosmic Ray has no call that clears a result)
        con.executemany("DELETE FROM work_results WHERE job_id = ?", [(job,) for job in again])


def retest(
    module: str, tests: list[str], tree: Path, workdir: Path, timeout: float | None, lines: tuple[int, int] | None
) -> None:
    """Run the survivors of ``module``'s session again, against its test files as they are now (after tests were
    added for them): each one killed now is recorded so."""
    from cosmic_ray.mutating import mutate_and_test
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome

    db = workdir / f"{session_name(module)}.sqlite"
    skip_inert(db, tree / module)
    command = " ".join(test_command(module, tests))
    with inside(tree), use_db(str(db), WorkDB.Mode.open) as work_db:
        survivors = [i for i, r in work_db.completed_work_items if r.test_outcome == TestOutcome.SURVIVED]
        if lines is not None:
            survivors = [i for i in survivors if lines[0] <= i.mutations[0].start_pos[0] <= lines[1]]
        for item in survivors:
            result = mutate_and_test(item.mutations, command, timeout or 600)
            print(f"{module}: line {item.mutations[0].start_pos[0]} {item.mutations[0].operator_name}: "
                  f"{result.test_outcome}", flush=True)  # fmt: skip
            work_db.set_result(item.job_id, result)


@contextlib.contextmanager
def inside(tree: Path) -> Iterator[None]:
    """Run in the scratch copy, importing its ``src``."""
    here, env = Path.cwd(), dict(os.environ)
    os.chdir(tree)
    os.environ.update(PYTHONPATH="src", PYTHONDONTWRITEBYTECODE="1")
    try:
        yield
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(env)


def collect(directory: Path) -> int:
    """Run the default suite once under coverage with each test as its context (which tests ran each line) and
    ``--durations=0`` (what each costs), into ``directory``."""
    directory = directory.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    rc = directory / "coveragerc"
    rc.write_text(
        f"[run]\nsource = src/lightning_accum\nrelative_files = true\ndata_file = {directory / '.coverage'}\n"
    )
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--cov", f"--cov-config={rc}"]
    command += ["--cov-context=test", "--cov-report=", "--durations=0"]
    with (directory / "durations.log").open("w") as log:
        return subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode


def covering(directory: Path, module: str) -> dict[int, set[str]]:
    """The tests (pytest node ids) that ran each line of ``module`` in ``collect``'s run; a line run only while the
    tests were collected (an import) has none."""
    from coverage import CoverageData

    data = CoverageData(basename=str(directory / ".coverage"))
    data.read()
    data.set_query_contexts(None)
    by_line = data.contexts_by_lineno(module)
    return {line: {c.rsplit("|", 1)[0] for c in contexts if c} for line, contexts in by_line.items()}


DURATION = re.compile(r"^\s*([0-9.]+)s (?:setup|call|teardown)\s+(\S.*?)\s*$")


def durations(directory: Path) -> dict[str, float]:
    """Each test's seconds in ``collect``'s run (its setup, call and teardown)."""
    seconds: dict[str, float] = {}
    for line in (directory / "durations.log").read_text().splitlines():
        found = DURATION.match(line)
        if found:
            seconds[found[2]] = seconds.get(found[2], 0.0) + float(found[1])
    return seconds


def in_map(test: str, module: str, mapped: list[str]) -> bool:
    """Whether a test (a node id) runs in ``module``'s mapped files or its doctests.

    >>> [in_map(t, "m.py", ["t_a.py", "t_b.py::x"]) for t in ("t_a.py::y", "t_b.py::x[1]", "t_b.py::z", "m.py::f")]
    [True, True, False, True]
    """
    return any(test.split("::")[0] in (m, module) or test == m or test.startswith(m + "[") for m in mapped)


def covered_command(
    module: str, mapped: list[str], ids: set[str], seconds: dict[str, float]
) -> tuple[list[str], float]:
    """The tests one mutant runs, and their seconds in ``collect``'s run: those of ``ids`` outside the mapped files,
    fastest first, then the mapped files and the module (as without coverage).

    >>> ids, seconds = {"t_a.py::x", "t_b.py::y", "t_c.py::z"}, {"t_b.py::y": 2.0, "t_c.py::z": 1.0}
    >>> covered_command("m.py", ["t_a.py"], ids, seconds)[0][-4:]
    ['t_c.py::z', 't_b.py::y', 't_a.py', 'm.py']
    >>> command, cost = covered_command("m.py", ["t_a.py::x"], {"t_a.py::w", "t_a.py::x[1]"}, {"t_a.py::x[1]": 1.0})
    >>> command[-3:], cost
    (['t_a.py::w', 't_a.py::x', 'm.py'], 1.0)
    """
    outside = sorted((i for i in ids if not in_map(i, module, mapped)), key=lambda i: (seconds.get(i, 0.0), i))
    cost = sum(t for i, t in seconds.items() if i in ids or in_map(i, module, mapped))
    return test_command(module, outside + mapped), cost


def run_covered(
    module: str, mapped: list[str], tree: Path, workdir: Path, directory: Path, exclude: list[str],
    drawn: tuple[int, int] | None, timeout: float | None, again: bool = False,
) -> None:  # fmt: skip
    """``module``'s pending mutants, each against ``covered_command``'s tests; one that runs past 3 times its tests'
    seconds plus 300 (or ``timeout``; the seconds leave out pytest's start and collection, which a busy machine
    stretches) is recorded as a timeout (counted killed, and listed); ``again``: the timeouts of earlier runs run
    again first."""
    from cosmic_ray.mutating import mutate_and_test
    from cosmic_ray.work_db import WorkDB, use_db

    db = init_session(module, mapped, tree, workdir, exclude, drawn)
    if again:  # (Cosmic Ray has no call that clears a result)
        with sqlite3.connect(db) as con:
            con.execute("DELETE FROM work_results WHERE output = 'timeout'")
    lines, seconds = covering(directory, module), durations(directory)
    with inside(tree), use_db(str(db), WorkDB.Mode.open) as work_db:
        done = {job for job, _ in work_db.results}
        for item in [i for i in work_db.work_items if i.job_id not in done]:
            m = item.mutations[0]
            ids = set().union(*(lines.get(n, set()) for n in range(m.start_pos[0], m.end_pos[0] + 1)))
            command, cost = covered_command(module, mapped, ids, seconds)
            result = mutate_and_test(item.mutations, shlex.join(command), timeout or 3 * cost + 300)
            outcome = "timeout" if result.output == "timeout" else result.test_outcome
            print(f"{module}: line {m.start_pos[0]} {m.operator_name}: {outcome} "
                  f"({len(ids)} tests run the line)", flush=True)  # fmt: skip
            work_db.set_result(item.job_id, result)


def run_module(
    module: str,
    tests: list[str],
    tree: Path,
    workdir: Path,
    timeout: float | None,
    exclude: list[str],
    drawn: tuple[int, int] | None = None,
) -> bool:
    """One module's session, after a baseline run of its tests on the unmutated tree (False if that fails); with
    ``drawn`` (n, seed), only a sample of its mutants."""
    name = session_name(module)
    cfg = workdir / f"{name}.toml"
    env = {**os.environ, "PYTHONPATH": "src", "PYTHONDONTWRITEBYTECODE": "1"}
    db = init_session(module, tests, tree, workdir, exclude, drawn)
    if not summary(db)["counts"]["pending"]:  # (done, or nothing to mutate: no baseline run)
        return True
    began = time.monotonic()
    baseline = subprocess.run(test_command(module, tests), cwd=tree, env=env, capture_output=True, text=True)
    took = time.monotonic() - began
    if baseline.returncode != 0:
        print(f"{module}: the baseline (no mutant) fails; not run\n{baseline.stdout[-3000:]}", flush=True)
        return False
    timeout = timeout if timeout is not None else 3 * took + 15
    print(f"{module}: baseline {took:.0f} s, per-mutant timeout {timeout:.0f} s", flush=True)
    cfg.write_text(config_text(module, tests, timeout, exclude))
    subprocess.run(
        [str(Path(sys.executable).parent / "cosmic-ray"), "exec", str(cfg), str(db)], cwd=tree, env=env, check=True
    )
    return True


def init_session(
    module: str, tests: list[str], tree: Path, workdir: Path, exclude: list[str], drawn: tuple[int, int] | None
) -> Path:
    """``module``'s session (made the first time: every mutant, less the excluded operators and the inert), with
    ``drawn`` (n, seed) applied; its database."""
    name = session_name(module)
    cfg, db = workdir / f"{name}.toml", workdir / f"{name}.sqlite"
    env = {**os.environ, "PYTHONPATH": "src", "PYTHONDONTWRITEBYTECODE": "1"}
    bindir = Path(sys.executable).parent
    if not db.exists():
        cfg.write_text(config_text(module, tests, 0, exclude))
        for args in (["cosmic-ray", "init", str(cfg), str(db)], ["cr-filter-operators", str(db), str(cfg)]):
            subprocess.run([str(bindir / args[0]), *args[1:]], cwd=tree, env=env, check=True)
        skip_inert(db, tree / module)
    if drawn is not None:
        apply_sample(db, *drawn)
    return db


def summary(db: Path) -> dict[str, object]:
    """Counts of a session, and its survivors' diffs."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    counts = {"killed": 0, "timeout": 0, "survived": 0, "incompetent": 0, "skipped": 0, "not sampled": 0, "pending": 0}
    survivors, doctest_only = [], []
    with use_db(str(db), WorkDB.Mode.open) as work_db:
        done = set()
        for item, result in work_db.completed_work_items:
            done.add(item.job_id)
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                counts["not sampled" if result.output == NOT_SAMPLED else "skipped"] += 1
            elif result.test_outcome == TestOutcome.SURVIVED:
                counts["survived"] += 1
                m = item.mutations[0]
                survivors.append({"line": m.start_pos[0], "operator": m.operator_name, "diff": result.diff})
            elif result.test_outcome == TestOutcome.KILLED:
                counts["timeout" if result.output == "timeout" else "killed"] += 1
                m = item.mutations[0]
                if _failed_in_doctest(result.output or "", str(m.module_path)):
                    doctest_only.append({"line": m.start_pos[0], "operator": m.operator_name, "diff": result.diff})
            else:
                counts["incompetent"] += 1
        counts["pending"] = sum(1 for item in work_db.work_items if item.job_id not in done)
    ran = counts["killed"] + counts["timeout"] + counts["survived"]
    score = (counts["killed"] + counts["timeout"]) / ran if ran else float("nan")
    return {
        "counts": counts,
        "score": score,
        "survivors": sorted(survivors, key=lambda s: s["line"]),
        "doctest_only": sorted(doctest_only, key=lambda s: s["line"]),
    }


def failed_test(line: str) -> str:
    """The test a pytest summary line names (its id may hold spaces; the message follows `` - ``).

    >>> failed_test("FAILED tests/t.py::f[1-`a` of b] - AssertionError: x")
    'tests/t.py::f[1-`a` of b]'
    """
    return line.split(" ", 1)[1].split(" - ", 1)[0]


def first_failures(db: Path) -> dict[str, int]:
    """The test that failed first for each killed mutant of a session (not a timeout), and how many it killed."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome

    tests: dict[str, int] = {}
    with use_db(str(db), WorkDB.Mode.open) as work_db:
        for _, result in work_db.completed_work_items:
            if result.test_outcome == TestOutcome.KILLED and result.output != "timeout":
                failed = [
                    failed_test(line)
                    for line in (result.output or "").splitlines()
                    if line.startswith(("FAILED ", "ERROR "))
                ]
                if failed:
                    tests[failed[0]] = tests.get(failed[0], 0) + 1
    return tests


def check_kills(workdir: Path, modules: list[str]) -> int:
    """Run the tests that killed the sessions' mutants once on the working tree, without a mutant: a kill by a test
    that fails there (a flaky test, one that needs another's state) is no kill. 0 where they all pass."""
    tests: dict[str, int] = {}
    for module in modules:
        db = workdir / f"{session_name(module)}.sqlite"
        for test, n in (first_failures(db) if db.exists() else {}).items():
            tests[test] = tests.get(test, 0) + n
    print(f"{len(tests)} tests killed {sum(tests.values())} mutants; running them without a mutant", flush=True)
    if not tests:
        return 0
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *sorted(tests)]
    return subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": "src"}).returncode


def _failed_in_doctest(output: str, module: str) -> bool:
    """Whether the first failure was the module's own doctest: the test files run first (``-x``), so they all
    passed and only the doctest caught the mutant."""
    failed = [line for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    return bool(failed) and failed[0].split()[1].startswith(module)


def report(workdir: Path, modules: list[str], diffs: bool) -> None:
    for module in modules:
        db = workdir / f"{session_name(module)}.sqlite"
        if not db.exists():
            continue
        s = summary(db)
        c: dict[str, int] = s["counts"]  # type: ignore[assignment]
        runnable = sum(c.values()) - c["skipped"]
        drawn = f", sampled {runnable - c['not sampled']} of {runnable}" if c["not sampled"] else ""
        print(
            f"{module}: score {s['score']:.1%}  killed {c['killed']} timeout {c['timeout']} survived {c['survived']}"
            f" incompetent {c['incompetent']} pending {c['pending']} (filtered out: {c['skipped']}{drawn})"
        )
        if s["doctest_only"]:
            print(f"  killed only by the module's doctests: {len(s['doctest_only'])}")
        shown = [("survived", m) for m in s["survivors"]] + [("doctest only", m) for m in s["doctest_only"]]
        for what, mutant in shown if diffs else ():
            print(f"  {what}: line {mutant['line']} {mutant['operator']}")
            print("    " + "\n    ".join(line for line in (mutant["diff"] or "").splitlines()[2:]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modules", nargs="*", help="paths as in tools/mutation.toml (default: all, smallest first)")
    parser.add_argument("--smallest", type=int, default=None, help="only the N smallest modules of the map")
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds one mutant's tests may run (default: 3 times the baseline's, plus 15)",
    )
    parser.add_argument("--workdir", type=Path, default=ROOT / ".mutation", help="sessions and the scratch copy")
    parser.add_argument("--report", action="store_true", help="print the scores of the sessions so far")
    parser.add_argument("--diffs", action="store_true", help="with --report: each survivor's diff")
    parser.add_argument("--check", action="store_true", help="fail if a mapped path does not exist")
    parser.add_argument("--retest", action="store_true", help="run the survivors again against the tests as they are")
    parser.add_argument("--tests", nargs="+", default=None, help="with --retest: these test files instead of the map's")
    parser.add_argument("--sample", type=int, default=None, help="run only N mutants of each module, drawn at random")
    parser.add_argument("--seed", type=int, default=0, help="with --sample: the draw's seed")
    parser.add_argument("--lines", default=None, help="with --retest: only the survivors on lines A-B")
    parser.add_argument("--collect", type=Path, default=None, help="run the suite once under coverage into DIR")
    parser.add_argument("--covered", type=Path, default=None, help="each mutant against the tests that ran it (DIR)")
    parser.add_argument("--timeouts-again", action="store_true", help="with --covered: run the timeouts again")
    parser.add_argument("--check-kills", action="store_true", help="run the killing tests without a mutant")
    args = parser.parse_args()

    config = load_map()
    mapping: dict[str, list[str]] = config["modules"]  # type: ignore[assignment]
    exclude: list[str] = config["operators"]["exclude"]  # type: ignore[index]
    if args.collect is not None:
        return collect(args.collect)
    if args.check:
        missing = check(mapping)
        print("\n".join(missing) or "every mapped path exists")
        return 1 if missing else 0
    unknown = [m for m in args.modules if m not in mapping]
    if unknown:
        parser.error(f"not in tools/mutation.toml: {unknown}")
    modules = args.modules or sorted(mapping, key=lambda m: (ROOT / m).stat().st_size)
    modules = modules[: args.smallest] if args.smallest is not None else modules
    args.workdir = args.workdir.resolve()  # (a retest runs in the scratch copy)
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.check_kills:
        return check_kills(args.workdir, modules)
    if args.retest:
        for module in modules:
            if (args.workdir / f"{session_name(module)}.sqlite").exists():
                lines = tuple(int(n) for n in args.lines.split("-")) if args.lines else None
                tests = args.tests or mapping[module]
                tree = scratch_copy(args.workdir, "retest")
                retest(module, tests, tree, args.workdir, args.timeout, lines)  # type: ignore[arg-type]
    elif not args.report:
        for module in modules:  # (a fresh copy each: the tests as they are now)
            tree = scratch_copy(args.workdir)
            drawn = (args.sample, args.seed) if args.sample is not None else None
            if args.covered is not None:
                run_covered(
                    module,
                    mapping[module],
                    tree,
                    args.workdir,
                    args.covered.resolve(),
                    exclude,
                    drawn,
                    args.timeout,
                    args.timeouts_again,
                )
                report(args.workdir, [module], diffs=False)
            elif run_module(module, mapping[module], tree, args.workdir, args.timeout, exclude, drawn):
                report(args.workdir, [module], diffs=False)
    report(args.workdir, modules, diffs=args.diffs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
