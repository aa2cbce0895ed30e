"""The README and the docs: every Python snippet parses and its ``lightning_accum`` imports
resolve (a renamed or removed name fails here), every page is in the site's navigation, and
every public name has a reference page. ``.ci/run`` also builds the site with warnings as errors."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import lightning_accum

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
SNIPPETS = [
    pytest.param(code, id=f"{page.relative_to(ROOT)}:{i}")
    for page in PAGES
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.DOTALL))
]


@pytest.mark.parametrize("code", SNIPPETS)
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
