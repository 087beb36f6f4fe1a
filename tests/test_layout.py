"""The code's rooms stay small enough to hold in one's head: no module (of fedse/, services/, apps/,
and the tests, benchmarks and examples too) over MAX_MODULE_LINES lines, no function over
MAX_FUNCTION_LINES, no import circle among the modules of fedse/, services/ and apps/, and
nothing in fedse/ (what every service shares) importing a service or the command line. The code
generated from proto/ (fedse/v1/) is aside.

Imports are read from the source (ast), those inside functions too (an import put off to a call is
still a dependency), but not those under `if TYPE_CHECKING:`, which only type checkers follow."""

from __future__ import annotations

import ast
import pathlib

import pytest

from support import REPO

MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80
SOURCES = ("fedse", "services", "apps")
BOUNDED = (*SOURCES, "tests", "bench", "examples")  # where the bounds hold (imports are checked in SOURCES)
GENERATED = (("fedse", "v1"),)


def modules(root: pathlib.Path = REPO, tops: tuple[str, ...] = SOURCES) -> dict[str, pathlib.Path]:
    """Every module under `tops` by its dotted name (a package by its own name)."""
    out = {}
    for top in tops:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root)
            if any(rel.parts[:len(g)] == g for g in GENERATED):
                continue
            out[".".join(rel.with_suffix("").parts).removesuffix(".__init__")] = path
    return out


class Imports(ast.NodeVisitor):
    """The dotted names a module's source imports (a `from X import y` counts X and X.y)."""

    def __init__(self, package: str):
        self.package, self.names = package, set()

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if getattr(test, "id", getattr(test, "attr", "")) == "TYPE_CHECKING":
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.names.update(a.name for a in node.names)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            parts = self.package.split(".")
            base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
        self.names.add(base)
        self.names.update(f"{base}.{a.name}" for a in node.names)


def import_graph(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Which of `mods` each of them imports."""
    graph = {}
    for name, path in mods.items():
        visitor = Imports(name if path.name == "__init__.py" else name.rpartition(".")[0])
        visitor.visit(ast.parse(path.read_text()))
        graph[name] = {m for m in visitor.names if m in mods and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next((w for w in edges if w not in index or w in on_stack), None)
            if nxt is not None and nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(sorted(graph[nxt]))))
                continue
            if nxt is not None:
                low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    group.append(m)
                    if m == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def long_functions(path: pathlib.Path) -> list[tuple[str, int]]:
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_module_outgrows_its_bound():
    over = {name: n for name, path in modules(tops=BOUNDED).items()
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not over, f"split these modules by what their parts do (at most {MAX_MODULE_LINES} lines): {over}"


def test_no_function_outgrows_its_bound():
    over = {f"{name}.{fn}": n for name, path in modules(tops=BOUNDED).items() for fn, n in long_functions(path)}
    assert not over, f"split these functions (at most {MAX_FUNCTION_LINES} lines): {over}"


def test_no_import_circles():
    assert circles(import_graph(modules())) == []


def test_the_shared_code_imports_no_service():
    graph = import_graph(modules())
    wrong = {m: sorted(d for d in deps if d.startswith(("services", "apps")))
             for m, deps in graph.items() if m.startswith("fedse")}
    assert not {m: d for m, d in wrong.items() if d}, wrong


@pytest.mark.parametrize("case", ["circle", "long", "service"])
def test_the_checks_see_what_they_look_for(tmp_path, case):
    """Each check, run on a small tree that breaks it, finds the break."""
    (tmp_path / "fedse").mkdir()
    (tmp_path / "services").mkdir()
    (tmp_path / "apps").mkdir()
    (tmp_path / "fedse" / "__init__.py").write_text("")
    (tmp_path / "services" / "__init__.py").write_text("")
    if case == "circle":
        (tmp_path / "fedse" / "a.py").write_text("def f():\n    from fedse import b\n")
        (tmp_path / "fedse" / "b.py").write_text("from .a import f\n")
        (tmp_path / "fedse" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                 "    from fedse import a\n")
        assert circles(import_graph(modules(tmp_path))) == [["fedse.a", "fedse.b"]]
    elif case == "long":
        body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
        (tmp_path / "apps" / "m.py").write_text(f"def f():\n{body}\n\n\ndef g():\n    return 1\n")
        assert long_functions(modules(tmp_path)["apps.m"]) == [("f", MAX_FUNCTION_LINES + 1)]
    else:
        (tmp_path / "services" / "s.py").write_text("X = 1\n")
        (tmp_path / "fedse" / "u.py").write_text("from services.s import X\n")
        assert import_graph(modules(tmp_path))["fedse.u"] == {"services.s"}
