"""The project's conventions: the GitHub workflows parse and do what they say (they cannot run
here), the metadata carries its URLs, and CONTRIBUTING.md gives the commands."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / ".github" / "workflows"


def workflow(name: str) -> dict[str, Any]:
    data = yaml.safe_load((WORKFLOWS / name).read_text())
    data["on"] = data.pop(True, data.get("on"))  # (YAML 1.1 reads the key `on` as true)
    return data  # type: ignore[no-any-return]


def steps(job: dict[str, Any]) -> str:
    return "\n".join(str(step.get("run", step.get("uses", ""))) for step in job["steps"])


def test_ci_runs_the_ci_script_on_pull_requests_and_pushes_on_the_oldest_and_newest_python() -> None:
    ci = workflow("ci.yml")
    assert "pull_request" in ci["on"] and "push" in ci["on"]
    job = ci["jobs"]["test"]
    pythons = job["strategy"]["matrix"]["python"]
    assert "3.10" in pythons and max(pythons, key=lambda v: tuple(map(int, v.split(".")))) >= "3.13"
    assert "bash .ci/run" in steps(job)
    assert 'requires-python = ">=3.10"' in (ROOT / "pyproject.toml").read_text()


def test_a_job_tests_the_declared_floors() -> None:
    """The floors job installs the oldest Lightning pyproject.toml declares, on the torch .ci/run installs,
    which is the declared torch floor."""
    job = workflow("ci.yml")["jobs"]["floors"]
    floor = next(step["env"]["FLOORS"] for step in job["steps"] if "env" in step)
    project = (ROOT / "pyproject.toml").read_text()
    major_minor = ".".join(floor.split(".")[:2])
    assert f'"lightning>={major_minor}"' in project and f'"pytorch-lightning>={major_minor}"' in project
    torch = re.search(r"torch==(\d+\.\d+)", (ROOT / ".ci" / "run").read_text())
    assert torch and f'"torch>={torch.group(1)}"' in project
    assert "bash .ci/run" in steps(job) and "FLOORS" in (ROOT / ".ci" / "run").read_text()


def test_docs_build_strictly_and_deploy_to_pages_from_main() -> None:
    docs = workflow("docs.yml")
    assert docs["on"]["push"]["branches"] == ["main"]
    assert "mkdocs build --strict" in steps(docs["jobs"]["build"])
    assert "actions/deploy-pages" in steps(docs["jobs"]["deploy"])
    assert docs["permissions"]["pages"] == "write" and docs["permissions"]["id-token"] == "write"


def test_a_tag_builds_and_publishes_with_trusted_publishing() -> None:
    release = workflow("release.yml")
    assert release["on"]["push"]["tags"] == ["v*"]
    assert "python -m build" in steps(release["jobs"]["build"])
    publish = release["jobs"]["publish"]
    assert publish["permissions"]["id-token"] == "write"
    assert "pypa/gh-action-pypi-publish" in steps(publish)
    assert not any("password" in str(step.get("with", {})) for step in publish["steps"])  # (no token)


def test_metadata_urls_and_contributing() -> None:
    tomllib = pytest.importorskip("tomllib")  # (Python 3.11 on)
    urls = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]
    assert {"Homepage", "Documentation", "Source", "Changelog", "Issues"} <= set(urls)
    assert all(url.startswith("https://") for url in urls.values())
    text = (ROOT / "CONTRIBUTING.md").read_text()
    for command in ("pip install -e \".[dev]\"", "python -m pytest -q", "mkdocs build --strict", "bash .ci/run"):
        assert command in text
    assert "ratios, not timings" in text.lower() or "as ratios, not timings" in text


def test_the_examples_install_runs_every_example_and_readme_snippet() -> None:
    """README's first command installs ``.[examples]``: every third-party package an example or a README snippet
    imports is in that extra or the package's own dependencies (``transformers`` was not, and 4 examples and the
    second snippet failed there). One stated duration of the test command, the same in README and CONTRIBUTING."""
    import ast

    tomllib = pytest.importorskip("tomllib")  # (Python 3.11 on)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + project["optional-dependencies"]["examples"]
    installed = {re.split(r"[<>=;\[ ]", spec)[0].replace("_", "-").lower() for spec in declared}  # (PEP 503 names)
    installed |= {"torchmetrics", "numpy"}  # (Lightning's and torch's own)
    distribution = {"sklearn": "scikit-learn", "sentence_transformers": "sentence-transformers"}
    readme = (ROOT / "README.md").read_text()
    sources = [(path.name, path.read_text()) for path in sorted((ROOT / "examples").glob("*.py"))]
    sources += [(f"README block {i}", code) for i, code in enumerate(re.findall(r"```python\n(.*?)```", readme, re.S))]
    local = {path.stem for path in (ROOT / "examples").glob("*.py")} | {"lightning_accum"}
    missing = set()
    for where, code in sources:
        for node in ast.walk(ast.parse(code)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            )  # fmt: skip
            for name in names:
                root = name.split(".")[0]
                if root in local or root in sys.stdlib_module_names:
                    continue
                if distribution.get(root, root).replace("_", "-").lower() not in installed:
                    missing.add(f"{where}: {root}")
    assert not missing, sorted(missing)
    assert "pip install -e \".[examples]\"" in readme.split("```")[1]
    stated = {
        name: re.findall(r"about (\d+) minutes", (ROOT / name).read_text()) for name in ("README.md", "CONTRIBUTING.md")
    }
    assert stated == {"README.md": ["5"], "CONTRIBUTING.md": ["5"]}, stated


def mutation_tool() -> Any:
    """``tools/mutation.py`` (not a package: loaded from its path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mutation_tool", ROOT / "tools" / "mutation.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("total", "n"), [(0, 5), (1, 0), (1, 5), (7, 3), (7, 7), (7, 9), (40, 5)])
def test_the_mutation_tools_sample_draws_n_distinct_mutants_whatever_their_order(total: int, n: int) -> None:
    import random

    tool = mutation_tool()
    keys = [("m.py", (line, 0), "op", 0) for line in range(total)]
    shuffled = random.Random(1).sample(keys, len(keys))
    drawn = tool.sample(keys, n, seed=0)
    assert len(drawn) == len(set(drawn)) == min(n, total) and set(drawn) <= set(keys)
    assert tool.sample(shuffled, n, seed=0) == drawn  # (the draw names mutants, not their order in the session)
    assert tool.sample(keys, n + 2, seed=0)[:n] == drawn  # (a larger sample with the same seed holds the smaller)


def test_the_mutation_tools_sample_gives_every_mutant_the_same_chance() -> None:
    """Over 400 seeds, 2 of 10 mutants each: each is drawn 80 times in expectation (binomial, sd 8)."""
    tool = mutation_tool()
    keys = [(line,) for line in range(10)]
    drawn = [key for seed in range(400) for key in tool.sample(keys, 2, seed=seed)]
    assert all(50 <= drawn.count(key) <= 110 for key in keys), [drawn.count(key) for key in keys]


def test_the_mutation_tools_sample_skips_the_others_and_grows_with_n(tmp_path: Path) -> None:
    """In a Cosmic Ray session: a filtered mutant stays out, the rest not drawn are skipped as not sampled, a
    larger sample runs the smaller one's and more, and a mutant already run stays counted."""
    pytest.importorskip("cosmic_ray")
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import MutationSpec, TestOutcome, WorkerOutcome, WorkItem, WorkResult

    tool, db = mutation_tool(), tmp_path / "session.sqlite"
    with use_db(str(db), WorkDB.Mode.create) as work_db:
        work_db.add_work_items(
            [WorkItem.single(f"job{i}", MutationSpec("m.py", "core/Op", 0, (i + 1, 0), (i + 1, 1))) for i in range(9)]
        )
        work_db.set_result("job8", WorkResult(output="filtered", worker_outcome=WorkerOutcome.SKIPPED))

    def pending() -> set[str]:
        with use_db(str(db), WorkDB.Mode.open) as work_db:
            return {item.job_id for item in work_db.pending_work_items}

    tool.apply_sample(db, 3, 0)
    first = pending()
    counts = tool.summary(db)["counts"]
    assert len(first) == counts["pending"] == 3 and "job8" not in first
    assert counts["not sampled"] == 5 and counts["skipped"] == 1
    with use_db(str(db), WorkDB.Mode.open) as work_db:
        ran = sorted(first)[0]
        work_db.set_result(ran, WorkResult(worker_outcome=WorkerOutcome.NORMAL, test_outcome=TestOutcome.KILLED))
    tool.apply_sample(db, 5, 0)
    assert first - {ran} <= pending() and len(pending()) == 4 and ran not in pending()
    tool.apply_sample(db, 1, 7)  # (another, smaller draw: what ran stays counted)
    counts = tool.summary(db)["counts"]
    assert counts["killed"] == 1 and counts["pending"] + counts["killed"] <= 2 and counts["not sampled"] >= 6


def test_the_mutation_tools_doctests_pass() -> None:
    import doctest

    result = doctest.testmod(mutation_tool())
    assert result.attempted > 0 and result.failed == 0


def test_the_mutation_map_names_every_module_in_its_scope() -> None:
    """``tools/mutation.toml`` maps every module of ``_core/`` and ``_trainer/``, ``schedules.py``, ``lr.py`` and
    ``count.py`` (issue 53's scope) to its tests, and only paths that exist (``--check``)."""
    tool = mutation_tool()
    mapped = set(tool.load_map()["modules"])
    package = ROOT / "src" / "lightning_accum"
    scope = [*package.glob("_core/*.py"), *package.glob("_trainer/*.py")]
    scope += [package / name for name in ("schedules.py", "lr.py", "count.py")]
    wanted = {p.relative_to(ROOT).as_posix() for p in scope if p.name != "__init__.py"}
    assert wanted - mapped == set()
    assert tool.check(tool.load_map()["modules"]) == []
