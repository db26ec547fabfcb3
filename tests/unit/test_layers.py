"""The layers hold: contracts below both sides, the fleet blind to the run's roles, the roles blind to the fleet.

Every `import` statement of every module counts, those inside functions too (a lazy import is a
dependency all the same). The rules are the ones `contracts/__init__.py` states.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("app", "contracts", "deployments")
DRIVER = "app.train"  # the one module that wires both sides
# What the fleet may use of `app/`: the config layer (the run's and the fleet's configs, the model they name,
# resolved to a folder with its tokenizer) and the bucket.
FLEET_MAY_IMPORT = ("contracts", "app.config", "app.bucket", "app.models")


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
            while imported and imported not in files:  # `from app.config import RunConfig` -> app.config
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        edges[name] = targets
    return edges


def within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_contracts_import_nothing_of_either_side():
    bad = {
        m: sorted(t for t in ts if not within(t, ("contracts",)))
        for m, ts in graph().items()
        if within(m, ("contracts",))
    }
    assert {m: ts for m, ts in bad.items() if ts} == {}


def test_the_runs_roles_never_import_the_fleet_but_the_driver():
    bad = {
        m: sorted(t for t in ts if within(t, ("deployments",)))
        for m, ts in graph().items()
        if within(m, ("app",)) and m != DRIVER
    }
    assert {m: ts for m, ts in bad.items() if ts} == {}


def test_the_fleet_imports_only_contracts_config_and_bucket():
    bad = {
        m: sorted(t for t in ts if not within(t, ("deployments", *FLEET_MAY_IMPORT)))
        for m, ts in graph().items()
        if within(m, ("deployments",))
    }
    assert {m: ts for m, ts in bad.items() if ts} == {}


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


def test_no_import_cycle_crosses_a_package():
    crossing = [sorted(c) for c in strongly_connected(graph()) if len({m.split(".")[0] for m in c}) > 1]
    assert crossing == []


def test_the_scanner_sees_a_violation():
    """The checks above would fail on the cycle the first restructuring left (weight sync, fleet, replica)."""
    edges = {
        "app.weight_sync": {"deployments.fleet"},
        "deployments.fleet": {"deployments.replica"},
        "deployments.replica": {"app.weight_sync"},
    }
    assert [sorted(c) for c in strongly_connected(edges)] == [
        ["app.weight_sync", "deployments.fleet", "deployments.replica"]
    ]
    assert imports_of(ROOT / "app" / "train.py") & {"deployments.fleet"}  # lazy imports count
