"""The project's own modules import no circle: read from the source (AST), every import counted,
at the top of a file, inside a function or under TYPE_CHECKING alike."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kv_transfer", "deployments")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `path` (module `name`) imports: `from a.b import c` is `a.b.c` where that is a
    module, else `a.b`; relative imports resolved against `name`'s package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[:len(package.split(".")) - node.level + 1], *filter(None, [base])])
            for a in node.names:
                target = f"{base}.{a.name}"
                out.add(target if target in known else base)
    return {m for m in out if m in known and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_of_the_project_imports_a_circle():
    mods = modules()
    graph = {name: imports_of(name, path, set(mods)) for name, path in mods.items()}
    assert cycles(graph) == []


def test_the_check_sees_a_circle_through_a_function_local_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    tree = "def f():\n    from deployments.serve_cli import x\n"
    path = ROOT / "tests" / "_cycle_probe.py"
    path.write_text(tree)
    try:
        assert imports_of("probe", path, {"deployments.serve_cli"}) == {"deployments.serve_cli"}
    finally:
        path.unlink()
