"""The README and the docs: every Python snippet parses and its ``lightning_accum`` imports
resolve (a renamed or removed name fails here), every page is in the site's navigation, and
every public name has a reference page. ``.ci/run`` also builds the site with warnings as errors.

Every Python block of the docs pages runs as written, unless the line right before its fence is
``<!-- fragment -->`` (a method body, a line of a larger program: invisible on the site). The blocks
run in one subprocess, each with ``exec`` in a fresh namespace and a fresh temporary folder; a
failing one is reported by its page and line (the README's blocks: ``test_readme.py``)."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

import lightning_accum

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
FRAGMENT = "<!-- fragment -->"
# (packages of the [test] extra some blocks import; a block that needs a missing one is skipped)
OPTIONAL = {"transformers", "sentence_transformers", "deepspeed"}


class Block(NamedTuple):
    page: Path
    line: int  # the line of the block's first line of code in its page, from 1
    code: str
    fragment: bool

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def python_blocks(page: Path) -> list[Block]:
    """The page's fenced ``python`` blocks, with where they start and whether they are marked fragments."""
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if re.fullmatch(r"```python\s*", lines[i]):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            fragment = i > 0 and lines[i - 1].strip() == FRAGMENT
            blocks.append(Block(page, i + 2, "\n".join(lines[i + 1 : end]) + "\n", fragment))
            i = end
        i += 1
    return blocks


BLOCKS = [block for page in PAGES for block in python_blocks(page)]
DOCS_BLOCKS = [b for b in BLOCKS if b.page.name != "README.md" and not b.fragment]


@pytest.mark.parametrize("code", [pytest.param(b.code, id=b.where) for b in BLOCKS])
def test_snippet_parses_and_its_imports_resolve(code: str) -> None:
    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_accum"):
            module = __import__(node.module or "", fromlist=["_"])
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"


def test_every_page_is_in_the_navigation_and_every_public_name_in_the_reference() -> None:
    config = (ROOT / "mkdocs.yml").read_text()
    for page in (ROOT / "docs").rglob("*.md"):
        assert str(page.relative_to(ROOT / "docs")) in config, f"{page} is not in mkdocs.yml's nav"
    reference = "".join(p.read_text() for p in (ROOT / "docs" / "reference").glob("*.md"))
    for name in lightning_accum.__all__:
        if name != "__version__":
            assert f"lightning_accum.{name}" in reference, f"{name} has no API reference entry"


def test_fragment_marks_sit_right_before_a_python_fence() -> None:
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() == FRAGMENT:
                assert i + 1 < len(lines) and lines[i + 1].startswith("```python"), (
                    f"{page.relative_to(ROOT)}:{i + 1}: {FRAGMENT} must be the line right before a ```python fence"
                )


# Each block: exec'd in a fresh namespace (as a script: __name__ == "__main__"), from a fresh temporary
# folder removed after it, with the seed reset; compiled under its page's path and padded with blank lines,
# so that a traceback names the page and the line. The results go to a file (the blocks print).
RUNNER = """
import json, os, sys, tempfile, traceback
import torch
blocks, results = json.load(open(sys.argv[1])), {}
for block in blocks:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as where:
        os.chdir(where)
        try:
            exec(compile("\\n" * (block["line"] - 1) + block["code"], block["path"], "exec"), {"__name__": "__main__"})
            results[block["where"]] = None
        except (Exception, SystemExit):
            results[block["where"]] = traceback.format_exc()
        finally:
            os.chdir(sys.argv[3])
json.dump(results, open(sys.argv[2], "w"))
"""


def missing_packages(block: Block) -> list[str]:
    roots = set()
    for node in ast.walk(ast.parse(block.code)):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            roots.add(node.module.split(".")[0])
    return sorted(name for name in roots & OPTIONAL if importlib.util.find_spec(name) is None)


@pytest.fixture(scope="module")
def block_results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    """Runs the blocks the session selected (all of them, or those ``-k`` picked) in one subprocess."""
    chosen = {
        item.callspec.id
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_docs_block_runs" and hasattr(item, "callspec")
    }
    blocks = [
        {"where": b.where, "path": str(b.page), "line": b.line, "code": b.code}
        for b in DOCS_BLOCKS
        if b.where in chosen and not missing_packages(b)
    ]
    folder = tmp_path_factory.mktemp("docs_blocks")
    (folder / "blocks.json").write_text(json.dumps(blocks))
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, str(folder / "blocks.json"), str(folder / "results.json"), str(folder)],
        capture_output=True,
        text=True,
        cwd=folder,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results: dict[str, str | None] = json.loads((folder / "results.json").read_text())
    return results


@pytest.mark.parametrize("block", [pytest.param(b, id=b.where) for b in DOCS_BLOCKS])
def test_docs_block_runs(block: Block, block_results: dict[str, str | None]) -> None:
    missing = missing_packages(block)
    if missing:
        pytest.skip(f"{block.where} needs {', '.join(missing)} (in the [test] extra)")
    error = block_results[block.where]
    if error is not None:
        pytest.fail(f"the Python block at {block.where} failed (or mark it {FRAGMENT}):\n{error}", pytrace=False)


def test_the_budget_pages_example_prints_the_output_shown_under_it(tmp_path: Path) -> None:
    """Run as a reader runs it (its own process, no seed but its own), the example prints the windows the page
    shows: the page's text block right under it, and the sentence after it about the last window."""
    page = ROOT / "docs" / "guide" / "budget.md"
    (block,) = [b for b in python_blocks(page) if "TokensPerStep" in b.code]
    lines = page.read_text().splitlines()
    after = lines[block.line - 1 + block.code.count("\n") :]
    start = after.index("```text") + 1
    shown = after[start : after.index("```", start)]
    done = subprocess.run([sys.executable, "-c", block.code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [line for line in done.stdout.splitlines() if re.match(r"step \d|Progress\(", line)]
    assert printed == shown
    last = re.fullmatch(r"step (\d+): (\d+) micro-batches, (\d+) tokens", printed[-2])
    assert last is not None and int(last[3]) < 3_000  # (the last window is under the budget: cut short)
    assert f"(Step {last[1]} is the epoch's last window, cut short" in page.read_text()
