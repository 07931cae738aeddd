"""The layering rules of core.md §1: the core does no I/O; adapters do no I/O."""

from __future__ import annotations

import ast
import pkgutil
from pathlib import Path

import selection_proto

PACKAGE = Path(selection_proto.__file__).parent
CORE_FORBIDDEN = {"socket", "asyncio", "threading", "time", "anyio", "h11", "wsproto", "zmq", "selectors",
                  "subprocess", "selection_proto.adapters", "selection_proto.transports"}
ADAPTER_FORBIDDEN = {"socket", "anyio", "zmq", "asyncio", "selectors", "selection_proto.transports"}


def imports_of(path: Path, package: str) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                found.add(f"{base}.{node.module}" if node.module else base)
            elif node.module:
                found.add(node.module)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os":
            if node.attr in ("environ", "getenv"):
                found.add("os.environ")
    return found


def _violations(folder: str, forbidden: set[str]) -> list[str]:
    bad = []
    for path in sorted((PACKAGE / folder).rglob("*.py")):  # the core's wings are sub-packages
        package = ".".join(("selection_proto", *path.relative_to(PACKAGE).parent.parts))
        for name in imports_of(path, package):
            if any(name == f or name.startswith(f + ".") for f in forbidden | {"os.environ"}):
                bad.append(f"{path.relative_to(PACKAGE)}: {name}")
    return bad


def test_core_imports_no_io_module() -> None:
    assert len(list((PACKAGE / "core").rglob("*.py"))) > 50, "core package not found"
    assert _violations("core", CORE_FORBIDDEN) == []


def test_adapters_do_no_io() -> None:
    assert _violations("adapters", ADAPTER_FORBIDDEN) == []


def test_every_core_module_imports_cleanly() -> None:
    import importlib

    names = [m.name for m in pkgutil.walk_packages([str(PACKAGE / "core")], "selection_proto.core.")]
    assert "selection_proto.core.service" in names and "selection_proto.core.base.hashing" in names
    for name in names:
        importlib.import_module(name)


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    sample = tmp_path / "x.py"
    sample.write_text("import socket\nfrom ..transports import server\nimport os\nos.environ['A']\n")
    found = imports_of(sample, "selection_proto.core")
    assert {"socket", "selection_proto.transports", "os.environ"} <= found
