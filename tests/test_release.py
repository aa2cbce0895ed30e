"""Release hygiene that needs no build: the version is PEP 440 and agrees with the CHANGELOG (a
``.devN`` version is unreleased, a release has its dated section), which uses Keep a Changelog's
headings and a compare link for each section."""

from __future__ import annotations

import re
from pathlib import Path

import lightning_accum

ROOT = Path(__file__).resolve().parents[1]
KEEP_A_CHANGELOG = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}


def test_version_matches_changelog() -> None:
    version = lightning_accum.__version__
    match = re.fullmatch(r"(\d+\.\d+\.\d+)((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?", version)
    assert match
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog
    released = re.findall(r"^## \[(\d[^\]]*)\] - \d{4}-\d{2}-\d{2}$", changelog, re.MULTILINE)
    if match.group(5):  # X.Y.Z.devN: X.Y.Z is the next release, after every dated one
        assert all(_release(match.group(1)) > _release(done) for done in released), (version, released)
    else:
        assert version in released


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def test_changelog_uses_keep_a_changelog_headings_and_links() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    headings = set(re.findall(r"^### (.+)$", changelog, re.MULTILINE))
    assert headings <= KEEP_A_CHANGELOG, headings - KEEP_A_CHANGELOG
    for section in re.findall(r"^## \[([^\]]+)\]", changelog, re.MULTILINE):
        assert re.search(rf"^\[{re.escape(section)}\]: https://\S+$", changelog, re.MULTILINE), section


def test_public_api_is_exported_and_typed() -> None:
    assert (ROOT / "src" / "lightning_accum" / "py.typed").exists()
    for name in lightning_accum.__all__:
        assert hasattr(lightning_accum, name)


def test_help_shows_the_public_modules_only() -> None:
    """``help(lightning_accum)`` lists the package's modules: the public ones are the API; every internal
    module lives under a private package (``_core``, ``_trainer``, ``_fabric``) or has a leading underscore."""
    import pkgutil

    modules = {m.name for m in pkgutil.iter_modules(lightning_accum.__path__)}
    public = {name for name in modules if not name.startswith("_")}
    assert public == {
        "callbacks", "count", "fabric", "lr", "mixin", "multitask", "noise", "progress", "schedules", "types"
    }  # fmt: skip
    assert {name for name in modules if name.startswith("_")} == {"_core", "_fabric", "_lightning", "_seam", "_trainer"}
    shown = [name for name in dir(lightning_accum) if not name.startswith("_")]
    assert set(shown) <= set(lightning_accum.__all__) | public, set(shown) - set(lightning_accum.__all__) - public


def test_help_orients_and_the_three_entry_points_import_from_the_top() -> None:
    """``help(lightning_accum)`` names the three entry points (one line each) and the docs address; the Fabric
    helper imports from the top as the other two do (it was only in ``lightning_accum.fabric``)."""
    import pydoc

    from lightning_accum import AccumulationMixin, AccumulationScheduler, FabricAccumulator, fabric

    assert FabricAccumulator is fabric.FabricAccumulator and "FabricAccumulator" in lightning_accum.__all__
    text = pydoc.render_doc(lightning_accum, renderer=pydoc.plaintext)
    head = text.split("PACKAGE CONTENTS")[0]
    for entry in (AccumulationScheduler, AccumulationMixin, FabricAccumulator):
        assert len([line for line in head.splitlines() if line.strip().startswith(f"- ``{entry.__name__}")]) == 1
    assert "https://lightning-accum.github.io/lightning-accum/" in head
    assert "you never construct one" in (lightning_accum.Accumulator.__doc__ or "")
