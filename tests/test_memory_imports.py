"""leanopt.memory's modules import one another in one direction: no import circle, counting the
imports inside functions (a circle hidden in a function still ties two modules together)."""

from __future__ import annotations

import ast
from pathlib import Path

MEMORY = Path(__file__).resolve().parents[1] / "src" / "leanopt" / "memory"
PACKAGE = "leanopt.memory"


def _imports(path: Path) -> set[str]:
    """The leanopt.memory modules ``path`` imports, at any scope."""
    names = {p.stem for p in MEMORY.glob("*.py") if p.stem != "__init__"}
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            if target.startswith(PACKAGE + "."):
                name = target[len(PACKAGE) + 1 :].split(".")[0]
                if name in names and name != path.stem:
                    out.add(name)
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_memory_modules_import_without_a_circle():
    graph = {p.stem: _imports(p) for p in MEMORY.glob("*.py") if p.stem != "__init__"}
    assert "plan" in graph["doctor"] and "process" in graph["plan"]  # the parser sees both kinds of import
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
