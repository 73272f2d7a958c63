"""The layout tells the architecture: no import cycle among fsdp_exp's modules (imports inside functions
count too), and outside fsdp_exp/parallel/ no code compares a backend's name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fsdp_exp"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the fsdp_exp modules it imports anywhere in its body. A package's ``__init__`` importing
    its own submodules (to fill a registry, to re-export) is not an edge: the submodules importing the
    package's siblings is what could form a cycle."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:  # the longest module the import names
                    target = target.rsplit(".", 1)[0] if "." in target else ""
                own_submodule = path.name == "__init__.py" and target.startswith(name + ".")
                if target and target != name and not own_submodule:
                    edges[name].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
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


def test_no_import_cycle_among_fsdp_exp_modules():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


BACKEND_NAME = re.compile(r"""(==|!=|in \(|in \[|in \{)\s*["'](fsdp1|fsdp2|ddp|deepspeed)["']"""
                          r"""|["'](fsdp1|fsdp2|ddp|deepspeed)["']\s*(==|!=)|backend\s*(==|!=|in )""")


def test_no_code_outside_parallel_compares_a_backend_name():
    hits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "parallel" in path.relative_to(PACKAGE).parts[:1]:
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if BACKEND_NAME.search(line.split("#")[0]):
                hits.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert hits == [], "ask the backend object instead (fsdp_exp/parallel/backend.py):\n" + "\n".join(hits)


def test_the_schema_is_a_leaf():
    assert not {m for m in import_graph()["fsdp_exp.config.schema"] if m.startswith("fsdp_exp")}
