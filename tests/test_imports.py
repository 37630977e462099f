"""The import graph of `quest_hf/` has no cycle, counting imports inside functions too (a lazy import that closes a
cycle still ties the two modules together)."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "quest_hf"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported quest_hf module: line}, from every `import` / `from ... import` in the file."""
    mods = _modules()
    edges: dict[str, dict[str, int]] = {m: {} for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    for cand in (f"{target}.{alias.name}", target):  # a submodule, else the module itself
                        if cand in mods and cand != name:
                            edges[name].setdefault(cand, node.lineno)
                            break
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in mods and alias.name != name:
                        edges[name].setdefault(alias.name, node.lineno)
    return edges


def cycles(edges) -> list[list[str]]:
    state, found = {}, []

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for nxt in edges[node]:
            if state.get(nxt) == 1:
                loop = stack[stack.index(nxt):] + [nxt]
                found.append([f"{a} (line {edges[a][b]})" for a, b in zip(loop, loop[1:])] + [nxt])
            elif not state.get(nxt):
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in edges:
        if not state.get(node):
            visit(node, [])
    return found


def test_the_graph_is_read():
    edges = import_graph()
    assert "quest_hf.cache" in edges["quest_hf"] and "quest_hf.config" in edges["quest_hf.cache"]


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles in quest_hf/: " + "; ".join(" -> ".join(c) for c in found)


def test_a_cycle_is_found():
    with pytest.raises(AssertionError):
        assert not cycles({"a": {"b": 1}, "b": {"a": 2}})
