"""The layout tells the architecture: no import cycle among fsdp_exp's modules, nor among its first-level
parts (a subpackage or a top-level module: the layers point one way), imports inside functions and under
TYPE_CHECKING counted too; and outside fsdp_exp/parallel/ no code compares a backend's name."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from typing import Iterator

PACKAGE = Path(__file__).resolve().parents[2] / "fsdp_exp"


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.lru_cache(maxsize=None)
def imports(root: Path = PACKAGE) -> tuple[tuple[str, str, str], ...]:
    """(module, the module of the package it imports, where: path:line) for every import anywhere in its
    body: at the top, inside functions, under ``if TYPE_CHECKING``."""
    return tuple(_imports(root))


def _imports(root: Path) -> Iterator[tuple[str, str, str]]:
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
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
                if target and target != name:
                    yield name, target, f"{path.relative_to(root.parent)}:{node.lineno}"


def import_graph() -> dict[str, set[str]]:
    """module -> the fsdp_exp modules it imports. A package's ``__init__`` importing its own submodules (to
    fill a registry, to re-export) is not an edge: the submodules importing the package's siblings is what
    could form a cycle (and the part graph below sees that)."""
    edges: dict[str, set[str]] = {module_name(p): set() for p in PACKAGE.rglob("*.py")}
    for name, target, _ in imports():
        if not target.startswith(name + "."):
            edges[name].add(target)
    return edges


def part_of(module: str) -> str:
    """fsdp_exp.plan.activations.hf -> fsdp_exp.plan; fsdp_exp.preflight -> itself."""
    return ".".join(module.split(".")[:2])


def part_graph(root: Path = PACKAGE) -> tuple[dict[str, set[str]], dict[tuple[str, str], list[str]]]:
    """part -> the parts it imports, and (part, part) -> where. The package root (``fsdp_exp/__init__.py``,
    the version) is left out: every part stands inside it."""
    edges: dict[str, set[str]] = {}
    where: dict[tuple[str, str], list[str]] = {}
    for name, target, place in imports(root):
        a, b = part_of(name), part_of(target)
        edges.setdefault(a, set())
        edges.setdefault(b, set())
        if a != b and root.name not in (a, b):
            edges[a].add(b)
            places = where.setdefault((a, b), [])
            if place not in places:  # "from x.y import z" names x.y and x.y.z: one import
                places.append(place)
    return edges, where


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


def test_no_import_cycle_among_fsdp_exp_parts():
    """The parts form layers: each imports only parts below it, counting imports inside functions (a cycle
    there is as real as one at the top: whichever part loads first pulls in the others)."""
    edges, where = part_graph()
    found = cycles(edges)
    inside = [f"{a} -> {b}: {', '.join(where[a, b][:3])}" for c in found for a in c for b in sorted(edges[a]) if b in c]
    assert found == [], "parts that import each other in a circle:\n" + "\n".join(inside)


def test_the_part_graph_counts_imports_inside_functions_and_under_type_checking(tmp_path):
    root = tmp_path / "pkg"
    for module, text in {
        "__init__.py": "",
        "low/__init__.py": "from pkg.low import spec\n",  # its own submodule: no edge between parts
        "low/spec.py": "def profile():\n    from pkg.high.model import Profile\n",
        "high/__init__.py": "",
        "high/model.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.low.spec import profile\n",
        "top.py": "import pkg\nfrom pkg import high\n",  # the root is left out
    }.items():
        (root / module).parent.mkdir(parents=True, exist_ok=True)
        (root / module).write_text(text)
    edges, where = part_graph(root)
    assert edges == {"pkg": set(), "pkg.low": {"pkg.high"}, "pkg.high": {"pkg.low"}, "pkg.top": {"pkg.high"}}
    assert where["pkg.low", "pkg.high"] == ["pkg/low/spec.py:2"] and where["pkg.high", "pkg.low"] == [
        "pkg/high/model.py:3"
    ]
    assert cycles(edges) == [["pkg.high", "pkg.low"]]


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


BACKEND_NAME = re.compile(
    r"""(==|!=|in \(|in \[|in \{)\s*["'](fsdp1|fsdp2|ddp|deepspeed)["']"""
    r"""|["'](fsdp1|fsdp2|ddp|deepspeed)["']\s*(==|!=)|backend\s*(==|!=|in )"""
)


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


def test_the_op_list_that_checkpointing_and_the_planner_share_is_a_leaf():
    assert not import_graph()["fsdp_exp.ops"]


def test_no_two_test_modules_share_a_basename():
    """tests/ has no __init__.py: pytest imports each test module by its basename, so a second file of the same
    name in the other tier stops the whole suite at collection ("import file mismatch")."""
    tests = Path(__file__).resolve().parents[1]
    seen: dict[str, Path] = {}
    for path in sorted(tests.rglob("test_*.py")):
        assert path.name not in seen, f"{path} and {seen[path.name]} share a basename: rename one"
        seen[path.name] = path
