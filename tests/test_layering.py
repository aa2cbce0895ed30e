"""The package's imports run one way (docs/architecture.md): the public adapters -> ``_trainer`` / ``_fabric``
(and ``_seam``) -> ``_core`` -> the pure modules. Read off the source (every import, those inside functions
and under ``TYPE_CHECKING`` included), so a lazy import cannot hide a climb."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "lightning_accum"

#: the layers, bottom up; a module may import only from its own layer or one below
PURE, CORE, MACHINERY, ADAPTERS = 0, 1, 2, 3
TOP_LEVEL = {
    "schedules": PURE,
    "lr": PURE,
    "noise": PURE,
    "count": PURE,
    "multitask": PURE,
    "_lightning": PURE,
    "_seam": MACHINERY,
    "mixin": ADAPTERS,
    "fabric": ADAPTERS,
    "progress": ADAPTERS,
    "types": ADAPTERS,
    "__init__": ADAPTERS,
}
FOLDERS = {"_core": CORE, "_trainer": MACHINERY, "_fabric": MACHINERY, "callbacks": ADAPTERS}
NAMES = {PURE: "a pure module", CORE: "_core", MACHINERY: "_trainer/_fabric/_seam", ADAPTERS: "an adapter"}


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def layer(name: str) -> int:
    head = name.split(".")[0]
    if head in FOLDERS:
        return FOLDERS[head]
    assert head in TOP_LEVEL, f"`lightning_accum.{name}` is in no layer: add it to tests/test_layering.py"
    return TOP_LEVEL[head]


def is_module(name: str, package: Path) -> bool:
    path = package.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imported(path: Path, package: Path) -> set[str]:
    """The package modules ``path`` imports (``from lightning_accum import mod`` counted as ``mod``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from lightning_accum._core import sync` imports the module `_core.sync`, not a name of `_core`
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [name for name in names if is_module(name.removeprefix("lightning_accum."), package)]
            names = names or [node.module]
        else:
            assert not (isinstance(node, ast.ImportFrom) and node.level), f"{path.name}: a relative import"
            continue
        for name in names:
            inside = name.removeprefix("lightning_accum.")
            if inside != name and is_module(inside, package):
                found.add(inside)
    return found


def climbs(package: Path = PACKAGE) -> list[str]:
    wrong = []
    for path in sorted(package.rglob("*.py")):
        name = module_name(path, package)
        own = layer(name)
        for target in sorted(imported(path, package)):
            if layer(target) > own:
                wrong.append(f"{name} ({NAMES[own]}) imports {target} ({NAMES[layer(target)]})")
            if {name.split(".")[0], target.split(".")[0]} == {"_trainer", "_fabric"}:
                wrong.append(f"{name} imports {target} (the two adapters' machinery stay apart)")
    return wrong


def test_imports_run_down_the_layers() -> None:
    assert climbs() == []


def test_the_walk_sees_an_upward_import(tmp_path: Path) -> None:
    """A module of ``_core`` that imports ``_trainer`` inside a function (as ``_core/options.py`` imported
    ``check_mode`` at its top) is found; one that imports down is not."""
    for folder in ("_core", "_trainer"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "_trainer" / "schedulers.py").write_text("from lightning_accum._core import options\n")
    (tmp_path / "_core" / "options.py").write_text("def f():\n    from lightning_accum._trainer import schedulers\n")
    assert climbs(tmp_path) == ["_core.options (_core) imports _trainer.schedulers (_trainer/_fabric/_seam)"]
