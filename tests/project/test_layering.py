"""The packages' layering, checked from the source: six floors (``rlvla3`` the Ray-free core,
``envs``, ``datalake``, ``actors``, ``measure`` the measuring kit, and ``commands`` on top,
which nothing imports), imports only pointing down a floor or within one, and no import cycle
between modules (lazy imports inside functions count; imports under ``if TYPE_CHECKING:`` do
not, since they never run).
``rlvla3/__main__.py`` reaches the commands by module name (``importlib``), not by import."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FLOORS = {"rlvla3": 1, "envs": 2, "datalake": 3, "actors": 4, "measure": 5, "commands": 6}
ALLOWED_DOWN = {"envs": {"rlvla3"}, "datalake": {"rlvla3", "envs"},
                "actors": {"rlvla3", "envs", "datalake"},
                "measure": {"rlvla3", "envs", "datalake", "actors"},
                "commands": {"rlvla3", "envs", "datalake", "actors", "measure"}, "rlvla3": set()}


def _modules() -> dict[str, Path]:
    out = {}
    for package in FLOORS:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """First-party modules ``name`` imports (``from a import b`` counts ``a.b`` when that is
    a module, else ``a``)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rsplit(".", 1)[0] if "." in target else ""
            if target and target != name:
                out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_imports_only_point_down_a_floor():
    wrong = [f"{a} imports {b}" for a, targets in _graph().items() for b in targets
             if a.split(".")[0] != b.split(".")[0]
             and b.split(".")[0] not in ALLOWED_DOWN[a.split(".")[0]]]
    assert not wrong, "\n".join(sorted(wrong))


def test_no_module_imports_itself_through_others():
    graph = _graph()
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    # a package's __init__ that lists its modules is not a cycle with them
    cycles = [c for c in cycles if not all(
        a == b.rsplit(".", 1)[0] or b == a.rsplit(".", 1)[0]
        for a, b in zip(c.split(" -> "), c.split(" -> ")[1:], strict=False))]
    assert not cycles, "\n".join(cycles)
