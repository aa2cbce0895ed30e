"""The API reference has no gap: every public name the reference renders, and every public method,
property and attribute of its classes, carries a docstring of its own (mkdocstrings shows an
undocumented member as a bare signature); the reference shows no private base class or internal
constructor, and every type alias a public signature uses with its value."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest

import lightning_accum
from lightning_accum import count, lr, multitask

DOCS = Path(__file__).resolve().parents[1] / "docs"


def rendered() -> dict[str, Any]:
    """What the reference pages render (``::: name`` directives), modules expanded to their public names."""
    names: dict[str, Any] = {}
    for page in (DOCS / "reference").glob("*.md"):
        for target in re.findall(r"^::: ([\w.]+)", page.read_text(), flags=re.M):
            module_name, _, attr = target.rpartition(".")
            obj = getattr(__import__(module_name, fromlist=[attr]), attr)
            if inspect.ismodule(obj):
                for name in getattr(obj, "__all__", [n for n in vars(obj) if not n.startswith("_")]):
                    member = getattr(obj, name)
                    if getattr(member, "__module__", obj.__name__) == obj.__name__ or inspect.isfunction(member):
                        names[f"{target}.{name}"] = member
            else:
                names[target] = obj
    return names


def members(cls: type) -> list[tuple[str, Any]]:
    """The public members a class defines itself (what its reference entry lists)."""
    out = []
    for name, value in vars(cls).items():
        if re.match(r"_|on_|configure_callbacks$", name):  # (mkdocs.yml's filters: Lightning's hooks)
            continue
        if isinstance(value, staticmethod | classmethod):
            value = value.__func__
        if inspect.isfunction(value) or isinstance(value, property):
            out.append((name, value))
    return out


def test_every_rendered_name_and_member_has_a_docstring() -> None:
    missing = []
    for name, obj in rendered().items():
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and not (obj.__doc__ or "").strip():
            missing.append(name)
        if inspect.isclass(obj):
            missing += [f"{name}.{m}" for m, value in members(obj) if not (value.__doc__ or "").strip()]
    assert not missing, f"public names without a docstring: {missing}"


def test_the_reference_covers_the_package_and_its_modules() -> None:
    names = rendered()
    for public in lightning_accum.__all__:
        if public not in ("__version__", "lr"):
            assert any(key.endswith(f".{public}") for key in names), public
    for module in (lr, count, multitask):
        assert any(key.startswith(module.__name__) for key in names), module.__name__


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mkdocstrings")
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("site")
    root = DOCS.parent
    command = [sys.executable, "-m", "mkdocs", "build", "-q", "-d", str(out)]
    subprocess.run(command, check=True, capture_output=True, cwd=root)
    return out


@pytest.mark.parametrize("page", ["callbacks", "mixin", "schedules", "lr", "count", "multitask", "types"])
def test_no_private_base_or_internal_constructor_is_shown(site: Path, page: str) -> None:
    html = (site / "reference" / page / "index.html").read_text()
    text = re.sub(r"<[^>]+>", "", html)
    assert not re.search(r"Bases: *_", text.replace("\n", " ")), f"a private base on the {page} page"
    assert "Block" not in text and "MixinDriver" not in text, f"an internal constructor on the {page} page"
    assert text.count("doctest:") == 0, f"doctest flags rendered on the {page} page"
    assert "= IGNORE_INDEX" not in text, "a default shown by its constant's name instead of its value"
    if page == "types":  # each alias a public signature uses, with its value
        for alias in ("Normalize", "Reduction", "Count", "LRScaling", "Reset", "SyncMode", "Unit", "Factor", "GetRep",
                      "MicrobatchSize"):
            assert re.search(rf"{alias} = \S", text), alias


def test_signatures_and_attribute_tables_render_cleanly(site: Path) -> None:
    for page in (DOCS / "reference").glob("*.md"):
        html = (site / "reference" / page.stem / "index.html").read_text()
        text = re.sub(r"<[^>]+>", "", html)
        lambda_default = re.search(r"=\s*\(lambda", text)
        assert not lambda_default, f"a default shown as a lambda on the {page.stem} page (name its factory)"
        # (a Google-style entry ``a, b: ...`` is parsed as one attribute named "a,")
        assert not re.search(r'title="lightning_accum\.[\w.]*,"', html), f"a name with a comma on the {page.stem} page"


@pytest.mark.parametrize("module", [multitask])
def test_a_module_with_all_renders_exactly_its_all(site: Path, module: Any) -> None:
    page = next(p for p in (DOCS / "reference").glob("*.md") if f"::: {module.__name__}\n" in p.read_text())
    html = (site / "reference" / page.stem / "index.html").read_text()
    shown = set(re.findall(rf'id="{re.escape(module.__name__)}\.(\w+)"', html))
    assert shown == set(module.__all__), f"rendered {sorted(shown)}, __all__ {sorted(module.__all__)}"
