"""The floors hold: each package imports only the floors below it, and no module imports itself in a circle.

From the ground: `contracts/` (what both sides agree on) imports nothing of ours; the base, `core/` (config, bucket,
model paths, the local Ray), imports the contracts; the run's roles (`app/`) and the fleet (`deployments/`) import
the base and the contracts, never each other; the tiny model (`tiny/`), the demos' model and no role of a run, stands
on the run's roles (whose tasks it warms up on) and never on the fleet; the entry points (`launch/`) are the only
modules that import both products, and build the tiny model.
Every `import` statement of every module counts, those inside functions and under `TYPE_CHECKING` too (a lazy or
type-only import is a dependency all the same), and there is no circle of imports anywhere, inside a package or
across: each module can be read, and replaced, knowing only those below it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Each floor and the floors it may import (itself included).
FLOORS = {
    "contracts": ("contracts",),
    "core": ("core", "contracts"),
    "app": ("app", "core", "contracts"),
    "deployments": ("deployments", "core", "contracts"),
    "tiny": ("tiny", "app", "core", "contracts"),
    "launch": ("launch", "tiny", "app", "deployments", "core", "contracts"),
}
PACKAGES = tuple(FLOORS)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """The modules of our packages that `path` imports, anywhere in the file."""
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's own package upwards
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(n for n in names if n.split(".")[0] in PACKAGES)
    return found


def graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (a `from X import name` counts as X, or X.name if that is a module)."""
    files = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    edges = {}
    for name, path in files.items():
        targets = set()
        for imported in imports_of(path):
            while imported and imported not in files:  # `from core.config import RunConfig` -> core.config
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        edges[name] = targets
    return edges


def within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_every_package_imports_only_the_floors_below_it():
    bad = {m: sorted(t for t in ts if not within(t, FLOORS[m.split(".")[0]])) for m, ts in graph().items()}
    assert {m: ts for m, ts in bad.items() if ts} == {}


def test_only_the_entry_points_import_both_the_runs_roles_and_the_fleet():
    both = sorted(
        m
        for m, ts in graph().items()
        if any(within(t, ("app",)) for t in ts) and any(within(t, ("deployments",)) for t in ts)
    )
    assert all(within(m, ("launch",)) for m in both) and both, both


def strongly_connected(edges: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components with more than one module: the import cycles."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

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
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_in_a_circle():
    assert [sorted(c) for c in strongly_connected(graph())] == []


def test_the_scanner_sees_a_violation():
    """The checks above would fail on the circles the second restructuring left (a type-only import among them) and
    on a lazy import of the fleet by the run's roles."""
    edges = {
        "core.bucket.committed": {"core.bucket.fetching"},
        "core.bucket.fetching": {"core.bucket.committed"},  # under TYPE_CHECKING, as it was
    }
    assert [sorted(c) for c in strongly_connected(edges)] == [["core.bucket.committed", "core.bucket.fetching"]]
    assert imports_of(ROOT / "launch" / "train.py") & {"deployments.fleet"}  # lazy imports count
    typed = ROOT / "core" / "bucket" / "fetching.py"
    assert "core.bucket.committed" in imports_of(typed)  # and type-only ones
