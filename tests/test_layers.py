"""The package's layers: core ← adapters ← transports ← cli, and no import cycle anywhere.

Every import counts, also one inside a function (a lazy import hides a cycle, it does not remove
it). For the layers, `if TYPE_CHECKING:` blocks are left out, since they never run; for cycles they
count too: two modules that name each other's types are one concept split in two. Inside core, the
wings of docs/LAYOUT.md: sub-packages whose imports run down."""

from __future__ import annotations

import ast
from pathlib import Path

import selection_proto

PACKAGE = Path(selection_proto.__file__).parent
LAYERS = {"core": 0, "adapters": 1, "transports": 2}  # anything else (cli, __main__) is on top


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_blocks(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    return skipped


def package_imports(path: Path, types: bool = False) -> set[str]:
    """The `selection_proto` modules `path` imports (a `from X import name` of a submodule counts
    as that submodule); `types`: those imported only for type checking too."""
    tree = ast.parse(path.read_text())
    skipped = set() if types else _type_checking_blocks(tree)
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            submodules = {f"{module}.{alias.name}" for alias in node.names} & modules
            # `from pkg import mod` imports mod; `from mod import name` imports mod.
            found.update(submodules if submodules else {module})
    return {m for m in found if m in modules and m != name}


def graph(types: bool = False) -> dict[str, set[str]]:
    return {module_name(p): package_imports(p, types) for p in PACKAGE.rglob("*.py")}


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.get(parts[1], 3) if len(parts) > 2 else 3


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_not_even_through_types() -> None:
    edges = graph(types=True)
    assert "selection_proto.core.service" in edges
    assert "selection_proto.core.service_api" in edges["selection_proto.core.handler"]
    assert cycles(edges) == []


def test_layers_only_import_downwards() -> None:
    upward = [f"{module} imports {target}" for module, targets in sorted(graph().items())
              for target in sorted(targets)
              if layer(target) > layer(module) and not target.endswith("__init__")
              and target not in ("selection_proto", "selection_proto._version")]
    assert upward == []


def test_the_checks_can_fail() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer("selection_proto.core.service") < layer("selection_proto.adapters.http") \
        < layer("selection_proto.transports.server") < layer("selection_proto.cli")


def test_adapters_and_transports_record_through_observe() -> None:
    """Telemetry from outside the core goes through `SelectionService.observe` (and the core's
    named methods), never around it into `service.metrics`."""
    around = [f"{path.relative_to(PACKAGE)}:{n}" for folder in ("adapters", "transports")
              for path in sorted((PACKAGE / folder).glob("*.py"))
              for n, line in enumerate(path.read_text().splitlines(), 1) if ".metrics." in line]
    assert around == []


def test_the_facade_is_thin_and_no_core_module_is_large() -> None:
    """The facade at most ~450 lines (465 with the prefill/decode plan
    calls, docs/PD.md), no core module over ~550."""
    sizes = {str(path.relative_to(PACKAGE)): len(path.read_text().splitlines())
             for path in sorted(PACKAGE.rglob("*.py"))}
    assert sizes["core/service.py"] <= 465
    assert {name: n for name, n in sizes.items() if n > 550} == {}  # the whole package, not only core


def test_each_counted_family_is_named_once_outside_the_table() -> None:
    """A metric family's name is spelled in `metrics.FAMILIES` and at most once more (its named
    recorder, or a state gauge of `metrics_text`); adapters and transports use the constants."""
    from selection_proto.core.base.metrics import FAMILIES

    texts = {path: path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}
    spelled = {name: sum(text.count(f'"{name}"') for text in texts.values()) for name in FAMILIES}
    assert {name: n for name, n in spelled.items() if n > 2} == {}
    outside = [f"{path.relative_to(PACKAGE)}: {name}" for path, text in texts.items()
               if path.parent.name in ("adapters", "transports")
               for name in FAMILIES if f'"{name}"' in text]
    assert outside == []


def test_the_routes_that_hash_a_prompt_ahead_are_those_whose_body_has_one() -> None:
    """A route's prompt is a fact of the route table, not a second list beside it."""
    import attrs

    from selection_proto.core.base.routes import ROUTES

    with_prompt = {r.template for r in ROUTES
                   if r.body_type is not None and "token_ids" in {f.name for f in attrs.fields(r.body_type)}}
    assert {r.template for r in ROUTES if r.prompt} == with_prompt
    assert with_prompt == {"/select", "/select_and_reserve", "/reservations", "/potential_loads", "/overlap_scores",
                           "/select_pd", "/select_pd_and_reserve"}


# The wings of `core/` (docs/LAYOUT.md), bottom to top: a wing may import itself and the wings
# below it. Each is a sub-package of `core/` but `service`, the modules left in `core/` itself.
CORE_WINGS = ("base", "cache", "bookings", "fleet", "intake", "routing", "service")


def wing_of(module: str) -> str:
    """`base.errors` is in `base`; a module of `core/` itself (`handler`) in `service`."""
    first = module.split(".")[0]
    return first if first in CORE_WINGS else "service"


def arrows_up(edges: dict[str, set[str]], wings: tuple[str, ...]) -> list[str]:
    """The imports from a module to one in a higher wing (modules named without `selection_proto.core.`)."""
    floor = {wing: n for n, wing in enumerate(wings)}
    return [f"{module} -> {target}" for module, targets in sorted(edges.items()) for target in sorted(targets)
            if floor[wing_of(target)] > floor[wing_of(module)]]


def core_edges() -> dict[str, set[str]]:
    """The imports between core modules, type-only ones too, named without `selection_proto.core.`."""
    prefix = "selection_proto.core."
    return {module.removeprefix(prefix): {t.removeprefix(prefix) for t in targets if t.startswith(prefix)}
            for module, targets in graph(types=True).items() if module.startswith(prefix)}


def test_core_wings_are_its_sub_packages_and_imports_between_them_run_down() -> None:
    edges = core_edges()
    wings = {path.name for path in (PACKAGE / "core").iterdir() if (path / "__init__.py").exists()}
    assert wings == set(CORE_WINGS) - {"service"}, "a wing package not in CORE_WINGS (docs/LAYOUT.md)"
    assert {wing_of(module) for module in edges} == set(CORE_WINGS)
    assert arrows_up(edges, CORE_WINGS) == []
    assert sum(len(targets) for targets in edges.values()) > 250  # the graph was read, type-only imports too


def test_the_wing_check_can_fail() -> None:
    assert arrows_up({"base.a": {"base.b"}, "base.b": {"cache.c"}, "cache.c": {"handler"}, "handler": {"base.a"}},
                     CORE_WINGS) == ["base.b -> cache.c", "cache.c -> handler"]
