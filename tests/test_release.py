"""Release hygiene that needs no build: the version is PEP 440 and has its CHANGELOG section."""

from __future__ import annotations

import re
from pathlib import Path

import lightning_accum

ROOT = Path(__file__).resolve().parents[1]


def test_version_matches_changelog() -> None:
    version = lightning_accum.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?", version)
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog
    assert re.search(rf"^## \[{re.escape(version)}\] - \d{{4}}-\d{{2}}-\d{{2}}$", changelog, re.MULTILINE)


def test_public_api_is_exported_and_typed() -> None:
    assert (ROOT / "src" / "lightning_accum" / "py.typed").exists()
    for name in lightning_accum.__all__:
        assert hasattr(lightning_accum, name)
